// Decoding with a KV cache (flash-attn's flash_attn_with_kvcache; flash-decoding) on CUDA cores.
//
// Decoding reads the whole cache for a handful of query rows, so it is bound by memory bandwidth,
// not by the multiply units: plain f32 FMAs on CUDA cores, with the elements widened as they are
// loaded, serve f32, f16 and bf16 caches alike. The file holds three kernels, one per compile
// (FA_DECODE_ENTRY):
//   1 decode_split    one CTA per (query row block, key split, kv head, sequence): the query rows
//                     of one kv head's group (position i, head h: row i * group + h % group, up
//                     to BLOCK_M = 16 of them) against its share of the sequence's keys, read in
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
// Defines: FA_DECODE_ENTRY (0: all three, for the host emulation); FA_BF16 or FA_F16 (else f32); HEAD_DIM (padded head_dim, a multiple
// of 32), IS_MASKED (causal or window), HAS_SOFTCAP, HAS_ALIBI.
#include "common.cuh"

#define DECODE_FIELDS 10
#define BLOCK_M 16
#define BLOCK_N 32
#define NUM_THREADS 128
#define PITCH (HEAD_DIM + 1)
#define P_PITCH (BLOCK_N + 1)

static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM <= 256, "HEAD_DIM: a multiple of 32, at most 256");
static_assert(NUM_THREADS == 8 * BLOCK_M && BLOCK_N == 32, "8 threads per row, 4 keys each");

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

// Element (x) of a rotated head row `src` (its first 2 * half elements rotated by cos/sin `cs`:
// half cos values, then half sin values): GPT-J pairs (2i, 2i + 1) when interleaved, else GPT-NeoX
// pairs (i, i + half). Computed in f32, as the CPU path does.
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
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
decode_split(const elem_t* __restrict__ q, const elem_t* __restrict__ k_cache,
             const elem_t* __restrict__ v_cache, float* __restrict__ ws_o,
             float* __restrict__ ws_lse, const i64* __restrict__ seqs,
             const int* __restrict__ pages, const float* __restrict__ alibi_slopes,
             const float* __restrict__ rot, int heads, int heads_kv, int head_dim, int splits,
             i64 q_row_stride, i64 q_head_stride, i64 k_page_stride, i64 k_row_stride,
             i64 k_head_stride, i64 v_page_stride, i64 v_row_stride, i64 v_head_stride,
             int page_size, int max_blocks, float softmax_scale, float softcap, int window_left,
             int window_right, int rot_half, int rot_interleaved, int rot_npos, i64 total_rows) {
    FA_DYNAMIC_SMEM(float, smem_f);
    float* q_tile = smem_f;                       // [BLOCK_M][PITCH]
    float* k_tile = q_tile + BLOCK_M * PITCH;     // [BLOCK_N][PITCH]
    float* v_tile = k_tile + BLOCK_N * PITCH;     // [BLOCK_N][HEAD_DIM]
    float* p_tile = v_tile + BLOCK_N * HEAD_DIM;  // [BLOCK_M][P_PITCH]
    // The tile's row offsets (kv head hk) in k_cache and v_cache. The float count above is even
    // (80 HEAD_DIM + 576), so this is 8-byte aligned.
    i64* k_off = (i64*)(p_tile + BLOCK_M * P_PITCH);
    i64* v_off = k_off + BLOCK_N;

    const int b = blockIdx.z, hk = blockIdx.y;
    const int rb = blockIdx.x / splits, sp = blockIdx.x % splits;
    const i64* s = seqs + DECODE_FIELDS * b;
    const int seqlen_q = (int)s[0], seqlen_k = (int)s[1], leftpad = (int)s[2];
    const i64 q_base = s[3], out_row0 = s[4];
    const int group = heads / heads_kv;
    const int rows = seqlen_q * group;
    const int r0 = rb * BLOCK_M;
    if (r0 >= rows) return;
    const int r_end = min(r0 + BLOCK_M, rows);

    // Keys this CTA's rows see (both ends of a row's window grow with its position), from the
    // first visible one at leftpad on; this split's share of them.
    const Mask mask{seqlen_k, seqlen_k - seqlen_q, window_left, window_right};
    const int lo = max(mask.lo(r0 / group), leftpad);
    const int hi = max(mask.hi((r_end - 1) / group), lo);
    const int chunk = (hi - lo + splits - 1) / splits;
    const int n_lo = min(lo + sp * chunk, hi), n_hi = min(lo + (sp + 1) * chunk, hi);

    // This thread's row and column phase; rows past r_end see no key.
    const int r = threadIdx.x / 8, c8 = threadIdx.x % 8;
    const bool valid = r0 + r < r_end;
    const int i = valid ? (r0 + r) / group : 0;
    const int h = hk * group + (valid ? (r0 + r) % group : 0);
    const int row_lo = valid ? max(mask.lo(i), leftpad) : 0;
    const int row_hi = valid ? mask.hi(i) : 0;
    ScoreMod mods;
    mods.scale_log2 = softmax_scale * FA_LOG2E;
    mods.cap_in = softmax_scale / softcap;
    mods.cap_out = softcap * FA_LOG2E;
    mods.alibi_log2 = HAS_ALIBI ? alibi_slopes[b * heads + h] * FA_LOG2E : 0.f;
    mods.offset = mask.offset;

    float acc_o[HEAD_DIM / 8];
#pragma unroll
    for (int c = 0; c < HEAD_DIM / 8; ++c) acc_o[c] = 0.f;
    float row_max = -FA_INF, row_sum = 0.f;

    if (n_lo < n_hi) {
        // q rows in f32, rotated at flash-attn's positions: query i at cache_seqlen + i under a
        // causal or window mask, every query at cache_seqlen otherwise.
        for (int e = threadIdx.x; e < BLOCK_M * HEAD_DIM; e += NUM_THREADS) {
            const int rr = e / HEAD_DIM, col = e % HEAD_DIM;
            float x = 0.f;
            if (r0 + rr < r_end && col < head_dim) {
                const int ir = (r0 + rr) / group, hr = hk * group + (r0 + rr) % group;
                const elem_t* src = q + q_base + (i64)ir * q_row_stride + (i64)hr * q_head_stride;
                const float* cs =
                    rot == nullptr
                        ? nullptr
                        : rot + ((i64)b * rot_npos + (IS_MASKED ? ir : 0)) * 2 * rot_half;
                x = rotated(src, col, cs, rot_half, rot_interleaved);
            }
            q_tile[rr * PITCH + col] = x;
        }
    }

    for (int n0 = n_lo; n0 < n_hi; n0 += BLOCK_N) {
        if (threadIdx.x < BLOCK_N) {
            const int j = min(n0 + (int)threadIdx.x, n_hi - 1);
            const i64 page = pages[(i64)b * max_blocks + j / page_size];
            const i64 row = j % page_size;
            k_off[threadIdx.x] = page * k_page_stride + row * k_row_stride + hk * k_head_stride;
            v_off[threadIdx.x] = page * v_page_stride + row * v_row_stride + hk * v_head_stride;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < BLOCK_N * HEAD_DIM; e += NUM_THREADS) {
            const int rr = e / HEAD_DIM, col = e % HEAD_DIM;
            const bool ok = n0 + rr < n_hi && col < head_dim;
            k_tile[rr * PITCH + col] = ok ? to_f32(k_cache[k_off[rr] + col]) : 0.f;
            v_tile[rr * HEAD_DIM + col] = ok ? to_f32(v_cache[v_off[rr] + col]) : 0.f;
        }
        __syncthreads();

        float sc[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int jc = c8 + 8 * u;
            float dot = 0.f;
#pragma unroll 8
            for (int d = 0; d < HEAD_DIM; ++d) dot = fmaf(q_tile[r * PITCH + d], k_tile[jc * PITCH + d], dot);
            const int j = n0 + jc;
            float x = mods.apply(dot, i, j);
            if (j < row_lo || j >= row_hi || j >= n_hi) x = -FA_INF;
            sc[u] = x;
        }
        float mx = fmaxf(fmaxf(sc[0], sc[1]), fmaxf(sc[2], sc[3]));
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
            sc[u] = fa_exp2(sc[u] - m_use);
            sum += sc[u];
            p_tile[r * P_PITCH + c8 + 8 * u] = sc[u];
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        sum += __shfl_xor_sync(0xffffffffu, sum, 4);
        row_sum = row_sum * alpha + sum;
        __syncwarp();  // the row's P was written by lanes of this warp only
#pragma unroll
        for (int c = 0; c < HEAD_DIM / 8; ++c) {
            float acc = acc_o[c] * alpha;
            const int col = c8 + 8 * c;
#pragma unroll 8
            for (int jc = 0; jc < BLOCK_N; ++jc) acc = fmaf(p_tile[r * P_PITCH + jc], v_tile[jc * HEAD_DIM + col], acc);
            acc_o[c] = acc;
        }
        __syncthreads();  // the tiles are rewritten next
    }

    if (valid) {
        const i64 row = (out_row0 + i) * heads + h;
        const float inv = row_sum == 0.f ? 0.f : 1.f / row_sum;
        float* o = ws_o + ((i64)sp * total_rows + row) * head_dim;
#pragma unroll
        for (int c = 0; c < HEAD_DIM / 8; ++c) {
            const int col = c8 + 8 * c;
            if (col < head_dim) o[col] = acc_o[c] * inv;
        }
        if (c8 == 0)
            ws_lse[(i64)sp * total_rows + row] =
                row_sum == 0.f ? -FA_INF : (row_max + log2f(row_sum)) * FA_LN2;
    }
}
#endif  // FA_DECODE_ENTRY == 1

#if FA_DECODE_ENTRY == 2 || FA_DECODE_ENTRY == 0
// grid (ceil(seqlen_q * heads / 4), 1, sequences), 128 threads: warp w merges row
// blockIdx.x * 4 + w = (query i, head h) of sequence blockIdx.z.
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
decode_combine(const float* __restrict__ ws_o, const float* __restrict__ ws_lse,
               elem_t* __restrict__ out, float* __restrict__ lse, const i64* __restrict__ seqs,
               int heads, int head_dim, int splits, i64 lse_head_stride, i64 total_rows) {
    const i64* s = seqs + DECODE_FIELDS * blockIdx.z;
    const int seqlen_q = (int)s[0];
    const i64 out_row0 = s[4], lse_base = s[5];
    const int idx = blockIdx.x * (NUM_THREADS / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (idx >= seqlen_q * heads) return;
    const int i = idx / heads, h = idx % heads;
    const i64 row = (out_row0 + i) * heads + h;
    float mx = -FA_INF;
    for (int sp = 0; sp < splits; ++sp) mx = fmaxf(mx, ws_lse[(i64)sp * total_rows + row]);
    elem_t* o = out + row * head_dim;
    if (mx == -FA_INF) {
        // No split saw a key: 0 and -inf, as the CPU path's fully-masked-row rule.
        for (int x = lane; x < head_dim; x += 32) o[x] = from_f32_elem(0.f);
        if (lane == 0) lse[lse_base + (i64)h * lse_head_stride + i] = -FA_INF;
        return;
    }
    float sum = 0.f;
    for (int sp = 0; sp < splits; ++sp) sum += expf(ws_lse[(i64)sp * total_rows + row] - mx);
    const float inv = 1.f / sum;
    for (int x = lane; x < head_dim; x += 32) {
        float acc = 0.f;
        for (int sp = 0; sp < splits; ++sp) {
            const float l = ws_lse[(i64)sp * total_rows + row];
            if (l == -FA_INF) continue;  // whatever such a split holds cannot leak in
            acc += expf(l - mx) * inv * ws_o[((i64)sp * total_rows + row) * head_dim + x];
        }
        o[x] = from_f32_elem(acc);
    }
    if (lane == 0) lse[lse_base + (i64)h * lse_head_stride + i] = mx + logf(sum);
}
#endif  // FA_DECODE_ENTRY == 2

#if FA_DECODE_ENTRY == 3 || FA_DECODE_ENTRY == 0
// grid (heads_kv), 128 threads: thread x writes dims x, x + 128 of kv head blockIdx.x for every
// new row of every sequence, in batch order. Two batch rows that share a cache row (a repeated
// cache_batch_idx, a shared page) then overwrite each other in batch order, as on the CPU, never
// concurrently. (One CTA per kv head: a decode step appends a few rows; a prefill-sized append
// runs its rows one after another.)
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
decode_append(const elem_t* __restrict__ k_new, const elem_t* __restrict__ v_new,
              elem_t* __restrict__ k_cache, elem_t* __restrict__ v_cache,
              const i64* __restrict__ seqs, const int* __restrict__ pages,
              const float* __restrict__ rot, int batch, int head_dim, i64 kn_row_stride,
              i64 kn_head_stride, i64 vn_row_stride, i64 vn_head_stride, i64 k_page_stride,
              i64 k_row_stride, i64 k_head_stride, i64 v_page_stride, i64 v_row_stride,
              i64 v_head_stride, int page_size, int max_blocks, int rot_half,
              int rot_interleaved, int rot_npos) {
    const int hk = blockIdx.x;
    for (int b = 0; b < batch; ++b) {
        const i64* s = seqs + DECODE_FIELDS * b;
        const int cache_seqlen = (int)s[6], new_len = (int)s[7];
        const i64 kn_base = s[8], vn_base = s[9];
        for (int t = 0; t < new_len; ++t) {
            const int j = cache_seqlen + t;
            const i64 page = pages[(i64)b * max_blocks + j / page_size];
            const i64 row = j % page_size;
            const elem_t* ks = k_new + kn_base + (i64)t * kn_row_stride + (i64)hk * kn_head_stride;
            const elem_t* vs = v_new + vn_base + (i64)t * vn_row_stride + (i64)hk * vn_head_stride;
            elem_t* kd = k_cache + page * k_page_stride + row * k_row_stride + hk * k_head_stride;
            elem_t* vd = v_cache + page * v_page_stride + row * v_row_stride + hk * v_head_stride;
            const float* cs = rot == nullptr ? nullptr : rot + ((i64)b * rot_npos + t) * 2 * rot_half;
            for (int x = threadIdx.x; x < head_dim; x += NUM_THREADS) {
                kd[x] = cs == nullptr ? ks[x] : from_f32_elem(rotated(ks, x, cs, rot_half, rot_interleaved));
                vd[x] = vs[x];
            }
        }
    }
}
#endif  // FA_DECODE_ENTRY == 3
