//! Work-tile scheduling of the warp-specialised sm_90a forward (kernels/fwd_sm90_ws.cu): its grid
//! is one-dimensional, and each CTA loops over work tiles, one (query block, head, sequence) each.
//! The kernel numbers the tiles heaviest first under a causal or window mask (the last query blocks
//! see the most keys) and hands them out in rounds of one tile per CTA (`Tiles::take`).
//!
//! Two launches of the same kernel: one CTA per tile (each runs one iteration), or persistent
//! (FlashAttention-3's scheduler): as many CTAs as the GPU holds at once, SMs × CTAs per SM, each
//! taking a tile per round, so that the short causal tiles fill the gaps the long ones leave at
//! the end instead of waiting for a free SM, and a CTA's set-up (barriers, register reallocation)
//! is paid once per SM. `FLASHATTN_SM90_PERSISTENT=0` keeps one CTA per tile, to measure the gain.
//!
//! The rounds are static: CTA c takes tiles c, 2g - 1 - c, 2g + c, ... of a grid of g, whatever
//! the tiles cost. `FLASHATTN_SM90_SCHEDULER=dynamic` (FlashAttention-3's dynamic persistent
//! scheduler) makes each CTA's producer take its next tile with one atomicAdd on a counter of the
//! launch instead, so a CTA that finished early takes the next tile in line. The counter is one
//! int per launch, zeroed by the host on the launch's stream before it (cudarc's `alloc_zeros`:
//! an async allocation and a memset): a scheme with no memset (the CTA that takes the last tile
//! resets it) needs a counter shared by the launches of a stream and trusts every launch to run
//! to its end, while a launch's own counter cannot be raced by a concurrent launch on another
//! stream. Static stays the default until the dynamic one has run on a GPU.

/// CTAs of fwd_sm90_ws.cu one SM holds: 1. Its launch bounds (384 threads, one CTA per SM) give
/// 168 registers each at entry, which fill the SM's 64 Ki-register file (384 × 168 = 64512).
pub const WS_CTAS_PER_SM: usize = 1;

/// The one-dimensional grid of one CTA per work tile, from the (query blocks, heads, launched
/// sequences) grid of the other forward kernels.
pub(crate) fn tile_grid(grid: (u32, u32, u32)) -> (u32, u32, u32) {
    let tiles = grid.0 as u64 * grid.1 as u64 * grid.2 as u64;
    // MAX_SEQLEN (launch.rs) and the 65535 heads and sequences keep this far below 2^31.
    (u32::try_from(tiles).expect("tile count fits a grid"), 1, 1)
}

/// The persistent form of a [`tile_grid`]: at most `ctas` CTAs (at least 1), never more than
/// there are tiles.
pub(crate) fn persistent_grid(grid: (u32, u32, u32), ctas: usize) -> (u32, u32, u32) {
    let ctas = u32::try_from(ctas.max(1)).unwrap_or(u32::MAX);
    (grid.0.min(ctas), grid.1, grid.2)
}

/// The CTA count of a persistent launch on a GPU of `sm_count` SMs, or `None` for one CTA per
/// tile: persistent unless `FLASHATTN_SM90_PERSISTENT=0` (read once per process).
pub(crate) fn persistent_ctas(sm_count: usize) -> Option<usize> {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("FLASHATTN_SM90_PERSISTENT").as_deref() != Ok("0"));
    on.then_some(sm_count * WS_CTAS_PER_SM)
}

/// Whether the warp-specialised forward takes its tiles from a counter (the dynamic scheduler):
/// `FLASHATTN_SM90_SCHEDULER=dynamic`; static rounds otherwise (read once per process).
pub(crate) fn dynamic_tiles() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("FLASHATTN_SM90_SCHEDULER").as_deref() == Ok("dynamic"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grids() {
        assert_eq!(tile_grid((3, 4, 5)), (60, 1, 1));
        assert_eq!(tile_grid((0, 4, 5)), (0, 1, 1));
        assert_eq!(persistent_grid((60, 1, 1), 132), (60, 1, 1));
        assert_eq!(persistent_grid((600, 1, 1), 132), (132, 1, 1));
        assert_eq!(persistent_grid((600, 1, 1), 0), (1, 1, 1));
        assert_eq!(persistent_grid((0, 1, 1), 132), (0, 1, 1));
    }
}
