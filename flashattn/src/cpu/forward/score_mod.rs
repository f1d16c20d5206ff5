//! The score modifiers of a (sequence, head): scale, softcap, ALiBi and a custom score function,
//! and the mask.

use crate::blocks::Mask;
use crate::cpu::tanh::tanh;
use crate::params::{Params, LOG2_E};
use crate::score_fn::{ScoreFn, ScoreStrip};

/// Scores a custom function is handed at a time under softcap (a stack buffer holds their
/// derivatives, multiplied into `1 - tanh²`).
const STRIP: usize = 64;

/// A custom score function with what it needs in the natural-log domain.
#[derive(Clone, Copy, Debug)]
struct User<'p> {
    f: &'p ScoreFn,
    /// (sequence, head) of the strips.
    bh: (usize, usize),
    scale: f32,
    softcap: Option<f32>,
    slope: Option<f32>,
}

/// Scale, softcap and ALiBi, folded for the log2 domain, and a custom score function.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ScoreMod<'p> {
    /// softmax_scale · log2(e): without softcap, one multiply takes a raw dot product to the log2 domain.
    pub scale_log2: f32,
    /// (softmax_scale / softcap, softcap · log2(e)).
    softcap: Option<(f32, f32)>,
    /// slope · log2(e).
    alibi_log2: Option<f32>,
    user: Option<User<'p>>,
}

impl<'p> ScoreMod<'p> {
    pub fn new(p: &'p Params, b: usize, h: usize) -> Self {
        let scale = p.score_scale(b, h);
        ScoreMod {
            scale_log2: scale * LOG2_E,
            softcap: p.softcap.map(|c| (scale / c, c * LOG2_E)),
            alibi_log2: p.alibi_slope(b, h).map(|s| s * LOG2_E),
            user: p.score_fn.as_ref().map(|f| User {
                f,
                bh: (b, h),
                scale,
                softcap: p.softcap,
                slope: p.alibi_slope(b, h),
            }),
        }
    }

    /// Whether a block needs [`ScoreMod::apply`] rather than a plain multiply by `scale_log2`.
    pub fn needs_apply(&self, masked: bool) -> bool {
        masked || self.softcap.is_some() || self.alibi_log2.is_some() || self.user.is_some()
    }

    /// Whether a masked block can take [`ScoreMod::mask_raw`] and leave the scale to the softmax
    /// kernel: no softcap or ALiBi, and a finite positive `scale_log2` (then `-inf · scale` stays
    /// -inf and the kernel's `max(s) · scale` is exact).
    pub fn mask_only(&self) -> bool {
        self.softcap.is_none()
            && self.alibi_log2.is_none()
            && self.user.is_none()
            && self.scale_log2 > 0.0
            && self.scale_log2.is_finite()
    }

    /// Sets the scores that `mask` hides in the block of keys `n0..n0 + cols` (rows of `st`) ×
    /// query rows `m0..m0 + rows` (lanes) to -inf, leaving the others raw: the mask alone of
    /// [`ScoreMod::apply`], key by key. Both ends of a row's visible keys grow with the row
    /// (`blocks`), so each key's visible rows are one run of lanes `a..b`, found by two cursors
    /// that only move forward; the rest of its lanes are filled, contiguously.
    pub fn mask_raw(
        st: &mut [f32],
        np: usize,
        (m0, rows): (usize, usize),
        (n0, cols): (usize, usize),
        mask: &Mask,
    ) {
        // a: the first row whose visible keys end after `key`; b: the first row whose start
        // after it.
        let (mut a, mut b) = (0, 0);
        for c in 0..cols {
            let key = n0 + c;
            while a < rows && mask.key_range(m0 + a).1 <= key {
                a += 1;
            }
            while b < rows && mask.key_range(m0 + b).0 <= key {
                b += 1;
            }
            let row = &mut st[c * np..c * np + rows];
            row[..a].fill(f32::NEG_INFINITY);
            row[b.max(a)..].fill(f32::NEG_INFINITY);
        }
    }

    /// Raw dot products of keys `n0..n0 + cols` (rows of `st`) x query rows `m0..m0 + rows`
    /// (lanes, `np` per key) -> log2-domain scores, masked to -inf where `masked` says the mask
    /// cuts this block. With softcap, `dtanh` (if given, same layout as `st`) receives the
    /// derivative `1 - tanh²` that the backward pass needs, from the same `tanh`. With a custom
    /// score function, `dtanh` receives the whole derivative `d(score)/d(scaled product)`:
    /// `f'` times `1 - tanh²` under softcap.
    #[allow(clippy::too_many_arguments)]
    pub fn apply(
        &self,
        st: &mut [f32],
        np: usize,
        (m0, rows): (usize, usize),
        (n0, cols): (usize, usize),
        mask: &Mask,
        masked: bool,
        mut dtanh: Option<&mut [f32]>,
    ) {
        if let Some(u) = &self.user {
            for c in 0..cols {
                let dt = dtanh.as_deref_mut().map(|d| &mut d[c * np..c * np + rows]);
                u.column(&mut st[c * np..c * np + rows], dt, (m0, n0 + c), mask);
            }
        } else {
            self.builtin(st, np, (m0, rows), (n0, cols), mask, dtanh);
        }
        if masked {
            for r in 0..rows {
                let (lo, hi) = mask.key_range(m0 + r);
                for c in 0..cols {
                    if !(lo..hi).contains(&(n0 + c)) {
                        st[c * np + r] = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }

    /// [`ScoreMod::apply`] without a custom function: scale (or softcap) and ALiBi folded for
    /// the log2 domain.
    fn builtin(
        &self,
        st: &mut [f32],
        np: usize,
        (m0, rows): (usize, usize),
        (n0, cols): (usize, usize),
        mask: &Mask,
        mut dtanh: Option<&mut [f32]>,
    ) {
        for c in 0..cols {
            let row = &mut st[c * np..c * np + rows];
            match (self.softcap, dtanh.as_deref_mut()) {
                (None, _) => row.iter_mut().for_each(|x| *x *= self.scale_log2),
                (Some((pre, post)), None) => {
                    row.iter_mut().for_each(|x| *x = post * tanh(*x * pre))
                }
                (Some((pre, post)), Some(dt)) => {
                    for (x, t) in row.iter_mut().zip(&mut dt[c * np..c * np + rows]) {
                        let th = tanh(*x * pre);
                        *t = 1.0 - th * th;
                        *x = post * th;
                    }
                }
            }
            if let Some(slope) = self.alibi_log2 {
                for (r, x) in row.iter_mut().enumerate() {
                    *x -= slope * mask.diagonal_distance(m0 + r, n0 + c).unsigned_abs() as f32;
                }
            }
        }
    }
}

impl User<'_> {
    /// Raw dot products of key `k` with query rows `m0..m0 + row.len()` -> log2-domain scores:
    /// `f(softcap(scale · x) - alibi) · log2(e)` (each step that is set); `dt`, if given,
    /// receives the derivative of the function's result with respect to `scale · x`.
    fn column(
        &self,
        row: &mut [f32],
        mut dt: Option<&mut [f32]>,
        (m0, k): (usize, usize),
        mask: &Mask,
    ) {
        match self.softcap {
            None => row.iter_mut().for_each(|x| *x *= self.scale),
            Some(cap) => {
                let pre = self.scale / cap;
                for (r, x) in row.iter_mut().enumerate() {
                    let th = tanh(*x * pre);
                    *x = cap * th;
                    if let Some(d) = dt.as_deref_mut() {
                        d[r] = 1.0 - th * th;
                    }
                }
            }
        }
        if let Some(slope) = self.slope {
            for (r, x) in row.iter_mut().enumerate() {
                *x -= slope * mask.diagonal_distance(m0 + r, k).unsigned_abs() as f32;
            }
        }
        let at = |q0| ScoreStrip {
            batch: self.bh.0,
            head: self.bh.1,
            q0,
            k,
        };
        match (dt, self.softcap) {
            // One call for the whole strip where no derivative is to be combined.
            (None, _) => self.f.apply(at(m0), row, None),
            (Some(d), None) => self.f.apply(at(m0), row, Some(d)),
            (Some(d), Some(_)) => {
                let mut grad = [0f32; STRIP];
                for (i, (chunk, d)) in row.chunks_mut(STRIP).zip(d.chunks_mut(STRIP)).enumerate() {
                    let g = &mut grad[..chunk.len()];
                    self.f.apply(at(m0 + i * STRIP), chunk, Some(g));
                    d.iter_mut().zip(g.iter()).for_each(|(d, g)| *d *= g);
                }
            }
        }
        row.iter_mut().for_each(|x| *x *= LOG2_E);
    }
}
