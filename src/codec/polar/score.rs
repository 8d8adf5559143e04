//! PolarQuant key pages as a read-only view, with the lookup-table score
//! kernel of the paper's section 3.3 and a plain dequantize-then-dot
//! reference.
//!
//! A quantized key pair is `(rho * s_j) * u_a` with `u_a` one of `M = 2^m`
//! directions. For a query `q` (same head_dim, same pairing), the inner
//! product with a key is
//!
//! ```text
//! q . k = sum_j (q_xj, q_yj) . (rho_j s_j u_{a_j}) = sum_j T_j[a_j] * rho_j
//! T_j[k] = s_j * (q_xj * cos_k + q_yj * sin_k)          (M entries per pair)
//! ```
//!
//! so scoring every cached token needs one table of `head_dim/2 * M` floats
//! per query and plane, then one lookup and one multiply-add per pair and
//! token instead of dequantizing `head_dim` values and a dot product.
//!
//! [`PolarKeys::scores`] is that kernel; [`PolarKeys::scores_dequant`]
//! dequantizes each key (exactly as the decoder does) and takes the dot
//! product, as the baseline it is measured against (tests/benches/polar.rs).
//! Both sum in f32 in a fixed order; they agree with the f64 dot product of
//! the query and the decoded keys up to f32 rounding (tests/polar.rs).

use std::borrow::Cow;

use crate::cache::TensorInfo;
use crate::error::Result;
use crate::format::PageView;
use crate::kernels::bitpack;

use super::{Pairing, Polar, f32_at, key_sections};

/// Lanes of the f32 accumulators (pairs `j` with the same `j % LANES` share
/// an accumulator; lanes are summed as a balanced tree at the end).
const LANES: usize = 8;

/// A validated PolarQuant key page: radius scales and pair codes of every
/// plane and token.
#[derive(Debug, Clone)]
pub struct PolarKeys<'a> {
    m: u32,
    pairing: Pairing,
    dirs: &'a [[f32; 2]],
    planes: usize,
    tokens: usize,
    head_dim: usize,
    /// `s_j` per plane and pair, `[planes, head_dim/2]`.
    scales: Vec<f32>,
    /// Pair codes `a | rho << m`, `[planes * tokens, head_dim/2]`: the page's
    /// INDEX bytes when codes are exactly 8 bits, else unpacked (one byte per
    /// code up to 8 bits, two above).
    codes: Codes<'a>,
}

#[derive(Debug, Clone)]
enum Codes<'a> {
    Bytes(Cow<'a, [u8]>),
    Wide(Vec<u16>),
}

impl<'a> PolarKeys<'a> {
    /// Reads a key page of `tensor` encoded by `codec`: all
    /// `tensor.planes()` planes, the page's tokens. `codec` is the page's
    /// codec, e.g. `Polar::from_params` of its codec table entry.
    ///
    /// # Errors
    /// [`crate::Error::Format`] naming the page when a section is missing or
    /// has the wrong type or size.
    pub fn new(
        codec: &'a Polar,
        page: &'a PageView<'_>,
        tensor: &TensorInfo,
    ) -> Result<PolarKeys<'a>> {
        let head_dim = tensor.head_dim as usize;
        let planes = tensor.planes();
        let tokens = page.header.meta.tokens as usize;
        let (scales, index) =
            key_sections(codec.code_bits() as u8, page, planes, tokens, head_dim)?;
        let pairs = head_dim / 2;
        let bits = codec.code_bits();
        let n = planes * tokens * pairs;
        let codes = if bits == 8 {
            Codes::Bytes(Cow::Borrowed(index))
        } else if bits < 8 {
            let mut b = vec![0u8; n];
            bitpack::unpack_u8(index, bits, &mut b);
            Codes::Bytes(Cow::Owned(b))
        } else {
            let mut wide = vec![0u32; n];
            bitpack::unpack_u32(index, bits, &mut wide);
            Codes::Wide(wide.into_iter().map(|c| c as u16).collect())
        };
        Ok(PolarKeys {
            m: u32::from(codec.angle_bits),
            pairing: codec.pairing,
            dirs: codec.directions(),
            planes,
            tokens,
            head_dim,
            scales: (0..planes * pairs).map(|i| f32_at(scales, i)).collect(),
            codes,
        })
    }

    /// Planes (`batch * kv_heads`).
    pub fn planes(&self) -> usize {
        self.planes
    }

    /// Tokens per plane.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    fn pairs(&self) -> usize {
        self.head_dim / 2
    }

    /// Code of pair `j` of row `r`.
    #[inline(always)]
    fn code(&self, r: usize, j: usize) -> u32 {
        let i = r * self.pairs() + j;
        match &self.codes {
            Codes::Bytes(b) => u32::from(b[i]),
            Codes::Wide(w) => u32::from(w[i]),
        }
    }

    /// Dequantizes row `r` (plane `r / tokens`, token `r % tokens`) into
    /// `out` (`head_dim` values) with the normative arithmetic of
    /// format/codecs/polar.md: `t = f32(rho) * s_j; x = t * cos_a;
    /// y = t * sin_a`.
    ///
    /// # Panics
    /// If `r >= planes * tokens` or `out.len() != head_dim`.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.head_dim);
        let pairs = self.pairs();
        let mask = (1u32 << self.m) - 1;
        let sc = &self.scales[(r / self.tokens) * pairs..][..pairs];
        for (j, &s) in sc.iter().enumerate() {
            let c = self.code(r, j);
            let u = self.dirs[(c & mask) as usize];
            let t = (c >> self.m) as f32 * s;
            let (i1, i2) = self.pairing.channels(self.head_dim, j);
            out[i1] = t * u[0];
            out[i2] = t * u[1];
        }
    }

    /// The lookup table of query `q` for `plane`: `T[j * M + k] =
    /// s_j * ((q_xj * cos_k) + (q_yj * sin_k))`.
    ///
    /// # Panics
    /// If `q.len() != head_dim` or `plane >= planes`.
    pub fn table(&self, plane: usize, q: &[f32]) -> Vec<f32> {
        assert_eq!(q.len(), self.head_dim);
        let pairs = self.pairs();
        let mut t = Vec::with_capacity(pairs * self.dirs.len());
        for j in 0..pairs {
            let (i1, i2) = self.pairing.channels(self.head_dim, j);
            let s = self.scales[plane * pairs + j];
            t.extend(self.dirs.iter().map(|u| (q[i1] * u[0] + q[i2] * u[1]) * s));
        }
        t
    }

    /// Scores `out[t] = q . k_t` of every token of `plane` by table lookup
    /// (section 3.3): one table per call, then per token and pair one
    /// lookup `T_j[a]` times the radius level `rho`.
    ///
    /// # Panics
    /// If `q.len() != head_dim`, `out.len() != tokens` or `plane >= planes`.
    pub fn scores(&self, plane: usize, q: &[f32], out: &mut [f32]) {
        assert_eq!(out.len(), self.tokens);
        let table = self.table(plane, q);
        let pairs = self.pairs();
        let row0 = plane * self.tokens;
        match &self.codes {
            Codes::Bytes(b) => {
                let b = &b[row0 * pairs..(row0 + self.tokens) * pairs];
                score_rows_u8(&table, b, pairs, self.m, out);
            }
            Codes::Wide(w) => {
                let w = &w[row0 * pairs..(row0 + self.tokens) * pairs];
                score_rows_scalar(&table, w, pairs, self.m, out);
            }
        }
    }

    /// [`PolarKeys::scores`] on the portable scalar path (the reference the
    /// AVX2 path must equal bit for bit).
    ///
    /// # Panics
    /// As [`PolarKeys::scores`].
    pub fn scores_reference(&self, plane: usize, q: &[f32], out: &mut [f32]) {
        assert_eq!(out.len(), self.tokens);
        let table = self.table(plane, q);
        let pairs = self.pairs();
        let rows = plane * self.tokens * pairs..(plane + 1) * self.tokens * pairs;
        match &self.codes {
            Codes::Bytes(b) => score_rows_scalar(&table, &b[rows], pairs, self.m, out),
            Codes::Wide(w) => score_rows_scalar(&table, &w[rows], pairs, self.m, out),
        }
    }

    /// The baseline: dequantize each key of `plane` (as
    /// [`PolarKeys::dequantize_row`]) and take its dot product with `q`
    /// (f32, `LANES` accumulators over channels).
    ///
    /// # Panics
    /// As [`PolarKeys::scores`].
    pub fn scores_dequant(&self, plane: usize, q: &[f32], out: &mut [f32]) {
        assert_eq!(out.len(), self.tokens);
        assert_eq!(q.len(), self.head_dim);
        let mut k = vec![0f32; self.head_dim];
        for (t, o) in out.iter_mut().enumerate() {
            self.dequantize_row(plane * self.tokens + t, &mut k);
            *o = dot(q, &k);
        }
    }
}

/// Balanced-tree sum of the lane accumulators.
#[inline(always)]
fn hsum(a: [f32; LANES]) -> f32 {
    ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))
}

/// f32 dot product with [`LANES`] accumulators (channel `i` into lane
/// `i % LANES`).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, ra) = a.as_chunks::<LANES>();
    let (cb, rb) = b.as_chunks::<LANES>();
    for (x, y) in ca.iter().zip(cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    for (l, (x, y)) in ra.iter().zip(rb).enumerate() {
        acc[l] += x * y;
    }
    hsum(acc)
}

/// Lookup scores of `out.len()` rows of `pairs` one-byte codes each, on
/// the AVX2 path when available (bit-identical to [`score_rows_scalar`]).
fn score_rows_u8(table: &[f32], codes: &[u8], pairs: usize, m: u32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if pairs.is_multiple_of(LANES) && crate::kernels::simd_available() {
        // SAFETY: AVX2 availability checked; pairs is a multiple of 8.
        unsafe { avx2::score_rows_u8(table, codes, pairs, m, out) };
        return;
    }
    score_rows_scalar(table, codes, pairs, m, out);
}

/// Portable reference of the lookup kernel: for each row of `pairs` codes
/// `c = a | rho << m`, `sum_j table[j * 2^m + a] * f32(rho)` with pair `j`
/// accumulated into lane `j % 8` (in increasing `j`), lanes summed as
/// `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`.
///
/// # Panics
/// If `codes` holds fewer than `out.len() * pairs` codes or a code indexes
/// past `table`.
pub fn score_rows_scalar<C: Copy + Into<u32>>(
    table: &[f32],
    codes: &[C],
    pairs: usize,
    m: u32,
    out: &mut [f32],
) {
    let big_m = 1usize << m;
    let mask = (1u32 << m) - 1;
    for (o, row) in out.iter_mut().zip(codes.chunks_exact(pairs)) {
        let mut acc = [0f32; LANES];
        for (j, &c) in row.iter().enumerate() {
            let c: u32 = c.into();
            acc[j % LANES] += table[j * big_m + (c & mask) as usize] * (c >> m) as f32;
        }
        *o = hsum(acc);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{LANES, hsum};

    /// AVX2 version of [`super::score_rows_scalar`] for one-byte codes:
    /// eight pairs per step, table entries fetched by a gather; the same
    /// products and additions in the same order, so bit-identical.
    ///
    /// # Safety
    /// AVX2 must be available; `pairs` must be a multiple of 8.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn score_rows_u8(
        table: &[f32],
        codes: &[u8],
        pairs: usize,
        m: u32,
        out: &mut [f32],
    ) {
        assert!(pairs.is_multiple_of(LANES));
        assert!(codes.len() >= out.len() * pairs);
        let big_m = 1i32 << m;
        assert!(table.len() >= pairs * big_m as usize);
        let mask = _mm256_set1_epi32(big_m - 1);
        let shift = _mm_cvtsi32_si128(m as i32);
        let lane_base = _mm256_mullo_epi32(
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            _mm256_set1_epi32(big_m),
        );
        let step = _mm256_set1_epi32(big_m * LANES as i32);
        for (t, o) in out.iter_mut().enumerate() {
            let row = &codes[t * pairs..(t + 1) * pairs];
            let mut acc = _mm256_setzero_ps();
            let mut base = lane_base;
            for j in (0..pairs).step_by(LANES) {
                // SAFETY: j + 8 <= pairs = row.len(); the gather indices are
                // (j + l) * M + a with a < M, below pairs * M <= table.len().
                unsafe {
                    let c8 = (row.as_ptr().add(j) as *const i64).read_unaligned();
                    let c = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(c8));
                    let a = _mm256_and_si256(c, mask);
                    let rho = _mm256_cvtepi32_ps(_mm256_srl_epi32(c, shift));
                    let v = _mm256_i32gather_ps::<4>(table.as_ptr(), _mm256_add_epi32(base, a));
                    acc = _mm256_add_ps(acc, _mm256_mul_ps(v, rho));
                }
                base = _mm256_add_epi32(base, step);
            }
            let mut lanes = [0f32; LANES];
            // SAFETY: 8-float store into an 8-float array.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
            *o = hsum(lanes);
        }
    }
}
