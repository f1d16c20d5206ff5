//! `flashattn._flashattn`: the extension module behind the `flashattn` Python package.
//!
//! Each function takes torch tensors as [`view::RawView`]s, runs one call of the Rust library on a
//! rayon pool of `opts.num_threads` threads with the GIL released, and writes its results into
//! output tensors the Python layer allocated. Validation of shapes, strides, options and values
//! is the library's (one boundary); this layer only checks what turns addresses into slices.

mod block_mask;
#[cfg(feature = "cuda")]
mod cuda;
mod errors;
mod score_mod;
mod view;

use std::cell::RefCell;
use std::sync::{Arc, Mutex};

use flashattn::fp8::Descale;
use flashattn::{AttnOptions, BlockTable, KvCacheOptions, TensorRef};
use pyo3::prelude::*;

use block_mask::{PyBlockMask, PyBlockMaskBuilder};
use errors::{BindError, FlashAttnError};
use score_mod::PyScoreMod;
use view::{Dt, RawView, View};

/// The options every attention call shares, as the Python layer passes them (a dict).
#[derive(Debug, FromPyObject)]
#[pyo3(from_item_all)]
pub(crate) struct Opts {
    softmax_scale: f32,
    causal: bool,
    window_left: i64,
    window_right: i64,
    /// 0: no softcap (flash-attn's convention).
    softcap: f32,
    alibi_slopes: Option<RawView>,
    learnable_sink: Option<RawView>,
    dropout_p: f32,
    seed: u64,
    num_threads: usize,
    /// Packed (varlen) sequences: `cu_seqlens_q`, `cu_seqlens_k`.
    cu_seqlens: Option<(Vec<i32>, Vec<i32>)>,
    /// FP8 forward: the descale factors are per-block tables (`Descale::per_block`).
    descale_per_block: bool,
    /// A mask evaluated once (`flashattn.BlockMask`; CPU forward and backward).
    block_mask: Option<Py<PyBlockMask>>,
    /// A traced score function (`flashattn.flex_attention(score_mod=)`; CPU forward and
    /// backward). Absent from the dicts of the calls that take none.
    #[pyo3(default)]
    score_mod: Option<Py<PyScoreMod>>,
}

/// The options' tensors, checked.
struct OptViews {
    alibi: Option<View>,
    sink: Option<View>,
}

impl Opts {
    fn views(&self) -> Result<OptViews, BindError> {
        Ok(OptViews {
            alibi: self.alibi_slopes.clone().map(View::try_from).transpose()?,
            sink: self
                .learnable_sink
                .clone()
                .map(View::try_from)
                .transpose()?,
        })
    }

    /// # Safety
    /// The option tensors stay alive and unwritten for `'a` (see [`View::tensor`]).
    unsafe fn attn<'a>(&self, v: &OptViews) -> Result<AttnOptions<'a>, BindError> {
        let mut o = AttnOptions::default()
            .softmax_scale(self.softmax_scale)
            .causal(self.causal)
            .window(self.window_left, self.window_right);
        if self.softcap != 0.0 {
            o = o.softcap(self.softcap);
        }
        if let Some(a) = &v.alibi {
            o = o.alibi_slopes(a.tensor()?);
        }
        if let Some(s) = &v.sink {
            o = o.learnable_sink(s.tensor()?);
        }
        if self.dropout_p != 0.0 {
            o = o.dropout(self.dropout_p, self.seed);
        }
        if let Some(m) = &self.block_mask {
            o = o.block_mask(m.get().inner.clone());
        }
        if let Some(f) = &self.score_mod {
            o = o.score_mod(f.get().inner.clone());
        }
        Ok(o)
    }

    /// [`Opts::attn`] with the packed layout of `cu_seqlens` when given: the options of a
    /// forward or backward call (a decode call packs through its own `cu_seqlens_q`).
    ///
    /// # Safety
    /// As [`Opts::attn`].
    unsafe fn attn_packed<'a>(&'a self, v: &OptViews) -> Result<AttnOptions<'a>, BindError> {
        let o = self.attn(v)?;
        Ok(match &self.cu_seqlens {
            Some((cq, ck)) => o.varlen(cq, ck),
            None => o,
        })
    }
}

/// Rayon pools by thread count, made once each, for calls that cannot run on their caller's
/// own pool (see [`run`]).
fn shared_pool(threads: usize) -> Result<Arc<rayon::ThreadPool>, BindError> {
    static POOLS: Mutex<Vec<(usize, Arc<rayon::ThreadPool>)>> = Mutex::new(Vec::new());
    let mut pools = POOLS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, p)) = pools.iter().find(|(n, _)| *n == threads) {
        return Ok(p.clone());
    }
    let p = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("flashattn-{i}"))
        .build()
        .map_err(|e| BindError::Value(format!("could not start {threads} threads: {e}")))?;
    let p = Arc::new(p);
    pools.push((threads, p.clone()));
    Ok(p)
}

/// What [`run`] knows about the calling thread's own pool.
enum Own {
    /// No call from this thread yet.
    Untried,
    /// A pool of `current_num_threads()` threads whose worker 0 is this thread.
    Pool(rayon::ThreadPool),
    /// Building one failed: this thread's calls go to [`shared_pool`].
    Failed,
}

thread_local! {
    /// The pool this thread joined on its first call (dropped, its other threads ended, when
    /// the thread exits).
    static OWN: RefCell<Own> = const { RefCell::new(Own::Untried) };
}

/// Runs `f` (one library call) on `threads` threads: `rayon::current_num_threads()` is `threads`
/// inside it, which the decode's split count reads; the other entry points give the same bits
/// for any count.
///
/// The calling thread's first call makes it worker 0 of a pool of that many threads of its own
/// (`use_current_thread`; the other `threads - 1` are started then), so every call with that
/// count runs on the caller: work that does not split (one work item, or one thread) never
/// leaves it, and split work goes to the other threads by work stealing while the caller takes
/// its share. Handing the whole call to a pool's thread instead and sleeping until it ends cost
/// ~60-270 us per call on a 2-vCPU VM (waking an idle thread, and on an idle VM a halted vCPU),
/// against ~10 us for all of SDPA on a tiny call. Rayon cannot take a thread out of a pool
/// again, so a call with another count (torch.set_num_threads changed since) goes to a shared
/// pool of that count and pays the hand-off.
fn run<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> Result<R, BindError> {
    let threads = threads.max(1);
    let mut f = Some(f);
    let ran = OWN.with(|own| {
        let untried = matches!(*own.borrow(), Own::Untried);
        if untried {
            *own.borrow_mut() = match rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .use_current_thread()
                .thread_name(|i| format!("flashattn-{i}"))
                .build()
            {
                Ok(p) => Own::Pool(p),
                Err(_) => Own::Failed,
            };
        }
        match &*own.borrow() {
            // `install` from the pool's own worker 0 runs `f` on this thread.
            Own::Pool(p) if p.current_num_threads() == threads => f.take().map(|f| p.install(f)),
            _ => None,
        }
    });
    match (ran, f) {
        (Some(r), _) => Ok(r),
        (None, Some(f)) => Ok(shared_pool(threads)?.install(f)),
        (None, None) => unreachable!("`f` runs or is handed on"),
    }
}

pub(crate) fn views<const N: usize>(raw: [RawView; N]) -> Result<[View; N], BindError> {
    let v: Vec<View> = raw
        .into_iter()
        .map(View::try_from)
        .collect::<Result<_, _>>()?;
    Ok(v.try_into().expect("N views"))
}

/// Where a forward writes its lse: the caller's `lse`, or, when it drops it, `own` sized to the
/// call's `rows` (one f32 per query row and head).
///
/// # Safety
/// As [`View::dest_f32`].
unsafe fn lse_dest<'a>(
    lse: Option<&View>,
    rows: usize,
    own: &'a mut Vec<f32>,
) -> Result<&'a mut [f32], BindError> {
    match lse {
        Some(l) => l.dest_f32(),
        None => {
            own.resize(rows, 0f32);
            Ok(own)
        }
    }
}

/// Forward: `flash_attn_into` (or the varlen form with `opts.cu_seqlens`): the kernels write
/// straight into out and lse. Without `lse` (a caller that drops it) the kernels write it to a
/// buffer of this call's own, one f32 per query row and head.
#[pyfunction]
#[pyo3(signature = (q, k, v, out, lse, opts))]
fn fwd(
    py: Python<'_>,
    q: RawView,
    k: RawView,
    v: RawView,
    out: RawView,
    lse: Option<RawView>,
    opts: Opts,
) -> PyResult<()> {
    py.detach(move || -> Result<(), BindError> {
        let [q, k, v, out] = views([q, k, v, out])?;
        let lse = lse.map(View::try_from).transpose()?;
        let ov = opts.views()?;
        let mut inputs = vec![&q, &k, &v];
        inputs.extend(ov.alibi.iter().chain(&ov.sink));
        for w in [Some(&out), lse.as_ref()].into_iter().flatten() {
            w.check_disjoint(inputs.iter().copied())?;
        }
        out.check_disjoint(lse.iter())?;
        // q's elements over its last dimension: the rows of lse in either layout.
        let rows = q.shape.iter().product::<usize>() / q.shape.last().copied().unwrap_or(1).max(1);
        let mut own_lse = Vec::new();
        // SAFETY: the Python layer holds every tensor of the call alive and does not write the
        // inputs while it runs; out and lse are fresh tensors, checked disjoint from the inputs
        // and from each other, so the kernels write them in place.
        unsafe {
            let ao = opts.attn_packed(&ov)?;
            let (qt, kt, vt) = (q.tensor()?, k.tensor()?, v.tensor()?);
            let dst = flashattn::OutBuffers {
                out: out.dest()?,
                lse: lse_dest(lse.as_ref(), rows, &mut own_lse)?,
            };
            run(opts.num_threads, || {
                flashattn::flash_attn_into(&qt, &kt, &vt, &ao, dst)
            })??;
        }
        Ok(())
    })?;
    Ok(())
}

/// Backward: gradients of the forward above, written in place into dq, dk, dv (and dsink).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn bwd(
    py: Python<'_>,
    q: RawView,
    k: RawView,
    v: RawView,
    out: RawView,
    lse: RawView,
    dout: RawView,
    dq: RawView,
    dk: RawView,
    dv: RawView,
    dsink: Option<RawView>,
    opts: Opts,
) -> PyResult<()> {
    py.detach(move || -> Result<(), BindError> {
        let [q, k, v, out, lse, dout, dq, dk, dv] = views([q, k, v, out, lse, dout, dq, dk, dv])?;
        let dsink = dsink.map(View::try_from).transpose()?;
        let ov = opts.views()?;
        // SAFETY: as in `fwd`; the gradients are fresh tensors checked disjoint from the inputs
        // and from each other before they are written.
        let mut inputs = vec![&q, &k, &v, &out, &lse, &dout];
        inputs.extend(ov.alibi.iter().chain(&ov.sink));
        let mut outs = vec![&dq, &dk, &dv];
        outs.extend(dsink.iter());
        for (i, w) in outs.iter().enumerate() {
            w.check_disjoint(inputs.iter().copied())?;
            w.check_disjoint(outs[i + 1..].iter().copied())?;
        }
        // SAFETY: as in `fwd`; the gradients are fresh tensors checked disjoint from the inputs
        // and from each other, written in place by the kernels.
        unsafe {
            let ao = opts.attn_packed(&ov)?;
            let t = [&q, &k, &v, &out, &lse, &dout].map(|x| x.tensor());
            let [qt, kt, vt, ot, lt, dot] = t;
            let (qt, kt, vt, ot, lt, dot) = (qt?, kt?, vt?, ot?, lt?, dot?);
            let dst = flashattn::GradBuffers {
                dq: dq.dest()?,
                dk: dk.dest()?,
                dv: dv.dest()?,
                dsink: dsink.as_ref().map(|d| d.dest_f32()).transpose()?,
            };
            run(opts.num_threads, || {
                flashattn::flash_attn_backward_into(&qt, &kt, &vt, &ot, &lt, &dot, &ao, dst)
            })??;
        }
        Ok(())
    })?;
    Ok(())
}

/// FP8 forward (e4m3fn or e5m2 q, k, v with descale factors); out is bf16.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn fwd_fp8(
    py: Python<'_>,
    q: RawView,
    k: RawView,
    v: RawView,
    out: RawView,
    lse: RawView,
    q_descale: Option<Vec<f32>>,
    k_descale: Option<Vec<f32>>,
    v_descale: Option<Vec<f32>>,
    opts: Opts,
) -> PyResult<()> {
    py.detach(move || -> Result<(), BindError> {
        let [q, k, v, out, lse] = views([q, k, v, out, lse])?;
        let ov = opts.views()?;
        let descale = Descale {
            q: q_descale.as_deref(),
            k: k_descale.as_deref(),
            v: v_descale.as_deref(),
            per_block: opts.descale_per_block,
        };
        let mut inputs = vec![&q, &k, &v];
        inputs.extend(ov.alibi.iter().chain(&ov.sink));
        for w in [&out, &lse] {
            w.check_disjoint(inputs.iter().copied())?;
        }
        out.check_disjoint([&lse])?;
        // SAFETY: as in `fwd`: out (bf16) and lse are fresh tensors, checked disjoint from the
        // inputs and from each other, written in place by the kernels.
        unsafe {
            let ao = opts.attn_packed(&ov)?.descale(descale);
            let (qt, kt, vt) = (q.fp8()?, k.fp8()?, v.fp8()?);
            let dst = flashattn::OutBuffers {
                out: out.dest()?,
                lse: lse.dest_f32()?,
            };
            run(opts.num_threads, || {
                flashattn::fp8::flash_attn_fp8_into(&qt, &kt, &vt, &ao, dst)
            })??;
        }
        Ok(())
    })?;
    Ok(())
}

/// What `flash_attn_with_kvcache` takes beyond the attention options (a dict).
#[derive(Debug, FromPyObject)]
#[pyo3(from_item_all)]
pub(crate) struct KvOpts {
    k: Option<RawView>,
    v: Option<RawView>,
    rotary_cos: Option<RawView>,
    rotary_sin: Option<RawView>,
    rotary_interleaved: bool,
    cache_batch_idx: Option<Vec<i32>>,
    cache_leftpad: Option<Vec<i32>>,
    /// `(table, batch, max_blocks_per_seq)`, row-major.
    block_table: Option<(Vec<i32>, usize, usize)>,
    cu_seqlens_q: Option<Vec<i32>>,
    cu_seqlens_k_new: Option<Vec<i32>>,
    /// 0: chosen from the shape and the thread count.
    num_splits: usize,
    /// FP8 caches' factors (one, or `[batch, heads_kv]`).
    k_descale: Option<Vec<f32>>,
    v_descale: Option<Vec<f32>>,
}

impl KvOpts {
    /// The index arrays and split count of the call (what both backends take the same way).
    pub(crate) fn index_options<'a>(&'a self, mut ko: KvCacheOptions<'a>) -> KvCacheOptions<'a> {
        if let Some(i) = &self.cache_batch_idx {
            ko = ko.cache_batch_idx(i);
        }
        if let Some(l) = &self.cache_leftpad {
            ko = ko.cache_leftpad(l);
        }
        if let Some((t, b, m)) = &self.block_table {
            ko = ko.block_table(BlockTable::new(t, *b, *m));
        }
        if let Some(c) = &self.cu_seqlens_q {
            ko = ko.cu_seqlens_q(c);
        }
        if let Some(c) = &self.cu_seqlens_k_new {
            ko = ko.cu_seqlens_k_new(c);
        }
        if self.num_splits > 0 {
            ko = ko.num_splits(self.num_splits);
        }
        ko
    }
}

/// Decoding over KV caches, appending the new keys in place first. No `lse`: the caller drops it.
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, cache_seqlens, out, lse, opts, kv))]
#[allow(clippy::too_many_arguments)]
fn kvcache(
    py: Python<'_>,
    q: RawView,
    k_cache: RawView,
    v_cache: RawView,
    cache_seqlens: Vec<i32>,
    out: RawView,
    lse: Option<RawView>,
    opts: Opts,
    kv: KvOpts,
) -> PyResult<()> {
    py.detach(move || -> Result<(), BindError> {
        let [q, kc, vc, out] = views([q, k_cache, v_cache, out])?;
        let lse = lse.map(View::try_from).transpose()?;
        let ov = opts.views()?;
        let opt = |r: &Option<RawView>| r.clone().map(View::try_from).transpose();
        let (kn, vn, cos, sin) = (
            opt(&kv.k)?,
            opt(&kv.v)?,
            opt(&kv.rotary_cos)?,
            opt(&kv.rotary_sin)?,
        );
        let mut reads: Vec<&View> = vec![&q];
        reads.extend(
            [&kn, &vn, &cos, &sin, &ov.alibi, &ov.sink]
                .into_iter()
                .flatten(),
        );
        // The caches are written in place: neither may alias the other or any input.
        kc.check_disjoint(reads.iter().copied().chain([&vc]))?;
        vc.check_disjoint(reads.iter().copied())?;
        // out and lse too: neither may alias an input, a cache or the other.
        for w in [Some(&out), lse.as_ref()].into_iter().flatten() {
            w.check_disjoint(reads.iter().copied().chain([&kc, &vc]))?;
        }
        out.check_disjoint(lse.iter())?;
        // q's elements over its last dimension: the rows of lse in either layout.
        let rows = q.shape.iter().product::<usize>() / q.shape.last().copied().unwrap_or(1).max(1);
        let mut own_lse = Vec::new();
        // SAFETY: as in `fwd`; the caches, out and lse are the only views written during the
        // call and are checked disjoint from each other and from everything read.
        unsafe {
            let mut ko = KvCacheOptions::default().attn(opts.attn(&ov)?);
            if let (Some(k), Some(v)) = (&kn, &vn) {
                ko = ko.new_kv(k.tensor()?, v.tensor()?);
            } else if kn.is_some() || vn.is_some() {
                return Err(BindError::Value("k and v must be given together".into()));
            }
            if let (Some(c), Some(s)) = (&cos, &sin) {
                ko = ko.rotary(c.tensor()?, s.tensor()?, kv.rotary_interleaved);
            } else if cos.is_some() || sin.is_some() {
                return Err(BindError::Value(
                    "rotary_cos and rotary_sin must be given together".into(),
                ));
            }
            ko = kv.index_options(ko);
            let qt: TensorRef = q.tensor()?;
            let dst = flashattn::OutBuffers {
                out: out.dest()?,
                lse: lse_dest(lse.as_ref(), rows, &mut own_lse)?,
            };
            if matches!(kc.dt, Dt::F8E4M3 | Dt::F8E5M2) {
                let (mut kt, mut vt) = (kc.fp8_mut()?, vc.fp8_mut()?);
                let descale = Descale {
                    q: None,
                    k: kv.k_descale.as_deref(),
                    v: kv.v_descale.as_deref(),
                    per_block: false,
                };
                let ko = ko.descale(descale);
                run(opts.num_threads, || {
                    flashattn::fp8::flash_attn_with_kvcache_fp8_into(
                        &qt,
                        &mut kt,
                        &mut vt,
                        &cache_seqlens,
                        &ko,
                        dst,
                    )
                })??
            } else {
                let (mut kt, mut vt) = (kc.tensor_mut()?, vc.tensor_mut()?);
                run(opts.num_threads, || {
                    flashattn::flash_attn_with_kvcache_into(
                        &qt,
                        &mut kt,
                        &mut vt,
                        &cache_seqlens,
                        &ko,
                        dst,
                    )
                })??
            };
        }
        Ok(())
    })?;
    Ok(())
}

/// The dropout keep-mask of a call with `seed` and `p`, as the kernels regenerate it:
/// `mask[b, h, i, j]` is 1 where the probability of query i for key j is kept.
#[pyfunction]
fn dropout_keep_mask(py: Python<'_>, seed: u64, p: f32, mask: RawView) -> PyResult<()> {
    py.detach(move || -> Result<(), BindError> {
        let m = View::try_from(mask)?;
        let [b, h, sq, sk] = <[usize; 4]>::try_from(m.shape.as_slice()).map_err(|_| {
            BindError::Value("mask must be [batch, heads, seqlen_q, seqlen_k]".into())
        })?;
        // SAFETY: the mask is a fresh contiguous uint8 tensor the Python layer allocated.
        let bytes = unsafe { m.bytes_mut()? };
        if sq * sk == 0 {
            return Ok(());
        }
        for (bh, chunk) in bytes.chunks_exact_mut(sq * sk).enumerate() {
            let keep = flashattn::dropout::keep_mask(seed, p, bh / h.max(1), bh % h.max(1), sq, sk);
            for (d, k) in chunk.iter_mut().zip(keep) {
                *d = k as u8;
            }
        }
        debug_assert_eq!(bytes.len(), b * h * sq * sk);
        Ok(())
    })?;
    Ok(())
}

/// The instruction set the CPU kernels run on (`avx512`, `avx2`, `neon` or `scalar`).
#[pyfunction]
fn isa() -> PyResult<String> {
    flashattn::simd::active()
        .map(|i| i.name().to_string())
        .map_err(|e| BindError::Lib(e).into())
}

#[pymodule]
fn _flashattn(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("FlashAttnError", m.py().get_type::<FlashAttnError>())?;
    m.add("MAX_HEAD_DIM", flashattn::MAX_HEAD_DIM)?;
    m.add("BLOCK_SIZE", flashattn::block_mask::MASK_BLOCK)?;
    m.add_class::<PyBlockMask>()?;
    m.add_class::<PyBlockMaskBuilder>()?;
    m.add_class::<PyScoreMod>()?;
    m.add_function(wrap_pyfunction!(fwd, m)?)?;
    m.add_function(wrap_pyfunction!(bwd, m)?)?;
    m.add_function(wrap_pyfunction!(fwd_fp8, m)?)?;
    m.add_function(wrap_pyfunction!(kvcache, m)?)?;
    m.add_function(wrap_pyfunction!(dropout_keep_mask, m)?)?;
    m.add_function(wrap_pyfunction!(isa, m)?)?;
    #[cfg(feature = "cuda")]
    {
        m.add_function(wrap_pyfunction!(cuda::cuda_fwd, m)?)?;
        m.add_function(wrap_pyfunction!(cuda::cuda_fwd_fp8, m)?)?;
        m.add_function(wrap_pyfunction!(cuda::cuda_bwd, m)?)?;
        m.add_function(wrap_pyfunction!(cuda::cuda_kvcache, m)?)?;
    }
    Ok(())
}
