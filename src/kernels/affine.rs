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

use half::bf16;

use crate::error::{Error, Result};

use super::{bitpack, convert, wht};

/// AVX-512 paths of the 4-bit row step ([`encode_row4`], [`decode_row4`]).
#[cfg(target_arch = "x86_64")]
mod avx512;

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
        Err(overflow(lo, hi))
    }
}

fn overflow(lo: f32, hi: f32) -> Error {
    Error::param(format!(
        "the row's range {lo:e}..{hi:e} overflows f32; an affine code cannot represent it \
         (use raw, or a codec with outliers)"
    ))
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

/// A row to encode: f32 values or bf16 elements (widened exactly).
#[derive(Debug, Clone, Copy)]
pub enum RowSrc<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// bf16 elements.
    Bf16(&'a [bf16]),
}

/// Where a decoded row goes: f32 values, or bf16 elements (round to
/// nearest even, as [`convert::f32_to_bf16`]).
#[derive(Debug)]
pub enum RowDst<'a> {
    /// f32 values.
    F32(&'a mut [f32]),
    /// bf16 elements.
    Bf16(&'a mut [bf16]),
}

/// The AVX-512 kernel for rows of `d` values and rotation block `block`:
/// `Some(N)` registers per row when `d` is 64, 128 or 256 and the block
/// (if any) is at least 16 and divides `d`.
#[cfg(target_arch = "x86_64")]
fn avx512_regs(d: usize, block: Option<usize>) -> Option<usize> {
    let regs = matches!(d, 64 | 128 | 256).then_some(d / 16)?;
    let block_ok = block.is_none_or(|h| h >= 16 && h.is_power_of_two() && d.is_multiple_of(h));
    (block_ok && super::avx512_available()).then_some(regs)
}

/// Encodes one row as 4-bit affine codes, the row step of `int4` (`block
/// = None`) and `bdr{h}` (`block = Some(h)`, format/codecs/bdr.md: the
/// unnormalized transform of every `h`-block, times `1/sqrt(h)`), writing
/// `d / 2` bytes into `packed` (`d = scratch.len()`, the row's length;
/// `scratch` is working memory). Returns the row's parameters.
///
/// On AVX-512F CPUs rows of 64, 128 or 256 values stay in registers from
/// load to store; the result is bit-identical to [`encode_row4_portable`].
///
/// # Errors
/// [`Error::Parameter`] when the row holds NaN/inf or its range overflows
/// f32 (the caller adds the location).
///
/// # Panics
/// If `src` does not hold `d` values, `packed.len() != d / 2`, `d` is odd
/// or above 1024, or `block` does not divide `d`.
pub fn encode_row4(
    src: RowSrc<'_>,
    block: Option<usize>,
    scratch: &mut [f32],
    packed: &mut [u8],
) -> Result<RowParams> {
    let d = scratch.len();
    let n = match src {
        RowSrc::F32(x) => x.len(),
        RowSrc::Bf16(x) => x.len(),
    };
    assert!(
        n == d && packed.len() * 2 == d,
        "row of {n} values, {d} expected"
    );
    #[cfg(target_arch = "x86_64")]
    if let Some(regs) = avx512_regs(d, block) {
        let rotate = block.map(|h| (h, wht::inv_sqrt(h)));
        // SAFETY: avx512_regs checked AVX-512F, d == 16 * regs and the
        // block; lengths asserted above.
        let r = unsafe {
            match regs {
                4 => avx512::encode_row4::<4>(src, rotate, packed),
                8 => avx512::encode_row4::<8>(src, rotate, packed),
                _ => avx512::encode_row4::<16>(src, rotate, packed),
            }
        };
        return r.map_err(|(lo, hi, finite)| {
            if finite {
                overflow(lo, hi)
            } else {
                non_finite()
            }
        });
    }
    encode_row4_portable(src, block, scratch, packed)
}

/// The reference of [`encode_row4`]: widen into `scratch`,
/// [`wht::fwht_blocks`] and [`scale_min_max`] by [`wht::inv_sqrt`] (or
/// [`min_max`] without a block), then [`quantize_row_in_range`].
///
/// # Errors
/// As [`encode_row4`].
///
/// # Panics
/// As [`encode_row4`].
pub fn encode_row4_portable(
    src: RowSrc<'_>,
    block: Option<usize>,
    scratch: &mut [f32],
    packed: &mut [u8],
) -> Result<RowParams> {
    match src {
        RowSrc::F32(x) => scratch.copy_from_slice(x),
        RowSrc::Bf16(x) => convert::bf16_to_f32(x, scratch),
    }
    let (mn, mx) = match block {
        Some(h) => {
            wht::fwht_blocks(scratch, h);
            scale_min_max(scratch, wht::inv_sqrt(h))?
        }
        None => min_max(scratch)?,
    };
    Ok(quantize_row_in_range(scratch, mn, mx, 4, packed))
}

/// Decodes one row of `d = scratch.len()` values from 4-bit codes (`d /
/// 2` bytes of `packed`): `(q - p.zero) * p.scale`, then the unnormalized
/// transform of every `block`-block, stored to `dst` (the row step of the
/// `int4` / `bdr{h}` decoders; `p.scale` already includes the
/// `1/sqrt(h)` factor). `scratch` is working memory.
///
/// On AVX-512F CPUs rows of 64, 128 or 256 values stay in registers; the
/// result is bit-identical to [`decode_row4_portable`].
///
/// # Panics
/// If `dst` does not hold `d` values, `packed` is shorter than `d / 2`,
/// `d` is odd or above 1024, or `block` does not divide `d`.
pub fn decode_row4(
    packed: &[u8],
    p: RowParams,
    block: Option<usize>,
    scratch: &mut [f32],
    dst: RowDst<'_>,
) {
    let d = scratch.len();
    let n = match &dst {
        RowDst::F32(o) => o.len(),
        RowDst::Bf16(o) => o.len(),
    };
    assert!(
        n == d && packed.len() * 2 >= d,
        "row of {n} values, {d} expected"
    );
    #[cfg(target_arch = "x86_64")]
    if let Some(regs) = avx512_regs(d, block) {
        // SAFETY: avx512_regs checked AVX-512F, d == 16 * regs and the
        // block; lengths asserted above.
        unsafe {
            match regs {
                4 => avx512::decode_row4::<4>(packed, p.scale, p.zero, block, dst),
                8 => avx512::decode_row4::<8>(packed, p.scale, p.zero, block, dst),
                _ => avx512::decode_row4::<16>(packed, p.scale, p.zero, block, dst),
            }
        }
        return;
    }
    decode_row4_portable(packed, p, block, scratch, dst);
}

/// The reference of [`decode_row4`]: [`dequantize_row`] into `scratch`,
/// [`wht::fwht_blocks`], then a copy or [`convert::f32_to_bf16`].
///
/// # Panics
/// As [`decode_row4`].
pub fn decode_row4_portable(
    packed: &[u8],
    p: RowParams,
    block: Option<usize>,
    scratch: &mut [f32],
    dst: RowDst<'_>,
) {
    dequantize_row(packed, 4, p, scratch);
    if let Some(h) = block {
        wht::fwht_blocks(scratch, h);
    }
    match dst {
        RowDst::F32(o) => o.copy_from_slice(scratch),
        RowDst::Bf16(o) => convert::f32_to_bf16(scratch, o),
    }
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

    /// The row step of `int4` / `bdr{h}` from scalar operations only.
    fn encode_row4_scalar(x: &[f32], block: Option<usize>) -> Result<(RowParams, Vec<u8>)> {
        let mut y = x.to_vec();
        if let Some(h) = block {
            wht::fwht_blocks_scalar(&mut y, h);
            y.iter_mut().for_each(|v| *v *= wht::inv_sqrt(h));
        }
        let (mn, mx) = min_max_scalar(&y)?;
        let (p, inv) = params(mn, mx, 15);
        let mut codes = vec![0u8; y.len()];
        quantize_codes(&y, inv, p.zero, 15, &mut codes);
        let mut packed = vec![0u8; y.len() / 2];
        bitpack::pack_u8(&codes, 4, &mut packed);
        Ok((p, packed))
    }

    fn decode_row4_scalar(packed: &[u8], p: RowParams, block: Option<usize>, d: usize) -> Vec<f32> {
        let mut y: Vec<f32> = (0..d)
            .map(|i| (((packed[i / 2] >> (4 * (i % 2))) & 15) as f32 - p.zero) * p.scale)
            .collect();
        if let Some(h) = block {
            wht::fwht_blocks_scalar(&mut y, h);
        }
        y
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    proptest::proptest! {
        /// The dispatched row kernels (AVX-512 on CPUs that have it: rows
        /// of 64/128/256, blocks of 16 and up) equal the scalar operations
        /// bit for bit, from f32 and from bf16, into f32 and into bf16.
        #[test]
        fn row4_kernels_equal_the_scalar_reference(
            seed in proptest::prelude::any::<u64>(),
            d_pick in 0usize..5,
            h_pick in 0usize..6,
            spread in 1e-3f32..1e4,
            zeros in 0usize..4,
        ) {
            let d = [64usize, 128, 256, 32, 96][d_pick];
            let block = [None, Some(16), Some(32), Some(64), Some(d), Some(8)][h_pick]
                .filter(|h| h.is_power_of_two() && d.is_multiple_of(*h));
            let mut s = seed | 1;
            let mut x: Vec<f32> = (0..d).map(|_| {
                s ^= s << 13; s ^= s >> 7; s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * spread
            }).collect();
            // Zeros of both signs, so ties at the minimum or maximum occur.
            for k in 0..zeros {
                x[(seed as usize >> (8 * k)) % d] = if k % 2 == 0 { 0.0 } else { -0.0 };
            }
            let (want_p, want) = encode_row4_scalar(&x, block).unwrap();
            let mut scratch = vec![0f32; d];
            let mut got = vec![0u8; d / 2];
            let p = encode_row4(RowSrc::F32(&x), block, &mut scratch, &mut got).unwrap();
            proptest::prop_assert_eq!((p.scale.to_bits(), p.zero.to_bits()), (want_p.scale.to_bits(), want_p.zero.to_bits()));
            proptest::prop_assert_eq!(&got, &want);
            // From bf16: the same as from the widened values.
            let hb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            let wide: Vec<f32> = hb.iter().map(|v| v.to_f32()).collect();
            let (want_p, want) = encode_row4_scalar(&wide, block).unwrap();
            let p = encode_row4(RowSrc::Bf16(&hb), block, &mut scratch, &mut got).unwrap();
            proptest::prop_assert_eq!((p.scale.to_bits(), p.zero.to_bits()), (want_p.scale.to_bits(), want_p.zero.to_bits()));
            proptest::prop_assert_eq!(&got, &want);
            // Decode, with the decoder's folded scale.
            let c = block.map_or(1.0, wht::inv_sqrt);
            let q = RowParams { scale: p.scale * c, zero: p.zero };
            let want = decode_row4_scalar(&got, q, block, d);
            let mut out = vec![0f32; d];
            decode_row4(&got, q, block, &mut scratch, RowDst::F32(&mut out));
            proptest::prop_assert_eq!(bits(&out), bits(&want));
            let mut outb = vec![bf16::ZERO; d];
            decode_row4(&got, q, block, &mut scratch, RowDst::Bf16(&mut outb));
            let wantb: Vec<u16> = want.iter().map(|&v| convert::f32_to_bf16_bits(v)).collect();
            proptest::prop_assert_eq!(outb.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), wantb);
            // The portable compositions agree too.
            let p2 = encode_row4_portable(RowSrc::Bf16(&hb), block, &mut scratch, &mut got).unwrap();
            proptest::prop_assert_eq!(p2, p);
        }
    }

    /// Rows the affine code cannot represent are refused by the fused path
    /// with the portable path's error.
    #[test]
    fn row4_refuses_non_finite_and_overflowing_rows() {
        for d in [64usize, 128, 256] {
            for block in [None, Some(16), Some(d)] {
                for (at, v) in [
                    (3, f32::NAN),
                    (d - 1, f32::INFINITY),
                    (0, f32::NEG_INFINITY),
                ] {
                    let mut x = vec![0.5f32; d];
                    x[at] = v;
                    let mut scratch = vec![0f32; d];
                    let mut out = vec![0u8; d / 2];
                    let e =
                        encode_row4(RowSrc::F32(&x), block, &mut scratch, &mut out).unwrap_err();
                    let r = encode_row4_portable(RowSrc::F32(&x), block, &mut scratch, &mut out)
                        .unwrap_err();
                    assert_eq!(e.to_string(), r.to_string());
                }
                let mut x = vec![0.0f32; d];
                x[0] = f32::MAX;
                x[1] = -f32::MAX;
                let mut scratch = vec![0f32; d];
                let mut out = vec![0u8; d / 2];
                let e = encode_row4(RowSrc::F32(&x), None, &mut scratch, &mut out).unwrap_err();
                assert!(e.to_string().contains("overflows"), "{e}");
            }
        }
    }

    #[test]
    fn rne_magic_rounds_ties_to_even() {
        let mut codes = [0u8; 4];
        quantize_codes(&[0.5, 1.5, 2.5, 14.5], 1.0, 0.0, 15, &mut codes);
        assert_eq!(codes, [0, 2, 2, 14]);
    }
}
