// The softmax pieces: ex2, the learnable sink's fold into a finished row, and (tensor-core
// kernels) the online-softmax step over an mma accumulator tile.
#pragma once
#include "types.cuh"

#ifndef FA_HOST_EMULATION
__device__ __forceinline__ float fa_exp2(float x) {
    // ex2.approx: relative error ~2^-22; exactly +0 for -inf (a masked score).
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
#endif

// A learnable sink (a logit with no value) joins a finished row's normaliser, as
// cpu::softmax::fold_sink does: given the row's lse over its keys, returns lse' = log(exp(lse) +
// exp(sink)) and sets `factor` = exp(lse - lse'), by which the row (normalised by its keys alone)
// is multiplied. In f64, once per row. A row that saw no key (lse -inf) gets factor 0, lse' = sink.
// The sink is finite (the library validates it).
__device__ __forceinline__ float fold_sink(float lse, float sink, float* factor) {
    const double l = lse, s = sink, m = fmax(l, s);
    const double total = m + log(exp(l - m) + exp(s - m));
    *factor = (float)exp(l - total);
    return (float)total;
}

// `fold_sink` in f32 and in the log2 domain, for the tensor-core forward: there the f64 version
// spilled registers in eight d = 128 variants (the two-block layout already holds 255), and its
// output is f16/bf16, whose rounding (2^-11 at best) dwarfs this one's few f32 ulps. `l2` and `s2`
// are lse · log2 e and sink · log2 e; returns lse' · log2 e.
__device__ __forceinline__ float fold_sink_log2(float l2, float s2, float* factor) {
    const float m = fmaxf(l2, s2);
    const float total = m + log2f(fa_exp2(l2 - m) + fa_exp2(s2 - m));
    *factor = fa_exp2(l2 - total);
    return total;
}

#ifdef FA_TENSOR_CORE_KERNEL
// One online-softmax step over this warp's NK keys of a 16-row tile: `s` holds the scores (in
// log2 units) of this thread's rows g and g + 8, as an m16n8 accumulator tile per 8 keys. The row
// maxima move to cover the new keys (across the quad's 4 threads), `s` becomes the probabilities,
// this thread's partial row sums (a quarter of each row; summed across the quad at the end, which
// is exact since the rescaling is linear) and `acc_o` are rescaled by the change of maximum and
// the sums gain the new probabilities. A row that has seen only masked keys keeps max -inf and
// subtracts 0 (not -inf - -inf). Shared by the forward and the tensor-core decode kernel.
template <int NK>
__device__ __forceinline__ void online_softmax_step(float (&s)[NK / 8][4], float (&row_max)[2],
                                                    float (&row_sum)[2],
                                                    float (&acc_o)[HEAD_DIM / 8][4]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = row_max[r];
#pragma unroll
        for (int nt = 0; nt < NK / 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_use = mx == -FA_INF ? 0.f : mx;
        const float alpha = fa_exp2(row_max[r] - m_use);
        row_max[r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NK / 8; ++nt) {
            s[nt][2 * r] = fa_exp2(s[nt][2 * r] - m_use);
            s[nt][2 * r + 1] = fa_exp2(s[nt][2 * r + 1] - m_use);
            sum += s[nt][2 * r] + s[nt][2 * r + 1];
        }
        row_sum[r] = row_sum[r] * alpha + sum;
#pragma unroll
        for (int dt = 0; dt < HEAD_DIM / 8; ++dt) {
            acc_o[dt][2 * r] *= alpha;
            acc_o[dt][2 * r + 1] *= alpha;
        }
    }
}
#endif  // FA_TENSOR_CORE_KERNEL
