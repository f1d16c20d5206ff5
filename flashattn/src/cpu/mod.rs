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
pub(crate) mod tanh;

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

/// Tile sizes for a pass at head dim `d`, from the kernels' measured preference and this CPU's
/// caches ([`simd::cache_sizes`], read once per process).
///
/// `block_n` is 64 keys throughout: it fixes where the online softmax rescales and how the P·V
/// sums are chunked, so it decides rounding; keeping it constant keeps results independent of the
/// host's caches. At d <= 128 its k or v tile (32 KiB of f32) is what the products re-read for
/// every 16-lane strip of queries, from L1d where that holds it beside a strip of qᵀ and sᵀ
/// (12 KiB): 48 KiB L1d (this Intel host) does, 32 KiB (Zen 3/4) streams it from L2.
///
/// The forward's `block_m` is the largest multiple of 16 rows, at most the pass's preference below, whose
/// per-worker working set ([`working_set`]: qᵀ, acc_oᵀ, sᵀ and the k and v tiles) fits in half of
/// L2, the other half left to the next key tiles streaming in and to k and v shared with the
/// other threads' items. At d = 128 that is 184 KiB for 96 rows (f32), so on a 2 MiB (this host),
/// 1 MiB (Zen 4) or 512 KiB (Zen 3) L2 the preference holds; d = 256 on a 512 KiB L2 gets 48
/// rows.
///
/// The preferences (measured, the working set being far inside L2 on the hosts measured):
/// f32 products, 128 rows with the AVX-512 kernels: the k and v tiles are copied once per
/// (query block, key block), so 128 query rows halve that copy and the qᵀ transpose per FLOP
/// against 64 (2026-11-23, 2 threads, 16 heads, `flashattn bench`, f32 d = 128: 147 -> 154
/// GFLOP/s at N = 2048 and 118 -> 142 at N = 8192; d = 64 equal within noise). AVX2 runs the f32
/// forward with 96 rows (A/B in one process, alternating call by call, f32, 16 heads, 2 threads,
/// AVX2 kernels on the Zen 4 host, 2026-11-27; docs/PERFORMANCE.md), GFLOP/s of 96 rows against
/// 128: d = 128 at N = 512, 1024, 2048, 4096: 1.13, 1.07, 1.09-1.11, 1.15; d = 64: 1.07, 1.05
/// (N = 1024, 4096); d = 256: 1.10, 1.12 (N = 2048). 64 to 112 rows all beat 128, 144 was
/// slower; the AVX-512 kernels measured 96 to 128 rows level (d = 128) and keep 128. The bf16
/// dot-product path measured the other way (285 GFLOP/s with 64 rows, 259 with 128, d = 128,
/// N = 2048) and keeps 64; the backward was equal within noise (111-127 GFLOP/s either way) and
/// keeps 64, which halves its per-thread scratch, unless its working set passes half of L2
/// (d = 256 on a 512 KiB L2: 32 rows), in multiples of [`simd::KC`] rows so that its results do
/// not depend on the choice. 96 and 128 rows measured level with 64 on the Intel host too (f32 and
/// bf16, d = 64 and 128, AVX2 and AVX-512, least CPU time of alternating runs, loaded host).
pub(crate) fn block_sizes(pass: Pass, isa: Isa, d: usize) -> BlockSizes {
    block_sizes_for(pass, isa, d, simd::cache_sizes())
}

/// [`block_sizes`] for given cache sizes.
pub(crate) fn block_sizes_for(
    pass: Pass,
    isa: Isa,
    d: usize,
    caches: simd::CacheSizes,
) -> BlockSizes {
    const BLOCK_N: usize = 64;
    let preferred = match pass {
        Pass::ForwardF32 if isa == Isa::Avx2 => 96,
        Pass::ForwardF32 => 128,
        Pass::ForwardBf16Dot | Pass::Backward => 64,
    };
    let mut block_m = preferred;
    // The backward's block_m is where its dK and dV sums over query rows are cut; the products
    // add their terms to C in chunks of `KC` rows from the first row of each call, so any
    // multiple of KC cuts them where the chunks do, and gives the same bits. Hence steps of KC
    // there (the forward's rows are independent lanes: steps of one lane group). The scalar
    // kernels sum each call in f64 and round once, so there the backward keeps its rows.
    let step = if pass == Pass::Backward {
        simd::KC
    } else {
        simd::LANES
    };
    let fixed = pass == Pass::Backward && isa == Isa::Scalar;
    while !fixed && block_m > step && working_set(pass, block_m, BLOCK_N, d) > caches.l2 / 2 {
        block_m -= step;
    }
    BlockSizes {
        block_m,
        block_n: BLOCK_N,
    }
}

/// Bytes of the tiles one worker re-reads for every key block (see [`block_sizes`]): the
/// lane-major qᵀ and acc_oᵀ (`d · block_m` each), sᵀ (`block_n · block_m`; the backward keeps
/// four such: P, dS, and two products), and the k and v tiles (`block_n · d` each; f32, or bf16
/// pairs on the dot-product path, whose qᵀ is pairs too).
pub(crate) fn working_set(pass: Pass, block_m: usize, block_n: usize, d: usize) -> usize {
    let f = std::mem::size_of::<f32>();
    match pass {
        Pass::ForwardF32 => f * (2 * d * block_m + block_n * block_m + 2 * block_n * d),
        Pass::ForwardBf16Dot => {
            f * ((d + d / 2) * block_m + block_n * block_m * 3 / 2 + block_n * d)
        }
        // q, dout, dq and the dq partial: 4 lane-major d-row tiles; 4 score-sized tiles.
        Pass::Backward => f * (4 * d * block_m + 4 * block_n * block_m + 2 * block_n * d),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn caches(l1d_kib: usize, l2_kib: usize) -> simd::CacheSizes {
        simd::CacheSizes {
            l1d: l1d_kib << 10,
            l2: l2_kib << 10,
            l3: 0,
            source: "test",
        }
    }

    #[test]
    fn block_sizes_follow_l2() {
        let bm = |pass, isa, d, c| block_sizes_for(pass, isa, d, c).block_m;
        let (intel, zen4, zen3) = (caches(48, 2048), caches(32, 1024), caches(32, 512));
        for c in [intel, zen4, zen3] {
            // The measured preferences wherever the working set fits (d <= 128 everywhere).
            for d in [64, 128] {
                assert_eq!(bm(Pass::ForwardF32, Isa::Avx2, d, c), 96);
                assert_eq!(bm(Pass::ForwardF32, Isa::Avx512, d, c), 128);
                assert_eq!(bm(Pass::ForwardBf16Dot, Isa::Avx512, d, c), 64);
            }
            for d in [64, 128] {
                assert_eq!(bm(Pass::Backward, Isa::Avx2, d, c), 64);
            }
            assert_eq!(
                block_sizes_for(Pass::ForwardF32, Isa::Avx2, 64, c).block_n,
                64
            );
        }
        assert_eq!(bm(Pass::ForwardF32, Isa::Avx2, 256, intel), 96);
        assert_eq!(bm(Pass::ForwardF32, Isa::Avx2, 256, zen3), 48);
        // The backward in multiples of KC rows: 64 where d = 256 fits half of L2, else 32.
        assert_eq!(bm(Pass::Backward, Isa::Avx2, 256, intel), 64);
        assert_eq!(bm(Pass::Backward, Isa::Avx512, 256, zen4), 64);
        assert_eq!(bm(Pass::Backward, Isa::Avx2, 256, zen3), 32);
        assert_eq!(bm(Pass::Backward, Isa::Avx2, 256, caches(16, 64)), 32);
        assert_eq!(bm(Pass::Backward, Isa::Scalar, 256, zen3), 64);
        // Never below one lane group, however small the cache.
        assert_eq!(bm(Pass::ForwardF32, Isa::Avx2, 256, caches(16, 64)), 16);
    }
}
