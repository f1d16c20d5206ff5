//! The one FLOP model of benchmarks and the CLI: forward `4 · head_dim · heads · (visible
//! (query, key) pairs)`, summed over the batch (so causal counts about half the pairs, a window
//! fewer still); backward 2.5x forward. Two GEMMs of 2 FLOPs per multiply-add, softmax not counted.

use crate::blocks::Mask;

/// Visible (query, key) pairs of one sequence under a window (`None` = unbounded side).
pub fn visible_pairs(
    seqlen_q: usize,
    seqlen_k: usize,
    window_left: Option<usize>,
    window_right: Option<usize>,
) -> u64 {
    let m = Mask::new(seqlen_q, seqlen_k, window_left, window_right);
    (0..seqlen_q)
        .map(|i| {
            let (lo, hi) = m.key_range(i);
            hi.saturating_sub(lo) as u64
        })
        .sum()
}

/// Forward FLOPs of a batched call. `causal` overrides `window_right` with 0.
pub fn forward(
    batch: usize,
    heads: usize,
    seqlen_q: usize,
    seqlen_k: usize,
    head_dim: usize,
    causal: bool,
    window: (i64, i64),
) -> f64 {
    let side = |w: i64| (w >= 0).then_some(w as usize);
    let right = if causal { Some(0) } else { side(window.1) };
    let pairs = visible_pairs(seqlen_q, seqlen_k, side(window.0), right);
    4.0 * batch as f64 * heads as f64 * head_dim as f64 * pairs as f64
}

/// Backward FLOPs: 2.5x the forward (five GEMMs instead of two).
pub fn backward(forward_flops: f64) -> f64 {
    2.5 * forward_flops
}

#[cfg(test)]
mod tests {
    #[test]
    fn causal_square_counts_the_lower_triangle() {
        assert_eq!(super::visible_pairs(4, 4, None, Some(0)), 10);
        assert_eq!(super::visible_pairs(4, 4, None, None), 16);
        assert_eq!(
            super::forward(2, 3, 4, 4, 8, true, (-1, -1)),
            4.0 * 2.0 * 3.0 * 8.0 * 10.0
        );
    }
}
