// `polar` key pages (format/codecs/polar.md): pair code c = a | rho << m
// (C = m + n bits) per row and pair, an f32 radius scale per (plane, pair),
// and the 2^m-entry direction table (cos_k, sin_k) of the parameter block,
// passed as the side table (float2). Value pages are `int{b}` or `raw`
// pages and use those kernels.
//
// Decode of pair j of row r (plane p), binary32, no fused multiply-add:
//     t = f32(rho) * s_{p,j};   x_{i1} = t * cos_a;   x_{i2} = t * sin_a
// with (i1, i2) = (j, j + D/2) (half pairing) or (2j, 2j + 1) (adjacent).
//
// Descriptor: sec0 = SCALE (f32, planes * D/2), sec1 = INDEX (C-bit codes,
// rows * D/2), p0 = m, p1 = C, side = direction table.
//
// Fast `decode_polar_{half|adj}_c{C}_{out}` (D % 16 == 0, C <= 8; C = 0
// means C is read from p1): a unit is 8 consecutive pairs of a row (C bytes
// of codes, 32 bytes of scales); POLAR_U units per thread (BLOCK apart,
// rows walked without divisions), code loads first. Half
// pairing writes 8 x at j and 8 y at j + D/2 (two 16-byte stores), adjacent
// 16 interleaved values (two 16-byte stores).
// Fallback `decode_polar_any_{out}` (any even D, C <= 16): one pair per unit.

#define POLAR_U 4

// The 2^m directions into shared memory (every thread of the block calls).
__device__ __forceinline__ void polar_load_dirs(float2* dirs, const PageDesc& d) {
    const float2* tab = reinterpret_cast<const float2*>(d.side);
    for (u32 i = threadIdx.x; i < (1u << d.p0); i += blockDim.x) dirs[i] = tab[i];
    __syncthreads();
}

// One chunk of 8 pairs: the codes (angle in the low m bits of each
// cbits-bit code, radius level above), the 8 radius scales (sa, sb) and
// the direction table give x = r cos, y = r sin, stored as adjacent pairs
// (ADJ) or as the two halves of the row (`pairs` elements apart).
template <bool ADJ, int OUT>
__device__ __forceinline__ void polar_chunk(u64 codes, u32 cbits, u32 m, u64 cmask, u32 amask, float4 sa,
                                            float4 sb, const float2* dirs, u16* out, u32 pairs) {
    const float s[8] = {sa.x, sa.y, sa.z, sa.w, sb.x, sb.y, sb.z, sb.w};
    float x[8], y[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        u32 c = (u32)((codes >> (cbits * i)) & cmask);
        float t = __fmul_rn(code_f32(c >> m), s[i]);
        float2 u = dirs[c & amask];
        x[i] = __fmul_rn(t, u.x);
        y[i] = __fmul_rn(t, u.y);
    }
    if (ADJ) {
        st_u4(out, make_uint4(pack2<OUT>(x[0], y[0]), pack2<OUT>(x[1], y[1]), pack2<OUT>(x[2], y[2]),
                              pack2<OUT>(x[3], y[3])));
        st_u4(out + 8, make_uint4(pack2<OUT>(x[4], y[4]), pack2<OUT>(x[5], y[5]), pack2<OUT>(x[6], y[6]),
                                  pack2<OUT>(x[7], y[7])));
    } else {
        st_out8<OUT>(out, x);
        st_out8<OUT>(out + pairs, y);
    }
}

template <int C, bool ADJ, int OUT>
__device__ __forceinline__ void polar_decode(const PageDesc* __restrict__ descs,
                                             const uint2* __restrict__ work, u64* status) {
    __shared__ float2 dirs[256];
    const uint2 w = work[blockIdx.x];
    const PageDesc d = descs[w.x];
    polar_load_dirs(dirs, d);
    const u32 cbits = C ? (u32)C : d.p1;
    const u32 m = d.p0;
    const u32 pairs = d.head_dim >> 1;
    const u32 nunits = d.rows * d.upr;  // units of 8 pairs
    const u8* body = reinterpret_cast<const u8*>(d.body);
    const float* scales = reinterpret_cast<const float*>(body + d.sec0);
    const u8* index = body + d.sec1;
    u16* dst = reinterpret_cast<u16*>(d.dst);
    const u32 drow = walk_step(d.upr);
    RowWalk r;
    walk_init(d, w.y + threadIdx.x, r);
    u64 codes[POLAR_U];
    const float* sp[POLAR_U];
    u16* out[POLAR_U];
#pragma unroll
    for (int k = 0; k < POLAR_U; k++) {
        u32 u = w.y + (u32)k * BLOCK + threadIdx.x;
        if (k > 0) walk_next(d, u, drow, r);
        codes[k] = 0;
        out[k] = nullptr;
        sp[k] = scales;
        if (u < nunits) {
            u32 j0 = 8u * r.j;
            u64 first = (u64)r.row * pairs + j0;  // a multiple of 8
            const u8* p = index + (first >> 3) * cbits;
            if (C == 8) codes[k] = load_le<8>(p);
            else if (C == 6) codes[k] = load_le<6>(p);
            else if (C == 4) codes[k] = load_le<4>(p);
            else {
                u64 v = 0;
                for (u32 b = 0; b < cbits; b++) v |= (u64)__ldg(p + b) << (8 * b);
                codes[k] = v;
            }
            sp[k] = scales + (u64)r.p * pairs + j0;
            i64 o = row_dst_pt(d, r.row, r.p, r.t, status);
            if (o >= 0) out[k] = dst + o + (ADJ ? 2u * j0 : j0);
        }
    }
    const u32 amask = (1u << m) - 1u;
    const u64 cmask = (1ull << cbits) - 1ull;
#pragma unroll
    for (int k = 0; k < POLAR_U; k++) {
        // Radius scales of the unit's 8 pairs (shared by the plane's tokens:
        // L1/L2 hits).
        float4 a = __ldg(reinterpret_cast<const float4*>(sp[k]));
        float4 b = __ldg(reinterpret_cast<const float4*>(sp[k]) + 1);
        if (out[k] != nullptr) polar_chunk<ADJ, OUT>(codes[k], cbits, m, cmask, amask, a, b, dirs, out[k], pairs);
    }
}

#define POLAR_ARGS const PageDesc *descs, const uint2 *work, u64 *status
extern "C" __global__ void __launch_bounds__(BLOCK) decode_polar_half_c4_bf16(POLAR_ARGS) { polar_decode<4, false, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_polar_half_c6_bf16(POLAR_ARGS) { polar_decode<6, false, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_polar_half_c8_bf16(POLAR_ARGS) { polar_decode<8, false, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_polar_half_c0_bf16(POLAR_ARGS) { polar_decode<0, false, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_polar_adj_c4_bf16(POLAR_ARGS) { polar_decode<4, true, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_polar_adj_c6_bf16(POLAR_ARGS) { polar_decode<6, true, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_polar_adj_c8_bf16(POLAR_ARGS) { polar_decode<8, true, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_polar_adj_c0_bf16(POLAR_ARGS) { polar_decode<0, true, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_polar_half_c4_f16(POLAR_ARGS) { polar_decode<4, false, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_polar_half_c6_f16(POLAR_ARGS) { polar_decode<6, false, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_polar_half_c8_f16(POLAR_ARGS) { polar_decode<8, false, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_polar_half_c0_f16(POLAR_ARGS) { polar_decode<0, false, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_polar_adj_c4_f16(POLAR_ARGS) { polar_decode<4, true, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_polar_adj_c6_f16(POLAR_ARGS) { polar_decode<6, true, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_polar_adj_c8_f16(POLAR_ARGS) { polar_decode<8, true, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_polar_adj_c0_f16(POLAR_ARGS) { polar_decode<0, true, OUT_F16>(descs, work, status); }

// Quad kernels `decode_polar_halfq_c{C}_{out}` (rotate_half pairing, D / 16
// a power of two <= 256, C <= 8; see Quad in common.cuh; adjacent pairs use
// the per-unit kernel, which measured faster for them): a thread decodes chunk j
// (pairs j0 = 8j .. j0 + 7) of 4 consecutive rows. The chunk's 8 radius
// scales (per plane and pair) are loaded once for the quad (reloaded for a
// row of another plane), the codes of the 4 rows first.
template <int C, int OUT>
__device__ __forceinline__ void polar_decode_q(const PageDesc* __restrict__ descs,
                                               const uint2* __restrict__ work, u64* status) {
    __shared__ float2 dirs[256];
    const uint2 w = work[blockIdx.x];
    const PageDesc d = descs[w.x];
    polar_load_dirs(dirs, d);
    const u32 lg = __ffs(d.upr) - 1u;
#pragma unroll 1
    for (u32 qi = 0; qi < QUADS; qi++) {
        const u32 r0 = quad_row0(w.y, lg, qi);
        if (r0 >= d.rows) return;
        const Quad q = quad_at(d, r0);
        const u32 cbits = C ? (u32)C : d.p1;
        const u32 m = d.p0;
        const u32 pairs = d.head_dim >> 1;
        const u32 jc = threadIdx.x & (d.upr - 1u), j0 = 8u * jc;
        const u8* body = reinterpret_cast<const u8*>(d.body);
        const float* scales = reinterpret_cast<const float*>(body + d.sec0);
        const u8* index = body + d.sec1;
        u64 codes[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const u32 unit = r0 * d.upr + jc + min((u32)k, q.last) * d.upr;  // 8 pairs
            if (C == 8) codes[k] = load_le<8>(index + unit * 8u);
            else if (C == 4) codes[k] = load_le<4>(index + unit * 4u);
            else if (C == 6) codes[k] = get_bits64(index, (u64)unit * 48u, 48u);
            else codes[k] = get_bits64(index, (u64)unit * (8u * cbits), 8u * cbits);
        }
        // Radius scales of the chunk's 8 pairs in the quad's plane (shared by
        // the plane's tokens: L1/L2 hits).
        const float4* sp = reinterpret_cast<const float4*>(scales + (q.p * pairs + j0));
        float4 sa = __ldg(sp), sb = __ldg(sp + 1);
        u32 sp_plane = q.p;
        u16* out[4];
        quad_dst(d, q, j0, out, status);
        const u32 amask = (1u << m) - 1u;
        const u64 cmask = (1ull << cbits) - 1ull;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            if (out[k] == nullptr) continue;
            if (!q.same) {
                u32 pk, tk;
                quad_pt(d, q, (u32)k, pk, tk);
                if (pk != sp_plane) {
                    sp_plane = pk;
                    const float4* spk = reinterpret_cast<const float4*>(scales + (pk * pairs + j0));
                    sa = __ldg(spk);
                    sb = __ldg(spk + 1);
                }
            }
            polar_chunk<false, OUT>(codes[k], cbits, m, cmask, amask, sa, sb, dirs, out[k], pairs);
        }
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK) decode_polar_halfq_c4_bf16(POLAR_ARGS) { polar_decode_q<4, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_polar_halfq_c6_bf16(POLAR_ARGS) { polar_decode_q<6, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_polar_halfq_c8_bf16(POLAR_ARGS) { polar_decode_q<8, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_polar_halfq_c0_bf16(POLAR_ARGS) { polar_decode_q<0, OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_polar_halfq_c4_f16(POLAR_ARGS) { polar_decode_q<4, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_polar_halfq_c6_f16(POLAR_ARGS) { polar_decode_q<6, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_polar_halfq_c8_f16(POLAR_ARGS) { polar_decode_q<8, OUT_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_polar_halfq_c0_f16(POLAR_ARGS) { polar_decode_q<0, OUT_F16>(descs, work, status); }

// Fallback: one pair per unit (Grid::Units with w = 2), any even head_dim,
// C <= 16; p2 = 1 for the adjacent pairing.
template <int OUT>
__device__ __forceinline__ void polar_decode_any(const PageDesc* __restrict__ descs,
                                                 const uint2* __restrict__ work, u64* status) {
    __shared__ float2 dirs[256];
    const uint2 w = work[blockIdx.x];
    const PageDesc d = descs[w.x];
    polar_load_dirs(dirs, d);
    const u32 m = d.p0, cbits = d.p1;
    const bool adj = d.p2 != 0;
    const u32 pairs = d.upr;  // head_dim / 2
    const u32 nunits = d.rows * pairs;
    const u8* body = reinterpret_cast<const u8*>(d.body);
    const float* scales = reinterpret_cast<const float*>(body + d.sec0);
    const u8* index = body + d.sec1;
    u16* dst = reinterpret_cast<u16*>(d.dst);
    for (int k = 0; k < UNITS_PER_THREAD; k++) {
        u32 u = w.y + (u32)k * BLOCK + threadIdx.x;
        if (u >= nunits) break;
        u32 row = udiv(u, pairs, d.m_upr);
        u32 j = u - row * pairs;
        i64 o = row_dst(d, row, status);
        if (o < 0) continue;
        u32 c = get_bits(index, (u64)u * cbits, cbits);
        u32 pl = udiv(row, d.tokens, d.m_tokens);
        float t = __fmul_rn(code_f32(c >> m), __ldg(scales + (u64)pl * pairs + j));
        float2 dir = dirs[c & ((1u << m) - 1u)];
        u32 i1 = adj ? 2u * j : j, i2 = adj ? 2u * j + 1u : j + pairs;
        dst[o + i1] = to_out<OUT>(__fmul_rn(t, dir.x));
        dst[o + i2] = to_out<OUT>(__fmul_rn(t, dir.y));
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK) decode_polar_any_bf16(POLAR_ARGS) { polar_decode_any<OUT_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_polar_any_f16(POLAR_ARGS) { polar_decode_any<OUT_F16>(descs, work, status); }
