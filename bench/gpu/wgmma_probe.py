"""Layout probe for the sm_90a forward's building blocks, on a Hopper GPU (CuPy compiles with its
NVRTC): does wgmma, fed through sm90.cuh's descriptors and SW128 tiles, compute exactly the
products the kernel assumes?

  ss: D[128][128] = A[128][128] · B[128][128]ᵀ, two warpgroups (rows 0-63 and 64-127 of A), both
      operands K-major in SW128 tiles of two slabs (what S = Q·Kᵀ does at head_dim 128);
  rs: D[128][128] = P[128][64] · V[64][128], P from registers (the m16n8k16 A fragment), V
      MN-major in a SW128 tile of two slabs (O = P·V at head_dim 128), with the leading / stride
      byte offsets as sm90.cuh sets them and swapped (variant 1), to tell which the hardware wants.

Inputs are small multiples of 1/8, so every product and sum is exact in f32: a match is bit for bit.
Prints one line per case; writes the arrays of a failing case to $OUT (or /tmp) as .npy.

    python3 bench/gpu/wgmma_probe.py
"""
import os
import pathlib
import sys

import numpy as np

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "flashattn/src/cuda/kernels"

SRC = r"""
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
#define MMA_TYPE "bf16"
#include "sm90.cuh"

__device__ __forceinline__ u16* aligned_smem(unsigned char* raw) {
    u32 base = (u32)__cvta_generic_to_shared(raw);
    return (u16*)(raw + ((1024 - (base & 1023)) & 1023));
}

__device__ __forceinline__ void store_acc(float* d_out, const float (&d)[16][4], int ld) {
    const int wg = threadIdx.x / 128, w = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            d_out[(64 * wg + 16 * w + g + 8 * (e >> 1)) * ld + 8 * j + 2 * t + (e & 1)] = d[j][e];
}

extern "C" __global__ void __launch_bounds__(256, 1)
probe_ss(const u16* a, const u16* b, float* d_out) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    u16* sa = aligned_smem(smem_raw);  // [128][128], 2 slabs
    u16* sb = sa + 128 * 128;          // [128][128], 2 slabs
    for (int i = threadIdx.x; i < 128 * 128; i += 256) {
        sa[sw128(i / 128, i % 128, 128)] = a[i];
        sb[sw128(i / 128, i % 128, 128)] = b[i];
    }
    fence_proxy_async();
    __syncthreads();
    const int wg = threadIdx.x / 128;
    const u32 ta = (u32)__cvta_generic_to_shared(sa), tb = (u32)__cvta_generic_to_shared(sb);
    float d[16][4];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
        Wgmma<128>::ss(d, desc_kmajor(ta, 128, 64 * wg, kk), desc_kmajor(tb, 128, 0, kk), kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    store_acc(d_out, d, 128);
}

__device__ __forceinline__ u32 pair(const u16* p) { return (u32)p[0] | ((u32)p[1] << 16); }

extern "C" __global__ void __launch_bounds__(256, 1)
probe_rs(const u16* p, const u16* v, float* d_out, int variant) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    u16* sv = aligned_smem(smem_raw);  // [64 keys][128 dims], 2 slabs of 64 rows
    for (int i = threadIdx.x; i < 64 * 128; i += 256) sv[sw128(i / 128, i % 128, 64)] = v[i];
    fence_proxy_async();
    __syncthreads();
    const int wg = threadIdx.x / 128, w = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4, row = 64 * wg + 16 * w + g;
    const u32 tv = (u32)__cvta_generic_to_shared(sv);
    float d[16][4];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        u32 af[4];
        const int c = 16 * kk + 2 * t;
        af[0] = pair(p + row * 64 + c);
        af[1] = pair(p + (row + 8) * 64 + c);
        af[2] = pair(p + row * 64 + c + 8);
        af[3] = pair(p + (row + 8) * 64 + c + 8);
        const u64 desc = variant == 0 ? desc_mnmajor(tv, 64, kk)
                                      : wgmma_desc(tv + kk * 2048, 1024, 64 * 128);
        Wgmma<128>::rs(d, af, desc, kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    store_acc(d_out, d, 128);
}
"""


def bf16_bits(x):
    """float32 values exactly representable in bf16 -> their bf16 bit patterns."""
    return (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def main():
    import cupy as cp

    out_dir = pathlib.Path(os.environ.get("OUT", "/tmp"))
    rng = np.random.default_rng(7)
    small = lambda *s: rng.integers(-8, 9, size=s).astype(np.float32) / 8  # noqa: E731
    mod = cp.RawModule(code=SRC, options=("--gpu-architecture=sm_90a", "-std=c++17",
                                          f"-I{KERNELS}"))
    def check(name, got, want):
        bad = np.argwhere(got != want)
        ok = len(bad) == 0 and not np.isnan(got).any()
        first = "" if ok else f"; first wrong at {tuple(bad[0])}: got {got[tuple(bad[0])]}, want {want[tuple(bad[0])]}"
        print(f"{name}: {'exact' if ok else f'{len(bad)} of {got.size} wrong'}{first}", flush=True)
        if not ok:
            np.save(out_dir / f"probe_{name}_got.npy", got)
            np.save(out_dir / f"probe_{name}_want.npy", want)
        return ok

    a, b = small(128, 128), small(128, 128)
    d = cp.full((128, 128), np.nan, dtype=cp.float32)
    f = mod.get_function("probe_ss")
    f.max_dynamic_shared_size_bytes = 2 * 128 * 128 * 2 + 1024
    f((1,), (256,), (cp.asarray(bf16_bits(a)), cp.asarray(bf16_bits(b)), d),
      shared_mem=2 * 128 * 128 * 2 + 1024)
    ss_ok = check("ss_k128_n128_two_warpgroups", cp.asnumpy(d), (a.astype(np.float64) @ b.T).astype(np.float32))

    p, v = small(128, 64), small(64, 128)
    want = (p.astype(np.float64) @ v).astype(np.float32)
    g = mod.get_function("probe_rs")
    g.max_dynamic_shared_size_bytes = 64 * 128 * 2 + 1024
    rs_ok = []
    for variant in (0, 1):
        d = cp.full((128, 128), np.nan, dtype=cp.float32)
        g((1,), (256,), (cp.asarray(bf16_bits(p)), cp.asarray(bf16_bits(v)), d, np.int32(variant)),
          shared_mem=64 * 128 * 2 + 1024)
        cp.cuda.runtime.deviceSynchronize()
        rs_ok.append(check(f"rs_trans_b_variant{variant}", cp.asnumpy(d), want))
    print(f"probe: ss {'ok' if ss_ok else 'WRONG'}, rs as sm90.cuh {'ok' if rs_ok[0] else 'WRONG'}"
          f", rs with the offsets swapped {'ok' if rs_ok[1] else 'wrong'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
