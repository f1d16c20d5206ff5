//! Shared helpers of the integration tests: seeded inputs in every dtype and memory layout, and the
//! error-bound checker that compares flashattn with the naive yardstick and the f64 oracle.
//!
//! Not every test binary uses every helper.
#![allow(dead_code)]

use flashattn::reference::Reference;
use flashattn::tensor::contiguous_strides;
use flashattn::{AttnOptions, AttnOutput, Buffer, DType, Element, Slice, Tensor, TensorRef};
use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::fmt;

pub mod backward;
#[cfg(feature = "cuda")]
pub mod emu;
pub mod grid;
pub mod props;

mod case;
mod check;
mod data;
mod layout;
mod varlen;

#[allow(unused_imports)] // not every test binary uses every part
pub use case::*;
#[allow(unused_imports)]
pub use check::*;
#[allow(unused_imports)]
pub use data::*;
#[allow(unused_imports)]
pub use layout::*;
#[allow(unused_imports)]
pub use varlen::*;
