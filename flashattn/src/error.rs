//! The one error type of flashattn: an [`Error`] around a non-exhaustive [`ErrorKind`] that carries
//! the offending values, so a message can name the tensor and the numbers without the caller digging.

use crate::dtype::DType;
use std::fmt;

/// Which input an error is about.
pub type TensorName = &'static str;

/// What was wrong with a `cu_seqlens` array.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CuSeqlensProblem {
    /// `cu_seqlens_q` and `cu_seqlens_k` must have the same number of entries (batch + 1, at least 1).
    Length { expected: usize, got: usize },
    /// The first entry must be 0.
    NotStartingAtZero { first: i32 },
    /// Entries must not decrease.
    Decreasing {
        index: usize,
        previous: i32,
        value: i32,
    },
    /// The last entry points past the packed tensor's token dimension.
    PastTensor { last: i32, total: usize },
}

impl fmt::Display for CuSeqlensProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CuSeqlensProblem::Length { expected, got } => {
                write!(
                    f,
                    "has {got} entries, expected {expected} (batch + 1, at least 1)"
                )
            }
            CuSeqlensProblem::NotStartingAtZero { first } => {
                write!(f, "starts at {first}, must start at 0")
            }
            CuSeqlensProblem::Decreasing {
                index,
                previous,
                value,
            } => {
                write!(f, "decreases at entry {index}: {previous} then {value}")
            }
            CuSeqlensProblem::PastTensor { last, total } => {
                write!(
                    f,
                    "ends at {last}, past the {total} tokens of the packed tensor"
                )
            }
        }
    }
}

/// Every way an input can be rejected. Values are those the caller passed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ErrorKind {
    #[error("tensor `{tensor}` has rank {got}, expected {expected} ({layout})")]
    Rank {
        tensor: TensorName,
        expected: usize,
        got: usize,
        layout: &'static str,
    },
    #[error("tensor `{tensor}` has {strides} strides for {dims} dimensions")]
    StridesRank {
        tensor: TensorName,
        dims: usize,
        strides: usize,
    },
    #[error("tensor `{tensor}` has shape {got:?}, expected {expected:?}")]
    Shape {
        tensor: TensorName,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    #[error("tensor `{tensor}` has dtype {got}, expected {expected}")]
    DType {
        tensor: TensorName,
        expected: DType,
        got: DType,
    },
    #[error("tensor `{tensor}` has head_dim {head_dim}; supported: 1..=256")]
    HeadDim { tensor: TensorName, head_dim: usize },
    #[error("heads ({heads}) must be a positive multiple of heads_kv ({heads_kv})")]
    HeadsNotMultiple { heads: usize, heads_kv: usize },
    #[error(
        "tensor `{tensor}`: the last dimension must be contiguous (stride 1), got stride {stride}"
    )]
    LastDimNotContiguous { tensor: TensorName, stride: usize },
    #[error(
        "tensor `{tensor}`: shape {shape:?} with strides {strides:?} reaches element {needed}, \
         but the buffer holds {len}"
    )]
    OutOfBounds {
        tensor: TensorName,
        shape: Vec<usize>,
        strides: Vec<usize>,
        needed: u128,
        len: usize,
    },
    #[error(
        "select({dim}, {index}) does not fit a view of shape {shape:?} and strides {strides:?} \
         over {len} elements: dim must be below the rank, index below shape[dim], and \
         index · strides[dim] within the buffer"
    )]
    Select {
        dim: usize,
        index: usize,
        shape: Vec<usize>,
        strides: Vec<usize>,
        len: usize,
    },
    #[error("window ({left}, {right}) is invalid: each side must be -1 (unbounded) or >= 0")]
    Window { left: i64, right: i64 },
    #[error(
        "softcap {softcap} is invalid: it must be a finite number > 0, with softcap · log2(e) \
         finite and softmax_scale / softcap not below f32's smallest normal number (leave it unset \
         to disable)"
    )]
    Softcap { softcap: f32 },
    #[error("softmax_scale {scale} is invalid: softmax_scale · log2(e) must be finite in f32")]
    Scale { scale: f32 },
    #[error("alibi_slopes has shape {got:?}, expected [{heads}] or [{batch}, {heads}]")]
    AlibiShape {
        got: Vec<usize>,
        batch: usize,
        heads: usize,
    },
    #[error(
        "alibi_slopes: the slope of batch row {batch}, head {head} is {slope}; its bias for the \
         farthest key, slope · log2(e) · {max_distance}, must be finite in f32"
    )]
    AlibiSlope {
        batch: usize,
        head: usize,
        slope: f32,
        /// The largest query-key distance of the call: max(seqlen_q, seqlen_k) - 1 over its
        /// sequences.
        max_distance: usize,
    },
    #[error("learnable_sink has shape {got:?}, expected [{heads}] (one logit per query head)")]
    SinkShape { got: Vec<usize>, heads: usize },
    #[error(
        "learnable_sink: the sink of head {head} is {value}; sink · log2(e) must be finite in f32"
    )]
    SinkValue { head: usize, value: f32 },
    #[error("`{tensor}` {problem}")]
    CuSeqlens {
        tensor: TensorName,
        problem: CuSeqlensProblem,
    },
    #[error("dropout_p {p} is invalid: it must be in [0, 1)")]
    Dropout { p: f32 },
    #[error("tensor `{tensor}` is too large: its size overflows the address space")]
    TooLarge { tensor: TensorName },
    /// A caller-provided destination (`flash_attn_into` and the like) of the wrong size: it must
    /// hold `shape`'s elements, contiguous.
    #[error(
        "destination `{tensor}` holds {got} elements, expected {expected} (contiguous {shape:?})"
    )]
    DestinationLength {
        tensor: TensorName,
        expected: usize,
        got: usize,
        shape: Vec<usize>,
    },
    /// The memory for a result, the per-sequence table or a working buffer whose size follows
    /// the shapes could not be had: `bytes` is what the one allocation asked for. Nothing the
    /// caller owns was written.
    #[error("out of memory: {bytes} bytes for {what} could not be allocated")]
    OutOfMemory { what: &'static str, bytes: usize },
    #[error(
        "instruction set {requested:?} is not available on this CPU (best available: {best:?})"
    )]
    IsaUnavailable {
        requested: crate::isa::Isa,
        best: crate::isa::Isa,
    },
    #[error("FLASHATTN_ISA={name:?} names no instruction set; use scalar, neon, avx2 or avx512")]
    IsaUnknown { name: String },
    #[error(
        "FLASHATTN_DQ_CHUNKS={value:?} is not a dQ strategy; use 0 (two passes) or 1 to 4 (copies of dQ)"
    )]
    DqChunksUnknown { value: String },
    #[error("`{tensor}` has {got} entries, expected {expected} ({what})")]
    IndexLength {
        tensor: TensorName,
        expected: usize,
        got: usize,
        what: &'static str,
    },
    #[error("`{tensor}`[{index}] = {value} is out of range 0..{bound}")]
    IndexOutOfRange {
        tensor: TensorName,
        index: usize,
        value: i64,
        bound: usize,
    },
    #[error(
        "appending {seqlen_new} tokens at cache_seqlens[{batch}] = {cache_seqlen} needs {needed} \
         slots, but the cache holds {capacity} for this sequence; nothing was written"
    )]
    CacheOverflow {
        batch: usize,
        cache_seqlen: usize,
        seqlen_new: usize,
        needed: usize,
        capacity: usize,
    },
    #[error(
        "cache_batch_idx cannot be combined with block_table: a paged cache is addressed through \
         block_table alone"
    )]
    PagedWithBatchIdx,
    #[error(
        "rotary_dim {rotary_dim} (twice the columns of rotary_cos/rotary_sin) must be in \
         2..=head_dim ({head_dim})"
    )]
    RotaryDim { rotary_dim: usize, head_dim: usize },
    #[error(
        "the rotary embedding of batch {batch} needs positions 0..{needed}, but rotary_cos and \
         rotary_sin have {seqlen_ro} rows"
    )]
    RotaryPositions {
        batch: usize,
        needed: usize,
        seqlen_ro: usize,
    },
    #[error(
        "a rotary embedding needs new keys (k_new, v_new): q and the appended keys are rotated at \
         positions cache_seqlens[b] + i"
    )]
    RotaryWithoutNewKv,
    #[error(
        "cu_seqlens_k_new is given without new keys and values: it packs k_new and v_new \
         ([total_k_new, heads_kv, head_dim]); pass them too, or drop it"
    )]
    CuSeqlensKNewWithoutNewKv,
    #[error("dropout is not available when decoding with a KV cache (dropout_p = {p}); use 0")]
    DropoutInDecode { p: f32 },
    #[error(
        "num_splits = {num_splits} is invalid: it must be 1 to {max} (unset: automatic)",
        max = crate::limits::MAX_NUM_SPLITS
    )]
    NumSplits { num_splits: usize },
    #[error("merging attention partials needs at least one partial result")]
    NoPartials,
    #[error("got {outs} partial outputs but {lses} partial LSEs")]
    PartialsCount { outs: usize, lses: usize },
    #[error(
        "partial {part}: `{tensor}` has shape {got:?} and dtype {got_dtype}, expected \
         {expected:?} and {expected_dtype} (those of partial 0)"
    )]
    PartialMismatch {
        part: usize,
        tensor: TensorName,
        expected: Vec<usize>,
        got: Vec<usize>,
        expected_dtype: DType,
        got_dtype: DType,
    },
    #[error(
        "partial {part}: lse holds {value} at flat index {index}; an LSE must be finite or -inf"
    )]
    PartialLse {
        part: usize,
        index: usize,
        value: f32,
    },
    #[error(
        "tensor `{tensor}` is fp8 {got}, expected {expected} (q's format): q, k and v share one \
         FP8 format"
    )]
    Fp8Format {
        tensor: TensorName,
        expected: crate::dtype::Fp8Format,
        got: crate::dtype::Fp8Format,
    },
    #[error(
        "`{tensor}` has {got} values, expected 1 (the whole tensor) or batch · heads_kv = \
         {batch} · {heads_kv}"
    )]
    DescaleLength {
        tensor: TensorName,
        got: usize,
        batch: usize,
        heads_kv: usize,
    },
    #[error(
        "`v_cache` is fp8 {got} but `k_cache` is fp8 {expected}: the two caches share one FP8 format"
    )]
    Fp8CacheFormat {
        expected: crate::dtype::Fp8Format,
        got: crate::dtype::Fp8Format,
    },
    #[error(
        "`{tensor}` was given, but that tensor is not FP8 in this call (only the caches are): \
         leave it unset"
    )]
    DescaleUnused { tensor: TensorName },
    #[error(
        "descale factors were given to a call whose inputs are not FP8: only the FP8 calls \
         (fp8::flash_attn_fp8, fp8::flash_attn_with_kvcache_fp8) take them; leave \
         AttnOptions::descale unset"
    )]
    DescaleNotFp8,
    #[error(
        "AttnOptions::varlen (cu_seqlens_q, cu_seqlens_k) was given to a decode call: pack its \
         queries with KvCacheOptions::cu_seqlens_q and its new keys with cu_seqlens_k_new"
    )]
    VarlenInDecode,
    #[error(
        "the FP8 descale factors let {what} reach {reach:e}, beyond f32's range: scale the \
         inputs so that their factors are smaller"
    )]
    DescaleRange { what: &'static str, reach: f64 },
    /// Incoherent processing (`fp8::quantize_qkv`) multiplies q and k by a Hadamard matrix of
    /// order `head_dim`, which exists here for powers of two only.
    #[error(
        "incoherent processing needs head_dim to be a power of two (its Hadamard transform), \
         got {head_dim}"
    )]
    IncoherentHeadDim { head_dim: usize },
    #[error("`{tensor}`[{index}] = {value} is invalid: a descale factor must be finite and > 0")]
    DescaleValue {
        tensor: TensorName,
        index: usize,
        value: f32,
    },
    /// No usable NVIDIA GPU: the driver library is missing, or it reports no device.
    #[error("no CUDA device: {reason}")]
    CudaUnavailable { reason: String },
    /// NVRTC (the run-time CUDA compiler) could not be found or loaded.
    #[error(
        "NVRTC (libnvrtc) not found: searched {searched:?}; install it (e.g. `pip install \
         nvidia-cuda-nvrtc==13.0.88`) or point FLASHATTN_NVRTC at libnvrtc.so"
    )]
    NvrtcUnavailable { searched: Vec<String> },
    /// A CUDA driver call failed.
    #[error("CUDA driver call `{call}` failed: {message}")]
    CudaDriver { call: &'static str, message: String },
    /// NVRTC rejected a kernel; `log` is its compile log.
    #[error("NVRTC could not compile kernel `{kernel}` for {arch}:\n{log}")]
    KernelCompile {
        kernel: String,
        arch: String,
        log: String,
    },
    /// A custom mask function ([`crate::AttnOptions::mask_mod`]) on a call that does not take one:
    /// only the CPU forward and backward of f32, f16 and bf16 inputs do.
    #[error(
        "mask_mod or block_mask (a custom mask) is not supported by {call}; only the CPU forward and \
         backward of f32, f16 and bf16 inputs take one"
    )]
    MaskModUnsupported { call: &'static str },
    /// A custom score function ([`crate::AttnOptions::score_mod`]) on a call that does not take
    /// one: only the CPU forward and backward of f32, f16 and bf16 inputs do.
    #[error(
        "score_mod (a custom score function) is not supported by {call}; only the CPU forward and \
         backward of f32, f16 and bf16 inputs take one"
    )]
    ScoreModUnsupported { call: &'static str },
    /// A score expression ([`crate::score_expr::ScoreExpr`]) that is not well formed.
    #[error("invalid score expression: {detail}")]
    ScoreExpr { detail: String },
    /// A block mask ([`crate::AttnOptions::block_mask`]) made for another shape than the call's:
    /// `dim` of the mask is `mask`, the call's `call`. Batch and heads may be 1 (shared); the
    /// lengths must equal the call's, or with `packed` (varlen) cover its longest sequence.
    #[error(
        "block_mask was made for {dim} {mask} but the call has {dim} {call} ({})",
        if *packed {
            "packed: the mask's lengths must be at least the longest sequence's"
        } else if *dim == "batch" || *dim == "heads" {
            "the mask's batch and heads must be the call's or 1"
        } else {
            "the mask's lengths must be the call's"
        }
    )]
    BlockMaskShape {
        dim: &'static str,
        mask: usize,
        call: usize,
        packed: bool,
    },
    /// A block mask's construction input is inconsistent (a dense mask of the wrong size, rows
    /// that are not whole blocks, rows never given).
    #[error("block mask: {detail}")]
    BlockMaskInput { detail: String },
    /// An option the CUDA backend does not implement (the CPU path does).
    #[error("{feature} is not supported by the CUDA backend{detail}")]
    CudaUnsupported {
        feature: &'static str,
        detail: String,
    },
    /// A size beyond what one kernel launch can address.
    #[error("{what} = {value} exceeds the CUDA backend's limit of {limit}")]
    CudaLimit {
        what: &'static str,
        value: u64,
        limit: u64,
    },
    /// A per-block descale table ([`crate::Descale::per_block`]) of the wrong length.
    #[error(
        "`{tensor}` has {got} values, expected {expected} per-block factors: [batch, heads, \
         blocks] = [{batch}, {heads}, {blocks}] (blocks of 128 rows, ceil of the longest \
         sequence's length over 128)"
    )]
    DescaleBlockLength {
        tensor: TensorName,
        got: usize,
        expected: usize,
        batch: usize,
        heads: usize,
        blocks: usize,
    },
    /// Per-block descale factors given to a call that takes one factor per (sequence, kv head)
    /// at most.
    #[error(
        "{call} does not take per-block descale factors (Descale::per_block): give one factor \
         per tensor or per (sequence, kv head)"
    )]
    DescalePerBlock { call: &'static str },
}

/// The error flashattn returns for every rejected input.
#[derive(Clone, Debug, PartialEq)]
pub struct Error {
    kind: ErrorKind,
}

impl Error {
    pub fn kind(&self) -> &ErrorKind {
        &self.kind
    }
}

impl From<ErrorKind> for Error {
    fn from(kind: ErrorKind) -> Self {
        Error { kind }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.kind.fmt(f)
    }
}

impl std::error::Error for Error {}

pub type Result<T, E = Error> = std::result::Result<T, E>;
