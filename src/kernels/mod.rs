//! Shared numeric kernels used by the codecs: element-type conversion
//! (bf16, fp16, fp8 E4M3FN / E5M2), bit packing, mixed-radix digit packing,
//! the fast Walsh-Hadamard transform, asymmetric (affine) and group-wise
//! quantization, quaternion arithmetic, a seeded integer PRNG, random
//! sign-flipped rotations, Lloyd-Max codebooks, the octahedral map and the
//! QJL residual sketch.
//!
//! Every kernel has a portable scalar implementation that defines its exact
//! result. Where an x86-64 AVX2 path exists it is selected at run time and
//! is bit-identical to the scalar one (the same IEEE operations in the same
//! order; multiplications by ±1 are exact, so sign-flip tricks do not change
//! results). Property tests in this module compare the two.

pub mod affine;
pub mod bitpack;
pub mod convert;
pub mod fp8;
pub mod group;
pub mod lloyd_max;
pub mod octahedral;
pub mod polar;
pub mod qjl;
pub mod quaternion;
pub mod radix;
pub mod rng;
pub mod rotation;
pub mod wht;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

/// True when the AVX2 + FMA + F16C paths may be used on this CPU.
///
/// Cached after the first call. Always false on non-x86-64 targets. Setting
/// the environment variable `KVPACK_NO_SIMD=1` forces the scalar paths (used
/// by tests and benchmarks to compare both).
pub fn simd_available() -> bool {
    use std::sync::OnceLock;
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        if std::env::var_os("KVPACK_NO_SIMD").is_some_and(|v| v != "0") {
            return false;
        }
        detect()
    })
}

/// True when the AVX-512F paths may be used on this CPU: AVX-512F and
/// [`simd_available`] (so `KVPACK_NO_SIMD=1` turns them off too;
/// `KVPACK_NO_AVX512=1` turns off these alone, to compare paths). Cached
/// after the first call; always false on non-x86-64 targets.
pub fn avx512_available() -> bool {
    use std::sync::OnceLock;
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            simd_available()
                && std::env::var_os("KVPACK_NO_AVX512").is_none_or(|v| v == "0")
                && is_x86_feature_detected!("avx512f")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

#[cfg(target_arch = "x86_64")]
fn detect() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> bool {
    false
}

/// Runs `f` inside a function compiled for AVX2 when [`simd_available`],
/// else as it is: loops of `f` inlined there are vectorized 8 lanes wide
/// instead of the baseline's 4. Rust neither reassociates nor contracts
/// floating-point operations (an `a * b + c` stays two rounded operations
/// whatever the target features), so the result is bit-identical either
/// way; only the instructions differ. For the effect, `f` and its hot
/// helpers must be inlined (`#[inline(always)]` on the closure and on
/// them).
#[inline(always)]
pub fn with_avx2<T>(f: impl FnOnce() -> T) -> T {
    #[cfg(target_arch = "x86_64")]
    if simd_available() {
        #[target_feature(enable = "avx2")]
        fn run<T>(f: impl FnOnce() -> T) -> T {
            f()
        }
        // SAFETY: simd_available() checked AVX2.
        return unsafe { run(f) };
    }
    f()
}

/// Multiplies every element of `x` by `c` (one IEEE multiplication each).
pub fn scale(x: &mut [f32], c: f32) {
    #[cfg(target_arch = "x86_64")]
    if simd_available() {
        // SAFETY: AVX2 availability checked.
        unsafe { x86::scale(x, c) };
        return;
    }
    for v in x {
        *v *= c;
    }
}

/// Euclidean norm `sqrt(Σ x_i^2)` with the squares summed in f64 in index
/// order, the square root taken in f64 and rounded to f32 (a fixed
/// sequence of correctly rounded operations: the same bits everywhere).
pub fn l2_norm(x: &[f32]) -> f32 {
    let acc: f64 = x.iter().fold(0.0, |a, &v| a + f64::from(v) * f64::from(v));
    acc.sqrt() as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The loops the budget planner's distortion runs (eight-accumulator
    /// dot products, an axpy, an f64 quadratic form) give the same bits
    /// through [`with_avx2`] as in the portable build.
    #[test]
    fn with_avx2_is_bit_identical() {
        #[inline(always)]
        fn work(a: &[f32], b: &[f32]) -> (f32, Vec<f32>, f64) {
            let mut acc = [0.0f32; 8];
            for (x, y) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
                for i in 0..8 {
                    acc[i] += x[i] * y[i];
                }
            }
            let dot = acc.iter().sum::<f32>();
            let mut o = b.to_vec();
            for (o, x) in o.iter_mut().zip(a) {
                *o += dot * x;
            }
            let q = a
                .iter()
                .zip(&o)
                .map(|(&x, &y)| f64::from(x) * f64::from(y))
                .sum();
            (dot, o, q)
        }
        let mut r = rng::SplitMix64::new(3);
        let mut v = || (r.next_u64() >> 40) as f32 / 16_777_216.0 - 0.5;
        let a: Vec<f32> = (0..1000).map(|_| v()).collect();
        let b: Vec<f32> = (0..1000).map(|_| v() * 1e3).collect();
        let plain = work(&a, &b);
        let wide = with_avx2(
            #[inline(always)]
            || work(&a, &b),
        );
        assert_eq!(plain.0.to_bits(), wide.0.to_bits());
        assert!(
            plain
                .1
                .iter()
                .zip(&wide.1)
                .all(|(x, y)| x.to_bits() == y.to_bits())
        );
        assert_eq!(plain.2.to_bits(), wide.2.to_bits());
    }
}
