//! Group-wise asymmetric INT-b quantization with an fp16 scale and an fp16
//! minimum per group of `g` consecutive channels of one head vector: the
//! value quantizer the OCTOPUS paper pairs with its key codec (section 4,
//! "value group size g in {16, 32}"; KIVI's per-token value groups).
//!
//! Normative rules (format/codecs/octopus.md "Value groups"), IEEE binary32
//! round to nearest even, no fused multiply-add, `L = 2^b - 1`:
//!
//! ```text
//! mn, mx = min, max of the group          (NaN/inf rejected)
//! m  = f16(mn)            ; mf = f32(m)
//! s  = f16((mx - mf) / L) ; sf = f32(s)   (must be finite)
//! q_i = 0                                          if sf == 0
//!       rne(clamp((x_i - mf) * (1 / sf), 0, L))    otherwise
//! x^_i = f32(q_i) * sf + mf                        (decode: multiply, then add)
//! ```
//!
//! `f16(.)` rounds to nearest even. Cost: `b + 32 / g` bits per element.

use half::f16;

use crate::error::{Error, Result};

/// `1.5 * 2^23`: adding and subtracting it rounds to the nearest integer,
/// ties to even, for values in `[0, 2^22)`.
const RNE_MAGIC: f32 = 12_582_912.0;

/// Quantizes one head vector `x` in groups of `g` channels.
///
/// Writes `x.len()` codes (each `< 2^bits`) to `codes` and `x.len() / g`
/// scales and minimums.
///
/// # Errors
/// [`Error::Parameter`] when a group holds NaN or inf, or its range does
/// not fit fp16 (the caller adds the location).
///
/// # Panics
/// If `g` does not divide `x.len()`, `bits` is not in 1..=8, or an output
/// slice has the wrong length.
pub fn quantize(
    x: &[f32],
    g: usize,
    bits: u32,
    codes: &mut [u8],
    scales: &mut [f16],
    mins: &mut [f16],
) -> Result<()> {
    assert!(g > 0 && x.len().is_multiple_of(g) && (1..=8).contains(&bits));
    assert!(codes.len() == x.len() && scales.len() == x.len() / g && mins.len() == scales.len());
    let levels = ((1u32 << bits) - 1) as f32;
    for (j, xs) in x.chunks_exact(g).enumerate() {
        let (mn, mx) = super::affine::min_max(xs)?;
        let m = f16::from_f32(mn);
        let mf = m.to_f32();
        let s = f16::from_f32((mx - mf) / levels);
        let sf = s.to_f32();
        if !mf.is_finite() || !sf.is_finite() {
            return Err(Error::param(format!(
                "value group range [{mn}, {mx}] does not fit fp16"
            )));
        }
        let cs = &mut codes[j * g..(j + 1) * g];
        if sf == 0.0 {
            cs.fill(0);
        } else {
            let inv = 1.0 / sf;
            for (c, &v) in cs.iter_mut().zip(xs) {
                let t = ((v - mf) * inv).clamp(0.0, levels);
                *c = ((t + RNE_MAGIC) - RNE_MAGIC) as u8;
            }
        }
        scales[j] = s;
        mins[j] = m;
    }
    Ok(())
}

/// Decodes one head vector: `out_i = f32(q_i) * scale + min` for the group
/// of channel `i`.
///
/// # Panics
/// If the slice lengths are inconsistent with `g`.
pub fn dequantize(codes: &[u8], g: usize, scales: &[f32], mins: &[f32], out: &mut [f32]) {
    assert!(
        codes.len() == out.len() && out.len() == scales.len() * g && mins.len() == scales.len()
    );
    for (((o, c), &s), &m) in out
        .chunks_exact_mut(g)
        .zip(codes.chunks_exact(g))
        .zip(scales)
        .zip(mins)
    {
        for (v, &q) in o.iter_mut().zip(c) {
            *v = q as f32 * s + m;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(x: &[f32], g: usize, bits: u32) -> (Vec<f32>, Vec<f32>) {
        let n = x.len();
        let (mut c, mut s, mut m) = (vec![0u8; n], vec![f16::ZERO; n / g], vec![f16::ZERO; n / g]);
        quantize(x, g, bits, &mut c, &mut s, &mut m).unwrap();
        let sf: Vec<f32> = s.iter().map(|v| v.to_f32()).collect();
        let mf: Vec<f32> = m.iter().map(|v| v.to_f32()).collect();
        let mut out = vec![0f32; n];
        dequantize(&c, g, &sf, &mf, &mut out);
        (out, sf)
    }

    #[test]
    fn error_is_within_half_a_step() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 29 % 23) as f32 - 11.0) * 0.37)
            .collect();
        for bits in [2u32, 3, 4, 8] {
            for g in [16usize, 32] {
                let (y, s) = round_trip(&x, g, bits);
                for (i, (a, b)) in x.iter().zip(&y).enumerate() {
                    // Half a step plus the fp16 rounding of the minimum.
                    let tol = s[i / g] * 0.5 + a.abs().max(4.0) * 1e-3;
                    assert!((a - b).abs() <= tol, "b={bits} g={g} i={i}: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn constant_groups_and_errors() {
        let (y, s) = round_trip(&[3.0; 16], 16, 4);
        assert_eq!(s[0], 0.0);
        assert!(y.iter().all(|&v| v == 3.0));
        let mut c = [0u8; 16];
        let (mut s, mut m) = ([f16::ZERO], [f16::ZERO]);
        let mut x = [0f32; 16];
        x[3] = f32::NAN;
        assert!(quantize(&x, 16, 4, &mut c, &mut s, &mut m).is_err());
        x[3] = 1e6;
        assert!(quantize(&x, 16, 4, &mut c, &mut s, &mut m).is_err());
    }
}
