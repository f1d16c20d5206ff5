//! The backward's dQ strategies, each forced through `FLASHATTN_DQ_CHUNKS`: two passes (`0`) and
//! the one pass with 1 to 4 copies of dQ, over the whole gradient grid and packed sequences; a
//! bad value is a typed error. The variable is read on every call, so this binary holds one test
//! that sets it in turn (tests of one binary run in parallel and would see each other's value).

#[path = "integration/common/mod.rs"]
mod common;

use common::backward::{grid, varlen_case};
use flashattn::{flash_attn, AttnOptions, ErrorKind, TensorRef};
use half::{bf16, f16};

/// Every strategy runs the f32 grid and one 16-bit grid (the two 16-bit types share the
/// strategies' code and take turns; `FLASHATTN_TESTS_ALL=1` runs both everywhere).
#[test]
fn every_dq_strategy_matches_the_reference() {
    let all = std::env::var("FLASHATTN_TESTS_ALL").is_ok_and(|v| v == "1");
    for (i, chunks) in ["0", "1", "2", "3", "4"].into_iter().enumerate() {
        std::env::set_var("FLASHATTN_DQ_CHUNKS", chunks);
        grid::<f32>();
        varlen_case::<f32>();
        if all || i % 2 == 0 {
            grid::<f16>();
            varlen_case::<f16>();
        }
        if all || i % 2 == 1 {
            grid::<bf16>();
            varlen_case::<bf16>();
        }
    }
    let x = [0.5f32; 8];
    let t = TensorRef::contiguous(&x, &[1, 2, 1, 4]);
    let opts = AttnOptions::default();
    let fwd = flash_attn(&t, &t, &t, &opts).unwrap();
    for bad in ["5", "-1", "two", ""] {
        std::env::set_var("FLASHATTN_DQ_CHUNKS", bad);
        let err = fwd.backward(&t, &t, &t, &t, &opts).unwrap_err();
        assert_eq!(
            err.kind(),
            &ErrorKind::DqChunksUnknown { value: bad.into() },
            "{bad:?}"
        );
        assert!(err.to_string().contains("FLASHATTN_DQ_CHUNKS"), "{err}");
    }
    std::env::remove_var("FLASHATTN_DQ_CHUNKS");
    assert!(fwd.backward(&t, &t, &t, &t, &opts).is_ok());
}
