// Runs the backward kernels of bwd.cu (bwd_prep, bwd_dq, bwd_dkdv) on the CPU through
// host_emulation.h, with the launches cuda/backward.rs computes.
// Built by tests/integration/cuda/emulated.rs: g++ -std=c++17 -DFA_HOST_EMULATION -DFA_BWD_ENTRY=0
//   -D<variant defines> -I<kernels dir> bwd_driver.cpp
// Usage: driver DIR. DIR holds params.txt (the launch's grids and buffer sizes, read below),
// params.bin (the kernels' BwdParams as the library wrote it) and q, k, v, out, dout (elements), lse
// (f32, the caller's view buffer), table (i64) and slopes (f32, when used) as .bin files; dq.bin,
// dk.bin, dv.bin and the workspaces lse2.bin and dsum.bin are written there.
#include "bwd.cu"
#include "io.h"

int main(int argc, char** argv) {
    if (argc != 2) return 2;
    const Dir dir{argv[1]};
    Numbers pf(dir + "/params.txt");
    long long pg[3], rg[3], kg[3], smem_dq, smem_dkdv, has_slopes, dq_len, dk_len, lse_len;
    for (auto& x : pg) pf >> x;
    for (auto& x : rg) pf >> x;
    for (auto& x : kg) pf >> x;
    pf >> smem_dq >> smem_dkdv >> has_slopes >> dq_len >> dk_len >> lse_len;
    if (!pf) return 3;
    // The kernels' parameter as the library built it (its device addresses 0), set below to the
    // host buffers.
    BwdParams p;
    if (!read_struct(dir + "/params.bin", &p)) return 3;
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
    p.q = q.data();
    p.k = k.data();
    p.v = v.data();
    p.out = out.data();
    p.dout = dout.data();
    p.lse = lse.data();
    p.lse2 = lse2.data();
    p.dsum = dsum.data();
    p.dq = dq.data();
    p.dk = dk.data();
    p.dv = dv.data();
    p.seqs = table.data();
    p.alibi_slopes = has_slopes ? slopes.data() : nullptr;
    const emu::Dim3 prep_grid{unsigned(pg[0]), unsigned(pg[1]), unsigned(pg[2])};
    const emu::Dim3 row_grid{unsigned(rg[0]), unsigned(rg[1]), unsigned(rg[2])};
    const emu::Dim3 key_grid{unsigned(kg[0]), unsigned(kg[1]), unsigned(kg[2])};
    if (rg[0] > 0) {
        emu::launch(prep_grid, NUM_THREADS, 0, [&] { bwd_prep(p); });
        emu::launch(row_grid, NUM_THREADS, size_t(smem_dq), [&] { bwd_dq(p); });
    }
    if (kg[0] > 0) emu::launch(key_grid, NUM_THREADS, size_t(smem_dkdv), [&] { bwd_dkdv(p); });
    write(dir + "/dq.bin", dq.data(), dq.size());
    write(dir + "/dk.bin", dk.data(), dk.size());
    write(dir + "/dv.bin", dv.data(), dv.size());
    // The prep kernel's workspaces, from which the host computes the sinks' gradient.
    write(dir + "/lse2.bin", lse2.data(), lse2.size());
    write(dir + "/dsum.bin", dsum.data(), dsum.size());
    return 0;
}
