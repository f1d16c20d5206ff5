//! The CPU backend: tiled forward (and, later, backward and decoding) over rayon.
//!
//! Work is split into independent items (sequence, head, query block); each item owns the output
//! rows it writes, so results do not depend on the number of threads or on scheduling.

pub(crate) mod backward;
pub(crate) mod forward;
pub(crate) mod kernels;
pub(crate) mod simd;
pub(crate) mod softmax;

use std::marker::PhantomData;

/// Tile sizes of the CPU path for a head dimension.
///
/// 64 x 64 tiles: per worker, q (64·d), k and v (64·d each), acc_o (64·d) and s (64·64) in f32 are
/// 16·(4d + 64) bytes: 80 KiB at d = 64, 272 KiB at d = 256, inside a 1 MiB L2 with room for the
/// other core's prefetches; a row of s (256 B) and a row of acc_o stay in L1 across the inner loops.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BlockSizes {
    pub block_m: usize,
    pub block_n: usize,
}

pub(crate) fn block_sizes(_head_dim: usize) -> BlockSizes {
    BlockSizes {
        block_m: 64,
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
