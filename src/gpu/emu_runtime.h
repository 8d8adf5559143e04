// Host C++ runtime of kvpack's SIMT emulator (src/gpu/emu.rs): runs the
// CUDA kernels of src/gpu/kernels/*.cu on the CPU so that their logic can be
// tested without a GPU. Every CUDA thread of a block is a fiber (ucontext);
// __syncthreads and warp shuffles are barriers at which fibers yield; blocks
// run one after another. Arithmetic is plain IEEE binary32 / binary64 on the
// host (built with -ffp-contract=off), so the *_rn intrinsics give the
// GPU's results; f16 conversions are implemented bit-exactly below.
//
// Device memory is one file mapped at a fixed address (the "arena"); the
// kernels' descriptors hold absolute addresses inside it.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <string>
#include <sys/mman.h>
#include <sys/stat.h>
#include <ucontext.h>
#include <unistd.h>
#include <vector>

#define KVPACK_EMU 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct dim3 { unsigned x, y, z; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
static inline uint2 make_uint2(unsigned a, unsigned b) { return uint2{a, b}; }
static inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }

// ---- threads ---------------------------------------------------------------
struct EmuThread {
    ucontext_t ctx;
    dim3 tid;
    bool done;
    bool waiting;
    char* stack;
};
struct EmuWarp {
    int count;
    unsigned gen;
    int live;
    unsigned long long buf[32];
};
static EmuThread* emu_cur;
static dim3 emu_block_idx, emu_block_dim;
static ucontext_t emu_main;
static std::vector<EmuThread> emu_threads;
static std::vector<EmuWarp> emu_warps;
static int emu_live, emu_bar_count;
static unsigned emu_bar_gen;
static std::vector<unsigned char> emu_smem;
static void* emu_dyn_smem() { return emu_smem.data(); }
#define threadIdx (emu_cur->tid)
#define blockIdx emu_block_idx
#define blockDim emu_block_dim

static void emu_yield() {
    emu_cur->waiting = true;
    swapcontext(&emu_cur->ctx, &emu_main);
    emu_cur->waiting = false;
}
static inline void __syncthreads() {
    unsigned g = emu_bar_gen;
    if (++emu_bar_count >= emu_live) {
        emu_bar_count = 0;
        emu_bar_gen++;
        return;
    }
    while (emu_bar_gen == g) emu_yield();
}
static void emu_warp_barrier() {
    EmuWarp& w = emu_warps[emu_cur->tid.x / 32];
    unsigned g = w.gen;
    if (++w.count >= w.live) {
        w.count = 0;
        w.gen++;
        return;
    }
    while (w.gen == g) emu_yield();
}
// Every lane of the warp (a full mask) reaches __syncwarp before any goes on.
static inline void __syncwarp(unsigned = 0xffffffffu) { emu_warp_barrier(); }
template <class T>
static T emu_shfl(T v, int src) {
    EmuWarp& w = emu_warps[emu_cur->tid.x / 32];
    unsigned long long x = 0;
    memcpy(&x, &v, sizeof(T));
    w.buf[emu_cur->tid.x & 31] = x;
    emu_warp_barrier();
    unsigned long long y = w.buf[src & 31];
    T r;
    memcpy(&r, &y, sizeof(T));
    emu_warp_barrier();
    return r;
}
template <class T>
static inline T __shfl_xor_sync(unsigned, T v, int m) { return emu_shfl(v, (int)(emu_cur->tid.x & 31) ^ m); }
template <class T>
static inline T __shfl_sync(unsigned, T v, int src) { return emu_shfl(v, src); }
template <class T>
static inline T __shfl_up_sync(unsigned, T v, unsigned d) {
    int lane = (int)(emu_cur->tid.x & 31);
    return emu_shfl(v, lane - (int)d >= 0 ? lane - (int)d : lane);
}

// ---- intrinsics -------------------------------------------------------------
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __dsqrt_rn(double a) { return sqrt(a); }
static inline float __double2float_rn(double a) { return (float)a; }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static inline int __float_as_int(float f) { int u; memcpy(&u, &f, 4); return u; }
static inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
static inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
static inline unsigned __brev(unsigned x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
    return __builtin_bswap32(x);
}
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
// Vector loads and stores must be naturally aligned on the GPU (a fault
// there); the emulator checks it.
static void emu_check_align(const void* p, size_t a, const char* what) {
    if (a > 1 && ((uintptr_t)p % (a > 16 ? 16 : a)) != 0) {
        fprintf(stderr, "emu: misaligned %zu-byte %s at %p (block %u thread %u)\n", a, what, p, emu_block_idx.x,
                emu_cur ? emu_cur->tid.x : 0u);
        exit(5);
    }
}
template <class T>
static inline T __ldg(const T* p) {
    emu_check_align(p, sizeof(T), "load");
    return *p;
}
static inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
static inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
static inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
static inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v) {
    unsigned long long o = *p;
    if (v < o) *p = v;
    return o;
}
static inline unsigned atomicMax(unsigned* p, unsigned v) {
    unsigned o = *p;
    if (v > o) *p = v;
    return o;
}
static inline unsigned atomicOr(unsigned* p, unsigned v) {
    unsigned o = *p;
    *p = o | v;
    return o;
}
static inline unsigned atomicAdd(unsigned* p, unsigned v) {
    unsigned o = *p;
    *p = o + v;
    return o;
}

// f16 <-> f32, round to nearest even (bit-exact with the GPU's cvt).
static inline float emu_f16_to_f32(unsigned short h) {
    unsigned s = (h >> 15) & 1u, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        float f = (float)m * 5.9604644775390625e-8f;  // m * 2^-24, exact
        return s ? -f : f;
    }
    unsigned bits = e == 31 ? (s << 31) | 0x7f800000u | (m << 13) : (s << 31) | ((e + 112u) << 23) | (m << 13);
    return __uint_as_float(bits);
}
static inline unsigned short emu_f32_to_f16(float f) {
    unsigned x = __float_as_uint(f);
    unsigned s = (x >> 16) & 0x8000u, e = (x >> 23) & 0xffu, m = x & 0x7fffffu;
    if (e == 0xff) return (unsigned short)(s | 0x7c00u | (m ? 0x200u | (m >> 13) : 0u));
    int E = (int)e - 112;
    if (E >= 31) return (unsigned short)(s | 0x7c00u);
    if (E <= 0) {
        if (E < -10) return (unsigned short)s;
        m |= 0x800000u;
        unsigned shift = (unsigned)(14 - E);
        unsigned q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return (unsigned short)(s | q);
    }
    unsigned q = ((unsigned)E << 10) | (m >> 13), rem = m & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) q++;
    return (unsigned short)(s | q);
}
