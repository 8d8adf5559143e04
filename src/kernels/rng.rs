//! SplitMix64: a fixed, platform-independent integer PRNG for codebooks
//! that are regenerated from a seed instead of being stored (Steele, Lea and
//! Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014; the
//! constants of Java's `SplittableRandom`).
//!
//! All arithmetic is on `u64`, wrapping modulo 2^64, so every
//! implementation (CPU, GPU, another language) produces the same stream:
//!
//! ```text
//! mix64(z):   z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
//!             z = (z ^ (z >> 27)) * 0x94D049BB133111EB
//!             return z ^ (z >> 31)
//! next():     state = state + 0x9E3779B97F4A7C15 ; return mix64(state)
//! ```

/// The golden-ratio increment `0x9E3779B97F4A7C15` added to the state per draw.
pub const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// The SplitMix64 output function (a bijection on `u64`), also used to
/// derive independent seeds from structured keys.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A SplitMix64 generator (64-bit state).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitMix64 {
    /// Current state; the next output is `mix64(state + GAMMA)`.
    pub state: u64,
}

impl SplitMix64 {
    /// A generator whose first output is `mix64(seed + GAMMA)`.
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GAMMA);
        mix64(self.state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_published_reference_stream() {
        // First outputs for seed 1234567 of the reference C implementation
        // (https://prng.di.unimi.it/splitmix64.c).
        let mut r = SplitMix64::new(1234567);
        let got: Vec<u64> = (0..5).map(|_| r.next_u64()).collect();
        assert_eq!(
            got,
            [
                6457827717110365317,
                3203168211198807973,
                9817491932198370423,
                4593380528125082431,
                16408922859458223821
            ]
        );
    }

    #[test]
    fn mix64_is_not_the_identity_and_zero_is_a_fixed_point() {
        assert_eq!(mix64(0), 0);
        assert_ne!(mix64(1), 1);
        assert_ne!(mix64(1), mix64(2));
    }
}
