//! `polar:m{m}n{n}`: PolarQuant (Wu et al., "PolarQuant: Leveraging Polar
//! Transformation for Efficient Key Cache Quantization and Decoding
//! Acceleration", arXiv:2502.00527, section 3; format/codecs/polar.md).
//!
//! Post-RoPE keys are cut into 2-D sub-vectors along the RoPE pairing, each
//! pair `(x, y)` becomes a radius and an angle (section 3.2):
//!
//! * pairing `half` (default): channel `j` with `j + head_dim/2`, the HF
//!   `rotate_half` layout; `adjacent`: channels `2j, 2j+1` (interleaved
//!   RoPE). The choice is recorded in the parameter block.
//! * radius: `n` bits, `Q(r) = rne(r / s_j)` with one scale per plane and
//!   pair-channel `s_j = max_t r_{t,j} / (2^n - 1)` over the page's tokens;
//!   no zero point (radii are non-negative).
//! * angle: `m` bits uniform on `[0, 2 pi)`: the index of the nearest of the
//!   `2^m` directions `2 pi k / 2^m`, stored in the parameter block as f32
//!   `(cos, sin)` pairs and found by comparing dot products, not by `atan2`
//!   ([`crate::kernels::polar`]).
//! * values: token-wise INT-b (`int{b}` pages, default b = 4) or raw.
//!
//! A key decodes to `x = (rho * s_j) * cos_a`, `y = (rho * s_j) * sin_a`.
//! Section 3.3's lookup decoding is [`score::PolarKeys`]: for a query `q`,
//! one table per pair-channel of `q` projected on the `2^m` directions
//! (times `s_j`), so `q . k = sum_j T_j[a_j] * rho_j`.
//!
//! Key pages: SCALE stream 0 (f32, `planes * head_dim/2`, plane then pair),
//! INDEX stream 0 (`m + n`-bit codes `a | rho << m`, one per row and pair,
//! row-major). Value pages: exactly the `int{b}` or `raw` sections.

pub mod score;

use std::sync::Arc;

use crate::cache::{Role, TensorInfo};
use crate::error::{Error, Result};
use crate::format::{ElemType, PageView, Section, SectionKind};
use crate::kernels::bitpack;
use crate::kernels::polar::{MAX_ANGLE_BITS, NearestDirection, radius, uniform_directions};

use super::affine::Affine;
use super::raw::Raw;
use super::{
    Codec, Example, Family, PageIn, PageOut, expect_section, expect_section_count, f32_at, pagebuf,
};

/// Codec id of `polar`.
pub const ID: u16 = 6;
/// Default recent window: the paper's 128-token full-precision residual
/// (section 4.1, Table 3 `s = 128`).
pub const DEFAULT_RESIDUAL: u32 = 128;
/// Default value bits (token-wise INT4).
pub const DEFAULT_VALUE_BITS: u8 = 4;
/// Bytes of the parameter block before the direction table.
const FIXED_PARAMS: usize = 8;

/// Which key channels form a 2-D sub-vector (the model's RoPE layout).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pairing {
    /// Pair `j` is channels `(j, j + head_dim/2)`: the HF `rotate_half`
    /// layout (Llama, Mistral, Gemma, Qwen in transformers).
    Half,
    /// Pair `j` is channels `(2j, 2j + 1)`: interleaved RoPE (the paper's
    /// Eq. 1 notation, GPT-J style).
    Adjacent,
}

impl Pairing {
    /// The two channels `(x, y)` of pair `j` in a head vector of `d`
    /// channels.
    #[inline]
    pub fn channels(self, d: usize, j: usize) -> (usize, usize) {
        match self {
            Pairing::Half => (j, j + d / 2),
            Pairing::Adjacent => (2 * j, 2 * j + 1),
        }
    }
}

/// How value pages are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Values {
    /// At source precision (`raw` sections).
    Raw,
    /// Token-wise asymmetric INT-b (`int{b}` sections), b in 1..=8.
    Int(u8),
}

/// The PolarQuant codec.
#[derive(Debug, Clone)]
pub struct Polar {
    /// Angle bits `m`, 1..=8.
    pub angle_bits: u8,
    /// Radius bits `n`, 1..=8.
    pub radius_bits: u8,
    /// RoPE pairing of key channels.
    pub pairing: Pairing,
    /// Value storage.
    pub values: Values,
    dirs: Arc<NearestDirection>,
}

/// Registry entry of `polar`.
pub const FAMILY: Family = Family {
    id: ID,
    name: "polar",
    syntax: "polar:m{m}n{n}[:half|:adjacent][:v{b}|:vraw] e.g. polar:m4n4, polar:m4n2",
    summary: "PolarQuant: RoPE key pairs as n-bit radius + m-bit angle; values INT4; 128 recent raw",
    parse,
    from_params: |p| Ok(Box::new(Polar::from_params(p)?)),
    examples: &[
        Example {
            name: "polar:m4n4",
            min_snr_db: 11.0,
        },
        Example {
            name: "polar:m4n2",
            min_snr_db: 9.0,
        },
        Example {
            name: "polar:m4n2:adjacent:vraw",
            min_snr_db: 9.0,
        },
    ],
};

fn parse(s: &str) -> Option<Result<Box<dyn Codec>>> {
    let rest = s.strip_prefix("polar")?;
    let bad = || {
        Some(Err(Error::param(format!(
            "{s:?}: PolarQuant takes polar:m{{1..8}}n{{1..8}}[:half|:adjacent][:v{{1..8}}|:vraw], \
             e.g. polar:m4n4"
        ))))
    };
    let mut parts = rest.split(':');
    if parts.next() != Some("") {
        return bad();
    }
    let Some((m, n)) = parts
        .next()
        .and_then(|mn| mn.strip_prefix('m'))
        .and_then(|mn| mn.split_once('n'))
    else {
        return bad();
    };
    let (Ok(m), Ok(n)) = (m.parse::<u8>(), n.parse::<u8>()) else {
        return bad();
    };
    if !(1..=MAX_ANGLE_BITS as u8).contains(&m) || !(1..=8).contains(&n) {
        return bad();
    }
    let (mut pairing, mut values) = (Pairing::Half, Values::Int(DEFAULT_VALUE_BITS));
    for opt in parts {
        match opt {
            "half" => pairing = Pairing::Half,
            "adjacent" => pairing = Pairing::Adjacent,
            "vraw" => values = Values::Raw,
            _ => match opt.strip_prefix('v').and_then(|b| b.parse::<u8>().ok()) {
                Some(b) if (1..=8).contains(&b) => values = Values::Int(b),
                _ => return bad(),
            },
        }
    }
    Some(Ok(Box::new(Polar::new(m, n, pairing, values))))
}

impl Polar {
    /// A PolarQuant codec with the canonical uniform direction table.
    ///
    /// # Panics
    /// If `m` or `n` is outside 1..=8 or value bits outside 1..=8.
    pub fn new(m: u8, n: u8, pairing: Pairing, values: Values) -> Polar {
        assert!((1..=8).contains(&m) && (1..=8).contains(&n));
        assert!(matches!(values, Values::Raw | Values::Int(1..=8)));
        Polar {
            angle_bits: m,
            radius_bits: n,
            pairing,
            values,
            dirs: Arc::new(NearestDirection::new(uniform_directions(u32::from(m)))),
        }
    }

    /// Rebuilds the codec from its parameter block (format/codecs/polar.md).
    ///
    /// # Errors
    /// [`Error::Parameter`] for out-of-range fields, a wrong length, set
    /// reserved bytes or a non-finite direction.
    pub fn from_params(p: &[u8]) -> Result<Polar> {
        let err = |m: String| Error::param(format!("polar parameters: {m}"));
        if p.len() < FIXED_PARAMS {
            return Err(err(format!(
                "{} bytes, need at least {FIXED_PARAMS}",
                p.len()
            )));
        }
        let (m, n, pairing, values) = (p[0], p[1], p[2], p[3]);
        if !(1..=MAX_ANGLE_BITS as u8).contains(&m)
            || !(1..=8).contains(&n)
            || pairing > 1
            || values > 8
            || p[4..8] != [0; 4]
        {
            return Err(err(format!(
                "out of range: m {m}, n {n}, pairing {pairing}, values {values}, reserved {:02x?}",
                &p[4..8]
            )));
        }
        let count = 1usize << m;
        if p.len() != FIXED_PARAMS + 8 * count {
            return Err(err(format!(
                "{} bytes, m = {m} needs {}",
                p.len(),
                FIXED_PARAMS + 8 * count
            )));
        }
        let table = &p[FIXED_PARAMS..];
        let dirs: Vec<[f32; 2]> = (0..count)
            .map(|k| [f32_at(table, 2 * k), f32_at(table, 2 * k + 1)])
            .collect();
        if let Some(k) = dirs
            .iter()
            .position(|u| !(u[0].is_finite() && u[1].is_finite()))
        {
            return Err(err(format!("direction {k} is not finite")));
        }
        Ok(Polar {
            angle_bits: m,
            radius_bits: n,
            pairing: if pairing == 0 {
                Pairing::Half
            } else {
                Pairing::Adjacent
            },
            values: if values == 0 {
                Values::Raw
            } else {
                Values::Int(values)
            },
            dirs: Arc::new(NearestDirection::new(dirs)),
        })
    }

    /// The `2^m` direction table `(cos, sin)` used by this codec.
    pub fn directions(&self) -> &[[f32; 2]] {
        self.dirs.directions()
    }

    /// Bits of one pair code: `m + n`.
    pub fn code_bits(&self) -> u32 {
        u32::from(self.angle_bits) + u32::from(self.radius_bits)
    }

    fn value_codec(&self) -> Box<dyn Codec> {
        match self.values {
            Values::Raw => Box::new(Raw),
            Values::Int(bits) => Box::new(Affine {
                bits,
                block: None,
                keys_only: false,
            }),
        }
    }

    fn encode_keys(&self, page: &PageIn<'_>) -> Result<Vec<Section>> {
        let d = page.head_dim();
        let pairs = d / 2;
        let (planes, tokens) = (page.planes.len(), page.tokens as usize);
        let buf = pagebuf::load(page);
        let levels = (1u32 << self.radius_bits) - 1;
        // Radii, row-major [planes * tokens, pairs], and their maxima per
        // (plane, pair).
        let mut radii = vec![0f32; planes * tokens * pairs];
        let mut scales = vec![0f32; planes * pairs];
        for (r, row) in buf.chunks_exact(d).enumerate() {
            let p = r / tokens;
            for j in 0..pairs {
                let (i1, i2) = self.pairing.channels(d, j);
                let (x, y) = (row[i1], row[i2]);
                if !(x.is_finite() && y.is_finite()) {
                    let e = Error::param("non-finite value (NaN or inf) in a key to quantize");
                    return Err(pagebuf::at(page, r * d + i1, e));
                }
                let rad = radius(x, y);
                radii[r * pairs + j] = rad;
                let s = &mut scales[p * pairs + j];
                *s = s.max(rad);
            }
        }
        for s in &mut scales {
            *s /= levels as f32;
        }
        let m = u32::from(self.angle_bits);
        let mut codes = vec![0u32; planes * tokens * pairs];
        for (r, row) in buf.chunks_exact(d).enumerate() {
            let p = r / tokens;
            for j in 0..pairs {
                let (i1, i2) = self.pairing.channels(d, j);
                let a = self.dirs.find(row[i1], row[i2]);
                let s = scales[p * pairs + j];
                let rho = if s > 0.0 {
                    let t = (radii[r * pairs + j] / s).clamp(0.0, levels as f32);
                    ((t + 12_582_912.0) - 12_582_912.0) as u32
                } else {
                    0
                };
                codes[r * pairs + j] = a | rho << m;
            }
        }
        let bits = self.code_bits();
        let mut index = vec![0u8; bitpack::packed_len(codes.len(), bits)];
        bitpack::pack_u32(&codes, bits, &mut index);
        Ok(vec![
            Section::f32s(SectionKind::Scale, 0, &scales),
            Section::packed(
                SectionKind::Index,
                0,
                bits as u8,
                pagebuf::count(codes.len())?,
                index,
            ),
        ])
    }

    fn decode_keys(&self, page: &PageView<'_>, out: &mut PageOut<'_>) -> Result<()> {
        let keys = score::PolarKeys::new(self, page, out.tensor)?;
        let d = out.tensor.head_dim as usize;
        let mut row = vec![0f32; d];
        for r in 0..out.rows() {
            keys.dequantize_row(r, &mut row);
            out.store_row(r, &row);
        }
        Ok(())
    }
}

impl Codec for Polar {
    fn size_depends_only_on_shape(&self) -> bool {
        true
    }

    fn name(&self) -> String {
        let mut s = format!("polar:m{}n{}", self.angle_bits, self.radius_bits);
        if self.pairing == Pairing::Adjacent {
            s.push_str(":adjacent");
        }
        match self.values {
            Values::Raw => s.push_str(":vraw"),
            Values::Int(DEFAULT_VALUE_BITS) => {}
            Values::Int(b) => s.push_str(&format!(":v{b}")),
        }
        s
    }

    fn id(&self) -> u16 {
        ID
    }

    fn params(&self) -> Vec<u8> {
        let mut p = vec![
            self.angle_bits,
            self.radius_bits,
            u8::from(self.pairing == Pairing::Adjacent),
            match self.values {
                Values::Raw => 0,
                Values::Int(b) => b,
            },
            0,
            0,
            0,
            0,
        ];
        for u in self.directions() {
            p.extend(u[0].to_le_bytes());
            p.extend(u[1].to_le_bytes());
        }
        p
    }

    fn check(&self, t: &TensorInfo) -> Result<()> {
        match t.kind.role() {
            Role::Key if !t.head_dim.is_multiple_of(2) => Err(Error::param(format!(
                "{} pairs key channels, but {} ({}) has the odd head_dim {}",
                self.name(),
                t.name,
                t.describe(),
                t.head_dim
            ))),
            Role::Key => Ok(()),
            Role::Value => self.value_codec().check(t),
        }
    }

    fn default_windows(&self) -> (u32, u32) {
        (0, DEFAULT_RESIDUAL)
    }

    fn encode(&self, page: &PageIn<'_>) -> Result<Vec<Section>> {
        match page.tensor.kind.role() {
            Role::Key => self.encode_keys(page),
            Role::Value => self.value_codec().encode(page),
        }
    }

    fn decode(&self, page: &PageView<'_>, out: &mut PageOut<'_>) -> Result<()> {
        match out.tensor.kind.role() {
            Role::Key => self.decode_keys(page, out),
            Role::Value => self.value_codec().decode(page, out),
        }
    }

    /// Keys: `(m + n) / 2` bits per element for the codes; the per-page
    /// radius scales add `16 / page_tokens` (f32 per pair-channel and page),
    /// not included because they depend on the page size. Values: as
    /// `int{b}` (`b + 64/head_dim`) or the source precision.
    fn bits_per_element(&self, t: &TensorInfo) -> f64 {
        match t.kind.role() {
            Role::Key => f64::from(self.code_bits()) / 2.0,
            Role::Value => self.value_codec().bits_per_element(t),
        }
    }
}

/// The checked layout of a key page of `planes x tokens` rows of
/// `head_dim` channels with `code_bits` (`m + n`) bits per pair code:
/// exactly SCALE 0 (f32 per plane and pair channel) and INDEX 0 (one code
/// per pair), returned in that order. Decoding, scoring and the GPU
/// staging all read key pages through it.
///
/// # Errors
/// [`Error::Format`] naming the page for an odd head_dim or a missing,
/// mistyped or extra section.
pub(crate) fn key_sections<'p>(
    code_bits: u8,
    page: &'p PageView<'_>,
    planes: usize,
    tokens: usize,
    head_dim: usize,
) -> Result<(&'p [u8], &'p [u8])> {
    if !head_dim.is_multiple_of(2) {
        return Err(page.error(format!(
            "polar key page of a tensor with the odd head_dim {head_dim}"
        )));
    }
    let pairs = head_dim / 2;
    let scales = expect_section(page, SectionKind::Scale, 0, ElemType::F32, planes * pairs)?;
    let index = expect_section(
        page,
        SectionKind::Index,
        0,
        ElemType::Packed(code_bits),
        planes * tokens * pairs,
    )?;
    expect_section_count(page, 2)?;
    Ok((scales, index))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for n in [
            "polar:m4n4",
            "polar:m4n2",
            "polar:m3n5:adjacent",
            "polar:m4n4:vraw",
            "polar:m8n8:v2",
            "polar:m1n1:adjacent:v8",
        ] {
            let c = crate::codec::parse(n).unwrap();
            assert_eq!(c.name(), n);
            let back = Polar::from_params(&c.params()).unwrap();
            assert_eq!(back.name(), n);
            assert_eq!(back.params(), c.params());
        }
        assert_eq!(
            crate::codec::parse("polar:m4n4:half:v4").unwrap().name(),
            "polar:m4n4"
        );
        for n in [
            "polar",
            "polar:",
            "polar:m4",
            "polar:m0n4",
            "polar:m9n4",
            "polar:m4n9",
            "polar:m4n4:v0",
            "polar:m4n4:x",
            "polarm4n4",
        ] {
            assert!(crate::codec::parse(n).is_err(), "{n}");
        }
    }

    #[test]
    fn bad_parameter_blocks_are_rejected() {
        let good = crate::codec::parse("polar:m2n4").unwrap().params();
        assert_eq!(good.len(), 8 + 8 * 4);
        assert!(Polar::from_params(&good).is_ok());
        for (i, v) in [(0, 0u8), (0, 9), (1, 0), (2, 2), (3, 9), (5, 1)] {
            let mut p = good.clone();
            p[i] = v;
            assert!(Polar::from_params(&p).is_err(), "byte {i} = {v}");
        }
        assert!(Polar::from_params(&good[..good.len() - 1]).is_err());
        let mut p = good.clone();
        p[8..12].copy_from_slice(&f32::NAN.to_le_bytes());
        assert!(Polar::from_params(&p).is_err());
    }
}
