//! The options of a call ([`FlashAttnOptions`]) and their host-side form that the op keeps
//! ([`HostOptions`]): ALiBi slopes and sequence offsets copied out of their tensors once.

use candle_core::{DType, Error, Result, Tensor};

/// Everything a call can ask for; [`crate::flash_attn_with`] takes it. The `flash_attn*`
/// functions with candle-flash-attn's signatures fill it in.
///
/// ```
/// use flashattn_candle::FlashAttnOptions;
/// let opts = FlashAttnOptions::default().causal(true).softcap(30.0);
/// assert_eq!(opts.softmax_scale, None); // 1/sqrt(head_dim)
/// ```
#[derive(Clone, Debug, Default)]
pub struct FlashAttnOptions {
    /// Multiplies Q·Kᵀ; `None`: 1/sqrt(head_dim).
    pub softmax_scale: Option<f32>,
    /// Causal mask aligned to the bottom-right corner: query i sees key j iff
    /// `j <= i + seqlen_k - seqlen_q` (flash-attn ≥ 2.1). The same as `window_size_right = Some(0)`.
    pub causal: bool,
    /// How many keys to the left of its diagonal a query sees; `None`: all.
    pub window_size_left: Option<usize>,
    /// How many keys to the right of its diagonal a query sees; `None`: all.
    pub window_size_right: Option<usize>,
    /// Scores become `softcap · tanh(scores / softcap)` (after scaling).
    pub softcap: Option<f32>,
    /// ALiBi slopes, `[heads]` or `[batch, heads]` (converted to f32): bias
    /// `-slope · |i + seqlen_k - seqlen_q - j|`. No gradient flows to them.
    pub alibi_slopes: Option<Tensor>,
    /// Packed sequences of different lengths (see [`Varlen`]).
    pub varlen: Option<Varlen>,
}

/// Packed sequences: q is `[total_q, heads, head_dim]`, k and v `[total_k, heads_kv, head_dim]`,
/// and sequence b holds q rows `seqlens_q[b]..seqlens_q[b + 1]` and k/v rows
/// `seqlens_k[b]..seqlens_k[b + 1]`. Both are rank-1 integer tensors (u32 as candle-flash-attn
/// takes them, or i32/i64) of `batch + 1` cumulative offsets from 0; they are read on the host.
#[derive(Clone, Debug)]
pub struct Varlen {
    pub seqlens_q: Tensor,
    pub seqlens_k: Tensor,
}

impl FlashAttnOptions {
    pub fn softmax_scale(mut self, scale: f32) -> Self {
        self.softmax_scale = Some(scale);
        self
    }
    pub fn causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }
    pub fn window(mut self, left: Option<usize>, right: Option<usize>) -> Self {
        self.window_size_left = left;
        self.window_size_right = right;
        self
    }
    pub fn softcap(mut self, softcap: f32) -> Self {
        self.softcap = Some(softcap);
        self
    }
    pub fn alibi_slopes(mut self, slopes: &Tensor) -> Self {
        self.alibi_slopes = Some(slopes.clone());
        self
    }
    pub fn varlen(mut self, seqlens_q: &Tensor, seqlens_k: &Tensor) -> Self {
        self.varlen = Some(Varlen {
            seqlens_q: seqlens_q.clone(),
            seqlens_k: seqlens_k.clone(),
        });
        self
    }
}

/// ALiBi slopes on the host, f32, with their shape.
#[derive(Debug)]
pub(crate) struct HostSlopes {
    pub data: Vec<f32>,
    pub shape: Vec<usize>,
}

/// Cumulative sequence offsets on the host.
#[derive(Debug)]
pub(crate) struct CuSeqlens {
    pub q: Vec<i32>,
    pub k: Vec<i32>,
}

/// [`FlashAttnOptions`] with its tensors read onto the host: what the op keeps for the forward
/// and the backward.
#[derive(Debug)]
pub(crate) struct HostOptions {
    pub softmax_scale: Option<f32>,
    pub causal: bool,
    pub window: (i64, i64),
    pub softcap: Option<f32>,
    pub alibi: Option<HostSlopes>,
    pub cu_seqlens: Option<CuSeqlens>,
}

impl HostOptions {
    pub fn new(o: &FlashAttnOptions) -> Result<Self> {
        // A window wider than i64 is wider than any sequence: unbounded.
        let side = |w: Option<usize>| w.map_or(-1, |w| i64::try_from(w).unwrap_or(i64::MAX));
        let alibi = match &o.alibi_slopes {
            Some(t) => Some(HostSlopes {
                data: t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
                shape: t.dims().to_vec(),
            }),
            None => None,
        };
        let cu_seqlens = match &o.varlen {
            Some(v) => Some(CuSeqlens {
                q: offsets(&v.seqlens_q, "seqlens_q")?,
                k: offsets(&v.seqlens_k, "seqlens_k")?,
            }),
            None => None,
        };
        Ok(HostOptions {
            softmax_scale: o.softmax_scale,
            causal: o.causal,
            window: (side(o.window_size_left), side(o.window_size_right)),
            softcap: o.softcap,
            alibi,
            cu_seqlens,
        })
    }

    /// flashattn's options, borrowing the host copies.
    pub fn attn(&self) -> flashattn::AttnOptions<'_> {
        let mut a = flashattn::AttnOptions::default()
            .causal(self.causal)
            .window(self.window.0, self.window.1);
        a.softmax_scale = self.softmax_scale;
        a.softcap = self.softcap;
        if let Some(s) = &self.alibi {
            a = a.alibi_slopes(flashattn::TensorRef::contiguous(&s.data, &s.shape));
        }
        if let Some(c) = &self.cu_seqlens {
            a = a.varlen(&c.q, &c.k);
        }
        a
    }
}

/// A rank-1 integer tensor of offsets as i32 (flashattn checks their order and range).
fn offsets(t: &Tensor, name: &str) -> Result<Vec<i32>> {
    if t.rank() != 1 || !matches!(t.dtype(), DType::U32 | DType::I32 | DType::I64) {
        return Err(Error::Msg(format!(
            "flashattn-candle: {name} must be a rank-1 u32, i32 or i64 tensor, got {:?} of shape {:?}",
            t.dtype(),
            t.dims()
        )));
    }
    t.to_dtype(DType::I64)?
        .to_vec1::<i64>()?
        .into_iter()
        .map(|x| {
            i32::try_from(x).map_err(|_| {
                Error::Msg(format!(
                    "flashattn-candle: {name} holds {x}, outside the i32 range of offsets"
                ))
            })
        })
        .collect()
}
