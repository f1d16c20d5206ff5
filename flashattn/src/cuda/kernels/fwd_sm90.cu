// Hopper (sm_90a) forward for f16 / bf16: the FlashAttention-2 algorithm of fwd.cu with both
// products on warpgroup tensor-core instructions (wgmma.mma_async), accumulation in f32.
//
// One CTA computes BLOCK_M = 64 · NUM_WG query rows of one (sequence, head); warpgroup wg (128
// threads) owns rows 64·wg .. 64·wg + 63 and issues its own wgmma. For every key block the CTA can
// see (the key range comes from the mask rule, as in fwd.cu):
//   S = Q·Kᵀ     wgmma m64n{BLOCK_N}k16, both operands read from shared memory through
//                descriptors (sm90.cuh), HEAD_DIM / 16 k-steps committed as one group;
//   mask/mods    scale, softcap, ALiBi, mask (the per-element mask only on blocks it cuts);
//   softmax      online, in registers: the accumulator layout per warp is mma.m16n8's, so
//                common.cuh's online_softmax_step serves unchanged;
//   acc_o += P·V wgmma m64n{HEAD_DIM}k16 with P from registers (the S accumulators re-packed as
//                the A fragment, pack_kstep) and V read MN-major (transposed) from shared memory.
// K and V tiles are double-buffered with cp.async as in fwd.cu: block n+1 loads while block n
// computes. Tiles use the 128-byte-swizzled slab layout wgmma's descriptors read (sm90.cuh).
// With SM90_OVERLAP the softmax of one block runs while the tensor cores compute P·V of the one
// before (FlashAttention-3's intra-warpgroup overlap). Not yet here from FlashAttention-3: the
// producer warp with TMA loads and mbarriers, and the pingpong of two warpgroups.
//
// Defines (set from the Rust KernelKey, cuda/key.rs): FA_BF16 (else f16), HEAD_DIM (head_dim
// rounded up to a multiple of 64: whole slabs), BLOCK_N, NUM_WG, IS_MASKED, HAS_SOFTCAP,
// HAS_ALIBI, SM90_OVERLAP (default 1: the softmax of block n runs while the tensor cores do
// P·V of block n - 1; 0: each product waited for at once). Needs VEC_LOAD's conditions (16-byte loads); no dropout, no FP8 (fwd.cu has them).
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
#ifndef SM90_OVERLAP
#define SM90_OVERLAP 1
#endif

static_assert(HEAD_DIM % 64 == 0 && HEAD_DIM <= 256, "HEAD_DIM: whole 64-column slabs, at most 256");
static_assert(BLOCK_N % 16 == 0 && BLOCK_N >= 16 && BLOCK_N <= 256, "BLOCK_N: a wgmma n size");

// Loads ROWS rows (row r from src + (row0 + r) * row_stride) of HEAD_DIM columns into the SW128
// tile at `tile`, 16 bytes per cp.async; rows at or past `row_end` and columns at or past
// `head_dim` become 0 (a masked key's probability is 0, and 0 times a stale NaN would not be).
template <int ROWS>
__device__ __forceinline__ void load_tile_sw128(u16* tile, const u16* src, i64 row_stride,
                                                int row0, int row_end, int head_dim) {
    constexpr int CHUNKS = ROWS * (HEAD_DIM / 8);
#pragma unroll
    for (int c = threadIdx.x; c < CHUNKS; c += NUM_THREADS) {
        const int r = c / (HEAD_DIM / 8), col = (c % (HEAD_DIM / 8)) * 8;
        const bool ok = row0 + r < row_end && col < head_dim;
        const u16* g = ok ? src + (i64)(row0 + r) * row_stride + col : src;
        cp_async16(smem_addr(tile + sw128(r, col, ROWS)), g, ok ? 16 : 0);
    }
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
flash_fwd(const __grid_constant__ FwdParams p) {
    FA_DYNAMIC_SMEM(unsigned char, smem_raw);
    // Tiles start 1024-byte aligned: the hardware's swizzle reads address bits 7-9 as the row.
    u16* q_tile = reinterpret_cast<u16*>(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));
    u16* k_tiles = q_tile + BLOCK_M * HEAD_DIM;       // 2 buffers of [BLOCK_N][HEAD_DIM]
    u16* v_tiles = k_tiles + 2 * BLOCK_N * HEAD_DIM;  // 2 buffers

    CtaWork<u16> w;
    if (!cta_work<u16, BLOCK_M, BLOCK_N>(w, p)) return;
    const int m0 = w.m0, seqlen_q = w.seqlen_q, seqlen_k = w.seqlen_k;
    const int n_block_min = w.n_block_min, n_block_max = w.n_block_max;

    const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;

#if SM90_OVERLAP
    // Loads run one block ahead, V one step behind K: iteration n loads K[n + 1] and V[n] (one
    // cp.async group) while S = Q·K[n]ᵀ and O += P[n - 1]·V[n - 1] run. A K buffer is rewritten
    // two iterations after its product was issued, a V buffer likewise: the __syncthreads ending
    // each iteration orders every warpgroup's waits before those writes.
    load_tile_sw128<BLOCK_M>(q_tile, w.q_g, p.q_row_stride, m0, seqlen_q, p.head_dim);
    if (n_block_min < n_block_max)
        load_tile_sw128<BLOCK_N>(k_tiles, w.k_g, p.k_row_stride, n_block_min * BLOCK_N, seqlen_k,
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

    u32 p_frag[BLOCK_N / 16][4];  // P of the previous block, the A operand of its P·V
    for (int n_block = n_block_min; n_block < n_block_max; ++n_block) {
        const int it = n_block - n_block_min, buf = it & 1;
        if (n_block + 1 < n_block_max)
            load_tile_sw128<BLOCK_N>(k_tiles + (buf ^ 1) * BLOCK_N * HEAD_DIM, w.k_g, p.k_row_stride,
                                     (n_block + 1) * BLOCK_N, seqlen_k, p.head_dim);
        load_tile_sw128<BLOCK_N>(v_tiles + buf * BLOCK_N * HEAD_DIM, w.v_g, p.v_row_stride,
                                 n_block * BLOCK_N, seqlen_k, p.head_dim);
        cp_async_commit();
        cp_async_wait<1>();  // K[n] and V[n - 1] (this thread's copies) have landed
        fence_proxy_async();
        __syncthreads();

        float s[BLOCK_N / 8][4];
        const u32 k_addr = smem_addr(k_tiles + buf * BLOCK_N * HEAD_DIM);
        reg_fence_all(acc_o);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
            Wgmma<BLOCK_N>::ss(s, desc_kmajor(q_addr, BLOCK_M, 64 * wg, kk),
                               desc_kmajor(k_addr, BLOCK_N, 0, kk), kk > 0);
        wgmma_commit();
        if (it > 0) {
            // O += P[n - 1]·V[n - 1] runs while this block's scores are masked and exponentiated.
            const u32 v_addr = smem_addr(v_tiles + (buf ^ 1) * BLOCK_N * HEAD_DIM);
#pragma unroll
            for (int j = 0; j < BLOCK_N / 16; ++j)
                Wgmma<HEAD_DIM>::rs(acc_o, p_frag[j], desc_mnmajor(v_addr, BLOCK_N, j), 1);
            wgmma_commit();
            wgmma_wait<1>();  // S is ready; the P·V group may still run
        } else {
            wgmma_wait<0>();
        }
        reg_fence_all(s);

        mask_scores(s, w, row_i, n_block * BLOCK_N, t);
        float alpha[2];
        softmax_rows(s, row_max, row_sum, alpha);
        wgmma_wait<0>();  // acc_o holds O through block n - 1: rescale it for block n's maximum
        reg_fence_all(acc_o);
        rescale_o(acc_o, alpha);
#pragma unroll
        for (int j = 0; j < BLOCK_N / 16; ++j) pack_kstep<BLOCK_N>(p_frag[j], s, j);
        __syncthreads();  // every warpgroup is done with K[n] and V[n - 1]
    }
    if (n_block_min < n_block_max) {
        // The last block's P·V, once its V has landed.
        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads();
        const u32 v_addr = smem_addr(v_tiles + ((n_block_max - 1 - n_block_min) & 1) * BLOCK_N * HEAD_DIM);
        reg_fence_all(acc_o);
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < BLOCK_N / 16; ++j)
            Wgmma<HEAD_DIM>::rs(acc_o, p_frag[j], desc_mnmajor(v_addr, BLOCK_N, j), 1);
        wgmma_commit();
        wgmma_wait<0>();
        reg_fence_all(acc_o);
    }
#else
    load_tile_sw128<BLOCK_M>(q_tile, w.q_g, p.q_row_stride, m0, seqlen_q, p.head_dim);
    cp_async_commit();
    if (n_block_min < n_block_max) {
        load_tile_sw128<BLOCK_N>(k_tiles, w.k_g, p.k_row_stride, n_block_min * BLOCK_N, seqlen_k,
                                 p.head_dim);
        load_tile_sw128<BLOCK_N>(v_tiles, w.v_g, p.v_row_stride, n_block_min * BLOCK_N, seqlen_k,
                                 p.head_dim);
    }
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

    for (int n_block = n_block_min; n_block < n_block_max; ++n_block) {
        const int buf = (n_block - n_block_min) & 1;
        u16* k_tile = k_tiles + buf * BLOCK_N * HEAD_DIM;
        u16* v_tile = v_tiles + buf * BLOCK_N * HEAD_DIM;
        if (n_block + 1 < n_block_max) {
            // The other buffer was released by the __syncthreads ending the previous iteration.
            load_tile_sw128<BLOCK_N>(k_tiles + (buf ^ 1) * BLOCK_N * HEAD_DIM, w.k_g, p.k_row_stride,
                                     (n_block + 1) * BLOCK_N, seqlen_k, p.head_dim);
            load_tile_sw128<BLOCK_N>(v_tiles + (buf ^ 1) * BLOCK_N * HEAD_DIM, w.v_g, p.v_row_stride,
                                     (n_block + 1) * BLOCK_N, seqlen_k, p.head_dim);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        // cp.async wrote through the generic proxy; wgmma reads through the async one.
        fence_proxy_async();
        __syncthreads();

        // S = Q·Kᵀ for this warpgroup's 64 rows × BLOCK_N keys.
        float s[BLOCK_N / 8][4];
        const u32 k_addr = smem_addr(k_tile);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
            Wgmma<BLOCK_N>::ss(s, desc_kmajor(q_addr, BLOCK_M, 64 * wg, kk),
                               desc_kmajor(k_addr, BLOCK_N, 0, kk), kk > 0);
        wgmma_commit();
        wgmma_wait<0>();
        reg_fence_all(s);

        mask_scores(s, w, row_i, n_block * BLOCK_N, t);
        online_softmax_step<BLOCK_N>(s, row_max, row_sum, acc_o);

        // acc_o += P·V: the accumulators of key tiles 2j, 2j+1 form the A fragment of k-step j.
        const u32 v_addr = smem_addr(v_tile);
        reg_fence_all(acc_o);
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < BLOCK_N / 16; ++j) {
            u32 af[4];
            pack_kstep<BLOCK_N>(af, s, j);
            Wgmma<HEAD_DIM>::rs(acc_o, af, desc_mnmajor(v_addr, BLOCK_N, j), 1);
        }
        wgmma_commit();
        wgmma_wait<0>();
        reg_fence_all(acc_o);
        __syncthreads();  // every warpgroup is done with this K and V buffer
    }
#endif
    cp_async_wait<0>();  // a CTA that saw no key block still has its q tile in flight

    store_rows(acc_o, row_max, row_sum, row_i, w, p, t);
}
