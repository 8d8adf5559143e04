// `hqmq` pages (format/codecs/hqmq.md): per row an f16 radius scale sigma;
// per inlier chunk k (4 elements) the symbol v = h_k * 2^E + l_k with l_k
// the E-bit code of INDEX 0 and h_k the base-O digit t = k mod G of the
// W-bit group g = k / G of INDEX 1 (N_g = sum h_{gG+t} O^t); with +med,
// outlier chunks stored as four f16 values in the OUTLIERS table (list of
// u32 positions or bitmap; inliers are numbered in position order).
//
// Decode, binary32, no fused multiply-add:
//     step_r = f32(sigma_r) / f32(L)          (L = 2^b - 1)
//     j = v >> b, q = v mod 2^b, rh = f32(q) * step_r, x_t = rh * C_{j,t}
//     +chan / +ctr: x_t = x_t * f32(g_{plane, 4c+t});  +ctr: then x_t = x_t + f32(m_{plane, 4c+t})
// with C the joint codebook (24 S quaternions) of the row's (layer, kv head,
// K|V), regenerated on the host (side table).
//
// Side table: u64 O^G at byte 0 (the largest valid group value plus one),
// then at byte 16 the joint codebooks of every kv head, [heads][24 S] float4.
// Descriptor: sec0 = SCALE, sec1 = INDEX 0, sec2 = INDEX 1, sec3 = OUTLIERS
// (0 without), sec4 = SCALE stream 1 (+chan: per plane D gains; +ctr: per
// plane D gains then D offsets; 0 without); p0 = S, p1 = b | E << 8 | G << 16 | W << 24, p2 = O,
// p3 = inlier chunks of the page.
//
// `decode_hqmq_o{3|9|0}_{s|g}[_c|_m]_{out}` (`_c`: +chan, `_m`: +ctr): work item = up to HQ_ITEM rows of
// one plane (one codebook); the block copies the codebook to shared memory
// (`s`; `g` reads it through L1), then walks sub-blocks of up to HQ_ROWS
// rows (at most HQ_NPOS chunks): (1) outlier flags of the sub-block and the
// outliers before it, (2) the digit groups covering its inliers, one group
// per thread: digits (O = 3, 9 at compile time, else at run time) and the
// group's low codes (a bit stream) combined into full symbols in shared
// memory, and each row's step and destination, (3) one chunk per thread
// and step (a symbol, a codebook entry, 8-byte stores; a warp writes 32
// consecutive chunks).
// Digit groups >= O^G, non-zero padding digits and scales that are not
// finite or negative are content errors (status word 1).

#define HQ_NPOS 2048
#define HQ_ROWS 256

__device__ __forceinline__ u32 hq_block_sum(u32 v, u32* red) {
    for (u32 m = 16; m; m >>= 1) v += __shfl_xor_sync(FULL_MASK, v, m);
    if ((threadIdx.x & 31u) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    u32 s = 0;
    for (u32 i = 0; i < BLOCK / 32; i++) s += red[i];
    __syncthreads();
    return s;
}

// The G base-O digits of group value n into dg[0..G) (least significant
// first). O = 3 and 9 (OT) split n once into two values below 2^32 (O^10 =
// 3^20 = 3486784401), so every digit is a 32-bit division by a constant;
// other O (OT = 0) divide 64-bit values.
template <int OT>
__device__ __forceinline__ void hq_digits(u64 n, u32 o, u32 G, u32* dg) {
    if (OT == 3 || OT == 9) {
        const u64 P = 3486784401ull;
        const u32 K = OT == 9 ? 10u : 20u;
        u64 a = n / P;
        u32 lo = (u32)(n - a * P), hi = (u32)a;
        for (u32 t = 0; t < G; t++) {
            if (t < K) {
                dg[t] = lo % (u32)OT;
                lo /= (u32)OT;
            } else {
                dg[t] = hi % (u32)OT;
                hi /= (u32)OT;
            }
        }
    } else {
        for (u32 t = 0; t < G; t++) {
            u64 q = n / o;
            dg[t] = (u32)(n - q * o);
            n = q;
        }
    }
}

// Multiplies a chunk by its channels' gains (format/codecs/hqmq.md,
// decoding with +chan); a gain that is negative, infinite or NaN is a
// content error.
__device__ __forceinline__ void hq_gain(const u16* g, float& x0, float& x1, float& x2, float& x3,
                                        u64* status, u32 page) {
    u16 g0 = __ldg(g), g1 = __ldg(g + 1), g2 = __ldg(g + 2), g3 = __ldg(g + 3);
    if (((g0 | g1 | g2 | g3) & 0x8000u) || (g0 & 0x7c00u) == 0x7c00u || (g1 & 0x7c00u) == 0x7c00u ||
        (g2 & 0x7c00u) == 0x7c00u || (g3 & 0x7c00u) == 0x7c00u)
        content_error(status, page);
    x0 = __fmul_rn(x0, f16_to_f32(g0));
    x1 = __fmul_rn(x1, f16_to_f32(g1));
    x2 = __fmul_rn(x2, f16_to_f32(g2));
    x3 = __fmul_rn(x3, f16_to_f32(g3));
}

// Adds a chunk's channels' offsets (decoding with +ctr, after the gains);
// an offset that is infinite or NaN is a content error.
__device__ __forceinline__ void hq_offset(const u16* m, float& x0, float& x1, float& x2, float& x3,
                                          u64* status, u32 page) {
    u16 m0 = __ldg(m), m1 = __ldg(m + 1), m2 = __ldg(m + 2), m3 = __ldg(m + 3);
    if ((m0 & 0x7c00u) == 0x7c00u || (m1 & 0x7c00u) == 0x7c00u || (m2 & 0x7c00u) == 0x7c00u ||
        (m3 & 0x7c00u) == 0x7c00u)
        content_error(status, page);
    x0 = __fadd_rn(x0, f16_to_f32(m0));
    x1 = __fadd_rn(x1, f16_to_f32(m1));
    x2 = __fadd_rn(x2, f16_to_f32(m2));
    x3 = __fadd_rn(x3, f16_to_f32(m3));
}

// CH: 0 plain, 1 +chan (gains), 2 +ctr (gains, then offsets).
template <int OT, bool SMEM, int OUT, int CH>
__device__ __forceinline__ void hqmq_decode(const PageDesc* __restrict__ descs,
                                            const uint2* __restrict__ work, u64* status) {
    DYN_SHARED(float4, cb_s);
    __shared__ u32 sym[HQ_NPOS + 128];
    __shared__ float steps[HQ_ROWS];
    __shared__ i64 dsto[HQ_ROWS];
    __shared__ u32 obits[HQ_NPOS / 32];
    __shared__ u32 opre[HQ_NPOS / 32];
    __shared__ u32 red[BLOCK / 32];
    __shared__ u32 s_total;
    const uint2 w = work[blockIdx.x];
    const PageDesc d = descs[w.x];
    const u32 tid = threadIdx.x;
    const u32 S = d.p0, b = d.p1 & 0xffu, E = (d.p1 >> 8) & 0xffu, G = (d.p1 >> 16) & 0xffu,
              W = d.p1 >> 24;
    const u32 O = OT ? (u32)OT : d.p2;
    const u32 n_in = d.p3;
    const u32 nc = d.upr;  // head_dim / 4
    const float L = (float)((1u << b) - 1u);
    const u32 plane = udiv(w.y, d.tokens, d.m_tokens);
    const u32 head = plane - udiv(plane, d.heads, d.m_heads) * d.heads;
    const u32 r_end = min(w.y + (u32)HQ_ITEM, (plane + 1u) * d.tokens);
    const u8* side = reinterpret_cast<const u8*>(d.side);
    const u64 limit = *reinterpret_cast<const u64*>(side);
    const float4* cb_g = reinterpret_cast<const float4*>(side + 16) + (u64)head * 24u * S;
    if (SMEM) {
        for (u32 i = tid; i < 24u * S; i += BLOCK) cb_s[i] = __ldg(cb_g + i);
    }
    const float4* cb = SMEM ? cb_s : cb_g;
    const u8* body = reinterpret_cast<const u8*>(d.body);
    const u8* scales = body + d.sec0;
    const u32* idx0 = reinterpret_cast<const u32*>(body + d.sec1);
    const u8* idx1 = body + d.sec2;
    const bool has_out = d.sec3 != 0;
    const u8* tab = body + d.sec3;
    u32 n_out = 0, enc = 0, vals_off = 0;
    if (has_out) {
        n_out = *reinterpret_cast<const u32*>(tab);
        enc = tab[5];
        u32 universe = *reinterpret_cast<const u32*>(tab + 8);
        vals_off = 12u + (enc == 0 ? 4u * n_out : (universe + 7u) / 8u);
    }
    const u32* opos = reinterpret_cast<const u32*>(tab + 12);
    // +chan (the _c kernels): f16 gain per (plane, channel), SCALE stream 1
    // at sec4; +ctr (the _m kernels): per plane the gains, then the
    // offsets. A page without the section is a content error there.
    const bool has_gain = CH != 0;
    if (CH != 0 && d.sec4 == 0) content_error(status, w.x);
    const u16* gains = reinterpret_cast<const u16*>(body + d.sec4) + (u64)plane * (CH == 2 ? 8u : 4u) * nc;
    const u16* offs = gains + 4u * nc;
    const u32 nr_max = min((u32)HQ_ROWS, (u32)HQ_NPOS / nc);
    // Chunk i of a sub-block is row i / nc, chunk i % nc; with nc dividing
    // BLOCK a thread keeps its chunk and advances BLOCK / nc rows per step.
    const bool fixed = (nc & (nc - 1u)) == 0u && nc <= (u32)BLOCK;
    const u32 dr = fixed ? (u32)BLOCK / nc : 0u;
    const u32 qmask = (1u << b) - 1u, lmask = (1u << E) - 1u;
    u16* dst = reinterpret_cast<u16*>(d.dst);
    for (u32 ra = w.y; ra < r_end; ra += nr_max) {
        const u32 nr = min(nr_max, r_end - ra);
        const u32 npos = nr * nc;
        const u64 u0 = (u64)ra * nc;
        // (1) Outliers: o0 before the sub-block, flags and prefix counts.
        u32 o0 = 0, nout = 0;
        if (has_out) {
            for (u32 i = tid; i < HQ_NPOS / 32; i += BLOCK) obits[i] = 0;
            __syncthreads();
            u32 before = 0;
            if (enc == 0) {
                for (u32 i = tid; i < n_out; i += BLOCK) {
                    u32 p = __ldg(opos + i);
                    if (p < u0) before++;
                    else if (p < u0 + npos) atomicOr(&obits[(p - (u32)u0) >> 5], 1u << ((p - (u32)u0) & 31u));
                }
            } else {
                const u32 full = (u32)(u0 >> 5);
                for (u32 i = tid; i < full; i += BLOCK) before += __popc(__ldg(opos + i));
                if (tid == 0 && (u0 & 31u)) before += __popc(get_bits(tab + 12, (u64)full * 32u, (u32)(u0 & 31u)));
                for (u32 i = tid; i < (npos + 31u) / 32u; i += BLOCK)
                    obits[i] = get_bits(tab + 12, u0 + 32u * i, min(32u, npos - 32u * i));
            }
            o0 = hq_block_sum(before, red);  // synchronizes: obits complete
            if (tid < 32) {
                u32 c0 = __popc(obits[2 * tid]), c1 = __popc(obits[2 * tid + 1]);
                u32 incl = c0 + c1;
                for (u32 m = 1; m < 32; m <<= 1) {
                    u32 t = __shfl_up_sync(FULL_MASK, incl, m);
                    if (tid >= m) incl += t;
                }
                u32 excl = incl - c0 - c1;
                opre[2 * tid] = excl;
                opre[2 * tid + 1] = excl + c0;
                if (tid == 31) s_total = incl;
            }
            __syncthreads();
            nout = s_total;
        }
        // (2) The symbols of inliers [k0, k1) (whole digit groups), each
        // row's step and destination.
        const u32 k0 = (u32)u0 - o0, k1 = k0 + npos - nout;
        const u32 gf = k0 / G;
        const u32 ng = k1 > k0 ? (k1 - 1u) / G - gf + 1u : 0u;
        for (u32 gi = tid; gi < ng; gi += BLOCK) {
            u32 g = gf + gi;
            u64 n = get_bits64(idx1, (u64)g * W, W);
            if (limit != 0 && n >= limit) content_error(status, w.x);
            u32* sg = sym + gi * G;
            hq_digits<OT>(n, O, G, sg);
            // Low codes of the group's inliers, read as a bit stream.
            u32 kend = min(g * G + G, n_in);
            for (u32 t = g * G + G; t > kend; t--) {
                if (sg[t - 1u - g * G] != 0) content_error(status, w.x);  // padding digit
            }
            u64 bit = (u64)g * G * E;
            const u32* wp = idx0 + (bit >> 5);
            u32 have = 32u - ((u32)bit & 31u);
            u64 buf = kend > g * G ? (u64)(__ldg(wp) >> ((u32)bit & 31u)) : 0ull;
            for (u32 k = g * G; k < kend; k++) {
                if (have < E) {
                    buf |= (u64)__ldg(++wp) << have;
                    have += 32u;
                }
                u32 t = k - g * G;
                sg[t] = (sg[t] << E) | ((u32)buf & lmask);
                buf >>= E;
                have -= E;
            }
        }
        for (u32 rl = tid; rl < nr; rl += BLOCK) {
            u32 sb = __ldg(reinterpret_cast<const u16*>(scales) + ra + rl);
            if ((sb & 0x7c00u) == 0x7c00u || (sb & 0x8000u)) content_error(status, w.x);
            steps[rl] = __fdiv_rn(f16_to_f32((u16)sb), L);
            dsto[rl] = row_dst(d, ra + rl, status);
        }
        __syncthreads();
        // (3) One chunk per thread and step.
        const u32 sbase = k0 - gf * G;  // symbol of inlier k at sym[k - gf * G]
        u32 rl = fixed ? tid / nc : 0u, c = fixed ? tid - rl * nc : 0u;
        if (!has_out) {
            for (u32 i = tid; i < npos; i += BLOCK) {
                if (!fixed) {
                    rl = udiv(i, nc, d.m_upr);
                    c = i - rl * nc;
                }
                u32 v = sym[sbase + i];
                float rh = __fmul_rn(code_f32(v & qmask), steps[rl]);
                float4 cw = cb[v >> b];
                float x0 = __fmul_rn(rh, cw.x), x1 = __fmul_rn(rh, cw.y), x2 = __fmul_rn(rh, cw.z),
                      x3 = __fmul_rn(rh, cw.w);
                if (has_gain) hq_gain(gains + 4u * c, x0, x1, x2, x3, status, w.x);
                if (CH == 2) hq_offset(offs + 4u * c, x0, x1, x2, x3, status, w.x);
                i64 o = dsto[rl];
                if (o >= 0) st_u2(dst + o + 4u * c, make_uint2(pack2<OUT>(x0, x1), pack2<OUT>(x2, x3)));
                rl += dr;
            }
        } else {
            for (u32 i = tid; i < npos; i += BLOCK) {
                if (!fixed) {
                    rl = udiv(i, nc, d.m_upr);
                    c = i - rl * nc;
                }
                float x0, x1, x2, x3;
                u32 wb = obits[i >> 5];
                u32 before = opre[i >> 5] + __popc(wb & ((1u << (i & 31u)) - 1u));
                if ((wb >> (i & 31u)) & 1u) {
                    const u8* vp = tab + vals_off + 8u * (o0 + before);
                    u32 lo = (u32)vp[0] | ((u32)vp[1] << 8) | ((u32)vp[2] << 16) | ((u32)vp[3] << 24);
                    u32 hi = (u32)vp[4] | ((u32)vp[5] << 8) | ((u32)vp[6] << 16) | ((u32)vp[7] << 24);
                    x0 = f16_to_f32((u16)(lo & 0xffffu));
                    x1 = f16_to_f32((u16)(lo >> 16));
                    x2 = f16_to_f32((u16)(hi & 0xffffu));
                    x3 = f16_to_f32((u16)(hi >> 16));
                } else {
                    u32 v = sym[sbase + i - before];
                    float rh = __fmul_rn(code_f32(v & qmask), steps[rl]);
                    float4 cw = cb[v >> b];
                    x0 = __fmul_rn(rh, cw.x);
                    x1 = __fmul_rn(rh, cw.y);
                    x2 = __fmul_rn(rh, cw.z);
                    x3 = __fmul_rn(rh, cw.w);
                }
                if (has_gain) hq_gain(gains + 4u * c, x0, x1, x2, x3, status, w.x);
                if (CH == 2) hq_offset(offs + 4u * c, x0, x1, x2, x3, status, w.x);
                i64 o = dsto[rl];
                if (o >= 0) st_u2(dst + o + 4u * c, make_uint2(pack2<OUT>(x0, x1), pack2<OUT>(x2, x3)));
                rl += dr;
            }
        }
        __syncthreads();
    }
}

#define HQMQ_ARGS const PageDesc *descs, const uint2 *work, u64 *status
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o3_s_bf16(HQMQ_ARGS) { hqmq_decode<3, true, OUT_BF16, 0>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o3_s_c_bf16(HQMQ_ARGS) { hqmq_decode<3, true, OUT_BF16, 1>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o3_s_m_bf16(HQMQ_ARGS) { hqmq_decode<3, true, OUT_BF16, 2>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o3_g_bf16(HQMQ_ARGS) { hqmq_decode<3, false, OUT_BF16, 0>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o3_g_c_bf16(HQMQ_ARGS) { hqmq_decode<3, false, OUT_BF16, 1>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o3_g_m_bf16(HQMQ_ARGS) { hqmq_decode<3, false, OUT_BF16, 2>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o9_s_bf16(HQMQ_ARGS) { hqmq_decode<9, true, OUT_BF16, 0>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o9_s_c_bf16(HQMQ_ARGS) { hqmq_decode<9, true, OUT_BF16, 1>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o9_s_m_bf16(HQMQ_ARGS) { hqmq_decode<9, true, OUT_BF16, 2>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o9_g_bf16(HQMQ_ARGS) { hqmq_decode<9, false, OUT_BF16, 0>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o9_g_c_bf16(HQMQ_ARGS) { hqmq_decode<9, false, OUT_BF16, 1>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o9_g_m_bf16(HQMQ_ARGS) { hqmq_decode<9, false, OUT_BF16, 2>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o0_s_bf16(HQMQ_ARGS) { hqmq_decode<0, true, OUT_BF16, 0>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o0_s_c_bf16(HQMQ_ARGS) { hqmq_decode<0, true, OUT_BF16, 1>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o0_s_m_bf16(HQMQ_ARGS) { hqmq_decode<0, true, OUT_BF16, 2>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o0_g_bf16(HQMQ_ARGS) { hqmq_decode<0, false, OUT_BF16, 0>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o0_g_c_bf16(HQMQ_ARGS) { hqmq_decode<0, false, OUT_BF16, 1>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o0_g_m_bf16(HQMQ_ARGS) { hqmq_decode<0, false, OUT_BF16, 2>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o3_s_f16(HQMQ_ARGS) { hqmq_decode<3, true, OUT_F16, 0>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o3_s_c_f16(HQMQ_ARGS) { hqmq_decode<3, true, OUT_F16, 1>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o3_s_m_f16(HQMQ_ARGS) { hqmq_decode<3, true, OUT_F16, 2>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o3_g_f16(HQMQ_ARGS) { hqmq_decode<3, false, OUT_F16, 0>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o3_g_c_f16(HQMQ_ARGS) { hqmq_decode<3, false, OUT_F16, 1>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o3_g_m_f16(HQMQ_ARGS) { hqmq_decode<3, false, OUT_F16, 2>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o9_s_f16(HQMQ_ARGS) { hqmq_decode<9, true, OUT_F16, 0>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o9_s_c_f16(HQMQ_ARGS) { hqmq_decode<9, true, OUT_F16, 1>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o9_s_m_f16(HQMQ_ARGS) { hqmq_decode<9, true, OUT_F16, 2>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o9_g_f16(HQMQ_ARGS) { hqmq_decode<9, false, OUT_F16, 0>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o9_g_c_f16(HQMQ_ARGS) { hqmq_decode<9, false, OUT_F16, 1>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o9_g_m_f16(HQMQ_ARGS) { hqmq_decode<9, false, OUT_F16, 2>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o0_s_f16(HQMQ_ARGS) { hqmq_decode<0, true, OUT_F16, 0>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o0_s_c_f16(HQMQ_ARGS) { hqmq_decode<0, true, OUT_F16, 1>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o0_s_m_f16(HQMQ_ARGS) { hqmq_decode<0, true, OUT_F16, 2>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o0_g_f16(HQMQ_ARGS) { hqmq_decode<0, false, OUT_F16, 0>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o0_g_c_f16(HQMQ_ARGS) { hqmq_decode<0, false, OUT_F16, 1>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_hqmq_o0_g_m_f16(HQMQ_ARGS) { hqmq_decode<0, false, OUT_F16, 2>(descs, work, status); }
