// The visibility rule (Mask) and the score modifiers (ScoreMod: scale, softcap, ALiBi).
#pragma once
#include "types.cuh"

// The visibility rule of blocks.rs: query row i sees key j iff lo(i) <= j < hi(i), with
// offset = seqlen_k - seqlen_q (bottom-right alignment) and -1 meaning an unbounded side.
// 32-bit arithmetic is exact: the launcher caps sequence lengths at 2^29 and clamps window sides to
// seqlen_q + seqlen_k (a wider side sees the same keys), so no sum here exceeds 2^31.
struct Mask {
    int seqlen_k, offset;
    int left, right;
    __device__ __forceinline__ int lo(int i) const {
        if (left < 0) return 0;
        return min(max(i + offset - left, 0), seqlen_k);
    }
    __device__ __forceinline__ int hi(int i) const {
        if (right < 0) return seqlen_k;
        return min(max(i + offset + right + 1, 0), seqlen_k);
    }
};

// Scale, softcap and ALiBi of one raw dot product `x` (row i, key j), in the log2 domain. The
// same order as the CPU path: scale, then softcap, then the ALiBi bias.
struct ScoreMod {
    float scale_log2;        // softmax_scale * log2(e) (no softcap)
    float cap_in, cap_out;   // softmax_scale / softcap, softcap * log2(e)
    float alibi_log2;        // slope * log2(e)
    int offset;
    __device__ __forceinline__ float apply(float x, int i, int j) const {
#if HAS_SOFTCAP
        float s = cap_out * tanhf(x * cap_in);
#else
        float s = x * scale_log2;
#endif
#if HAS_ALIBI
        s -= alibi_log2 * (float)abs(i + offset - j);
#endif
        return s;
    }
};
