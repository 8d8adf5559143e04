// `octopus` and `turbo` coded pages (format/codecs/octopus.md "Decoding",
// format/codecs/turbo.md): per row the norm gamma (f32), the codes of the
// rotated unit vector, optionally (K pages, `+qjl`) the f16 residual norm
// gamma' and one sign bit per coordinate. Value-group V pages are `kivi`
// value pages and use the kivi kernels.
//
// Decode of row r (plane of kv head h), binary32, no fused multiply-add
// except the exact sign-times-value butterflies across lanes:
//     turbo:    u_j = C(D)[c_j]
//     octopus:  u_{3i+k} = n(jx_i, jy_i)_k * C_rho(D)[jn_i]     (components >= D dropped)
//     qjl:      h = H sigma (exact), a = (f32(gamma') * K) * (1/D), u_j = u_j + (s'_j * h_j) * a
//     v_j = u_j * (gamma * c_D);  x = H v;  out_j = s_j * x_j
//
// Side table (per tensor): octopus: float4 n(a, b) = (x, y, r, 0) at
// [a * 2^b_dir + b], then the 2^b_norm f32 norm centroids; turbo: the 2^b
// f32 centroids. At byte p2: per kv head, the D rotation sign bits s (1 =
// negative, LSB-first), then with QJL the D bits of s'.
//
// Descriptor: sec0 = SCALE 0 (gamma, f32), sec1 = INDEX 0 (turbo codes or
// octopus direction codes), sec2 = INDEX 1 (octopus norm codes), sec3 =
// SCALE 1 (gamma', f16), sec4 = the QJL sign bits; p0 = turbo b / octopus
// b_dir, p1 = b_norm (| octopus << 8 | qjl << 9 for the fallback), p2 =
// offset of the sign bits in the side table, p3 = bits of c_D.
//
// Fast `decode_sphere_{turbo|oct}[_qjl]_{out}` (D = 32 * lpr, lpr a power
// of two <= 32): the interleaved 32-element layout of the bdr kernels (a
// thread holds chunks m = 0..3 of 8 elements at 8 * (j + lpr * m)), all
// butterflies of the row in registers and xor shuffles. Turbo looks codes
// up in a shared-memory table; octopus (`octt`, 2 b_dir + b_norm <= 10)
// looks each triplet up in the side table's products n(a, b) * C_rho[jn]
// (float4 at ((a | b << b_dir) << b_norm) | jn, computed on the host with
// the decoder's f32 products) copied to shared memory, every chunk decoding
// the 4 triplets covering its 8 elements; larger octopus splits (`oct`)
// first decode the block's triplets into shared memory (one triplet per
// thread and step), then every thread reads its 32 elements back. Fallback `decode_sphere_any_{out}` (any D
// <= 4096): one row per block, everything in shared memory.

#define SQRT_HALF_PI_BITS 0x3FA06C99u
// Largest rows per block times (D + 4): 256 rows of D = 32.
#define SPHERE_UBUF (256 * 36)

// The sign bits of chunk m of the interleaved layout (8 bits at element
// 8 * (j + lpr * m)) of a D-bit vector starting at `bits`.
__device__ __forceinline__ u32 sphere_bits8(const u8* bits, u32 n0) { return __ldg(bits + (n0 >> 3)); }

// Byte offset of the octopus product table in the side table: after the
// sign bits of every kv head, 16-aligned (codecs::sphere_product_offset).
__device__ __forceinline__ u32 sphere_product_offset(const PageDesc& d, bool qjl) {
    u32 signs = d.heads * (qjl ? 2u : 1u) * (d.head_dim >> 3);
    return (d.p2 + signs + 15u) & ~15u;
}

// OCT: 0 turbo, 1 octopus through shared-memory staging, 2 octopus through
// the product table n(a, b) * C_rho[jn] (2 b_dir + b_norm <= 10): every
// chunk decodes the (up to 4) triplets covering its 8 elements directly.
template <int OCT, bool QJL, int OUT>
__device__ __forceinline__ void sphere_decode(const PageDesc* __restrict__ descs,
                                              const uint2* __restrict__ work, u64* status) {
    __shared__ __align__(16) float4 sdir[OCT == 2 ? 1024 : 256];
    __shared__ float slut[64];
    __shared__ __align__(16) float ubuf[OCT == 1 ? SPHERE_UBUF : 4];
    const uint2 w = work[blockIdx.x];
    const PageDesc d = descs[w.x];
    const u32 D = d.head_dim, lpr = d.upr, nunits = d.rows * lpr;
    const u32 ba = d.p0, bn = d.p1 & 0xffu;
    const u8* side = reinterpret_cast<const u8*>(d.side);
    const float4* gdir = reinterpret_cast<const float4*>(side);
    const bool dir_in_smem = OCT == 1 && ba <= 4u;
    if (OCT == 2) {
        const float4* prod = reinterpret_cast<const float4*>(side + sphere_product_offset(d, QJL));
        for (u32 i = threadIdx.x; i < (1u << (2u * ba + bn)); i += blockDim.x) sdir[i] = prod[i];
    } else if (OCT == 1) {
        const u32 nd = 1u << (2u * ba);
        if (dir_in_smem) {
            for (u32 i = threadIdx.x; i < nd; i += blockDim.x) sdir[i] = gdir[i];
        }
        const float* nl = reinterpret_cast<const float*>(side + 16u * nd);
        for (u32 i = threadIdx.x; i < (1u << bn); i += blockDim.x) slut[i] = nl[i];
    } else {
        const float* cl = reinterpret_cast<const float*>(side);
        for (u32 i = threadIdx.x; i < (1u << ba); i += blockDim.x) slut[i] = cl[i];
    }
    __syncthreads();
    const u8* body = reinterpret_cast<const u8*>(d.body);
    const u32 row0 = w.y / lpr;  // w.y is a multiple of BLOCK, lpr divides BLOCK
    const u32 stride = D + 4u;   // shared row stride (floats): conflict-free 16-byte reads
    if (OCT == 1) {
        // Phase A: the block's triplets into shared memory.
        const u32 T = (D + 2u) / 3u;
        const u32 mT = (u32)((0x100000000ull + T - 1u) / T);
        const u32 nrows = min(BLOCK / lpr, d.rows - row0);
        const u8* dc = body + d.sec1;
        const u8* nc = body + d.sec2;
        for (u32 i = threadIdx.x; i < nrows * T; i += BLOCK) {
            u32 rl = udiv(i, T, mT);
            u32 ti = i - rl * T;
            u64 ci = (u64)(row0 + rl) * T + ti;
            u32 ab = get_bits(dc, ci * 2u * ba, 2u * ba);
            u32 a = ab & ((1u << ba) - 1u), b = ab >> ba;
            u32 jn = get_bits(nc, ci * bn, bn);
            float4 n = dir_in_smem ? sdir[(a << ba) | b] : __ldg(gdir + ((a << ba) | b));
            float rho = slut[jn];
            float* up = ubuf + rl * stride + 3u * ti;
            up[0] = __fmul_rn(n.x, rho);
            if (3u * ti + 1u < D) up[1] = __fmul_rn(n.y, rho);
            if (3u * ti + 2u < D) up[2] = __fmul_rn(n.z, rho);
        }
        __syncthreads();
    }
    // Phase B: one unit (32 elements of a row) per thread.
    const u32 u = w.y + threadIdx.x;
    const bool live = u < nunits;
    const u32 row = live ? udiv(u, lpr, d.m_upr) : row0;
    const u32 j = live ? u - row * lpr : 0u;
    const u32 pl = udiv(row, d.tokens, d.m_tokens);
    const u32 head = pl - udiv(pl, d.heads, d.m_heads) * d.heads;
    const u8* signs = side + d.p2 + (u64)head * (QJL ? 2u : 1u) * (D >> 3);
    float v[4][8];
    float gamma = 0.f, gq = 0.f;
    u32 rot[4] = {0, 0, 0, 0}, qs[4] = {0, 0, 0, 0}, sig[4] = {0, 0, 0, 0};
    i64 o = -1;
    if (live) {
        gamma = __ldg(reinterpret_cast<const float*>(body + d.sec0) + row);
        if (QJL) gq = ld_f16(body + d.sec3, row);
#pragma unroll
        for (int m = 0; m < 4; m++) {
            u32 n0 = 8u * (j + lpr * (u32)m);
            rot[m] = sphere_bits8(signs, n0);
            if (QJL) {
                qs[m] = sphere_bits8(signs + (D >> 3), n0);
                sig[m] = sphere_bits8(body + d.sec4, row * D + n0);
            }
            if (OCT == 2) {
                // Triplets t0 .. t0 + 3 cover elements n0 .. n0 + 7 (from
                // offset o = n0 - 3 t0); those past the row are never used.
                const u32 T = (D + 2u) / 3u;
                const u32 t0 = n0 / 3u, o = n0 - 3u * t0;
                const u64 ci = (u64)row * T + t0;
                const u64 dirs = get_bits64(body + d.sec1, ci * 2u * ba, 8u * ba);
                const u32 norms = get_bits(body + d.sec2, ci * bn, 4u * bn);
                float w[12];
#pragma unroll
                for (int t = 0; t < 4; t++) {
                    u32 pair = (u32)(dirs >> (2u * ba * t)) & ((1u << (2u * ba)) - 1u);
                    u32 jn = (norms >> (bn * t)) & ((1u << bn) - 1u);
                    float4 nv = sdir[(pair << bn) | jn];
                    w[3 * t] = nv.x;
                    w[3 * t + 1] = nv.y;
                    w[3 * t + 2] = nv.z;
                }
#pragma unroll
                for (int e = 0; e < 8; e++) v[m][e] = o == 0u ? w[e] : (o == 1u ? w[e + 1] : w[e + 2]);
            } else if (OCT == 1) {
                const float4* up = reinterpret_cast<const float4*>(ubuf + (row - row0) * stride + n0);
                float4 a = up[0], b = up[1];
                v[m][0] = a.x; v[m][1] = a.y; v[m][2] = a.z; v[m][3] = a.w;
                v[m][4] = b.x; v[m][5] = b.y; v[m][6] = b.z; v[m][7] = b.w;
            } else {
                u64 c = get_bits64(body + d.sec1, (u64)(row * D + n0) * ba, 8u * ba);
#pragma unroll
                for (int e = 0; e < 8; e++) v[m][e] = slut[(u32)(c >> (ba * e)) & ((1u << ba) - 1u)];
            }
        }
        o = row_dst(d, row, status);
    } else {
#pragma unroll
        for (int m = 0; m < 4; m++) {
#pragma unroll
            for (int e = 0; e < 8; e++) v[m][e] = 0.f;
        }
    }
    if (QJL) {
        float h[4][8];
#pragma unroll
        for (int m = 0; m < 4; m++) {
#pragma unroll
            for (int e = 0; e < 8; e++) h[m][e] = ((sig[m] >> e) & 1u) ? -1.0f : 1.0f;
        }
        wht_interleaved<true>(h, D, lpr);
        float a = __fmul_rn(__fmul_rn(gq, __uint_as_float(SQRT_HALF_PI_BITS)), __fdiv_rn(1.0f, (float)D));
#pragma unroll
        for (int m = 0; m < 4; m++) {
#pragma unroll
            for (int e = 0; e < 8; e++)
                v[m][e] = __fadd_rn(v[m][e], __fmul_rn(flip_if(h[m][e], (qs[m] >> e) & 1u), a));
        }
    }
    const float g = __fmul_rn(gamma, __uint_as_float(d.p3));
#pragma unroll
    for (int m = 0; m < 4; m++) {
#pragma unroll
        for (int e = 0; e < 8; e++) v[m][e] = __fmul_rn(v[m][e], g);
    }
    wht_interleaved<true>(v, D, lpr);
    if (o >= 0) {
        u16* out = reinterpret_cast<u16*>(d.dst) + o + 8u * j;
#pragma unroll
        for (int m = 0; m < 4; m++) {
            float x[8];
#pragma unroll
            for (int e = 0; e < 8; e++) x[e] = flip_if(v[m][e], (rot[m] >> e) & 1u);
            st_out8<OUT>(out + 8u * lpr * (u32)m, x);
        }
    }
}

#define SPHERE_ARGS const PageDesc *descs, const uint2 *work, u64 *status
extern "C" __global__ void __launch_bounds__(BLOCK) decode_sphere_turbo_bf16(SPHERE_ARGS) { sphere_decode<0, false, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_sphere_turbo_qjl_bf16(SPHERE_ARGS) { sphere_decode<0, true, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_sphere_oct_bf16(SPHERE_ARGS) { sphere_decode<1, false, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_sphere_oct_qjl_bf16(SPHERE_ARGS) { sphere_decode<1, true, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_sphere_octt_bf16(SPHERE_ARGS) { sphere_decode<2, false, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_sphere_octt_qjl_bf16(SPHERE_ARGS) { sphere_decode<2, true, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_sphere_turbo_f16(SPHERE_ARGS) { sphere_decode<0, false, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_sphere_turbo_qjl_f16(SPHERE_ARGS) { sphere_decode<0, true, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_sphere_oct_f16(SPHERE_ARGS) { sphere_decode<1, false, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_sphere_oct_qjl_f16(SPHERE_ARGS) { sphere_decode<1, true, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_sphere_octt_f16(SPHERE_ARGS) { sphere_decode<2, false, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_sphere_octt_qjl_f16(SPHERE_ARGS) { sphere_decode<2, true, OUT_F16>(descs, work, status); }

// Fallback: one row per block of SEG_BLOCK threads (Grid::Rows), any power
// of two D <= 4096, the butterflies in shared memory.
template <int OUT>
__device__ __forceinline__ void sphere_decode_any(const PageDesc* __restrict__ descs,
                                                  const uint2* __restrict__ work, u64* status) {
    __shared__ float ub[4096];
    __shared__ float hq[4096];
    __shared__ float slut[64];
    const uint2 w = work[blockIdx.x];
    const PageDesc d = descs[w.x];
    const u32 D = d.head_dim, row = w.y;
    const u32 ba = d.p0, bn = d.p1 & 0xffu;
    const bool oct = (d.p1 >> 8) & 1u, qjl = (d.p1 >> 9) & 1u;
    const u8* side = reinterpret_cast<const u8*>(d.side);
    const u8* body = reinterpret_cast<const u8*>(d.body);
    const u32 nd = oct ? 1u << (2u * ba) : 0u;
    const float* lut = reinterpret_cast<const float*>(side + 16u * nd);
    for (u32 i = threadIdx.x; i < (1u << (oct ? bn : ba)); i += blockDim.x) slut[i] = lut[i];
    __syncthreads();
    if (oct) {
        const u32 T = (D + 2u) / 3u;
        for (u32 ti = threadIdx.x; ti < T; ti += blockDim.x) {
            u64 ci = (u64)row * T + ti;
            u32 ab = get_bits(body + d.sec1, ci * 2u * ba, 2u * ba);
            u32 a = ab & ((1u << ba) - 1u), b = ab >> ba;
            float4 n = __ldg(reinterpret_cast<const float4*>(side) + ((a << ba) | b));
            float rho = slut[get_bits(body + d.sec2, ci * bn, bn)];
            ub[3u * ti] = __fmul_rn(n.x, rho);
            if (3u * ti + 1u < D) ub[3u * ti + 1u] = __fmul_rn(n.y, rho);
            if (3u * ti + 2u < D) ub[3u * ti + 2u] = __fmul_rn(n.z, rho);
        }
    } else {
        for (u32 i = threadIdx.x; i < D; i += blockDim.x)
            ub[i] = slut[get_bits(body + d.sec1, ((u64)row * D + i) * ba, ba)];
    }
    const u32 pl = udiv(row, d.tokens, d.m_tokens);
    const u32 head = pl - udiv(pl, d.heads, d.m_heads) * d.heads;
    const u8* signs = side + d.p2 + (u64)head * (qjl ? 2u : 1u) * (D >> 3);
    if (qjl) {
        for (u32 i = threadIdx.x; i < D; i += blockDim.x)
            hq[i] = get_bits(body + d.sec4, (u64)row * D + i, 1u) ? -1.0f : 1.0f;
        __syncthreads();
        wht_shared(hq, D, D);
        float a = __fmul_rn(__fmul_rn(ld_f16(body + d.sec3, row), __uint_as_float(SQRT_HALF_PI_BITS)),
                            __fdiv_rn(1.0f, (float)D));
        for (u32 i = threadIdx.x; i < D; i += blockDim.x) {
            u32 sb = (__ldg(signs + (D >> 3) + (i >> 3)) >> (i & 7u)) & 1u;
            ub[i] = __fadd_rn(ub[i], __fmul_rn(flip_if(hq[i], sb), a));
        }
    }
    const float g = __fmul_rn(__ldg(reinterpret_cast<const float*>(body + d.sec0) + row), __uint_as_float(d.p3));
    __syncthreads();
    for (u32 i = threadIdx.x; i < D; i += blockDim.x) ub[i] = __fmul_rn(ub[i], g);
    __syncthreads();
    wht_shared(ub, D, D);
    i64 o = row_dst(d, row, status);
    if (o < 0) return;
    u16* out = reinterpret_cast<u16*>(d.dst) + o;
    for (u32 i = threadIdx.x; i < D; i += blockDim.x)
        out[i] = to_out<OUT>(flip_if(ub[i], (__ldg(signs + (i >> 3)) >> (i & 7u)) & 1u));
}

extern "C" __global__ void __launch_bounds__(SEG_BLOCK) decode_sphere_any_bf16(SPHERE_ARGS) { sphere_decode_any<OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(SEG_BLOCK) decode_sphere_any_f16(SPHERE_ARGS) { sphere_decode_any<OUT_F16>(descs, work, status); }
