//! Limits every layer may name (errors quote them). The bottom layer.

/// The most key splits a decode call may ask for (`KvCacheOptions::num_splits`).
pub const MAX_NUM_SPLITS: usize = 256;
