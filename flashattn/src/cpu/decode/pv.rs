//! The product `acc_o += P·V` of a few query rows over a tile's keys ([`pv_acc`]): the dispatch
//! to the kernels the kernel table names ([`DecodeKernels`]), and the portable one.

#[cfg(target_arch = "x86_64")]
use super::avx2;
use super::prefetch::Ahead;
use super::rows::{KeyRows, PRows};
#[cfg(target_arch = "x86_64")]
use super::x86_pv::{pv_avx512, pv_avx512_bf16};
use crate::cpu::simd::DecodeKernels;
use crate::tensor::Element;
use half::bf16;

/// The largest padded head dimension (stack rows of the portable kernels).
pub(super) const MAX_D: usize = 256;

/// `acc[r · dpad + x] += Σ_c p[c][r] · v[c][x]` for `r < rows`, `x < vr.d`, with `v[c]` the row
/// of `src` that `vr` names, widened to f32 as it is loaded (or, for bf16 with `p.bf16_pairs` on
/// a CPU with AVX512_BF16, two keys at a time by `vdpbf16ps` against p rounded to bf16, as the
/// forward does). Steps `ahead` once per key. Where [`acc_in_even_odd_order`] says so, acc's
/// rows are in the AVX2 kernels' even-odd order (each whole 16-dim chunk even dims first).
pub(crate) fn pv_acc<T: Element>(
    kern: DecodeKernels,
    p: PRows,
    src: &[T],
    vr: KeyRows,
    acc: &mut [f32],
    dpad: usize,
    ahead: &mut Ahead,
) {
    let PRows { rows, np, .. } = p;
    vr.check(src.len());
    let cols = vr.cols();
    assert!(
        vr.d <= dpad
            && rows <= np
            && (cols == 0 || p.f32.len() >= (cols - 1) * np + rows)
            && p.bf16_pairs
                .is_none_or(|b| cols < 2 || b.len() >= (cols / 2 - 1) * np + rows)
            && acc.len() >= rows * dpad,
        "decode P·V: operands too short"
    );
    #[cfg(target_arch = "x86_64")]
    if let DecodeKernels::Avx512 | DecodeKernels::Avx512Bf16 = kern {
        if let (Some(pairs), Some(v)) = (p.bf16_pairs, bf16::unwrap(T::wrap(src))) {
            if kern == DecodeKernels::Avx512Bf16 {
                // SAFETY: AVX-512F and AVX512_BF16 present (only their table has
                // `Avx512Bf16`, `Kernels::for_isa`); bounds checked above.
                return unsafe { pv_avx512_bf16(p, pairs, v, vr, acc, dpad, ahead) };
            }
        }
        // SAFETY: as in `scores`.
        return unsafe { pv_avx512(p.f32, np, rows, src, vr, acc, dpad, 0, Some(ahead)) };
    }
    #[cfg(target_arch = "x86_64")]
    if kern == DecodeKernels::Avx2 && avx2::has_f16c() {
        // SAFETY: a kernel table with the AVX2 decode kernels exists only on a CPU with AVX2
        // and FMA (`Kernels::for_isa`), F16C checked; bounds checked above.
        return unsafe { avx2::pv(p.f32, np, rows, src, vr, acc, dpad, ahead) };
    }
    let _ = kern;
    pv_portable(p.f32, np, rows, src, vr, acc, dpad, ahead);
}

/// Whether [`pv_acc`] takes acc's rows in even-odd order ([`acc_to_dim_order`] puts them
/// back): the AVX2 kernels with bf16 values, which they widen in (even, odd) pairs. The same
/// condition as the dispatch to them.
pub(super) fn acc_in_even_odd_order<T: Element>(kern: DecodeKernels) -> bool {
    #[cfg(target_arch = "x86_64")]
    if kern == DecodeKernels::Avx2 && avx2::has_f16c() {
        return T::DTYPE == crate::tensor::DType::BF16;
    }
    let _ = kern;
    false
}

/// Puts a row of acc_o that [`pv_acc`] kept in even-odd order (see [`acc_in_even_odd_order`])
/// back in dim order.
pub(super) fn acc_to_dim_order(row: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    avx2::acc_to_dim_order(row);
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!(
        "decode: even-odd acc rows on x86-64 only ({} dims)",
        row.len()
    );
}

/// [`pv_acc`] without intrinsics: one v row widened to f32, then an axpy per query row.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn pv_portable<T: Element>(
    st: &[f32],
    np: usize,
    rows: usize,
    src: &[T],
    vr: KeyRows,
    acc: &mut [f32],
    dpad: usize,
    ahead: &mut Ahead,
) {
    let mut vrow = [0f32; MAX_D];
    let vrow = &mut vrow[..vr.d];
    for c in 0..vr.cols() {
        ahead.step(1);
        let at = vr.at(c);
        widen_row(&src[at..at + vr.d], vrow);
        for r in 0..rows {
            let p = st[c * np + r];
            for (a, &x) in acc[r * dpad..r * dpad + vr.d].iter_mut().zip(vrow.iter()) {
                *a += p * x;
            }
        }
    }
}

/// One row to f32, portable: bf16 by a shift (exact; `half`'s slice conversion also quietens
/// NaNs and measured ~4× slower than the whole decode step's budget), f16 and f32 as `half`
/// and `copy_from_slice` do it.
#[inline]
pub(super) fn widen_row<T: Element>(src: &[T], dst: &mut [f32]) {
    match bf16::unwrap(T::wrap(src)) {
        Some(b) => {
            for (o, x) in dst.iter_mut().zip(b) {
                *o = f32::from_bits((x.to_bits() as u32) << 16);
            }
        }
        None => T::widen(src, dst),
    }
}
