// File input and output of the emulation drivers (driver.cpp, decode_driver.cpp, ...): raw
// little-endian element arrays, read whole, written whole, and the whitespace-separated numbers
// of params.txt. C stdio only: <fstream> and <string> alone took a quarter of a driver's compile.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

// The work folder given on the command line; `dir + "/q.bin"` names a file in it.
struct Dir {
    const char* s;
};
struct Path {
    char s[4096];
};
static Path operator+(Dir d, const char* name) {
    Path p;
    if (std::snprintf(p.s, sizeof p.s, "%s%s", d.s, name) >= int(sizeof p.s)) {
        std::fprintf(stderr, "path too long: %s%s\n", d.s, name);
        std::exit(4);
    }
    return p;
}

// The file's elements, plus one spare (an empty file still gives a valid data pointer). A
// missing file reads as empty, as with the streams this replaced.
template <typename T>
static std::vector<T> read(const Path& path) {
    std::vector<T> v(1);
    if (FILE* f = std::fopen(path.s, "rb")) {
        std::fseek(f, 0, SEEK_END);
        const long bytes = std::ftell(f);
        std::fseek(f, 0, SEEK_SET);
        if (bytes > 0) {
            v.resize(size_t(bytes) / sizeof(T) + 1);
            if (std::fread(v.data(), 1, size_t(bytes), f) != size_t(bytes)) {
                std::fprintf(stderr, "cannot read %s\n", path.s);
                std::exit(5);
            }
        }
        std::fclose(f);
    }
    return v;
}

// A kernel's parameter struct from the bytes the library wrote (params.cuh, cuda/params.rs); false
// when the file is missing or its size is not the struct's.
template <typename T>
static bool read_struct(const Path& path, T* out) {
    const std::vector<unsigned char> b = read<unsigned char>(path);
    if (b.size() != sizeof(T) + 1) {
        std::fprintf(stderr, "%s: %zu bytes, the struct has %zu\n", path.s, b.size() - 1, sizeof(T));
        return false;
    }
    std::memcpy(out, b.data(), sizeof(T));
    return true;
}

template <typename T>
static void write(const Path& path, const T* p, size_t n) {
    FILE* f = std::fopen(path.s, "wb");
    if (!f || std::fwrite(p, sizeof(T), n, f) != n) {
        std::fprintf(stderr, "cannot write %s\n", path.s);
        std::exit(5);
    }
    std::fclose(f);
}

// params.txt, read number by number with `>>`; false once a read failed (as a stream would be).
struct Numbers {
    FILE* f;
    bool good;
    explicit Numbers(const Path& path) : f(std::fopen(path.s, "r")), good(f != nullptr) {}
    ~Numbers() {
        if (f) std::fclose(f);
    }
    Numbers(const Numbers&) = delete;
    Numbers& operator=(const Numbers&) = delete;
    Numbers& operator>>(long long& x) { return scan("%lld", &x); }
    Numbers& operator>>(int& x) { return scan("%d", &x); }
    Numbers& operator>>(float& x) { return scan("%f", &x); }
    Numbers& operator>>(double& x) { return scan("%lf", &x); }
    bool operator!() const { return !good; }

  private:
    template <typename T>
    Numbers& scan(const char* fmt, T* x) {
        good = good && std::fscanf(f, fmt, x) == 1;
        return *this;
    }
};
