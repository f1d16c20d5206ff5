// Runs the backward kernels of bwd.cu (bwd_prep, bwd_dq, bwd_dkdv) on the CPU through
// host_emulation.h, with the launches cuda/backward.rs computes.
// Built by tests/integration/cuda/emulated.rs: g++ -std=c++17 -DFA_HOST_EMULATION -DFA_BWD_ENTRY=0
//   -D<variant defines> -I<kernels dir> bwd_driver.cpp
// Usage: driver DIR. DIR holds params.txt (read below) and q, k, v, out, dout (elements), lse
// (f32, the caller's view buffer), table (i64) and slopes (f32, when used) as .bin files; dq.bin,
// dk.bin, dv.bin and the workspaces lse2.bin and dsum.bin are written there.
#include "bwd.cu"
#include "io.h"

int main(int argc, char** argv) {
    if (argc != 2) return 2;
    const Dir dir{argv[1]};
    Numbers pf(dir + "/params.txt");
    long long pg[3], rg[3], kg[3], smem_dq, smem_dkdv, has_slopes, heads, heads_kv, head_dim;
    long long st[13], window_left, window_right, dq_len, dk_len, lse_len;
    float scale, softcap;
    for (auto& x : pg) pf >> x;
    for (auto& x : rg) pf >> x;
    for (auto& x : kg) pf >> x;
    pf >> smem_dq >> smem_dkdv >> has_slopes >> heads >> heads_kv >> head_dim;
    for (auto& x : st) pf >> x;
    pf >> scale >> softcap >> window_left >> window_right >> dq_len >> dk_len >> lse_len;
    long long drop_lo, drop_hi, drop_threshold;
    float drop_scale;
    pf >> drop_lo >> drop_hi >> drop_threshold >> drop_scale;
    if (!pf) return 3;
    auto q = read<elem_t>(dir + "/q.bin");
    auto k = read<elem_t>(dir + "/k.bin");
    auto v = read<elem_t>(dir + "/v.bin");
    auto out = read<elem_t>(dir + "/out.bin");
    auto dout = read<elem_t>(dir + "/dout.bin");
    auto lse = read<float>(dir + "/lse.bin");
    auto table = read<i64>(dir + "/table.bin");
    std::vector<float> slopes = has_slopes ? read<float>(dir + "/slopes.bin") : std::vector<float>();
    // Poisoned like the library's outputs and workspaces: all-ones bytes are NaN.
    std::vector<elem_t> dq(dq_len), dk(dk_len), dv(dk_len);
    std::vector<float> lse2(lse_len), dsum(lse_len);
    for (auto* b : {&dq, &dk, &dv}) std::memset(b->data(), 0xFF, b->size() * sizeof(elem_t));
    for (auto* b : {&lse2, &dsum}) std::memset(b->data(), 0xFF, b->size() * sizeof(float));
    auto call = [&](auto kernel) {
        kernel(q.data(), k.data(), v.data(), out.data(), dout.data(), lse.data(), lse2.data(),
               dsum.data(), dq.data(), dk.data(), dv.data(), table.data(),
               has_slopes ? slopes.data() : nullptr, int(heads), int(heads_kv), int(head_dim), st[0],
               st[1], st[2], st[3], st[4], st[5], st[6], st[7], st[8], st[9], st[10], st[11], st[12],
               scale, softcap, int(window_left), int(window_right), u32(drop_lo), u32(drop_hi),
               drop_threshold, drop_scale);
    };
    const emu::Dim3 prep_grid{unsigned(pg[0]), unsigned(pg[1]), unsigned(pg[2])};
    const emu::Dim3 row_grid{unsigned(rg[0]), unsigned(rg[1]), unsigned(rg[2])};
    const emu::Dim3 key_grid{unsigned(kg[0]), unsigned(kg[1]), unsigned(kg[2])};
    if (rg[0] > 0) {
        emu::launch(prep_grid, NUM_THREADS, 0, [&] { call(bwd_prep); });
        emu::launch(row_grid, NUM_THREADS, size_t(smem_dq), [&] { call(bwd_dq); });
    }
    if (kg[0] > 0) emu::launch(key_grid, NUM_THREADS, size_t(smem_dkdv), [&] { call(bwd_dkdv); });
    write(dir + "/dq.bin", dq.data(), dq.size());
    write(dir + "/dk.bin", dk.data(), dk.size());
    write(dir + "/dv.bin", dv.data(), dv.size());
    // The prep kernel's workspaces, from which the host computes the sinks' gradient.
    write(dir + "/lse2.bin", lse2.data(), lse2.size());
    write(dir + "/dsum.bin", dsum.data(), dsum.size());
    return 0;
}
