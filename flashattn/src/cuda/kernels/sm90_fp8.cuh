// The e4m3 pieces of the sm_90a FP8 forwards (fwd_sm90_fp8.cu, and fwd_sm90_ws.cu with
// FA_FP8_INPUT): one-byte SW128 addressing, the key order of the P fragment, and P rounded to
// e4m3.
//
// The P fragment: a thread's S accumulators hold, per 32 keys, keys {0, 1, 8, 9, 16, 17, 24, 25}
// + 2t of rows g and g + 8, while the 8-bit A fragment wants k positions 4t .. 4t + 3 and
// 16 + 4t .. 16 + 4t + 3. Instead of exchanging registers (FlashAttention-3's
// permute_Cregs_fp8), the contraction order is permuted: key κ of a 32-key group is stored at
// k position kpos(κ) of the Vᵀ tile, the position its probability takes in the fragment.
// The including file defines BLOCK_N and includes common.cuh and sm90.cuh first.
#pragma once

typedef unsigned char u8;

// Byte offset of (row, col) in a SW128 tile of one-byte elements with `rows` rows: slabs of 128
// columns, row r one 128-byte line, 16-byte chunk c at chunk position c ^ (r % 8).
__device__ __forceinline__ int sw128_b(int row, int col, int rows) {
    return (col >> 7) * rows * 128 + row * 128 + ((((col >> 4) & 7) ^ (row & 7)) << 4) + (col & 15);
}

// The k position of key κ (0 .. 31) of a 32-key group in the P fragment (see the top).
__device__ __forceinline__ int kpos(int key) {
    const int half = key >> 4, q = (key >> 3) & 1, c = key & 7;
    return 16 * half + 4 * (c >> 1) + 2 * q + (c & 1);
}

// Four floats rounded to e4m3 (nearest even, saturating) in one word, x0 in the lowest byte.
__device__ __forceinline__ u32 pack4_e4m3(float x0, float x1, float x2, float x3) {
#ifdef FA_HOST_EMULATION
    return (u32)emu::float_to_e4m3(x0) | (u32)emu::float_to_e4m3(x1) << 8 |
           (u32)emu::float_to_e4m3(x2) << 16 | (u32)emu::float_to_e4m3(x3) << 24;
#else
    unsigned short lo, hi;
    // cvt ...e4m3x2.f32 d, a, b: a to the upper byte, b to the lower.
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(x1), "f"(x0));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(x3), "f"(x2));
    return (u32)lo | (u32)hi << 16;
#endif
}

// The A fragment of k-step j (keys 32j .. 32j + 31) from the probabilities in s, times 256
// (exact; P ≤ 1, so P · 256 ≤ 256 < 448 and small probabilities stay normal longer): the rows
// are divided by 256 once, at the end.
__device__ __forceinline__ void pack_p_e4m3(u32 (&a)[4], const float (&s)[BLOCK_N / 8][4], int j) {
    const float k = 256.f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        a[r] = pack4_e4m3(s[4 * j][2 * r] * k, s[4 * j][2 * r + 1] * k, s[4 * j + 1][2 * r] * k,
                          s[4 * j + 1][2 * r + 1] * k);
        a[2 + r] = pack4_e4m3(s[4 * j + 2][2 * r] * k, s[4 * j + 2][2 * r + 1] * k,
                              s[4 * j + 3][2 * r] * k, s[4 * j + 3][2 * r + 1] * k);
    }
}

// Per-block factors (params.cuh: FwdParams block_q, FlashAttention-3's block quantisation): the q
// factor of one warpgroup's 64 rows (softmax_scale folded in; they lie in one 128-row query block)
// and the k and v factor rows of its (sequence, kv head); `k` and `v` null without them. The k
// and v factors of key n0's block: k[n0 / 128], v[n0 / 128] (at BLOCK_N = 64 two key blocks share
// one).
struct BlockFactors {
    const float* __restrict__ k = nullptr;
    const float* __restrict__ v = nullptr;
    float q = 0.f;
    __device__ __forceinline__ BlockFactors(const FwdParams& p, int b, int h, int q_row) {
        if (p.block_q == 0) return;
        const float* __restrict__ ds = p.descale;
        const i64 kv_row = ((i64)b * p.heads_kv + h / (p.heads / p.heads_kv)) * p.k_blocks;
        q = ds[p.block_q + ((i64)b * p.heads + h) * p.q_blocks + q_row / 128];
        k = ds + p.block_k + kv_row;
        v = ds + p.block_v + kv_row;
    }
};

// The score scale of one key block with per-block factors (common.cuh's cta_work_at sets it once
// per CTA otherwise).
template <typename T>
__device__ __forceinline__ void set_block_scale(CtaWork<T>& w, float scale, float softcap) {
    w.mods.scale_log2 = scale * FA_LOG2E;
    w.mods.cap_in = scale / softcap;
}

// Per-block factors: acc_o (in units of v factor `unit`) to units of `next`, folded into the
// rescale by alpha that follows.
__device__ __forceinline__ void block_v_rescale(float (&alpha)[2], float& unit, float next) {
    const float r = unit / next;
    alpha[0] *= r;
    alpha[1] *= r;
    unit = next;
}

// Bytes 0 and 2 of x, then of y, in one word (x's byte 0 lowest), and bytes 1 and 3: the two
// lines of V's 16-bit pairs that ldmatrix .trans delivered (fwd_sm90_ws.cu's transpose).
__device__ __forceinline__ u32 bytes_even(u32 x, u32 y) {
#ifdef FA_HOST_EMULATION
    return (x & 0xffu) | (x >> 16 & 0xffu) << 8 | (y & 0xffu) << 16 | (y >> 16 & 0xffu) << 24;
#else
    return __byte_perm(x, y, 0x6420);
#endif
}
__device__ __forceinline__ u32 bytes_odd(u32 x, u32 y) {
#ifdef FA_HOST_EMULATION
    return (x >> 8 & 0xffu) | (x >> 24) << 8 | (y >> 8 & 0xffu) << 16 | (y >> 24) << 24;
#else
    return __byte_perm(x, y, 0x7531);
#endif
}
