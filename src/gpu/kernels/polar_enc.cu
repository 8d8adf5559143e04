// Encode of `polar` key pages (format/codecs/polar.md), producing the CPU
// encoder's sections bit for bit (src/codec/polar/mod.rs, src/kernels/polar.rs).
// Value pages are `int{b}` pages (the affine encoder).
//
// Pair j of a row is channels (j, j + D/2) (half) or (2j, 2j + 1) (adjacent).
//     r = f32(sqrt_f64(f64(x)^2 + f64(y)^2))          (one rounding to f32)
//     s_{p,j} = (max over the page's tokens of r) / f32(L), L = 2^n - 1
//     rho = s > 0 ? rne(clamp(r / s, 0, L)) : 0
//     a = the direction k maximizing (x * c_k) + (y * s_k), ties to the
//         smallest k, by the CPU's search (NearestDirection::find): for the
//         canonical uniform table with M >= 8 and 1e-30 <= max(|x|, |y|) <=
//         1e30, the three candidates around the same approximate angle
//         (the same binary32 operations, so the same candidates); otherwise
//         every direction
//     code = a | rho << m, (m + n)-bit codes in row-major (row, pair) order
//
// `encode_polar_scale_{src}`: work item (page, first row of a plane); the
// radius maxima of the plane's pairs in shared memory (atomicMax on the
// bits: radii are non-negative), then SCALE written. A NaN or infinity is
// reported as atomicMin of page << 32 | row.
// `encode_polar_{src}`: work item (page, first row) = up to p3 rows of one
// plane; codes staged in shared memory, then packed into INDEX (whole
// words stored, the two edge words OR-ed in with atomics).
//
// EncDesc: sec_scale = SCALE 0, sec_index = INDEX 0, side = the direction
// table (2^m (cos, sin) f32 pairs); p0 = m, p1 = n, p2 = adjacent | uniform
// << 1, p3 = rows per work item of `encode_polar_{src}`.

#define PE_MAX_PAIRS 512
#define PE_TILE 4096
#define PE_RNE 12582912.0f

// kernels::polar::radius.
__device__ __forceinline__ float pe_radius(float x, float y) {
    double a = (double)x, b = (double)y;
    return __double2float_rn(__dsqrt_rn(__dadd_rn(__dmul_rn(a, a), __dmul_rn(b, b))));
}

// x^2 + y^2 in binary64 (the radius before its square root): max over
// tokens of the radius = the radius of the max of this (sqrt and the
// rounding to f32 are monotone), so the scale pass takes one square root
// per pair.
__device__ __forceinline__ double pe_norm2(float x, float y) {
    double a = (double)x, b = (double)y;
    return __dadd_rn(__dmul_rn(a, a), __dmul_rn(b, b));
}

// rho = rne(clamp(radius(x, y) / s, 0, L)) for finite x, y and s > 0. Fast
// path in binary32: r' = sqrt(x*x + y*y) is within 2^-21.5 (relative) of the
// binary64 radius rounded to f32, and t' = r' * RN(1/s) within 2^-13 of
// RN(radius / s) for t' <= 2^8 (a larger t' clamps to L either way); so t'
// rounds to the same integer unless it lies within PE_NEAR = 2^-10 of a
// half-integer, where the exact path decides. The fast path needs max(|x|,
// |y|) in [2^-60, 2^60] and 1/s normal (no overflow or underflow).
#define PE_NEAR 0.0009765625f
__device__ __forceinline__ u32 pe_rho(float x, float y, float s, float rs, float L) {
    const float mag = fmaxf(fabsf(x), fabsf(y));
    if (mag >= 8.6736174e-19f && mag <= 1.1529215e18f && rs >= 1.0e-30f && rs <= 1.0e30f) {
        const float r = __fsqrt_rn(__fmaf_rn(x, x, __fmul_rn(y, y)));
        const float t = fminf(fmaxf(__fmul_rn(r, rs), 0.0f), L);
        const float m = __fadd_rn(t, PE_RNE);
        if (fabsf(fabsf(__fsub_rn(t, __fsub_rn(m, PE_RNE))) - 0.5f) >= PE_NEAR) return __float_as_uint(m) - 0x4b400000u;
    }
    const float q = fminf(fmaxf(__fdiv_rn(pe_radius(x, y), s), 0.0f), L);
    return __float_as_uint(__fadd_rn(q, PE_RNE)) - 0x4b400000u;
}

__device__ __forceinline__ float pe_dot(float x, float y, float2 u) {
    return __fadd_rn(__fmul_rn(x, u.x), __fmul_rn(y, u.y));
}

__device__ __forceinline__ float pe_sel(bool c, float a, float b) { return c ? a : b; }

// kernels::polar::approx_turns, operation for operation.
__device__ __forceinline__ float pe_turns(float x, float y) {
    float ax = fabsf(x), ay = fabsf(y);
    float num = fminf(ax, ay), den = fmaxf(ax, ay);
    float z = __fdiv_rn(num, pe_sel(den > 0.0f, den, 1.0f));
    float z2 = __fmul_rn(z, z);
    float p = __int_as_float(0x3b3bd749);
    p = __fadd_rn(__int_as_float(0xbc846e02), __fmul_rn(z2, p));
    p = __fadd_rn(__int_as_float(0x3d2fc1fe), __fmul_rn(z2, p));
    p = __fadd_rn(__int_as_float(0xbd9a3174), __fmul_rn(z2, p));
    p = __fadd_rn(__int_as_float(0x3dda3d83), __fmul_rn(z2, p));
    p = __fadd_rn(__int_as_float(0xbe117fc3), __fmul_rn(z2, p));
    p = __fadd_rn(__int_as_float(0x3e4cbbe5), __fmul_rn(z2, p));
    p = __fadd_rn(__int_as_float(0xbeaaaa6c), __fmul_rn(z2, p));
    float a = __fadd_rn(z, __fmul_rn(__fmul_rn(z, z2), p));
    a = pe_sel(ay > ax, __fsub_rn(__int_as_float(0x3fc90fdb), a), a);  // pi/2
    a = pe_sel(x < 0.0f, __fsub_rn(__int_as_float(0x40490fdb), a), a);  // pi
    a = pe_sel(y < 0.0f, __fsub_rn(__int_as_float(0x40c90fdb), a), a);  // 2 pi
    return __fmul_rn(a, __int_as_float(0x3e22f983));                   // 1 / (2 pi)
}

// kernels::polar::NearestDirection::find.
__device__ __forceinline__ u32 pe_find(float x, float y, const float2* dirs, u32 n, bool uniform) {
    float mag = fmaxf(fabsf(x), fabsf(y));
    if (!uniform || !(mag >= __int_as_float(0x0da24260) && mag <= __int_as_float(0x7149f2ca))) {
        u32 best = 0;
        float bd = pe_dot(x, y, dirs[0]);
        for (u32 k = 1; k < n; k++) {
            float dk = pe_dot(x, y, dirs[k]);
            if (dk > bd) {
                best = k;
                bd = dk;
            }
        }
        return best;
    }
    const u32 mask = n - 1u;
    const u32 k0 = ((u32)__fadd_rn(__fmul_rn(pe_turns(x, y), (float)n), 0.5f)) & mask;
    u32 c0, c1, c2;
    if (k0 == 0u) {
        c0 = 0u; c1 = 1u; c2 = mask;
    } else if (k0 == mask) {
        c0 = 0u; c1 = mask - 1u; c2 = mask;
    } else {
        c0 = k0 - 1u; c1 = k0; c2 = k0 + 1u;
    }
    float d0 = pe_dot(x, y, dirs[c0]), d1 = pe_dot(x, y, dirs[c1]), d2 = pe_dot(x, y, dirs[c2]);
    u32 best = c0;
    float bd = d0;
    if (d1 > bd) {
        best = c1;
        bd = d1;
    }
    if (d2 > bd) best = c2;
    return best;
}

// Channels of pair j.
__device__ __forceinline__ void pe_pair(u32 D, u32 j, bool adjacent, u32& i1, u32& i2) {
    if (adjacent) {
        i1 = 2u * j;
        i2 = i1 + 1u;
    } else {
        i1 = j;
        i2 = j + D / 2u;
    }
}

template <int SRC>
__device__ __forceinline__ void polar_scale(const EncDesc* __restrict__ descs, const uint2* __restrict__ work,
                                            u64* status) {
    __shared__ u32 smax[PE_MAX_PAIRS];
    const uint2 w = work[blockIdx.x];
    const EncDesc d = descs[w.x];
    const u32 D = d.head_dim, pairs = D / 2u, T = d.tokens;
    const bool adjacent = (d.p2 & 1u) != 0u;
    const u32 r0 = w.y, plane = udiv(r0, T, d.m_tokens);
    const u8* src = reinterpret_cast<const u8*>(d.src) + (SRC == SRC_F32 ? 4u : 2u) * ((u64)plane * d.stride);
    const float L = (float)((1u << d.p1) - 1u);
    float* scales = reinterpret_cast<float*>(reinterpret_cast<u8*>(d.body) + d.sec_scale);
    if (pairs <= blockDim.x && blockDim.x % pairs == 0u) {
        // Each thread keeps one pair j = threadIdx.x % pairs: the max of x^2
        // + y^2 in a register, then one square root per pair.
        __shared__ double snorm[BLOCK];
        const u32 j = threadIdx.x % pairs, dt = blockDim.x / pairs;
        u32 i1, i2;
        pe_pair(D, j, adjacent, i1, i2);
        double mx = 0.0;
        for (u32 t = threadIdx.x / pairs; t < T; t += dt) {
            const float x = enc_load<SRC>(src, (u64)t * D + i1), y = enc_load<SRC>(src, (u64)t * D + i2);
            if (!is_finite(x) || !is_finite(y)) {
                atomicMin(status, ((u64)d.page << 32) | (r0 + t));
                continue;
            }
            mx = fmax(mx, pe_norm2(x, y));
        }
        snorm[threadIdx.x] = mx;
        __syncthreads();
        if (threadIdx.x < pairs) {
            for (u32 k = threadIdx.x + pairs; k < blockDim.x; k += pairs) mx = fmax(mx, snorm[k]);
            const float r = __double2float_rn(__dsqrt_rn(mx));
            scales[(u64)plane * pairs + threadIdx.x] = __fdiv_rn(r, L);
        }
        return;
    }
    for (u32 j = threadIdx.x; j < pairs; j += blockDim.x) smax[j] = 0u;
    __syncthreads();
    for (u32 i = threadIdx.x; i < T * pairs; i += blockDim.x) {
        u32 t = i / pairs, j = i - t * pairs, i1, i2;
        pe_pair(D, j, adjacent, i1, i2);
        float x = enc_load<SRC>(src, (u64)t * D + i1), y = enc_load<SRC>(src, (u64)t * D + i2);
        if (!is_finite(x) || !is_finite(y)) {
            atomicMin(status, ((u64)d.page << 32) | (r0 + t));
            continue;
        }
        atomicMax(&smax[j], __float_as_uint(pe_radius(x, y)));
    }
    __syncthreads();
    for (u32 j = threadIdx.x; j < pairs; j += blockDim.x)
        scales[(u64)plane * pairs + j] = __fdiv_rn(__uint_as_float(smax[j]), L);
}

template <int SRC>
__device__ __forceinline__ void polar_codes(const EncDesc* __restrict__ descs, const uint2* __restrict__ work,
                                            u64* status) {
    __shared__ __align__(16) u16 codes[PE_TILE];
    __shared__ float2 sdirs[256];
    const uint2 w = work[blockIdx.x];
    const EncDesc d = descs[w.x];
    const u32 D = d.head_dim, pairs = D / 2u, m = d.p0, nb = d.p1, ndir = 1u << m;
    const bool adjacent = (d.p2 & 1u) != 0u, uniform = (d.p2 & 2u) != 0u;
    const float L = (float)((1u << nb) - 1u);
    const u32 r0 = w.y, plane = udiv(r0, d.tokens, d.m_tokens), t0 = r0 - plane * d.tokens;
    const u32 nr = min(d.p3, d.tokens - t0), n = nr * pairs;
    const u8* src = reinterpret_cast<const u8*>(d.src) + (SRC == SRC_F32 ? 4u : 2u) * ((u64)plane * d.stride + (u64)t0 * D);
    u8* body = reinterpret_cast<u8*>(d.body);
    const float* scales = reinterpret_cast<const float*>(body + d.sec_scale) + (u64)plane * pairs;
    const float2* gdirs = reinterpret_cast<const float2*>(d.side);
    __shared__ float ssc[PE_MAX_PAIRS], srs[PE_MAX_PAIRS];
    for (u32 k = threadIdx.x; k < ndir; k += blockDim.x) sdirs[k] = gdirs[k];
    for (u32 k = threadIdx.x; k < pairs; k += blockDim.x) {
        const float s = scales[k];
        ssc[k] = s;
        srs[k] = s > 0.0f ? __fdiv_rn(1.0f, s) : 0.0f;
    }
    __syncthreads();
    (void)status;
    // (t, j) of element i = threadIdx.x + k * blockDim.x, stepped without
    // a division.
    u32 t = threadIdx.x / pairs, j = threadIdx.x - t * pairs;
    const u32 dt = blockDim.x / pairs, dj = blockDim.x - dt * pairs;
    for (u32 i = threadIdx.x; i < n; i += blockDim.x) {
        u32 i1, i2;
        pe_pair(D, j, adjacent, i1, i2);
        const float x = enc_load<SRC>(src, t * D + i1), y = enc_load<SRC>(src, t * D + i2);
        const float s = ssc[j];
        const u32 rho = s > 0.0f ? pe_rho(x, y, s, srs[j], L) : 0u;
        codes[i] = (u16)(pe_find(x, y, sdirs, ndir, uniform) | (rho << m));
        t += dt;
        j += dj;
        if (j >= pairs) {
            j -= pairs;
            t++;
        }
    }
    __syncthreads();
    enc_pack(codes, n, (u64)r0 * pairs, m + nb, reinterpret_cast<u32*>(body + d.sec_index));
}

#define PE_ARGS const EncDesc *descs, const uint2 *work, u64 *status
extern "C" __global__ void __launch_bounds__(BLOCK) encode_polar_scale_bf16(PE_ARGS) { polar_scale<SRC_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_polar_scale_f16(PE_ARGS) { polar_scale<SRC_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_polar_scale_f32(PE_ARGS) { polar_scale<SRC_F32>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_polar_bf16(PE_ARGS) { polar_codes<SRC_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_polar_f16(PE_ARGS) { polar_codes<SRC_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_polar_f32(PE_ARGS) { polar_codes<SRC_F32>(descs, work, status); }
