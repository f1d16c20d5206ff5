//! Decoding with a KV cache on the GPU: [`flash_attn_with_kvcache`], the CPU call's semantics
//! (same validation, `crate::params::decode::validate`) with q, the caches and the new keys/values in GPU
//! memory. Three kernels of `kernels/decode.cu` run on the device's stream: the append (new keys,
//! rotated, and values into the caches), one CTA per (query row block, key split, kv head,
//! sequence) writing partial results, and the merge of the splits through their LSEs, into
//! `out` and `lse`: the caller's ([`flash_attn_with_kvcache_into`]) or new ones.

use super::buffer::{CudaAttnOutput, CudaTensor, DeviceBuffer};
use super::decode_plan::{limit, DecodeKernel, DecodeLaunch};
use super::device::CudaDevice;
use super::error::driver_err;
use super::forward::{check_destination, CudaOutBuffers};
use super::launch::alloc_output;
use super::params;
use crate::decode::KvCacheOptions;
use crate::error::{ErrorKind, Result};
use crate::fp8::Fp8Format;
use crate::params::decode::validate;
use crate::params::DecodeParams;
use crate::tensor::DType;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig,
    PushKernelArg,
};
use std::sync::Arc;

/// [`crate::flash_attn_with_kvcache`] on the GPU, queued on `dev`'s stream (returns without
/// waiting): q `[batch, seqlen_q, heads, head_dim]` (or packed with `opts.cu_seqlens_q`), the
/// caches `[batch_cache, seqlen_cache, heads_kv, head_dim]` (or paged with `opts.block_table`)
/// and the new keys and values (`new_kv`, the layout of `opts.new_kv` on the CPU) in GPU memory.
/// `cache_seqlens` and the other index arrays of `opts` (cu_seqlens, block table, cache_batch_idx,
/// cache_leftpad), the rotary cos/sin tables and the ALiBi slopes are host data: they are
/// validated on the host and the rows a call uses are uploaded with it (flash-attn keeps them on
/// the device). `opts.new_kv` must be `None`; `opts.num_splits` overrides the split count
/// (default: about four CTAs per SM, splits of at least 256 keys; at most
/// [`crate::decode::MAX_NUM_SPLITS`]).
///
/// As on the CPU, every input is validated before anything is queued: on error the caches are
/// untouched. Appends run in batch order (one CTA per kv head), so a prefill-sized append is slow.
pub fn flash_attn_with_kvcache(
    dev: &CudaDevice,
    q: &CudaTensor,
    k_cache: &mut CudaTensor,
    v_cache: &mut CudaTensor,
    cache_seqlens: &[i32],
    new_kv: Option<(&CudaTensor, &CudaTensor)>,
    opts: &KvCacheOptions,
) -> Result<CudaAttnOutput> {
    refuse_host_new_kv(opts)?;
    let dp = validate(q, &*k_cache, &*v_cache, new_kv, cache_seqlens, opts)?;
    let mut res = alloc_outputs(dev, &dp)?;
    let dst = CudaOutBuffers {
        out: &mut res.out,
        lse: &mut res.lse,
    };
    kvcache_into(dev, &dp, q, (k_cache, v_cache), new_kv, dst)?;
    Ok(res)
}

/// [`flash_attn_with_kvcache`] writing `out` and `lse` into caller-provided buffers
/// ([`CudaOutBuffers`]: `out` in q's dtype and shape, `lse` f32 `[batch, heads, seqlen_q]` or,
/// packed, `[heads, total_q]`, both contiguous): no allocation of them, no copy. Every input and
/// both destinations are validated before anything is queued: on error nothing is written (the
/// caches are untouched too). Queued on `dev`'s stream without waiting.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_with_kvcache_into(
    dev: &CudaDevice,
    q: &CudaTensor,
    k_cache: &mut CudaTensor,
    v_cache: &mut CudaTensor,
    cache_seqlens: &[i32],
    new_kv: Option<(&CudaTensor, &CudaTensor)>,
    opts: &KvCacheOptions,
    dst: CudaOutBuffers,
) -> Result<()> {
    refuse_host_new_kv(opts)?;
    let dp = validate(q, &*k_cache, &*v_cache, new_kv, cache_seqlens, opts)?;
    kvcache_into(dev, &dp, q, (k_cache, v_cache), new_kv, dst)
}

/// The decode of validated `dp` on f32/f16/bf16 caches, into `dst`.
fn kvcache_into(
    dev: &CudaDevice,
    dp: &DecodeParams,
    q: &CudaTensor,
    (k_cache, v_cache): (&mut CudaTensor, &mut CudaTensor),
    new_kv: Option<(&CudaTensor, &CudaTensor)>,
    dst: CudaOutBuffers,
) -> Result<()> {
    let d = prepare(
        dev,
        dp,
        [
            q.buf.context(),
            k_cache.buf.context(),
            v_cache.buf.context(),
        ],
        new_kv,
        None,
        &dst,
    )?;
    match (&mut k_cache.buf, &mut v_cache.buf) {
        (DeviceBuffer::F32(k), DeviceBuffer::F32(v)) => queue(dev, &d, q, (k, v), new_kv, dst),
        (DeviceBuffer::F16(k), DeviceBuffer::F16(v)) => queue(dev, &d, q, (k, v), new_kv, dst),
        (DeviceBuffer::BF16(k), DeviceBuffer::BF16(v)) => queue(dev, &d, q, (k, v), new_kv, dst),
        _ => unreachable!("the caches' dtype was validated against q's"),
    }
}

/// New (poisoned, see `alloc_output`) `out` (q's dtype) and `lse` for validated `dp`: what the
/// allocating decode calls pass to their `_into` code.
pub(crate) fn alloc_outputs(dev: &CudaDevice, dp: &DecodeParams) -> Result<CudaAttnOutput> {
    let s = &dev.stream;
    let (p, out_len) = (&dp.p, dp.p.out_len());
    let out = match p.dtype {
        DType::F32 => DeviceBuffer::F32(alloc_output(s, out_len)?),
        DType::F16 => DeviceBuffer::F16(alloc_output(s, out_len)?),
        DType::BF16 => DeviceBuffer::BF16(alloc_output(s, out_len)?),
    };
    Ok(CudaAttnOutput {
        out: CudaTensor::contiguous(out, &p.out_shape),
        lse: CudaTensor::contiguous(
            DeviceBuffer::F32(alloc_output(s, p.lse_len())?),
            &p.lse_shape,
        ),
    })
}

/// The GPU calls take the new keys and values as device tensors (their `new_kv` argument), not
/// as the host views of `opts.new_kv`.
pub(crate) fn refuse_host_new_kv(opts: &KvCacheOptions) -> Result<()> {
    if opts.new_kv.is_some() {
        return Err(ErrorKind::CudaUnsupported {
            feature: "host tensors in KvCacheOptions::new_kv",
            detail: " (pass the new keys and values as device tensors, the `new_kv` argument)"
                .into(),
        }
        .into());
    }
    Ok(())
}

/// What both decode calls check after validation (the destinations: out in q's dtype, lse in
/// f32, their lengths, contiguous; every tensor on `dev`'s context, a device that runs the
/// dtype), then the launches.
pub(crate) fn prepare(
    dev: &CudaDevice,
    dp: &DecodeParams,
    contexts: [&Arc<CudaContext>; 3],
    new_kv: Option<(&CudaTensor, &CudaTensor)>,
    fp8: Option<(Fp8Format, &[f32])>,
    dst: &CudaOutBuffers,
) -> Result<DecodeLaunch> {
    check_destination("out", dst.out, dp.p.dtype, &dp.p.out_shape)?;
    check_destination("lse", dst.lse, DType::F32, &dp.p.lse_shape)?;
    let mut all = contexts.to_vec();
    all.extend([dst.out.buf.context(), dst.lse.buf.context()]);
    all.extend(
        new_kv
            .iter()
            .flat_map(|(k, v)| [k.buf.context(), v.buf.context()]),
    );
    if all.iter().any(|c| !Arc::ptr_eq(c, &dev.ctx)) {
        return Err(ErrorKind::CudaUnsupported {
            feature: "a tensor from another CUDA context",
            detail: format!(" (the call runs on {})", dev.name),
        }
        .into());
    }
    if dp.p.dtype != DType::F32 && dev.arch.major < 8 {
        return Err(ErrorKind::CudaUnsupported {
            feature: "f16/bf16",
            detail: format!(
                " on {} (compute capability {}.{}; the kernels need 8.0 or newer)",
                dev.name, dev.arch.major, dev.arch.minor
            ),
        }
        .into());
    }
    let d = DecodeLaunch::new(dp, dev.shape(), fp8, DecodeKernel::from_env())?;
    limit(
        "shared memory per block (bytes)",
        d.split.smem_bytes(),
        dev.smem_optin,
    )?;
    Ok(d)
}

/// Compiles (or finds) the kernels of `d`, uploads its tables and queues the launches on caches
/// of element type `C` (q's type, or FP8 bytes), writing `dst` (checked by [`prepare`]).
pub(crate) fn queue<C: DeviceRepr>(
    dev: &CudaDevice,
    d: &DecodeLaunch,
    q: &CudaTensor,
    (k, v): (&mut CudaSlice<C>, &mut CudaSlice<C>),
    new_kv: Option<(&CudaTensor, &CudaTensor)>,
    dst: CudaOutBuffers,
) -> Result<()> {
    // The launches below rely on this: the kernels read bytes exactly when compiled for FP8.
    assert_eq!(
        d.split.fp8,
        std::mem::size_of::<C>() == 1,
        "decode caches: element type and kernel variant disagree"
    );
    let kernels = Kernels {
        split: dev.function(&d.split)?.0,
        combine: dev.function(&d.combine)?.0,
        append: d
            .append
            .as_ref()
            .map(|k| dev.function(k).map(|f| f.0))
            .transpose()?,
    };
    let s = &dev.stream;
    let (ws_o_len, ws_lse_len) = d.workspace_len();
    let up = Uploads {
        tables: PackedTables::upload(dev, d)?,
        ws_o: alloc_output::<f32>(s, ws_o_len)?,
        ws_lse: alloc_output::<f32>(s, ws_lse_len)?,
    };
    let DeviceBuffer::F32(lse) = &mut dst.lse.buf else {
        unreachable!("prepare checked lse as f32")
    };
    macro_rules! typed {
        ($variant:ident) => {{
            let DeviceBuffer::$variant(qb) = &q.buf else {
                unreachable!("matched on q's dtype")
            };
            let new = match new_kv {
                Some((kn, vn)) => match (&kn.buf, &vn.buf) {
                    (DeviceBuffer::$variant(a), DeviceBuffer::$variant(b)) => Some((a, b)),
                    _ => unreachable!("k_new and v_new were validated against q's dtype"),
                },
                None => None,
            };
            let DeviceBuffer::$variant(out) = &mut dst.out.buf else {
                unreachable!("prepare checked out against q's dtype")
            };
            launch(dev, d, &kernels, up, (qb, k, v), new, out, lse)
        }};
    }
    match q.dtype() {
        DType::F32 => typed!(F32),
        DType::F16 => typed!(F16),
        DType::BF16 => typed!(BF16),
    }
}

struct Kernels {
    split: CudaFunction,
    combine: CudaFunction,
    append: Option<CudaFunction>,
}

/// The call's tables on the device and its workspace.
struct Uploads {
    tables: PackedTables,
    ws_o: CudaSlice<f32>,
    ws_lse: CudaSlice<f32>,
}

/// The call's host tables (sequence table, pages, and the slopes, rotary table and FP8 factors
/// where the call has them) in one device buffer: one allocation and one copy per call instead of
/// one each. The kernels get their device addresses; an absent table is the null address.
struct PackedTables {
    /// Kept until the launches are queued; its stream-ordered free follows them.
    _buf: CudaSlice<u8>,
    table: u64,
    pages: u64,
    slopes: u64,
    rot: u64,
    descale: u64,
    sink: u64,
}

impl PackedTables {
    /// Each table starts at a multiple of 16 bytes from the buffer's start (which the driver
    /// aligns far more coarsely), so every i64 and f32 the kernels read is aligned.
    const ALIGN: usize = 16;

    fn upload(dev: &CudaDevice, d: &DecodeLaunch) -> Result<PackedTables> {
        let mut bytes: Vec<u8> = Vec::new();
        let mut put = |part: &[u8]| {
            bytes.resize(bytes.len().next_multiple_of(Self::ALIGN), 0);
            let at = bytes.len();
            bytes.extend_from_slice(part);
            at
        };
        let table = put(bytemuck::cast_slice(&d.table));
        let pages = put(bytemuck::cast_slice(&d.pages));
        let mut opt = |t: &Option<Vec<f32>>| t.as_deref().map(|x| put(bytemuck::cast_slice(x)));
        let (slopes, rot, descale) = (opt(&d.slopes), opt(&d.rot), opt(&d.descale));
        let sink = opt(&d.sink);
        let buf = dev.htod(&bytes)?;
        let (base, sync) = buf.device_ptr(&dev.stream);
        drop(sync);
        let addr = |at: Option<usize>| at.map_or(0, |at| base + at as u64);
        Ok(PackedTables {
            table: addr(Some(table)),
            pages: addr(Some(pages)),
            slopes: addr(slopes),
            rot: addr(rot),
            descale: addr(descale),
            sink: addr(sink),
            _buf: buf,
        })
    }
}

/// q, then the caches (elements of q's type, or FP8 bytes).
type Cache<'a, T, C> = (&'a CudaSlice<T>, &'a mut CudaSlice<C>, &'a mut CudaSlice<C>);

/// Queues the append (if any), the splits and the merge into `out` and `lse`, each kernel with
/// `d.params`, its device addresses set to these buffers and the uploaded tables.
#[allow(clippy::too_many_arguments)]
fn launch<T, C>(
    dev: &CudaDevice,
    d: &DecodeLaunch,
    f: &Kernels,
    mut up: Uploads,
    (q, k, v): Cache<'_, T, C>,
    new: Option<(&CudaSlice<T>, &CudaSlice<T>)>,
    out: &mut CudaSlice<T>,
    lse: &mut CudaSlice<f32>,
) -> Result<()> {
    let cfg = |grid: (u32, u32, u32), smem: usize| LaunchConfig {
        grid_dim: grid,
        block_dim: (128, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let s = &dev.stream;
    // The buffers' device addresses; each guard records the launches' use of its buffer when
    // dropped, after they are queued (what `arg` does for a buffer pushed directly).
    let (q_ptr, _q) = q.device_ptr(s);
    let (k_ptr, _k) = k.device_ptr_mut(s);
    let (v_ptr, _v) = v.device_ptr_mut(s);
    let (out_ptr, _out) = out.device_ptr_mut(s);
    let (lse_ptr, _lse) = lse.device_ptr_mut(s);
    let (ws_o_ptr, _ws_o) = up.ws_o.device_ptr_mut(s);
    let (ws_lse_ptr, _ws_lse) = up.ws_lse.device_ptr_mut(s);
    let kn = new.map(|(kn, _)| kn.device_ptr(s));
    let vn = new.map(|(_, vn)| vn.device_ptr(s));
    let addr = |t: &Option<(u64, _)>| t.as_ref().map_or(0, |t| t.0);
    let t = &up.tables;
    let params = params::DecodeParams {
        q: q_ptr,
        k_cache: k_ptr,
        v_cache: v_ptr,
        k_new: addr(&kn),
        v_new: addr(&vn),
        out: out_ptr,
        lse: lse_ptr,
        ws_o: ws_o_ptr,
        ws_lse: ws_lse_ptr,
        seqs: t.table,
        pages: t.pages,
        alibi_slopes: t.slopes,
        rot: t.rot,
        descale: t.descale,
        sink: t.sink,
        ..d.params
    };
    if let (Some(fa), Some(_)) = (&f.append, new) {
        if d.batch > 0 {
            let mut b = s.launch_builder(fa);
            b.arg(&params);
            // SAFETY: the argument matches `decode_append` in decode.cu: one DecodeParams, laid
            // out as params.cuh's (the size and offset checks on both sides), whose addresses
            // are those of k_new and v_new (elements of T), the caches (C), the uploaded table,
            // pages, rotary table (or null) and FP8 factors (or null), all alive past the
            // launch (borrowed here; their guards record the launches when dropped). C is u8
            // exactly when the kernel was compiled with FA_FP8_CACHE (the key's fp8), which
            // then reads 3 factors per (sequence, kv head). Validation checked that every new
            // row (table: bases, lengths) lies inside k_new/v_new, that cache_seqlen + new_len
            // fits each sequence's capacity and that every page it names exists, so every write
            // lies inside the caches; the rotary table holds rot_npos positions per sequence.
            unsafe { b.launch(cfg(d.append_grid(), 0)) }.map_err(driver_err("cuLaunchKernel"))?;
        }
    }
    if d.is_empty() {
        return Ok(());
    }
    let mut b = s.launch_builder(&f.split);
    b.arg(&params);
    // SAFETY: the argument matches `decode_split` in decode.cu (either kernel): one DecodeParams
    // as above, with the addresses of q (T), the caches (C), the workspace (f32) and the uploaded
    // tables (null for the slopes, rotary table and FP8 factors a call does not use), C being u8
    // exactly when the kernel was compiled with FA_FP8_CACHE, which then reads 3 factors per
    // (launched sequence, kv head), all uploaded. With vec_loads every k row start is a multiple
    // of 8 elements from the buffer's 256-byte-aligned start. Validation checked every q row and
    // every cache row a sequence attends (keys leftpad..seqlen_k through its pages); the
    // workspace holds splits · total_rows rows of head_dim, each written by the one CTA that owns
    // (split, row); the slopes hold one row of heads per launched sequence.
    unsafe { b.launch(cfg(d.split_grid(), d.split.smem_bytes())) }
        .map_err(driver_err("cuLaunchKernel"))?;
    let mut b = s.launch_builder(&f.combine);
    b.arg(&params);
    // SAFETY: the argument matches `decode_combine`: one DecodeParams as above, whose workspace
    // the split kernel wrote; out (T) and lse (f32) hold out_len / lse_len elements, and every
    // (sequence, query, head) row of the table lies inside them (the tail sequence covers packed
    // rows after the last); the sinks, when present, hold `heads` logits per launched sequence.
    unsafe { b.launch(cfg(d.combine_grid(), 0)) }.map_err(driver_err("cuLaunchKernel"))?;
    Ok(())
}
