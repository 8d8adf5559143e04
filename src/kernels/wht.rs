//! Fast Walsh-Hadamard transform (Sylvester order) over contiguous blocks.
//!
//! For a block of `h = 2^k` values the unnormalized transform applies `k`
//! butterfly stages in the fixed order stride `1, 2, 4, ..., h/2`; at stride
//! `s`, every pair `(i, i + s)` with bit `s` of `i` clear becomes
//! `(x_i + x_{i+s}, x_i - x_{i+s})`. The result equals multiplication by the
//! Sylvester Hadamard matrix `H_h` (entries ±1, `H_h H_h = h I`). The
//! normalized transform multiplies by `1/sqrt(h)` afterwards
//! ([`inv_sqrt`]); it is orthogonal and its own inverse.
//!
//! The stage order is normative (format/codecs/bdr.md): it fixes the float
//! rounding, so CPU and GPU produce identical bits.

/// The f32 nearest to `1/sqrt(h)` for a power of two `h` (exact when `h` is
/// a power of 4).
///
/// # Panics
/// If `h` is not a power of two or exceeds 2^30.
pub fn inv_sqrt(h: usize) -> f32 {
    assert!(h.is_power_of_two() && h <= 1 << 30);
    let k = h.trailing_zeros();
    let pow = f32::from_bits((127 - k / 2) << 23); // 2^-(k/2)
    if k.is_multiple_of(2) {
        pow
    } else {
        pow * std::f32::consts::FRAC_1_SQRT_2
    }
}

/// In-place unnormalized transform of every `h`-block of `x`.
///
/// # Panics
/// If `h` is not a power of two or does not divide `x.len()`.
pub fn fwht_blocks(x: &mut [f32], h: usize) {
    assert!(h.is_power_of_two() && x.len().is_multiple_of(h));
    #[cfg(target_arch = "x86_64")]
    if h >= 8 && super::simd_available() {
        // SAFETY: simd_available() checked that the CPU supports AVX2+FMA.
        unsafe { avx2::fwht_blocks(x, h) };
        return;
    }
    fwht_blocks_scalar(x, h);
}

/// Portable reference implementation of [`fwht_blocks`].
pub fn fwht_blocks_scalar(x: &mut [f32], h: usize) {
    assert!(h.is_power_of_two() && x.len().is_multiple_of(h));
    let mut s = 1;
    while s < h {
        for pair in x.chunks_exact_mut(2 * s) {
            let (a, b) = pair.split_at_mut(s);
            for (u, v) in a.iter_mut().zip(b.iter_mut()) {
                let (p, q) = (*u, *v);
                *u = p + q;
                *v = p - q;
            }
        }
        s *= 2;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// Butterfly of two registers: `(a + b, a - b)`.
    #[inline(always)]
    unsafe fn bfly(a: __m256, b: __m256) -> (__m256, __m256) {
        // SAFETY: register-only AVX ops; the caller's target features apply.
        unsafe { (_mm256_add_ps(a, b), _mm256_sub_ps(a, b)) }
    }

    /// Strides 1, 2 and 4 inside one register as `perm(v) + v * sign`: the
    /// product is exact, so the single rounding equals the scalar
    /// `a + b` / `a - b`.
    #[inline(always)]
    unsafe fn in_register(mut v: __m256) -> __m256 {
        // SAFETY: register-only AVX/FMA ops.
        unsafe {
            let sign1 = _mm256_setr_ps(1., -1., 1., -1., 1., -1., 1., -1.);
            let sign2 = _mm256_setr_ps(1., 1., -1., -1., 1., 1., -1., -1.);
            let sign4 = _mm256_setr_ps(1., 1., 1., 1., -1., -1., -1., -1.);
            v = _mm256_fmadd_ps(v, sign1, _mm256_permute_ps::<0b10_11_00_01>(v));
            v = _mm256_fmadd_ps(v, sign2, _mm256_permute_ps::<0b01_00_11_10>(v));
            _mm256_fmadd_ps(v, sign4, _mm256_permute2f128_ps::<1>(v, v))
        }
    }

    /// AVX2 transform, bit-identical to the scalar one (same operations per
    /// element in the same stage order). The first pass does strides 1..16
    /// on 32 values in registers, later passes do two stages each.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `h >= 8`, power of two, divides
    /// `x.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fwht_blocks(x: &mut [f32], h: usize) {
        let n = x.len();
        let p = x.as_mut_ptr();
        let mut s;
        // SAFETY (all blocks below): every access is p.add(k) with
        // k + 8 <= n, because blocks of h (a multiple of the step) tile n.
        unsafe {
            if h >= 32 {
                let mut i = 0;
                while i < n {
                    let a = in_register(_mm256_loadu_ps(p.add(i)));
                    let b = in_register(_mm256_loadu_ps(p.add(i + 8)));
                    let c = in_register(_mm256_loadu_ps(p.add(i + 16)));
                    let d = in_register(_mm256_loadu_ps(p.add(i + 24)));
                    let (a, b) = bfly(a, b);
                    let (c, d) = bfly(c, d);
                    let (a, c) = bfly(a, c);
                    let (b, d) = bfly(b, d);
                    _mm256_storeu_ps(p.add(i), a);
                    _mm256_storeu_ps(p.add(i + 8), b);
                    _mm256_storeu_ps(p.add(i + 16), c);
                    _mm256_storeu_ps(p.add(i + 24), d);
                    i += 32;
                }
                s = 32;
            } else {
                let mut i = 0;
                while i < n {
                    _mm256_storeu_ps(p.add(i), in_register(_mm256_loadu_ps(p.add(i))));
                    i += 8;
                }
                s = 8;
            }
            while s * 4 <= h {
                let mut base = 0;
                while base < n {
                    let mut j = base;
                    while j < base + s {
                        let a = _mm256_loadu_ps(p.add(j));
                        let b = _mm256_loadu_ps(p.add(j + s));
                        let c = _mm256_loadu_ps(p.add(j + 2 * s));
                        let d = _mm256_loadu_ps(p.add(j + 3 * s));
                        let (a, b) = bfly(a, b);
                        let (c, d) = bfly(c, d);
                        let (a, c) = bfly(a, c);
                        let (b, d) = bfly(b, d);
                        _mm256_storeu_ps(p.add(j), a);
                        _mm256_storeu_ps(p.add(j + s), b);
                        _mm256_storeu_ps(p.add(j + 2 * s), c);
                        _mm256_storeu_ps(p.add(j + 3 * s), d);
                        j += 8;
                    }
                    base += 4 * s;
                }
                s *= 4;
            }
            if s < h {
                let mut base = 0;
                while base < n {
                    let mut j = base;
                    while j < base + s {
                        let (a, b) = bfly(_mm256_loadu_ps(p.add(j)), _mm256_loadu_ps(p.add(j + s)));
                        _mm256_storeu_ps(p.add(j), a);
                        _mm256_storeu_ps(p.add(j + s), b);
                        j += 8;
                    }
                    base += 2 * s;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hadamard_entry(i: usize, j: usize) -> f64 {
        if (i & j).count_ones().is_multiple_of(2) {
            1.0
        } else {
            -1.0
        }
    }

    #[test]
    fn matches_sylvester_matrix() {
        for h in [2usize, 4, 8, 16, 64, 256] {
            let x: Vec<f32> = (0..h).map(|i| ((i * 37 % 11) as f32) - 5.0).collect();
            let mut y = x.clone();
            fwht_blocks(&mut y, h);
            for (i, yi) in y.iter().enumerate() {
                let want: f64 = (0..h).map(|j| hadamard_entry(i, j) * x[j] as f64).sum();
                assert_eq!(*yi as f64, want, "h={h} i={i}");
            }
        }
    }

    #[test]
    fn inv_sqrt_values() {
        assert_eq!(inv_sqrt(4), 0.5);
        assert_eq!(inv_sqrt(256), 1.0 / 16.0);
        assert_eq!(inv_sqrt(128).to_bits(), 0x3DB504F3);
        assert_eq!(inv_sqrt(2), std::f32::consts::FRAC_1_SQRT_2);
        for k in 0..20 {
            let h = 1usize << k;
            assert_eq!(inv_sqrt(h), (1.0 / (h as f64).sqrt()) as f32, "h={h}");
        }
    }

    proptest! {
        #[test]
        fn simd_equals_scalar(k in 3u32..10, blocks in 1usize..4, seed in any::<u64>()) {
            let h = 1usize << k;
            let mut state = seed | 1;
            let x: Vec<f32> = (0..h * blocks).map(|_| {
                state ^= state << 13; state ^= state >> 7; state ^= state << 17;
                (state as i32 as f32) / 1.0e7
            }).collect();
            let mut a = x.clone();
            let mut b = x.clone();
            fwht_blocks(&mut a, h);
            fwht_blocks_scalar(&mut b, h);
            let abits: Vec<u32> = a.iter().map(|v| v.to_bits()).collect();
            let bbits: Vec<u32> = b.iter().map(|v| v.to_bits()).collect();
            prop_assert_eq!(abits, bbits);
        }
    }
}
