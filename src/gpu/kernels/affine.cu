// `int{b}` and `bdr{h}` pages (format/codecs/int.md, format/codecs/bdr.md):
// one f32 scale and zero point per row (head vector), b-bit codes, and for
// bdr a block-diagonal Walsh-Hadamard rotation with blocks of h channels.
//
// Decode, per row r and element i (binary32, no fused multiply-add):
//     s' = s_r * c_h            (c_h = 1 without rotation)
//     y_i = (f32(q_ri) - z_r) * s'
//     x = fwht(y, h)             (butterflies, strides 1, 2, 4, ... in order)
//
// Fast decode `decode_affine_b{B}_{out}` (head_dim / 32 a power of two,
// any h): a unit is 32 elements of a row held as four chunks of 8 at stride
// 8 * lpr (lpr = head_dim / 32 lanes per row), so every 16-byte store
// instruction of a warp writes whole sectors; butterflies inside chunks and
// across chunks run in registers, the others across lanes with xor
// shuffles; `decode_affine_rowrot_b{B}_{out}` is the same for h ==
// head_dim with every stage unconditional. `decode_affine_w8_b{B}_{out}` (head_dim % 8 == 0, h <= 256,
// the other shapes): a unit is 8 consecutive elements, strides 8..h/2
// across lanes (the h/8 lanes of a block are consecutive and aligned in the
// warp because head_dim is a multiple of h). Work item (x, y) = (page
// descriptor, first unit); `h` = 0 or 1 means no rotation.
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
// Fast encode `encode_affine_b{B}_{src}` (head_dim / 32 a power of two <=
// 32, any h) and `encode_affine_w8_b{B}_{src}` (head_dim / 8 a power of two
// <= 32, h <= 256); the row's min/max reduced with xor shuffles over its
// lanes.
// Fallback encode `encode_affine_any_{src}`: one block per row, codes OR-ed
// into the (zeroed) INDEX section with atomics since rows need not start on
// a byte boundary.
//
// Rows holding NaN or infinity cannot be encoded: the first such (page, row)
// is reported through `status` (atomicMin of page << 32 | row).

#define MIN_NORMAL 1.17549435e-38f
#define RNE_MAGIC 12582912.0f

// The codes of one unit: W codes of B bits, LSB-first, as 32-bit words.
template <int B, int W>
struct Codes {
    static const int WORDS = (W * B + 31) / 32;
    u32 w[WORDS];

    __device__ __forceinline__ void load(const u8* p) {
        if (W == 32) {  // 4B bytes, 4B-aligned (16B-aligned when B % 4 == 0)
            if (B % 4 == 0) {
#pragma unroll
                for (int i = 0; i < B / 4; i++) {
                    uint4 x = __ldg(reinterpret_cast<const uint4*>(p) + i);
                    w[4 * i] = x.x; w[4 * i + 1] = x.y; w[4 * i + 2] = x.z; w[4 * i + 3] = x.w;
                }
            } else if (B % 2 == 0) {
#pragma unroll
                for (int i = 0; i < B / 2; i++) {
                    uint2 x = __ldg(reinterpret_cast<const uint2*>(p) + i);
                    w[2 * i] = x.x; w[2 * i + 1] = x.y;
                }
            } else {
#pragma unroll
                for (int i = 0; i < B; i++) w[i] = __ldg(reinterpret_cast<const u32*>(p) + i);
            }
        } else {  // W == 8: B bytes, B-aligned
            u64 v;
            if (B == 8) v = *reinterpret_cast<const u64*>(p);
            else if (B == 4) v = *reinterpret_cast<const u32*>(p);
            else if (B == 2) v = *reinterpret_cast<const u16*>(p);
            else {
                v = 0;
#pragma unroll
                for (int i = 0; i < B; i++) v |= ((u64)p[i]) << (8 * i);
            }
            w[0] = (u32)v;
            if (WORDS > 1) w[WORDS - 1] = (u32)(v >> 32);
        }
    }

    __device__ __forceinline__ void store(u8* p) const {
        if (W == 32) {
            if (B % 4 == 0) {
#pragma unroll
                for (int i = 0; i < B / 4; i++)
                    st_u4(reinterpret_cast<uint4*>(p) + i, make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]));
            } else if (B % 2 == 0) {
#pragma unroll
                for (int i = 0; i < B / 2; i++)
                    st_u2(reinterpret_cast<uint2*>(p) + i, make_uint2(w[2 * i], w[2 * i + 1]));
            } else {
#pragma unroll
                for (int i = 0; i < B; i++) st_u1(reinterpret_cast<u32*>(p) + i, w[i]);
            }
        } else {
            u64 v = w[0];
            if (WORDS > 1) v |= ((u64)w[WORDS - 1]) << 32;
            if (B == 8) *reinterpret_cast<u64*>(p) = v;
            else if (B == 4) *reinterpret_cast<u32*>(p) = (u32)v;
            else if (B == 2) *reinterpret_cast<u16*>(p) = (u16)v;
            else {
#pragma unroll
                for (int i = 0; i < B; i++) p[i] = (u8)(v >> (8 * i));
            }
        }
    }

    // Code i (compile-time i after unrolling).
    __device__ __forceinline__ u32 get(int i) const {
        const int bit = i * B, k = bit >> 5, sh = bit & 31;
        u32 v = w[k] >> sh;
        if (sh + B > 32) v |= w[k + 1] << (32 - sh);
        return v & ((1u << B) - 1u);
    }

    // f32(code i) - z, exactly as the CPU: the code OR-ed into the mantissa
    // of 2^23 (one LOP3 with the mask and 2^23 in registers), minus 2^23.
    __device__ __forceinline__ float centered(int i, u32 mask, u32 two23, float z) const {
        const int bit = i * B, k = bit >> 5, sh = bit & 31;
        u32 v = w[k] >> sh;
        if (sh + B > 32) v |= w[k + 1] << (32 - sh);
        float f = __uint_as_float(and_or(v, mask, two23));
        return __fsub_rn(__fsub_rn(f, 8388608.0f), z);
    }

    __device__ __forceinline__ void clear() {
#pragma unroll
        for (int k = 0; k < WORDS; k++) w[k] = 0;
    }

    // ORs code q (< 2^B) in as code i.
    __device__ __forceinline__ void put(int i, u32 q) {
        const int bit = i * B, k = bit >> 5, sh = bit & 31;
        w[k] |= q << sh;
        if (sh + B > 32) w[k + 1] |= q >> (32 - sh);
    }
};

// Decode with 32 elements per thread in the interleaved layout (four chunks
// of 8 at stride 8 * lpr), so that each 16-byte store instruction of a warp
// writes whole 32-byte sectors (64 contiguous bytes per row and chunk), and
// U units per thread whose loads are all issued before any arithmetic.
template <int B, int OUT, int U, bool ROWROT>
__device__ __forceinline__ void affine_decode_il(const PageDesc* __restrict__ descs,
                                                 const uint2* __restrict__ work, u32 h, float c,
                                                 u64* status) {
    const uint2 w = work[blockIdx.x];
    Codes<B, 8> codes[U][4];
    float sc[U], zp[U];
    u16* out[U];
    u32 lpr;
    {
        const PageDesc d = descs[w.x];
        lpr = d.upr;  // head_dim / 32
        const u32 nunits = d.rows * lpr;
        const u8* body = reinterpret_cast<const u8*>(d.body);
        const float* scales = reinterpret_cast<const float*>(body + d.sec0);
        const float* zeros = reinterpret_cast<const float*>(body + d.sec1);
        const u8* index = body + d.sec2;
        u16* dst = reinterpret_cast<u16*>(d.dst);
#pragma unroll
        for (int k = 0; k < U; k++) {
            u32 u = w.y + (u32)k * BLOCK + threadIdx.x;
            sc[k] = 0.f;
            zp[k] = 0.f;
            out[k] = nullptr;
#pragma unroll
            for (int m = 0; m < 4; m++) codes[k][m].clear();
            if (u < nunits) {
                u32 row = udiv(u, lpr, d.m_upr);
                u32 j = u - row * lpr;
                u64 chunk = (u64)row * 4u * lpr + j;  // first chunk of this lane
#pragma unroll
                for (int m = 0; m < 4; m++) codes[k][m].load(index + (chunk + (u64)lpr * m) * B);
                sc[k] = __ldg(scales + row);
                zp[k] = __ldg(zeros + row);
                i64 o = row_dst(d, row, status);
                if (o >= 0) out[k] = dst + o + 8 * j;
            }
        }
    }
    u32 mask = (1u << B) - 1u, two23 = 0x4b000000u;
    asm("" : "+r"(mask), "+r"(two23));
#pragma unroll
    for (int k = 0; k < U; k++) {
        float sp = __fmul_rn(sc[k], c);
        float v[4][8];
#pragma unroll
        for (int m = 0; m < 4; m++) {
#pragma unroll
            for (int e = 0; e < 8; e++) v[m][e] = __fmul_rn(codes[k][m].centered(e, mask, two23, zp[k]), sp);
        }
        if (ROWROT || h > 1) wht_interleaved<ROWROT>(v, h, lpr);  // uniform over the launch
        if (out[k] != nullptr) {
#pragma unroll
            for (int m = 0; m < 4; m++) {
                st_u4(out[k] + 8u * lpr * m,
                       make_uint4(pack2<OUT>(v[m][0], v[m][1]), pack2<OUT>(v[m][2], v[m][3]),
                                  pack2<OUT>(v[m][4], v[m][5]), pack2<OUT>(v[m][6], v[m][7])));
            }
        }
    }
}

template <int B, int OUT, int W, int U>
__device__ __forceinline__ void affine_decode_fast(const PageDesc* __restrict__ descs,
                                                   const uint2* __restrict__ work, u32 h, float c,
                                                   u64* status) {
    const uint2 w = work[blockIdx.x];
    // Every load of the thread (codes, scales, zero points, slots) is issued
    // before any arithmetic, so U units' worth of memory requests are in
    // flight per thread; the descriptor is dead after this phase.
    Codes<B, W> codes[U];
    float sc[U], zp[U];
    u16* out[U];
    {
        const PageDesc d = descs[w.x];
        const u32 nunits = d.rows * d.upr;
        const u8* body = reinterpret_cast<const u8*>(d.body);
        const float* scales = reinterpret_cast<const float*>(body + d.sec0);
        const float* zeros = reinterpret_cast<const float*>(body + d.sec1);
        const u8* index = body + d.sec2;
        u16* dst = reinterpret_cast<u16*>(d.dst);
#pragma unroll
        for (int k = 0; k < U; k++) {
            u32 u = w.y + (u32)k * BLOCK + threadIdx.x;
            codes[k].clear();
            sc[k] = 0.f;
            zp[k] = 0.f;
            out[k] = nullptr;
            if (u < nunits) {
                u32 row = udiv(u, d.upr, d.m_upr);
                u32 j = u - row * d.upr;
                codes[k].load(index + (u64)u * (W * B / 8));
                sc[k] = __ldg(scales + row);
                zp[k] = __ldg(zeros + row);
                i64 o = row_dst(d, row, status);
                if (o >= 0) out[k] = dst + o + W * j;
            }
        }
    }
    // Opaque to the compiler, so they stay in registers for LOP3.
    u32 mask = (1u << B) - 1u, two23 = 0x4b000000u;
    asm("" : "+r"(mask), "+r"(two23));
#pragma unroll
    for (int k = 0; k < U; k++) {
        float sp = __fmul_rn(sc[k], c);
        float v[W];
#pragma unroll
        for (int i = 0; i < W; i++) v[i] = __fmul_rn(codes[k].centered(i, mask, two23, zp[k]), sp);
        if (h > 1) wht<W>(v, h);  // uniform over the launch: every lane shuffles
        if (out[k] != nullptr) {
            uint4* q = reinterpret_cast<uint4*>(out[k]);
#pragma unroll
            for (int i = 0; i < W / 8; i++) {
                st_u4(q + i, make_uint4(pack2<OUT>(v[8 * i], v[8 * i + 1]), pack2<OUT>(v[8 * i + 2], v[8 * i + 3]),
                                         pack2<OUT>(v[8 * i + 4], v[8 * i + 5]), pack2<OUT>(v[8 * i + 6], v[8 * i + 7])));
            }
        }
    }
}

#define DEC_ARGS const PageDesc *descs, const uint2 *work, u32 h, float c, u64 *status
#define DEC_PASS descs, work, h, c, status
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_b1_bf16(DEC_ARGS) { affine_decode_il<1, OUT_BF16, DEC_UNITS_W32, false>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_b1_f16(DEC_ARGS) { affine_decode_il<1, OUT_F16, DEC_UNITS_W32, false>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_b2_bf16(DEC_ARGS) { affine_decode_il<2, OUT_BF16, DEC_UNITS_W32, false>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_b2_f16(DEC_ARGS) { affine_decode_il<2, OUT_F16, DEC_UNITS_W32, false>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_b3_bf16(DEC_ARGS) { affine_decode_il<3, OUT_BF16, DEC_UNITS_W32, false>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_b3_f16(DEC_ARGS) { affine_decode_il<3, OUT_F16, DEC_UNITS_W32, false>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_b4_bf16(DEC_ARGS) { affine_decode_il<4, OUT_BF16, DEC_UNITS_W32, false>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_b4_f16(DEC_ARGS) { affine_decode_il<4, OUT_F16, DEC_UNITS_W32, false>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_b5_bf16(DEC_ARGS) { affine_decode_il<5, OUT_BF16, DEC_UNITS_W32, false>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_b5_f16(DEC_ARGS) { affine_decode_il<5, OUT_F16, DEC_UNITS_W32, false>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_b6_bf16(DEC_ARGS) { affine_decode_il<6, OUT_BF16, DEC_UNITS_W32, false>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_b6_f16(DEC_ARGS) { affine_decode_il<6, OUT_F16, DEC_UNITS_W32, false>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_b7_bf16(DEC_ARGS) { affine_decode_il<7, OUT_BF16, DEC_UNITS_W32, false>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_b7_f16(DEC_ARGS) { affine_decode_il<7, OUT_F16, DEC_UNITS_W32, false>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_b8_bf16(DEC_ARGS) { affine_decode_il<8, OUT_BF16, DEC_UNITS_W32, false>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_b8_f16(DEC_ARGS) { affine_decode_il<8, OUT_F16, DEC_UNITS_W32, false>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_rowrot_b1_bf16(DEC_ARGS) { affine_decode_il<1, OUT_BF16, DEC_UNITS_W32, true>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_rowrot_b1_f16(DEC_ARGS) { affine_decode_il<1, OUT_F16, DEC_UNITS_W32, true>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_rowrot_b2_bf16(DEC_ARGS) { affine_decode_il<2, OUT_BF16, DEC_UNITS_W32, true>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_rowrot_b2_f16(DEC_ARGS) { affine_decode_il<2, OUT_F16, DEC_UNITS_W32, true>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_rowrot_b3_bf16(DEC_ARGS) { affine_decode_il<3, OUT_BF16, DEC_UNITS_W32, true>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_rowrot_b3_f16(DEC_ARGS) { affine_decode_il<3, OUT_F16, DEC_UNITS_W32, true>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_rowrot_b4_bf16(DEC_ARGS) { affine_decode_il<4, OUT_BF16, DEC_UNITS_W32, true>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_rowrot_b4_f16(DEC_ARGS) { affine_decode_il<4, OUT_F16, DEC_UNITS_W32, true>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_rowrot_b5_bf16(DEC_ARGS) { affine_decode_il<5, OUT_BF16, DEC_UNITS_W32, true>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_rowrot_b5_f16(DEC_ARGS) { affine_decode_il<5, OUT_F16, DEC_UNITS_W32, true>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_rowrot_b6_bf16(DEC_ARGS) { affine_decode_il<6, OUT_BF16, DEC_UNITS_W32, true>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_rowrot_b6_f16(DEC_ARGS) { affine_decode_il<6, OUT_F16, DEC_UNITS_W32, true>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_rowrot_b7_bf16(DEC_ARGS) { affine_decode_il<7, OUT_BF16, DEC_UNITS_W32, true>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_rowrot_b7_f16(DEC_ARGS) { affine_decode_il<7, OUT_F16, DEC_UNITS_W32, true>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_rowrot_b8_bf16(DEC_ARGS) { affine_decode_il<8, OUT_BF16, DEC_UNITS_W32, true>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS_W32) decode_affine_rowrot_b8_f16(DEC_ARGS) { affine_decode_il<8, OUT_F16, DEC_UNITS_W32, true>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_w8_b1_bf16(DEC_ARGS) { affine_decode_fast<1, OUT_BF16, 8, UNITS_PER_THREAD>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_w8_b1_f16(DEC_ARGS) { affine_decode_fast<1, OUT_F16, 8, UNITS_PER_THREAD>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_w8_b2_bf16(DEC_ARGS) { affine_decode_fast<2, OUT_BF16, 8, UNITS_PER_THREAD>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_w8_b2_f16(DEC_ARGS) { affine_decode_fast<2, OUT_F16, 8, UNITS_PER_THREAD>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_w8_b3_bf16(DEC_ARGS) { affine_decode_fast<3, OUT_BF16, 8, UNITS_PER_THREAD>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_w8_b3_f16(DEC_ARGS) { affine_decode_fast<3, OUT_F16, 8, UNITS_PER_THREAD>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_w8_b4_bf16(DEC_ARGS) { affine_decode_fast<4, OUT_BF16, 8, UNITS_PER_THREAD>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_w8_b4_f16(DEC_ARGS) { affine_decode_fast<4, OUT_F16, 8, UNITS_PER_THREAD>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_w8_b5_bf16(DEC_ARGS) { affine_decode_fast<5, OUT_BF16, 8, UNITS_PER_THREAD>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_w8_b5_f16(DEC_ARGS) { affine_decode_fast<5, OUT_F16, 8, UNITS_PER_THREAD>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_w8_b6_bf16(DEC_ARGS) { affine_decode_fast<6, OUT_BF16, 8, UNITS_PER_THREAD>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_w8_b6_f16(DEC_ARGS) { affine_decode_fast<6, OUT_F16, 8, UNITS_PER_THREAD>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_w8_b7_bf16(DEC_ARGS) { affine_decode_fast<7, OUT_BF16, 8, UNITS_PER_THREAD>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_w8_b7_f16(DEC_ARGS) { affine_decode_fast<7, OUT_F16, 8, UNITS_PER_THREAD>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_w8_b8_bf16(DEC_ARGS) { affine_decode_fast<8, OUT_BF16, 8, UNITS_PER_THREAD>(DEC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) decode_affine_w8_b8_f16(DEC_ARGS) { affine_decode_fast<8, OUT_F16, 8, UNITS_PER_THREAD>(DEC_PASS); }

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

// min / max propagating NaN (PTX .NaN): a row holding NaN ends with a NaN
// bound, one holding inf with an infinite one, so one finiteness check of
// the bounds finds every row the CPU rejects.
#ifndef KVPACK_EMU
__device__ __forceinline__ float min_nan(float a, float b) {
    float r;
    asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float max_nan(float a, float b) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
#else
__device__ __forceinline__ float min_nan(float a, float b) { return (a != a || b != b) ? a + b : fminf(a, b); }
__device__ __forceinline__ float max_nan(float a, float b) { return (a != a || b != b) ? a + b : fmaxf(a, b); }
#endif

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


// Code of x: rne(clamp(x * inv + zero, 0, levels)); the rounding is the
// CPU's (t + 1.5 * 2^23) - 1.5 * 2^23, read off the sum's mantissa.
__device__ __forceinline__ u32 quantize(float x, float inv, float zero, float levels) {
    float t = __fadd_rn(__fmul_rn(x, inv), zero);
    t = fminf(fmaxf(t, 0.0f), levels);
    return __float_as_uint(__fadd_rn(t, RNE_MAGIC)) - 0x4b400000u;
}

template <int B, int SRC, int W, int U>
__device__ __forceinline__ void affine_encode_fast(const EncDesc* __restrict__ descs,
                                                   const uint2* __restrict__ work, u32 h, float c,
                                                   u64* status) {
    const uint2 w = work[blockIdx.x];
    const EncDesc d = descs[w.x];
    const u32 upr = d.upr;  // a power of two <= 32
    const u32 nunits = d.rows * upr;
    const u32 esize = SRC == SRC_F32 ? 4u : 2u;
    const u8* src = reinterpret_cast<const u8*>(d.src);
    u8* body = reinterpret_cast<u8*>(d.body);
    const u32 levels = (1u << B) - 1u;

    float v[U][W];
#pragma unroll
    for (int k = 0; k < U; k++) {
        u32 u = w.y + (u32)k * BLOCK + threadIdx.x;
        if (u < nunits) {
            u32 row = udiv(u, upr, d.m_upr);
            u32 j = u - row * upr;
            u32 p = udiv(row, d.tokens, d.m_tokens);
            u32 t = row - p * d.tokens;
            u64 e = (u64)p * d.stride + (u64)t * d.head_dim + (u64)W * j;
            load_src<SRC, W>(src + e * esize, v[k]);
        } else {
#pragma unroll
            for (int i = 0; i < W; i++) v[k][i] = 0.0f;
        }
    }
#pragma unroll
    for (int k = 0; k < U; k++) {
        u32 u = w.y + (u32)k * BLOCK + threadIdx.x;
        bool live = u < nunits;
        if (h > 1) {
            wht<W>(v[k], h);
#pragma unroll
            for (int i = 0; i < W; i++) v[k][i] = __fmul_rn(v[k][i], c);
        }
        float mn = v[k][0], mx = v[k][0];
#pragma unroll
        for (int i = 1; i < W; i++) {
            mn = min_nan(mn, v[k][i]);
            mx = max_nan(mx, v[k][i]);
        }
        if (!live) {
            mn = __int_as_float(0x7f800000);  // +inf: neutral for min
            mx = __int_as_float(0xff800000);  // -inf: neutral for max
        }
        for (u32 m = 1; m < upr; m <<= 1) {
            mn = min_nan(mn, __shfl_xor_sync(FULL_MASK, mn, m));
            mx = max_nan(mx, __shfl_xor_sync(FULL_MASK, mx, m));
        }
        if (!live) continue;
        u32 row = udiv(u, upr, d.m_upr);
        u32 j = u - row * upr;
        if (!is_finite(mn) || !is_finite(mx)) {
            if (j == 0) atomicMin(status, ((u64)d.page << 32) | row);
            continue;
        }
        float scale, zero, inv;
        row_params(mn, mx, levels, &scale, &zero, &inv);
        Codes<B, W> out;
        out.clear();
#pragma unroll
        for (int i = 0; i < W; i++) {
            // The clamped t lies in [0, levels], so t + 1.5 * 2^23 holds the
            // rounded code in its low mantissa bits.
            float t = __fadd_rn(__fmul_rn(v[k][i], inv), zero);
            t = fminf(fmaxf(t, 0.0f), (float)levels);
            out.put(i, __float_as_uint(__fadd_rn(t, RNE_MAGIC)) & levels);
        }
        out.store(body + d.sec_index + (u64)u * (W * B / 8));
        if (j == 0) {
            reinterpret_cast<float*>(body + d.sec_scale)[row] = scale;
            reinterpret_cast<float*>(body + d.sec_zero)[row] = zero;
        }
    }
}

#define ENC_ARGS const EncDesc *descs, const uint2 *work, u32 h, float c, u64 *status
#define ENC_PASS descs, work, h, c, status
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b1_bf16(ENC_ARGS) { affine_encode_fast<1, SRC_BF16, 32, ENC_UNITS_W32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b1_f16(ENC_ARGS) { affine_encode_fast<1, SRC_F16, 32, ENC_UNITS_W32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b1_f32(ENC_ARGS) { affine_encode_fast<1, SRC_F32, 32, ENC_UNITS_W32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b2_bf16(ENC_ARGS) { affine_encode_fast<2, SRC_BF16, 32, ENC_UNITS_W32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b2_f16(ENC_ARGS) { affine_encode_fast<2, SRC_F16, 32, ENC_UNITS_W32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b2_f32(ENC_ARGS) { affine_encode_fast<2, SRC_F32, 32, ENC_UNITS_W32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b3_bf16(ENC_ARGS) { affine_encode_fast<3, SRC_BF16, 32, ENC_UNITS_W32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b3_f16(ENC_ARGS) { affine_encode_fast<3, SRC_F16, 32, ENC_UNITS_W32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b3_f32(ENC_ARGS) { affine_encode_fast<3, SRC_F32, 32, ENC_UNITS_W32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b4_bf16(ENC_ARGS) { affine_encode_fast<4, SRC_BF16, 32, ENC_UNITS_W32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b4_f16(ENC_ARGS) { affine_encode_fast<4, SRC_F16, 32, ENC_UNITS_W32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b4_f32(ENC_ARGS) { affine_encode_fast<4, SRC_F32, 32, ENC_UNITS_W32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b5_bf16(ENC_ARGS) { affine_encode_fast<5, SRC_BF16, 32, ENC_UNITS_W32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b5_f16(ENC_ARGS) { affine_encode_fast<5, SRC_F16, 32, ENC_UNITS_W32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b5_f32(ENC_ARGS) { affine_encode_fast<5, SRC_F32, 32, ENC_UNITS_W32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b6_bf16(ENC_ARGS) { affine_encode_fast<6, SRC_BF16, 32, ENC_UNITS_W32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b6_f16(ENC_ARGS) { affine_encode_fast<6, SRC_F16, 32, ENC_UNITS_W32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b6_f32(ENC_ARGS) { affine_encode_fast<6, SRC_F32, 32, ENC_UNITS_W32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b7_bf16(ENC_ARGS) { affine_encode_fast<7, SRC_BF16, 32, ENC_UNITS_W32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b7_f16(ENC_ARGS) { affine_encode_fast<7, SRC_F16, 32, ENC_UNITS_W32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b7_f32(ENC_ARGS) { affine_encode_fast<7, SRC_F32, 32, ENC_UNITS_W32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b8_bf16(ENC_ARGS) { affine_encode_fast<8, SRC_BF16, 32, ENC_UNITS_W32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b8_f16(ENC_ARGS) { affine_encode_fast<8, SRC_F16, 32, ENC_UNITS_W32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_b8_f32(ENC_ARGS) { affine_encode_fast<8, SRC_F32, 32, ENC_UNITS_W32>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_w8_b1_bf16(ENC_ARGS) { affine_encode_fast<1, SRC_BF16, 8, UNITS_PER_THREAD>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_w8_b1_f16(ENC_ARGS) { affine_encode_fast<1, SRC_F16, 8, UNITS_PER_THREAD>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_w8_b1_f32(ENC_ARGS) { affine_encode_fast<1, SRC_F32, 8, UNITS_PER_THREAD>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_w8_b2_bf16(ENC_ARGS) { affine_encode_fast<2, SRC_BF16, 8, UNITS_PER_THREAD>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_w8_b2_f16(ENC_ARGS) { affine_encode_fast<2, SRC_F16, 8, UNITS_PER_THREAD>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_w8_b2_f32(ENC_ARGS) { affine_encode_fast<2, SRC_F32, 8, UNITS_PER_THREAD>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_w8_b3_bf16(ENC_ARGS) { affine_encode_fast<3, SRC_BF16, 8, UNITS_PER_THREAD>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_w8_b3_f16(ENC_ARGS) { affine_encode_fast<3, SRC_F16, 8, UNITS_PER_THREAD>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_w8_b3_f32(ENC_ARGS) { affine_encode_fast<3, SRC_F32, 8, UNITS_PER_THREAD>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_w8_b4_bf16(ENC_ARGS) { affine_encode_fast<4, SRC_BF16, 8, UNITS_PER_THREAD>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_w8_b4_f16(ENC_ARGS) { affine_encode_fast<4, SRC_F16, 8, UNITS_PER_THREAD>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_w8_b4_f32(ENC_ARGS) { affine_encode_fast<4, SRC_F32, 8, UNITS_PER_THREAD>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_w8_b5_bf16(ENC_ARGS) { affine_encode_fast<5, SRC_BF16, 8, UNITS_PER_THREAD>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_w8_b5_f16(ENC_ARGS) { affine_encode_fast<5, SRC_F16, 8, UNITS_PER_THREAD>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_w8_b5_f32(ENC_ARGS) { affine_encode_fast<5, SRC_F32, 8, UNITS_PER_THREAD>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_w8_b6_bf16(ENC_ARGS) { affine_encode_fast<6, SRC_BF16, 8, UNITS_PER_THREAD>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_w8_b6_f16(ENC_ARGS) { affine_encode_fast<6, SRC_F16, 8, UNITS_PER_THREAD>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_w8_b6_f32(ENC_ARGS) { affine_encode_fast<6, SRC_F32, 8, UNITS_PER_THREAD>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_w8_b7_bf16(ENC_ARGS) { affine_encode_fast<7, SRC_BF16, 8, UNITS_PER_THREAD>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_w8_b7_f16(ENC_ARGS) { affine_encode_fast<7, SRC_F16, 8, UNITS_PER_THREAD>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_w8_b7_f32(ENC_ARGS) { affine_encode_fast<7, SRC_F32, 8, UNITS_PER_THREAD>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_w8_b8_bf16(ENC_ARGS) { affine_encode_fast<8, SRC_BF16, 8, UNITS_PER_THREAD>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_w8_b8_f16(ENC_ARGS) { affine_encode_fast<8, SRC_F16, 8, UNITS_PER_THREAD>(ENC_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_affine_w8_b8_f32(ENC_ARGS) { affine_encode_fast<8, SRC_F32, 8, UNITS_PER_THREAD>(ENC_PASS); }

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
    for (u32 i = threadIdx.x; i < D; i += blockDim.x) buf[i] = load_src1<SRC>(src, e0 + i);
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
