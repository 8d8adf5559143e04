// HQMQ encode (format/codecs/hqmq.md "Encoding"), producing the CPU
// encoder's sections bit for bit, with or without outlier extraction
// (`+med{C}`, flag bit 31 of p3) and with or without per-channel gains
// (`+chan`, flag bit 30 of p3) or centring (`+ctr`, flag bits 30 and 29):
//
// `encode_hqmq_gains_{src}` (+chan and +ctr only): work item = (page,
// plane); per channel c of the plane, +chan: g_c = f16_ceil(max |x| over
// the page's tokens); +ctr: m_c = f16(sum_t x / tokens) (binary32 sum in
// token order, one thread per channel), g_c = f16_ceil(sqrt(max |x - m_c|));
// into SCALE stream 1 (the section after SCALE 0, at sec_scale + 64-aligned
// 2 * rows; +ctr: per plane the D gains, then the D offsets) and as f32
// into the page's scratch; every kernel below then reads x / g_c (+ctr:
// (x - m_c) / g_c; binary32; +0 where g_c = 0) instead of x, after the
// range check of the raw value.
// `encode_hqmq_med_{src}` (+med only): work item = (page, plane); the lower
// median of the plane's N = tokens * n_c chunk radii by a 4-pass radix
// select over their binary32 bit patterns (radii are >= +0, so the bit
// order is the value order), tau = f32(C) * med into the page header;
// plane 0 zeroes the page's outlier count.
// `encode_hqmq_{src}`: work item = up to RB rows of one plane of a page
// (p1, RB = max(1, 256 / n_c)); one chunk per thread and step:
//     range check (finite, |x| <= 65504), rho = sqrt(((x0*x0 + x1*x1) + x2*x2) + x3*x3)
//     sigma_r = f16_ceil(max rho over the row), step = f32(sigma) / L  (SCALE written here)
//     q = step == 0 ? 0 : rne(min(rho / step, L))
//     j = the smallest index among the largest binary32 scores
//         ((x0*C0 + x1*C1) + x2*C2) + x3*C3 over the 24 S joint codewords,
//         found through the cell index when the plan has one (p1 bit 31:
//         hqe_search_cells, a few candidates per chunk, gpu::hqmq_cells),
//         else (and for its fallbacks) by the fast exact search of
//         src/codec/hqmq/search.rs: the
//         best coset max(2 max|w_i|, sum |w_i|) of w = x conj(Q_s) over all
//         secondaries (shared memory, broadcast reads), the winner's best
//         and second-best unit, accepted when it leads by more than 2 eps,
//         eps = 2 max|x_i| 2^-17 + 1e-36; otherwise every coset within
//         4 eps is re-scored with the normative rule (joint codebook).
//     symbol v = j * 2^b + q into the page's scratch (u32 per chunk)
//     +med: chunks with rho > tau are outliers: not in the row maximum, not
//     searched, symbol 0xffffffff, counted into the page header.
// `encode_hqmq_compact_{src}` (+med only): work item = one page; a block
// scan over the chunk positions moves the inlier symbols to the front of
// the scratch (in place, in position order) and writes the OUTLIERS table
// (position list when 4 n_out <= ceil(n/8) bytes, else the bitmap; the
// chunk values rounded to fp16).
// `encode_hqmq_pack`: one thread per output word of INDEX 0 (the low E bits
// of each symbol) and INDEX 1 (W-bit groups N_g = sum h_{gG+t} O^t of the
// high digits h = v >> E), written whole (no atomics, padding bits zero);
// n_in = n - n_out symbols with +med.
//
// `encode_hqmq_cells` (plan time, once): the cell index's candidate lists.
//
// Side table: per kv head, S secondaries then 24 S joint codewords (float4);
// with p1 bit 31 then the cell region (gpu::hqmq_cells::region).
// EncDesc: sec_scale = SCALE, sec_index = INDEX 0, sec3 = INDEX 1,
// sec_zero = OUTLIERS (+med), aux = the page's scratch: u32 per chunk
// (n = rows * n_c), then with +med the page header at aux + 4 n: u32 n_out,
// f32 C, f32 tau per plane, then with +chan the gains (f32, planes * D;
// +ctr: per plane D gains then D offsets);
// side = the tensor's codebooks; p0 = S, p1 =
// rows per work item (RB) | cells << 31, p2 = b | E << 8 | G << 16 | W << 24, p3 = O |
// ctr << 29 | (chan or ctr) << 30 | med << 31. With +med the body is the worst-case layout (INDEX streams for
// n chunks, OUTLIERS for n_cap = planes * floor(N / 2) outliers, the most
// a lower median with C >= 1 allows); the host cuts the sections to n_out
// (gpu::encplan).

// Secondaries kept in shared memory (larger S: read through L1). Small, so
// that the static shared memory does not limit the blocks per SM.
#define HQE_MAX_SMEM_S 256
// Chunk radii of a page plane the median kernel keeps in shared memory
// (more: recomputed from the source in every pass).
#define HQE_MED_SMEM 8192
#define F16_MAX_F 65504.0f
#define RNE_MAGIC_F 12582912.0f
#define HQE_OUTLIER 0xffffffffu
// Positions per thread per tile of the compaction kernel.
#define HQE_CPT 16

template <int SRC>
__device__ __forceinline__ float4 hqe_load4(const u8* src, u64 e) {
    if (SRC == SRC_F32) {
        return __ldg(reinterpret_cast<const float4*>(src + 4 * e));
    }
    uint2 a = __ldg(reinterpret_cast<const uint2*>(src + 2 * e));
    float4 v;
    if (SRC == SRC_BF16) {
        v.x = bf16_to_f32((u16)(a.x & 0xffffu));
        v.y = bf16_to_f32((u16)(a.x >> 16));
        v.z = bf16_to_f32((u16)(a.y & 0xffffu));
        v.w = bf16_to_f32((u16)(a.y >> 16));
    } else {
        v.x = f16_to_f32((u16)(a.x & 0xffffu));
        v.y = f16_to_f32((u16)(a.x >> 16));
        v.z = f16_to_f32((u16)(a.y & 0xffffu));
        v.w = f16_to_f32((u16)(a.y >> 16));
    }
    return v;
}

// The chunk radius sqrt(((x0*x0 + x1*x1) + x2*x2) + x3*x3), no fused multiply-add.
__device__ __forceinline__ float hqe_rho(float4 x) {
    return __fsqrt_rn(__fadd_rn(
        __fadd_rn(__fadd_rn(__fmul_rn(x.x, x.x), __fmul_rn(x.y, x.y)), __fmul_rn(x.z, x.z)),
        __fmul_rn(x.w, x.w)));
}

// w = x * conj(q) (approximate: fused multiply-adds; the margin covers it).
__device__ __forceinline__ float4 hqe_rotate(float4 x, float4 q) {
    float4 w;
    w.x = __fmaf_rn(x.w, q.w, __fmaf_rn(x.z, q.z, __fmaf_rn(x.y, q.y, __fmul_rn(x.x, q.x))));
    w.y = __fmaf_rn(x.w, q.z, __fmaf_rn(-x.z, q.w, __fmaf_rn(-x.x, q.y, __fmul_rn(x.y, q.x))));
    w.z = __fmaf_rn(-x.w, q.y, __fmaf_rn(x.y, q.w, __fmaf_rn(-x.x, q.z, __fmul_rn(x.z, q.x))));
    w.w = __fmaf_rn(x.z, q.y, __fmaf_rn(-x.y, q.z, __fmaf_rn(-x.x, q.w, __fmul_rn(x.w, q.x))));
    return w;
}

// Twice the coset maximum: max(2 max|w_i|, (|w0| + |w1|) + (|w2| + |w3|)).
__device__ __forceinline__ float hqe_group2(float4 w) {
    float a0 = fabsf(w.x), a1 = fabsf(w.y), a2 = fabsf(w.z), a3 = fabsf(w.w);
    float m = fmaxf(fmaxf(a0, a1), fmaxf(a2, a3));
    float s = __fadd_rn(__fadd_rn(a0, a1), __fadd_rn(a2, a3));
    return fmaxf(__fadd_rn(m, m), s);
}

// The normative score ((x0*c0 + x1*c1) + x2*c2) + x3*c3, no fused multiply-add.
__device__ __forceinline__ float hqe_dot(float4 x, float4 c) {
    return __fadd_rn(__fadd_rn(__fadd_rn(__fmul_rn(x.x, c.x), __fmul_rn(x.y, c.y)), __fmul_rn(x.z, c.z)),
                     __fmul_rn(x.w, c.w));
}

// The direction index of chunk x (src/codec/hqmq/search.rs, `search` +
// `finish`), equal to the exhaustive normative search.
__device__ __forceinline__ u32 hqe_search(float4 x, const float4* sec, const float4* joint, u32 S) {
    float b = __int_as_float(0xff800000), b2 = b;
    u32 s1 = 0;
    for (u32 s = 0; s < S; s++) {
        float sc = hqe_group2(hqe_rotate(x, sec[s]));
        b2 = fmaxf(b2, fminf(b, sc));
        if (sc > b) {
            b = sc;
            s1 = s;
        }
    }
    float xm = fmaxf(fmaxf(fabsf(x.x), fabsf(x.y)), fmaxf(fabsf(x.z), fabsf(x.w)));
    float r = __fmul_rn(2.0f, xm);
    if (r == 0.0f) return 0;
    float eps = __fadd_rn(__fmul_rn(r, 1.0f / 131072.0f), 1e-36f);
    float4 w = hqe_rotate(x, sec[s1]);
    float a[4] = {fabsf(w.x), fabsf(w.y), fabsf(w.z), fabsf(w.w)};
    u32 i1 = 0;
#pragma unroll
    for (u32 i = 1; i < 4; i++)
        if (a[i] > a[i1]) i1 = i;
    float m1 = a[i1], m2 = __int_as_float(0xff800000);
#pragma unroll
    for (u32 i = 0; i < 4; i++)
        if (i != i1) m2 = fmaxf(m2, a[i]);
    float h1 = __fmul_rn(__fadd_rn(__fadd_rn(a[0], a[1]), __fadd_rn(a[2], a[3])), 0.5f);
    float h2 = __fsub_rn(h1, fminf(fminf(a[0], a[1]), fminf(a[2], a[3])));
    float wv[4] = {w.x, w.y, w.z, w.w};
    u32 p;
    float v1;
    if (m1 >= h1) {
        v1 = m1;
        p = 2u * i1 + (__float_as_uint(wv[i1]) >> 31);
    } else {
        v1 = h1;
        p = 8u + (__float_as_uint(w.x) >> 31) + 2u * (__float_as_uint(w.y) >> 31) +
            4u * (__float_as_uint(w.z) >> 31) + 8u * (__float_as_uint(w.w) >> 31);
    }
    float v2 = fmaxf(fmaxf(fminf(m1, h1), m2), h2);
    if (__fsub_rn(v1, fmaxf(__fmul_rn(b2, 0.5f), v2)) > __fmul_rn(2.0f, eps)) return p * S + s1;
    // Near-tie: the normative rule over every coset within 4 eps.
    float floor_ = __fsub_rn(v1, __fmul_rn(4.0f, eps));
    float best = __int_as_float(0xff800000);
    u32 arg = 0xffffffffu;
    for (u32 s = 0; s < S; s++) {
        if (__fmul_rn(hqe_group2(hqe_rotate(x, sec[s])), 0.5f) < floor_) continue;
        for (u32 q = 0; q < 24u; q++) {
            u32 jj = q * S + s;
            float sc = hqe_dot(x, __ldg(joint + jj));
            if (sc > best || (sc == best && jj < arg)) {
                best = sc;
                arg = jj;
            }
        }
    }
    return arg;
}

// ---- Cell index (gpu::hqmq_cells; must match its constants) ----------------
#define HQC_CAP 32
#define HQC_OVERFLOW 0xffffu
#define HQC_BOX_SLACK 2e-4
#define HQC_SCORE_SLACK 1e-5

// Byte offsets in the cell region: u32 g, u32 cells, 8 bytes, u8 unit
// products [24][24], u32 columns [g * g] (padded to 16 bytes), u16 lists.
#define HQC_MUL 16u
#define HQC_COLS 592u
__device__ __forceinline__ u32 hqc_lists_at(u32 g) { return (HQC_COLS + 4u * g * g + 15u) & ~15u; }

// The direction index through the cell index (gpu::hqmq_cells docs): the
// nearest unit P of x, y = conj(P) x, the cell of t = y_{1,2,3} / y_0,
// and the normative score over the cell's candidates P * P_p' * Q_s.
// Falls back to hqe_search for tiny chunks, t off the grid and overfull
// cells. `mul` is the unit product table (shared memory).
__device__ __forceinline__ u32 hqe_search_cells(float4 x, const float4* sec, const float4* joint, u32 S,
                                                const u32* cols, const u16* lists, const u8* mul, u32 g) {
    float a0 = fabsf(x.x), a1 = fabsf(x.y), a2 = fabsf(x.z), a3 = fabsf(x.w);
    float xm = fmaxf(fmaxf(a0, a1), fmaxf(a2, a3));
    // 2^-100: no underflow in the scores of a larger chunk matters.
    if (!(xm >= 7.888609e-31f)) return hqe_search(x, sec, joint, S);
    float h1 = __fmul_rn(__fadd_rn(__fadd_rn(a0, a1), __fadd_rn(a2, a3)), 0.5f);
    u32 i1 = a1 > a0 ? 1u : 0u;
    float m1 = fmaxf(a0, a1);
    if (a2 > m1) { i1 = 2u; m1 = a2; }
    if (a3 > m1) { i1 = 3u; m1 = a3; }
    float4 P;
    u32 ps;
    if (m1 >= h1) {
        float xv = i1 == 0u ? x.x : i1 == 1u ? x.y : i1 == 2u ? x.z : x.w;
        float sg = xv < 0.0f ? -1.0f : 1.0f;
        P = make_float4(i1 == 0u ? sg : 0.0f, i1 == 1u ? sg : 0.0f, i1 == 2u ? sg : 0.0f, i1 == 3u ? sg : 0.0f);
        ps = 2u * i1 + (xv < 0.0f ? 1u : 0u);
    } else {
        P = make_float4(x.x < 0.0f ? -0.5f : 0.5f, x.y < 0.0f ? -0.5f : 0.5f, x.z < 0.0f ? -0.5f : 0.5f,
                        x.w < 0.0f ? -0.5f : 0.5f);
        ps = 8u + (x.x < 0.0f ? 1u : 0u) + (x.y < 0.0f ? 2u : 0u) + (x.z < 0.0f ? 4u : 0u) + (x.w < 0.0f ? 8u : 0u);
    }
    // y = conj(P) x (Hamilton product; rounding is covered by the slacks).
    float y0 = P.x * x.x + P.y * x.y + P.z * x.z + P.w * x.w;
    float y1 = P.x * x.y - P.y * x.x - P.z * x.w + P.w * x.z;
    float y2 = P.x * x.z + P.y * x.w - P.z * x.x - P.w * x.y;
    float y3 = P.x * x.w - P.y * x.z + P.z * x.y - P.w * x.x;
    float inv = 1.0f / y0;
    float t1 = y1 * inv, t2 = y2 * inv, t3 = y3 * inv;
    if (!(fabsf(t1) <= 1.0001f && fabsf(t2) <= 1.0001f && fabsf(t3) <= 1.0001f)) return hqe_search(x, sec, joint, S);
    float half = 0.5f * (float)g;
    u32 k1 = min(g - 1u, (u32)fmaxf(0.0f, (t1 + 1.0f) * half));
    u32 k2 = min(g - 1u, (u32)fmaxf(0.0f, (t2 + 1.0f) * half));
    u32 k3 = min(g - 1u, (u32)fmaxf(0.0f, (t3 + 1.0f) * half));
    u32 col = __ldg(cols + k1 * g + k2);
    u32 lo = (col >> 20) & 63u, hi = col >> 26;
    if (k3 < lo || k3 > hi) return hqe_search(x, sec, joint, S);
    const u16* L = lists + (u64)((col & 0xfffffu) + k3 - lo) * HQC_CAP;
    u32 cnt = __ldg(L);
    if (cnt >= HQC_CAP) return hqe_search(x, sec, joint, S);
    float best = __int_as_float(0xff800000);
    u32 arg = 0xffffffffu;
    const u8* mrow = mul + 24u * ps;
    for (u32 i = 1; i <= cnt; i++) {
        u32 e = __ldg(L + i);
        u32 jj = (u32)mrow[e >> 11] * S + (e & 2047u);
        float sc = hqe_dot(x, __ldg(joint + jj));
        if (sc > best || (sc == best && jj < arg)) {
            best = sc;
            arg = jj;
        }
    }
    return arg;
}

// Builds the candidate lists (gpu::hqmq_cells docs): work item (0, first
// grid box over all kv heads), one box (k1, k2, k3) of one head per thread.
__device__ __forceinline__ void hqmq_cells(const EncDesc* __restrict__ descs, const uint2* __restrict__ work) {
    const uint2 w = work[blockIdx.x];
    const EncDesc d = descs[w.x];
    const u32 S = d.p0;
    const u8* reg = reinterpret_cast<const u8*>(d.side) + (u64)d.heads * 25u * S * 16u;
    const u32 g = reinterpret_cast<const u32*>(reg)[0];
    const u32* cols = reinterpret_cast<const u32*>(reg + HQC_COLS);
    u16* lists = reinterpret_cast<u16*>(const_cast<u8*>(reg) + hqc_lists_at(g));
    const u32 cells = reinterpret_cast<const u32*>(reg)[1];
    const u32 gc = w.y + threadIdx.x, g3 = g * g * g;
    if (gc >= d.heads * g3) return;
    const u32 head = gc / g3, b = gc - head * g3;
    const u32 k1 = b / (g * g), k2 = (b / g) % g, k3 = b % g;
    const u32 col = cols[k1 * g + k2];
    const u32 lo = (col >> 20) & 63u, hi = col >> 26;
    if (k3 < lo || k3 > hi) return;
    u16* L = lists + ((u64)head * cells + (col & 0xfffffu) + k3 - lo) * HQC_CAP;
    const float4* joint = reinterpret_cast<const float4*>(d.side) + (u64)head * 25u * S + S;
    double blo[3], bhi[3], c[4];
    const u32 ks[3] = {k1, k2, k3};
    for (int i = 0; i < 3; i++) {
        blo[i] = -1.0 + 2.0 * (double)ks[i] / (double)g - HQC_BOX_SLACK;
        bhi[i] = -1.0 + 2.0 * (double)(ks[i] + 1u) / (double)g + HQC_BOX_SLACK;
    }
    c[0] = 1.0;
    for (int i = 0; i < 3; i++) c[i + 1] = 0.5 * (blo[i] + bhi[i]);
    double cn = sqrt(c[0] * c[0] + c[1] * c[1] + c[2] * c[2] + c[3] * c[3]);
    for (int i = 0; i < 4; i++) c[i] /= cn;
    double r = 0.0;
    for (u32 m = 0; m < 8u; m++) {
        double v[4] = {1.0, (m & 1u) ? bhi[0] : blo[0], (m & 2u) ? bhi[1] : blo[1], (m & 4u) ? bhi[2] : blo[2]};
        double vn = sqrt(v[0] * v[0] + v[1] * v[1] + v[2] * v[2] + v[3] * v[3]);
        double dc = (c[0] * v[0] + c[1] * v[1] + c[2] * v[2] + c[3] * v[3]) / vn;
        r = fmax(r, acos(fmin(1.0, dc)));
    }
    r += 1e-9;
    const u32 n = 24u * S;
    double d0 = -2.0;
    for (u32 k = 0; k < n; k++) {
        float4 q = joint[k];
        double qn = sqrt((double)q.x * q.x + (double)q.y * q.y + (double)q.z * q.z + (double)q.w * q.w);
        double dk = (c[0] * q.x + c[1] * q.y + c[2] * q.z + c[3] * q.w) / qn;
        d0 = fmax(d0, dk);
    }
    const double pi = 3.141592653589793;
    double A = cos(fmin(pi, acos(fmin(1.0, d0)) + r)) - HQC_SCORE_SLACK;
    if (A <= -1.0) {
        L[0] = (u16)HQC_OVERFLOW;
        return;
    }
    double T = cos(fmin(pi, acos(A) + r));
    u32 cnt = 0;
    for (u32 k = 0; k < n; k++) {
        float4 q = joint[k];
        double qn = sqrt((double)q.x * q.x + (double)q.y * q.y + (double)q.z * q.z + (double)q.w * q.w);
        double dk = (c[0] * q.x + c[1] * q.y + c[2] * q.z + c[3] * q.w) / qn;
        if (dk >= T) {
            if (cnt + 1u < HQC_CAP) L[1u + cnt] = (u16)((k / S) << 11 | (k % S));
            cnt++;
        }
    }
    L[0] = (u16)(cnt + 1u < HQC_CAP ? cnt : HQC_OVERFLOW);
}

// The smallest f16 >= v (v >= 0 finite), as bits; >= 0x7c00 when above the range.
__device__ __forceinline__ u32 hqe_f16_ceil(float v) {
    u32 h = f32_to_f16(v);
    if (f16_to_f32((u16)h) < v) h++;
    return h;
}

// +chan / +ctr: the page's f32 side row of `plane` (scratch after the
// symbols and the +med header): D gains, then with +ctr D offsets.
__device__ __forceinline__ float* hqe_gains(const EncDesc& d, u32 nc, u32 plane) {
    const u32 planes = d.rows / d.tokens;
    const u32 per = ((d.p3 >> 29) & 1u) ? 8u * nc : 4u * nc;
    return reinterpret_cast<float*>(d.aux) + (u64)d.rows * nc + ((d.p3 >> 31) ? 2u + planes : 0u) +
           (u64)plane * per;
}

// The channel treatment of chunk c of a row whose plane's side row is g
// (hqe_gains): x / g (+chan) or (x - m) / g (+ctr, m = g[D + ...]) per
// element, +0 where g = 0; x itself without either.
__device__ __forceinline__ float4 hqe_chan4(float4 x, const EncDesc& d, const float* row, u32 c) {
    if (!((d.p3 >> 30) & 1u)) return x;
    const float* g = row + 4u * c;
    if ((d.p3 >> 29) & 1u) {
        const float* m = g + d.head_dim;
        x.x = __fsub_rn(x.x, m[0]);
        x.y = __fsub_rn(x.y, m[1]);
        x.z = __fsub_rn(x.z, m[2]);
        x.w = __fsub_rn(x.w, m[3]);
    }
    x.x = g[0] > 0.0f ? __fdiv_rn(x.x, g[0]) : 0.0f;
    x.y = g[1] > 0.0f ? __fdiv_rn(x.y, g[1]) : 0.0f;
    x.z = g[2] > 0.0f ? __fdiv_rn(x.z, g[2]) : 0.0f;
    x.w = g[3] > 0.0f ? __fdiv_rn(x.w, g[3]) : 0.0f;
    return x;
}

// +chan / +ctr, work item (page, plane): the plane's channel gains and
// (+ctr) offsets (header comment). A value outside the fp16 range gives the
// largest fp16 gain (65504, as the CPU); the search kernel reports the value.
template <int SRC>
__device__ __forceinline__ void hqmq_gains(const EncDesc* __restrict__ descs, const uint2* __restrict__ work) {
    const uint2 w = work[blockIdx.x];
    const EncDesc d = descs[w.x];
    const u32 plane = w.y, D = d.head_dim;
    const bool ctr = ((d.p3 >> 29) & 1u) != 0;
    const u8* src = reinterpret_cast<const u8*>(d.src) + (SRC == SRC_F32 ? 4u : 2u) * ((u64)plane * d.stride);
    float* gf = hqe_gains(d, D >> 2, plane);
    u16* gh = reinterpret_cast<u16*>(reinterpret_cast<u8*>(d.body) + d.sec_scale + ((2u * d.rows + 63u) & ~63u)) +
              (u64)plane * (ctr ? 2u : 1u) * D;
    auto load = [&](u32 t, u32 c) -> float {
        if (SRC == SRC_F32) return __ldg(reinterpret_cast<const float*>(src) + (u64)t * D + c);
        u16 h = __ldg(reinterpret_cast<const u16*>(src) + (u64)t * D + c);
        return SRC == SRC_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
    };
    for (u32 c = threadIdx.x; c < D; c += BLOCK) {
        float mean = 0.0f;
        if (ctr) {
            // Binary32 sum in token order, then the fp16 mean.
            float sum = 0.0f;
            for (u32 t = 0; t < d.tokens; t++) sum = __fadd_rn(sum, load(t, c));
            u16 mh = f32_to_f16(__fdiv_rn(sum, (float)d.tokens));
            mean = f16_to_f32(mh);
            gh[D + c] = mh;
            gf[D + c] = mean;
        }
        float m = 0.0f;
        for (u32 t = 0; t < d.tokens; t++) {
            float v = load(t, c);
            m = fmaxf(m, fabsf(ctr ? __fsub_rn(v, mean) : v));
        }
        u32 h = hqe_f16_ceil(ctr ? __fsqrt_rn(m) : m);
        if (h >= 0x7c00u) h = 0x7bffu;
        gh[c] = (u16)h;
        gf[c] = f16_to_f32((u16)h);
    }
}

template <int SRC>
__device__ __forceinline__ void hqmq_encode(const EncDesc* __restrict__ descs,
                                            const uint2* __restrict__ work, u64* status) {
    __shared__ __align__(16) float4 ssec[HQE_MAX_SMEM_S];
    __shared__ u32 rmax[BLOCK];
    __shared__ float rstep[BLOCK];
    __shared__ u32 nout;
    __shared__ u8 smul[576];
    const uint2 w = work[blockIdx.x];
    const EncDesc d = descs[w.x];
    const u32 tid = threadIdx.x;
    const u32 S = d.p0, RB = d.p1 & 0xffffu, b = d.p2 & 0xffu;
    const bool med = (d.p3 >> 31) != 0, cells = (d.p1 >> 31) != 0;
    const u32 D = d.head_dim, nc = D >> 2;
    // The item: rows [r0, r0 + nr) of one plane (the host cuts items at
    // plane ends), so one kv head and one codebook.
    const u32 r0 = w.y;
    const u32 plane = udiv(r0, d.tokens, d.m_tokens);
    const u32 nr = min(RB, (plane + 1u) * d.tokens - r0), npos = nr * nc;
    const u32 t0 = r0 - plane * d.tokens;
    const float L = (float)((1u << b) - 1u);
    const u8* src = reinterpret_cast<const u8*>(d.src) + (SRC == SRC_F32 ? 4u : 2u) * ((u64)plane * d.stride + (u64)t0 * D);
    u8* body = reinterpret_cast<u8*>(d.body);
    u32* scratch = reinterpret_cast<u32*>(d.aux);
    u32* hdr = scratch + (u64)d.rows * nc;
    const float* gains = hqe_gains(d, nc, plane);
    // Without +med no chunk is an outlier (rho > inf is false, NaN included).
    const float tau = med ? __uint_as_float(hdr[2u + plane]) : __int_as_float(0x7f800000);
    const float4* gsec = reinterpret_cast<const float4*>(d.side) + (u64)(plane % d.heads) * 25u * S;
    const float4* joint = gsec + S;
    const bool smem = S <= HQE_MAX_SMEM_S;
    if (smem) {
        for (u32 i = tid; i < S; i += BLOCK) ssec[i] = __ldg(gsec + i);
    }
    // The cell index after every head's codebooks (gpu::hqmq_cells).
    const u8* reg = reinterpret_cast<const u8*>(d.side) + (u64)d.heads * 25u * S * 16u;
    const u32 g = cells ? reinterpret_cast<const u32*>(reg)[0] : 0u;
    const u32* cols = reinterpret_cast<const u32*>(reg + HQC_COLS);
    const u16* lists = reinterpret_cast<const u16*>(reg + hqc_lists_at(g)) +
                       (cells ? (u64)(plane % d.heads) * reinterpret_cast<const u32*>(reg)[1] * HQC_CAP : 0u);
    if (cells) {
        for (u32 i = tid; i < 576u; i += BLOCK) smul[i] = reg[HQC_MUL + i];
    }
    for (u32 i = tid; i < nr; i += BLOCK) rmax[i] = 0;
    if (tid == 0) nout = 0;
    __syncthreads();
    const float4* sec = smem ? ssec : gsec;
    // Pass 1: radii, row maxima over the inliers, range check.
    for (u32 i = tid; i < npos; i += BLOCK) {
        u32 rl = i / nc;
        float4 x = hqe_load4<SRC>(src, (u64)i * 4u);
        bool ok = fabsf(x.x) <= F16_MAX_F && fabsf(x.y) <= F16_MAX_F && fabsf(x.z) <= F16_MAX_F &&
                  fabsf(x.w) <= F16_MAX_F;
        if (!ok) atomicMin(status, ((u64)d.page << 32) | (r0 + rl));
        x = hqe_chan4(x, d, gains, i - rl * nc);
        float rho = hqe_rho(x);
        if (ok && !(rho > tau)) atomicMax(&rmax[rl], __float_as_uint(rho));
    }
    __syncthreads();
    for (u32 rl = tid; rl < nr; rl += BLOCK) {
        u32 h = hqe_f16_ceil(__uint_as_float(rmax[rl]));
        if (h >= 0x7c00u) atomicMin(status, ((u64)d.page << 32) | (r0 + rl));
        reinterpret_cast<u16*>(body + d.sec_scale)[r0 + rl] = (u16)h;
        rstep[rl] = __fdiv_rn(f16_to_f32((u16)h), L);
    }
    __syncthreads();
    // Pass 2: radius levels and directions (outliers: a marker).
    u32 mine = 0;
    for (u32 i = tid; i < npos; i += BLOCK) {
        u32 rl = i / nc;
        float4 x = hqe_load4<SRC>(src, (u64)i * 4u);
        x = hqe_chan4(x, d, gains, i - rl * nc);
        float rho = hqe_rho(x);
        if (rho > tau) {
            scratch[(u64)r0 * nc + i] = HQE_OUTLIER;
            mine++;
            continue;
        }
        float step = rstep[rl];
        u32 q = 0;
        if (step != 0.0f) {
            float tq = fminf(__fdiv_rn(rho, step), L);
            q = __float_as_uint(__fadd_rn(tq, RNE_MAGIC_F)) - 0x4b400000u;
        }
        u32 j = cells ? hqe_search_cells(x, sec, joint, S, cols, lists, smul, g) : hqe_search(x, sec, joint, S);
        scratch[(u64)r0 * nc + i] = (j << b) | q;
    }
    if (med) {
        if (mine) atomicAdd(&nout, mine);
        __syncthreads();
        if (tid == 0 && nout) atomicAdd(hdr, nout);
    }
}

#define HQE_ARGS const EncDesc *descs, const uint2 *work, u64 *status
// Six blocks of BLOCK threads per SM (at most 40 registers). The search is
// latency-bound (dependent loads of the cell column, list and codewords),
// so occupancy pays: without the bound the driver's JIT gave this kernel
// 64 registers (four blocks per SM), in one build 128 (two); 5 and 8
// blocks per SM measured slower than 6 (tests/benches/gpu.md, ninth
// session).
#define HQE_MIN_BLOCKS 6
extern "C" __global__ void __launch_bounds__(BLOCK, HQE_MIN_BLOCKS) encode_hqmq_bf16(HQE_ARGS) { hqmq_encode<SRC_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, HQE_MIN_BLOCKS) encode_hqmq_f16(HQE_ARGS) { hqmq_encode<SRC_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, HQE_MIN_BLOCKS) encode_hqmq_f32(HQE_ARGS) { hqmq_encode<SRC_F32>(descs, work, status); }

// +med, work item (page, plane): tau = f32(C) * the lower median (rank
// floor((N - 1) / 2), N = tokens * n_c) of the plane's chunk radii.
template <int SRC>
__device__ __forceinline__ void hqmq_median(const EncDesc* __restrict__ descs, const uint2* __restrict__ work) {
    __shared__ u32 hist[256];
    __shared__ u32 pick[2];
    __shared__ u32 rad[HQE_MED_SMEM];
    const uint2 w = work[blockIdx.x];
    const EncDesc d = descs[w.x];
    const u32 tid = threadIdx.x, plane = w.y;
    const u32 nc = d.head_dim >> 2, N = d.tokens * nc;
    const u8* src = reinterpret_cast<const u8*>(d.src) + (SRC == SRC_F32 ? 4u : 2u) * ((u64)plane * d.stride);
    u32* hdr = reinterpret_cast<u32*>(d.aux) + (u64)d.rows * nc;
    const float* gains = hqe_gains(d, nc, plane);
    if (plane == 0 && tid == 0) hdr[0] = 0;
    u32 prefix = 0, mask = 0, k = (N - 1u) / 2u;
    const bool cached = N <= HQE_MED_SMEM;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (u32 i = tid; i < 256u; i += BLOCK) hist[i] = 0;
        __syncthreads();
        // Chunk i of the plane is elements 4i .. 4i + 3 (rows are contiguous).
        for (u32 i = tid; i < N; i += BLOCK) {
            u32 v;
            if (cached && shift != 24) {
                v = rad[i];
            } else {
                float4 x = hqe_load4<SRC>(src, (u64)i * 4u);
                x = hqe_chan4(x, d, gains, i % nc);
                v = __float_as_uint(hqe_rho(x));
                if (cached) rad[i] = v;
            }
            if ((v & mask) == prefix) atomicAdd(&hist[(v >> shift) & 0xffu], 1u);
        }
        __syncthreads();
        if (tid == 0) {
            u32 cum = 0, sel = 255;
            for (u32 bin = 0; bin < 256u; bin++) {
                if (k < cum + hist[bin]) {
                    sel = bin;
                    break;
                }
                cum += hist[bin];
            }
            pick[0] = sel;
            pick[1] = k - cum;
        }
        __syncthreads();
        prefix |= pick[0] << shift;
        mask |= 0xffu << shift;
        k = pick[1];
        __syncthreads();
    }
    if (tid == 0) hdr[2u + plane] = __float_as_uint(__fmul_rn(__uint_as_float(hdr[1]), __uint_as_float(prefix)));
}

// +med, work item (page, 0): compaction of the inlier symbols and the
// OUTLIERS table (file header comment).
template <int SRC>
__device__ __forceinline__ void hqmq_compact(const EncDesc* __restrict__ descs, const uint2* __restrict__ work,
                                             u64* status) {
    __shared__ u32 scan[BLOCK];
    __shared__ u32 base[2];
    const uint2 w = work[blockIdx.x];
    const EncDesc d = descs[w.x];
    const u32 tid = threadIdx.x;
    const u32 D = d.head_dim, nc = D >> 2, n = d.rows * nc;
    const u32 planes = d.rows / d.tokens, cap = planes * (d.tokens * nc / 2u);
    u32* sym = reinterpret_cast<u32*>(d.aux);
    const u32 n_out = sym[n];
    u8* tab = reinterpret_cast<u8*>(d.body) + d.sec_zero;
    if (n_out > cap) {
        // Impossible with C >= 1 and a finite page (NaN was reported).
        atomicMin(status, (u64)d.page << 32);
        return;
    }
    const u32 bitmap_len = (n + 7u) / 8u;
    const bool list = 4u * n_out <= bitmap_len;
    const u32 pos_len = list ? 4u * n_out : bitmap_len;
    u8* vals = tab + 12u + pos_len;
    if (tid == 0) {
        reinterpret_cast<u32*>(tab)[0] = n_out;
        reinterpret_cast<u32*>(tab)[1] = 4u | (list ? 0u : 1u) << 8;
        reinterpret_cast<u32*>(tab)[2] = n;
        base[0] = 0;
        base[1] = 0;
    }
    const u8* src0 = reinterpret_cast<const u8*>(d.src);
    const u32 esz = SRC == SRC_F32 ? 4u : 2u;
    for (u32 tile = 0; tile < n; tile += BLOCK * HQE_CPT) {
        const u32 p0 = tile + tid * HQE_CPT;
        const u32 cnt = p0 < n ? min((u32)HQE_CPT, n - p0) : 0u;
        u32 v[HQE_CPT];
        u32 outs = 0, bits = 0;
#pragma unroll
        for (u32 j = 0; j < HQE_CPT; j++) {
            v[j] = j < cnt ? sym[p0 + j] : 0u;
            if (j < cnt && v[j] == HQE_OUTLIER) {
                outs++;
                bits |= 1u << j;
            }
        }
        scan[tid] = outs;
        __syncthreads();
        // Inclusive scan of the outlier counts (Hillis-Steele).
        for (u32 off = 1; off < BLOCK; off <<= 1) {
            u32 add = tid >= off ? scan[tid - off] : 0u;
            __syncthreads();
            scan[tid] += add;
            __syncthreads();
        }
        const u32 o_before = scan[tid] - outs;
        const u32 bo = base[0], bi = base[1];
        u32 ko = bo + o_before, ki = bi + (tid * HQE_CPT - o_before);
        // Every thread has read its symbols and the bases: writes may go.
        __syncthreads();
        for (u32 j = 0; j < cnt; j++) {
            u32 u = p0 + j;
            if (v[j] != HQE_OUTLIER) {
                sym[ki++] = v[j];
                continue;
            }
            if (ko >= cap) break;
            if (list) reinterpret_cast<u32*>(tab + 12u)[ko] = u;
            u32 r = u / nc, c = u - r * nc;
            u32 pl = r / d.tokens, t = r - pl * d.tokens;
            float4 x = hqe_load4<SRC>(src0 + esz * ((u64)pl * d.stride + (u64)t * D), (u64)c * 4u);
            x = hqe_chan4(x, d, hqe_gains(d, nc, pl), c);
            u16 h[4] = {f32_to_f16(x.x), f32_to_f16(x.y), f32_to_f16(x.z), f32_to_f16(x.w)};
            u8* o = vals + 8u * ko;
#pragma unroll
            for (u32 m = 0; m < 4u; m++) {
                o[2u * m] = (u8)(h[m] & 0xffu);
                o[2u * m + 1u] = (u8)(h[m] >> 8);
            }
            ko++;
        }
        if (!list && cnt) {
            // HQE_CPT = 16 positions from a multiple of 16: two bitmap bytes.
            u32 at = p0 / 8u;
            tab[12u + at] = (u8)(bits & 0xffu);
            if (at + 1u < bitmap_len) tab[12u + at + 1u] = (u8)(bits >> 8);
        }
        if (tid == BLOCK - 1u) {
            base[0] = bo + scan[tid];
            base[1] = bi + (min((u32)(BLOCK * HQE_CPT), n - tile) - scan[tid]);
        }
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK) encode_hqmq_cells(HQE_ARGS) { (void)status; hqmq_cells(descs, work); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_hqmq_gains_bf16(HQE_ARGS) { (void)status; hqmq_gains<SRC_BF16>(descs, work); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_hqmq_gains_f16(HQE_ARGS) { (void)status; hqmq_gains<SRC_F16>(descs, work); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_hqmq_gains_f32(HQE_ARGS) { (void)status; hqmq_gains<SRC_F32>(descs, work); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_hqmq_med_bf16(HQE_ARGS) { (void)status; hqmq_median<SRC_BF16>(descs, work); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_hqmq_med_f16(HQE_ARGS) { (void)status; hqmq_median<SRC_F16>(descs, work); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_hqmq_med_f32(HQE_ARGS) { (void)status; hqmq_median<SRC_F32>(descs, work); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_hqmq_compact_bf16(HQE_ARGS) { hqmq_compact<SRC_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_hqmq_compact_f16(HQE_ARGS) { hqmq_compact<SRC_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_hqmq_compact_f32(HQE_ARGS) { hqmq_compact<SRC_F32>(descs, work, status); }

// Pack: work item (page, first word); words [0, n0) are INDEX 0, words
// [n0, n0 + n1) INDEX 1 (n0, n1 from the chunk and group counts).
__device__ __forceinline__ void hqmq_pack(const EncDesc* __restrict__ descs, const uint2* __restrict__ work,
                                          u64* status) {
    const uint2 w = work[blockIdx.x];
    const EncDesc d = descs[w.x];
    const u32 b = d.p2 & 0xffu, E = (d.p2 >> 8) & 0xffu, G = (d.p2 >> 16) & 0xffu, W = d.p2 >> 24;
    const u64 O = d.p3 & 0x1fffffffu;
    const u32 nall = d.rows * (d.head_dim >> 2);
    // With +med, the inliers only (compacted to the front of the scratch).
    const u32 n = (d.p3 >> 31) ? nall - reinterpret_cast<const u32*>(d.aux)[nall] : nall;
    const u32 ngroups = (n + G - 1u) / G;
    // Words of the worst-case streams (n = nall): the ones past n_in get 0.
    const u32 n0 = (u32)(((u64)nall * E + 31u) / 32u);
    const u32 n1 = (u32)((((u64)(nall + G - 1u) / G) * W + 31u) / 32u);
    const u32* sym = reinterpret_cast<const u32*>(d.aux);
    u8* body = reinterpret_cast<u8*>(d.body);
    (void)b;
    (void)status;
    const u32 wd = w.y + threadIdx.x;
    if (wd < n0) {
        u64 lo = (u64)wd * 32u, hi = lo + 32u;
        u32 word = 0;
        for (u64 k = lo / E; k * E < hi && k < n; k++) {
            u64 v = sym[k] & ((1u << E) - 1u);
            i64 sh = (i64)(k * E) - (i64)lo;
            word |= sh >= 0 ? (u32)(v << sh) : (u32)(v >> (-sh));
        }
        reinterpret_cast<u32*>(body + d.sec_index)[wd] = word;
    } else if (wd < n0 + n1) {
        u32 w1 = wd - n0;
        u64 lo = (u64)w1 * 32u, hi = lo + 32u;
        u32 word = 0;
        for (u64 g = lo / W; g * W < hi && g < ngroups; g++) {
            u64 v = 0;
            for (u32 t = G; t-- > 0;) {
                u64 k = g * G + t;
                v = v * O + (k < n ? (u64)(sym[k] >> E) : 0ull);
            }
            i64 sh = (i64)(g * W) - (i64)lo;
            word |= sh >= 0 ? (u32)(v << sh) : (u32)(v >> (-sh));
        }
        reinterpret_cast<u32*>(body + d.sec3)[w1] = word;
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK) encode_hqmq_pack(HQE_ARGS) { hqmq_pack(descs, work, status); }
