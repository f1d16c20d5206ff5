//! The library's integration tests, one test binary organised by concern. The tests that need a
//! process of their own (a custom allocator, an environment variable read once per process or
//! set while they run, process-wide scratch buffers) are the other files of `tests/`.
//!
//! Filters select by concern: `cargo test -p flashattn --test integration decode::`,
//! `... fp8::gpu::`, `... cuda::device::`.

mod common;

mod backward;
mod block_mask;
#[cfg(feature = "cuda")]
mod cuda;
mod decode;
mod destinations;
mod errors;
mod forward;
mod fp8;
mod kernels;
mod mask_mod;
mod packed_qkv;
mod score_mod;
mod sink;
