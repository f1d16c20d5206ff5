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

#ifdef FA_TENSOR_CORE_KERNEL
// ---- What bwd.cu's tensor-core kernels and bwd_sm90.cu share -----------------------------------
// Both hold a block product's result in the accumulator fragment of mma.sync m16n8 (a wgmma
// m64nN warpgroup is four such warps stacked): this thread owns rows g and g + 8 (r = 0, 1) of
// its warp's 16, and of each 8-wide n-tile nt the columns 2t and 2t + 1 (c = 0, 1), entry
// x[nt][2r + c] (g = lane / 4, t = lane % 4). The tile sizes differ (bwd.cu: TC_DQ_N, TC_KV_M;
// bwd_sm90.cu: DQ_BLOCK_N, KV_BLOCK_M), hence the templates.

// Zeroes an accumulator tile.
template <int N>
__device__ __forceinline__ void acc_zero(float (&x)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) x[i][0] = x[i][1] = x[i][2] = x[i][3] = 0.f;
}

// bwd_dkdv: the blocks of M query rows that may see keys n0 .. n_end - 1 (hi(i) > n0 from i_min
// on, lo(i) < n_end below i_max; lo and hi are non-decreasing in i): mb_min, and mb_count of
// them (0 when none).
struct BwdQueryBlocks {
    int mb_min, mb_count;
};
template <int M>
__device__ __forceinline__ BwdQueryBlocks bwd_query_blocks(const Mask& mask, const BwdParams& p,
                                                           int seqlen_q, int n0, int n_end) {
    const int i_min = p.window_right < 0 ? 0 : max(0, n0 - mask.offset - p.window_right);
    const int i_max =
        p.window_left < 0 ? seqlen_q : min(seqlen_q, n_end - mask.offset + p.window_left);
    BwdQueryBlocks qb;
    qb.mb_min = i_min / M;
    qb.mb_count = i_max > i_min ? (i_max + M - 1) / M - qb.mb_min : 0;
    return qb;
}

// bwd_dkdv: copies lse2 and dsum of query rows m0 .. m0 + M - 1 (head base `w0` = lse_base + h ·
// lse_head_stride) into stats[0 .. M) and stats[M .. 2M), 4 bytes per cp.async, threads 0 .. 2M - 1
// one each. Rows past the sequence read its last row's (their entries are masked).
template <int M>
__device__ __forceinline__ void load_stats(float* stats, const float* lse2, const float* dsum,
                                           i64 w0, int m0, int seqlen_q) {
    if (threadIdx.x < 2 * M) {
        const int which = threadIdx.x / M, r = threadIdx.x % M;
        const int i = min(m0 + r, seqlen_q - 1);
        cp_async4(smem_addr(stats + which * M + r), (which ? dsum : lse2) + w0 + i);
    }
}

// bwd_dkdv: whether the block of M query rows from m0 (m_end: past its last real row) against
// the N keys from n0 has an entry that is past either sequence or outside the mask.
template <int M, int N>
__device__ __forceinline__ bool dkdv_need_mask(const Mask& mask, const BwdSeq& seq, int m0,
                                               int m_end, int n0) {
    return n0 + N > seq.seqlen_k || m0 + M > seq.seqlen_q ||
           (IS_MASKED && !(mask.lo(m_end - 1) <= n0 && mask.hi(m0) >= n0 + N));
}

// bwd_dkdv's elementwise step over the transposed tiles of this thread's keys key_j[r] (rows)
// and the step's M query rows from m0 (columns i = m0 + 8nt + 2t + c): st = Sᵀ and dpt = dPᵀ as
// raw products in, P̃ᵀ (P ∘ Z / (1 - p) under dropout, else Pᵀ) in st and dSᵀ · ds/dx in dpt out.
// `l2s` holds the rows' lse2 at [0, M) and dsum at [M, 2M) (load_stats); an entry masked or past
// either sequence gets P = 0, so 0 in both (need_mask false: none is).
template <int M>
__device__ __forceinline__ void dkdv_scores(float (&st)[M / 8][4], float (&dpt)[M / 8][4],
                                            const BwdMod& mod, const Mask& mask,
                                            const Dropout& drop, const BwdSeq& seq, bool need_mask,
                                            const float* l2s, int m0, const int (&key_j)[2], int g,
                                            int t, int h, int b) {
#pragma unroll
    for (int nt = 0; nt < M / 8; ++nt) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int i = m0 + nt * 8 + 2 * t + c;
            const float l2 = l2s[nt * 8 + 2 * t + c], ds = l2s[M + nt * 8 + 2 * t + c];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int e = 2 * r + c, j = key_j[r];
                float deriv;
                const float x = mod.apply(st[nt][e], i, j, deriv);
                const bool vis = !need_mask || (i < seq.seqlen_q && j < seq.seqlen_k &&
                                                j >= mask.lo(i) && j < mask.hi(i));
                const float pr = vis ? fa_exp2(x - l2) : 0.f;
#if HAS_DROPOUT
                // Key j's word of the Philox group (j / 4, row i); j % 4 = g % 4.
                u32 wd[4];
                drop.words(wd, j >> 2, i, h, b);
                const bool kept = drop.kept(pick_word(wd, g & 3));
                dpt[nt][e] = pr * ((kept ? dpt[nt][e] * drop.scale : 0.f) - ds) * deriv;  // dSᵀ
                st[nt][e] = kept ? pr * drop.scale : 0.f;                                // P̃ᵀ
#else
                dpt[nt][e] = pr * (dpt[nt][e] - ds) * deriv;  // dSᵀ
                st[nt][e] = pr;                               // Pᵀ
#endif
            }
        }
    }
}

// bwd_dq: this thread's two query rows row_i[r] = row0 + 8r, with the mask's key range
// [row_lo, row_hi) and the lse2 and dsum of each (a row past m_end reads row m_end - 1's).
struct BwdRows {
    int row_i[2], row_lo[2], row_hi[2];
    float row_lse2[2], row_dsum[2];
    __device__ __forceinline__ BwdRows(int row0, int m_end, const Mask& mask, const float* lse2,
                                       const float* dsum, i64 w0) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            row_i[r] = row0 + 8 * r;
            row_lo[r] = mask.lo(row_i[r]);
            row_hi[r] = mask.hi(row_i[r]);
            const i64 w = w0 + min(row_i[r], m_end - 1);
            row_lse2[r] = lse2[w];
            row_dsum[r] = dsum[w];
        }
    }
};

// bwd_dq: the key blocks of N keys that query rows m0 .. m_end - 1 see: [nb_min, nb_max).
template <int N>
__device__ __forceinline__ void bwd_key_blocks(const Mask& mask, int m0, int m_end, int& nb_min,
                                               int& nb_max) {
    const int lo = mask.lo(m0), hi = mask.hi(m_end - 1);
    nb_min = lo / N;
    nb_max = hi > lo ? (hi + N - 1) / N : nb_min;
}

// bwd_dq: whether the CTA's query rows m0 .. m_end - 1 against the N keys from n0 have an entry
// past the keys or outside the mask (rows past the sequence are not stored).
template <int N>
__device__ __forceinline__ bool dq_need_mask(const Mask& mask, const BwdSeq& seq, int m0, int m_end,
                                             int n0) {
    return n0 + N > seq.seqlen_k ||
           (IS_MASKED && !(mask.lo(m_end - 1) <= n0 && mask.hi(m0) >= n0 + N));
}

// bwd_dq's elementwise step over this thread's rows (BwdRows) and the N keys from n0 (columns
// j = n0 + 8nt + 2t + c): s = S and dp = dP as raw products in, dS · ds/dx in s out, with
// dP ∘ Z / (1 - p) under dropout. An entry masked or past the keys gets P = 0, so dS = 0.
template <int N>
__device__ __forceinline__ void dq_scores(float (&s)[N / 8][4], const float (&dp)[N / 8][4],
                                          const BwdMod& mod, const Dropout& drop,
                                          const BwdRows& rows, int seqlen_k, bool need_mask,
                                          int n0, int t, int h, int b) {
#pragma unroll
    for (int nt = 0; nt < N / 8; ++nt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#if HAS_DROPOUT
            // Keys 2t, 2t+1 of the 8-key tile: words 2(t & 1), +1 of one Philox group.
            u32 wd[4];
            drop.words(wd, (n0 + nt * 8 + 2 * t) >> 2, rows.row_i[r], h, b);
#endif
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int e = 2 * r + c, j = n0 + nt * 8 + 2 * t + c;
                float deriv;
                const float x = mod.apply(s[nt][e], rows.row_i[r], j, deriv);
                const bool vis =
                    !need_mask || (j < seqlen_k && j >= rows.row_lo[r] && j < rows.row_hi[r]);
                const float pr = vis ? fa_exp2(x - rows.row_lse2[r]) : 0.f;
#if HAS_DROPOUT
                const float dpv =
                    drop.kept(pick_word(wd, 2 * (t & 1) + c)) ? dp[nt][e] * drop.scale : 0.f;
#else
                const float dpv = dp[nt][e];
#endif
                s[nt][e] = pr * (dpv - rows.row_dsum[r]) * deriv;  // dS
            }
        }
    }
}

// Writes this thread's two rows (row_ptr[r], null when past the end) of accumulators rounded to
// the input type (f16 / bf16: u16, bwd.cu's elem_t), the pairs of columns 8·dt + 2t; with
// VEC_LOAD (head_dim a multiple of 8: a pair is wholly inside the row or past it) as one 4-byte
// store.
__device__ __forceinline__ void store_rows(const float (&acc)[HEAD_DIM / 8][4],
                                           u16* const row_ptr[2], int t, int head_dim) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        u16* o = row_ptr[r];
        if (o == nullptr) continue;
#pragma unroll
        for (int dt = 0; dt < HEAD_DIM / 8; ++dt) {
            const int col = dt * 8 + 2 * t;
            const float x0 = acc[dt][2 * r], x1 = acc[dt][2 * r + 1];
#if VEC_LOAD
            if (col < head_dim) *reinterpret_cast<u32*>(o + col) = pack2(x0, x1);
#else
            if (col < head_dim) o[col] = from_f32(x0);
            if (col + 1 < head_dim) o[col + 1] = from_f32(x1);
#endif
        }
    }
}

// bwd_dq's epilogue: this thread's rows of dQ (those inside the sequence).
__device__ __forceinline__ void store_dq(const float (&acc)[HEAD_DIM / 8][4], const BwdRows& rows,
                                         const BwdSeq& seq, u16* dq, const BwdParams& p, int h,
                                         int t) {
    u16* out[2];
#pragma unroll
    for (int r = 0; r < 2; ++r)
        out[r] = rows.row_i[r] < seq.seqlen_q
                     ? dq + ((seq.out_row0 + rows.row_i[r]) * p.heads + h) * (i64)p.head_dim
                     : nullptr;
    store_rows(acc, out, t, p.head_dim);
}

// bwd_dkdv's epilogue: this thread's keys' rows of dK and dV (those inside the sequence).
__device__ __forceinline__ void store_dkdv(const float (&acc_k)[HEAD_DIM / 8][4],
                                           const float (&acc_v)[HEAD_DIM / 8][4],
                                           const int (&key_j)[2], const BwdSeq& seq, u16* dk,
                                           u16* dv, const BwdParams& p, int hk, int t) {
    u16* out[2];
#pragma unroll
    for (int r = 0; r < 2; ++r)
        out[r] = key_j[r] < seq.seqlen_k
                     ? dk + ((seq.k_row0 + key_j[r]) * p.heads_kv + hk) * (i64)p.head_dim
                     : nullptr;
    store_rows(acc_k, out, t, p.head_dim);
#pragma unroll
    for (int r = 0; r < 2; ++r)
        if (out[r] != nullptr) out[r] = dv + (out[r] - dk);
    store_rows(acc_v, out, t, p.head_dim);
}
#endif  // FA_TENSOR_CORE_KERNEL
