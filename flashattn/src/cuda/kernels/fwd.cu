// FlashAttention-2 forward for f16 / bf16 on sm_80 and newer, accumulation in f32.
//
// One CTA computes BLOCK_M query rows of one (sequence, head); each of its NUM_WARPS warps owns
// M_TILES blocks of 16 rows (key.rs picks 2 where the registers allow, as FlashAttention-2's 4
// warps x 32 rows: every K and V fragment read from shared memory then feeds two mma blocks).
// For every key block the CTA can see (the key range comes from the mask rule, so blocks a causal
// or windowed CTA cannot see are never loaded):
//   S = Q·Kᵀ     tensor cores, mma.sync m16n8k16, operands from shared memory by ldmatrix;
//   mask/mods    scale, softcap, ALiBi, mask (the per-element mask only on blocks it cuts);
//   softmax      online, in registers: row_max / row_sum per row, acc_o rescaled by alpha;
//   acc_o += P·V P stays in registers (the S accumulators re-packed as the A operand), V read with
//                ldmatrix.trans.
// K and V tiles are double-buffered with cp.async: block n+1 loads while block n computes. Shared
// memory rows are swizzled (16-byte chunk index XOR row % 8) so ldmatrix reads 8 distinct banks.
// The output is divided by row_sum once at the end; lse = (row_max + log2(row_sum)) · ln 2.
//
// Defines (set from the Rust KernelKey, cuda/key.rs):
//   FA_BF16 (else f16), HEAD_DIM (padded head_dim, multiple of 32), SMEM_ROW (row pitch in
//   elements, multiple of 64), BLOCK_M, BLOCK_N, NUM_WARPS, IS_MASKED (causal or window),
//   HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, VEC_LOAD (head_dim and every row/head stride a multiple of 8 elements
//   and 16-byte-aligned bases: tiles move by cp.async 16 bytes at a time; else element by element);
//   FA_FP8_INPUT (with FA_BF16): q, k and v hold FP8 bytes (see below; VEC_LOAD then means
//   head_dim, strides and bases multiples of 16 elements).
//
// FP8 inputs (flashattn::fp8::flash_attn_fp8 on the CPU): the kernel is the bf16 one, fed from
// FP8 bytes. Every e4m3 and e5m2 value is a bf16 value, so the tiles are widened exactly: the raw
// bytes of the next key block are staged in shared memory by cp.async (double-buffered, the same
// overlap as the 16-bit kernel) and widened into single bf16 K and V tiles just before use. The
// format is a launch argument (fp8_e5m2); the folded score scale and v_descale of each (sequence,
// kv head) come from `descale` (params.cuh: FwdParams). out is bf16. Per-block factors
// (FwdParams block_q): a CTA's rows lie in one 128-row query block (BLOCK_M divides 128), so its
// q factor is fixed; the score scale q · k factor is set per key block (BLOCK_N divides 128), and
// the key block's v factor over the largest of the (sequence, kv head) multiplies P after row_sum
// took it (row_sum normalises the unscaled P), the largest multiplying the finished rows.
#define FA_TENSOR_CORE_KERNEL
#define NUM_THREADS (NUM_WARPS * 32)
#include "common.cuh"

static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM <= 256, "HEAD_DIM: a multiple of 32, at most 256");
static_assert(SMEM_ROW % 64 == 0 && SMEM_ROW >= HEAD_DIM, "SMEM_ROW: whole swizzle groups");
#define M_TILES (BLOCK_M / (16 * NUM_WARPS))
static_assert(BLOCK_M == 16 * NUM_WARPS * M_TILES && M_TILES >= 1,
              "each warp owns whole 16-row tiles");
static_assert(BLOCK_N % 16 == 0, "key blocks are whole mma k-steps");

// Shared-memory addressing of the products' ldmatrix reads. A lane's x4 read at 16-row block 0 and
// k-step 0 starts at (row, chunk c in 0..1) of a swizzled tile (tiles.cuh: swz); at k-step kk
// its chunk is 2kk + c, whose byte offset is that of k-step 0 with bits 4-6 XORed by
// 16 · (2kk mod 8), plus 128 bytes per 8 chunks (rows are whole 128-byte swizzle groups, so
// row · row_bytes has bits 4-6 clear); another 16-row block adds 16 rows, which keeps row % 8.
// Every read is then a base register plus one XOR and an immediate, so the compiler need not keep
// an address per (k-step, block) live across the key loop.
#define ROW_BYTES (2 * SMEM_ROW)
__device__ __forceinline__ u32 frag_offset(int row, int c) {
    return (u32)(row * ROW_BYTES + ((c ^ (row & 7)) << 4));
}
__device__ __forceinline__ u32 kstep_offset(u32 off, int kk) {
    return (off ^ (u32)((2 * kk & 7) << 4)) + (u32)((kk >> 2) * 128);
}

// c[t][n] and c[t][n + 1] += the t-th A fragment times the two n8 halves of one x4 B fragment
// (mma.cuh: mma_x4), for every block t: each B fragment read from shared memory feeds all MT
// blocks.
template <int MT, int N>
__device__ __forceinline__ void mma_x4_mt(float (&c)[MT][N][4], int n, const u32 (&af)[MT][4],
                                          const u32 (&bf)[4]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) mma_x4(c[mt][n], c[mt][n + 1], af[mt], bf);
}

// x[t][·][NCOLS] = A·Bᵀ for MT 16-row blocks of the tile at `a` (this lane's offset a_off) and
// the NCOLS rows of the tile at `b` (b_off): S = Q·Kᵀ. Each K fragment feeds all MT blocks.
template <int MT, int NCOLS>
__device__ __forceinline__ void mma_abt_mt(float (&x)[MT][NCOLS / 8][4], u32 a, u32 a_off, u32 b,
                                           u32 b_off) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < NCOLS / 8; ++i)
            x[mt][i][0] = x[mt][i][1] = x[mt][i][2] = x[mt][i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        u32 af[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            ldsm_x4(af[mt], a + kstep_offset(a_off, kk) + mt * 16 * ROW_BYTES);
#pragma unroll
        for (int np = 0; np < NCOLS / 16; ++np) {
            u32 bf[4];
            ldsm_x4(bf, b + kstep_offset(b_off, kk) + np * 16 * ROW_BYTES);
            mma_x4_mt(x, 2 * np, af, bf);
        }
    }
}

// acc[t][·][HEAD_DIM] += X_t·B for MT blocks: X_t the t-th 16 x NK block of accumulators (rounded
// to the input type as the A operand) and B the tile at `b` ([NK][HEAD_DIM], read transposed;
// this lane's offset b_off): O += P·V. Each V fragment feeds all MT blocks.
template <int MT, int NK>
__device__ __forceinline__ void mma_xb_mt(float (&acc)[MT][HEAD_DIM / 8][4],
                                          const float (&x)[MT][NK / 8][4], u32 b, u32 b_off) {
#pragma unroll
    for (int j = 0; j < NK / 16; ++j) {
        u32 af[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) pack_kstep<NK>(af[mt], x[mt], j);
#pragma unroll
        for (int dp = 0; dp < HEAD_DIM / 16; ++dp) {
            u32 bf[4];
            ldsm_x4_trans(bf, b + kstep_offset(b_off, dp) + j * 16 * ROW_BYTES);
            mma_x4_mt(acc, 2 * dp, af, bf);
        }
    }
}

#ifdef FA_FP8_INPUT
#ifndef FA_BF16
#error "FA_FP8_INPUT widens to bf16 tiles: compile with FA_BF16"
#endif
typedef unsigned char in_t;
#define KV_BUFS 1  // bf16 K and V tiles; the double buffering is in the raw staging area
static_assert(BLOCK_M <= 4 * BLOCK_N, "the q tile's bytes fit the staging area");

// 16 bytes at p (16-byte aligned) as four words, the lower address in the low byte of w[0].
__device__ __forceinline__ void ld16(u32 w[4], const void* p) {
#ifdef FA_HOST_EMULATION
    std::memcpy(w, p, 16);
#else
    const uint4 a = *reinterpret_cast<const uint4*>(p);
    w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w;
#endif
}

__device__ __forceinline__ void st16(void* p, const u32 w[4]) {
#ifdef FA_HOST_EMULATION
    std::memcpy(p, w, 16);
#else
    uint4 a;
    a.x = w[0], a.y = w[1], a.z = w[2], a.w = w[3];
    *reinterpret_cast<uint4*>(p) = a;
#endif
}

// Two FP8 bytes as a bf16 pair (`lo` at the lower address), exactly: the f32 value's upper half.
__device__ __forceinline__ u32 fp8x2_to_bf16x2(u32 lo, u32 hi, int e5m2) {
    return (__float_as_uint(fp8_to_f32(lo, e5m2)) >> 16) |
           (__float_as_uint(fp8_to_f32(hi, e5m2)) & 0xffff0000u);
}

// Copies `ROWS` rows of HEAD_DIM bytes (row r from src + (row0 + r) * row_stride) into the
// unswizzled staging area `raw` ([ROWS][HEAD_DIM]); rows at or past `row_end` and columns at or
// past `head_dim` become 0. VEC_LOAD: 16 bytes per cp.async, chunk c by thread c % NUM_THREADS
// (widen_tile reads each chunk in the same thread); else byte by byte, synchronously.
template <int ROWS>
__device__ __forceinline__ void stage_tile(unsigned char* raw, const in_t* src, i64 row_stride,
                                           int row0, int row_end, int head_dim) {
#if VEC_LOAD
    constexpr int CHUNKS = ROWS * (HEAD_DIM / 16);
#pragma unroll
    for (int c = threadIdx.x; c < CHUNKS; c += NUM_THREADS) {
        int r = c / (HEAD_DIM / 16), col = (c % (HEAD_DIM / 16)) * 16;
        bool ok = row0 + r < row_end && col < head_dim;
        const in_t* g = ok ? src + (i64)(row0 + r) * row_stride + col : src;
        cp_async16(smem_addr(raw + r * HEAD_DIM + col), g, ok ? 16 : 0);
    }
#else
    constexpr int ELEMS = ROWS * HEAD_DIM;
    for (int e = threadIdx.x; e < ELEMS; e += NUM_THREADS) {
        int r = e / HEAD_DIM, col = e % HEAD_DIM;
        bool ok = row0 + r < row_end && col < head_dim;
        raw[e] = ok ? src[(i64)(row0 + r) * row_stride + col] : (in_t)0;
    }
#endif
}

// Widens the staged bytes of `ROWS` rows into the swizzled bf16 `tile`, 16 bytes per step (two
// 16-byte chunks of the tile).
template <int ROWS>
__device__ __forceinline__ void widen_tile(u16* tile, const unsigned char* raw, int e5m2) {
    constexpr int CHUNKS = ROWS * (HEAD_DIM / 16);
#pragma unroll
    for (int c = threadIdx.x; c < CHUNKS; c += NUM_THREADS) {
        int r = c / (HEAD_DIM / 16), col = (c % (HEAD_DIM / 16)) * 16;
        u32 w[4], o[8];
        ld16(w, raw + r * HEAD_DIM + col);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            o[2 * i] = fp8x2_to_bf16x2(w[i] & 0xffu, (w[i] >> 8) & 0xffu, e5m2);
            o[2 * i + 1] = fp8x2_to_bf16x2((w[i] >> 16) & 0xffu, w[i] >> 24, e5m2);
        }
        st16(tile + swz(r, col), o);
        st16(tile + swz(r, col + 8), o + 4);
    }
}
#else
typedef u16 in_t;
#define KV_BUFS 2
#endif

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
flash_fwd(const __grid_constant__ FwdParams p) {
    FA_DYNAMIC_SMEM(u16, smem);
    u16* q_tile = smem;
    u16* k_tiles = q_tile + BLOCK_M * SMEM_ROW;            // KV_BUFS buffers
    u16* v_tiles = k_tiles + KV_BUFS * BLOCK_N * SMEM_ROW;  // KV_BUFS buffers

    CtaWork<in_t> w;
    if (!cta_work<in_t, BLOCK_M, BLOCK_N>(w, p)) return;
    const int h = w.h, m0 = w.m0, m_end = w.m_end, seqlen_q = w.seqlen_q, seqlen_k = w.seqlen_k;
    const in_t* q_g = w.q_g;
    const in_t* k_g = w.k_g;
    const in_t* v_g = w.v_g;
    const i64 out_row0 = w.out_row0, lse_base = w.lse_base;
    const Mask& mask = w.mask;
    const ScoreMod& mods = w.mods;
    const int n_block_min = w.n_block_min, n_block_max = w.n_block_max;
#ifdef FA_FP8_INPUT
    static_assert(128 % BLOCK_M == 0 && 128 % BLOCK_N == 0,
                  "per-block factors: a CTA's rows and a key block lie in one 128-row block");
    // Per-block factors: this CTA's q factor (softmax_scale folded in) and its (sequence, kv
    // head)'s k and v rows; null without them.
    const float* __restrict__ k_fac = nullptr;
    const float* __restrict__ v_fac = nullptr;
    float q_fac = 0.f;
    if (p.block_q != 0) {
        const float* __restrict__ ds = p.descale;
        const i64 kv_row = ((i64)w.b * p.heads_kv + h / (p.heads / p.heads_kv)) * p.k_blocks;
        q_fac = ds[p.block_q + ((i64)w.b * p.heads + h) * p.q_blocks + m0 / 128];
        k_fac = ds + p.block_k + kv_row;
        v_fac = ds + p.block_v + kv_row;
    }
#endif

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;  // mma fragment row group and column pair
    // This lane's ldmatrix offsets: q rows of its warp (A), k rows (B), v rows read transposed.
    const u32 q_off =
        frag_offset(warp * 16 * M_TILES + (lane & 7) + ((lane >> 3) & 1) * 8, lane >> 4);
    const u32 k_off = frag_offset((lane & 7) + (lane >> 4) * 8, (lane >> 3) & 1);
    const u32 v_off = frag_offset((lane & 7) + ((lane >> 3) & 1) * 8, lane >> 4);

#ifdef FA_FP8_INPUT
    // Staging: [2 buffers][k, v][BLOCK_N][HEAD_DIM] bytes, after the bf16 tiles.
    unsigned char* raw = reinterpret_cast<unsigned char*>(v_tiles + BLOCK_N * SMEM_ROW);
    auto raw_k = [&](int b) { return raw + (2 * b) * BLOCK_N * HEAD_DIM; };
    auto raw_v = [&](int b) { return raw + (2 * b + 1) * BLOCK_N * HEAD_DIM; };
    // The q tile goes through the staging area first (it fits: BLOCK_M <= 4 * BLOCK_N).
    stage_tile<BLOCK_M>(raw, q_g, p.q_row_stride, m0, seqlen_q, p.head_dim);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    widen_tile<BLOCK_M>(q_tile, raw, p.fp8_e5m2);
    __syncthreads();  // the staging area is free again
    if (n_block_min < n_block_max) {
        stage_tile<BLOCK_N>(raw_k(0), k_g, p.k_row_stride, n_block_min * BLOCK_N, seqlen_k, p.head_dim);
        stage_tile<BLOCK_N>(raw_v(0), v_g, p.v_row_stride, n_block_min * BLOCK_N, seqlen_k, p.head_dim);
    }
    cp_async_commit();
#else
    load_tile<BLOCK_M, true>(q_tile, q_g, p.q_row_stride, m0, seqlen_q, p.head_dim);
    cp_async_commit();
    if (n_block_min < n_block_max) {
        load_tile<BLOCK_N, true>(k_tiles, k_g, p.k_row_stride, n_block_min * BLOCK_N, seqlen_k, p.head_dim);
        load_tile<BLOCK_N, true>(v_tiles, v_g, p.v_row_stride, n_block_min * BLOCK_N, seqlen_k, p.head_dim);
    }
    cp_async_commit();
#endif

    float acc_o[M_TILES][HEAD_DIM / 8][4];
    // This thread's two rows of each tile mt: warp * 16 * M_TILES + 16 * mt + g and + 8. (The keys
    // each row sees come from the mask where a block needs it: kept in registers for the whole
    // loop, those bounds made two blocks of 16 rows at head_dim 128 spill.)
    float row_max[M_TILES][2], row_sum[M_TILES][2];
    int row_i[M_TILES][2];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
        for (int i = 0; i < HEAD_DIM / 8; ++i)
            acc_o[mt][i][0] = acc_o[mt][i][1] = acc_o[mt][i][2] = acc_o[mt][i][3] = 0.f;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            row_max[mt][r] = -FA_INF;
            row_sum[mt][r] = 0.f;
            row_i[mt][r] = m0 + (warp * M_TILES + mt) * 16 + g + 8 * r;
        }
    }

    for (int n_block = n_block_min; n_block < n_block_max; ++n_block) {
        const int buf = (n_block - n_block_min) & 1;
#ifdef FA_FP8_INPUT
        u16* k_tile = k_tiles;
        u16* v_tile = v_tiles;
        if (n_block + 1 < n_block_max) {
            // The other staging buffer was last read before the previous iteration's final
            // __syncthreads.
            stage_tile<BLOCK_N>(raw_k(buf ^ 1), k_g, p.k_row_stride, (n_block + 1) * BLOCK_N,
                                seqlen_k, p.head_dim);
            stage_tile<BLOCK_N>(raw_v(buf ^ 1), v_g, p.v_row_stride, (n_block + 1) * BLOCK_N,
                                seqlen_k, p.head_dim);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
#if !VEC_LOAD
        __syncthreads();  // byte staging: other threads wrote the chunks this one widens
#endif
        // (With VEC_LOAD each thread widens the chunks its own cp.async filled, visible to it
        // after the wait; the K and V tiles were released by the previous iteration's barrier.)
        widen_tile<BLOCK_N>(k_tile, raw_k(buf), p.fp8_e5m2);
        widen_tile<BLOCK_N>(v_tile, raw_v(buf), p.fp8_e5m2);
        __syncthreads();
#else
        u16* k_tile = k_tiles + buf * BLOCK_N * SMEM_ROW;
        u16* v_tile = v_tiles + buf * BLOCK_N * SMEM_ROW;
        if (n_block + 1 < n_block_max) {
            // The other buffer was released by the __syncthreads ending the previous iteration.
            load_tile<BLOCK_N, true>(k_tiles + (buf ^ 1) * BLOCK_N * SMEM_ROW, k_g, p.k_row_stride,
                               (n_block + 1) * BLOCK_N, seqlen_k, p.head_dim);
            load_tile<BLOCK_N, true>(v_tiles + (buf ^ 1) * BLOCK_N * SMEM_ROW, v_g, p.v_row_stride,
                               (n_block + 1) * BLOCK_N, seqlen_k, p.head_dim);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();

#endif

        // S = Q·Kᵀ for this warp's 16 * M_TILES rows × BLOCK_N keys.
        float s[M_TILES][BLOCK_N / 8][4];
        mma_abt_mt<M_TILES, BLOCK_N>(s, smem_addr(q_tile), q_off, smem_addr(k_tile), k_off);

        // Scores to the log2 domain; the per-element mask only where this block needs it.
        const int n0 = n_block * BLOCK_N;
        const bool need_mask = w.needs_mask(n0, BLOCK_N);
#ifdef FA_FP8_INPUT
        if (k_fac != nullptr) {  // per-block factors: this key block's score scale
            const float scale = q_fac * k_fac[n0 / 128];
            w.mods.scale_log2 = scale * FA_LOG2E;
            w.mods.cap_in = scale / p.softcap;
        }
#endif
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
            for (int nt = 0; nt < BLOCK_N / 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    s[mt][nt][e] = mods.apply(s[mt][nt][e], row_i[mt][e >> 1],
                                              n0 + nt * 8 + 2 * t + (e & 1));
            }
        }
        if (need_mask) {
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
                for (int nt = 0; nt < BLOCK_N / 8; ++nt) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int j = n0 + nt * 8 + 2 * t + (e & 1);
                        const int i = row_i[mt][e >> 1];
                        if (j < mask.lo(i) || j >= mask.hi(i)) s[mt][nt][e] = -FA_INF;
                    }
                }
            }
        }

        // Online softmax, tile by tile: max_get_scale, then probabilities and row_sum, then
        // rescale_o.
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
            online_softmax_step<BLOCK_N>(s[mt], row_max[mt], row_sum[mt], acc_o[mt]);

#if HAS_DROPOUT
        // Dropout zeroes probabilities for P·V only (row_sum above keeps them); 1/(1-p) is applied
        // once, at the end. This thread's keys 2t, 2t+1 of an 8-key tile are words 2(t & 1) and
        // 2(t & 1) + 1 of one Philox group.
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
            for (int nt = 0; nt < BLOCK_N / 8; ++nt) {
                const int j = n0 + nt * 8 + 2 * t;
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    u32 wd[4];
                    w.drop.words(wd, j >> 2, row_i[mt][r], h, w.b);
                    if (!w.drop.kept(pick_word(wd, 2 * (t & 1)))) s[mt][nt][2 * r] = 0.f;
                    if (!w.drop.kept(pick_word(wd, 2 * (t & 1) + 1))) s[mt][nt][2 * r + 1] = 0.f;
                }
            }
        }
#endif

#ifdef FA_FP8_INPUT
        if (v_fac != nullptr) {  // per-block factors: this key block's v factor (<= 1) into P
            const float f = v_fac[n0 / 128];
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                for (int nt = 0; nt < BLOCK_N / 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[mt][nt][e] *= f;
        }
#endif

        // acc_o += P·V: the accumulators of key tiles 2j, 2j+1 form the A fragment of k-step j.
        mma_xb_mt<M_TILES, BLOCK_N>(acc_o, s, smem_addr(v_tile), v_off);
        __syncthreads();
    }
    cp_async_wait<0>();  // a CTA that saw no key block still has its q tile in flight

    // finalize: divide by row_sum once; fully masked rows (row_sum 0) give 0 and lse -inf (with
    // a sink: 0 and lse = sink).
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float sum = row_sum[mt][r];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const int i = row_i[mt][r];
            if (i >= seqlen_q) continue;
            float inv = sum == 0.f ? 0.f : w.out_scale / sum;
            float row_lse2 = sum == 0.f ? -FA_INF : row_max[mt][r] + log2f(sum);
            if (w.sink != -FA_INF) {
                float factor;
                row_lse2 = fold_sink_log2(row_lse2, w.sink * FA_LOG2E, &factor);
                inv *= factor;
            }
            const float row_lse = row_lse2 * FA_LN2;
            u16* o = static_cast<u16*>(p.out) + ((out_row0 + i) * p.heads + h) * (i64)p.head_dim;
#pragma unroll
            for (int dt = 0; dt < HEAD_DIM / 8; ++dt) {
                const int col = dt * 8 + 2 * t;
                const float x0 = acc_o[mt][dt][2 * r] * inv, x1 = acc_o[mt][dt][2 * r + 1] * inv;
#if VEC_LOAD
                // head_dim is even, so a pair is either wholly inside the row or wholly past it.
                if (col < p.head_dim) *reinterpret_cast<u32*>(o + col) = pack2(x0, x1);
#else
                if (col < p.head_dim) o[col] = from_f32(x0);
                if (col + 1 < p.head_dim) o[col + 1] = from_f32(x1);
#endif
            }
            if (t == 0) p.lse[lse_base + (i64)h * p.lse_head_stride + i] = row_lse;
        }
    }
}
