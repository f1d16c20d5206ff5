// Runs flashattn's CUDA decode kernels (decode.cu: append, split, combine) on the CPU through
// host_emulation.h. Built by tests/integration/decode/emulated.rs:
// g++ -std=c++17 -DFA_HOST_EMULATION -DFA_DECODE_ENTRY=0 -D<variant defines> -I<kernels dir>
// decode_driver.cpp
// Usage: decode_driver DIR. DIR holds params.txt (the launch, in the order read below) and q.bin,
// k.bin, v.bin (the caches: FP8 bytes when built with FA_FP8_CACHE), table.bin, pages.bin, and
// kn.bin, vn.bin, slopes.bin, rot.bin, descale.bin, sink.bin when used; out.bin, lse.bin and the caches after
// the call (k_out.bin, v_out.bin) are written there.
#include "decode.cu"
#include "io.h"
#include <cstdio>

int main(int argc, char** argv) {
    if (argc != 2) return 2;
    const Dir dir{argv[1]};
    Numbers pf(dir + "/params.txt");
    long long split_grid[3], combine_grid[3], append_grid[3], smem, has_append, has_slopes,
        has_rot, batch, heads, heads_kv, head_dim, splits, qs[2], ks[3], vs[3], kns[2], vns[2],
        page_size, max_blocks, window_left, window_right, rot_half, rot_inter, rot_npos,
        lse_head_stride, total_rows, vec_loads, out_len, lse_len, ws_o_len, ws_lse_len, k_len, v_len,
        has_descale, e5m2, has_sink;
    float scale, softcap;
    for (auto& x : split_grid) pf >> x;
    for (auto& x : combine_grid) pf >> x;
    for (auto& x : append_grid) pf >> x;
    pf >> smem >> has_append >> has_slopes >> has_rot >> batch >> heads >> heads_kv >> head_dim >>
        splits;
    for (auto& x : qs) pf >> x;
    for (auto& x : ks) pf >> x;
    for (auto& x : vs) pf >> x;
    for (auto& x : kns) pf >> x;
    for (auto& x : vns) pf >> x;
    pf >> page_size >> max_blocks >> scale >> softcap >> window_left >> window_right >> rot_half >>
        rot_inter >> rot_npos >> lse_head_stride >> total_rows >> vec_loads >> out_len >> lse_len >> ws_o_len >>
        ws_lse_len >> k_len >> v_len >> has_descale >> e5m2 >> has_sink;
    if (!pf) return 3;
    auto q = read<elem_t>(dir + "/q.bin");
    auto k = read<cache_t>(dir + "/k.bin");
    auto v = read<cache_t>(dir + "/v.bin");
    std::vector<float> descale =
        has_descale ? read<float>(dir + "/descale.bin") : std::vector<float>();
    const float* dp = has_descale ? descale.data() : nullptr;
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
    const float* rp = has_rot ? rot.data() : nullptr;
    // Poisoned like the library's buffers: all-ones bytes are NaN.
    std::vector<elem_t> out(out_len);
    std::vector<float> lse(lse_len), ws_o(ws_o_len), ws_lse(ws_lse_len);
    std::memset(out.data(), 0xFF, out.size() * sizeof(elem_t));
    std::memset(lse.data(), 0xFF, lse.size() * sizeof(float));
    std::memset(ws_o.data(), 0xFF, ws_o.size() * sizeof(float));
    std::memset(ws_lse.data(), 0xFF, ws_lse.size() * sizeof(float));
    auto dim = [](long long* g) { return emu::Dim3{unsigned(g[0]), unsigned(g[1]), unsigned(g[2])}; };
    if (has_append && batch > 0) {
        emu::launch(dim(append_grid), NUM_THREADS, 0, [&] {
            decode_append(kn.data(), vn.data(), k.data(), v.data(), table.data(), pages.data(), rp,
                          int(batch), int(head_dim), kns[0], kns[1], vns[0], vns[1], ks[0], ks[1],
                          ks[2], vs[0], vs[1], vs[2], int(page_size), int(max_blocks),
                          int(rot_half), int(rot_inter), int(rot_npos), dp, int(e5m2));
        });
    }
    if (out_len > 0 && split_grid[2] > 0) {
        emu::launch(dim(split_grid), NUM_THREADS, size_t(smem), [&] {
            decode_split(q.data(), k.data(), v.data(), ws_o.data(), ws_lse.data(), table.data(),
                         pages.data(), has_slopes ? slopes.data() : nullptr, rp, int(heads),
                         int(heads_kv), int(head_dim), int(splits), qs[0], qs[1], ks[0], ks[1],
                         ks[2], vs[0], vs[1], vs[2], int(page_size), int(max_blocks), scale,
                         softcap, int(window_left), int(window_right), int(rot_half),
                         int(rot_inter), int(rot_npos), total_rows, int(vec_loads), dp,
                         int(e5m2));
        });
        emu::launch(dim(combine_grid), NUM_THREADS, 0, [&] {
            decode_combine(ws_o.data(), ws_lse.data(), out.data(), lse.data(), table.data(),
                           int(heads), int(head_dim), int(splits), lse_head_stride, total_rows,
                           has_sink ? sink.data() : nullptr);
        });
    }
    write(dir + "/out.bin", out.data(), out.size());
    write(dir + "/lse.bin", lse.data(), lse.size());
    write(dir + "/k_out.bin", k.data(), size_t(k_len));
    write(dir + "/v_out.bin", v.data(), size_t(v_len));
    return 0;
}
