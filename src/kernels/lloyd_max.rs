//! Lloyd-Max scalar codebooks trained on analytic densities, with a fixed
//! quadrature and stopping rule so that the result is a deterministic
//! function of `(density, levels)`.
//!
//! The densities are the marginals of rotation-preconditioned codecs
//! (OCTOPUS paper, Boss et al., arXiv:2605.21226):
//!
//! * [`Density::Coordinate`]: one coordinate of a uniform unit vector in
//!   `d` dimensions, `f(u) ∝ (1 - u^2)^((d-3)/2)` on `[-1, 1]` (Eq. 3,
//!   appendix C.3; TurboQuant-MSE's marginal).
//! * [`Density::TripletNorm`]: the norm of three such coordinates,
//!   `f(r) ∝ r^2 (1 - r^2)^((d-5)/2)` on `[0, 1]` (Eq. 4, Lemma 3.1).
//! * [`Density::Octahedral`]: one octahedral coordinate of a uniform
//!   direction on S^2, `f(ξ) ∝ (a^2 + (1-a)^2)^(-1/2) ((1-a)/(1-2a+3a^2) +
//!   a/(2-4a+3a^2))` with `a = |ξ|` on `[-1, 1]` (Eq. 7, appendix C.8).
//!
//! Normalizing constants are dropped (centroids are ratios of integrals).
//! Every density is evaluated with `+ - * /` and `sqrt` only (half-integer
//! powers are an integer power times a square root), so training uses no
//! libm transcendental and gives the same bits on every IEEE 754 platform.
//! Codecs still store the trained tables in their parameter block; decoders
//! never retrain.
//!
//! # Quadrature
//! The support `[lo, hi]` is cut into [`PANELS`] equal panels (edge `i` is
//! `lo + i * ((hi - lo) / PANELS)`). The integrals `∫ x^m f(x) dx`, `m = 0,
//! 1, 2`, over an interval are the 3-point Gauss-Legendre rule (nodes `mid`,
//! `mid ± half * sqrt(3/5)`, weights `8/9, 5/9, 5/9`) on each whole panel
//! (prefix sums, panels in ascending order) plus the same rule on the two
//! partial panels at the interval ends. All arithmetic is f64.
//!
//! # Iteration and stopping rule
//! Start from the conditional means of `levels` equal-probability cells
//! (boundaries found by scanning the panel prefix sums). Then repeat the
//! Lloyd-Max step: boundaries are midpoints of adjacent centroids (the
//! outer ones are `lo` and `hi`), each new centroid is the conditional mean
//! of its cell (a cell with zero mass keeps its centroid); for a symmetric
//! density the pair `(c_k, c_{L-1-k})` is replaced by `(v, -v)` with
//! `v = (c_k - c_{L-1-k}) / 2`. Stop after the first step whose largest
//! centroid move is at most [`TOLERANCE`] times the support width, or after
//! [`MAX_ITERATIONS`] steps.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Panels of the fixed quadrature grid.
pub const PANELS: usize = 8192;
/// Stopping rule: largest centroid move, relative to the support width.
pub const TOLERANCE: f64 = 1e-13;
/// Hard cap on Lloyd-Max steps.
pub const MAX_ITERATIONS: usize = 1_000_000;

/// A marginal density on a bounded support (module docs give the formulas).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Density {
    /// One coordinate of a uniform unit vector in `d` dimensions (Eq. 3),
    /// on `[-1, 1]`. Requires `d >= 3`.
    Coordinate {
        /// Dimension of the unit vector (head_dim).
        d: u32,
    },
    /// Norm of three coordinates of a uniform unit vector in `d`
    /// dimensions (Eq. 4), on `[0, 1]`. Requires `d >= 5`.
    TripletNorm {
        /// Dimension of the unit vector (head_dim).
        d: u32,
    },
    /// One octahedral coordinate of a uniform direction on S^2 (Eq. 7), on
    /// `[-1, 1]`.
    Octahedral,
}

/// `b^n` by binary exponentiation (square-and-multiply from the low bit),
/// a fixed sequence of IEEE multiplications.
fn powi(b: f64, mut n: u32) -> f64 {
    let (mut acc, mut base) = (1.0f64, b);
    while n > 0 {
        if n & 1 == 1 {
            acc *= base;
        }
        base *= base;
        n >>= 1;
    }
    acc
}

/// `w^(m/2)` for `w >= 0` and integer `m >= 0`: `w^(m/2)` or
/// `w^((m-1)/2) * sqrt(w)`.
fn half_pow(w: f64, m: u32) -> f64 {
    if m.is_multiple_of(2) {
        powi(w, m / 2)
    } else {
        powi(w, m / 2) * w.sqrt()
    }
}

impl Density {
    /// Support `[lo, hi]`.
    pub fn support(self) -> (f64, f64) {
        match self {
            Density::TripletNorm { .. } => (0.0, 1.0),
            _ => (-1.0, 1.0),
        }
    }

    /// True when `f(-x) = f(x)` (the codebook is made exactly symmetric).
    pub fn symmetric(self) -> bool {
        !matches!(self, Density::TripletNorm { .. })
    }

    /// Unnormalized density at `x` (0 outside the support).
    ///
    /// # Panics
    /// If `d` is below the density's minimum (3 for coordinates, 5 for
    /// triplet norms).
    pub fn eval(self, x: f64) -> f64 {
        let (lo, hi) = self.support();
        if !(lo..=hi).contains(&x) {
            return 0.0;
        }
        match self {
            Density::Coordinate { d } => {
                assert!(d >= 3, "coordinate density needs d >= 3");
                let w = 1.0 - x * x;
                if w <= 0.0 { 0.0 } else { half_pow(w, d - 3) }
            }
            Density::TripletNorm { d } => {
                assert!(d >= 5, "triplet-norm density needs d >= 5");
                let w = 1.0 - x * x;
                if w <= 0.0 {
                    0.0
                } else {
                    x * x * half_pow(w, d - 5)
                }
            }
            Density::Octahedral => {
                let a = x.abs();
                let b = 1.0 - a;
                let r = (a * a + b * b).sqrt();
                (b / (1.0 - 2.0 * a + 3.0 * a * a) + a / (2.0 - 4.0 * a + 3.0 * a * a)) / r
            }
        }
    }
}

/// A trained codebook.
#[derive(Debug, Clone, PartialEq)]
pub struct Codebook {
    /// Centroids in ascending order (f64, as trained).
    pub centroids: Vec<f64>,
    /// Mean squared error of the f64 codebook under the (normalized)
    /// density: `E[(x - Q(x))^2]`.
    pub distortion: f64,
    /// Lloyd-Max steps performed.
    pub iterations: usize,
}

impl Codebook {
    /// Centroids rounded to f32 (round to nearest even), as stored in files.
    pub fn centroids_f32(&self) -> Vec<f32> {
        self.centroids.iter().map(|&c| c as f32).collect()
    }
}

/// Moments `(∫f, ∫xf, ∫x²f)` over `[a, b]` by 3-point Gauss-Legendre.
fn gl3(f: Density, a: f64, b: f64) -> [f64; 3] {
    let mid = 0.5 * (a + b);
    let half = 0.5 * (b - a);
    let off = half * 0.6f64.sqrt();
    let mut m = [0.0; 3];
    for (x, w) in [
        (mid - off, 5.0 / 9.0),
        (mid, 8.0 / 9.0),
        (mid + off, 5.0 / 9.0),
    ] {
        let fx = f.eval(x) * w * half;
        m[0] += fx;
        m[1] += fx * x;
        m[2] += fx * x * x;
    }
    m
}

/// Panel grid with prefix sums of the three moments.
struct Grid {
    f: Density,
    lo: f64,
    width: f64,
    prefix: Vec<[f64; 3]>,
}

impl Grid {
    fn new(f: Density) -> Grid {
        let (lo, hi) = f.support();
        let width = (hi - lo) / PANELS as f64;
        let mut prefix = Vec::with_capacity(PANELS + 1);
        let mut acc = [0.0f64; 3];
        prefix.push(acc);
        for i in 0..PANELS {
            let m = gl3(f, lo + i as f64 * width, lo + (i + 1) as f64 * width);
            for k in 0..3 {
                acc[k] += m[k];
            }
            prefix.push(acc);
        }
        Grid {
            f,
            lo,
            width,
            prefix,
        }
    }

    fn edge(&self, i: usize) -> f64 {
        self.lo + i as f64 * self.width
    }

    fn panel_of(&self, x: f64) -> usize {
        (((x - self.lo) / self.width) as usize).min(PANELS - 1)
    }

    /// Moments over `[a, b]`, `a <= b` inside the support.
    fn moments(&self, a: f64, b: f64) -> [f64; 3] {
        if b <= a {
            return [0.0; 3];
        }
        let (ia, ib) = (self.panel_of(a), self.panel_of(b));
        if ia == ib {
            return gl3(self.f, a, b);
        }
        let head = gl3(self.f, a, self.edge(ia + 1));
        let tail = gl3(self.f, self.edge(ib), b);
        let (p, q) = (self.prefix[ib], self.prefix[ia + 1]);
        let mut m = [0.0; 3];
        for k in 0..3 {
            m[k] = head[k] + (p[k] - q[k]) + tail[k];
        }
        m
    }

    fn total(&self) -> f64 {
        self.prefix[PANELS][0]
    }

    /// Smallest panel edge where the cumulative mass reaches `target`.
    fn quantile_edge(&self, target: f64) -> f64 {
        let i = self.prefix.partition_point(|m| m[0] < target);
        self.edge(i.min(PANELS))
    }
}

/// Trains a `levels`-level Lloyd-Max codebook on `f` (module docs give the
/// exact procedure). Results are cached per `(f, levels)` for the process.
///
/// # Panics
/// If `levels < 2` or `levels > 65536`, or `f` is invalid (see
/// [`Density::eval`]).
pub fn train(f: Density, levels: usize) -> Arc<Codebook> {
    type Cache = Mutex<HashMap<(Density, usize), Arc<Codebook>>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(c) = cache.lock().expect("codebook cache").get(&(f, levels)) {
        return c.clone();
    }
    let c = Arc::new(train_uncached(f, levels));
    cache
        .lock()
        .expect("codebook cache")
        .insert((f, levels), c.clone());
    c
}

/// [`train`] without the process cache.
///
/// # Panics
/// As [`train`].
pub fn train_uncached(f: Density, levels: usize) -> Codebook {
    assert!((2..=65536).contains(&levels), "levels {levels}");
    let grid = Grid::new(f);
    let (lo, hi) = f.support();
    let total = grid.total();
    // Equal-probability start.
    let mut bounds = vec![lo];
    for k in 1..levels {
        bounds.push(grid.quantile_edge(total * k as f64 / levels as f64));
    }
    bounds.push(hi);
    let mut c: Vec<f64> = (0..levels)
        .map(|k| {
            let m = grid.moments(bounds[k], bounds[k + 1]);
            if m[0] > 0.0 {
                m[1] / m[0]
            } else {
                0.5 * (bounds[k] + bounds[k + 1])
            }
        })
        .collect();
    let mut next = c.clone();
    let mut iterations = 0;
    while iterations < MAX_ITERATIONS {
        iterations += 1;
        let mut delta = 0.0f64;
        let mut a = lo;
        for k in 0..levels {
            let b = if k + 1 < levels {
                0.5 * (c[k] + c[k + 1])
            } else {
                hi
            };
            let m = grid.moments(a, b);
            next[k] = if m[0] > 0.0 { m[1] / m[0] } else { c[k] };
            a = b;
        }
        if f.symmetric() {
            for k in 0..levels / 2 {
                let v = 0.5 * (next[k] - next[levels - 1 - k]);
                next[k] = v;
                next[levels - 1 - k] = -v;
            }
        }
        for k in 0..levels {
            delta = delta.max((next[k] - c[k]).abs());
        }
        std::mem::swap(&mut c, &mut next);
        if delta <= TOLERANCE * (hi - lo) {
            break;
        }
    }
    let distortion = distortion(&grid, &c) / total;
    Codebook {
        centroids: c,
        distortion,
        iterations,
    }
}

/// Unnormalized `Σ ∫_cell (x - c_k)^2 f`.
fn distortion(grid: &Grid, c: &[f64]) -> f64 {
    let (lo, hi) = grid.f.support();
    let mut a = lo;
    let mut d = 0.0;
    for k in 0..c.len() {
        let b = if k + 1 < c.len() {
            0.5 * (c[k] + c[k + 1])
        } else {
            hi
        };
        let m = grid.moments(a, b);
        d += m[2] - 2.0 * c[k] * m[1] + c[k] * c[k] * m[0];
        a = b;
    }
    d
}

/// Mean squared error of an arbitrary ascending codebook (nearest-centroid
/// rounding) under the normalized density `f`.
pub fn distortion_of(f: Density, centroids: &[f64]) -> f64 {
    let grid = Grid::new(f);
    distortion(&grid, centroids) / grid.total()
}

/// Decision boundaries of an ascending f32 codebook of `2^b` centroids for
/// encoders: `B_k = (c_k + c_{k+1}) * 0.5` in f32, `k = 0..len-2`, followed
/// by one `+inf` so that the length is a power of two (for [`search`]).
///
/// # Panics
/// If `centroids.len()` is not a power of two.
pub fn boundaries(centroids: &[f32]) -> Vec<f32> {
    assert!(centroids.len().is_power_of_two());
    let mut b: Vec<f32> = centroids.windows(2).map(|w| (w[0] + w[1]) * 0.5).collect();
    b.push(f32::INFINITY);
    b
}

/// Index of the nearest centroid given the [`boundaries`]: the number of
/// boundaries strictly below `x` (a value exactly on a boundary takes the
/// lower cell; the `+inf` padding never counts).
#[inline]
pub fn search(padded: &[f32], x: f32) -> usize {
    padded.iter().filter(|&&b| b < x).count()
}

/// [`search`] for many values at once (`out[i] = search(padded, xs[i])`),
/// looping over boundaries outside so that the inner loop vectorizes.
///
/// # Panics
/// If the lengths differ or `padded` has more than 256 entries.
pub fn search_many(padded: &[f32], xs: &[f32], out: &mut [u8]) {
    assert!(xs.len() == out.len() && padded.len() <= 256);
    out.fill(0);
    for &b in &padded[..padded.len().saturating_sub(1)] {
        for (o, &x) in out.iter_mut().zip(xs) {
            *o += u8::from(b < x);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gaussian Lloyd-Max levels (as quoted by TurboQuant, arXiv:2504.19874): the coordinate
    /// codebook times sqrt(d) approaches them for large d.
    #[test]
    fn coordinate_codebook_approaches_the_gaussian_levels() {
        let d = 4096u32;
        let s = (d as f64).sqrt();
        for (bits, want) in [
            (1usize, vec![0.7979]),
            (2, vec![0.4528, 1.5104]),
            (3, vec![0.2451, 0.7560, 1.3439, 2.1519]),
        ] {
            let cb = train_uncached(Density::Coordinate { d }, 1 << bits);
            let pos: Vec<f64> = cb.centroids[cb.centroids.len() / 2..]
                .iter()
                .map(|c| c * s)
                .collect();
            for (g, w) in pos.iter().zip(&want) {
                assert!((g - w).abs() < 2e-3, "b={bits}: {g} vs {w}");
            }
        }
    }

    /// TurboQuant unit-vector MSE at d=128 (arXiv:2504.19874, Thm. 1): d * D_coord.
    #[test]
    fn turbo_unit_vector_mse_at_d128() {
        for (bits, want) in [(1, 0.362), (2, 0.116), (3, 0.034), (4, 0.009)] {
            let cb = train(Density::Coordinate { d: 128 }, 1 << bits);
            let mse = 128.0 * cb.distortion;
            // The anchors are rounded (0.362 is read off TurboQuant's plot).
            assert!(
                (mse - want).abs() <= 1.5e-3 + 0.02 * want,
                "b={bits}: {mse}"
            );
            assert!(cb.iterations < MAX_ITERATIONS);
        }
    }

    #[test]
    fn densities_integrate_like_their_closed_forms() {
        // Eq. 7 is a normalized density once multiplied by 1/pi.
        let g = Grid::new(Density::Octahedral);
        assert!((g.total() / std::f64::consts::PI - 1.0).abs() < 1e-10);
        // E[rho^2] = 3/d (appendix C.10).
        for d in [8u32, 64, 128, 256, 1024] {
            let g = Grid::new(Density::TripletNorm { d });
            let m = g.moments(0.0, 1.0);
            assert!((m[2] / m[0] - 3.0 / d as f64).abs() < 1e-9 * 3.0, "d={d}");
            // E[u^2] = 1/d for a coordinate.
            let g = Grid::new(Density::Coordinate { d });
            let m = g.moments(-1.0, 1.0);
            assert!((m[2] / m[0] - 1.0 / d as f64).abs() < 1e-9, "d={d}");
        }
    }

    #[test]
    fn codebooks_are_sorted_symmetric_and_reproducible() {
        for f in [
            Density::Octahedral,
            Density::Coordinate { d: 64 },
            Density::TripletNorm { d: 256 },
        ] {
            let a = train_uncached(f, 8);
            let b = train_uncached(f, 8);
            assert_eq!(a, b);
            assert!(a.centroids.windows(2).all(|w| w[0] < w[1]));
            if f.symmetric() {
                for k in 0..4 {
                    assert_eq!(a.centroids[k], -a.centroids[7 - k]);
                }
            }
            // Lloyd-Max optimality: moving one centroid raises the error.
            let mut moved = a.centroids.clone();
            moved[5] += 0.01 * (moved[6] - moved[5]);
            assert!(distortion_of(f, &moved) > a.distortion);
        }
    }

    #[test]
    fn search_counts_the_boundaries_below() {
        let b = boundaries(&[-1.0, 0.0, 0.5, 1.0]);
        assert_eq!(b, vec![-0.5, 0.25, 0.75, f32::INFINITY]);
        assert_eq!(search(&b, -0.5), 0);
        assert_eq!(search(&b, -0.49), 1);
        assert_eq!(search(&b, 0.25), 1);
        assert_eq!(search(&b, 2.0), 3);
        assert_eq!(search(&b, f32::INFINITY), 3);
        let xs = [-0.5f32, -0.49, 0.25, 2.0, f32::INFINITY, -7.0];
        let mut out = [9u8; 6];
        search_many(&b, &xs, &mut out);
        assert_eq!(out, [0, 1, 1, 3, 3, 0]);
        // Against the definition, for every codebook size used.
        for bits in 1..=6u32 {
            let c: Vec<f32> = (0..1u32 << bits)
                .map(|k| (k * k) as f32 / 7.0 - 3.0)
                .collect();
            let b = boundaries(&c);
            for k in 0..2000 {
                let x = k as f32 * 0.01 - 4.0;
                let want = b[..b.len() - 1].iter().filter(|&&v| v < x).count();
                assert_eq!(search(&b, x), want, "bits {bits} x {x}");
            }
            for &x in &b[..b.len() - 1] {
                let want = b[..b.len() - 1].iter().filter(|&&v| v < x).count();
                assert_eq!(search(&b, x), want);
            }
        }
    }
}
