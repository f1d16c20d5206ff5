//! Working buffers the allocator refuses: this test binary's global allocator refuses every
//! single allocation over [`LIMIT`], so a call whose results fit but whose working buffers (which
//! follow the inputs' shapes, not the results') do not must return `OutOfMemory` naming them,
//! and leave what the caller owns untouched, where it used to abort the process. The inputs are
//! stride-0 views or small, so only the library's own buffers pass the limit.

use flashattn::{
    flash_attn, flash_attn_backward, flash_attn_with_kvcache, merge_attn_partials, naive,
    reference, AttnOptions, ErrorKind, KvCacheOptions, TensorMut, TensorRef,
};
use std::alloc::{GlobalAlloc, Layout, System};

/// The largest single allocation this binary grants: 64 MiB.
const LIMIT: usize = 64 << 20;

struct Limited;

// SAFETY: forwards to the system allocator, or refuses (a null pointer) as `GlobalAlloc` allows.
unsafe impl GlobalAlloc for Limited {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > LIMIT {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout (nothing else is granted).
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() > LIMIT {
            return std::ptr::null_mut();
        }
        // SAFETY: as in `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > LIMIT {
            return std::ptr::null_mut();
        }
        // SAFETY: as in `dealloc`; the caller's contract for the new size.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Limited = Limited;

fn out_of_memory(e: &flashattn::Error) -> (&'static str, usize) {
    match e.kind() {
        ErrorKind::OutOfMemory { what, bytes } => (what, *bytes),
        _ => panic!("expected OutOfMemory, got: {e}"),
    }
}

#[test]
fn the_limit_holds() {
    assert!(Vec::<u8>::new().try_reserve_exact(LIMIT + 1).is_err());
    assert!(Vec::<u8>::new().try_reserve_exact(LIMIT).is_ok());
}

/// The forward packs k and v once for all query heads of a kv head: 16 heads over one, 2^20
/// keys at d = 32 (128 MiB of f32 tiles each) for an output of 16 rows.
#[test]
fn forward_packed_tiles() {
    let one = [0.25f32; 32];
    let q = TensorRef::new(&one, &[1, 1, 16, 32], &[0, 0, 0, 1]);
    let k = TensorRef::new(&one, &[1, 1 << 20, 1, 32], &[0, 0, 0, 1]);
    let e = flash_attn(&q, &k, &k, &AttnOptions::default()).unwrap_err();
    let (what, bytes) = out_of_memory(&e);
    assert_eq!(what, "the packed tiles of k", "{e}");
    assert_eq!(bytes, (1 << 20) * 32 * 4, "{e}");
}

/// The backward's query tiles hold q and dO twice each in f32 (transposed and as rows), four
/// times dq's size: dq 32 MiB, the tiles ~128 MiB.
#[test]
fn backward_query_tiles() {
    let (n, h, d) = (4096, 16, 128);
    let one = [0.25f32; 128];
    let q = TensorRef::new(&one, &[1, n, h, d], &[0, 0, 0, 1]);
    let k = TensorRef::new(&one, &[1, 64, h, d], &[0, 0, 0, 1]);
    let lse_data = vec![1.0f32; n];
    let lse = TensorRef::new(&lse_data, &[1, h, n], &[0, 0, 1]);
    let e = flash_attn_backward(&q, &k, &k, &q, &lse, &q, &AttnOptions::default()).unwrap_err();
    let (what, bytes) = out_of_memory(&e);
    assert_eq!(what, "the backward's query tiles", "{e}");
    assert!(bytes > LIMIT, "{e}");
}

/// A decoding step forced to 256 splits over 64 sequences: the splits' partial rows (256 × 64 ×
/// 32 rows × 128 dims in f32, 256 MiB) against an output of 1 MiB. The call appends a key to
/// each sequence first: refused, it must have written neither cache.
#[test]
fn decode_split_partials_write_nothing() {
    let (b, h, hk, d, cap, len) = (64, 32, 8, 128, 16, 8i32);
    let q_data: Vec<f32> = (0..b * h * d).map(|i| (i % 7) as f32 * 0.1).collect();
    let new: Vec<f32> = (0..b * hk * d).map(|i| (i % 5) as f32 * 0.2).collect();
    let cache: Vec<f32> = (0..b * cap * hk * d)
        .map(|i| (i % 11) as f32 * 0.05)
        .collect();
    let (mut kc, mut vc) = (cache.clone(), cache.clone());
    let q = TensorRef::contiguous(&q_data, &[b, 1, h, d]);
    let kn = TensorRef::contiguous(&new, &[b, 1, hk, d]);
    let lens = vec![len; b];
    let call = |kc: &mut [f32], vc: &mut [f32], splits: usize| {
        let opts = KvCacheOptions::default()
            .new_kv(kn.clone(), kn.clone())
            .num_splits(splits);
        let mut k = TensorMut::contiguous(kc, &[b, cap, hk, d]);
        let mut v = TensorMut::contiguous(vc, &[b, cap, hk, d]);
        flash_attn_with_kvcache(&q, &mut k, &mut v, &lens, &opts)
    };
    let e = call(&mut kc, &mut vc, 256).unwrap_err();
    let (what, bytes) = out_of_memory(&e);
    assert_eq!(what, "the split partials", "{e}");
    assert_eq!(bytes, 256 * b * h * d * 4, "{e}");
    assert!(
        kc == cache && vc == cache,
        "a refused call wrote the caches"
    );
    // The same call with splits that fit runs (and appends).
    let r = call(&mut kc, &mut vc, 2).expect("two splits fit");
    assert!(r.out.to_f32_vec().iter().all(|x| x.is_finite()));
    assert!(kc != cache, "the append ran");
}

/// The naive backward (the benchmarks' yardstick) holds S and P of one (sequence, head), 4200 ×
/// 4200 f32 (70.6 MB), for gradients of 4200 × 8 values each.
#[test]
fn naive_backward_score_matrix() {
    let n = 4200;
    let one = [0.25f32; 8];
    let q = TensorRef::new(&one, &[1, n, 1, 8], &[0, 0, 0, 1]);
    let e = naive::attention_backward(&q, &q, &q, &q, &AttnOptions::default()).unwrap_err();
    assert_eq!(
        out_of_memory(&e),
        ("the naive score matrix S", n * n * 4),
        "{e}"
    );
}

/// The f64 reference holds one (sequence, head) as rows: 3 million keys of one query are 72 MB
/// of row handles for k alone.
#[test]
fn reference_head_matrices() {
    let one = [0.25f32];
    let q = TensorRef::new(&one, &[1, 1, 1, 1], &[0, 0, 0, 1]);
    let k = TensorRef::new(&one, &[1, 3_000_000, 1, 1], &[0, 0, 0, 1]);
    let o = AttnOptions::default();
    let e = reference::attention(&q, &k, &k, &o).unwrap_err();
    let (what, bytes) = out_of_memory(&e);
    assert_eq!(what, "the reference's per-head matrices", "{e}");
    assert!(bytes > LIMIT, "{e}");
    let dout = q.clone();
    let e = reference::attention_backward(&q, &k, &k, &dout, &o).unwrap_err();
    assert_eq!(
        out_of_memory(&e).0,
        "the reference's per-head matrices",
        "{e}"
    );
}

/// `merge_attn_partials` of one stride-0 partial of 2^20 heads × 64 dims: LSEs of 4 MiB, a
/// merged out of 256 MiB.
#[test]
fn merged_result() {
    let (heads, d) = (1usize << 20, 64);
    let one = [0.5f32; 64];
    let out = TensorRef::new(&one, &[1, 1, heads, d], &[0, 0, 0, 1]);
    let lse = TensorRef::new(&one, &[1, heads, 1], &[0, 0, 1]);
    let e = merge_attn_partials(&[out], &[lse]).unwrap_err();
    assert_eq!(out_of_memory(&e), ("`out`", heads * d * 4), "{e}");
}
