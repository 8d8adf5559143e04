//! Direction search: the nearest joint codeword `q_p * q_s` of a chunk
//! (HQMQ paper section 3 "Joint codebook", appendix B line 4).
//!
//! # The normative rule ([`exhaustive`])
//! For a chunk `x` (four f32 values), codeword `j = p*S + s` scores
//! `score_j = ((x0*C_j0 + x1*C_j1) + x2*C_j2) + x3*C_j3` in binary32 without
//! fused multiply-add, `C_j` being the joint codebook entry. The chosen
//! index is the **smallest `j` among those with the largest score**. (The
//! paper maximizes `<x/|x|, c>`; dividing by `|x| > 0` does not change the
//! argmax in exact arithmetic, and scoring `x` directly avoids a rounding.)
//! Evaluating all `24 S` codewords costs `24 S` four-term dot products.
//!
//! # The fast exact search ([`search`])
//! Right multiplication by a quaternion is adjoint to right multiplication
//! by its conjugate, so `<x, q_p q_s> = <x conj(q_s), q_p>`: with
//! `w = x conj(q_s)` (one quaternion product per secondary) the 24 scores
//! of coset `s` are `+-w_i` (axis units) and `(+-w_0 +-w_1 +-w_2 +-w_3)/2`
//! (half units), whose maximum is `max(max_i |w_i|, sum_i |w_i| / 2)`. The
//! search computes that group maximum for every `s` (16 chunks per
//! AVX-512 register or 8 per AVX2 register, fused multiply-adds allowed),
//! keeps the best and second-best group, then, for the winner, the best
//! and second-best unit. The pass over the secondaries is a running
//! maximum, so it can stop after the first `S'` secondaries and continue
//! later ([`search_resume`]): a codebook's secondaries start with those of
//! every smaller codebook of its seed, so searches of growing `S` on one
//! page score each secondary once.
//!
//! These approximate scores differ from the normative binary32 scores by at
//! most about `21 * 2^-24 * |x|` (rounding of `w`: `<= 8u|x|`; of the group
//! sums: `<= 2u|x|`; of the normative codeword and dot product: `<= 10u|x|`,
//! with `u = 2^-24`), plus `2^-145` absolute for underflow. With the margin
//! `eps = 2 max_i |x_i| * 2^-17 + 10^-36` (`2 max_i |x_i| >= |x|`; more
//! than 6 times that bound):
//!
//! * if the best approximate score exceeds every other codeword's by more
//!   than `2 eps`, its codeword is the unique normative maximum and is
//!   returned;
//! * otherwise (near-ties: a fraction of a percent of real chunks), every
//!   group whose approximate maximum is within `4 eps` of the best is
//!   re-scored with the normative rule over its 24 codewords, and the
//!   smallest `j` with the largest normative score is returned.
//!
//! Either way the result equals [`exhaustive`] bit for bit; tests compare
//! them on millions of random and adversarial chunks and the real fixture.

use crate::kernels::quaternion::{self, Quat};

use super::codebook::{Codebook, PRIMARY};

/// The normative direction index: smallest `j` with the largest binary32
/// score `((x0*C0 + x1*C1) + x2*C2) + x3*C3` over the joint codebook.
/// `24 S` dot products; the reference the fast search is tested against.
pub fn exhaustive(joint: &[Quat], x: Quat) -> u32 {
    let mut best = f32::NEG_INFINITY;
    let mut arg = 0u32;
    for (j, c) in joint.iter().enumerate() {
        let sc = quaternion::dot(x, *c);
        if sc > best {
            best = sc;
            arg = j as u32;
        }
    }
    arg
}

/// Normative index restricted to the codewords of the listed secondaries
/// (all 24 primaries each), smallest `j` among equal scores.
fn exhaustive_in_groups(cb: &Codebook, x: Quat, groups: &[usize]) -> u32 {
    let s_count = cb.s();
    let mut best = f32::NEG_INFINITY;
    let mut arg = u32::MAX;
    for &s in groups {
        for p in 0..PRIMARY {
            let j = p * s_count + s;
            let sc = quaternion::dot(x, cb.joint[j]);
            if sc > best || (sc == best && (j as u32) < arg) {
                best = sc;
                arg = j as u32;
            }
        }
    }
    arg
}

/// `x * conj(q)`.
#[inline]
fn rotate(x: Quat, q: Quat) -> Quat {
    quaternion::mul(x, quaternion::conj(q))
}

/// Twice the group maximum `max(2 max_i |w_i|, sum_i |w_i|)` (scalar).
#[inline]
fn group_score2(w: Quat) -> f32 {
    let a = w.map(f32::abs);
    let m = a[0].max(a[1]).max(a[2].max(a[3]));
    let sum = (a[0] + a[1]) + (a[2] + a[3]);
    (m + m).max(sum)
}

/// Best and second-best approximate scores of the 24 units against `w`
/// (`<w, q_p>`), and the best unit's index `p`.
fn top2_units(w: Quat) -> (f32, f32, usize) {
    let a = w.map(f32::abs);
    // Axis units: largest and second-largest |w_i|.
    let mut i1 = 0;
    for i in 1..4 {
        if a[i] > a[i1] {
            i1 = i;
        }
    }
    let m1 = a[i1];
    let m2 = (0..4)
        .filter(|&i| i != i1)
        .map(|i| a[i])
        .fold(f32::NEG_INFINITY, f32::max);
    // Half units: signs of w; the runner-up flips the smallest |w_i|.
    let h1 = ((a[0] + a[1]) + (a[2] + a[3])) * 0.5;
    let h2 = h1 - a[0].min(a[1]).min(a[2].min(a[3]));
    let neg = |v: f32| usize::from(v.is_sign_negative());
    let (best, p) = if m1 >= h1 {
        (m1, 2 * i1 + neg(w[i1]))
    } else {
        (
            h1,
            8 + neg(w[0]) + 2 * neg(w[1]) + 4 * neg(w[2]) + 8 * neg(w[3]),
        )
    };
    let second = m1.min(h1).max(m2).max(h2);
    (best, second, p)
}

/// Margin `eps` of the module docs for a chunk of norm at most `r`.
#[inline]
fn margin(r: f32) -> f32 {
    r * (1.0 / 131_072.0) + 1e-36
}

/// Finishes the search of one chunk given the vector pass's best group
/// `s1`, its doubled score `b`, and the doubled best score `b2` of all other
/// groups.
fn finish(cb: &Codebook, x: Quat, s1: usize, b2: f32) -> u32 {
    // 2 max|x_i| >= |x| exactly, without the underflow of x_i^2.
    let r = 2.0 * x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if r == 0.0 {
        // Every score is +-0: the smallest index wins.
        return 0;
    }
    let eps = margin(r);
    let w = rotate(x, cb.secondary[s1]);
    let (v1, v2, p) = top2_units(w);
    if v1 - (b2 * 0.5).max(v2) > 2.0 * eps {
        return (p * cb.s() + s1) as u32;
    }
    // Near-tie: rescore every group that can hold the normative maximum.
    let floor = v1 - 4.0 * eps;
    let groups: Vec<usize> = (0..cb.s())
        .filter(|&s| group_score2(rotate(x, cb.secondary[s])) * 0.5 >= floor)
        .collect();
    exhaustive_in_groups(cb, x, &groups)
}

/// Where the filter pass of one chunk stands: the best doubled group
/// score, the best of the other groups and the best group.
#[derive(Debug, Clone, Copy)]
struct Lane {
    b: f32,
    b2: f32,
    s1: u32,
}

/// The filter state before any secondary.
const START: Lane = Lane {
    b: f32::NEG_INFINITY,
    b2: f32::NEG_INFINITY,
    s1: 0,
};

/// Filter states of some chunks, by field: `(b, b2, s1)` of [`Lane`].
type States<'a> = (&'a mut [f32], &'a mut [f32], &'a mut [u32]);

/// Filter states of `L` chunks, by field, in and out of a vector kernel.
type Block<'a, const L: usize> = (&'a mut [f32; L], &'a mut [f32; L], &'a mut [u32; L]);

/// Portable filter pass for one chunk over secondaries `from..S`,
/// continuing `st`.
fn filter_scalar(cb: &Codebook, x: Quat, st: &mut Lane, from: usize) {
    let Lane {
        mut b,
        mut b2,
        mut s1,
    } = *st;
    for (s, q) in cb.secondary.iter().enumerate().skip(from) {
        let sc = group_score2(rotate(x, *q));
        b2 = b2.max(b.min(sc));
        if sc > b {
            b = sc;
            s1 = s as u32;
        }
    }
    *st = Lane { b, b2, s1 };
}

/// Chunks in structure-of-arrays form: component `k` of chunk `i` is
/// `x[k][i]`; all four slices have the same length.
pub type Soa<'a> = [&'a [f32]; 4];

/// Direction index of every chunk of `x` into `out`, equal to
/// [`exhaustive`] for each (module docs), 16 chunks at a time with
/// AVX-512F, else 8 with AVX2 + FMA, else one by one; every path returns
/// the same indices.
///
/// # Panics
/// If the slices of `x` and `out` differ in length.
pub fn search(cb: &Codebook, x: Soa<'_>, out: &mut [u32]) {
    run(cb, x, out, None, 0);
}

/// The filter pass of [`search`] over some chunks, stopped after the
/// first `upto` secondaries of a codebook: per chunk the best doubled
/// group score, the best of the other groups and the best group. A search
/// with a larger codebook of the same seed, layer, kv head and kind (whose
/// secondaries start with the smaller one's,
/// [`super::codebook::secondaries`]) continues from it
/// ([`search_resume`]).
#[derive(Debug, Clone, Default)]
pub struct Progress {
    upto: usize,
    b: Vec<f32>,
    b2: Vec<f32>,
    s1: Vec<u32>,
}

/// [`search`] whose filter pass starts where `progress` stands and leaves
/// it after all `S` secondaries of `cb`: equal to [`search`] when the
/// first `progress.upto` secondaries of `cb` are those `progress` was made
/// with. A `progress` of another chunk count, or of more secondaries than
/// `cb` has, is started over.
///
/// # Panics
/// If the slices of `x` and `out` differ in length.
pub fn search_resume(cb: &Codebook, x: Soa<'_>, progress: &mut Progress, out: &mut [u32]) {
    let n = out.len();
    if progress.s1.len() != n || progress.upto > cb.s() {
        *progress = Progress {
            upto: 0,
            b: vec![START.b; n],
            b2: vec![START.b2; n],
            s1: vec![START.s1; n],
        };
    }
    let from = progress.upto;
    let states = (
        &mut progress.b[..],
        &mut progress.b2[..],
        &mut progress.s1[..],
    );
    run(cb, x, out, Some(states), from);
    progress.upto = cb.s();
}

/// [`search`] with the filter states of `progress` (after `from`
/// secondaries), or from the start.
fn run(cb: &Codebook, x: Soa<'_>, out: &mut [u32], progress: Option<States<'_>>, from: usize) {
    let n = out.len();
    assert!(x.iter().all(|c| c.len() == n));
    #[cfg(target_arch = "x86_64")]
    {
        if crate::kernels::avx512_available() {
            // SAFETY: avx512_available() checked AVX-512F.
            blocks(cb, x, out, progress, from, |l, st| unsafe {
                avx512::search16(cb, l, st, from)
            });
            return;
        }
        if crate::kernels::simd_available() {
            // SAFETY: simd_available() checked AVX2 and FMA.
            blocks(cb, x, out, progress, from, |l, st| unsafe {
                avx2::search8(cb, l, st, from)
            });
            return;
        }
    }
    scalar(cb, x, out, progress, from);
}

/// What a vector kernel returns for `L` chunks, per lane: the joint index,
/// whether it is proven (else [`finish`] decides), the best group `s` and
/// the doubled score of the best other group.
type Lanes<const L: usize> = ([u32; L], [bool; L], [u32; L], [f32; L]);

/// Runs `kernel` on `L` chunks at a time (the last block padded with
/// zero chunks, whose results are dropped), with their filter states
/// taken from and left in `progress` (else started), and [`finish`]es the
/// lanes it could not prove.
#[cfg(target_arch = "x86_64")]
fn blocks<const L: usize>(
    cb: &Codebook,
    x: Soa<'_>,
    out: &mut [u32],
    mut progress: Option<States<'_>>,
    from: usize,
    kernel: impl Fn(&[[f32; L]; 4], Option<Block<'_, L>>) -> Lanes<L>,
) {
    let n = out.len();
    let mut i = 0;
    while i < n {
        let m = (n - i).min(L);
        let mut lanes = [[0f32; L]; 4];
        for k in 0..4 {
            lanes[k][..m].copy_from_slice(&x[k][i..i + m]);
        }
        let (j, ok, s1, b2) = match progress.as_mut() {
            Some((pb, pb2, ps)) => {
                let (mut b, mut b2, mut s) = ([START.b; L], [START.b2; L], [START.s1; L]);
                if from > 0 {
                    b[..m].copy_from_slice(&pb[i..i + m]);
                    b2[..m].copy_from_slice(&pb2[i..i + m]);
                    s[..m].copy_from_slice(&ps[i..i + m]);
                }
                let r = kernel(&lanes, Some((&mut b, &mut b2, &mut s)));
                pb[i..i + m].copy_from_slice(&b[..m]);
                pb2[i..i + m].copy_from_slice(&b2[..m]);
                ps[i..i + m].copy_from_slice(&s[..m]);
                r
            }
            None => kernel(&lanes, None),
        };
        for l in 0..m {
            out[i + l] = if ok[l] {
                j[l]
            } else {
                let q = [lanes[0][l], lanes[1][l], lanes[2][l], lanes[3][l]];
                finish(cb, q, s1[l] as usize, b2[l])
            };
        }
        i += m;
    }
}

/// Portable [`run`].
fn scalar(
    cb: &Codebook,
    x: Soa<'_>,
    out: &mut [u32],
    mut progress: Option<States<'_>>,
    from: usize,
) {
    for (i, o) in out.iter_mut().enumerate() {
        let q = [x[0][i], x[1][i], x[2][i], x[3][i]];
        let mut st = match &progress {
            Some((b, b2, s1)) if from > 0 => Lane {
                b: b[i],
                b2: b2[i],
                s1: s1[i],
            },
            _ => START,
        };
        filter_scalar(cb, q, &mut st, from);
        if let Some((b, b2, s1)) = progress.as_mut() {
            (b[i], b2[i], s1[i]) = (st.b, st.b2, st.s1);
        }
        *o = finish(cb, q, st.s1 as usize, st.b2);
    }
}

/// Portable implementation of [`search`] (same results).
///
/// # Panics
/// If the slices of `x` and `out` differ in length.
pub fn search_scalar(cb: &Codebook, x: Soa<'_>, out: &mut [u32]) {
    assert!(x.iter().all(|c| c.len() == out.len()));
    scalar(cb, x, out, None, 0);
}

/// [`search`] over chunks given as quaternions (a convenience for tests
/// and tools).
pub fn search_quats(cb: &Codebook, xs: &[Quat], out: &mut [u32]) {
    let soa: [Vec<f32>; 4] = std::array::from_fn(|k| xs.iter().map(|q| q[k]).collect());
    search(cb, [&soa[0], &soa[1], &soa[2], &soa[3]], out);
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Block, Codebook, Lanes};

    /// Search of 8 chunks (`x[k][lane]` = component `k` of chunk `lane`):
    /// the filter pass over all secondaries, then the winner check of
    /// [`super::finish`] in vector form. Per lane: the joint index, whether
    /// it is proven (else the caller runs `finish`), the best group `s` and
    /// the doubled score of the best other group.
    ///
    /// # Safety
    /// AVX2 and FMA must be available.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn search8(
        cb: &Codebook,
        x: &[[f32; 8]; 4],
        st: Option<Block<'_, 8>>,
        from: usize,
    ) -> Lanes<8> {
        let [sa, sb, sc, sd] = &cb.soa;
        let n = sa.len().min(sb.len()).min(sc.len()).min(sd.len());
        let s_count = cb.s() as i32;
        // SAFETY (whole body): loads are from 8-element arrays; broadcast
        // loads read index s < n of slices of length >= n; gathers read
        // indices s1 < n (s1 is a loop index, or 0 when n == 0 is
        // impossible: S >= 1).
        unsafe {
            let x0 = _mm256_loadu_ps(x[0].as_ptr());
            let x1 = _mm256_loadu_ps(x[1].as_ptr());
            let x2 = _mm256_loadu_ps(x[2].as_ptr());
            let x3 = _mm256_loadu_ps(x[3].as_ptr());
            let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
            let (mut b, mut b2, mut best_s) = match &st {
                Some((b, b2, s)) => (
                    _mm256_loadu_ps(b.as_ptr()),
                    _mm256_loadu_ps(b2.as_ptr()),
                    _mm256_cvtepi32_ps(_mm256_loadu_si256(s.as_ptr() as *const __m256i)),
                ),
                None => (
                    _mm256_set1_ps(f32::NEG_INFINITY),
                    _mm256_set1_ps(f32::NEG_INFINITY),
                    _mm256_setzero_ps(),
                ),
            };
            // w = x * conj(q), q = (qa, qb, qc, qd).
            let rot = |qa: __m256, qb: __m256, qc: __m256, qd: __m256| {
                let mut w0 = _mm256_mul_ps(x0, qa);
                w0 = _mm256_fmadd_ps(x1, qb, w0);
                w0 = _mm256_fmadd_ps(x2, qc, w0);
                w0 = _mm256_fmadd_ps(x3, qd, w0);
                let mut w1 = _mm256_mul_ps(x1, qa);
                w1 = _mm256_fnmadd_ps(x0, qb, w1);
                w1 = _mm256_fnmadd_ps(x2, qd, w1);
                w1 = _mm256_fmadd_ps(x3, qc, w1);
                let mut w2 = _mm256_mul_ps(x2, qa);
                w2 = _mm256_fnmadd_ps(x0, qc, w2);
                w2 = _mm256_fmadd_ps(x1, qd, w2);
                w2 = _mm256_fnmadd_ps(x3, qb, w2);
                let mut w3 = _mm256_mul_ps(x3, qa);
                w3 = _mm256_fnmadd_ps(x0, qd, w3);
                w3 = _mm256_fnmadd_ps(x1, qc, w3);
                w3 = _mm256_fmadd_ps(x2, qb, w3);
                [w0, w1, w2, w3]
            };
            let idx = &cb.index;
            for s in from..n {
                let qa = _mm256_broadcast_ss(sa.get_unchecked(s));
                let qb = _mm256_broadcast_ss(sb.get_unchecked(s));
                let qc = _mm256_broadcast_ss(sc.get_unchecked(s));
                let qd = _mm256_broadcast_ss(sd.get_unchecked(s));
                let [w0, w1, w2, w3] = rot(qa, qb, qc, qd);
                let a0 = _mm256_and_ps(w0, abs);
                let a1 = _mm256_and_ps(w1, abs);
                let a2 = _mm256_and_ps(w2, abs);
                let a3 = _mm256_and_ps(w3, abs);
                let m = _mm256_max_ps(_mm256_max_ps(a0, a1), _mm256_max_ps(a2, a3));
                let sum = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
                let score = _mm256_max_ps(_mm256_add_ps(m, m), sum);
                b2 = _mm256_max_ps(b2, _mm256_min_ps(b, score));
                let gt = _mm256_cmp_ps::<_CMP_GT_OQ>(score, b);
                b = _mm256_max_ps(b, score);
                best_s = _mm256_blendv_ps(best_s, _mm256_broadcast_ss(idx.get_unchecked(s)), gt);
            }

            // Winner check (super::finish): best and second-best unit of
            // the winning group, against the margin.
            let s1 = _mm256_cvttps_epi32(best_s);
            if let Some((sb, sb2, ss)) = st {
                _mm256_storeu_ps(sb.as_mut_ptr(), b);
                _mm256_storeu_ps(sb2.as_mut_ptr(), b2);
                _mm256_storeu_si256(ss.as_mut_ptr() as *mut __m256i, s1);
            }
            let [w0, w1, w2, w3] = rot(
                _mm256_i32gather_ps::<4>(sa.as_ptr(), s1),
                _mm256_i32gather_ps::<4>(sb.as_ptr(), s1),
                _mm256_i32gather_ps::<4>(sc.as_ptr(), s1),
                _mm256_i32gather_ps::<4>(sd.as_ptr(), s1),
            );
            let a0 = _mm256_and_ps(w0, abs);
            let a1 = _mm256_and_ps(w1, abs);
            let a2 = _mm256_and_ps(w2, abs);
            let a3 = _mm256_and_ps(w3, abs);
            let (lo01, hi01) = (_mm256_min_ps(a0, a1), _mm256_max_ps(a0, a1));
            let (lo23, hi23) = (_mm256_min_ps(a2, a3), _mm256_max_ps(a2, a3));
            let m1 = _mm256_max_ps(hi01, hi23);
            let m2 = _mm256_max_ps(_mm256_min_ps(hi01, hi23), _mm256_max_ps(lo01, lo23));
            let min4 = _mm256_min_ps(lo01, lo23);
            let half = _mm256_set1_ps(0.5);
            let h1 = _mm256_mul_ps(
                _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                half,
            );
            let h2 = _mm256_sub_ps(h1, min4);
            let v1 = _mm256_max_ps(m1, h1);
            let v2 = _mm256_max_ps(
                _mm256_max_ps(_mm256_min_ps(m1, h1), m2),
                _mm256_max_ps(h2, _mm256_mul_ps(b2, half)),
            );
            let xm = _mm256_max_ps(
                _mm256_max_ps(_mm256_and_ps(x0, abs), _mm256_and_ps(x1, abs)),
                _mm256_max_ps(_mm256_and_ps(x2, abs), _mm256_and_ps(x3, abs)),
            );
            // 2 eps = 2 * (2 max|x_i| * 2^-17 + 1e-36).
            let two_eps = _mm256_add_ps(
                _mm256_mul_ps(xm, _mm256_set1_ps(4.0 / 131_072.0)),
                _mm256_set1_ps(2e-36),
            );
            let ok = _mm256_cmp_ps::<_CMP_GT_OQ>(_mm256_sub_ps(v1, v2), two_eps);

            // Unit index: axis 2i + sign(w_i) for the largest |w_i| (unique
            // when ok), else the half unit 8 + sum_k sign(w_k) 2^k.
            let sign = |w: __m256| _mm256_srli_epi32::<31>(_mm256_castps_si256(w));
            let (g0, g1, g2, g3) = (sign(w0), sign(w1), sign(w2), sign(w3));
            let half_p = _mm256_add_epi32(
                _mm256_set1_epi32(8),
                _mm256_add_epi32(
                    _mm256_add_epi32(g0, _mm256_slli_epi32::<1>(g1)),
                    _mm256_add_epi32(_mm256_slli_epi32::<2>(g2), _mm256_slli_epi32::<3>(g3)),
                ),
            );
            let is = |a: __m256| _mm256_castps_si256(_mm256_cmp_ps::<_CMP_EQ_OQ>(a, m1));
            let mut axis_p = _mm256_add_epi32(_mm256_set1_epi32(6), g3);
            axis_p = _mm256_blendv_epi8(axis_p, _mm256_add_epi32(_mm256_set1_epi32(4), g2), is(a2));
            axis_p = _mm256_blendv_epi8(axis_p, _mm256_add_epi32(_mm256_set1_epi32(2), g1), is(a1));
            axis_p = _mm256_blendv_epi8(axis_p, g0, is(a0));
            let use_axis = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(m1, h1));
            let p = _mm256_blendv_epi8(half_p, axis_p, use_axis);
            let j = _mm256_add_epi32(_mm256_mullo_epi32(p, _mm256_set1_epi32(s_count)), s1);

            let mut j_out = [0u32; 8];
            let mut s_out = [0u32; 8];
            let mut b2_out = [0f32; 8];
            _mm256_storeu_si256(j_out.as_mut_ptr() as *mut __m256i, j);
            _mm256_storeu_si256(s_out.as_mut_ptr() as *mut __m256i, s1);
            _mm256_storeu_ps(b2_out.as_mut_ptr(), b2);
            let mask = _mm256_movemask_ps(ok);
            let ok_out = std::array::from_fn(|l| mask >> l & 1 == 1);
            (j_out, ok_out, s_out, b2_out)
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{Block, Codebook, Lanes};

    /// [`super::avx2::search8`] on 16 chunks: the same operations lane for
    /// lane (the same rotations with fused multiply-adds, group scores,
    /// winner check and margin), so every lane's result equals the 8-lane
    /// kernel's.
    ///
    /// # Safety
    /// AVX-512F must be available.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn search16(
        cb: &Codebook,
        x: &[[f32; 16]; 4],
        st: Option<Block<'_, 16>>,
        from: usize,
    ) -> Lanes<16> {
        let [sa, sb, sc, sd] = &cb.soa;
        let n = sa.len().min(sb.len()).min(sc.len()).min(sd.len());
        let s_count = cb.s() as i32;
        // SAFETY (whole body): loads are from 16-element arrays, stores to
        // 16-element arrays; broadcasts read index s < n of slices of
        // length >= n; gathers read indices s1 < n (s1 is a loop index,
        // or 0 while n >= 1: S >= 1).
        unsafe {
            let x0 = _mm512_loadu_ps(x[0].as_ptr());
            let x1 = _mm512_loadu_ps(x[1].as_ptr());
            let x2 = _mm512_loadu_ps(x[2].as_ptr());
            let x3 = _mm512_loadu_ps(x[3].as_ptr());
            let (mut b, mut b2, mut best_s) = match &st {
                Some((b, b2, s)) => (
                    _mm512_loadu_ps(b.as_ptr()),
                    _mm512_loadu_ps(b2.as_ptr()),
                    _mm512_loadu_si512(s.as_ptr() as *const __m512i),
                ),
                None => (
                    _mm512_set1_ps(f32::NEG_INFINITY),
                    _mm512_set1_ps(f32::NEG_INFINITY),
                    _mm512_setzero_si512(),
                ),
            };
            // w = x * conj(q), q = (qa, qb, qc, qd), as in search8.
            let rot = |qa: __m512, qb: __m512, qc: __m512, qd: __m512| {
                let mut w0 = _mm512_mul_ps(x0, qa);
                w0 = _mm512_fmadd_ps(x1, qb, w0);
                w0 = _mm512_fmadd_ps(x2, qc, w0);
                w0 = _mm512_fmadd_ps(x3, qd, w0);
                let mut w1 = _mm512_mul_ps(x1, qa);
                w1 = _mm512_fnmadd_ps(x0, qb, w1);
                w1 = _mm512_fnmadd_ps(x2, qd, w1);
                w1 = _mm512_fmadd_ps(x3, qc, w1);
                let mut w2 = _mm512_mul_ps(x2, qa);
                w2 = _mm512_fnmadd_ps(x0, qc, w2);
                w2 = _mm512_fmadd_ps(x1, qd, w2);
                w2 = _mm512_fnmadd_ps(x3, qb, w2);
                let mut w3 = _mm512_mul_ps(x3, qa);
                w3 = _mm512_fnmadd_ps(x0, qd, w3);
                w3 = _mm512_fnmadd_ps(x1, qc, w3);
                w3 = _mm512_fmadd_ps(x2, qb, w3);
                [w0, w1, w2, w3]
            };
            for s in from..n {
                let qa = _mm512_set1_ps(*sa.get_unchecked(s));
                let qb = _mm512_set1_ps(*sb.get_unchecked(s));
                let qc = _mm512_set1_ps(*sc.get_unchecked(s));
                let qd = _mm512_set1_ps(*sd.get_unchecked(s));
                let [w0, w1, w2, w3] = rot(qa, qb, qc, qd);
                let a0 = _mm512_abs_ps(w0);
                let a1 = _mm512_abs_ps(w1);
                let a2 = _mm512_abs_ps(w2);
                let a3 = _mm512_abs_ps(w3);
                let m = _mm512_max_ps(_mm512_max_ps(a0, a1), _mm512_max_ps(a2, a3));
                let sum = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
                let score = _mm512_max_ps(_mm512_add_ps(m, m), sum);
                b2 = _mm512_max_ps(b2, _mm512_min_ps(b, score));
                let gt = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(score, b);
                b = _mm512_max_ps(b, score);
                best_s = _mm512_mask_mov_epi32(best_s, gt, _mm512_set1_epi32(s as i32));
            }

            let s1 = best_s;
            if let Some((sb, sb2, ss)) = st {
                _mm512_storeu_ps(sb.as_mut_ptr(), b);
                _mm512_storeu_ps(sb2.as_mut_ptr(), b2);
                _mm512_storeu_si512(ss.as_mut_ptr() as *mut __m512i, s1);
            }

            // Winner check, as in search8.
            let [w0, w1, w2, w3] = rot(
                _mm512_i32gather_ps::<4>(s1, sa.as_ptr()),
                _mm512_i32gather_ps::<4>(s1, sb.as_ptr()),
                _mm512_i32gather_ps::<4>(s1, sc.as_ptr()),
                _mm512_i32gather_ps::<4>(s1, sd.as_ptr()),
            );
            let a0 = _mm512_abs_ps(w0);
            let a1 = _mm512_abs_ps(w1);
            let a2 = _mm512_abs_ps(w2);
            let a3 = _mm512_abs_ps(w3);
            let (lo01, hi01) = (_mm512_min_ps(a0, a1), _mm512_max_ps(a0, a1));
            let (lo23, hi23) = (_mm512_min_ps(a2, a3), _mm512_max_ps(a2, a3));
            let m1 = _mm512_max_ps(hi01, hi23);
            let m2 = _mm512_max_ps(_mm512_min_ps(hi01, hi23), _mm512_max_ps(lo01, lo23));
            let min4 = _mm512_min_ps(lo01, lo23);
            let half = _mm512_set1_ps(0.5);
            let h1 = _mm512_mul_ps(
                _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                half,
            );
            let h2 = _mm512_sub_ps(h1, min4);
            let v1 = _mm512_max_ps(m1, h1);
            let v2 = _mm512_max_ps(
                _mm512_max_ps(_mm512_min_ps(m1, h1), m2),
                _mm512_max_ps(h2, _mm512_mul_ps(b2, half)),
            );
            let xm = _mm512_max_ps(
                _mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)),
                _mm512_max_ps(_mm512_abs_ps(x2), _mm512_abs_ps(x3)),
            );
            // 2 eps = 2 * (2 max|x_i| * 2^-17 + 1e-36).
            let two_eps = _mm512_add_ps(
                _mm512_mul_ps(xm, _mm512_set1_ps(4.0 / 131_072.0)),
                _mm512_set1_ps(2e-36),
            );
            let ok = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_sub_ps(v1, v2), two_eps);

            // Unit index, as in search8.
            let sign = |w: __m512| _mm512_srli_epi32::<31>(_mm512_castps_si512(w));
            let (g0, g1, g2, g3) = (sign(w0), sign(w1), sign(w2), sign(w3));
            let half_p = _mm512_add_epi32(
                _mm512_set1_epi32(8),
                _mm512_add_epi32(
                    _mm512_add_epi32(g0, _mm512_slli_epi32::<1>(g1)),
                    _mm512_add_epi32(_mm512_slli_epi32::<2>(g2), _mm512_slli_epi32::<3>(g3)),
                ),
            );
            let is = |a: __m512| _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(a, m1);
            let mut axis_p = _mm512_add_epi32(_mm512_set1_epi32(6), g3);
            axis_p =
                _mm512_mask_mov_epi32(axis_p, is(a2), _mm512_add_epi32(_mm512_set1_epi32(4), g2));
            axis_p =
                _mm512_mask_mov_epi32(axis_p, is(a1), _mm512_add_epi32(_mm512_set1_epi32(2), g1));
            axis_p = _mm512_mask_mov_epi32(axis_p, is(a0), g0);
            let use_axis = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(m1, h1);
            let p = _mm512_mask_mov_epi32(half_p, use_axis, axis_p);
            let j = _mm512_add_epi32(_mm512_mullo_epi32(p, _mm512_set1_epi32(s_count)), s1);

            let mut j_out = [0u32; 16];
            let mut s_out = [0u32; 16];
            let mut b2_out = [0f32; 16];
            _mm512_storeu_si512(j_out.as_mut_ptr() as *mut __m512i, j);
            _mm512_storeu_si512(s_out.as_mut_ptr() as *mut __m512i, s1);
            _mm512_storeu_ps(b2_out.as_mut_ptr(), b2);
            let ok_out = std::array::from_fn(|l| ok >> l & 1 == 1);
            (j_out, ok_out, s_out, b2_out)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::Kind;
    use crate::codec::hqmq::codebook::secondaries;
    use crate::kernels::quaternion::HURWITZ;
    use crate::kernels::rng::SplitMix64;

    fn book(s: usize, seed: u64) -> Codebook {
        Codebook::new(secondaries(seed, 0, 0, Kind::Key, s))
    }

    /// Uniform f32 in [-1, 1).
    fn uniform(r: &mut SplitMix64) -> f32 {
        ((r.next_u64() >> 40) as f32 - 8_388_608.0) / 8_388_608.0
    }

    /// Chunks built to hit ties and near-ties: codewords themselves,
    /// zeros, axis-aligned and half-unit-aligned vectors, tiny and
    /// subnormal values, sums of two codewords.
    fn adversarial(cb: &Codebook, r: &mut SplitMix64, n: usize) -> Vec<Quat> {
        let mut v = Vec::with_capacity(n);
        while v.len() < n {
            let j = (r.next_u64() % cb.joint.len() as u64) as usize;
            let k = (r.next_u64() % cb.joint.len() as u64) as usize;
            let c = cb.joint[j];
            let scale = [1.0f32, 3.5, 1e-3, 1e-38, 1e-41, 65_000.0][v.len() % 6];
            v.push(c.map(|t| t * scale));
            let d = cb.joint[k];
            v.push(std::array::from_fn(|i| (c[i] + d[i]) * scale));
            v.push([0.0, -0.0, 0.0, 0.0]);
            v.push(HURWITZ[v.len() % 24].map(|t| t * scale));
            let mut a = [0.0f32; 4];
            a[v.len() % 4] = uniform(r);
            v.push(a);
            v.push([1.0, 1.0, 0.0, 0.0].map(|t: f32| t * scale));
            v.push([uniform(r), uniform(r), uniform(r), 0.0]);
            v.push(std::array::from_fn(|_| (uniform(r) * 4.0).round()));
        }
        v
    }

    /// The search paths this CPU has.
    fn paths() -> Vec<&'static str> {
        let mut v = vec!["scalar"];
        if cfg!(target_arch = "x86_64") && crate::kernels::simd_available() {
            v.push("avx2");
        }
        if cfg!(target_arch = "x86_64") && crate::kernels::avx512_available() {
            v.push("avx512");
        }
        v
    }

    /// [`run`] on one path.
    fn run_path(
        path: &str,
        cb: &Codebook,
        x: Soa<'_>,
        out: &mut [u32],
        progress: Option<States<'_>>,
        from: usize,
    ) {
        match path {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: paths() lists avx2 only when simd_available().
            "avx2" => blocks(cb, x, out, progress, from, |l, st| unsafe {
                avx2::search8(cb, l, st, from)
            }),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: paths() lists avx512 only when avx512_available().
            "avx512" => blocks(cb, x, out, progress, from, |l, st| unsafe {
                avx512::search16(cb, l, st, from)
            }),
            _ => scalar(cb, x, out, progress, from),
        }
    }

    /// Every search path this CPU has (portable, AVX2, AVX-512F) on
    /// `xs`: `(path name, indices)`.
    fn every_path(cb: &Codebook, xs: &[Quat]) -> Vec<(&'static str, Vec<u32>)> {
        let soa: [Vec<f32>; 4] = std::array::from_fn(|k| xs.iter().map(|q| q[k]).collect());
        let x = [&soa[0][..], &soa[1], &soa[2], &soa[3]];
        let mut out = Vec::new();
        for path in paths() {
            let mut o = vec![0u32; xs.len()];
            run_path(path, cb, x, &mut o, None, 0);
            out.push((path, o));
        }
        let mut o = vec![0u32; xs.len()];
        search(cb, x, &mut o);
        out.push(("dispatch", o));
        out
    }

    fn check(cb: &Codebook, xs: &[Quat]) {
        let paths = every_path(cb, xs);
        for (i, x) in xs.iter().enumerate() {
            let want = exhaustive(&cb.joint, *x);
            for (name, got) in &paths {
                assert_eq!(got[i], want, "S={} chunk {x:?} ({name})", cb.s());
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(200))]

        /// Every path equals the exhaustive rule on random pages of any
        /// length (the vector kernels pad the last block), mixing random
        /// chunks with codewords, their sums and scaled units (exact ties
        /// and near-ties), for codebooks of 1 to 200 secondaries.
        #[test]
        fn every_path_equals_exhaustive(
            s in 1usize..200,
            seed in 0u64..1000,
            len in 0usize..70,
            mix in 0u64..u64::MAX,
        ) {
            let cb = book(s, seed);
            let mut r = SplitMix64::new(mix);
            let adv = adversarial(&cb, &mut r, len);
            let xs: Vec<Quat> = (0..len)
                .map(|i| {
                    if r.next_u64().is_multiple_of(2) {
                        adv[i]
                    } else {
                        std::array::from_fn(|_| uniform(&mut r) * 4.0)
                    }
                })
                .collect();
            check(&cb, &xs);
        }

        /// A search resumed from the filter pass of a smaller codebook of
        /// the same seed (a prefix of its secondaries), on every path and
        /// through `search_resume`, equals the plain search, for chains of
        /// 1 to 3 growing codebooks; a progress of too many secondaries
        /// or another length is started over.
        #[test]
        fn resumed_searches_equal_plain_searches(
            sizes in proptest::collection::vec(1usize..120, 1..4),
            seed in 0u64..1000,
            len in 0usize..120,
            mix in 0u64..u64::MAX,
        ) {
            let mut r = SplitMix64::new(mix);
            let sb = *sizes.iter().max().unwrap();
            let big = book(sb, seed);
            let sa = *sizes.iter().min().unwrap();
            // Near-ties across the resume point: the sum of a codeword of
            // a group the first search scores and one of a group only
            // the continuation scores.
            let across = |r: &mut SplitMix64| -> Quat {
                let ga = (r.next_u64() % sa as u64) as usize;
                let gb = sa + (r.next_u64() % (sb - sa).max(1) as u64) as usize;
                let (p, q) = (r.next_u64() % 24, r.next_u64() % 24);
                let a = big.joint[p as usize * sb + ga];
                let b = big.joint[q as usize * sb + gb.min(sb - 1)];
                std::array::from_fn(|k| a[k] + b[k])
            };
            let xs: Vec<Quat> = adversarial(&big, &mut r, len)
                .into_iter()
                .zip(0..len)
                .map(|(a, i)| match i % 3 {
                    0 => std::array::from_fn(|_| uniform(&mut r) * 2.0),
                    1 => across(&mut r),
                    _ => a,
                })
                .collect();
            let soa: [Vec<f32>; 4] = std::array::from_fn(|k| xs.iter().map(|q| q[k]).collect());
            let x = [&soa[0][..], &soa[1], &soa[2], &soa[3]];
            let mut sorted = sizes.clone();
            sorted.sort_unstable();
            for path in paths() {
                let (mut b, mut b2, mut s1) = (vec![START.b; len], vec![START.b2; len], vec![0; len]);
                let mut from = 0;
                for &s in &sorted {
                    let cb = book(s, seed);
                    let mut got = vec![0u32; len];
                    run_path(path, &cb, x, &mut got, Some((&mut b, &mut b2, &mut s1)), from);
                    from = s;
                    let mut want = vec![0u32; len];
                    search(&cb, x, &mut want);
                    proptest::prop_assert_eq!(&got, &want, "{} S={}", path, s);
                }
            }
            // The public entry, in the given (unsorted) order.
            let mut progress = Progress::default();
            for &s in &sizes {
                let cb = book(s, seed);
                let mut got = vec![0u32; len];
                search_resume(&cb, x, &mut progress, &mut got);
                let mut want = vec![0u32; len];
                search(&cb, x, &mut want);
                proptest::prop_assert_eq!(&got, &want, "resume S={}", s);
            }
        }
    }

    #[test]
    fn fast_search_equals_exhaustive_on_random_and_adversarial_chunks() {
        let mut r = SplitMix64::new(2024);
        for (s, seed) in [(1, 1u64), (5, 2), (24, 3), (96, 4), (192, 5), (100, 6)] {
            let cb = book(s, seed);
            let mut xs: Vec<Quat> = (0..4000)
                .map(|_| std::array::from_fn(|_| uniform(&mut r)))
                .collect();
            xs.extend(adversarial(&cb, &mut r, 4000));
            check(&cb, &xs);
        }
    }

    #[test]
    fn ties_go_to_the_smallest_joint_index() {
        let cb = book(7, 11);
        // x = 0: all scores equal.
        assert_eq!(exhaustive(&cb.joint, [0.0; 4]), 0);
        let mut o = [9u32];
        search_quats(&cb, &[[0.0; 4]], &mut o);
        assert_eq!(o[0], 0);
        // A secondary codebook with a repeated entry: the coset of the
        // first copy wins.
        let mut sec = cb.secondary.clone();
        sec[5] = sec[2];
        let dup = Codebook::new(sec);
        let x = quaternion::mul(HURWITZ[13], dup.secondary[2]);
        let want = exhaustive(&dup.joint, x);
        assert_eq!(want as usize, 13 * 7 + 2);
        search_quats(&dup, &[x], &mut o);
        assert_eq!(o[0], want);
        search_scalar(&dup, [&[x[0]], &[x[1]], &[x[2]], &[x[3]]], &mut o);
        assert_eq!(o[0], want);
    }

    /// The proof obligation: at least 10^6 random chunks (S = 96,
    /// the headline configuration), fast == exhaustive.
    #[test]
    fn a_million_random_chunks() {
        let cb = book(96, 42);
        let mut r = SplitMix64::new(7);
        let xs: Vec<Quat> = (0..1_000_000)
            .map(|i| {
                // Gaussian-like magnitudes across several decades.
                let scale = [1.0f32, 0.01, 30.0, 4.0][i % 4];
                std::array::from_fn(|_| {
                    (uniform(&mut r) + uniform(&mut r) + uniform(&mut r)) * scale
                })
            })
            .collect();
        let mut fast = vec![0u32; xs.len()];
        search_quats(&cb, &xs, &mut fast);
        let mismatches = xs
            .iter()
            .zip(&fast)
            .filter(|(x, f)| exhaustive(&cb.joint, **x) != **f)
            .count();
        assert_eq!(mismatches, 0);
    }
}
