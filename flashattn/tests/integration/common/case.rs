//! A forward case and its inputs.

use super::*;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Alibi {
    None,
    /// `[heads]`.
    PerHead,
    /// `[batch, heads]`.
    PerBatchHead,
}

/// One batched attention problem.
#[derive(Clone, Debug)]
pub struct Case {
    pub dtype: DType,
    pub batch: usize,
    pub seqlen_q: usize,
    pub seqlen_k: usize,
    pub heads: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    pub causal: bool,
    pub window: (i64, i64),
    pub softcap: Option<f32>,
    pub scale: Option<f32>,
    pub alibi: Alibi,
    pub layout: Layout,
    pub dist: Dist,
    pub seed: u64,
}

impl Default for Case {
    fn default() -> Self {
        Case {
            dtype: DType::F32,
            batch: 1,
            seqlen_q: 16,
            seqlen_k: 16,
            heads: 1,
            heads_kv: 1,
            head_dim: 8,
            causal: false,
            window: (-1, -1),
            softcap: None,
            scale: None,
            alibi: Alibi::None,
            layout: Layout::Contiguous,
            dist: Dist::Uniform,
            seed: 0,
        }
    }
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} b={} sq={} sk={} h={}/{} d={} causal={} window={:?} softcap={:?} scale={:?} alibi={:?} \
             layout={:?} dist={:?} seed={}",
            self.dtype,
            self.batch,
            self.seqlen_q,
            self.seqlen_k,
            self.heads,
            self.heads_kv,
            self.head_dim,
            self.causal,
            self.window,
            self.softcap,
            self.scale,
            self.alibi,
            self.layout,
            self.dist,
            self.seed
        )
    }
}

impl Case {
    /// Work of the f64 reference: multiply-adds of Q·Kᵀ (P·V costs the same again).
    pub fn cost(&self) -> usize {
        self.batch * self.heads * self.seqlen_q * self.seqlen_k * self.head_dim
    }

    pub fn effective_scale(&self) -> f64 {
        self.scale
            .map_or(1.0 / (self.head_dim as f64).sqrt(), |s| s as f64)
    }

    pub fn build(&self) -> Inputs {
        let mut rng = rng(self.seed);
        let (b, sq, sk, h, hkv, d) = (
            self.batch,
            self.seqlen_q,
            self.seqlen_k,
            self.heads,
            self.heads_kv,
            self.head_dim,
        );
        let (pq, pk, pv, n_bufs) = batched_placements(self.layout, &mut rng, b, sq, sk, h, hkv, d);
        let mut q = values(&mut rng, b * sq * h * d, self.dist);
        let mut k = values(&mut rng, b * sk * hkv * d, self.dist);
        let v = values(&mut rng, b * sk * hkv * d, Dist::Uniform);
        if let Dist::Huge(target) = self.dist {
            // Scaled score std = scale · c² · sqrt(d) / 3 for U(-1, 1) entries times c.
            let scale = self.effective_scale().abs().max(1e-3);
            let c = (3.0 * target / (scale * (d as f64).sqrt())).sqrt();
            q.iter_mut().chain(k.iter_mut()).for_each(|x| *x *= c);
        }
        let bufs = materialize(&[(&pq, &q), (&pk, &k), (&pv, &v)], self.dtype, n_bufs);
        let alibi = match self.alibi {
            Alibi::None => None,
            Alibi::PerHead => Some((
                vec![h],
                (0..h).map(|_| rng.gen_range(0.01f32..0.5)).collect(),
            )),
            Alibi::PerBatchHead => Some((
                vec![b, h],
                (0..b * h).map(|_| rng.gen_range(0.01f32..0.5)).collect(),
            )),
        };
        Inputs {
            bufs,
            q: pq,
            k: pk,
            v: pv,
            alibi,
            case: self.clone(),
        }
    }
}

/// The materialised inputs of a [`Case`].
pub struct Inputs {
    pub bufs: Vec<Buffer>,
    pub q: Placement,
    pub k: Placement,
    pub v: Placement,
    /// (shape, slopes) of the ALiBi slopes.
    pub alibi: Option<(Vec<usize>, Vec<f32>)>,
    pub case: Case,
}

impl Inputs {
    /// The values of v as stored (rounded to the dtype), in logical order.
    pub fn v_values(&self) -> Vec<f64> {
        let all = Tensor::from_buffer(
            self.bufs[self.v.buf].clone(),
            &[self.bufs[self.v.buf].as_slice().len()],
        )
        .expect("1-d")
        .to_f64_vec();
        self.v.indices().into_iter().map(|i| all[i]).collect()
    }

    pub fn views(&self) -> (TensorRef<'_>, TensorRef<'_>, TensorRef<'_>) {
        (
            view(&self.bufs, &self.q),
            view(&self.bufs, &self.k),
            view(&self.bufs, &self.v),
        )
    }

    pub fn opts(&self) -> AttnOptions<'_> {
        let c = &self.case;
        let mut o = AttnOptions::default()
            .causal(c.causal)
            .window(c.window.0, c.window.1);
        o.softcap = c.softcap;
        o.softmax_scale = c.scale;
        if let Some((shape, slopes)) = &self.alibi {
            o = o.alibi_slopes(TensorRef::contiguous(slopes, shape));
        }
        o
    }

    pub fn flash(&self) -> AttnOutput {
        let (q, k, v) = self.views();
        flashattn::flash_attn(&q, &k, &v, &self.opts())
            .unwrap_or_else(|e| panic!("{}: flash_attn: {e}", self.case))
    }

    pub fn naive(&self) -> AttnOutput {
        let (q, k, v) = self.views();
        flashattn::naive::attention(&q, &k, &v, &self.opts())
            .unwrap_or_else(|e| panic!("{}: naive: {e}", self.case))
    }

    pub fn reference(&self) -> Reference {
        let (q, k, v) = self.views();
        flashattn::reference::attention(&q, &k, &v, &self.opts())
            .unwrap_or_else(|e| panic!("{}: reference: {e}", self.case))
    }

    /// `flash`, a call on these inputs with `opts` (the case's plus, e.g., learnable sinks),
    /// against the f64 reference with [`check_bound`], naive in both dot-product orders as the
    /// yardstick.
    pub fn check_with(&self, flash: &AttnOutput, what: &str, opts: &AttnOptions) -> Errors {
        let (q, k, v) = self.views();
        let order = flashattn::naive::DotOrder::Sequential;
        let naives = [
            flashattn::naive::attention(&q, &k, &v, opts).unwrap(),
            flashattn::naive::attention_with_order(&q, &k, &v, opts, order).unwrap(),
        ];
        let r = flashattn::reference::attention(&q, &k, &v, opts).unwrap();
        let v_max = self.v_values().iter().fold(0f64, |m, x| m.max(x.abs()));
        let what = format!("{} {what}", self.case);
        check_bound(
            &what,
            self.case.dtype,
            flash,
            &naives,
            &r,
            v_max,
            self.case.seqlen_k,
        )
    }

    /// Naive attention with the scores' dot products summed sequentially (as BLAS does).
    pub fn naive_sequential(&self) -> AttnOutput {
        let (q, k, v) = self.views();
        let order = flashattn::naive::DotOrder::Sequential;
        flashattn::naive::attention_with_order(&q, &k, &v, &self.opts(), order)
            .unwrap_or_else(|e| panic!("{}: naive: {e}", self.case))
    }

    /// Runs naive (both dot-product orders) and the reference once, and flash on every instruction
    /// set this CPU runs (the scalar twin included), and checks the error bound for each; returns
    /// the errors of the default instruction set.
    pub fn check(&self) -> Errors {
        let naive = [self.naive(), self.naive_sequential()];
        let reference = self.reference();
        let v_max = self.v_values().iter().fold(0f64, |m, x| m.max(x.abs()));
        let mut default = None;
        for isa in flashattn::simd::available() {
            let (q, k, v) = self.views();
            let flash = flashattn::flash_attn(&q, &k, &v, &self.opts().isa(isa))
                .unwrap_or_else(|e| panic!("{}: flash_attn ({isa}): {e}", self.case));
            let e = check_bound(
                &format!("{} isa={isa}", self.case),
                self.case.dtype,
                &flash,
                &naive,
                &reference,
                v_max,
                self.case.seqlen_k,
            );
            if isa == flashattn::simd::detected() {
                default = Some(e);
            }
        }
        default.expect("the detected ISA is available")
    }
}
