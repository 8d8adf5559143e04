// Encode of the group-wise codecs `kivi` (format/codecs/kivi.md) and
// `innerq` (format/codecs/innerq.md), producing the CPU encoder's sections
// bit for bit (src/codec/kivi.rs, src/codec/innerq.rs, src/kernels/group.rs).
//
// Per group of G elements (binary32, no fused multiply-add, IEEE division):
//     mn, mx = min, max in the CPU's order (the sign of a zero minimum is
//              the AVX2 min_max's); a NaN or infinity, or mx - mn beyond
//              f32, makes the page an error
//     kivi:        Z = f16_floor(mn), S = f16_ceil((mx - Z) / L)
//     innerq asym: Z = mn,            S = f16_ceil((mx - Z) / L)
//     innerq sym:  S = f16_ceil(max(|mn|, |mx|) / L)
//     q = S > 0 ? rne(clamp((x - Z) / S, 0, L)) : 0        (asymmetric)
//     q = S > 0 ? rne(clamp(|x| / S, 0, L)) : 0, sign = x < 0 && q > 0
//     hybrid: both; the squared errors summed in binary64 in element order
//     (as the CPU: e += (f64(x) - f64(x^))^2); symmetric when e_sym <= e_asym.
// An f16 scale or zero point beyond the f16 range is an error, as on the
// CPU. InnerQ keys are divided by the layer's normalization factor n_{h,c}
// (side table, f32 [heads, head_dim]) before anything else.
//
// Kernels `encode_groups_{ch|tok|tok1}_{mode}_{src}`, mode kivi, asym, sym
// or hybrid (a template parameter: each kernel carries one mode's
// arithmetic). Groups along channels (kivi V, innerq K): `ch`, work item
// (page, first row) = up to p3 rows of one plane staged in shared memory
// as f32 (a pad word every 32 so that one thread per group reads without
// bank conflicts); one thread per group. Groups along tokens (kivi K,
// innerq V): `tok1` (one group per thread) and `tok` (up to GE_CPT), work
// item (page, first row of a token group) = p2 consecutive token groups of
// G (or fewer, at the page end) tokens of one plane; one thread per
// (group, channel); `tok1` with G = 32 and head_dim a multiple of 32
// stages the item in shared memory as `ch` does, other cases read the
// group from global memory in each pass.
// Groups of 32 (the default G) are coded from registers without a
// division (ge_codes32), recoding only the few values near a rounding
// boundary exactly (ge_fix32). Codes go straight from registers into
// INDEX where a group fills whole words (`ch`); otherwise the b-bit codes
// of a run of consecutive rows are staged in shared memory and packed
// LSB-first into the INDEX section: words the run covers whole are
// stored, the two edge words OR-ed in with atomics (the body template is
// zeroed).
//
// EncDesc: sec_scale = SCALE 0, sec_zero = ZERO 0, sec_index = INDEX 0,
// sec3 = AUX 0 (innerq hybrid mode flags), side = normalization factors
// (innerq K, else 0); p0 = G, p1 = b | mode << 8 | norm << 16 (mode 0 innerq
// asymmetric, 1 symmetric, 2 hybrid, 3 kivi), p2 = token groups per work
// item (token groups), p3 = rows per work item (channel groups). Errors: atomicMin of page << 32 | the group's first row.

#define GE_TILE 8192
// The CPU-order min/max replay is rare (a zero minimum or maximum): kept out
// of line so that its registers do not count in the hot loop.
#ifdef KVPACK_EMU
#define GE_COLD
#else
#define GE_COLD __noinline__
#endif
#define GE_CPT 4
#define GE_SUB 32
#define GE_RNE 12582912.0f
#define GE_KIVI 3u
#define GE_ASYM 0u
#define GE_SYM 1u
#define GE_HYBRID 2u

// The smallest f16 >= x (x >= 0), as bits; >= 0x7c00 when beyond the range.
__device__ __forceinline__ u32 ge_f16_ceil(float x) {
    u32 h = f32_to_f16(x);
    if (f16_to_f32((u16)h) < x) h++;
    return h;
}

// The largest f16 <= x, as bits; (h & 0x7fff) >= 0x7c00 when beyond the range.
__device__ __forceinline__ u32 ge_f16_floor(float x) {
    u32 h = f32_to_f16(x);
    if (f16_to_f32((u16)h) > x) h = h == 0u ? 0x8001u : ((h & 0x8000u) == 0u ? h - 1u : h + 1u);
    return h;
}

__device__ __forceinline__ bool ge_f16_ok(u32 h) { return (h & 0x7fffu) < 0x7c00u; }

// rne(clamp(t, 0, L)) for a finite t.
__device__ __forceinline__ u32 ge_rne(float t, float L) {
    t = fminf(fmaxf(t, 0.0f), L);
    return __float_as_uint(__fadd_rn(t, GE_RNE)) - 0x4b400000u;
}

// One group's parameters: the chosen scale (f16 bits, value and its
// correctly rounded reciprocal), the zero point (asymmetric), and whether it
// is coded symmetrically.
struct GeGroup {
    u32 scale;
    float s;
    float r;
    float z;
    u32 zbits;  // kivi: f16 bits of Z
    bool sym;
};

__device__ __forceinline__ GeGroup ge_group(u32 scale, float z, u32 zbits, bool sym) {
    const float s = f16_to_f32((u16)scale);
    return GeGroup{scale, s, s > 0.0f ? __fdiv_rn(1.0f, s) : 0.0f, z, zbits, sym};
}

// Whether groups of MODE are coded symmetrically: always (GE_SYM), never
// (GE_ASYM, GE_KIVI), or as chosen per group (GE_HYBRID).
template <u32 MODE>
__device__ __forceinline__ bool ge_is_sym(const GeGroup& g) {
    return MODE == GE_SYM || (MODE == GE_HYBRID && g.sym);
}

// rne(clamp(d / s, 0, L)) for a finite d and an f16 scale s > 0, without a
// division: t' = RN(d * RN(1/s)) is within 2^-14 of RN(d / s) for
// |t'| <= 2^8 (two roundings of relative 2^-24 each), and a larger t' clamps
// to L as the exact quotient does; so rounding t' gives the same integer
// unless t' lies within GE_NEAR = 2^-12 of a half-integer, where the exact
// quotient decides. With u = rne(t'), |t' - u| <= 1/2 is exact, and t' is
// that near exactly when |t' - u| > 1/2 - GE_NEAR (GE_HALF).
#define GE_NEAR 0.000244140625f
#define GE_HALF 0.499755859375f
__device__ __forceinline__ u32 ge_quot(float d, const GeGroup& g, float L) {
    const float t = fminf(fmaxf(__fmul_rn(d, g.r), 0.0f), L);
    const float m = __fadd_rn(t, GE_RNE);
    if (fabsf(__fsub_rn(t, __fsub_rn(m, GE_RNE))) > GE_HALF) return ge_rne(__fdiv_rn(d, g.s), L);
    return __float_as_uint(m) - 0x4b400000u;
}

// ge_quot's fast path alone, without a branch: the code from t', and
// `near` set when t' lies within GE_NEAR of a half-integer (the code may
// then differ from ge_quot's). With s = 0, RN(1/s) is 0 and the code 0,
// as ge_code gives.
__device__ __forceinline__ u32 ge_quot_fast(float d, const GeGroup& g, float L, bool& near) {
    const float t = fminf(fmaxf(__fmul_rn(d, g.r), 0.0f), L);
    const float m = __fadd_rn(t, GE_RNE);
    near = fabsf(__fsub_rn(t, __fsub_rn(m, GE_RNE))) > GE_HALF;
    return __float_as_uint(m) - 0x4b400000u;
}

// The operand of ge_quot for value x of group g.
template <u32 MODE>
__device__ __forceinline__ float ge_operand(const GeGroup& g, float x) {
    return ge_is_sym<MODE>(g) ? fabsf(x) : __fsub_rn(x, g.z);
}

template <u32 MODE>
__device__ __forceinline__ u32 ge_code(const GeGroup& g, float x, float L) {
    if (!(g.s > 0.0f)) return 0u;
    return ge_quot(ge_is_sym<MODE>(g) ? fabsf(x) : __fsub_rn(x, g.z), g, L);
}

// Squared-error contribution of x coded as q with the given parameters.
__device__ __forceinline__ double ge_err(float x, u32 q, float s, float z, bool sym) {
    float v;
    if (sym) {
        v = __fmul_rn(code_f32(q), s);
        if (x < 0.0f && q > 0u) v = __uint_as_float(__float_as_uint(v) ^ 0x80000000u);
    } else {
        v = __fadd_rn(__fmul_rn(code_f32(q), s), z);
    }
    double e = __dadd_rn((double)x, -(double)v);
    return __dmul_rn(e, e);
}

// The CPU's min_max (src/kernels/x86.rs) of n finite values: eight lanes
// over whole chunks of 8 with MINPS/MAXPS tie rules (the new value wins),
// lanes folded in order, then the tail. Only the sign of a zero result
// depends on this order.
template <class At>
__device__ GE_COLD void ge_minmax_cpu(At at, u32 n, float& mn_out, float& mx_out) {
    float lmn[8], lmx[8];
    for (int l = 0; l < 8; l++) {
        lmn[l] = __int_as_float(0x7f800000);
        lmx[l] = __int_as_float(0xff800000);
    }
    u32 i = 0;
    for (; i + 8u <= n; i += 8u) {
        for (int l = 0; l < 8; l++) {
            float x = at(i + l);
            lmn[l] = lmn[l] < x ? lmn[l] : x;
            lmx[l] = lmx[l] > x ? lmx[l] : x;
        }
    }
    float mn = __int_as_float(0x7f800000), mx = __int_as_float(0xff800000);
    for (int l = 0; l < 8; l++) {
        mn = lmn[l] < mn ? lmn[l] : mn;
        mx = lmx[l] > mx ? lmx[l] : mx;
    }
    for (; i < n; i++) {
        float x = at(i);
        mn = x < mn ? x : mn;
        mx = x > mx ? x : mx;
    }
    mn_out = mn;
    mx_out = mx;
}

// Min and max of a group of n values read through `at(i)`, bit-identical to
// the CPU's; false when a value is NaN or infinite. One pass of FMNMX in
// any order (the value of a min or max does not depend on the order, only
// the sign of a zero does: then the CPU's order is replayed, reading the
// same values through `mem(i)`, which must not be registers: the replay is
// out of line); x * 0 is NaN exactly for a non-finite x, so one FMA per
// value tracks finiteness. With a constant n (the 32-value fast paths) the
// loop is unrolled, so `at` may index a register array.
template <class At, class Mem>
__device__ __forceinline__ bool ge_minmax(At at, Mem mem, u32 n, float& mn, float& mx) {
    float a = __int_as_float(0x7f800000), b = __int_as_float(0xff800000), nf = 0.0f;
#pragma unroll
    for (u32 i = 0; i < n; i++) {
        const float x = at(i);
        a = fminf(a, x);
        b = fmaxf(b, x);
        nf = __fmaf_rn(x, 0.0f, nf);
    }
    if (nf != 0.0f) return false;
    if (a == 0.0f || b == 0.0f) ge_minmax_cpu(mem, n, a, b);
    mn = a;
    mx = b;
    return true;
}

// The CPU's hybrid rule: the squared errors of both codings summed in
// binary64 in element order; symmetric when e_sym <= e_asym.
template <class At>
__device__ GE_COLD bool ge_hybrid_exact(At at, u32 n, const GeGroup& s, const GeGroup& a, float L) {
    double es = 0.0, ea = 0.0;
    for (u32 i = 0; i < n; i++) {
        const float x = at(i);
        es = __dadd_rn(es, ge_err(x, ge_code<GE_SYM>(s, x, L), s.s, 0.0f, true));
        ea = __dadd_rn(ea, ge_err(x, ge_code<GE_ASYM>(a, x, L), a.s, a.z, false));
    }
    return es <= ea;
}

// The same decision from binary32 sums: each differs from the exact sum
// of squares by at most (n + 2) 2^-24 of it (the CPU's binary64 sum by far
// less), so when the two sums differ by more than (n + 8) 2^-23 of their
// total the order is the CPU's; otherwise (near-ties, overflow, totals
// below 2^-90 where underflow is not relative, or a code of the branch-free
// ge_quot_fast that may differ from ge_code's) the binary64 rule is
// replayed from `mem`.
template <class At, class Mem>
__device__ __forceinline__ bool ge_hybrid_sym(At at, Mem mem, u32 n, const GeGroup& s, const GeGroup& a, float L) {
    float fs = 0.0f, fa = 0.0f;
    u32 near = 0;          // bit i (i < 32): a code of value i may differ from ge_code's
    bool differs = false;  // the same for some value i >= 32
#pragma unroll
    for (u32 i = 0; i < n; i++) {
        const float x = at(i);
        bool ns, na;
        const u32 qs = ge_quot_fast(fabsf(x), s, L, ns), qa = ge_quot_fast(__fsub_rn(x, a.z), a, L, na);
        if (ns || na) {
            if (i < 32u) {
                near |= 1u << i;
            } else {
                differs = true;
            }
        }
        float vs = __fmul_rn(code_f32(qs), s.s);
        if (x < 0.0f && qs > 0u) vs = -vs;
        const float va = __fadd_rn(__fmul_rn(code_f32(qa), a.s), a.z);
        const float es = __fsub_rn(x, vs), ea = __fsub_rn(x, va);
        fs = __fmaf_rn(es, es, fs);
        fa = __fmaf_rn(ea, ea, fa);
    }
    const float tot = __fadd_rn(fs, fa);
    // The sums stand when every uncertain code equals ge_code's.
    while (near != 0u && !differs) {
        const u32 i = (u32)__ffs(near) - 1u;
        near &= near - 1u;
        const float x = mem(i);
        bool unused;
        differs = ge_quot_fast(fabsf(x), s, L, unused) != ge_code<GE_SYM>(s, x, L) ||
                  ge_quot_fast(__fsub_rn(x, a.z), a, L, unused) != ge_code<GE_ASYM>(a, x, L);
    }
    if (!differs && is_finite(tot) && tot >= 8.0779357e-28f &&
        fabsf(__fsub_rn(fs, fa)) > __fmul_rn(__fmul_rn((float)(n + 8u), 1.1920929e-7f), tot))
        return fs < fa;
    return ge_hybrid_exact(mem, n, s, a, L);
}

// Parameters of a group of `n` values read through `at(i)` (and `mem(i)`,
// see ge_minmax); false when the group cannot be coded (non-finite value,
// f16 overflow).
template <u32 MODE, class At, class Mem>
__device__ __forceinline__ bool ge_params(At at, Mem mem, u32 n, float L, GeGroup& g) {
    float mn, mx;
    if (!ge_minmax(at, mem, n, mn, mx) || !is_finite(__fsub_rn(mx, mn))) return false;
    u32 ss = 0, sa = 0, zbits = 0;
    float zs = 0.0f;
    if (MODE == GE_SYM || MODE == GE_HYBRID) {
        ss = ge_f16_ceil(__fdiv_rn(fmaxf(fabsf(mn), fabsf(mx)), L));
        if (!ge_f16_ok(ss)) return false;
    }
    if (MODE != GE_SYM) {
        if (MODE == GE_KIVI) {
            zbits = ge_f16_floor(mn);
            if (!ge_f16_ok(zbits)) return false;
            zs = f16_to_f32((u16)zbits);
        } else {
            zs = mn;
        }
        sa = ge_f16_ceil(__fdiv_rn(__fsub_rn(mx, zs), L));
        if (!ge_f16_ok(sa)) return false;
    }
    bool sym = MODE == GE_SYM;
    if (MODE == GE_HYBRID) sym = ge_hybrid_sym(at, mem, n, ge_group(ss, 0.0f, 0u, true), ge_group(sa, zs, 0u, false), L);
    g = ge_group(sym ? ss : sa, zs, zbits, sym);
    return true;
}

// Writes group `gi`'s SCALE, ZERO (kivi f16 / innerq asymmetric slot word 0)
// and mode flag; sign words are written by the caller.
template <u32 MODE>
__device__ __forceinline__ void ge_store_params(u8* body, const EncDesc& d, u64 gi, const GeGroup& g) {
    reinterpret_cast<u16*>(body + d.sec_scale)[gi] = (u16)g.scale;
    if (MODE == GE_KIVI) {
        reinterpret_cast<u16*>(body + d.sec_zero)[gi] = (u16)g.zbits;
    } else if (!ge_is_sym<MODE>(g)) {
        reinterpret_cast<u32*>(body + d.sec_zero)[gi * (d.p0 >> 5)] = __float_as_uint(g.z);
    }
    if (MODE == GE_HYBRID && g.sym) atomicOr(reinterpret_cast<u32*>(body + d.sec3) + (gi >> 5), 1u << (gi & 31u));
}

// Codes of a full group of 32 values held in registers (the fast paths
// for G = 32), without a division and without a branch per value: each
// value's code by ge_quot_fast, either (BYTES) into `codes[i * cstride]`
// as bytes or packed LSB-first at `bits` bits (the constant B when B > 0)
// and stored word by word through `out` (the group's own whole words);
// sign bits into `sign`. Returns the mask of values whose code may differ
// from ge_code's, for ge_fix32.
template <u32 MODE, int B, bool BYTES>
__device__ __forceinline__ u32 ge_codes32(const float (&x)[32], const GeGroup& g, float L, u32 bits_rt, u32* out,
                                          u8* codes, u32 cstride, u32& sign) {
    const u32 bits = B > 0 ? (u32)B : bits_rt;
    u32 acc = 0, sh = 0, sg = 0, near = 0;
#pragma unroll
    for (u32 i = 0; i < 32u; i++) {
        bool nr;
        const u32 q = ge_quot_fast(ge_operand<MODE>(g, x[i]), g, L, nr);
        if (nr) near |= 1u << i;
        if (MODE == GE_SYM || MODE == GE_HYBRID) sg |= (ge_is_sym<MODE>(g) && x[i] < 0.0f && q > 0u ? 1u : 0u) << i;
        if (BYTES) {
            codes[i * cstride] = (u8)q;
            continue;
        }
        acc |= q << sh;
        sh += bits;
        if (sh >= 32u) {
            *out++ = acc;
            sh -= 32u;
            acc = sh != 0u ? q >> (bits - sh) : 0u;
        }
    }
    sign = sg;
    return near;
}

// Recodes the values of `near` (ge_codes32's mask) with ge_code, which
// replays the division where it decides, reading them through `mem`, and
// rewrites their codes and sign bits: the few lanes of a warp with such a
// value take a few iterations instead of the warp recoding whole groups.
// `out` is the group's first word (its codes start on a word boundary).
template <u32 MODE, bool BYTES, class Mem>
__device__ __forceinline__ void ge_fix32(u32 near, Mem mem, const GeGroup& g, float L, u32 bits, u32* out, u8* codes,
                                         u32 cstride, u32& sign) {
    while (near != 0u) {
        const u32 i = (u32)__ffs(near) - 1u;
        near &= near - 1u;
        const float x = mem(i);
        const u32 q = ge_code<MODE>(g, x, L);
        if (ge_is_sym<MODE>(g)) sign = (sign & ~(1u << i)) | ((x < 0.0f && q > 0u ? 1u : 0u) << i);
        if (BYTES) {
            codes[i * cstride] = (u8)q;
            continue;
        }
        const u32 pos = i * bits, wi = pos >> 5, sh = pos & 31u, m = (1u << bits) - 1u;
        out[wi] = (out[wi] & ~(m << sh)) | (q << sh);
        if (sh + bits > 32u) out[wi + 1u] = (out[wi + 1u] & ~(m >> (32u - sh))) | (q >> (32u - sh));
    }
}

// Shared-memory index of staged element i (a pad word every 32).
__device__ __forceinline__ u32 ge_pad(u32 i) { return i + (i >> 5); }

// Codes of the staged group starting at element e0 (G elements, one
// thread): the sign words of a symmetric group, then either the packed
// INDEX words stored straight from registers (when the group's codes start
// on a word boundary and fill whole words) or the codes into `codes` for
// enc_pack.
template <u32 MODE>
__device__ __forceinline__ void ge_codes_ch(const float* vals, u32 e0, u32 G, float L, u32 bits, const GeGroup& g,
                                            u32* signs, u32* out, u8* codes) {
    u32 sign = 0, acc = 0, sh = 0;
    const bool sym = ge_is_sym<MODE>(g);
    for (u32 i = 0; i < G; i++) {
        const float x = vals[ge_pad(e0 + i)];
        const u32 q = ge_code<MODE>(g, x, L);
        if (sym) {
            if (x < 0.0f && q > 0u) sign |= 1u << (i & 31u);
            if ((i & 31u) == 31u || i + 1u == G) {
                signs[i >> 5] = sign;
                sign = 0;
            }
        }
        if (out != nullptr) {
            acc |= q << sh;
            sh += bits;
            if (sh >= 32u) {
                *out++ = acc;
                sh -= 32u;
                acc = sh != 0u ? q >> (bits - sh) : 0u;
            }
        } else {
            codes[e0 + i] = (u8)q;
        }
    }
}

// Stages elements [0, n) of a row run (head_dim D) into `vals` as f32 at
// ge_pad positions, InnerQ keys divided by their factors (`norm`).
// 16-byte loads of eight 16-bit elements where aligned, GE_LOADS of them
// issued before any is used, so that their latencies overlap.
#define GE_LOADS 4u
template <int SRC>
__device__ __forceinline__ void ge_stage(const u8* src, u32 n, u32 D, bool norm, const float* factors, float* vals) {
    if (SRC != SRC_F32 && (D & 7u) == 0u && (reinterpret_cast<u64>(src) & 15u) == 0u) {
        const u32 nv = n / 8u;
        for (u32 v0 = threadIdx.x; v0 < nv; v0 += GE_LOADS * blockDim.x) {
            uint4 q[GE_LOADS];
#pragma unroll
            for (u32 j = 0; j < GE_LOADS; j++) {
                const u32 v = v0 + j * blockDim.x;
                if (v < nv) q[j] = __ldg(reinterpret_cast<const uint4*>(src) + v);
            }
#pragma unroll
            for (u32 j = 0; j < GE_LOADS; j++) {
                const u32 v = v0 + j * blockDim.x;
                if (v >= nv) break;
                const u32 ws[4] = {q[j].x, q[j].y, q[j].z, q[j].w};
                const u32 i0 = 8u * v, c0 = norm ? i0 % D : 0u;
#pragma unroll
                for (u32 k = 0; k < 8u; k++) {
                    const u16 h = (u16)(ws[k >> 1] >> (16u * (k & 1u)));
                    float x = SRC == SRC_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
                    if (norm) x = __fdiv_rn(x, __ldg(factors + c0 + k));
                    vals[ge_pad(i0 + k)] = x;
                }
            }
        }
    } else {
        for (u32 i = threadIdx.x; i < n; i += blockDim.x) {
            float x = enc_load<SRC>(src, i);
            if (norm) x = __fdiv_rn(x, __ldg(factors + i % D));
            vals[ge_pad(i)] = x;
        }
    }
}

// The channel-group work item's groups of 32 (G = 32, codes stored straight
// from registers): group k is vals[33k .. 33k + 32) (ge_pad), one thread
// per group, conflict-free (thread k reads bank (k + i) mod 32).
template <u32 MODE, int B>
__device__ __forceinline__ void ge_ch32(const float* vals, u32 n, const EncDesc& d, u32 r0, float L, u32 bits,
                                        u8* body, u32* index, u64* status) {
    const u32 D = d.head_dim;
    const u64 g0 = (u64)r0 * D / 32u;
    for (u32 k = threadIdx.x; k < n / 32u; k += blockDim.x) {
        const float* v = vals + 33u * k;
        float x[32];
#pragma unroll
        for (u32 i = 0; i < 32u; i++) x[i] = v[i];
        GeGroup g;
        if (!ge_params<MODE>([&](u32 i) { return x[i]; }, [=](u32 i) { return v[i]; }, 32u, L, g)) {
            atomicMin(status, ((u64)d.page << 32) | (r0 + 32u * k / D));
            continue;
        }
        ge_store_params<MODE>(body, d, g0 + k, g);
        u32* out = index + (((u64)r0 * D + 32u * k) * bits >> 5);
        u32* signs = reinterpret_cast<u32*>(body + d.sec_zero) + (g0 + k);
        u32 sign;
        const u32 near = ge_codes32<MODE, B, false>(x, g, L, bits, out, nullptr, 0u, sign);
        ge_fix32<MODE, false>(near, [=](u32 i) { return v[i]; }, g, L, bits, out, nullptr, 0u, sign);
        if (ge_is_sym<MODE>(g)) *signs = sign;
    }
}

template <int SRC, u32 MODE>
__device__ __forceinline__ void groups_channels(const EncDesc* __restrict__ descs,
                                                const uint2* __restrict__ work, u64* status) {
    __shared__ float vals[GE_TILE + GE_TILE / 32];
    __shared__ u8 codes[GE_TILE];
    const uint2 w = work[blockIdx.x];
    const EncDesc d = descs[w.x];
    const u32 D = d.head_dim, G = d.p0, bits = d.p1 & 0xffu;
    const bool norm = ((d.p1 >> 16) & 1u) != 0u;
    const float L = (float)((1u << bits) - 1u);
    const u32 r0 = w.y;
    const u32 plane = udiv(r0, d.tokens, d.m_tokens);
    const u32 t0 = r0 - plane * d.tokens;
    const u32 nr = min(d.p3, d.tokens - t0), n = nr * D;
    const u8* src = reinterpret_cast<const u8*>(d.src) + (SRC == SRC_F32 ? 4u : 2u) * ((u64)plane * d.stride + (u64)t0 * D);
    const float* factors = reinterpret_cast<const float*>(d.side) + (u64)(plane % d.heads) * D;
    u8* body = reinterpret_cast<u8*>(d.body);
    ge_stage<SRC>(src, n, D, norm, factors, vals);
    __syncthreads();
    const u64 g0 = (u64)r0 * D / G;
    // Whole words per group: every group's codes start on a word boundary.
    const bool direct = ((G * bits) & 31u) == 0u && (((u64)r0 * D * bits) & 31u) == 0u;
    u32* index = reinterpret_cast<u32*>(body + d.sec_index);
    if (G == 32u && direct) {
        if (bits == 2u) {
            ge_ch32<MODE, 2>(vals, n, d, r0, L, bits, body, index, status);
        } else if (bits == 4u) {
            ge_ch32<MODE, 4>(vals, n, d, r0, L, bits, body, index, status);
        } else {
            ge_ch32<MODE, 0>(vals, n, d, r0, L, bits, body, index, status);
        }
        return;
    }
    for (u32 k = threadIdx.x; k < n / G; k += blockDim.x) {
        const u32 e0 = k * G;
        GeGroup g;
        const auto at = [&](u32 i) { return vals[ge_pad(e0 + i)]; };
        if (!ge_params<MODE>(at, at, G, L, g)) {
            atomicMin(status, ((u64)d.page << 32) | (r0 + e0 / D));
            continue;
        }
        ge_store_params<MODE>(body, d, g0 + k, g);
        u32* signs = reinterpret_cast<u32*>(body + d.sec_zero) + (g0 + k) * (G >> 5);
        ge_codes_ch<MODE>(vals, e0, G, L, bits, g, signs, direct ? index + (((u64)r0 * D + e0) * bits >> 5) : nullptr,
                          codes);
    }
    if (direct) return;
    __syncthreads();
    enc_pack(codes, n, (u64)r0 * D, bits, index);
}

// CPT = groups per thread: 1 when the item's K * head_dim groups fit the
// block (head_dim <= BLOCK), else GE_CPT (fewer live registers with 1).
// With CPT = 1, G = 32 and D a multiple of 32, a full group is read from
// the staged item into registers and coded there (ge_codes32); other
// groups read global memory in each pass.
template <int SRC, int CPT, u32 MODE>
__device__ __forceinline__ void groups_tokens(const EncDesc* __restrict__ descs,
                                              const uint2* __restrict__ work, u64* status) {
    __shared__ __align__(16) u8 codes[GE_SUB * CPT * BLOCK];
    __shared__ float vals[CPT == 1 ? GE_TILE + GE_TILE / 32 : 1];
    const uint2 w = work[blockIdx.x];
    const EncDesc d = descs[w.x];
    const u32 D = d.head_dim, G = d.p0, K = d.p2, bits = d.p1 & 0xffu;
    const float L = (float)((1u << bits) - 1u);
    const u32 r0 = w.y;
    const u32 plane = udiv(r0, d.tokens, d.m_tokens);
    const u32 t0 = r0 - plane * d.tokens;
    const u8* src = reinterpret_cast<const u8*>(d.src) + (SRC == SRC_F32 ? 4u : 2u) * ((u64)plane * d.stride + (u64)t0 * D);
    u8* body = reinterpret_cast<u8*>(d.body);
    const u64 g0 = ((u64)plane * ((d.tokens + G - 1u) / G) + t0 / G) * D;
    // Slot s of the item is the token group starting at row r0 + s * G;
    // thread lane idx = threadIdx.x + m * blockDim.x is (slot idx / D,
    // channel idx % D); element (t, c) of slot sl is element
    // (sl * G + t) * D + c of the item.
    // CPT = 1, G = 32, D a multiple of 32: the item's rows (K * 32 * D <=
    // 32 * BLOCK = GE_TILE elements) staged in shared memory with 16-byte
    // loads, then each thread reads its group's column: value i of the
    // group at column offset p0 is vals[p0 + i * (D + D / 32)] (ge_pad),
    // and a warp's 32 consecutive channels read 32 consecutive words.
    const bool staged = CPT == 1 && G == 32u && (D & 31u) == 0u;
    if (staged) {
        ge_stage<SRC>(src, min(K * 32u, d.tokens - t0) * D, D, false, nullptr, vals);
        __syncthreads();
    }
    GeGroup gs[CPT];
    bool ok[CPT];
    u32 len[CPT];
    bool done = false;  // CPT = 1: coded by the fast path
#pragma unroll
    for (u32 m = 0; m < CPT; m++) {
        const u32 idx = threadIdx.x + m * blockDim.x, sl = idx / D, c = idx - sl * D;
        ok[m] = false;
        len[m] = 0;
        if (sl >= K || t0 + sl * G >= d.tokens) continue;
        len[m] = min(G, d.tokens - t0 - sl * G);
        const u32 e = sl * G * D + c;
        const auto mem = [=](u32 i) { return enc_load<SRC>(src, e + i * D); };
        if (staged && len[m] == 32u) {
            const u32 p0 = ge_pad(e), dp = D + D / 32u;
            const auto smem = [=](u32 i) { return vals[p0 + i * dp]; };
            float x[32];
#pragma unroll
            for (u32 i = 0; i < 32u; i++) x[i] = smem(i);
            ok[m] = ge_params<MODE>([&](u32 i) { return x[i]; }, smem, 32u, L, gs[m]);
            if (ok[m]) {
                u8* out = codes + sl * GE_SUB * D + c;
                u32 sign;
                const u32 near = ge_codes32<MODE, 0, true>(x, gs[m], L, bits, nullptr, out, D, sign);
                ge_fix32<MODE, true>(near, smem, gs[m], L, bits, nullptr, out, D, sign);
                done = true;
                if (ge_is_sym<MODE>(gs[m])) reinterpret_cast<u32*>(body + d.sec_zero)[g0 + (u64)sl * D + c] = sign;
            }
        } else {
            ok[m] = ge_params<MODE>(mem, mem, len[m], L, gs[m]);
        }
        if (!ok[m]) {
            atomicMin(status, ((u64)d.page << 32) | (r0 + sl * G));
            continue;
        }
        ge_store_params<MODE>(body, d, g0 + (u64)sl * D + c, gs[m]);
    }
    const u32 len0 = min(G, d.tokens - t0);
    for (u32 sb = 0; sb < len0; sb += GE_SUB) {
#pragma unroll
        for (u32 m = 0; m < CPT; m++) {
            const u32 idx = threadIdx.x + m * blockDim.x, sl = idx / D, c = idx - sl * D;
            if (len[m] <= sb || done) continue;
            const u32 ns = min((u32)GE_SUB, len[m] - sb);
            const u32 e = (sl * G + sb) * D + c;
            u8* out = codes + sl * GE_SUB * D + c;
            u32 sign = 0;
            const bool sym = ge_is_sym<MODE>(gs[m]);
            for (u32 t = 0; t < ns; t++) {
                const float x = enc_load<SRC>(src, e + t * D);
                const u32 q = ok[m] ? ge_code<MODE>(gs[m], x, L) : 0u;
                out[t * D] = (u8)q;
                if (sym && x < 0.0f && q > 0u) sign |= 1u << t;
            }
            if (ok[m] && sym)
                reinterpret_cast<u32*>(body + d.sec_zero)[(g0 + (u64)sl * D + c) * (G >> 5) + (sb >> 5)] = sign;
        }
        __syncthreads();
        for (u32 sl = 0; sl < K && t0 + sl * G + sb < d.tokens; sl++) {
            const u32 ns = min(min((u32)GE_SUB, G - sb), d.tokens - t0 - sl * G - sb);
            enc_pack(codes + sl * GE_SUB * D, ns * D, ((u64)r0 + sl * G + sb) * D, bits,
                     reinterpret_cast<u32*>(body + d.sec_index));
        }
        __syncthreads();
    }
}

// Kernels `encode_groups_{ch|tok|tok1}_{kivi|asym|sym|hybrid}_{src}`: the
// coding mode is a template parameter, so each kernel carries one mode's
// arithmetic.
#define GE_ARGS const EncDesc *descs, const uint2 *work, u64 *status
// Blocks per SM the staged kernels (ch, tok1) are compiled for: 4 x 256
// threads (at most 64 registers each; 4 x 42 kB of shared memory).
#ifndef GE_MIN_BLOCKS
#define GE_MIN_BLOCKS 4
#endif
extern "C" __global__ void __launch_bounds__(BLOCK, GE_MIN_BLOCKS) encode_groups_ch_kivi_bf16(GE_ARGS) { groups_channels<SRC_BF16, GE_KIVI>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_groups_tok_kivi_bf16(GE_ARGS) { groups_tokens<SRC_BF16, GE_CPT, GE_KIVI>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, GE_MIN_BLOCKS) encode_groups_tok1_kivi_bf16(GE_ARGS) { groups_tokens<SRC_BF16, 1, GE_KIVI>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, GE_MIN_BLOCKS) encode_groups_ch_kivi_f16(GE_ARGS) { groups_channels<SRC_F16, GE_KIVI>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_groups_tok_kivi_f16(GE_ARGS) { groups_tokens<SRC_F16, GE_CPT, GE_KIVI>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, GE_MIN_BLOCKS) encode_groups_tok1_kivi_f16(GE_ARGS) { groups_tokens<SRC_F16, 1, GE_KIVI>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, GE_MIN_BLOCKS) encode_groups_ch_kivi_f32(GE_ARGS) { groups_channels<SRC_F32, GE_KIVI>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_groups_tok_kivi_f32(GE_ARGS) { groups_tokens<SRC_F32, GE_CPT, GE_KIVI>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, GE_MIN_BLOCKS) encode_groups_tok1_kivi_f32(GE_ARGS) { groups_tokens<SRC_F32, 1, GE_KIVI>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, GE_MIN_BLOCKS) encode_groups_ch_asym_bf16(GE_ARGS) { groups_channels<SRC_BF16, GE_ASYM>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_groups_tok_asym_bf16(GE_ARGS) { groups_tokens<SRC_BF16, GE_CPT, GE_ASYM>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, GE_MIN_BLOCKS) encode_groups_tok1_asym_bf16(GE_ARGS) { groups_tokens<SRC_BF16, 1, GE_ASYM>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, GE_MIN_BLOCKS) encode_groups_ch_asym_f16(GE_ARGS) { groups_channels<SRC_F16, GE_ASYM>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_groups_tok_asym_f16(GE_ARGS) { groups_tokens<SRC_F16, GE_CPT, GE_ASYM>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, GE_MIN_BLOCKS) encode_groups_tok1_asym_f16(GE_ARGS) { groups_tokens<SRC_F16, 1, GE_ASYM>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, GE_MIN_BLOCKS) encode_groups_ch_asym_f32(GE_ARGS) { groups_channels<SRC_F32, GE_ASYM>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_groups_tok_asym_f32(GE_ARGS) { groups_tokens<SRC_F32, GE_CPT, GE_ASYM>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, GE_MIN_BLOCKS) encode_groups_tok1_asym_f32(GE_ARGS) { groups_tokens<SRC_F32, 1, GE_ASYM>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, GE_MIN_BLOCKS) encode_groups_ch_sym_bf16(GE_ARGS) { groups_channels<SRC_BF16, GE_SYM>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_groups_tok_sym_bf16(GE_ARGS) { groups_tokens<SRC_BF16, GE_CPT, GE_SYM>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, GE_MIN_BLOCKS) encode_groups_tok1_sym_bf16(GE_ARGS) { groups_tokens<SRC_BF16, 1, GE_SYM>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, GE_MIN_BLOCKS) encode_groups_ch_sym_f16(GE_ARGS) { groups_channels<SRC_F16, GE_SYM>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_groups_tok_sym_f16(GE_ARGS) { groups_tokens<SRC_F16, GE_CPT, GE_SYM>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, GE_MIN_BLOCKS) encode_groups_tok1_sym_f16(GE_ARGS) { groups_tokens<SRC_F16, 1, GE_SYM>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, GE_MIN_BLOCKS) encode_groups_ch_sym_f32(GE_ARGS) { groups_channels<SRC_F32, GE_SYM>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_groups_tok_sym_f32(GE_ARGS) { groups_tokens<SRC_F32, GE_CPT, GE_SYM>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, GE_MIN_BLOCKS) encode_groups_tok1_sym_f32(GE_ARGS) { groups_tokens<SRC_F32, 1, GE_SYM>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, GE_MIN_BLOCKS) encode_groups_ch_hybrid_bf16(GE_ARGS) { groups_channels<SRC_BF16, GE_HYBRID>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_groups_tok_hybrid_bf16(GE_ARGS) { groups_tokens<SRC_BF16, GE_CPT, GE_HYBRID>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, GE_MIN_BLOCKS) encode_groups_tok1_hybrid_bf16(GE_ARGS) { groups_tokens<SRC_BF16, 1, GE_HYBRID>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, GE_MIN_BLOCKS) encode_groups_ch_hybrid_f16(GE_ARGS) { groups_channels<SRC_F16, GE_HYBRID>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_groups_tok_hybrid_f16(GE_ARGS) { groups_tokens<SRC_F16, GE_CPT, GE_HYBRID>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, GE_MIN_BLOCKS) encode_groups_tok1_hybrid_f16(GE_ARGS) { groups_tokens<SRC_F16, 1, GE_HYBRID>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, GE_MIN_BLOCKS) encode_groups_ch_hybrid_f32(GE_ARGS) { groups_channels<SRC_F32, GE_HYBRID>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) encode_groups_tok_hybrid_f32(GE_ARGS) { groups_tokens<SRC_F32, GE_CPT, GE_HYBRID>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK, GE_MIN_BLOCKS) encode_groups_tok1_hybrid_f32(GE_ARGS) { groups_tokens<SRC_F32, 1, GE_HYBRID>(descs, work, status); }

// InnerQ key normalization statistics (format/codecs/innerq.md, the
// compressor's Codec::prepare): max |x| per (kv head, channel) over the
// key tensor's body pages, into a u32 array [heads, head_dim] of f32 bits
// (atomicMax: the values are non-negative). Work item (page, first row of
// a plane); one thread per channel. sec_index = the array's offset in the
// body; a NaN or infinity is reported as atomicMin of page << 32 | row.
template <int SRC>
__device__ __forceinline__ void key_amax(const EncDesc* __restrict__ descs, const uint2* __restrict__ work,
                                         u64* status) {
    const uint2 w = work[blockIdx.x];
    const EncDesc d = descs[w.x];
    const u32 D = d.head_dim, r0 = w.y, plane = udiv(r0, d.tokens, d.m_tokens);
    const u8* src = reinterpret_cast<const u8*>(d.src) + (SRC == SRC_F32 ? 4u : 2u) * ((u64)plane * d.stride);
    u32* amax = reinterpret_cast<u32*>(reinterpret_cast<u8*>(d.body) + d.sec_index) + (u64)(plane % d.heads) * D;
    for (u32 c = threadIdx.x; c < D; c += blockDim.x) {
        float m = 0.0f;
        for (u32 t = 0; t < d.tokens; t++) {
            float x = enc_load<SRC>(src, (u64)t * D + c);
            if (!is_finite(x)) {
                atomicMin(status, ((u64)d.page << 32) | (r0 + t));
                break;
            }
            m = fmaxf(m, fabsf(x));
        }
        atomicMax(amax + c, __float_as_uint(m));
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK) innerq_key_amax_bf16(GE_ARGS) { key_amax<SRC_BF16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) innerq_key_amax_f16(GE_ARGS) { key_amax<SRC_F16>(descs, work, status); }
extern "C" __global__ void __launch_bounds__(BLOCK) innerq_key_amax_f32(GE_ARGS) { key_amax<SRC_F32>(descs, work, status); }
