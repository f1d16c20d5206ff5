// Runs flashattn's CUDA decode kernels (decode.cu: append, split, combine) on the CPU through
// host_emulation.h. Built by tests/integration/decode/emulated.rs:
// g++ -std=c++17 -DFA_HOST_EMULATION -DFA_DECODE_ENTRY=0 -D<variant defines> -I<kernels dir>
// decode_driver.cpp
// Usage: decode_driver DIR. DIR holds params.txt (the launch's grids, which tables it has and the
// buffer sizes, in the order read below), params.bin (the kernels' DecodeParams as the library
// wrote it) and q.bin, k.bin, v.bin (the caches: FP8 bytes when built with FA_FP8_CACHE),
// table.bin, pages.bin, and kn.bin, vn.bin, slopes.bin, rot.bin, descale.bin, sink.bin when used;
// out.bin, lse.bin and the caches after the call (k_out.bin, v_out.bin) are written there.
#include "decode.cu"
#include "io.h"
#include <cstdio>

int main(int argc, char** argv) {
    if (argc != 2) return 2;
    const Dir dir{argv[1]};
    Numbers pf(dir + "/params.txt");
    long long split_grid[3], combine_grid[3], append_grid[3], smem, has_append, has_slopes,
        has_rot, out_len, lse_len, ws_o_len, ws_lse_len, k_len, v_len, has_descale, has_sink;
    for (auto& x : split_grid) pf >> x;
    for (auto& x : combine_grid) pf >> x;
    for (auto& x : append_grid) pf >> x;
    pf >> smem >> has_append >> has_slopes >> has_rot >> out_len >> lse_len >> ws_o_len >>
        ws_lse_len >> k_len >> v_len >> has_descale >> has_sink;
    if (!pf) return 3;
    // The kernels' parameter as the library built it (its device addresses 0), set below to the
    // host buffers.
    DecodeParams p;
    if (!read_struct(dir + "/params.bin", &p)) return 3;
    auto q = read<elem_t>(dir + "/q.bin");
    auto k = read<cache_t>(dir + "/k.bin");
    auto v = read<cache_t>(dir + "/v.bin");
    std::vector<float> descale =
        has_descale ? read<float>(dir + "/descale.bin") : std::vector<float>();
    auto table = read<i64>(dir + "/table.bin");
    auto pages = read<int>(dir + "/pages.bin");
    std::vector<elem_t> kn, vn;
    if (has_append) {
        kn = read<elem_t>(dir + "/kn.bin");
        vn = read<elem_t>(dir + "/vn.bin");
    }
    std::vector<float> slopes = has_slopes ? read<float>(dir + "/slopes.bin") : std::vector<float>();
    std::vector<float> rot = has_rot ? read<float>(dir + "/rot.bin") : std::vector<float>();
    std::vector<float> sink = has_sink ? read<float>(dir + "/sink.bin") : std::vector<float>();
    // Poisoned like the library's buffers: all-ones bytes are NaN.
    std::vector<elem_t> out(out_len);
    std::vector<float> lse(lse_len), ws_o(ws_o_len), ws_lse(ws_lse_len);
    std::memset(out.data(), 0xFF, out.size() * sizeof(elem_t));
    std::memset(lse.data(), 0xFF, lse.size() * sizeof(float));
    std::memset(ws_o.data(), 0xFF, ws_o.size() * sizeof(float));
    std::memset(ws_lse.data(), 0xFF, ws_lse.size() * sizeof(float));
    p.q = q.data();
    p.k_cache = k.data();
    p.v_cache = v.data();
    p.k_new = has_append ? kn.data() : nullptr;
    p.v_new = has_append ? vn.data() : nullptr;
    p.out = out.data();
    p.lse = lse.data();
    p.ws_o = ws_o.data();
    p.ws_lse = ws_lse.data();
    p.seqs = table.data();
    p.pages = pages.data();
    p.alibi_slopes = has_slopes ? slopes.data() : nullptr;
    p.rot = has_rot ? rot.data() : nullptr;
    p.descale = has_descale ? descale.data() : nullptr;
    p.sink = has_sink ? sink.data() : nullptr;
    auto dim = [](long long* g) { return emu::Dim3{unsigned(g[0]), unsigned(g[1]), unsigned(g[2])}; };
    if (has_append && p.batch > 0)
        emu::launch(dim(append_grid), NUM_THREADS, 0, [&] { decode_append(p); });
    if (out_len > 0 && split_grid[2] > 0) {
        emu::launch(dim(split_grid), NUM_THREADS, size_t(smem), [&] { decode_split(p); });
        emu::launch(dim(combine_grid), NUM_THREADS, 0, [&] { decode_combine(p); });
    }
    write(dir + "/out.bin", out.data(), out.size());
    write(dir + "/lse.bin", lse.data(), lse.size());
    write(dir + "/k_out.bin", k.data(), size_t(k_len));
    write(dir + "/v_out.bin", v.data(), size_t(v_len));
    return 0;
}
