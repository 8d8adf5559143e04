// Shared definitions for every kvpack kernel source. The Rust side prepends
// this file to each .cu source before handing it to NVRTC, so the sources
// need no #include (NVRTC ships no standard headers).
//
// Numerics: every kernel is compiled with --fmad=false and spells the
// normative operations with the *_rn intrinsics, so no multiply-add is ever
// contracted; denormals are kept (no -ftz). This makes the results
// bit-identical to the CPU reference (format/codecs/*.md).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define FULL_MASK 0xffffffffu
// Threads per block of every unit kernel. A unit is 8 or 32 consecutive
// elements of a row (the kernel's W); a thread handles U units BLOCK apart,
// so a block covers BLOCK * U units: U = UNITS_PER_THREAD for W = 8,
// DEC_UNITS_W32 / ENC_UNITS_W32 for the 32-element decode / encode.
#define BLOCK 256
#define UNITS_PER_THREAD 4
#define DEC_UNITS_W32 2
#define ENC_UNITS_W32 1
// Resident blocks per SM the 32-element decode kernels are compiled for
// (caps their registers at 64, so 32 warps per SM keep loads in flight).
#define MIN_BLOCKS_W32 4
#define UNITS_PER_BLOCK (BLOCK * UNITS_PER_THREAD)
// Threads per block of the segment (fallback) kernels; largest segment.
#define SEG_BLOCK 128
#define SEG_MAX 1024
// Rows (tokens of one plane) per work item of the hqmq decode kernels.
#define HQ_ITEM 256

// Output element types (template tags).
#define OUT_BF16 0
#define OUT_F16 1
// Source element types (template tags; the same codes as the file format).
#define SRC_BF16 1
#define SRC_F16 2
#define SRC_F32 3

// One page to decode (mirrors gpu::abi::PageDesc, 160 bytes).
struct PageDesc {
    u64 body;     // device address of the page body (uncompressed)
    u64 dst;      // output base: contiguous = element (plane 0, output token 0); paged = cache base
    u64 slots;    // paged: address of slot_mapping[batch 0, tensor token 0] (i64); 0 = contiguous
    u64 stride;   // contiguous: elements between planes; paged: slot entries between batch items
    u64 limit;    // paged: number of slots in the cache
    u32 rows;     // planes * tokens
    u32 tokens;   // tokens in the page
    u32 heads;    // kv heads per batch item
    u32 head_dim; // elements per row
    u32 sec0;     // body offset of SCALE (affine) or RAW (raw)
    u32 sec1;     // body offset of ZERO
    u32 sec2;     // body offset of INDEX
    int tok_off;  // contiguous: page token_start - output first token; paged: page token_start
    u32 t_lo;     // first page-relative token to write
    u32 t_hi;     // one past the last page-relative token to write
    u32 m_tokens; // udiv magic of tokens
    u32 m_heads;  // udiv magic of heads
    u32 upr;      // units per row of the launched kernel (head_dim / W)
    u32 m_upr;    // udiv magic of upr
    u64 side;     // device address of the tensor's side table (codebooks, signs, factors), 0 if none
    u32 sec3;     // body offsets of further sections (codec-specific, see each kernel)
    u32 sec4;
    u32 p0;       // codec parameters (see each kernel)
    u32 p1;
    u32 p2;
    u32 p3;
    // Paged row addressing (gpu::paged::PagedStrides): slot s is row
    // s % block_size of block s / block_size; head h of it starts at element
    // block * blk_stride + row * tok_stride + h * head_stride from dst.
    u64 blk_stride;
    u64 tok_stride;
    u64 head_stride;
    u32 block_size;
    u32 m_block;  // udiv magic of block_size
};
static_assert(sizeof(PageDesc) == 160, "PageDesc must match gpu::abi::PageDesc");

// One page to encode (mirrors gpu::abi::EncDesc, 104 bytes).
struct EncDesc {
    u64 src;      // device address of source element (plane 0, page token 0)
    u64 body;     // device address of the output page body
    u64 stride;   // source elements between planes
    u32 rows;
    u32 tokens;
    u32 head_dim;
    u32 sec_scale;
    u32 sec_zero;
    u32 sec_index;
    u32 page;     // page number, for error reports
    u32 m_tokens; // udiv magic of tokens
    u32 upr;      // units per row of the launched kernel (head_dim / W)
    u32 m_upr;    // udiv magic of upr
    u64 side;     // device address of the tensor's side table (codebooks), 0 if none
    u64 aux;      // device address of the page's scratch, 0 if none
    u32 sec3;     // body offset of a further section (codec-specific)
    u32 heads;    // kv heads per batch item
    u32 p0;       // codec parameters (see each kernel)
    u32 p1;
    u32 p2;
    u32 p3;
};
static_assert(sizeof(EncDesc) == 104, "EncDesc must match gpu::abi::EncDesc");

// n / d for the d whose magic m = ceil(2^32 / d) (0 when d == 1), computed
// on the host (gpu::spec::magic): umulhi gives the quotient or one more.
__device__ __forceinline__ u32 udiv(u32 n, u32 d, u32 m) {
    if (m == 0) return n;
    u32 q = __umulhi(n, m);
    if ((u64)q * d > (u64)n) q--;
    return q;
}

// Exact f32 of an integer code q < 2^23 without a conversion instruction.
__device__ __forceinline__ float code_f32(u32 q) {
    return __fsub_rn(__uint_as_float(0x4b000000u | q), 8388608.0f);
}

// Plain (weak, write-back) global stores. Pointers built from descriptor
// addresses are generic to the compiler, which would emit generic stores;
// __stwb would make them strong (STG.STRONG.SM).
#ifndef KVPACK_EMU
__device__ __forceinline__ void st_u4(void* p, uint4 v) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}
__device__ __forceinline__ void st_u2(void* p, uint2 v) {
    asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(v.x), "r"(v.y) : "memory");
}
__device__ __forceinline__ void st_u1(void* p, u32 v) {
    asm volatile("st.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// (a & b) | c in one LOP3 (the constants in registers).
__device__ __forceinline__ u32 and_or(u32 a, u32 b, u32 c) {
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}
#else
// The SIMT emulator (gpu::emu) compiles these sources as host C++.
__device__ __forceinline__ void st_u4(void* p, uint4 v) {
    emu_check_align(p, 16, "store");
    *reinterpret_cast<uint4*>(p) = v;
}
__device__ __forceinline__ void st_u2(void* p, uint2 v) {
    emu_check_align(p, 8, "store");
    *reinterpret_cast<uint2*>(p) = v;
}
__device__ __forceinline__ void st_u1(void* p, u32 v) {
    emu_check_align(p, 4, "store");
    *reinterpret_cast<u32*>(p) = v;
}
__device__ __forceinline__ u32 and_or(u32 a, u32 b, u32 c) { return (a & b) | c; }
#endif

// Two f32 as packed bf16x2 / f16x2 (round to nearest even; a NaN becomes
// the canonical NaN, the only place where bits may differ from the CPU,
// whose NaN keeps its payload).

__device__ __forceinline__ bool is_nan(float x) { return x != x; }
__device__ __forceinline__ bool is_finite(float x) {
    return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

// f32 -> bf16 bits, round to nearest even, NaN quieted (kernels::convert).
__device__ __forceinline__ u16 f32_to_bf16(float x) {
    u32 b = __float_as_uint(x);
    if (is_nan(x)) return (u16)((b >> 16) | 0x40u);
    return (u16)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

// f32 -> f16 bits, round to nearest even; NaN as the `half` crate does it.
__device__ __forceinline__ u16 f32_to_f16(float x) {
    if (is_nan(x)) {
        u32 b = __float_as_uint(x);
        return (u16)(((b >> 16) & 0x8000u) | 0x7c00u | 0x0200u | ((b & 0x7fffffu) >> 13));
    }
#ifndef KVPACK_EMU
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
#else
    return emu_f32_to_f16(x);
#endif
}
__device__ __forceinline__ float f16_to_f32(u16 h) {
#ifndef KVPACK_EMU
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    return emu_f16_to_f32(h);
#endif
}

// Two f32 as packed bf16x2 / f16x2 (round to nearest even; a NaN becomes
// the canonical NaN, the only place where bits may differ from the CPU,
// whose NaN keeps its payload).
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
#ifndef KVPACK_EMU
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    auto one = [](float x) -> u32 { return is_nan(x) ? 0x7fffu : (u32)f32_to_bf16(x); };
    return one(lo) | (one(hi) << 16);
#endif
}
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
#ifndef KVPACK_EMU
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    auto one = [](float x) -> u32 { return is_nan(x) ? 0x7fffu : (u32)f32_to_f16(x); };
    return one(lo) | (one(hi) << 16);
#endif
}

template <int OUT>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    return OUT == OUT_BF16 ? pack_bf16x2(lo, hi) : pack_f16x2(lo, hi);
}

template <int OUT>
__device__ __forceinline__ u16 to_out(float x) {
    return OUT == OUT_BF16 ? f32_to_bf16(x) : f32_to_f16(x);
}

// Eight output elements as one 16-byte store.
template <int OUT>
__device__ __forceinline__ void store8(u16* p, const float v[8]) {
    uint4 o;
    o.x = (u32)to_out<OUT>(v[0]) | ((u32)to_out<OUT>(v[1]) << 16);
    o.y = (u32)to_out<OUT>(v[2]) | ((u32)to_out<OUT>(v[3]) << 16);
    o.z = (u32)to_out<OUT>(v[4]) | ((u32)to_out<OUT>(v[5]) << 16);
    o.w = (u32)to_out<OUT>(v[6]) | ((u32)to_out<OUT>(v[7]) << 16);
    st_u4(p, o);
}

// Output element offset of (row, element 0) of a page, or -1 when the row is
// not written (outside [t_lo, t_hi), or a paged slot < 0). A slot past the
// cache is reported through `status` and skipped.
__device__ __forceinline__ i64 row_dst_pt(const PageDesc& d, u32 row, u32 p, u32 t, u64* status);
__device__ __forceinline__ i64 row_dst(const PageDesc& d, u32 row, u64* status) {
    u32 p = udiv(row, d.tokens, d.m_tokens);
    return row_dst_pt(d, row, p, row - p * d.tokens, status);
}

// row_dst for a row whose plane p and page token t are known.
__device__ __forceinline__ i64 row_dst_pt(const PageDesc& d, u32 row, u32 p, u32 t, u64* status) {
    if (t < d.t_lo || t >= d.t_hi) return -1;
    if (d.slots == 0) {
        return (i64)p * (i64)d.stride + ((i64)t + (i64)d.tok_off) * (i64)d.head_dim;
    }
    u32 b = udiv(p, d.heads, d.m_heads);
    u32 h = p - b * d.heads;
    const i64* slots = reinterpret_cast<const i64*>(d.slots);
    i64 slot = slots[(i64)b * (i64)d.stride + (i64)d.tok_off + (i64)t];
    if (slot < 0) return -1;
    if ((u64)slot >= d.limit) {
        atomicMin(status, (u64)row);
        return -1;
    }
    // limit <= 2^32 (checked on the host), so the slot fits 32 bits.
    u32 blk = udiv((u32)slot, d.block_size, d.m_block);
    u32 off = (u32)slot - blk * d.block_size;
    return (i64)blk * (i64)d.blk_stride + (i64)off * (i64)d.tok_stride + (i64)h * (i64)d.head_stride;
}

// Walsh-Hadamard butterflies on W consecutive elements held by one thread
// (strides 1, 2, 4, ... while below h and W), then on strides W..h/2 across
// lanes with xor shuffles. The stage order is the normative one
// (format/codecs/bdr.md): strides 1, 2, 4, ... in increasing order. The
// thread whose lane bit is clear holds the lower index and computes a + b;
// its partner computes a - b with a = the lower value. Every lane of the
// warp must call this (h is uniform over a launch).
template <int W>
__device__ __forceinline__ void wht_stage(float v[W], int s) {
#pragma unroll
    for (int i = 0; i < W; i++) {
        if (!(i & s)) {
            float a = v[i], b = v[i + s];
            v[i] = __fadd_rn(a, b);
            v[i + s] = __fsub_rn(a, b);
        }
    }
}

template <int W>
__device__ __forceinline__ void wht(float v[W], u32 h) {
    if (h >= (u32)W) {  // the common case: every in-register stage, no branches
#pragma unroll
        for (int s = 1; s < W; s <<= 1) wht_stage<W>(v, s);
    } else {
#pragma unroll
        for (int s = 1; s < W; s <<= 1) {
            if ((u32)s < h) wht_stage<W>(v, s);
        }
    }
    // Across lanes: o + v * sign with sign = +1 (lower) or -1 (upper) as
    // one fused multiply-add. The product is exact, so the single rounding
    // gives exactly the a + b / a - b of the normative butterfly (the CPU's
    // AVX2 path does the same).
    u32 lane = threadIdx.x & 31u;
    for (u32 m = 1; (u32)W * m < h; m <<= 1) {
        float sign = (lane & m) ? -1.0f : 1.0f;
#pragma unroll
        for (int i = 0; i < W; i++) {
            float o = __shfl_xor_sync(FULL_MASK, v[i], m);
            v[i] = __fmaf_rn(v[i], sign, o);
        }
    }
}

// Butterflies over a segment of n values in shared memory (strides 1..h/2
// within aligned blocks of h), for block-wide (fallback) kernels. Callers
// __syncthreads() before; this ends with one.
__device__ __forceinline__ void wht_shared(float* buf, u32 n, u32 h) {
    for (u32 s = 1; s < h; s <<= 1) {
        for (u32 p = threadIdx.x; p < n / 2; p += blockDim.x) {
            u32 i = (p / s) * 2u * s + (p % s);
            float a = buf[i], b = buf[i + s];
            buf[i] = __fadd_rn(a, b);
            buf[i + s] = __fsub_rn(a, b);
        }
        __syncthreads();
    }
}

// Code `i` (bits wide, LSB-first) of a packed stream, any alignment.
__device__ __forceinline__ u32 get_code(const u8* p, u64 i, u32 bits) {
    u64 bit = i * (u64)bits;
    u64 byte = bit >> 3;
    u32 sh = (u32)(bit & 7u);
    u32 v = p[byte];
    if (sh + bits > 8u) v |= ((u32)p[byte + 1]) << 8;
    return (v >> sh) & ((1u << bits) - 1u);
}

// Butterflies of the interleaved layout: a thread holds chunks m = 0..3 of
// 8 elements, chunk m of lane-in-row j being elements 8 * (j + lpr * m) .. +7
// of the row (lpr = head_dim / 32 lanes per row, a power of two). Element
// index bits: [0, 3) inside a chunk, [3, 3 + log2 lpr) the lane, then 2 bits
// of m. Stages run in the normative order (strides 1, 2, 4, ...): inside
// chunks, across lanes, across chunks.
__device__ __forceinline__ void wht_chunk_stage(float v[4][8], int s) {
#pragma unroll
    for (int m = 0; m < 4; m++) {
#pragma unroll
        for (int e = 0; e < 8; e++) {
            if (!(e & s)) {
                float a = v[m][e], b = v[m][e + s];
                v[m][e] = __fadd_rn(a, b);
                v[m][e + s] = __fsub_rn(a, b);
            }
        }
    }
}

__device__ __forceinline__ void wht_across_chunks(float v[4][8], int s) {
#pragma unroll
    for (int m = 0; m < 4; m++) {
        if (!(m & s)) {
#pragma unroll
            for (int e = 0; e < 8; e++) {
                float a = v[m][e], b = v[m + s][e];
                v[m][e] = __fadd_rn(a, b);
                v[m + s][e] = __fsub_rn(a, b);
            }
        }
    }
}

// ROWROT: the block is the whole row (h == head_dim == 32 * lpr, the usual
// bdr{head_dim}): every stage runs, with no run-time conditions (whose
// register merges would cost moves).
template <bool ROWROT>
__device__ __forceinline__ void wht_interleaved(float v[4][8], u32 h, u32 lpr) {
    if (ROWROT) {
        wht_chunk_stage(v, 1);
        wht_chunk_stage(v, 2);
        wht_chunk_stage(v, 4);
        u32 lane = threadIdx.x & 31u;
        for (u32 ml = 1; ml < lpr; ml <<= 1) {
            float sign = (lane & ml) ? -1.0f : 1.0f;
#pragma unroll
            for (int m = 0; m < 4; m++) {
#pragma unroll
                for (int e = 0; e < 8; e++) {
                    float o = __shfl_xor_sync(FULL_MASK, v[m][e], ml);
                    v[m][e] = __fmaf_rn(v[m][e], sign, o);
                }
            }
        }
        wht_across_chunks(v, 1);
        wht_across_chunks(v, 2);
        return;
    }
    if (h >= 8) {
        wht_chunk_stage(v, 1);
        wht_chunk_stage(v, 2);
        wht_chunk_stage(v, 4);
    } else {
        if (h > 1) wht_chunk_stage(v, 1);
        if (h > 2) wht_chunk_stage(v, 2);
        if (h > 4) wht_chunk_stage(v, 4);
    }
    // Across lanes (see wht<W>: one exact FMA per element).
    u32 lane = threadIdx.x & 31u;
    for (u32 ml = 1; ml < lpr && 8u * ml < h; ml <<= 1) {
        float sign = (lane & ml) ? -1.0f : 1.0f;
#pragma unroll
        for (int m = 0; m < 4; m++) {
#pragma unroll
            for (int e = 0; e < 8; e++) {
                float o = __shfl_xor_sync(FULL_MASK, v[m][e], ml);
                v[m][e] = __fmaf_rn(v[m][e], sign, o);
            }
        }
    }
    if (8u * lpr < h) wht_across_chunks(v, 1);
    if (16u * lpr < h) wht_across_chunks(v, 2);
}

// v with its sign bit flipped when bit is 1: v * (+-1), exactly.
__device__ __forceinline__ float flip_if(float v, u32 bit) {
    return __uint_as_float(__float_as_uint(v) ^ (bit << 31));
}

// Source element i (bf16, f16 or f32) widened to f32.
template <int SRC>
__device__ __forceinline__ float load_src1(const u8* base, u64 i) {
    if (SRC == SRC_F32) return reinterpret_cast<const float*>(base)[i];
    u16 h = reinterpret_cast<const u16*>(base)[i];
    return SRC == SRC_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

// W source elements (16-byte aligned) widened to f32.
template <int SRC, int W>
__device__ __forceinline__ void load_src(const u8* p, float v[W]) {
    if (SRC == SRC_F32) {
#pragma unroll
        for (int i = 0; i < W / 4; i++) {
            float4 a = __ldg(reinterpret_cast<const float4*>(p) + i);
            v[4 * i] = a.x; v[4 * i + 1] = a.y; v[4 * i + 2] = a.z; v[4 * i + 3] = a.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < W / 8; i++) {
            uint4 a = __ldg(reinterpret_cast<const uint4*>(p) + i);
            u32 x[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
            for (int k = 0; k < 4; k++) {
                if (SRC == SRC_BF16) {
                    v[8 * i + 2 * k] = __uint_as_float(x[k] << 16);
                    v[8 * i + 2 * k + 1] = __uint_as_float(x[k] & 0xffff0000u);
                } else {
                    v[8 * i + 2 * k] = f16_to_f32((u16)(x[k] & 0xffffu));
                    v[8 * i + 2 * k + 1] = f16_to_f32((u16)(x[k] >> 16));
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Helpers of the kernels added with the VQ and group codecs (hqmq, octopus,
// turbo, polar, innerq, kivi).

// `n` bits (1..32) of a packed stream (SPEC 6.2, LSB-first) from stream bit
// `bit`, read as aligned 32-bit words. Section starts are 64-byte aligned and
// sections are padded to 64 bytes, so the word holding the last wanted bit
// lies inside the body; a second word is read only when the field crosses
// into it.
__device__ __forceinline__ u32 get_bits(const u8* base, u64 bit, u32 n) {
    const u32* w = reinterpret_cast<const u32*>(base) + (bit >> 5);
    u32 sh = (u32)bit & 31u;
    u32 v = __ldg(w) >> sh;
    if (sh + n > 32u) v |= __ldg(w + 1) << (32u - sh);
    return n >= 32u ? v : v & ((1u << n) - 1u);
}

// `n` bits (1..64) from stream bit `bit`, as get_bits.
__device__ __forceinline__ u64 get_bits64(const u8* base, u64 bit, u32 n) {
    const u32* w = reinterpret_cast<const u32*>(base) + (bit >> 5);
    u32 sh = (u32)bit & 31u;
    u64 v = (u64)__ldg(w) >> sh;
    u32 have = 32u - sh;
    if (have < n) {
        v |= (u64)__ldg(w + 1) << have;
        have += 32u;
    }
    if (have < n) v |= (u64)__ldg(w + 2) << have;
    return n >= 64u ? v : v & ((1ull << n) - 1ull);
}

// NB (1..8) little-endian bytes at p, p aligned to the largest power of two
// (at most 8) dividing NB, with the widest loads that alignment allows.
template <int NB>
__device__ __forceinline__ u64 load_le(const u8* p) {
    if (NB == 8) return __ldg(reinterpret_cast<const unsigned long long*>(p));
    if (NB == 4) return __ldg(reinterpret_cast<const u32*>(p));
    if (NB == 2) return __ldg(reinterpret_cast<const u16*>(p));
    if (NB == 1) return __ldg(p);
    u64 v = 0;
    if (NB % 2 == 0) {
#pragma unroll
        for (int i = 0; i < NB / 2; i++) v |= (u64)__ldg(reinterpret_cast<const u16*>(p) + i) << (16 * i);
    } else {
#pragma unroll
        for (int i = 0; i < NB; i++) v |= (u64)__ldg(p + i) << (8 * i);
    }
    return v;
}

// f16 bits at element i of a section.
__device__ __forceinline__ float ld_f16(const u8* sec, u64 i) {
    return f16_to_f32(__ldg(reinterpret_cast<const u16*>(sec) + i));
}

// Eight f16 at element i (i % 8 == 0) of a 16-byte aligned section.
__device__ __forceinline__ void ld_f16x8(const u8* sec, u64 i, float v[8]) {
    uint4 a = __ldg(reinterpret_cast<const uint4*>(sec + 2 * i));
    u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        v[2 * k] = f16_to_f32((u16)(w[k] & 0xffffu));
        v[2 * k + 1] = f16_to_f32((u16)(w[k] >> 16));
    }
}

// Eight packed outputs as one 16-byte store.
template <int OUT>
__device__ __forceinline__ void st_out8(u16* p, const float v[8]) {
    st_u4(p, make_uint4(pack2<OUT>(v[0], v[1]), pack2<OUT>(v[2], v[3]), pack2<OUT>(v[4], v[5]),
                        pack2<OUT>(v[6], v[7])));
}

// Records that a page of the launch failed the codec's content checks (the
// host reports a format error; the CPU decoder names the page). Word 1 of
// the status buffer; word 0 is the slot-mapping check of row_dst.
__device__ __forceinline__ void content_error(u64* status, u32 desc) {
    atomicMin(status + 1, (u64)desc);
}

// Dynamic shared memory of a kernel (the launch sets its size).
#ifndef KVPACK_EMU
#define DYN_SHARED(T, name) extern __shared__ __align__(16) T name[]
#else
#define DYN_SHARED(T, name) T* name = reinterpret_cast<T*>(emu_dyn_smem())
#endif

// Walking the units u = base + k * BLOCK (k = 0, 1, ...) of a unit kernel:
// row, unit in row j, plane p and page token t. When the units per row
// are a power of two <= BLOCK, j is the same for every k and the row
// advances by BLOCK / upr (`drow`), so no division is needed after the
// first unit; otherwise (drow == 0) every unit is divided out again.
struct RowWalk {
    u32 row, j, p, t;
};
__device__ __forceinline__ void walk_init(const PageDesc& d, u32 u, RowWalk& r) {
    r.row = udiv(u, d.upr, d.m_upr);
    r.j = u - r.row * d.upr;
    r.p = udiv(r.row, d.tokens, d.m_tokens);
    r.t = r.row - r.p * d.tokens;
}
__device__ __forceinline__ u32 walk_step(u32 upr) {
    return (upr & (upr - 1u)) == 0u && upr <= (u32)BLOCK ? (u32)BLOCK >> (__ffs(upr) - 1) : 0u;
}
__device__ __forceinline__ void walk_next(const PageDesc& d, u32 u, u32 drow, RowWalk& r) {
    if (drow == 0u) {
        walk_init(d, u, r);
        return;
    }
    r.row += drow;
    r.t += drow;
    while (r.t >= d.tokens) {
        r.t -= d.tokens;
        r.p++;
    }
}

// ---------------------------------------------------------------------------
// Quad layout of the group kernels (innerq, kivi, polar): a thread handles
// one chunk j (8 elements, or 8 pairs for polar) of QUADS quads of 4
// consecutive rows r0 .. r0 + 3 (r0 a multiple of 4). The chunks per row
// (`upr`) are a power of two <= 256 and the upr lanes of a row are
// consecutive threads, so every 16-byte store instruction of a warp writes
// whole rows, and per-group data shared along tokens (innerq values, kivi
// keys, polar radius scales) is loaded and prepared once for 4 rows. Work
// items come from the 8-element (16 for polar) unit grid with 4 * QUADS
// units per thread: a block covers 4 * QUADS * BLOCK / upr rows, a multiple
// of 4 starting at a multiple of 4. Quad q of a thread starts at row
// quad_row0(first unit, log2 upr, q).
#define QUADS 1

__device__ __forceinline__ u32 quad_row0(u32 first_unit, u32 lg, u32 q) {
    return (first_unit >> lg) + 4u * ((threadIdx.x >> lg) + q * ((u32)BLOCK >> lg));
}

// A quad: first row r0 (< rows), its plane p and page token t, the index
// of its last row in the page (0..3), and whether its 4 rows lie in plane
// p (tokens t .. t + 3; always when the page's token count is a multiple
// of 4).
struct Quad {
    u32 r0, p, t, last;
    bool same;
};
__device__ __forceinline__ Quad quad_at(const PageDesc& d, u32 r0) {
    Quad q;
    q.r0 = r0;
    q.p = udiv(r0, d.tokens, d.m_tokens);
    q.t = r0 - q.p * d.tokens;
    q.last = min(d.rows - r0, 4u) - 1u;
    q.same = q.t + 3u < d.tokens;
    return q;
}

// Row k of the quad for loads: rows past the page repeat its last row
// (loaded, never stored), so loads need no conditions.
__device__ __forceinline__ u32 quad_row(const Quad& q, u32 k) { return q.r0 + min(k, q.last); }

// Plane pk and page token tk of row k of the quad.
__device__ __forceinline__ void quad_pt(const PageDesc& d, const Quad& q, u32 k, u32& pk, u32& tk) {
    pk = q.p;
    tk = q.t + k;
    if (!q.same) {
        while (tk >= d.tokens) {
            tk -= d.tokens;
            pk++;
        }
    }
}

// Output pointers of the quad's 4 rows at element `off` of each row;
// nullptr for rows not written (past the page, outside the token range,
// unmapped slots). Contiguous quads in one plane are D elements apart.
__device__ __forceinline__ void quad_dst(const PageDesc& d, const Quad& q, u32 off, u16* out[4], u64* status) {
    u16* dst = reinterpret_cast<u16*>(d.dst);
    if (d.slots == 0 && q.same) {
        u16* b = dst + ((i64)q.p * (i64)d.stride + ((i64)q.t + (i64)d.tok_off) * (i64)d.head_dim) + off;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const u32 t = q.t + (u32)k;
            out[k] = t >= d.t_lo && t < d.t_hi ? b + (u32)k * d.head_dim : nullptr;
        }
        return;
    }
#pragma unroll
    for (int k = 0; k < 4; k++) {
        out[k] = nullptr;
        if ((u32)k <= q.last) {
            u32 pk, tk;
            quad_pt(d, q, (u32)k, pk, tk);
            i64 o = row_dst_pt(d, q.r0 + (u32)k, pk, tk, status);
            if (o >= 0) out[k] = dst + o + off;
        }
    }
}

// Calls row(r, pk, tk, out) for every written row of the quad with its
// plane and page token: the row-by-row path of quads whose rows do not
// share the per-group data (across planes or token groups).
template <class Row>
__device__ __forceinline__ void quad_each_row(const PageDesc& d, const Quad& q, u16* const out[4], Row row) {
#pragma unroll
    for (u32 k = 0; k < 4; k++) {
        if (out[k] == nullptr) continue;
        u32 pk, tk;
        quad_pt(d, q, k, pk, tk);
        row(q.r0 + k, pk, tk, out[k]);
    }
}

// The 8 codes of B bits of chunk `unit` (elements 8 * unit .. + 7) of a
// packed stream: B aligned bytes for B = 1, 2, 4, 8, else the 8B-bit
// field from aligned 32-bit words.
template <int B>
__device__ __forceinline__ u64 codes8(const u8* index, u32 unit) {
    if (B == 1 || B == 2 || B == 4 || B == 8) return load_le<B>(index + unit * (u32)B);
    return get_bits64(index, (u64)unit * (8u * B), 8u * B);
}

// Code i of 8 codes of B bits as an exact f32 (the code OR-ed into the
// mantissa of 2^23, minus 2^23).
template <int B>
__device__ __forceinline__ float code8_f32(u64 codes, int i, u32 mask) {
    u32 lo = (u32)codes, hi = (u32)(codes >> 32);
    u32 cw = B * (i + 1) <= 32 ? lo >> (B * i) : B * i >= 32 ? hi >> (B * i - 32) : (u32)(codes >> (B * i));
    return __fsub_rn(__uint_as_float(and_or(cw, mask, 0x4b000000u)), 8388608.0f);
}

// Eight affine values x_i = q_i * s_i + z_i from 8 codes of B bits, each
// one fused multiply-add: q * s is exact in binary32 (a code below 2^8
// times an f16 scale), so it rounds exactly like (q * s) + z.
template <int B>
__device__ __forceinline__ void affine8(u64 codes, u32 mask, const float s[8], const float z[8], float x[8]) {
#pragma unroll
    for (int i = 0; i < 8; i++) x[i] = __fmaf_rn(code8_f32<B>(codes, i, mask), s[i], z[i]);
}

// Eight outputs as one packed 16-byte value, element i negated when bit i
// of `neg` (< 256) is set by flipping the sign bit of its packed value: the
// same bits as negating before the conversion (rounding to nearest even is
// symmetric; the values are never NaN). m holds sign 2i at bit 15 - 2i and
// sign 2i + 1 at bit 31 - 2i, so (m << 2i) & 0x80008000 is the mask of
// output word i.
template <int OUT>
__device__ __forceinline__ uint4 pack8_neg(const float x[8], u32 neg) {
    const u32 rb = __brev(neg);
    const u32 m = (rb >> 16) | (rb << 1);
    const u32 s = 0x80008000u;
    return make_uint4(pack2<OUT>(x[0], x[1]) ^ (m & s), pack2<OUT>(x[2], x[3]) ^ ((m << 2) & s),
                      pack2<OUT>(x[4], x[5]) ^ ((m << 4) & s), pack2<OUT>(x[6], x[7]) ^ ((m << 6) & s));
}

// Encode kernels: source element e (bf16 / f16 / f32) widened to f32.
template <int SRC>
__device__ __forceinline__ float enc_load(const u8* src, u64 e) {
    if (SRC == SRC_F32) return __ldg(reinterpret_cast<const float*>(src) + e);
    u16 h = __ldg(reinterpret_cast<const u16*>(src) + e);
    return SRC == SRC_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

// Encode kernels: packs codes[0..n) (code k = code e0 + k of the page) into
// the section `words` at `bits` bits per code, LSB-first: words the run
// covers whole are stored, the edge words OR-ed in with atomics (the body
// template is zeroed, so neighbouring runs of other blocks combine). Bit
// offsets within the run are 32-bit (n * bits < 2^32). One thread per word;
// for 8- or 16-bit codes of a power-of-two width starting on a word
// boundary, each word is 32-bit shared loads (4 or 2 codes) and shifts.
template <class C>
__device__ __forceinline__ void enc_pack(const C* codes, u32 n, u64 e0, u32 bits, u32* words) {
    const u64 b0 = e0 * bits;
    const u32 off = (u32)b0 & 31u, nb = off + n * bits, nw = (nb + 31u) >> 5;
    u32* w0 = words + (b0 >> 5);
    if (sizeof(C) <= 2 && off == 0u && (bits & (bits - 1u)) == 0u && bits <= 8u * sizeof(C) &&
        (n & (4u / sizeof(C) - 1u)) == 0u && (reinterpret_cast<u64>(codes) & 3u) == 0u) {
        // Whole words of 32 / bits codes (a multiple of the 4 / sizeof(C)
        // codes of one 32-bit shared load).
        const u32 per = 32u / bits, step = 4u / sizeof(C);
        for (u32 j = threadIdx.x; j < nw; j += blockDim.x) {
            const u32 k0 = j * per, k1 = min(k0 + per, n);
            u32 word = 0;
            for (u32 k = k0; k < k1; k += step) {
                const u32 v = *reinterpret_cast<const u32*>(codes + k);
                const u32 q = sizeof(C) == 1 ? (v & 0xffu) | (((v >> 8) & 0xffu) << bits) |
                                                   (((v >> 16) & 0xffu) << (2u * bits)) | ((v >> 24) << (3u * bits))
                                             : (v & 0xffffu) | ((v >> 16) << bits);
                word |= q << ((k - k0) * bits);
            }
            if (32u * j + 32u <= nb) {
                w0[j] = word;
            } else if (word != 0u) {
                atomicOr(w0 + j, word);
            }
        }
        return;
    }
    for (u32 j = threadIdx.x; j < nw; j += blockDim.x) {
        const u32 lo = 32u * j;
        u32 k = lo > off ? (lo - off) / bits : 0u;
        u32 word = 0;
        for (; k < n; k++) {
            const u32 cb = off + k * bits;
            if (cb >= lo + 32u) break;
            const u32 v = codes[k];
            word |= cb >= lo ? v << (cb - lo) : v >> (lo - cb);
        }
        if ((j > 0u || off == 0u) && lo + 32u <= nb) {
            w0[j] = word;
        } else if (word != 0u) {
            atomicOr(w0 + j, word);
        }
    }
}
