// The tensor-core kernels' products (fwd.cu, and bwd.cu and decode.cu for f16/bf16): mma.sync
// m16n8k16 and ldmatrix, and the products built from them over swizzled tiles (tiles.cuh). The
// including file defines NUM_THREADS, HEAD_DIM and SMEM_ROW first; host_emulation.h has the CPU
// twins of the PTX primitives.
#pragma once
#include "tiles.cuh"

#ifdef FA_TENSOR_CORE_KERNEL
#if defined(FA_BF16)
#define MMA_TYPE "bf16"
#else
#define MMA_TYPE "f16"
#endif

#ifndef FA_HOST_EMULATION
// Two floats rounded to one packed pair: `lo` at the lower address.
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
#if defined(FA_BF16)
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

__device__ __forceinline__ u16 from_f32(float x) {
    u16 r;
#if defined(FA_BF16)
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
#endif
    return r;
}

__device__ __forceinline__ void mma16816(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldsm_x4(u32 r[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(u32 r[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
#endif  // FA_HOST_EMULATION

// c0 += A·B[:, 0..8] and c1 += A·B[:, 8..16]: one x4 B fragment from ldmatrix holds both n8
// halves of a 16-column block, so every product below issues its mma.sync in these pairs.
__device__ __forceinline__ void mma_x4(float (&c0)[4], float (&c1)[4], const u32 (&af)[4],
                                       const u32 (&bf)[4]) {
    mma16816(c0, af, bf[0], bf[1]);
    mma16816(c1, af, bf[2], bf[3]);
}

// x[·][NCOLS] = A·Bᵀ for this warp's 16 rows of tile `a` and the NCOLS rows of tile `b` (both
// [rows][HEAD_DIM], swizzled): the forward's S = Q·Kᵀ (and the
// backward's S, dP and their transposes).
template <int NCOLS>
__device__ __forceinline__ void mma_abt(float (&x)[NCOLS / 8][4], const u16* a, const u16* b,
                                        int warp, int lane) {
#pragma unroll
    for (int i = 0; i < NCOLS / 8; ++i) x[i][0] = x[i][1] = x[i][2] = x[i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        u32 af[4];
        ldsm_x4(af, smem_addr(a + swz(warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                      kk * 16 + (lane >> 4) * 8)));
#pragma unroll
        for (int np = 0; np < NCOLS / 16; ++np) {
            u32 bf[4];
            ldsm_x4(bf, smem_addr(b + swz(np * 16 + (lane & 7) + (lane >> 4) * 8,
                                          kk * 16 + ((lane >> 3) & 1) * 8)));
            mma_x4(x[2 * np], x[2 * np + 1], af, bf);
        }
    }
}

// The A fragment of k-step j from this warp's 16 x NK accumulators, rounded to the input type:
// the accumulators of key tiles 2j and 2j + 1.
template <int NK>
__device__ __forceinline__ void pack_kstep(u32 (&a)[4], const float (&x)[NK / 8][4], int j) {
    a[0] = pack2(x[2 * j][0], x[2 * j][1]);
    a[1] = pack2(x[2 * j][2], x[2 * j][3]);
    a[2] = pack2(x[2 * j + 1][0], x[2 * j + 1][1]);
    a[3] = pack2(x[2 * j + 1][2], x[2 * j + 1][3]);
}

// All NK / 16 A fragments of this warp's 16 x NK accumulators (pack_kstep), packed at once.
template <int NK>
__device__ __forceinline__ void pack_a(u32 (&a)[NK / 16][4], const float (&x)[NK / 8][4]) {
#pragma unroll
    for (int j = 0; j < NK / 16; ++j) pack_kstep<NK>(a[j], x, j);
}

// acc[·][HEAD_DIM] += A·B_j for k-step j: `a` the packed A fragment of keys 16j .. 16j + 16 and
// B_j those rows of the tile `b` ([NK][HEAD_DIM], swizzled), read transposed.
__device__ __forceinline__ void mma_kstep_b(float (&acc)[HEAD_DIM / 8][4], const u32 (&a)[4],
                                            const u16* b, int j, int lane) {
#pragma unroll
    for (int dp = 0; dp < HEAD_DIM / 16; ++dp) {
        u32 bf[4];
        ldsm_x4_trans(bf, smem_addr(b + swz(j * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                            dp * 16 + (lane >> 4) * 8)));
        mma_x4(acc[2 * dp], acc[2 * dp + 1], a, bf);
    }
}

// acc[·][HEAD_DIM] += X·B, X given as its packed A fragments (pack_a) and B the tile `b`
// ([NK][HEAD_DIM], swizzled).
template <int NK>
__device__ __forceinline__ void mma_pb(float (&acc)[HEAD_DIM / 8][4], const u32 (&a)[NK / 16][4],
                                       const u16* b, int lane) {
#pragma unroll
    for (int j = 0; j < NK / 16; ++j) mma_kstep_b(acc, a[j], b, j, lane);
}

// acc[·][HEAD_DIM] += X·B, X this warp's 16 x NK accumulators (rounded to the input type as the
// A operand) and B the tile `b` ([NK][HEAD_DIM], swizzled): the tensor-core decode kernel's
// O += P·V and bwd_dq's dQ. Each k-step's fragment is packed just before its products, the order
// those kernels were measured with (fwd.cu's mma_xb_mt does the same: packing all of P first made
// the forward spill); bwd_dkdv packs first (pack_a, mma_pb), which saved it
// registers.
template <int NK>
__device__ __forceinline__ void mma_xb(float (&acc)[HEAD_DIM / 8][4], const float (&x)[NK / 8][4],
                                       const u16* b, int lane) {
#pragma unroll
    for (int j = 0; j < NK / 16; ++j) {
        u32 af[4];
        pack_kstep<NK>(af, x, j);
        mma_kstep_b(acc, af, b, j, lane);
    }
}
#endif  // FA_TENSOR_CORE_KERNEL
