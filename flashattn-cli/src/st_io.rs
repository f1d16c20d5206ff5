//! Reading the inputs of `flashattn run` from a safetensors file and writing its outputs.

use crate::error::{fail, CliError, Result};
use flashattn::{AttnGrads, AttnOutput, Buffer, Tensor, TensorRef};
use half::{bf16, f16};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::path::Path;

/// Every tensor name `run` understands; anything else in the file is rejected rather than ignored,
/// so a typo (`Q`, `cu_seqlen_q`) cannot silently change the computation.
pub const ACCEPTED: [&str; 10] = [
    "q",
    "k",
    "v",
    "qkv",
    "kv",
    "dout",
    "alibi_slopes",
    "learnable_sink",
    "cu_seqlens_q",
    "cu_seqlens_k",
];

/// An owned floating-point tensor, contiguous, row-major.
pub struct Loaded {
    pub buf: Buffer,
    pub shape: Vec<usize>,
    strides: Vec<usize>,
}

impl Loaded {
    pub fn view(&self) -> TensorRef<'_> {
        TensorRef::from_slice(self.buf.as_slice(), &self.shape, &self.strides)
    }
}

/// Where q, k and v come from: three tensors, or flash-attn's packed layouts, whose parts are
/// strided views (`TensorRef::select`) along `dim` (2 batched, 1 with cu_seqlens).
pub enum QkvSource {
    Separate([Loaded; 3]),
    /// `qkv` `[batch, seqlen, 3, heads, head_dim]` or `[total, 3, heads, head_dim]`.
    QkvPacked {
        qkv: Loaded,
        dim: usize,
    },
    /// q, and `kv` `[batch, seqlen_k, 2, heads_kv, head_dim]` or `[total_k, 2, heads_kv, head_dim]`.
    KvPacked {
        q: Loaded,
        kv: Loaded,
        dim: usize,
    },
}

impl QkvSource {
    /// q, k and v as views (the packed dimension was checked when the file was read).
    pub fn views(&self) -> [TensorRef<'_>; 3] {
        fn part(t: &Loaded, dim: usize, i: usize) -> TensorRef<'_> {
            t.view().select(dim, i).expect("checked by load")
        }
        match self {
            QkvSource::Separate([q, k, v]) => [q.view(), k.view(), v.view()],
            QkvSource::QkvPacked { qkv, dim } => [0, 1, 2].map(|i| part(qkv, *dim, i)),
            QkvSource::KvPacked { q, kv, dim } => [q.view(), part(kv, *dim, 0), part(kv, *dim, 1)],
        }
    }

    /// The gradients as output tensors: `dq`, `dk`, `dv`, or packed like the inputs (`dqkv`;
    /// `dq` and `dkv`), as flash-attn's packed functions return them; and `dsink` with sinks.
    pub fn grads(&self, g: &AttnGrads) -> Vec<(&'static str, Buffer, Vec<usize>)> {
        let own = |n, t: &Tensor| (n, t.buffer().clone(), t.shape().to_vec());
        let mut named = match self {
            QkvSource::Separate(_) => vec![own("dq", &g.dq), own("dk", &g.dk), own("dv", &g.dv)],
            QkvSource::QkvPacked { qkv, dim } => {
                let buf = interleave(&[&g.dq, &g.dk, &g.dv], *dim);
                vec![("dqkv", buf, qkv.shape.clone())]
            }
            QkvSource::KvPacked { kv, dim, .. } => vec![
                own("dq", &g.dq),
                ("dkv", interleave(&[&g.dk, &g.dv], *dim), kv.shape.clone()),
            ],
        };
        named.extend(g.dsink.as_ref().map(|t| own("dsink", t)));
        named
    }
}

/// Contiguous tensors of one shape `[lead.., rest..]` (`dim` leading dimensions) interleaved
/// along a new dimension at `dim`: `[lead.., parts, rest..]`.
fn interleave(parts: &[&Tensor], dim: usize) -> Buffer {
    fn go<T: Copy>(parts: &[&[T]], chunk: usize) -> Vec<T> {
        let rows = parts[0].len() / chunk.max(1);
        let mut out = Vec::with_capacity(parts.len() * parts[0].len());
        for r in 0..rows {
            for p in parts {
                out.extend_from_slice(&p[r * chunk..(r + 1) * chunk]);
            }
        }
        out
    }
    let chunk: usize = parts[0].shape()[dim..].iter().product();
    match parts[0].buffer() {
        Buffer::F32(_) => Buffer::F32(go(
            &parts
                .iter()
                .map(|t| t.as_slice::<f32>().unwrap())
                .collect::<Vec<_>>(),
            chunk,
        )),
        Buffer::F16(_) => Buffer::F16(go(
            &parts
                .iter()
                .map(|t| t.as_slice::<f16>().unwrap())
                .collect::<Vec<_>>(),
            chunk,
        )),
        Buffer::BF16(_) => Buffer::BF16(go(
            &parts
                .iter()
                .map(|t| t.as_slice::<bf16>().unwrap())
                .collect::<Vec<_>>(),
            chunk,
        )),
    }
}

/// The contents of an input file.
pub struct Inputs {
    pub qkv: QkvSource,
    pub alibi_slopes: Option<Loaded>,
    /// Learnable sinks, F32 `[heads]`.
    pub learnable_sink: Option<Loaded>,
    /// Gradient of the output; present means the backward pass runs too.
    pub dout: Option<Loaded>,
    /// `(cu_seqlens_q, cu_seqlens_k)`: present means the packed layout.
    pub cu_seqlens: Option<(Vec<i32>, Vec<i32>)>,
}

/// Row-major strides, or an error if they overflow. A shape with a zero dimension passes the
/// safetensors size check whatever its other dimensions are, so this cannot be left to chance.
fn checked_strides(name: &str, shape: &[usize]) -> Result<Vec<usize>> {
    let mut strides = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1].checked_mul(shape[i + 1]).ok_or_else(|| {
            CliError(format!(
                "tensor `{name}` has shape {shape:?}, whose size overflows"
            ))
        })?;
    }
    Ok(strides)
}

/// Decodes a float tensor. Bytes are copied into typed vectors (little-endian, as safetensors
/// stores them) because the file's data section need not be aligned for f32 or f16.
pub fn decode_float(name: &str, t: &TensorView) -> Result<Loaded> {
    let bytes = t.data();
    let buf = match t.dtype() {
        Dtype::F32 => Buffer::F32(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
        Dtype::F16 => Buffer::F16(
            bytes
                .chunks_exact(2)
                .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
        ),
        Dtype::BF16 => Buffer::BF16(
            bytes
                .chunks_exact(2)
                .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
        ),
        other => {
            return fail(format!(
                "tensor `{name}` has dtype {other:?}, expected F32, F16 or BF16"
            ))
        }
    };
    let shape = t.shape().to_vec();
    let strides = checked_strides(name, &shape)?;
    Ok(Loaded {
        buf,
        shape,
        strides,
    })
}

/// The ALiBi slopes of a file, which must be F32 (their shape is the library's to check).
pub fn decode_alibi(t: Option<TensorView>) -> Result<Option<Loaded>> {
    match t {
        Some(t) if t.dtype() != Dtype::F32 => fail(format!(
            "tensor `alibi_slopes` has dtype {:?}, expected F32",
            t.dtype()
        )),
        Some(t) => Ok(Some(decode_float("alibi_slopes", &t)?)),
        None => Ok(None),
    }
}

pub fn decode_i32(name: &str, t: &TensorView) -> Result<Vec<i32>> {
    if t.dtype() != Dtype::I32 {
        return fail(format!(
            "tensor `{name}` has dtype {:?}, expected I32",
            t.dtype()
        ));
    }
    if t.shape().len() != 1 {
        return fail(format!(
            "tensor `{name}` has shape {:?}, expected rank 1 [batch + 1]",
            t.shape()
        ));
    }
    Ok(t.data()
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// A descale tensor: F32, any shape; its element count (1, or batch · heads_kv) is checked by
/// the library.
pub fn decode_descale(name: &str, t: &TensorView) -> Result<Vec<f32>> {
    if t.dtype() != Dtype::F32 {
        return fail(format!(
            "tensor `{name}` has dtype {:?}, expected F32",
            t.dtype()
        ));
    }
    Ok(t.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// Reads and checks `path`: accepted names only, q/k/v present and of one float dtype, ALiBi
/// slopes F32, cu_seqlens I32 and both or neither. Shapes are left to the library, which names
/// the tensor and the expected layout in its errors.
pub fn load(path: &Path) -> Result<Inputs> {
    let shown = path.display();
    let bytes = read(path)?;
    let st = parse(&bytes, &shown, &ACCEPTED, "")?;
    let get = |name: &str| tensor(&st, name, &shown);
    let required = |name: &str| -> Result<Loaded> {
        match get(name)? {
            Some(t) => decode_float(name, &t),
            None => fail(format!(
                "{shown}: missing tensor `{name}` (q, k and v are required)"
            )),
        }
    };
    // flash-attn's packed layouts: `qkv` alone, or `q` with `kv`; the part dimension is 2 in
    // the batched layout (rank 5) and 1 in the packed one (rank 4, with cu_seqlens).
    let packed_part = |name: &str, parts: usize| -> Result<Option<(Loaded, usize)>> {
        let Some(t) = get(name)? else {
            return Ok(None);
        };
        let t = decode_float(name, &t)?;
        let dim = match t.shape.len() {
            5 => 2,
            4 => 1,
            _ => usize::MAX,
        };
        if t.shape.get(dim) != Some(&parts) {
            return fail(format!(
                "tensor `{name}` has shape {:?}, expected [batch, seqlen, {parts}, heads, head_dim] \
                 or, with cu_seqlens, [total, {parts}, heads, head_dim]",
                t.shape
            ));
        }
        Ok(Some((t, dim)))
    };
    let present = |name: &str| st.names().iter().any(|n| n.as_str() == name);
    let qkv = match (packed_part("qkv", 3)?, packed_part("kv", 2)?) {
        (Some(_), Some(_)) => {
            return fail(format!(
                "{shown}: tensors `qkv` and `kv` exclude each other"
            ))
        }
        (Some((qkv, dim)), None) => {
            if let Some(n) = ["q", "k", "v"].into_iter().find(|n| present(n)) {
                return fail(format!(
                    "{shown}: tensor `{n}` is present beside `qkv`, which holds q, k and v"
                ));
            }
            QkvSource::QkvPacked { qkv, dim }
        }
        (None, Some((kv, dim))) => {
            if let Some(n) = ["k", "v"].into_iter().find(|n| present(n)) {
                return fail(format!(
                    "{shown}: tensor `{n}` is present beside `kv`, which holds k and v"
                ));
            }
            let q = required("q")?;
            if kv.buf.dtype() != q.buf.dtype() {
                return fail(format!(
                    "tensor `kv` has dtype {}, but `q` has {}; q and kv must share one dtype",
                    kv.buf.dtype(),
                    q.buf.dtype()
                ));
            }
            QkvSource::KvPacked { q, kv, dim }
        }
        (None, None) => {
            let q = required("q")?;
            let k = required("k")?;
            let v = required("v")?;
            for (name, t) in [("k", &k), ("v", &v)] {
                if t.buf.dtype() != q.buf.dtype() {
                    return fail(format!(
                        "tensor `{name}` has dtype {}, but `q` has {}; q, k and v must share one dtype",
                        t.buf.dtype(),
                        q.buf.dtype()
                    ));
                }
            }
            QkvSource::Separate([q, k, v])
        }
    };
    let q_dtype = qkv.views()[0].dtype();
    let dout = match get("dout")? {
        Some(t) => Some(decode_float("dout", &t)?),
        None => None,
    };
    if let Some(t) = &dout {
        if t.buf.dtype() != q_dtype {
            return fail(format!(
                "tensor `dout` has dtype {}, but `q` has {q_dtype}; dout must have q's dtype",
                t.buf.dtype(),
            ));
        }
    }
    let alibi_slopes = decode_alibi(get("alibi_slopes")?)?;
    let learnable_sink = match get("learnable_sink")? {
        Some(t) if t.dtype() != Dtype::F32 => {
            return fail(format!(
                "tensor `learnable_sink` has dtype {:?}, expected F32",
                t.dtype()
            ))
        }
        Some(t) => Some(decode_float("learnable_sink", &t)?),
        None => None,
    };
    let cu_seqlens = match (get("cu_seqlens_q")?, get("cu_seqlens_k")?) {
        (Some(cq), Some(ck)) => Some((
            decode_i32("cu_seqlens_q", &cq)?,
            decode_i32("cu_seqlens_k", &ck)?,
        )),
        (None, None) => None,
        (Some(_), None) => return fail(
            "tensor `cu_seqlens_q` is present without `cu_seqlens_k`; the packed layout needs both",
        ),
        (None, Some(_)) => return fail(
            "tensor `cu_seqlens_k` is present without `cu_seqlens_q`; the packed layout needs both",
        ),
    };
    Ok(Inputs {
        qkv,
        alibi_slopes,
        learnable_sink,
        dout,
        cu_seqlens,
    })
}

/// The JSON header of the safetensors file at `path`, if it has one (used to pick the kind of
/// run before reading the whole file; every error is reported later, by the full parse).
pub fn header(path: &Path) -> Option<serde_json::Map<String, serde_json::Value>> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).ok()?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len).ok()?;
    let n = u64::from_le_bytes(len);
    // safetensors caps headers at 100 MB.
    if n > 100_000_000 {
        return None;
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).ok()?;
    serde_json::from_slice(&header).ok()
}

/// The bytes of the file at `path`.
pub fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| CliError(format!("cannot read {}: {e}", path.display())))
}

/// `bytes` as a safetensors file (`shown` names it in errors) whose tensors are all named in
/// `accepted`; `what` qualifies the file in the unexpected-name error (e.g. " in a KV-cache file").
pub fn parse<'a>(
    bytes: &'a [u8],
    shown: &dyn std::fmt::Display,
    accepted: &[&str],
    what: &str,
) -> Result<SafeTensors<'a>> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| {
        CliError(format!(
            "{shown} is not a valid safetensors file: {}",
            describe(&e)
        ))
    })?;
    let mut names: Vec<&String> = st.names();
    names.sort();
    if let Some(bad) = names.iter().find(|n| !accepted.contains(&n.as_str())) {
        return fail(format!(
            "{shown}: unexpected tensor `{bad}`{what}; accepted names: {}",
            accepted.join(", ")
        ));
    }
    Ok(st)
}

/// The tensor `name` of `st`, `None` when the file has none of that name.
pub fn tensor<'a>(
    st: &'a SafeTensors,
    name: &str,
    shown: &dyn std::fmt::Display,
) -> Result<Option<TensorView<'a>>> {
    match st.tensor(name) {
        Ok(t) => Ok(Some(t)),
        Err(safetensors::SafeTensorError::TensorNotFound(_)) => Ok(None),
        Err(e) => fail(format!(
            "{shown}: cannot read tensor `{name}`: {}",
            describe(&e)
        )),
    }
}

/// A readable sentence for a safetensors error (its own Display is its Debug form).
pub fn describe(e: &safetensors::SafeTensorError) -> String {
    use safetensors::SafeTensorError as E;
    match e {
        E::InvalidHeader => "the header is not valid UTF-8".into(),
        E::InvalidHeaderStart => "the header does not start with `{`".into(),
        E::InvalidHeaderDeserialization => "the header is not valid JSON".into(),
        E::HeaderTooLarge => "the header is larger than 100 MB".into(),
        E::HeaderTooSmall => "the file is shorter than its 8-byte header length".into(),
        E::InvalidHeaderLength => "the header length points past the end of the file".into(),
        E::TensorNotFound(name) => format!("no tensor named `{name}`"),
        E::TensorInvalidInfo => "a tensor's shape, dtype and data offsets disagree".into(),
        E::InvalidOffset(name) => format!("tensor `{name}` has invalid data offsets"),
        E::MetadataIncompleteBuffer => "the tensors do not cover the data section exactly".into(),
        E::ValidationOverflow => "a tensor's size overflows".into(),
        other => format!("{other:?}"),
    }
}

/// Little-endian bytes of a buffer, with its safetensors dtype.
pub fn buffer_bytes(buf: &Buffer) -> (Dtype, Vec<u8>) {
    match buf {
        Buffer::F32(d) => (Dtype::F32, d.iter().flat_map(|x| x.to_le_bytes()).collect()),
        Buffer::F16(d) => (
            Dtype::F16,
            d.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        ),
        Buffer::BF16(d) => (
            Dtype::BF16,
            d.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        ),
    }
}

/// An output file of the named tensors (name, buffer, shape), in memory.
pub fn serialize_named(named: &[(&str, &Buffer, &[usize])]) -> Result<Vec<u8>> {
    let encoded: Vec<(&str, Dtype, &[usize], Vec<u8>)> = named
        .iter()
        .map(|(name, buf, shape)| {
            let (dtype, bytes) = buffer_bytes(buf);
            (*name, dtype, *shape, bytes)
        })
        .collect();
    serialize_encoded(&encoded)
}

/// An output file of tensors already encoded: (name, dtype, shape, little-endian bytes).
pub fn serialize_encoded(encoded: &[(&str, Dtype, &[usize], Vec<u8>)]) -> Result<Vec<u8>> {
    let mut tensors = Vec::with_capacity(encoded.len());
    for (name, dtype, shape, bytes) in encoded {
        let view = TensorView::new(*dtype, shape.to_vec(), bytes)
            .map_err(|e| CliError(format!("cannot encode output tensor `{name}`: {e:?}")))?;
        tensors.push((*name, view));
    }
    safetensors::serialize(tensors, &None)
        .map_err(|e| CliError(format!("cannot encode the output: {e:?}")))
}

/// The whole output file (`out`, `lse`, and the gradients when computed: `dq`, `dk`, `dv`, or
/// packed as the inputs were, see [`QkvSource::grads`]) in memory.
pub fn serialize(res: &AttnOutput, grads: Option<(&AttnGrads, &QkvSource)>) -> Result<Vec<u8>> {
    let g = grads.map(|(g, qkv)| qkv.grads(g)).unwrap_or_default();
    let mut named: Vec<(&str, &Buffer, &[usize])> = vec![
        ("out", res.out.buffer(), res.out.shape()),
        ("lse", res.lse.buffer(), res.lse.shape()),
    ];
    named.extend(g.iter().map(|(n, b, s)| (*n, b, &s[..])));
    serialize_named(&named)
}
