// Encode of `polar` key pages (format/codecs/polar.md), producing the CPU
// encoder's sections bit for bit (src/codec/polar/mod.rs, src/kernels/polar.rs).
// Value pages are `int{b}` pages (the affine encoder).
//
// Pair j of a row is channels (j, j + D/2) (half) or (2j, 2j + 1) (adjacent).
//     r = f32(sqrt_f64(f64(x)^2 + f64(y)^2))          (one rounding to f32)
//     s_{p,j} = (max over the page's tokens of r) / f32(L), L = 2^n - 1
//     rho = s > 0 ? rne(clamp(r / s, 0, L)) : 0
//     a = the direction k maximizing (x * c_k) + (y * s_k), ties to the
//         smallest k
//     code = a | rho << m, (m + n)-bit codes in row-major (row, pair) order
//
// Two paths. The vectorized one (head_dim a multiple of 16, 16-byte
// aligned rows; codes only for the canonical uniform table of M >= 8
// directions): a thread takes 8 consecutive pairs of a row, radius levels
// and directions come from binary32 approximations with proven error
// bounds, and the rare pairs they cannot decide ("cold": pe_fast) take the
// exact operations of the generic path. The generic path (any shape and
// table): one pair per thread, the radius level in binary32 with the
// exact binary64 path near half-integers (pe_rho), the direction by the
// CPU's search (NearestDirection::find, pe_find: for the canonical table
// with M >= 8 and 1e-30 <= max(|x|, |y|) <= 1e30 the three candidates
// around the same approximate angle, otherwise every direction).
//
// `encode_polar_scale_{src}`: work item (page, first row of a plane); the
// radius maxima of the plane's pairs (as x^2 + y^2 in binary64), then
// SCALE written. A NaN or infinity is reported as atomicMin of page << 32
// | row.
// `encode_polar_{src}`: work item (page, first row) = up to p3 rows of one
// plane; codes stored straight into INDEX (m + n = 8 on the fast path) or
// staged in shared memory PE_TILE at a time, then packed into INDEX (whole
// words stored, the two edge words OR-ed in with atomics).
//
// Fused (p2 bit 2, planned for pages of at most 512 tokens on the fast
// path): `encode_polar_{src}` alone, its work item a whole plane of a page,
// computes SCALE as `encode_polar_scale_{src}` does, then the codes (the
// plane read twice, the second time mostly from L2).
//
// EncDesc: sec_scale = SCALE 0, sec_index = INDEX 0, side = the direction
// table (2^m (cos, sin) f32 pairs); p0 = m, p1 = n, p2 = adjacent | uniform
// << 1 | fused << 2, p3 = rows per work item of `encode_polar_{src}`.

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

// SCALE of one plane, any shape (the generic path of encode_polar_scale).
template <int SRC>
__device__ __forceinline__ void polar_scale_any(const EncDesc& d, const u8* src, u32 r0, u32 plane, float* scales,
                                                u64* status) {
    __shared__ u32 smax[PE_MAX_PAIRS];
    const u32 D = d.head_dim, pairs = D / 2u, T = d.tokens;
    const bool adjacent = (d.p2 & 1u) != 0u;
    const float L = (float)((1u << d.p1) - 1u);
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

// Codes of rows [0, nr) of a work item into `codes` (staged, u16), any
// shape and direction table (the generic path of encode_polar).
template <int SRC>
__device__ __forceinline__ void polar_codes_any(const EncDesc& d, const u8* src, u32 nr, const float* ssc,
                                                const float* srs, const float2* sdirs, u16* codes) {
    const u32 D = d.head_dim, pairs = D / 2u, m = d.p0, ndir = 1u << m, n = nr * pairs;
    const bool adjacent = (d.p2 & 1u) != 0u, uniform = (d.p2 & 2u) != 0u;
    const float L = (float)((1u << d.p1) - 1u);
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
}

// ---------------------------------------------------------------- fast paths
//
// For head_dim a multiple of 16 (pairs a multiple of PE_V) and 16-byte
// aligned rows, a thread handles PE_V consecutive pairs j0 .. j0 + 7 of a
// row (two or four 16-byte loads; G = pairs / PE_V threads per row, R =
// BLOCK / G rows at a time), so its pairs, their scales and the loop's
// address steps stay in registers.

#define PE_V 8
// Resident blocks per SM the code kernels are compiled for (64 registers).
#define PE_MIN_BLOCKS 4
#ifdef KVPACK_EMU
#define PE_COLD
#else
#define PE_COLD __noinline__
#endif
// Bits of 2^-60 and 2^60: the fast window of max(|x|, |y|).
#define PE_LO 0x21800000u
#define PE_HI 0x5d800000u

// Approximate reciprocal and reciprocal square root (one MUFU each; PTX
// ISA: rcp.approx within 1 ulp, rsqrt.approx within 2^-22.9 relative),
// only for normal arguments here.
#ifndef KVPACK_EMU
__device__ __forceinline__ float pe_rcp(float x) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ float pe_rsqrt(float x) {
    float r;
    asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
// Four codes' low bytes as one word (code k in byte k).
__device__ __forceinline__ u32 pe_bytes(u32 a, u32 b, u32 c, u32 d) {
    return __byte_perm(__byte_perm(a, b, 0x0040u), __byte_perm(c, d, 0x0040u), 0x5410u);
}
// Two codes' low halves as one word.
__device__ __forceinline__ u32 pe_halves(u32 a, u32 b) { return __byte_perm(a, b, 0x5410u); }
#else
// On the host: flush-to-zero inputs as on the GPU, and results off by
// 2^-23 (relative, within the GPU's bounds) so that the tests see inexact
// approximations, as the GPU's are.
__device__ __forceinline__ float pe_rcp(float x) {
    return x < 1.17549435e-38f ? INFINITY : __fmul_rn(1.0f / x, 0.99999988f);
}
__device__ __forceinline__ float pe_rsqrt(float x) {
    return x < 1.17549435e-38f ? INFINITY : __fmul_rn(1.0f / sqrtf(x), 1.00000012f);
}
__device__ __forceinline__ u32 pe_bytes(u32 a, u32 b, u32 c, u32 d) {
    return (a & 0xffu) | (b & 0xffu) << 8 | (c & 0xffu) << 16 | d << 24;
}
__device__ __forceinline__ u32 pe_halves(u32 a, u32 b) { return (a & 0xffffu) | b << 16; }
#endif

// Eight consecutive source elements e .. e + 7 (e a multiple of 8, 16-byte
// aligned) widened to f32.
template <int SRC>
__device__ __forceinline__ void pe_load8(const u8* src, u64 e, float v[8]) {
    if (SRC == SRC_F32) {
        const float4* p = reinterpret_cast<const float4*>(src) + e / 4u;
        const float4 a = __ldg(p), b = __ldg(p + 1);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
        const uint4 q = __ldg(reinterpret_cast<const uint4*>(src) + e / 8u);
        const u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (SRC == SRC_BF16) {
                v[2 * i] = __uint_as_float(w[i] << 16);
                v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
            } else {
                v[2 * i] = f16_to_f32((u16)w[i]);
                v[2 * i + 1] = f16_to_f32((u16)(w[i] >> 16));
            }
        }
    }
}

// Pairs j0 .. j0 + 7 of the row at `row`: x = channel i1, y = channel i2.
template <int SRC, bool ADJ>
__device__ __forceinline__ void pe_load_pairs(const u8* row, u32 j0, u32 pairs, float x[PE_V], float y[PE_V]) {
    if (ADJ) {
        float v[16];
        pe_load8<SRC>(row, 2u * j0, v);
        pe_load8<SRC>(row, 2u * j0 + 8u, v + 8);
#pragma unroll
        for (int k = 0; k < PE_V; k++) x[k] = v[2 * k], y[k] = v[2 * k + 1];
    } else {
        pe_load8<SRC>(row, j0, x);
        pe_load8<SRC>(row, j0 + pairs, y);
    }
}

// True when the fast paths take the plane starting at `src`.
__device__ __forceinline__ bool pe_fast_shape(u32 pairs, const u8* src) {
    return pairs % PE_V == 0u && (reinterpret_cast<u64>(src) & 15u) == 0u;
}

// SCALE of one plane: each thread keeps the max of x^2 + y^2 (binary64,
// exact products, one rounding: pe_norm2) of its PE_V pairs over its rows
// and their sum (finite exactly when every element is: a square of an f32
// is at most 2^256, a sum of 2^20 of them stays finite), then the maxima
// of a pair's threads are combined in shared memory and one square root
// taken per pair. A thread whose sum is not finite reports its first row
// holding a NaN or infinity.
template <int SRC, bool ADJ>
__device__ __forceinline__ void polar_scale_fast(const EncDesc& d, const u8* src, u32 r0, u32 plane, float* scales,
                                                 u64* status, double* snorm) {
    const u32 D = d.head_dim, pairs = D / 2u, T = d.tokens, G = pairs / PE_V, R = BLOCK / G;
    const u32 tr = threadIdx.x / G, j0 = (threadIdx.x - tr * G) * PE_V;
    const u64 rstep = (u64)(SRC == SRC_F32 ? 4u : 2u) * D;
    double mx[PE_V], acc = 0.0;
#pragma unroll
    for (int k = 0; k < PE_V; k++) mx[k] = 0.0;
    if (tr < R) {
        for (u32 t = tr; t < T; t += R) {
            float x[PE_V], y[PE_V];
            pe_load_pairs<SRC, ADJ>(src + t * rstep, j0, pairs, x, y);
#pragma unroll
            for (int k = 0; k < PE_V; k++) {
                const double n2 = pe_norm2(x[k], y[k]);
                mx[k] = n2 > mx[k] ? n2 : mx[k];
                acc = __dadd_rn(acc, n2);
            }
        }
        if (!(acc <= 1.0e300)) {
            for (u32 t = tr; t < T; t += R) {
                float x[PE_V], y[PE_V];
                pe_load_pairs<SRC, ADJ>(src + t * rstep, j0, pairs, x, y);
                bool bad = false;
#pragma unroll
                for (int k = 0; k < PE_V; k++) bad |= !is_finite(x[k]) || !is_finite(y[k]);
                if (bad) {
                    atomicMin(status, ((u64)d.page << 32) | (r0 + t));
                    break;
                }
            }
        }
#pragma unroll
        for (int k = 0; k < PE_V; k++) snorm[tr * pairs + j0 + k] = mx[k];
    }
    __syncthreads();
    const float L = (float)((1u << d.p1) - 1u);
    for (u32 j = threadIdx.x; j < pairs; j += blockDim.x) {
        double m = snorm[j];
        for (u32 i = 1; i < R; i++) {
            const double v = snorm[i * pairs + j];
            m = v > m ? v : m;
        }
        scales[(u64)plane * pairs + j] = __fdiv_rn(__double2float_rn(__dsqrt_rn(m)), L);
    }
}

// Loop constants of the approximate angle: the atan polynomial's
// coefficients scaled to bins (M / (2 pi)), and the reflections in bins
// less 1/4 (see pe_fast).
struct PeAngle {
    float c1, c3, c5, q1, q2, q4;
    u32 mask, mask2;  // M - 1, 2M - 1
};

__device__ __forceinline__ PeAngle pe_angle(u32 ndir) {
    const float k = __fmul_rn((float)ndir, 0.159154943f);
    const float M = (float)ndir;
    return PeAngle{__fmul_rn(0.995354f, k), __fmul_rn(-0.288679f, k), __fmul_rn(0.079331f, k),
                   __fsub_rn(__fmul_rn(M, 0.25f), 0.5f),  __fsub_rn(__fmul_rn(M, 0.5f), 0.5f), __fsub_rn(M, 0.5f),
                   ndir - 1u, 2u * ndir - 1u};
}

// The code of pair (x, y) for the canonical uniform table of M = 2^m >= 8
// directions, with `cold` set when this path cannot decide (the caller
// then takes pe_slow). `rs` = RN(1 / s) for the pair's scale s, or NaN when
// s is 0 or 1 / s is outside [1e-30, 1e30] (every pair of it goes cold);
// `half` = 0.5 - near, near = (L + 1) 2^-19. `dirs` holds the table
// extended to 2M + 1 entries (entry k = direction k mod M).
//
// Cold pairs are rare: ties, pairs outside the window (zeros among them)
// and radius levels within `near` of a rounding boundary.
//
// Window: n2 = x*x + y*y (binary32, below) normal, so 2^-63.5 <= max(|x|,
// |y|) < 2^64, inside the CPU's fast window [1e-30, 1e30] of
// NearestDirection::find. Outside it the radius level below is NaN or
// infinite (rsqrt.approx.ftz of +0, a subnormal or +inf is +inf, +inf or
// +0; then 0 * inf, inf - inf), so the pair goes cold.
//
// Direction. v = the angle of (x, y) in bins of 2 pi / M, approximated:
// the octant's z = min / max (approximate reciprocal, relative error below
// 2^-21), atan(z) by 0.995354 z - 0.288679 z^3 + 0.079331 z^5 (absolute
// error below 6.1e-4 rad = 0.025 bins at M = 256), reflected into the
// quadrant; with the binary32 roundings (v < 2^8: below 2^-15 bins) v is
// within 0.03 bins of the exact angle. j = rne(v - 1/4), so the exact
// angle lies in [j - 0.28, j + 0.78] bins: the nearest direction is j or
// j + 1 and every other direction is at least 0.72 bins away, while the
// nearest is within 0.5. The exact projections r cos(angle) then differ by
// at least r (cos(0.5 b) - cos(0.72 b)) >= 0.12 b^2 r >= 7.2e-5 r (b = 2 pi
// / M, M <= 256), far more than the error of the binary32 projections
// (table entries within 2^-24, two products and a sum rounded: below
// 3e-7 r each; products underflowing by at most 2^-148, against r >= 2^-64). So
// the argmax of the rule (ties to the smallest index) is j or j + 1 (mod
// M), and it is the larger of their two projections computed exactly as
// the rule does. An exact tie of the two (the rule then takes the smaller
// index, j + 1 when it wraps to 0) goes cold.
//
// Radius level. n2 = RN(x*x + RN(y*y)) is within 2^-23 (relative) of x^2
// + y^2, r' = RN(n2 * rsqrt(n2)) within 2^-21.9 of the radius (rsqrt.approx
// within 2^-22.9) and t' = RN(r' * rs) within 2^-21.5 of radius / s; the
// exact quotient q = RN(f32(radius) / s) is within 2^-23 of it, so |t' - q|
// <= 2^-21 (radius / s) <= (L + 1) 2^-21 = near / 4 (radius <= the plane's
// largest radius, L s >= that radius (1 - 2^-24)). Hence t' < L + 0.5 -
// near and q < L + 0.5: no clamp to L is needed, and rne(t') = rne(q)
// unless t' lies within `near` of a half-integer: then cold. (The margin
// would hold for an rsqrt error up to 2^-19.5.)
__device__ __forceinline__ u32 pe_fast(float x, float y, float rs, float half, const float2* dirs, const PeAngle& k,
                                       u32 m, bool& cold) {
    const float ax = fabsf(x), ay = fabsf(y);
    const float z = __fmul_rn(fminf(ax, ay), pe_rcp(fmaxf(ax, ay)));
    const float z2 = __fmul_rn(z, z);
    const float p = __fmaf_rn(__fmaf_rn(z2, k.c5, k.c3), z2, k.c1);
    float w = __fmaf_rn(z, p, -0.25f);
    w = ay > ax ? __fsub_rn(k.q1, w) : w;
    w = x < 0.0f ? __fsub_rn(k.q2, w) : w;
    w = y < 0.0f ? __fsub_rn(k.q4, w) : w;
    // j = rne(w) in 0 ..= M from the low bits (w + 1.5 * 2^23 holds rne(w)
    // in its low 22 bits): j and j + 1 index the extended table directly.
    const u32 j = __float_as_uint(__fadd_rn(w, PE_RNE)) & k.mask2;
    const float2* u = dirs + j;
    const float d1 = pe_dot(x, y, u[0]), d2 = pe_dot(x, y, u[1]);
    const u32 dir = (j + (u32)(d2 > d1)) & k.mask;
    const float n2 = __fmaf_rn(x, x, __fmul_rn(y, y));
    const float t = __fmul_rn(__fmul_rn(n2, pe_rsqrt(n2)), rs);
    const float q = __fadd_rn(t, PE_RNE);
    cold = !(fabsf(__fsub_rn(t, __fsub_rn(q, PE_RNE))) <= half) | (d2 == d1);
    // rne(t') << m | dir: the low 22 + m bits of bits(q) << m.
    return __float_as_uint(q) * (1u << m) + dir;
}

// The code of (x, y) by the exact operations of the generic path.
PE_COLD __device__ u32 pe_slow(float x, float y, float s, float L, const float2* sdirs, u32 ndir, u32 m) {
    const u32 rho = s > 0.0f ? pe_rho(x, y, s, __fdiv_rn(1.0f, s), L) : 0u;
    return pe_find(x, y, sdirs, ndir, true) | (rho << m);
}

// Codes of rows [0, nr) of a work item: stored straight into INDEX as
// bytes when `direct` (m + n = 8; a thread's PE_V codes of a row are 8
// aligned bytes), else staged into `codes` (u16) for enc_pack. `sfr`:
// pe_fast's rs per pair; `dirs`: the extended table.
template <int SRC, bool ADJ>
__device__ __forceinline__ void polar_codes_fast(const EncDesc& d, const u8* src, u32 r0, u32 nr, const float* ssc,
                                                 const float* sfr, const float2* dirs, u16* codes, u8* index,
                                                 bool direct) {
    const u32 D = d.head_dim, pairs = D / 2u, m = d.p0, G = pairs / PE_V, R = BLOCK / G;
    const u32 tr = threadIdx.x / G, j0 = (threadIdx.x - tr * G) * PE_V;
    if (tr >= R) return;
    const u64 rstep = (u64)(SRC == SRC_F32 ? 4u : 2u) * D;
    const PeAngle k = pe_angle(1u << m);
    const u32 Li = (1u << d.p1) - 1u;
    const float L = (float)Li, half = __fsub_rn(0.5f, __fmul_rn((float)(Li + 1u), 1.9073486e-06f));  // 2^-19
    float rs[PE_V];
#pragma unroll
    for (int i = 0; i < PE_V; i++) rs[i] = sfr[j0 + i];
    for (u32 t = tr; t < nr; t += R) {
        float x[PE_V], y[PE_V];
        pe_load_pairs<SRC, ADJ>(src + t * rstep, j0, pairs, x, y);
        u32 c[PE_V], cold = 0u;
#pragma unroll
        for (int i = 0; i < PE_V; i++) {
            bool cd;
            c[i] = pe_fast(x[i], y[i], rs[i], half, dirs, k, m, cd);
            cold |= (u32)cd << i;
        }
        if (cold != 0u) {
#pragma unroll
            for (int i = 0; i < PE_V; i++)
                if ((cold >> i) & 1u) c[i] = pe_slow(x[i], y[i], ssc[j0 + i], L, dirs, 1u << m, m);
        }
        if (direct) {
            st_u2(index + (u64)(r0 + t) * pairs + j0,
                  make_uint2(pe_bytes(c[0], c[1], c[2], c[3]), pe_bytes(c[4], c[5], c[6], c[7])));
        } else {
            *reinterpret_cast<uint4*>(codes + t * pairs + j0) =
                make_uint4(pe_halves(c[0], c[1]), pe_halves(c[2], c[3]), pe_halves(c[4], c[5]), pe_halves(c[6], c[7]));
        }
    }
}

// SCALE of the plane starting at `src` (page row r0); `snorm`: BLOCK *
// PE_V doubles of shared memory.
template <int SRC>
__device__ __forceinline__ void pe_scale_plane(const EncDesc& d, const u8* src, u32 r0, u32 plane, float* scales,
                                               u64* status, double* snorm) {
    const u32 pairs = d.head_dim / 2u;
    if (!pe_fast_shape(pairs, src))
        polar_scale_any<SRC>(d, src, r0, plane, scales, status);
    else if ((d.p2 & 1u) != 0u)
        polar_scale_fast<SRC, true>(d, src, r0, plane, scales, status, snorm);
    else
        polar_scale_fast<SRC, false>(d, src, r0, plane, scales, status, snorm);
}

template <int SRC>
__device__ __forceinline__ void polar_scale(const EncDesc* __restrict__ descs, const uint2* __restrict__ work,
                                            u64* status) {
    const uint2 w = work[blockIdx.x];
    const EncDesc d = descs[w.x];
    const u32 r0 = w.y, plane = udiv(r0, d.tokens, d.m_tokens);
    const u8* src = reinterpret_cast<const u8*>(d.src) + (SRC == SRC_F32 ? 4u : 2u) * ((u64)plane * d.stride);
    float* scales = reinterpret_cast<float*>(reinterpret_cast<u8*>(d.body) + d.sec_scale);
    __shared__ double snorm[BLOCK * PE_V];
    pe_scale_plane<SRC>(d, src, r0, plane, scales, status, snorm);
}

template <int SRC>
__device__ __forceinline__ void polar_codes(const EncDesc* __restrict__ descs, const uint2* __restrict__ work,
                                            u64* status) {
    // The staged codes (PE_TILE u16), or the fused scale pass's maxima
    // before them.
    __shared__ double stage[BLOCK * PE_V > PE_TILE / 4 ? BLOCK * PE_V : PE_TILE / 4];
    u16* codes = reinterpret_cast<u16*>(stage);
    __shared__ float2 sdirs[513];  // the table extended to 2M + 1 entries (pe_fast)
    __shared__ float ssc[PE_MAX_PAIRS], sfr[PE_MAX_PAIRS];
    const uint2 w = work[blockIdx.x];
    const EncDesc d = descs[w.x];
    const u32 D = d.head_dim, pairs = D / 2u, m = d.p0, ndir = 1u << m;
    const u32 r0 = w.y, plane = udiv(r0, d.tokens, d.m_tokens), t0 = r0 - plane * d.tokens;
    const u32 nr = min(d.p3, d.tokens - t0);
    const u8* src = reinterpret_cast<const u8*>(d.src) + (SRC == SRC_F32 ? 4u : 2u) * ((u64)plane * d.stride + (u64)t0 * D);
    u8* body = reinterpret_cast<u8*>(d.body);
    u8* index = body + d.sec_index;
    if ((d.p2 & 4u) != 0u) {
        // Fused: the work item is the whole plane (t0 = 0, nr = tokens);
        // its SCALE first, read back below after the barrier.
        pe_scale_plane<SRC>(d, src, r0, plane, reinterpret_cast<float*>(body + d.sec_scale), status, stage);
        __syncthreads();
    }
    // (volatile: written by this kernel when fused, never a read-only load)
    const volatile float* scales = reinterpret_cast<const volatile float*>(body + d.sec_scale) + (u64)plane * pairs;
    const float2* gdirs = reinterpret_cast<const float2*>(d.side);
    for (u32 k = threadIdx.x; k <= 2u * ndir; k += blockDim.x) sdirs[k] = gdirs[k & (ndir - 1u)];
    for (u32 k = threadIdx.x; k < pairs; k += blockDim.x) {
        const float s = scales[k];
        const float rs = s > 0.0f ? __fdiv_rn(1.0f, s) : 0.0f;
        ssc[k] = s;
        // pe_rho's fast path (generic) takes the same window; pe_fast goes
        // cold on NaN.
        sfr[k] = rs >= 1.0e-30f && rs <= 1.0e30f ? rs : __int_as_float(0x7fc00000);
    }
    __syncthreads();
    const bool fast = (d.p2 & 2u) != 0u && pe_fast_shape(pairs, src);
    const bool direct = fast && d.p0 + d.p1 == 8u && (reinterpret_cast<u64>(index) & 7u) == 0u;
    // Staged codes go through shared memory PE_TILE at a time.
    const u32 chunk = direct ? nr : PE_TILE / pairs;
    const u64 rstep = (u64)(SRC == SRC_F32 ? 4u : 2u) * D;
    for (u32 c0 = 0; c0 < nr; c0 += chunk) {
        const u32 cn = min(chunk, nr - c0);
        const u8* csrc = src + c0 * rstep;
        if (fast && (d.p2 & 1u) != 0u)
            polar_codes_fast<SRC, true>(d, csrc, r0 + c0, cn, ssc, sfr, sdirs, codes, index, direct);
        else if (fast)
            polar_codes_fast<SRC, false>(d, csrc, r0 + c0, cn, ssc, sfr, sdirs, codes, index, direct);
        else
            polar_codes_any<SRC>(d, csrc, cn, ssc, sfr, sdirs, codes);
        if (direct) return;
        __syncthreads();
        enc_pack(codes, cn * pairs, ((u64)r0 + c0) * pairs, d.p0 + d.p1, reinterpret_cast<u32*>(index));
        __syncthreads();
    }
}

#define PE_ARGS const EncDesc *descs, const uint2 *work, u64 *status
extern "C" __global__ void __launch_bounds__(BLOCK) encode_polar_scale_bf16(PE_ARGS) { polar_scale<SRC_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_polar_scale_f16(PE_ARGS) { polar_scale<SRC_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_polar_scale_f32(PE_ARGS) { polar_scale<SRC_F32>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, PE_MIN_BLOCKS) encode_polar_bf16(PE_ARGS) { polar_codes<SRC_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, PE_MIN_BLOCKS) encode_polar_f16(PE_ARGS) { polar_codes<SRC_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, PE_MIN_BLOCKS) encode_polar_f32(PE_ARGS) { polar_codes<SRC_F32>(descs, work, status); }
