//! Asymmetric (affine) row quantization: one scale and one zero point per
//! row, `b`-bit codes. This is the token-wise INT-b quantizer of the BDR
//! paper (SAW-INT4, Jia et al., arXiv:2604.19157, appendix A.1, Eq. 3-4)
//! with an unrounded fp32 zero point.
//!
//! Normative rules (format/codecs/int.md), all in IEEE f32, round to nearest
//! even, no fused multiply-add:
//!
//! ```text
//! L    = 2^b - 1
//! mn   = min(x), mx = max(x)
//! s    = (mx - mn) / L
//! if s < 2^-126 { s = 1; z = 0 - mn } else { z = 0 - (mn / s) }
//! inv  = 1 / s
//! q_i  = rne(clamp(x_i * inv + z, 0, L))
//! x^_i = (q_i - z) * s                                   (decode)
//! ```

use crate::error::{Error, Result};

use super::bitpack;

/// Smallest positive normal f32, `2^-126`: scales below it are degenerate.
const MIN_NORMAL: f32 = f32::MIN_POSITIVE;
/// `1.5 * 2^23`: adding and subtracting it rounds a value in `[0, 2^22)` to
/// the nearest integer, ties to even.
const RNE_MAGIC: f32 = 12_582_912.0;

/// Per-row quantization parameters as stored in the SCALE and ZERO sections.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowParams {
    /// Step between adjacent codes, in value units.
    pub scale: f32,
    /// Zero point in code units (unrounded): code `z` decodes to 0.
    pub zero: f32,
}

/// Minimum and maximum of a row.
///
/// # Errors
/// [`Error::Parameter`] when the row contains NaN or ±inf (a quantizing
/// codec cannot represent it; the caller adds the location).
pub fn min_max(x: &[f32]) -> Result<(f32, f32)> {
    #[cfg(target_arch = "x86_64")]
    if super::simd_available() {
        // SAFETY: AVX2 availability checked.
        let (lo, hi, ok) = unsafe { super::x86::min_max(x) };
        return if ok {
            finite_range(lo, hi)
        } else {
            Err(non_finite())
        };
    }
    min_max_scalar(x)
}

fn non_finite() -> Error {
    Error::param("non-finite value (NaN or inf) in a row to quantize")
}

/// `(lo, hi)` when `hi - lo` is finite; an affine code of a row whose range
/// overflows f32 (values near ±3.4e38 of both signs) would decode to
/// garbage, so such a row is refused like a non-finite one.
fn finite_range(lo: f32, hi: f32) -> Result<(f32, f32)> {
    if (hi - lo).is_finite() {
        Ok((lo, hi))
    } else {
        Err(Error::param(format!(
            "the row's range {lo:e}..{hi:e} overflows f32; an affine code cannot represent it \
             (use raw, or a codec with outliers)"
        )))
    }
}

/// Portable reference of [`min_max`].
///
/// # Errors
/// As [`min_max`].
pub fn min_max_scalar(x: &[f32]) -> Result<(f32, f32)> {
    let mut mn = [f32::INFINITY; 8];
    let mut mx = [f32::NEG_INFINITY; 8];
    let mut bad = [0.0f32; 8];
    let (chunks, rest) = x.as_chunks::<8>();
    for c in chunks {
        for l in 0..8 {
            let v = c[l];
            // The lane rule of x86 `minps`/`maxps` (the AVX2 path): keep
            // the accumulator only when strictly smaller (larger), else take
            // `v`, so ties between +0 and -0 resolve the same way on every
            // CPU and the zero point's sign bit is portable.
            mn[l] = if mn[l] < v { mn[l] } else { v };
            mx[l] = if mx[l] > v { mx[l] } else { v };
            bad[l] += v * 0.0;
        }
    }
    let mut lo = f32::INFINITY;
    let mut hi = f32::NEG_INFINITY;
    let mut b = 0.0f32;
    for l in 0..8 {
        lo = if mn[l] < lo { mn[l] } else { lo };
        hi = if mx[l] > hi { mx[l] } else { hi };
        b += bad[l];
    }
    for &v in rest {
        lo = if v < lo { v } else { lo };
        hi = if v > hi { v } else { hi };
        b += v * 0.0;
    }
    if b != 0.0 || b.is_nan() {
        return Err(non_finite());
    }
    finite_range(lo, hi)
}

/// Scale, zero point and reciprocal scale for `levels = 2^b - 1` (module
/// docs give the rule).
pub fn params(mn: f32, mx: f32, levels: u32) -> (RowParams, f32) {
    let s = (mx - mn) / levels as f32;
    let (scale, zero) = if s < MIN_NORMAL || !s.is_finite() {
        (1.0, 0.0 - mn)
    } else {
        (s, 0.0 - (mn / s))
    };
    (RowParams { scale, zero }, 1.0 / scale)
}

/// Quantizes `x` to codes in `0..=levels` with precomputed parameters.
///
/// # Panics
/// If `codes.len() != x.len()`.
#[inline]
pub fn quantize_codes(x: &[f32], inv: f32, zero: f32, levels: u32, codes: &mut [u8]) {
    assert_eq!(x.len(), codes.len());
    let l = levels as f32;
    for (c, &v) in codes.iter_mut().zip(x) {
        let t = (v * inv + zero).clamp(0.0, l);
        *c = ((t + RNE_MAGIC) - RNE_MAGIC) as u8;
    }
}

/// Quantizes one row: computes its parameters, writes `packed_len(x.len(),
/// bits)` bytes of `bits`-bit codes (1..=8) into `packed`.
///
/// # Errors
/// [`Error::Parameter`] when `x` holds NaN or inf.
///
/// # Panics
/// If `packed` has the wrong length or `x.len() > 1024`.
pub fn quantize_row(x: &[f32], bits: u32, packed: &mut [u8]) -> Result<RowParams> {
    let (mn, mx) = min_max(x)?;
    Ok(quantize_row_in_range(x, mn, mx, bits, packed))
}

/// [`quantize_row`] with the row's minimum and maximum already known (e.g.
/// from [`scale_min_max`]).
///
/// # Panics
/// If `packed` has the wrong length or `x.len() > 1024`.
pub fn quantize_row_in_range(
    x: &[f32],
    mn: f32,
    mx: f32,
    bits: u32,
    packed: &mut [u8],
) -> RowParams {
    let levels = (1u32 << bits) - 1;
    let (p, inv) = params(mn, mx, levels);
    #[cfg(target_arch = "x86_64")]
    if bits == 4 && x.len().is_multiple_of(32) && super::simd_available() {
        // SAFETY: AVX2 checked; x.len() is a multiple of 32 and
        // packed.len() == x.len() / 2 is asserted by pack_u8's contract below.
        assert_eq!(packed.len(), x.len() / 2);
        unsafe { super::x86::quantize_pack4(x, inv, p.zero, packed) };
        return p;
    }
    let mut codes = [0u8; 1024];
    let codes = &mut codes[..x.len()];
    quantize_codes(x, inv, p.zero, levels, codes);
    bitpack::pack_u8(codes, bits, packed);
    p
}

/// Multiplies `x` by `c` in place (one IEEE multiplication each) and
/// returns the minimum and maximum of the result, in one pass.
///
/// # Errors
/// As [`min_max`].
pub fn scale_min_max(x: &mut [f32], c: f32) -> Result<(f32, f32)> {
    #[cfg(target_arch = "x86_64")]
    if super::simd_available() {
        // SAFETY: AVX2 availability checked.
        let (lo, hi, ok) = unsafe { super::x86::scale_min_max(x, c) };
        return if ok {
            finite_range(lo, hi)
        } else {
            Err(non_finite())
        };
    }
    super::scale(x, c);
    min_max_scalar(x)
}

/// Decodes one row of `out.len()` values from `bits`-bit codes:
/// `out_i = (q_i - zero) * scale`.
///
/// # Panics
/// If `packed` is too short or `out.len() > 1024`.
pub fn dequantize_row(packed: &[u8], bits: u32, p: RowParams, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if bits == 4 && out.len().is_multiple_of(8) && super::simd_available() {
        assert!(packed.len() >= out.len() / 2);
        // SAFETY: AVX2 checked; lengths asserted above.
        unsafe { super::x86::dequant4(packed, p.scale, p.zero, out) };
        return;
    }
    if bits == 4 {
        dequantize_row_4bit(packed, p, out);
        return;
    }
    let mut codes = [0u8; 1024];
    let codes = &mut codes[..out.len()];
    bitpack::unpack_u8(packed, bits, codes);
    for (o, &q) in out.iter_mut().zip(codes.iter()) {
        *o = (q as f32 - p.zero) * p.scale;
    }
}

/// 4-bit specialization of [`dequantize_row`] (identical results).
fn dequantize_row_4bit(packed: &[u8], p: RowParams, out: &mut [f32]) {
    let (pairs, rest) = out.as_chunks_mut::<2>();
    for (o, &b) in pairs.iter_mut().zip(packed) {
        o[0] = ((b & 15) as f32 - p.zero) * p.scale;
        o[1] = ((b >> 4) as f32 - p.zero) * p.scale;
    }
    if let [last] = rest {
        *last = ((packed[pairs.len()] & 15) as f32 - p.zero) * p.scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_reproduced() {
        let x = [-2.0f32, -1.0, 0.0, 0.5, 1.0, 3.0, 2.9, -1.9];
        let mut packed = [0u8; 4];
        let p = quantize_row(&x, 4, &mut packed).unwrap();
        let mut y = [0.0f32; 8];
        dequantize_row(&packed, 4, p, &mut y);
        assert!((y[0] - -2.0).abs() < 1e-6 && (y[5] - 3.0).abs() < 1e-6);
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() <= p.scale / 2.0 + 1e-6);
        }
    }

    #[test]
    fn constant_row_is_exact() {
        let x = [1.25f32; 16];
        let mut packed = [0u8; 8];
        let p = quantize_row(&x, 4, &mut packed).unwrap();
        assert_eq!(p.scale, 1.0);
        let mut y = [0.0f32; 16];
        dequantize_row(&packed, 4, p, &mut y);
        assert_eq!(y, x);
    }

    #[test]
    fn negative_zero_minimum_gives_positive_zero_point() {
        let x = [-0.0f32, 1.0, 0.5, 0.25];
        let (mn, mx) = min_max(&x).unwrap();
        let (p, _) = params(mn, mx, 15);
        assert_eq!(p.zero.to_bits(), 0);
    }

    #[test]
    fn non_finite_is_rejected() {
        assert!(min_max(&[1.0, f32::NAN]).is_err());
        assert!(min_max(&[f32::INFINITY; 9]).is_err());
    }

    #[test]
    fn rne_magic_rounds_ties_to_even() {
        let mut codes = [0u8; 4];
        quantize_codes(&[0.5, 1.5, 2.5, 14.5], 1.0, 0.0, 15, &mut codes);
        assert_eq!(codes, [0, 2, 2, 14]);
    }
}
