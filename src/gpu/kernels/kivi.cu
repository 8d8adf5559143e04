// `kivi` pages (format/codecs/kivi.md), also the value-group V pages of
// `octopus` / `turbo` (`:vg{g}`): b-bit codes in element order, an f16 scale
// and an f16 zero point per group; groups run along tokens (K: up to G
// tokens of one channel, g = (p*J + t/G)*D + c with J = ceil(T/G)) or along
// channels (V: G channels of one row, g = r*(D/G) + c/G).
//
// Decode, binary32: x = (f32(q) * S_g) + Z_g. The product of a code below
// 2^8 and an f16 scale is exact in binary32, so the kernels evaluate it as
// one fused multiply-add, which rounds exactly as the normative sum.
//
// Descriptor: sec0 = SCALE (f16), sec1 = ZERO (f16), sec2 = INDEX;
// p0 = G, p1 = udiv magic of G, p2 = bits, p3 = 1 for channel groups.
//
// Fast `decode_kivi_{tok|ch}_b{B}_{out}` (D % 8 == 0; `ch` needs G % 8 ==
// 0): a unit is 8 consecutive channels of a row (B bytes of codes, one
// 16-byte store); token groups read the 8 scales and 8 zero points of the
// unit as two 16-byte loads, channel groups one of each. KIVI_U units per
// thread (BLOCK apart, rows walked without divisions: RowWalk), every load
// issued before any arithmetic.
// Fallback `decode_kivi_any_{out}`: one element per unit, any shape.

#define KIVI_U 4

template <int B, bool TOK, int OUT>
__device__ __forceinline__ void kivi_decode(const PageDesc* __restrict__ descs,
                                            const uint2* __restrict__ work, u64* status) {
    const uint2 w = work[blockIdx.x];
    u64 codes[KIVI_U];
    uint4 sc[KIVI_U], zp[KIVI_U];
    u16* out[KIVI_U];
    {
        const PageDesc d = descs[w.x];
        const u32 D = d.head_dim, nunits = d.rows * d.upr;
        const u32 G = d.p0, mG = d.p1;
        const u32 J = udiv(d.tokens + G - 1u, G, mG);
        const u8* body = reinterpret_cast<const u8*>(d.body);
        const u8* scales = body + d.sec0;
        const u8* zeros = body + d.sec1;
        const u8* index = body + d.sec2;
        u16* dst = reinterpret_cast<u16*>(d.dst);
        const u32 drow = walk_step(d.upr);
        RowWalk r;
        walk_init(d, w.y + threadIdx.x, r);
        u32 gi = udiv(8u * r.j, G, mG);  // channel groups: the unit's group in its row
        const u32 gpr = udiv(D, G, mG);
#pragma unroll
        for (int k = 0; k < KIVI_U; k++) {
            u32 u = w.y + (u32)k * BLOCK + threadIdx.x;
            if (k > 0) {
                walk_next(d, u, drow, r);
                if (drow == 0u) gi = udiv(8u * r.j, G, mG);
            }
            codes[k] = 0;
            sc[k] = make_uint4(0, 0, 0, 0);
            zp[k] = make_uint4(0, 0, 0, 0);
            out[k] = nullptr;
            if (u < nunits) {
                u32 c0 = 8u * r.j;
                u64 e0 = (u64)r.row * D + c0;  // a multiple of 8
                codes[k] = load_le<B>(index + (e0 >> 3) * B);
                if (TOK) {
                    u64 g0 = ((u64)r.p * J + udiv(r.t, G, mG)) * D + c0;
                    sc[k] = __ldg(reinterpret_cast<const uint4*>(scales + 2 * g0));
                    zp[k] = __ldg(reinterpret_cast<const uint4*>(zeros + 2 * g0));
                } else {
                    u64 g = (u64)r.row * gpr + gi;
                    u32 s = __ldg(reinterpret_cast<const u16*>(scales) + g);
                    u32 z = __ldg(reinterpret_cast<const u16*>(zeros) + g);
                    s |= s << 16;
                    z |= z << 16;
                    sc[k] = make_uint4(s, s, s, s);
                    zp[k] = make_uint4(z, z, z, z);
                }
                i64 o = row_dst_pt(d, r.row, r.p, r.t, status);
                if (o >= 0) out[k] = dst + o + c0;
            }
        }
    }
    u32 mask = (1u << B) - 1u, two23 = 0x4b000000u;
#pragma unroll
    for (int k = 0; k < KIVI_U; k++) {
        u32 sw[4] = {sc[k].x, sc[k].y, sc[k].z, sc[k].w};
        u32 zw[4] = {zp[k].x, zp[k].y, zp[k].z, zp[k].w};
        const u32 lo = (u32)codes[k], hi = (u32)(codes[k] >> 32);
        float x[8];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            u32 cw = B * (i + 1) <= 32 ? lo >> (B * i) : B * i >= 32 ? hi >> (B * i - 32) : (u32)(codes[k] >> (B * i));
            float q = __fsub_rn(__uint_as_float(and_or(cw, mask, two23)), 8388608.0f);
            float s = f16_to_f32((u16)(sw[i >> 1] >> (16 * (i & 1))));
            float z = f16_to_f32((u16)(zw[i >> 1] >> (16 * (i & 1))));
            // q * s is exact (an 8-bit integer times an f16), so the fused
            // multiply-add rounds exactly like (q * s) + z.
            x[i] = __fmaf_rn(q, s, z);
        }
        if (out[k] != nullptr) st_out8<OUT>(out[k], x);
    }
}

#define KIVI_ARGS const PageDesc *descs, const uint2 *work, u64 *status
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tok_b1_bf16(KIVI_ARGS) { kivi_decode<1, true, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tok_b2_bf16(KIVI_ARGS) { kivi_decode<2, true, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tok_b3_bf16(KIVI_ARGS) { kivi_decode<3, true, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tok_b4_bf16(KIVI_ARGS) { kivi_decode<4, true, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tok_b5_bf16(KIVI_ARGS) { kivi_decode<5, true, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tok_b6_bf16(KIVI_ARGS) { kivi_decode<6, true, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tok_b7_bf16(KIVI_ARGS) { kivi_decode<7, true, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tok_b8_bf16(KIVI_ARGS) { kivi_decode<8, true, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_ch_b1_bf16(KIVI_ARGS) { kivi_decode<1, false, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_ch_b2_bf16(KIVI_ARGS) { kivi_decode<2, false, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_ch_b3_bf16(KIVI_ARGS) { kivi_decode<3, false, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_ch_b4_bf16(KIVI_ARGS) { kivi_decode<4, false, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_ch_b5_bf16(KIVI_ARGS) { kivi_decode<5, false, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_ch_b6_bf16(KIVI_ARGS) { kivi_decode<6, false, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_ch_b7_bf16(KIVI_ARGS) { kivi_decode<7, false, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_ch_b8_bf16(KIVI_ARGS) { kivi_decode<8, false, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tok_b1_f16(KIVI_ARGS) { kivi_decode<1, true, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tok_b2_f16(KIVI_ARGS) { kivi_decode<2, true, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tok_b3_f16(KIVI_ARGS) { kivi_decode<3, true, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tok_b4_f16(KIVI_ARGS) { kivi_decode<4, true, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tok_b5_f16(KIVI_ARGS) { kivi_decode<5, true, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tok_b6_f16(KIVI_ARGS) { kivi_decode<6, true, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tok_b7_f16(KIVI_ARGS) { kivi_decode<7, true, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tok_b8_f16(KIVI_ARGS) { kivi_decode<8, true, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_ch_b1_f16(KIVI_ARGS) { kivi_decode<1, false, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_ch_b2_f16(KIVI_ARGS) { kivi_decode<2, false, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_ch_b3_f16(KIVI_ARGS) { kivi_decode<3, false, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_ch_b4_f16(KIVI_ARGS) { kivi_decode<4, false, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_ch_b5_f16(KIVI_ARGS) { kivi_decode<5, false, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_ch_b6_f16(KIVI_ARGS) { kivi_decode<6, false, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_ch_b7_f16(KIVI_ARGS) { kivi_decode<7, false, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_ch_b8_f16(KIVI_ARGS) { kivi_decode<8, false, OUT_F16>(descs, work, status); }

// Quad kernels `decode_kivi_{tokq|chq}_b{B}_{out}` (D / 8 a power of two <=
// 256; see Quad in common.cuh): a thread decodes chunk j (channels c0 = 8j
// .. c0 + 7) of 4 consecutive rows, every load issued first. Token groups:
// when the quad's rows lie in one plane and one token group (always when G
// and the page's token count are multiples of 4), the chunk's 8 scales and
// zero points are loaded (two 16-byte loads) and widened once for the 4
// rows; other quads go row by row (kivi_tok_row). Channel groups: per row
// one scale and zero point.

// One row of a token-group chunk (plane pk, page token tk).
template <int B, int OUT>
__device__ __forceinline__ void kivi_tok_row(const PageDesc& d, u32 r, u32 pk, u32 tk, u32 jc, u16* out) {
    const u32 D = d.head_dim, G = d.p0, mG = d.p1;
    const u32 J = udiv(d.tokens + G - 1u, G, mG);
    const u8* body = reinterpret_cast<const u8*>(d.body);
    const u32 g0 = (pk * J + udiv(tk, G, mG)) * D + 8u * jc;  // a multiple of 8
    const u64 codes = codes8<B>(body + d.sec2, r * d.upr + jc);
    const uint4 sc = __ldg(reinterpret_cast<const uint4*>(body + d.sec0) + (g0 >> 3));
    const uint4 zp = __ldg(reinterpret_cast<const uint4*>(body + d.sec1) + (g0 >> 3));
    const u32 sw[4] = {sc.x, sc.y, sc.z, sc.w}, zw[4] = {zp.x, zp.y, zp.z, zp.w};
    float x[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const float s = f16_to_f32((u16)(sw[i >> 1] >> (16 * (i & 1))));
        const float z = f16_to_f32((u16)(zw[i >> 1] >> (16 * (i & 1))));
        x[i] = __fmaf_rn(code8_f32<B>(codes, i, (1u << B) - 1u), s, z);
    }
    st_out8<OUT>(out, x);
}

template <int B, bool TOK, int OUT>
__device__ __forceinline__ void kivi_decode_q(const PageDesc* __restrict__ descs,
                                              const uint2* __restrict__ work, u64* status) {
    const uint2 w = work[blockIdx.x];
    const PageDesc d = descs[w.x];
    const u32 lg = __ffs(d.upr) - 1u;
    const u32 mask = (1u << B) - 1u;
#pragma unroll 1
    for (u32 qi = 0; qi < QUADS; qi++) {
        const u32 r0 = quad_row0(w.y, lg, qi);
        if (r0 >= d.rows) return;
        const Quad q = quad_at(d, r0);
        const u32 D = d.head_dim, G = d.p0, mG = d.p1;
        const u32 jc = threadIdx.x & (d.upr - 1u), c0 = 8u * jc;
        const u8* body = reinterpret_cast<const u8*>(d.body);
        u16* out[4];
        quad_dst(d, q, c0, out, status);
        u64 codes[4];
        float s[8], z[8];
        if (TOK) {
            const u32 jt = udiv(q.t, G, mG);
            if (!q.same || q.t + 3u >= (jt + 1u) * G) {
                quad_each_row(d, q, out,
                              [&](u32 r, u32 pk, u32 tk, u16* o) { kivi_tok_row<B, OUT>(d, r, pk, tk, jc, o); });
                continue;
            }
            const u32 J = udiv(d.tokens + G - 1u, G, mG);
            const u32 g0 = (q.p * J + jt) * D + c0;  // a multiple of 8
#pragma unroll
            for (int k = 0; k < 4; k++) codes[k] = codes8<B>(body + d.sec2, r0 * d.upr + jc + (u32)k * d.upr);
            const uint4 sc = __ldg(reinterpret_cast<const uint4*>(body + d.sec0) + (g0 >> 3));
            const uint4 zp = __ldg(reinterpret_cast<const uint4*>(body + d.sec1) + (g0 >> 3));
            const u32 sw[4] = {sc.x, sc.y, sc.z, sc.w}, zw[4] = {zp.x, zp.y, zp.z, zp.w};
#pragma unroll
            for (int i = 0; i < 8; i++) {
                s[i] = f16_to_f32((u16)(sw[i >> 1] >> (16 * (i & 1))));
                z[i] = f16_to_f32((u16)(zw[i >> 1] >> (16 * (i & 1))));
            }
#pragma unroll
            for (int k = 0; k < 4; k++) {
                if (out[k] == nullptr) continue;
                float x[8];
                affine8<B>(codes[k], mask, s, z, x);
                st_out8<OUT>(out[k], x);
            }
        } else {
            // Channel groups (G a multiple of 8): the chunk lies in group gi
            // of each row; rows past the page repeat its last row.
            const u32 gpr = udiv(D, G, mG), gi = udiv(c0, G, mG);
            const u16* sp = reinterpret_cast<const u16*>(body + d.sec0) + (r0 * gpr + gi);
            const u16* zp = reinterpret_cast<const u16*>(body + d.sec1) + (r0 * gpr + gi);
            u32 sv[4], zv[4];
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const u32 kk = min((u32)k, q.last);
                codes[k] = codes8<B>(body + d.sec2, r0 * d.upr + jc + kk * d.upr);
                sv[k] = __ldg(sp + kk * gpr);
                zv[k] = __ldg(zp + kk * gpr);
            }
#pragma unroll
            for (int k = 0; k < 4; k++) {
                if (out[k] == nullptr) continue;
                const float sk = f16_to_f32((u16)sv[k]), zk = f16_to_f32((u16)zv[k]);
                float x[8];
#pragma unroll
                for (int i = 0; i < 8; i++) x[i] = __fmaf_rn(code8_f32<B>(codes[k], i, mask), sk, zk);
                st_out8<OUT>(out[k], x);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tokq_b1_bf16(KIVI_ARGS) { kivi_decode_q<1, true, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tokq_b2_bf16(KIVI_ARGS) { kivi_decode_q<2, true, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tokq_b3_bf16(KIVI_ARGS) { kivi_decode_q<3, true, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tokq_b4_bf16(KIVI_ARGS) { kivi_decode_q<4, true, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tokq_b5_bf16(KIVI_ARGS) { kivi_decode_q<5, true, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tokq_b6_bf16(KIVI_ARGS) { kivi_decode_q<6, true, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tokq_b7_bf16(KIVI_ARGS) { kivi_decode_q<7, true, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tokq_b8_bf16(KIVI_ARGS) { kivi_decode_q<8, true, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_chq_b1_bf16(KIVI_ARGS) { kivi_decode_q<1, false, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_chq_b2_bf16(KIVI_ARGS) { kivi_decode_q<2, false, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_chq_b3_bf16(KIVI_ARGS) { kivi_decode_q<3, false, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_chq_b4_bf16(KIVI_ARGS) { kivi_decode_q<4, false, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_chq_b5_bf16(KIVI_ARGS) { kivi_decode_q<5, false, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_chq_b6_bf16(KIVI_ARGS) { kivi_decode_q<6, false, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_chq_b7_bf16(KIVI_ARGS) { kivi_decode_q<7, false, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_chq_b8_bf16(KIVI_ARGS) { kivi_decode_q<8, false, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tokq_b1_f16(KIVI_ARGS) { kivi_decode_q<1, true, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tokq_b2_f16(KIVI_ARGS) { kivi_decode_q<2, true, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tokq_b3_f16(KIVI_ARGS) { kivi_decode_q<3, true, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tokq_b4_f16(KIVI_ARGS) { kivi_decode_q<4, true, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tokq_b5_f16(KIVI_ARGS) { kivi_decode_q<5, true, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tokq_b6_f16(KIVI_ARGS) { kivi_decode_q<6, true, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tokq_b7_f16(KIVI_ARGS) { kivi_decode_q<7, true, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_tokq_b8_f16(KIVI_ARGS) { kivi_decode_q<8, true, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_chq_b1_f16(KIVI_ARGS) { kivi_decode_q<1, false, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_chq_b2_f16(KIVI_ARGS) { kivi_decode_q<2, false, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_chq_b3_f16(KIVI_ARGS) { kivi_decode_q<3, false, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_chq_b4_f16(KIVI_ARGS) { kivi_decode_q<4, false, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_chq_b5_f16(KIVI_ARGS) { kivi_decode_q<5, false, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_chq_b6_f16(KIVI_ARGS) { kivi_decode_q<6, false, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_chq_b7_f16(KIVI_ARGS) { kivi_decode_q<7, false, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_kivi_chq_b8_f16(KIVI_ARGS) { kivi_decode_q<8, false, OUT_F16>(descs, work, status); }

// Fallback: one element per unit (Grid::Units with w = 1), any head_dim,
// any G, bits from p2, axis from p3.
template <int OUT>
__device__ __forceinline__ void kivi_decode_any(const PageDesc* __restrict__ descs,
                                                const uint2* __restrict__ work, u64* status) {
    const uint2 w = work[blockIdx.x];
    const PageDesc d = descs[w.x];
    const u32 D = d.head_dim, n = d.rows * D;
    const u32 G = d.p0, mG = d.p1, bits = d.p2;
    const bool tok = d.p3 == 0;
    const u32 J = udiv(d.tokens + G - 1u, G, mG);
    const u8* body = reinterpret_cast<const u8*>(d.body);
    u16* dst = reinterpret_cast<u16*>(d.dst);
    for (int k = 0; k < UNITS_PER_THREAD; k++) {
        u32 e = w.y + (u32)k * BLOCK + threadIdx.x;
        if (e >= n) break;
        u32 row = udiv(e, D, d.m_upr);
        u32 c = e - row * D;
        i64 o = row_dst(d, row, status);
        if (o < 0) continue;
        u64 g;
        if (tok) {
            u32 p = udiv(row, d.tokens, d.m_tokens);
            g = ((u64)p * J + udiv(row - p * d.tokens, G, mG)) * D + c;
        } else {
            g = (u64)row * udiv(D, G, mG) + udiv(c, G, mG);
        }
        u32 q = get_bits(body + d.sec2, (u64)e * bits, bits);
        float x = __fadd_rn(__fmul_rn(code_f32(q), ld_f16(body + d.sec0, g)), ld_f16(body + d.sec1, g));
        dst[o + c] = to_out<OUT>(x);
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK) decode_kivi_any_bf16(KIVI_ARGS) { kivi_decode_any<OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_kivi_any_f16(KIVI_ARGS) { kivi_decode_any<OUT_F16>(descs, work, status); }
