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
