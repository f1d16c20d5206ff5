//! The CUDA backend: every kernel variant compiled with NVRTC (no GPU needed), the kernels' source
//! run on the CPU under host emulation (g++), and the device tests on a GPU (skipped without one).

mod compile;
mod device;
mod emulated;
mod emulated_bwd90;
mod emulated_sched;
