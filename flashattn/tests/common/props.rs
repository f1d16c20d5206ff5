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
