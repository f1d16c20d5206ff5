use flashattn::*;
fn main() {
    let (b, n, h, d) = (1usize, 4096usize, 8usize, 64usize);
    let q: Vec<f32> = (0..b*n*h*d).map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0).collect();
    let t = TensorRef::contiguous(&q, &[b,n,h,d]);
    for causal in [false, true] {
        let o = AttnOptions::default().causal(causal);
        flash_attn(&t,&t,&t,&o).unwrap();
        let s = std::time::Instant::now();
        for _ in 0..3 { flash_attn(&t,&t,&t,&o).unwrap(); }
        let el = s.elapsed().as_secs_f64()/3.0;
        let fl = flops::forward(b,h,n,n,d,causal,(-1,-1));
        println!("causal={causal} {:.1} ms {:.1} GFLOP/s", el*1e3, fl/el/1e9);
    }
}
