//! `flashattn._flashattn.BlockMask` and its builder: a [`flashattn::BlockMask`] made from rows
//! the Python layer evaluates in chunks (`flashattn.create_block_mask`, `BlockMask.from_dense`)
//! and handed to the attention calls through their options.

use flashattn::{BlockMaskBuilder, MaskShape};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::BindError;
use crate::view::{RawView, View};

/// A mask evaluated once (immutable, shared between calls and threads).
#[pyclass(frozen, module = "flashattn._flashattn", name = "BlockMask")]
pub struct PyBlockMask {
    pub(crate) inner: flashattn::BlockMask,
}

#[pymethods]
impl PyBlockMask {
    /// `(batch, heads, seqlen_q, seqlen_k)` as built (batch or heads 1: shared).
    #[getter]
    fn shape(&self) -> (usize, usize, usize, usize) {
        let s = self.inner.shape();
        (s.batch, s.heads, s.seqlen_q, s.seqlen_k)
    }

    /// Blocks of `BLOCK_SIZE` x `BLOCK_SIZE` pairs: `(empty, full, partial)`.
    fn block_counts(&self) -> (usize, usize, usize) {
        let c = self.inner.block_counts();
        (c.empty, c.full, c.partial)
    }

    /// Bytes held by the summary and the partial blocks' bits.
    fn nbytes(&self) -> usize {
        self.inner.bytes()
    }

    /// Whether query `q` of (sequence `b`, head `h`) sees key `k`.
    fn allows(&self, b: usize, h: usize, q: usize, k: usize) -> PyResult<bool> {
        let s = self.inner.shape();
        let b = if s.batch == 1 { 0 } else { b };
        let h = if s.heads == 1 { 0 } else { h };
        if b >= s.batch || h >= s.heads || q >= s.seqlen_q || k >= s.seqlen_k {
            return Err(
                BindError::Value(format!("({b}, {h}, {q}, {k}) is outside the mask")).into(),
            );
        }
        Ok(self.inner.allows(b, h, q, k))
    }

    /// Writes the mask into `dest`, a fresh contiguous bool tensor `[batch, heads, seqlen_q,
    /// seqlen_k]`.
    fn write_dense(&self, py: Python<'_>, dest: RawView) -> PyResult<()> {
        let d = View::try_from(dest)?;
        let s = self.inner.shape();
        if d.shape != [s.batch, s.heads, s.seqlen_q, s.seqlen_k] {
            return Err(BindError::Value(format!("dest has shape {:?}", d.shape)).into());
        }
        // SAFETY: the Python layer allocated `dest` for this call and holds it alive.
        let bytes = unsafe { d.bytes_mut()? };
        py.detach(|| {
            for (x, byte) in bytes.iter_mut().enumerate() {
                let (row, k) = (x / s.seqlen_k, x % s.seqlen_k);
                let (bh, q) = (row / s.seqlen_q, row % s.seqlen_q);
                *byte = self.inner.allows(bh / s.heads, bh % s.heads, q, k) as u8;
            }
        });
        Ok(())
    }

    /// `(kinds, bits)` as bytes in native order (as tensors hold them): one `i32` per block
    /// (`KIND_EMPTY`, `KIND_FULL` or a partial block's index) and `MASK_BLOCK` `u64` row words
    /// per partial block.
    fn parts<'py>(&self, py: Python<'py>) -> (Bound<'py, PyBytes>, Bound<'py, PyBytes>) {
        let p = self.inner.to_parts();
        let kinds: Vec<u8> = p.kinds.iter().flat_map(|k| k.to_ne_bytes()).collect();
        let bits: Vec<u8> = p.bits.iter().flat_map(|w| w.to_ne_bytes()).collect();
        (PyBytes::new(py, &kinds), PyBytes::new(py, &bits))
    }

    /// The mask of [`PyBlockMask::parts`]' arrays for `(batch, heads, seqlen_q, seqlen_k)`,
    /// checked, given as contiguous `uint8` views of an int32 and an int64 tensor that `owner`
    /// holds: read in place, no copy (copied only where a view is not aligned to its element).
    #[staticmethod]
    fn lend(
        py: Python<'_>,
        shape: (usize, usize, usize, usize),
        kinds: RawView,
        bits: RawView,
        owner: Py<PyAny>,
    ) -> PyResult<PyBlockMask> {
        let (batch, heads, seqlen_q, seqlen_k) = shape;
        let shape = MaskShape {
            batch,
            heads,
            seqlen_q,
            seqlen_k,
        };
        let (k, b) = (View::try_from(kinds)?, View::try_from(bits)?);
        // SAFETY: `owner` holds both tensors, and the Python layer does not write them while
        // the mask lives (it lives for one call).
        let (k, b) = unsafe { (k.bytes_ref()?, b.bytes_ref()?) };
        // Whole i32 kinds and u64 words only: a ragged tail would be dropped silently below.
        if k.len() % 4 != 0 || b.len() % 8 != 0 {
            return Err(BindError::Value(format!(
                "mask kinds ({} bytes) must be int32 and mask bits ({} bytes) int64",
                k.len(),
                b.len()
            ))
            .into());
        }
        let inner = py
            .detach(
                || match (bytemuck::try_cast_slice(k), bytemuck::try_cast_slice(b)) {
                    // SAFETY: `owner`, which the mask keeps, holds the tensors these bytes are
                    // (alive), and the Python layer does not write them while the mask lives.
                    (Ok(kinds), Ok(bits)) => unsafe {
                        flashattn::BlockMask::from_parts_lent(shape, kinds, bits, Box::new(owner))
                    },
                    _ => {
                        let kinds: Vec<i32> = k
                            .chunks_exact(4)
                            .map(|c| i32::from_ne_bytes(c.try_into().unwrap_or_default()))
                            .collect();
                        let bits: Vec<u64> = b
                            .chunks_exact(8)
                            .map(|c| u64::from_ne_bytes(c.try_into().unwrap_or_default()))
                            .collect();
                        flashattn::BlockMask::from_parts(shape, &kinds, &bits)
                    }
                },
            )
            .map_err(BindError::Lib)?;
        Ok(PyBlockMask { inner })
    }

    fn __repr__(&self) -> String {
        format!("{:?}", self.inner)
    }
}

/// Collects the rows of a [`PyBlockMask`].
#[pyclass(module = "flashattn._flashattn", name = "BlockMaskBuilder")]
pub struct PyBlockMaskBuilder {
    inner: Option<BlockMaskBuilder>,
}

#[pymethods]
impl PyBlockMaskBuilder {
    #[new]
    fn new(batch: usize, heads: usize, seqlen_q: usize, seqlen_k: usize) -> PyResult<Self> {
        let shape = MaskShape {
            batch,
            heads,
            seqlen_q,
            seqlen_k,
        };
        let b = BlockMaskBuilder::new(shape).map_err(BindError::Lib)?;
        Ok(PyBlockMaskBuilder { inner: Some(b) })
    }

    /// Rows `q0..` of (sequence `b`, head `h`): a contiguous bool tensor `[rows, seqlen_k]`.
    fn rows(
        &mut self,
        py: Python<'_>,
        b: usize,
        h: usize,
        q0: usize,
        mask: RawView,
    ) -> PyResult<()> {
        let builder = self
            .inner
            .as_mut()
            .ok_or_else(|| BindError::Value("the builder was finished".into()))?;
        let m = View::try_from(mask)?;
        // SAFETY: the Python layer holds the chunk alive and unwritten for this call.
        let bytes = unsafe { m.bytes_ref()? };
        py.detach(|| builder.rows(b, h, q0, bytes))
            .map_err(BindError::Lib)?;
        Ok(())
    }

    /// The mask, once every row was given.
    fn finish(&mut self) -> PyResult<PyBlockMask> {
        let builder = self
            .inner
            .take()
            .ok_or_else(|| BindError::Value("the builder was finished".into()))?;
        let inner = builder.finish().map_err(BindError::Lib)?;
        Ok(PyBlockMask { inner })
    }
}
