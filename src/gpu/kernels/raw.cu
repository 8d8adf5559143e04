// Decode of `raw` pages (format/codecs/raw.md): elements at source precision
// (bf16, f16 or f32), converted to the output type with round to nearest
// even. bf16 -> bf16 and f16 -> f16 are plain copies.
//
// Fast kernels `decode_raw_{src}_{out}`: head_dim % 8 == 0; one unit = 8
// consecutive elements of a row (one 16-byte store); each thread handles
// UNITS_PER_THREAD units 256 apart, so every warp instruction touches
// contiguous memory. Work item (x, y) = (page descriptor, first unit).
//
// Fallback `decode_raw_any_{out}`: any head_dim, one element per thread, the
// source type a run-time argument. Work item (x, y) = (page, first element).

template <int SRC>
__device__ __forceinline__ void load8(const u8* p, float v[8]) {
    if (SRC == SRC_F32) {
        float4 a = reinterpret_cast<const float4*>(p)[0];
        float4 b = reinterpret_cast<const float4*>(p)[1];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
        uint4 a = *reinterpret_cast<const uint4*>(p);
        u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u16 lo = (u16)(w[i] & 0xffffu), hi = (u16)(w[i] >> 16);
            v[2 * i] = SRC == SRC_BF16 ? bf16_to_f32(lo) : f16_to_f32(lo);
            v[2 * i + 1] = SRC == SRC_BF16 ? bf16_to_f32(hi) : f16_to_f32(hi);
        }
    }
}

template <int SRC, int OUT>
__device__ __forceinline__ void raw_decode_fast(const PageDesc* __restrict__ descs,
                                                const uint2* __restrict__ work, u64* status) {
    const uint2 w = work[blockIdx.x];
    const PageDesc d = descs[w.x];
    const u32 upr = d.upr;  // head_dim / 8
    const u32 nunits = d.rows * upr;
    const u32 esize = SRC == SRC_F32 ? 4u : 2u;
    const u8* src = reinterpret_cast<const u8*>(d.body) + d.sec0;
    u16* dst = reinterpret_cast<u16*>(d.dst);
    // Pure copy when the types agree: move 16 bytes without conversion.
    const bool same = (SRC == SRC_BF16 && OUT == OUT_BF16) || (SRC == SRC_F16 && OUT == OUT_F16);
    uint4 raw[UNITS_PER_THREAD];
    float v[UNITS_PER_THREAD][8];
#pragma unroll
    for (int k = 0; k < UNITS_PER_THREAD; k++) {
        u32 u = w.y + (u32)k * BLOCK + threadIdx.x;
        if (u < nunits) {
            const u8* p = src + (u64)u * 8u * esize;
            if (same) raw[k] = __ldg(reinterpret_cast<const uint4*>(p));
            else load8<SRC>(p, v[k]);
        }
    }
#pragma unroll
    for (int k = 0; k < UNITS_PER_THREAD; k++) {
        u32 u = w.y + (u32)k * BLOCK + threadIdx.x;
        if (u < nunits) {
            u32 row = udiv(u, upr, d.m_upr);
            u32 j = u - row * upr;
            i64 o = row_dst(d, row, status);
            if (o >= 0) {
                u16* q = dst + o + 8 * j;
                if (same) st_u4(q, raw[k]);
                else store8<OUT>(q, v[k]);
            }
        }
    }
}

#define RAW_ARGS const PageDesc *descs, const uint2 *work, u64 *status
extern "C" __global__ void __launch_bounds__(BLOCK) decode_raw_bf16_bf16(RAW_ARGS) { raw_decode_fast<SRC_BF16, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_raw_bf16_f16(RAW_ARGS) { raw_decode_fast<SRC_BF16, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_raw_f16_bf16(RAW_ARGS) { raw_decode_fast<SRC_F16, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_raw_f16_f16(RAW_ARGS) { raw_decode_fast<SRC_F16, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_raw_f32_bf16(RAW_ARGS) { raw_decode_fast<SRC_F32, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_raw_f32_f16(RAW_ARGS) { raw_decode_fast<SRC_F32, OUT_F16>(descs, work, status); }

template <int OUT>
__device__ __forceinline__ void raw_decode_any(const PageDesc* __restrict__ descs,
                                               const uint2* __restrict__ work, u32 src_type,
                                               u64* status) {
    const uint2 w = work[blockIdx.x];
    const PageDesc d = descs[w.x];
    const u32 n = d.rows * d.head_dim;
    const u8* src = reinterpret_cast<const u8*>(d.body) + d.sec0;
    u16* dst = reinterpret_cast<u16*>(d.dst);
    for (int k = 0; k < UNITS_PER_THREAD; k++) {
        u32 e = w.y + (u32)k * BLOCK + threadIdx.x;
        if (e >= n) break;
        u32 row = e / d.head_dim;
        u32 i = e - row * d.head_dim;
        i64 o = row_dst(d, row, status);
        if (o < 0) continue;
        u16 out;
        if (src_type == SRC_F32) {
            out = to_out<OUT>(reinterpret_cast<const float*>(src)[e]);
        } else {
            u16 s = reinterpret_cast<const u16*>(src)[e];
            bool same = (src_type == SRC_BF16) == (OUT == OUT_BF16);
            out = same ? s : to_out<OUT>(src_type == SRC_BF16 ? bf16_to_f32(s) : f16_to_f32(s));
        }
        dst[o + i] = out;
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK)
    decode_raw_any_bf16(const PageDesc* descs, const uint2* work, u32 src_type, u64* status) {
    raw_decode_any<OUT_BF16>(descs, work, src_type, status);
}
extern "C" __global__ void __launch_bounds__(BLOCK)
    decode_raw_any_f16(const PageDesc* descs, const uint2* work, u32 src_type, u64* status) {
    raw_decode_any<OUT_F16>(descs, work, src_type, status);
}

// Gather of one K or V tensor out of a paged KV cache into the contiguous
// layout [planes, tokens, head_dim] (the source of an encode): the inverse
// of a raw decode. The descriptor describes the paged side exactly as for a
// decode (dst = the cache, slots, strides: row_dst addresses the row) and
// `body` is the contiguous output. Unmapped rows (slot < 0) are zero.
//
// gather_paged_w8: head_dim % 8 == 0, units of 8 elements (16-byte loads
// and stores), UNITS_PER_THREAD units per thread BLOCK apart. Work item
// (x, y) = (descriptor, first unit).
extern "C" __global__ void __launch_bounds__(BLOCK)
    gather_paged_w8(const PageDesc* __restrict__ descs, const uint2* __restrict__ work, u64* status) {
    const uint2 w = work[blockIdx.x];
    const PageDesc d = descs[w.x];
    const u32 nunits = d.rows * d.upr;
    const u16* src = reinterpret_cast<const u16*>(d.dst);
    u16* out = reinterpret_cast<u16*>(d.body);
#pragma unroll
    for (int k = 0; k < UNITS_PER_THREAD; k++) {
        u32 u = w.y + (u32)k * BLOCK + threadIdx.x;
        if (u < nunits) {
            u32 row = udiv(u, d.upr, d.m_upr);
            u32 j = u - row * d.upr;
            i64 o = row_dst(d, row, status);
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (o >= 0) v = *reinterpret_cast<const uint4*>(src + o + 8u * j);
            st_u4(out + (u64)u * 8u, v);
        }
    }
}

// gather_paged_any: any head_dim, one element per thread, UNITS_PER_BLOCK
// elements per block. Work item (x, y) = (descriptor, first element).
extern "C" __global__ void __launch_bounds__(BLOCK)
    gather_paged_any(const PageDesc* __restrict__ descs, const uint2* __restrict__ work, u64* status) {
    const uint2 w = work[blockIdx.x];
    const PageDesc d = descs[w.x];
    const u64 n = (u64)d.rows * d.head_dim;
    const u16* src = reinterpret_cast<const u16*>(d.dst);
    u16* out = reinterpret_cast<u16*>(d.body);
    for (u32 k = 0; k < (u32)UNITS_PER_THREAD; k++) {
        u64 e = (u64)w.y + (u64)k * BLOCK + threadIdx.x;
        if (e < n) {
            u32 row = (u32)(e / d.head_dim);
            u32 c = (u32)(e - (u64)row * d.head_dim);
            i64 o = row_dst(d, row, status);
            out[e] = o >= 0 ? src[o + c] : (u16)0;
        }
    }
}

// Encode of `raw` pages (the raw codec, `polar:...:vraw` value pages): the
// page's elements copied into the RAW section in page order (plane-major
// rows). `encode_raw_u16` / `encode_raw_u32` by element size; work item
// (page, first element), UNITS_PER_THREAD elements per thread BLOCK apart.
template <typename T>
__device__ __forceinline__ void raw_encode(const EncDesc* __restrict__ descs, const uint2* __restrict__ work) {
    const uint2 w = work[blockIdx.x];
    const EncDesc d = descs[w.x];
    const u32 per = d.tokens * d.head_dim, n = d.rows * d.head_dim;
    const T* src = reinterpret_cast<const T*>(d.src);
    T* out = reinterpret_cast<T*>(reinterpret_cast<u8*>(d.body) + d.sec_index);
#pragma unroll
    for (u32 k = 0; k < UNITS_PER_THREAD; k++) {
        const u32 e = w.y + k * BLOCK + threadIdx.x;
        if (e >= n) break;
        const u32 p = e / per;
        out[e] = __ldg(src + (u64)p * d.stride + (e - p * per));
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK) encode_raw_u16(const EncDesc *descs, const uint2 *work, u64 *status) { raw_encode<u16>(descs, work); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_raw_u32(const EncDesc *descs, const uint2 *work, u64 *status) { raw_encode<u32>(descs, work); }
