// Shared pieces of flashattn's CUDA kernels: element conversions, the online-softmax helpers and
// the masking rule. Compiled by NVRTC with no CUDA headers: half types are carried as raw 16-bit
// words and converted with PTX `cvt`, so nothing depends on cuda_fp16.h / cuda_bf16.h.
//
// Vocabulary as in the Rust code: block_m/block_n, m_block/n_block, row_max, row_sum, acc_o, lse,
// scale_log2. Scores are moved to the log2 domain (times log2(e)) so every exponential is ex2.
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#ifdef FA_HOST_EMULATION
// The CPU twin of the CUDA primitives (tests/cuda_emulated.rs); NVRTC never sees this branch.
#include "host_emulation.h"
#endif

#define FA_INF __int_as_float(0x7f800000)
#define FA_LOG2E 1.4426950408889634f
#define FA_LN2 0.6931471805599453f

// Entries per sequence in the `seqs` table (cuda/mod.rs: SEQ_FIELDS).
#define SEQ_FIELDS 7

// Where sequence b's rows live. Packed (varlen) calls pass a table of SEQ_FIELDS i64 per sequence:
// seqlen_q, seqlen_k, element offsets of q/k/v row 0, head 0, out row of query 0, lse index of
// (head 0, query 0). Batched calls pass no table (nothing to upload per call): every sequence has
// the same lengths and sits a batch stride further on.
struct SeqInfo {
    int seqlen_q, seqlen_k;
    i64 q_base, k_base, v_base, out_row0, lse_base;
    __device__ __forceinline__ SeqInfo(const i64* seqs, int b, int heads, int seqlen_q_, int seqlen_k_,
                                       i64 q_batch_stride, i64 k_batch_stride, i64 v_batch_stride) {
        if (seqs != nullptr) {
            const i64* s = seqs + SEQ_FIELDS * b;
            seqlen_q = (int)s[0];
            seqlen_k = (int)s[1];
            q_base = s[2];
            k_base = s[3];
            v_base = s[4];
            out_row0 = s[5];
            lse_base = s[6];
        } else {
            seqlen_q = seqlen_q_;
            seqlen_k = seqlen_k_;
            q_base = b * q_batch_stride;
            k_base = b * k_batch_stride;
            v_base = b * v_batch_stride;
            out_row0 = (i64)b * seqlen_q_;
            lse_base = (i64)b * heads * seqlen_q_;
        }
    }
};

#ifndef FA_HOST_EMULATION
#define FA_DYNAMIC_SMEM(T, name) extern __shared__ __align__(128) T name[]

__device__ __forceinline__ float fa_exp2(float x) {
    // ex2.approx: relative error ~2^-22; exactly +0 for -inf (a masked score).
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
#endif

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
