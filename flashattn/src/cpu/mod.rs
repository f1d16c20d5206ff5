//! The CPU backend: tiled forward and backward over rayon, on the microkernels of [`simd`].
//!
//! Work is split into independent items (sequence, head, query block); each item owns the output
//! rows it writes, so results do not depend on the number of threads or on scheduling.

pub(crate) mod backward;
pub(crate) mod decode;
pub(crate) mod forward;
pub(crate) mod fp8;
pub(crate) mod kernels;
pub(crate) mod reuse;
pub(crate) mod simd;
pub(crate) mod softmax;

use simd::Isa;
use std::marker::PhantomData;

/// A per-thread tile buffer, starting on a 64-byte cache line (a `Vec` from glibc starts at any
/// multiple of 16, so the microkernels' 64-byte vector loads of it would straddle two lines).
pub(crate) type Buf<T> = crate::memory::CacheBuf<T>;

/// `n` copies of `x` in a [`Buf`].
pub(crate) fn buf<T: Copy>(x: T, n: usize) -> Buf<T> {
    buf_from(std::iter::repeat_n(x, n))
}

/// The values of `iter` in a [`Buf`] (never advised for huge pages: the tiles live in L1/L2).
pub(crate) fn buf_from<T: Copy>(iter: impl ExactSizeIterator<Item = T>) -> Buf<T> {
    crate::memory::CacheBuf::from_iter_advised(iter, false)
}

/// `n` copies of `x` in a [`Buf`], or `OutOfMemory` naming `what`: for working buffers whose size
/// follows the inputs' shapes (packed tiles, dQ copies), which stride-0 views make as large as
/// the results can be small.
pub(crate) fn try_buf<T: Copy>(what: &'static str, x: T, n: usize) -> crate::Result<Buf<T>> {
    crate::memory::CacheBuf::try_from_iter_advised(what, std::iter::repeat_n(x, n), false)
}

/// Tile sizes of the CPU path: `block_m` query rows (SIMD lanes) by `block_n` keys.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BlockSizes {
    pub block_m: usize,
    pub block_n: usize,
}

/// Which pass the tiles are for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pass {
    /// The forward with f32 products (f32, f16, and bf16 without a bf16 dot product).
    ForwardF32,
    /// The forward with `vdpbf16ps` products.
    ForwardBf16Dot,
    Backward,
}

/// Tile sizes for a pass; `block_n` is 64 keys throughout.
///
/// Working set per worker at d = 128, block_m = 128 (f32 path): qᵀ and acc_oᵀ 64 KiB each, the k and
/// v tiles 32 KiB each, sᵀ 32 KiB: ~224 KiB, inside the 1 MiB L2 of a Zen 4 core; one lane row of
/// sᵀ or acc_oᵀ (512 B) stays in L1 across the product's k loop. The k and v tiles are copied once
/// per (query block, key block), so 128 query rows halve that copy and the qᵀ transpose per FLOP:
/// measured 2026-11-23, 2 threads, 16 heads, `flashattn bench`, f32 d = 128: 147 -> 154 GFLOP/s at
/// N = 2048 and 118 -> 142 at N = 8192 against 64 rows; d = 64 equal within noise (150/130 vs
/// 148/135). The bf16 dot-product path measured the other way (285 GFLOP/s with 64 rows, 259 with
/// 128, d = 128, N = 2048) and keeps 64; the backward was equal within noise (111-127 GFLOP/s
/// either way) and keeps 64, which halves its per-thread scratch.
///
/// AVX2 runs the f32 forward with 96 rows (A/B in one process, alternating call by call, f32, 16
/// heads, 2 threads, AVX2 kernels on the Zen 4 host, 2026-11-27; docs/PERFORMANCE.md), GFLOP/s
/// of 96 rows against 128: d = 128 at N = 512, 1024, 2048, 4096: 1.13, 1.07, 1.09-1.11, 1.15;
/// d = 64: 1.07, 1.05 (N = 1024, 4096); d = 256: 1.10, 1.12 (N = 2048). 64 to 112 rows all
/// beat 128, 144 was slower; the AVX-512 kernels measured 96 to 128 rows level (d = 128) and
/// keep 128.
pub(crate) fn block_sizes(pass: Pass, isa: Isa) -> BlockSizes {
    let block_m = match pass {
        Pass::ForwardF32 if isa == Isa::Avx2 => 96,
        Pass::ForwardF32 => 128,
        Pass::ForwardBf16Dot | Pass::Backward => 64,
    };
    BlockSizes {
        block_m,
        block_n: 64,
    }
}

/// An output buffer that parallel workers write at disjoint index ranges.
pub(crate) struct Disjoint<'a, T> {
    ptr: *mut T,
    len: usize,
    _borrow: PhantomData<&'a mut [T]>,
}

// SAFETY: `Disjoint` is only a way to hand out non-overlapping `&mut` sub-slices of one exclusively
// borrowed buffer to several threads; sending or sharing it is as safe as sending `&mut [T]` pieces.
unsafe impl<T: Send> Send for Disjoint<'_, T> {}
unsafe impl<T: Send> Sync for Disjoint<'_, T> {}

impl<'a, T> Disjoint<'a, T> {
    pub fn new(buf: &'a mut [T]) -> Self {
        Disjoint {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            _borrow: PhantomData,
        }
    }

    /// The elements `start..start + len`.
    ///
    /// # Safety
    /// While the returned slice lives, no other call may return a range overlapping it. The work
    /// decomposition guarantees this: each work item writes only its own (sequence, head, rows).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn range(&self, start: usize, len: usize) -> &mut [T] {
        assert!(
            start <= self.len && len <= self.len - start,
            "range {start}+{len} past {}",
            self.len
        );
        // SAFETY: in bounds (checked above) of a buffer borrowed mutably for 'a; exclusive by the
        // caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }
}
