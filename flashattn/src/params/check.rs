//! Checks of one tensor or index array: the view against its buffer, dtype, shape, the sizes a
//! call allocates, `cu_seqlens`, and caller-provided destinations.

use super::contract::{Params, RowLayout, Seq};
use crate::error::{CuSeqlensProblem, ErrorKind, Result, TensorName};
use crate::output::OutBuffers;
use crate::tensor::{DType, ViewDesc};

/// Checks rank, stride count, contiguity of the last dimension and that every element the view
/// addresses lies inside its buffer.
pub(crate) fn check_view<V: ViewDesc + ?Sized>(
    name: TensorName,
    t: &V,
    rank: usize,
    layout: &'static str,
) -> Result<()> {
    if t.shape().len() != rank {
        return Err(ErrorKind::Rank {
            tensor: name,
            expected: rank,
            got: t.shape().len(),
            layout,
        }
        .into());
    }
    if t.strides().len() != rank {
        return Err(ErrorKind::StridesRank {
            tensor: name,
            dims: rank,
            strides: t.strides().len(),
        }
        .into());
    }
    let last = rank - 1;
    if t.shape()[last] > 1 && t.strides()[last] != 1 {
        return Err(ErrorKind::LastDimNotContiguous {
            tensor: name,
            stride: t.strides()[last],
        }
        .into());
    }
    if t.shape().contains(&0) {
        return Ok(());
    }
    // Each term is below 2^128 but their sum need not be: overflow means "far out of bounds".
    let max_index: Option<u128> = t
        .shape()
        .iter()
        .zip(t.strides())
        .try_fold(0u128, |acc, (&n, &s)| {
            acc.checked_add((n as u128 - 1).checked_mul(s as u128)?)
        });
    let needed = max_index
        .and_then(|m| m.checked_add(1))
        .unwrap_or(u128::MAX);
    if needed > t.buffer_len() as u128 {
        return Err(ErrorKind::OutOfBounds {
            tensor: name,
            shape: t.shape().to_vec(),
            strides: t.strides().to_vec(),
            needed,
            len: t.buffer_len(),
        }
        .into());
    }
    Ok(())
}

pub(crate) fn check_dtype<V: ViewDesc + ?Sized>(
    name: TensorName,
    t: &V,
    expected: DType,
) -> Result<()> {
    if t.dtype() != expected {
        return Err(ErrorKind::DType {
            tensor: name,
            expected,
            got: t.dtype(),
        }
        .into());
    }
    Ok(())
}

pub(crate) fn check_shape<V: ViewDesc + ?Sized>(
    name: TensorName,
    t: &V,
    expected: &[usize],
) -> Result<()> {
    if t.shape() != expected {
        return Err(ErrorKind::Shape {
            tensor: name,
            expected: expected.to_vec(),
            got: t.shape().to_vec(),
        }
        .into());
    }
    Ok(())
}

/// Element count of `dims`, if a buffer of that many `elem_bytes`-byte elements can be allocated
/// (at most `isize::MAX` bytes); otherwise `TooLarge`.
pub(crate) fn checked_product(
    name: TensorName,
    dims: &[usize],
    elem_bytes: usize,
) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .filter(|&n| {
            n.checked_mul(elem_bytes)
                .is_some_and(|b| b <= isize::MAX as usize)
        })
        .ok_or_else(|| ErrorKind::TooLarge { tensor: name }.into())
}

/// The per-sequence table, allocated fallibly (see [`crate::memory::try_collect`]): a batched
/// call's batch is a shape entry, so stride-0 views of one element can ask for 2^50 empty
/// sequences.
pub(crate) fn seq_table(seqs: impl ExactSizeIterator<Item = Seq>) -> Result<Vec<Seq>> {
    crate::memory::try_collect("the per-sequence table", seqs)
}

pub(crate) fn layout_of<V: ViewDesc + ?Sized>(t: &V) -> RowLayout {
    let n = t.strides().len();
    RowLayout {
        row_stride: t.strides()[n - 3],
        head_stride: t.strides()[n - 2],
    }
}

pub(crate) fn check_cu_seqlens(
    name: TensorName,
    cu: &[i32],
    entries: usize,
    total: usize,
) -> Result<()> {
    let err = |problem| {
        Err(ErrorKind::CuSeqlens {
            tensor: name,
            problem,
        }
        .into())
    };
    if cu.len() != entries || entries == 0 {
        return err(CuSeqlensProblem::Length {
            expected: entries.max(1),
            got: cu.len(),
        });
    }
    if cu[0] != 0 {
        return err(CuSeqlensProblem::NotStartingAtZero { first: cu[0] });
    }
    for (index, w) in cu.windows(2).enumerate() {
        if w[1] < w[0] {
            return err(CuSeqlensProblem::Decreasing {
                index: index + 1,
                previous: w[0],
                value: w[1],
            });
        }
    }
    let last = cu[entries - 1];
    if last as usize > total {
        return err(CuSeqlensProblem::PastTensor { last, total });
    }
    Ok(())
}

/// Checks a caller-provided destination: dtype `expected_dtype`, `shape`'s number of elements
/// (contiguous). The `_into` calls write nothing before every destination has passed.
pub(crate) fn destination(
    tensor: &'static str,
    (dtype, len): (DType, usize),
    expected_dtype: DType,
    shape: &[usize],
) -> Result<()> {
    if dtype != expected_dtype {
        return Err(ErrorKind::DType {
            tensor,
            expected: expected_dtype,
            got: dtype,
        }
        .into());
    }
    let expected: usize = shape.iter().product();
    if len != expected {
        return Err(ErrorKind::DestinationLength {
            tensor,
            expected,
            got: len,
            shape: shape.to_vec(),
        }
        .into());
    }
    Ok(())
}

/// Checks a forward's caller-provided destinations against validated `p`: `out` of `dtype` (the
/// inputs', bf16 for FP8 inputs, q's for a decode call) and `p.out_shape`'s length, `lse` of
/// `p.lse_shape`'s.
pub(crate) fn out_buffers(p: &Params, dtype: DType, dst: &OutBuffers) -> Result<()> {
    let out = (dst.out.dtype(), dst.out.as_slice().len());
    destination("out", out, dtype, &p.out_shape)?;
    destination("lse", (DType::F32, dst.lse.len()), DType::F32, &p.lse_shape)
}
