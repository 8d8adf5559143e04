// `innerq` pages (format/codecs/innerq.md): b-bit codes in element order;
// per group an f16 scale, a slot of W = G/32 u32 words (asymmetric: word 0
// is the f32 zero point; symmetric: bit e of the slot is the sign of
// element e) and, in hybrid mode, a 1-bit flag (1 = symmetric). K groups
// are G channels of one row (g = r*(D/G) + c/G, element e = c mod G), V
// groups up to G tokens of one channel (g = (p*J + t/G)*D + c, e = t mod G).
// With key normalization, K values are multiplied by the factor n_{h,c}
// of the tensor's layer (side table: f32 [heads][D]).
//
// Decode, binary32, no fused multiply-add (the normative rule):
//     asymmetric: v = (f32(q) * S) + Z      symmetric: v = f32(q) * S, sign flipped when set
//     keys with normalization: x = v * n_{h,c}
// The kernels evaluate v as one fused multiply-add fma(q, +-S, Z or -0):
// q * S is exact in binary32 (a code below 2^8 times an f16), so the
// result is bit-identical (see innerq_value).
//
// Descriptor: sec0 = SCALE (f16), sec1 = ZERO (u32 slots), sec2 = INDEX,
// sec3 = AUX (hybrid flags); p0 = G, p1 = udiv magic of G,
// p2 = mode (0 asym, 1 sym, 2 hybrid) | normalization << 8 | W << 16,
// p3 = bits | (1 << 8 for token groups), for the fallback.
//
// Fast `decode_innerq_{k|v}_b{B}_{out}` (D % 8 == 0): a unit is 8
// consecutive channels of a row; K units lie in one group (one scale, zero
// point, sign word, flag and 8 factors), V units span 8 consecutive groups
// (8 scales in one 16-byte load, 8 slots in two when W = 1, 8 flags in one
// byte). INNERQ_U units per thread (BLOCK apart, rows walked without
// divisions). Fallback `decode_innerq_any_{out}`: one element per unit.

#define INNERQ_U 4

// Group mode: true = symmetric.
__device__ __forceinline__ bool innerq_sym(u32 mode, const u8* aux, u64 g) {
    if (mode == 2u) return (__ldg(aux + (g >> 3)) >> (u32)(g & 7u)) & 1u;
    return mode == 1u;
}

// One element: asymmetric (q * s + z) or symmetric (q * s, the sign
// flipped when `sign` is set), as one fused multiply-add: the product of a
// code below 2^8 and an f16 scale is exact in binary32, so fma(q, s, z)
// rounds exactly as (q * s) + z; a symmetric element is fma(q, +-s, -0),
// exactly +-(q * s) including the sign of a zero (-0 + -0 = -0, +0 + -0 = +0).
__device__ __forceinline__ float innerq_value(float q, float s, bool sym, u32 zbits, u32 sign) {
    float sv = __uint_as_float(__float_as_uint(s) ^ ((sym ? sign : 0u) << 31));
    return __fmaf_rn(q, sv, __uint_as_float(sym ? 0x80000000u : zbits));
}

// Code i of a unit's 8 codes of b bits, as an exact f32.
__device__ __forceinline__ float innerq_code(u64 codes, int i, int b, u32 mask) {
    u32 lo = (u32)codes, hi = (u32)(codes >> 32);
    u32 cw = b * (i + 1) <= 32 ? lo >> (b * i) : b * i >= 32 ? hi >> (b * i - 32) : (u32)(codes >> (b * i));
    return __fsub_rn(__uint_as_float(and_or(cw, mask, 0x4b000000u)), 8388608.0f);
}

template <int B, int OUT>
__device__ __forceinline__ void innerq_decode_k(const PageDesc* __restrict__ descs,
                                                const uint2* __restrict__ work, u64* status) {
    const uint2 w = work[blockIdx.x];
    const PageDesc d = descs[w.x];
    const u32 D = d.head_dim, nunits = d.rows * d.upr;
    const u32 G = d.p0, mG = d.p1, mode = d.p2 & 0xffu, W = d.p2 >> 16;
    const bool norm = (d.p2 >> 8) & 1u;
    const u32 gpr = udiv(D, G, mG);
    const u8* body = reinterpret_cast<const u8*>(d.body);
    const u32* slots = reinterpret_cast<const u32*>(body + d.sec1);
    const u8* index = body + d.sec2;
    const u8* aux = body + d.sec3;
    const float* fac = reinterpret_cast<const float*>(d.side);
    u16* dst = reinterpret_cast<u16*>(d.dst);
    const u32 drow = walk_step(d.upr);
    RowWalk r;
    walk_init(d, w.y + threadIdx.x, r);
    u64 codes[INNERQ_U];
    float s[INNERQ_U];
    u32 zb[INNERQ_U], sw[INNERQ_U], head[INNERQ_U], cz[INNERQ_U];
    bool sym[INNERQ_U];
    u16* out[INNERQ_U];
#pragma unroll
    for (int k = 0; k < INNERQ_U; k++) {
        u32 u = w.y + (u32)k * BLOCK + threadIdx.x;
        if (k > 0) walk_next(d, u, drow, r);
        codes[k] = 0;
        s[k] = 0.f;
        zb[k] = 0;
        sw[k] = 0;
        sym[k] = false;
        head[k] = 0;
        cz[k] = 0;
        out[k] = nullptr;
        if (u < nunits) {
            u32 c0 = 8u * r.j;
            cz[k] = c0;
            u32 gi = udiv(c0, G, mG);
            u32 e0 = c0 - gi * G;
            u64 g = (u64)r.row * gpr + gi;
            codes[k] = load_le<B>(index + (((u64)r.row * D + c0) >> 3) * B);
            s[k] = ld_f16(body + d.sec0, g);
            sym[k] = innerq_sym(mode, aux, g);
            zb[k] = __ldg(slots + g * W);
            sw[k] = __ldg(slots + g * W + (e0 >> 5)) >> (e0 & 31u);
            if (norm) head[k] = r.p - udiv(r.p, d.heads, d.m_heads) * d.heads;
            i64 o = row_dst_pt(d, r.row, r.p, r.t, status);
            if (o >= 0) out[k] = dst + o + c0;
        }
    }
    const u32 mask = (1u << B) - 1u;
#pragma unroll
    for (int k = 0; k < INNERQ_U; k++) {
        // The unit's 8 elements share the group: its sign bits (0 for an
        // asymmetric group) and its addend (-0 for a symmetric group, see
        // innerq_value) are set once.
        const u32 sg = sym[k] ? sw[k] : 0u, sbits = __float_as_uint(s[k]);
        const float z = __uint_as_float(sym[k] ? 0x80000000u : zb[k]);
        float x[8];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float sv = __uint_as_float(sbits ^ ((sg << (31 - i)) & 0x80000000u));
            x[i] = __fmaf_rn(innerq_code(codes[k], i, B, mask), sv, z);
        }
        if (norm) {
            // Factors of the unit's 8 channels (L1-resident: heads x D f32).
            const float4* fp = reinterpret_cast<const float4*>(fac + (u64)head[k] * D + cz[k]);
            float4 a = __ldg(fp), b = __ldg(fp + 1);
            float f[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
            for (int i = 0; i < 8; i++) x[i] = __fmul_rn(x[i], f[i]);
        }
        if (out[k] != nullptr) st_out8<OUT>(out[k], x);
    }
}

template <int B, int OUT>
__device__ __forceinline__ void innerq_decode_v(const PageDesc* __restrict__ descs,
                                                const uint2* __restrict__ work, u64* status) {
    const uint2 w = work[blockIdx.x];
    const PageDesc d = descs[w.x];
    const u32 D = d.head_dim, nunits = d.rows * d.upr;
    const u32 G = d.p0, mG = d.p1, mode = d.p2 & 0xffu, W = d.p2 >> 16;
    const u32 J = udiv(d.tokens + G - 1u, G, mG);
    const u8* body = reinterpret_cast<const u8*>(d.body);
    const u32* slots = reinterpret_cast<const u32*>(body + d.sec1);
    const u8* index = body + d.sec2;
    const u8* aux = body + d.sec3;
    u16* dst = reinterpret_cast<u16*>(d.dst);
    const u32 drow = walk_step(d.upr);
    RowWalk r;
    walk_init(d, w.y + threadIdx.x, r);
    u64 codes[INNERQ_U], g0s[INNERQ_U];
    uint4 sc[INNERQ_U];
    u32 flags[INNERQ_U], es[INNERQ_U];
    u16* out[INNERQ_U];
#pragma unroll
    for (int k = 0; k < INNERQ_U; k++) {
        u32 u = w.y + (u32)k * BLOCK + threadIdx.x;
        if (k > 0) walk_next(d, u, drow, r);
        codes[k] = 0;
        g0s[k] = 0;
        sc[k] = make_uint4(0, 0, 0, 0);
        flags[k] = mode == 1u ? 0xffu : 0u;
        es[k] = 0;
        out[k] = nullptr;
        if (u < nunits) {
            u32 c0 = 8u * r.j;
            u32 j = udiv(r.t, G, mG);
            es[k] = r.t - j * G;
            u64 g0 = ((u64)r.p * J + j) * D + c0;  // a multiple of 8
            g0s[k] = g0;
            codes[k] = load_le<B>(index + (((u64)r.row * D + c0) >> 3) * B);
            sc[k] = __ldg(reinterpret_cast<const uint4*>(body + d.sec0 + 2 * g0));
            if (mode == 2u) flags[k] = __ldg(aux + (g0 >> 3));
            i64 o = row_dst_pt(d, r.row, r.p, r.t, status);
            if (o >= 0) out[k] = dst + o + c0;
        }
    }
    const u32 mask = (1u << B) - 1u;
#pragma unroll
    for (int k = 0; k < INNERQ_U; k++) {
        // The slots of the unit's 8 groups (each shared by up to G rows:
        // L1/L2 hits): zero points, or sign words of element e.
        u32 zb[8], sw[8];
        const u32 eb = es[k] & 31u;
        if (W == 1u) {
            const uint4* p = reinterpret_cast<const uint4*>(slots + g0s[k]);
            uint4 a = __ldg(p), b = __ldg(p + 1);
            zb[0] = a.x; zb[1] = a.y; zb[2] = a.z; zb[3] = a.w;
            zb[4] = b.x; zb[5] = b.y; zb[6] = b.z; zb[7] = b.w;
#pragma unroll
            for (int i = 0; i < 8; i++) sw[i] = zb[i];
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) {
                zb[i] = __ldg(slots + (g0s[k] + i) * W);
                sw[i] = __ldg(slots + (g0s[k] + i) * W + (es[k] >> 5));
            }
        }
        u32 s4[4] = {sc[k].x, sc[k].y, sc[k].z, sc[k].w};
        float x[8];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float s = f16_to_f32((u16)(s4[i >> 1] >> (16 * (i & 1))));
            x[i] = innerq_value(innerq_code(codes[k], i, B, mask), s, (flags[k] >> i) & 1u, zb[i],
                                (sw[i] >> eb) & 1u);
        }
        if (out[k] != nullptr) st_out8<OUT>(out[k], x);
    }
}

#define INNERQ_ARGS const PageDesc *descs, const uint2 *work, u64 *status
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_k_b1_bf16(INNERQ_ARGS) { innerq_decode_k<1, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_k_b2_bf16(INNERQ_ARGS) { innerq_decode_k<2, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_k_b3_bf16(INNERQ_ARGS) { innerq_decode_k<3, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_k_b4_bf16(INNERQ_ARGS) { innerq_decode_k<4, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_k_b5_bf16(INNERQ_ARGS) { innerq_decode_k<5, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_k_b6_bf16(INNERQ_ARGS) { innerq_decode_k<6, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_k_b7_bf16(INNERQ_ARGS) { innerq_decode_k<7, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_k_b8_bf16(INNERQ_ARGS) { innerq_decode_k<8, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_v_b1_bf16(INNERQ_ARGS) { innerq_decode_v<1, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_v_b2_bf16(INNERQ_ARGS) { innerq_decode_v<2, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_v_b3_bf16(INNERQ_ARGS) { innerq_decode_v<3, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_v_b4_bf16(INNERQ_ARGS) { innerq_decode_v<4, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_v_b5_bf16(INNERQ_ARGS) { innerq_decode_v<5, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_v_b6_bf16(INNERQ_ARGS) { innerq_decode_v<6, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_v_b7_bf16(INNERQ_ARGS) { innerq_decode_v<7, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_v_b8_bf16(INNERQ_ARGS) { innerq_decode_v<8, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_k_b1_f16(INNERQ_ARGS) { innerq_decode_k<1, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_k_b2_f16(INNERQ_ARGS) { innerq_decode_k<2, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_k_b3_f16(INNERQ_ARGS) { innerq_decode_k<3, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_k_b4_f16(INNERQ_ARGS) { innerq_decode_k<4, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_k_b5_f16(INNERQ_ARGS) { innerq_decode_k<5, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_k_b6_f16(INNERQ_ARGS) { innerq_decode_k<6, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_k_b7_f16(INNERQ_ARGS) { innerq_decode_k<7, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_k_b8_f16(INNERQ_ARGS) { innerq_decode_k<8, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_v_b1_f16(INNERQ_ARGS) { innerq_decode_v<1, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_v_b2_f16(INNERQ_ARGS) { innerq_decode_v<2, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_v_b3_f16(INNERQ_ARGS) { innerq_decode_v<3, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_v_b4_f16(INNERQ_ARGS) { innerq_decode_v<4, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_v_b5_f16(INNERQ_ARGS) { innerq_decode_v<5, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_v_b6_f16(INNERQ_ARGS) { innerq_decode_v<6, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_v_b7_f16(INNERQ_ARGS) { innerq_decode_v<7, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_v_b8_f16(INNERQ_ARGS) { innerq_decode_v<8, OUT_F16>(descs, work, status); }

// Fallback: one element per unit (Grid::Units with w = 1), any head_dim.
template <int OUT>
__device__ __forceinline__ void innerq_decode_any(const PageDesc* __restrict__ descs,
                                                  const uint2* __restrict__ work, u64* status) {
    const uint2 w = work[blockIdx.x];
    const PageDesc d = descs[w.x];
    const u32 D = d.head_dim, n = d.rows * D;
    const u32 G = d.p0, mG = d.p1, mode = d.p2 & 0xffu, W = d.p2 >> 16;
    const bool norm = (d.p2 >> 8) & 1u;
    const u32 bits = d.p3 & 0xffu;
    const bool tok = (d.p3 >> 8) & 1u;
    const u32 J = udiv(d.tokens + G - 1u, G, mG);
    const u8* body = reinterpret_cast<const u8*>(d.body);
    const u32* slots = reinterpret_cast<const u32*>(body + d.sec1);
    const float* fac = reinterpret_cast<const float*>(d.side);
    u16* dst = reinterpret_cast<u16*>(d.dst);
    for (int k = 0; k < UNITS_PER_THREAD; k++) {
        u32 e = w.y + (u32)k * BLOCK + threadIdx.x;
        if (e >= n) break;
        u32 row = udiv(e, D, d.m_upr);
        u32 c = e - row * D;
        i64 o = row_dst(d, row, status);
        if (o < 0) continue;
        u32 p = udiv(row, d.tokens, d.m_tokens);
        u32 t = row - p * d.tokens;
        u64 g;
        u32 el;
        if (tok) {
            u32 j = udiv(t, G, mG);
            g = ((u64)p * J + j) * D + c;
            el = t - j * G;
        } else {
            u32 gi = udiv(c, G, mG);
            g = (u64)row * udiv(D, G, mG) + gi;
            el = c - gi * G;
        }
        u32 q = get_bits(body + d.sec2, (u64)e * bits, bits);
        bool sym = innerq_sym(mode, body + d.sec3, g);
        u32 sign = (__ldg(slots + g * W + (el >> 5)) >> (el & 31u)) & 1u;
        float x = innerq_value(code_f32(q), ld_f16(body + d.sec0, g), sym, __ldg(slots + g * W), sign);
        if (norm) {
            u32 h = p - udiv(p, d.heads, d.m_heads) * d.heads;
            x = __fmul_rn(x, __ldg(fac + (u64)h * D + c));
        }
        dst[o + c] = to_out<OUT>(x);
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK) decode_innerq_any_bf16(INNERQ_ARGS) { innerq_decode_any<OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_innerq_any_f16(INNERQ_ARGS) { innerq_decode_any<OUT_F16>(descs, work, status); }
