//! flashattn-candle against candle's own naive attention (matmul, softmax, matmul), forward and
//! forward + backward through candle's autograd, f32, causal, on the CPU. The two alternate and
//! each reports its least wall time of the rounds, so a loaded host skews both alike.
//!
//! `cargo run --release -p flashattn-candle --example candle_naive_ab -- [seqlen] [rounds]`

use std::time::{Duration, Instant};

use candle_core::{Device, Result, Tensor, Var, D};

const BATCH: usize = 1;
const HEADS: usize = 8;
const HEAD_DIM: usize = 64;

/// Causal attention in candle ops, `[batch, seqlen, heads, head_dim]`.
fn naive(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let (q, k, v) = (
        q.transpose(1, 2)?.contiguous()?,
        k.transpose(1, 2)?.contiguous()?,
        v.transpose(1, 2)?.contiguous()?,
    );
    let s = (q.matmul(&k.t()?)? * (1.0 / (HEAD_DIM as f64).sqrt()))?.broadcast_add(mask)?;
    let e = s
        .broadcast_sub(&s.max_keepdim(D::Minus1)?.detach())?
        .exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    p.matmul(&v)?.transpose(1, 2)
}

fn least(f: &mut dyn FnMut() -> Result<()>, best: &mut Duration) -> Result<()> {
    let t = Instant::now();
    f()?;
    *best = (*best).min(t.elapsed());
    Ok(())
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let seqlen: usize = args.next().map_or(1024, |a| a.parse().expect("seqlen"));
    let rounds: usize = args.next().map_or(5, |a| a.parse().expect("rounds"));
    let dev = Device::Cpu;
    let shape = (BATCH, seqlen, HEADS, HEAD_DIM);
    let q = Var::randn(0f32, 1.0, shape, &dev)?;
    let k = Var::randn(0f32, 1.0, shape, &dev)?;
    let v = Var::randn(0f32, 1.0, shape, &dev)?;
    let mask: Vec<f32> = (0..seqlen * seqlen)
        .map(|x| {
            if x % seqlen > x / seqlen {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let mask = Tensor::from_vec(mask, (seqlen, seqlen), &dev)?;
    let scale = 1.0 / (HEAD_DIM as f32).sqrt();
    let flash = || flashattn_candle::flash_attn(&q, &k, &v, scale, true);
    let slow = || naive(&q, &k, &v, &mask);

    let mut best = [Duration::MAX; 4];
    for _ in 0..rounds {
        least(&mut || flash().map(drop), &mut best[0])?;
        least(&mut || slow().map(drop), &mut best[1])?;
        least(
            &mut || flash()?.sum_all()?.backward().map(drop),
            &mut best[2],
        )?;
        least(
            &mut || slow()?.sum_all()?.backward().map(drop),
            &mut best[3],
        )?;
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!("batch {BATCH}, heads {HEADS}, seqlen {seqlen}, head_dim {HEAD_DIM}, f32, causal; least of {rounds}");
    println!(
        "forward:            flashattn-candle {:8.2} ms  candle naive {:8.2} ms  ({:.2}x)",
        ms(best[0]),
        ms(best[1]),
        ms(best[1]) / ms(best[0])
    );
    println!(
        "forward + backward: flashattn-candle {:8.2} ms  candle naive {:8.2} ms  ({:.2}x)",
        ms(best[2]),
        ms(best[3]),
        ms(best[3]) / ms(best[2])
    );
    Ok(())
}
