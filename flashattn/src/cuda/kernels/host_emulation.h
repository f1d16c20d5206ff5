// Host emulation of the CUDA primitives the kernels use, so the kernel sources themselves can run
// on a CPU (built with g++ -DFA_HOST_EMULATION; see flashattn/tests/cuda_emulated.rs). Each CUDA
// thread of a block is a fiber (see launch below); warp-collective instructions (ldmatrix,
// mma.sync, shfl) meet at a per-warp barrier, exchange operands through per-warp slots, and meet
// again; __syncthreads is a block barrier. Fragment layouts follow the PTX ISA (mma.m16n8k16 with f16/bf16 inputs and
// f32 accumulators; ldmatrix .x4 and .x4.trans of 8x8 b16 matrices). This checks the kernels'
// indexing, masking, pipelining and online softmax on any machine; what it cannot check is the
// hardware's own behaviour (timing, races the emulation's barriers would hide).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <sys/mman.h>
// Fibers switch by a few instructions of assembly on x86-64, by ucontext elsewhere (or when
// FA_EMU_UCONTEXT is defined, which is how that path is tested on x86-64).
#if defined(__x86_64__) && !defined(FA_EMU_UCONTEXT)
#define FA_EMU_ASM_SWITCH 1
#else
#define FA_EMU_ASM_SWITCH 0
#include <ucontext.h>
#endif
#include <map>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __grid_constant__
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

namespace emu {
struct Dim3 { unsigned x = 0, y = 0, z = 0; };

// The CUDA threads of a block are fibers (user-mode contexts, each with its own stack) run by one
// OS thread, one at a time: the running fiber goes on until it must wait at a barrier, and then the
// first runnable fiber in order runs. A barrier releases its waiters once every participant has
// arrived. Any order that respects the barriers is a valid CUDA execution; this one is
// deterministic and lets a warp run as far ahead of the others as the barriers allow, so a missing
// barrier shows up as a wrong result (a read of shared memory another warp has not yet written, or
// a write over data another warp has not yet read). Blocks alternate the order (thread 0 first,
// then the last thread first) so that both directions of such a race are exercised. (One OS thread
// per CUDA thread, as before, spent most of its time in the kernel's futex calls.)
constexpr size_t kStack = size_t(1) << 20;  // per fiber
constexpr size_t kGuard = 4096;

#if FA_EMU_ASM_SWITCH
// fa_emu_switch(save, to): saves the callee-saved registers, MXCSR and the x87 control word on the
// current stack, stores the stack pointer in *save, and resumes the context whose stack pointer is
// `to` (System V: rdi, rsi).
extern "C" void fa_emu_switch(void** save, void* to);
asm(R"(
    .text
    .globl fa_emu_switch
    .type fa_emu_switch, @function
fa_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size fa_emu_switch, .-fa_emu_switch
)");
#endif

// A suspended execution context: fa_emu_switch's saved stack pointer on x86-64, a ucontext_t
// elsewhere. The only platform-specific code of the emulation.
struct Context {
#if FA_EMU_ASM_SWITCH
    void* sp = nullptr;
#else
    ucontext_t uc;
#endif
    // A context that, when first switched to, runs `entry` (which never returns) on the kStack
    // bytes at `stack`.
    void start(char* stack, void (*entry)()) {
#if FA_EMU_ASM_SWITCH
        // The frame fa_emu_switch pops: MXCSR and x87 control word (defaults), six zeroed
        // registers, then `entry` as the return address, entered with the stack aligned as at a
        // call (rsp + 8 a multiple of 16).
        uintptr_t top = (uintptr_t(stack) + kStack) & ~uintptr_t(15);
        auto* frame = reinterpret_cast<uint64_t*>(top) - 9;
        std::memset(frame, 0, 9 * sizeof(uint64_t));
        uint32_t csr[2] = {0x1F80u, 0x037Fu};
        std::memcpy(frame, csr, sizeof csr);
        frame[7] = uint64_t(uintptr_t(entry));
        sp = frame;
#else
        getcontext(&uc);
        uc.uc_stack.ss_sp = stack;
        uc.uc_stack.ss_size = kStack;
        uc.uc_link = nullptr;
        makecontext(&uc, entry, 0);
#endif
    }
    // Saves the running context into `this` and resumes `to`.
    void switch_to(Context& to) {
#if FA_EMU_ASM_SWITCH
        fa_emu_switch(&sp, to.sp);
#else
        swapcontext(&uc, &to.uc);
#endif
    }
};

struct Barrier;
struct Fiber {
    Context ctx;
    char* stack = nullptr;  // kStack usable bytes above a guard page, owned by the Scheduler
    const Barrier* wait = nullptr;  // the barrier it waits at, and that barrier's generation
    unsigned long wait_gen = 0;
    bool done = false;
    inline bool runnable() const;
};
struct Scheduler {
    std::vector<Fiber> fibers;
    Context main;
    int current = -1;  // the running fiber's position in `fibers`
    int hint = 0;      // every fiber before this position waits or is done
    void (*run)(void*) = nullptr;  // runs the kernel lambda at `arg`
    void* arg = nullptr;
    Scheduler() = default;
    Scheduler(const Scheduler&) = delete;
    Scheduler& operator=(const Scheduler&) = delete;
    ~Scheduler() {
        for (auto& f : fibers)
            if (f.stack) munmap(f.stack - kGuard, kStack + kGuard);
    }
};
inline thread_local Scheduler* sched = nullptr;

// Suspends the running fiber and returns to the scheduler.
inline void yield() { sched->fibers[sched->current].ctx.switch_to(sched->main); }

struct Barrier {
    int expected;
    int count = 0;
    int first = 0;  // the lowest position among the fibers waiting here
    unsigned long gen = 0;
    explicit Barrier(int n) : expected(n) {}
    void arrive_and_wait() {
        const int pos = sched->current;
        first = count == 0 || pos < first ? pos : first;
        if (++count == expected) {  // the last to arrive releases the others and goes on
            count = 0;
            ++gen;
            if (first < sched->hint) sched->hint = first;
            return;
        }
        Fiber& f = sched->fibers[pos];
        f.wait = this;
        f.wait_gen = gen;
        yield();
    }
};
inline bool Fiber::runnable() const { return !done && !(wait && wait->gen == wait_gen); }
struct Warp {
    Barrier bar{32};
    uint32_t u[32][6];
    float f[32];
};
// A TMA load issued and not yet delivered (see the sm_90a section below): the box's global
// source, already resolved, and its shared-memory destination.
struct TmaCopy {
    uint32_t dst;
    const unsigned char* base;
    uint64_t dims[4], strides[3];
    int coords[4];
    uint32_t box_rows;
};
// An mbarrier: arrivals still expected in this phase, transaction bytes still expected, the
// phase's parity, TMA loads to deliver, and a generation counter that wakes its waiters.
struct Mbar {
    int count = 0, pending = 0;
    long tx = 0;
    int phase = 0;
    std::vector<TmaCopy> copies;
    Barrier wake{1};
};
// A named barrier (bar.sync / bar.arrive with an id): arrivals in this generation.
struct NamedBar {
    int count = 0;
    Barrier wake{1};
};
// One wgmma a thread has issued and not yet waited for (see the sm_90a section below).
struct WgOp {
    int n;          // the instruction's N
    bool rs;        // A from registers (a), else from shared memory (desc_a)
    uint64_t desc_a, desc_b;
    int scale_d;    // 0: d = A·B, else d += A·B
    float* d;       // the thread's accumulators (n / 2 floats)
    uint32_t a[4];  // its A fragment (rs), as issued
    int group;      // the commit group it belongs to
    bool e4m3 = false;  // 8-bit operands (WgmmaE4m3: k32, both K-major), else 16-bit (k16)
};
// A thread's wgmma state: issued ops, commits so far, and the true values of accumulators that
// pending ops will write (the registers themselves read as NaN until the wait).
struct WgThread {
    std::vector<WgOp> ops;
    int commits = 0;
    std::vector<std::pair<float*, std::vector<float>>> shadows;
};
struct Block {
    Barrier bar;
    std::vector<Warp> warps;
    std::vector<unsigned char> smem;
    std::vector<WgThread> wg_threads;  // per thread
    std::vector<Barrier> wg_bars;      // per warpgroup of 128 threads
    std::map<uint32_t, Mbar> mbars;    // the mbarriers, by shared-memory address
    NamedBar named[16];                // bar.sync / bar.arrive ids
    Block(int threads, size_t smem_bytes)
        : bar(threads), warps(size_t(threads / 32)), smem(smem_bytes + 16),
          wg_threads(size_t(threads)), wg_bars(size_t(threads / 128), Barrier(128)) {}
};
inline thread_local Dim3 thread_idx, block_idx, grid_dim;
inline thread_local Block* block = nullptr;
inline Warp& warp() { return block->warps[thread_idx.x / 32]; }
inline int lane() { return thread_idx.x % 32; }
inline unsigned char* smem_base() { return block->smem.data(); }

// A fiber's first frame: runs the kernel, marks the fiber done and returns to the scheduler for
// good.
inline void fiber_main() {
    sched->run(sched->arg);
    sched->fibers[sched->current].done = true;
    yield();
    std::abort();  // a finished fiber is never resumed
}

// Runs `kernel` over the grid, one block after another; each block's threads are fibers.
template <typename F>
void launch(Dim3 grid, int threads, size_t smem_bytes, F kernel) {
    Scheduler s;
    s.run = [](void* k) { (*static_cast<F*>(k))(); };
    s.arg = &kernel;
    s.fibers.resize(threads);
    for (auto& f : s.fibers) {
        // Pages are committed only when the fiber touches them; an overflow hits the guard page
        // (a segmentation fault) instead of the next fiber's stack.
        void* m = mmap(nullptr, kStack + kGuard, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED || mprotect(m, kGuard, PROT_NONE) != 0) std::abort();
        f.stack = static_cast<char*>(m) + kGuard;
    }
    Scheduler* outer = sched;
    sched = &s;
    grid_dim = grid;
    Block b(threads, smem_bytes);
    block = &b;
    unsigned long linear = 0;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x, ++linear) {
                block_idx = {x, y, z};
                // Uninitialised shared memory reads as garbage on a GPU: poison it here.
                std::memset(b.smem.data(), 0xAB, b.smem.size());
                for (auto& w : b.wg_threads) w = WgThread{};
                b.mbars.clear();
                for (auto& n : b.named) n.count = 0;
                // Every barrier is at count 0 here: the previous block ran to its end.
                for (auto& f : s.fibers) {
                    f.done = false;
                    f.wait = nullptr;
                    f.ctx.start(f.stack, &fiber_main);
                }
                // Fiber p runs CUDA thread p in even blocks, thread threads-1-p in odd ones.
                const bool reversed = linear % 2;
                s.hint = 0;
                int left = threads;
                while (left > 0) {
                    int p = s.hint;
                    while (p < threads && !s.fibers[p].runnable()) ++p;
                    if (p == threads) {
                        std::fprintf(stderr,
                                     "emulation: block (%u,%u,%u) deadlocked: a barrier that not "
                                     "every thread reaches\n",
                                     x, y, z);
                        std::abort();
                    }
                    s.hint = p;
                    Fiber& f = s.fibers[p];
                    f.wait = nullptr;
                    thread_idx = {unsigned(reversed ? threads - 1 - p : p), 0, 0};
                    s.current = p;
                    s.main.switch_to(f.ctx);
                    if (f.done) --left;
                }
            }
    block = nullptr;
    sched = outer;
}
inline float bits_to_float(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }
#if defined(FA_BF16)
inline float half_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }
inline uint16_t float_to_half(float x) {
    uint32_t b = float_to_bits(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) return uint16_t((b >> 16) | 0x40);  // NaN stays NaN
    b += 0x7fffu + ((b >> 16) & 1u);                                        // nearest even
    return uint16_t(b >> 16);
}
#else
inline float half_to_float(uint16_t h) { _Float16 v; std::memcpy(&v, &h, 2); return float(v); }
inline uint16_t float_to_half(float x) { _Float16 v = _Float16(x); uint16_t h; std::memcpy(&h, &v, 2); return h; }
#endif
}  // namespace emu

#define threadIdx (emu::thread_idx)
#define blockIdx (emu::block_idx)
#define gridDim (emu::grid_dim)
inline float __int_as_float(int i) { return emu::bits_to_float(uint32_t(i)); }
inline unsigned __float_as_uint(float f) { return emu::float_to_bits(f); }
inline long long __double_as_longlong(double x) { long long b; std::memcpy(&b, &x, 8); return b; }
using std::fabs;
using std::frexp;
using std::ldexp;
using std::rint;
inline void __syncthreads() { emu::block->bar.arrive_and_wait(); }
// Atomics on global memory: the blocks of a launch run one after another on one OS thread, and a
// fiber gives the thread up only at a barrier, so a plain read-modify-write is atomic here. (So
// under emulation the block that runs first takes every tile a dynamic scheduler hands out after
// each block's first; any such split is a valid CUDA execution.)
inline int atomicAdd(int* a, int v) {
    const int old = *a;
    *a = old + v;
    return old;
}
inline void __syncwarp() { emu::warp().bar.arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int mask) {
    emu::Warp& w = emu::warp();
    int l = emu::lane();
    w.f[l] = v;
    w.bar.arrive_and_wait();
    float r = w.f[l ^ mask];
    w.bar.arrive_and_wait();
    return r;
}
// CUDA's integer and float max/min, with std::max/min's semantics (a NaN operand is not special).
template <typename T>
inline T max(T a, T b) { return a < b ? b : a; }
template <typename T>
inline T min(T a, T b) { return b < a ? b : a; }
#define FA_DYNAMIC_SMEM(T, name) T* name = reinterpret_cast<T*>(emu::smem_base())

// --- the kernels' primitives -------------------------------------------------------------------
inline float fa_exp2(float x) { return std::exp2(x); }
#ifdef FA_TENSOR_CORE_KERNEL
inline uint32_t pack2(float lo, float hi) {
    return uint32_t(emu::float_to_half(lo)) | (uint32_t(emu::float_to_half(hi)) << 16);
}
inline uint16_t from_f32(float x) { return emu::float_to_half(x); }
inline uint32_t smem_addr(const void* p) {
    return uint32_t(static_cast<const unsigned char*>(p) - emu::smem_base());
}
inline int ld_shared_s32(uint32_t addr) {
    int v;
    std::memcpy(&v, emu::smem_base() + addr, 4);
    return v;
}
inline void st_shared_s32(uint32_t addr, int v) { std::memcpy(emu::smem_base() + addr, &v, 4); }
inline uint16_t smem_u16(uint32_t addr) {
    uint16_t v;
    std::memcpy(&v, emu::smem_base() + addr, 2);
    return v;
}
// ldmatrix .x4: lanes 8i..8i+7 give the row addresses of matrix i; lane l receives, in register i,
// row l/4, columns 2(l%4) and 2(l%4)+1 of matrix i (trans: rows 2(l%4), 2(l%4)+1 of column l/4).
inline void ldsm_common(uint32_t r[4], uint32_t addr, bool trans) {
    emu::Warp& w = emu::warp();
    int l = emu::lane();
    w.u[l][0] = addr;
    w.bar.arrive_and_wait();
    for (int i = 0; i < 4; ++i) {
        uint16_t lo, hi;
        if (!trans) {
            uint32_t row = w.u[8 * i + l / 4][0];
            lo = smem_u16(row + 4 * (l % 4));
            hi = smem_u16(row + 4 * (l % 4) + 2);
        } else {
            lo = smem_u16(w.u[8 * i + 2 * (l % 4)][0] + 2 * (l / 4));
            hi = smem_u16(w.u[8 * i + 2 * (l % 4) + 1][0] + 2 * (l / 4));
        }
        r[i] = uint32_t(lo) | (uint32_t(hi) << 16);
    }
    w.bar.arrive_and_wait();
}
inline void ldsm_x4(uint32_t r[4], uint32_t addr) { ldsm_common(r, addr, false); }
inline void ldsm_x4_trans(uint32_t r[4], uint32_t addr) { ldsm_common(r, addr, true); }
// mma.m16n8k16.row.col, f32 += f16/bf16 x f16/bf16. Lane l (g = l/4, t = l%4) holds A as
// a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..); B as b0 (k 2t..2t+1, n g),
// b1 (k 2t+8.., n g); C as c0 c1 (g, 2t..2t+1), c2 c3 (g+8, 2t..2t+1).
inline void mma16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    emu::Warp& w = emu::warp();
    int l = emu::lane();
    for (int i = 0; i < 4; ++i) w.u[l][i] = a[i];
    w.u[l][4] = b0;
    w.u[l][5] = b1;
    w.bar.arrive_and_wait();
    auto half = [](uint32_t reg, int hi) { return emu::half_to_float(uint16_t(hi ? reg >> 16 : reg)); };
    auto A = [&](int row, int k) {
        int g = row % 8, t = (k % 8) / 2, reg = (row >= 8) + 2 * (k >= 8);
        return half(w.u[4 * g + t][reg], k % 2);
    };
    auto B = [&](int k, int n) {
        int t = (k % 8) / 2;
        return half(w.u[4 * n + t][4 + (k >= 8)], k % 2);
    };
    int g = l / 4, t = l % 4;
    float d[4];
    for (int e = 0; e < 4; ++e) {
        int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
        float acc = c[e];
        for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
        d[e] = acc;
    }
    w.bar.arrive_and_wait();
    for (int e = 0; e < 4; ++e) c[e] = d[e];
}
inline void cp_async16(uint32_t dst, const void* src, int src_bytes) {
    std::memset(emu::smem_base() + dst, 0, 16);
    if (src_bytes > 0) std::memcpy(emu::smem_base() + dst, src, src_bytes);
}
inline void cp_async4(uint32_t dst, const void* src) {
    std::memcpy(emu::smem_base() + dst, src, 4);
}
inline void cp_async_commit() {}
template <int N>
inline void cp_async_wait() {}
#endif

#ifdef FA_SM90_KERNEL
// --- sm_90a: warpgroup-wide wgmma through shared-memory matrix descriptors -----------------------
// wgmma.mma_async is asynchronous: the hardware may read its shared-memory operands and write its
// accumulators at any time until wgmma.wait_group retires its group. The emulation takes the
// latest moment: an issued op only records its operands (the A registers as issued, the
// descriptors); its accumulators read as NaN until the wait; and at the wait the warpgroup meets,
// each thread computes its own accumulators from the other threads' A registers and from shared
// memory as it is then. So a kernel that reads accumulators before the wait, or overwrites a tile
// a pending op reads, gets a wrong result here. Descriptors are decoded by the PTX ISA's canonical
// 128-byte-swizzle layouts (sm90.cuh's SW128 tiles): K-major element (mn, k) at
// start + (mn % 8) · 128 + (mn / 8) · SBO + 2k, MN-major (trans-b) at
// start + 2 (mn % 64) + (mn / 64) · LBO + (k % 8) · 128 + (k / 8) · SBO, then address bits 4-6
// XORed with bits 7-9.
inline void wgmma_fence() {}
inline void fence_proxy_async() {}
inline void reg_fence(float&) {}
inline void wgmma_commit() { emu::block->wg_threads[threadIdx.x].commits++; }

namespace emu {
inline float desc_elem(uint64_t desc, int mn, int k, bool mn_major) {
    if ((desc >> 62) != 1) {
        std::fprintf(stderr, "emulation: wgmma descriptor without the 128-byte swizzle\n");
        std::abort();
    }
    const uint32_t start = uint32_t(desc & 0x3FFF) << 4;
    const uint32_t lbo = uint32_t((desc >> 16) & 0x3FFF) << 4;
    const uint32_t sbo = uint32_t((desc >> 32) & 0x3FFF) << 4;
    uint32_t a = mn_major ? start + 2 * (mn % 64) + (mn / 64) * lbo + (k % 8) * 128 + (k / 8) * sbo
                          : start + (mn % 8) * 128 + (mn / 8) * sbo + 2 * k;
    a ^= ((a >> 7) & 7) << 4;
    if (a + 2 > block->smem.size()) {
        std::fprintf(stderr, "emulation: wgmma operand outside shared memory\n");
        std::abort();
    }
    return half_to_float(smem_u16(a));
}

// The value of e4m3 (E4M3FN) byte b: bias 7, subnormals below exponent field 1, NaN 0x7f/0xff.
inline float e4m3_to_float(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    float x = (b & 0x7f) == 0x7f ? NAN : e == 0 ? std::ldexp(float(m), -9) : std::ldexp(float(8 + m), e - 10);
    return (b & 0x80) ? -x : x;
}

// x rounded to the nearest e4m3 value, ties to even, saturating at ±448 (cvt.rn.satfinite); NaN
// to 0x7f. Found by search over the 127 magnitudes: exact, if slow.
inline uint8_t float_to_e4m3(float x) {
    if (std::isnan(x)) return 0x7f;
    const uint8_t sign = std::signbit(x) ? 0x80 : 0;
    const double a = std::fabs(double(x));
    uint8_t best = 0;
    for (int m = 1; m < 0x7f; ++m) {
        const double d = std::fabs(double(e4m3_to_float(uint8_t(m))) - a),
                     db = std::fabs(double(e4m3_to_float(best)) - a);
        if (d < db || (d == db && (m & 1) == 0)) best = uint8_t(m);
    }
    return uint8_t(sign | best);
}

// The byte of an 8-bit K-major operand: element (mn, k) at start + (mn % 8) · 128 + (mn / 8) ·
// SBO + k (k < 32 per instruction, one byte each), then the 128-byte swizzle.
inline float desc_elem_e4m3(uint64_t desc, int mn, int k) {
    if ((desc >> 62) != 1) {
        std::fprintf(stderr, "emulation: wgmma descriptor without the 128-byte swizzle\n");
        std::abort();
    }
    const uint32_t start = uint32_t(desc & 0x3FFF) << 4;
    const uint32_t sbo = uint32_t((desc >> 32) & 0x3FFF) << 4;
    uint32_t a = start + (mn % 8) * 128 + (mn / 8) * sbo + k;
    a ^= ((a >> 7) & 7) << 4;
    if (a + 1 > block->smem.size()) {
        std::fprintf(stderr, "emulation: wgmma operand outside shared memory\n");
        std::abort();
    }
    return e4m3_to_float(block->smem[a]);
}

inline void wg_issue(int n, bool rs, float* d, uint64_t desc_a, uint64_t desc_b, int scale_d,
                     const uint32_t* a, bool e4m3 = false) {
    WgThread& me = block->wg_threads[thread_idx.x];
    bool shadowed = false;
    for (auto& p : me.shadows) shadowed |= p.first == d;
    if (!shadowed) {
        me.shadows.push_back({d, std::vector<float>(d, d + n / 2)});
        for (int i = 0; i < n / 2; ++i) d[i] = NAN;
    }
    WgOp op{n, rs, desc_a, desc_b, scale_d, d, {0, 0, 0, 0}, me.commits};
    op.e4m3 = e4m3;
    if (a) std::memcpy(op.a, a, sizeof op.a);
    me.ops.push_back(op);
}
}  // namespace emu

template <int N>
struct Wgmma {
    static void ss(float (&d)[N / 8][4], uint64_t desc_a, uint64_t desc_b, int scale_d) {
        emu::wg_issue(N, false, &d[0][0], desc_a, desc_b, scale_d, nullptr);
    }
    static void rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
        emu::wg_issue(N, true, &d[0][0], 0, desc_b, scale_d, a);
    }
};
// e4m3 operands, k32 (fwd_sm90_fp8.cu): A and B both K-major; rs's A is mma.m16n8k32's 8-bit
// fragment per warp.
template <int N>
struct WgmmaE4m3 {
    static void ss(float (&d)[N / 8][4], uint64_t desc_a, uint64_t desc_b, int scale_d) {
        emu::wg_issue(N, false, &d[0][0], desc_a, desc_b, scale_d, nullptr, true);
    }
    static void rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
        emu::wg_issue(N, true, &d[0][0], 0, desc_b, scale_d, a, true);
    }
};

template <int N>
inline void wgmma_wait() {
    using namespace emu;
    const int tid = int(threadIdx.x), wg = tid / 128, w = (tid / 32) % 4, g = (tid % 32) / 4,
              t = tid % 4;
    WgThread& me = block->wg_threads[tid];
    Barrier& bar = block->wg_bars[wg];
    bar.arrive_and_wait();  // every thread of the warpgroup has issued what it waits for
    if (me.ops.size() != block->wg_threads[wg * 128].ops.size()) {
        std::fprintf(stderr, "emulation: the threads of a warpgroup issued different wgmma\n");
        std::abort();
    }
    size_t count = 0;
    while (count < me.ops.size() && me.ops[count].group < me.commits - N) ++count;
    for (size_t o = 0; o < count; ++o) {
        const WgOp& op = me.ops[o];
        std::vector<float>* acc = nullptr;
        for (auto& p : me.shadows)
            if (p.first == op.d) acc = &p.second;
        auto A = [&](int row, int k) {
            if (op.e4m3) {
                if (!op.rs) return desc_elem_e4m3(op.desc_a, row, k);
                // mma.m16n8k32's 8-bit A fragment: a[0] row g, k 4t .. 4t + 3 (lowest byte
                // first), a[1] row g + 8, a[2] and a[3] the same at k 16 + 4t.
                const int r16 = row % 16, owner = wg * 128 + 32 * (row / 16) + 4 * (r16 % 8) + (k % 16) / 4;
                const uint32_t reg = block->wg_threads[owner].ops[o].a[(r16 >= 8) + 2 * (k >= 16)];
                return e4m3_to_float(uint8_t(reg >> (8 * (k % 4))));
            }
            if (!op.rs) return desc_elem(op.desc_a, row, k, false);
            // mma.m16n8k16's A fragment, per warp of the warpgroup.
            const int r16 = row % 16, owner = wg * 128 + 32 * (row / 16) + 4 * (r16 % 8) + (k % 8) / 2;
            const uint32_t reg = block->wg_threads[owner].ops[o].a[(r16 >= 8) + 2 * (k >= 8)];
            return half_to_float(uint16_t(k % 2 ? reg >> 16 : reg));
        };
        for (int j = 0; j < op.n / 8; ++j)
            for (int e = 0; e < 4; ++e) {
                const int row = 16 * w + g + 8 * (e >> 1), col = 8 * j + 2 * t + (e & 1);
                float x = op.scale_d ? (*acc)[4 * j + e] : 0.f;
                if (op.e4m3)
                    for (int k = 0; k < 32; ++k) x += A(row, k) * desc_elem_e4m3(op.desc_b, col, k);
                else
                    for (int k = 0; k < 16; ++k) x += A(row, k) * desc_elem(op.desc_b, col, k, op.rs);
                (*acc)[4 * j + e] = x;
            }
    }
    bar.arrive_and_wait();  // every thread has read the others' A registers
    me.ops.erase(me.ops.begin(), me.ops.begin() + long(count));
    for (size_t i = 0; i < me.shadows.size();) {
        bool pending = false;
        for (auto& op : me.ops) pending |= op.d == me.shadows[i].first;
        if (pending) {
            ++i;
            continue;
        }
        std::memcpy(me.shadows[i].first, me.shadows[i].second.data(),
                    me.shadows[i].second.size() * sizeof(float));
        me.shadows.erase(me.shadows.begin() + long(i));
    }
}

// --- sm_90a: mbarriers, TMA, register reallocation (fwd_sm90_ws.cu) -----------------------------
// An mbarrier's phase completes when its expected arrivals have arrived and its announced
// transaction bytes have landed; try_wait.parity(p) succeeds once the phase of parity p has
// completed (a fresh barrier is in phase 0, so parity 1 passes at once). A thread whose wait
// fails parks until the barrier's next phase change; if every thread is parked the launch aborts
// as deadlocked (a parity or count mistake fails loudly instead of hanging). A TMA load poisons
// its destination at issue and is delivered (copied, swizzled, out-of-bounds elements 0, its bytes
// completed) only when a thread first waits on its barrier, so a read that does not wait for the
// load sees the poison.
struct TmaDesc {
    const unsigned char* base;
    uint64_t dims[4], strides[3];
    uint32_t box_rows;
};
template <int N>
inline void regs_dealloc() {}
template <int N>
inline void regs_alloc() {}
inline void mbar_init_fence() {}
// Named barriers: `threads` arrivals (sync or arrive) complete a generation; sync waits for it.
inline void named_bar_arrive(int id, int threads) {
    emu::NamedBar& b = emu::block->named[id];
    if (++b.count == threads) {
        b.count = 0;
        ++b.wake.gen;
        emu::sched->hint = 0;
    }
}
inline void named_bar_sync(int id, int threads) {
    emu::NamedBar& b = emu::block->named[id];
    const unsigned long gen = b.wake.gen;
    named_bar_arrive(id, threads);
    if (b.wake.gen != gen) return;
    emu::Fiber& f = emu::sched->fibers[emu::sched->current];
    f.wait = &b.wake;
    f.wait_gen = gen;
    emu::yield();
}

namespace emu {
inline Mbar& mbar(uint32_t bar) {
    auto it = block->mbars.find(bar);
    if (it == block->mbars.end()) {
        std::fprintf(stderr, "emulation: mbarrier at %u used before mbarrier.init\n", bar);
        std::abort();
    }
    return it->second;
}
inline void mbar_complete(Mbar& m) {
    if (m.pending < 0 || m.tx < 0) {
        std::fprintf(stderr, "emulation: mbarrier phase over-arrived (arrivals %d, bytes %ld)\n",
                     m.pending, m.tx);
        std::abort();
    }
    if (m.pending == 0 && m.tx == 0) {
        m.phase ^= 1;
        m.pending = m.count;
        ++m.wake.gen;
        sched->hint = 0;  // parked waiters may be anywhere before the running fiber
    }
}
// The element size of the kernel's tensor maps: 2 (f16 / bf16), or 1 where the kernel defines
// FA_TMA_ELEM_BYTES 1 (FP8). A box row is 128 bytes either way: 64 or 128 columns.
#ifndef FA_TMA_ELEM_BYTES
#define FA_TMA_ELEM_BYTES 2
#endif
inline void tma_deliver(Mbar& m) {
    constexpr int E = FA_TMA_ELEM_BYTES;
    std::vector<TmaCopy> copies;
    copies.swap(m.copies);
    for (const TmaCopy& c : copies) {
        for (uint32_t r = 0; r < c.box_rows; ++r)
            for (int col = 0; col < 128 / E; ++col) {
                const int64_t x[4] = {c.coords[0] + col, c.coords[1] + int64_t(r), c.coords[2],
                                      c.coords[3]};
                uint16_t v = 0;
                bool inside = true;
                for (int d = 0; d < 4; ++d) inside &= x[d] >= 0 && uint64_t(x[d]) < c.dims[d];
                if (inside)
                    std::memcpy(&v,
                                c.base + E * x[0] + x[1] * c.strides[0] + x[2] * c.strides[1] +
                                    x[3] * c.strides[2],
                                E);
                uint32_t a = c.dst + r * 128 + E * col;
                a ^= ((a >> 7) & 7) << 4;
                std::memcpy(smem_base() + a, &v, E);
            }
        m.tx -= long(c.box_rows) * 128;
    }
    mbar_complete(m);
}
}  // namespace emu

inline void mbar_init(uint32_t bar, int count) {
    emu::Mbar& m = emu::block->mbars[bar];
    m.count = m.pending = count;
    m.tx = 0;
    m.phase = 0;
    m.copies.clear();
}
inline void mbar_arrive(uint32_t bar) {
    emu::Mbar& m = emu::mbar(bar);
    --m.pending;
    emu::mbar_complete(m);
}
inline void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    emu::Mbar& m = emu::mbar(bar);
    m.tx += long(bytes);
    --m.pending;
    emu::mbar_complete(m);
}
inline void mbar_wait(uint32_t bar, int parity) {
    for (;;) {
        emu::Mbar& m = emu::mbar(bar);
        if (!m.copies.empty()) emu::tma_deliver(m);
        if (m.phase != (parity & 1)) return;
        emu::Fiber& f = emu::sched->fibers[emu::sched->current];
        f.wait = &m.wake;
        f.wait_gen = m.wake.gen;
        emu::yield();
    }
}
inline void tma_load_4d(uint32_t dst, const TmaDesc* map, int c0, int c1, int c2, int c3,
                        uint32_t bar) {
    if (dst % 1024 != 0 || dst + map->box_rows * 128 > emu::block->smem.size()) {
        std::fprintf(stderr, "emulation: TMA box at %u not 1024-aligned or past shared memory\n",
                     dst);
        std::abort();
    }
    std::memset(emu::smem_base() + dst, 0xFF, map->box_rows * 128);
    emu::TmaCopy c{dst, map->base, {}, {}, {c0, c1, c2, c3}, map->box_rows};
    std::memcpy(c.dims, map->dims, sizeof c.dims);
    std::memcpy(c.strides, map->strides, sizeof c.strides);
    emu::Mbar& m = emu::mbar(bar);
    m.copies.push_back(c);
    // Parked waiters wake to take the delivery (the phase itself completes only then).
    ++m.wake.gen;
    emu::sched->hint = 0;
}
#endif  // FA_SM90_KERNEL
