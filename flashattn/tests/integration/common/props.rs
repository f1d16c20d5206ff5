//! Settings of the property tests (proptest).

use proptest::test_runner::{Config, RngSeed};

/// `cases` cases from a fixed seed, so a run is reproducible and CI sees the same cases every
/// time; `PROPTEST_CASES` and `PROPTEST_RNG_SEED` override either (a new seed draws new cases).
/// Failures are not written to regression files: a failing case prints itself, shrunk.
pub fn config(cases: u32) -> Config {
    let set = |name: &str| std::env::var_os(name).is_some();
    let mut c = Config {
        failure_persistence: None,
        ..Config::default()
    };
    if !set("PROPTEST_CASES") {
        c.cases = cases;
    }
    if !set("PROPTEST_RNG_SEED") {
        c.rng_seed = RngSeed::Fixed(0x00f1_a5ba_77e0);
    }
    c
}

/// Integers, floats and sizes for changing valid calls: ordinary values in `normal`, and the
/// extremes of the type (overflow, sign, NaN, infinities, subnormal edge, any normal float).
pub mod extremes {
    use proptest::prelude::*;
    use std::ops::Range;

    pub fn f32s() -> impl Strategy<Value = f32> {
        prop_oneof![
            Just(f32::NAN),
            Just(f32::INFINITY),
            Just(f32::NEG_INFINITY),
            Just(0.0f32),
            Just(-0.0f32),
            Just(f32::MIN_POSITIVE),
            Just(f32::MAX),
            Just(1e38f32),
            Just(-1e38f32),
            // Any normal float of either sign: finite values whose products with the call's
            // lengths and constants overflow (a slope of -1e38 times a distance).
            prop::num::f32::POSITIVE | prop::num::f32::NEGATIVE,
            -3.0f32..3.0,
        ]
    }

    pub fn i32s(normal: Range<i32>) -> impl Strategy<Value = i32> {
        prop_oneof![
            normal,
            Just(i32::MIN),
            Just(i32::MAX),
            Just(i32::MAX / 2 + 7),
            any::<i32>()
        ]
    }

    pub fn i64s(normal: Range<i64>) -> impl Strategy<Value = i64> {
        prop_oneof![normal, Just(i64::MIN), Just(i64::MAX), any::<i64>()]
    }

    pub fn usizes(normal: Range<usize>) -> impl Strategy<Value = usize> {
        prop_oneof![
            normal,
            Just(usize::MAX),
            Just(usize::MAX / 2 + 1),
            Just(usize::MAX / 3),
            Just(1 << 31),
            Just(1 << 40)
        ]
    }
}

/// `v[i % (len + 1)] = x`, the extra position appending an entry (a dimension or a stride).
pub fn set_dim(v: &mut Vec<usize>, i: usize, x: usize) {
    let i = i % (v.len() + 1);
    if i == v.len() {
        v.push(x);
    } else {
        v[i] = x;
    }
}

/// Whether `softmax_scale` can take a score whose dot products reach `max_dot` (|q·k| <= head_dim
/// for values in [-1, 1]) past the f32 range in the kernels' log2 domain. Scores are f32, so
/// such a call gives non-finite results, as any f32 attention would; it is not refused, because
/// that depends on the data.
pub fn scores_may_overflow(softmax_scale: Option<f32>, max_dot: f64) -> bool {
    softmax_scale
        .is_some_and(|s| s.abs() as f64 * max_dot * std::f64::consts::LOG2_E >= f32::MAX as f64)
}

/// An accepted call's result holds no NaN (the fuzz tests' inputs are finite).
pub fn assert_no_nan(o: &flashattn::AttnOutput) {
    assert!(o.out.to_f64_vec().iter().all(|x| !x.is_nan()), "NaN in out");
    assert!(o.lse.to_f64_vec().iter().all(|x| !x.is_nan()), "NaN in lse");
}
