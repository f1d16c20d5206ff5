//! Buffers for KV caches in transparent huge pages, and the fallible allocation of results.
//!
//! A decoding step reads the whole cache. With 4 KiB pages, a contiguous f32 cache of 8 kv heads
//! at d = 128 spans one page per key, so a 32k-token step walks 65 536 pages of k and as many
//! of v, and the decode kernel reads 8 keys' pages at once (one kv head at a time). In 2 MiB
//! pages the same step at the decode benchmark shape (B = 1, 32 / 8 heads, d = 128, 32k keys, 2 threads,
//! AVX2 host) took 0.82-1.00 of the time in f32 (median 0.91 over 11 pairs) and 0.89-0.98 in
//! bf16 (4 pairs): caches of both kinds in one process, calls alternating (`examples/
//! decode_step.rs`; docs/PERFORMANCE.md). A plain sequential read of 1 GiB ran as fast in
//! either kind of page, so the gain is in the decode kernel's access pattern, not a faster
//! memory.
//!
//! Linux backs an anonymous mapping with huge pages where
//! `/sys/kernel/mm/transparent_hugepage/enabled` says `always`, or says `madvise` (the default of
//! many distributions) and the range was advised with `MADV_HUGEPAGE`: what [`kv_cache_vec`]
//! does before it first writes the buffer. PyTorch does the same for CPU tensors of 2 MiB or more
//! when `THP_MEM_ALLOC_ENABLE=1` is set, NumPy for arrays of 4 MiB or more. It is a hint: where
//! the kernel has no huge page free, or on other systems, the buffer is an ordinary one and
//! everything computes the same. [`huge_page_bytes`] tells how much of a buffer the kernel did
//! back with huge pages. The buffers are [`CacheBuf`]s, which start on a 2 MiB boundary (see
//! there for why that is not a `Vec`).
//!
//! Also here (crate-private): `try_collect`, `try_filled`, `try_poisoned`, `par_fill` and `CacheBuf::try_from_iter_advised`, the
//! fallible allocation of every call's results and of the working buffers whose size follows the
//! inputs' shapes, which turns an allocator's refusal into `ErrorKind::OutOfMemory` instead of an
//! abort.

use crate::error::{ErrorKind, Result};
use rayon::prelude::*;

/// The huge page size the advice asks for (x86-64 and most aarch64 kernels): buffers smaller
/// than this are not advised.
pub const HUGE_PAGE: usize = 2 << 20;

/// Where a [`CacheBuf`] of `bytes` bytes starts: on a [`HUGE_PAGE`] boundary from one huge page
/// up (so the kernel can back all of it with huge pages, not only the whole huge pages inside
/// it), else on a 64-byte cache line.
fn cache_align(bytes: usize) -> usize {
    if bytes >= HUGE_PAGE {
        HUGE_PAGE
    } else {
        64
    }
}

/// An owned buffer of `T` for a KV cache, allocated on a [`HUGE_PAGE`] boundary (64 bytes
/// below one huge page) and, unless asked not to, advised for transparent huge pages before its
/// first write. It dereferences to `[T]`, so `&mut buf[..]` is what
/// [`crate::TensorMut::new`] takes.
///
/// Why not a `Vec`: glibc returns a large allocation 16 bytes past a page boundary (its chunk
/// header), so every 64-byte vector load of the decode kernels straddles two cache lines, and
/// its bytes before the first and after the last 2 MiB boundary cannot be huge pages. A decoding step over caches
/// starting on a 2 MiB boundary against the same caches 16 bytes further on (the decode benchmark shape, B
/// = 1, 32 / 8 heads, d = 128, Zen 4, alternating call by call, medians): with the cache in L2
/// (256 keys, one thread) bf16 0.92-0.94 and f32 0.90-0.91 of the time; at 32k keys on two
/// threads, bound by memory, bf16 0.92-1.01 over nine runs (median 0.97), f32 0.97-1.06 (no
/// clear change) (docs/PERFORMANCE.md). PyTorch's CPU tensors start on 64-byte boundaries.
pub struct CacheBuf<T: Copy> {
    /// Start of the allocation (dangling when `layout.size() == 0`).
    ptr: std::ptr::NonNull<T>,
    /// Elements in use from `ptr`.
    len: usize,
    /// Initialised elements from `ptr` (at least `len`): all that `from_iter_advised` wrote, or
    /// `len` at its largest since.
    init: usize,
    /// Elements the allocation holds.
    cap: usize,
    layout: std::alloc::Layout,
}

// SAFETY: a CacheBuf owns its elements as a Box<[T]> does; no other handle to them exists.
unsafe impl<T: Copy + Send> Send for CacheBuf<T> {}
// SAFETY: shared access only reads, as through &[T].
unsafe impl<T: Copy + Sync> Sync for CacheBuf<T> {}

impl<T: Copy> CacheBuf<T> {
    /// The values of `iter` (at most `iter.len()` of them), advised for transparent huge pages
    /// before they are written when `huge_pages`.
    ///
    /// # Panics
    /// If `iter.len()` elements of `T` exceed `isize::MAX` bytes, or on allocation failure
    /// (`handle_alloc_error`), as `Vec::with_capacity` does.
    pub fn from_iter_advised<I>(iter: I, huge_pages: bool) -> Self
    where
        I: IntoIterator<Item = T>,
        I::IntoIter: ExactSizeIterator,
    {
        let iter = iter.into_iter();
        match Self::alloc(iter.len()) {
            Ok(buf) => buf.filled(iter, huge_pages),
            Err(Some(layout)) => std::alloc::handle_alloc_error(layout),
            Err(None) => panic!("CacheBuf: size overflow"),
        }
    }

    /// [`CacheBuf::from_iter_advised`], or [`ErrorKind::OutOfMemory`] naming `what` where the
    /// allocator refuses or the size passes `isize::MAX` bytes, instead of an aborted process:
    /// for a cache (or any buffer) whose size comes from a user's request.
    pub fn try_from_iter_advised<I>(what: &'static str, iter: I, huge_pages: bool) -> Result<Self>
    where
        I: IntoIterator<Item = T>,
        I::IntoIter: ExactSizeIterator,
    {
        let iter = iter.into_iter();
        match Self::alloc(iter.len()) {
            Ok(buf) => Ok(buf.filled(iter, huge_pages)),
            Err(_) => Err(ErrorKind::OutOfMemory {
                what,
                bytes: iter.len().saturating_mul(std::mem::size_of::<T>()),
            }
            .into()),
        }
    }

    /// An uninitialised buffer of `cap` elements (`len` 0), or the layout the allocator refused
    /// (`None`: the size has no layout).
    fn alloc(cap: usize) -> std::result::Result<Self, Option<std::alloc::Layout>> {
        let size = cap.checked_mul(std::mem::size_of::<T>()).ok_or(None)?;
        let align = cache_align(size).max(std::mem::align_of::<T>());
        let layout = std::alloc::Layout::from_size_align(size, align).map_err(|_| None)?;
        let ptr = if size == 0 {
            // Aligned for T and non-null; never read or freed (no element occupies bytes).
            std::ptr::NonNull::<T>::dangling()
        } else {
            // SAFETY: `layout` has a non-zero size.
            let raw = unsafe { std::alloc::alloc(layout) };
            std::ptr::NonNull::new(raw.cast::<T>()).ok_or(Some(layout))?
        };
        Ok(CacheBuf {
            ptr,
            len: 0,
            init: 0,
            cap,
            layout,
        })
    }

    /// Writes the values of `iter` (at most `cap`) from the start of a new buffer from
    /// [`CacheBuf::alloc`], advised first when `huge_pages`.
    fn filled(mut self, iter: impl Iterator<Item = T>, huge_pages: bool) -> Self {
        if huge_pages {
            advise_huge_pages(self.ptr.as_ptr() as usize, self.layout.size());
        }
        let mut len = 0;
        // `take(cap)`: an ExactSizeIterator that yields more than it said writes no further.
        for x in iter.take(self.cap) {
            // SAFETY: len < cap, so slot `len` lies inside the allocation of `cap` elements,
            // aligned for T; T is Copy, so overwriting the uninitialised slot drops nothing.
            unsafe { self.ptr.as_ptr().add(len).write(x) };
            len += 1;
        }
        (self.len, self.init) = (len, len);
        self
    }
}

impl<T: Copy> CacheBuf<T> {
    /// An empty buffer, no allocation (for statics).
    pub(crate) const fn empty() -> Self {
        CacheBuf {
            ptr: std::ptr::NonNull::dangling(),
            len: 0,
            init: 0,
            cap: 0,
            layout: std::alloc::Layout::new::<()>(),
        }
    }

    /// Elements the buffer can hold without a new allocation.
    pub(crate) fn capacity(&self) -> usize {
        self.cap
    }

    /// Makes the buffer `len` elements long (`len <= capacity()`): all of them `fill`, or, with
    /// `overwrite`, only those never initialised (the caller writes every element before it
    /// reads it).
    pub(crate) fn reset(&mut self, len: usize, fill: T, overwrite: bool) {
        assert!(len <= self.cap, "CacheBuf::reset past the capacity");
        let from = if overwrite { self.init.min(len) } else { 0 };
        for i in from..len {
            // SAFETY: i < len <= cap: inside the allocation, aligned for T; T is Copy.
            unsafe { self.ptr.as_ptr().add(i).write(fill) };
        }
        self.len = len;
        self.init = self.init.max(len);
    }
}

impl<T: Copy> std::ops::Deref for CacheBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: the first `len` elements from `ptr` are initialised and owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Copy> std::ops::DerefMut for CacheBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and &mut self makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Copy> Drop for CacheBuf<T> {
    fn drop(&mut self) {
        if self.layout.size() > 0 {
            // SAFETY: allocated in `from_iter_advised` with this very layout; T is Copy, so no
            // element needs dropping.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr().cast(), self.layout) };
        }
    }
}

impl<T: Copy> Default for CacheBuf<T> {
    /// An empty buffer (no allocation).
    fn default() -> Self {
        Self::empty()
    }
}

impl<T: Copy> Clone for CacheBuf<T> {
    /// A copy in a new buffer, on the same alignment and advised for huge pages as
    /// [`kv_cache_vec`]'s buffers are.
    fn clone(&self) -> Self {
        Self::from_iter_advised(self.iter().copied(), true)
    }
}

impl<T: Copy + std::fmt::Debug> std::fmt::Debug for CacheBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// A buffer of `len` copies of `T::default()` (zero for every element type of this crate) for a
/// KV cache: a [`CacheBuf`], starting on a 2 MiB boundary and advised to the kernel for
/// transparent huge pages before its first write (Linux; elsewhere an ordinary aligned
/// allocation). Use it for caches that decoding reads every step: see the module docs and
/// [`CacheBuf`] for what it measured.
pub fn kv_cache_vec<T: Copy + Default>(len: usize) -> CacheBuf<T> {
    kv_cache_from_iter(std::iter::repeat_n(T::default(), len))
}

/// The values of `iter` in a buffer for a KV cache, aligned and advised as [`kv_cache_vec`]'s
/// before they are written (each element once: a cache filled from a file or a generator needs
/// no zeroing first).
pub fn kv_cache_from_iter<T, I>(iter: I) -> CacheBuf<T>
where
    T: Copy,
    I: IntoIterator<Item = T>,
    I::IntoIter: ExactSizeIterator,
{
    CacheBuf::from_iter_advised(iter, true)
}

/// Advises the whole 4 KiB pages of `[addr, addr + bytes)` for transparent huge pages.
#[cfg(target_os = "linux")]
fn advise_huge_pages(addr: usize, bytes: usize) {
    const PAGE: usize = 4096;
    let start = addr.next_multiple_of(PAGE);
    let end = (addr + bytes) / PAGE * PAGE;
    if end < start + HUGE_PAGE {
        return;
    }
    // SAFETY: `[start, end)` lies inside one live allocation the caller owns (a Vec's capacity),
    // and both ends are page-aligned as madvise requires. MADV_HUGEPAGE changes neither the
    // contents nor the validity of the range, only how the kernel may back it. Its result is
    // ignored: the advice is a hint, and a kernel without THP answers EINVAL.
    unsafe {
        libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages(_addr: usize, _bytes: usize) {}

/// Bytes of huge pages backing the memory mappings that overlap `buf` (`AnonHugePages` in
/// `/proc/self/smaps`), or `None` where that file cannot be read (not Linux). A mapping may reach
/// past `buf`, so this can exceed its size for a buffer inside a larger mapping.
pub fn huge_page_bytes<T>(buf: &[T]) -> Option<usize> {
    huge_page_bytes_in(&[byte_range(buf)])
}

/// The address range of `buf`'s bytes (for [`huge_page_bytes_in`]).
pub fn byte_range<T>(buf: &[T]) -> std::ops::Range<usize> {
    let lo = buf.as_ptr() as usize;
    lo..lo + std::mem::size_of_val(buf)
}

/// As [`huge_page_bytes`] for several address ranges (e.g. a k and a v cache), each mapping that
/// overlaps any of them counted once.
pub fn huge_page_bytes_in(ranges: &[std::ops::Range<usize>]) -> Option<usize> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    smaps_huge_bytes(&smaps, ranges)
}

/// The `AnonHugePages` bytes of the mappings in `smaps` (the text of `/proc/<pid>/smaps`) that
/// overlap any of `ranges`; `None` if such a line does not parse.
fn smaps_huge_bytes(smaps: &str, ranges: &[std::ops::Range<usize>]) -> Option<usize> {
    let mut total = 0;
    let mut inside = false;
    for line in smaps.lines() {
        // A mapping's header: `start-end perms offset dev inode [path]`, addresses in hex.
        let range = line.split_whitespace().next().and_then(|r| {
            let (a, b) = r.split_once('-')?;
            Some((
                usize::from_str_radix(a, 16).ok()?,
                usize::from_str_radix(b, 16).ok()?,
            ))
        });
        if let Some((a, b)) = range {
            inside = ranges.iter().any(|r| a < r.end && r.start < b);
        } else if let Some(kb) = line.strip_prefix("AnonHugePages:") {
            if inside {
                total += kb
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<usize>()
                    .ok()?
                    << 10;
            }
        }
    }
    Some(total)
}

/// The values of `iter` in a `Vec`, or [`ErrorKind::OutOfMemory`] naming `what` where the
/// allocation fails. The results of a call, its per-sequence table and the working buffers
/// that follow its shapes are allocated this way,
/// before anything the caller owns is written: their sizes follow from shapes alone, which
/// stride-0 views make as large as the address space allows while the caller holds one element.
/// (`vec!` and `collect` abort the process when the allocator refuses.)
pub(crate) fn try_collect<T>(
    what: &'static str,
    iter: impl ExactSizeIterator<Item = T>,
) -> Result<Vec<T>> {
    let n = iter.len();
    let mut v = try_with_capacity(what, n)?;
    v.extend(iter.take(n));
    Ok(v)
}

/// `n` copies of `value` (see [`try_collect`]).
pub(crate) fn try_filled<T: Clone>(what: &'static str, value: T, n: usize) -> Result<Vec<T>> {
    try_collect(what, std::iter::repeat_n(value, n))
}

/// Elements per task of the poison fills: 64 KiB of f32, 16 pages.
const POISON_CHUNK: usize = 1 << 14;

/// `n` copies of `value` (the poison of the passes' results), or `OutOfMemory` naming `what`, written
/// by the pool's threads. The first writes to a fresh allocation take its page faults, which on
/// the calling thread alone kept the other threads waiting: a 32 MiB `out` (N = 4096, 16 heads,
/// f32 d = 128) took 43-91 ms of wall time to poison on one thread (median 56), 27-60 ms on two
/// (median 41), against ~0.87 s of CPU time on two threads for the causal forward after it (Zen 4
/// VM, loaded host, 9 calls each way).
pub(crate) fn try_poisoned<T: Copy + Send + Sync>(
    what: &'static str,
    value: T,
    n: usize,
) -> Result<Vec<T>> {
    poisoned(what, value, n, false)
}

/// [`try_poisoned`] with the allocation advised for transparent huge pages before its first
/// write (the backward's gradients: a fresh allocation every call, whose 4 KiB page faults
/// took ~3-4% of the f32 causal backward's samples at N = 1024, d = 128).
pub(crate) fn try_poisoned_huge<T: Copy + Send + Sync>(
    what: &'static str,
    value: T,
    n: usize,
) -> Result<Vec<T>> {
    poisoned(what, value, n, true)
}

fn poisoned<T: Copy + Send + Sync>(
    what: &'static str,
    value: T,
    n: usize,
    huge: bool,
) -> Result<Vec<T>> {
    let mut v = try_with_capacity(what, n)?;
    if huge {
        advise_huge_pages(v.as_ptr() as usize, n * std::mem::size_of::<T>());
    }
    // An indexed iterator extends in place, into the capacity reserved above.
    v.par_extend(rayon::iter::repeat_n(value, n).with_min_len(POISON_CHUNK));
    Ok(v)
}

/// An empty vector with room for `n` elements, or `OutOfMemory` naming `what`.
fn try_with_capacity<T>(what: &'static str, n: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| ErrorKind::OutOfMemory {
        what,
        bytes: n.saturating_mul(std::mem::size_of::<T>()),
    })?;
    Ok(v)
}

/// `dst.fill(value)` by the pool's threads (see [`try_poisoned`]: the caller's fresh buffers fault
/// too).
pub(crate) fn par_fill<T: Copy + Send + Sync>(dst: &mut [T], value: T) {
    dst.par_chunks_mut(POISON_CHUNK)
        .for_each(|chunk| chunk.fill(value));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn try_from_iter_advised_refuses_cleanly() {
        // A buffer that fits: the same as the infallible constructor, on its alignment.
        let b = CacheBuf::try_from_iter_advised("b", (0..HUGE_PAGE + 5).map(|i| i as u8), true);
        let b = b.unwrap();
        assert_eq!(b.len(), HUGE_PAGE + 5);
        assert!(b.iter().enumerate().all(|(i, &x)| x == i as u8));
        assert_eq!(b.as_ptr() as usize % HUGE_PAGE, 0);
        // More than any machine maps, and more than the address space: OutOfMemory naming it.
        for (n, bytes) in [(1usize << 60, 1usize << 62), (usize::MAX / 2, usize::MAX)] {
            let e = CacheBuf::<f32>::try_from_iter_advised("the cache", (0..n).map(|_| 0.0), true)
                .unwrap_err();
            assert_eq!(
                e.kind(),
                &ErrorKind::OutOfMemory {
                    what: "the cache",
                    bytes
                }
            );
        }
    }

    #[test]
    fn kv_cache_vec_is_zeroed_and_usable() {
        for len in [0, 1, 1000, (3 * HUGE_PAGE) / 4 + 5] {
            let mut v = kv_cache_vec::<f32>(len);
            assert_eq!(v.len(), len);
            assert!(v.iter().all(|&x| x == 0.0));
            v.iter_mut().enumerate().for_each(|(i, x)| *x = i as f32);
            assert!(v.iter().enumerate().all(|(i, &x)| x == i as f32));
        }
        let b = kv_cache_vec::<half::bf16>(HUGE_PAGE);
        assert!(b.iter().all(|x| x.to_bits() == 0));
        let n = HUGE_PAGE + 3;
        let c = kv_cache_from_iter((0..n).map(|i| i as u32));
        assert_eq!(c.len(), n);
        assert!(c.iter().enumerate().all(|(i, &x)| x == i as u32));
    }

    #[test]
    fn cache_buf_is_aligned_and_holds_what_the_iterator_gave() {
        for (len, align) in [
            (1, 64),
            (1000, 64),
            (HUGE_PAGE / 4, HUGE_PAGE),
            (HUGE_PAGE, HUGE_PAGE),
        ] {
            for huge in [false, true] {
                let b = CacheBuf::from_iter_advised((0..len).map(|i| i as f32), huge);
                assert_eq!(b.len(), len);
                assert_eq!(
                    b.as_ptr() as usize % align,
                    0,
                    "{len} elements, huge {huge}"
                );
                assert!(b.iter().enumerate().all(|(i, &x)| x == i as f32));
                let c = b.clone();
                assert_eq!(&c[..], &b[..]);
                assert_ne!(c.as_ptr(), b.as_ptr());
            }
        }
        // Empty, and zero-sized elements: no allocation, nothing to read.
        let e = CacheBuf::<f32>::from_iter_advised(std::iter::empty(), true);
        assert!(e.is_empty());
        let z = CacheBuf::from_iter_advised(std::iter::repeat_n((), 5), true);
        assert_eq!(z.len(), 5);
        assert_eq!(
            format!("{:?}", CacheBuf::from_iter_advised([1u8, 2], false)),
            "[1, 2]"
        );
    }

    /// An ExactSizeIterator whose `len` is wrong (a safe trait may lie): the buffer holds what
    /// it yielded, up to the length it announced, never uninitialised elements.
    #[test]
    fn cache_buf_survives_a_lying_iterator() {
        struct Lying {
            said: usize,
            gives: usize,
        }
        impl Iterator for Lying {
            type Item = u16;
            fn next(&mut self) -> Option<u16> {
                (self.gives > 0).then(|| {
                    self.gives -= 1;
                    7
                })
            }
        }
        impl ExactSizeIterator for Lying {
            fn len(&self) -> usize {
                self.said
            }
        }
        let short = CacheBuf::from_iter_advised(Lying { said: 10, gives: 4 }, false);
        assert_eq!(&short[..], &[7; 4]);
        let long = CacheBuf::from_iter_advised(Lying { said: 3, gives: 50 }, false);
        assert_eq!(&long[..], &[7; 3]);
    }

    #[test]
    fn smaps_counts_the_overlapping_mappings() {
        let smaps = "\
7f0000000000-7f0000400000 rw-p 00000000 00:00 0
Size:               4096 kB
AnonHugePages:      2048 kB
7f0000400000-7f0000c00000 rw-p 00000000 00:00 0
AnonHugePages:      8192 kB
7f0000c00000-7f0000e00000 r--p 00000000 08:01 42   /usr/lib/x.so
AnonHugePages:         0 kB
";
        let m = |a: usize| 0x7f00_0000_0000 + a;
        let huge = |lo, hi| smaps_huge_bytes(smaps, std::slice::from_ref(&(m(lo)..m(hi))));
        assert_eq!(huge(0, 0x10), Some(2048 << 10));
        assert_eq!(huge(0x3f_0000, 0x41_0000), Some(10240 << 10));
        assert_eq!(huge(0x40_0000, 0xe0_0000), Some(8192 << 10));
        assert_eq!(huge(0xe0_0000, 0xf0_0000), Some(0));
        let bad = "1000-2000 rw-p 0 00:00 0\nAnonHugePages: x kB\n";
        assert_eq!(
            smaps_huge_bytes(bad, std::slice::from_ref(&(0x1000..0x1001))),
            None
        );
        // Two ranges in one mapping count it once; in two, both.
        let two = |a, b, c, d| smaps_huge_bytes(smaps, &[m(a)..m(b), m(c)..m(d)]);
        assert_eq!(two(0, 0x10, 0x100, 0x110), Some(2048 << 10));
        assert_eq!(two(0, 0x10, 0x50_0000, 0x50_0010), Some(10240 << 10));
    }

    /// On Linux the buffer's mappings are found; whether the kernel gave them huge pages
    /// depends on the system (THP setting, free memory), so that is only printed.
    #[test]
    fn huge_page_bytes_reads_this_process() {
        let v = kv_cache_vec::<f32>(4 * HUGE_PAGE);
        let b = huge_page_bytes(&v);
        if cfg!(target_os = "linux") {
            let b = b.expect("/proc/self/smaps unreadable");
            eprintln!("{b} of {} bytes in huge pages", 16 * HUGE_PAGE);
        }
    }
}
