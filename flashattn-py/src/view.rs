//! Tensors handed over from Python as `(address, dtype, shape, strides)`: the one place where raw
//! addresses become slices.
//!
//! The Python layer (`flashattn/_ops.py`) passes `tensor.data_ptr()` of CPU tensors it holds for
//! the whole call, with strides in elements. Here each view is checked (known dtype, rank of the
//! strides, non-null and aligned address, extent that fits `isize`), and writable views are checked
//! not to overlap any other view of the same call, so the slices built from them never alias.

use flashattn::fp8::{Fp8TensorMut, Fp8TensorRef};
use flashattn::{SliceMut, TensorMut, TensorRef};
use float8::{F8E4M3, F8E5M2};
use half::{bf16, f16};
use pyo3::prelude::*;

use crate::errors::BindError;

/// Element types that cross the boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dt {
    F32,
    F16,
    BF16,
    F8E4M3,
    F8E5M2,
    U8,
}

impl Dt {
    fn parse(name: &str) -> Result<Self, BindError> {
        Ok(match name {
            "float32" => Dt::F32,
            "float16" => Dt::F16,
            "bfloat16" => Dt::BF16,
            "float8_e4m3fn" => Dt::F8E4M3,
            "float8_e5m2" => Dt::F8E5M2,
            "uint8" | "bool" => Dt::U8,
            other => return Err(BindError::Type(format!("unsupported dtype {other}"))),
        })
    }

    fn size(self) -> usize {
        match self {
            Dt::F32 => 4,
            Dt::F16 | Dt::BF16 => 2,
            Dt::F8E4M3 | Dt::F8E5M2 | Dt::U8 => 1,
        }
    }
}

/// One tensor as Python describes it: `(name, address, dtype, shape, strides)`.
#[derive(Clone, Debug, FromPyObject)]
pub struct RawView(String, usize, String, Vec<usize>, Vec<usize>);

/// A checked [`RawView`]: its address range is known, so overlap can be tested.
#[derive(Clone, Debug)]
pub struct View {
    pub name: String,
    addr: usize,
    pub dt: Dt,
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
    /// Elements from the first to one past the last reachable one (0 for an empty tensor).
    extent: usize,
}

impl TryFrom<RawView> for View {
    type Error = BindError;
    fn try_from(r: RawView) -> Result<Self, BindError> {
        let RawView(name, addr, dtype, shape, strides) = r;
        let dt = Dt::parse(&dtype)?;
        if shape.len() != strides.len() {
            return Err(BindError::Value(format!(
                "{name}: {} strides for {} dimensions",
                strides.len(),
                shape.len()
            )));
        }
        let extent = if shape.contains(&0) {
            0
        } else {
            let mut last: u128 = 0;
            for (&n, &s) in shape.iter().zip(&strides) {
                last += (n as u128 - 1) * s as u128;
            }
            let extent = last + 1;
            if extent * dt.size() as u128 > isize::MAX as u128 {
                return Err(BindError::Value(format!(
                    "{name}: shape {shape:?} with strides {strides:?} spans more than isize::MAX bytes"
                )));
            }
            extent as usize
        };
        if extent > 0 && (addr == 0 || addr % dt.size() != 0) {
            return Err(BindError::Value(format!(
                "{name}: address {addr:#x} is null or not aligned to its {}-byte elements",
                dt.size()
            )));
        }
        Ok(View {
            name,
            addr,
            dt,
            shape,
            strides,
            extent,
        })
    }
}

impl View {
    /// The first element's address.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // used by the CUDA calls only
    pub fn addr(&self) -> usize {
        self.addr
    }

    /// Elements from the first to one past the last reachable one.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // used by the CUDA calls only
    pub fn extent(&self) -> usize {
        self.extent
    }

    fn bytes(&self) -> std::ops::Range<usize> {
        self.addr..self.addr + self.extent * self.dt.size()
    }

    /// Fails if this (writable) view shares a byte with any of `others`.
    pub fn check_disjoint<'a>(
        &self,
        others: impl IntoIterator<Item = &'a View>,
    ) -> Result<(), BindError> {
        let a = self.bytes();
        for o in others {
            let b = o.bytes();
            if !a.is_empty() && !b.is_empty() && a.start < b.end && b.start < a.end {
                return Err(BindError::Value(format!(
                    "{} overlaps {} in memory; it is written by this call and must not alias \
                     another argument",
                    self.name, o.name
                )));
            }
        }
        Ok(())
    }

    fn expect(&self, dt: Dt) -> Result<(), BindError> {
        if self.dt == dt {
            Ok(())
        } else {
            Err(BindError::Type(format!(
                "{} has dtype {:?}, expected {:?}",
                self.name, self.dt, dt
            )))
        }
    }

    /// The elements this view reaches, as a slice.
    ///
    /// # Safety
    /// The caller (the Python layer) keeps the tensor alive and unmodified for `'a`, and `T` is
    /// the element type `self.dt` names.
    unsafe fn slice<'a, T>(&self) -> &'a [T] {
        if self.extent == 0 {
            return &[];
        }
        // SAFETY: `addr` is non-null and aligned for `T` (checked in `try_from`, `T`'s size is
        // `dt.size()`), the `extent` elements lie in the tensor's storage (torch's invariant for a
        // tensor of this shape and strides), span at most isize::MAX bytes (checked), and stay
        // valid and unwritten for 'a (this function's contract).
        std::slice::from_raw_parts(self.addr as *const T, self.extent)
    }

    /// # Safety
    /// As [`View::slice`], and no other live slice overlaps this one (callers check with
    /// [`View::check_disjoint`] against every other view of the call).
    unsafe fn slice_mut<'a, T>(&self) -> &'a mut [T] {
        if self.extent == 0 {
            return &mut [];
        }
        // SAFETY: as in `slice`; exclusivity is the caller's contract stated above.
        std::slice::from_raw_parts_mut(self.addr as *mut T, self.extent)
    }

    /// A borrowed tensor of f32, f16 or bf16.
    ///
    /// # Safety
    /// As [`View::slice`].
    pub unsafe fn tensor<'a>(&self) -> Result<TensorRef<'a>, BindError> {
        let (s, st) = (&self.shape, &self.strides);
        Ok(match self.dt {
            Dt::F32 => TensorRef::new(self.slice::<f32>(), s, st),
            Dt::F16 => TensorRef::new(self.slice::<f16>(), s, st),
            Dt::BF16 => TensorRef::new(self.slice::<bf16>(), s, st),
            _ => return Err(self.not_float()),
        })
    }

    /// A writable tensor of f32, f16 or bf16 (a KV cache).
    ///
    /// # Safety
    /// As [`View::slice_mut`].
    pub unsafe fn tensor_mut<'a>(&self) -> Result<TensorMut<'a>, BindError> {
        let (s, st) = (&self.shape, &self.strides);
        Ok(match self.dt {
            Dt::F32 => TensorMut::new(self.slice_mut::<f32>(), s, st),
            Dt::F16 => TensorMut::new(self.slice_mut::<f16>(), s, st),
            Dt::BF16 => TensorMut::new(self.slice_mut::<bf16>(), s, st),
            _ => return Err(self.not_float()),
        })
    }

    /// A borrowed FP8 tensor.
    ///
    /// # Safety
    /// As [`View::slice`].
    pub unsafe fn fp8<'a>(&self) -> Result<Fp8TensorRef<'a>, BindError> {
        let (s, st) = (&self.shape, &self.strides);
        Ok(match self.dt {
            Dt::F8E4M3 => Fp8TensorRef::new(self.slice::<F8E4M3>(), s, st),
            Dt::F8E5M2 => Fp8TensorRef::new(self.slice::<F8E5M2>(), s, st),
            _ => return Err(self.not_fp8()),
        })
    }

    /// A writable FP8 tensor (an FP8 KV cache).
    ///
    /// # Safety
    /// As [`View::slice_mut`].
    pub unsafe fn fp8_mut<'a>(&self) -> Result<Fp8TensorMut<'a>, BindError> {
        let (s, st) = (&self.shape, &self.strides);
        Ok(match self.dt {
            Dt::F8E4M3 => Fp8TensorMut::new(self.slice_mut::<F8E4M3>(), s, st),
            Dt::F8E5M2 => Fp8TensorMut::new(self.slice_mut::<F8E5M2>(), s, st),
            _ => return Err(self.not_fp8()),
        })
    }

    fn check_contiguous(&self) -> Result<(), BindError> {
        // An empty tensor's strides are arbitrary (torch gives `(1, 1)` to a `[4, 0]` tensor).
        if self.extent > 0 && self.strides != flashattn::tensor::contiguous_strides(&self.shape) {
            return Err(BindError::Value(format!(
                "{}: a destination must be contiguous, got shape {:?} strides {:?}",
                self.name, self.shape, self.strides
            )));
        }
        Ok(())
    }

    /// A contiguous destination of f32, f16 or bf16 that the library writes in place.
    ///
    /// # Safety
    /// As [`View::slice_mut`].
    pub unsafe fn dest<'a>(&self) -> Result<SliceMut<'a>, BindError> {
        self.check_contiguous()?;
        Ok(match self.dt {
            Dt::F32 => SliceMut::F32(self.slice_mut::<f32>()),
            Dt::F16 => SliceMut::F16(self.slice_mut::<f16>()),
            Dt::BF16 => SliceMut::BF16(self.slice_mut::<bf16>()),
            _ => return Err(self.not_float()),
        })
    }

    /// A contiguous f32 destination (lse, dsink).
    ///
    /// # Safety
    /// As [`View::slice_mut`].
    pub unsafe fn dest_f32<'a>(&self) -> Result<&'a mut [f32], BindError> {
        self.check_contiguous()?;
        self.expect(Dt::F32)?;
        Ok(self.slice_mut::<f32>())
    }

    /// The bytes of a contiguous `uint8`/`bool` view, read only.
    ///
    /// # Safety
    /// As [`View::slice`].
    pub unsafe fn bytes_ref<'a>(&self) -> Result<&'a [u8], BindError> {
        self.expect(Dt::U8)?;
        self.check_contiguous()?;
        Ok(self.slice::<u8>())
    }

    /// The bytes of a contiguous `uint8`/`bool` view, writable.
    ///
    /// # Safety
    /// As [`View::slice_mut`].
    pub unsafe fn bytes_mut<'a>(&self) -> Result<&'a mut [u8], BindError> {
        self.expect(Dt::U8)?;
        if self.extent > 0 && self.strides != flashattn::tensor::contiguous_strides(&self.shape) {
            return Err(BindError::Value(format!(
                "{} must be contiguous",
                self.name
            )));
        }
        Ok(self.slice_mut::<u8>())
    }

    fn not_float(&self) -> BindError {
        BindError::Type(format!(
            "{} has dtype {:?}; expected float32, float16 or bfloat16",
            self.name, self.dt
        ))
    }

    fn not_fp8(&self) -> BindError {
        BindError::Type(format!(
            "{} has dtype {:?}; expected float8_e4m3fn or float8_e5m2",
            self.name, self.dt
        ))
    }
}
