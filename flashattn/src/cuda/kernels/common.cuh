// What the attention kernels share, by concern: types.cuh (scalar types, constants, the host
// emulation), params.cuh (the host-kernel contract), convert.cuh (element conversions), mask.cuh
// (visibility and score modifiers), dropout.cuh (Philox), softmax.cuh (ex2, sinks, the online
// softmax), tiles.cuh (swizzled tiles and copies) and mma.cuh (tensor-core products); here, where a
// sequence's rows live and what one forward CTA works on.
//
// Vocabulary as in the Rust code: block_m/block_n, m_block/n_block, row_max, row_sum, acc_o, lse,
// scale_log2. Scores are moved to the log2 domain (times log2(e)) so every exponential is ex2.
#pragma once
#include "types.cuh"
#include "params.cuh"
#include "convert.cuh"
#include "mask.cuh"
#include "dropout.cuh"
#include "softmax.cuh"
#include "tiles.cuh"
#include "mma.cuh"

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

// What one CTA works on: its (sequence, head, query block), where that head's rows live, the
// mask, the score modifiers and the key blocks it visits (blocks.rs: n_block_range).
template <typename T>
struct CtaWork {
    int b, h, m0, m_end, seqlen_q, seqlen_k;
    const T *q_g, *k_g, *v_g;  // row 0 of this head (kv head for k and v)
    i64 out_row0, lse_base;
    Mask mask;
    ScoreMod mods;
    Dropout drop;
    float out_scale;  // multiplies the finished rows: dropout's 1 / (1 - p) times v_descale
    float sink;  // this (sequence, head)'s learnable sink logit, -inf for none
    int n_block_min, n_block_max;

    // Whether key block [n0, n0 + bn) needs the per-element mask: the end of the keys cuts it, or
    // (causal, window) some row of m0..m_end does not see all of it.
    __device__ __forceinline__ bool needs_mask(int n0, int bn) const {
        return n0 + bn > seqlen_k ||
               (IS_MASKED && !(mask.lo(m_end - 1) <= n0 && mask.hi(m0) >= n0 + bn));
    }
};

// Fills `w` for query block m_block of head h of launched sequence b; false when the block lies
// past the sequence (nothing to do).
template <typename T, int BM, int BN>
__device__ __forceinline__ bool cta_work_at(CtaWork<T>& w, const FwdParams& p, int m_block, int h,
                                            int b) {
    w.b = b;
    w.h = h;
    w.drop = Dropout{p.drop};
    // The pointers as restrict-qualified locals, as they were when they were kernel parameters:
    // through the struct's fields alone ptxas allocated worse (d = 128 variants spilled on sm_80).
    const i64* __restrict__ seqs = p.seqs;
    const float* __restrict__ descale = p.descale;
    const float* __restrict__ sink = p.sink;
    const float* __restrict__ alibi_slopes = p.alibi_slopes;
    const SeqInfo seq(seqs, b, p.heads, p.batch_seqlen_q, p.batch_seqlen_k, p.q_batch_stride,
                      p.k_batch_stride, p.v_batch_stride);
    w.seqlen_q = seq.seqlen_q;
    w.seqlen_k = seq.seqlen_k;
    w.m0 = m_block * BM;
    if (w.m0 >= w.seqlen_q) return false;
    w.m_end = min(w.m0 + BM, w.seqlen_q);
    const int hk = w.h / (p.heads / p.heads_kv);
    const T* __restrict__ q = static_cast<const T*>(p.q);
    const T* __restrict__ k = static_cast<const T*>(p.k);
    const T* __restrict__ v = static_cast<const T*>(p.v);
    w.q_g = q + seq.q_base + (i64)w.h * p.q_head_stride;
    w.k_g = k + seq.k_base + (i64)hk * p.k_head_stride;
    w.v_g = v + seq.v_base + (i64)hk * p.v_head_stride;
    w.out_row0 = seq.out_row0;
    w.lse_base = seq.lse_base;
    w.mask = Mask{w.seqlen_k, w.seqlen_k - w.seqlen_q, p.window_left, p.window_right};
    // FP8 inputs: the folded score scale of this (sequence, kv head) replaces softmax_scale.
    const float* ds = descale != nullptr ? descale + 2 * ((i64)b * p.heads_kv + hk) : nullptr;
    const float scale = ds != nullptr ? ds[0] : p.softmax_scale;
    w.out_scale = (HAS_DROPOUT ? w.drop.scale : 1.f) * (ds != nullptr ? ds[1] : 1.f);
    w.sink = sink != nullptr ? sink[(i64)b * p.heads + w.h] : -FA_INF;
    w.mods.scale_log2 = scale * FA_LOG2E;
    w.mods.cap_in = scale / p.softcap;
    w.mods.cap_out = p.softcap * FA_LOG2E;
    w.mods.alibi_log2 = HAS_ALIBI ? alibi_slopes[b * p.heads + w.h] * FA_LOG2E : 0.f;
    w.mods.offset = w.mask.offset;
    w.n_block_min = w.n_block_max = 0;
    const int lo = w.mask.lo(w.m0), hi = w.mask.hi(w.m_end - 1);
    if (hi > lo) {
        w.n_block_min = lo / BN;
        w.n_block_max = (hi + BN - 1) / BN;
    }
    return true;
}

// Fills `w` for this CTA (query block, head, sequence from the grid); false when its query block
// lies past the sequence (nothing to do).
template <typename T, int BM, int BN>
__device__ __forceinline__ bool cta_work(CtaWork<T>& w, const FwdParams& p) {
    // Masked (causal) query blocks get more keys the later they come: launch those first, so the
    // longest CTAs do not start last and leave SMs idle at the end (as FlashAttention-2 does).
    const int m_block = IS_MASKED ? (int)gridDim.x - 1 - (int)blockIdx.x : (int)blockIdx.x;
    return cta_work_at<T, BM, BN>(w, p, m_block, (int)blockIdx.y, (int)blockIdx.z);
}

