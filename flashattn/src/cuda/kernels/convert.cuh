// Element conversions of the CUDA-core kernels (elem_t, to_f32, from_f32_elem) and of FP8 bytes
// (fp8_to_f32). The tensor-core kernels' packed conversions are in mma.cuh.
#pragma once
#include "types.cuh"

#ifdef FA_CUDA_CORE_ELEM
// The element type of the CUDA-core kernels (decode.cu, bwd.cu), widened to f32 as it is loaded
// and rounded once when stored: FA_BF16 or FA_F16 (raw 16-bit words), else f32.
#if defined(FA_BF16) || defined(FA_F16)
typedef u16 elem_t;
#else
typedef float elem_t;
#endif

#ifndef FA_HOST_EMULATION
__device__ __forceinline__ float to_f32(elem_t x) {
#if defined(FA_BF16)
    return __int_as_float((int)((u32)x << 16));
#elif defined(FA_F16)
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
#else
    return x;
#endif
}

__device__ __forceinline__ elem_t from_f32_elem(float x) {
#if defined(FA_BF16)
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
#elif defined(FA_F16)
    u16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
#else
    return x;
#endif
}
#else
inline float to_f32(elem_t x) {
#if defined(FA_BF16) || defined(FA_F16)
    return emu::half_to_float(x);
#else
    return x;
#endif
}
inline elem_t from_f32_elem(float x) {
#if defined(FA_BF16) || defined(FA_F16)
    return emu::float_to_half(x);
#else
    return x;
#endif
}
#endif  // FA_HOST_EMULATION
#endif  // FA_CUDA_CORE_ELEM

#if defined(FA_FP8_CACHE) || defined(FA_FP8_INPUT)
// The value of FP8 byte `b` as f32, exactly. The magnitude's bits, shifted so that the format's
// exponent field lands in f32's, read as an f32 whose exponent is off by the bias difference
// (120 for e4m3, 112 for e5m2) and multiplied back by that power of two: exact for normal and
// subnormal inputs alike (the shifted subnormals are f32 denormals; nothing here flushes them, as
// NVRTC's default is -ftz=false and the files ask for no fast math). Specials: e4m3 (E4M3FN) has
// no infinities and one NaN magnitude, 0x7f; e5m2's are IEEE's (exponent field 31).
__device__ __forceinline__ float fp8_to_f32(u32 b, int e5m2) {
    const u32 mag = b & 0x7fu;
    float x = e5m2 ? __int_as_float((int)(mag << 21)) * __int_as_float(0x77800000)   // 2^112
                   : __int_as_float((int)(mag << 20)) * __int_as_float(0x7b800000);  // 2^120
    if (e5m2 ? mag >= 0x7cu : mag == 0x7fu)
        x = e5m2 && mag == 0x7cu ? FA_INF : __int_as_float(0x7fc00000);
    return (b & 0x80u) ? -x : x;
}
#endif
