//! The octahedral map between directions in R^3 and the square `[-1, 1]^2`
//! (OCTOPUS paper, Boss et al., arXiv:2605.21226, section 3.2
//! Eq. 5-6 and appendix C.6-C.7; Engelhardt & Dachsbacher 2008).
//!
//! Exact arithmetic (normative for format/codecs/octopus.md): IEEE binary32,
//! round to nearest even, no fused multiply-add, `sgn(v) = -1` if `v < 0`
//! else `+1` (so `sgn(-0) = +1`, the paper's `sign(0) = +1`).

/// `-1.0` for negative `v`, else `+1.0` (also for `-0.0`).
#[inline(always)]
pub fn sgn(v: f32) -> f32 {
    if v < 0.0 { -1.0 } else { 1.0 }
}

/// Octahedral coordinates `(ξ, η)` of the direction of `t` (Eq. 5).
///
/// `t` need not be normalized: with `ℓ = (|x| + |y|) + |z|` and `p = t / ℓ`
/// (three divisions), `(ξ, η) = (p_x, p_y)` when `p_z >= 0`, else
/// `(sgn(p_x) (1 - |p_y|), sgn(p_y) (1 - |p_x|))`. The zero vector maps to
/// `(0, 0)`.
#[inline]
pub fn encode(t: [f32; 3]) -> (f32, f32) {
    let l = (t[0].abs() + t[1].abs()) + t[2].abs();
    let (px, py, pz) = (t[0] / l, t[1] / l, t[2] / l);
    // Both branches as selects (no data-dependent jumps, so that a loop
    // over triplets vectorizes); 0/0 lanes are replaced by (0, 0).
    let fx = sgn(px) * (1.0 - py.abs());
    let fy = sgn(py) * (1.0 - px.abs());
    let up = pz >= 0.0;
    let xi = if up { px } else { fx };
    let eta = if up { py } else { fy };
    if l == 0.0 { (0.0, 0.0) } else { (xi, eta) }
}

/// Unit direction of the square point `(ξ, η)` (Eq. 6):
///
/// ```text
/// r = (1 - |ξ|) - |η|
/// (x, y) = (ξ, η)                                   if r >= 0
///          (sgn(ξ) (1 - |η|), sgn(η) (1 - |ξ|))     otherwise
/// w = 1 / sqrt((x*x + y*y) + r*r)
/// n = (x*w, y*w, r*w)
/// ```
#[inline]
pub fn decode(xi: f32, eta: f32) -> [f32; 3] {
    let (ax, ay) = (xi.abs(), eta.abs());
    let r = (1.0 - ax) - ay;
    let (x, y) = if r >= 0.0 {
        (xi, eta)
    } else {
        (sgn(xi) * (1.0 - ay), sgn(eta) * (1.0 - ax))
    };
    let w = 1.0 / ((x * x + y * y) + r * r).sqrt();
    [x * w, y * w, r * w]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dirs() -> Vec<[f32; 3]> {
        // A deterministic spread of directions, including axes and faces.
        let mut v = vec![
            [1.0, 0.0, 0.0],
            [0.0, -1.0, 0.0],
            [0.0, 0.0, 1.0],
            [0.0, 0.0, -1.0],
            [0.3, -0.4, -0.5],
            [-0.6, 0.2, 0.0],
            [-0.0, 0.5, -0.5],
        ];
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..2000 {
            let mut c = [0f32; 3];
            for x in c.iter_mut() {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                *x = (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
            }
            v.push(c);
        }
        v
    }

    #[test]
    fn decode_inverts_encode() {
        for t in dirs() {
            let n = (t[0] * t[0] + t[1] * t[1] + t[2] * t[2]).sqrt();
            if n == 0.0 {
                continue;
            }
            let (xi, eta) = encode(t);
            assert!(xi.abs() <= 1.0 && eta.abs() <= 1.0);
            let d = decode(xi, eta);
            for k in 0..3 {
                assert!((d[k] - t[k] / n).abs() < 2e-6, "{t:?} -> {d:?}");
            }
        }
    }

    #[test]
    fn fold_convention_and_zero() {
        assert_eq!(encode([0.0, 0.0, 0.0]), (0.0, 0.0));
        // Lower hemisphere with p_x = -0: sgn(-0) = +1.
        assert_eq!(encode([-0.0, 0.5, -0.5]), (0.5, 1.0));
        assert_eq!(encode([0.0, 0.0, -1.0]), (1.0, 1.0));
        // The fold boundary p_z = 0 is on the upper branch.
        assert_eq!(encode([0.25, -0.75, 0.0]), (0.25, -0.75));
        // The corners all decode to the south pole.
        for (x, y) in [(1.0, 1.0), (-1.0, 1.0), (1.0, -1.0), (-1.0, -1.0)] {
            assert_eq!(decode(x, y), [0.0, 0.0, -1.0]);
        }
    }
}
