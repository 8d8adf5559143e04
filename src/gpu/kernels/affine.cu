// `int{b}` and `bdr{h}` pages (format/codecs/int.md, format/codecs/bdr.md):
// one f32 scale and zero point per row (head vector), b-bit codes, and for
// bdr a block-diagonal Walsh-Hadamard rotation with blocks of h channels.
//
// Decode, per row r and element i (binary32, no fused multiply-add):
//     s' = s_r * c_h            (c_h = 1 without rotation)
//     y_i = (f32(q_ri) - z_r) * s'
//     x = fwht(y, h)             (butterflies, strides 1, 2, 4, ... in order)
//
// Fast decode `decode_affine_b{B}_{out}`: head_dim % 8 == 0 and h <= 256.
// A unit is 8 consecutive elements of a row: B bytes of codes, one 16-byte
// store. Rotation stages of stride 1..4 run in registers, strides 8..h/2
// across lanes with xor shuffles (the h/8 lanes of a block are consecutive
// and aligned in the warp because head_dim is a multiple of h).
// Work item (x, y) = (page descriptor, first unit); `h` = 0 or 1 means no
// rotation.
//
// Fallback decode `decode_affine_any_{out}`: any head_dim <= 1024, any h:
// one block per segment (h elements of one row, or the whole row without
// rotation), the butterflies in shared memory. Work item = (page, segment).
//
// Encode, per row (format/codecs/int.md "Encoding"):
//     u = fwht(x, h); u_i = u_i * c_h                 (bdr only)
//     mn, mx = min, max; s = (mx - mn) / L, L = 2^b - 1
//     s < 2^-126 or inf: s = 1, z = 0 - mn   else z = 0 - (mn / s)
//     q_i = rne(clamp(u_i * (1 / s) + z, 0, L))
// Fast encode `encode_affine_b{B}_{src}`: head_dim / 8 a power of two <= 32,
// h <= 256; the row's min/max reduced with xor shuffles over its lanes.
// Fallback encode `encode_affine_any_{src}`: one block per row, codes OR-ed
// into the (zeroed) INDEX section with atomics since rows need not start on
// a byte boundary.
//
// Rows holding NaN or infinity cannot be encoded: the first such (page, row)
// is reported through `status` (atomicMin of page << 32 | row).

#define MIN_NORMAL 1.17549435e-38f
#define RNE_MAGIC 12582912.0f

// B bytes of codes (8 codes of B bits, LSB-first) at p, as one integer.
template <int B>
__device__ __forceinline__ u64 load_codes(const u8* p) {
    if (B == 8) return *reinterpret_cast<const u64*>(p);
    if (B == 4) return *reinterpret_cast<const u32*>(p);
    if (B == 2) return *reinterpret_cast<const u16*>(p);
    u64 v = 0;
#pragma unroll
    for (int i = 0; i < B; i++) v |= ((u64)p[i]) << (8 * i);
    return v;
}

template <int B>
__device__ __forceinline__ void store_codes(u8* p, u64 v) {
    if (B == 8) { *reinterpret_cast<u64*>(p) = v; return; }
    if (B == 4) { *reinterpret_cast<u32*>(p) = (u32)v; return; }
    if (B == 2) { *reinterpret_cast<u16*>(p) = (u16)v; return; }
#pragma unroll
    for (int i = 0; i < B; i++) p[i] = (u8)(v >> (8 * i));
}

template <int B, int OUT>
__device__ __forceinline__ void affine_decode_fast(const PageDesc* __restrict__ descs,
                                                   const uint2* __restrict__ work, u32 h, float c,
                                                   u64* status) {
    const uint2 w = work[blockIdx.x];
    const PageDesc d = descs[w.x];
    const u32 upr = d.head_dim >> 3;
    const u32 nunits = d.rows * upr;
    const u8* body = reinterpret_cast<const u8*>(d.body);
    const float* scales = reinterpret_cast<const float*>(body + d.sec0);
    const float* zeros = reinterpret_cast<const float*>(body + d.sec1);
    const u8* index = body + d.sec2;
    u16* dst = reinterpret_cast<u16*>(d.dst);

    u64 codes[UNITS_PER_THREAD];
    float sc[UNITS_PER_THREAD], zp[UNITS_PER_THREAD];
#pragma unroll
    for (int k = 0; k < UNITS_PER_THREAD; k++) {
        u32 u = w.y + (u32)k * BLOCK + threadIdx.x;
        codes[k] = 0;
        sc[k] = 0.f;
        zp[k] = 0.f;
        if (u < nunits) {
            u32 row = u / upr;
            codes[k] = load_codes<B>(index + (u64)u * B);
            sc[k] = scales[row];
            zp[k] = zeros[row];
        }
    }
#pragma unroll
    for (int k = 0; k < UNITS_PER_THREAD; k++) {
        u32 u = w.y + (u32)k * BLOCK + threadIdx.x;
        float sp = __fmul_rn(sc[k], c);
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            u32 q = (u32)(codes[k] >> (B * i)) & ((1u << B) - 1u);
            v[i] = __fmul_rn(__fsub_rn((float)q, zp[k]), sp);
        }
        if (h > 1) wht8(v, h);  // uniform over the launch: every lane shuffles
        if (u < nunits) {
            u32 row = u / upr;
            u32 j = u - row * upr;
            i64 o = row_dst(d, row, status);
            if (o >= 0) store8<OUT>(dst + o + 8 * j, v);
        }
    }
}

#define DEC_ARGS const PageDesc *descs, const uint2 *work, u32 h, float c, u64 *status
#define DEC_PASS descs, work, h, c, status
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_b1_bf16(DEC_ARGS) { affine_decode_fast<1, OUT_BF16>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_b1_f16(DEC_ARGS) { affine_decode_fast<1, OUT_F16>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_b2_bf16(DEC_ARGS) { affine_decode_fast<2, OUT_BF16>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_b2_f16(DEC_ARGS) { affine_decode_fast<2, OUT_F16>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_b3_bf16(DEC_ARGS) { affine_decode_fast<3, OUT_BF16>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_b3_f16(DEC_ARGS) { affine_decode_fast<3, OUT_F16>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_b4_bf16(DEC_ARGS) { affine_decode_fast<4, OUT_BF16>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_b4_f16(DEC_ARGS) { affine_decode_fast<4, OUT_F16>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_b5_bf16(DEC_ARGS) { affine_decode_fast<5, OUT_BF16>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_b5_f16(DEC_ARGS) { affine_decode_fast<5, OUT_F16>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_b6_bf16(DEC_ARGS) { affine_decode_fast<6, OUT_BF16>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_b6_f16(DEC_ARGS) { affine_decode_fast<6, OUT_F16>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_b7_bf16(DEC_ARGS) { affine_decode_fast<7, OUT_BF16>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_b7_f16(DEC_ARGS) { affine_decode_fast<7, OUT_F16>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_b8_bf16(DEC_ARGS) { affine_decode_fast<8, OUT_BF16>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_b8_f16(DEC_ARGS) { affine_decode_fast<8, OUT_F16>(DEC_PASS); }

// Fallback decode: one block per segment of `seg` elements (seg = h with a
// rotation, else head_dim), seg <= SEG_MAX.
template <int OUT>
__device__ __forceinline__ void affine_decode_any(const PageDesc* __restrict__ descs,
                                                  const uint2* __restrict__ work, u32 bits,
                                                  u32 h, float c, u64* status) {
    __shared__ float buf[SEG_MAX];
    const uint2 w = work[blockIdx.x];
    const PageDesc d = descs[w.x];
    const u32 D = d.head_dim;
    const u32 seg = h > 1 ? h : D;
    const u32 spr = D / seg;
    const u32 row = w.y / spr;
    const u32 base = (w.y - row * spr) * seg;
    const u8* body = reinterpret_cast<const u8*>(d.body);
    const float sp = __fmul_rn(reinterpret_cast<const float*>(body + d.sec0)[row], c);
    const float z = reinterpret_cast<const float*>(body + d.sec1)[row];
    const u8* index = body + d.sec2;
    for (u32 i = threadIdx.x; i < seg; i += blockDim.x) {
        u32 q = get_code(index, (u64)row * D + base + i, bits);
        buf[i] = __fmul_rn(__fsub_rn((float)q, z), sp);
    }
    __syncthreads();
    if (h > 1) wht_shared(buf, seg, h);
    i64 o = row_dst(d, row, status);
    if (o < 0) return;
    u16* dst = reinterpret_cast<u16*>(d.dst) + o + base;
    for (u32 i = threadIdx.x; i < seg; i += blockDim.x) dst[i] = to_out<OUT>(buf[i]);
}

extern "C" __global__ void __launch_bounds__(SEG_BLOCK) decode_affine_any_bf16(
    const PageDesc* descs, const uint2* work, u32 bits, u32 h, float c, u64* status) {
    affine_decode_any<OUT_BF16>(descs, work, bits, h, c, status);
}
extern "C" __global__ void __launch_bounds__(SEG_BLOCK) decode_affine_any_f16(
    const PageDesc* descs, const uint2* work, u32 bits, u32 h, float c, u64* status) {
    affine_decode_any<OUT_F16>(descs, work, bits, h, c, status);
}

// ---------------------------------------------------------------- encode

template <int SRC>
__device__ __forceinline__ float load_src(const u8* base, u64 i) {
    if (SRC == SRC_F32) return reinterpret_cast<const float*>(base)[i];
    u16 h = reinterpret_cast<const u16*>(base)[i];
    return SRC == SRC_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

template <int SRC>
__device__ __forceinline__ void load_src8(const u8* p, float v[8]) {
    if (SRC == SRC_F32) {
        float4 a = reinterpret_cast<const float4*>(p)[0];
        float4 b = reinterpret_cast<const float4*>(p)[1];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
        uint4 a = *reinterpret_cast<const uint4*>(p);
        u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u16 lo = (u16)(w[i] & 0xffffu), hi = (u16)(w[i] >> 16);
            v[2 * i] = SRC == SRC_BF16 ? bf16_to_f32(lo) : f16_to_f32(lo);
            v[2 * i + 1] = SRC == SRC_BF16 ? bf16_to_f32(hi) : f16_to_f32(hi);
        }
    }
}

// Row parameters from the row's min and max (kernels::affine::params).
__device__ __forceinline__ void row_params(float mn, float mx, u32 levels, float* scale,
                                           float* zero, float* inv) {
    float s = __fdiv_rn(__fsub_rn(mx, mn), (float)levels);
    if (s < MIN_NORMAL || !is_finite(s)) {
        *scale = 1.0f;
        *zero = __fsub_rn(0.0f, mn);
    } else {
        *scale = s;
        *zero = __fsub_rn(0.0f, __fdiv_rn(mn, s));
    }
    *inv = __fdiv_rn(1.0f, *scale);
}

__device__ __forceinline__ u32 quantize(float x, float inv, float zero, float levels) {
    float t = __fadd_rn(__fmul_rn(x, inv), zero);
    t = t < 0.0f ? 0.0f : t;
    t = t > levels ? levels : t;
    return (u32)__fsub_rn(__fadd_rn(t, RNE_MAGIC), RNE_MAGIC);
}

template <int B, int SRC>
__device__ __forceinline__ void affine_encode_fast(const EncDesc* __restrict__ descs,
                                                   const uint2* __restrict__ work, u32 h, float c,
                                                   u64* status) {
    const uint2 w = work[blockIdx.x];
    const EncDesc d = descs[w.x];
    const u32 upr = d.head_dim >> 3;  // a power of two <= 32
    const u32 nunits = d.rows * upr;
    const u32 esize = SRC == SRC_F32 ? 4u : 2u;
    const u8* src = reinterpret_cast<const u8*>(d.src);
    u8* body = reinterpret_cast<u8*>(d.body);
    const u32 levels = (1u << B) - 1u;

    float v[UNITS_PER_THREAD][8];
#pragma unroll
    for (int k = 0; k < UNITS_PER_THREAD; k++) {
        u32 u = w.y + (u32)k * BLOCK + threadIdx.x;
        if (u < nunits) {
            u32 row = u / upr;
            u32 j = u - row * upr;
            u32 p = row / d.tokens;
            u32 t = row - p * d.tokens;
            u64 e = (u64)p * d.stride + (u64)t * d.head_dim + 8u * j;
            load_src8<SRC>(src + e * esize, v[k]);
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) v[k][i] = 0.0f;
        }
    }
#pragma unroll
    for (int k = 0; k < UNITS_PER_THREAD; k++) {
        u32 u = w.y + (u32)k * BLOCK + threadIdx.x;
        bool live = u < nunits;
        if (h > 1) {
            wht8(v[k], h);
#pragma unroll
            for (int i = 0; i < 8; i++) v[k][i] = __fmul_rn(v[k][i], c);
        }
        float mn = __int_as_float(0x7f800000);   // +inf
        float mx = __int_as_float(0xff800000);   // -inf
        bool bad = false;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float x = v[k][i];
            mn = x < mn ? x : mn;
            mx = x > mx ? x : mx;
            bad |= !is_finite(x);
        }
        if (!live) {
            mn = __int_as_float(0x7f800000);
            mx = __int_as_float(0xff800000);
            bad = false;
        }
        for (u32 m = 1; m < upr; m <<= 1) {
            float omn = __shfl_xor_sync(FULL_MASK, mn, m);
            float omx = __shfl_xor_sync(FULL_MASK, mx, m);
            int obad = __shfl_xor_sync(FULL_MASK, (int)bad, m);
            mn = omn < mn ? omn : mn;
            mx = omx > mx ? omx : mx;
            bad |= obad != 0;
        }
        if (!live) continue;
        u32 row = u / upr;
        u32 j = u - row * upr;
        if (bad) {
            if (j == 0) atomicMin(status, ((u64)d.page << 32) | row);
            continue;
        }
        float scale, zero, inv;
        row_params(mn, mx, levels, &scale, &zero, &inv);
        u64 packed = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            packed |= ((u64)quantize(v[k][i], inv, zero, (float)levels)) << (B * i);
        }
        store_codes<B>(body + d.sec_index + (u64)u * B, packed);
        if (j == 0) {
            reinterpret_cast<float*>(body + d.sec_scale)[row] = scale;
            reinterpret_cast<float*>(body + d.sec_zero)[row] = zero;
        }
    }
}

#define ENC_ARGS const EncDesc *descs, const uint2 *work, u32 h, float c, u64 *status
#define ENC_PASS descs, work, h, c, status
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b1_bf16(ENC_ARGS) { affine_encode_fast<1, SRC_BF16>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b1_f16(ENC_ARGS) { affine_encode_fast<1, SRC_F16>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b1_f32(ENC_ARGS) { affine_encode_fast<1, SRC_F32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b2_bf16(ENC_ARGS) { affine_encode_fast<2, SRC_BF16>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b2_f16(ENC_ARGS) { affine_encode_fast<2, SRC_F16>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b2_f32(ENC_ARGS) { affine_encode_fast<2, SRC_F32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b3_bf16(ENC_ARGS) { affine_encode_fast<3, SRC_BF16>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b3_f16(ENC_ARGS) { affine_encode_fast<3, SRC_F16>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b3_f32(ENC_ARGS) { affine_encode_fast<3, SRC_F32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b4_bf16(ENC_ARGS) { affine_encode_fast<4, SRC_BF16>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b4_f16(ENC_ARGS) { affine_encode_fast<4, SRC_F16>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b4_f32(ENC_ARGS) { affine_encode_fast<4, SRC_F32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b5_bf16(ENC_ARGS) { affine_encode_fast<5, SRC_BF16>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b5_f16(ENC_ARGS) { affine_encode_fast<5, SRC_F16>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b5_f32(ENC_ARGS) { affine_encode_fast<5, SRC_F32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b6_bf16(ENC_ARGS) { affine_encode_fast<6, SRC_BF16>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b6_f16(ENC_ARGS) { affine_encode_fast<6, SRC_F16>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b6_f32(ENC_ARGS) { affine_encode_fast<6, SRC_F32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b7_bf16(ENC_ARGS) { affine_encode_fast<7, SRC_BF16>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b7_f16(ENC_ARGS) { affine_encode_fast<7, SRC_F16>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b7_f32(ENC_ARGS) { affine_encode_fast<7, SRC_F32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b8_bf16(ENC_ARGS) { affine_encode_fast<8, SRC_BF16>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b8_f16(ENC_ARGS) { affine_encode_fast<8, SRC_F16>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b8_f32(ENC_ARGS) { affine_encode_fast<8, SRC_F32>(ENC_PASS); }

// Min/max/non-finite of a block (SEG_BLOCK threads), broadcast to all.
__device__ __forceinline__ void block_minmax(float* mn, float* mx, bool* bad) {
    __shared__ float smn[SEG_BLOCK / 32], smx[SEG_BLOCK / 32];
    __shared__ int sbad[SEG_BLOCK / 32];
    float a = *mn, b = *mx;
    int f = *bad ? 1 : 0;
    for (u32 m = 1; m < 32; m <<= 1) {
        float oa = __shfl_xor_sync(FULL_MASK, a, m);
        float ob = __shfl_xor_sync(FULL_MASK, b, m);
        int of = __shfl_xor_sync(FULL_MASK, f, m);
        a = oa < a ? oa : a;
        b = ob > b ? ob : b;
        f |= of;
    }
    u32 warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31u) == 0) {
        smn[warp] = a;
        smx[warp] = b;
        sbad[warp] = f;
    }
    __syncthreads();
    a = smn[0];
    b = smx[0];
    f = sbad[0];
    for (u32 i = 1; i < blockDim.x / 32; i++) {
        a = smn[i] < a ? smn[i] : a;
        b = smx[i] > b ? smx[i] : b;
        f |= sbad[i];
    }
    *mn = a;
    *mx = b;
    *bad = f != 0;
}

// Fallback encode: one block (SEG_BLOCK threads) per row, head_dim <= SEG_MAX.
template <int SRC>
__device__ __forceinline__ void affine_encode_any(const EncDesc* __restrict__ descs,
                                                  const uint2* __restrict__ work, u32 bits,
                                                  u32 h, float c, u64* status) {
    __shared__ float buf[SEG_MAX];
    const uint2 w = work[blockIdx.x];
    const EncDesc d = descs[w.x];
    const u32 D = d.head_dim;
    const u32 row = w.y;
    const u32 p = row / d.tokens;
    const u32 t = row - p * d.tokens;
    const u8* src = reinterpret_cast<const u8*>(d.src);
    const u64 e0 = (u64)p * d.stride + (u64)t * D;
    for (u32 i = threadIdx.x; i < D; i += blockDim.x) buf[i] = load_src<SRC>(src, e0 + i);
    __syncthreads();
    if (h > 1) {
        wht_shared(buf, D, h);
        for (u32 i = threadIdx.x; i < D; i += blockDim.x) buf[i] = __fmul_rn(buf[i], c);
        __syncthreads();
    }
    float mn = __int_as_float(0x7f800000), mx = __int_as_float(0xff800000);
    bool bad = false;
    for (u32 i = threadIdx.x; i < D; i += blockDim.x) {
        float x = buf[i];
        mn = x < mn ? x : mn;
        mx = x > mx ? x : mx;
        bad |= !is_finite(x);
    }
    block_minmax(&mn, &mx, &bad);
    if (bad) {
        if (threadIdx.x == 0) atomicMin(status, ((u64)d.page << 32) | row);
        return;
    }
    const u32 levels = (1u << bits) - 1u;
    float scale, zero, inv;
    row_params(mn, mx, levels, &scale, &zero, &inv);
    u8* body = reinterpret_cast<u8*>(d.body);
    u32* words = reinterpret_cast<u32*>(body + d.sec_index);
    for (u32 i = threadIdx.x; i < D; i += blockDim.x) {
        u32 q = quantize(buf[i], inv, zero, (float)levels);
        u64 bit = ((u64)row * D + i) * bits;
        u32 sh = (u32)(bit & 31u);
        u64 word = bit >> 5;
        if (q != 0) {
            atomicOr(words + word, q << sh);
            if (sh + bits > 32u) atomicOr(words + word + 1, q >> (32u - sh));
        }
    }
    if (threadIdx.x == 0) {
        reinterpret_cast<float*>(body + d.sec_scale)[row] = scale;
        reinterpret_cast<float*>(body + d.sec_zero)[row] = zero;
    }
}

#define ENC_ANY_ARGS const EncDesc *descs, const uint2 *work, u32 bits, u32 h, float c, u64 *status
#define ENC_ANY_PASS descs, work, bits, h, c, status
extern "C" __global__ void __launch_bounds__(SEG_BLOCK) encode_affine_any_bf16(ENC_ANY_ARGS) { affine_encode_any<SRC_BF16>(ENC_ANY_PASS); }
extern "C" __global__ void __launch_bounds__(SEG_BLOCK) encode_affine_any_f16(ENC_ANY_ARGS) { affine_encode_any<SRC_F16>(ENC_ANY_PASS); }
extern "C" __global__ void __launch_bounds__(SEG_BLOCK) encode_affine_any_f32(ENC_ANY_ARGS) { affine_encode_any<SRC_F32>(ENC_ANY_PASS); }
