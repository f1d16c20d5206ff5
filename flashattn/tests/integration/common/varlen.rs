//! Packed sequences (varlen) cases and their inputs.

use super::*;

/// Packed sequences of lengths `lens_q` / `lens_k`, with `extra_q` query rows after the last one.
#[derive(Clone, Debug)]
pub struct VarlenCase {
    pub dtype: DType,
    pub lens_q: Vec<usize>,
    pub lens_k: Vec<usize>,
    pub extra_q: usize,
    pub causal: bool,
    pub window: (i64, i64),
    pub heads: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    pub seed: u64,
}

/// The materialised inputs of a [`VarlenCase`].
pub struct VarlenInputs {
    pub case: VarlenCase,
    pub q: Buffer,
    pub k: Buffer,
    pub v: Buffer,
    pub v_max: f64,
    pub cu_q: Vec<i32>,
    pub cu_k: Vec<i32>,
    pub total_q: usize,
    pub total_k: usize,
}

impl VarlenCase {
    pub fn build(&self) -> VarlenInputs {
        let mut g = rng(self.seed);
        let (h, hkv, d) = (self.heads, self.heads_kv, self.head_dim);
        let total_q = self.lens_q.iter().sum::<usize>() + self.extra_q;
        let total_k = self.lens_k.iter().sum::<usize>();
        let cu = |l: &[usize]| {
            std::iter::once(0)
                .chain(l.iter().scan(0, |acc, &x| {
                    *acc += x as i32;
                    Some(*acc)
                }))
                .collect::<Vec<i32>>()
        };
        let qv = values(&mut g, total_q * h * d, Dist::Normal);
        let kv = values(&mut g, total_k * hkv * d, Dist::Normal);
        let vv = values(&mut g, total_k * hkv * d, Dist::Uniform);
        VarlenInputs {
            q: to_buffer(&qv, self.dtype),
            k: to_buffer(&kv, self.dtype),
            v: to_buffer(&vv, self.dtype),
            v_max: vv.iter().fold(0f64, |m, x| m.max(x.abs())),
            cu_q: cu(&self.lens_q),
            cu_k: cu(&self.lens_k),
            total_q,
            total_k,
            case: self.clone(),
        }
    }
}

impl VarlenInputs {
    pub fn views(&self) -> (TensorRef<'_>, TensorRef<'_>, TensorRef<'_>) {
        let (h, hkv, d) = (self.case.heads, self.case.heads_kv, self.case.head_dim);
        (
            TensorRef::from_slice(self.q.as_slice(), &[self.total_q, h, d], &[h * d, d, 1]),
            TensorRef::from_slice(self.k.as_slice(), &[self.total_k, hkv, d], &[hkv * d, d, 1]),
            TensorRef::from_slice(self.v.as_slice(), &[self.total_k, hkv, d], &[hkv * d, d, 1]),
        )
    }

    pub fn opts(&self) -> AttnOptions<'static> {
        AttnOptions::default()
            .causal(self.case.causal)
            .window(self.case.window.0, self.case.window.1)
    }

    /// Checks `flash` against the f64 reference with the naive yardstick, and the rows after the
    /// last sequence: out exactly 0, lse exactly -inf.
    pub fn check(&self, flash: &AttnOutput, backend: &str) {
        self.check_with(flash, backend, &self.opts())
    }

    /// [`Self::check`] of a call made with `opts` (the case's, plus e.g. learnable sinks, which
    /// rows after the last sequence do not get).
    pub fn check_with(&self, flash: &AttnOutput, backend: &str, opts: &AttnOptions) {
        let c = &self.case;
        let what = format!(
            "{} {backend} varlen q {:?}+{} k {:?} causal={} window={:?}",
            c.dtype, c.lens_q, c.extra_q, c.lens_k, c.causal, c.window
        );
        let (q, k, v) = self.views();
        let (cq, ck) = (&self.cu_q, &self.cu_k);
        let nv = flashattn::naive::attention_varlen(&q, &k, &v, cq, ck, opts).unwrap();
        let mut r = flashattn::reference::attention_varlen(&q, &k, &v, cq, ck, opts).unwrap();
        let (h, d, tq) = (c.heads, c.head_dim, self.total_q);
        let used = cq[c.lens_q.len()] as usize;
        // The oracle leaves lse 0.0 on rows after the last sequence (see `forward::varlen`).
        for hh in 0..h {
            r.lse[hh * tq + used..(hh + 1) * tq].fill(f64::NEG_INFINITY);
        }
        let max_keys = c.lens_k.iter().copied().max().unwrap_or(0);
        check_bound(
            &what,
            c.dtype,
            flash,
            std::slice::from_ref(&nv),
            &r,
            self.v_max,
            max_keys,
        );
        let out = flash.out.to_f64_vec();
        assert!(
            out[used * h * d..].iter().all(|&x| x == 0.0),
            "{what}: tail out"
        );
        let lse = flash.lse.to_f64_vec();
        for hh in 0..h {
            assert!(
                lse[hh * tq + used..(hh + 1) * tq]
                    .iter()
                    .all(|&x| x == f64::NEG_INFINITY),
                "{what}: tail lse"
            );
        }
    }
}

/// The learnable sink logits the CUDA sink tests use for `heads` heads: -1.25, 0.25, 1.75, ..
/// (below, near and above a row's typical LSE).
pub fn test_sinks(heads: usize) -> Vec<f32> {
    (0..heads).map(|h| 1.5 * h as f32 - 1.25).collect()
}

/// Packed batches with empty sequences, keys without queries and the reverse, rows after the last
/// sequence, causal and windowed.
#[allow(clippy::type_complexity)]
pub fn varlen_cases(
    dtype: DType,
    heads: usize,
    heads_kv: usize,
    head_dim: usize,
) -> Vec<VarlenCase> {
    let configs: [(&[usize], &[usize], usize, bool, (i64, i64)); 4] = [
        (&[5, 0, 70, 1], &[7, 9, 0, 65], 3, false, (-1, -1)),
        (&[33, 20, 0], &[20, 33, 0], 2, true, (-1, -1)),
        (&[1, 17, 64, 65], &[1, 17, 64, 65], 0, false, (9, 4)),
        (&[0, 0], &[0, 4], 4, false, (-1, -1)),
    ];
    configs
        .iter()
        .enumerate()
        .map(|(i, &(lq, lk, extra_q, causal, window))| VarlenCase {
            dtype,
            lens_q: lq.to_vec(),
            lens_k: lk.to_vec(),
            extra_q,
            causal,
            window,
            heads,
            heads_kv,
            head_dim,
            seed: 7000 + 10 * dtype as u64 + i as u64,
        })
        .collect()
}
