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

// The slot words of the 8 consecutive groups g0 .. g0 + 7 (g0 a multiple
// of 8): zw[i] = word 0 of slot g0 + i (the zero point's bits), sw[i] = the
// word holding element e's sign bit (word e / 32); one 32-byte load when
// a slot is one word (W = 1).
__device__ __forceinline__ void innerq_slots8(const u32* slots, u32 g0, u32 W, u32 e, u32 zw[8], u32 sw[8]) {
    if (W == 1u) {
        const uint4* sp = reinterpret_cast<const uint4*>(slots) + (g0 >> 2);
        uint4 a = __ldg(sp), b = __ldg(sp + 1);
        zw[0] = a.x; zw[1] = a.y; zw[2] = a.z; zw[3] = a.w;
        zw[4] = b.x; zw[5] = b.y; zw[6] = b.z; zw[7] = b.w;
#pragma unroll
        for (int i = 0; i < 8; i++) sw[i] = zw[i];
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            zw[i] = __ldg(slots + (g0 + i) * W);
            sw[i] = __ldg(slots + ((g0 + i) * W + (e >> 5)));
        }
    }
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
        innerq_slots8(slots, g0s[k], W, es[k], zb, sw);
        const u32 eb = es[k] & 31u;
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

// ---------------------------------------------------------------------------
// Quad kernels `decode_innerq_{kq|vq}_b{B}_{out}` (D / 8 a power of two <=
// 256; see Quad in common.cuh): a thread decodes chunk j (channels c0 = 8j
// .. c0 + 7) of 4 consecutive rows, every load issued first. Signs of
// symmetric groups are applied to the packed outputs (pack8_neg), so every
// element is one fused multiply-add fma(q, S, Z or -0) (and the factor
// product for normalized keys). The body is specialized for G = 32 (one
// slot word per group) in each mode (MODE 0 asymmetric, 1 symmetric, 2
// hybrid); MODE 3 reads mode and slot width from the descriptor. The
// kernel picks the body from the descriptor (uniform over a launch).

// Quad rows' offsets `min(k, last) * stride` (rows past the page repeat the
// last row, see quad_row).
__device__ __forceinline__ void quad_offs(const Quad& q, u32 stride, u32 o[4]) {
#pragma unroll
    for (int k = 0; k < 4; k++) o[k] = min((u32)k, q.last) * stride;
}

// K (groups of G channels of one row; G divides D, so it is a power of two
// here): per row the group's scale, slot word(s) and flag; the 8 factors of
// the chunk once per quad (reloaded for a row of another plane).
template <int B, int OUT, int MODE>
__device__ __forceinline__ void innerq_kq_body(const PageDesc& d, u32 r0, u64* status) {
    const u32 mask = (1u << B) - 1u;
    const Quad q = quad_at(d, r0);
    const u32 D = d.head_dim, G = d.p0;
    const u32 mode = MODE == 3 ? d.p2 & 0xffu : (u32)MODE, W = MODE == 3 ? d.p2 >> 16 : 1u;
    const bool norm = (d.p2 >> 8) & 1u;
    const u32 lgG = __ffs(G) - 1u;
    const u32 jc = threadIdx.x & (d.upr - 1u), c0 = 8u * jc;
    const u32 gpr = D >> lgG, gi = c0 >> lgG, e0 = c0 & (G - 1u);
    const u8* body = reinterpret_cast<const u8*>(d.body);
    // The quad's rows are gpr groups and upr chunks apart.
    const u32 g0 = r0 * gpr + gi;
    const u16* sp = reinterpret_cast<const u16*>(body + d.sec0) + g0;
    const u32* zp = reinterpret_cast<const u32*>(body + d.sec1) + g0 * W;
    const u32* wp = zp + (e0 >> 5);
    const u32* aux = reinterpret_cast<const u32*>(body + d.sec3);
    u32 og[4], oc[4];
    quad_offs(q, gpr, og);
    quad_offs(q, d.upr, oc);
    u64 codes[4];
    u32 sc[4], sg[4], zw[4], fl[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        codes[k] = codes8<B>(body + d.sec2, r0 * d.upr + jc + oc[k]);
        sc[k] = __ldg(sp + og[k]);
        sg[k] = __ldg(wp + og[k] * W);
        zw[k] = W == 1u ? sg[k] : __ldg(zp + og[k] * W);
        const u32 g = g0 + og[k];
        // Hybrid flags as aligned 32-bit words (the AUX section is padded).
        fl[k] = mode == 2u ? __ldg(aux + (g >> 5)) >> (g & 31u) : mode;
    }
    const float* fac = reinterpret_cast<const float*>(d.side);
    float f[8];
    u32 fp = q.p;  // plane whose factors f holds
    if (norm) {
        // Factors of the chunk's 8 channels (L1-resident: heads x D f32).
        const u32 h = q.p - udiv(q.p, d.heads, d.m_heads) * d.heads;
        const float4* fv = reinterpret_cast<const float4*>(fac + (h * D + c0));
        float4 a = __ldg(fv), b = __ldg(fv + 1);
        f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
        f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
    }
    u16* out[4];
    quad_dst(d, q, c0, out, status);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        if (out[k] == nullptr) continue;
        if (norm && !q.same) {
            u32 pk, tk;
            quad_pt(d, q, (u32)k, pk, tk);
            if (pk != fp) {
                fp = pk;
                const u32 h = pk - udiv(pk, d.heads, d.m_heads) * d.heads;
                const float4* fv = reinterpret_cast<const float4*>(fac + (h * D + c0));
                float4 a = __ldg(fv), b = __ldg(fv + 1);
                f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
                f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
            }
        }
        // A symmetric group adds -0 and negates the elements whose sign
        // bit is set (see innerq_value); an asymmetric one adds Z.
        const bool sym = MODE == 0 ? false : MODE == 1 ? true : (fl[k] & 1u) != 0u;
        const float s = f16_to_f32((u16)sc[k]);
        const float z = __uint_as_float(sym ? 0x80000000u : zw[k]);
        float x[8];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            x[i] = __fmaf_rn(code8_f32<B>(codes[k], i, mask), s, z);
            if (norm) x[i] = __fmul_rn(x[i], f[i]);
        }
        if (MODE == 0) {
            st_u4(out[k], make_uint4(pack2<OUT>(x[0], x[1]), pack2<OUT>(x[2], x[3]), pack2<OUT>(x[4], x[5]),
                                     pack2<OUT>(x[6], x[7])));
        } else {
            const u32 neg = sym ? (sg[k] >> (e0 & 31u)) & 0xffu : 0u;
            st_u4(out[k], pack8_neg<OUT>(x, neg));
        }
    }
}

// One row of a V chunk whose quad's rows do not share token group and slot
// word (a quad across planes or token groups): each element with its own
// group's scale, slot and flag, as the 8-element kernel.
template <int B, int OUT>
__device__ __forceinline__ void innerq_v_row(const PageDesc& d, u32 r, u32 pk, u32 tk, u32 jc, u16* out) {
    const u32 D = d.head_dim, G = d.p0, mG = d.p1, mode = d.p2 & 0xffu, W = d.p2 >> 16;
    const u32 J = udiv(d.tokens + G - 1u, G, mG);
    const u8* body = reinterpret_cast<const u8*>(d.body);
    const u32* slots = reinterpret_cast<const u32*>(body + d.sec1);
    const u32 j = udiv(tk, G, mG), e = tk - j * G;
    const u32 g0 = (pk * J + j) * D + 8u * jc;
    const u64 codes = codes8<B>(body + d.sec2, r * d.upr + jc);
    const uint4 sc = __ldg(reinterpret_cast<const uint4*>(body + d.sec0) + (g0 >> 3));
    const u32 flags = mode == 2u ? __ldg(body + d.sec3 + (g0 >> 3)) : mode == 1u ? 0xffu : 0u;
    const u32 s4[4] = {sc.x, sc.y, sc.z, sc.w};
    float x[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const u32 zb = __ldg(slots + (g0 + i) * W);
        const u32 sw = __ldg(slots + ((g0 + i) * W + (e >> 5)));
        const float s = f16_to_f32((u16)(s4[i >> 1] >> (16 * (i & 1))));
        x[i] = innerq_value(code8_f32<B>(codes, i, (1u << B) - 1u), s, (flags >> i) & 1u, zb,
                            (sw >> (e & 31u)) & 1u);
    }
    st_out8<OUT>(out, x);
}

// V (groups of up to G tokens of one channel): the chunk's 8 groups are
// shared by the quad's 4 rows when they lie in one plane, one token group
// and one slot word (always when the page's token count is a multiple of
// 4); then the 8 scales (one 16-byte load), slots (two when W = 1) and
// flags (one byte) are read and prepared once: per group S, the addend, and
// the 4 rows' sign bits. Other quads go row by row (innerq_v_row).
template <int B, int OUT, int MODE>
__device__ __forceinline__ void innerq_vq_body(const PageDesc& d, u32 r0, u64* status) {
    const u32 mask = (1u << B) - 1u;
    const Quad q = quad_at(d, r0);
    const u32 D = d.head_dim, G = d.p0, mG = d.p1;
    const u32 mode = MODE == 3 ? d.p2 & 0xffu : (u32)MODE, W = MODE == 3 ? d.p2 >> 16 : 1u;
    const u32 jc = threadIdx.x & (d.upr - 1u), c0 = 8u * jc;
    const u8* body = reinterpret_cast<const u8*>(d.body);
    const u32* slots = reinterpret_cast<const u32*>(body + d.sec1);
    u16* out[4];
    quad_dst(d, q, c0, out, status);
    // G is a multiple of 32: tokens t .. t + 3 of one plane share group and
    // slot word when they stay inside an aligned 32.
    if (!q.same || (q.t & 31u) > 28u) {
        quad_each_row(d, q, out, [&](u32 r, u32 pk, u32 tk, u16* o) { innerq_v_row<B, OUT>(d, r, pk, tk, jc, o); });
        return;
    }
    const u32 J = udiv(d.tokens + G - 1u, G, mG);
    const u32 j = udiv(q.t, G, mG), e = q.t - j * G;
    const u32 g0 = (q.p * J + j) * D + c0;  // a multiple of 8
    u64 codes[4];
#pragma unroll
    for (int k = 0; k < 4; k++) codes[k] = codes8<B>(body + d.sec2, r0 * d.upr + jc + (u32)k * d.upr);
    const uint4 sc = __ldg(reinterpret_cast<const uint4*>(body + d.sec0) + (g0 >> 3));
    const u32 flags = mode == 2u ? __ldg(body + d.sec3 + (g0 >> 3)) : mode == 1u ? 0xffu : 0u;
    u32 zw[8], sw[8];
    innerq_slots8(slots, g0, W, e, zw, sw);
    // Per group: f32 scale, addend (Z, or -0 for a symmetric group) and the
    // sign bits of tokens e .. e + 3 (bits 0..3; 0 when asymmetric). Pair
    // i's sign bits go to np[i]: group 2i in bits 0..3, group 2i + 1 in
    // bits 16..19, so row k's mask of output word i is
    // (np[i] << (15 - k)) & 0x80008000.
    const u32 s4[4] = {sc.x, sc.y, sc.z, sc.w};
    float s[8], z[8];
    u32 np[4];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const bool sym = (flags >> i) & 1u;
        s[i] = f16_to_f32((u16)(s4[i >> 1] >> (16 * (i & 1))));
        z[i] = __uint_as_float(sym ? 0x80000000u : zw[i]);
        const u32 nb = sym ? (sw[i] >> (e & 31u)) & 0xfu : 0u;
        if (i & 1) np[i >> 1] |= nb << 16;
        else np[i >> 1] = nb;
    }
#pragma unroll
    for (int k = 0; k < 4; k++) {
        if (out[k] == nullptr) continue;
        float x[8];
        affine8<B>(codes[k], mask, s, z, x);
        const u32 m = 0x80008000u;
        if (MODE == 0) {
            st_u4(out[k], make_uint4(pack2<OUT>(x[0], x[1]), pack2<OUT>(x[2], x[3]), pack2<OUT>(x[4], x[5]),
                                     pack2<OUT>(x[6], x[7])));
        } else {
            st_u4(out[k], make_uint4(pack2<OUT>(x[0], x[1]) ^ ((np[0] << (15 - k)) & m),
                                     pack2<OUT>(x[2], x[3]) ^ ((np[1] << (15 - k)) & m),
                                     pack2<OUT>(x[4], x[5]) ^ ((np[2] << (15 - k)) & m),
                                     pack2<OUT>(x[6], x[7]) ^ ((np[3] << (15 - k)) & m)));
        }
    }
}

// A quad body for K (V = false) or V (V = true) in group mode MODE.
template <int B, int OUT, int MODE, bool V>
__device__ __forceinline__ void innerq_q_body(const PageDesc& d, u32 r0, u64* status) {
    if (V) innerq_vq_body<B, OUT, MODE>(d, r0, status);
    else innerq_kq_body<B, OUT, MODE>(d, r0, status);
}

// The quad kernels: the body specialized for the launch's mode and slot
// width (uniform over a launch), QUADS quads per thread.
template <int B, int OUT, bool V>
__device__ __forceinline__ void innerq_decode_q(const PageDesc* __restrict__ descs,
                                                const uint2* __restrict__ work, u64* status) {
    const uint2 w = work[blockIdx.x];
    const PageDesc d = descs[w.x];
    const u32 lg = __ffs(d.upr) - 1u;
    const u32 mode = d.p2 & 0xffu, W = d.p2 >> 16;
#pragma unroll 1
    for (u32 qi = 0; qi < QUADS; qi++) {
        const u32 r0 = quad_row0(w.y, lg, qi);
        if (r0 >= d.rows) return;
        if (W != 1u) innerq_q_body<B, OUT, 3, V>(d, r0, status);
        else if (mode == 2u) innerq_q_body<B, OUT, 2, V>(d, r0, status);
        else if (mode == 1u) innerq_q_body<B, OUT, 1, V>(d, r0, status);
        else innerq_q_body<B, OUT, 0, V>(d, r0, status);
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_kq_b1_bf16(INNERQ_ARGS) { innerq_decode_q<1, OUT_BF16, false>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_kq_b2_bf16(INNERQ_ARGS) { innerq_decode_q<2, OUT_BF16, false>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_kq_b3_bf16(INNERQ_ARGS) { innerq_decode_q<3, OUT_BF16, false>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_kq_b4_bf16(INNERQ_ARGS) { innerq_decode_q<4, OUT_BF16, false>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_kq_b5_bf16(INNERQ_ARGS) { innerq_decode_q<5, OUT_BF16, false>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_kq_b6_bf16(INNERQ_ARGS) { innerq_decode_q<6, OUT_BF16, false>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_kq_b7_bf16(INNERQ_ARGS) { innerq_decode_q<7, OUT_BF16, false>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_kq_b8_bf16(INNERQ_ARGS) { innerq_decode_q<8, OUT_BF16, false>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_vq_b1_bf16(INNERQ_ARGS) { innerq_decode_q<1, OUT_BF16, true>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_vq_b2_bf16(INNERQ_ARGS) { innerq_decode_q<2, OUT_BF16, true>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_vq_b3_bf16(INNERQ_ARGS) { innerq_decode_q<3, OUT_BF16, true>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_vq_b4_bf16(INNERQ_ARGS) { innerq_decode_q<4, OUT_BF16, true>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_vq_b5_bf16(INNERQ_ARGS) { innerq_decode_q<5, OUT_BF16, true>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_vq_b6_bf16(INNERQ_ARGS) { innerq_decode_q<6, OUT_BF16, true>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_vq_b7_bf16(INNERQ_ARGS) { innerq_decode_q<7, OUT_BF16, true>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_vq_b8_bf16(INNERQ_ARGS) { innerq_decode_q<8, OUT_BF16, true>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_kq_b1_f16(INNERQ_ARGS) { innerq_decode_q<1, OUT_F16, false>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_kq_b2_f16(INNERQ_ARGS) { innerq_decode_q<2, OUT_F16, false>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_kq_b3_f16(INNERQ_ARGS) { innerq_decode_q<3, OUT_F16, false>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_kq_b4_f16(INNERQ_ARGS) { innerq_decode_q<4, OUT_F16, false>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_kq_b5_f16(INNERQ_ARGS) { innerq_decode_q<5, OUT_F16, false>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_kq_b6_f16(INNERQ_ARGS) { innerq_decode_q<6, OUT_F16, false>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_kq_b7_f16(INNERQ_ARGS) { innerq_decode_q<7, OUT_F16, false>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_kq_b8_f16(INNERQ_ARGS) { innerq_decode_q<8, OUT_F16, false>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_vq_b1_f16(INNERQ_ARGS) { innerq_decode_q<1, OUT_F16, true>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_vq_b2_f16(INNERQ_ARGS) { innerq_decode_q<2, OUT_F16, true>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_vq_b3_f16(INNERQ_ARGS) { innerq_decode_q<3, OUT_F16, true>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_vq_b4_f16(INNERQ_ARGS) { innerq_decode_q<4, OUT_F16, true>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_vq_b5_f16(INNERQ_ARGS) { innerq_decode_q<5, OUT_F16, true>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_vq_b6_f16(INNERQ_ARGS) { innerq_decode_q<6, OUT_F16, true>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_vq_b7_f16(INNERQ_ARGS) { innerq_decode_q<7, OUT_F16, true>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_innerq_vq_b8_f16(INNERQ_ARGS) { innerq_decode_q<8, OUT_F16, true>(descs, work, status); }

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
