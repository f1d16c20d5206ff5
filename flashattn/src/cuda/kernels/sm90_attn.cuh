// What the two sm_90a forward kernels share (fwd_sm90.cu, fwd_sm90_ws.cu): the score
// modifications and mask of one key block, the online softmax split around the P·V in flight,
// and the epilogue. A warpgroup's accumulator tiles are per warp mma.m16n8's: this thread holds
// rows g and g + 8 of its warp's 16 (g = lane / 4) and columns 2t, 2t + 1 of each 8 (t = lane % 4).
// The including file defines BLOCK_N and HEAD_DIM and includes common.cuh and sm90.cuh first.
#pragma once

// Scores of key block n0 .. n0 + BLOCK_N to the log2 domain (scale, softcap, ALiBi), and the
// per-element mask where the block needs it.
template <typename T>
__device__ __forceinline__ void mask_scores(float (&s)[BLOCK_N / 8][4], const CtaWork<T>& w,
                                            const int (&row_i)[2], int n0, int t) {
#pragma unroll
    for (int nt = 0; nt < BLOCK_N / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e)
            s[nt][e] = w.mods.apply(s[nt][e], row_i[e >> 1], n0 + nt * 8 + 2 * t + (e & 1));
    }
    if (w.needs_mask(n0, BLOCK_N)) {
#pragma unroll
        for (int nt = 0; nt < BLOCK_N / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int j = n0 + nt * 8 + 2 * t + (e & 1);
                const int i = row_i[e >> 1];
                if (j < w.mask.lo(i) || j >= w.mask.hi(i)) s[nt][e] = -FA_INF;
            }
        }
    }
}

// The online-softmax step of common.cuh split in two, so acc_o can be rescaled after the P·V
// product in flight retires: row_max, row_sum and the probabilities now, alpha for later.
__device__ __forceinline__ void softmax_rows(float (&s)[BLOCK_N / 8][4], float (&row_max)[2],
                                             float (&row_sum)[2], float (&alpha)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = row_max[r];
#pragma unroll
        for (int nt = 0; nt < BLOCK_N / 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_use = mx == -FA_INF ? 0.f : mx;
        alpha[r] = fa_exp2(row_max[r] - m_use);
        row_max[r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < BLOCK_N / 8; ++nt) {
            s[nt][2 * r] = fa_exp2(s[nt][2 * r] - m_use);
            s[nt][2 * r + 1] = fa_exp2(s[nt][2 * r + 1] - m_use);
            sum += s[nt][2 * r] + s[nt][2 * r + 1];
        }
        row_sum[r] = row_sum[r] * alpha[r] + sum;
    }
}

// acc_o rows g and g + 8 times alpha[0] and alpha[1].
__device__ __forceinline__ void rescale_o(float (&acc_o)[HEAD_DIM / 8][4], const float (&alpha)[2]) {
#pragma unroll
    for (int dt = 0; dt < HEAD_DIM / 8; ++dt) {
        acc_o[dt][0] *= alpha[0];
        acc_o[dt][1] *= alpha[0];
        acc_o[dt][2] *= alpha[1];
        acc_o[dt][3] *= alpha[1];
    }
}

// The epilogue, as fwd.cu's: divides this thread's rows by row_sum once and writes them and
// their lse; fully masked rows (row_sum 0) give 0 and lse -inf (with a sink: 0 and lse = sink).
template <typename T>
__device__ __forceinline__ void store_rows(const float (&acc_o)[HEAD_DIM / 8][4],
                                           const float (&row_max)[2], const float (&row_sum)[2],
                                           const int (&row_i)[2], const CtaWork<T>& w,
                                           const FwdParams& p, int t) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float sum = row_sum[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const int i = row_i[r];
        if (i >= w.seqlen_q) continue;
        float inv = sum == 0.f ? 0.f : w.out_scale / sum;
        float row_lse2 = sum == 0.f ? -FA_INF : row_max[r] + log2f(sum);
        if (w.sink != -FA_INF) {
            float factor;
            row_lse2 = fold_sink_log2(row_lse2, w.sink * FA_LOG2E, &factor);
            inv *= factor;
        }
        u16* o = static_cast<u16*>(p.out) + ((w.out_row0 + i) * p.heads + w.h) * (i64)p.head_dim;
#pragma unroll
        for (int dt = 0; dt < HEAD_DIM / 8; ++dt) {
            const int col = dt * 8 + 2 * t;
            // head_dim is a multiple of 8, so a pair is either wholly inside the row or past it.
            if (col < p.head_dim)
                *reinterpret_cast<u32*>(o + col) =
                    pack2(acc_o[dt][2 * r] * inv, acc_o[dt][2 * r + 1] * inv);
        }
        if (t == 0) p.lse[w.lse_base + (i64)w.h * p.lse_head_stride + i] = row_lse2 * FA_LN2;
    }
}
