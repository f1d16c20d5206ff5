// Runs one flashattn CUDA kernel variant on the CPU through host_emulation.h.
// Built by tests/integration/cuda/emulated.rs: g++ -std=c++17 -DFA_HOST_EMULATION -D<variant defines>
//   -DFA_KERNEL='"<path to fwd.cu or fwd_f32.cu>"' -I<kernels dir> driver.cpp
// Usage: driver DIR. DIR holds params.txt (the launch's shape and which tables it has, in the
// order read below), params.bin (the kernel's FwdParams as the library wrote it) and q.bin, k.bin,
// v.bin (raw elements: FP8 bytes with FA_FP8_INPUT), table.bin, slopes.bin, descale.bin and
// sink.bin when used; out.bin and lse.bin are written there.
#include FA_KERNEL
#include "io.h"
#include <cstdio>

#if defined(FA_FP8_INPUT)
typedef unsigned char drv_in_t;
typedef u16 drv_out_t;
#elif defined(FA_TENSOR_CORE_KERNEL)
typedef u16 drv_in_t;
typedef u16 drv_out_t;
#else
typedef float drv_in_t;
typedef float drv_out_t;
#endif

int main(int argc, char** argv) {
    if (argc != 2) return 2;
    const Dir dir{argv[1]};
    Numbers pf(dir + "/params.txt");
    long long gx, gy, gz, threads, smem, has_table, has_slopes, out_len, lse_len, has_descale,
        has_sink;
    pf >> gx >> gy >> gz >> threads >> smem >> has_table >> has_slopes >> out_len >> lse_len >>
        has_descale >> has_sink;
#ifdef FA_SM90_WS
    // The tensor maps of q, k and v: 4 dims, 3 byte strides and the box rows each.
    TmaDesc maps[3];
    for (auto& m : maps) {
        long long x;
        for (auto& d : m.dims) pf >> x, d = uint64_t(x);
        for (auto& st : m.strides) pf >> x, st = uint64_t(x);
        pf >> x, m.box_rows = uint32_t(x);
    }
    // Then 1 for the dynamic tile scheduler (a zeroed counter), 0 for the static rounds (null).
    long long dynamic_tiles;
    pf >> dynamic_tiles;
    int tile_counter = 0;
#endif
    if (!pf) return 3;
    // The kernel's parameter as the library built it (its device addresses 0), set below to the
    // host buffers.
    FwdParams p;
    if (!read_struct(dir + "/params.bin", &p)) return 3;
    auto q = read<drv_in_t>(dir + "/q.bin");
    auto k = read<drv_in_t>(dir + "/k.bin");
    auto v = read<drv_in_t>(dir + "/v.bin");
    std::vector<float> descale =
        has_descale ? read<float>(dir + "/descale.bin") : std::vector<float>();
    std::vector<i64> table = has_table ? read<i64>(dir + "/table.bin") : std::vector<i64>();
    std::vector<float> slopes = has_slopes ? read<float>(dir + "/slopes.bin") : std::vector<float>();
    std::vector<float> sink = has_sink ? read<float>(dir + "/sink.bin") : std::vector<float>();
    // Poisoned like the library's outputs: all-ones bytes are NaN.
    std::vector<drv_out_t> out(out_len);
    std::vector<float> lse(lse_len);
    std::memset(out.data(), 0xFF, out.size() * sizeof(drv_out_t));
    std::memset(lse.data(), 0xFF, lse.size() * sizeof(float));
    p.q = q.data();
    p.k = k.data();
    p.v = v.data();
    p.out = out.data();
    p.lse = lse.data();
    p.seqs = has_table ? table.data() : nullptr;
    p.alibi_slopes = has_slopes ? slopes.data() : nullptr;
    p.descale = has_descale ? descale.data() : nullptr;
    p.sink = has_sink ? sink.data() : nullptr;
#ifdef FA_SM90_WS
    maps[0].base = reinterpret_cast<const unsigned char*>(q.data());
    maps[1].base = reinterpret_cast<const unsigned char*>(k.data());
    maps[2].base = reinterpret_cast<const unsigned char*>(v.data());
#endif
    emu::launch({unsigned(gx), unsigned(gy), unsigned(gz)}, int(threads), size_t(smem), [&] {
        flash_fwd(p
#ifdef FA_SM90_WS
                  , maps[0], maps[1], maps[2], dynamic_tiles ? &tile_counter : nullptr
#endif
        );
    });
    write(dir + "/out.bin", out.data(), out.size());
    write(dir + "/lse.bin", lse.data(), lse.size());
    return 0;
}
