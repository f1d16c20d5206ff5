// Hopper (sm_90a) primitives of the warpgroup forward (fwd_sm90.cu): the 128-byte-swizzled
// shared-memory tiles that wgmma reads through matrix descriptors, the descriptors themselves, and
// the wgmma fence / commit / wait. host_emulation.h has the CPU twins of the PTX ones.
//
// Tile layout ("SW128"): a [ROWS][COLS] tile of 16-bit elements (COLS a multiple of 64) is stored
// as COLS / 64 slabs of [ROWS][64]; slab s holds columns 64s .. 64s + 63, each row one 128-byte
// line, and inside a line the 16-byte chunk c of row r sits at chunk position c ^ (r % 8). Every
// slab starts 1024-byte aligned. This is the canonical 128-byte-swizzle layout of the PTX ISA's
// wgmma matrix descriptors: read K-major (rows = M or N, columns = K: Q and K for S = Q·Kᵀ) the
// 8-row groups lie 1024 bytes apart (the stride byte offset); read MN-major (rows = K, columns = N:
// V for O = P·V) the 8-row groups of K lie 1024 bytes apart and the 64-column groups of N one slab
// apart (the leading byte offset). The hardware applies the XOR to address bits 4-6 from bits
// 7-9, so tiles and slabs must be 1024-byte aligned.
#pragma once

typedef unsigned long long u64;

// Element offset of (row, col) in a SW128 tile of `rows` rows.
__device__ __forceinline__ int sw128(int row, int col, int rows) {
    return (col >> 6) * rows * 64 + row * 64 + ((((col >> 3) & 7) ^ (row & 7)) << 3) + (col & 7);
}

// A wgmma matrix descriptor: start address, leading and stride byte offsets (each >> 4 in 14
// bits), base offset 0 (1024-aligned tiles), swizzle mode 1 (128 bytes) in bits 62-63.
__device__ __forceinline__ u64 wgmma_desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((lbo >> 4) & 0x3FFF) << 16) |
           ((u64)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

// K-major operand (A or B of S = Q·Kᵀ): rows `row0` .. of the SW128 tile at shared address `tile`
// (`rows` rows per slab), k-step kk (16 elements): slab kk / 4, 32 bytes per k-step inside the
// line. The leading byte offset is unused with this swizzle (16, as the ISA's examples set it).
__device__ __forceinline__ u64 desc_kmajor(u32 tile, int rows, int row0, int kk) {
    return wgmma_desc(tile + (kk >> 2) * rows * 128 + row0 * 128 + (kk & 3) * 32, 16, 1024);
}

// MN-major operand (B of O = P·V, V stored [keys][head_dim]): k-step kk covers keys
// 16kk .. 16kk + 15 (two 8-row groups, 2048 bytes); the N dimension crosses slabs of `rows` rows.
__device__ __forceinline__ u64 desc_mnmajor(u32 tile, int rows, int kk) {
    return wgmma_desc(tile + kk * 2048, rows * 128, 1024);
}

#ifndef FA_HOST_EMULATION
// Orders this thread's earlier register accesses before the warpgroup's next wgmma.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
// Closes the group of wgmma issued since the last commit.
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
// Waits until at most N committed groups are still in flight; their accumulators are then
// readable.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Makes this thread's generic-proxy writes to shared memory (st.shared, cp.async) visible to the
// async proxy that wgmma reads through; then a barrier hands them to the other threads.
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// Keeps the compiler from moving accesses of `x` across a wgmma fence / wait.
__device__ __forceinline__ void reg_fence(float& x) { asm volatile("" : "+f"(x)::"memory"); }
#include "sm90_wgmma.cuh"
#endif

// reg_fence on every accumulator of a tile: after a wgmma wait (so no read of them moves above
// it) and before an issue that accumulates into them (so no write moves below it). The compiler
// sees wgmma write its accumulators at the issue; only these keep their uses behind the wait.
template <int N>
__device__ __forceinline__ void reg_fence_all(float (&x)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        reg_fence(x[i][0]);
        reg_fence(x[i][1]);
        reg_fence(x[i][2]);
        reg_fence(x[i][3]);
    }
}
