// Hopper (sm_90a) FP8 forward: e4m3 q, k and v on the FP8 tensor cores (wgmma k32 with e4m3
// operands, f32 accumulators), as FlashAttention-3's FP8 forward. The structure is fwd_sm90.cu's
// (with SM90_OVERLAP the softmax of a key block runs while P·V of the one before is in flight):
// one CTA computes BLOCK_M = 64 · NUM_WG query
// rows of one (sequence, head), warpgroup wg owns rows 64·wg .. 64·wg + 63. Per key block:
//   S = Q·Kᵀ     wgmma m64n{BLOCK_N}k32 e4m3, Q and K K-major from shared memory through
//                descriptors: the SW128 layout of sm90.cuh with one-byte elements, so a 128-byte
//                line holds 128 columns and a k-step is the same 32 bytes as k16 of 16-bit types
//                (desc_kmajor serves unchanged); the raw FP8 products, scaled by the folded
//                softmax_scale · q_descale · k_descale of the (sequence, kv head);
//   mask/mods    and the online softmax: sm90_attn.cuh's, unchanged (the accumulator layout is
//                the 16-bit wgmma's);
//   acc_o += P·V wgmma m64n{HEAD_DIM}k32 e4m3 with P from registers: P · 256 (exact; P ≤ 1, so
//                P · 256 ≤ 256 < 448 and small probabilities stay normal longer) rounded to e4m3 and
//                packed as the 8-bit A fragment. 8-bit wgmma reads B K-major only, so V is stored
//                transposed in shared memory (Vᵀ: head_dim rows, keys as the K columns), written
//                by ordinary loads and byte stores while the next block's K tile is in flight;
//                two Vᵀ buffers, so that block n's is written while P·V of block n - 1 may still
//                read the other (SM90_OVERLAP).
// The P fragment's key order (kpos), the one-byte SW128 addressing (sw128_b) and P rounded to
// e4m3 (pack_p_e4m3) are sm90_fp8.cuh's, shared with fwd_sm90_ws.cu's FP8 mode.
// The output is divided by 256 · row_sum and multiplied by v_descale; out is bf16, lse f32.
// Per-block factors (params.cuh: FwdParams block_q): a warpgroup's 64 rows lie in one 128-row
// query block, so its q factor is fixed; the score scale q · k factor (and softcap's cap_in) is
// set per key block before mask_scores (at BLOCK_N = 64 two key blocks share a k factor). The v
// factors are not folded into P (rounded to e4m3, a dominant P = 1 would lose its exact 256):
// acc_o is kept in units of the current key block's v factor instead, the rescale by alpha that
// every block does anyway also multiplying by (previous block's factor / this block's) before
// P·V of this block is added, and the finished rows by the last block's factor (with
// v_descale's place, the largest factor of the (sequence, kv head), the table's factors being
// relative to it); row_sum stays the sum of P.
//
// Defines (cuda/key.rs): HEAD_DIM (128 or 256: whole 128-byte lines), BLOCK_N (128: one line of
// Vᵀ; 64, the first half of its lines, where 128 keys' scores spill registers), NUM_WG, IS_MASKED, HAS_SOFTCAP, HAS_ALIBI, FA_BF16 and FA_FP8_INPUT (both 1: bf16 out,
// FP8 in), SM90_OVERLAP (default 1; 0: each product waited for at once, as fwd_sm90.cu's switch). e4m3 only (the instruction names the format; e5m2 runs on fwd.cu); 16-byte aligned
// rows (VEC_LOAD's conditions); no dropout.
#define FA_TENSOR_CORE_KERNEL
#define FA_SM90_KERNEL
#define NUM_THREADS (NUM_WG * 128)
#define BLOCK_M (NUM_WG * 64)
#define VEC_LOAD 1
#define HAS_DROPOUT 0
#define SMEM_ROW HEAD_DIM
#include "common.cuh"
#include "sm90.cuh"
#include "sm90_attn.cuh"
#include "sm90_fp8.cuh"
#ifndef SM90_OVERLAP
#define SM90_OVERLAP 1
#endif

static_assert(HEAD_DIM % 128 == 0 && HEAD_DIM <= 256, "HEAD_DIM: whole 128-byte lines, at most 256");
static_assert(BLOCK_N == 128 || BLOCK_N == 64, "BLOCK_N: at most one 128-byte line of Vᵀ");

// Loads ROWS rows of HEAD_DIM bytes into the SW128 tile at `tile`, 16 bytes per cp.async; rows at
// or past `row_end` and columns at or past `head_dim` become 0.
template <int ROWS>
__device__ __forceinline__ void load_tile_b(u8* tile, const u8* src, i64 row_stride, int row0,
                                            int row_end, int head_dim) {
    constexpr int CHUNKS = ROWS * (HEAD_DIM / 16);
#pragma unroll
    for (int c = threadIdx.x; c < CHUNKS; c += NUM_THREADS) {
        const int r = c / (HEAD_DIM / 16), col = (c % (HEAD_DIM / 16)) * 16;
        const bool ok = row0 + r < row_end && col < head_dim;
        const u8* g = ok ? src + (i64)(row0 + r) * row_stride + col : src;
        cp_async16(smem_addr(tile + sw128_b(r, col, ROWS)), g, ok ? 16 : 0);
    }
}

// Vᵀ of keys row0 .. row0 + BLOCK_N - 1 into the SW128 tile `vt` (HEAD_DIM rows, BLOCK_N key
// columns in kpos order), through registers: 16 bytes of a key row per load, one byte store each.
__device__ __forceinline__ void load_vt(u8* vt, const u8* src, i64 row_stride, int row0,
                                        int row_end, int head_dim) {
    constexpr int CHUNKS = BLOCK_N * (HEAD_DIM / 16);
    for (int c = threadIdx.x; c < CHUNKS; c += NUM_THREADS) {
        const int key = c % BLOCK_N, col = (c / BLOCK_N) * 16;
        u32 w[4] = {0u, 0u, 0u, 0u};
        if (row0 + key < row_end && col < head_dim) {
#ifdef FA_HOST_EMULATION
            std::memcpy(w, src + (i64)(row0 + key) * row_stride + col, 16);
#else
            const uint4 a = *reinterpret_cast<const uint4*>(src + (i64)(row0 + key) * row_stride + col);
            w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w;
#endif
        }
        const int kc = (key & ~31) + kpos(key & 31);
#pragma unroll
        for (int i = 0; i < 16; ++i)
            vt[sw128_b(col + i, kc, HEAD_DIM)] = (u8)(w[i >> 2] >> (8 * (i & 3)));
    }
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
flash_fwd(const __grid_constant__ FwdParams p) {
    FA_DYNAMIC_SMEM(unsigned char, smem_raw);
    // Tiles start 1024-byte aligned: the hardware's swizzle reads address bits 7-9 as the row.
    u8* q_tile = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    u8* k_tiles = q_tile + BLOCK_M * HEAD_DIM;       // 2 buffers of [BLOCK_N][HEAD_DIM]
    u8* vt_tiles = k_tiles + 2 * BLOCK_N * HEAD_DIM;  // 2 buffers of [HEAD_DIM][128]: 128-byte lines

    CtaWork<u8> w8;
    if (!cta_work<u8, BLOCK_M, BLOCK_N>(w8, p)) return;
    // sm90_attn.cuh's helpers read everything but the tensor pointers, which stay in w8.
    CtaWork<u16> w;
    w.b = w8.b, w.h = w8.h, w.m0 = w8.m0, w.m_end = w8.m_end;
    w.seqlen_q = w8.seqlen_q, w.seqlen_k = w8.seqlen_k;
    w.q_g = w.k_g = w.v_g = nullptr;
    w.out_row0 = w8.out_row0, w.lse_base = w8.lse_base;
    w.mask = w8.mask, w.mods = w8.mods, w.drop = w8.drop, w.sink = w8.sink;
    w.n_block_min = w8.n_block_min, w.n_block_max = w8.n_block_max;
    // P was scaled by 256 before rounding: the rows are divided by it once, at the end.
    w.out_scale = w8.out_scale * (1.f / 256.f);
    const int m0 = w.m0, seqlen_q = w.seqlen_q, seqlen_k = w.seqlen_k;
    const int n_block_min = w.n_block_min, n_block_max = w.n_block_max;

    const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;

    // Per-block factors: this warpgroup's q factor (softmax_scale folded in) and this (sequence,
    // kv head)'s k and v rows; null without them.
    const BlockFactors fac(p, w.b, w.h, m0 + 64 * wg);
    const float* __restrict__ k_fac = fac.k;
    const float* __restrict__ v_fac = fac.v;
    const float q_fac = fac.q;
    float v_unit = 1.f;  // the v factor acc_o is in units of
    if (v_fac != nullptr && n_block_min < n_block_max) v_unit = v_fac[n_block_min * BLOCK_N / 128];

    load_tile_b<BLOCK_M>(q_tile, w8.q_g, p.q_row_stride, m0, seqlen_q, p.head_dim);
    if (n_block_min < n_block_max)
        load_tile_b<BLOCK_N>(k_tiles, w8.k_g, p.k_row_stride, n_block_min * BLOCK_N, seqlen_k,
                             p.head_dim);
    cp_async_commit();

    // This thread's rows of the tile: 64·wg + 16·warp + g and + 8.
    float acc_o[HEAD_DIM / 8][4];
    float row_max[2], row_sum[2];
    int row_i[2];
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 8; ++i) acc_o[i][0] = acc_o[i][1] = acc_o[i][2] = acc_o[i][3] = 0.f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        row_max[r] = -FA_INF;
        row_sum[r] = 0.f;
        row_i[r] = m0 + 64 * wg + 16 * warp + g + 8 * r;
    }
    const u32 q_addr = smem_addr(q_tile);

#if SM90_OVERLAP
    u32 p_frag[BLOCK_N / 32][4];  // P of the previous block, the A operand of its P·V
    for (int n_block = n_block_min; n_block < n_block_max; ++n_block) {
        const int it = n_block - n_block_min, buf = it & 1;
        if (n_block + 1 < n_block_max) {
            // The other K buffer was released by the __syncthreads ending the previous iteration.
            load_tile_b<BLOCK_N>(k_tiles + (buf ^ 1) * BLOCK_N * HEAD_DIM, w8.k_g, p.k_row_stride,
                                 (n_block + 1) * BLOCK_N, seqlen_k, p.head_dim);
        }
        cp_async_commit();
        // Vᵀ of this block into buffer buf while K[n + 1] is in flight. Its last reader, P·V of
        // block n - 2, retired (wait 0) before the __syncthreads ending the previous iteration;
        // P·V of block n - 1, issued below, reads the other buffer.
        load_vt(vt_tiles + buf * HEAD_DIM * 128, w8.v_g, p.v_row_stride, n_block * BLOCK_N,
                seqlen_k, p.head_dim);
        cp_async_wait<1>();  // K[n] (and the q tile) have landed
        fence_proxy_async();
        __syncthreads();

        float s[BLOCK_N / 8][4];
        const u32 k_addr = smem_addr(k_tiles + buf * BLOCK_N * HEAD_DIM);
        reg_fence_all(acc_o);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 32; ++kk)
            WgmmaE4m3<BLOCK_N>::ss(s, desc_kmajor(q_addr, BLOCK_M, 64 * wg, kk),
                                   desc_kmajor(k_addr, BLOCK_N, 0, kk), kk > 0);
        wgmma_commit();
        if (it > 0) {
            // O += P[n - 1]·V[n - 1] runs while this block's scores are masked and exponentiated.
            const u32 vt_addr = smem_addr(vt_tiles + (buf ^ 1) * HEAD_DIM * 128);
#pragma unroll
            for (int j = 0; j < BLOCK_N / 32; ++j)
                WgmmaE4m3<HEAD_DIM>::rs(acc_o, p_frag[j], desc_kmajor(vt_addr, HEAD_DIM, 0, j), 1);
            wgmma_commit();
            wgmma_wait<1>();  // S is ready; the P·V group may still run
        } else {
            wgmma_wait<0>();
        }
        reg_fence_all(s);

        if (k_fac != nullptr) set_block_scale(w, q_fac * k_fac[n_block * BLOCK_N / 128], p.softcap);
        mask_scores(s, w, row_i, n_block * BLOCK_N, t);
        float alpha[2];
        softmax_rows(s, row_max, row_sum, alpha);
        // acc_o holds O through block n - 1 and p_frag is free once P·V has retired: only then is
        // acc_o rescaled for block n's maximum and P[n] packed over the registers it read.
        wgmma_wait<0>();
        reg_fence_all(acc_o);
        if (v_fac != nullptr) block_v_rescale(alpha, v_unit, v_fac[n_block * BLOCK_N / 128]);
        rescale_o(acc_o, alpha);
#pragma unroll
        for (int j = 0; j < BLOCK_N / 32; ++j) pack_p_e4m3(p_frag[j], s, j);
        __syncthreads();  // every warpgroup is done with K[n] and Vᵀ[n - 1]
    }
    if (n_block_min < n_block_max) {
        // The last block's P·V: its Vᵀ was written and fenced before the last iteration's
        // __syncthreads.
        const u32 vt_addr =
            smem_addr(vt_tiles + ((n_block_max - 1 - n_block_min) & 1) * HEAD_DIM * 128);
        reg_fence_all(acc_o);
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < BLOCK_N / 32; ++j)
            WgmmaE4m3<HEAD_DIM>::rs(acc_o, p_frag[j], desc_kmajor(vt_addr, HEAD_DIM, 0, j), 1);
        wgmma_commit();
        wgmma_wait<0>();
        reg_fence_all(acc_o);
    }
#else
    const u32 vt_addr = smem_addr(vt_tiles);
    for (int n_block = n_block_min; n_block < n_block_max; ++n_block) {
        const int buf = (n_block - n_block_min) & 1;
        if (n_block + 1 < n_block_max) {
            // The other K buffer was released by the __syncthreads ending the previous iteration.
            load_tile_b<BLOCK_N>(k_tiles + (buf ^ 1) * BLOCK_N * HEAD_DIM, w8.k_g, p.k_row_stride,
                                 (n_block + 1) * BLOCK_N, seqlen_k, p.head_dim);
        }
        cp_async_commit();
        // Vᵀ of this block while K[n + 1] is in flight (the previous P·V has retired: its wait and
        // the __syncthreads ending the iteration came before).
        load_vt(vt_tiles, w8.v_g, p.v_row_stride, n_block * BLOCK_N, seqlen_k, p.head_dim);
        cp_async_wait<1>();  // K[n] (and the q tile) have landed
        // cp.async and the Vᵀ stores wrote through the generic proxy; wgmma reads through the
        // async one.
        fence_proxy_async();
        __syncthreads();

        // S = Q·Kᵀ for this warpgroup's 64 rows × BLOCK_N keys.
        float s[BLOCK_N / 8][4];
        const u32 k_addr = smem_addr(k_tiles + buf * BLOCK_N * HEAD_DIM);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 32; ++kk)
            WgmmaE4m3<BLOCK_N>::ss(s, desc_kmajor(q_addr, BLOCK_M, 64 * wg, kk),
                                   desc_kmajor(k_addr, BLOCK_N, 0, kk), kk > 0);
        wgmma_commit();
        wgmma_wait<0>();
        reg_fence_all(s);

        if (k_fac != nullptr) set_block_scale(w, q_fac * k_fac[n_block * BLOCK_N / 128], p.softcap);
        mask_scores(s, w, row_i, n_block * BLOCK_N, t);
        float alpha[2];
        softmax_rows(s, row_max, row_sum, alpha);
        // P packed whole before acc_o is touched: the scores' registers are free again while
        // acc_o is rescaled and the products issue (at head_dim 256 with ALiBi, packing k-step by
        // k-step between the issues spilled).
        u32 p_frag[BLOCK_N / 32][4];
#pragma unroll
        for (int j = 0; j < BLOCK_N / 32; ++j) pack_p_e4m3(p_frag[j], s, j);
        if (v_fac != nullptr) block_v_rescale(alpha, v_unit, v_fac[n_block * BLOCK_N / 128]);
        rescale_o(acc_o, alpha);

        // acc_o += P·V: k-step j is keys 32j .. 32j + 31, B the Vᵀ tile's columns there.
        reg_fence_all(acc_o);
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < BLOCK_N / 32; ++j)
            WgmmaE4m3<HEAD_DIM>::rs(acc_o, p_frag[j], desc_kmajor(vt_addr, HEAD_DIM, 0, j), 1);
        wgmma_commit();
        wgmma_wait<0>();
        reg_fence_all(acc_o);
        __syncthreads();  // every warpgroup is done with this K buffer and the Vᵀ tile
    }
#endif
    cp_async_wait<0>();  // a CTA that saw no key block still has its q tile in flight
    w.out_scale *= v_unit;  // per-block factors: acc_o is in units of the last block's v factor

    store_rows(acc_o, row_max, row_sum, row_i, w, p, t);
}
