// What the backward kernels (bwd.cu, bwd_sm90.cu) share: the per-sequence table row and the
// score modifiers with their derivative. Included after common.cuh.
#pragma once

#define BWD_FIELDS 11  // i64 per launched sequence (cuda/backward.rs writes them)

// One launched sequence of the table: seqlen_q, seqlen_k, element offsets of row 0, head 0 in q,
// k, v, out and dout, out_row0, lse_base, lse_view_base and k_row0 (bwd.cu's header says what each is).
struct BwdSeq {
    int seqlen_q, seqlen_k;
    i64 q_base, k_base, v_base, out_base, dout_base, out_row0, lse_base, lse_view_base, k_row0;
    __device__ __forceinline__ explicit BwdSeq(const i64* s) {
        seqlen_q = (int)s[0];
        seqlen_k = (int)s[1];
        q_base = s[2];
        k_base = s[3];
        v_base = s[4];
        out_base = s[5];
        dout_base = s[6];
        out_row0 = s[7];
        lse_base = s[8];
        lse_view_base = s[9];
        k_row0 = s[10];
    }
};

// Scale, softcap and ALiBi of a raw dot product x (row i, key j): the score in the log2 domain,
// and `deriv` = d(score, natural units) / dx.
struct BwdMod {
    float scale, scale_log2, cap_in, cap_out, alibi_log2;
    int offset;
    __device__ __forceinline__ float apply(float x, int i, int j, float& deriv) const {
#if HAS_SOFTCAP
        const float t = tanhf(x * cap_in);
        float s = cap_out * t;
        deriv = scale * (1.f - t * t);
#else
        float s = x * scale_log2;
        deriv = scale;
#endif
#if HAS_ALIBI
        s -= alibi_log2 * (float)abs(i + offset - j);
#endif
        return s;
    }
};

__device__ __forceinline__ BwdMod bwd_mod(float softmax_scale, float softcap, float slope, int offset) {
    BwdMod m;
    m.scale = softmax_scale;
    m.scale_log2 = softmax_scale * FA_LOG2E;
    m.cap_in = softmax_scale / softcap;
    m.cap_out = softcap * FA_LOG2E;
    m.alibi_log2 = slope * FA_LOG2E;
    m.offset = offset;
    return m;
}
