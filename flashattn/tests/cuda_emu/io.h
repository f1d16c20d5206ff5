// File input and output of the emulation drivers (driver.cpp, decode_driver.cpp): raw
// little-endian element arrays, read whole, written whole.
#pragma once
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

// The file's elements, plus one spare (an empty file still gives a valid data pointer).
template <typename T>
static std::vector<T> read(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    std::vector<T> v(bytes.size() / sizeof(T) + 1);
    std::memcpy(v.data(), bytes.data(), bytes.size());
    return v;
}

template <typename T>
static void write(const std::string& path, const T* p, size_t n) {
    std::ofstream f(path, std::ios::binary);
    f.write(reinterpret_cast<const char*>(p), n * sizeof(T));
}
