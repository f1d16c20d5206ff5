// Runs decode.cu's FP8 conversions (fp8_to_f32, f64_to_fp8) on the CPU through host_emulation.h.
// Built by tests/integration/decode/emulated.rs: g++ -std=c++17 -DFA_HOST_EMULATION -DFA_DECODE_ENTRY=0 -DFA_FP8_CACHE=1
// -D<variant defines> -I<kernels dir> fp8_driver.cpp
// Usage: fp8_driver DIR. DIR holds in.bin (f64 values); written there: widened.bin (f32: the 256
// e4m3 bytes, then the 256 e5m2 bytes) and quantised.bin (the inputs in e4m3, then in e5m2).
#include "decode.cu"
#include "io.h"

int main(int argc, char** argv) {
    if (argc != 2) return 2;
    const Dir dir{argv[1]};
    auto in = read<double>(dir + "/in.bin");
    const size_t n = in.size() - 1;  // read() adds a spare element
    std::vector<float> widened(512);
    std::vector<unsigned char> quantised(2 * n);
    for (int f = 0; f < 2; ++f) {
        for (u32 b = 0; b < 256; ++b) widened[256 * f + b] = fp8_to_f32(b, f);
        for (size_t i = 0; i < n; ++i) quantised[n * f + i] = f64_to_fp8(in[i], f);
    }
    write(dir + "/widened.bin", widened.data(), widened.size());
    write(dir + "/quantised.bin", quantised.data(), quantised.size());
    return 0;
}
