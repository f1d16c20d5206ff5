//! The backward's two paths for bf16 inputs on a CPU with a bf16 dot product, each forced through
//! `FLASHATTN_BWD_BF16`: `dot` (`vdpbf16ps` products, P̃ and dS rounded to bf16) and `f32` (the
//! inputs widened to f32 tiles), over the whole gradient grid and packed sequences. The variable
//! is read on every call, so this binary holds one test that sets it in turn (tests of one binary
//! run in parallel and would see each other's value). Where the CPU has no bf16 dot product both
//! settings run the f32 products.

#[path = "integration/common/mod.rs"]
mod common;

use common::backward::{grid, varlen_case};
use half::bf16;

#[test]
fn both_bf16_backward_paths_match_the_reference() {
    for path in ["dot", "f32"] {
        std::env::set_var("FLASHATTN_BWD_BF16", path);
        grid::<bf16>();
        varlen_case::<bf16>();
    }
    std::env::remove_var("FLASHATTN_BWD_BF16");
}
