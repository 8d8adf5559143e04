// Device-to-device copy, the memory-bandwidth ceiling every kernel is
// compared with (bytes read + bytes written). 16-byte loads and stores,
// four independent loads in flight per thread, grid-stride.

extern "C" __global__ void __launch_bounds__(BLOCK)
    copy_u128(const uint4* __restrict__ src, uint4* __restrict__ dst, u64 n) {
    u64 stride = (u64)gridDim.x * BLOCK;
    u64 i = (u64)blockIdx.x * BLOCK + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        uint4 a = src[i];
        uint4 b = src[i + stride];
        uint4 c = src[i + 2 * stride];
        uint4 d = src[i + 3 * stride];
        dst[i] = a;
        dst[i + stride] = b;
        dst[i + 2 * stride] = c;
        dst[i + 3 * stride] = d;
    }
    for (; i < n; i += stride) dst[i] = src[i];
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
