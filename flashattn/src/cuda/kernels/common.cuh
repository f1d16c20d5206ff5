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

#ifdef FA_CUDA_CORE_ELEM
// The element type of the CUDA-core kernels (decode.cu, bwd.cu), widened to f32 as it is loaded
// and rounded once when stored: FA_BF16 or FA_F16 (raw 16-bit words), else f32.
#if defined(FA_BF16) || defined(FA_F16)
typedef u16 elem_t;
#else
typedef float elem_t;
#endif

#ifndef FA_HOST_EMULATION
__device__ __forceinline__ float to_f32(elem_t x) {
#if defined(FA_BF16)
    return __int_as_float((int)((u32)x << 16));
#elif defined(FA_F16)
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
#else
    return x;
#endif
}

__device__ __forceinline__ elem_t from_f32_elem(float x) {
#if defined(FA_BF16)
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
#elif defined(FA_F16)
    u16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
#else
    return x;
#endif
}
#else
inline float to_f32(elem_t x) {
#if defined(FA_BF16) || defined(FA_F16)
    return emu::half_to_float(x);
#else
    return x;
#endif
}
inline elem_t from_f32_elem(float x) {
#if defined(FA_BF16) || defined(FA_F16)
    return emu::float_to_half(x);
#else
    return x;
#endif
}
#endif  // FA_HOST_EMULATION
#endif  // FA_CUDA_CORE_ELEM

#if defined(FA_FP8_CACHE) || defined(FA_FP8_INPUT)
// The value of FP8 byte `b` as f32, exactly. The magnitude's bits, shifted so that the format's
// exponent field lands in f32's, read as an f32 whose exponent is off by the bias difference
// (120 for e4m3, 112 for e5m2) and multiplied back by that power of two: exact for normal and
// subnormal inputs alike (the shifted subnormals are f32 denormals; nothing here flushes them, as
// NVRTC's default is -ftz=false and the files ask for no fast math). Specials: e4m3 (E4M3FN) has
// no infinities and one NaN magnitude, 0x7f; e5m2's are IEEE's (exponent field 31).
__device__ __forceinline__ float fp8_to_f32(u32 b, int e5m2) {
    const u32 mag = b & 0x7fu;
    float x = e5m2 ? __int_as_float((int)(mag << 21)) * __int_as_float(0x77800000)   // 2^112
                   : __int_as_float((int)(mag << 20)) * __int_as_float(0x7b800000);  // 2^120
    if (e5m2 ? mag >= 0x7cu : mag == 0x7fu)
        x = e5m2 && mag == 0x7cu ? FA_INF : __int_as_float(0x7fc00000);
    return (b & 0x80u) ? -x : x;
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

// Dropout on the probabilities, the mask of dropout.rs regenerated bit for bit: Philox 4x32-10
// keyed by the seed, counter (key / 4, query row, head, sequence); key j uses word j % 4 and is
// kept iff that word is below `threshold` = round((1 - p) · 2^32) (at most 2^32, hence 64-bit).
// Kept probabilities are scaled by `scale` = 1 / (1 - p); the softmax normaliser and the LSE are
// those of the undropped probabilities, as on the CPU.
struct Dropout {
    u32 seed_lo, seed_hi;
    i64 threshold;
    float scale;
    // The four words of keys 4·group .. 4·group + 3 of (sequence b, head h, query row i).
    __device__ __forceinline__ void words(u32 c[4], int group, int i, int h, int b) const {
        c[0] = (u32)group;
        c[1] = (u32)i;
        c[2] = (u32)h;
        c[3] = (u32)b;
        u32 k0 = seed_lo, k1 = seed_hi;
#pragma unroll
        for (int round = 0; round < 10; ++round) {
            if (round > 0) {
                k0 += 0x9E3779B9u;
                k1 += 0xBB67AE85u;
            }
            const unsigned long long p0 = 0xD2511F53ull * c[0], p1 = 0xCD9E8D57ull * c[2];
            const u32 n0 = (u32)(p1 >> 32) ^ c[1] ^ k0, n2 = (u32)(p0 >> 32) ^ c[3] ^ k1;
            c[0] = n0;
            c[1] = (u32)p1;
            c[2] = n2;
            c[3] = (u32)p0;
        }
    }
    __device__ __forceinline__ bool kept(u32 word) const { return (i64)word < threshold; }
};

// w[sel] for a run-time sel in 0..4 by selects (indexing a register array with a run-time index
// would move it to local memory).
__device__ __forceinline__ u32 pick_word(const u32 w[4], int sel) {
    const u32 lo = (sel & 1) ? w[1] : w[0], hi = (sel & 1) ? w[3] : w[2];
    return (sel & 2) ? hi : lo;
}

// The dropout arguments every attention kernel takes last (zero threshold and unit scale unused
// without HAS_DROPOUT).
#define FA_DROPOUT_PARAMS u32 drop_seed_lo, u32 drop_seed_hi, i64 drop_threshold, float drop_scale
#define FA_DROPOUT_ARGS drop_seed_lo, drop_seed_hi, drop_threshold, drop_scale

// The parameters of both forward kernels (cuda/mod.rs pushes them in this order): q, k and v of
// element type TI (u16, f32, or FP8 bytes), out of type TO. `descale` (FP8 inputs, else null):
// two factors per (launched sequence b, kv head hk) at 2 * (b * heads_kv + hk), the score scale
// (softmax_scale · q_descale · k_descale, folded on the host and rounded once, as the CPU path
// does), which replaces softmax_scale, and v_descale, which scales the finished rows; `fp8_e5m2`
// picks the FP8 format (0: e4m3), so both formats share one compile. `sink` (learnable sinks,
// else null): the logit of (launched sequence b, head h) at b * heads + h, folded into each
// finished row by `fold_sink`; -inf (the tail of packed rows after the last sequence) folds
// nothing.
#define FLASH_FWD_PARAMS(TI, TO)                                                                  \
    const TI *__restrict__ q, const TI *__restrict__ k, const TI *__restrict__ v,                 \
        TO *__restrict__ out, float *__restrict__ lse, const i64 *__restrict__ seqs,              \
        const float *__restrict__ alibi_slopes, int heads, int heads_kv, int head_dim,            \
        i64 q_row_stride, i64 q_head_stride, i64 k_row_stride, i64 k_head_stride,                 \
        i64 v_row_stride, i64 v_head_stride, i64 lse_head_stride, float softmax_scale,            \
        float softcap, int window_left, int window_right, int batch_seqlen_q, int batch_seqlen_k, \
        i64 q_batch_stride, i64 k_batch_stride, i64 v_batch_stride,                               \
        const float *__restrict__ descale, int fp8_e5m2, const float *__restrict__ sink,          \
        FA_DROPOUT_PARAMS

#define FLASH_FWD_ARGS                                                                            \
    q, k, v, out, lse, seqs, alibi_slopes, heads, heads_kv, head_dim, q_row_stride, q_head_stride, \
        k_row_stride, k_head_stride, v_row_stride, v_head_stride, lse_head_stride, softmax_scale, \
        softcap, window_left, window_right, batch_seqlen_q, batch_seqlen_k, q_batch_stride,       \
        k_batch_stride, v_batch_stride, descale, fp8_e5m2, sink, FA_DROPOUT_ARGS

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

// Fills `w` for this CTA; false when its query block lies past the sequence (nothing to do).
template <typename T, typename TO, int BM, int BN>
__device__ __forceinline__ bool cta_work(CtaWork<T>& w, FLASH_FWD_PARAMS(T, TO)) {
    // Masked (causal) query blocks get more keys the later they come: launch those first, so the
    // longest CTAs do not start last and leave SMs idle at the end (as FlashAttention-2 does).
    const int m_block = IS_MASKED ? (int)gridDim.x - 1 - (int)blockIdx.x : (int)blockIdx.x;
    const int b = blockIdx.z;
    w.b = b;
    w.h = blockIdx.y;
    w.drop = Dropout{drop_seed_lo, drop_seed_hi, drop_threshold, drop_scale};
    const SeqInfo seq(seqs, b, heads, batch_seqlen_q, batch_seqlen_k, q_batch_stride,
                      k_batch_stride, v_batch_stride);
    w.seqlen_q = seq.seqlen_q;
    w.seqlen_k = seq.seqlen_k;
    w.m0 = m_block * BM;
    if (w.m0 >= w.seqlen_q) return false;
    w.m_end = min(w.m0 + BM, w.seqlen_q);
    const int hk = w.h / (heads / heads_kv);
    w.q_g = q + seq.q_base + (i64)w.h * q_head_stride;
    w.k_g = k + seq.k_base + (i64)hk * k_head_stride;
    w.v_g = v + seq.v_base + (i64)hk * v_head_stride;
    w.out_row0 = seq.out_row0;
    w.lse_base = seq.lse_base;
    w.mask = Mask{w.seqlen_k, w.seqlen_k - w.seqlen_q, window_left, window_right};
    // FP8 inputs: the folded score scale of this (sequence, kv head) replaces softmax_scale.
    const float* ds = descale != nullptr ? descale + 2 * ((i64)b * heads_kv + hk) : nullptr;
    const float scale = ds != nullptr ? ds[0] : softmax_scale;
    w.out_scale = (HAS_DROPOUT ? w.drop.scale : 1.f) * (ds != nullptr ? ds[1] : 1.f);
    w.sink = sink != nullptr ? sink[(i64)b * heads + w.h] : -FA_INF;
    w.mods.scale_log2 = scale * FA_LOG2E;
    w.mods.cap_in = scale / softcap;
    w.mods.cap_out = softcap * FA_LOG2E;
    w.mods.alibi_log2 = HAS_ALIBI ? alibi_slopes[b * heads + w.h] * FA_LOG2E : 0.f;
    w.mods.offset = w.mask.offset;
    w.n_block_min = w.n_block_max = 0;
    const int lo = w.mask.lo(w.m0), hi = w.mask.hi(w.m_end - 1);
    if (hi > lo) {
        w.n_block_min = lo / BN;
        w.n_block_max = (hi + BN - 1) / BN;
    }
    return true;
}


#ifdef FA_TENSOR_CORE_KERNEL
// The tensor-core kernels' primitives (fwd.cu, and bwd.cu for f16/bf16): mma.sync m16n8k16,
// ldmatrix, cp.async, the swizzled shared-memory tiles. The including file defines NUM_THREADS,
// HEAD_DIM, SMEM_ROW and VEC_LOAD first; host_emulation.h has the CPU twins of the PTX ones.
#if defined(FA_BF16)
#define MMA_TYPE "bf16"
#else
#define MMA_TYPE "f16"
#endif

#ifndef FA_HOST_EMULATION
// Two floats rounded to one packed pair: `lo` at the lower address.
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
#if defined(FA_BF16)
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

__device__ __forceinline__ u16 from_f32(float x) {
    u16 r;
#if defined(FA_BF16)
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
#endif
    return r;
}

__device__ __forceinline__ void mma16816(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldsm_x4(u32 r[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(u32 r[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
    // src_bytes 0 reads nothing and zero-fills the 16 bytes (rows past the sequence, columns past
    // head_dim).
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// 4 bytes (both addresses 4-byte aligned), through L1.
__device__ __forceinline__ void cp_async4(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}
#endif  // FA_HOST_EMULATION

// c0 += A·B[:, 0..8] and c1 += A·B[:, 8..16]: one x4 B fragment from ldmatrix holds both n8
// halves of a 16-column block, so every product below issues its mma.sync in these pairs.
__device__ __forceinline__ void mma_x4(float (&c0)[4], float (&c1)[4], const u32 (&af)[4],
                                       const u32 (&bf)[4]) {
    mma16816(c0, af, bf[0], bf[1]);
    mma16816(c1, af, bf[2], bf[3]);
}

// Element offset of (row, col) in a swizzled tile: the 16-byte chunk index is XORed with row % 8
// inside each group of 8 chunks (SMEM_ROW is a multiple of 64 elements, so groups are whole).
__device__ __forceinline__ int swz(int row, int col) {
    int chunk = col >> 3;
    chunk = (chunk & ~7) | ((chunk ^ row) & 7);
    return row * SMEM_ROW + (chunk << 3) + (col & 7);
}

// x[·][NCOLS] = A·Bᵀ for this warp's 16 rows of tile `a` and the NCOLS rows of tile `b` (both
// [rows][HEAD_DIM], swizzled): the forward's S = Q·Kᵀ (and the
// backward's S, dP and their transposes).
template <int NCOLS>
__device__ __forceinline__ void mma_abt(float (&x)[NCOLS / 8][4], const u16* a, const u16* b,
                                        int warp, int lane) {
#pragma unroll
    for (int i = 0; i < NCOLS / 8; ++i) x[i][0] = x[i][1] = x[i][2] = x[i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        u32 af[4];
        ldsm_x4(af, smem_addr(a + swz(warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                      kk * 16 + (lane >> 4) * 8)));
#pragma unroll
        for (int np = 0; np < NCOLS / 16; ++np) {
            u32 bf[4];
            ldsm_x4(bf, smem_addr(b + swz(np * 16 + (lane & 7) + (lane >> 4) * 8,
                                          kk * 16 + ((lane >> 3) & 1) * 8)));
            mma_x4(x[2 * np], x[2 * np + 1], af, bf);
        }
    }
}

// The A fragment of k-step j from this warp's 16 x NK accumulators, rounded to the input type:
// the accumulators of key tiles 2j and 2j + 1.
template <int NK>
__device__ __forceinline__ void pack_kstep(u32 (&a)[4], const float (&x)[NK / 8][4], int j) {
    a[0] = pack2(x[2 * j][0], x[2 * j][1]);
    a[1] = pack2(x[2 * j][2], x[2 * j][3]);
    a[2] = pack2(x[2 * j + 1][0], x[2 * j + 1][1]);
    a[3] = pack2(x[2 * j + 1][2], x[2 * j + 1][3]);
}

// All NK / 16 A fragments of this warp's 16 x NK accumulators (pack_kstep), packed at once.
template <int NK>
__device__ __forceinline__ void pack_a(u32 (&a)[NK / 16][4], const float (&x)[NK / 8][4]) {
#pragma unroll
    for (int j = 0; j < NK / 16; ++j) pack_kstep<NK>(a[j], x, j);
}

// acc[·][HEAD_DIM] += A·B_j for k-step j: `a` the packed A fragment of keys 16j .. 16j + 16 and
// B_j those rows of the tile `b` ([NK][HEAD_DIM], swizzled), read transposed.
__device__ __forceinline__ void mma_kstep_b(float (&acc)[HEAD_DIM / 8][4], const u32 (&a)[4],
                                            const u16* b, int j, int lane) {
#pragma unroll
    for (int dp = 0; dp < HEAD_DIM / 16; ++dp) {
        u32 bf[4];
        ldsm_x4_trans(bf, smem_addr(b + swz(j * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                            dp * 16 + (lane >> 4) * 8)));
        mma_x4(acc[2 * dp], acc[2 * dp + 1], a, bf);
    }
}

// acc[·][HEAD_DIM] += X·B, X given as its packed A fragments (pack_a) and B the tile `b`
// ([NK][HEAD_DIM], swizzled).
template <int NK>
__device__ __forceinline__ void mma_pb(float (&acc)[HEAD_DIM / 8][4], const u32 (&a)[NK / 16][4],
                                       const u16* b, int lane) {
#pragma unroll
    for (int j = 0; j < NK / 16; ++j) mma_kstep_b(acc, a[j], b, j, lane);
}

// acc[·][HEAD_DIM] += X·B, X this warp's 16 x NK accumulators (rounded to the input type as the
// A operand) and B the tile `b` ([NK][HEAD_DIM], swizzled): the tensor-core decode kernel's
// O += P·V and bwd_dq's dQ. Each k-step's fragment is packed just before its products, the order
// those kernels were measured with (fwd.cu's mma_xb_mt does the same: packing all of P first made
// the forward spill, docs/GPU.md run 8); bwd_dkdv packs first (pack_a, mma_pb), which saved it
// registers.
template <int NK>
__device__ __forceinline__ void mma_xb(float (&acc)[HEAD_DIM / 8][4], const float (&x)[NK / 8][4],
                                       const u16* b, int lane) {
#pragma unroll
    for (int j = 0; j < NK / 16; ++j) {
        u32 af[4];
        pack_kstep<NK>(af, x, j);
        mma_kstep_b(acc, af, b, j, lane);
    }
}

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

// Loads `rows` rows (row r from src + (row0 + r) * row_stride) of HEAD_DIM columns into a
// swizzled tile; rows at or past `row_end` and columns at or past `head_dim` become 0.
template <int ROWS>
__device__ __forceinline__ void load_tile(u16* tile, const u16* src, i64 row_stride, int row0,
                                          int row_end, int head_dim) {
#if VEC_LOAD
    constexpr int CHUNKS = ROWS * (HEAD_DIM / 8);
#pragma unroll
    for (int c = threadIdx.x; c < CHUNKS; c += NUM_THREADS) {
        int r = c / (HEAD_DIM / 8), col = (c % (HEAD_DIM / 8)) * 8;
        bool ok = row0 + r < row_end && col < head_dim;
        const u16* g = ok ? src + (i64)(row0 + r) * row_stride + col : src;
        cp_async16(smem_addr(tile + swz(r, col)), g, ok ? 16 : 0);
    }
#else
    constexpr int ELEMS = ROWS * HEAD_DIM;
    for (int e = threadIdx.x; e < ELEMS; e += NUM_THREADS) {
        int r = e / HEAD_DIM, col = e % HEAD_DIM;
        bool ok = row0 + r < row_end && col < head_dim;
        tile[swz(r, col)] = ok ? src[(i64)(row0 + r) * row_stride + col] : (u16)0;
    }
#endif
}
#endif  // FA_TENSOR_CORE_KERNEL
