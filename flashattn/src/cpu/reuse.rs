//! Large scratch buffers kept from one call to the next.
//!
//! A backward call's query tiles and dQ copies, and a forward call's packed k/v tiles, are tens of
//! MiB (f32, N = 2048, 16 heads, d = 128: 64 MiB of query tiles). Allocated fresh, every call
//! page-faulted them in again, since the allocator hands buffers this large back to the system
//! when they are freed: `/usr/bin/time` counted ~100k minor faults and ~15% of the machine's time
//! in the kernel per f32 forward+backward call at that shape. Each [`Slot`] keeps the last buffer
//! of one site for the next call; all slots together keep at most [`BUDGET_BYTES`], and
//! [`crate::release_scratch`] frees them.

use super::{try_buf, Buf};
use crate::error::Result;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

/// Most bytes all slots keep together (the f32 training shape above keeps ~160 MiB).
pub(crate) const BUDGET_BYTES: usize = 256 << 20;

/// Bytes the slots keep now.
static KEPT: AtomicUsize = AtomicUsize::new(0);

/// One site's kept buffer.
pub(crate) struct Slot<T: Copy>(Mutex<Buf<T>>);

fn bytes<T: Copy>(v: &Buf<T>) -> usize {
    v.capacity() * std::mem::size_of::<T>()
}

impl<T: Copy> Slot<T> {
    pub const fn new() -> Self {
        Slot(Mutex::new(Buf::empty()))
    }

    fn lock(&self) -> MutexGuard<'_, Buf<T>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The kept buffer (empty when there is none, or another call holds it).
    fn take_kept(&self) -> Buf<T> {
        let v = std::mem::take(&mut *self.lock());
        KEPT.fetch_sub(bytes(&v), Ordering::Relaxed);
        v
    }

    /// Keeps `v` for the next call, unless that would take the slots past [`BUDGET_BYTES`].
    pub fn put(&self, v: Buf<T>) {
        let mut kept = self.lock();
        KEPT.fetch_sub(bytes(&kept), Ordering::Relaxed);
        *kept = Buf::empty();
        let b = bytes(&v);
        if KEPT.fetch_add(b, Ordering::Relaxed) + b > BUDGET_BYTES {
            KEPT.fetch_sub(b, Ordering::Relaxed);
            return;
        }
        *kept = v;
    }

    /// Frees the kept buffer.
    pub fn clear(&self) {
        drop(self.take_kept());
    }
}

impl<T: Copy> Slot<T> {
    /// `len` elements, all `fill`: the kept buffer when it is large enough (no allocation, no page
    /// faults; the fill writes every element), else a new one, or `OutOfMemory` naming `what`.
    #[cfg(test)]
    pub fn take(&self, what: &'static str, len: usize, fill: T) -> Result<Buf<T>> {
        self.take_reset(what, len, fill, false)
    }

    /// `len` elements of unspecified values (a kept buffer's old contents, or `fill`), for a
    /// caller that writes every element before reading it; `OutOfMemory` as [`Slot::take`].
    pub fn take_for_overwrite(&self, what: &'static str, len: usize, fill: T) -> Result<Buf<T>> {
        self.take_reset(what, len, fill, true)
    }

    fn take_reset(
        &self,
        what: &'static str,
        len: usize,
        fill: T,
        overwrite: bool,
    ) -> Result<Buf<T>> {
        let mut v = self.take_kept();
        if v.capacity() < len {
            // The kept buffer is freed before the larger one is asked for.
            drop(v);
            return try_buf(what, fill, len);
        }
        v.reset(len, fill, overwrite);
        Ok(v)
    }
}

/// The backward's query tiles (f32 and bf16 pairs) and dQ copies.
pub(crate) static QUERY_TILES: Slot<f32> = Slot::new();
pub(crate) static QUERY_PAIRS: Slot<u32> = Slot::new();
pub(crate) static DQ_COPIES: Slot<f32> = Slot::new();
/// The forward's packed key and value tiles (f32, and bf16 pairs).
pub(crate) static K_TILES: Slot<f32> = Slot::new();
pub(crate) static V_TILES: Slot<f32> = Slot::new();
pub(crate) static K_PAIRS: Slot<u32> = Slot::new();
pub(crate) static V_PAIRS: Slot<u32> = Slot::new();

/// Frees every kept buffer.
pub(crate) fn release_all() {
    for s in [&QUERY_TILES, &DQ_COPIES, &K_TILES, &V_TILES] {
        s.clear();
    }
    for s in [&QUERY_PAIRS, &K_PAIRS, &V_PAIRS] {
        s.clear();
    }
}

/// Overwrites every kept buffer with NaN (f32) or all-ones (u32) bits: a call that read a kept
/// buffer's old contents before writing them would then show it (tests).
#[cfg(feature = "test-hooks")]
pub(crate) fn poison_all() {
    for s in [&QUERY_TILES, &DQ_COPIES, &K_TILES, &V_TILES] {
        s.lock().fill(f32::NAN);
    }
    for s in [&QUERY_PAIRS, &K_PAIRS, &V_PAIRS] {
        s.lock().fill(u32::MAX);
    }
}

/// Bytes kept now.
pub(crate) fn kept_bytes() -> usize {
    KEPT.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_reuse_within_the_budget() {
        static S: Slot<f32> = Slot::new();
        let v = S.take("t", 1000, 0.0).unwrap();
        let ptr = v.as_ptr();
        // On a cache line, as every scratch buffer (see `cpu::Buf`).
        assert_eq!(ptr as usize % 64, 0);
        S.put(v);
        // Taken again, smaller: the same allocation, zeroed.
        let mut v = S.take("t", 500, 0.0).unwrap();
        assert_eq!(v.as_ptr(), ptr);
        assert!(v.iter().all(|&x| x == 0.0) && v.len() == 500);
        v.fill(7.0);
        S.put(v);
        // For overwrite: old values may remain, the length is right.
        let v = S.take_for_overwrite("t", 800, 0.0).unwrap();
        assert_eq!((v.as_ptr(), v.len()), (ptr, 800));
        assert!(v[..500].iter().all(|&x| x == 7.0) && v[500..].iter().all(|&x| x == 0.0));
        // Larger than kept: a new buffer.
        S.put(v);
        let v = S.take("t", 5000, 1.0).unwrap();
        assert!(v.len() == 5000 && v.iter().all(|&x| x == 1.0));
        // Over the budget: not kept.
        S.put(super::super::buf(0.0, BUDGET_BYTES / 4 + 1));
        assert_eq!(S.take("t", 1, 0.0).unwrap().capacity(), 1);
        // More than any machine maps: OutOfMemory naming the buffer, and the kept one freed.
        S.put(super::super::buf(0.0, 100));
        let e = S.take("the test's tiles", 1 << 60, 0.0).unwrap_err();
        assert_eq!(
            e.kind(),
            &crate::ErrorKind::OutOfMemory {
                what: "the test's tiles",
                bytes: 1 << 62
            }
        );
        let e = S.take_for_overwrite("x", usize::MAX / 2, 0.0).unwrap_err();
        assert_eq!(
            e.kind(),
            &crate::ErrorKind::OutOfMemory {
                what: "x",
                bytes: usize::MAX
            }
        );
        // The slot kept nothing: a new buffer of the size asked for.
        assert_eq!(S.take("t", 1, 0.0).unwrap().capacity(), 1);
        S.clear();
    }
}
