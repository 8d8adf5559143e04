//! 8-bit floating point (fp8) conversion: the two OCP/NVIDIA formats that
//! serving engines use for KV caches (vLLM `--kv-cache-dtype fp8`).
//!
//! * **E4M3FN**: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits. No
//!   infinities; codes `0x7F` and `0xFF` are NaN; largest finite value 448
//!   (`0x7E`); smallest subnormal `2^-9`.
//! * **E5M2**: 1 sign, 5 exponent bits (bias 15), 2 mantissa bits, IEEE-like:
//!   exponent field 31 holds ±inf (mantissa 0) and NaN; largest finite value
//!   57344 (`0x7B`); smallest subnormal `2^-16`.
//!
//! (Micikevicius et al., "FP8 Formats for Deep Learning", arXiv:2209.05433,
//! section 3 and table 1.)
//!
//! fp8 -> f32 is exact. f32 -> fp8 rounds to nearest, ties to even, and
//! **saturates**: a finite value beyond the largest finite one becomes ±max
//! in both formats (as vLLM's scaled fp8 quantization clamps); ±inf becomes
//! ±inf in E5M2 and ±448 in E4M3FN (which has no infinity); NaN becomes the
//! quiet NaN code of the sign (`0x7F`/`0xFF` E4M3FN, `0x7E`/`0xFE` E5M2).
//!
//! A KV cache tensor stored as fp8 has a per-tensor `scale` (f32): the
//! value an fp8 code stands for is `fp8 * scale`, computed in f32, and
//! quantizing `x` stores `fp8(x / scale)` (one f32 division, then the
//! rounding above).

/// One of the two fp8 element formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Fp8Format {
    /// E4M3FN: bias 7, no infinities, NaN `0x7F`/`0xFF`, max 448.
    E4M3Fn,
    /// E5M2: bias 15, ±inf `0x7C`/`0xFC`, NaN exponent 31 with mantissa != 0,
    /// max 57344.
    E5M2,
}

impl Fp8Format {
    /// Mantissa (fraction) bits: 3 or 2.
    pub const fn mantissa_bits(self) -> u32 {
        match self {
            Fp8Format::E4M3Fn => 3,
            Fp8Format::E5M2 => 2,
        }
    }

    /// Exponent bias: 7 or 15.
    pub const fn bias(self) -> i32 {
        match self {
            Fp8Format::E4M3Fn => 7,
            Fp8Format::E5M2 => 15,
        }
    }

    /// Largest finite value: 448 or 57344.
    pub const fn max(self) -> f32 {
        match self {
            Fp8Format::E4M3Fn => 448.0,
            Fp8Format::E5M2 => 57344.0,
        }
    }

    /// Code of the largest finite positive value: `0x7E` or `0x7B`.
    const fn max_code(self) -> u8 {
        match self {
            Fp8Format::E4M3Fn => 0x7E,
            Fp8Format::E5M2 => 0x7B,
        }
    }

    /// Positive quiet NaN code: `0x7F` or `0x7E`.
    const fn nan_code(self) -> u8 {
        match self {
            Fp8Format::E4M3Fn => 0x7F,
            Fp8Format::E5M2 => 0x7E,
        }
    }

    /// The f32 value of every code, indexed by code (exact).
    pub fn table(self) -> &'static [f32; 256] {
        match self {
            Fp8Format::E4M3Fn => &E4M3FN_TABLE,
            Fp8Format::E5M2 => &E5M2_TABLE,
        }
    }
}

/// The f32 bit pattern of fp8 `code` (exact widening).
const fn to_f32_bits(code: u8, f: Fp8Format) -> u32 {
    let m_bits = f.mantissa_bits();
    let sign = ((code >> 7) as u32) << 31;
    let e = ((code & 0x7F) >> m_bits) as i32;
    let m = (code as u32) & ((1 << m_bits) - 1);
    let e_max = (1 << (7 - m_bits)) - 1;
    match f {
        Fp8Format::E4M3Fn if e == e_max && m == (1 << m_bits) - 1 => return sign | 0x7FC0_0000,
        Fp8Format::E5M2 if e == e_max => {
            return sign | if m == 0 { 0x7F80_0000 } else { 0x7FC0_0000 };
        }
        _ => {}
    }
    if e == 0 {
        if m == 0 {
            return sign;
        }
        // Subnormal m * 2^(1 - bias - M): normalise the leading one.
        let mut k = 0;
        while (m << k) & (1 << m_bits) == 0 {
            k += 1;
        }
        let exp = 1 - f.bias() - k;
        let frac = (m << k) & ((1 << m_bits) - 1);
        return sign | (((exp + 127) as u32) << 23) | (frac << (23 - m_bits));
    }
    sign | (((e - f.bias() + 127) as u32) << 23) | (m << (23 - m_bits))
}

const fn build_table(f: Fp8Format) -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut c = 0;
    while c < 256 {
        t[c] = f32::from_bits(to_f32_bits(c as u8, f));
        c += 1;
    }
    t
}

static E4M3FN_TABLE: [f32; 256] = build_table(Fp8Format::E4M3Fn);
static E5M2_TABLE: [f32; 256] = build_table(Fp8Format::E5M2);

/// Widens one fp8 code to f32 (exact).
#[inline]
pub fn to_f32(code: u8, f: Fp8Format) -> f32 {
    f.table()[code as usize]
}

/// Narrows one f32 to fp8: round to nearest, ties to even, saturating
/// (module documentation).
pub fn from_f32(x: f32, f: Fp8Format) -> u8 {
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    if x.is_nan() {
        return sign | f.nan_code();
    }
    if x.is_infinite() {
        return sign
            | match f {
                Fp8Format::E4M3Fn => f.max_code(),
                Fp8Format::E5M2 => 0x7C,
            };
    }
    let m_bits = f.mantissa_bits();
    let a_bits = x.to_bits() & 0x7FFF_FFFF;
    let a = f32::from_bits(a_bits);
    if a >= f.max() {
        return sign | f.max_code();
    }
    let emin = 1 - f.bias();
    if a_bits < (((emin + 127) as u32) << 23) {
        // Below the smallest normal: a multiple of the smallest subnormal
        // 2^(emin - M). Scaling by a power of two is exact, so the rounding
        // to an integer is the only one; 2^M (rounding up into the normal
        // range) is the code of the smallest normal, as wanted.
        let scaled = a * f32::from_bits(((m_bits as i32 - emin + 127) as u32) << 23);
        return sign | scaled.round_ties_even() as u8;
    }
    // Normal: round the f32 bits to M mantissa bits, nearest even (a carry
    // out of the mantissa increments the exponent, as it should), then
    // rebias the exponent from 127 to the format's bias.
    let shift = 23 - m_bits;
    let rounded = a_bits + ((1 << (shift - 1)) - 1) + ((a_bits >> shift) & 1);
    let code = (rounded >> shift) - (((127 - f.bias()) as u32) << m_bits);
    sign | code.min(u32::from(f.max_code())) as u8
}

/// Dequantizes `src` codes into `dst`: `dst[i] = to_f32(src[i]) * scale`.
///
/// # Panics
/// If the lengths differ.
pub fn dequantize(src: &[u8], f: Fp8Format, scale: f32, dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    let t = f.table();
    for (d, &c) in dst.iter_mut().zip(src) {
        *d = t[c as usize] * scale;
    }
}

/// Quantizes `src` into codes: `dst[i] = from_f32(src[i] / scale)`.
///
/// # Panics
/// If the lengths differ.
pub fn quantize(src: &[f32], f: Fp8Format, scale: f32, dst: &mut [u8]) {
    assert_eq!(src.len(), dst.len());
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = from_f32(x / scale, f);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FORMATS: [Fp8Format; 2] = [Fp8Format::E4M3Fn, Fp8Format::E5M2];

    /// Independent decoding formula (f64 arithmetic, format parameters
    /// written out): the oracle for the bit-level table.
    fn reference(code: u8, f: Fp8Format) -> f64 {
        let (e_bits, m_bits, bias) = match f {
            Fp8Format::E4M3Fn => (4, 3, 7),
            Fp8Format::E5M2 => (5, 2, 15),
        };
        let s = if code & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = i32::from((code >> m_bits) & ((1 << e_bits) - 1));
        let m = f64::from(code & ((1 << m_bits) - 1));
        let e_max = (1 << e_bits) - 1;
        if f == Fp8Format::E4M3Fn && e == e_max && m == 7.0 {
            return f64::NAN;
        }
        if f == Fp8Format::E5M2 && e == e_max {
            return if m == 0.0 {
                s * f64::INFINITY
            } else {
                f64::NAN
            };
        }
        let frac = m / f64::from(1 << m_bits);
        if e == 0 {
            s * 2f64.powi(1 - bias) * frac
        } else {
            s * 2f64.powi(e - bias) * (1.0 + frac)
        }
    }

    #[test]
    fn every_code_widens_like_the_formula() {
        for f in FORMATS {
            for c in 0..=255u8 {
                let (got, want) = (to_f32(c, f), reference(c, f));
                if want.is_nan() {
                    assert!(got.is_nan(), "{f:?} {c:#04x}");
                } else {
                    assert_eq!(f64::from(got), want, "{f:?} {c:#04x}");
                    assert_eq!(got.is_sign_negative(), c & 0x80 != 0, "{f:?} {c:#04x}");
                }
            }
        }
        assert_eq!(to_f32(0x7E, Fp8Format::E4M3Fn), 448.0);
        assert_eq!(to_f32(0x01, Fp8Format::E4M3Fn), 2f32.powi(-9));
        assert_eq!(to_f32(0x7B, Fp8Format::E5M2), 57344.0);
        assert_eq!(to_f32(0x01, Fp8Format::E5M2), 2f32.powi(-16));
        assert_eq!(to_f32(0x7C, Fp8Format::E5M2), f32::INFINITY);
        assert!(to_f32(0xFF, Fp8Format::E4M3Fn).is_nan());
    }

    #[test]
    fn every_code_round_trips() {
        for f in FORMATS {
            for c in 0..=255u8 {
                let x = to_f32(c, f);
                let back = from_f32(x, f);
                if x.is_nan() {
                    assert!(to_f32(back, f).is_nan(), "{f:?} {c:#04x}");
                    assert_eq!(back & 0x80, c & 0x80);
                } else {
                    assert_eq!(back, c, "{f:?} {c:#04x} = {x}");
                }
            }
        }
    }

    /// Brute-force oracle: the nearest finite code, ties to the even
    /// mantissa (even code), saturating beyond the largest finite value.
    fn nearest(x: f32, f: Fp8Format) -> u8 {
        let mut best: Option<(f64, u8)> = None;
        for c in 0..=127u8 {
            let v = reference(c, f);
            if !v.is_finite() {
                continue;
            }
            let d = (f64::from(x.abs()) - v).abs();
            best = match best {
                Some((bd, bc)) if bd < d || (bd == d && bc % 2 == 0) => Some((bd, bc)),
                _ => Some((d, c)),
            };
        }
        let c = best.unwrap().1;
        if x.is_sign_negative() { c | 0x80 } else { c }
    }

    #[test]
    fn narrowing_matches_brute_force_nearest() {
        let mut s = 0x0123_4567_89AB_CDEF_u64;
        for f in FORMATS {
            let mut xs: Vec<f32> = Vec::new();
            // Every midpoint between neighbouring codes, and its f32
            // neighbours (the tie-breaking cases), over the whole range.
            for c in 0..126u8 {
                let (a, b) = (to_f32(c, f), to_f32(c + 1, f));
                if !b.is_finite() || b.is_nan() {
                    continue;
                }
                let mid = (a + b) / 2.0;
                xs.extend([mid, mid.next_up(), mid.next_down(), a, b]);
            }
            for _ in 0..20_000 {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let mag = ((s >> 11) as f64 / (1u64 << 53) as f64) * 40.0 - 24.0;
                let v = (2f64.powf(mag) * if s & 1 == 1 { -1.0 } else { 1.0 }) as f32;
                xs.push(v);
            }
            xs.extend([0.0, -0.0, 1e-30, -1e-30, 1e6, -1e6, f.max(), 1e-45]);
            for x in xs {
                assert_eq!(from_f32(x, f), nearest(x, f), "{f:?} x = {x:e}");
            }
        }
    }

    #[test]
    fn specials_saturate_or_stay() {
        let f = Fp8Format::E4M3Fn;
        assert_eq!(from_f32(f32::INFINITY, f), 0x7E);
        assert_eq!(from_f32(f32::NEG_INFINITY, f), 0xFE);
        assert_eq!(from_f32(1e9, f), 0x7E);
        assert_eq!(from_f32(464.0, f), 0x7E);
        assert_eq!(from_f32(f32::NAN, f), 0x7F);
        let f = Fp8Format::E5M2;
        assert_eq!(from_f32(f32::INFINITY, f), 0x7C);
        assert_eq!(from_f32(-1e9, f), 0xFB);
        assert_eq!(from_f32(f32::NAN, f), 0x7E);
    }

    #[test]
    fn scaled_codes_round_trip() {
        for f in FORMATS {
            for scale in [1.0f32, 0.0123, 3.7, 1e-3, 0.5] {
                let codes: Vec<u8> = (0..=255u8).filter(|&c| to_f32(c, f).is_finite()).collect();
                let mut vals = vec![0.0; codes.len()];
                dequantize(&codes, f, scale, &mut vals);
                let mut back = vec![0u8; codes.len()];
                quantize(&vals, f, scale, &mut back);
                for (c, b) in codes.iter().zip(&back) {
                    // -0 and +0 are both zero codes; everything else exact.
                    assert!(
                        c == b || (c & 0x7F == 0 && b & 0x7F == 0),
                        "{f:?} {scale} {c:#x} -> {b:#x}"
                    );
                }
            }
        }
    }
}
