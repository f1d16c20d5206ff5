//! [`Params`]: a validated attention call, the whole contract between the API and the kernels
//! (per-sequence offsets, layouts, options folded into constants).

use crate::blocks::MaskMod;
use crate::cpu::simd::Kernels;
use crate::dropout::Dropout;
use crate::score_fn::ScoreFn;
use crate::tensor::DType;

/// log2(e), folded into the softmax scale so the kernels can use exp2.
pub const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// Largest supported head dimension.
pub const MAX_HEAD_DIM: usize = 256;

/// Element strides of a q/k/v-like tensor's token and head dimensions (the last one is 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RowLayout {
    pub row_stride: usize,
    pub head_stride: usize,
}

/// One sequence of the batch.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Seq {
    pub seqlen_q: usize,
    pub seqlen_k: usize,
    /// Element offsets of row 0, head 0 in q, k and v.
    pub q_base: usize,
    pub k_base: usize,
    pub v_base: usize,
    /// Token index of row 0 in the contiguous outputs (`b * seqlen_q` batched, `cu_seqlens_q[b]` packed).
    pub out_row0: usize,
    /// Index of (head 0, row 0) in `lse`.
    pub lse_base: usize,
    /// Token index of key 0 in the contiguous `dk`/`dv` (`b * seqlen_k` batched, `cu_seqlens_k[b]` packed).
    pub k_row0: usize,
}

/// Validated parameters: the whole contract between the API and the kernels.
#[derive(Clone, Debug)]
pub(crate) struct Params {
    pub dtype: DType,
    pub heads: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    pub seqs: Vec<Seq>,
    pub q: RowLayout,
    pub k: RowLayout,
    pub v: RowLayout,
    /// Total rows of `out` (batch * seqlen_q, or total_q when packed).
    pub total_q: usize,
    /// Distance between heads in `lse`.
    pub lse_head_stride: usize,
    pub out_shape: Vec<usize>,
    pub lse_shape: Vec<usize>,
    /// Shape of k and v (and so of `dk`, `dv`).
    pub k_shape: Vec<usize>,
    /// Total key rows (batch * seqlen_k, or total_k when packed).
    pub total_k: usize,
    pub softmax_scale: f32,
    pub softcap: Option<f32>,
    /// `None`: unbounded.
    pub window_left: Option<usize>,
    pub window_right: Option<usize>,
    /// Slopes per (batch, head), `batch * heads` entries.
    pub alibi: Option<Vec<f32>>,
    /// Learnable sink logits per head (natural log, like the scaled scores).
    pub sink: Option<Vec<f32>>,
    pub dropout: Option<Dropout>,
    /// Whether q is packed (`[total_q, heads, d]`) rather than batched.
    pub packed: bool,
    /// The CPU microkernels to run.
    pub kernels: &'static Kernels,
    /// FP8 dequantisation factors (forward only; see [`crate::fp8`]).
    pub descale: Option<Descales>,
    /// The custom mask function ([`crate::AttnOptions::mask_mod`]; CPU forward and backward).
    pub mask_mod: Option<MaskMod>,
    /// The custom score function ([`crate::AttnOptions::score_mod`]; CPU forward and backward).
    pub score_fn: Option<ScoreFn>,
}

/// The FP8 descale factors, folded: per (sequence b, kv head hk), at `b * heads_kv + hk`.
#[derive(Clone, Debug)]
pub(crate) struct Descales {
    /// `softmax_scale · q_descale · k_descale` (the product taken in f64, rounded once).
    pub score_scale: Vec<f32>,
    /// `v_descale`: multiplies the output rows.
    pub out_scale: Vec<f32>,
    /// Per-block factors ([`crate::Descale::per_block`]): then `score_scale` is the softmax scale
    /// and `out_scale` 1, and these tables hold the factors.
    pub blocks: Option<BlockDescales>,
}

/// Rows of one (sequence, head) that share a factor in [`crate::Descale::per_block`] tables (as
/// FlashAttention-3's block quantisation and its kernels' 128-row query tiles).
pub const DESCALE_BLOCK: usize = 128;

/// Per-block factors ([`crate::Descale::per_block`]), checked: `[batch, heads, q_blocks]` for q and
/// `[batch, heads_kv, k_blocks]` for k and v, 1 for an unset table and for the padding entries
/// past a sequence's last block (never read).
#[derive(Clone, Debug)]
pub(crate) struct BlockDescales {
    pub q_blocks: usize,
    pub k_blocks: usize,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

impl BlockDescales {
    /// The factor of row `i` of (sequence `b`, head `h`) of tensor `t` (0: q, 1: k, 2: v).
    #[inline]
    pub fn factor(&self, t: usize, heads: usize, b: usize, h: usize, i: usize) -> f32 {
        let (table, blocks) = match t {
            0 => (&self.q, self.q_blocks),
            1 => (&self.k, self.k_blocks),
            _ => (&self.v, self.k_blocks),
        };
        table[(b * heads + h) * blocks + i / DESCALE_BLOCK]
    }
}

impl Params {
    /// Index into `out` of (sequence `b`, row `i`, head `h`, 0).
    #[inline]
    pub fn out_offset(&self, b: usize, i: usize, h: usize) -> usize {
        ((self.seqs[b].out_row0 + i) * self.heads + h) * self.head_dim
    }
    /// Index into `lse` of (sequence `b`, head `h`, row `i`).
    #[inline]
    pub fn lse_offset(&self, b: usize, h: usize, i: usize) -> usize {
        self.seqs[b].lse_base + h * self.lse_head_stride + i
    }
    /// Index into `dk`/`dv` of (sequence `b`, key `j`, kv head `hk`, 0).
    #[inline]
    pub fn dk_offset(&self, b: usize, j: usize, hk: usize) -> usize {
        ((self.seqs[b].k_row0 + j) * self.heads_kv + hk) * self.head_dim
    }
    pub fn dk_len(&self) -> usize {
        self.total_k * self.heads_kv * self.head_dim
    }
    /// The kv head that query head `h` reads.
    #[inline]
    pub fn kv_head(&self, h: usize) -> usize {
        h / (self.heads / self.heads_kv)
    }
    /// The factor of the raw dot products q·k of query head `h` in sequence `b`: `softmax_scale`,
    /// times the FP8 descale factors of q and k when there are any.
    #[inline]
    pub fn score_scale(&self, b: usize, h: usize) -> f32 {
        match &self.descale {
            Some(d) => d.score_scale[b * self.heads_kv + self.kv_head(h)],
            None => self.softmax_scale,
        }
    }
    /// The factor of the output rows of query head `h` in sequence `b` (FP8 `v_descale`; else 1).
    #[inline]
    pub fn out_descale(&self, b: usize, h: usize) -> f32 {
        self.descale
            .as_ref()
            .map_or(1.0, |d| d.out_scale[b * self.heads_kv + self.kv_head(h)])
    }
    pub fn alibi_slope(&self, b: usize, h: usize) -> Option<f32> {
        self.alibi.as_ref().map(|s| s[b * self.heads + h])
    }
    pub fn out_len(&self) -> usize {
        self.total_q * self.heads * self.head_dim
    }
    pub fn lse_len(&self) -> usize {
        self.total_q * self.heads
    }
}
