//! Element-type conversion between bf16 / fp16 and f32.
//!
//! f32 -> bf16 rounds to nearest, ties to even; NaN stays NaN (quiet bit
//! set, sign kept). bf16 -> f32 is exact. fp16 conversions use the `half`
//! crate (hardware F16C where available), also round-to-nearest-even.

use half::{bf16, f16, slice::HalfFloatSliceExt};

/// Widens bf16 to f32 (exact). `src.len()` must equal `dst.len()`.
///
/// # Panics
/// If the lengths differ.
pub fn bf16_to_f32(src: &[bf16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    if super::simd_available() {
        // SAFETY: AVX2 checked; bf16 is a transparent u16; lengths equal.
        unsafe { super::x86::bf16_to_f32(bytemuck::cast_slice(src), dst) };
        return;
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits((s.to_bits() as u32) << 16);
    }
}

/// Narrows one f32 to bf16 bits, round to nearest even (the normative rule
/// of format/SPEC.md "Element types").
#[inline(always)]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        ((b >> 16) as u16) | 0x0040
    } else {
        (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16
    }
}

/// Narrows f32 to bf16, round to nearest even. Lengths must match.
///
/// # Panics
/// If the lengths differ.
pub fn f32_to_bf16(src: &[f32], dst: &mut [bf16]) {
    assert_eq!(src.len(), dst.len());
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if super::simd_available() {
        // SAFETY: AVX2 checked; bf16 is a transparent u16.
        done = unsafe { super::x86::f32_to_bf16(src, bytemuck::cast_slice_mut(dst)) };
    }
    for (d, s) in dst[done..].iter_mut().zip(&src[done..]) {
        *d = bf16::from_bits(f32_to_bf16_bits(*s));
    }
}

/// Widens fp16 to f32 (exact). Lengths must match.
///
/// # Panics
/// If the lengths differ.
pub fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    src.convert_to_f32_slice(dst);
}

/// Narrows f32 to fp16, round to nearest even. Lengths must match.
///
/// # Panics
/// If the lengths differ.
pub fn f32_to_f16(src: &[f32], dst: &mut [f16]) {
    dst.convert_from_f32_slice(src);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_matches_half_crate() {
        let samples = [
            0.0f32,
            -0.0,
            1.0,
            1.003_906_3,
            1.005_859_4,
            -3.2500002,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ];
        for x in samples {
            assert_eq!(f32_to_bf16_bits(x), bf16::from_f32(x).to_bits(), "{x}");
        }
        assert!(bf16::from_bits(f32_to_bf16_bits(f32::NAN)).is_nan());
    }
}
