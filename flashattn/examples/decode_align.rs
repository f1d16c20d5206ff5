//! Times one decoding step at the decode benchmark shape (B = 1, 32 / 8 heads, d = 128) over the same
//! caches at several start addresses, alternating call by call: `cargo run --release -p
//! flashattn --example decode_align -- [f32|bf16] [reps]`, with `CFGS=A:E,...` the starts (the
//! first address ≡ 0 mod A in a larger buffer, plus E bytes; default `64:16,64:0,4096:0,
//! 2097152:0`, where `64:16` is where glibc puts a large `Vec`) and `CAP=N` the cached tokens
//! (default 32768). What `memory::CacheBuf`'s 2 MiB alignment rests on (docs/PERFORMANCE.md).
use flashattn::decode::{flash_attn_with_kvcache, KvCacheOptions, TensorMut};
use flashattn::TensorRef;
use half::bf16;
use std::time::Instant;

fn lcg(s: &mut u64) -> f32 {
    *s = s
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

fn run<T: flashattn::tensor::Element>(conv: fn(f32) -> T, reps: usize)
where
    for<'a> flashattn::decode::SliceMut<'a>: From<&'a mut [T]>,
{
    let cap: usize = std::env::var("CAP")
        .ok()
        .and_then(|x| x.parse().ok())
        .unwrap_or(32768);
    let (heads, heads_kv, d) = (32, 8, 128);
    let es = std::mem::size_of::<T>();
    let mut s = 7u64;
    let q: Vec<T> = (0..heads * d).map(|_| conv(lcg(&mut s))).collect();
    let n = cap * heads_kv * d;
    let slack = (4 << 20) / es;
    let mut k = flashattn::memory::kv_cache_from_iter((0..n + slack).map(|_| conv(lcg(&mut s))));
    let mut v = flashattn::memory::kv_cache_from_iter((0..n + slack).map(|_| conv(lcg(&mut s))));
    println!("k {:p} v {:p}", k.as_ptr(), v.as_ptr());
    let cfgs: Vec<(usize, usize)> = std::env::var("CFGS")
        .unwrap_or("64:16,64:0,4096:0,2097152:0".into())
        .split(',')
        .map(|c| {
            let (a, b) = c.split_once(':').unwrap();
            (a.parse().unwrap(), b.parse().unwrap())
        })
        .collect();
    let shape = [1, cap, heads_kv, d];
    let qv = TensorRef::contiguous(&q, &[1, 1, heads, d]);
    let lens = [cap as i32];
    let opts = KvCacheOptions::default();
    let strides = [cap * heads_kv * d, heads_kv * d, d, 1];
    let mut times = vec![Vec::new(); cfgs.len()];
    for rep in 0..reps + 1 {
        for (ci, &(al, extra)) in cfgs.iter().enumerate() {
            let off = |p: usize| ((p.next_multiple_of(al) - p) + extra) / es;
            let (ko, vo) = (off(k.as_ptr() as usize), off(v.as_ptr() as usize));
            let mut kc = TensorMut::new(&mut k[ko..ko + n], &shape, &strides);
            let mut vc = TensorMut::new(&mut v[vo..vo + n], &shape, &strides);
            let t = Instant::now();
            let r = flash_attn_with_kvcache(&qv, &mut kc, &mut vc, &lens, &opts).unwrap();
            std::hint::black_box(r);
            if rep > 0 {
                times[ci].push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
    }
    for (c, mut t) in cfgs.iter().zip(times) {
        t.sort_by(f64::total_cmp);
        let l = t.len();
        println!(
            "{} align {:>7} +{:>3}: median {:.3} ms  q1 {:.3} q3 {:.3} min {:.3}",
            std::any::type_name::<T>().rsplit("::").next().unwrap(),
            c.0,
            c.1,
            t[l / 2],
            t[l / 4],
            t[3 * l / 4],
            t[0]
        );
    }
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let reps: usize = a.get(2).and_then(|x| x.parse().ok()).unwrap_or(30);
    match a.get(1).map(String::as_str) {
        Some("f32") => run::<f32>(|x| x, reps),
        _ => run::<bf16>(bf16::from_f32, reps),
    }
}
