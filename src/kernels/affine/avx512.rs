//! AVX-512F paths of the 4-bit affine row kernels of `int4` and `bdr{h}`
//! (format/codecs/int.md, format/codecs/bdr.md): one row of `16 * N`
//! values held in `N` registers from load to store, so the Walsh-Hadamard
//! stages, the min/max pass, the quantization and the packing never go
//! through memory. Each is bit-identical to the portable composition named
//! in its doc (the same IEEE operations per element in the same order, no
//! fused multiply-add where the reference has none; the in-register
//! butterflies are `perm(v) + v * (±1)` with one rounding, as in the AVX2
//! transform) and is property-tested against it in
//! [`super`] (`kernels::affine`).
//!
//! # Safety (all functions)
//! Callers must have checked [`crate::kernels::avx512_available`] (AVX-512F, and
//! the AVX2 set of [`crate::kernels::simd_available`]); slice lengths are stated
//! per function.

use std::arch::x86_64::*;

use super::{self as affine, RowDst, RowParams, RowSrc};

/// Loads register `k` (values `16k .. 16k + 16`) of the row.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn load(src: RowSrc<'_>, k: usize) -> __m512 {
    // SAFETY: the callers pass rows of 16 * N values and k < N.
    unsafe {
        match src {
            RowSrc::F32(x) => _mm512_loadu_ps(x.as_ptr().add(16 * k)),
            RowSrc::Bf16(x) => {
                let h = _mm256_loadu_si256(x.as_ptr().add(16 * k) as *const __m256i);
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            }
        }
    }
}

/// Strides 1, 2, 4 and 8 of the transform inside one register, each as
/// `perm(v) + v * sign` (the product is exact, so the one rounding equals
/// the scalar `a + b` / `a - b`).
#[target_feature(enable = "avx512f")]
#[inline]
fn in_register(mut v: __m512) -> __m512 {
    let (p, m) = (1.0f32, -1.0f32);
    let s1 = _mm512_setr_ps(p, m, p, m, p, m, p, m, p, m, p, m, p, m, p, m);
    let s2 = _mm512_setr_ps(p, p, m, m, p, p, m, m, p, p, m, m, p, p, m, m);
    let s4 = _mm512_setr_ps(p, p, p, p, m, m, m, m, p, p, p, p, m, m, m, m);
    let s8 = _mm512_setr_ps(p, p, p, p, p, p, p, p, m, m, m, m, m, m, m, m);
    v = _mm512_fmadd_ps(v, s1, _mm512_permute_ps::<0b10_11_00_01>(v));
    v = _mm512_fmadd_ps(v, s2, _mm512_permute_ps::<0b01_00_11_10>(v));
    v = _mm512_fmadd_ps(v, s4, _mm512_shuffle_f32x4::<0b10_11_00_01>(v, v));
    _mm512_fmadd_ps(v, s8, _mm512_shuffle_f32x4::<0b01_00_11_10>(v, v))
}

/// The unnormalized transform of every `h`-block (`16 <= h <= 16 N`, a
/// power of two) of the row in `v`, stage order 1, 2, 4, ... as
/// [`crate::kernels::wht::fwht_blocks_scalar`].
#[target_feature(enable = "avx512f")]
#[inline]
fn fwht<const N: usize>(v: &mut [__m512; N], h: usize) {
    for r in v.iter_mut() {
        *r = in_register(*r);
    }
    let mut m = 1;
    while 16 * m < h {
        for j in 0..N {
            if j & m == 0 {
                let (a, b) = (v[j], v[j + m]);
                v[j] = _mm512_add_ps(a, b);
                v[j + m] = _mm512_sub_ps(a, b);
            }
        }
        m *= 2;
    }
}

/// Encodes one row of `16 N` values as 4-bit affine codes: the transform
/// of every `h`-block then a multiplication by `c` when `rotate = Some((h,
/// c))`, the row's minimum and maximum, [`affine::params`] with 15 levels,
/// and the codes packed two per byte, low nibble first, into `packed`
/// (`8 N` bytes). Equals [`crate::kernels::wht::fwht_blocks`] + [`affine::scale_min_max`]
/// (or [`affine::min_max`] without rotation) + [`affine::quantize_row_in_range`]
/// bit for bit. The sign of a zero minimum or maximum may differ from the
/// portable lane rule, which does not change the parameters (`0 - (±0 / s)`
/// and `mx - (±0)` round the same).
///
/// Returns the parameters, or `Err((lo, hi, finite))` without writing when
/// the row holds NaN/inf (`finite` false) or its range overflows f32: the
/// caller reports those as the portable path does.
///
/// # Safety
/// AVX-512F available; `src` holds `16 N` values, `packed.len() == 8 N`,
/// `h` as above.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn encode_row4<const N: usize>(
    src: RowSrc<'_>,
    rotate: Option<(usize, f32)>,
    packed: &mut [u8],
) -> Result<RowParams, (f32, f32, bool)> {
    debug_assert_eq!(packed.len(), 8 * N);
    // SAFETY: the caller's contract bounds every load.
    let mut v: [__m512; N] = std::array::from_fn(|k| unsafe { load(src, k) });
    if let Some((h, c)) = rotate {
        fwht(&mut v, h);
        let vc = _mm512_set1_ps(c);
        for r in v.iter_mut() {
            *r = _mm512_mul_ps(*r, vc);
        }
    }
    let zero = _mm512_setzero_ps();
    let mut mn = _mm512_set1_ps(f32::INFINITY);
    let mut mx = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut bad: __mmask16 = 0;
    for &r in &v {
        mn = _mm512_min_ps(mn, r);
        mx = _mm512_max_ps(mx, r);
        // x * 0 is 0 for finite x and NaN for inf/NaN.
        bad |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(_mm512_mul_ps(r, zero), zero);
    }
    let (lo, hi) = (_mm512_reduce_min_ps(mn), _mm512_reduce_max_ps(mx));
    if bad != 0 || !(hi - lo).is_finite() {
        return Err((lo, hi, bad == 0));
    }
    let (p, inv) = affine::params(lo, hi, 15);
    let (vinv, vz) = (_mm512_set1_ps(inv), _mm512_set1_ps(p.zero));
    let (top, magic) = (_mm512_set1_ps(15.0), _mm512_set1_ps(12_582_912.0));
    let codes = |r: __m512| {
        let t = _mm512_add_ps(_mm512_mul_ps(r, vinv), vz);
        let t = _mm512_min_ps(_mm512_max_ps(t, zero), top);
        let q = _mm512_cvttps_epi32(_mm512_sub_ps(_mm512_add_ps(t, magic), magic));
        // Each 64-bit lane holds codes (2k, 2k + 1): fold the odd one into
        // bits 4..8 and keep the low byte.
        _mm512_cvtepi64_epi8(_mm512_or_si512(q, _mm512_srli_epi64::<28>(q)))
    };
    for k in 0..N / 2 {
        let pair = _mm_unpacklo_epi64(codes(v[2 * k]), codes(v[2 * k + 1]));
        // SAFETY: bytes 16k .. 16k + 16 of the 8 N-byte `packed`.
        unsafe { _mm_storeu_si128(packed.as_mut_ptr().add(16 * k) as *mut __m128i, pair) };
    }
    Ok(p)
}

/// Decodes one row of `16 N` values from 4-bit codes: `(q - zero) *
/// scale`, then the transform of every `h`-block when `block = Some(h)`,
/// stored to `dst`. Equals [`affine::dequantize_row`] +
/// [`crate::kernels::wht::fwht_blocks`] + the f32/bf16 store of
/// [`crate::cache::ElemsMut::store`] bit for bit.
///
/// # Safety
/// AVX-512F available; `packed.len() >= 8 N`, `dst` holds `16 N` values,
/// `h` as for [`encode_row4`].
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn decode_row4<const N: usize>(
    packed: &[u8],
    scale: f32,
    zero: f32,
    block: Option<usize>,
    dst: RowDst<'_>,
) {
    debug_assert!(packed.len() >= 8 * N);
    let (vs, vz) = (_mm512_set1_ps(scale), _mm512_set1_ps(zero));
    let mask = _mm512_set1_epi64(15);
    let mut v: [__m512; N] = std::array::from_fn(|k| {
        // SAFETY: bytes 8k .. 8k + 8 of `packed` (k < N).
        let b = unsafe { _mm_loadl_epi64(packed.as_ptr().add(8 * k) as *const __m128i) };
        let b = _mm512_cvtepu8_epi64(b);
        // Low nibble to the even 32-bit lane, high nibble to the odd one.
        let q = _mm512_or_si512(
            _mm512_and_si512(b, mask),
            _mm512_slli_epi64::<32>(_mm512_srli_epi64::<4>(b)),
        );
        _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(q), vz), vs)
    });
    if let Some(h) = block {
        fwht(&mut v, h);
    }
    match dst {
        RowDst::F32(o) => {
            for (k, &r) in v.iter().enumerate() {
                // SAFETY: values 16k .. 16k + 16 of the 16 N-value row.
                unsafe { _mm512_storeu_ps(o.as_mut_ptr().add(16 * k), r) };
            }
        }
        RowDst::Bf16(o) => {
            let (one, half) = (_mm512_set1_epi32(1), _mm512_set1_epi32(0x7FFF));
            let quiet = _mm512_set1_epi32(0x40);
            for (k, &r) in v.iter().enumerate() {
                let b = _mm512_castps_si512(r);
                let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), one);
                let rounded =
                    _mm512_srli_epi32::<16>(_mm512_add_epi32(b, _mm512_add_epi32(lsb, half)));
                let nan = _mm512_or_si512(_mm512_srli_epi32::<16>(b), quiet);
                let is_nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(r, r);
                let w = _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, nan));
                // SAFETY: values 16k .. 16k + 16 of the 16 N-value row.
                unsafe { _mm256_storeu_si256(o.as_mut_ptr().add(16 * k) as *mut __m256i, w) };
            }
        }
    }
}
