// Runs the sm_90a backward of bwd_sm90.cu (bwd_dq_sm90, bwd_dkdv_sm90) on the CPU through
// host_emulation.h, after bwd.cu's bwd_prep, with the launches cuda/backward.rs computes
// (BackwardLaunch::on_sm90).
// Built by tests/integration/cuda/emulated_bwd90.rs: g++ -std=c++17 -DFA_HOST_EMULATION
//   -DBWD_SM90_ENTRY=0 -D<variant defines> [-DFA_KERNEL='"<path to bwd_sm90.cu>"'] -I<kernels dir>
//   bwd_sm90_driver.cpp
// Usage and files as bwd_driver.cpp: DIR holds params.txt (the three grids, the two kernels'
// shared memory, whether there are slopes, the buffer lengths), params.bin, q, k, v, out, dout,
// lse, table and slopes; dq.bin, dk.bin, dv.bin, lse2.bin and dsum.bin are written there.
#ifndef FA_KERNEL
#define FA_KERNEL "bwd_sm90.cu"
#endif
// bwd.cu's prep kernel reads elements through its CUDA-core conversions (convert.cuh), which
// common.cuh declares when this is set at its first inclusion.
#define FA_CUDA_CORE_ELEM
#include FA_KERNEL
#include "io.h"

// bwd.cu's bwd_prep, in a namespace of its own: bwd.cu's own definitions stay apart from
// bwd_sm90.cu's; common.cuh and bwd_common.cuh (included above) are not included again. Its
// NUM_THREADS is bwd.cu's 128 inside it.
static const int SM90_THREADS = NUM_THREADS;
#undef NUM_THREADS
#undef FA_BWD_ENTRY
#define FA_BWD_ENTRY 1
#define BWD_TENSOR_CORES 0
namespace bwd_cu {
#include "bwd.cu"
}
static const int PREP_THREADS = NUM_THREADS;

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
    BwdParams p;
    if (!read_struct(dir + "/params.bin", &p)) return 3;
    auto q = read<u16>(dir + "/q.bin");
    auto k = read<u16>(dir + "/k.bin");
    auto v = read<u16>(dir + "/v.bin");
    auto out = read<u16>(dir + "/out.bin");
    auto dout = read<u16>(dir + "/dout.bin");
    auto lse = read<float>(dir + "/lse.bin");
    auto table = read<i64>(dir + "/table.bin");
    std::vector<float> slopes = has_slopes ? read<float>(dir + "/slopes.bin") : std::vector<float>();
    // Poisoned like the library's outputs and workspaces: all-ones bytes are NaN.
    std::vector<u16> dq(dq_len), dk(dk_len), dv(dk_len);
    std::vector<float> lse2(lse_len), dsum(lse_len);
    for (auto* b : {&dq, &dk, &dv}) std::memset(b->data(), 0xFF, b->size() * sizeof(u16));
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
    if (pg[0] > 0) emu::launch(prep_grid, PREP_THREADS, 0, [&] { bwd_cu::bwd_prep(p); });
    if (rg[0] > 0) emu::launch(row_grid, SM90_THREADS, size_t(smem_dq), [&] { bwd_dq_sm90(p); });
    if (kg[0] > 0) emu::launch(key_grid, SM90_THREADS, size_t(smem_dkdv), [&] { bwd_dkdv_sm90(p); });
    write(dir + "/dq.bin", dq.data(), dq.size());
    write(dir + "/dk.bin", dk.data(), dk.size());
    write(dir + "/dv.bin", dv.data(), dv.size());
    write(dir + "/lse2.bin", lse2.data(), lse2.size());
    write(dir + "/dsum.bin", dsum.data(), dsum.size());
    return 0;
}
