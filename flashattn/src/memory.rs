//! Buffers for KV caches in transparent huge pages.
//!
//! A decoding step reads the whole cache. With 4 KiB pages, a contiguous f32 cache of 8 kv heads
//! at d = 128 spans one page per key, so a 32k-token step walks 65 536 pages of k and as many
//! of v, and the decode kernel reads 8 keys' pages at once (one kv head at a time). In 2 MiB
//! pages the same step at issue 6's shape (B = 1, 32 / 8 heads, d = 128, 32k keys, 2 threads,
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
//! back with huge pages.

/// The huge page size the advice asks for (x86-64 and most aarch64 kernels): buffers smaller
/// than this are not advised.
pub const HUGE_PAGE: usize = 2 << 20;

/// A buffer of `len` copies of `T::default()` (zero for every element type of this crate) for a
/// KV cache, advised to the kernel for transparent huge pages before its first write (Linux;
/// elsewhere, and under `HUGE_PAGE` bytes, an ordinary `vec!`). Use it for caches that decoding
/// reads every step: see the module docs for what it measured.
pub fn kv_cache_vec<T: Copy + Default>(len: usize) -> Vec<T> {
    kv_cache_from_iter(std::iter::repeat_n(T::default(), len))
}

/// The values of `iter` in a buffer for a KV cache, advised as [`kv_cache_vec`]'s before they are
/// written (each element once: a cache filled from a file or a generator needs no zeroing first).
pub fn kv_cache_from_iter<T, I>(iter: I) -> Vec<T>
where
    I: IntoIterator<Item = T>,
    I::IntoIter: ExactSizeIterator,
{
    let iter = iter.into_iter();
    let mut v: Vec<T> = Vec::with_capacity(iter.len());
    advise_huge_pages(
        v.as_mut_ptr() as usize,
        iter.len() * std::mem::size_of::<T>(),
    );
    v.extend(iter);
    v
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

#[cfg(test)]
mod tests {
    use super::*;

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
