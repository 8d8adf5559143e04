//! AVX2 implementations of the hot row kernels. Each is bit-identical to
//! the portable reference named in its doc (same IEEE operations in the
//! same order, no fused multiply-add where the reference has none) and is
//! property-tested against it in this module.
//!
//! # Safety (all functions)
//! Callers must have checked [`super::simd_available`] (AVX2, FMA and F16C
//! present); slice length requirements are stated per function.

use std::arch::x86_64::*;

/// [`super::convert::bf16_to_f32`]. `src.len() == dst.len()`.
///
/// # Safety
/// AVX2, FMA and F16C must be available (checked by `simd_available`);
/// the length requirements above must hold.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn bf16_to_f32(src: &[u16], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n bounds both 8-element accesses.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
            let w = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h));
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_castsi256_ps(w));
        }
        i += 8;
    }
    for j in i..n {
        dst[j] = f32::from_bits((src[j] as u32) << 16);
    }
}

/// 8 floats to 8 bf16 (round to nearest even, NaN quieted), in the low
/// 128 bits.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn bf16x8(v: __m256) -> __m128i {
    let b = _mm256_castps_si256(v);
    let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
    let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(
        b,
        _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)),
    ));
    let nan = _mm256_or_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(0x40));
    let is_nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
    let r = _mm256_blendv_epi8(rounded, nan, is_nan);
    // Pack 8 x u32 (values < 2^16) to 8 x u16.
    let lo = _mm256_castsi256_si128(r);
    let hi = _mm256_extracti128_si256::<1>(r);
    _mm_packus_epi32(lo, hi)
}

/// [`super::convert::f32_to_bf16`] for the first `8 * floor(n / 8)`
/// elements (`n = min(src.len(), dst.len())`); returns how many it
/// converted. The caller narrows the rest with the scalar rounding (so this
/// module needs nothing from `convert`).
///
/// # Safety
/// AVX2, FMA and F16C must be available (checked by `simd_available`).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn f32_to_bf16(src: &[f32], dst: &mut [u16]) -> usize {
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n bounds both accesses.
        unsafe {
            let v = _mm256_loadu_ps(src.as_ptr().add(i));
            _mm_storeu_si128(dst.as_mut_ptr().add(i) as *mut __m128i, bf16x8(v));
        }
        i += 8;
    }
    i
}

/// Reduces 8-lane min/max/non-finite accumulators and folds in `tail`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn reduce_min_max(mn: __m256, mx: __m256, bad: __m256, tail: &[f32]) -> (f32, f32, bool) {
    let mut a = [0f32; 8];
    let mut b = [0f32; 8];
    let mut c = [0f32; 8];
    // SAFETY: 8-float stores into 8-float arrays.
    unsafe {
        _mm256_storeu_ps(a.as_mut_ptr(), mn);
        _mm256_storeu_ps(b.as_mut_ptr(), mx);
        _mm256_storeu_ps(c.as_mut_ptr(), bad);
    }
    let mut lo = f32::INFINITY;
    let mut hi = f32::NEG_INFINITY;
    let mut ok = c.iter().all(|v| v.to_bits() == 0);
    for l in 0..8 {
        lo = if a[l] < lo { a[l] } else { lo };
        hi = if b[l] > hi { b[l] } else { hi };
    }
    for &v in tail {
        lo = if v < lo { v } else { lo };
        hi = if v > hi { v } else { hi };
        ok &= v.is_finite();
    }
    (lo, hi, ok)
}

/// Minimum, maximum and "all finite" of `x` ([`super::affine::min_max`]).
///
/// # Safety
/// AVX2, FMA and F16C must be available (checked by `simd_available`);
/// the length requirements above must hold.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn min_max(x: &[f32]) -> (f32, f32, bool) {
    let n = x.len();
    let mut mn = _mm256_set1_ps(f32::INFINITY);
    let mut mx = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut bad = _mm256_setzero_ps();
    let zero = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n.
        let v = unsafe { _mm256_loadu_ps(x.as_ptr().add(i)) };
        mn = _mm256_min_ps(mn, v);
        mx = _mm256_max_ps(mx, v);
        // x * 0 is 0 for finite x and NaN for inf/NaN.
        bad = _mm256_or_ps(
            bad,
            _mm256_cmp_ps::<_CMP_UNORD_Q>(_mm256_mul_ps(v, zero), zero),
        );
        i += 8;
    }
    // SAFETY: same target features.
    unsafe { reduce_min_max(mn, mx, bad, &x[i..]) }
}

/// Multiplies `x` by `c` in place and returns the minimum, maximum and
/// "all finite" of the products ([`super::scale`] then
/// [`super::affine::min_max`], in one pass).
///
/// # Safety
/// AVX2, FMA and F16C must be available (checked by `simd_available`).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn scale_min_max(x: &mut [f32], c: f32) -> (f32, f32, bool) {
    let n = x.len();
    let vc = _mm256_set1_ps(c);
    let mut mn = _mm256_set1_ps(f32::INFINITY);
    let mut mx = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut bad = _mm256_setzero_ps();
    let zero = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n.
        let v = unsafe {
            let p = x.as_mut_ptr().add(i);
            let v = _mm256_mul_ps(_mm256_loadu_ps(p), vc);
            _mm256_storeu_ps(p, v);
            v
        };
        mn = _mm256_min_ps(mn, v);
        mx = _mm256_max_ps(mx, v);
        bad = _mm256_or_ps(
            bad,
            _mm256_cmp_ps::<_CMP_UNORD_Q>(_mm256_mul_ps(v, zero), zero),
        );
        i += 8;
    }
    for v in &mut x[i..] {
        *v *= c;
    }
    // SAFETY: same target features.
    unsafe { reduce_min_max(mn, mx, bad, &x[i..]) }
}

/// Quantizes `x` to 4-bit codes and packs them two per byte, low nibble
/// first ([`super::affine::quantize_codes`] + [`super::bitpack::pack_u8`]).
/// `x.len()` must be a multiple of 32 and `out.len() == x.len() / 2`.
///
/// # Safety
/// AVX2, FMA and F16C must be available (checked by `simd_available`);
/// the length requirements above must hold.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize_pack4(x: &[f32], inv: f32, zero: f32, out: &mut [u8]) {
    let vinv = _mm256_set1_ps(inv);
    let vz = _mm256_set1_ps(zero);
    let lo = _mm256_setzero_ps();
    let hi = _mm256_set1_ps(15.0);
    let magic = _mm256_set1_ps(12_582_912.0);
    let shifts = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
    let codes = |p: *const f32| {
        // SAFETY: the caller guarantees 8 readable floats at p.
        let v = unsafe { _mm256_loadu_ps(p) };
        let t = _mm256_add_ps(_mm256_mul_ps(v, vinv), vz);
        let t = _mm256_min_ps(_mm256_max_ps(t, lo), hi);
        let t = _mm256_sub_ps(_mm256_add_ps(t, magic), magic);
        _mm256_sllv_epi32(_mm256_cvttps_epi32(t), shifts)
    };
    let mut i = 0;
    while i + 32 <= x.len() {
        let p = x.as_ptr();
        // SAFETY: i + 32 <= x.len() covers the four 8-float loads; the
        // 16-byte store covers out[i/2 .. i/2 + 16] with out.len() == x.len()/2.
        unsafe {
            let a = codes(p.add(i));
            let b = codes(p.add(i + 8));
            let c = codes(p.add(i + 16));
            let d = codes(p.add(i + 24));
            let ab = _mm256_hadd_epi32(a, b);
            let cd = _mm256_hadd_epi32(c, d);
            let w = _mm256_packus_epi32(ab, cd);
            let by = _mm256_packus_epi16(w, w);
            let l0 = _mm256_castsi256_si128(by);
            let l1 = _mm256_extracti128_si256::<1>(by);
            _mm_storeu_si128(
                out.as_mut_ptr().add(i / 2) as *mut __m128i,
                _mm_unpacklo_epi16(l0, l1),
            );
        }
        i += 32;
    }
}

/// Dequantizes packed 4-bit codes: `out_i = (q_i - zero) * scale`
/// ([`super::affine::dequantize_row`] for 4 bits). `out.len()` must be a
/// multiple of 8 and `packed.len() >= out.len() / 2`.
///
/// # Safety
/// AVX2, FMA and F16C must be available (checked by `simd_available`);
/// the length requirements above must hold.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dequant4(packed: &[u8], scale: f32, zero: f32, out: &mut [f32]) {
    let vs = _mm256_set1_ps(scale);
    let vz = _mm256_set1_ps(zero);
    let shifts = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
    let mask = _mm256_set1_epi32(15);
    let mut i = 0;
    while i + 8 <= out.len() {
        // SAFETY: 4 bytes at packed[i/2..i/2+4] exist since packed.len() >=
        // out.len()/2 and i + 8 <= out.len(); the store writes out[i..i+8].
        unsafe {
            let w = (packed.as_ptr().add(i / 2) as *const u32).read_unaligned();
            let b = _mm_cvtsi32_si128(w as i32);
            let dup = _mm_unpacklo_epi8(b, b);
            let q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_cvtepu8_epi32(dup), shifts), mask);
            let f = _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(q), vz), vs);
            _mm256_storeu_ps(out.as_mut_ptr().add(i), f);
        }
        i += 8;
    }
}

/// Multiplies every element by `c`.
///
/// # Safety
/// AVX2, FMA and F16C must be available (checked by `simd_available`);
/// the length requirements above must hold.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn scale(x: &mut [f32], c: f32) {
    let vc = _mm256_set1_ps(c);
    let n = x.len();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n.
        unsafe {
            let p = x.as_mut_ptr().add(i);
            _mm256_storeu_ps(p, _mm256_mul_ps(_mm256_loadu_ps(p), vc));
        }
        i += 8;
    }
    for v in &mut x[i..] {
        *v *= c;
    }
}

#[cfg(test)]
mod tests {
    use super::super::{affine, bitpack, convert};
    use super::*;
    use proptest::prelude::*;

    fn vals(seed: u64, n: usize, spread: f32) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * spread
            })
            .collect()
    }

    proptest! {
        #[test]
        fn avx2_kernels_equal_the_references(seed in any::<u64>(), rows in 1usize..5, spread in 0.001f32..300.0) {
            if !super::super::simd_available() {
                return Ok(());
            }
            let n = 32 * rows;
            let x = vals(seed, n, spread);
            // min/max
            let (lo, hi, ok) = unsafe { min_max(&x) };
            prop_assert!(ok);
            let (rlo, rhi) = affine::min_max_scalar(&x).unwrap();
            prop_assert_eq!((lo.to_bits(), hi.to_bits()), (rlo.to_bits(), rhi.to_bits()));
            // scale + min/max in one pass
            let mut y = x.clone();
            let (slo, shi, sok) = unsafe { scale_min_max(&mut y, 0.0883883) };
            let mut z = x.clone();
            z.iter_mut().for_each(|v| *v *= 0.0883883);
            prop_assert!(sok);
            prop_assert_eq!(y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), z.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
            let (rlo, rhi) = affine::min_max_scalar(&z).unwrap();
            prop_assert_eq!((slo.to_bits(), shi.to_bits()), (rlo.to_bits(), rhi.to_bits()));
            // quantize + pack
            let (p, inv) = affine::params(lo, hi, 15);
            let mut codes = vec![0u8; n];
            affine::quantize_codes(&x, inv, p.zero, 15, &mut codes);
            let mut want = vec![0u8; n / 2];
            bitpack::pack_u8(&codes, 4, &mut want);
            let mut got = vec![0u8; n / 2];
            unsafe { quantize_pack4(&x, inv, p.zero, &mut got) };
            prop_assert_eq!(&got, &want);
            // dequantize
            let mut a = vec![0f32; n];
            let mut b = vec![0f32; n];
            unsafe { dequant4(&want, p.scale, p.zero, &mut a) };
            for (o, &q) in b.iter_mut().zip(&codes) {
                *o = (q as f32 - p.zero) * p.scale;
            }
            prop_assert_eq!(a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), b.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
            // bf16 both ways (odd tail included)
            let mut h = vec![0u16; n - 3];
            let done = unsafe { f32_to_bf16(&x[..n - 3], &mut h) };
            prop_assert_eq!(done, (n - 3) / 8 * 8);
            for j in done..n - 3 {
                h[j] = convert::f32_to_bf16_bits(x[j]);
            }
            let want_h: Vec<u16> = x[..n - 3].iter().map(|&v| convert::f32_to_bf16_bits(v)).collect();
            prop_assert_eq!(&h, &want_h);
            let mut f = vec![0f32; n - 3];
            unsafe { bf16_to_f32(&h, &mut f) };
            for (a, &b) in f.iter().zip(&h) {
                prop_assert_eq!(a.to_bits(), (b as u32) << 16);
            }
        }
    }

    /// Rows whose minimum or maximum is a zero of either sign, in every
    /// lane position and order: the AVX2 and portable paths agree on the
    /// sign bit (it reaches the kivi/innerq zero point's f16 bits).
    #[test]
    fn signed_zero_ties_resolve_like_the_portable_path() {
        if !super::super::simd_available() {
            return;
        }
        // Two zeros in the same lane (8 apart), so the lane's tie rule
        // decides, and in different lanes, so the reduction decides.
        for n in [16usize, 19, 32] {
            for pos in 0..n {
                for (fill, z) in [(1.0f32, -0.0f32), (1.0, 0.0), (-1.0, -0.0), (-1.0, 0.0)] {
                    for other in [0.0f32, -0.0] {
                        let mut x = vec![fill; n];
                        x[pos] = z;
                        x[(pos + 8) % n] = other;
                        // SAFETY: AVX2 checked above.
                        let (lo, hi, ok) = unsafe { min_max(&x) };
                        assert!(ok);
                        let (rlo, rhi) = affine::min_max_scalar(&x).unwrap();
                        assert_eq!(
                            (lo.to_bits(), hi.to_bits()),
                            (rlo.to_bits(), rhi.to_bits()),
                            "{x:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn special_values() {
        if !super::super::simd_available() {
            return;
        }
        let x = [
            f32::NAN,
            -0.0,
            f32::INFINITY,
            f32::MAX,
            1.0e-40,
            -1.5,
            3.0,
            2.5,
        ];
        let mut h = [0u16; 8];
        assert_eq!(unsafe { f32_to_bf16(&x, &mut h) }, 8);
        for (v, b) in x.iter().zip(h) {
            let r = convert::f32_to_bf16_bits(*v);
            assert_eq!(b, r, "{v}");
        }
        assert!(!unsafe { min_max(&x) }.2);
    }
}
