// `octopus` and `turbo` unit-coded pages, encode (format/codecs/octopus.md
// and format/codecs/turbo.md "Encoding"; src/codec/sphere.rs `encode_row`),
// producing the CPU encoder's sections bit for bit. Per row x (one head
// vector of D values, plane of kv head h), binary32 unless stated, no fused
// multiply-add except the exact sign-times-value butterflies across lanes:
//     gamma = f32(sqrt(sum_i f64(x_i)^2))            (f64 sum in index order)
//     u = H (s ⊙ x)                                   (normative butterfly order)
//     f = c_D / gamma; u = 0 when gamma == 0 or f is not finite, else u_i * f
//     turbo:   c_i = #{k : B_k < u_i}  (B: midpoints of the coordinate codebook)
//     octopus: triplet t_i = u[3i .. 3i+2] (zero-padded): (xi, eta) = the
//              octahedral map (l = (|t0| + |t1|) + |t2|, three divisions,
//              fold when p_z < 0, (0, 0) for l == 0); jx, jy = search of the
//              direction bounds; (a, b) = the first maximum of
//              (t0*n0 + t1*n1) + t2*n2 over the candidates in ascending
//              order (3x3 around (jx, jy) clamped; every code with :full;
//              (jx, jy) alone with :scalar); jn = search of the norm bounds
//              for clamp(best, 0, 1)
//     qjl (K pages): u^ = C[c] / n(a, b)_k * C_rho[jn]; r = u - u^;
//              gamma' = f16(f32(sqrt(sum_i f64(r_i)^2))); w = H (s' ⊙ r);
//              sign bit i = w_i < 0
// A row whose gamma is not finite (NaN, inf, or a norm beyond f32) cannot
// be encoded: the first such (page, row) is reported through `status`
// (atomicMin of page << 32 | row).
//
// Side table: the decode table of the tensor (sphere.cu: octopus float4
// n(a, b) at [a * 2^b_dir + b] and the 2^b_norm norm centroids, or the 2^b
// turbo centroids; at byte p1 per kv head the D rotation sign bits, then
// with QJL the D bits of s'), and at `aux` (device address) the encoder's
// bounds (kernels::lloyd_max::boundaries, +inf padded): octopus the 2^b_dir
// direction bounds then the 2^b_norm norm bounds; turbo the 2^b coordinate
// bounds.
//
// EncDesc: sec_scale = SCALE 0 (gamma, f32), sec_index = INDEX 0 (turbo
// codes or octopus direction code pairs), sec_zero = INDEX 1 (octopus norm
// codes), sec3 = SCALE 1 (gamma', f16), p3 = the INDEX of the QJL sign bits;
// p0 = a | b << 8 | rounding << 16 | octopus << 24 | qjl << 25 (a = turbo b
// or b_dir, b = b_norm; rounding 0 local, 1 full, 2 scalar), p1 = offset of
// the sign bits in the side table, p2 = bits of c_D.
//
// Fast `encode_sphere_turbo[_qjl]_b{B}_{src}` / `encode_sphere_oct[_qjl]_{src}`
// (D = 32 * lpr, lpr a power of two <= 32; Grid::Units w = 32): a thread
// holds 32 consecutive elements of a row (the row's lpr lanes consecutive),
// butterflies in registers and xor shuffles; the block's rows are staged in
// shared memory, where one thread per row takes the norms in index order.
// Turbo writes each unit's B code words directly; octopus codes one triplet
// per thread and step from shared memory, OR-ing the codes into per-block
// word buffers (atomics in shared memory), then writes the words (atomicOr
// for the two words the block may share with its neighbours). Fallback
// `encode_sphere_any_{src}` (any D; Grid::Rows): one row per block of
// SEG_BLOCK threads, everything in shared memory, codes OR-ed into the
// (zeroed) sections with global atomics.

#define SPHERE_ENC_MAX_D 4096
#define SE_LOCAL 0
#define SE_FULL 1
#define SE_SCALAR 2

// Shared-memory row layout of the fast kernels: unit j of a row (32
// elements) at 36 j floats, rows RS floats apart with RS / 4 odd, so that
// 16-byte reads of a unit by consecutive lanes, and of a row by one thread
// per row, are free of bank conflicts.
__device__ __forceinline__ u32 se_row_stride(u32 lpr) { return lpr == 1u ? 36u : 36u * lpr + 4u; }
__device__ __forceinline__ u32 se_at(u32 i) { return (i >> 5) * 36u + (i & 31u); }

// Number of bounds below x among 2^bits non-decreasing bounds whose last is
// +inf (kernels::lloyd_max::search), by bisection.
__device__ __forceinline__ u32 se_search(const float* b, u32 bits, float x) {
    u32 idx = 0;
    for (u32 s = 1u << (bits - 1u); s > 0u; s >>= 1) {
        if (b[idx + s - 1u] < x) idx += s;
    }
    return idx;
}

// sqrt(sum_i f64(v_i)^2) as f32, the squares summed in index order
// (kernels::l2_norm): row of the fast layout.
__device__ __forceinline__ float se_norm_fast(const float* row, u32 D) {
    double acc = 0.0;
    for (u32 i = 0; i < D; i += 4u) {
        float4 q = *reinterpret_cast<const float4*>(row + se_at(i));
        acc = __dadd_rn(acc, __dmul_rn((double)q.x, (double)q.x));
        acc = __dadd_rn(acc, __dmul_rn((double)q.y, (double)q.y));
        acc = __dadd_rn(acc, __dmul_rn((double)q.z, (double)q.z));
        acc = __dadd_rn(acc, __dmul_rn((double)q.w, (double)q.w));
    }
    return (float)sqrt(acc);
}

// The same for D consecutive floats.
__device__ __forceinline__ float se_norm_flat(const float* row, u32 D) {
    double acc = 0.0;
    for (u32 i = 0; i < D; i++) acc = __dadd_rn(acc, __dmul_rn((double)row[i], (double)row[i]));
    return (float)sqrt(acc);
}

// gamma of a row from its squares summed in any order (`acc`, binary64) and
// the smallest non-zero |x_i| (`mn`), when that equals the CPU's index-order
// sum; -1 otherwise. A source value with `mb` significant bits and
// 2^e <= |x| is a multiple of 2^(e - mb + 1), so every square (exact in
// binary64) and every partial sum is a multiple of q = (2^(e_min - mb +
// 1))^2; while the total is below 2^53 q no partial sum in any order is
// rounded, so every order gives the exact total (a larger total, or a
// non-finite or subnormal value, takes the index-order sum). two53_q =
// 2^(53 - 2 (mb - 1)): 2^39 for bf16, 2^33 for f16, 2^7 for f32 sources.
__device__ __forceinline__ float se_norm_exact(double acc, float mn, double two53_q) {
    if (acc == 0.0) return 0.0f;
    const u32 e = __float_as_uint(mn) & 0x7f800000u;
    if (e == 0u || e == 0x7f800000u) return -1.0f;
    const double p = (double)__uint_as_float(e);
    return acc < __dmul_rn(__dmul_rn(p, p), two53_q) ? (float)sqrt(acc) : -1.0f;
}

// The factor f of a row: c_D / gamma, or 0 when u is zeroed (gamma == 0 or
// f not finite; f is never 0 otherwise). Reports a non-finite gamma when
// `report` (one thread per row).
__device__ __forceinline__ float se_factor(float gamma, float cd, const EncDesc& d, u32 row, u64* status, bool report) {
    if (!is_finite(gamma)) {
        if (report) atomicMin(status, ((u64)d.page << 32) | row);
        return 0.0f;
    }
    float f = __fdiv_rn(cd, gamma);
    return (gamma == 0.0f || !is_finite(f)) ? 0.0f : f;
}

// Octahedral coordinates (xi, eta) of the direction of t
// (kernels::octahedral::encode).
__device__ __forceinline__ void se_octahedral(const float t[3], float& xi, float& eta) {
    float l = __fadd_rn(__fadd_rn(fabsf(t[0]), fabsf(t[1])), fabsf(t[2]));
    float px = __fdiv_rn(t[0], l), py = __fdiv_rn(t[1], l), pz = __fdiv_rn(t[2], l);
    float fx = __fmul_rn(px < 0.0f ? -1.0f : 1.0f, __fsub_rn(1.0f, fabsf(py)));
    float fy = __fmul_rn(py < 0.0f ? -1.0f : 1.0f, __fsub_rn(1.0f, fabsf(px)));
    bool up = pz >= 0.0f;
    xi = up ? px : fx;
    eta = up ? py : fy;
    if (l == 0.0f) xi = eta = 0.0f;
}

// se_search over the 2^B bounds at `b` (shared memory), B known at compile
// time: the same bisection on byte offsets, so that each level after the
// first is one shared load at a register plus a constant, a compare and a
// predicated add. Returns 4 times the index.
template <int B>
__device__ __forceinline__ u32 se_search_b4(const float* b, float x) {
    const char* base = reinterpret_cast<const char*>(b);
    u32 off = 0;  // 4 * the index so far
#pragma unroll
    for (int s = 1 << (B - 1); s > 0; s >>= 1) {
        const float bk = *reinterpret_cast<const float*>(base + off + 4u * (u32)(s - 1));
#ifdef __CUDA_ARCH__
        // A predicated add (ptxas otherwise selects, then adds).
        asm("{\n\t.reg .pred p;\n\tsetp.lt.f32 p, %1, %2;\n\t@p add.u32 %0, %0, %3;\n\t}" : "+r"(off) : "f"(bk), "f"(x), "r"(4u * (u32)s));
#else
        if (bk < x) off += 4u * (u32)s;
#endif
    }
    return off;
}

// The index itself.
template <int B>
__device__ __forceinline__ u32 se_search_b(const float* b, float x) {
    return se_search_b4<B>(b, x) >> 2;
}

// se_search over bounds held in shared or global memory (any size).
struct SeBisect {
    const float* b;
    u32 bits;
    __device__ __forceinline__ u32 operator()(float x) const { return se_search(b, bits, x); }
};

// se_search over at most N finite bounds held in registers: the number of
// bounds below x, counted (the same result for non-decreasing bounds whose
// last is +inf, and 0 for NaN; no dependent shared-memory loads).
template <int N>
struct SeCount {
    float b[N];
    __device__ __forceinline__ void load(const float* src, u32 bits) {
#pragma unroll
        for (int k = 0; k < N; k++) b[k] = (u32)k + 1u < (1u << bits) ? src[k] : __int_as_float(0x7f800000);
    }
    __device__ __forceinline__ u32 operator()(float x) const {
        u32 c = 0;
#pragma unroll
        for (int k = 0; k < N; k++) c += b[k] < x ? 1u : 0u;
        return c;
    }
};

// Scores candidate (a, b) of triplet t, keeping the first maximum.
__device__ __forceinline__ void se_score(const float t[3], const float4* dirs, u32 bd, u32 a, u32 b, float& best,
                                         u32& ba, u32& bb) {
    float4 c = dirs[(a << bd) | b];
    float s = __fadd_rn(__fadd_rn(__fmul_rn(t[0], c.x), __fmul_rn(t[1], c.y)), __fmul_rn(t[2], c.z));
    if (s > best) {
        best = s;
        ba = a;
        bb = b;
    }
}

// The codes (a, b, jn) of triplet t (TripletQuantizer::quantize_triplet);
// `dirs` holds n(a, b) at a << bd | b, `dsearch` / `nsearch` search the
// direction / norm bounds. Returns the maximum score's direction in n.
template <class DS, class NS>
__device__ __forceinline__ void se_triplet(const float t[3], const float4* dirs, const DS& dsearch, const NS& nsearch,
                                           u32 bd, u32 rounding, u32& a_out, u32& b_out, u32& jn, float4& n) {
    float xi, eta;
    se_octahedral(t, xi, eta);
    const u32 jx = dsearch(xi), jy = dsearch(eta);
    const u32 top = (1u << bd) - 1u;
    float best = __int_as_float(0xff800000);
    u32 ba = jx, bb = jy;
    if (rounding == SE_LOCAL) {
        // The 3x3 neighbourhood, indices clamped: a clamped duplicate
        // repeats its neighbour's score right after it, which never
        // replaces the first maximum, so this is the ascending scan of the
        // distinct candidates.
        const u32 as[3] = {jx > 0u ? jx - 1u : 0u, jx, min(jx + 1u, top)};
        const u32 bs[3] = {jy > 0u ? jy - 1u : 0u, jy, min(jy + 1u, top)};
#pragma unroll
        for (int x = 0; x < 3; x++) {
#pragma unroll
            for (int y = 0; y < 3; y++) se_score(t, dirs, bd, as[x], bs[y], best, ba, bb);
        }
    } else {
        const bool full = rounding == SE_FULL;
        const u32 a0 = full ? 0u : jx, a1 = full ? top : jx, b0 = full ? 0u : jy, b1 = full ? top : jy;
        for (u32 a = a0; a <= a1; a++) {
            for (u32 b = b0; b <= b1; b++) se_score(t, dirs, bd, a, b, best, ba, bb);
        }
    }
    float p = best;
    if (p < 0.0f) p = 0.0f;
    if (p > 1.0f) p = 1.0f;
    jn = nsearch(p);
    a_out = ba;
    b_out = bb;
    n = dirs[(ba << bd) | bb];
}

// ORs the n-bit value v (n <= 32) into a packed stream at bit `bit` (u32
// words; global or shared memory).
__device__ __forceinline__ void se_or_bits(u32* words, u64 bit, u32 v, u32 n) {
    u32 sh = (u32)bit & 31u;
    u32* w = words + (bit >> 5);
    atomicOr(w, v << sh);
    if (sh + n > 32u) atomicOr(w + 1, v >> (32u - sh));
}

// Rotation (and with QJL projection) sign bits of the kv head of plane p.
// `p % heads` out of line: reached only for batch > 1.
#ifdef KVPACK_EMU
#define SE_COLD
#else
#define SE_COLD __noinline__
#endif
__device__ SE_COLD u32 se_mod(u32 p, u32 heads) { return p % heads; }

// Batch 1 (planes = kv heads, so p < heads) skips the division, which
// the compiler would otherwise predicate (and issue) inline. Not for the
// QJL kernels: the call there cost them 11% (more live registers).
__device__ __forceinline__ const u8* se_signs_p(const EncDesc& d, u32 p, bool qjl) {
    const u32 h = qjl ? p % d.heads : (p < d.heads ? p : se_mod(p, d.heads));
    return reinterpret_cast<const u8*>(d.side) + d.p1 + (u64)h * (qjl ? 2u : 1u) * (d.head_dim >> 3);
}

// The same for the plane of `row`.
__device__ __forceinline__ const u8* se_signs(const EncDesc& d, u32 row, bool qjl) {
    return se_signs_p(d, udiv(row, d.tokens, d.m_tokens), qjl);
}

// Octopus codes of the block's rows (staged rotated in xs, RS floats apart,
// T triplets each), OR-ed into the word buffers wd (direction pairs) and wn
// (norms) whose first bits sit at bd0 & 31 / bn0 & 31; with QJL the
// residual replaces the row. Each warp codes the rows its lanes staged
// (32 / lpr of them), one triplet per lane and step.
template <bool QJL, class DS, class NS>
__device__ __forceinline__ void se_code_triplets(float* xs, u32 RS, u32 lpr, u32 nrows, u32 T, u32 mT, u32 D,
                                                 const float4* dirs, const DS& dsearch, const NS& nsearch, u32 bd,
                                                 u32 bn, u32 rounding, u32* wd, u32* wn, u64 bd0, u64 bn0,
                                                 const float* slut) {
    const u32 rpw = 32u / lpr, warp = threadIdx.x >> 5;
    const u32 end = min((warp + 1u) * rpw, nrows) * T;
    for (u32 i = min(warp * rpw, nrows) * T + (threadIdx.x & 31u); i < end; i += 32u) {
        const u32 r = udiv(i, T, mT), ti = i - r * T;
        float* rp = xs + r * RS;
        float t[3];
#pragma unroll
        for (u32 k = 0; k < 3u; k++) t[k] = 3u * ti + k < D ? rp[se_at(3u * ti + k)] : 0.0f;
        u32 a, b, jn;
        float4 n;
        se_triplet(t, dirs, dsearch, nsearch, bd, rounding, a, b, jn, n);
        const u32 c = r * T + ti;
        se_or_bits(wd, (bd0 & 31u) + (u64)c * 2u * bd, a | (b << bd), 2u * bd);
        se_or_bits(wn, (bn0 & 31u) + (u64)c * bn, jn, bn);
        if (QJL) {
            const float rho = slut[jn];
            const float nn[3] = {n.x, n.y, n.z};
#pragma unroll
            for (u32 k = 0; k < 3u; k++) {
                if (3u * ti + k < D) rp[se_at(3u * ti + k)] = __fsub_rn(t[k], __fmul_rn(nn[k], rho));
            }
        }
    }
}

// ------------------------------------------------------------------ fast

// 32 bf16 source elements (16-byte aligned) widened to f32, element i
// negated when bit i of `rot` is set, the signs flipped in the packed
// pairs: pair k (elements 2 k, 2 k + 1) takes bits 2 k and 2 k + 1 of rot
// at bits 15 and 31, from w (bits 0 .. 15 of rot: even bits in place, odd
// bits moved up by 15; bits 16 .. 31 likewise after a shift by 16) shifted
// left by 15 - 2 (k mod 8).
__device__ __forceinline__ void se_load_bf16_flipped(const u8* p, float v[32], u32 rot) {
    const u32 wl = (rot & 0x5555u) | ((rot & 0xaaaau) << 15);
    const u32 wh = ((rot >> 16) & 0x5555u) | ((rot & 0xaaaa0000u) >> 1);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const uint4 a = __ldg(reinterpret_cast<const uint4*>(p) + i);
        const u32 x[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int pr = 4 * i + k;
            const u32 y = x[k] ^ (((pr < 8 ? wl : wh) << (15 - 2 * (pr & 7))) & 0x80008000u);
            v[2 * pr] = __uint_as_float(y << 16);
            v[2 * pr + 1] = __uint_as_float(y & 0xffff0000u);
        }
    }
}

// The B-bit chunk codes p[k] (chunk j of unit k, B < 4) to the lane of
// each unit through rowp: lane j's four at words 4 j .. 4 j + 3; unit j's
// chunks are words j, 4 + j, 8 + j, 12 + j; lane j writes unit j's B words
// at out[B j].
template <int B>
__device__ __forceinline__ void se_lpr4_words(const u32 p[4], float* rowp, u32 j, bool live, u32* out) {
    u32* cb = reinterpret_cast<u32*>(rowp);
    __syncwarp();
    if (live) *reinterpret_cast<uint4*>(cb + 4u * j) = make_uint4(p[0], p[1], p[2], p[3]);
    __syncwarp();
    if (live) {
        u32 w[B > 0 ? B : 1];
#pragma unroll
        for (int k = 0; k < B; k++) w[k] = 0u;
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const u32 q = cb[4 * c + (int)j];
            const int bit = 8 * B * c;
            w[bit >> 5] |= q << (bit & 31);
            if ((bit & 31) + 8 * B > 32) w[(bit >> 5) + 1] |= q >> (32 - (bit & 31));
        }
#pragma unroll
        for (int k = 0; k < B; k++) out[B * (int)j + k] = w[k];
    }
}

// Turbo for D = 128 (4 lanes per row, B <= 4), from v = the
// lane's 32 sign-flipped elements (lane j of the row: elements 32 j ..
// 32 j + 31): the in-register butterflies (strides 1 .. 16), then a
// transpose through the row's staging area `rowp` (units 36 floats apart)
// so that lane j holds chunk j (8 elements) of each unit k, i.e. elements
// 32 k + 8 j + e in v[8 k + e], and strides 32 and 64 are butterflies in
// registers too (no shuffles). The codes of chunk j of unit k (8 B bits)
// go back through rowp to the lane of unit k, which writes its B words at
// out[k * B] (out: the row's first unit). With QJL the residuals
// u - C[c] (centroids at slut) end in rowp in index order (unit j of the
// row at rowp + 36 j), for the caller's barrier. Every lane of the warp
// calls this; only `live` lanes write. The caller's lanes are done with
// rowp.
template <int B, bool QJL>
__device__ __forceinline__ void se_turbo_lpr4(float v[32], float* rowp, u32 j, float f, const float* sb,
                                              const float* slut, bool live, u32* out) {
    wht<32>(v, 32u);
    float* mine = rowp + 36u * j;
    if (live) {
#pragma unroll
        for (int i = 0; i < 32; i += 4) *reinterpret_cast<float4*>(mine + i) = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
    }
    __syncwarp();
#pragma unroll
    for (int k = 0; k < 4; k++) {
#pragma unroll
        for (int h = 0; h < 8; h += 4) {
            const float4 q = *reinterpret_cast<const float4*>(rowp + 36u * (u32)k + 8u * j + (u32)h);
            v[8 * k + h] = q.x;
            v[8 * k + h + 1] = q.y;
            v[8 * k + h + 2] = q.z;
            v[8 * k + h + 3] = q.w;
        }
    }
    // Strides 32 (units k, k + 1) and 64 (k, k + 2), the lower index a + b.
#pragma unroll
    for (int s = 1; s < 4; s <<= 1) {
#pragma unroll
        for (int k = 0; k < 4; k++) {
            if (!(k & s)) {
#pragma unroll
                for (int e = 0; e < 8; e++) {
                    const float a = v[8 * k + e], b = v[8 * (k + s) + e];
                    v[8 * k + e] = __fadd_rn(a, b);
                    v[8 * (k + s) + e] = __fsub_rn(a, b);
                }
            }
        }
    }
    u32 p[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        p[k] = 0u;
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const float x = __fmul_rn(v[8 * k + e], f);
            const u32 c4 = se_search_b4<B>(sb, x);
            if (QJL) v[8 * k + e] = __fsub_rn(x, *reinterpret_cast<const float*>(reinterpret_cast<const char*>(slut) + c4));
            // 4 c shifted into place: one shift-add (the fields are disjoint).
            p[k] += B * e >= 2 ? c4 << (B * e - 2) : c4 >> (2 - B * e);
        }
    }
    if constexpr (B == 4) {
        // Chunk j of unit k is word j of unit k.
        if (live) {
#pragma unroll
            for (int k = 0; k < 4; k++) out[4 * k + (int)j] = p[k];
        }
    } else {
        se_lpr4_words<B>(p, rowp, j, live, out);
    }
    if (QJL) {
        // Chunk j of unit k back where lane j read it (after the lanes'
        // reads of the code words, which share the start of rowp).
        if (B != 4) __syncwarp();
        if (live) {
#pragma unroll
            for (int k = 0; k < 4; k++) {
#pragma unroll
                for (int h = 0; h < 8; h += 4) {
                    *reinterpret_cast<float4*>(rowp + 36u * (u32)k + 8u * j + (u32)h) =
                        make_float4(v[8 * k + h], v[8 * k + h + 1], v[8 * k + h + 2], v[8 * k + h + 3]);
                }
            }
        }
    }
}

template <int SRC, bool OCT, bool QJL, int B>
__device__ __forceinline__ void sphere_encode_fast(const EncDesc* __restrict__ descs, const uint2* __restrict__ work,
                                                   u64* status) {
    DYN_SHARED(float, xs);
    __shared__ float sb[128];
    __shared__ float slut[64];
    __shared__ __align__(16) float4 sdir[256];
    const uint2 w = work[blockIdx.x];
    const EncDesc d = descs[w.x];
    const u32 D = d.head_dim, lpr = d.upr;
    const u32 bd = d.p0 & 0xffu, bn = (d.p0 >> 8) & 0xffu, rounding = (d.p0 >> 16) & 0xffu;
    const u32 RS = se_row_stride(lpr);
    // lpr is a power of two: divisions by it are shifts.
    const u32 ls = (u32)__ffs(lpr) - 1u;
    const u32 row0 = w.y >> ls, nrows = min((u32)BLOCK >> ls, d.rows - row0);
    const u8* side = reinterpret_cast<const u8*>(d.side);
    const float* bounds = reinterpret_cast<const float*>(d.aux);
    u8* body = reinterpret_cast<u8*>(d.body);
    // Bounds (and centroids for the QJL reconstruction) into shared memory.
    const u32 nb0 = OCT ? 1u << bd : 0u, nbt = nb0 + (1u << (OCT ? bn : (u32)B));
    for (u32 i = threadIdx.x; i < nbt; i += BLOCK) sb[i] = bounds[i];
    if (QJL) {
        const float* lut = reinterpret_cast<const float*>(side + (OCT ? 16u << (2u * bd) : 0u));
        for (u32 i = threadIdx.x; i < (1u << (OCT ? bn : (u32)B)); i += BLOCK) slut[i] = lut[i];
    }
    const bool dir_smem = OCT && bd <= 4u;
    if (dir_smem) {
        for (u32 i = threadIdx.x; i < (1u << (2u * bd)); i += BLOCK) sdir[i] = reinterpret_cast<const float4*>(side)[i];
    }
    // Load: 32 consecutive elements of a row per thread, also staged.
    const u32 u = w.y + threadIdx.x;
    const bool live = u < d.rows * lpr;
    // Threads past the page act as lane 0 of the block's first row: they
    // load its values and never store.
    const u32 row = live ? u >> ls : row0;
    const u32 j = live ? u & (lpr - 1u) : 0u, rl = row - row0;
    const u32 esize = SRC == SRC_F32 ? 4u : 2u;
    // bf16: the rotation signs s are applied as the values are loaded (the
    // norm and the staged copy do not depend on signs); f16 and f32 flip
    // after the norm (at load time their register counts rose above 64).
    const u32 p = udiv(row, d.tokens, d.m_tokens);
    float v[32];
    {
        const u32 t = row - p * d.tokens;
        const u64 e = (u64)p * d.stride + (u64)t * D + 32u * j;
        const u8* src = reinterpret_cast<const u8*>(d.src) + e * esize;
        if (SRC == SRC_BF16) {
            se_load_bf16_flipped(src, v, *reinterpret_cast<const u32*>(se_signs_p(d, p, QJL) + 4u * j));
        } else {
            load_src<SRC, 32>(src, v);
        }
    }
    float* mine = xs + rl * RS + 36u * j;
    if (live) {
#pragma unroll
        for (int i = 0; i < 32; i += 4) *reinterpret_cast<float4*>(mine + i) = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
    }
    // Octopus: the block's code word buffers (after its rows) zeroed.
    const u32 T = (D + 2u) / 3u;
    const u32 rows_blk = (u32)BLOCK >> ls;
    const u32 nwd = OCT ? (rows_blk * T * 2u * bd + 31u) / 32u + 1u : 0u;
    const u32 nwn = OCT ? (rows_blk * T * bn + 31u) / 32u + 1u : 0u;
    u32* wd = reinterpret_cast<u32*>(xs + rows_blk * RS);
    u32* wn = wd + nwd;
    for (u32 i = threadIdx.x; i < nwd + nwn; i += BLOCK) wd[i] = 0u;
    // The bounds, tables, staged rows and word buffers are visible to the
    // whole block from here on (the only block barrier before the codes).
    __syncthreads();
    float f;
    {
        // The row's squares summed across its lpr lanes in any order
        // (se_norm_exact says when that is the CPU's sum); every lane of
        // the row (one warp) then takes gamma and f itself, the index-order
        // sum from the staged row when the exact shortcut does not apply.
        // The square of a binary32 value is exact in binary64, so one
        // fused multiply-add rounds exactly as the product-then-sum does.
        // mk: the smallest 2|x| - 1 over the bits of x (zeros wrap to the
        // maximum), i.e. the smallest non-zero magnitude.
        double a[4] = {0.0, 0.0, 0.0, 0.0};
        u32 mk = 0xffffffffu;
#pragma unroll
        for (int i = 0; i < 32; i++) {
            a[i & 3] = __fma_rn((double)v[i], (double)v[i], a[i & 3]);
            mk = min(mk, (__float_as_uint(v[i]) << 1) - 1u);
        }
        double acc = __dadd_rn(__dadd_rn(a[0], a[1]), __dadd_rn(a[2], a[3]));
        for (u32 m = 1; m < lpr; m <<= 1) {
            acc = __dadd_rn(acc, __shfl_xor_sync(FULL_MASK, acc, (int)m));
            mk = min(mk, __shfl_xor_sync(FULL_MASK, mk, (int)m));
        }
        const float mn = mk == 0xffffffffu ? __int_as_float(0x7f800000) : __uint_as_float((mk + 1u) >> 1);
        float gamma = se_norm_exact(acc, mn, SRC == SRC_BF16 ? 549755813888.0 : SRC == SRC_F16 ? 8589934592.0 : 128.0);
        if (gamma < 0.0f) gamma = se_norm_fast(xs + rl * RS, D);
        const bool first = live && j == 0u;
        if (first) reinterpret_cast<float*>(body + d.sec_scale)[row] = gamma;
        f = se_factor(gamma, __uint_as_float(d.p2), d, row, status, first);
    }
    // The row's lanes are done reading its staged copy (it is overwritten
    // below by octopus and QJL).
    __syncwarp();
    // Rotate and scale: u = H (s ⊙ x) * f. With f == 0 (u zeroed) every
    // H (s ⊙ x)_i is finite (gamma is 0, or so small that c_D / gamma
    // overflows), so the product is +-0: a zero of either sign has the
    // codes, residuals (up to the sign of a zero) and sign bits of +0.
    if (SRC != SRC_BF16) {
        const u32 rot = *reinterpret_cast<const u32*>(se_signs(d, row, QJL) + 4u * j);
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = flip_if(v[i], (rot >> i) & 1u);
    }
    // Turbo at D = 128 (b <= 4): se_turbo_lpr4; with QJL its residuals are
    // staged for the tail below.
    const bool t4 = !OCT && B <= 4 && lpr == 4u;
    if (t4) {
        se_turbo_lpr4<(B <= 4 ? B : 4), QJL>(v, xs + rl * RS, j, f, sb, slut, live,
                                            reinterpret_cast<u32*>(body + d.sec_index) + (u64)(u - j) * B);
        if (!QJL) return;
    } else {
        wht<32>(v, D);
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = __fmul_rn(v[i], f);
        if (!OCT) {
            // Turbo: B-bit codes, B words per unit; the residual stays in v.
            u32 cw[B > 0 ? B : 1];
#pragma unroll
            for (int k = 0; k < B; k++) cw[k] = 0u;
#pragma unroll
            for (int i = 0; i < 32; i++) {
                u32 c = se_search_b<B>(sb, v[i]);
                const int bit = i * B;
                cw[bit >> 5] |= c << (bit & 31);
                if ((bit & 31) + B > 32) cw[(bit >> 5) + 1] |= c >> (32 - (bit & 31));
                if (QJL) v[i] = __fsub_rn(v[i], slut[c]);
            }
            if (live) {
                u32* out = reinterpret_cast<u32*>(body + d.sec_index) + (u64)u * B;
#pragma unroll
                for (int k = 0; k < B; k++) out[k] = cw[k];
            }
            if (QJL && live) {
#pragma unroll
                for (int i = 0; i < 32; i += 4) *reinterpret_cast<float4*>(mine + i) = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
            }
        } else {
            // Octopus: the rotated rows into shared memory, one triplet per
            // thread and step, the codes OR-ed into the block's word buffers.
            if (live) {
#pragma unroll
                for (int i = 0; i < 32; i += 4) *reinterpret_cast<float4*>(mine + i) = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
            }
            const u32 mT = (u32)((0x100000000ull + T - 1u) / T);
            const u64 bd0 = (u64)row0 * T * 2u * bd, bn0 = (u64)row0 * T * bn;
            // Each warp codes the triplets of its own rows: no block barrier.
            __syncwarp();
            if (bd <= 4u && bn <= 3u) {
                // Small codebooks (b <= 3 splits): the bounds in registers, the
                // directions in shared memory.
                SeCount<15> ds;
                SeCount<7> ns;
                ds.load(sb, bd);
                ns.load(sb + nb0, bn);
                se_code_triplets<QJL>(xs, RS, lpr, nrows, T, mT, D, sdir, ds, ns, bd, bn, rounding, wd, wn, bd0, bn0, slut);
            } else {
                const float4* dirs = dir_smem ? sdir : reinterpret_cast<const float4*>(side);
                se_code_triplets<QJL>(xs, RS, lpr, nrows, T, mT, D, dirs, SeBisect{sb, bd}, SeBisect{sb + nb0, bn}, bd,
                                      bn, rounding, wd, wn, bd0, bn0, slut);
            }
            __syncthreads();
            // The word buffers out: words shared with a neighbouring block
            // (partly outside the block's bits) with atomics.
            const u64 bd1 = bd0 + (u64)nrows * T * 2u * bd, bn1 = bn0 + (u64)nrows * T * bn;
            for (u32 s = 0; s < 2u; s++) {
                const u64 lo = s == 0u ? bd0 : bn0, hi = s == 0u ? bd1 : bn1;
                const u32* src = s == 0u ? wd : wn;
                u32* dst = reinterpret_cast<u32*>(body + (s == 0u ? d.sec_index : d.sec_zero)) + (lo >> 5);
                const u32 nw = (u32)(((hi + 31u) >> 5) - (lo >> 5));
                for (u32 k = threadIdx.x; k < nw; k += BLOCK) {
                    const bool partial = (k == 0u && (lo & 31u)) || (k == nw - 1u && (hi & 31u));
                    if (partial) {
                        atomicOr(dst + k, src[k]);
                    } else {
                        dst[k] = src[k];
                    }
                }
            }
            if (QJL && live) {
#pragma unroll
                for (int i = 0; i < 32; i += 4) {
                    float4 q = *reinterpret_cast<const float4*>(mine + i);
                    v[i] = q.x;
                    v[i + 1] = q.y;
                    v[i + 2] = q.z;
                    v[i + 3] = q.w;
                }
            }
        }
    }
    if (QJL) {
        // gamma' of the residuals (staged above), then the sign bits of
        // w = H (s' ⊙ r).
        __syncthreads();
        if (threadIdx.x < nrows) {
            const float g = se_norm_fast(xs + threadIdx.x * RS, D);
            reinterpret_cast<u16*>(body + d.sec3)[row0 + threadIdx.x] = f32_to_f16(g);
        }
        if (t4) {
            // The lane's unit of residuals back from the staged row.
#pragma unroll
            for (int i = 0; i < 32; i += 4) {
                const float4 q = *reinterpret_cast<const float4*>(mine + i);
                v[i] = q.x;
                v[i + 1] = q.y;
                v[i + 2] = q.z;
                v[i + 3] = q.w;
            }
        }
        const u32 qs = *reinterpret_cast<const u32*>(se_signs(d, row, QJL) + (D >> 3) + 4u * j);
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = flip_if(v[i], (qs >> i) & 1u);
        wht<32>(v, D);
        u32 bits = 0;
#pragma unroll
        for (int i = 0; i < 32; i++) bits |= (v[i] < 0.0f ? 1u : 0u) << i;
        if (live) reinterpret_cast<u32*>(body + d.p3)[u] = bits;
    }
}

#define SE_ARGS const EncDesc *descs, const uint2 *work, u64 *status
// Blocks per SM the turbo and octopus kernels without QJL are compiled for:
// 4 x 256 threads (at most 64 registers each; 5 gives 48 registers with
// about 90 bytes of spills).
#ifndef SE_MIN_BLOCKS
#define SE_MIN_BLOCKS 4
#endif
extern "C" __global__ void __launch_bounds__(BLOCK, SE_MIN_BLOCKS) encode_sphere_turbo_b1_bf16(SE_ARGS) { sphere_encode_fast<SRC_BF16, false, false, 1>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_sphere_turbo_qjl_b1_bf16(SE_ARGS) { sphere_encode_fast<SRC_BF16, false, true, 1>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, SE_MIN_BLOCKS) encode_sphere_turbo_b2_bf16(SE_ARGS) { sphere_encode_fast<SRC_BF16, false, false, 2>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_sphere_turbo_qjl_b2_bf16(SE_ARGS) { sphere_encode_fast<SRC_BF16, false, true, 2>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, SE_MIN_BLOCKS) encode_sphere_turbo_b3_bf16(SE_ARGS) { sphere_encode_fast<SRC_BF16, false, false, 3>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_sphere_turbo_qjl_b3_bf16(SE_ARGS) { sphere_encode_fast<SRC_BF16, false, true, 3>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, SE_MIN_BLOCKS) encode_sphere_turbo_b4_bf16(SE_ARGS) { sphere_encode_fast<SRC_BF16, false, false, 4>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_sphere_turbo_qjl_b4_bf16(SE_ARGS) { sphere_encode_fast<SRC_BF16, false, true, 4>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, SE_MIN_BLOCKS) encode_sphere_turbo_b5_bf16(SE_ARGS) { sphere_encode_fast<SRC_BF16, false, false, 5>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_sphere_turbo_qjl_b5_bf16(SE_ARGS) { sphere_encode_fast<SRC_BF16, false, true, 5>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, SE_MIN_BLOCKS) encode_sphere_turbo_b6_bf16(SE_ARGS) { sphere_encode_fast<SRC_BF16, false, false, 6>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_sphere_turbo_qjl_b6_bf16(SE_ARGS) { sphere_encode_fast<SRC_BF16, false, true, 6>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, SE_MIN_BLOCKS) encode_sphere_oct_bf16(SE_ARGS) { sphere_encode_fast<SRC_BF16, true, false, 0>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_sphere_oct_qjl_bf16(SE_ARGS) { sphere_encode_fast<SRC_BF16, true, true, 0>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, SE_MIN_BLOCKS) encode_sphere_turbo_b1_f16(SE_ARGS) { sphere_encode_fast<SRC_F16, false, false, 1>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_sphere_turbo_qjl_b1_f16(SE_ARGS) { sphere_encode_fast<SRC_F16, false, true, 1>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, SE_MIN_BLOCKS) encode_sphere_turbo_b2_f16(SE_ARGS) { sphere_encode_fast<SRC_F16, false, false, 2>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_sphere_turbo_qjl_b2_f16(SE_ARGS) { sphere_encode_fast<SRC_F16, false, true, 2>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, SE_MIN_BLOCKS) encode_sphere_turbo_b3_f16(SE_ARGS) { sphere_encode_fast<SRC_F16, false, false, 3>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_sphere_turbo_qjl_b3_f16(SE_ARGS) { sphere_encode_fast<SRC_F16, false, true, 3>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, SE_MIN_BLOCKS) encode_sphere_turbo_b4_f16(SE_ARGS) { sphere_encode_fast<SRC_F16, false, false, 4>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_sphere_turbo_qjl_b4_f16(SE_ARGS) { sphere_encode_fast<SRC_F16, false, true, 4>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, SE_MIN_BLOCKS) encode_sphere_turbo_b5_f16(SE_ARGS) { sphere_encode_fast<SRC_F16, false, false, 5>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_sphere_turbo_qjl_b5_f16(SE_ARGS) { sphere_encode_fast<SRC_F16, false, true, 5>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, SE_MIN_BLOCKS) encode_sphere_turbo_b6_f16(SE_ARGS) { sphere_encode_fast<SRC_F16, false, false, 6>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_sphere_turbo_qjl_b6_f16(SE_ARGS) { sphere_encode_fast<SRC_F16, false, true, 6>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, SE_MIN_BLOCKS) encode_sphere_oct_f16(SE_ARGS) { sphere_encode_fast<SRC_F16, true, false, 0>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_sphere_oct_qjl_f16(SE_ARGS) { sphere_encode_fast<SRC_F16, true, true, 0>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, SE_MIN_BLOCKS) encode_sphere_turbo_b1_f32(SE_ARGS) { sphere_encode_fast<SRC_F32, false, false, 1>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_sphere_turbo_qjl_b1_f32(SE_ARGS) { sphere_encode_fast<SRC_F32, false, true, 1>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, SE_MIN_BLOCKS) encode_sphere_turbo_b2_f32(SE_ARGS) { sphere_encode_fast<SRC_F32, false, false, 2>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_sphere_turbo_qjl_b2_f32(SE_ARGS) { sphere_encode_fast<SRC_F32, false, true, 2>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, SE_MIN_BLOCKS) encode_sphere_turbo_b3_f32(SE_ARGS) { sphere_encode_fast<SRC_F32, false, false, 3>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_sphere_turbo_qjl_b3_f32(SE_ARGS) { sphere_encode_fast<SRC_F32, false, true, 3>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, SE_MIN_BLOCKS) encode_sphere_turbo_b4_f32(SE_ARGS) { sphere_encode_fast<SRC_F32, false, false, 4>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_sphere_turbo_qjl_b4_f32(SE_ARGS) { sphere_encode_fast<SRC_F32, false, true, 4>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, SE_MIN_BLOCKS) encode_sphere_turbo_b5_f32(SE_ARGS) { sphere_encode_fast<SRC_F32, false, false, 5>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_sphere_turbo_qjl_b5_f32(SE_ARGS) { sphere_encode_fast<SRC_F32, false, true, 5>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, SE_MIN_BLOCKS) encode_sphere_turbo_b6_f32(SE_ARGS) { sphere_encode_fast<SRC_F32, false, false, 6>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_sphere_turbo_qjl_b6_f32(SE_ARGS) { sphere_encode_fast<SRC_F32, false, true, 6>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, SE_MIN_BLOCKS) encode_sphere_oct_f32(SE_ARGS) { sphere_encode_fast<SRC_F32, true, false, 0>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_sphere_oct_qjl_f32(SE_ARGS) { sphere_encode_fast<SRC_F32, true, true, 0>(descs, work, status); }

// -------------------------------------------------------------- fallback

// One row per block of SEG_BLOCK threads (Grid::Rows), any D <= 4096.
template <int SRC>
__device__ __forceinline__ void sphere_encode_any(const EncDesc* __restrict__ descs, const uint2* __restrict__ work,
                                                  u64* status) {
    __shared__ float xs[SPHERE_ENC_MAX_D];
    __shared__ float sfac;
    const uint2 w = work[blockIdx.x];
    const EncDesc d = descs[w.x];
    const u32 D = d.head_dim, row = w.y;
    const u32 ba = d.p0 & 0xffu, bn = (d.p0 >> 8) & 0xffu, rounding = (d.p0 >> 16) & 0xffu;
    const bool oct = (d.p0 >> 24) & 1u, qjl = (d.p0 >> 25) & 1u;
    const u8* side = reinterpret_cast<const u8*>(d.side);
    const float* bounds = reinterpret_cast<const float*>(d.aux);
    u8* body = reinterpret_cast<u8*>(d.body);
    const u32 p = udiv(row, d.tokens, d.m_tokens);
    const u64 e0 = (u64)p * d.stride + (u64)(row - p * d.tokens) * D;
    const u8* src = reinterpret_cast<const u8*>(d.src);
    for (u32 i = threadIdx.x; i < D; i += blockDim.x) xs[i] = load_src1<SRC>(src, e0 + i);
    __syncthreads();
    if (threadIdx.x == 0) {
        float gamma = se_norm_flat(xs, D);
        reinterpret_cast<float*>(body + d.sec_scale)[row] = gamma;
        sfac = se_factor(gamma, __uint_as_float(d.p2), d, row, status, true);
    }
    const u8* signs = se_signs(d, row, qjl);
    __syncthreads();
    for (u32 i = threadIdx.x; i < D; i += blockDim.x) xs[i] = flip_if(xs[i], (signs[i >> 3] >> (i & 7u)) & 1u);
    __syncthreads();
    wht_shared(xs, D, D);
    const float f = sfac;
    for (u32 i = threadIdx.x; i < D; i += blockDim.x) xs[i] = f == 0.0f ? 0.0f : __fmul_rn(xs[i], f);
    __syncthreads();
    if (!oct) {
        const float* lut = reinterpret_cast<const float*>(side);
        u32* index = reinterpret_cast<u32*>(body + d.sec_index);
        for (u32 i = threadIdx.x; i < D; i += blockDim.x) {
            u32 c = se_search(bounds, ba, xs[i]);
            se_or_bits(index, ((u64)row * D + i) * ba, c, ba);
            if (qjl) xs[i] = __fsub_rn(xs[i], lut[c]);
        }
    } else {
        const u32 T = (D + 2u) / 3u;
        const float4* dirs = reinterpret_cast<const float4*>(side);
        const float* lut = reinterpret_cast<const float*>(side + (16u << (2u * ba)));
        for (u32 ti = threadIdx.x; ti < T; ti += blockDim.x) {
            float t[3];
            for (u32 k = 0; k < 3u; k++) t[k] = 3u * ti + k < D ? xs[3u * ti + k] : 0.0f;
            u32 a, b, jn;
            float4 n;
            se_triplet(t, dirs, SeBisect{bounds, ba}, SeBisect{bounds + (1u << ba), bn}, ba, rounding, a, b, jn, n);
            const u64 c = (u64)row * T + ti;
            se_or_bits(reinterpret_cast<u32*>(body + d.sec_index), c * 2u * ba, a | (b << ba), 2u * ba);
            se_or_bits(reinterpret_cast<u32*>(body + d.sec_zero), c * bn, jn, bn);
            if (qjl) {
                const float rho = lut[jn];
                const float nn[3] = {n.x, n.y, n.z};
                for (u32 k = 0; k < 3u; k++) {
                    if (3u * ti + k < D) xs[3u * ti + k] = __fsub_rn(t[k], __fmul_rn(nn[k], rho));
                }
            }
        }
    }
    if (!qjl) return;
    __syncthreads();
    if (threadIdx.x == 0) reinterpret_cast<u16*>(body + d.sec3)[row] = f32_to_f16(se_norm_flat(xs, D));
    __syncthreads();
    for (u32 i = threadIdx.x; i < D; i += blockDim.x)
        xs[i] = flip_if(xs[i], (signs[(D >> 3) + (i >> 3)] >> (i & 7u)) & 1u);
    __syncthreads();
    wht_shared(xs, D, D);
    u32* bits = reinterpret_cast<u32*>(body + d.p3);
    for (u32 i = threadIdx.x; i < D; i += blockDim.x) {
        if (xs[i] < 0.0f) se_or_bits(bits, (u64)row * D + i, 1u, 1u);
    }
}

extern "C" __global__ void __launch_bounds__(SEG_BLOCK) encode_sphere_any_bf16(SE_ARGS) { sphere_encode_any<SRC_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(SEG_BLOCK) encode_sphere_any_f16(SE_ARGS) { sphere_encode_any<SRC_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(SEG_BLOCK) encode_sphere_any_f32(SE_ARGS) { sphere_encode_any<SRC_F32>(descs, work, status); }
