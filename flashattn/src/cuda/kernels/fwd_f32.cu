// The f32 forward: a plain CUDA-core kernel (no tensor cores, whose tf32 would not be f32-exact),
// with the same tiling, online softmax and semantics as fwd.cu and the CPU path.
//
// One CTA of 128 threads computes BLOCK_M = 16 query rows of one (sequence, head); 8 threads share
// a row. Per key block of BLOCK_N = 32 keys (staged in shared memory, pitch HEAD_DIM + 1 so that
// the 8 keys a warp reads at once fall in distinct banks): each thread computes 4 scores of its
// row, the row's max and sum are reduced over its 8 threads by shuffles, P goes through shared
// memory, and each thread accumulates HEAD_DIM / 8 output columns of its row.
//
// Defines: HEAD_DIM (padded head_dim, multiple of 32), IS_MASKED, HAS_SOFTCAP, HAS_ALIBI,
// HAS_DROPOUT.
#include "common.cuh"

#define BLOCK_M 16
#define BLOCK_N 32
#define NUM_THREADS 128
#define PITCH (HEAD_DIM + 1)
#define P_PITCH (BLOCK_N + 1)  // the 4 rows of a warp read P in distinct banks

static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM <= 256, "HEAD_DIM: a multiple of 32, at most 256");
static_assert(NUM_THREADS == 8 * BLOCK_M && BLOCK_N == 32, "8 threads per row, 4 keys each");

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
flash_fwd(const __grid_constant__ FwdParams p) {
    FA_DYNAMIC_SMEM(float, smem_f);
    float* q_tile = smem_f;                      // [BLOCK_M][PITCH]
    float* k_tile = q_tile + BLOCK_M * PITCH;    // [BLOCK_N][PITCH]
    float* v_tile = k_tile + BLOCK_N * PITCH;    // [BLOCK_N][HEAD_DIM]
    float* p_tile = v_tile + BLOCK_N * HEAD_DIM; // [BLOCK_M][P_PITCH]

    CtaWork<float> w;
    if (!cta_work<float, BLOCK_M, BLOCK_N>(w, p)) return;
    const int h = w.h, m0 = w.m0, m_end = w.m_end, seqlen_q = w.seqlen_q, seqlen_k = w.seqlen_k;
    const float* q_g = w.q_g;
    const float* k_g = w.k_g;
    const float* v_g = w.v_g;
    const i64 out_row0 = w.out_row0, lse_base = w.lse_base;
    const Mask& mask = w.mask;
    const ScoreMod& mods = w.mods;
    const int n_block_min = w.n_block_min, n_block_max = w.n_block_max;

    const int r = threadIdx.x / 8, c8 = threadIdx.x % 8;  // this thread's row and column phase
    const int i = m0 + r;
    const int row_lo = mask.lo(i), row_hi = mask.hi(i);

    for (int e = threadIdx.x; e < BLOCK_M * HEAD_DIM; e += NUM_THREADS) {
        int rr = e / HEAD_DIM, col = e % HEAD_DIM;
        q_tile[rr * PITCH + col] =
            (m0 + rr < seqlen_q && col < p.head_dim) ? q_g[(i64)(m0 + rr) * p.q_row_stride + col] : 0.f;
    }

    float acc_o[HEAD_DIM / 8];
#pragma unroll
    for (int c = 0; c < HEAD_DIM / 8; ++c) acc_o[c] = 0.f;
    float row_max = -FA_INF, row_sum = 0.f;

    for (int n_block = n_block_min; n_block < n_block_max; ++n_block) {
        const int n0 = n_block * BLOCK_N;
        for (int e = threadIdx.x; e < BLOCK_N * HEAD_DIM; e += NUM_THREADS) {
            int rr = e / HEAD_DIM, col = e % HEAD_DIM;
            bool ok = n0 + rr < seqlen_k && col < p.head_dim;
            k_tile[rr * PITCH + col] = ok ? k_g[(i64)(n0 + rr) * p.k_row_stride + col] : 0.f;
            v_tile[rr * HEAD_DIM + col] = ok ? v_g[(i64)(n0 + rr) * p.v_row_stride + col] : 0.f;
        }
        __syncthreads();

        const bool need_mask = w.needs_mask(n0, BLOCK_N);
        float s[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int jc = c8 + 8 * u;
            // Eight partial sums added pairwise, as the CPU path and naive attention sum: one
            // running f32 sum over d = 256 moved the scores by ~1e-6 and out past 2x naive's
            // error.
            // (The backward's recomputation in bwd.cu sums the same way, so that its P matches
            // this LSE.)
            float part[8];
#pragma unroll
            for (int l = 0; l < 8; ++l) part[l] = 0.f;
#pragma unroll 1
            for (int d0 = 0; d0 < HEAD_DIM; d0 += 8) {
#pragma unroll
                for (int l = 0; l < 8; ++l)
                    part[l] = fmaf(q_tile[r * PITCH + d0 + l], k_tile[jc * PITCH + d0 + l], part[l]);
            }
            const float dot = ((part[0] + part[4]) + (part[1] + part[5])) +
                              ((part[2] + part[6]) + (part[3] + part[7]));
            const int j = n0 + jc;
            float x = mods.apply(dot, i, j);
            if (need_mask && (j < row_lo || j >= row_hi)) x = -FA_INF;
            s[u] = x;
        }
        // Row statistics over the row's 8 threads (lanes 8r'..8r'+7 of one warp).
        float mx = fmaxf(fmaxf(s[0], s[1]), fmaxf(s[2], s[3]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
        mx = fmaxf(mx, row_max);
        const float m_use = mx == -FA_INF ? 0.f : mx;
        const float alpha = fa_exp2(row_max - m_use);
        row_max = mx;
        float sum = 0.f;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            s[u] = fa_exp2(s[u] - m_use);
            sum += s[u];
            p_tile[r * P_PITCH + c8 + 8 * u] = s[u];
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        sum += __shfl_xor_sync(0xffffffffu, sum, 4);
        row_sum = row_sum * alpha + sum;
        __syncwarp();  // the row's P was written by lanes of this warp only
#if HAS_DROPOUT
        {
            // Dropout zeroes probabilities for P·V only (row_sum keeps them); 1/(1-p) is applied
            // once, at the end. Lane c8 of the row takes Philox group c8: keys 4·c8 .. 4·c8 + 3.
            u32 wd[4];
            w.drop.words(wd, (n0 >> 2) + c8, i, h, w.b);
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (!w.drop.kept(wd[e])) p_tile[r * P_PITCH + 4 * c8 + e] = 0.f;
        }
        __syncwarp();
#endif
#pragma unroll
        for (int c = 0; c < HEAD_DIM / 8; ++c) {
            float acc = acc_o[c] * alpha;
            const int col = c8 + 8 * c;
#pragma unroll 8
            for (int jc = 0; jc < BLOCK_N; ++jc) acc = fmaf(p_tile[r * P_PITCH + jc], v_tile[jc * HEAD_DIM + col], acc);
            acc_o[c] = acc;
        }
        __syncthreads();
    }

    if (i < seqlen_q) {
        float inv = row_sum == 0.f ? 0.f : w.out_scale / row_sum;
        float row_lse = row_sum == 0.f ? -FA_INF : (row_max + log2f(row_sum)) * FA_LN2;
        if (w.sink != -FA_INF) {
            float factor;
            row_lse = fold_sink(row_lse, w.sink, &factor);
            inv *= factor;
        }
        float* o = static_cast<float*>(p.out) + ((out_row0 + i) * p.heads + h) * (i64)p.head_dim;
#pragma unroll
        for (int c = 0; c < HEAD_DIM / 8; ++c) {
            const int col = c8 + 8 * c;
            if (col < p.head_dim) o[col] = acc_o[c] * inv;
        }
        if (c8 == 0) p.lse[lse_base + (i64)h * p.lse_head_stride + i] = row_lse;
    }
}
