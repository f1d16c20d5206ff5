// Hopper (sm_90a) forward for f16 / bf16, warp-specialised (FlashAttention-3's layout): one
// producer warpgroup moves tiles with TMA, NUM_WG consumer warpgroups compute on wgmma.
//
// CTA = (1 + NUM_WG) warpgroups of 128 threads for BLOCK_M = 64 · NUM_WG query rows of one
// (sequence, head):
//   producer   warpgroup 0 gives up registers (setmaxnreg) and one thread issues every TMA load:
//              the Q tile once, then K and V tiles of each key block into a STAGES-deep ring of
//              shared-memory buffers, each completing on its `full` mbarrier (bytes announced with
//              expect_tx) once the consumers have released the buffer on its `empty` mbarrier;
//   consumers  warpgroup 1 + c owns rows 64c .. 64c + 63 and takes the registers; per key block:
//              wait K full; S = Q·Kᵀ (wgmma, both operands in shared memory); then, while the
//              scores are masked and exponentiated, O += P·V of the previous block (wgmma, P from
//              registers); release each buffer as soon as its product has retired.
// Work tiles (tile_coords below): the grid is one-dimensional and each CTA loops over work tiles,
// one (query block, head, sequence) each, numbered heaviest first for causal masks; a launch of
// one CTA per tile runs one iteration, a persistent one (cuda/schedule.rs: SMs x CTAs per SM,
// FlashAttention-3's persistent scheduler) many, in static rounds (Tiles::take) or, with a tile
// counter, dynamically (TileSource: one consumer thread claims each next tile with an atomicAdd
// and hands it to every role through shared memory). The mbarrier phases run on across tiles: the
// K/V ring position is counted over every key block the CTA has taken, and Q's buffer is
// reloaded once the consumers release it on q_empty.
// No __syncthreads after the set-up: the warpgroups meet only at the mbarriers. Tiles are the
// SW128 slabs of sm90.cuh, which TMA writes with its 128-byte swizzle (a box of 64 columns per
// slab). Rows past a tensor's end arrive as zeros (TMA's out-of-bounds fill); rows past a
// sequence inside a packed tensor are other sequences' rows, which the mask gives probability 0.
//
// Defines (cuda/key.rs): FA_BF16 (else f16), HEAD_DIM (multiple of 64), BLOCK_N, NUM_WG,
// IS_MASKED, HAS_SOFTCAP, HAS_ALIBI, SM90_PINGPONG (1: the two consumer warpgroups take turns
// issuing their products, named barriers 1 and 2, so one's softmax runs under the other's
// products, FlashAttention-3's pingpong). The launch passes FwdParams (params.cuh), then the
// tensor maps of q, k and v (cuda/tma.rs): 4-D {head_dim, rows, heads, batches} of 16-bit
// elements, box {64, BLOCK_M or BLOCK_N, 1, 1}, 128-byte swizzle, then the tile counter: null for
// the static rounds, or one int the host zeroed before the launch for the dynamic scheduler.
//
// FP8 mode (FA_FP8_INPUT, with FA_BF16: e4m3 q, k and v, bf16 out; HEAD_DIM 128 or 256, BLOCK_N
// 64 or 128), FlashAttention-3's FP8 forward: the same producer, ring, scheduler and consumers on
// one-byte tiles (a box of 128 columns per slab) and wgmma k32 with e4m3 operands (QGMMA) for both
// products. 8-bit wgmma reads B K-major only, so P·V reads Vᵀ: the producer warpgroup's other
// three warps (the transposers) wait for each V tile TMA delivered, write it transposed (ldmatrix
// .trans and byte permutes, transpose_v) into a Vᵀ buffer of the stage (HEAD_DIM lines of 128
// bytes, keys in sm90_fp8.cuh's kpos order), release the V buffer on v_empty and publish Vᵀ on
// vt_full; the consumers read Vᵀ and release it on vt_empty. The consumers keep most of their registers: the producer warpgroup takes 40 (232 each
// for the consumers) for the transpose.
// Scores and P as fwd_sm90_fp8.cu: S scaled by the folded softmax_scale · q_descale · k_descale of
// the (sequence, kv head), P · 256 rounded to e4m3, out divided by 256 · row_sum and multiplied
// by v_descale; per-block factors (FwdParams block_q) as there: the score scale set per key block,
// acc_o kept in units of the current key block's v factor (consume). The tensor maps are then of
// one-byte elements, box {128, rows, 1, 1}.
#define FA_TENSOR_CORE_KERNEL
#define FA_SM90_KERNEL
#define FA_SM90_WS  // the launch passes tensor maps (tests/cuda_emu/driver.cpp reads this)
#define NUM_THREADS ((NUM_WG + 1) * 128)
#define BLOCK_M (NUM_WG * 64)
#define VEC_LOAD 1
#define HAS_DROPOUT 0
#define SMEM_ROW HEAD_DIM
#define STAGES 2
#ifdef FA_FP8_INPUT
#define ELEM_BYTES 1
#define FA_TMA_ELEM_BYTES 1  // the host emulation's TMA boxes: 128 one-byte columns
#else
#define ELEM_BYTES 2
#endif
#ifndef SM90_PINGPONG
#define SM90_PINGPONG 0
#endif
#include "common.cuh"
#include "sm90.cuh"
#include "sm90_attn.cuh"
#ifdef FA_FP8_INPUT
#include "sm90_fp8.cuh"
typedef u8 elem_t;
static_assert(HEAD_DIM % 128 == 0 && HEAD_DIM <= 256, "HEAD_DIM: whole 128-byte lines, at most 256");
static_assert(BLOCK_N == 128 || BLOCK_N == 64, "BLOCK_N: at most one 128-byte line of Vᵀ");
// The producer warpgroup's warps 1 to 3 transpose V.
#define TRANSPOSERS 96
#define VT_BYTES (HEAD_DIM * 128)
#else
typedef u16 elem_t;
static_assert(HEAD_DIM % 64 == 0 && HEAD_DIM <= 256, "HEAD_DIM: whole 64-column slabs, at most 256");
static_assert(BLOCK_N % 16 == 0 && BLOCK_N >= 16 && BLOCK_N <= 256, "BLOCK_N: a wgmma n size");
#define VT_BYTES 0
#endif
// Columns per 128-byte slab (one TMA box wide), elements per wgmma k-step (32 bytes).
#define SLAB_COLS (128 / ELEM_BYTES)
#define K_STEP (32 / ELEM_BYTES)
static_assert(NUM_WG == 2, "the register split below is for two consumer warpgroups");
// Registers: 3 x 168 at entry (launch bounds of 384 threads) = 24 (producer) + 2 x 240; FP8:
// 40 + 2 x 232, the transposers spilled in 24 (NVRTC 13.0: 120 bytes) and the consumers' scores
// and acc_o fit 232 (P is half the size of the 16-bit mode's).
#ifdef FA_FP8_INPUT
#define PRODUCER_REGS 40
#define CONSUMER_REGS 232
#else
#define PRODUCER_REGS 24
#define CONSUMER_REGS 240
#endif

// The dynamic scheduler's thread (TileSource): the first thread of consumer 0, whose registers
// have room (the producer warpgroup's 24 in the 16-bit mode spilled with it). Every thread with a
// role loads its tiles: the consumers, the producer's thread and the transposers (FP8).
#define SCHEDULER_THREAD 128
#ifdef FA_FP8_INPUT
#define TILE_READERS (NUM_WG * 128 + 1 + TRANSPOSERS)
#else
#define TILE_READERS (NUM_WG * 128 + 1)
#endif

#define TILE_BYTES (BLOCK_N * HEAD_DIM * ELEM_BYTES)
#define Q_BYTES (BLOCK_M * HEAD_DIM * ELEM_BYTES)

// Shared-memory addresses: the Q tile, the K and V rings (FP8: then the Vᵀ ring), then the
// mbarriers: q_full, then per stage k_full, k_empty, v_full, v_empty (FP8: vt_full, vt_empty),
// then q_empty, then the dynamic scheduler's tile_full and tile_empty of its two tile slots
// (TileSource), then the slots (4 bytes each). pv_full / pv_empty: the barriers of the B operand
// of P·V (V, or Vᵀ in FP8).
#ifdef FA_FP8_INPUT
#define STAGE_BARS 6
#else
#define STAGE_BARS 4
#endif
struct Smem {
    u32 q, k0, v0, vt0, bars;
    __device__ __forceinline__ u32 k(int s) const { return k0 + s * TILE_BYTES; }
    __device__ __forceinline__ u32 v(int s) const { return v0 + s * TILE_BYTES; }
    __device__ __forceinline__ u32 vt(int s) const { return vt0 + s * VT_BYTES; }
    __device__ __forceinline__ u32 q_full() const { return bars; }
    __device__ __forceinline__ u32 k_full(int s) const { return bars + 8 * (1 + STAGE_BARS * s); }
    __device__ __forceinline__ u32 k_empty(int s) const { return bars + 8 * (2 + STAGE_BARS * s); }
    __device__ __forceinline__ u32 v_full(int s) const { return bars + 8 * (3 + STAGE_BARS * s); }
    __device__ __forceinline__ u32 v_empty(int s) const { return bars + 8 * (4 + STAGE_BARS * s); }
    __device__ __forceinline__ u32 vt_full(int s) const { return bars + 8 * (5 + STAGE_BARS * s); }
    __device__ __forceinline__ u32 vt_empty(int s) const { return bars + 8 * (6 + STAGE_BARS * s); }
    __device__ __forceinline__ u32 q_empty() const { return bars + 8 * (1 + STAGE_BARS * STAGES); }
    __device__ __forceinline__ u32 tile_full(int s) const {
        return bars + 8 * (2 + STAGE_BARS * STAGES + s);
    }
    __device__ __forceinline__ u32 tile_empty(int s) const {
        return bars + 8 * (4 + STAGE_BARS * STAGES + s);
    }
    __device__ __forceinline__ u32 tile_slot(int s) const {
        return bars + 8 * (6 + STAGE_BARS * STAGES) + 4 * s;
    }
#ifdef FA_FP8_INPUT
    __device__ __forceinline__ u32 pv_full(int s) const { return vt_full(s); }
    __device__ __forceinline__ u32 pv_empty(int s) const { return vt_empty(s); }
#else
    __device__ __forceinline__ u32 pv_full(int s) const { return v_full(s); }
    __device__ __forceinline__ u32 pv_empty(int s) const { return v_empty(s); }
#endif
};

// The work tiles: (m_block, head, sequence) of every launched sequence. With a mask (causal,
// window) the query blocks nearer the end see more keys: tiles are numbered by m_block from the
// last down, so the longest start first and the short ones fill the gaps at the end
// (FlashAttention-3's longest-processing-time-first order); without one every tile costs the
// same, and consecutive tiles share their head (and its K and V in L2).
struct Tiles {
    int m_blocks, heads, seqs, count;
    __device__ __forceinline__ explicit Tiles(const FwdParams& p)
        : m_blocks((p.batch_seqlen_q + BLOCK_M - 1) / BLOCK_M), heads(p.heads), seqs(p.num_seqs),
          count(m_blocks * p.heads * p.num_seqs) {}
    __device__ __forceinline__ void coords(int tile, int& m_block, int& h, int& b) const {
        if (IS_MASKED) {
            m_block = m_blocks - 1 - tile / (heads * seqs);
            b = (tile / heads) % seqs;
            h = tile % heads;
        } else {
            m_block = tile % m_blocks;
            h = (tile / m_blocks) % heads;
            b = tile / (m_blocks * heads);
        }
    }
    // The tile this CTA takes in round `round` (rounds of gridDim.x tiles, the CTAs in order in
    // even rounds and in reverse in odd ones, so that with the heaviest tiles first no CTA takes
    // the heaviest of every round); -1 past the last round; count or more when this round has
    // none for this CTA.
    __device__ __forceinline__ int take(int round) const {
        const long long first = (long long)round * gridDim.x;
        if (first >= count) return -1;
        return (int)first + ((round & 1) ? (int)gridDim.x - 1 - (int)blockIdx.x : (int)blockIdx.x);
    }
};

// The next work tile of this CTA from round `round` on into `w`, `round` then past it; false when
// none is left. Every role walks the same tiles in the same order and skips the same empty ones
// (query blocks past a shorter sequence of a packed call).
__device__ __forceinline__ bool next_work(const Tiles& tiles, const FwdParams& p, int& round,
                                          CtaWork<elem_t>& w) {
    for (;; ++round) {
        const int tile = tiles.take(round);
        if (tile < 0) return false;
        if (tile >= tiles.count) continue;
        int m_block, h, b;
        tiles.coords(tile, m_block, h, b);
        if (cta_work_at<elem_t, BLOCK_M, BLOCK_N>(w, p, m_block, h, b)) {
            ++round;
            return true;
        }
    }
}

// Where every role of a CTA takes its work tiles. Static (`counter` null, the default): each
// role walks the rounds itself (next_work). Dynamic (a per-launch counter, zeroed by the host
// before the launch: FlashAttention-3's dynamic persistent scheduler): the scheduler thread
// (SCHEDULER_THREAD) hands the CTA's tiles to every thread with a role through two shared-memory
// slots (tile j in slot j % 2): tile 0 is blockIdx.x, tile j + 1 gridDim.x + the counter's old
// value (one atomicAdd) claimed as the consumers take tile j, so the producer's thread can load
// the next tile's Q, K and V while they finish this one; -1 once the counter has passed the last.
// It waits on the slot's tile_empty (every reader has loaded tile j - 2), stores the tile and
// arrives on its tile_full (the arrive releases the store to whoever completes a wait on that
// phase); every thread with a role (the scheduler too) waits on tile_full, loads the tile and
// arrives on tile_empty. So all roles take the same tiles in the same order (each skipping the
// tiles with no rows, as next_work) and stop on the same -1. The scheduler's steps run in every
// consumer thread, only the claim, the store and the arrive on that one thread's predicate:
// branching around them for one thread had ptxas serialise the consumers' wgmma (C7520). `n`:
// static, the next round; dynamic, the tiles taken so far (the -1 included). The counter is the
// kernel's parameter, read where it is used.
struct TileSource {
    int n = 0;
};

// The scheduler's step for tile j (every consumer thread runs it): once slot j % 2 is free, tile
// j is stored there: blockIdx.x if j is 0, else the next the counter gives.
__device__ __forceinline__ void hand_on_tile(const Smem& sm, int j, int* counter,
                                             const Tiles& tiles) {
    const int slot = j % 2;
    mbar_wait(sm.tile_empty(slot), ((j / 2) & 1) ^ 1);
    if (threadIdx.x == SCHEDULER_THREAD) {
        const int t = j == 0 ? (int)blockIdx.x : (int)gridDim.x + atomicAdd(counter, 1);
        st_shared_s32(sm.tile_slot(slot), t < tiles.count ? t : -1);
        mbar_arrive(sm.tile_full(slot));
    }
}

// A thread's next tile from the slots; -1: none is left.
__device__ __forceinline__ int read_tile(TileSource& src, const Smem& sm) {
    const int slot = src.n % 2;
    mbar_wait(sm.tile_full(slot), (src.n / 2) & 1);
    ++src.n;
    const int tile = ld_shared_s32(sm.tile_slot(slot));
    mbar_arrive(sm.tile_empty(slot));
    return tile;
}

// This role's next work tile into `w` (see TileSource); false when none is left. `consumer`: the
// consumer threads also run the scheduler's steps.
__device__ __forceinline__ bool take_tile(TileSource& src, const Tiles& tiles, int* counter,
                                          bool consumer, const Smem& sm, const FwdParams& p,
                                          CtaWork<elem_t>& w) {
    if (counter == nullptr) return next_work(tiles, p, src.n, w);
    for (;;) {
        const int j = src.n;
        if (consumer && j == 0) hand_on_tile(sm, 0, counter, tiles);
        const int tile = read_tile(src, sm);
        if (tile < 0) return false;
        if (consumer) hand_on_tile(sm, j + 1, counter, tiles);
        int m_block, h, b;
        tiles.coords(tile, m_block, h, b);
        if (cta_work_at<elem_t, BLOCK_M, BLOCK_N>(w, p, m_block, h, b)) return true;
    }
}

// The TMA loads of one tile: HEAD_DIM / SLAB_COLS boxes of ROWS rows, one per slab.
template <int ROWS>
__device__ __forceinline__ void tma_tile(u32 dst, const TmaDesc* map, int row, int head, int batch,
                                         u32 bar) {
#pragma unroll
    for (int slab = 0; slab < HEAD_DIM / SLAB_COLS; ++slab)
        tma_load_4d(dst + slab * ROWS * 128, map, SLAB_COLS * slab, row, head, batch, bar);
}

// S = Q·Kᵀ of consumer c's 64 rows and the key block in the K tile at `k`, issued (not waited).
__device__ __forceinline__ void issue_qk(float (&s)[BLOCK_N / 8][4], u32 q, u32 k, int c) {
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / K_STEP; ++kk) {
#ifdef FA_FP8_INPUT
        WgmmaE4m3<BLOCK_N>::ss(s, desc_kmajor(q, BLOCK_M, 64 * c, kk), desc_kmajor(k, BLOCK_N, 0, kk),
                               kk > 0);
#else
        Wgmma<BLOCK_N>::ss(s, desc_kmajor(q, BLOCK_M, 64 * c, kk), desc_kmajor(k, BLOCK_N, 0, kk),
                           kk > 0);
#endif
    }
}

// acc_o += P·V of the key block in stage `stage`, issued: V MN-major from its tile (16-bit), or
// Vᵀ K-major (FP8: k-step j is keys 32j .. 32j + 31, in kpos order).
__device__ __forceinline__ void issue_pv(float (&acc_o)[HEAD_DIM / 8][4],
                                         const u32 (&p_frag)[BLOCK_N / K_STEP][4], const Smem& sm,
                                         int stage) {
#pragma unroll
    for (int j = 0; j < BLOCK_N / K_STEP; ++j) {
#ifdef FA_FP8_INPUT
        WgmmaE4m3<HEAD_DIM>::rs(acc_o, p_frag[j], desc_kmajor(sm.vt(stage), HEAD_DIM, 0, j), 1);
#else
        Wgmma<HEAD_DIM>::rs(acc_o, p_frag[j], desc_mnmajor(sm.v(stage), BLOCK_N, j), 1);
#endif
    }
}

// The probabilities in s packed as the A fragments of P·V (FP8: times 256, rounded to e4m3).
__device__ __forceinline__ void pack_p(u32 (&p_frag)[BLOCK_N / K_STEP][4],
                                       const float (&s)[BLOCK_N / 8][4]) {
#pragma unroll
    for (int j = 0; j < BLOCK_N / K_STEP; ++j) {
#ifdef FA_FP8_INPUT
        pack_p_e4m3(p_frag[j], s, j);
#else
        pack_kstep<BLOCK_N>(p_frag[j], s, j);
#endif
    }
}

// The producer's one thread: every TMA load of one work tile. Tensor-map coordinates: packed
// calls address rows of the whole tensor (a sequence's first row from its base offset), batched
// calls rows of batch w.b. `ring`: the key blocks this CTA loaded before this tile (the K/V ring's
// position); `q_phase`: the parity of this tile's Q (Q tiles loaded before it, mod 2). A tile that
// sees no key block loads nothing (its rows are written without Q).
__device__ __forceinline__ void produce(const CtaWork<elem_t>& w, const Smem& sm, bool packed,
                                        int q_row0, int k_row0, int v_row0, int hk,
                                        const TmaDesc* q_map, const TmaDesc* k_map,
                                        const TmaDesc* v_map, int ring, int q_phase) {
    if (w.n_block_min == w.n_block_max) return;
    const int batch = packed ? 0 : w.b;
    // The previous tile's Q stays until both consumers' last Q·Kᵀ has retired.
    mbar_wait(sm.q_empty(), q_phase ^ 1);
    mbar_arrive_expect_tx(sm.q_full(), Q_BYTES);
    tma_tile<BLOCK_M>(sm.q, q_map, q_row0 + w.m0, w.h, batch, sm.q_full());
    for (int n_block = w.n_block_min; n_block < w.n_block_max; ++n_block) {
        const int it = ring + n_block - w.n_block_min, stage = it % STAGES,
                  phase = (it / STAGES) & 1;
        // A fresh mbarrier counts as having completed the phase before its first: the first
        // lap's waits on `empty` (parity 1) pass at once.
        mbar_wait(sm.k_empty(stage), phase ^ 1);
        mbar_arrive_expect_tx(sm.k_full(stage), TILE_BYTES);
        tma_tile<BLOCK_N>(sm.k(stage), k_map, k_row0 + n_block * BLOCK_N, hk, batch,
                          sm.k_full(stage));
        mbar_wait(sm.v_empty(stage), phase ^ 1);
        mbar_arrive_expect_tx(sm.v_full(stage), TILE_BYTES);
        tma_tile<BLOCK_N>(sm.v(stage), v_map, v_row0 + n_block * BLOCK_N, hk, batch,
                          sm.v_full(stage));
    }
}

// produce of w's tile, its tensor-map coordinates worked out (packed calls address rows of the
// whole tensor, a sequence's first row from its base offset; batched calls rows of batch w.b);
// `ring` and `q_loads` (Q tiles loaded so far) then past it.
__device__ __forceinline__ void produce_tile(const CtaWork<elem_t>& w, const FwdParams& p,
                                             const Smem& sm, const TmaDesc* q_map,
                                             const TmaDesc* k_map, const TmaDesc* v_map, int& ring,
                                             int& q_loads) {
    const bool packed = p.seqs != nullptr;
    const int hk = w.h / (p.heads / p.heads_kv);
    const elem_t* k = static_cast<const elem_t*>(p.k);
    const elem_t* v = static_cast<const elem_t*>(p.v);
    const int k_row0 =
        packed ? (int)((w.k_g - k - (i64)hk * p.k_head_stride) / p.k_row_stride) : 0;
    const int v_row0 =
        packed ? (int)((w.v_g - v - (i64)hk * p.v_head_stride) / p.v_row_stride) : 0;
    produce(w, sm, packed, packed ? (int)w.out_row0 : 0, k_row0, v_row0, hk, q_map, k_map, v_map,
            ring, q_loads & 1);
    ring += w.n_block_max - w.n_block_min;
    q_loads += w.n_block_min < w.n_block_max;
}

#ifdef FA_FP8_INPUT
// A transposer thread (`tid` 0 .. TRANSPOSERS - 1 of warps 1 to 3 of the producer warpgroup):
// every key block of one work tile, V as TMA delivered it ([BLOCK_N keys][HEAD_DIM], SW128) into
// the stage's Vᵀ buffer (HEAD_DIM lines, key κ of each 32 at column kpos(κ)), as FlashAttention-3
// transposes FP8 V: a warp step takes 32 keys (group g) by 16 columns (chunk c) with one
// `ldmatrix .x4 .trans` of 16-bit pairs (matrix i: keys 8i .. 8i + 7 of the group, i = 2 · half +
// q in kpos's terms), which gives lane (j = lane / 4, t = lane % 4) columns 2j and 2j + 1 of keys
// 2t and 2t + 1 of each matrix; two byte permutes per half then make the words of lines
// 16c + 2j and 16c + 2j + 1 at k positions 16 · half + 4t .. + 3 (keys 2t, 2t + 1, 8 + 2t,
// 9 + 2t: kpos's order), one 4-byte store each. `ring` as for produce.
__device__ __forceinline__ void transpose_v(const CtaWork<elem_t>& w, const Smem& sm, int tid,
                                            int ring) {
    const int warp = tid / 32, lane = tid % 32, t = lane % 4, j = lane / 4;
    for (int n_block = w.n_block_min; n_block < w.n_block_max; ++n_block) {
        const int it = ring + n_block - w.n_block_min, stage = it % STAGES,
                  phase = (it / STAGES) & 1;
        mbar_wait(sm.v_full(stage), phase);
        // The consumers' P·V two blocks back has retired from this buffer.
        mbar_wait(sm.vt_empty(stage), phase ^ 1);
        const u32 v = sm.v(stage), vt = sm.vt(stage);
        for (int step = warp; step < (BLOCK_N / 32) * (HEAD_DIM / 16); step += TRANSPOSERS / 32) {
            const int g = step % (BLOCK_N / 32), c = step / (BLOCK_N / 32);
            u32 r[4];
            ldsm_x4_trans(r, v + sw128_b(32 * g + 8 * (lane / 8) + lane % 8, 16 * c, BLOCK_N));
            const int line = 16 * c + 2 * j;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int pos = 32 * g + 16 * half + 4 * t;
                const u32 x = r[2 * half], y = r[2 * half + 1];
                st_shared_s32(vt + sw128_b(line, pos, HEAD_DIM), (int)bytes_even(x, y));
                st_shared_s32(vt + sw128_b(line + 1, pos, HEAD_DIM), (int)bytes_odd(x, y));
            }
        }
        // The stores went through the generic proxy; wgmma reads through the async one.
        fence_proxy_async();
        mbar_arrive(sm.vt_full(stage));
        // This thread's reads of V are done: TMA may refill the buffer.
        mbar_arrive(sm.v_empty(stage));
    }
}
#endif

// A consumer warpgroup (warpgroup 1 + c of the CTA): its 64 rows of one work tile through every
// key block, then out and lse. `ring` and `q_phase` as for produce. FP8 with per-block factors:
// the score scale is set per key block (w's), and acc_o kept in units of the current key block's
// v factor, as fwd_sm90_fp8.cu (its top comment).
__device__ __forceinline__ void consume(CtaWork<elem_t>& w, const Smem& sm, int c,
                                        const FwdParams& p, int ring, int q_phase) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const bool releaser = threadIdx.x % 128 == 0;  // arrives on `empty` for its warpgroup
    float acc_o[HEAD_DIM / 8][4];
    float row_max[2], row_sum[2];
    int row_i[2];
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 8; ++i) acc_o[i][0] = acc_o[i][1] = acc_o[i][2] = acc_o[i][3] = 0.f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        row_max[r] = -FA_INF;
        row_sum[r] = 0.f;
        row_i[r] = w.m0 + 64 * c + 16 * warp + g + 8 * r;
    }
    // A tile that sees no key block waits for no Q (the producer loads none): had it waited and
    // released Q at once, the releasing thread could run ahead of its warpgroup, the next Q load
    // complete a second phase, and a thread not yet past this wait would miss the parity it waits
    // for (the emulation deadlocked on packed sequences with no keys).
    const bool has_keys = w.n_block_min < w.n_block_max;
#ifdef FA_FP8_INPUT
    const BlockFactors fac(p, w.b, w.h, w.m0 + 64 * c);
    float v_unit = 1.f;  // the v factor acc_o is in units of
    if (fac.v != nullptr && has_keys) v_unit = fac.v[w.n_block_min * BLOCK_N / 128];
#endif
    if (has_keys) mbar_wait(sm.q_full(), q_phase);

    u32 p_frag[BLOCK_N / K_STEP][4];  // P of the previous block, the A operand of its P·V
    for (int n_block = w.n_block_min; n_block < w.n_block_max; ++n_block) {
        // i: the block's place in this tile; it: in the ring, counted over the CTA's tiles.
        const int i = n_block - w.n_block_min, it = ring + i;
        const int stage = it % STAGES, phase = (it / STAGES) & 1;
        // The previous block's buffer (used when i > 0, so it - 1 >= 0).
        const int prev = (it + STAGES - 1) % STAGES, prev_phase = ((it + STAGES - 1) / STAGES - 1) & 1;
        float s[BLOCK_N / 8][4];
        mbar_wait(sm.k_full(stage), phase);
        if (i > 0) mbar_wait(sm.pv_full(prev), prev_phase);
#if SM90_PINGPONG
        named_bar_sync(1 + c, 256);  // this warpgroup's turn to issue
#endif
        reg_fence_all(acc_o);
        wgmma_fence();
        issue_qk(s, sm.q, sm.k(stage), c);
        wgmma_commit();
        if (i > 0) {
            // O += P·V of the previous block runs while these scores are masked and exponentiated.
            issue_pv(acc_o, p_frag, sm, prev);
            wgmma_commit();
        }
        if (i > 0) {
            wgmma_wait<1>();  // S is ready; the P·V group may still run
        } else {
            wgmma_wait<0>();
        }
        reg_fence_all(s);
#if SM90_PINGPONG
        // The other warpgroup's turn, once these scores are in: an arrive between the issue and
        // the wait made ptxas serialise the wgmma pipeline (C7514, NVRTC 13.0).
        named_bar_arrive(1 + (c ^ 1), 256);
#endif
        if (releaser) mbar_arrive(sm.k_empty(stage));

#ifdef FA_FP8_INPUT
        if (fac.k != nullptr) set_block_scale(w, fac.q * fac.k[n_block * BLOCK_N / 128], p.softcap);
#endif
        mask_scores(s, w, row_i, n_block * BLOCK_N, t);
        float alpha[2];
        softmax_rows(s, row_max, row_sum, alpha);
        wgmma_wait<0>();  // acc_o holds O through the previous block
        reg_fence_all(acc_o);
        if (i > 0 && releaser) mbar_arrive(sm.pv_empty(prev));
#ifdef FA_FP8_INPUT
        if (fac.v != nullptr) block_v_rescale(alpha, v_unit, fac.v[n_block * BLOCK_N / 128]);
#endif
        rescale_o(acc_o, alpha);
        pack_p(p_frag, s);
    }
    if (has_keys) {
        // Every Q·Kᵀ of this tile has retired (the whole warpgroup has waited for its products):
        // the producer may load the next tile's Q.
        if (releaser) mbar_arrive(sm.q_empty());
        // The last block's P·V.
        const int it = ring + w.n_block_max - 1 - w.n_block_min, stage = it % STAGES;
        mbar_wait(sm.pv_full(stage), (it / STAGES) & 1);
#if SM90_PINGPONG
        named_bar_sync(1 + c, 256);
#endif
        reg_fence_all(acc_o);
        wgmma_fence();
        issue_pv(acc_o, p_frag, sm, stage);
        wgmma_commit();
        wgmma_wait<0>();
        reg_fence_all(acc_o);
        // The buffer goes back to the ring: the CTA's next tile loads into it.
        if (releaser) mbar_arrive(sm.pv_empty(stage));
#if SM90_PINGPONG
        named_bar_arrive(1 + (c ^ 1), 256);
#endif
    }
#ifdef FA_FP8_INPUT
    w.out_scale *= v_unit;  // per-block factors: acc_o is in units of the last block's v factor
#endif
    store_rows(acc_o, row_max, row_sum, row_i, w, p, t);
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
flash_fwd(const __grid_constant__ FwdParams p, const __grid_constant__ TmaDesc q_map,
          const __grid_constant__ TmaDesc k_map, const __grid_constant__ TmaDesc v_map,
          int* __restrict__ tile_counter) {
    FA_DYNAMIC_SMEM(unsigned char, smem_raw);
    // Tiles start 1024-byte aligned: the swizzle reads address bits 7-9 as the row.
    const u32 q0 = (smem_addr(smem_raw) + 1023) & ~1023u;
    const u32 k0 = q0 + Q_BYTES, v0 = k0 + STAGES * TILE_BYTES, vt0 = v0 + STAGES * TILE_BYTES;
    const Smem sm{q0, k0, v0, vt0, vt0 + STAGES * VT_BYTES};

    if (threadIdx.x == 0) {
        mbar_init(sm.q_full(), 1);
        mbar_init(sm.q_empty(), NUM_WG);
        // The tile slot: the scheduler thread stores, every other thread with a role loads.
        for (int s = 0; s < 2; ++s) {
            mbar_init(sm.tile_full(s), 1);
            mbar_init(sm.tile_empty(s), TILE_READERS);
        }
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(sm.k_full(s), 1);
            mbar_init(sm.v_full(s), 1);
            mbar_init(sm.k_empty(s), NUM_WG);
#ifdef FA_FP8_INPUT
            // V is read by the transposers, Vᵀ by the consumers.
            mbar_init(sm.v_empty(s), TRANSPOSERS);
            mbar_init(sm.vt_full(s), TRANSPOSERS);
            mbar_init(sm.vt_empty(s), NUM_WG);
#else
            mbar_init(sm.v_empty(s), NUM_WG);
#endif
        }
        mbar_init_fence();
    }
    __syncthreads();

    // One branch per role, as setmaxnreg needs: the producer warpgroup gives registers up, the
    // consumers take them.
    const int wg = threadIdx.x / 128;
    // Each role takes its tiles itself (next_work, or the dynamic scheduler's slots), after its
    // register change, so that nothing computed before the branch stays live across it (ptxas
    // then spilled the consumers). The producer's thread has a loop per scheduler: one loop
    // taking either way spilled its 24 registers.
    if (wg == 0) {
        regs_dealloc<PRODUCER_REGS>();
        if (threadIdx.x == 0) {
            TileSource src;
            int ring = 0, q_loads = 0;
            CtaWork<elem_t> w;
            if (tile_counter != nullptr) {
                // The dynamic scheduler's tiles, from its thread.
                const Tiles tiles(p);
                for (;;) {
                    const int tile = read_tile(src, sm);
                    if (tile < 0) break;
                    int m_block, h, b;
                    tiles.coords(tile, m_block, h, b);
                    if (!cta_work_at<elem_t, BLOCK_M, BLOCK_N>(w, p, m_block, h, b)) continue;
                    produce_tile(w, p, sm, &q_map, &k_map, &v_map, ring, q_loads);
                }
            } else {
                // Static: this thread walks the rounds itself.
                const Tiles tiles(p);
                for (int round = 0; next_work(tiles, p, round, w);) {
                    produce_tile(w, p, sm, &q_map, &k_map, &v_map, ring, q_loads);
                }
            }
        }
#ifdef FA_FP8_INPUT
        else if (threadIdx.x >= 32) {
            const Tiles tiles(p);
            TileSource src;
            int ring = 0;
            CtaWork<elem_t> w;
            while (take_tile(src, tiles, tile_counter, false, sm, p, w)) {
                transpose_v(w, sm, threadIdx.x - 32, ring);
                ring += w.n_block_max - w.n_block_min;
            }
        }
#endif
    } else {
        regs_alloc<CONSUMER_REGS>();
#if SM90_PINGPONG
        // Consumer 0 takes the first turn, once per CTA: every tile then leaves the turns as it
        // found them (each consumer syncs and arrives once per product issue).
        if (wg == 2) named_bar_arrive(1, 256);
#endif
        const Tiles tiles(p);
        TileSource src;
        int ring = 0, q_loads = 0;
        CtaWork<elem_t> w;
        while (take_tile(src, tiles, tile_counter, true, sm, p, w)) {
#ifdef FA_FP8_INPUT
            // P was scaled by 256 before rounding: the rows are divided by it once, at the end.
            w.out_scale *= 1.f / 256.f;
#endif
            consume(w, sm, wg - 1, p, ring, q_loads & 1);
            ring += w.n_block_max - w.n_block_min;  // the consumers' ring position
            q_loads += w.n_block_min < w.n_block_max;
        }
    }
}
