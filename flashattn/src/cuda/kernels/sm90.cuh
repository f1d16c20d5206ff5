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

// --- The warp-specialised kernel's primitives (fwd_sm90_ws.cu) ---------------------------------
// A TMA descriptor (CUtensorMap, encoded on the host by cuTensorMapEncodeTiled) as the kernel
// receives it: by value, as a __grid_constant__ parameter whose address TMA reads.
struct __align__(64) TmaDesc {
    u64 opaque[16];
};

// An mbarrier in shared memory: `count` arrivals (plus the transaction bytes announced with
// expect_tx) complete a phase; waiting threads test the parity of the phase they wait for.
__device__ __forceinline__ void mbar_init(u32 bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// After mbar_init and before the barrier that publishes the mbarriers to the other threads and
// to the async proxy (TMA).
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// One arrival that also announces `bytes` of TMA writes the phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(u32 bar, int parity) {
    u32 ok;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(ok)
        : "r"(bar), "r"(parity)
        : "memory");
    return ok != 0;
}
// Until the phase of parity `parity` has completed. With FA_HANG_TRAP (a debugging build) a
// wait that lasts 2^26 tries (many seconds) traps, which the host sees as a launch failure
// instead of a hang; off by default, since the trap's exit path made ptxas spill the consumer
// warpgroups' registers (NVRTC 13.0: 500 bytes at head_dim 256).
__device__ __forceinline__ void mbar_wait(u32 bar, int parity) {
#ifdef FA_HANG_TRAP
    for (u32 i = 0; !mbar_try_wait(bar, parity); ++i)
        if (i == (1u << 26)) __trap();
#else
    while (!mbar_try_wait(bar, parity)) {
    }
#endif
}

// TMA: the box at coordinates (c0 innermost .. c3) of the tensor `map` describes, into shared
// memory at `dst` (1024-byte aligned for the 128-byte swizzle), completing `bytes` on `bar`.
__device__ __forceinline__ void tma_load_4d(u32 dst, const TmaDesc* map, int c0, int c1, int c2,
                                            int c3, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5}], [%6];" ::"r"(dst),
        "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}

// Named barriers (ids 1..15; 0 is __syncthreads): `sync` waits until `threads` threads have
// arrived or synced on `id`, `arrive` counts this thread without waiting.
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// No memory clobber: it orders the wgmma issues around it (volatile asm keeps their order), not
// memory; with one, ptxas serialised the wgmma pipeline (C7514) between the issue and the wait.
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads));
}

// Moves registers between warpgroups: the producer gives its up, the consumers take them.
template <int N>
__device__ __forceinline__ void regs_dealloc() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}
// A 32-bit load and store at a shared-memory address (the warp-specialised forward's tile slots).
__device__ __forceinline__ int ld_shared_s32(u32 addr) {
    int v;
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ void st_shared_s32(u32 addr, int v) {
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
template <int N>
__device__ __forceinline__ void regs_alloc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
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
