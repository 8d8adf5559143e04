//! Mixed-radix packing of base-`B` digits into fixed-width bit fields, for
//! symbol alphabets whose size is not a power of two (HQMQ's `24 S`
//! direction codewords: `log2(24 S)` is fractional, HQMQ paper Table 21).
//!
//! Digits `h_0 .. h_{n-1}` (each `< B`) are cut into groups of `G`
//! consecutive digits; group `g` is the integer
//!
//! ```text
//! N_g = sum_{k < G} h_{g*G + k} * B^k        (h_i = 0 for i >= n)
//! ```
//!
//! stored in `W = bitlen(B^G - 1)` bits (the smallest width that holds every
//! group value), LSB-first in the bitstream convention of format/SPEC.md
//! section 6.2 ([`super::bitpack::pack_u64`]); there are `ceil(n / G)`
//! groups. A group costs `W / G` bits per digit against the entropy bound
//! `log2 B`; [`Groups::best`] picks the `G` with the least waste among those
//! whose groups fit in 64 bits (for `B = 9`: `G = 17`, `W = 54`, 3.1765
//! bits per digit against 3.1699).

use super::bitpack;

/// A digit grouping: base, digits per group and field width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Groups {
    /// Digit base `B >= 2`.
    pub base: u64,
    /// Digits per group `G >= 1`.
    pub digits: u32,
    /// Bits per group `W = bitlen(B^G - 1)`, 1..=64.
    pub bits: u32,
}

/// Why a digit stream is invalid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RadixError {
    /// A group value is `>= B^G` (it would yield a digit `>= B`).
    GroupOutOfRange,
    /// A digit past the last one (padding of the final group) is not zero,
    /// or bits past the last group are set.
    NonZeroPadding,
}

impl std::fmt::Display for RadixError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RadixError::GroupOutOfRange => "a digit group value is out of range",
            RadixError::NonZeroPadding => {
                "padding digits or bits after the last digit are not zero"
            }
        })
    }
}

/// `base^g` as u128 when it does not exceed 2^64.
fn power(base: u64, g: u32) -> Option<u128> {
    let mut p: u128 = 1;
    for _ in 0..g {
        p = p.checked_mul(u128::from(base))?;
        if p > 1u128 << 64 {
            return None;
        }
    }
    Some(p)
}

impl Groups {
    /// The grouping with `g` digits per group, or `None` when `base < 2`,
    /// `g == 0` or `base^g > 2^64` (a group would not fit in 64 bits).
    pub fn new(base: u64, g: u32) -> Option<Groups> {
        if base < 2 || g == 0 {
            return None;
        }
        let p = power(base, g)?;
        let bits = 128 - (p - 1).leading_zeros();
        Some(Groups {
            base,
            digits: g,
            bits,
        })
    }

    /// The grouping with the fewest bits per digit (`W / G` smallest; ties
    /// to the smaller `G`) among all `G` with `base^G <= 2^64`.
    ///
    /// # Panics
    /// If `base < 2`.
    pub fn best(base: u64) -> Groups {
        let mut best = Groups::new(base, 1).expect("base >= 2");
        let mut g = 2;
        while let Some(c) = Groups::new(base, g) {
            // c.bits / c.digits < best.bits / best.digits, exactly.
            if u64::from(c.bits) * u64::from(best.digits)
                < u64::from(best.bits) * u64::from(c.digits)
            {
                best = c;
            }
            g += 1;
        }
        best
    }

    /// `B^G` (fits in u128; at most 2^64).
    pub fn limit(&self) -> u128 {
        power(self.base, self.digits).expect("validated grouping")
    }

    /// Number of groups for `n` digits: `ceil(n / G)`.
    pub fn groups(&self, n: usize) -> usize {
        n.div_ceil(self.digits as usize)
    }

    /// Bytes of the packed stream of `n` digits: `ceil(groups(n) * W / 8)`.
    pub fn packed_len(&self, n: usize) -> usize {
        bitpack::packed_len(self.groups(n), self.bits)
    }

    /// Average bits per digit of a long stream, `W / G`.
    pub fn bits_per_digit(&self) -> f64 {
        f64::from(self.bits) / f64::from(self.digits)
    }

    /// Packs `digits` (each `< base`) into `out` (`packed_len(digits.len())`
    /// bytes).
    ///
    /// # Panics
    /// If `out` has the wrong length or a digit is `>= base`.
    pub fn pack(&self, digits: &[u32], out: &mut [u8]) {
        let g = self.digits as usize;
        let values: Vec<u64> = digits
            .chunks(g)
            .map(|c| {
                c.iter().rev().fold(0u64, |acc, &h| {
                    assert!(u64::from(h) < self.base, "digit {h} >= base {}", self.base);
                    acc * self.base + u64::from(h)
                })
            })
            .collect();
        bitpack::pack_u64(&values, self.bits, out);
    }

    /// Unpacks `out.len()` digits from `packed`, checking that every group
    /// is below `B^G`, the padding digits of the last group are zero and so
    /// are the bits after the last group.
    ///
    /// # Errors
    /// [`RadixError`] for a non-canonical or out-of-range stream.
    ///
    /// # Panics
    /// If `packed.len() != packed_len(out.len())`.
    pub fn unpack(&self, packed: &[u8], out: &mut [u32]) -> Result<(), RadixError> {
        let n = out.len();
        let ng = self.groups(n);
        assert_eq!(packed.len(), self.packed_len(n));
        if !bitpack::tail_is_zero(packed, ng, self.bits) {
            return Err(RadixError::NonZeroPadding);
        }
        let mut values = vec![0u64; ng];
        bitpack::unpack_u64(packed, self.bits, &mut values);
        let limit = self.limit();
        if values.iter().any(|&v| u128::from(v) >= limit) {
            return Err(RadixError::GroupOutOfRange);
        }
        let g = self.digits as usize;
        let full = n / g;
        let (head, tail) = out.split_at_mut(full * g);
        match self.base {
            3 => split_groups::<3>(&values[..full], head, g),
            9 => split_groups::<9>(&values[..full], head, g),
            b => split_groups_dyn(&values[..full], head, g, b),
        }
        if !tail.is_empty() {
            let mut v = values[full];
            for d in tail.iter_mut() {
                *d = (v % self.base) as u32;
                v /= self.base;
            }
            if v != 0 {
                return Err(RadixError::NonZeroPadding);
            }
        }
        Ok(())
    }
}

/// Splits full groups into digits with a compile-time base (the compiler
/// turns `%` and `/` into multiplications).
fn split_groups<const B: u64>(values: &[u64], out: &mut [u32], g: usize) {
    for (&v, o) in values.iter().zip(out.chunks_exact_mut(g)) {
        let mut v = v;
        for d in o {
            *d = (v % B) as u32;
            v /= B;
        }
    }
}

fn split_groups_dyn(values: &[u64], out: &mut [u32], g: usize, base: u64) {
    for (&v, o) in values.iter().zip(out.chunks_exact_mut(g)) {
        let mut v = v;
        for d in o {
            *d = (v % base) as u32;
            v /= base;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn best_groupings() {
        assert_eq!(
            Groups::best(9),
            Groups {
                base: 9,
                digits: 17,
                bits: 54
            }
        );
        assert_eq!(Groups::best(3).digits, 29);
        assert_eq!(Groups::best(3).bits, 46);
        // Powers of two waste nothing with one digit per group.
        assert_eq!(Groups::best(16).bits_per_digit(), 4.0);
        assert_eq!(Groups::best(2).digits, 1);
        // Every best grouping is within 1/G bits of the entropy bound.
        for b in [3u64, 5, 7, 9, 15, 27, 45, 97, 1001, 196_605] {
            let g = Groups::best(b);
            let waste = g.bits_per_digit() - (b as f64).log2();
            assert!((0.0..0.2).contains(&waste), "{b}: {g:?}");
        }
        assert!(Groups::new(9, 21).is_none());
        assert_eq!(Groups::new(9, 20).unwrap().bits, 64);
        assert_eq!(Groups::new(2, 64).unwrap().bits, 64);
        assert!(Groups::new(2, 65).is_none());
    }

    #[test]
    fn known_bytes() {
        // Base 9, 2 digits per group (W = 7): digits 1, 2 -> 1 + 2*9 = 19;
        // digit 8 alone -> 8. Bits: 0010011 then 0001000 LSB-first.
        let g = Groups::new(9, 2).unwrap();
        assert_eq!(g.bits, 7);
        let mut out = vec![0u8; g.packed_len(3)];
        g.pack(&[1, 2, 8], &mut out);
        assert_eq!(out, [19 | (8 << 7), 8 >> 1]);
        let mut back = [0u32; 3];
        g.unpack(&out, &mut back).unwrap();
        assert_eq!(back, [1, 2, 8]);
    }

    #[test]
    fn invalid_streams_are_rejected() {
        let g = Groups::new(9, 2).unwrap();
        // Group value 81 = 9^2 is out of range.
        let mut back = [0u32; 2];
        assert_eq!(g.unpack(&[81], &mut back), Err(RadixError::GroupOutOfRange));
        // Three digits: the second group's padding digit must be zero.
        let mut back = [0u32; 3];
        let mut out = vec![0u8; g.packed_len(3)];
        g.pack(&[0, 0, 0], &mut out);
        out[0] |= 1 << 7; // second group = 1 + 9*? -> set bit 0 of group 1
        out[1] |= 1; // group 1 = 1 + 2 = 3 (digit 3): fine
        assert!(g.unpack(&out, &mut back).is_ok());
        out[1] |= 1 << 3; // group 1 += 16: digit 1 of group 1 becomes nonzero
        assert_eq!(g.unpack(&out, &mut back), Err(RadixError::NonZeroPadding));
        // Stray bit after the last group.
        let mut out = vec![0u8; g.packed_len(3)];
        g.pack(&[0, 0, 0], &mut out);
        out[1] |= 0x80;
        assert_eq!(g.unpack(&out, &mut back), Err(RadixError::NonZeroPadding));
    }

    proptest! {
        #[test]
        fn round_trip(base in 2u64..400, g in 1u32..30, raw in proptest::collection::vec(any::<u32>(), 0..200)) {
            let Some(grp) = Groups::new(base, g) else { return Ok(()); };
            let digits: Vec<u32> = raw.iter().map(|&d| (u64::from(d) % base) as u32).collect();
            let mut packed = vec![0u8; grp.packed_len(digits.len())];
            grp.pack(&digits, &mut packed);
            let mut back = vec![0u32; digits.len()];
            grp.unpack(&packed, &mut back).unwrap();
            prop_assert_eq!(back, digits);
        }
    }
}
