// Hopper (sm_90a) backward for f16 / bf16: bwd.cu's tensor-core bwd_dq and bwd_dkdv with every
// block product on warpgroup tensor-core instructions (wgmma.mma_async), accumulation in f32.
// bwd.cu's bwd_prep (dsum = rowsum(dO ∘ O), the LSE in the log2 domain: lse2) runs first as for
// bwd.cu's kernels; these two read its workspaces. As there, dQ is computed apart from dK/dV, so
// no kernel needs atomics and the gradients are bit-identical from run to run.
//
// With the key block fixed per CTA, dK/dV is the forward twice over (fwd_sm90.cu):
//   Sᵀ  = K·Qᵀ, dPᵀ = V·dOᵀ  wgmma m64n{KV_BLOCK_M}k16, both operands K-major over head_dim in
//                            shared memory (A = this warpgroup's 64 keys, B = the step's query rows),
//                            shaped like the forward's S = Q·Kᵀ;
//   P̃ᵀ, dSᵀ                 recomputed elementwise as in bwd.cu (mask, softcap, ALiBi, dropout);
//   dV += P̃ᵀ·dO, dK += dSᵀ·Q wgmma m64n{HEAD_DIM}k16 with A from registers (the accumulators
//                            re-packed as the A fragment, pack_a) and B (dO, Q) read MN-major,
//                            shaped like the forward's O += P·V.
// With the query block fixed per CTA, dQ likewise: S = Q·Kᵀ and dP = dO·Vᵀ (SS), dQ += dS·K (RS,
// K read MN-major).
//
//   bwd_dkdv_sm90  one CTA per (64 · NUM_WG keys, kv head, sequence), warpgroup wg owning keys
//                  64·wg .. 64·wg + 63; it walks the query heads of its group and the blocks of
//                  KV_BLOCK_M query rows that see its keys (q, dO and their lse2 / dsum
//                  double-buffered with cp.async, the next step loading while this one computes).
//   bwd_dq_sm90    one CTA per (64 · NUM_WG query rows, head, sequence), warpgroup wg owning rows
//                  64·wg .. 64·wg + 63; it walks the blocks of DQ_BLOCK_N keys its rows see (k and
//                  v double-buffered).
// Tiles are sm90.cuh's 128-byte-swizzled slabs, 1024-byte aligned, loaded 16 bytes per cp.async
// (rows past the sequence and columns past head_dim zero-filled); every product is waited for
// before its results are used (no overlap of the elementwise work with the tensor cores yet).
//
// Defines (cuda/key.rs): FA_BF16 or FA_F16, HEAD_DIM (head_dim rounded up to 64 or 128: whole
// slabs), IS_MASKED, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, NUM_WG, KV_BLOCK_M, DQ_BLOCK_N and
// BWD_SM90_ENTRY (2: bwd_dq_sm90, 3: bwd_dkdv_sm90, 0: both, for the host emulation). Needs
// VEC_LOAD's conditions (16-byte loads); the other calls stay on bwd.cu.
#define FA_TENSOR_CORE_KERNEL
#define FA_SM90_KERNEL
#define NUM_THREADS (NUM_WG * 128)
#define VEC_LOAD 1
#define SMEM_ROW HEAD_DIM
#include "common.cuh"
#include "sm90.cuh"
#include "bwd_common.cuh"

#define KV_N (NUM_WG * 64)  // bwd_dkdv_sm90: keys per CTA
#define DQ_M (NUM_WG * 64)  // bwd_dq_sm90: query rows per CTA

static_assert(HEAD_DIM % 64 == 0 && HEAD_DIM <= 128,
              "HEAD_DIM: whole 64-column slabs; two HEAD_DIM accumulators per thread up to 128");
static_assert(KV_BLOCK_M % 16 == 0 && KV_BLOCK_M >= 32 && DQ_BLOCK_N % 16 == 0 && DQ_BLOCK_N >= 32,
              "wgmma n sizes whose tiles are whole 8-row swizzle groups of 1024-byte slabs");



// Loads ROWS rows (row r from src + (row0 + r) * row_stride) of HEAD_DIM columns into the SW128
// tile at `tile`, 16 bytes per cp.async; rows at or past `row_end` and columns at or past
// `head_dim` become 0 (a masked entry's P and dS are 0, and 0 times a stale NaN would not be).
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

// Tiles start 1024-byte aligned: the hardware's swizzle reads address bits 7-9 as the row.
__device__ __forceinline__ u16* aligned_tiles(unsigned char* smem_raw) {
    return reinterpret_cast<u16*>(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));
}

#if BWD_SM90_ENTRY == 3 || BWD_SM90_ENTRY == 0
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
bwd_dkdv_sm90(const __grid_constant__ BwdParams p) {
    const u16* __restrict__ q = static_cast<const u16*>(p.q);
    const u16* __restrict__ k = static_cast<const u16*>(p.k);
    const u16* __restrict__ v = static_cast<const u16*>(p.v);
    const u16* __restrict__ dout = static_cast<const u16*>(p.dout);
    float* __restrict__ lse2 = p.lse2;
    float* __restrict__ dsum = p.dsum;
    u16* __restrict__ dk = static_cast<u16*>(p.dk);
    u16* __restrict__ dv = static_cast<u16*>(p.dv);
    const i64* __restrict__ seqs = p.seqs;
    const float* __restrict__ alibi_slopes = p.alibi_slopes;
    FA_DYNAMIC_SMEM(unsigned char, smem_raw);
    u16* k_tile = aligned_tiles(smem_raw);              // [KV_N][HEAD_DIM]
    u16* v_tile = k_tile + KV_N * HEAD_DIM;             // [KV_N]
    u16* q_tiles = v_tile + KV_N * HEAD_DIM;            // 2 x [KV_BLOCK_M]
    u16* do_tiles = q_tiles + 2 * KV_BLOCK_M * HEAD_DIM; // 2 x [KV_BLOCK_M]
    // lse2 and dsum of the step's rows, 2 x [2][KV_BLOCK_M] f32, copied with the q and dO tiles.
    float* stats = reinterpret_cast<float*>(do_tiles + 2 * KV_BLOCK_M * HEAD_DIM);

    const int b = blockIdx.z, hk = blockIdx.y;
    const BwdSeq seq(seqs + BWD_FIELDS * b);
    const int n0 = blockIdx.x * KV_N;
    if (n0 >= seq.seqlen_k) return;
    const int n_end = min(n0 + KV_N, seq.seqlen_k);
    const int group = p.heads / p.heads_kv;
    const Mask mask{seq.seqlen_k, seq.seqlen_k - seq.seqlen_q, p.window_left, p.window_right};
    const Dropout drop{p.drop};
    const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;

    // The query blocks that may see keys n0..n_end.
    const BwdQueryBlocks qb = bwd_query_blocks<KV_BLOCK_M>(mask, p, seq.seqlen_q, n0, n_end);
    const int mb_min = qb.mb_min, mb_count = qb.mb_count;
    const int steps = group * mb_count;  // (head, query block) pairs, head-major

    load_tile_sw128<KV_N>(k_tile, k + seq.k_base + hk * p.k_head_stride, p.k_row_stride, n0,
                          seq.seqlen_k, p.head_dim);
    load_tile_sw128<KV_N>(v_tile, v + seq.v_base + hk * p.v_head_stride, p.v_row_stride, n0,
                          seq.seqlen_k, p.head_dim);
    cp_async_commit();
    auto load_step = [&](int step, int buf) {
        const int h = hk * group + step / mb_count, m0 = (mb_min + step % mb_count) * KV_BLOCK_M;
        load_tile_sw128<KV_BLOCK_M>(q_tiles + buf * KV_BLOCK_M * HEAD_DIM,
                                    q + seq.q_base + h * p.q_head_stride, p.q_row_stride, m0,
                                    seq.seqlen_q, p.head_dim);
        load_tile_sw128<KV_BLOCK_M>(do_tiles + buf * KV_BLOCK_M * HEAD_DIM,
                                    dout + seq.dout_base + h * p.dout_head_stride,
                                    p.dout_row_stride, m0, seq.seqlen_q, p.head_dim);
        load_stats<KV_BLOCK_M>(stats + 2 * buf * KV_BLOCK_M, lse2, dsum,
                               seq.lse_base + h * p.lse_head_stride, m0, seq.seqlen_q);
    };
    if (steps > 0) load_step(0, 0);
    cp_async_commit();

    // This thread's keys: 64·wg + 16·warp + g and + 8 of the CTA's.
    int key_j[2];
    key_j[0] = n0 + 64 * wg + 16 * warp + g;
    key_j[1] = key_j[0] + 8;
    float acc_k[HEAD_DIM / 8][4], acc_v[HEAD_DIM / 8][4];
    acc_zero(acc_k);
    acc_zero(acc_v);
    const u32 k_addr = smem_addr(k_tile), v_addr = smem_addr(v_tile);

    for (int step = 0; step < steps; ++step) {
        const int buf = step & 1;
        if (step + 1 < steps) {
            load_step(step + 1, buf ^ 1);  // released by the __syncthreads ending the last step
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        // cp.async wrote through the generic proxy; wgmma reads through the async one.
        fence_proxy_async();
        __syncthreads();

        const int h = hk * group + step / mb_count, m0 = (mb_min + step % mb_count) * KV_BLOCK_M;
        const int m_end = min(m0 + KV_BLOCK_M, seq.seqlen_q);
        const BwdMod mod = bwd_mod(p.softmax_scale, p.softcap,
                                   HAS_ALIBI ? alibi_slopes[b * p.heads + h] : 0.f, mask.offset);
        const u32 q_addr = smem_addr(q_tiles + buf * KV_BLOCK_M * HEAD_DIM);
        const u32 do_addr = smem_addr(do_tiles + buf * KV_BLOCK_M * HEAD_DIM);
        // Transposed: rows are this warpgroup's keys, columns the step's query rows.
        float st[KV_BLOCK_M / 8][4], dpt[KV_BLOCK_M / 8][4];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
            Wgmma<KV_BLOCK_M>::ss(st, desc_kmajor(k_addr, KV_N, 64 * wg, kk),
                                  desc_kmajor(q_addr, KV_BLOCK_M, 0, kk), kk > 0);
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
            Wgmma<KV_BLOCK_M>::ss(dpt, desc_kmajor(v_addr, KV_N, 64 * wg, kk),
                                  desc_kmajor(do_addr, KV_BLOCK_M, 0, kk), kk > 0);
        wgmma_commit();
        wgmma_wait<0>();
        reg_fence_all(st);
        reg_fence_all(dpt);

        const bool need_mask = dkdv_need_mask<KV_BLOCK_M, KV_N>(mask, seq, m0, m_end, n0);
        dkdv_scores<KV_BLOCK_M>(st, dpt, mod, mask, drop, seq, need_mask,
                                stats + 2 * buf * KV_BLOCK_M, m0, key_j, g, t, h, b);
        // P̃ᵀ and dSᵀ rounded to the input type as the A fragments of the two RS products: k-step
        // j covers the step's query rows 16j .. 16j + 15, the rows of dO and Q read MN-major.
        u32 pa[KV_BLOCK_M / 16][4], da[KV_BLOCK_M / 16][4];
        pack_a<KV_BLOCK_M>(pa, st);
        pack_a<KV_BLOCK_M>(da, dpt);
        reg_fence_all(acc_v);
        reg_fence_all(acc_k);
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < KV_BLOCK_M / 16; ++j)
            Wgmma<HEAD_DIM>::rs(acc_v, pa[j], desc_mnmajor(do_addr, KV_BLOCK_M, j), 1);
#pragma unroll
        for (int j = 0; j < KV_BLOCK_M / 16; ++j)
            Wgmma<HEAD_DIM>::rs(acc_k, da[j], desc_mnmajor(q_addr, KV_BLOCK_M, j), 1);
        wgmma_commit();
        wgmma_wait<0>();
        reg_fence_all(acc_v);
        reg_fence_all(acc_k);
        __syncthreads();  // every warpgroup is done with this step's q and dO buffers
    }
    cp_async_wait<0>();  // a CTA that saw no query block still has its tiles in flight
    store_dkdv(acc_k, acc_v, key_j, seq, dk, dv, p, hk, t);
}
#endif  // BWD_SM90_ENTRY == 3

#if BWD_SM90_ENTRY == 2 || BWD_SM90_ENTRY == 0
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
bwd_dq_sm90(const __grid_constant__ BwdParams p) {
    const u16* __restrict__ q = static_cast<const u16*>(p.q);
    const u16* __restrict__ k = static_cast<const u16*>(p.k);
    const u16* __restrict__ v = static_cast<const u16*>(p.v);
    const u16* __restrict__ dout = static_cast<const u16*>(p.dout);
    float* __restrict__ lse2 = p.lse2;
    float* __restrict__ dsum = p.dsum;
    u16* __restrict__ dq = static_cast<u16*>(p.dq);
    const i64* __restrict__ seqs = p.seqs;
    const float* __restrict__ alibi_slopes = p.alibi_slopes;
    FA_DYNAMIC_SMEM(unsigned char, smem_raw);
    u16* q_tile = aligned_tiles(smem_raw);              // [DQ_M][HEAD_DIM]
    u16* do_tile = q_tile + DQ_M * HEAD_DIM;            // [DQ_M]
    u16* k_tiles = do_tile + DQ_M * HEAD_DIM;           // 2 x [DQ_BLOCK_N]
    u16* v_tiles = k_tiles + 2 * DQ_BLOCK_N * HEAD_DIM; // 2 x [DQ_BLOCK_N]

    const int b = blockIdx.z, h = blockIdx.y;
    const BwdSeq seq(seqs + BWD_FIELDS * b);
    const int m0 = blockIdx.x * DQ_M;
    if (m0 >= seq.seqlen_q) return;
    const int m_end = min(m0 + DQ_M, seq.seqlen_q);
    const int hk = h / (p.heads / p.heads_kv);
    const Mask mask{seq.seqlen_k, seq.seqlen_k - seq.seqlen_q, p.window_left, p.window_right};
    const Dropout drop{p.drop};
    const BwdMod mod = bwd_mod(p.softmax_scale, p.softcap,
                               HAS_ALIBI ? alibi_slopes[b * p.heads + h] : 0.f, mask.offset);
    const u16* q_g = q + seq.q_base + h * p.q_head_stride;
    const u16* do_g = dout + seq.dout_base + h * p.dout_head_stride;
    const u16* k_g = k + seq.k_base + hk * p.k_head_stride;
    const u16* v_g = v + seq.v_base + hk * p.v_head_stride;
    const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;

    int nb_min, nb_max;
    bwd_key_blocks<DQ_BLOCK_N>(mask, m0, m_end, nb_min, nb_max);
    load_tile_sw128<DQ_M>(q_tile, q_g, p.q_row_stride, m0, seq.seqlen_q, p.head_dim);
    load_tile_sw128<DQ_M>(do_tile, do_g, p.dout_row_stride, m0, seq.seqlen_q, p.head_dim);
    cp_async_commit();
    if (nb_min < nb_max) {
        load_tile_sw128<DQ_BLOCK_N>(k_tiles, k_g, p.k_row_stride, nb_min * DQ_BLOCK_N, seq.seqlen_k,
                                    p.head_dim);
        load_tile_sw128<DQ_BLOCK_N>(v_tiles, v_g, p.v_row_stride, nb_min * DQ_BLOCK_N, seq.seqlen_k,
                                    p.head_dim);
    }
    cp_async_commit();

    // This thread's rows 64·wg + 16·warp + g and + 8: the mask, the LSE and dsum of each.
    const BwdRows rows(m0 + 64 * wg + 16 * warp + g, m_end, mask, lse2, dsum,
                       seq.lse_base + h * p.lse_head_stride);
    float acc[HEAD_DIM / 8][4];
    acc_zero(acc);
    const u32 q_addr = smem_addr(q_tile), do_addr = smem_addr(do_tile);

    for (int nb = nb_min; nb < nb_max; ++nb) {
        const int buf = (nb - nb_min) & 1;
        if (nb + 1 < nb_max) {
            // The other buffers were released by the __syncthreads ending the previous step.
            load_tile_sw128<DQ_BLOCK_N>(k_tiles + (buf ^ 1) * DQ_BLOCK_N * HEAD_DIM, k_g,
                                        p.k_row_stride, (nb + 1) * DQ_BLOCK_N, seq.seqlen_k,
                                        p.head_dim);
            load_tile_sw128<DQ_BLOCK_N>(v_tiles + (buf ^ 1) * DQ_BLOCK_N * HEAD_DIM, v_g,
                                        p.v_row_stride, (nb + 1) * DQ_BLOCK_N, seq.seqlen_k,
                                        p.head_dim);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        fence_proxy_async();
        __syncthreads();

        const u32 k_addr = smem_addr(k_tiles + buf * DQ_BLOCK_N * HEAD_DIM);
        const u32 v_addr = smem_addr(v_tiles + buf * DQ_BLOCK_N * HEAD_DIM);
        float s[DQ_BLOCK_N / 8][4], dp[DQ_BLOCK_N / 8][4];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
            Wgmma<DQ_BLOCK_N>::ss(s, desc_kmajor(q_addr, DQ_M, 64 * wg, kk),
                                  desc_kmajor(k_addr, DQ_BLOCK_N, 0, kk), kk > 0);
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
            Wgmma<DQ_BLOCK_N>::ss(dp, desc_kmajor(do_addr, DQ_M, 64 * wg, kk),
                                  desc_kmajor(v_addr, DQ_BLOCK_N, 0, kk), kk > 0);
        wgmma_commit();
        wgmma_wait<0>();
        reg_fence_all(s);
        reg_fence_all(dp);

        const int n0 = nb * DQ_BLOCK_N;
        const bool need_mask = dq_need_mask<DQ_BLOCK_N>(mask, seq, m0, m_end, n0);
        dq_scores<DQ_BLOCK_N>(s, dp, mod, drop, rows, seq.seqlen_k, need_mask, n0, t, h, b);
        // dQ += dS·K: k-step j covers keys 16j .. 16j + 15, the rows of K read MN-major.
        reg_fence_all(acc);
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < DQ_BLOCK_N / 16; ++j) {
            u32 af[4];
            pack_kstep<DQ_BLOCK_N>(af, s, j);
            Wgmma<HEAD_DIM>::rs(acc, af, desc_mnmajor(k_addr, DQ_BLOCK_N, j), 1);
        }
        wgmma_commit();
        wgmma_wait<0>();
        reg_fence_all(acc);
        __syncthreads();  // every warpgroup is done with this K and V buffer
    }
    cp_async_wait<0>();  // a CTA that saw no key block still has its tiles in flight
    store_dq(acc, rows, seq, dq, p, h, t);
}
#endif  // BWD_SM90_ENTRY == 2
