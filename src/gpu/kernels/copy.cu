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
