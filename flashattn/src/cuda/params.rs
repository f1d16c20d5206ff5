//! The host-kernel contract: one `#[repr(C)]` struct per kernel family, which a launch passes by
//! value as the kernel's only parameter (the warp-specialised sm_90a forward takes its tensor maps
//! after it). Each struct is mirrored field for field by a C struct in `kernels/params.cuh`; both
//! sides check the same size and offsets at compile time, and the host-emulation tests compare
//! every field's offset with the C side's and run the kernels on the bytes written here.
//!
//! Layout rules, so that neither compiler adds padding: 8-byte fields first (device addresses,
//! i64), then 4-byte ones, and an explicit `pad` where they leave the size short of a multiple of
//! 8. Device addresses are [`CUdeviceptr`]s (u64; 0 for a null pointer), filled in at launch from
//! the buffers' `device_ptr`; a launch description carries them as 0.
//!
//! Adding a field: add it here and in params.cuh at the same place, update both size checks (and
//! the offsets checked when they move), and set it where the launch description is built.

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::DeviceRepr;

/// Declares a contract struct: `#[repr(C)]`, plain data, and (for the tests) its fields' names,
/// offsets and sizes.
macro_rules! contract {
    ($(#[$m:meta])* pub struct $name:ident { $($(#[$fm:meta])* pub $f:ident: $t:ty,)* }) => {
        $(#[$m])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default, PartialEq)]
        pub struct $name {
            $($(#[$fm])* pub $f: $t,)*
        }

        impl $name {
            /// Every field's name, byte offset and size, in declaration order.
            #[cfg(any(test, feature = "test-hooks"))]
            pub fn fields() -> Vec<FieldLayout> {
                vec![$(FieldLayout {
                    name: stringify!($f),
                    offset: core::mem::offset_of!($name, $f),
                    size: size_of::<$t>(),
                },)*]
            }

            /// The struct's bytes, as the kernel receives them.
            pub fn as_bytes(&self) -> &[u8] {
                // SAFETY: the struct is repr(C) of integer and float fields (and contract structs
                // of such fields) with no padding: the size checks below equal the sum of the
                // fields' sizes (checked by `no_padding`), so every byte is initialised.
                unsafe {
                    std::slice::from_raw_parts(
                        (self as *const $name).cast::<u8>(),
                        size_of::<$name>(),
                    )
                }
            }
        }

        // SAFETY: repr(C) plain data with no padding (see `as_bytes`), laid out as its mirror in
        // params.cuh (the size and offset checks below and in params.cuh, and the emulation
        // tests' field-by-field comparison); the driver copies the bytes as the kernel parameter.
        unsafe impl DeviceRepr for $name {}
    };
}

contract! {
    /// Dropout on the probabilities (dropout.cuh: Dropout; dropout.rs): the Philox seed's halves,
    /// the keep threshold round((1 - p) · 2^32) and 1 / (1 - p); threshold 2^32 and scale 1
    /// without dropout.
    pub struct DropoutParams {
        pub seed_lo: u32,
        pub seed_hi: u32,
        pub threshold: i64,
        pub scale: f32,
        pub pad: u32,
    }
}

const _: () = assert!(size_of::<DropoutParams>() == 24);
const _: () = assert!(core::mem::offset_of!(DropoutParams, threshold) == 8);

impl DropoutParams {
    pub(crate) fn new(d: Option<crate::dropout::Dropout>) -> DropoutParams {
        d.map_or(
            DropoutParams {
                threshold: 1 << 32,
                scale: 1.0,
                ..Default::default()
            },
            |d| DropoutParams {
                seed_lo: d.seed() as u32,
                seed_hi: (d.seed() >> 32) as u32,
                threshold: d.threshold() as i64,
                scale: d.scale(),
                pad: 0,
            },
        )
    }
}

contract! {
    /// Every forward kernel's parameters (fwd.cu, fwd_f32.cu, fwd_sm90.cu, fwd_sm90_ws.cu, FP8
    /// inputs included); params.cuh: FwdParams documents each field. Strides in elements; window
    /// sides -1 for unbounded; null (0) for the tables a call does not use.
    pub struct FwdParams {
        pub q: CUdeviceptr,
        pub k: CUdeviceptr,
        pub v: CUdeviceptr,
        pub out: CUdeviceptr,
        pub lse: CUdeviceptr,
        /// Packed calls: SEQ_FIELDS i64 per launched sequence; batched calls: null.
        pub seqs: CUdeviceptr,
        /// ALiBi: `heads` slopes per launched sequence.
        pub alibi_slopes: CUdeviceptr,
        /// FP8 inputs: the score scale and the v factor per (launched sequence, kv head), then
        /// any per-block tables (`block_q`).
        pub descale: CUdeviceptr,
        /// Learnable sinks: `heads` logits per launched sequence.
        pub sink: CUdeviceptr,
        pub q_row_stride: i64,
        pub q_head_stride: i64,
        pub k_row_stride: i64,
        pub k_head_stride: i64,
        pub v_row_stride: i64,
        pub v_head_stride: i64,
        pub lse_head_stride: i64,
        /// Batched calls: how far one sequence's q, k and v rows sit from the previous one's.
        pub q_batch_stride: i64,
        pub k_batch_stride: i64,
        pub v_batch_stride: i64,
        pub drop: DropoutParams,
        pub heads: i32,
        pub heads_kv: i32,
        pub head_dim: i32,
        pub softmax_scale: f32,
        pub softcap: f32,
        /// Window sides, -1 unbounded, clamped to seqlen_q + seqlen_k.
        pub window_left: i32,
        pub window_right: i32,
        /// Batched calls: every sequence's lengths (packed calls: the longest).
        pub batch_seqlen_q: i32,
        pub batch_seqlen_k: i32,
        /// FP8 inputs: 1 for e5m2, 0 for e4m3 (and for 16-bit and f32 inputs).
        pub fp8_e5m2: i32,
        /// Launched sequences (packed calls: the table's rows; batched calls: the batch): the
        /// tile grid of fwd_sm90_ws.cu's persistent launch.
        pub num_seqs: i32,
        pub pad: u32,
        /// Per-block FP8 factors (0: none): the offsets in `descale` of the q, k and v tables
        /// (params.cuh: FwdParams).
        pub block_q: i32,
        pub block_k: i32,
        pub block_v: i32,
        /// Blocks of 128 rows per (sequence, head) row of the q table and of the k and v ones.
        pub q_blocks: i32,
        pub k_blocks: i32,
        pub pad2: u32,
    }
}

const _: () = assert!(size_of::<FwdParams>() == 248);
const _: () = assert!(core::mem::offset_of!(FwdParams, block_q) == 224);
const _: () = assert!(core::mem::offset_of!(FwdParams, q_row_stride) == 72);
const _: () = assert!(core::mem::offset_of!(FwdParams, drop) == 152);
const _: () = assert!(core::mem::offset_of!(FwdParams, heads) == 176);
const _: () = assert!(core::mem::offset_of!(FwdParams, fp8_e5m2) == 212);

contract! {
    /// The backward kernels' parameters (bwd.cu: bwd_prep, bwd_dq, bwd_dkdv); params.cuh:
    /// BwdParams documents each field.
    pub struct BwdParams {
        pub q: CUdeviceptr,
        pub k: CUdeviceptr,
        pub v: CUdeviceptr,
        pub out: CUdeviceptr,
        pub dout: CUdeviceptr,
        /// The caller's lse view (lse_view_* strides).
        pub lse: CUdeviceptr,
        /// The f32 workspaces, laid out as the forward's contiguous lse (lse_head_stride).
        pub lse2: CUdeviceptr,
        pub dsum: CUdeviceptr,
        pub dq: CUdeviceptr,
        pub dk: CUdeviceptr,
        pub dv: CUdeviceptr,
        /// BWD_FIELDS i64 per launched sequence.
        pub seqs: CUdeviceptr,
        /// ALiBi: `heads` slopes per launched sequence.
        pub alibi_slopes: CUdeviceptr,
        pub q_row_stride: i64,
        pub q_head_stride: i64,
        pub k_row_stride: i64,
        pub k_head_stride: i64,
        pub v_row_stride: i64,
        pub v_head_stride: i64,
        pub out_row_stride: i64,
        pub out_head_stride: i64,
        pub dout_row_stride: i64,
        pub dout_head_stride: i64,
        pub lse_view_head_stride: i64,
        pub lse_view_row_stride: i64,
        pub lse_head_stride: i64,
        pub drop: DropoutParams,
        pub heads: i32,
        pub heads_kv: i32,
        pub head_dim: i32,
        pub softmax_scale: f32,
        pub softcap: f32,
        /// Window sides, -1 unbounded, clamped to seqlen_q + seqlen_k.
        pub window_left: i32,
        pub window_right: i32,
        pub pad: u32,
    }
}

const _: () = assert!(size_of::<BwdParams>() == 264);
const _: () = assert!(core::mem::offset_of!(BwdParams, q_row_stride) == 104);
const _: () = assert!(core::mem::offset_of!(BwdParams, drop) == 208);
const _: () = assert!(core::mem::offset_of!(BwdParams, heads) == 232);
const _: () = assert!(core::mem::offset_of!(BwdParams, window_right) == 256);

contract! {
    /// The decode kernels' parameters (decode.cu: decode_append, decode_split, decode_combine),
    /// one for the three launches of a call; params.cuh: DecodeParams documents each field.
    /// Strides in elements; window sides -1 for unbounded; null (0) for the tables a call does
    /// not use.
    pub struct DecodeParams {
        pub q: CUdeviceptr,
        /// Elements of q's type, or FP8 bytes: written by the append, read by the splits.
        pub k_cache: CUdeviceptr,
        pub v_cache: CUdeviceptr,
        /// The new keys and values (null without an append).
        pub k_new: CUdeviceptr,
        pub v_new: CUdeviceptr,
        pub out: CUdeviceptr,
        pub lse: CUdeviceptr,
        /// The splits' partial rows (f32, `splits · total_rows` rows of head_dim) and LSEs.
        pub ws_o: CUdeviceptr,
        pub ws_lse: CUdeviceptr,
        /// DECODE_FIELDS i64 per launched sequence.
        pub seqs: CUdeviceptr,
        /// The page of (sequence, block), `batch · max_blocks` i32.
        pub pages: CUdeviceptr,
        /// ALiBi: `heads` slopes per launched sequence.
        pub alibi_slopes: CUdeviceptr,
        /// Rotary: `rot_half` cos then `rot_half` sin per (sequence, position).
        pub rot: CUdeviceptr,
        /// FP8 caches: three factors per (launched sequence, kv head).
        pub descale: CUdeviceptr,
        /// Learnable sinks: `heads` logits per launched sequence.
        pub sink: CUdeviceptr,
        pub q_row_stride: i64,
        pub q_head_stride: i64,
        pub k_page_stride: i64,
        pub k_row_stride: i64,
        pub k_head_stride: i64,
        pub v_page_stride: i64,
        pub v_row_stride: i64,
        pub v_head_stride: i64,
        /// k_new and v_new (0 without new keys).
        pub kn_row_stride: i64,
        pub kn_head_stride: i64,
        pub vn_row_stride: i64,
        pub vn_head_stride: i64,
        pub lse_head_stride: i64,
        /// Rows of out (total_q · heads): the stride of one split in the workspace.
        pub total_rows: i64,
        /// The sequences the append writes (the launched ones less a tail of packed rows).
        pub batch: i32,
        pub heads: i32,
        pub heads_kv: i32,
        pub head_dim: i32,
        pub splits: i32,
        pub page_size: i32,
        pub max_blocks: i32,
        pub softmax_scale: f32,
        pub softcap: f32,
        /// Window sides, -1 unbounded, clamped to seqlen_q + seqlen_k.
        pub window_left: i32,
        pub window_right: i32,
        pub rot_half: i32,
        pub rot_interleaved: i32,
        pub rot_npos: i32,
        /// 1 when head_dim and every k cache stride are multiples of 8 elements: the CUDA-core
        /// `decode_split` reads keys 16 bytes at a time.
        pub vec_loads: i32,
        /// FP8 caches: 1 for e5m2, 0 for e4m3 (and for caches that are not FP8).
        pub fp8_e5m2: i32,
    }
}

const _: () = assert!(size_of::<DecodeParams>() == 296);
const _: () = assert!(core::mem::offset_of!(DecodeParams, q_row_stride) == 120);
const _: () = assert!(core::mem::offset_of!(DecodeParams, batch) == 232);
const _: () = assert!(core::mem::offset_of!(DecodeParams, softmax_scale) == 260);
const _: () = assert!(core::mem::offset_of!(DecodeParams, fp8_e5m2) == 292);

/// One field of a contract struct: its name, byte offset and size.
#[cfg(any(test, feature = "test-hooks"))]
#[derive(Clone, Copy, Debug)]
pub struct FieldLayout {
    pub name: &'static str,
    pub offset: usize,
    pub size: usize,
}

/// One contract struct: its C name (params.cuh), size and fields in declaration order.
#[cfg(any(test, feature = "test-hooks"))]
#[derive(Clone, Debug)]
pub struct StructLayout {
    pub name: &'static str,
    pub size: usize,
    pub fields: Vec<FieldLayout>,
}

/// Every contract struct, for the tests that compare them with the C side's.
#[cfg(any(test, feature = "test-hooks"))]
pub fn layouts() -> Vec<StructLayout> {
    let layout = |name, size, fields| StructLayout { name, size, fields };
    vec![
        layout(
            "DropoutParams",
            size_of::<DropoutParams>(),
            DropoutParams::fields(),
        ),
        layout("FwdParams", size_of::<FwdParams>(), FwdParams::fields()),
        layout("BwdParams", size_of::<BwdParams>(), BwdParams::fields()),
        layout(
            "DecodeParams",
            size_of::<DecodeParams>(),
            DecodeParams::fields(),
        ),
    ]
}

#[cfg(test)]
mod tests {
    /// Every struct's fields tile it exactly: no padding byte the kernels or `as_bytes` could
    /// see uninitialised.
    #[test]
    fn no_padding() {
        for s in super::layouts() {
            let mut end = 0;
            for f in &s.fields {
                assert_eq!(f.offset, end, "{}.{} follows a gap", s.name, f.name);
                end = f.offset + f.size;
            }
            assert_eq!(end, s.size, "{} has tail padding", s.name);
        }
    }
}
