//! Memory layouts: where a tensor's elements lie in its buffer, and views of them.

use super::*;

/// Memory layout of q, k and v (batched `[batch, seqlen, heads, head_dim]` views).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Three contiguous buffers.
    Contiguous,
    /// One buffer `[batch, seqlen, heads + 2 * heads_kv, d]` holding q, k and v side by side (the
    /// `qkvpacked` layout); when seqlen_q != seqlen_k, q is contiguous and only k/v are packed.
    Packed,
    /// Each tensor in its own buffer, with gaps between heads, rows and batches, and a leading offset.
    /// Gaps are filled with NaN, so reading one shows up in the output.
    Padded,
    /// `[batch, heads, seqlen, d]` in memory (head stride larger than row stride).
    HeadMajor,
    /// k and v stored once and broadcast over the batch (batch stride 0).
    BroadcastKv,
}

pub const LAYOUTS: [Layout; 5] = [
    Layout::Contiguous,
    Layout::Packed,
    Layout::Padded,
    Layout::HeadMajor,
    Layout::BroadcastKv,
];

/// Where one tensor lives: buffer index, offset of element 0, shape, strides.
#[derive(Clone, Debug)]
pub struct Placement {
    pub buf: usize,
    pub offset: usize,
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
}

impl Placement {
    /// Every element index (relative to the buffer start) in row-major logical order.
    pub(super) fn indices(&self) -> Vec<usize> {
        let n: usize = self.shape.iter().product();
        let mut out = Vec::with_capacity(n);
        let mut idx = vec![0usize; self.shape.len()];
        for _ in 0..n {
            out.push(
                self.offset
                    + idx
                        .iter()
                        .zip(&self.strides)
                        .map(|(i, s)| i * s)
                        .sum::<usize>(),
            );
            for dim in (0..idx.len()).rev() {
                idx[dim] += 1;
                if idx[dim] < self.shape[dim] {
                    break;
                }
                idx[dim] = 0;
            }
        }
        out
    }

    /// One past the largest element index addressed (0 for an empty tensor).
    fn extent(&self) -> usize {
        if self.shape.contains(&0) {
            return self.offset;
        }
        self.offset
            + self
                .shape
                .iter()
                .zip(&self.strides)
                .map(|(n, s)| (n - 1) * s)
                .sum::<usize>()
            + 1
    }
}

/// Lays out logical values into physical buffers (gaps NaN) and rounds them to `dtype`.
/// `tensors[i]` = (placement, logical row-major values); returns the buffers.
pub fn materialize(tensors: &[(&Placement, &[f64])], dtype: DType, n_bufs: usize) -> Vec<Buffer> {
    let mut raw: Vec<Vec<f64>> = vec![Vec::new(); n_bufs];
    for (p, _) in tensors {
        let len = &mut raw[p.buf];
        if len.len() < p.extent() + 3 {
            len.resize(p.extent() + 3, f64::NAN); // a little slack past the end, NaN too
        }
    }
    for (p, vals) in tensors {
        for (idx, &x) in p.indices().into_iter().zip(vals.iter()) {
            raw[p.buf][idx] = x;
        }
    }
    raw.iter().map(|r| to_buffer(r, dtype)).collect()
}

/// Placements of q, k, v for a batched problem; returns (q, k, v, number of buffers).
#[allow(clippy::too_many_arguments)]
pub fn batched_placements(
    layout: Layout,
    rng: &mut ChaCha8Rng,
    b: usize,
    sq: usize,
    sk: usize,
    h: usize,
    hkv: usize,
    d: usize,
) -> (Placement, Placement, Placement, usize) {
    let contiguous = |buf: usize, shape: [usize; 4]| Placement {
        buf,
        offset: 0,
        shape: shape.to_vec(),
        strides: contiguous_strides(&shape),
    };
    let qs = [b, sq, h, d];
    let ks = [b, sk, hkv, d];
    match layout {
        Layout::Contiguous => (contiguous(0, qs), contiguous(1, ks), contiguous(2, ks), 3),
        Layout::Packed => {
            if sq == sk {
                let w = h + 2 * hkv;
                let strides = vec![sq * w * d, w * d, d, 1];
                let at = |offset: usize, shape: [usize; 4]| Placement {
                    buf: 0,
                    offset,
                    shape: shape.to_vec(),
                    strides: strides.clone(),
                };
                (at(0, qs), at(h * d, ks), at((h + hkv) * d, ks), 1)
            } else {
                // kv packed as [b, sk, 2, hkv, d].
                let strides = vec![sk * 2 * hkv * d, 2 * hkv * d, d, 1];
                let at = |offset: usize| Placement {
                    buf: 1,
                    offset,
                    shape: ks.to_vec(),
                    strides: strides.clone(),
                };
                (contiguous(0, qs), at(0), at(hkv * d), 2)
            }
        }
        Layout::Padded => {
            let mut padded = |buf: usize, shape: [usize; 4]| {
                let head = d + rng.gen_range(0..4);
                let row = shape[2] * head + rng.gen_range(0..5);
                let batch = shape[1] * row + rng.gen_range(1..7);
                Placement {
                    buf,
                    offset: rng.gen_range(0..9),
                    shape: shape.to_vec(),
                    strides: vec![batch, row, head, 1],
                }
            };
            let q = padded(0, qs);
            let k = padded(1, ks);
            let v = padded(2, ks);
            (q, k, v, 3)
        }
        Layout::HeadMajor => {
            let hm = |buf: usize, shape: [usize; 4]| {
                let (s, n) = (shape[1], shape[2]);
                Placement {
                    buf,
                    offset: 0,
                    shape: shape.to_vec(),
                    strides: vec![n * s * d, d, s * d, 1],
                }
            };
            (hm(0, qs), hm(1, ks), hm(2, ks), 3)
        }
        Layout::BroadcastKv => {
            let mut k = contiguous(1, ks);
            let mut v = contiguous(2, ks);
            k.strides[0] = 0;
            v.strides[0] = 0;
            (contiguous(0, qs), k, v, 3)
        }
    }
}

/// A view of `p` inside `bufs`.
pub fn view<'a>(bufs: &'a [Buffer], p: &Placement) -> TensorRef<'a> {
    TensorRef::from_slice(
        slice_from(bufs[p.buf].as_slice(), p.offset),
        &p.shape,
        &p.strides,
    )
}
