//! Writing the new keys and values into the caches (rotated, and quantised for FP8 caches)
//! before a decode call attends.

use crate::dtype::Fp8Format;
use crate::params::DecodeParams;
use crate::tensor::Element;

/// [`append`] into FP8 caches: each new row (the keys rotated in f32 first) is divided by its
/// (sequence, kv head) descale factor in f64 and rounded once to the format, saturating at its
/// largest finite value (CUDA's `__NV_SATFINITE`; NaN stays NaN).
pub(super) fn append_fp8<T: Element>(
    dp: &DecodeParams,
    (kn, vn): (&[T], &[T]),
    (k, v): (&mut [u8], &mut [u8]),
    format: Fp8Format,
    (k_descale, v_descale): (&[f32], &[f32]),
) {
    let Some(nk) = &dp.new_kv else { return };
    let (p, cache) = (&dp.p, &dp.cache);
    let d = p.head_dim;
    let mut row = vec![0f32; d];
    let quantise = |row: &[f32], factor: f32, dst: &mut [u8]| {
        for (o, &x) in dst.iter_mut().zip(row) {
            *o = format.quantise(x as f64 / factor as f64);
        }
    };
    for (b, &len) in dp.cache_seqlens.iter().enumerate() {
        for t in 0..nk.lens[b] {
            let (k0, v0) = cache.key_offsets(b, len + t);
            for hk in 0..p.heads_kv {
                let factor = b * p.heads_kv + hk;
                let src = nk.k_base[b] + t * nk.k.row_stride + hk * nk.k.head_stride;
                T::widen(&kn[src..src + d], &mut row);
                if let Some(rot) = &dp.rotary {
                    rot.rotate(&mut row, b, t);
                }
                let dst = k0 + hk * cache.k.head_stride;
                quantise(&row, k_descale[factor], &mut k[dst..dst + d]);
                let src = nk.v_base[b] + t * nk.v.row_stride + hk * nk.v.head_stride;
                T::widen(&vn[src..src + d], &mut row);
                let dst = v0 + hk * cache.v.head_stride;
                quantise(&row, v_descale[factor], &mut v[dst..dst + d]);
            }
        }
    }
}

/// Writes the new keys (rotated when the call has a rotary embedding, in f64, rounded once to the
/// cache's dtype) and values at positions `cache_seqlens[b]..` of each sequence. Sequential: it
/// moves `Σ seqlen_new · heads_kv · d` elements, a few KiB per decode step, and two batch
/// rows sharing a cache row or page then overwrite each other in batch order, never concurrently.
pub(super) fn append<T: Element>(dp: &DecodeParams, kn: &[T], vn: &[T], k: &mut [T], v: &mut [T]) {
    let Some(nk) = &dp.new_kv else { return };
    let (p, cache) = (&dp.p, &dp.cache);
    let d = p.head_dim;
    let mut row = vec![0f32; d];
    for (b, &len) in dp.cache_seqlens.iter().enumerate() {
        for t in 0..nk.lens[b] {
            let (k0, v0) = cache.key_offsets(b, len + t);
            for hk in 0..p.heads_kv {
                let src = nk.k_base[b] + t * nk.k.row_stride + hk * nk.k.head_stride;
                let dst = k0 + hk * cache.k.head_stride;
                match &dp.rotary {
                    Some(rot) => {
                        T::widen(&kn[src..src + d], &mut row);
                        rot.rotate_to::<T>(&mut row, b, t);
                        T::narrow(&row, &mut k[dst..dst + d]);
                    }
                    None => k[dst..dst + d].copy_from_slice(&kn[src..src + d]),
                }
                let src = nk.v_base[b] + t * nk.v.row_stride + hk * nk.v.head_stride;
                let dst = v0 + hk * cache.v.head_stride;
                v[dst..dst + d].copy_from_slice(&vn[src..src + d]);
            }
        }
    }
}
