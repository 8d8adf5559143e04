//! `octopus:b{b}`: OCTOPUS, octahedral triplet quantization of rotated
//! unit vectors (format/codecs/octopus.md; Boss et al., "OCTOPUS:
//! Optimized KV Cache for Transformers via Octahedral Parametrization Under
//! optimal Squared error quantization", arXiv:2605.21226, sections 3.1-3.6,
//! appendices A-E).
//!
//! Per head vector (`d = head_dim`, a power of two): the norm `γ` (f32) and
//! the rotated unit vector `u` ([`super::sphere`]); `u` is cut into
//! `n_tri = ceil(d/3)` contiguous triplets `t_i` (the last zero-padded),
//! each coded as two octahedral coordinates `(ξ, η)` of its direction with a
//! shared `b_dir`-bit Lloyd-Max codebook on the octahedral marginal (Eq. 5,
//! 7) and a norm with a `b_norm`-bit Lloyd-Max codebook on the Beta triplet
//! norm density for this `d` (Eq. 4). The default split is
//! `(b_dir, b_norm) = (b + 1, b - 1)` (section 3.3, Table 4). The encoder
//! picks the direction code maximizing `t . n(ξ^, η^)` over the 3x3
//! neighbourhood of the scalar rounding, then the norm centroid nearest to
//! that projection (section 3.5, Algorithm 1); `:full` searches all
//! direction codes, `:scalar` keeps the scalar seed.
//!
//! Bits per element: `(32 + ceil(d/3) (2 b_dir + b_norm)) / d`, plus
//! `1 + 16/d` on K with `+qjl`; `b + 32/g` on V with `:vg{g}`.
//!
//! Names: `octopus:b{2..5}[+qjl][:vg{g}[b{bits}]][:full|:scalar][:seed{n}]`
//! (split `(b+1, b-1)`), or `octopus:d{b_dir}n{b_norm}...` for any split
//! with both in 1..=6.

use std::sync::Arc;

use crate::cache::TensorInfo;
use crate::error::{Error, Result};
use crate::format::{PageView, Section};
use crate::kernels::lloyd_max::{self, Density};
use crate::kernels::octahedral;
use crate::plan::Layout;

use super::sphere::{self, Options, UnitQuantizer, Values};
use super::{Codec, Example, Family, PageIn, PageOut};

/// Codec id of `octopus`.
pub const ID: u16 = 4;
/// Largest `b_dir` or `b_norm`.
pub const MAX_BITS: u8 = 6;

/// Registry entry of `octopus`.
pub const FAMILY: Family = Family {
    id: ID,
    name: "octopus",
    syntax: "octopus:b{b}[+qjl][:vg{g}][:full|:scalar][:seed{n}] b = 2..5, e.g. octopus:b3",
    summary: "OCTOPUS: WHT rotation + octahedral triplets, Lloyd-Max (b+1, b-1) split; V int-b groups with :vg{g}",
    parse,
    from_params: |p| Ok(Box::new(Octopus::from_params(p)?)),
    examples: &[
        Example {
            name: "octopus:b2",
            min_snr_db: 9.0,
        },
        Example {
            name: "octopus:b3",
            min_snr_db: 14.0,
        },
        Example {
            name: "octopus:b4",
            min_snr_db: 20.0,
        },
        Example {
            name: "octopus:b3+qjl:vg16",
            min_snr_db: 15.0,
        },
        Example {
            name: "octopus:b2+qjl",
            min_snr_db: 9.0,
        },
    ],
};

/// Bits per octahedral coordinate and per triplet norm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Split {
    /// Bits of each octahedral coordinate (`b_dir`).
    pub dir: u8,
    /// Bits of the triplet norm (`b_norm`).
    pub norm: u8,
}

impl Split {
    /// The paper's split `(b + 1, b - 1)` for nominal `b` (section 3.3).
    pub fn for_bits(b: u8) -> Split {
        Split {
            dir: b + 1,
            norm: b - 1,
        }
    }

    /// The nominal `b` when this is a `(b + 1, b - 1)` split.
    pub fn nominal(self) -> Option<u8> {
        (self.dir >= 2 && self.norm + 2 == self.dir).then_some(self.dir - 1)
    }
}

/// Encoder search for the direction code (section 3.5, appendix E). Does
/// not change the bitstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rounding {
    /// The 3x3 neighbourhood of the scalar rounding (default, Algorithm 1).
    Local,
    /// All `2^(2 b_dir)` direction codes (the joint optimum).
    Full,
    /// The scalar rounding only (Algorithm 1 with `Δ = {(0, 0)}`).
    Scalar,
}

impl Rounding {
    /// Parameter-block code: 0 local, 1 full, 2 scalar.
    pub fn code(self) -> u8 {
        match self {
            Rounding::Local => 0,
            Rounding::Full => 1,
            Rounding::Scalar => 2,
        }
    }

    fn from_code(c: u8) -> Option<Rounding> {
        Some(match c {
            0 => Rounding::Local,
            1 => Rounding::Full,
            2 => Rounding::Scalar,
            _ => return None,
        })
    }
}

/// The direction codebook, its boundaries and the decoded direction of
/// every code pair.
#[derive(Debug, Clone, PartialEq)]
pub struct DirTables {
    /// Bits per coordinate.
    pub bits: u8,
    /// `2^bits` ascending centroids in `[-1, 1]`.
    pub centroids: Vec<f32>,
    /// Midpoints of adjacent centroids, padded with `+inf`
    /// ([`lloyd_max::boundaries`]).
    pub bounds: Vec<f32>,
    /// `dirs[64 * jx + jy] = octahedral::decode(c[jx], c[jy])` (stride 64,
    /// the largest codebook, so that masked `u8` codes index it without
    /// bounds checks); entries outside the codebook are zero.
    pub dirs: Box<[[f32; 3]; 4096]>,
}

impl DirTables {
    /// Tables for stored centroids.
    pub fn new(bits: u8, centroids: Vec<f32>) -> DirTables {
        assert!(centroids.len() <= 64);
        let mut dirs = Box::new([[0f32; 3]; 4096]);
        for (a, &x) in centroids.iter().enumerate() {
            for (b, &y) in centroids.iter().enumerate() {
                dirs[a << 6 | b] = octahedral::decode(x, y);
            }
        }
        DirTables {
            bits,
            bounds: lloyd_max::boundaries(&centroids),
            centroids,
            dirs,
        }
    }

    /// Trained tables: Lloyd-Max on the octahedral marginal (Eq. 7).
    pub fn trained(bits: u8) -> DirTables {
        let cb = lloyd_max::train(Density::Octahedral, 1 << bits);
        DirTables::new(bits, cb.centroids_f32())
    }

    /// The decoded direction of code pair `(a, b)` (codes below 64).
    #[inline(always)]
    pub fn dir(&self, a: usize, b: usize) -> [f32; 3] {
        self.dirs[(a & 63) << 6 | (b & 63)]
    }
}

/// A codebook padded to 256 entries, indexed by `u8` codes without bounds
/// checks (entries past the codebook repeat the last centroid).
pub(crate) fn lut(centroids: &[f32]) -> Box<[f32; 256]> {
    let mut t = Box::new([0f32; 256]);
    for (k, v) in t.iter_mut().enumerate() {
        *v = centroids[k.min(centroids.len() - 1)];
    }
    t
}

/// The triplet-norm codebook of one head_dim.
#[derive(Debug, Clone, PartialEq)]
pub struct NormTables {
    /// head_dim `d` the codebook is matched to.
    pub dim: u32,
    /// `2^bits` ascending centroids in `[0, 1]`.
    pub centroids: Vec<f32>,
    /// Midpoints of adjacent centroids, padded with `+inf`.
    pub bounds: Vec<f32>,
    /// The centroids padded to 256 entries.
    pub lut: Box<[f32; 256]>,
}

impl NormTables {
    /// Tables for stored centroids.
    pub fn new(dim: u32, centroids: Vec<f32>) -> NormTables {
        NormTables {
            dim,
            bounds: lloyd_max::boundaries(&centroids),
            lut: lut(&centroids),
            centroids,
        }
    }

    /// Trained tables: Lloyd-Max on the Beta triplet-norm density of `d`
    /// (Eq. 4).
    pub fn trained(dim: u32, bits: u8) -> NormTables {
        let cb = lloyd_max::train(Density::TripletNorm { d: dim }, 1 << bits);
        NormTables::new(dim, cb.centroids_f32())
    }
}

/// The OCTOPUS unit quantizer for one head_dim.
#[derive(Debug, Clone)]
pub struct TripletQuantizer {
    d: usize,
    dir: Arc<DirTables>,
    norm: Arc<NormTables>,
    rounding: Rounding,
}

impl TripletQuantizer {
    /// Builds the quantizer of `norm.dim` from its tables.
    pub fn new(dir: Arc<DirTables>, norm: Arc<NormTables>, rounding: Rounding) -> Self {
        TripletQuantizer {
            d: norm.dim as usize,
            dir,
            norm,
            rounding,
        }
    }

    /// Number of triplets `ceil(d/3)`.
    pub fn triplets(&self) -> usize {
        self.d.div_ceil(3)
    }

    /// Codes one triplet: `(jx, jy, jn)` (section 3.5).
    pub fn quantize_triplet(&self, t: [f32; 3]) -> (u8, u8, u8) {
        let (xi, eta) = octahedral::encode(t);
        let jx = lloyd_max::search(&self.dir.bounds, xi);
        let jy = lloyd_max::search(&self.dir.bounds, eta);
        let (bx, by, best) = self.choose(t, jx, jy);
        let jn = lloyd_max::search(&self.norm.bounds, best.clamp(0.0, 1.0));
        (bx as u8, by as u8, jn as u8)
    }

    /// The direction code maximizing `t . n(a, b)` over the candidates
    /// around the scalar seed `(jx, jy)`, and that maximum (Algorithm 1).
    #[inline]
    fn choose(&self, t: [f32; 3], jx: usize, jy: usize) -> (usize, usize, f32) {
        let dt = &self.dir;
        let l = dt.centroids.len();
        let score = |a: usize, b: usize| {
            let n = dt.dir(a, b);
            (t[0] * n[0] + t[1] * n[1]) + t[2] * n[2]
        };
        // Candidates in ascending (a, b) order with a strict comparison: the
        // smallest code pair among equal maxima wins.
        let (ra, rb) = match self.rounding {
            Rounding::Scalar => (jx..=jx, jy..=jy),
            Rounding::Local => (
                jx.saturating_sub(1)..=(jx + 1).min(l - 1),
                jy.saturating_sub(1)..=(jy + 1).min(l - 1),
            ),
            Rounding::Full => (0..=l - 1, 0..=l - 1),
        };
        let (mut bx, mut by, mut best) = (jx, jy, f32::NEG_INFINITY);
        for a in ra {
            for b in rb.clone() {
                let s = score(a, b);
                if s > best {
                    (bx, by, best) = (a, b, s);
                }
            }
        }
        (bx, by, best)
    }
}

impl UnitQuantizer for TripletQuantizer {
    fn dim(&self) -> usize {
        self.d
    }

    fn streams(&self) -> Vec<(u8, usize)> {
        let n = self.triplets();
        vec![(self.dir.bits, 2 * n), (self.norm_bits(), n)]
    }

    fn quantize(&self, u: &[f32], codes: &mut [&mut [u8]]) {
        // The steps of `quantize_triplet`, 8 triplets at a time so that the
        // octahedral fold and the searches vectorize (and, with AVX2, the
        // local 3x3 search too).
        let n = self.triplets();
        let (dir, rest) = codes.split_at_mut(1);
        let (dir, norm) = (&mut *dir[0], &mut *rest[0]);
        #[cfg(target_arch = "x86_64")]
        let simd = self.rounding == Rounding::Local && crate::kernels::simd_available();
        for c in (0..n).step_by(8) {
            let m = (n - c).min(8);
            let mut t = [[0f32; 8]; 3];
            if 3 * (c + 8) <= u.len() {
                let (tri, _) = u[3 * c..3 * c + 24].as_chunks::<3>();
                for (k, v) in tri.iter().enumerate() {
                    (t[0][k], t[1][k], t[2][k]) = (v[0], v[1], v[2]);
                }
            } else {
                for (k, v) in u[3 * c..].iter().take(3 * m).enumerate() {
                    t[k % 3][k / 3] = *v;
                }
            }
            let (mut xi, mut eta) = ([0f32; 8], [0f32; 8]);
            for k in 0..8 {
                (xi[k], eta[k]) = octahedral::encode([t[0][k], t[1][k], t[2][k]]);
            }
            let (mut jx, mut jy) = ([0u8; 8], [0u8; 8]);
            lloyd_max::search_many(&self.dir.bounds, &xi, &mut jx);
            lloyd_max::search_many(&self.dir.bounds, &eta, &mut jy);
            let mut ab = [0u8; 16];
            let mut proj = [0f32; 8];
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: AVX2 checked; all arrays hold 8 (16) elements;
                // codes are below l <= 64.
                unsafe {
                    avx2::choose_local(
                        [&t[0], &t[1], &t[2]],
                        &jx,
                        &jy,
                        self.dir.centroids.len() as i32,
                        &self.dir.dirs,
                        &mut ab,
                        &mut proj,
                    )
                };
                dir[2 * c..2 * (c + m)].copy_from_slice(&ab[..2 * m]);
            }
            #[cfg(target_arch = "x86_64")]
            let scalar = !simd;
            #[cfg(not(target_arch = "x86_64"))]
            let scalar = true;
            if scalar {
                for k in 0..m {
                    let tk = [t[0][k], t[1][k], t[2][k]];
                    let (a, b, s) = self.choose(tk, jx[k] as usize, jy[k] as usize);
                    dir[2 * (c + k)] = a as u8;
                    dir[2 * (c + k) + 1] = b as u8;
                    proj[k] = s;
                }
            }
            for p in &mut proj {
                *p = p.clamp(0.0, 1.0);
            }
            let mut jn = [0u8; 8];
            lloyd_max::search_many(&self.norm.bounds, &proj, &mut jn);
            norm[c..c + m].copy_from_slice(&jn[..m]);
        }
    }

    fn reconstruct(&self, codes: &[&[u8]], u_hat: &mut [f32]) {
        let (dir, norm) = (codes[0], codes[1]);
        let full = self.d / 3;
        let (pairs, _) = dir.as_chunks::<2>();
        let (whole, _) = u_hat.as_chunks_mut::<3>();
        for ((t, p), &c) in whole.iter_mut().zip(pairs).zip(norm).take(full) {
            let n = self.dir.dir(p[0] as usize, p[1] as usize);
            let rho = self.norm.lut[c as usize];
            *t = [n[0] * rho, n[1] * rho, n[2] * rho];
        }
        if full < self.triplets() {
            let i = full;
            let n = self.dir.dir(dir[2 * i] as usize, dir[2 * i + 1] as usize);
            let rho = self.norm.lut[norm[i] as usize];
            for k in 0..self.d - 3 * i {
                u_hat[3 * i + k] = n[k] * rho;
            }
        }
    }
}

/// AVX2 local 3x3 search for 8 triplets at once, bit-identical to
/// [`TripletQuantizer::choose`] with [`Rounding::Local`] (same IEEE
/// operations per lane, no fused multiply-add; property-tested below).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// For lanes `i` in 0..8: the code pair `(a, b)` maximizing
    /// `(t0*n0 + t1*n1) + t2*n2` over the clamped 3x3 neighbourhood of
    /// `(jx_i, jy_i)`, visited in ascending order with a strict comparison
    /// (the first maximum wins; clamped repeats never replace it). Writes
    /// `a` to `ab[2i]`, `b` to `ab[2i+1]` and the score to `s[i]`.
    ///
    /// # Safety
    /// AVX2 must be available; `t[k]`, `jx`, `jy`, `s` have 8 elements;
    /// `1 <= l <= 64`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn choose_local(
        t: [&[f32]; 3],
        jx: &[u8],
        jy: &[u8],
        l: i32,
        dirs: &[[f32; 3]; 4096],
        ab: &mut [u8; 16],
        s: &mut [f32],
    ) {
        assert!(t.iter().all(|x| x.len() == 8) && jx.len() == 8 && jy.len() == 8 && s.len() == 8);
        assert!((1..=64).contains(&l));
        let base = dirs.as_ptr() as *const f32;
        let widen = |j: &[u8]| {
            let mut w = [0i32; 8];
            for (o, &v) in w.iter_mut().zip(j) {
                *o = i32::from(v);
            }
            // SAFETY: 8 i32 in a local array.
            unsafe { _mm256_loadu_si256(w.as_ptr() as *const __m256i) }
        };
        // SAFETY: register-only AVX2 ops; unaligned loads/stores of 8
        // elements from slices asserted to hold 8; gathers read
        // `base[3 * (64 a + b) + k]` with `0 <= a, b < l <= 64`, inside the
        // 4096 * 3 floats of `dirs`.
        unsafe {
            let (x0, y0) = (widen(jx), widen(jy));
            let t0 = _mm256_loadu_ps(t[0].as_ptr());
            let t1 = _mm256_loadu_ps(t[1].as_ptr());
            let t2 = _mm256_loadu_ps(t[2].as_ptr());
            let zero = _mm256_setzero_si256();
            let top = _mm256_set1_epi32(l - 1);
            let clamp = |v: __m256i, d: i32| {
                _mm256_min_epi32(
                    _mm256_max_epi32(_mm256_add_epi32(v, _mm256_set1_epi32(d)), zero),
                    top,
                )
            };
            let mut best = _mm256_set1_ps(f32::NEG_INFINITY);
            let (mut ba, mut bb) = (x0, y0);
            for da in -1..=1 {
                let a = clamp(x0, da);
                for db in -1..=1 {
                    let b = clamp(y0, db);
                    let idx = _mm256_mullo_epi32(
                        _mm256_or_si256(_mm256_slli_epi32::<6>(a), b),
                        _mm256_set1_epi32(3),
                    );
                    let n0 = _mm256_i32gather_ps::<4>(base, idx);
                    let n1 = _mm256_i32gather_ps::<4>(base.add(1), idx);
                    let n2 = _mm256_i32gather_ps::<4>(base.add(2), idx);
                    let sc = _mm256_add_ps(
                        _mm256_add_ps(_mm256_mul_ps(t0, n0), _mm256_mul_ps(t1, n1)),
                        _mm256_mul_ps(t2, n2),
                    );
                    let gt = _mm256_cmp_ps::<_CMP_GT_OQ>(sc, best);
                    best = _mm256_blendv_ps(best, sc, gt);
                    let gti = _mm256_castps_si256(gt);
                    ba = _mm256_blendv_epi8(ba, a, gti);
                    bb = _mm256_blendv_epi8(bb, b, gti);
                }
            }
            _mm256_storeu_ps(s.as_mut_ptr(), best);
            let (mut oa, mut ob) = ([0i32; 8], [0i32; 8]);
            _mm256_storeu_si256(oa.as_mut_ptr() as *mut __m256i, ba);
            _mm256_storeu_si256(ob.as_mut_ptr() as *mut __m256i, bb);
            for i in 0..8 {
                ab[2 * i] = oa[i] as u8;
                ab[2 * i + 1] = ob[i] as u8;
            }
        }
    }
}

impl TripletQuantizer {
    fn norm_bits(&self) -> u8 {
        self.norm.centroids.len().trailing_zeros() as u8
    }
}

/// The `octopus` codec: a split, an encoder search, the shared options and
/// the codebooks (direction, and triplet norm per prepared head_dim).
#[derive(Debug, Clone)]
pub struct Octopus {
    /// Bit split.
    pub split: Split,
    /// Encoder search.
    pub rounding: Rounding,
    /// QJL, value coding and seed.
    pub options: Options,
    dir: Arc<DirTables>,
    norms: Vec<Arc<NormTables>>,
}

impl Octopus {
    /// A codec with trained direction codebook and no norm codebooks yet
    /// (see [`Octopus::with_head_dims`]; compression calls
    /// [`Codec::prepare`], which adds those of the cache).
    ///
    /// # Panics
    /// If a split component is outside 1..=[`MAX_BITS`].
    pub fn new(split: Split, rounding: Rounding, options: Options) -> Octopus {
        assert!((1..=MAX_BITS).contains(&split.dir) && (1..=MAX_BITS).contains(&split.norm));
        Octopus {
            split,
            rounding,
            options,
            dir: Arc::new(DirTables::trained(split.dir)),
            norms: Vec::new(),
        }
    }

    /// This codec with trained norm codebooks for every head_dim in `dims`
    /// (powers of two in 8..=4096) added.
    ///
    /// # Errors
    /// [`Error::Parameter`] for an unsupported head_dim.
    pub fn with_head_dims(&self, dims: &[u32]) -> Result<Octopus> {
        let mut c = self.clone();
        for &d in dims {
            sphere::check_dim_key(d, None)?;
            if c.norms.iter().all(|n| n.dim != d) {
                c.norms
                    .push(Arc::new(NormTables::trained(d, self.split.norm)));
            }
        }
        c.norms.sort_by_key(|n| n.dim);
        Ok(c)
    }

    /// The same codec with another encoder search.
    pub fn with_rounding(&self, rounding: Rounding) -> Octopus {
        Octopus {
            rounding,
            ..self.clone()
        }
    }

    /// The direction codebook.
    pub fn dir_tables(&self) -> &DirTables {
        &self.dir
    }

    /// The unit quantizer for head_dim `d`, when its norm codebook is
    /// present.
    pub fn quantizer(&self, d: u32) -> Option<TripletQuantizer> {
        self.norms
            .iter()
            .find(|n| n.dim == d)
            .map(|n| TripletQuantizer::new(self.dir.clone(), n.clone(), self.rounding))
    }

    fn quantizer_for(&self, t: &TensorInfo) -> Result<TripletQuantizer> {
        self.quantizer(t.head_dim)
            .ok_or_else(|| sphere::no_codebook(&self.name(), "triplet-norm codebook", t))
    }

    /// Compressed-domain scores `q . k_t` for every token of `plane` of a
    /// K page, with the QJL correction when the file has it (paper Eq. 13,
    /// C.15). See [`sphere::unit_scores`].
    ///
    /// # Errors
    /// As [`sphere::unit_scores`]; [`Error::Parameter`] without a codebook
    /// for the head_dim.
    pub fn scores(
        &self,
        page: &PageView<'_>,
        t: &TensorInfo,
        plane: usize,
        q: &[f32],
    ) -> Result<Vec<f32>> {
        let uq = self.quantizer_for(t)?;
        sphere::unit_scores(&uq, &self.options, page, t, plane, q)
    }

    fn nominal(&self) -> u8 {
        self.split.nominal().unwrap_or(self.split.norm + 1)
    }
}

fn parse(s: &str) -> Option<Result<Box<dyn Codec>>> {
    let p = match sphere::parse_name("octopus", s)? {
        Ok(p) => p,
        Err(e) => return Some(Err(e)),
    };
    Some(parse_parsed(s, p))
}

fn parse_parsed(s: &str, p: sphere::ParsedName) -> Result<Box<dyn Codec>> {
    let bad_bits = || {
        Error::param(format!(
            "{s:?}: OCTOPUS takes b2..b5 (split (b+1, b-1)) or d{{dir}}n{{norm}} with both in 1..={MAX_BITS}, e.g. octopus:b3"
        ))
    };
    let split = if let Some(b) = p.bits.strip_prefix('b') {
        match b.parse::<u8>() {
            Ok(b) if (2..=5).contains(&b) => Split::for_bits(b),
            _ => return Err(bad_bits()),
        }
    } else if let Some((d, n)) = p.bits.strip_prefix('d').and_then(|r| r.split_once('n')) {
        match (d.parse::<u8>(), n.parse::<u8>()) {
            (Ok(d), Ok(n)) if (1..=MAX_BITS).contains(&d) && (1..=MAX_BITS).contains(&n) => {
                Split { dir: d, norm: n }
            }
            _ => return Err(bad_bits()),
        }
    } else {
        return Err(bad_bits());
    };
    let mut rounding = Rounding::Local;
    for opt in &p.rest {
        rounding = match opt.as_str() {
            "full" => Rounding::Full,
            "scalar" => Rounding::Scalar,
            "local" => Rounding::Local,
            _ => {
                return Err(Error::param(format!(
                    "{s:?}: unknown OCTOPUS option {opt:?} (+qjl, :vg{{g}}, :full, :scalar, :seed{{n}})"
                )));
            }
        };
    }
    let nominal = split.nominal().unwrap_or(split.norm + 1);
    let options = sphere::options_from(&p, nominal);
    Ok(Box::new(Octopus::new(split, rounding, options)))
}

impl Octopus {
    /// Rebuilds the codec from its parameter block (layout in
    /// format/codecs/octopus.md), e.g. to call [`Octopus::scores`] on a file's pages.
    ///
    /// # Errors
    /// [`Error::Parameter`] for an invalid block.
    pub fn from_params(p: &[u8]) -> Result<Octopus> {
        let (dir, norm, enc, options, tail) = sphere::read_header(p)?;
        let rounding = Rounding::from_code(enc)
            .ok_or_else(|| Error::param(format!("unknown OCTOPUS encoder code {enc}")))?;
        if !(1..=MAX_BITS).contains(&dir) || !(1..=MAX_BITS).contains(&norm) {
            return Err(Error::param(format!(
                "OCTOPUS split ({dir}, {norm}) outside 1..={MAX_BITS}"
            )));
        }
        let mut at = 0;
        let dc = sphere::read_f32s(tail, &mut at, 1 << dir)?;
        sphere::check_codebook("direction", &dc, -1.0, 1.0)?;
        let n = sphere::read_u32(tail, &mut at)? as usize;
        let mut norms = Vec::new();
        let mut prev = None;
        for _ in 0..n {
            let d = sphere::read_u32(tail, &mut at)?;
            sphere::check_dim_key(d, prev)?;
            prev = Some(d);
            let c = sphere::read_f32s(tail, &mut at, 1 << norm)?;
            sphere::check_codebook("triplet-norm", &c, 0.0, 1.0)?;
            norms.push(Arc::new(NormTables::new(d, c)));
        }
        if at != tail.len() {
            return Err(Error::param(format!(
                "{} bytes after the OCTOPUS codebooks",
                tail.len() - at
            )));
        }
        Ok(Octopus {
            split: Split { dir, norm },
            rounding,
            options,
            dir: Arc::new(DirTables::new(dir, dc)),
            norms,
        })
    }
}

impl Octopus {
    /// The triplet-norm centroids for head_dim `d`, if the codec has them.
    pub fn norm_codebook(&self, d: u32) -> Option<&[f32]> {
        self.norms
            .iter()
            .find(|n| n.dim == d)
            .map(|n| n.centroids.as_slice())
    }
}

impl Codec for Octopus {
    fn size_depends_only_on_shape(&self) -> bool {
        true
    }

    fn name(&self) -> String {
        let mut n = match self.split.nominal() {
            Some(b) => format!("octopus:b{b}"),
            None => format!("octopus:d{}n{}", self.split.dir, self.split.norm),
        };
        if self.options.qjl {
            n.push_str("+qjl");
        }
        n.push_str(&sphere::options_suffix(&self.options, self.nominal()));
        match self.rounding {
            Rounding::Local => {}
            Rounding::Full => n.push_str(":full"),
            Rounding::Scalar => n.push_str(":scalar"),
        }
        n
    }

    fn id(&self) -> u16 {
        ID
    }

    fn params(&self) -> Vec<u8> {
        let mut p = sphere::write_header(
            self.split.dir,
            self.split.norm,
            self.rounding.code(),
            &self.options,
        );
        for c in &self.dir.centroids {
            p.extend_from_slice(&c.to_le_bytes());
        }
        sphere::write_dim_tables(&mut p, self.norms.iter().map(|n| (n.dim, &n.centroids[..])));
        p
    }

    fn check(&self, t: &TensorInfo) -> Result<()> {
        sphere::check_tensor("octopus", &self.options, t)
    }

    fn prepare(
        &self,
        cache: &crate::view::CacheView<'_>,
        _layout: &Layout,
    ) -> Result<Option<Box<dyn Codec>>> {
        let dims = sphere::coded_head_dims(&self.options, cache);
        Ok(Some(Box::new(self.with_head_dims(&dims)?)))
    }

    fn encode(&self, page: &PageIn<'_>) -> Result<Vec<Section>> {
        match self.options.values {
            Values::Groups { bits, group }
                if page.tensor.kind.role() == crate::cache::Role::Value =>
            {
                sphere::encode_group_page(bits, group, page)
            }
            _ => {
                let uq = self.quantizer_for(page.tensor)?;
                sphere::encode_unit_page(&uq, &self.options, page)
            }
        }
    }

    fn decode(&self, page: &PageView<'_>, out: &mut PageOut<'_>) -> Result<()> {
        match self.options.values {
            Values::Groups { bits, group }
                if out.tensor.kind.role() == crate::cache::Role::Value =>
            {
                sphere::decode_group_page(bits, group, page, out)
            }
            _ => {
                let uq = self.quantizer(out.tensor.head_dim).ok_or_else(|| {
                    page.error(format!(
                        "the OCTOPUS parameter block has no triplet-norm codebook for head_dim {}",
                        out.tensor.head_dim
                    ))
                })?;
                sphere::decode_unit_page(&uq, &self.options, page, out)
            }
        }
    }

    fn bits_per_element(&self, t: &TensorInfo) -> f64 {
        let n = u64::from(t.head_dim).div_ceil(3) as usize;
        let code = n * (2 * self.split.dir as usize + self.split.norm as usize);
        sphere::bits_per_element(&self.options, t, code)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::registry;
    use crate::format::CodecEntry;

    fn prepared(name: &str) -> Box<dyn Codec> {
        let c = registry::parse(name).unwrap();
        let mut cache = crate::KvCache::default();
        for (d, kind) in [
            (64u32, crate::cache::Kind::Key),
            (128, crate::cache::Kind::Value),
        ] {
            let info = TensorInfo {
                name: format!("t{d}"),
                layer: 0,
                kind,
                dtype: crate::cache::DType::F32,
                batch: 1,
                heads: 1,
                tokens: 1,
                head_dim: d,
            };
            let data = crate::cache::TensorData::F32(vec![0.0; d as usize]);
            cache
                .tensors
                .push(crate::cache::Tensor::new(info, data).unwrap());
        }
        c.prepare(&cache.view(), &Layout::default())
            .unwrap()
            .unwrap()
    }

    #[test]
    fn names_round_trip_through_params() {
        for n in [
            "octopus:b2",
            "octopus:b3",
            "octopus:b4",
            "octopus:b5",
            "octopus:b3+qjl",
            "octopus:b3:vg32",
            "octopus:b2+qjl:vg16b4:seed9",
            "octopus:b4:full",
            "octopus:b3:scalar",
            "octopus:d5n1",
            "octopus:d1n6:vg64b2",
        ] {
            let c = prepared(n);
            assert_eq!(c.name(), n);
            let back = registry::from_entry(
                0,
                &CodecEntry {
                    id: c.id(),
                    params: c.params(),
                },
            )
            .unwrap();
            assert_eq!(back.name(), n);
            assert_eq!(back.params(), c.params());
        }
        // Alternative spellings parse to the canonical name.
        assert_eq!(
            registry::parse("octopus:b3:vg32+qjl").unwrap().name(),
            "octopus:b3+qjl:vg32"
        );
        assert_eq!(
            registry::parse("octopus:d4n2:local").unwrap().name(),
            "octopus:b3"
        );
        assert_eq!(
            registry::parse("octopus:b3:vg32b3:seed0").unwrap().name(),
            "octopus:b3:vg32"
        );
    }

    #[test]
    fn bad_names_are_rejected() {
        for n in [
            "octopus",
            "octopus:",
            "octopus:b1",
            "octopus:b6",
            "octopus:d7n1",
            "octopus:d0n3",
            "octopus:b3:vg1",
            "octopus:b3:vg32b9",
            "octopus:b3:fast",
            "octopus:b3+qjl+qjl",
            "octopus:b3:seedx",
        ] {
            assert!(registry::parse(n).is_err(), "{n}");
        }
    }

    #[test]
    fn corrupt_parameter_blocks_are_rejected() {
        let good = prepared("octopus:b3+qjl").params();
        assert!(Octopus::from_params(&good).is_ok());
        let mut bad = Vec::new();
        // Flags, reserved byte, rounding code, split.
        for (at, v) in [(2usize, 2u8), (5, 1), (3, 3), (0, 7), (1, 0)] {
            let mut p = good.clone();
            p[at] = v;
            bad.push(p);
        }
        // Value-group fields inconsistent.
        let mut p = good.clone();
        p[4] = 3;
        bad.push(p);
        // Direction codebook not ascending.
        let mut p = good.clone();
        p[16..20].copy_from_slice(&0.9f32.to_le_bytes());
        bad.push(p);
        // Norm codebook outside [0, 1].
        let mut p = good.clone();
        let at = 16 + 4 * 16 + 4 + 4;
        p[at..at + 4].copy_from_slice(&(-0.5f32).to_le_bytes());
        bad.push(p);
        // head_dim key not a power of two.
        let mut p = good.clone();
        let at = 16 + 4 * 16 + 4;
        p[at..at + 4].copy_from_slice(&96u32.to_le_bytes());
        bad.push(p);
        // Truncated and extended.
        bad.push(good[..good.len() - 1].to_vec());
        bad.push([good.clone(), vec![0]].concat());
        bad.push(good[..10].to_vec());
        for (i, p) in bad.iter().enumerate() {
            assert!(Octopus::from_params(p).is_err(), "case {i}");
        }
    }

    #[test]
    fn bits_per_element_follow_the_split() {
        let c = prepared("octopus:b3+qjl:vg32");
        let t = |d: u32, kind| TensorInfo {
            name: String::new(),
            layer: 0,
            kind,
            dtype: crate::cache::DType::Bf16,
            batch: 1,
            heads: 1,
            tokens: 1,
            head_dim: d,
        };
        use crate::cache::Kind::{Key, Value};
        // 43 triplets x (2*4 + 2) bits + 32-bit norm + 128 sign bits + fp16.
        let k128 = (32.0 + 430.0 + 128.0 + 16.0) / 128.0;
        assert!((c.bits_per_element(&t(128, Key)) - k128).abs() < 1e-12);
        assert!((c.bits_per_element(&t(128, Value)) - (3.0 + 1.0)).abs() < 1e-12);
        let plain = prepared("octopus:b2");
        assert!(
            (plain.bits_per_element(&t(256, Value)) - (32.0 + 86.0 * 7.0) / 256.0).abs() < 1e-12
        );
    }

    /// Joint rounding minimizes the triplet loss of Eq. 11 over its
    /// candidates: full <= local <= scalar on every triplet.
    #[test]
    fn joint_rounding_never_loses_to_scalar() {
        let base = Octopus::new(Split::for_bits(2), Rounding::Local, Options::default())
            .with_head_dims(&[128])
            .unwrap();
        let q = |r| base.with_rounding(r).quantizer(128).unwrap();
        let (s, l, f) = (q(Rounding::Scalar), q(Rounding::Local), q(Rounding::Full));
        let loss = |q: &TripletQuantizer, t: [f32; 3]| {
            let (a, b, c) = q.quantize_triplet(t);
            let n = q.dir.dir(a as usize, b as usize);
            let rho = q.norm.centroids[c as usize];
            (0..3).map(|k| (t[k] - rho * n[k]).powi(2)).sum::<f32>()
        };
        let mut state = crate::kernels::rng::SplitMix64::new(12345);
        let (mut ls, mut ll) = (0f64, 0f64);
        for _ in 0..5000 {
            let mut t = [0f32; 3];
            for v in t.iter_mut() {
                *v = (state.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 0.4 - 0.2;
            }
            let (a, b, c) = (loss(&s, t), loss(&l, t), loss(&f, t));
            assert!(c <= b + 1e-7 && b <= a + 1e-7, "{t:?}: {a} {b} {c}");
            ls += f64::from(a);
            ll += f64::from(b);
        }
        assert!(ll < 0.97 * ls, "local {ll} vs scalar {ls}");
    }
}

#[cfg(test)]
mod batch_tests {
    use super::*;

    /// The batched row quantizer (AVX2 local search where available) gives
    /// the codes of the per-triplet scalar one.
    #[test]
    fn row_quantizer_equals_the_triplet_quantizer() {
        for (b, d, r) in [
            (2u8, 64u32, Rounding::Local),
            (3, 256, Rounding::Local),
            (4, 128, Rounding::Scalar),
            (3, 8, Rounding::Full),
            (5, 128, Rounding::Local),
            (4, 16, Rounding::Local),
        ] {
            let q = Octopus::new(Split::for_bits(b), r, Options::default())
                .with_head_dims(&[d])
                .unwrap()
                .quantizer(d)
                .unwrap();
            let d = d as usize;
            let n = q.triplets();
            let mut state = crate::kernels::rng::SplitMix64::new(u64::from(b) * 77 + d as u64);
            for _ in 0..50 {
                let mut u: Vec<f32> = (0..d)
                    .map(|_| (state.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
                    .collect();
                let norm = crate::kernels::l2_norm(&u);
                u.iter_mut().for_each(|x| *x /= norm);
                let (mut dir, mut nrm) = (vec![0u8; 2 * n], vec![0u8; n]);
                q.quantize(&u, &mut [&mut dir, &mut nrm]);
                for i in 0..n {
                    let at = |k: usize| u.get(3 * i + k).copied().unwrap_or(0.0);
                    let want = q.quantize_triplet([at(0), at(1), at(2)]);
                    assert_eq!(
                        (dir[2 * i], dir[2 * i + 1], nrm[i]),
                        want,
                        "b={b} d={d} i={i}"
                    );
                }
            }
        }
    }
}
