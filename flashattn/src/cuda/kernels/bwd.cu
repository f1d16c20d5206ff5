// The backward pass on CUDA cores, for f32, f16 and bf16 (elements widened to f32 as they are
// staged in shared memory; every product and sum in f32; each gradient rounded once when stored).
//
// FlashAttention's recomputation: only out and the forward's LSE are kept; the probabilities are
// recomputed tile by tile as P = exp2(s - lse·log2 e) and never stored in global memory. Three
// kernels, one per compile (FA_BWD_ENTRY; 0 compiles all three, for the host emulation):
//   1 bwd_prep   one warp per query row: dsum_i = Σ_d dO·O (the D of FlashAttention-2) and the
//                LSE moved to the log2 domain (lse2; a row that saw no key gets +inf, so its
//                P is 0), both into f32 workspaces laid out like the forward's contiguous lse.
//   2 bwd_dq     one CTA per (query block of BLOCK_Q = 16 rows, head, sequence), walking the key
//                blocks its rows see: dQ = Σ_j dS_ij·K_j, held in registers, written once.
//   3 bwd_dkdv   one CTA per (key block of BLOCK_K = 16 keys, kv head, sequence), walking the
//                query heads of its group and the query blocks that see it: dV = Σ Pᵀ·dO and
//                dK = Σ dSᵀ·Q, in registers, written once.
// dQ is computed apart from dK/dV (recomputing S and dP, seven block products instead of five)
// so that no kernel needs atomics: every gradient element is summed by one thread in a fixed
// order, and the results are bit-identical from run to run (as the CPU path's).
//
// With x = q·k, s = scale·x (or softcap·tanh(scale·x / softcap)) plus the ALiBi bias, P = exp(s -
// lse), dP = dO·V and dS = P ∘ (dP - dsum): dV += Pᵀ·dO, and with dX = dS · ds/dx (scale, or
// scale·(1 - tanh²) under softcap) dQ += dX·K, dK += dXᵀ·Q.
//
// Per sequence the kernels read BWD_FIELDS i64 (cuda/backward.rs): seqlen_q, seqlen_k, element
// offsets of row 0, head 0 in q, k, v, out and dout, out_row0 (token index of query 0 in dq and
// in the workspaces), lse_base (workspace index of head 0, query 0), lse_view_base (the caller's
// lse, head 0, query 0) and k_row0 (token index of key 0 in dk and dv).
//
// With BWD_TENSOR_CORES (f16/bf16, head_dim <= 128) bwd_dq and bwd_dkdv run on tensor cores
// instead (mma.sync m16n8k16 through the forward's primitives, common.cuh): the same steps, tiles
// of 64 rows or keys, P and dS rounded to the input type for their products, as FlashAttention-2.
//
// Dropout (HAS_DROPOUT) regenerates the forward's mask (dropout.cuh: Dropout): with keep mask Z
// and P̃ = P ∘ Z / (1 - p) (what multiplied V), dV += P̃ᵀ·dO and dS = P ∘ (dP ∘ Z / (1 - p) - dsum),
// dsum being dO·O of the dropped output, as on the CPU.
//
// Defines: FA_BWD_ENTRY; FA_BF16 or FA_F16 (else f32); HEAD_DIM (padded head_dim, a multiple of
// 32), IS_MASKED (causal or window), HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT; BWD_TENSOR_CORES, and
// with it SMEM_ROW and VEC_LOAD (as fwd.cu).
#define FA_CUDA_CORE_ELEM
#define NUM_THREADS 128
#if BWD_TENSOR_CORES
#define FA_TENSOR_CORE_KERNEL
#endif
#include "common.cuh"
#include "bwd_common.cuh"

#define BLOCK_Q 16   // bwd_dq: query rows per CTA; bwd_prep: rows per CTA
#define STEP_K 32    // bwd_dq: keys per step
#define BLOCK_K 16   // bwd_dkdv: keys per CTA
#define STEP_Q 32    // bwd_dkdv: query rows per step
#define PITCH (HEAD_DIM + 1)  // f32 tile rows: the rows a warp reads at once fall in distinct banks

static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM <= 256, "HEAD_DIM: a multiple of 32, at most 256");
static_assert(BLOCK_Q * STEP_K == 4 * NUM_THREADS && STEP_Q * BLOCK_K == 4 * NUM_THREADS,
              "each thread computes 4 entries of a tile pair");


#if FA_BWD_ENTRY == 1 || FA_BWD_ENTRY == 0
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
bwd_prep(const __grid_constant__ BwdParams p) {
    const elem_t* __restrict__ out = static_cast<const elem_t*>(p.out);
    const elem_t* __restrict__ dout = static_cast<const elem_t*>(p.dout);
    const float* __restrict__ lse = p.lse;
    float* __restrict__ lse2 = p.lse2;
    float* __restrict__ dsum = p.dsum;
    const i64* __restrict__ seqs = p.seqs;
    const BwdSeq seq(seqs + BWD_FIELDS * blockIdx.z);
    const int h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int r = warp; r < BLOCK_Q; r += NUM_THREADS / 32) {
        const int i = blockIdx.x * BLOCK_Q + r;
        if (i >= seq.seqlen_q) break;
        const elem_t* o = out + seq.out_base + i * p.out_row_stride + h * p.out_head_stride;
        const elem_t* g = dout + seq.dout_base + i * p.dout_row_stride + h * p.dout_head_stride;
        float acc = 0.f;
        for (int c = lane; c < p.head_dim; c += 32) acc = fmaf(to_f32(o[c]), to_f32(g[c]), acc);
#pragma unroll
        for (int m = 16; m >= 1; m /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, m);
        if (lane == 0) {
            const i64 w = seq.lse_base + h * p.lse_head_stride + i;
            const float l = lse[seq.lse_view_base + h * p.lse_view_head_stride + i * p.lse_view_row_stride];
            dsum[w] = acc;
            lse2[w] = l == -FA_INF ? FA_INF : l * FA_LOG2E;
        }
    }
}
#endif  // FA_BWD_ENTRY == 1

#if FA_BWD_ENTRY != 1

// `rows` rows of one head into an f32 tile of pitch PITCH: row r from src + (row0 + r) *
// row_stride; rows at or past row_end and columns at or past head_dim become 0.
__device__ __forceinline__ void stage(float* tile, int rows, const elem_t* src, i64 row_stride,
                                      int row0, int row_end, int head_dim) {
    for (int e = threadIdx.x; e < rows * HEAD_DIM; e += NUM_THREADS) {
        const int r = e / HEAD_DIM, c = e % HEAD_DIM;
        const bool ok = row0 + r < row_end && c < head_dim;
        tile[r * PITCH + c] = ok ? to_f32(src[(i64)(row0 + r) * row_stride + c]) : 0.f;
    }
}

// One (query tile, key tile) pair: for ROWS query rows from m0 and KEYS keys from n0, with q, dO,
// k and v staged, writes P̃ and dX into p_t and dx_t ([ROWS][KEYS + 1]); entries of rows or keys
// past the sequence, or hidden by the mask, are 0. Each thread computes four consecutive keys of
// one row: one Philox group under dropout (n0 is a multiple of 4).
template <int ROWS, int KEYS>
__device__ __forceinline__ void tile_pair(const float* q_t, const float* do_t, const float* k_t,
                                          const float* v_t, float* p_t, float* dx_t,
                                          const float* lse2_r, const float* dsum_r, int m0, int n0,
                                          int seqlen_q, const Mask& mask, const BwdMod& mod,
                                          bool need_mask, const Dropout& drop, int h, int b) {
    static_assert(ROWS * KEYS == 4 * NUM_THREADS && KEYS % 4 == 0, "four keys of a row per thread");
    const int r = threadIdx.x * 4 / KEYS, jc0 = threadIdx.x * 4 % KEYS;
    const int i = m0 + r;
    // The scores in eight partial sums added pairwise, as fwd_f32.cu (and the CPU path) sum
    // them: P = exp2(s - lse) then rounds as the forward's LSE did, and a row's P sums to 1.
    float xs[4][8], x[4], dp[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int l = 0; l < 8; ++l) xs[u][l] = 0.f;
#pragma unroll 1
    for (int c0 = 0; c0 < HEAD_DIM; c0 += 8) {
#pragma unroll
        for (int l = 0; l < 8; ++l) {
            const int c = c0 + l;
            const float qc = q_t[r * PITCH + c], dc = do_t[r * PITCH + c];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                xs[u][l] = fmaf(qc, k_t[(jc0 + u) * PITCH + c], xs[u][l]);
                dp[u] = fmaf(dc, v_t[(jc0 + u) * PITCH + c], dp[u]);
            }
        }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u)
        x[u] = ((xs[u][0] + xs[u][4]) + (xs[u][1] + xs[u][5])) +
               ((xs[u][2] + xs[u][6]) + (xs[u][3] + xs[u][7]));
#if HAS_DROPOUT
    u32 wd[4];
    drop.words(wd, (n0 + jc0) >> 2, i, h, b);
#endif
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        const int jc = jc0 + u, j = n0 + jc;
        float deriv;
        const float s = mod.apply(x[u], i, j, deriv);
        bool visible = i < seqlen_q && j < mask.seqlen_k;
        if (need_mask) visible = visible && j >= mask.lo(i) && j < mask.hi(i);
        const float p = visible ? fa_exp2(s - lse2_r[r]) : 0.f;
#if HAS_DROPOUT
        const bool kept = drop.kept(wd[u]);
        p_t[r * (KEYS + 1) + jc] = kept ? p * drop.scale : 0.f;
        dx_t[r * (KEYS + 1) + jc] = p * ((kept ? dp[u] * drop.scale : 0.f) - dsum_r[r]) * deriv;
#else
        p_t[r * (KEYS + 1) + jc] = p;
        dx_t[r * (KEYS + 1) + jc] = p * (dp[u] - dsum_r[r]) * deriv;
#endif
    }
}
#endif  // FA_BWD_ENTRY != 1

#if (FA_BWD_ENTRY == 2 || FA_BWD_ENTRY == 0) && !BWD_TENSOR_CORES
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
bwd_dq(const __grid_constant__ BwdParams p) {
    const elem_t* __restrict__ q = static_cast<const elem_t*>(p.q);
    const elem_t* __restrict__ k = static_cast<const elem_t*>(p.k);
    const elem_t* __restrict__ v = static_cast<const elem_t*>(p.v);
    const elem_t* __restrict__ dout = static_cast<const elem_t*>(p.dout);
    float* __restrict__ lse2 = p.lse2;
    float* __restrict__ dsum = p.dsum;
    elem_t* __restrict__ dq = static_cast<elem_t*>(p.dq);
    const i64* __restrict__ seqs = p.seqs;
    const float* __restrict__ alibi_slopes = p.alibi_slopes;
    FA_DYNAMIC_SMEM(float, smem_f);
    float* q_t = smem_f;                        // [BLOCK_Q][PITCH]
    float* do_t = q_t + BLOCK_Q * PITCH;        // [BLOCK_Q][PITCH]
    float* k_t = do_t + BLOCK_Q * PITCH;        // [STEP_K][PITCH]
    float* v_t = k_t + STEP_K * PITCH;          // [STEP_K][PITCH]
    float* p_t = v_t + STEP_K * PITCH;          // [BLOCK_Q][STEP_K + 1]
    float* dx_t = p_t + BLOCK_Q * (STEP_K + 1); // [BLOCK_Q][STEP_K + 1]
    float* lse2_r = dx_t + BLOCK_Q * (STEP_K + 1);
    float* dsum_r = lse2_r + BLOCK_Q;

    const int b = blockIdx.z, h = blockIdx.y;
    const BwdSeq seq(seqs + BWD_FIELDS * b);
    const int m0 = blockIdx.x * BLOCK_Q;
    if (m0 >= seq.seqlen_q) return;
    const int m_end = min(m0 + BLOCK_Q, seq.seqlen_q);
    const int hk = h / (p.heads / p.heads_kv);
    const Mask mask{seq.seqlen_k, seq.seqlen_k - seq.seqlen_q, p.window_left, p.window_right};
    const Dropout drop{p.drop};
    const BwdMod mod = bwd_mod(p.softmax_scale, p.softcap,
                               HAS_ALIBI ? alibi_slopes[b * p.heads + h] : 0.f, mask.offset);
    const elem_t* q_g = q + seq.q_base + h * p.q_head_stride;
    const elem_t* do_g = dout + seq.dout_base + h * p.dout_head_stride;
    const elem_t* k_g = k + seq.k_base + hk * p.k_head_stride;
    const elem_t* v_g = v + seq.v_base + hk * p.v_head_stride;

    stage(q_t, BLOCK_Q, q_g, p.q_row_stride, m0, seq.seqlen_q, p.head_dim);
    stage(do_t, BLOCK_Q, do_g, p.dout_row_stride, m0, seq.seqlen_q, p.head_dim);
    for (int r = threadIdx.x; r < BLOCK_Q; r += NUM_THREADS) {
        const i64 w = seq.lse_base + h * p.lse_head_stride + min(m0 + r, m_end - 1);
        lse2_r[r] = lse2[w];
        dsum_r[r] = dsum[w];
    }

    const int r = threadIdx.x / 8, c8 = threadIdx.x % 8;  // this thread's dQ row and column phase
    float acc[HEAD_DIM / 8];
#pragma unroll
    for (int c = 0; c < HEAD_DIM / 8; ++c) acc[c] = 0.f;

    const int lo = mask.lo(m0), hi = mask.hi(m_end - 1);
    for (int n0 = (lo / STEP_K) * STEP_K; n0 < hi; n0 += STEP_K) {
        __syncthreads();  // the previous step's tiles are no longer read
        stage(k_t, STEP_K, k_g, p.k_row_stride, n0, seq.seqlen_k, p.head_dim);
        stage(v_t, STEP_K, v_g, p.v_row_stride, n0, seq.seqlen_k, p.head_dim);
        __syncthreads();
        const bool need_mask =
            n0 + STEP_K > seq.seqlen_k ||
            (IS_MASKED && !(mask.lo(m_end - 1) <= n0 && mask.hi(m0) >= n0 + STEP_K));
        tile_pair<BLOCK_Q, STEP_K>(q_t, do_t, k_t, v_t, p_t, dx_t, lse2_r, dsum_r, m0, n0,
                                   seq.seqlen_q, mask, mod, need_mask, drop, h, b);
        __syncthreads();
#pragma unroll
        for (int c = 0; c < HEAD_DIM / 8; ++c) {
            const int col = c8 + 8 * c;
            float a = acc[c];
#pragma unroll 8
            for (int jc = 0; jc < STEP_K; ++jc) a = fmaf(dx_t[r * (STEP_K + 1) + jc], k_t[jc * PITCH + col], a);
            acc[c] = a;
        }
    }

    const int i = m0 + r;
    if (i < seq.seqlen_q) {
        elem_t* o = dq + ((seq.out_row0 + i) * p.heads + h) * (i64)p.head_dim;
#pragma unroll
        for (int c = 0; c < HEAD_DIM / 8; ++c) {
            const int col = c8 + 8 * c;
            if (col < p.head_dim) o[col] = from_f32_elem(acc[c]);
        }
    }
}
#endif  // FA_BWD_ENTRY == 2

#if (FA_BWD_ENTRY == 3 || FA_BWD_ENTRY == 0) && !BWD_TENSOR_CORES
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
bwd_dkdv(const __grid_constant__ BwdParams p) {
    const elem_t* __restrict__ q = static_cast<const elem_t*>(p.q);
    const elem_t* __restrict__ k = static_cast<const elem_t*>(p.k);
    const elem_t* __restrict__ v = static_cast<const elem_t*>(p.v);
    const elem_t* __restrict__ dout = static_cast<const elem_t*>(p.dout);
    float* __restrict__ lse2 = p.lse2;
    float* __restrict__ dsum = p.dsum;
    elem_t* __restrict__ dk = static_cast<elem_t*>(p.dk);
    elem_t* __restrict__ dv = static_cast<elem_t*>(p.dv);
    const i64* __restrict__ seqs = p.seqs;
    const float* __restrict__ alibi_slopes = p.alibi_slopes;
    FA_DYNAMIC_SMEM(float, smem_f);
    float* k_t = smem_f;                        // [BLOCK_K][PITCH]
    float* v_t = k_t + BLOCK_K * PITCH;         // [BLOCK_K][PITCH]
    float* q_t = v_t + BLOCK_K * PITCH;         // [STEP_Q][PITCH]
    float* do_t = q_t + STEP_Q * PITCH;         // [STEP_Q][PITCH]
    float* p_t = do_t + STEP_Q * PITCH;         // [STEP_Q][BLOCK_K + 1]
    float* dx_t = p_t + STEP_Q * (BLOCK_K + 1); // [STEP_Q][BLOCK_K + 1]
    float* lse2_r = dx_t + STEP_Q * (BLOCK_K + 1);
    float* dsum_r = lse2_r + STEP_Q;

    const int b = blockIdx.z, hk = blockIdx.y;
    const BwdSeq seq(seqs + BWD_FIELDS * b);
    const int n0 = blockIdx.x * BLOCK_K;
    if (n0 >= seq.seqlen_k) return;
    const int n_end = min(n0 + BLOCK_K, seq.seqlen_k);
    const int group = p.heads / p.heads_kv;
    const Mask mask{seq.seqlen_k, seq.seqlen_k - seq.seqlen_q, p.window_left, p.window_right};
    const Dropout drop{p.drop};

    stage(k_t, BLOCK_K, k + seq.k_base + hk * p.k_head_stride, p.k_row_stride, n0, seq.seqlen_k, p.head_dim);
    stage(v_t, BLOCK_K, v + seq.v_base + hk * p.v_head_stride, p.v_row_stride, n0, seq.seqlen_k, p.head_dim);

    const int jc = threadIdx.x / 8, c8 = threadIdx.x % 8;  // this thread's key and column phase
    float acc_k[HEAD_DIM / 8], acc_v[HEAD_DIM / 8];
#pragma unroll
    for (int c = 0; c < HEAD_DIM / 8; ++c) acc_k[c] = acc_v[c] = 0.f;

    // The query rows that may see keys n0..n_end: lo and hi are non-decreasing in the row, so
    // they form one range; a step outside it is skipped whole.
    for (int h = hk * group; h < (hk + 1) * group; ++h) {
        const BwdMod mod = bwd_mod(p.softmax_scale, p.softcap,
                                   HAS_ALIBI ? alibi_slopes[b * p.heads + h] : 0.f, mask.offset);
        const elem_t* q_g = q + seq.q_base + h * p.q_head_stride;
        const elem_t* do_g = dout + seq.dout_base + h * p.dout_head_stride;
        for (int m0 = 0; m0 < seq.seqlen_q; m0 += STEP_Q) {
            const int m_end = min(m0 + STEP_Q, seq.seqlen_q);
            if (mask.hi(m_end - 1) <= n0 || mask.lo(m0) >= n_end) continue;
            __syncthreads();  // the previous step's tiles are no longer read
            stage(q_t, STEP_Q, q_g, p.q_row_stride, m0, seq.seqlen_q, p.head_dim);
            stage(do_t, STEP_Q, do_g, p.dout_row_stride, m0, seq.seqlen_q, p.head_dim);
            for (int r = threadIdx.x; r < STEP_Q; r += NUM_THREADS) {
                const i64 w = seq.lse_base + h * p.lse_head_stride + min(m0 + r, m_end - 1);
                lse2_r[r] = lse2[w];
                dsum_r[r] = dsum[w];
            }
            __syncthreads();
            const bool need_mask =
                n0 + BLOCK_K > seq.seqlen_k ||
                (IS_MASKED && !(mask.lo(m_end - 1) <= n0 && mask.hi(m0) >= n0 + BLOCK_K));
            tile_pair<STEP_Q, BLOCK_K>(q_t, do_t, k_t, v_t, p_t, dx_t, lse2_r, dsum_r, m0, n0,
                                       seq.seqlen_q, mask, mod, need_mask, drop, h, b);
            __syncthreads();
#pragma unroll
            for (int c = 0; c < HEAD_DIM / 8; ++c) {
                const int col = c8 + 8 * c;
                float ak = acc_k[c], av = acc_v[c];
#pragma unroll 8
                for (int r = 0; r < STEP_Q; ++r) {
                    av = fmaf(p_t[r * (BLOCK_K + 1) + jc], do_t[r * PITCH + col], av);
                    ak = fmaf(dx_t[r * (BLOCK_K + 1) + jc], q_t[r * PITCH + col], ak);
                }
                acc_k[c] = ak;
                acc_v[c] = av;
            }
        }
    }

    const int j = n0 + jc;
    if (j < seq.seqlen_k) {
        const i64 row = ((seq.k_row0 + j) * p.heads_kv + hk) * (i64)p.head_dim;
#pragma unroll
        for (int c = 0; c < HEAD_DIM / 8; ++c) {
            const int col = c8 + 8 * c;
            if (col < p.head_dim) {
                dk[row + col] = from_f32_elem(acc_k[c]);
                dv[row + col] = from_f32_elem(acc_v[c]);
            }
        }
    }
}
#endif  // FA_BWD_ENTRY == 3

#if BWD_TENSOR_CORES && FA_BWD_ENTRY != 1
// ---- f16/bf16 on tensor cores -----------------------------------------------------------------
#define TC_DQ_M 64   // bwd_dq: query rows per CTA (16 per warp)
#define TC_DQ_N 64   // bwd_dq: keys per step
#define TC_KV_N 64   // bwd_dkdv: keys per CTA (16 per warp)
#define TC_KV_M 32   // bwd_dkdv: query rows per step
static_assert(HEAD_DIM <= 128, "the tensor-core backward keeps two HEAD_DIM accumulators per warp");
// The elementwise steps, the row bookkeeping and the stores are bwd_common.cuh's, shared with
// bwd_sm90.cu.
#endif  // BWD_TENSOR_CORES && FA_BWD_ENTRY != 1

#if BWD_TENSOR_CORES && (FA_BWD_ENTRY == 2 || FA_BWD_ENTRY == 0)
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
bwd_dq(const __grid_constant__ BwdParams p) {
    const elem_t* __restrict__ q = static_cast<const elem_t*>(p.q);
    const elem_t* __restrict__ k = static_cast<const elem_t*>(p.k);
    const elem_t* __restrict__ v = static_cast<const elem_t*>(p.v);
    const elem_t* __restrict__ dout = static_cast<const elem_t*>(p.dout);
    float* __restrict__ lse2 = p.lse2;
    float* __restrict__ dsum = p.dsum;
    elem_t* __restrict__ dq = static_cast<elem_t*>(p.dq);
    const i64* __restrict__ seqs = p.seqs;
    const float* __restrict__ alibi_slopes = p.alibi_slopes;
    FA_DYNAMIC_SMEM(u16, smem);
    u16* q_tile = smem;                             // [TC_DQ_M][SMEM_ROW]
    u16* do_tile = q_tile + TC_DQ_M * SMEM_ROW;     // [TC_DQ_M]
    u16* k_tiles = do_tile + TC_DQ_M * SMEM_ROW;    // 2 x [TC_DQ_N]
    u16* v_tiles = k_tiles + 2 * TC_DQ_N * SMEM_ROW; // 2 x [TC_DQ_N]

    const int b = blockIdx.z, h = blockIdx.y;
    const BwdSeq seq(seqs + BWD_FIELDS * b);
    const int m0 = blockIdx.x * TC_DQ_M;
    if (m0 >= seq.seqlen_q) return;
    const int m_end = min(m0 + TC_DQ_M, seq.seqlen_q);
    const int hk = h / (p.heads / p.heads_kv);
    const Mask mask{seq.seqlen_k, seq.seqlen_k - seq.seqlen_q, p.window_left, p.window_right};
    const Dropout drop{p.drop};
    const BwdMod mod = bwd_mod(p.softmax_scale, p.softcap,
                               HAS_ALIBI ? alibi_slopes[b * p.heads + h] : 0.f, mask.offset);
    const u16* q_g = q + seq.q_base + h * p.q_head_stride;
    const u16* do_g = dout + seq.dout_base + h * p.dout_head_stride;
    const u16* k_g = k + seq.k_base + hk * p.k_head_stride;
    const u16* v_g = v + seq.v_base + hk * p.v_head_stride;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;

    int nb_min, nb_max;
    bwd_key_blocks<TC_DQ_N>(mask, m0, m_end, nb_min, nb_max);
    load_tile<TC_DQ_M>(q_tile, q_g, p.q_row_stride, m0, seq.seqlen_q, p.head_dim);
    load_tile<TC_DQ_M>(do_tile, do_g, p.dout_row_stride, m0, seq.seqlen_q, p.head_dim);
    cp_async_commit();
    if (nb_min < nb_max) {
        load_tile<TC_DQ_N, true>(k_tiles, k_g, p.k_row_stride, nb_min * TC_DQ_N, seq.seqlen_k, p.head_dim);
        load_tile<TC_DQ_N, true>(v_tiles, v_g, p.v_row_stride, nb_min * TC_DQ_N, seq.seqlen_k, p.head_dim);
    }
    cp_async_commit();

    // This thread's rows warp * 16 + g and + 8: the mask, the LSE and dsum of each.
    const BwdRows rows(m0 + warp * 16 + g, m_end, mask, lse2, dsum,
                       seq.lse_base + h * p.lse_head_stride);
    float acc[HEAD_DIM / 8][4];
    acc_zero(acc);

    for (int nb = nb_min; nb < nb_max; ++nb) {
        const int buf = (nb - nb_min) & 1;
        const u16* k_tile = k_tiles + buf * TC_DQ_N * SMEM_ROW;
        const u16* v_tile = v_tiles + buf * TC_DQ_N * SMEM_ROW;
        if (nb + 1 < nb_max) {
            // The other buffers were released by the __syncthreads ending the previous step.
            load_tile<TC_DQ_N, true>(k_tiles + (buf ^ 1) * TC_DQ_N * SMEM_ROW, k_g, p.k_row_stride,
                               (nb + 1) * TC_DQ_N, seq.seqlen_k, p.head_dim);
            load_tile<TC_DQ_N, true>(v_tiles + (buf ^ 1) * TC_DQ_N * SMEM_ROW, v_g, p.v_row_stride,
                               (nb + 1) * TC_DQ_N, seq.seqlen_k, p.head_dim);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();

        float s[TC_DQ_N / 8][4], dp[TC_DQ_N / 8][4];
        mma_abt<TC_DQ_N>(s, q_tile, k_tile, warp, lane);
        mma_abt<TC_DQ_N>(dp, do_tile, v_tile, warp, lane);
        const int n0 = nb * TC_DQ_N;
        const bool need_mask = dq_need_mask<TC_DQ_N>(mask, seq, m0, m_end, n0);
        dq_scores<TC_DQ_N>(s, dp, mod, drop, rows, seq.seqlen_k, need_mask, n0, t, h, b);
        mma_xb<TC_DQ_N>(acc, s, k_tile, lane);
        __syncthreads();
    }
    cp_async_wait<0>();  // a CTA that saw no key block still has its tiles in flight
    store_dq(acc, rows, seq, dq, p, h, t);
}
#endif  // BWD_TENSOR_CORES && FA_BWD_ENTRY == 2

#if BWD_TENSOR_CORES && (FA_BWD_ENTRY == 3 || FA_BWD_ENTRY == 0)
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
bwd_dkdv(const __grid_constant__ BwdParams p) {
    const elem_t* __restrict__ q = static_cast<const elem_t*>(p.q);
    const elem_t* __restrict__ k = static_cast<const elem_t*>(p.k);
    const elem_t* __restrict__ v = static_cast<const elem_t*>(p.v);
    const elem_t* __restrict__ dout = static_cast<const elem_t*>(p.dout);
    float* __restrict__ lse2 = p.lse2;
    float* __restrict__ dsum = p.dsum;
    elem_t* __restrict__ dk = static_cast<elem_t*>(p.dk);
    elem_t* __restrict__ dv = static_cast<elem_t*>(p.dv);
    const i64* __restrict__ seqs = p.seqs;
    const float* __restrict__ alibi_slopes = p.alibi_slopes;
    FA_DYNAMIC_SMEM(u16, smem);
    u16* k_tile = smem;                               // [TC_KV_N][SMEM_ROW]
    u16* v_tile = k_tile + TC_KV_N * SMEM_ROW;        // [TC_KV_N]
    u16* q_tiles = v_tile + TC_KV_N * SMEM_ROW;       // 2 x [TC_KV_M]
    u16* do_tiles = q_tiles + 2 * TC_KV_M * SMEM_ROW; // 2 x [TC_KV_M]
    // lse2 and dsum of the step's rows, 2 x [2][TC_KV_M] f32, copied with the q and dO tiles
    // (read from global memory in the step, they were loaded early and held in registers through
    // the products).
    float* stats = reinterpret_cast<float*>(do_tiles + 2 * TC_KV_M * SMEM_ROW);

    const int b = blockIdx.z, hk = blockIdx.y;
    const BwdSeq seq(seqs + BWD_FIELDS * b);
    const int n0 = blockIdx.x * TC_KV_N;
    if (n0 >= seq.seqlen_k) return;
    const int n_end = min(n0 + TC_KV_N, seq.seqlen_k);
    const int group = p.heads / p.heads_kv;
    const Mask mask{seq.seqlen_k, seq.seqlen_k - seq.seqlen_q, p.window_left, p.window_right};
    const Dropout drop{p.drop};
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;

    // The query blocks that may see keys n0..n_end.
    const BwdQueryBlocks qb = bwd_query_blocks<TC_KV_M>(mask, p, seq.seqlen_q, n0, n_end);
    const int mb_min = qb.mb_min, mb_count = qb.mb_count;
    const int steps = group * mb_count;  // (head, query block) pairs, head-major

    load_tile<TC_KV_N>(k_tile, k + seq.k_base + hk * p.k_head_stride, p.k_row_stride, n0, seq.seqlen_k,
                       p.head_dim);
    load_tile<TC_KV_N>(v_tile, v + seq.v_base + hk * p.v_head_stride, p.v_row_stride, n0, seq.seqlen_k,
                       p.head_dim);
    cp_async_commit();
    auto load_step = [&](int step, int buf) {
        const int h = hk * group + step / mb_count, m0 = (mb_min + step % mb_count) * TC_KV_M;
        load_tile<TC_KV_M>(q_tiles + buf * TC_KV_M * SMEM_ROW, q + seq.q_base + h * p.q_head_stride,
                           p.q_row_stride, m0, seq.seqlen_q, p.head_dim);
        load_tile<TC_KV_M>(do_tiles + buf * TC_KV_M * SMEM_ROW,
                           dout + seq.dout_base + h * p.dout_head_stride, p.dout_row_stride, m0,
                           seq.seqlen_q, p.head_dim);
        load_stats<TC_KV_M>(stats + 2 * buf * TC_KV_M, lse2, dsum,
                            seq.lse_base + h * p.lse_head_stride, m0, seq.seqlen_q);
    };
    if (steps > 0) load_step(0, 0);
    cp_async_commit();

    int key_j[2];
    key_j[0] = n0 + warp * 16 + g;
    key_j[1] = key_j[0] + 8;
    float acc_k[HEAD_DIM / 8][4], acc_v[HEAD_DIM / 8][4];
    acc_zero(acc_k);
    acc_zero(acc_v);

    for (int step = 0; step < steps; ++step) {
        const int buf = step & 1;
        const u16* q_tile = q_tiles + buf * TC_KV_M * SMEM_ROW;
        const u16* do_tile = do_tiles + buf * TC_KV_M * SMEM_ROW;
        if (step + 1 < steps) {
            load_step(step + 1, buf ^ 1);  // released by the __syncthreads ending the last step
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();

        const int h = hk * group + step / mb_count, m0 = (mb_min + step % mb_count) * TC_KV_M;
        const int m_end = min(m0 + TC_KV_M, seq.seqlen_q);
        const BwdMod mod = bwd_mod(p.softmax_scale, p.softcap,
                                   HAS_ALIBI ? alibi_slopes[b * p.heads + h] : 0.f, mask.offset);
        // Transposed: rows are this warp's keys, columns the step's query rows.
        float st[TC_KV_M / 8][4], dpt[TC_KV_M / 8][4];
        mma_abt<TC_KV_M>(st, k_tile, q_tile, warp, lane);
        mma_abt<TC_KV_M>(dpt, v_tile, do_tile, warp, lane);
        const bool need_mask = dkdv_need_mask<TC_KV_M, TC_KV_N>(mask, seq, m0, m_end, n0);
        dkdv_scores<TC_KV_M>(st, dpt, mod, mask, drop, seq, need_mask, stats + 2 * buf * TC_KV_M,
                             m0, key_j, g, t, h, b);
        // P̃ᵀ and dSᵀ rounded to the input type at once (half the registers through the products).
        u32 pa[TC_KV_M / 16][4], da[TC_KV_M / 16][4];
        pack_a<TC_KV_M>(pa, st);
        pack_a<TC_KV_M>(da, dpt);
        mma_pb<TC_KV_M>(acc_v, pa, do_tile, lane);
        mma_pb<TC_KV_M>(acc_k, da, q_tile, lane);
        __syncthreads();
    }
    cp_async_wait<0>();
    store_dkdv(acc_k, acc_v, key_j, seq, dk, dv, p, hk, t);
}
#endif  // BWD_TENSOR_CORES && FA_BWD_ENTRY == 3
