// Decoding with a KV cache (flash-attn's flash_attn_with_kvcache; flash-decoding) on CUDA cores.
//
// Decoding reads the whole cache for a handful of query rows, so it is bound by memory bandwidth,
// not by the multiply units: plain f32 FMAs on CUDA cores, with the elements widened as they are
// loaded, serve f32, f16 and bf16 caches alike. The file holds three kernels, one per compile
// (FA_DECODE_ENTRY):
//   1 decode_split    one CTA per (query row block, key split, kv head, sequence): the query rows
//                     of one kv head's group (position i, head h: row i * group + h % group, up
//                     to MAX_ROWS = 16 of them) against its share of the sequence's keys, read in
//                     place from a contiguous or paged cache. Writes each row's normalised partial
//                     output (f32) and LSE into a workspace.
//   2 decode_combine  one warp per (query row, head): merges the splits' partials through their
//                     LSEs (the rule of cpu::decode::merge_row) into out (q's dtype) and lse.
//   3 decode_append   writes the new keys (rotated) and values into the caches before attending.
//
// Per-sequence table (DECODE_FIELDS i64 per launched sequence, cuda/mod.rs): seqlen_q, seqlen_k
// (keys attended: cached + new), leftpad (first key attended), q_base (element offset of its query
// row 0, head 0), out_row0 (out row of its query 0), lse_base (lse index of head 0, query 0),
// cache_seqlen (where its new keys go), new_len, k_new_base, v_new_base. Key j of sequence b lives
// in page pages[b * max_blocks + j / page_size], row j % page_size (a contiguous cache is one
// page per sequence).
//
// Every kernel takes one DecodeParams (params.cuh), by value as its `const __grid_constant__`
// parameter: the tensors', tables' and workspace's addresses, strides and the call's scalars.
//
// Defines: FA_DECODE_ENTRY (0: all three, for the host emulation); FA_BF16 or FA_F16 (else f32);
// HEAD_DIM (padded head_dim, a multiple of 32), IS_MASKED (causal or window), HAS_SOFTCAP,
// HAS_ALIBI; FA_FP8_CACHE: the caches hold FP8 bytes (e4m3 or e5m2, a launch argument, so both
// formats share a compile) with dequantisation factors, while q, the new keys and values and out
// keep elem_t.
//
// FP8 caches (flashattn::fp8::flash_attn_with_kvcache_fp8 on the CPU): a launch passes `descale`,
// three factors per (launched sequence b, kv head hk) at 3 * (b * heads_kv + hk): the score scale
// (softmax_scale · k_descale, folded on the host and rounded once, as the CPU path does),
// k_descale and v_descale; other launches pass null.
// Keys and values are widened exactly to f32 as they are loaded; the score scale replaces
// softmax_scale, v_descale scales each finished row, and the append divides each new key (rotated
// first) and value by its factor in f64 and rounds once to FP8, saturating.
//
// DECODE_TC (f16/bf16 caches that are not FP8, head_dim and every cache stride a multiple of 8
// elements): decode_split is the tensor-core kernel below instead, with SMEM_ROW and VEC_LOAD = 1
// for common.cuh's mma/ldmatrix/cp.async pieces. The default where a call allows it since an H100
// timed it 1.3-1.6x faster than the CUDA-core one (FLASHATTN_CUDA_DECODE=cuda-core keeps that).
#define NUM_THREADS 128
#if DECODE_TC
#if !(defined(FA_BF16) || defined(FA_F16)) || defined(FA_FP8_CACHE)
#error "DECODE_TC needs f16 or bf16 caches"
#endif
#define FA_TENSOR_CORE_KERNEL
#endif
#define FA_CUDA_CORE_ELEM
#include "common.cuh"

#ifdef FA_FP8_CACHE
typedef unsigned char cache_t;

// fp8_to_f32 (common.cuh) widens a byte exactly.

// `x` rounded to nearest even in FP8, saturating (CUDA's __NV_SATFINITE and flashattn's
// Fp8Format::quantise): magnitudes from the largest finite value up, infinities included, become
// it; NaN stays NaN (0x7f with x's sign). The rounding is one rint of x scaled to units of the
// last place of its binade (binades below the smallest normal share its unit: subnormals).
__device__ __forceinline__ unsigned char f64_to_fp8(double x, int e5m2) {
    const int mbits = e5m2 ? 2 : 3, emin = e5m2 ? -14 : -6, bias = e5m2 ? 15 : 7;
    const u32 sign = __double_as_longlong(x) < 0 ? 0x80u : 0u;
    const double a = fabs(x);
    if (a != a) return (unsigned char)(sign | 0x7fu);
    if (a >= (e5m2 ? 57344.0 : 448.0)) return (unsigned char)(sign | (e5m2 ? 0x7bu : 0x7eu));
    int e;
    frexp(a, &e);  // a = f · 2^e, f in [0.5, 1): its leading bit is 2^(e - 1)
    const int lead = a == 0.0 ? emin : max(e - 1, emin);
    const int q = (int)rint(ldexp(a, mbits - lead));  // 0 ..= 2^(mbits + 1)
    // Exponent field lead + bias with q's leading bit as the implicit one; below the normals
    // (lead = emin, q < 2^mbits) the field is 0 and q the mantissa; q = 2^(mbits + 1) carries
    // into the next binade by itself.
    return (unsigned char)(sign | (u32)(((lead + bias - 1) << mbits) + q));
}

__device__ __forceinline__ float cache_to_f32(cache_t x, int e5m2) { return fp8_to_f32(x, e5m2); }
#else
typedef elem_t cache_t;
__device__ __forceinline__ float cache_to_f32(cache_t x, int) { return to_f32(x); }
#endif

#define DECODE_FIELDS 10
#define MAX_ROWS 16
#define NUM_WARPS (NUM_THREADS / 32)
#define TILE NUM_THREADS                              // keys per tile: one per thread
#define NCOL ((HEAD_DIM + NUM_THREADS - 1) / NUM_THREADS)  // output columns per thread
#define PV_UNROLL 8                                   // keys of P·V whose v loads go out together
// 8-element key loads in flight per thread in the scores: 4 where the H200 timed it (head_dim
// 128, f32/f16/bf16 caches; 2026-11-26), 2 elsewhere, which compiles in ~60% of the time (the
// 16 unrolled rows make each extra chunk 128 more FMAs for ptxas; CI compiles every variant).
#if HEAD_DIM == 128 && !defined(FA_FP8_CACHE)
#define KEY_CHUNKS 4
#else
#define KEY_CHUNKS 2
#endif

static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM <= 256, "HEAD_DIM: a multiple of 32, at most 256");


// Element (x) of a rotated head row `src` (its first 2 * half elements rotated by cos/sin `cs`:
// half cos values, then half sin values): GPT-J pairs (2i, 2i + 1) when interleaved, else GPT-NeoX
// pairs (i, i + half). Computed in f32 (the CPU path rotates in f64 and rounds once, to q's or the
// cache's type: the two may differ in the last bit).
__device__ __forceinline__ float rotated(const elem_t* src, int x, const float* cs, int half,
                                         int interleaved) {
    if (cs == nullptr || x >= 2 * half) return to_f32(src[x]);
    int i, i0, i1;
    if (interleaved) {
        i = x / 2;
        i0 = 2 * i;
        i1 = i0 + 1;
    } else {
        i = x % half;
        i0 = i;
        i1 = i + half;
    }
    const float x0 = to_f32(src[i0]), x1 = to_f32(src[i1]), c = cs[i], s = cs[half + i];
    return x == i0 ? x0 * c - x1 * s : x0 * s + x1 * c;
}

#if FA_DECODE_ENTRY == 1 || FA_DECODE_ENTRY == 0
// decode_split's pointers (either kernel) as typed, restrict-qualified locals, as they were when
// they were kernel parameters (common.cuh: cta_work does the same for the forward: through the
// struct's fields alone ptxas allocates registers differently).
#define DECODE_SPLIT_POINTERS(p)                                                                  \
    const elem_t* __restrict__ q = static_cast<const elem_t*>(p.q);                               \
    const cache_t* __restrict__ k_cache = static_cast<const cache_t*>(p.k_cache);                 \
    const cache_t* __restrict__ v_cache = static_cast<const cache_t*>(p.v_cache);                 \
    float* __restrict__ ws_o = p.ws_o;                                                            \
    float* __restrict__ ws_lse = p.ws_lse;                                                        \
    const int* __restrict__ pages = p.pages;                                                      \
    const float* __restrict__ alibi_slopes = p.alibi_slopes;                                      \
    const float* __restrict__ rot = p.rot

// What one decode_split CTA works on: grid (row blocks x splits, kv heads, sequences); its
// sequence's table row, its MAX_ROWS query rows (r = i * group + h % group of kv head hk), and
// this split's share of the keys those rows see (both ends of a row's window grow with its
// position, and nothing before leftpad is seen).
struct SplitWork {
    int b, hk, sp, group, r0, nrows, leftpad;
    i64 q_base, out_row0;
    Mask mask;
    int n_lo, n_hi;
};

// Fills `w` for this CTA; false when its row block lies past the sequence's rows.
__device__ __forceinline__ bool split_work(SplitWork& w, const DecodeParams& p) {
    const i64* __restrict__ seqs = p.seqs;
    const int heads = p.heads, heads_kv = p.heads_kv, splits = p.splits;
    w.b = blockIdx.z;
    w.hk = blockIdx.y;
    const int rb = blockIdx.x / splits;
    w.sp = blockIdx.x % splits;
    const i64* s = seqs + DECODE_FIELDS * w.b;
    const int seqlen_q = (int)s[0], seqlen_k = (int)s[1];
    w.leftpad = (int)s[2];
    w.q_base = s[3];
    w.out_row0 = s[4];
    w.group = heads / heads_kv;
    const int rows = seqlen_q * w.group;
    w.r0 = rb * MAX_ROWS;
    if (w.r0 >= rows) return false;
    w.nrows = min(MAX_ROWS, rows - w.r0);
    w.mask = Mask{seqlen_k, seqlen_k - seqlen_q, p.window_left, p.window_right};
    const int lo = max(w.mask.lo(w.r0 / w.group), w.leftpad);
    const int hi = max(w.mask.hi((w.r0 + w.nrows - 1) / w.group), lo);
    const int chunk = (hi - lo + splits - 1) / splits;
    w.n_lo = min(lo + w.sp * chunk, hi);
    w.n_hi = min(lo + (w.sp + 1) * chunk, hi);
    return true;
}
#endif

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int m = 16; m >= 1; m /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, m));
    return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int m = 16; m >= 1; m /= 2) x += __shfl_xor_sync(0xffffffffu, x, m);
    return x;
}

#if (FA_DECODE_ENTRY == 1 || FA_DECODE_ENTRY == 0) && !DECODE_TC
// 8 elements of a cache row at `p` as f32: one 16-byte load (two for f32, one 8-byte load for FP8)
// when `vec` (the launcher checked head_dim, every cache stride and so every row start are
// multiples of 8 elements; device buffers start 256-byte aligned), else element by element.
// Elements at or past `n` read as 0.
__device__ __forceinline__ void load8(const cache_t* p, int n, bool vec, int e5m2, float out[8]) {
    if (vec && n >= 8) {
        u32 w[8 * sizeof(cache_t) / 4];
#ifndef FA_HOST_EMULATION
#if defined(FA_FP8_CACHE)
        const uint2 a = *reinterpret_cast<const uint2*>(p);
        w[0] = a.x, w[1] = a.y;
#elif defined(FA_BF16) || defined(FA_F16)
        const uint4 a = *reinterpret_cast<const uint4*>(p);
        w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w;
#else
        const uint4 a = reinterpret_cast<const uint4*>(p)[0];
        const uint4 b = reinterpret_cast<const uint4*>(p)[1];
        w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w;
        w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
#endif
#else
        std::memcpy(w, p, sizeof(w));
#endif
#if defined(FA_FP8_CACHE)
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = fp8_to_f32((w[i / 4] >> (8 * (i % 4))) & 0xffu, e5m2);
#elif defined(FA_BF16) || defined(FA_F16)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            out[2 * i] = to_f32((u16)(w[i] & 0xffffu));  // the lower address first
            out[2 * i + 1] = to_f32((u16)(w[i] >> 16));
        }
#else
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = __int_as_float((int)w[i]);
#endif
        return;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = i < n ? cache_to_f32(p[i], e5m2) : 0.f;
}

// Four consecutive probabilities of a row of p_s (16-byte aligned: p_s is, TILE and the offset
// are multiples of 4): one shared-memory load instead of four.
__device__ __forceinline__ void load_p4(const float* p, float out[4]) {
#ifndef FA_HOST_EMULATION
    const float4 a = *reinterpret_cast<const float4*>(p);
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
#else
    for (int i = 0; i < 4; ++i) out[i] = p[i];
#endif
}

// One CTA: up to MAX_ROWS query rows (r = i * group + h % group of kv head hk) against this split's
// keys, in tiles of TILE = 128 keys, one key per thread. Decoding reads each k/v element once and
// multiplies it by only a few query rows, so the kernel is laid out for the loads:
//   scores  thread t reads key n0 + t straight from the cache (16-byte loads where aligned) and
//           keeps its scores for every row in registers; q comes from shared memory as 16-byte
//           broadcasts (2 per 8 FMAs);
//   softmax per row, the tile's max and sum over the CTA (warp shuffles, then 4 warps through
//           shared memory); P to shared memory;
//   P·V     thread t owns columns t and t + 128 of every row (accumulators in registers) and reads
//           v row by row, each warp 32 consecutive elements of a row; P as 16-byte broadcasts.
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
decode_split(const __grid_constant__ DecodeParams p) {
    DECODE_SPLIT_POINTERS(p);
    const float* __restrict__ descale = p.descale;
    FA_DYNAMIC_SMEM(float, smem_f);
    i64* vrow_s = (i64*)smem_f;                // [TILE] offset of each key's v row in v_cache
    float* q_s = smem_f + 2 * TILE;            // [MAX_ROWS][HEAD_DIM], rows of q (f32, rotated)
    float* p_s = q_s + MAX_ROWS * HEAD_DIM;    // [MAX_ROWS][TILE], the tile's probabilities
    float* red_max = p_s + MAX_ROWS * TILE;    // [NUM_WARPS][MAX_ROWS]
    float* red_sum = red_max + NUM_WARPS * MAX_ROWS;
    float* m_s = red_sum + NUM_WARPS * MAX_ROWS;  // [MAX_ROWS] running max (log2 domain)
    float* l_s = m_s + MAX_ROWS;                  // running sum
    float* alpha_s = l_s + MAX_ROWS;              // this tile's rescale
    float* msub_s = alpha_s + MAX_ROWS;           // this tile's max, 0 where none
    float* slope_s = msub_s + MAX_ROWS;           // ALiBi slope · log2(e)
    int* lo_s = (int*)(slope_s + MAX_ROWS);       // first visible key
    int* hi_s = lo_s + MAX_ROWS;                  // one past the last
    int* pos_s = hi_s + MAX_ROWS;                 // query position i

    SplitWork w;
    if (!split_work(w, p)) return;
    const int b = w.b, hk = w.hk, sp = w.sp, group = w.group, r0 = w.r0, nrows = w.nrows;
    const int leftpad = w.leftpad, n_lo = w.n_lo, n_hi = w.n_hi;
    const i64 q_base = w.q_base, out_row0 = w.out_row0;
    const Mask& mask = w.mask;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

    // FP8 caches: this (sequence, kv head)'s score scale replaces softmax_scale; its v factor
    // scales the finished rows.
    const i64 fac = 3 * ((i64)b * p.heads_kv + hk);
    const float scale = descale == nullptr ? p.softmax_scale : descale[fac];
    const float v_scale = descale == nullptr ? 1.f : descale[fac + 2];
    ScoreMod mods;
    mods.scale_log2 = scale * FA_LOG2E;
    mods.cap_in = scale / p.softcap;
    mods.cap_out = p.softcap * FA_LOG2E;
    mods.offset = mask.offset;
    if (tid < MAX_ROWS) {
        const int i = (r0 + tid) / group, h = hk * group + (r0 + tid) % group;
        const bool valid = tid < nrows;
        pos_s[tid] = valid ? i : 0;
        lo_s[tid] = valid ? max(mask.lo(i), leftpad) : 0;
        hi_s[tid] = valid ? mask.hi(i) : 0;
        slope_s[tid] = HAS_ALIBI && valid ? alibi_slopes[b * p.heads + h] * FA_LOG2E : 0.f;
        m_s[tid] = -FA_INF;
        l_s[tid] = 0.f;
    }
    // q rows in f32, rotated at flash-attn's positions: query i at cache_seqlen + i under a
    // causal or window mask, every query at cache_seqlen otherwise, and rounded to q's type as
    // flash-attn hands a rotated q over (as the CPU path and the tensor-core kernel). Rows past
    // nrows and columns past head_dim are 0.
    for (int e = tid; e < MAX_ROWS * HEAD_DIM; e += NUM_THREADS) {
        const int rr = e / HEAD_DIM, col = e % HEAD_DIM;
        float x = 0.f;
        if (rr < nrows && col < p.head_dim && n_lo < n_hi) {
            const int ir = (r0 + rr) / group, hr = hk * group + (r0 + rr) % group;
            const elem_t* src = q + q_base + (i64)ir * p.q_row_stride + (i64)hr * p.q_head_stride;
            const float* cs =
                rot == nullptr ? nullptr
                               : rot + ((i64)b * p.rot_npos + (IS_MASKED ? ir : 0)) * 2 *
                                           p.rot_half;
            x = to_f32(from_f32_elem(rotated(src, col, cs, p.rot_half, p.rot_interleaved)));
        }
        q_s[e] = x;
    }
    __syncthreads();

    float acc[MAX_ROWS][NCOL];
#pragma unroll
    for (int r = 0; r < MAX_ROWS; ++r)
#pragma unroll
        for (int c = 0; c < NCOL; ++c) acc[r][c] = 0.f;

    for (int n0 = n_lo; n0 < n_hi; n0 += TILE) {
        const int n = min(TILE, n_hi - n0);
        // Scores of key j = n0 + tid against every row.
        const int j = n0 + tid;
        float sc[MAX_ROWS];
#pragma unroll
        for (int r = 0; r < MAX_ROWS; ++r) sc[r] = 0.f;
        // Where key j's v row is, for the P·V loop (read after the barriers below).
        vrow_s[tid] = 0;
        if (tid < n) {
            const i64 page = pages[(i64)b * p.max_blocks + j / p.page_size];
            vrow_s[tid] = page * p.v_page_stride + (i64)(j % p.page_size) * p.v_row_stride +
                          (i64)hk * p.v_head_stride;
            const cache_t* kr = k_cache + page * p.k_page_stride +
                                (i64)(j % p.page_size) * p.k_row_stride + (i64)hk * p.k_head_stride;
            // KEY_CHUNKS x 8 elements of the key loaded before their FMAs (several loads in
            // flight); past head_dim they read as 0, as do q's padded columns. Each score adds
            // its products in element order, as one chunk at a time did.
            for (int x0 = 0; x0 < HEAD_DIM && x0 < p.head_dim; x0 += 8 * KEY_CHUNKS) {
                float kf[KEY_CHUNKS][8];
#pragma unroll
                for (int g = 0; g < KEY_CHUNKS; ++g)
                    load8(kr + x0 + 8 * g, p.head_dim - x0 - 8 * g, p.vec_loads != 0, p.fp8_e5m2,
                          kf[g]);
#pragma unroll
                for (int r = 0; r < MAX_ROWS; ++r) {
                    if (r < nrows) {
                        const float* qr = q_s + r * HEAD_DIM + x0;
                        float d = sc[r];
#pragma unroll
                        for (int g = 0; g < KEY_CHUNKS; ++g)
#pragma unroll
                            for (int u = 0; u < 8; ++u) d = fmaf(qr[8 * g + u], kf[g][u], d);
                        sc[r] = d;
                    }
                }
            }
        }
        // Masks and modifiers, then the tile's max per row.
#pragma unroll
        for (int r = 0; r < MAX_ROWS; ++r) {
            if (r < nrows) {
                mods.alibi_log2 = slope_s[r];
                float x = mods.apply(sc[r], pos_s[r], j);
                if (tid >= n || j < lo_s[r] || j >= hi_s[r]) x = -FA_INF;
                sc[r] = x;
                const float mx = warp_max(x);
                if (lane == 0) red_max[warp * MAX_ROWS + r] = mx;
            }
        }
        __syncthreads();
        if (tid < nrows) {
            float mx = m_s[tid];
#pragma unroll
            for (int w = 0; w < NUM_WARPS; ++w) mx = fmaxf(mx, red_max[w * MAX_ROWS + tid]);
            const float m_use = mx == -FA_INF ? 0.f : mx;
            alpha_s[tid] = fa_exp2(m_s[tid] - m_use);
            msub_s[tid] = m_use;
            m_s[tid] = mx;
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < MAX_ROWS; ++r) {
            if (r < nrows) {
                const float pr = fa_exp2(sc[r] - msub_s[r]);
                p_s[r * TILE + tid] = pr;
                const float sm = warp_sum(pr);
                if (lane == 0) red_sum[warp * MAX_ROWS + r] = sm;
            }
        }
        __syncthreads();
        if (tid < nrows) {
            float sm = 0.f;
#pragma unroll
            for (int w = 0; w < NUM_WARPS; ++w) sm += red_sum[w * MAX_ROWS + tid];
            l_s[tid] = l_s[tid] * alpha_s[tid] + sm;
        }
        // P·V: columns tid and tid + 128 of every row; keys with p = 0 (masked, past the tile's
        // end) add nothing, and their v rows are not read past the tile's end.
#pragma unroll
        for (int r = 0; r < MAX_ROWS; ++r) {
            if (r < nrows) {
                const float a = alpha_s[r];
#pragma unroll
                for (int c = 0; c < NCOL; ++c) acc[r][c] *= a;
            }
        }
        // The tile's v rows, PV_UNROLL keys at a time: all their loads issued before their FMAs,
        // so that many loads are in flight per thread (one at a time left the kernel waiting on
        // memory latency, ~4% of the H200's bandwidth). Each acc[r][c] still adds its keys in
        // order, so the sum is the same as one key at a time.
        int jj = 0;
        for (; jj + PV_UNROLL <= n; jj += PV_UNROLL) {
            float vv[PV_UNROLL][NCOL];
#pragma unroll
            for (int u = 0; u < PV_UNROLL; ++u) {
                const cache_t* vr = v_cache + vrow_s[jj + u];
#pragma unroll
                for (int c = 0; c < NCOL; ++c) {
                    const int col = tid + c * NUM_THREADS;
                    vv[u][c] = col < p.head_dim ? cache_to_f32(vr[col], p.fp8_e5m2) : 0.f;
                }
            }
#pragma unroll
            for (int r = 0; r < MAX_ROWS; ++r) {
                if (r < nrows) {
                    float pr[PV_UNROLL];
#pragma unroll
                    for (int u = 0; u < PV_UNROLL; u += 4) load_p4(p_s + r * TILE + jj + u, pr + u);
#pragma unroll
                    for (int u = 0; u < PV_UNROLL; ++u)
#pragma unroll
                        for (int c = 0; c < NCOL; ++c) acc[r][c] = fmaf(pr[u], vv[u][c], acc[r][c]);
                }
            }
        }
        for (; jj < n; ++jj) {
            const cache_t* vr = v_cache + vrow_s[jj];
            float vv[NCOL];
#pragma unroll
            for (int c = 0; c < NCOL; ++c) {
                const int col = tid + c * NUM_THREADS;
                vv[c] = col < p.head_dim ? cache_to_f32(vr[col], p.fp8_e5m2) : 0.f;
            }
#pragma unroll
            for (int r = 0; r < MAX_ROWS; ++r) {
                if (r < nrows) {
                    const float pr = p_s[r * TILE + jj];
#pragma unroll
                    for (int c = 0; c < NCOL; ++c) acc[r][c] = fmaf(pr, vv[c], acc[r][c]);
                }
            }
        }
        __syncthreads();  // p_s, the reductions and the statistics are rewritten next tile
    }

    // Each row normalised: partial out (f32) and LSE into this split's workspace.
#pragma unroll
    for (int r = 0; r < MAX_ROWS; ++r) {
        if (r < nrows) {
            const int i = (r0 + r) / group, h = hk * group + (r0 + r) % group;
            const i64 row = (out_row0 + i) * p.heads + h;
            const float l = l_s[r];
            const float inv = l == 0.f ? 0.f : v_scale / l;
            float* o = ws_o + ((i64)sp * p.total_rows + row) * p.head_dim;
#pragma unroll
            for (int c = 0; c < NCOL; ++c) {
                const int col = tid + c * NUM_THREADS;
                if (col < p.head_dim) o[col] = acc[r][c] * inv;
            }
            if (tid == 0)
                ws_lse[(i64)sp * p.total_rows + row] =
                    l == 0.f ? -FA_INF : (m_s[r] + log2f(l)) * FA_LN2;
        }
    }
}
#endif  // FA_DECODE_ENTRY == 1

#if (FA_DECODE_ENTRY == 1 || FA_DECODE_ENTRY == 0) && DECODE_TC
// The tensor-core split kernel: FlashAttention-2's forward with the query rows of one kv head
// packed into a single 16-row mma tile (all NUM_WARPS warps share it) and the key tiles split
// between the warps. Per stage TC_BLOCK_N keys of k and v are copied by cp.async into swizzled
// shared memory while the warps compute the previous stage; warp w takes keys 16w..16w+15 of each
// stage:
//   S = Q·Kᵀ   16 rows x 16 keys, mma.sync m16n8k16 (mma.cuh: mma_abt);
//   softmax    online, in registers, per warp (its own row_max, row_sum, acc_o);
//   acc_o     += P·V with P rounded to the cache's type as the A operand (mma_xb), as
//               flash-attn's kernels and the CPU's bf16 path do.
// At the end the four warps' partial rows are merged exactly through their maxima and sums (one
// pass through shared memory) into the split's normalised partial output and LSE, the same
// workspace rows the CUDA-core kernel writes. q is rotated in f32 and rounded once to the cache's
// type (as flash-attn rotates q in its dtype). The CUDA-core kernel loads every key once per
// thread from global memory with a handful of loads in flight; here the whole next stage (32 KiB
// at head_dim 128) is in flight while the current one is computed.
#define TC_BLOCK_N 64  // keys per stage, 16 per warp
#define TC_WARP_N (TC_BLOCK_N / NUM_WARPS)
// TC_MIN_BLOCKS (from cuda/key.rs): the CTAs per SM this variant's shared memory allows (4 up to
// head_dim 64, 3 up to 128 (70 KiB), 2 up to 192, else 1), so ptxas keeps the registers to that
// many; the automatic split count counts on it.
static_assert(TC_WARP_N == 16, "each warp takes one mma k-step of keys per stage");
static_assert(MAX_ROWS == 16, "the query rows are one mma tile");
static_assert(VEC_LOAD == 1, "the tensor-core kernel copies 16 bytes at a time");
static_assert(TC_MIN_BLOCKS >= 1 && TC_MIN_BLOCKS <= 4, "TC_MIN_BLOCKS: CTAs per SM");

// Copies keys n0 .. n0 + TC_BLOCK_N of kv head hk of sequence b (page lookups per row) into the
// swizzled k and v tiles by cp.async; keys at or past n_end and columns at or past head_dim become
// 0 (nothing is read for them).
__device__ __forceinline__ void tc_load_kv(u16* k_tile, u16* v_tile, const u16* k_cache,
                                           const u16* v_cache, const int* pages,
                                           const DecodeParams& p, int b, int hk, int n0,
                                           int n_end) {
    constexpr int CH = HEAD_DIM / 8;  // 16-byte chunks per row
#pragma unroll
    for (int c = threadIdx.x; c < TC_BLOCK_N * CH; c += NUM_THREADS) {
        const int r = c / CH, col = (c % CH) * 8, j = n0 + r;
        const bool ok = j < n_end && col < p.head_dim;
        const u16* kg = k_cache;
        const u16* vg = v_cache;
        if (ok) {
            const i64 page = pages[(i64)b * p.max_blocks + j / p.page_size];
            const i64 row = j % p.page_size;
            kg = k_cache + page * p.k_page_stride + row * p.k_row_stride +
                 (i64)hk * p.k_head_stride + col;
            vg = v_cache + page * p.v_page_stride + row * p.v_row_stride +
                 (i64)hk * p.v_head_stride + col;
        }
        cp_async16(smem_addr(k_tile + swz(r, col)), kg, ok ? 16 : 0);
        cp_async16(smem_addr(v_tile + swz(r, col)), vg, ok ? 16 : 0);
    }
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, TC_MIN_BLOCKS)
decode_split(const __grid_constant__ DecodeParams p) {
    DECODE_SPLIT_POINTERS(p);
    FA_DYNAMIC_SMEM(u16, smem);
    u16* q_tile = smem;                                   // [MAX_ROWS][SMEM_ROW]
    u16* k_tiles = q_tile + MAX_ROWS * SMEM_ROW;          // [2][TC_BLOCK_N][SMEM_ROW]
    u16* v_tiles = k_tiles + 2 * TC_BLOCK_N * SMEM_ROW;   // [2][TC_BLOCK_N][SMEM_ROW]
    float* m_part = (float*)(v_tiles + 2 * TC_BLOCK_N * SMEM_ROW);  // [NUM_WARPS][MAX_ROWS]
    float* l_part = m_part + NUM_WARPS * MAX_ROWS;                  // [NUM_WARPS][MAX_ROWS]
    // After the key loop the stages hold the warps' rows: [NUM_WARPS][MAX_ROWS][HEAD_DIM] f32.
    float* o_part = (float*)k_tiles;

    SplitWork w;
    if (!split_work(w, p)) return;
    const int b = w.b, hk = w.hk, sp = w.sp, group = w.group, r0 = w.r0, nrows = w.nrows;
    const int leftpad = w.leftpad, n_lo = w.n_lo, n_hi = w.n_hi;
    const i64 q_base = w.q_base, out_row0 = w.out_row0;
    const Mask& mask = w.mask;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;  // mma fragment row group and column pair

    const int ntiles = (n_hi - n_lo + TC_BLOCK_N - 1) / TC_BLOCK_N;

    ScoreMod mods;
    mods.scale_log2 = p.softmax_scale * FA_LOG2E;
    mods.cap_in = p.softmax_scale / p.softcap;
    mods.cap_out = p.softcap * FA_LOG2E;
    mods.offset = mask.offset;
    // This thread's two rows of the tile, g and g + 8: query position, visible keys, ALiBi slope
    // (rows past nrows see no key).
    int pos[2], row_lo[2], row_hi[2];
    float slope[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int rr = g + 8 * r;
        const bool valid = rr < nrows;
        const int i = (r0 + rr) / group, h = hk * group + (r0 + rr) % group;
        pos[r] = valid ? i : 0;
        row_lo[r] = valid ? max(mask.lo(i), leftpad) : 0;
        row_hi[r] = valid ? mask.hi(i) : 0;
        slope[r] = HAS_ALIBI && valid ? alibi_slopes[b * p.heads + h] * FA_LOG2E : 0.f;
    }

    // The first stage's copies go out before q is prepared.
    if (ntiles > 0)
        tc_load_kv(k_tiles, v_tiles, k_cache, v_cache, pages, p, b, hk, n_lo, n_hi);
    cp_async_commit();
    // q rows, rotated in f32 at flash-attn's positions (as the CUDA-core kernel), rounded once to
    // the cache's type; rows past nrows and columns past head_dim are 0.
    for (int e = tid; e < MAX_ROWS * HEAD_DIM; e += NUM_THREADS) {
        const int rr = e / HEAD_DIM, col = e % HEAD_DIM;
        float x = 0.f;
        if (rr < nrows && col < p.head_dim && ntiles > 0) {
            const int ir = (r0 + rr) / group, hr = hk * group + (r0 + rr) % group;
            const elem_t* src = q + q_base + (i64)ir * p.q_row_stride + (i64)hr * p.q_head_stride;
            const float* cs =
                rot == nullptr ? nullptr
                               : rot + ((i64)b * p.rot_npos + (IS_MASKED ? ir : 0)) * 2 *
                                           p.rot_half;
            x = rotated(src, col, cs, p.rot_half, p.rot_interleaved);
        }
        q_tile[swz(rr, col)] = from_f32(x);
    }

    float acc_o[HEAD_DIM / 8][4];
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 8; ++i)
        acc_o[i][0] = acc_o[i][1] = acc_o[i][2] = acc_o[i][3] = 0.f;
    float row_max[2] = {-FA_INF, -FA_INF}, row_sum[2] = {0.f, 0.f};

    for (int it = 0; it < ntiles; ++it) {
        const int buf = it & 1;
        cp_async_wait<0>();
        // Stage `buf` (this thread's copies done above) is complete for every thread, q is
        // written, and every warp has finished the previous stage, so its buffer can be refilled.
        __syncthreads();
        if (it + 1 < ntiles) {
            tc_load_kv(k_tiles + (buf ^ 1) * TC_BLOCK_N * SMEM_ROW,
                       v_tiles + (buf ^ 1) * TC_BLOCK_N * SMEM_ROW, k_cache, v_cache, pages, p, b,
                       hk, n_lo + (it + 1) * TC_BLOCK_N, n_hi);
            cp_async_commit();
        }
        // This warp's 16 keys (a multiple of 8 rows into the tile, so the swizzle is the tile's).
        const int koff = (buf * TC_BLOCK_N + warp * TC_WARP_N) * SMEM_ROW;
        float sc[TC_WARP_N / 8][4];
        mma_abt<TC_WARP_N>(sc, q_tile, k_tiles + koff, 0, lane);

        // Scores to the log2 domain; keys outside the row's range or past this split's end
        // (zero-filled rows) become -inf.
        const int n0 = n_lo + it * TC_BLOCK_N + warp * TC_WARP_N;
#pragma unroll
        for (int nt = 0; nt < TC_WARP_N / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1, j = n0 + nt * 8 + 2 * t + (e & 1);
                mods.alibi_log2 = slope[r];
                float x = mods.apply(sc[nt][e], pos[r], j);
                if (j >= n_hi || j < row_lo[r] || j >= row_hi[r]) x = -FA_INF;
                sc[nt][e] = x;
            }
        }

        // Online softmax over this warp's keys.
        online_softmax_step<TC_WARP_N>(sc, row_max, row_sum, acc_o);
        mma_xb<TC_WARP_N>(acc_o, sc, v_tiles + koff, lane);
    }
    cp_async_wait<0>();  // an empty split committed an empty group

    // The warps' partial rows into shared memory (the stages are free once every warp is done).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
        row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int rr = g + 8 * r;
        if (t == 0) {
            m_part[warp * MAX_ROWS + rr] = row_max[r];
            l_part[warp * MAX_ROWS + rr] = row_sum[r];
        }
        float* o = o_part + (warp * MAX_ROWS + rr) * HEAD_DIM;
#pragma unroll
        for (int dt = 0; dt < HEAD_DIM / 8; ++dt) {
            o[dt * 8 + 2 * t] = acc_o[dt][2 * r];
            o[dt * 8 + 2 * t + 1] = acc_o[dt][2 * r + 1];
        }
    }
    __syncthreads();

    // Each row merged over the warps and normalised: partial out (f32) and LSE into this split's
    // workspace, as the CUDA-core kernel writes them.
    for (int e = tid; e < nrows * HEAD_DIM; e += NUM_THREADS) {
        const int rr = e / HEAD_DIM, col = e % HEAD_DIM;
        if (col >= p.head_dim) continue;
        float mx = -FA_INF;
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w) mx = fmaxf(mx, m_part[w * MAX_ROWS + rr]);
        const float m_use = mx == -FA_INF ? 0.f : mx;
        float l = 0.f, o = 0.f;
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w) {
            const float f = fa_exp2(m_part[w * MAX_ROWS + rr] - m_use);
            l += l_part[w * MAX_ROWS + rr] * f;
            o += o_part[(w * MAX_ROWS + rr) * HEAD_DIM + col] * f;
        }
        const int i = (r0 + rr) / group, h = hk * group + (r0 + rr) % group;
        const i64 row = (out_row0 + i) * p.heads + h;
        ws_o[((i64)sp * p.total_rows + row) * p.head_dim + col] = l == 0.f ? 0.f : o / l;
        if (col == 0)
            ws_lse[(i64)sp * p.total_rows + row] = l == 0.f ? -FA_INF : (mx + log2f(l)) * FA_LN2;
    }
}
#endif  // FA_DECODE_ENTRY == 1, DECODE_TC

#if FA_DECODE_ENTRY == 2 || FA_DECODE_ENTRY == 0
// grid (seqlen_q * heads of the longest sequence, ceil(head_dim / 32), sequences), 128 threads:
// block (x, y, z) merges dims 32y .. 32y + 32 of row x = (query i, head h) of sequence z. Every
// warp finds the splits' largest lse and the sum of their weights (lanes over splits); then warp
// w takes dims 32y + 8w .. + 8, its lane 8g + j dim j of them over the splits g, g + 4, g + 8, ..
// (independent loads, a 32-byte sector per split and group), and the four groups' sums are added
// by shuffles. History, the decode benchmark shape on an H100: a warp per row reading the 49 splits one
// after another took 91 us (the split kernel 62 us); a block per row with a thread per dim 27 us;
// this layout spreads the same loads over 4x the blocks and 4x the loads in flight per thread.
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
decode_combine(const __grid_constant__ DecodeParams p) {
    const float* __restrict__ ws_o = p.ws_o;
    const float* __restrict__ ws_lse = p.ws_lse;
    elem_t* __restrict__ out = static_cast<elem_t*>(p.out);
    float* __restrict__ lse = p.lse;
    const i64* __restrict__ seqs = p.seqs;
    const float* __restrict__ sink = p.sink;
    const i64* s = seqs + DECODE_FIELDS * blockIdx.z;
    const int seqlen_q = (int)s[0];
    const i64 out_row0 = s[4], lse_base = s[5];
    const int idx = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (idx >= seqlen_q * p.heads) return;
    const int i = idx / p.heads, h = idx % p.heads;
    const i64 row = (out_row0 + i) * p.heads + h;
    const int g = lane / 8, x = blockIdx.y * 32 + warp * 8 + lane % 8;
    const bool writes = g == 0 && x < p.head_dim;
    const bool first = blockIdx.y == 0 && threadIdx.x == 0;
    float mx = -FA_INF;
    for (int sp = lane; sp < p.splits; sp += 32)
        mx = fmaxf(mx, ws_lse[(i64)sp * p.total_rows + row]);
    // A learnable sink joins as one more split with lse = sink and a zero row (the CPU path folds
    // it in after its merge, in f64; the same sum, rounded in f32 here).
    // Its logit sits at (launched sequence z) * heads + h, -inf for none and for the tail of
    // packed rows after the last sequence.
    const float sk = sink != nullptr ? sink[(i64)blockIdx.z * p.heads + h] : -FA_INF;
    mx = fmaxf(warp_max(mx), sk);
    elem_t* o = out + row * p.head_dim;
    if (mx == -FA_INF) {
        // No split saw a key (and no sink): 0 and -inf, as the CPU path's fully-masked-row rule.
        if (writes) o[x] = from_f32_elem(0.f);
        if (first) lse[lse_base + (i64)h * p.lse_head_stride + i] = -FA_INF;
        return;
    }
    float sum = 0.f;
    for (int sp = lane; sp < p.splits; sp += 32)
        sum += expf(ws_lse[(i64)sp * p.total_rows + row] - mx);
    sum = warp_sum(sum) + expf(sk - mx);
    const float inv = 1.f / sum;
    float acc = 0.f;
    if (x < p.head_dim) {
#pragma unroll 4
        for (int sp = g; sp < p.splits; sp += 4) {
            const float l = ws_lse[(i64)sp * p.total_rows + row];
            const float v = ws_o[((i64)sp * p.total_rows + row) * p.head_dim + x];
            // A split that saw no key (lse -inf) adds nothing, whatever its row holds.
            acc = l == -FA_INF ? acc : fmaf(expf(l - mx) * inv, v, acc);
        }
    }
    // Every lane takes part (the shuffles name the whole warp); lanes past head_dim add zeros.
    acc += __shfl_xor_sync(0xffffffffu, acc, 8);
    acc += __shfl_xor_sync(0xffffffffu, acc, 16);
    if (writes) o[x] = from_f32_elem(acc);
    if (first) lse[lse_base + (i64)h * p.lse_head_stride + i] = mx + logf(sum);
}
#endif  // FA_DECODE_ENTRY == 2

#if FA_DECODE_ENTRY == 3 || FA_DECODE_ENTRY == 0
// grid (heads_kv), 128 threads: thread x writes dims x, x + 128 of kv head blockIdx.x for every
// new row of every sequence, in batch order. Two batch rows that share a cache row (a repeated
// cache_batch_idx, a shared page) then overwrite each other in batch order, as on the CPU, never
// concurrently. (One CTA per kv head: a decode step appends a few rows; a prefill-sized append
// runs its rows one after another.)
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
decode_append(const __grid_constant__ DecodeParams p) {
    const elem_t* __restrict__ k_new = static_cast<const elem_t*>(p.k_new);
    const elem_t* __restrict__ v_new = static_cast<const elem_t*>(p.v_new);
    cache_t* __restrict__ k_cache = static_cast<cache_t*>(p.k_cache);
    cache_t* __restrict__ v_cache = static_cast<cache_t*>(p.v_cache);
    const i64* __restrict__ seqs = p.seqs;
    const int* __restrict__ pages = p.pages;
    const float* __restrict__ rot = p.rot;
#ifdef FA_FP8_CACHE
    const float* __restrict__ descale = p.descale;
#endif
    const int hk = blockIdx.x;
    for (int b = 0; b < p.batch; ++b) {
        const i64* s = seqs + DECODE_FIELDS * b;
        const int cache_seqlen = (int)s[6], new_len = (int)s[7];
        const i64 kn_base = s[8], vn_base = s[9];
        for (int t = 0; t < new_len; ++t) {
            const int j = cache_seqlen + t;
            const i64 page = pages[(i64)b * p.max_blocks + j / p.page_size];
            const i64 row = j % p.page_size;
            const elem_t* ks =
                k_new + kn_base + (i64)t * p.kn_row_stride + (i64)hk * p.kn_head_stride;
            const elem_t* vs =
                v_new + vn_base + (i64)t * p.vn_row_stride + (i64)hk * p.vn_head_stride;
            cache_t* kd =
                k_cache + page * p.k_page_stride + row * p.k_row_stride + hk * p.k_head_stride;
            cache_t* vd =
                v_cache + page * p.v_page_stride + row * p.v_row_stride + hk * p.v_head_stride;
            const float* cs =
                rot == nullptr ? nullptr : rot + ((i64)b * p.rot_npos + t) * 2 * p.rot_half;
#ifdef FA_FP8_CACHE
            const i64 fac = 3 * ((i64)b * gridDim.x + hk);  // gridDim.x = heads_kv
            const double kf = descale[fac + 1], vf = descale[fac + 2];
            for (int x = threadIdx.x; x < p.head_dim; x += NUM_THREADS) {
                kd[x] = f64_to_fp8((double)rotated(ks, x, cs, p.rot_half, p.rot_interleaved) / kf, p.fp8_e5m2);
                vd[x] = f64_to_fp8((double)to_f32(vs[x]) / vf, p.fp8_e5m2);
            }
#else
            for (int x = threadIdx.x; x < p.head_dim; x += NUM_THREADS) {
                kd[x] = cs == nullptr ? ks[x] : from_f32_elem(rotated(ks, x, cs, p.rot_half, p.rot_interleaved));
                vd[x] = vs[x];
            }
#endif
        }
    }
}
#endif  // FA_DECODE_ENTRY == 3
