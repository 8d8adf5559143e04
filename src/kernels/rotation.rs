//! Random sign-flipped Walsh-Hadamard rotations `R = H diag(s)` (OCTOPUS
//! paper, Boss et al., arXiv:2605.21226, Eq. 2 and appendix C.2;
//! TurboQuant; QJL), with sign vectors drawn from a spelled-out integer
//! PRNG so that every implementation derives the same rotation from a seed.
//!
//! # PRNG and seed derivation (normative for format/codecs/octopus.md)
//! All arithmetic is on u64, wrapping; `mix64`, `GAMMA` and `next` are
//! SplitMix64 ([`super::rng`]).
//!
//! ```text
//! derive(seed, f_0, ..., f_n): h = seed; for each f_i: h = mix64((h + GAMMA) ^ f_i); return h
//! signs(key, d): state = key; word_j = next(state) for j = 0, 1, ...;
//!                s_i = -1 if bit (i mod 64) of word_(i div 64) is 1, else +1
//! ```
//!
//! # Rotation
//! `H` is the Sylvester Hadamard matrix applied by [`super::wht`] (normative
//! butterfly order), `c_d` the f32 nearest to `1/sqrt(d)`
//! ([`super::wht::inv_sqrt`]). Sign flips are exact, so `s ⊙ x` has no
//! rounding.

use super::rng::{GAMMA, SplitMix64, mix64};
use super::wht;

/// Derives a key from a seed and a list of fields (module docs).
pub fn derive(seed: u64, fields: &[u64]) -> u64 {
    fields
        .iter()
        .fold(seed, |h, &f| mix64(h.wrapping_add(GAMMA) ^ f))
}

/// A sign vector `s` in `{±1}^d` as f32, drawn from `key` (module docs).
pub fn signs(key: u64, d: usize) -> Vec<f32> {
    let mut rng = SplitMix64::new(key);
    let mut out = Vec::with_capacity(d);
    let mut word = 0u64;
    for i in 0..d {
        if i % 64 == 0 {
            word = rng.next_u64();
        }
        out.push(if (word >> (i % 64)) & 1 == 1 {
            -1.0
        } else {
            1.0
        });
    }
    out
}

/// `x <- s ⊙ x` (exact).
#[inline]
pub fn flip(x: &mut [f32], s: &[f32]) {
    for (v, &si) in x.iter_mut().zip(s) {
        *v *= si;
    }
}

/// `x <- H (s ⊙ x)`: the unnormalized forward rotation (multiply by `c_d`
/// for `R x`).
///
/// # Panics
/// If `x.len()` is not a power of two or differs from `s.len()`.
pub fn forward(x: &mut [f32], s: &[f32]) {
    assert_eq!(x.len(), s.len());
    flip(x, s);
    wht::fwht_blocks(x, x.len());
}

/// `y <- s ⊙ (H y)`: the unnormalized inverse rotation (multiply by `c_d`
/// for `R^T y`).
///
/// # Panics
/// As [`forward`].
pub fn inverse(y: &mut [f32], s: &[f32]) {
    assert_eq!(y.len(), s.len());
    wht::fwht_blocks(y, y.len());
    flip(y, s);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_derivation_reference_values() {
        // SplitMix64 from state 0 (Vigna's reference implementation).
        let mut s = SplitMix64::new(0);
        assert_eq!(s.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(s.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(derive(7, &[]), 7);
        assert_ne!(derive(0, &[1, 0]), derive(0, &[0, 1]));
        // format/codecs/octopus.md test values (computed independently).
        let pattern = |key| -> String {
            signs(key, 16)
                .iter()
                .map(|&s| if s < 0.0 { '-' } else { '+' })
                .collect()
        };
        assert_eq!(derive(0, &[0, 0, 0, 0]), 0x2130_748A_AAC8_0268);
        assert_eq!(pattern(0x2130_748A_AAC8_0268), "+----+-+++-+-+--");
        assert_eq!(derive(0, &[3, 1, 1, 1]), 0xF389_7719_BB9B_1D3C);
        assert_eq!(pattern(0xF389_7719_BB9B_1D3C), "--+---++-+---+++");
    }

    #[test]
    fn signs_follow_the_bits() {
        let mut st = SplitMix64::new(42);
        let w0 = st.next_u64();
        let w1 = st.next_u64();
        let s = signs(42, 100);
        for (i, &v) in s.iter().enumerate() {
            let w = if i < 64 { w0 } else { w1 };
            assert_eq!(v == -1.0, (w >> (i % 64)) & 1 == 1);
        }
        // Roughly balanced.
        let neg = signs(1, 4096).iter().filter(|&&v| v < 0.0).count();
        assert!((1900..2200).contains(&neg), "{neg}");
    }

    #[test]
    fn rotation_is_orthogonal_and_inverted() {
        let d = 64;
        let s = signs(3, d);
        let x: Vec<f32> = (0..d).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut y = x.clone();
        forward(&mut y, &s);
        let c = wht::inv_sqrt(d);
        let n0: f32 = x.iter().map(|v| v * v).sum();
        let n1: f32 = y.iter().map(|v| (v * c) * (v * c)).sum();
        assert!((n0 - n1).abs() < 1e-4 * n0);
        inverse(&mut y, &s);
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b * c * c).abs() < 1e-5);
        }
    }
}
