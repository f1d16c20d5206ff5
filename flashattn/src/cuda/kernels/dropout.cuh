// Dropout on the probabilities: the Philox mask of dropout.rs, regenerated bit for bit.
#pragma once
#include "params.cuh"

// Dropout on the probabilities, the mask of dropout.rs regenerated bit for bit: Philox 4x32-10
// keyed by the seed, counter (key / 4, query row, head, sequence); key j uses word j % 4 and is
// kept iff that word is below `threshold` = round((1 - p) · 2^32) (at most 2^32, hence 64-bit).
// Kept probabilities are scaled by `scale` = 1 / (1 - p); the softmax normaliser and the LSE are
// those of the undropped probabilities, as on the CPU. The fields are the launch's DropoutParams
// (params.cuh); built as `Dropout{p.drop}`.
struct Dropout : DropoutParams {
    // The four words of keys 4·group .. 4·group + 3 of (sequence b, head h, query row i).
    __device__ __forceinline__ void words(u32 c[4], int group, int i, int h, int b) const {
        c[0] = (u32)group;
        c[1] = (u32)i;
        c[2] = (u32)h;
        c[3] = (u32)b;
        u32 k0 = seed_lo, k1 = seed_hi;
#pragma unroll
        for (int round = 0; round < 10; ++round) {
            if (round > 0) {
                k0 += 0x9E3779B9u;
                k1 += 0xBB67AE85u;
            }
            const unsigned long long p0 = 0xD2511F53ull * c[0], p1 = 0xCD9E8D57ull * c[2];
            const u32 n0 = (u32)(p1 >> 32) ^ c[1] ^ k0, n2 = (u32)(p0 >> 32) ^ c[3] ^ k1;
            c[0] = n0;
            c[1] = (u32)p1;
            c[2] = n2;
            c[3] = (u32)p0;
        }
    }
    __device__ __forceinline__ bool kept(u32 word) const { return (i64)word < threshold; }
};

// w[sel] for a run-time sel in 0..4 by selects (indexing a register array with a run-time index
// would move it to local memory).
__device__ __forceinline__ u32 pick_word(const u32 w[4], int sel) {
    const u32 lo = (sel & 1) ? w[1] : w[0], hi = (sel & 1) ? w[3] : w[2];
    return (sel & 2) ? hi : lo;
}
