//! aarch64 Advanced SIMD (NEON) microkernels. Placeholder: the scalar twins, until the NEON
//! versions land.

pub(crate) use super::scalar::{gemm, max_get_scale, online_softmax, rescale_o};
