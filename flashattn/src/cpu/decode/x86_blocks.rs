//! Pieces shared by the AVX-512 kernels: the dispatch from a runtime block shape to a kernel
//! instantiated for it (`by_tile!`), the block walk of the score kernels (`score_blocks!`),
//! and the 16-element load [`load16`].

use crate::tensor::{DType, Element};

/// Calls `$body` with `A`, `B` bound as constants to `$a`, `$b` (each 1-4; 4 for anything
/// larger, 1 for anything smaller): the dispatch from a runtime block shape to a kernel
/// instantiated for it. Callers whose blocks stay smaller (AVX2: 2 keys, 3 vectors; bf16 P·V: 2
/// chunks) also instantiate shapes they never run.
macro_rules! by_tile {
    ($a:expr, $b:expr, |$A:ident, $B:ident| $body:expr) => {{
        macro_rules! with_b {
            ($av:literal) => {{
                const $A: usize = $av;
                match $b {
                    4.. => {
                        const $B: usize = 4;
                        $body
                    }
                    3 => {
                        const $B: usize = 3;
                        $body
                    }
                    2 => {
                        const $B: usize = 2;
                        $body
                    }
                    _ => {
                        const $B: usize = 1;
                        $body
                    }
                }
            }};
        }
        match $a {
            4.. => with_b!(4),
            3 => with_b!(3),
            2 => with_b!(2),
            _ => with_b!(1),
        }
    }};
}

/// The block walk of the score kernels: keys in blocks of up to `$keys` (stepping `ahead` once
/// per block), and within each, `$units` (query rows, or vectors of rows) in blocks of up to 4;
/// `$body` runs per block with its first key, first unit and the two sizes.
macro_rules! score_blocks {
    (
        ($kr:expr, $keys:expr), $units:expr, $ahead:expr,
        |$c0:ident, $u0:ident, $kb:ident, $ub:ident| $body:block
    ) => {{
        let units = $units;
        let mut $c0 = 0;
        while $c0 < $kr.cols() {
            let $kb = ($kr.cols() - $c0).min($keys);
            $ahead.step($kb);
            let mut $u0 = 0;
            while $u0 < units {
                let $ub = (units - $u0).min(4);
                $body
                $u0 += $ub;
            }
            $c0 += $kb;
        }
    }};
}

/// 16 elements at `p` as f32: a load (f32), `vcvtph2ps` (f16), or zero-extension and a shift
/// into the high half (bf16, exact).
///
/// # Safety
/// AVX-512F present; 16 elements readable at `p`.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn load16<T: Element>(p: *const T) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract.
    unsafe {
        match T::DTYPE {
            DType::F32 => _mm512_loadu_ps(p.cast::<f32>()),
            DType::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
            DType::BF16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(p.cast()),
            ))),
        }
    }
}
