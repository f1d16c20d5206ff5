//! Custom score functions (FlexAttention's `score_mod`): `f(score, batch, head, q, k) -> score`
//! applied to each scaled score before the softmax, with its derivative for the backward.
//!
//! The kernels hold scores key-major (one key, a run of query rows, contiguous), so a function
//! is handed a strip of one key and consecutive query rows at a time ([`ScoreStrip`]): an
//! implementation can loop over it as over a slice, or vectorise. [`ScoreFn::from_fns`] builds
//! one from two per-element closures (value and derivative); [`crate::score_expr::ScoreExpr`] is
//! an expression program evaluated in f64 (what the Python package traces a callable into).

use std::fmt;
use std::sync::Arc;

use crate::block_mask::MaskIndex;

/// Where a strip of scores sits: sequence `batch` (the packed call's sequence index), query head
/// `head`, key `k` and query rows `q0..q0 + len` (the slice's length), counted within the
/// sequence as [`MaskIndex`] counts them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScoreStrip {
    pub batch: usize,
    pub head: usize,
    pub q0: usize,
    pub k: usize,
}

impl ScoreStrip {
    /// The index of element `r` of the strip.
    #[inline]
    pub fn index(&self, r: usize) -> MaskIndex {
        MaskIndex {
            batch: self.batch,
            head: self.head,
            q: self.q0 + r,
            k: self.k,
        }
    }
}

/// The strip of the one score at `at`.
impl From<MaskIndex> for ScoreStrip {
    fn from(at: MaskIndex) -> Self {
        ScoreStrip {
            batch: at.batch,
            head: at.head,
            q0: at.q,
            k: at.k,
        }
    }
}

/// A function's value and derivative at one score.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScoreValue {
    pub value: f64,
    /// d(value)/d(score).
    pub grad: f64,
}

/// A score function: `f(score, index)` and its derivative with respect to the score. Must be
/// pure: the kernels call it from several threads, in any order, on every pair of a visited
/// tile (pairs the masks hide included: their results are then discarded), once per forward
/// and again in the backward.
pub trait ScoreFunction: Send + Sync {
    /// Replaces each `scores[r]` (query `at.q0 + r`, key `at.k`) with `f(scores[r])`; with
    /// `grad` (same length), also writes `f'` at the score it was given there.
    fn apply(&self, at: ScoreStrip, scores: &mut [f32], grad: Option<&mut [f32]>);

    /// Value and derivative of one score in f64, for the f64 reference
    /// ([`crate::reference`]). The default goes through [`ScoreFunction::apply`] in f32.
    fn eval_f64(&self, at: MaskIndex, score: f64) -> ScoreValue {
        let (mut s, mut g) = ([score as f32], [0f32]);
        self.apply(ScoreStrip::from(at), &mut s, Some(&mut g));
        ScoreValue {
            value: s[0] as f64,
            grad: g[0] as f64,
        }
    }
}

/// A custom score function on [`crate::AttnOptions::score_mod`]. Cheap to clone (shared).
#[derive(Clone)]
pub struct ScoreFn(Arc<dyn ScoreFunction>);

impl ScoreFn {
    pub fn new(f: impl ScoreFunction + 'static) -> Self {
        ScoreFn(Arc::new(f))
    }

    /// A function from two per-element closures: `value(score, index)` and its derivative
    /// `grad(score, index)` with respect to the score, both in f32.
    pub fn from_fns(
        value: impl Fn(f32, MaskIndex) -> f32 + Send + Sync + 'static,
        grad: impl Fn(f32, MaskIndex) -> f32 + Send + Sync + 'static,
    ) -> Self {
        ScoreFn::new(Closures { value, grad })
    }

    /// See [`ScoreFunction::apply`].
    #[inline]
    pub fn apply(&self, at: ScoreStrip, scores: &mut [f32], grad: Option<&mut [f32]>) {
        self.0.apply(at, scores, grad)
    }

    /// See [`ScoreFunction::eval_f64`].
    #[inline]
    pub fn eval_f64(&self, at: MaskIndex, score: f64) -> ScoreValue {
        self.0.eval_f64(at, score)
    }
}

impl fmt::Debug for ScoreFn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ScoreFn(<fn>)")
    }
}

/// [`ScoreFn::from_fns`]'s pair.
struct Closures<V, G> {
    value: V,
    grad: G,
}

impl<V, G> ScoreFunction for Closures<V, G>
where
    V: Fn(f32, MaskIndex) -> f32 + Send + Sync,
    G: Fn(f32, MaskIndex) -> f32 + Send + Sync,
{
    fn apply(&self, at: ScoreStrip, scores: &mut [f32], grad: Option<&mut [f32]>) {
        if let Some(g) = grad {
            for (r, (s, d)) in scores.iter().zip(g.iter_mut()).enumerate() {
                *d = (self.grad)(*s, at.index(r));
            }
        }
        for (r, s) in scores.iter_mut().enumerate() {
            *s = (self.value)(*s, at.index(r));
        }
    }
}
