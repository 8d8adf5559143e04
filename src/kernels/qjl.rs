//! 1-bit QJL residual sketch (Zandieh, Daliri, Han, "QJL: 1-bit quantized
//! JL transform for KV cache quantization with zero overhead"; OCTOPUS
//! paper, arXiv:2605.21226, section 3.6 and appendix C.15).
//!
//! For a residual `r` in the rotated frame (`d` a power of two) and a
//! second rotation `R' = H_norm diag(s')` with an independent sign vector,
//! the sketch is `σ = sign(R' r)` (one bit per coordinate) and `γ_r = ||r||`
//! in fp16. The asymmetric estimator of `a . r` is
//! `ẑ(a) = sqrt(pi / (2d)) γ_r (R' a) . σ`, unbiased when `R'` is a
//! Gaussian projection (C.15); with the structured `R'` it is unbiased up
//! to the Gaussian approximation of Rademacher sums. By linearity
//! `ẑ(a) = a . r̂` with
//!
//! ```text
//! r̂ = sqrt(pi / (2d)) γ_r R'^T σ = (sqrt(pi/2) γ_r / d) s' ⊙ (H σ)
//! ```
//!
//! so adding `r̂` to a reconstruction makes every dot product with it the
//! QJL-corrected score.
//!
//! Exact arithmetic (normative for format/codecs/octopus.md), IEEE
//! binary32, no fused multiply-add:
//!
//! ```text
//! encode:  γ_r = f16(f32(sqrt(Σ_i f64(r_i)^2)))  (f64 sum in index order)
//!          w = H (s' ⊙ r)  (unnormalized, wht butterfly order)
//!          bit_j = 1 if w_j < 0 else 0           (σ_j = +1 for bit 0, -1 for bit 1)
//! decode:  h = H σ                                (exact: integers below 2^24)
//!          a = (f32(γ_r) * K) * (1/d)             K = 0x3FA06C99, the f32 nearest sqrt(pi/2)
//!          r̂_j = (s'_j * h_j) * a
//! ```

use half::f16;

use super::wht;

/// The f32 nearest to `sqrt(pi/2)` (bits `0x3FA06C99`).
pub const SQRT_HALF_PI: f32 = f32::from_bits(0x3FA0_6C99);

/// Sketches residual `r` (modified in place into `H (s' ⊙ r)`): writes one
/// bit per coordinate (1 = negative) to `bits` and returns `γ_r` in fp16.
///
/// # Panics
/// If the lengths differ or are not a power of two.
pub fn sketch(r: &mut [f32], s2: &[f32], bits: &mut [u8]) -> f16 {
    assert!(bits.len() == r.len());
    let gamma = f16::from_f32(super::l2_norm(r));
    super::rotation::forward(r, s2);
    for (b, &w) in bits.iter_mut().zip(r.iter()) {
        *b = u8::from(w < 0.0);
    }
    gamma
}

/// The scale `a = (γ_r * sqrt(pi/2)) * (1/d)` of the residual estimate.
#[inline]
pub fn scale(gamma_r: f16, d: usize) -> f32 {
    (gamma_r.to_f32() * SQRT_HALF_PI) * (1.0 / d as f32)
}

/// Adds `r̂` (module docs) to `out`: `out_j = out_j + (s'_j * h_j) * a`.
/// `tmp` is scratch of the same length.
///
/// # Panics
/// If the lengths differ or are not a power of two.
pub fn add_residual(bits: &[u8], gamma_r: f16, s2: &[f32], tmp: &mut [f32], out: &mut [f32]) {
    let d = out.len();
    assert!(bits.len() == d && s2.len() == d && tmp.len() == d);
    for (t, &b) in tmp.iter_mut().zip(bits) {
        *t = if b == 0 { 1.0 } else { -1.0 };
    }
    wht::fwht_blocks(tmp, d);
    let a = scale(gamma_r, d);
    for ((o, &h), &s) in out.iter_mut().zip(tmp.iter()).zip(s2) {
        *o += (s * h) * a;
    }
}

/// Projects a rotated query for [`estimate`]: `H (s' ⊙ q_rot)` (in place).
pub fn project_query(q_rot: &mut [f32], s2: &[f32]) {
    super::rotation::forward(q_rot, s2);
}

/// The estimator `ẑ = a Σ_j p_j σ_j` of `q_rot . r` for a projected query
/// `p` ([`project_query`]); accumulated in f64 (not normative).
pub fn estimate(projected: &[f32], bits: &[u8], gamma_r: f16) -> f64 {
    let dot: f64 = projected
        .iter()
        .zip(bits)
        .map(|(&p, &b)| if b == 0 { f64::from(p) } else { -f64::from(p) })
        .sum();
    f64::from(scale(gamma_r, projected.len())) * dot
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::rotation::signs;

    #[test]
    fn constant_is_sqrt_half_pi() {
        assert!((f64::from(SQRT_HALF_PI) - (std::f64::consts::PI / 2.0).sqrt()).abs() < 1e-7);
    }

    /// The estimate through `add_residual` equals `estimate` and is
    /// unbiased on average over projections.
    #[test]
    fn estimator_is_linear_and_nearly_unbiased() {
        let d = 128;
        let r: Vec<f32> = (0..d)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 300.0)
            .collect();
        let a: Vec<f32> = (0..d)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 40.0)
            .collect();
        let truth: f64 = r
            .iter()
            .zip(&a)
            .map(|(&x, &y)| f64::from(x) * f64::from(y))
            .sum();
        let n = 3000;
        let mut mean = 0.0;
        for seed in 0..n {
            let s2 = signs(seed, d);
            let mut w = r.clone();
            let mut bits = vec![0u8; d];
            let g = sketch(&mut w, &s2, &mut bits);
            let mut p = a.clone();
            project_query(&mut p, &s2);
            let z = estimate(&p, &bits, g);
            let mut rhat = vec![0f32; d];
            let mut tmp = vec![0f32; d];
            add_residual(&bits, g, &s2, &mut tmp, &mut rhat);
            let z2: f64 = rhat
                .iter()
                .zip(&a)
                .map(|(&x, &y)| f64::from(x) * f64::from(y))
                .sum();
            assert!((z - z2).abs() < 1e-4 * (1.0 + z.abs()), "{z} vs {z2}");
            mean += z / n as f64;
        }
        let norm_r = r.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
        let norm_a = a.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
        // Standard error of the mean: sqrt((pi/2 - 1) / n) |a||r| at most.
        let se = (0.58 / n as f64).sqrt() * norm_a * norm_r;
        assert!(
            (mean - truth).abs() < 4.0 * se,
            "mean {mean} truth {truth} se {se}"
        );
    }
}
