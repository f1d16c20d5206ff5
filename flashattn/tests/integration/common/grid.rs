//! The forward grid: every value of every dimension with each dtype (the others drawn at random
//! within a cost budget), plus random cases. Shared by the CPU forward tests and the GPU tests,
//! which run the same cases.

use super::*;
use flashattn::DType;
use rand::Rng;

// ---------------------------------------------------------------------------------------------
// The grid
// ---------------------------------------------------------------------------------------------

pub const HEAD_DIMS: [usize; 8] = [1, 8, 40, 59, 64, 111, 128, 256];
pub const SEQLENS: [(usize, usize); 11] = [
    (1, 1),
    (1, 1023),
    (63, 63),
    (113, 203),
    (203, 113),
    (64, 65),
    (1023, 1023),
    (65, 64),
    (1, 64),
    (128, 128),
    (17, 300),
];
pub const HEADS: [(usize, usize); 6] = [(1, 1), (3, 3), (6, 2), (8, 2), (4, 1), (2, 1)];
/// (causal, window).
pub const MASKS: [(bool, (i64, i64)); 12] = [
    (false, (-1, -1)),
    (true, (-1, -1)),
    (false, (0, 0)),
    (false, (-1, 0)),
    (false, (0, -1)),
    (false, (5, -1)),
    (false, (-1, 7)),
    (false, (16, 3)),
    (false, (70, 0)),
    (true, (10, -1)),
    (true, (33, 8)),
    (false, (5000, 5000)),
];
pub const SOFTCAPS: [Option<f32>; 3] = [None, Some(30.0), Some(2.5)];
pub const SCALES: [Option<f32>; 5] = [None, Some(0.5), Some(2.0), Some(-0.7), Some(0.0)];
pub const ALIBIS: [Alibi; 3] = [Alibi::None, Alibi::PerHead, Alibi::PerBatchHead];
pub const BATCHES: [usize; 3] = [1, 2, 3];
/// Dist::Huge's target is set per dtype (see `huge`).
pub const DISTS: [Dist; 3] = [Dist::Uniform, Dist::Normal, Dist::Huge(0.0)];

/// Reference work (`Case::cost`) allowed for one grid case (~0.5 s of f64 reference on one core at
/// most; the whole grid, 3 x 119 cases, runs in ~15 s on 2 cores).
pub const BUDGET: usize = 150_000_000;
/// Random cases per dtype on top of the covering ones.
pub const RANDOM_CASES: usize = 60;

/// Standard deviation of the scaled scores for `Dist::Huge`: ~1e3 (extremes ~4e3) in f32/bf16. f16
/// tops out at 65504 and the naive yardstick rounds the raw dot product (before scaling) to f16, so
/// there the target keeps `|dot| = |score| / scale` well inside the range.
pub fn huge(dtype: DType, scale: f64) -> Dist {
    match dtype {
        DType::F16 => Dist::Huge((1e3 * scale.abs()).min(300.0)),
        _ => Dist::Huge(1000.0),
    }
}

/// The dimensions of the grid; a case fixes one value of one dimension and draws the others.
#[derive(Clone, Copy, Debug)]
pub enum Axis {
    HeadDim,
    Seqlens,
    Heads,
    Mask,
    Softcap,
    Scale,
    Alibi,
    Batch,
    Layout,
    Dist,
}

impl Axis {
    pub const ALL: [Axis; 10] = [
        Axis::HeadDim,
        Axis::Seqlens,
        Axis::Heads,
        Axis::Mask,
        Axis::Softcap,
        Axis::Scale,
        Axis::Alibi,
        Axis::Batch,
        Axis::Layout,
        Axis::Dist,
    ];
    pub fn len(self) -> usize {
        match self {
            Axis::HeadDim => HEAD_DIMS.len(),
            Axis::Seqlens => SEQLENS.len(),
            Axis::Heads => HEADS.len(),
            Axis::Mask => MASKS.len(),
            Axis::Softcap => SOFTCAPS.len(),
            Axis::Scale => SCALES.len(),
            Axis::Alibi => ALIBIS.len(),
            Axis::Batch => BATCHES.len(),
            Axis::Layout => LAYOUTS.len(),
            Axis::Dist => DISTS.len(),
        }
    }
    pub fn set(self, c: &mut Case, i: usize) {
        match self {
            Axis::HeadDim => c.head_dim = HEAD_DIMS[i],
            Axis::Seqlens => (c.seqlen_q, c.seqlen_k) = SEQLENS[i],
            Axis::Heads => (c.heads, c.heads_kv) = HEADS[i],
            Axis::Mask => (c.causal, c.window) = MASKS[i],
            Axis::Softcap => c.softcap = SOFTCAPS[i],
            Axis::Scale => c.scale = SCALES[i],
            Axis::Alibi => c.alibi = ALIBIS[i],
            Axis::Batch => c.batch = BATCHES[i],
            Axis::Layout => c.layout = LAYOUTS[i],
            Axis::Dist => c.dist = DISTS[i],
        }
    }
}

/// A case with every dimension drawn at random except `fixed`; redrawn until it fits the budget
/// (with the fixed value alone too costly, the budget grows to twice its minimum).
pub fn draw(
    rng: &mut rand_chacha::ChaCha8Rng,
    dtype: DType,
    fixed: Option<(Axis, usize)>,
    seed: u64,
) -> Case {
    let min_cost = {
        let mut c = Case {
            batch: 1,
            seqlen_q: 1,
            seqlen_k: 1,
            heads: 1,
            heads_kv: 1,
            head_dim: 1,
            ..Case::default()
        };
        if let Some((dim, i)) = fixed {
            dim.set(&mut c, i);
        }
        c.cost()
    };
    let budget = BUDGET.max(2 * min_cost);
    loop {
        let mut c = Case {
            dtype,
            seed,
            ..Case::default()
        };
        for dim in Axis::ALL {
            let i = rng.gen_range(0..dim.len());
            dim.set(&mut c, i);
        }
        if let Some((dim, i)) = fixed {
            dim.set(&mut c, i);
        }
        if let Dist::Huge(_) = c.dist {
            c.dist = huge(dtype, c.effective_scale());
        }
        if c.cost() <= budget {
            return c;
        }
    }
}

/// Every value of every dimension once with each dtype (others random), plus random cases.
pub fn grid(dtype: DType) -> Vec<Case> {
    let mut rng = rng(0xF1A5 + dtype as u64);
    let mut cases = Vec::new();
    let mut seed = 1000 * dtype as u64;
    for dim in Axis::ALL {
        for i in 0..dim.len() {
            seed += 1;
            cases.push(draw(&mut rng, dtype, Some((dim, i)), seed));
        }
    }
    for _ in 0..RANDOM_CASES {
        seed += 1;
        cases.push(draw(&mut rng, dtype, None, seed));
    }
    cases
}
