// Shared-memory tiles of the tensor-core kernels: the swizzle, cp.async copies and the tile load.
// The including file defines NUM_THREADS, HEAD_DIM, SMEM_ROW and VEC_LOAD first;
// host_emulation.h has the CPU twins of the PTX primitives.
#pragma once
#include "types.cuh"

#ifdef FA_TENSOR_CORE_KERNEL
#ifndef FA_HOST_EMULATION
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
    // src_bytes 0 reads nothing and zero-fills the 16 bytes (rows past the sequence, columns past
    // head_dim).
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// 4 bytes (both addresses 4-byte aligned), through L1.
__device__ __forceinline__ void cp_async4(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}
#endif  // FA_HOST_EMULATION

// Element offset of (row, col) in a swizzled tile: the 16-byte chunk index is XORed with row % 8
// inside each group of 8 chunks (SMEM_ROW is a multiple of 64 elements, so groups are whole).
__device__ __forceinline__ int swz(int row, int col) {
    int chunk = col >> 3;
    chunk = (chunk & ~7) | ((chunk ^ row) & 7);
    return row * SMEM_ROW + (chunk << 3) + (col & 7);
}

// Loads `rows` rows (row r from src + (row0 + r) * row_stride) of HEAD_DIM columns into a
// swizzled tile; rows at or past `row_end` and columns at or past `head_dim` become 0.
// RUNNING_OFFSET (the forward's and the dQ kernel's key tiles): see below. The dK/dV kernel keeps
// the plain loop: there the running offset cost registers (d = 128 dropout variants spilled on
// sm_90a), where in the dQ kernel it made room (d = 128 softcap+ALiBi+dropout spilled on sm_80).
template <int ROWS, bool RUNNING_OFFSET = false>
__device__ __forceinline__ void load_tile(u16* tile, const u16* src, i64 row_stride, int row0,
                                          int row_end, int head_dim) {
#if VEC_LOAD
    constexpr int ROW_CHUNKS = HEAD_DIM / 8;
    constexpr int CHUNKS = ROWS * ROW_CHUNKS;
    if constexpr (RUNNING_OFFSET && NUM_THREADS % ROW_CHUNKS == 0) {
        // Chunk c = threadIdx.x + it * NUM_THREADS (as in the loop below; the CTA has
        // NUM_THREADS threads) is in this thread's column in every step, RSTEP rows further on each time: one running element offset
        // instead of a pointer per chunk. (Held across the key loop, those pointers, four for
        // k and four for v at block_n 32, head_dim 128, made 255-register variants spill.)
        constexpr int RSTEP = NUM_THREADS / ROW_CHUNKS;
        const int r0 = threadIdx.x / ROW_CHUNKS, col = (threadIdx.x % ROW_CHUNKS) * 8;
        const bool col_ok = col < head_dim;
        i64 off = (i64)(row0 + r0) * row_stride + col;
        const i64 step = RSTEP * row_stride;
#pragma unroll
        for (int it = 0; it < (ROWS + RSTEP - 1) / RSTEP; ++it) {
            const int r = r0 + it * RSTEP;
            if (ROWS % RSTEP != 0 && r >= ROWS) break;
            const bool ok = row0 + r < row_end && col_ok;
            cp_async16(smem_addr(tile + swz(r, col)), ok ? src + off : src, ok ? 16 : 0);
            off += step;  // (row0 + r + RSTEP) * row_stride + col
        }
    } else {
#pragma unroll
        for (int c = threadIdx.x; c < CHUNKS; c += NUM_THREADS) {
            int r = c / (HEAD_DIM / 8), col = (c % (HEAD_DIM / 8)) * 8;
            bool ok = row0 + r < row_end && col < head_dim;
            const u16* g = ok ? src + (i64)(row0 + r) * row_stride + col : src;
            cp_async16(smem_addr(tile + swz(r, col)), g, ok ? 16 : 0);
        }
    }
#else
    constexpr int ELEMS = ROWS * HEAD_DIM;
    for (int e = threadIdx.x; e < ELEMS; e += NUM_THREADS) {
        int r = e / HEAD_DIM, col = e % HEAD_DIM;
        bool ok = row0 + r < row_end && col < head_dim;
        tile[swz(r, col)] = ok ? src[(i64)(row0 + r) * row_stride + col] : (u16)0;
    }
#endif
}
#endif  // FA_TENSOR_CORE_KERNEL
