//! Calls from several threads at once (a server's request handlers sharing the library): each
//! gets the bits it gets alone. They share the rayon pool and the scratch buffers kept between
//! calls (`cpu::reuse`), so one call may find another's kept buffer, or none. (In its own binary:
//! the kept buffers are process-wide, and `release_scratch` here must not race other tests.)

#[path = "integration/common/mod.rs"]
mod common;

use common::*;
use flashattn::{
    flash_attn, flash_attn_backward, release_scratch, AttnOptions, Buffer, DType, TensorRef,
};

fn view<'a>(b: &'a Buffer, shape: &[usize]) -> TensorRef<'a> {
    TensorRef::from_slice(
        b.as_slice(),
        shape,
        &flashattn::tensor::contiguous_strides(shape),
    )
}

/// One caller's work: forward and backward of its own shape; the bits of out, lse, dq, dk, dv.
struct Job {
    dtype: DType,
    /// (seqlen_q, seqlen_k, heads, heads_kv, head_dim)
    shape: (usize, usize, usize, usize, usize),
    causal: bool,
    bufs: [Buffer; 4],
}

impl Job {
    fn new(n: u64, dtype: DType, shape: (usize, usize, usize, usize, usize), causal: bool) -> Job {
        let (sq, sk, h, hkv, d) = shape;
        let mut rng = rng(100 + n);
        let mut draw = |len| to_buffer(&values(&mut rng, len, Dist::Normal), dtype);
        let bufs = [
            draw(sq * h * d),
            draw(sk * hkv * d),
            draw(sk * hkv * d),
            draw(sq * h * d),
        ];
        Job {
            dtype,
            shape,
            causal,
            bufs,
        }
    }

    fn run(&self) -> Vec<Vec<u32>> {
        let (sq, sk, h, hkv, d) = self.shape;
        let (qs, ks) = ([1, sq, h, d], [1, sk, hkv, d]);
        let [q, k, v, dout] = [
            view(&self.bufs[0], &qs),
            view(&self.bufs[1], &ks),
            view(&self.bufs[2], &ks),
            view(&self.bufs[3], &qs),
        ];
        let opts = AttnOptions::default().causal(self.causal);
        let f = flash_attn(&q, &k, &v, &opts).unwrap();
        let g =
            flash_attn_backward(&q, &k, &v, &f.out.view(), &f.lse.view(), &dout, &opts).unwrap();
        vec![
            bits(&f.out),
            bits(&f.lse),
            bits(&g.dq),
            bits(&g.dk),
            bits(&g.dv),
        ]
    }
}

#[test]
fn concurrent_calls_give_the_bits_of_serial_ones() {
    // Shapes large enough that the forward packs its k/v tiles and the backward keeps its
    // query tiles and dQ copies (the scratch slots), and different, so a kept buffer of one
    // shape is reused by another.
    let jobs = [
        Job::new(0, DType::F32, (512, 200, 8, 2, 64), false),
        Job::new(1, DType::BF16, (300, 700, 4, 4, 128), true),
        Job::new(2, DType::F32, (1024, 130, 16, 2, 40), true),
        Job::new(3, DType::F16, (257, 257, 6, 3, 59), false),
    ];
    release_scratch();
    let serial: Vec<_> = jobs.iter().map(Job::run).collect();
    assert!(
        release_scratch() > 0,
        "the calls kept no scratch: nothing shared"
    );
    for round in 0..3 {
        let got: Vec<Vec<_>> = std::thread::scope(|s| {
            let handles: Vec<_> = jobs
                .iter()
                .map(|j| s.spawn(move || (0..2).map(|_| j.run()).collect::<Vec<_>>()))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (i, (runs, want)) in got.iter().zip(&serial).enumerate() {
            for (r, run) in runs.iter().enumerate() {
                for (t, (a, b)) in run.iter().zip(want).enumerate() {
                    assert!(
                        a == b,
                        "round {round}, job {i} ({}), call {r}: result {t} differs from the serial call",
                        jobs[i].dtype
                    );
                }
            }
        }
    }
}
