// The host-kernel contract: one struct per kernel family, passed by value as the kernel's
// `const __grid_constant__` parameter (the warp-specialised sm_90a forward takes its tensor maps
// after it). Each struct is mirrored field for field by a `#[repr(C)]` struct in
// flashattn/src/cuda/params.rs; both sides assert the same size and offsets, and the host-emulation
// tests compare every field's offset and feed the kernels the bytes the Rust side wrote.
//
// Layout rules (so that no compiler adds padding the other side does not see): 8-byte fields first
// (device pointers, i64), then 4-byte ones, and an explicit `pad` where the 4-byte fields leave the
// struct short of a multiple of 8. Pointers are device addresses (u64 on the Rust side); the host
// emulation puts host pointers in them (8 bytes too on the 64-bit hosts it runs on).
//
// Adding a field: add it here and in params.rs at the same place (the groups above), update both
// size checks (and the offsets checked, when they move), and set it where the launch is built.
#pragma once
#include "types.cuh"

// Dropout on the probabilities (dropout.cuh: Dropout): Philox keyed by seed_lo | seed_hi << 32, a
// key kept iff its word is below `threshold` = round((1 - p) · 2^32) (2^32 without dropout), kept
// probabilities scaled by `scale` = 1 / (1 - p) (1 without dropout).
struct DropoutParams {
    u32 seed_lo, seed_hi;
    i64 threshold;
    float scale;
    u32 pad;
};
static_assert(sizeof(DropoutParams) == 24, "DropoutParams: params.rs");
static_assert(FA_OFFSETOF(DropoutParams, threshold) == 8, "DropoutParams: params.rs");

// Every forward kernel (fwd.cu, fwd_f32.cu, fwd_sm90.cu, fwd_sm90_ws.cu; FP8 inputs included):
// q, k and v hold elements of the variant's input type (u16, f32, or FP8 bytes), out its output
// type (bf16 for FP8 inputs). `seqs` (packed calls, else null): SEQ_FIELDS i64 per launched
// sequence (common.cuh: SeqInfo); batched calls use batch_seqlen_* and the batch strides instead.
// `alibi_slopes` (ALiBi, else null): `heads` slopes per launched sequence. `descale` (FP8 inputs,
// else null): two factors per (launched sequence b, kv head hk) at 2 * (b * heads_kv + hk), the
// score scale (softmax_scale · q_descale · k_descale, folded on the host and rounded once, as the
// CPU path does), which replaces softmax_scale, and v_descale, which scales the finished rows.
// `sink` (learnable sinks, else null): the logit of (launched sequence b, head h) at b * heads + h,
// -inf (the tail of packed rows after the last sequence) for none. Strides in elements; window
// sides -1 for unbounded; fp8_e5m2 picks the FP8 format (0: e4m3), so both share one compile.
struct FwdParams {
    const void* __restrict__ q;
    const void* __restrict__ k;
    const void* __restrict__ v;
    void* __restrict__ out;
    float* __restrict__ lse;
    const i64* __restrict__ seqs;
    const float* __restrict__ alibi_slopes;
    const float* __restrict__ descale;
    const float* __restrict__ sink;
    i64 q_row_stride, q_head_stride;
    i64 k_row_stride, k_head_stride;
    i64 v_row_stride, v_head_stride;
    i64 lse_head_stride;
    i64 q_batch_stride, k_batch_stride, v_batch_stride;
    DropoutParams drop;
    int heads, heads_kv, head_dim;
    float softmax_scale, softcap;
    int window_left, window_right;
    int batch_seqlen_q, batch_seqlen_k;
    int fp8_e5m2;
    int num_seqs;  // launched sequences (the tile grid of fwd_sm90_ws.cu's persistent launch)
    int pad;
    // Per-block FP8 factors (Descale::per_block; else block_q = 0): three tables inside `descale`,
    // after its per-(sequence, kv head) pairs (whose v factor is then the largest v factor of the
    // (sequence, kv head)), at element offsets block_q, block_k and block_v. Query block i (rows
    // 128i .. 128i + 127 of its sequence) of (launched sequence b, head h):
    // softmax_scale · q_descale at block_q + (b * heads + h) * q_blocks + i; key block j of (b,
    // kv head hk): k_descale at block_k + (b * heads_kv + hk) * k_blocks + j, and v_descale over
    // the pair's v factor (<= 1) at block_v + the same index.
    int block_q, block_k, block_v;
    int q_blocks, k_blocks;
    int pad2;
};
static_assert(sizeof(FwdParams) == 248, "FwdParams: params.rs");
static_assert(FA_OFFSETOF(FwdParams, block_q) == 224, "FwdParams: params.rs");
static_assert(FA_OFFSETOF(FwdParams, q_row_stride) == 72, "FwdParams: params.rs");
static_assert(FA_OFFSETOF(FwdParams, drop) == 152, "FwdParams: params.rs");
static_assert(FA_OFFSETOF(FwdParams, heads) == 176, "FwdParams: params.rs");
static_assert(FA_OFFSETOF(FwdParams, fp8_e5m2) == 212, "FwdParams: params.rs");

// The backward kernels (bwd.cu: bwd_prep, bwd_dq, bwd_dkdv; CUDA-core and tensor-core): q, k, v,
// out, dout, dq, dk and dv hold elements of the variant's type (elem_t); lse is the caller's view
// (lse_view_* strides), lse2 and dsum the f32 workspaces laid out as the forward's contiguous lse
// (lse_head_stride). `seqs`: BWD_FIELDS i64 per launched sequence (bwd.cu: BwdSeq).
// `alibi_slopes` (ALiBi, else null): `heads` slopes per launched sequence.
struct BwdParams {
    const void* __restrict__ q;
    const void* __restrict__ k;
    const void* __restrict__ v;
    const void* __restrict__ out;
    const void* __restrict__ dout;
    const float* __restrict__ lse;
    float* __restrict__ lse2;
    float* __restrict__ dsum;
    void* __restrict__ dq;
    void* __restrict__ dk;
    void* __restrict__ dv;
    const i64* __restrict__ seqs;
    const float* __restrict__ alibi_slopes;
    i64 q_row_stride, q_head_stride;
    i64 k_row_stride, k_head_stride;
    i64 v_row_stride, v_head_stride;
    i64 out_row_stride, out_head_stride;
    i64 dout_row_stride, dout_head_stride;
    i64 lse_view_head_stride, lse_view_row_stride;
    i64 lse_head_stride;
    DropoutParams drop;
    int heads, heads_kv, head_dim;
    float softmax_scale, softcap;
    int window_left, window_right;
    u32 pad;
};
static_assert(sizeof(BwdParams) == 264, "BwdParams: params.rs");
static_assert(FA_OFFSETOF(BwdParams, q_row_stride) == 104, "BwdParams: params.rs");
static_assert(FA_OFFSETOF(BwdParams, drop) == 208, "BwdParams: params.rs");
static_assert(FA_OFFSETOF(BwdParams, heads) == 232, "BwdParams: params.rs");
static_assert(FA_OFFSETOF(BwdParams, window_right) == 256, "BwdParams: params.rs");

// The decode kernels (decode.cu: decode_append, decode_split, decode_combine), one struct for the
// three launches of a call. q, k_new, v_new and out hold elements of the variant's type (elem_t);
// k_cache and v_cache its cache type (cache_t: elem_t, or FP8 bytes with FA_FP8_CACHE; written by
// decode_append, read by decode_split); ws_o and ws_lse the f32 workspace of the splits' partial
// rows and LSEs (`splits` blocks of total_rows rows). `seqs`: DECODE_FIELDS i64 per launched
// sequence (decode.cu); `pages`: the page of (sequence b, block) at b * max_blocks + block (a
// contiguous cache is one page per sequence). `alibi_slopes` (ALiBi, else null): `heads` slopes
// per launched sequence; `rot` (rotary, else null): rot_half cos then rot_half sin per (sequence,
// position), rot_npos positions per sequence; `descale` (FP8 caches, else null): three factors
// per (launched sequence b, kv head hk) at 3 * (b * heads_kv + hk) (decode.cu); `sink` (learnable
// sinks, else null): the logit of (launched sequence b, head h) at b * heads + h. Strides in
// elements; window sides -1 for unbounded; batch: the sequences the append writes; vec_loads: 1
// when head_dim and every k cache stride are multiples of 8 elements; fp8_e5m2 picks the FP8
// format of the caches (0: e4m3).
struct DecodeParams {
    const void* __restrict__ q;
    void* __restrict__ k_cache;
    void* __restrict__ v_cache;
    const void* __restrict__ k_new;
    const void* __restrict__ v_new;
    void* __restrict__ out;
    float* __restrict__ lse;
    float* __restrict__ ws_o;
    float* __restrict__ ws_lse;
    const i64* __restrict__ seqs;
    const int* __restrict__ pages;
    const float* __restrict__ alibi_slopes;
    const float* __restrict__ rot;
    const float* __restrict__ descale;
    const float* __restrict__ sink;
    i64 q_row_stride, q_head_stride;
    i64 k_page_stride, k_row_stride, k_head_stride;
    i64 v_page_stride, v_row_stride, v_head_stride;
    i64 kn_row_stride, kn_head_stride;
    i64 vn_row_stride, vn_head_stride;
    i64 lse_head_stride, total_rows;
    int batch, heads, heads_kv, head_dim, splits;
    int page_size, max_blocks;
    float softmax_scale, softcap;
    int window_left, window_right;
    int rot_half, rot_interleaved, rot_npos;
    int vec_loads, fp8_e5m2;
};
static_assert(sizeof(DecodeParams) == 296, "DecodeParams: params.rs");
static_assert(FA_OFFSETOF(DecodeParams, q_row_stride) == 120, "DecodeParams: params.rs");
static_assert(FA_OFFSETOF(DecodeParams, batch) == 232, "DecodeParams: params.rs");
static_assert(FA_OFFSETOF(DecodeParams, softmax_scale) == 260, "DecodeParams: params.rs");
static_assert(FA_OFFSETOF(DecodeParams, fp8_e5m2) == 292, "DecodeParams: params.rs");
