//! The typed kernel key: one struct with named fields decides which source a kernel comes from, the
//! defines it is compiled with, its launch shape, its readable name and its cache identity.
//! Specialisation is by compile-time defines, so a variant pays only for the features it uses.

use super::arch::{Arch, GpuShape};
use crate::tensor::DType;

/// The headers every kernel includes (through common.cuh), by the name it includes them under:
/// the host-kernel contract (params.cuh) and the shared device code, one concern per file.
pub(crate) const COMMON_HEADERS: [(&str, &str); 10] = [
    ("types.cuh", include_str!("kernels/types.cuh")),
    ("params.cuh", include_str!("kernels/params.cuh")),
    ("convert.cuh", include_str!("kernels/convert.cuh")),
    ("mask.cuh", include_str!("kernels/mask.cuh")),
    ("dropout.cuh", include_str!("kernels/dropout.cuh")),
    ("softmax.cuh", include_str!("kernels/softmax.cuh")),
    ("tiles.cuh", include_str!("kernels/tiles.cuh")),
    ("mma.cuh", include_str!("kernels/mma.cuh")),
    ("common.cuh", include_str!("kernels/common.cuh")),
    ("bwd_common.cuh", include_str!("kernels/bwd_common.cuh")),
];
/// The forward kernel sources, embedded in the library (compiled by NVRTC at first use).
pub(crate) const FWD_CU: &str = include_str!("kernels/fwd.cu");
pub(crate) const FWD_F32_CU: &str = include_str!("kernels/fwd_f32.cu");
/// The Hopper forward (wgmma) and its headers.
pub(crate) const FWD_SM90_CU: &str = include_str!("kernels/fwd_sm90.cu");
pub(crate) const SM90_CUH: &str = include_str!("kernels/sm90.cuh");
pub(crate) const SM90_WGMMA_CUH: &str = include_str!("kernels/sm90_wgmma.cuh");
pub(crate) const SM90_ATTN_CUH: &str = include_str!("kernels/sm90_attn.cuh");
/// The e4m3 pieces of fwd_sm90_ws.cu's FP8 mode.
pub(crate) const SM90_FP8_CUH: &str = include_str!("kernels/sm90_fp8.cuh");
/// The warp-specialised Hopper forward (TMA producer, wgmma consumers).
pub(crate) const FWD_SM90_WS_CU: &str = include_str!("kernels/fwd_sm90_ws.cu");
/// The sm_90a FP8 forward (e4m3 q, k, v on wgmma with e4m3 operands).
pub(crate) const FWD_SM90_FP8_CU: &str = include_str!("kernels/fwd_sm90_fp8.cu");
/// The decode kernels (split-KV attention over a KV cache, the merge of the splits, the append).
pub(crate) const DECODE_CU: &str = include_str!("kernels/decode.cu");
/// The backward kernels (dO·O and the LSE per row, dQ, dK and dV).
pub(crate) const BWD_CU: &str = include_str!("kernels/bwd.cu");
/// The Hopper backward (dQ, dK and dV on wgmma; bwd.cu's prep kernel before them).
pub(crate) const BWD_SM90_CU: &str = include_str!("kernels/bwd_sm90.cu");

/// Keys per step of `bwd_dq_sm90` (bwd_sm90.cu: DQ_BLOCK_N): 128 spilled at head_dim 64 with
/// every option on (NVRTC 13.0: 88 bytes).
const SM90_BWD_DQ_KEYS: usize = 64;

/// Granularity of the padded head dimension: the tensor-core kernel walks head_dim in k-steps of
/// 16 and n-tiles of 16, and 32 keeps the number of variants at 8 per dtype.
pub const HEAD_DIM_STEP: usize = 32;

/// Which kernel a [`KernelKey`] names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KernelKind {
    /// `flash_fwd` (fwd.cu, fwd_f32.cu).
    #[default]
    Forward,
    /// `flash_fwd` of fwd_sm90.cu: the same launch on warpgroup tensor-core instructions, for
    /// sm_90a only (f16/bf16 with 16-byte loads; no dropout). With `fp8`, fwd_sm90_fp8.cu: e4m3
    /// inputs on the FP8 tensor cores.
    ForwardSm90,
    /// `flash_fwd` of fwd_sm90_ws.cu: [`KernelKind::ForwardSm90`] warp-specialised, a producer
    /// warpgroup loading with TMA (the launch also passes the tensor maps, cuda/tma.rs).
    ForwardSm90Ws,
    /// `decode_split` (decode.cu): one key split of the query rows of a kv head.
    DecodeSplit,
    /// `decode_combine` (decode.cu): the merge of the splits through their LSEs. Only the dtype
    /// of its key matters (the other fields are canonical: head_dim 32, no flags).
    DecodeCombine,
    /// `decode_append` (decode.cu): new keys (rotated) and values into the caches. As
    /// `DecodeCombine`, only the dtype matters.
    DecodeAppend,
    /// `bwd_prep` (bwd.cu): dO·O and the LSE in the log2 domain per query row. Only the dtype of
    /// its key matters.
    BackwardPrep,
    /// `bwd_dq` (bwd.cu): dQ of one query block.
    BackwardDq,
    /// `bwd_dkdv` (bwd.cu): dK and dV of one key block and kv head.
    BackwardDkDv,
    /// `bwd_dq_sm90` (bwd_sm90.cu): [`KernelKind::BackwardDq`] on warpgroup tensor-core
    /// instructions, for sm_90a only (f16/bf16 with 16-byte loads, head_dim up to 128).
    BackwardDqSm90,
    /// `bwd_dkdv_sm90` (bwd_sm90.cu): [`KernelKind::BackwardDkDv`] on wgmma, as
    /// [`KernelKind::BackwardDqSm90`].
    BackwardDkDvSm90,
}

impl KernelKind {
    pub(crate) fn is_backward(self) -> bool {
        matches!(
            self,
            KernelKind::BackwardPrep | KernelKind::BackwardDq | KernelKind::BackwardDkDv
        )
    }

    /// One of the sm_90a backward kernels (bwd_sm90.cu).
    pub(crate) fn is_sm90_backward(self) -> bool {
        matches!(
            self,
            KernelKind::BackwardDqSm90 | KernelKind::BackwardDkDvSm90
        )
    }
}

/// One compiled variant of a kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelKey {
    pub kind: KernelKind,
    pub dtype: DType,
    /// head_dim rounded up to a multiple of [`HEAD_DIM_STEP`] (the kernel zero-fills the rest).
    pub head_dim: usize,
    /// Causal or sliding window: some key blocks need the per-element mask and some are skipped.
    pub masked: bool,
    pub softcap: bool,
    pub alibi: bool,
    /// Dropout on the probabilities (forward and backward kernels; the mask is regenerated from
    /// the seed, never stored).
    pub dropout: bool,
    /// f16/bf16 only: head_dim and every row/head/batch stride a multiple of 8 elements, so tiles
    /// move 16 bytes at a time by cp.async (otherwise element by element). On
    /// [`KernelKind::DecodeSplit`] it names the tensor-core split kernel ([`Self::decode_tc`]),
    /// which needs that of both caches.
    pub vec_load: bool,
    /// FP8 bytes (e4m3 or e5m2, chosen at launch) with dequantisation factors. Decode split and
    /// append: the KV caches, while q, the new keys and out keep `dtype`. Forward (`dtype` bf16):
    /// q, k and v, widened exactly to bf16 tiles; out is bf16 (`vec_load` then means multiples
    /// of 16 elements, one cp.async of 16 bytes).
    pub fp8: bool,
}

/// Tile shape of a variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tiles {
    pub block_m: usize,
    pub block_n: usize,
    pub num_warps: usize,
}

impl KernelKey {
    /// head_dim rounded up to the kernels' granularity.
    pub fn padded_head_dim(head_dim: usize) -> usize {
        head_dim.div_ceil(HEAD_DIM_STEP) * HEAD_DIM_STEP
    }

    /// Tile sizes, chosen so that acc_o (head_dim / 2 f32 registers per thread and 16-row block on
    /// the tensor-core path; a forward warp owns block_m / (16 · num_warps) blocks) plus the scores
    /// (block_n / 2 per block) stay within 255 registers without spills; checked for every
    /// variant by the compile test.
    pub fn tiles(&self) -> Tiles {
        match self.kind {
            // bwd.cu on tensor cores: 64 query rows per CTA and 64 keys a step (dkdv: 64 keys
            // per CTA, 32 rows a step).
            KernelKind::BackwardDq if self.bwd_tensor_cores() => {
                return Tiles {
                    block_m: 64,
                    block_n: 64,
                    num_warps: 4,
                }
            }
            KernelKind::BackwardDkDv if self.bwd_tensor_cores() => {
                return Tiles {
                    block_m: 32,
                    block_n: 64,
                    num_warps: 4,
                }
            }
            // bwd.cu: 16 query rows per CTA, 32 keys per step (dkdv: 16 keys, 32 rows a step).
            KernelKind::BackwardPrep | KernelKind::BackwardDq => {
                return Tiles {
                    block_m: 16,
                    block_n: 32,
                    num_warps: 4,
                }
            }
            KernelKind::BackwardDkDv => {
                return Tiles {
                    block_m: 32,
                    block_n: 16,
                    num_warps: 4,
                }
            }
            // bwd_sm90.cu: two warpgroups of 64 query rows (dq: 64 keys a step) or of 64 keys
            // (dkdv: `sm90_bwd_rows` query rows a step).
            KernelKind::BackwardDqSm90 => {
                return Tiles {
                    block_m: 128,
                    block_n: SM90_BWD_DQ_KEYS,
                    num_warps: 8,
                }
            }
            KernelKind::BackwardDkDvSm90 => {
                return Tiles {
                    block_m: self.sm90_bwd_rows(),
                    block_n: 128,
                    num_warps: 8,
                }
            }
            _ => {}
        }
        if self.kind == KernelKind::ForwardSm90Ws && self.fp8 {
            // fwd_sm90_ws.cu's FP8 mode: fwd_sm90_fp8.cu's key blocks (128 keys, one 128-byte
            // line of Vᵀ; 64 at head_dim 256) beside the producer warpgroup.
            return Tiles {
                block_m: 128,
                block_n: if self.head_dim <= 128 { 128 } else { 64 },
                num_warps: 12,
            };
        }
        if self.kind == KernelKind::ForwardSm90Ws {
            // Two consumer warpgroups of 64 rows and the producer. The consumers get 240
            // registers each (setmaxnreg): these key blocks keep the scores, P and acc_o within
            // them without spills (NVRTC 13.0, every option on; 80 keys at head_dim 256 as
            // FlashAttention-3, whose shared memory then just fits: 225 KiB).
            return Tiles {
                block_m: 128,
                block_n: match self.head_dim {
                    d if d <= 128 => 128,
                    d if d <= 192 => 64,
                    _ => 80,
                },
                num_warps: 12,
            };
        }
        if self.kind == KernelKind::ForwardSm90 && self.fp8 {
            // fwd_sm90_fp8.cu: two warpgroups of 64 rows, 128 keys (one 128-byte line of the
            // transposed V tile) up to head_dim 128; 64 at 256, where 128 keys' scores beside
            // acc_o spilled with softcap or ALiBi (NVRTC 13.0: 16 to 40 bytes).
            return Tiles {
                block_m: 128,
                block_n: if self.head_dim <= 128 { 128 } else { 64 },
                num_warps: 8,
            };
        }
        if self.kind == KernelKind::ForwardSm90 {
            // Two warpgroups of 64 rows. Key blocks as wide as the registers allow: the scores
            // (block_n / 2 per thread) beside acc_o (head_dim / 2, padded to 64) and P packed
            // (block_n / 4) stay under 255 without spills (NVRTC 13.0: 216 registers at head_dim
            // 128 with 128 keys, 249 at 256 with 64).
            return Tiles {
                block_m: 128,
                block_n: if self.head_dim <= 128 { 128 } else { 64 },
                num_warps: 8,
            };
        }
        if self.decode_tc() {
            // decode.cu, DECODE_TC: 16 query rows (one mma tile), 64-key stages, 4 warps of 16 keys.
            return Tiles {
                block_m: 16,
                block_n: 64,
                num_warps: 4,
            };
        }
        if self.kind != KernelKind::Forward {
            // decode.cu: 16 query rows, 128-key tiles (a key per thread), 4 warps.
            return Tiles {
                block_m: 16,
                block_n: 128,
                num_warps: 4,
            };
        }
        match (self.dtype, self.head_dim) {
            (DType::F32, _) => Tiles {
                block_m: 16,
                block_n: 32,
                num_warps: 4,
            },
            // Four warps of two 16-row blocks each (fwd.cu: M_TILES), as FlashAttention-2: each K
            // and V fragment read from shared memory feeds two mma blocks, and two CTAs share an
            // SM. Past head_dim 64 the two blocks' acc_o take 96 or 128 registers: 64-key blocks
            // then spilled, 32-key blocks fit, except at 128 with FP8 widening or with softcap and
            // ALiBi together (64 bytes on sm_90a without vector loads; NVRTC 13.0, sm_80 and
            // sm_90a; the compile test checks every variant). With dropout's Philox rounds it
            // spilled at every size: those keep eight warps of one block.
            (_, d) if d <= 64 && !self.dropout => Tiles {
                block_m: 128,
                block_n: 64,
                num_warps: 4,
            },
            (_, d)
                if d <= 128
                    && !self.dropout
                    && !(d > 96 && (self.fp8 || (self.softcap && self.alibi))) =>
            {
                Tiles {
                    block_m: 128,
                    block_n: 32,
                    num_warps: 4,
                }
            }
            (_, d) if d <= 128 => Tiles {
                block_m: 128,
                block_n: 64,
                num_warps: 8,
            },
            // At head_dim 256 with softcap, tanhf's temporaries on top of 128 acc_o registers
            // spilled 4 bytes on sm_80 with 32-key blocks (the compile test caught it); so did
            // the FP8 widening with ALiBi and dropout on sm_90a (52 bytes).
            (_, d) if d > 224 && (self.softcap || self.fp8) => Tiles {
                block_m: 64,
                block_n: 16,
                num_warps: 4,
            },
            _ => Tiles {
                block_m: 64,
                block_n: 32,
                num_warps: 4,
            },
        }
    }

    /// Row pitch of the f16/bf16 shared-memory tiles, in elements: a whole number of 8-chunk
    /// swizzle groups.
    fn smem_row(&self) -> usize {
        self.head_dim.div_ceil(64) * 64
    }

    /// Dynamic shared memory of one CTA, bytes.
    pub fn smem_bytes(&self) -> usize {
        let t = self.tiles();
        match self.kind {
            KernelKind::Forward => {}
            // fwd_sm90.cu: q [block_m], k and v double-buffered [2][block_n], rows of head_dim
            // padded to 64, plus 1 KiB to align the tiles to 1024 bytes.
            // fwd_sm90_fp8.cu: one byte per element: q [block_m], k double-buffered [2][block_n],
            // Vᵀ double-buffered [2][head_dim][128] (128-byte lines; the second for the overlap of
            // the softmax with the previous block's P·V), plus 1 KiB to align.
            KernelKind::ForwardSm90 if self.fp8 => {
                return (t.block_m + 2 * t.block_n + 2 * 128) * self.smem_row() + 1024
            }
            KernelKind::ForwardSm90 => {
                return 2 * (t.block_m + 4 * t.block_n) * self.smem_row() + 1024
            }
            // fwd_sm90_ws.cu: q [block_m], k and v in rings of 2 stages [2][block_n], 1 KiB to
            // align, and the mbarriers (q_full, 4 per stage and q_empty, 8 bytes each), then the
            // dynamic scheduler's two tile slots (4 mbarriers and 2 x 4 bytes). FP8: one byte
            // per element, the Vᵀ ring [2][head_dim][128] (128-byte lines) after v, and 6
            // mbarriers per stage.
            KernelKind::ForwardSm90Ws if self.fp8 => {
                return (t.block_m + 4 * t.block_n + 2 * 128) * self.smem_row()
                    + 1024
                    + 8 * 14
                    + 8 * 5
            }
            KernelKind::ForwardSm90Ws => {
                return 2 * (t.block_m + 4 * t.block_n) * self.smem_row() + 1024 + 8 * 10 + 8 * 5
            }
            // decode.cu: the tile's v row offsets [128] (i64), q [16][d] and p [16][128] in
            // f32, two [4 warps][16] reductions, then 5 + 3 per-row statistics of 4 bytes.
            // decode.cu, DECODE_TC: the q tile and double-buffered k and v tiles in the cache's
            // 16-bit type, then a maximum and a sum per (warp, row) in f32.
            KernelKind::DecodeSplit if self.decode_tc() => {
                return 2 * (t.block_m + 4 * t.block_n) * self.smem_row()
                    + 4 * 2 * t.num_warps * t.block_m
            }
            KernelKind::DecodeSplit => {
                return 8 * t.block_n
                    + 4 * (t.block_m * self.head_dim
                        + t.block_m * t.block_n
                        + 2 * t.num_warps * t.block_m
                        + 8 * t.block_m)
            }
            KernelKind::DecodeCombine | KernelKind::DecodeAppend | KernelKind::BackwardPrep => {
                return 0
            }
            // bwd.cu on tensor cores: q and dO tiles of the rows, k and v tiles of the keys, in
            // the input type; the tiles a CTA walks through double-buffered; dkdv's lse2 and dsum
            // of a step's rows, double-buffered, in f32.
            KernelKind::BackwardDq if self.bwd_tensor_cores() => {
                return 2 * (2 * t.block_m + 4 * t.block_n) * self.smem_row()
            }
            KernelKind::BackwardDkDv if self.bwd_tensor_cores() => {
                return 2 * (2 * t.block_n + 4 * t.block_m) * self.smem_row() + 4 * 4 * t.block_m
            }
            // bwd_sm90.cu: the same tiles (rows of head_dim padded to 64), plus 1 KiB to align
            // them to 1024 bytes.
            KernelKind::BackwardDqSm90 => {
                return 2 * (2 * t.block_m + 4 * t.block_n) * self.smem_row() + 1024
            }
            KernelKind::BackwardDkDvSm90 => {
                return 2 * (2 * t.block_n + 4 * t.block_m) * self.smem_row()
                    + 4 * 4 * t.block_m
                    + 1024
            }
            // bwd.cu: q and dO [block_m][d+1], k and v [block_n][d+1], P and dX
            // [block_m][block_n+1], two per-row statistics, all f32.
            KernelKind::BackwardDq | KernelKind::BackwardDkDv => {
                return 4
                    * (2 * (t.block_m + t.block_n) * (self.head_dim + 1)
                        + 2 * t.block_m * (t.block_n + 1)
                        + 2 * t.block_m)
            }
        }
        match self.dtype {
            // q [16][d+1], k [32][d+1], v [32][d], p [16][33]
            DType::F32 => {
                4 * (t.block_m * (self.head_dim + 1)
                    + t.block_n * (self.head_dim + 1)
                    + t.block_n * self.head_dim
                    + t.block_m * (t.block_n + 1))
            }
            // FP8: q [block_m], k and v [block_n] in bf16, then the raw bytes of k and v
            // double-buffered [2][2][block_n][head_dim]
            _ if self.fp8 => {
                2 * (t.block_m + 2 * t.block_n) * self.smem_row() + 4 * t.block_n * self.head_dim
            }
            // q [block_m], k and v double-buffered [2][block_n]
            _ => 2 * (t.block_m + 4 * t.block_n) * self.smem_row(),
        }
    }

    /// Whether this is decode.cu's tensor-core split kernel (`DECODE_TC`): f16/bf16 caches (not
    /// FP8) whose head_dim and strides are multiples of 8 elements.
    pub fn decode_tc(&self) -> bool {
        self.kind == KernelKind::DecodeSplit && self.vec_load
    }

    /// CTAs per SM the kernel is compiled for (`__launch_bounds__`' second value, which caps its
    /// registers): for the tensor-core decode split kernel as many as its shared memory lets an
    /// H100/H200 SM hold (228 KiB, 1 KiB of it kept per CTA), at most 4; 1 for the others.
    pub fn min_blocks(&self) -> usize {
        if !self.decode_tc() {
            return 1;
        }
        let sm = GpuShape::HOPPER.smem_optin + 1024;
        (sm / (self.smem_bytes() + 1024)).clamp(1, 4)
    }

    /// The Hopper twin of a forward key ([`KernelKind::ForwardSm90`]), where that kernel serves
    /// the call: f16/bf16 with 16-byte loads, no dropout, no FP8 inputs. Its head_dim is rounded
    /// up to a multiple of 64 (the kernel's tiles are whole 64-column slabs).
    pub fn sm90_forward(&self) -> Option<KernelKey> {
        if self.fp8 {
            return self.sm90_fp8_forward();
        }
        let eligible = self.kind == KernelKind::Forward
            && self.dtype != DType::F32
            && self.vec_load
            && !self.dropout
            && !self.fp8;
        eligible.then(|| KernelKey {
            kind: KernelKind::ForwardSm90,
            head_dim: self.head_dim.div_ceil(64) * 64,
            ..*self
        })
    }

    /// The FP8 Hopper twin of an FP8 forward key (fwd_sm90_fp8.cu), where that kernel serves the
    /// call: 16-byte loads, no dropout (and e4m3 inputs, which the launch checks: the key does not
    /// name the format). Its head_dim is rounded up to a multiple of 128 (whole 128-byte lines).
    pub fn sm90_fp8_forward(&self) -> Option<KernelKey> {
        let eligible = self.kind == KernelKind::Forward
            && self.fp8
            && self.dtype == DType::BF16
            && self.vec_load
            && !self.dropout;
        eligible.then(|| KernelKey {
            kind: KernelKind::ForwardSm90,
            head_dim: self.head_dim.div_ceil(128) * 128,
            ..*self
        })
    }

    /// The Hopper twin of a `bwd_dq` or `bwd_dkdv` key (bwd_sm90.cu), where that kernel serves the
    /// call: f16/bf16 with 16-byte loads, head_dim up to 128 (rounded up to a multiple of 64: the
    /// kernel's tiles are whole 64-column slabs); dropout, softcap, ALiBi and masks included.
    pub fn sm90_backward(&self) -> Option<KernelKey> {
        let kind = match self.kind {
            KernelKind::BackwardDq => KernelKind::BackwardDqSm90,
            KernelKind::BackwardDkDv => KernelKind::BackwardDkDvSm90,
            _ => return None,
        };
        let eligible = self.dtype != DType::F32 && self.vec_load && self.head_dim <= 128;
        eligible.then(|| KernelKey {
            kind,
            head_dim: self.head_dim.div_ceil(64) * 64,
            ..*self
        })
    }

    /// Query rows per step of `bwd_dkdv_sm90` (bwd_sm90.cu: KV_BLOCK_M), the N of its S and dP
    /// products: 64, or 32 at head_dim 128 with dropout, where dK and dV's accumulators (128
    /// registers) beside 64 rows' Sᵀ, dPᵀ, their packed fragments and the Philox rounds spilled
    /// (NVRTC 13.0, with every other option on: 12 bytes; 247 registers without dropout).
    fn sm90_bwd_rows(&self) -> usize {
        if self.head_dim > 64 && self.dropout {
            32
        } else {
            64
        }
    }

    /// Whether the variant compiles for `arch`: the sm_90a kernels only for compute capability
    /// 9.0 (NVRTC's `sm_90a`), the others for any.
    pub fn builds_for(&self, arch: Arch) -> bool {
        !self.is_sm90() || (arch.major, arch.minor) == (9, 0)
    }

    /// One of the sm_90a kernels (the forward ones and bwd_sm90.cu's).
    pub fn is_sm90(&self) -> bool {
        matches!(
            self.kind,
            KernelKind::ForwardSm90 | KernelKind::ForwardSm90Ws
        ) || self.kind.is_sm90_backward()
    }

    /// Whether `bwd_dq` / `bwd_dkdv` of this key run on tensor cores (f16/bf16, head_dim up to
    /// 128: two head_dim-wide accumulators per thread fit the registers there).
    pub fn bwd_tensor_cores(&self) -> bool {
        matches!(self.kind, KernelKind::BackwardDq | KernelKind::BackwardDkDv)
            && self.dtype != DType::F32
            && self.head_dim <= 128
    }

    pub fn threads(&self) -> usize {
        self.tiles().num_warps * 32
    }

    /// The kernel's source file name and text.
    pub(crate) fn source(&self) -> (&'static str, &'static str) {
        if self.kind.is_sm90_backward() {
            return ("bwd_sm90.cu", BWD_SM90_CU);
        }
        if self.kind.is_backward() {
            return ("bwd.cu", BWD_CU);
        }
        if self.kind == KernelKind::ForwardSm90 && self.fp8 {
            return ("fwd_sm90_fp8.cu", FWD_SM90_FP8_CU);
        }
        if self.kind == KernelKind::ForwardSm90 {
            return ("fwd_sm90.cu", FWD_SM90_CU);
        }
        if self.kind == KernelKind::ForwardSm90Ws {
            return ("fwd_sm90_ws.cu", FWD_SM90_WS_CU);
        }
        if self.kind != KernelKind::Forward {
            return ("decode.cu", DECODE_CU);
        }
        match self.dtype {
            DType::F32 => ("fwd_f32.cu", FWD_F32_CU),
            _ => ("fwd.cu", FWD_CU),
        }
    }

    /// The kernel's entry point in its module.
    pub fn entry(&self) -> &'static str {
        match self.kind {
            KernelKind::Forward | KernelKind::ForwardSm90 | KernelKind::ForwardSm90Ws => {
                "flash_fwd"
            }
            KernelKind::DecodeSplit => "decode_split",
            KernelKind::DecodeCombine => "decode_combine",
            KernelKind::DecodeAppend => "decode_append",
            KernelKind::BackwardPrep => "bwd_prep",
            KernelKind::BackwardDq => "bwd_dq",
            KernelKind::BackwardDkDv => "bwd_dkdv",
            KernelKind::BackwardDqSm90 => "bwd_dq_sm90",
            KernelKind::BackwardDkDvSm90 => "bwd_dkdv_sm90",
        }
    }

    /// The `-D` defines of this variant.
    pub fn defines(&self) -> Vec<(&'static str, String)> {
        let flag = |b: bool| (b as u8).to_string();
        if self.kind.is_sm90_backward() || self.is_sm90() {
            // The sm_90a kernels: whole-slab head_dim, the mask and modifiers, the element type
            // (FP8 inputs write bf16), then each kernel's own defines.
            let elem = if self.fp8 || self.dtype == DType::BF16 {
                "FA_BF16"
            } else {
                "FA_F16"
            };
            let mut d = vec![
                ("HEAD_DIM", self.smem_row().to_string()),
                ("IS_MASKED", flag(self.masked)),
                ("HAS_SOFTCAP", flag(self.softcap)),
                ("HAS_ALIBI", flag(self.alibi)),
                (elem, "1".into()),
            ];
            if self.kind.is_sm90_backward() {
                // bwd_sm90.cu: both kernels' tile sizes, so that one host-emulation build
                // (BWD_SM90_ENTRY=0) runs either.
                let dkdv = KernelKey {
                    kind: KernelKind::BackwardDkDvSm90,
                    ..*self
                };
                let entry = if self.kind == KernelKind::BackwardDqSm90 {
                    "2"
                } else {
                    "3"
                };
                d.extend([
                    ("HAS_DROPOUT", flag(self.dropout)),
                    ("NUM_WG", "2".into()),
                    ("KV_BLOCK_M", dkdv.sm90_bwd_rows().to_string()),
                    ("DQ_BLOCK_N", SM90_BWD_DQ_KEYS.to_string()),
                    ("BWD_SM90_ENTRY", entry.into()),
                ]);
                return d;
            }
            // fwd_sm90.cu / fwd_sm90_ws.cu (16-bit or FP8 mode) / fwd_sm90_fp8.cu: NUM_WG
            // warpgroups compute (the warp-specialised one has a producer warpgroup beside them);
            // each has its own experiment switch.
            let t = self.tiles();
            let ws = self.kind == KernelKind::ForwardSm90Ws;
            if self.fp8 {
                d.push(("FA_FP8_INPUT", "1".into()));
            }
            d.extend([
                ("BLOCK_N", t.block_n.to_string()),
                ("NUM_WG", (t.num_warps / 4 - ws as usize).to_string()),
                if ws {
                    ("SM90_PINGPONG", flag(sm90_pingpong()))
                } else {
                    ("SM90_OVERLAP", flag(sm90_overlap()))
                },
            ]);
            return d;
        }
        let mut d = vec![
            ("HEAD_DIM", self.head_dim.to_string()),
            ("IS_MASKED", flag(self.masked)),
            ("HAS_SOFTCAP", flag(self.softcap)),
            ("HAS_ALIBI", flag(self.alibi)),
            ("HAS_DROPOUT", flag(self.dropout)),
        ];
        if self.kind != KernelKind::Forward {
            let entry = match self.kind {
                KernelKind::DecodeSplit | KernelKind::BackwardPrep => 1,
                KernelKind::DecodeCombine | KernelKind::BackwardDq => 2,
                _ => 3,
            };
            let define = if self.kind.is_backward() {
                "FA_BWD_ENTRY"
            } else {
                "FA_DECODE_ENTRY"
            };
            d.push((define, entry.to_string()));
            if self.kind.is_backward() {
                d.push(("BWD_TENSOR_CORES", flag(self.bwd_tensor_cores())));
                if self.bwd_tensor_cores() {
                    d.push(("SMEM_ROW", self.smem_row().to_string()));
                    d.push(("VEC_LOAD", flag(self.vec_load)));
                }
            }
            match self.dtype {
                DType::BF16 => d.push(("FA_BF16", "1".into())),
                DType::F16 => d.push(("FA_F16", "1".into())),
                DType::F32 => {}
            }
            if self.fp8 {
                d.push(("FA_FP8_CACHE", "1".into()));
            }
            if self.decode_tc() {
                d.push(("DECODE_TC", "1".into()));
                d.push(("SMEM_ROW", self.smem_row().to_string()));
                d.push(("VEC_LOAD", "1".into()));
                d.push(("TC_MIN_BLOCKS", self.min_blocks().to_string()));
            }
            return d;
        }
        if self.dtype != DType::F32 {
            let t = self.tiles();
            d.push(if self.dtype == DType::BF16 {
                ("FA_BF16", "1".into())
            } else {
                ("FA_F16", "1".into())
            });
            d.push(("SMEM_ROW", self.smem_row().to_string()));
            d.push(("BLOCK_M", t.block_m.to_string()));
            d.push(("BLOCK_N", t.block_n.to_string()));
            d.push(("NUM_WARPS", t.num_warps.to_string()));
            d.push(("VEC_LOAD", flag(self.vec_load)));
            if self.fp8 {
                d.push(("FA_FP8_INPUT", "1".into()));
            }
        }
        d
    }

    /// A readable name, e.g. `fwd_bf16_d128_m128n64w8_causal_vec`.
    pub fn name(&self) -> String {
        let t = self.tiles();
        let mut s = match self.kind {
            KernelKind::Forward => format!(
                "fwd_{}_d{}_m{}n{}w{}",
                self.dtype, self.head_dim, t.block_m, t.block_n, t.num_warps
            ),
            KernelKind::ForwardSm90 => format!(
                "fwd_sm90_{}_d{}_m{}n{}",
                self.dtype, self.head_dim, t.block_m, t.block_n
            ),
            KernelKind::ForwardSm90Ws => format!(
                "fwd_sm90ws_{}_d{}_m{}n{}",
                self.dtype, self.head_dim, t.block_m, t.block_n
            ),
            KernelKind::DecodeSplit => format!(
                "decode_{}_d{}{}",
                self.dtype,
                self.head_dim,
                if self.decode_tc() { "_tc" } else { "" }
            ),
            KernelKind::DecodeCombine => return format!("decode_combine_{}", self.dtype),
            KernelKind::DecodeAppend if self.fp8 => {
                return format!("decode_append_{}_fp8", self.dtype)
            }
            KernelKind::DecodeAppend => return format!("decode_append_{}", self.dtype),
            KernelKind::BackwardPrep => return format!("bwd_prep_{}", self.dtype),
            KernelKind::BackwardDq | KernelKind::BackwardDkDv => format!(
                "{}_{}_d{}{}",
                self.entry(),
                self.dtype,
                self.head_dim,
                if self.bwd_tensor_cores() { "_tc" } else { "" }
            ),
            KernelKind::BackwardDqSm90 | KernelKind::BackwardDkDvSm90 => format!(
                "{}_{}_d{}_m{}n{}",
                self.entry(),
                self.dtype,
                self.head_dim,
                t.block_m,
                t.block_n
            ),
        };
        for (on, tag) in [
            (self.masked, "_masked"),
            (self.softcap, "_softcap"),
            (self.alibi, "_alibi"),
            (self.dropout, "_dropout"),
            (
                self.vec_load && self.dtype != DType::F32 && !self.decode_tc(),
                "_vec",
            ),
            (self.fp8, "_fp8"),
        ] {
            if on {
                s.push_str(tag);
            }
        }
        s
    }

    /// Every variant the library can launch (what the CI compile test builds).
    pub fn all() -> Vec<KernelKey> {
        let mut keys = Vec::new();
        for dtype in [DType::F16, DType::BF16, DType::F32] {
            for head_dim in (HEAD_DIM_STEP..=crate::MAX_HEAD_DIM).step_by(HEAD_DIM_STEP) {
                for bits in 0..64u32 {
                    let vec_load = bits & 8 != 0;
                    let fp8 = bits & 32 != 0;
                    if dtype == DType::F32 && vec_load {
                        continue; // the f32 kernel has no vector path
                    }
                    if fp8 && dtype != DType::BF16 {
                        continue; // FP8 inputs compute in bf16
                    }
                    keys.push(KernelKey {
                        kind: KernelKind::Forward,
                        dtype,
                        head_dim,
                        masked: bits & 1 != 0,
                        softcap: bits & 2 != 0,
                        alibi: bits & 4 != 0,
                        dropout: bits & 16 != 0,
                        vec_load,
                        fp8,
                    });
                }
            }
        }
        // fwd_sm90.cu and fwd_sm90_ws.cu in f16 and bf16 at whole 64-column slabs; then
        // fwd_sm90_fp8.cu and fwd_sm90_ws.cu's FP8 mode: e4m3 q, k, v (bf16 out), head_dim 128
        // or 256.
        let slabs: Vec<usize> = (64..=crate::MAX_HEAD_DIM).step_by(64).collect();
        let sm90_sets = [
            (DType::F16, slabs.as_slice(), false),
            (DType::BF16, slabs.as_slice(), false),
            (DType::BF16, [128, 256].as_slice(), true),
        ];
        for (dtype, head_dims, fp8) in sm90_sets {
            for &head_dim in head_dims {
                for bits in 0..8u32 {
                    for kind in [KernelKind::ForwardSm90, KernelKind::ForwardSm90Ws] {
                        keys.push(KernelKey {
                            kind,
                            dtype,
                            head_dim,
                            masked: bits & 1 != 0,
                            softcap: bits & 2 != 0,
                            alibi: bits & 4 != 0,
                            dropout: false,
                            vec_load: true,
                            fp8,
                        });
                    }
                }
            }
        }
        for dtype in [DType::F16, DType::BF16, DType::F32] {
            for head_dim in (HEAD_DIM_STEP..=crate::MAX_HEAD_DIM).step_by(HEAD_DIM_STEP) {
                for bits in 0..32u32 {
                    // bit 16: the tensor-core split kernel, f16/bf16 caches, not FP8.
                    let (fp8, tc) = (bits & 8 != 0, bits & 16 != 0);
                    if tc && (fp8 || dtype == DType::F32) {
                        continue;
                    }
                    keys.push(KernelKey {
                        kind: KernelKind::DecodeSplit,
                        dtype,
                        head_dim,
                        masked: bits & 1 != 0,
                        softcap: bits & 2 != 0,
                        alibi: bits & 4 != 0,
                        dropout: false,
                        vec_load: tc,
                        fp8,
                    });
                }
            }
            keys.push(KernelKey::decode_helper(KernelKind::DecodeCombine, dtype));
            keys.push(KernelKey::decode_helper(KernelKind::DecodeAppend, dtype));
            keys.push(KernelKey {
                fp8: true,
                ..KernelKey::decode_helper(KernelKind::DecodeAppend, dtype)
            });
        }
        for dtype in [DType::F16, DType::BF16, DType::F32] {
            for head_dim in (HEAD_DIM_STEP..=crate::MAX_HEAD_DIM).step_by(HEAD_DIM_STEP) {
                for kind in [KernelKind::BackwardDq, KernelKind::BackwardDkDv] {
                    for bits in 0..32u32 {
                        let key = KernelKey {
                            kind,
                            dtype,
                            head_dim,
                            masked: bits & 1 != 0,
                            softcap: bits & 2 != 0,
                            alibi: bits & 4 != 0,
                            dropout: bits & 16 != 0,
                            vec_load: bits & 8 != 0,
                            fp8: false,
                        };
                        // Only the tensor-core kernels have a vector-load path.
                        if !key.vec_load || key.bwd_tensor_cores() {
                            keys.push(key);
                        }
                    }
                }
            }
            keys.push(KernelKey::backward_prep(dtype));
        }
        // bwd_sm90.cu: f16/bf16 with 16-byte loads, head_dim 64 or 128.
        for dtype in [DType::F16, DType::BF16] {
            for head_dim in [64, 128] {
                for kind in [KernelKind::BackwardDqSm90, KernelKind::BackwardDkDvSm90] {
                    for bits in 0..16u32 {
                        keys.push(KernelKey {
                            kind,
                            dtype,
                            head_dim,
                            masked: bits & 1 != 0,
                            softcap: bits & 2 != 0,
                            alibi: bits & 4 != 0,
                            dropout: bits & 8 != 0,
                            vec_load: true,
                            fp8: false,
                        });
                    }
                }
            }
        }
        keys
    }

    /// The key of [`KernelKind::BackwardPrep`] for `dtype` (only the dtype matters).
    pub fn backward_prep(dtype: DType) -> KernelKey {
        KernelKey {
            kind: KernelKind::BackwardPrep,
            ..KernelKey::decode_helper(KernelKind::DecodeCombine, dtype)
        }
    }

    /// The key of [`KernelKind::DecodeCombine`] or [`KernelKind::DecodeAppend`] for `dtype`.
    pub fn decode_helper(kind: KernelKind, dtype: DType) -> KernelKey {
        KernelKey {
            kind,
            dtype,
            head_dim: HEAD_DIM_STEP,
            masked: false,
            softcap: false,
            alibi: false,
            dropout: false,
            vec_load: false,
            fp8: false,
        }
    }
}

/// Whether the sm_90a forward overlaps the softmax of a key block with the P·V product of the one
/// before (fwd_sm90.cu and fwd_sm90_fp8.cu: SM90_OVERLAP): on unless `FLASHATTN_SM90_OVERLAP=0`
/// (read once per process; for measuring what the overlap buys).
fn sm90_overlap() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("FLASHATTN_SM90_OVERLAP").as_deref() != Ok("0"))
}

/// Whether the two consumer warpgroups of the warp-specialised sm_90a forward take turns issuing
/// their products (fwd_sm90_ws.cu: SM90_PINGPONG): off unless `FLASHATTN_SM90_PINGPONG=1` (read
/// once per process; for measuring what it buys).
fn sm90_pingpong() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("FLASHATTN_SM90_PINGPONG").as_deref() == Ok("1"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// Every variant has its own name (the disk cache's file names and the compile report's rows)
    /// and its own defines (what NVRTC compiles); the FP8 variants are the decode split and
    /// append kernels and the bf16 forwards (fwd.cu, fwd_sm90_fp8.cu, fwd_sm90_ws.cu's FP8 mode),
    /// each with its plain twin.
    #[test]
    fn variants_are_distinct() {
        let keys = KernelKey::all();
        let names: HashSet<String> = keys.iter().map(|k| k.name()).collect();
        assert_eq!(names.len(), keys.len(), "duplicate kernel names");
        let defines: HashSet<(KernelKind, DType, String)> = keys
            .iter()
            .map(|k| (k.kind, k.dtype, format!("{:?}", k.defines())))
            .collect();
        assert_eq!(
            defines.len(),
            keys.len(),
            "two variants with the same defines"
        );
        let fp8: Vec<&KernelKey> = keys.iter().filter(|k| k.fp8).collect();
        assert_eq!(fp8.len(), 3 * 8 * 8 + 3 + 8 * 32 + 2 * 8 + 2 * 8);
        for k in fp8 {
            let define = match k.kind {
                KernelKind::DecodeSplit | KernelKind::DecodeAppend => "FA_FP8_CACHE",
                KernelKind::Forward | KernelKind::ForwardSm90 | KernelKind::ForwardSm90Ws => {
                    assert_eq!(k.dtype, DType::BF16);
                    "FA_FP8_INPUT"
                }
                _ => panic!("{} is FP8", k.name()),
            };
            assert!(k.name().ends_with("_fp8"), "{}", k.name());
            assert!(k.defines().contains(&(define, "1".into())));
            let plain = KernelKey { fp8: false, ..*k };
            assert!(keys.contains(&plain), "{} has no plain twin", k.name());
        }
    }
}
