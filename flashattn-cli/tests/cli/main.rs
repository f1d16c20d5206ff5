//! End-to-end tests of the `flashattn` binary: `run` against the f64 reference, every kind of bad
//! input (non-zero exit, a message naming the tensor, no OUT file, an existing OUT untouched), and
//! the JSON lines of `bench`.

//!
//! One test binary: `run` (against the reference, flash-attn's packed layouts, bad input),
//! `bench` (with `peak` and `plot`), decoding, FP8 and `--device cuda`.

mod common;

mod bench;
mod cuda;
mod decode;
mod fp8;
mod run;
