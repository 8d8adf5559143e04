//! Polar coordinates on the plane without libm: a table of `M = 2^m`
//! uniform directions defined by an exact procedure, the radius of a 2-D
//! sub-vector, and binning of a sub-vector to its nearest direction by
//! comparisons of dot products (no `atan2`).
//!
//! This is the angle/radius machinery of PolarQuant
//! (Wu et al., arXiv:2502.00527, section 3.2): a post-RoPE key pair
//! `(x, y)` becomes a radius `r = sqrt(x^2 + y^2)` and one of `M` angles.
//! The paper bins `atan2(y, x) + pi` uniformly on `[0, 2 pi)`; here the
//! angle bins are centred on the directions `u_k = (cos 2 pi k/M,
//! sin 2 pi k/M)` and a pair goes to the direction with the largest dot
//! product, which is the same as rounding its angle to the nearest multiple
//! of `2 pi / M` and needs no transcendental function. Every value that
//! defines file contents is computed with `+ - * / sqrt` only, so encoders on
//! every platform produce the same bytes (format/codecs/polar.md).

/// Largest supported angle bit width (`M = 256` directions).
pub const MAX_ANGLE_BITS: u32 = 8;

/// The binary64 value nearest to pi (`0x400921FB54442D18`).
const PI64: f64 = std::f64::consts::PI;

/// Terms of the nested Taylor series (enough for `|x| <= pi/4` to well
/// below one f64 ulp).
const TAYLOR_TERMS: u32 = 10;

/// `sin x` and `cos x` for `|x| <= pi/4` by the nested Taylor series of
/// format/codecs/polar.md, binary64 without fused multiply-add:
///
/// ```text
/// z = x * x
/// S = 1; for i = N..1: S = 1 - (z / ((2i)(2i+1))) * S      sin x = x * S
/// C = 1; for i = N..1: C = 1 - (z / ((2i-1)(2i))) * C      cos x = C
/// ```
fn sin_cos_reduced(x: f64) -> (f64, f64) {
    let z = x * x;
    let mut s = 1.0f64;
    let mut c = 1.0f64;
    for i in (1..=TAYLOR_TERMS).rev() {
        let i = f64::from(i);
        s = 1.0 - (z / ((2.0 * i) * (2.0 * i + 1.0))) * s;
        c = 1.0 - (z / ((2.0 * i - 1.0) * (2.0 * i))) * c;
    }
    (x * s, c)
}

/// The `M = 2^m` uniform unit directions `u_k = (cos, sin)(2 pi k / M)`,
/// `k = 0..M`, rounded to f32 by the exact procedure of
/// format/codecs/polar.md ("Direction table"): quarter-turn reduction with
/// integers, a binary64 Taylor series on `[-pi/4, pi/4]`, round to nearest
/// f32, negative zero replaced by `+0`.
///
/// # Panics
/// If `m` is 0 or above [`MAX_ANGLE_BITS`].
pub fn uniform_directions(m: u32) -> Vec<[f32; 2]> {
    assert!((1..=MAX_ANGLE_BITS).contains(&m));
    let big_m = 1i64 << m;
    (0..big_m)
        .map(|k| {
            let q = (4 * k + big_m / 2) / big_m;
            let t = 4 * k - q * big_m;
            let x = t as f64 * (PI64 / (2 * big_m) as f64);
            let (s, c) = sin_cos_reduced(x);
            let (cx, sy) = match q % 4 {
                0 => (c, s),
                1 => (-s, c),
                2 => (-c, -s),
                _ => (s, -c),
            };
            // `+ 0.0` turns a negative zero into +0 (RNE: -0 + +0 = +0).
            [cx as f32 + 0.0, sy as f32 + 0.0]
        })
        .collect()
}

/// Radius `sqrt(x^2 + y^2)` of a pair, computed in binary64 and rounded
/// once to f32 (cannot overflow for finite f32 inputs).
#[inline]
pub fn radius(x: f32, y: f32) -> f32 {
    let (x, y) = (f64::from(x), f64::from(y));
    (x * x + y * y).sqrt() as f32
}

/// Dot product of a pair with a direction as the format defines it:
/// `(x * c) + (y * s)` in f32, each product rounded, then the sum.
#[inline(always)]
fn dot(x: f32, y: f32, u: [f32; 2]) -> f32 {
    x * u[0] + y * u[1]
}

/// The nearest-direction rule of format/codecs/polar.md by exhaustive
/// search: the index `k` maximizing `dot``(x, y, dirs[k])`, ties to the
/// smallest `k` (so `(0, 0)` maps to 0).
///
/// # Panics
/// If `dirs` is empty.
pub fn nearest_direction_exhaustive(x: f32, y: f32, dirs: &[[f32; 2]]) -> u32 {
    let mut best = 0u32;
    let mut bd = dot(x, y, dirs[0]);
    for (k, &u) in dirs.iter().enumerate().skip(1) {
        let d = dot(x, y, u);
        if d > bd {
            best = k as u32;
            bd = d;
        }
    }
    best
}

/// Approximate angle of `(x, y)` in turns, in `[0, 1]`, without libm:
/// octant reduction and the Abramowitz-Stegun 4.4.49 arctangent polynomial
/// (absolute error below 1e-7 rad before f32 rounding). Only used to pick
/// candidates; the result never decides a code on its own.
#[inline]
fn approx_turns(x: f32, y: f32) -> f32 {
    // Branch-free selects: the signs of real data are unpredictable.
    let sel = |c: bool, a: f32, b: f32| {
        let m = 0u32.wrapping_sub(u32::from(c));
        f32::from_bits((a.to_bits() & m) | (b.to_bits() & !m))
    };
    let (ax, ay) = (x.abs(), y.abs());
    let (num, den) = (ax.min(ay), ax.max(ay));
    let z = num / sel(den > 0.0, den, 1.0);
    let z2 = z * z;
    let p = 0.002_866_225_5f32;
    let p = -0.016_165_737 + z2 * p;
    let p = 0.042_909_613 + z2 * p;
    let p = -0.075_289_64 + z2 * p;
    let p = 0.106_562_64 + z2 * p;
    let p = -0.142_088_94 + z2 * p;
    let p = 0.199_935_51 + z2 * p;
    let p = -0.333_331_47 + z2 * p;
    let a = z + z * z2 * p; // atan(z) in [0, pi/4]
    let a = sel(ay > ax, std::f32::consts::FRAC_PI_2 - a, a);
    let a = sel(x < 0.0, std::f32::consts::PI - a, a);
    let a = sel(y < 0.0, 2.0 * std::f32::consts::PI - a, a);
    a * (0.5 * std::f32::consts::FRAC_1_PI)
}

/// Magnitude window in which [`NearestDirection::find`] may use its fast
/// path: all products with a direction component are normal floats and no
/// dot product overflows, so the candidate search provably agrees with the
/// exhaustive rule.
const FAST_MIN: f32 = 1.0e-30;
const FAST_MAX: f32 = 1.0e30;

/// Nearest-direction binning against a fixed direction table.
///
/// For the canonical [`uniform_directions`] table with `M >= 8` it finds
/// the answer of [`nearest_direction_exhaustive`] by evaluating only the
/// three directions around an approximate angle (the approximation error,
/// below 1e-6 turns, is far smaller than the 1/M bin, so the maximizer
/// and every direction within one bin of the pair are among the three);
/// otherwise it searches exhaustively. Both paths return identical codes
/// (property-tested).
#[derive(Debug, Clone, PartialEq)]
pub struct NearestDirection {
    dirs: Vec<[f32; 2]>,
    uniform: bool,
}

impl NearestDirection {
    /// Binning against `dirs` (`M >= 1` entries). The fast path is enabled
    /// when `dirs` is exactly the canonical uniform table of its size.
    ///
    /// # Panics
    /// If `dirs` is empty.
    pub fn new(dirs: Vec<[f32; 2]>) -> Self {
        assert!(!dirs.is_empty());
        let m = dirs.len().trailing_zeros();
        let uniform = dirs.len().is_power_of_two()
            && dirs.len() >= 8
            && m <= MAX_ANGLE_BITS
            && uniform_directions(m) == dirs;
        NearestDirection { dirs, uniform }
    }

    /// The direction table.
    pub fn directions(&self) -> &[[f32; 2]] {
        &self.dirs
    }

    /// Index of the direction nearest to `(x, y)` by the rule of
    /// [`nearest_direction_exhaustive`]. `x` and `y` must be finite.
    #[inline]
    pub fn find(&self, x: f32, y: f32) -> u32 {
        let mag = x.abs().max(y.abs());
        if !self.uniform || !(FAST_MIN..=FAST_MAX).contains(&mag) {
            return nearest_direction_exhaustive(x, y, &self.dirs);
        }
        let n = self.dirs.len() as u32;
        let mask = n - 1;
        let k0 = ((approx_turns(x, y) * n as f32 + 0.5) as u32) & mask;
        // The three candidates in ascending index order, so that ties go
        // to the smallest index as in the exhaustive search.
        let cand = if k0 == 0 {
            [0, 1, mask]
        } else if k0 == mask {
            [0, mask - 1, mask]
        } else {
            [k0 - 1, k0, k0 + 1]
        };
        let d = cand.map(|k| dot(x, y, self.dirs[k as usize]));
        let (mut best, mut bd) = (cand[0], d[0]);
        if d[1] > bd {
            (best, bd) = (cand[1], d[1]);
        }
        if d[2] > bd {
            best = cand[2];
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ulp_diff(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn taylor_series_matches_std_to_an_f64_ulp_or_two() {
        for i in -1000..=1000 {
            let x = f64::from(i) / 1000.0 * std::f64::consts::FRAC_PI_4;
            let (s, c) = sin_cos_reduced(x);
            assert!((s - x.sin()).abs() <= 4e-16, "{x}");
            assert!((c - x.cos()).abs() <= 4e-16, "{x}");
        }
    }

    #[test]
    fn uniform_directions_are_the_f32_rounded_unit_circle() {
        for m in 1..=MAX_ANGLE_BITS {
            let d = uniform_directions(m);
            assert_eq!(d.len(), 1 << m);
            for (k, u) in d.iter().enumerate() {
                let a = 2.0 * std::f64::consts::PI * k as f64 / (1u64 << m) as f64;
                let (c, s) = (a.cos() as f32 + 0.0, a.sin() as f32 + 0.0);
                // Within one f32 ulp of libm (double rounding may differ in
                // the last bit); libm's sin(pi) = 1.2e-16 where the table
                // has an exact 0.
                let close = |a: f32, b: f32| ulp_diff(a, b) <= 1 || (a - b).abs() < 1e-15;
                assert!(
                    close(u[0], c) && close(u[1], s),
                    "m {m} k {k}: {u:?} vs {c} {s}"
                );
                assert!(u[0].to_bits() != (-0.0f32).to_bits());
                assert!(u[1].to_bits() != (-0.0f32).to_bits());
            }
        }
        // Axis directions are exact.
        let d = uniform_directions(4);
        assert_eq!(d[0], [1.0, 0.0]);
        assert_eq!(d[4], [0.0, 1.0]);
        assert_eq!(d[8], [-1.0, 0.0]);
        assert_eq!(d[12], [0.0, -1.0]);
        assert_eq!(uniform_directions(1), vec![[1.0, 0.0], [-1.0, 0.0]]);
    }

    #[test]
    fn symmetric_directions_are_exact_mirrors() {
        // The quarter-turn reduction makes the table exactly symmetric.
        for m in 2..=MAX_ANGLE_BITS {
            let d = uniform_directions(m);
            let n = d.len();
            for k in 0..n {
                let mirror = d[(n - k) % n];
                assert_eq!(mirror, [d[k][0], -d[k][1] + 0.0], "m {m} k {k}");
            }
        }
    }

    #[test]
    fn approx_turns_is_accurate() {
        let mut worst = 0.0f64;
        for i in 0..20000 {
            let a = i as f64 / 20000.0 * std::f64::consts::TAU;
            let (x, y) = (a.cos() as f32 * 3.7, a.sin() as f32 * 3.7);
            let t = approx_turns(x, y) as f64;
            let want = (f64::from(y).atan2(f64::from(x)) / std::f64::consts::TAU).rem_euclid(1.0);
            let mut e = (t - want).abs();
            e = e.min(1.0 - e);
            worst = worst.max(e);
        }
        assert!(worst < 1e-6, "worst error {worst} turns");
    }

    #[test]
    fn zero_and_axis_ties_go_to_the_smallest_index() {
        let nd = NearestDirection::new(uniform_directions(4));
        assert_eq!(nd.find(0.0, 0.0), 0);
        assert_eq!(nd.find(-0.0, 0.0), 0);
        // Exactly between directions 0 and 1 (angle pi/16): both dot
        // products are computed from the table; whichever is larger wins,
        // ties to 0. Compare with the exhaustive rule.
        let h = uniform_directions(5)[1];
        assert_eq!(
            nd.find(h[0], h[1]),
            nearest_direction_exhaustive(h[0], h[1], nd.directions())
        );
        assert_eq!(nd.find(1.0, 0.0), 0);
        assert_eq!(nd.find(0.0, 2.0), 4);
        assert_eq!(nd.find(-5.0, 0.0), 8);
        assert_eq!(nd.find(1e-38, -1e-38), 14);
    }

    #[test]
    fn dense_sweep_fast_path_equals_exhaustive_search() {
        // 2^16 angles per table (many land within an ulp of a bin edge),
        // at magnitudes from 1e-29 to 1e29.
        for m in 3..=MAX_ANGLE_BITS {
            let nd = NearestDirection::new(uniform_directions(m));
            for i in 0..1u32 << 16 {
                let a = f64::from(i) / 65536.0 * std::f64::consts::TAU;
                let r = 10f64.powi((i % 59) as i32 - 29);
                let (x, y) = ((r * a.cos()) as f32, (r * a.sin()) as f32);
                assert_eq!(
                    nd.find(x, y),
                    nearest_direction_exhaustive(x, y, nd.directions()),
                    "m {m} angle {a} r {r}"
                );
            }
        }
    }

    proptest! {
        #[test]
        fn fast_path_equals_exhaustive_search(
            m in 1u32..=8,
            x in -1.0e4f32..1.0e4,
            y in -1.0e4f32..1.0e4,
            e in -40i32..40,
        ) {
            let s = 2f32.powi(e);
            let (x, y) = (x * s, y * s);
            let nd = NearestDirection::new(uniform_directions(m));
            prop_assert_eq!(nd.find(x, y), nearest_direction_exhaustive(x, y, nd.directions()));
        }

        #[test]
        fn boundaries_agree_with_exhaustive_search(m in 3u32..=7, k in 0u32..512, bump in -3i32..=3) {
            // Points on (or one ulp around) the half-way directions.
            let fine = uniform_directions(m + 1);
            let u = fine[(2 * k as usize + 1) % fine.len()];
            let nudge = |v: f32| f32::from_bits((v.to_bits() as i32 + bump) as u32);
            let (x, y) = (nudge(u[0]), u[1]);
            let nd = NearestDirection::new(uniform_directions(m));
            prop_assert_eq!(nd.find(x, y), nearest_direction_exhaustive(x, y, nd.directions()));
        }

        #[test]
        fn nearest_direction_is_within_half_a_bin(m in 1u32..=8, a in 0.0f64..1.0, r in 0.001f64..1000.0) {
            let ang = a * std::f64::consts::TAU;
            let (x, y) = ((r * ang.cos()) as f32, (r * ang.sin()) as f32);
            let n = 1u32 << m;
            let k = NearestDirection::new(uniform_directions(m)).find(x, y);
            let diff = (a * f64::from(n) - f64::from(k)).rem_euclid(f64::from(n));
            let diff = diff.min(f64::from(n) - diff);
            prop_assert!(diff <= 0.5 + 1e-4, "angle {a} turns -> bin {k} of {n}");
        }
    }
}
