//! User options -> validated parameters. This is the only place that checks input: every shape,
//! stride, dtype, option and `cu_seqlens` entry is checked here once, and the kernels trust [`Params`].
//!
//! Batched and packed (varlen) layouts are reduced to one description: per sequence, the element
//! offset of its first row in q, k and v, its lengths, and where its rows go in `out` and `lse`.
//! Row `i`, head `h` of sequence `b` of q starts at `seqs[b].q_base + i * q.row_stride + h * q.head_stride`.
//!
//! The files: [`contract`] ([`Params`], the contract between the API and the kernels),
//! [`options`] (the public options of every call, [`AttnOptions`] and [`KvCacheOptions`], and the
//! checks of the attention options), [`check`] (checks of one tensor: view, dtype, shape, sizes,
//! `cu_seqlens`, destinations), [`attn`] (the forward and backward calls: batched, varlen, the
//! backward's extra inputs) and [`decode`] ([`DecodeParams`], the validation of a decode call).
//!
//! [`KvCacheOptions`]: options::KvCacheOptions

pub(crate) mod attn;
pub(crate) mod check;
pub(crate) mod contract;
pub(crate) mod decode;
pub(crate) mod options;

pub(crate) use attn::{attn, batched, grad_inputs, layout, q_like, varlen, GradInputs, QLike};
pub(crate) use check::{destination, out_buffers};
// Reached through the facade only from `cuda/`.
#[cfg(feature = "cuda")]
pub(crate) use attn::check_lse;
#[cfg(feature = "cuda")]
pub(crate) use check::check_view;
pub(crate) use contract::{BlockDescales, Descales, Params, RowLayout, Seq};
pub use contract::{DESCALE_BLOCK, LOG2_E, MAX_HEAD_DIM};
pub(crate) use decode::DecodeParams;
pub(crate) use options::{check_no_mask_mod, check_score_scale};
pub use options::{AttnOptions, Descale};
