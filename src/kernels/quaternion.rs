//! Quaternion arithmetic on `[f32; 4]`, the 24 Hurwitz units (the binary
//! tetrahedral group 2T) in a fixed order, and Haar-uniform random unit
//! quaternions drawn from an integer PRNG without transcendental functions.
//!
//! A quaternion `[a, b, c, d]` is `a + b i + c j + d k` (real part first).
//! Every function here uses only IEEE `+ - * / sqrt` in a stated order,
//! without fused multiply-add, so results are bit-identical on every
//! platform (format/codecs/hqmq.md relies on this).

use super::rng::SplitMix64;

/// A quaternion `a + b i + c j + d k` stored as `[a, b, c, d]`.
pub type Quat = [f32; 4];

/// Hamilton product `p * q` in binary32, no fused multiply-add, with this
/// normative operation order (format/codecs/hqmq.md):
///
/// ```text
/// r0 = ((p0*q0 - p1*q1) - p2*q2) - p3*q3
/// r1 = ((p0*q1 + p1*q0) + p2*q3) - p3*q2
/// r2 = ((p0*q2 - p1*q3) + p2*q0) + p3*q1
/// r3 = ((p0*q3 + p1*q2) - p2*q1) + p3*q0
/// ```
#[inline]
pub fn mul(p: Quat, q: Quat) -> Quat {
    [
        ((p[0] * q[0] - p[1] * q[1]) - p[2] * q[2]) - p[3] * q[3],
        ((p[0] * q[1] + p[1] * q[0]) + p[2] * q[3]) - p[3] * q[2],
        ((p[0] * q[2] - p[1] * q[3]) + p[2] * q[0]) + p[3] * q[1],
        ((p[0] * q[3] + p[1] * q[2]) - p[2] * q[1]) + p[3] * q[0],
    ]
}

/// Conjugate `a - b i - c j - d k` (exact).
#[inline]
pub fn conj(q: Quat) -> Quat {
    [q[0], -q[1], -q[2], -q[3]]
}

/// Inner product `((p0*q0 + p1*q1) + p2*q2) + p3*q3` in binary32, no fused
/// multiply-add (the normative HQMQ codeword score).
#[inline]
pub fn dot(p: Quat, q: Quat) -> f32 {
    ((p[0] * q[0] + p[1] * q[1]) + p[2] * q[2]) + p[3] * q[3]
}

/// Euclidean norm `sqrt(((q0*q0 + q1*q1) + q2*q2) + q3*q3)` in binary32 (one
/// correctly rounded square root).
#[inline]
pub fn norm(q: Quat) -> f32 {
    dot(q, q).sqrt()
}

/// The 24 unit Hurwitz quaternions (the binary tetrahedral group 2T; HQMQ
/// paper section 2 and appendix D) in the normative order of
/// format/codecs/hqmq.md:
///
/// * `p = 2i + n` for `i` in 0..4, `n` in 0..2: the axis unit `(-1)^n e_i`
///   (`e_0 = 1, e_1 = i, e_2 = j, e_3 = k`), i.e. `+1, -1, +i, -i, +j, -j,
///   +k, -k`;
/// * `p = 8 + m` for `m` in 0..16: `(s_0, s_1, s_2, s_3) / 2` with
///   `s_k = -1` when bit `k` of `m` is set and `+1` otherwise, i.e.
///   `(1+i+j+k)/2, (-1+i+j+k)/2, (1-i+j+k)/2, ...`.
///
/// All entries are exact in binary32.
pub const HURWITZ: [Quat; 24] = hurwitz_units();

const fn hurwitz_units() -> [Quat; 24] {
    let mut u = [[0.0f32; 4]; 24];
    let mut i = 0;
    while i < 4 {
        u[2 * i][i] = 1.0;
        u[2 * i + 1][i] = -1.0;
        i += 1;
    }
    let mut m = 0;
    while m < 16 {
        let mut k = 0;
        while k < 4 {
            u[8 + m][k] = if (m >> k) & 1 == 1 { -0.5 } else { 0.5 };
            k += 1;
        }
        m += 1;
    }
    u
}

/// Bits taken from each PRNG draw for one coordinate.
const COORD_BITS: u32 = 24;
/// `2^(COORD_BITS - 1)`: coordinates are `(v - HALF) / HALF` for `v` in
/// `[0, 2^24)`.
const HALF: i64 = 1 << (COORD_BITS - 1);
/// Squared integer norm of the unit sphere: `HALF^2 = 2^46`.
const UNIT2: u64 = 1 << 46;
/// Smallest accepted squared integer norm, `2^40` (norm 1/8): excludes a
/// tiny ball around the origin, where the coordinate grid is coarse
/// relative to the norm. The excluded set is rotation invariant, so the
/// direction stays uniform.
const FLOOR2: u64 = 1 << 40;

/// Draws a Haar-uniform random unit quaternion (uniform on the 3-sphere)
/// from `rng` by rejection sampling in the 4-ball, using only integer
/// arithmetic, one binary64 square root and binary64 divisions (all
/// correctly rounded, so the result is bit-exact everywhere):
///
/// ```text
/// repeat:
///     m_k = (next_u64() >> 40) - 2^23          for k = 0, 1, 2, 3 in order
///     n2  = m_0^2 + m_1^2 + m_2^2 + m_3^2      (exact integer)
/// until 2^40 <= n2 <= 2^46
/// q_k = f32( f64(m_k) / sqrt(f64(n2)) )        (binary64 ops, then RNE to f32)
/// ```
///
/// The point `m / 2^23` is uniform on a grid in the cube `[-1, 1)^4`;
/// conditioned on the shell `1/8 <= |m / 2^23| <= 1` it is (up to the
/// 2^-23 grid) uniform in a rotation-invariant set, so its direction is
/// uniform on S^3, as the HQMQ paper's calibration-free argument needs
/// (Proposition 3.1; appendix D draws normalized Gaussians, which have the
/// same distribution). About 31% of candidates are accepted.
pub fn haar_unit(rng: &mut SplitMix64) -> Quat {
    loop {
        let mut m = [0i64; 4];
        for v in &mut m {
            *v = (rng.next_u64() >> (64 - COORD_BITS)) as i64 - HALF;
        }
        let n2: u64 = m.iter().map(|&v| (v * v) as u64).sum();
        if (FLOOR2..=UNIT2).contains(&n2) {
            let r = (n2 as f64).sqrt();
            return m.map(|v| (v as f64 / r) as f32);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hurwitz_units_form_a_group_of_unit_quaternions() {
        let key = |q: Quat| q.map(f32::to_bits);
        let set: std::collections::HashSet<_> = HURWITZ.iter().map(|&q| key(q)).collect();
        assert_eq!(set.len(), 24);
        for &p in &HURWITZ {
            assert_eq!(dot(p, p), 1.0);
            for &q in &HURWITZ {
                // Closure, exactly (all products of halves are exact).
                let r = mul(p, q).map(|v| v + 0.0);
                assert!(set.contains(&key(r)), "{p:?} * {q:?} = {r:?}");
                // Largest pairwise cosine between distinct units is 1/2
                // (the 24-cell: 60 degree minimum angle).
                if key(p) != key(q) {
                    assert!(dot(p, q) <= 0.5);
                }
            }
        }
        assert_eq!(HURWITZ[0], [1.0, 0.0, 0.0, 0.0]);
        assert_eq!(HURWITZ[3], [0.0, -1.0, 0.0, 0.0]);
        assert_eq!(HURWITZ[8], [0.5; 4]);
        assert_eq!(HURWITZ[9], [-0.5, 0.5, 0.5, 0.5]);
        assert_eq!(HURWITZ[23], [-0.5; 4]);
    }

    #[test]
    fn hamilton_product_follows_ij_k() {
        let (one, i, j, k) = (HURWITZ[0], HURWITZ[2], HURWITZ[4], HURWITZ[6]);
        assert_eq!(mul(i, j), k);
        assert_eq!(mul(j, k), i);
        assert_eq!(mul(k, i), j);
        assert_eq!(mul(j, i), HURWITZ[7]);
        assert_eq!(mul(i, i), HURWITZ[1]);
        assert_eq!(mul(one, [0.25, -2.0, 3.0, 8.0]), [0.25, -2.0, 3.0, 8.0]);
        // q * conj(q) = |q|^2.
        let q = [0.5f32, -0.25, 0.125, 1.0];
        assert_eq!(mul(q, conj(q)), [dot(q, q), 0.0, 0.0, 0.0]);
    }

    #[test]
    fn haar_units_are_unit_and_isotropic() {
        let mut rng = SplitMix64::new(7);
        let n = 200_000;
        let mut mean = [0f64; 4];
        let mut second = [[0f64; 4]; 4];
        for _ in 0..n {
            let q = haar_unit(&mut rng);
            assert!((f64::from(norm(q)) - 1.0).abs() < 4e-7, "{q:?}");
            for (a, row) in second.iter_mut().enumerate() {
                mean[a] += f64::from(q[a]);
                for (b, v) in row.iter_mut().enumerate() {
                    *v += f64::from(q[a]) * f64::from(q[b]);
                }
            }
        }
        // Uniform on S^3: E[q] = 0, E[q q^T] = I/4. Standard errors are
        // about 1/sqrt(4n) = 0.0011 and 0.0005.
        for (a, row) in second.iter().enumerate() {
            assert!((mean[a] / n as f64).abs() < 0.006, "mean {mean:?}");
            for (b, &v) in row.iter().enumerate() {
                let want = if a == b { 0.25 } else { 0.0 };
                let got = v / n as f64;
                assert!((got - want).abs() < 0.004, "second moment {a}{b}: {got}");
            }
        }
    }

    #[test]
    fn haar_fourth_moment_matches_the_sphere() {
        // On S^3, E[q_0^4] = 3 / (4 * 6) = 1/8; a uniform cube direction or a
        // non-normalized draw would give a different value.
        let mut rng = SplitMix64::new(99);
        let n = 200_000;
        let m4: f64 = (0..n)
            .map(|_| f64::from(haar_unit(&mut rng)[0]).powi(4))
            .sum::<f64>()
            / n as f64;
        assert!((m4 - 0.125).abs() < 0.002, "E[q0^4] = {m4}");
    }
}
