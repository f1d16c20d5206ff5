// The scalar types and constants every kernel file shares, and the host emulation's stand-ins for
// the CUDA primitives when built with FA_HOST_EMULATION. Compiled by NVRTC with no CUDA headers:
// half types are carried as raw 16-bit words and converted with PTX `cvt`, so nothing depends on
// cuda_fp16.h / cuda_bf16.h.
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#ifdef FA_HOST_EMULATION
// The CPU twin of the CUDA primitives (tests/cuda_emulated.rs); NVRTC never sees this branch.
#include "host_emulation.h"
#endif

// offsetof for the layout checks of params.cuh: NVRTC (no <cstddef>) has EDG's __INTADDR__, g++
// (the host emulation) __builtin_offsetof.
#ifdef __CUDACC_RTC__
#define FA_OFFSETOF(T, field) __INTADDR__(&(((T*)0)->field))
#else
#define FA_OFFSETOF(T, field) __builtin_offsetof(T, field)
#endif

#define FA_INF __int_as_float(0x7f800000)
#define FA_LOG2E 1.4426950408889634f
#define FA_LN2 0.6931471805599453f

#ifndef FA_HOST_EMULATION
#define FA_DYNAMIC_SMEM(T, name) extern __shared__ __align__(128) T name[]
#endif
