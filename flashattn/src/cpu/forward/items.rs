//! The forward's work items (sequence, head, query block) and the key blocks they visit.

use crate::blocks::Mask;
use crate::cpu::simd::Isa;
use crate::cpu::BlockSizes;
use crate::params::Params;

/// How many times each key block is visited on average (by the query blocks of a head and the
/// heads of a GQA group), rounded down: at [`pack_visits_f32`] or [`PACK_VISITS_WIDENED`] visits
/// packing k and v once per call beats copying each tile at every visit.
///
/// Packing costs a pass over k and v into fresh memory (its page faults included), while per-visit
/// copies of f32 rows are cheap as long as k and v stay in the caches: f32, d = 128, 16 heads,
/// 2 threads (2026-11-24), packing was 4-10% faster at N = 2048-8192 without a mask (16-64
/// visits) and up to 20% slower at N = 512 or causal N = 2048 (4-9 visits), hence 16 for f32
/// inputs then (see [`pack_visits_f32`] now). Copies of bf16 or f16 rows also widen every element
/// at every visit (and a head's rows 4 KiB apart, as bf16 d = 128 with 16 heads, do not stay in
/// L2), so for them packing, which widens once, pays from 2 visits ([`PACK_VISITS_WIDENED`]):
/// AVX2 bf16 d = 128, 16 heads, 2 threads, alternating runs on a loaded host (2026-11-29), packed
/// against copied took 0.71-0.89 of the time at N = 1024 (11 visits) and 0.73-0.90 causal (~6
/// visits).
pub(super) fn key_block_visits(p: &Params, items: &[WorkItem], bs: BlockSizes) -> usize {
    let visits: usize = items.iter().map(|it| key_blocks(p, it, bs)).sum();
    let tiles: usize = p
        .seqs
        .iter()
        .map(|s| s.seqlen_k.div_ceil(bs.block_n))
        .sum::<usize>()
        * p.heads_kv;
    visits / tiles.max(1)
}

/// [`key_block_visits`]'s threshold for tiles copied without conversion. Since packed tiles are
/// kept from one call to the next (`cpu::reuse`: no page faults), packing pays from fewer visits
/// on x86, whose products prefetch the packed tiles as they arrive from L3 (AVX2's every operand,
/// AVX-512's score product its next rows of k): per-process CPU time, alternating, loaded host,
/// 16 heads, packing from 8 visits instead of 16 took 0.87-0.93 of the time on AVX2 at N = 1024
/// d = 64 and 128 and causal N = 2048 d = 128 (2 threads; 8-10 visits), and on AVX-512 0.95 and
/// 0.88 at N = 1024 d = 128 and 64, 0.99 causal N = 2048 d = 128 (medians of 4 pairs). At N = 1024
/// the per-visit copies from k's and v's rows, a 4 KiB page apart, were 15-18% of the samples.
/// From 4 visits now: against 8, AVX2 took 0.92-0.95 of the CPU time at causal N = 1024 d = 64 and
/// 128, N = 512 d = 128 and causal N = 512 d = 64 (4-6 visits), AVX-512 0.92-0.98 at causal
/// N = 1024 d = 64 and 128 and N = 512 d = 128 (2 threads, medians of 3 pairs). The copies' cost
/// is each row's first read from a new page (prefetching the rows a tile ahead moved it into the
/// prefetches).
pub(super) fn pack_visits_f32(isa: Isa) -> usize {
    match isa {
        Isa::Avx2 | Isa::Avx512 => 4,
        _ => 16,
    }
}
/// [`key_block_visits`]'s threshold for tiles widened from bf16 or f16.
pub(super) const PACK_VISITS_WIDENED: usize = 2;

/// One (sequence, head, query block) work item.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WorkItem {
    pub b: usize,
    pub h: usize,
    pub m_block: usize,
}

/// All work items, in (sequence, head, query block) order.
pub(crate) fn work_items(p: &Params, block_m: usize) -> Vec<WorkItem> {
    let mut items = Vec::new();
    for (b, s) in p.seqs.iter().enumerate() {
        for h in 0..p.heads {
            items.extend((0..s.seqlen_q.div_ceil(block_m)).map(|m_block| WorkItem {
                b,
                h,
                m_block,
            }));
        }
    }
    items
}

/// Number of key blocks a work item visits.
pub(crate) fn key_blocks(p: &Params, it: &WorkItem, bs: BlockSizes) -> usize {
    let s = p.seqs[it.b];
    let mask = Mask::new(s.seqlen_q, s.seqlen_k, p.window_left, p.window_right);
    let m0 = it.m_block * bs.block_m;
    let (lo, hi) = mask.n_block_range(m0, (m0 + bs.block_m).min(s.seqlen_q), bs.block_n);
    hi.saturating_sub(lo)
}
