//! Group-wise quantization with fp16 scales: asymmetric (scale + zero point
//! in value units) and symmetric (scale + sign bits, `b`-bit magnitudes).
//!
//! These are the quantizers of KIVI (keys per channel over token groups,
//! values per token over channel groups; fp16 scale and zero point) and of
//! InnerQ (Tayaranian Hosseini et al., arXiv:2602.23200, section 4.1.1, Eq. 10-13:
//! asymmetric `S = (max - min)/(2^b - 1)`, `Z = min`; symmetric
//! `S = max|x|/(2^b - 1)`, dequantized as `S q + Z`). A group is a short list
//! of values (gathered by the caller from a page); the functions here only
//! see that list.
//!
//! Normative rules (format/codecs/kivi.md, format/codecs/innerq.md), IEEE
//! binary32, round to nearest even, no fused multiply-add:
//!
//! ```text
//! L = 2^b - 1
//! asymmetric:  Z  = min (f32, InnerQ) or f16_floor(min) (KIVI)
//!              S  = f16_ceil((max - Z) / L)
//!              q  = S > 0 ? rne(clamp((x - Z) / S, 0, L)) : 0
//!              x^ = f32(q) * S + Z
//! symmetric:   S  = f16_ceil(max|x| / L)
//!              q  = S > 0 ? rne(clamp(|x| / S, 0, L)) : 0 ; sign = x < 0 && q > 0
//!              x^ = sign ? -(f32(q) * S) : f32(q) * S
//! ```
//!
//! `f16_ceil` / `f16_floor` give the smallest / largest binary16 value not
//! below / above their argument, so the codes never need clamping at the
//! top: rounding the scale up keeps `max` inside the code range.

use half::f16;

use crate::error::{Error, Result};

/// `1.5 * 2^23`: adding and subtracting it rounds a value in `[0, 2^22)` to
/// the nearest integer, ties to even.
const RNE_MAGIC: f32 = 12_582_912.0;

/// Round to nearest integer, ties to even, for `0 <= t < 2^22`.
#[inline(always)]
fn rne(t: f32) -> f32 {
    (t + RNE_MAGIC) - RNE_MAGIC
}

/// The smallest binary16 value `>= x`, for finite `x >= 0`; `None` when it
/// would exceed the largest finite f16 (65504).
pub fn f16_ceil(x: f32) -> Option<f16> {
    debug_assert!(x >= 0.0);
    let h = f16::from_f32(x);
    let h = if h.to_f32() < x {
        f16::from_bits(h.to_bits() + 1)
    } else {
        h
    };
    h.is_finite().then_some(h)
}

/// The largest binary16 value `<= x`, for finite `x`; `None` below -65504.
pub fn f16_floor(x: f32) -> Option<f16> {
    let h = f16::from_f32(x);
    let h = if h.to_f32() > x {
        let b = h.to_bits();
        f16::from_bits(match b {
            0x0000 => 0x8001,              // +0 -> -smallest subnormal
            b if b & 0x8000 == 0 => b - 1, // positive: step down
            b => b + 1,                    // negative: step away from zero
        })
    } else {
        h
    };
    h.is_finite().then_some(h)
}

fn scale_overflow(what: &str, v: f32) -> Error {
    Error::param(format!(
        "a group {what} of {v:e} does not fit the fp16 range (|x| <= 65504) of this codec's parameters"
    ))
}

/// Minimum, maximum and largest magnitude of a group.
///
/// # Errors
/// [`Error::Parameter`] when the group holds NaN or infinity.
pub fn min_max(x: &[f32]) -> Result<(f32, f32)> {
    super::affine::min_max(x)
}

/// Parameters of an asymmetric group: scale `S` (an f16 value) and zero
/// point `Z` in value units.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AsymParams {
    /// Step between codes (exactly representable in f16).
    pub scale: f16,
    /// Value of code 0.
    pub zero: f32,
}

/// Asymmetric parameters for a group with minimum `mn` and maximum `mx`
/// and `levels = 2^b - 1`. `f16_zero` rounds the zero point down to f16
/// (KIVI); otherwise it is `mn` itself (InnerQ's fp32 zero point).
///
/// # Errors
/// [`Error::Parameter`] when the scale (or an f16 zero point) exceeds the
/// f16 range.
pub fn asym_params(mn: f32, mx: f32, levels: u32, f16_zero: bool) -> Result<AsymParams> {
    let zero = if f16_zero {
        f16_floor(mn)
            .ok_or_else(|| scale_overflow("minimum", mn))?
            .to_f32()
    } else {
        mn
    };
    let s = (mx - zero) / levels as f32;
    let scale = f16_ceil(s).ok_or_else(|| scale_overflow("scale", s))?;
    Ok(AsymParams { scale, zero })
}

/// Asymmetric codes of `x` with parameters `p` (module docs give the rule).
///
/// # Panics
/// If `codes.len() != x.len()`.
pub fn quantize_asym(x: &[f32], p: AsymParams, levels: u32, codes: &mut [u8]) {
    assert_eq!(x.len(), codes.len());
    let s = p.scale.to_f32();
    if s <= 0.0 {
        codes.fill(0);
        return;
    }
    let l = levels as f32;
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = rne(((v - p.zero) / s).clamp(0.0, l)) as u8;
    }
}

/// Asymmetric dequantization `f32(q) * S + Z` (two roundings).
#[inline(always)]
pub fn dequantize_asym(q: u8, scale: f32, zero: f32) -> f32 {
    f32::from(q) * scale + zero
}

/// Symmetric scale `f16_ceil(max|x| / levels)` for a group with largest
/// magnitude `amax`.
///
/// # Errors
/// [`Error::Parameter`] when the scale exceeds the f16 range.
pub fn sym_scale(amax: f32, levels: u32) -> Result<f16> {
    let s = amax / levels as f32;
    f16_ceil(s).ok_or_else(|| scale_overflow("scale", s))
}

/// Symmetric magnitudes and sign bits of `x`: sets bit `i % 32` of
/// `signs[i / 32]` iff `x_i < 0` and its code is non-zero (other bits are
/// left as they are; pass zeroed words).
///
/// # Panics
/// If `codes.len() != x.len()` or `signs` has fewer than `ceil(len / 32)`
/// words.
pub fn quantize_sym(x: &[f32], scale: f16, levels: u32, codes: &mut [u8], signs: &mut [u32]) {
    assert_eq!(x.len(), codes.len());
    assert!(signs.len() * 32 >= x.len());
    let s = scale.to_f32();
    if s <= 0.0 {
        codes.fill(0);
        return;
    }
    let l = levels as f32;
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = rne((v.abs() / s).clamp(0.0, l)) as u8;
    }
    for (w, (cc, xc)) in signs.iter_mut().zip(codes.chunks(32).zip(x.chunks(32))) {
        let mut bits = 0u32;
        for (i, (&c, &v)) in cc.iter().zip(xc).enumerate() {
            bits |= (u32::from(v < 0.0) & u32::from(c > 0)) << i;
        }
        *w |= bits;
    }
}

/// Symmetric dequantization: `f32(q) * S`, negated when `negative`.
#[inline(always)]
pub fn dequantize_sym(q: u8, scale: f32, negative: bool) -> f32 {
    // Negation flips the sign bit (exactly `-v`), without a branch.
    let v = f32::from(q) * scale;
    f32::from_bits(v.to_bits() ^ (u32::from(negative) << 31))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn f16_rounding_directions() {
        assert_eq!(f16_ceil(1.0).unwrap().to_f32(), 1.0);
        let c = f16_ceil(1.0001).unwrap().to_f32();
        assert!(c > 1.0001 && c < 1.002);
        assert!(f16_ceil(65504.0).is_some());
        assert!(f16_ceil(65505.0).is_none());
        assert_eq!(f16_ceil(0.0).unwrap().to_f32(), 0.0);
        assert!(f16_ceil(1e-9).unwrap().to_f32() > 0.0);
        let f = f16_floor(-1.0001).unwrap().to_f32();
        assert!(f < -1.0001 && f > -1.002);
        assert!(f16_floor(1e-9).unwrap().to_f32() < 1e-9);
        assert!(f16_floor(-1e-9).unwrap().to_f32() < -1e-9);
        assert!(f16_floor(-65505.0).is_none());
        assert_eq!(f16_floor(3.0).unwrap().to_f32(), 3.0);
    }

    #[test]
    fn asym_reproduces_endpoints_within_the_f16_step() {
        let x = [-1.5f32, 0.25, 2.0, 0.7, -0.3];
        let p = asym_params(-1.5, 2.0, 3, false).unwrap();
        let mut q = [0u8; 5];
        quantize_asym(&x, p, 3, &mut q);
        assert_eq!(q[0], 0);
        assert_eq!(q[2], 3);
        let s = p.scale.to_f32();
        for (&v, &c) in x.iter().zip(&q) {
            assert!((dequantize_asym(c, s, p.zero) - v).abs() <= s / 2.0 + 1e-6);
        }
    }

    #[test]
    fn sym_keeps_signs_and_zero_is_positive() {
        let x = [-2.0f32, 1.0, -0.01, 0.0, 2.0];
        let s = sym_scale(2.0, 3).unwrap();
        let mut q = [0u8; 5];
        let mut signs = [0u32];
        quantize_sym(&x, s, 3, &mut q, &mut signs);
        assert_eq!(q, [3, 1, 0, 0, 3]); // 1.0 / 0.667 = 1.499 -> 1
        assert_eq!(signs, [0b00001]);
        let sf = s.to_f32();
        assert_eq!(dequantize_sym(q[0], sf, true), -(3.0 * sf));
        assert!(
            sf * 3.0 >= 2.0 && sf * 3.0 < 2.002,
            "scale rounded up to f16"
        );
        assert_eq!(dequantize_sym(q[2], sf, false).to_bits(), 0);
    }

    #[test]
    fn constant_groups_decode_exactly() {
        let p = asym_params(0.75, 0.75, 15, false).unwrap();
        assert_eq!(p.scale.to_f32(), 0.0);
        let mut q = [9u8; 4];
        quantize_asym(&[0.75; 4], p, 15, &mut q);
        assert_eq!(q, [0; 4]);
        assert_eq!(dequantize_asym(0, 0.0, p.zero), 0.75);
        assert_eq!(sym_scale(0.0, 3).unwrap().to_f32(), 0.0);
    }

    #[test]
    fn out_of_range_scales_are_parameter_errors() {
        assert!(asym_params(-1e6, 1e6, 3, false).is_err());
        assert!(asym_params(-7e4, 0.0, 15, true).is_err());
        assert!(sym_scale(1e6, 1).is_err());
    }

    proptest! {
        #[test]
        fn error_is_at_most_half_a_step(
            vals in proptest::collection::vec(-300.0f32..300.0, 1..40),
            bits in 1u32..=8,
            f16_zero in any::<bool>(),
        ) {
            let levels = (1u32 << bits) - 1;
            let (mn, mx) = min_max(&vals).unwrap();
            let p = asym_params(mn, mx, levels, f16_zero).unwrap();
            let mut q = vec![0u8; vals.len()];
            quantize_asym(&vals, p, levels, &mut q);
            let s = p.scale.to_f32();
            for (&v, &c) in vals.iter().zip(&q) {
                prop_assert!(u32::from(c) <= levels);
                let e = (dequantize_asym(c, s, p.zero) - v).abs();
                prop_assert!(e <= s * 0.5 + 1e-4 * (1.0 + v.abs()), "{v} -> {c}: err {e}, step {s}");
            }
            let amax = mn.abs().max(mx.abs());
            let ss = sym_scale(amax, levels).unwrap();
            let mut signs = [0u32; 2];
            quantize_sym(&vals, ss, levels, &mut q, &mut signs);
            let sf = ss.to_f32();
            for (i, (&v, &c)) in vals.iter().zip(&q).enumerate() {
                let e = (dequantize_sym(c, sf, signs[i / 32] >> (i % 32) & 1 == 1) - v).abs();
                prop_assert!(e <= sf * 0.5 + 1e-4 * (1.0 + v.abs()));
            }
        }
    }
}
