//! `kivi:{b}`: the KIVI baseline (Liu et al., ICML 2024, as configured in
//! the PolarQuant and InnerQ papers: "KIVI-b-gs32-rs128";
//! format/codecs/kivi.md).
//!
//! Keys are quantized per channel over groups of `G` tokens, values per
//! token over groups of `G` channels; both asymmetric with an fp16 scale and
//! an fp16 zero point (the group minimum) per group; the last 128 tokens
//! stay at source precision ([`Codec::default_windows`]). Bits per element
//! of the quantized body: `b + 32 / G` (PolarQuant Table 3: `32 T d / g`
//! parameters for `T d` elements).
//!
//! Sections per page: SCALE stream 0 (f16 per group), ZERO stream 0 (f16 per
//! group), INDEX stream 0 (`b`-bit codes in element order). Group order and
//! partial token groups: `codec/groups.rs`.

use half::f16;

use crate::cache::{Kind, Role, TensorInfo};
use crate::error::{Error, Result};
use crate::format::{ElemType, PageView, Section, SectionKind};
use crate::kernels::{bitpack, group};

use super::groups::{Axis, Groups};
use super::{
    Codec, Example, Family, PageIn, PageOut, expect_section, expect_section_count, pagebuf,
};

/// Codec id of `kivi`.
pub const ID: u16 = 8;
/// Default group size `G`.
pub const DEFAULT_GROUP: u16 = 32;
/// Default recent window (the paper's residual length `R`), tokens.
pub const DEFAULT_RESIDUAL: u32 = 128;

/// The KIVI quantizer: `b`-bit asymmetric codes, keys grouped over tokens,
/// values over channels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kivi {
    /// Bits per code, 1..=8.
    pub bits: u8,
    /// Group size `G`, 1..=1024 (values need `head_dim % G == 0`).
    pub group: u16,
}

/// Registry entry of `kivi`.
pub const FAMILY: Family = Family {
    id: ID,
    name: "kivi",
    syntax: "kivi:{b}[:g{G}]   b = 1..8, e.g. kivi:2, kivi:4",
    summary: "KIVI baseline: K per channel / V per token in groups of 32, fp16 scale+zero, 128 recent raw",
    parse,
    from_params: |p| Ok(Box::new(Kivi::from_params(p)?)),
    examples: &[
        Example {
            name: "kivi:2",
            min_snr_db: 4.0,
        },
        Example {
            name: "kivi:4",
            min_snr_db: 19.0,
        },
    ],
};

fn parse(s: &str) -> Option<Result<Box<dyn Codec>>> {
    let rest = s.strip_prefix("kivi")?;
    let bad = || {
        Some(Err(Error::param(format!(
            "{s:?}: KIVI takes kivi:{{bits 1..8}}[:g{{group 1..1024}}], e.g. kivi:2"
        ))))
    };
    let mut parts = rest.split(':');
    if parts.next() != Some("") {
        return bad();
    }
    let Some(bits) = parts.next().and_then(|b| b.parse::<u8>().ok()) else {
        return bad();
    };
    let mut c = Kivi {
        bits,
        group: DEFAULT_GROUP,
    };
    for opt in parts {
        match opt.strip_prefix('g').and_then(|g| g.parse::<u16>().ok()) {
            Some(g) => c.group = g,
            None => return bad(),
        }
    }
    if !(1..=8).contains(&c.bits) || !(1..=1024).contains(&c.group) {
        return bad();
    }
    Some(Ok(Box::new(c)))
}

/// The checked sections of one kivi page ([`Kivi::page`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct KiviPage<'p> {
    /// The page's quantization groups.
    pub groups: Groups,
    /// SCALE stream 0: f16 per group, all finite.
    pub scales: &'p [u8],
    /// ZERO stream 0: f16 per group, all finite.
    pub zeros: &'p [u8],
    /// INDEX stream 0: `bits`-bit codes in element order.
    pub index: &'p [u8],
}

impl Kivi {
    /// Parses the parameter block `[bits, 0, group u16]`
    /// (format/codecs/kivi.md): the codec's one reader of it, used by its
    /// registry entry and the GPU staging.
    ///
    /// # Errors
    /// [`Error::Parameter`] for a wrong length, a set reserved byte, bits
    /// outside 1..=8 or a group outside 1..=1024.
    pub fn from_params(p: &[u8]) -> Result<Kivi> {
        match p {
            [bits, 0, g0, g1] => {
                let group = u16::from_le_bytes([*g0, *g1]);
                if (1..=8).contains(bits) && (1..=1024).contains(&group) {
                    return Ok(Kivi { bits: *bits, group });
                }
                Err(Error::param(format!(
                    "kivi parameters out of range: bits {bits}, group {group}"
                )))
            }
            _ => Err(Error::param(format!(
                "kivi parameters must be [bits, 0, group u16], found {p:02x?}"
            ))),
        }
    }

    /// The checked layout of a page of `planes x tokens` rows of a tensor
    /// of `kind` and `head_dim`: exactly the three sections of the codec
    /// with their element types and counts, finite scales and zero points.
    /// The CPU decoder and the GPU staging both read pages through it.
    ///
    /// # Errors
    /// [`Error::Format`] naming the page for a value page whose head_dim is
    /// not a multiple of the group, a missing, mistyped or extra section,
    /// or a non-finite scale or zero point.
    pub(crate) fn page<'p>(
        &self,
        page: &'p PageView<'_>,
        kind: Kind,
        planes: usize,
        tokens: usize,
        head_dim: usize,
    ) -> Result<KiviPage<'p>> {
        if kind.role() == Role::Value && !head_dim.is_multiple_of(usize::from(self.group)) {
            return Err(page.error(format!(
                "value page with head_dim {head_dim}, not a multiple of the group size {}",
                self.group
            )));
        }
        let groups = self.groups(kind, planes, tokens, head_dim);
        let n = groups.count();
        let scales = expect_section(page, SectionKind::Scale, 0, ElemType::F16, n)?;
        let zeros = expect_section(page, SectionKind::Zero, 0, ElemType::F16, n)?;
        let index = expect_section(
            page,
            SectionKind::Index,
            0,
            ElemType::Packed(self.bits),
            planes * tokens * head_dim,
        )?;
        expect_section_count(page, 3)?;
        let bad = [scales, zeros]
            .into_iter()
            .filter_map(pagebuf::first_non_finite_f16)
            .min();
        if let Some(g) = bad {
            let (s, z) = (pagebuf::f16_at(scales, g), pagebuf::f16_at(zeros, g));
            return Err(page.error(format!("group {g}: scale {s} or zero point {z} not finite")));
        }
        Ok(KiviPage {
            groups,
            scales,
            zeros,
            index,
        })
    }

    fn groups(&self, kind: Kind, planes: usize, tokens: usize, head_dim: usize) -> Groups {
        Groups {
            axis: match kind.role() {
                Role::Key => Axis::Tokens,
                Role::Value => Axis::Channels,
            },
            size: self.group as usize,
            planes,
            tokens,
            head_dim,
        }
    }
}

impl Codec for Kivi {
    fn size_depends_only_on_shape(&self) -> bool {
        true
    }

    fn name(&self) -> String {
        let mut n = format!("kivi:{}", self.bits);
        if self.group != DEFAULT_GROUP {
            n.push_str(&format!(":g{}", self.group));
        }
        n
    }

    fn id(&self) -> u16 {
        ID
    }

    fn params(&self) -> Vec<u8> {
        let g = self.group.to_le_bytes();
        vec![self.bits, 0, g[0], g[1]]
    }

    fn check(&self, t: &TensorInfo) -> Result<()> {
        if t.kind.role() == Role::Value && !t.head_dim.is_multiple_of(u32::from(self.group)) {
            return Err(Error::param(format!(
                "{} groups values over {} channels, but {} ({}) has head_dim {}",
                self.name(),
                self.group,
                t.name,
                t.describe(),
                t.head_dim
            )));
        }
        Ok(())
    }

    fn default_windows(&self) -> (u32, u32) {
        (0, DEFAULT_RESIDUAL)
    }

    fn encode(&self, page: &PageIn<'_>) -> Result<Vec<Section>> {
        let d = page.head_dim();
        let buf = pagebuf::load(page);
        let gr = self.groups(page.tensor.kind, page.planes.len(), page.tokens as usize, d);
        let levels = (1u32 << self.bits) - 1;
        let n = gr.count();
        let mut scales = Vec::with_capacity(n);
        let mut zeros = Vec::with_capacity(n);
        let mut codes = vec![0u8; buf.len()];
        let mut vals = Vec::with_capacity(gr.size);
        let mut q = vec![0u8; gr.size];
        for g in 0..n {
            let span = gr.span(g);
            vals.clear();
            vals.extend(span.positions().map(|p| buf[p]));
            let p = group::min_max(&vals)
                .and_then(|(mn, mx)| group::asym_params(mn, mx, levels, true))
                .map_err(|e| pagebuf::at(page, span.start, e))?;
            let q = &mut q[..span.len];
            group::quantize_asym(&vals, p, levels, q);
            for (pos, &c) in span.positions().zip(q.iter()) {
                codes[pos] = c;
            }
            scales.push(p.scale);
            zeros.push(f16::from_f32(p.zero));
        }
        let mut index = vec![0u8; bitpack::packed_len(codes.len(), u32::from(self.bits))];
        bitpack::pack_u8(&codes, u32::from(self.bits), &mut index);
        Ok(vec![
            pagebuf::f16s(SectionKind::Scale, 0, &scales),
            pagebuf::f16s(SectionKind::Zero, 0, &zeros),
            Section::packed(
                SectionKind::Index,
                0,
                self.bits,
                pagebuf::count(codes.len())?,
                index,
            ),
        ])
    }

    fn decode(&self, page: &PageView<'_>, out: &mut PageOut<'_>) -> Result<()> {
        let d = out.tensor.head_dim as usize;
        let n_el = out.rows() * d;
        let p = self.page(
            page,
            out.tensor.kind,
            out.planes.len(),
            out.tokens as usize,
            d,
        )?;
        let mut codes = vec![0u8; n_el];
        bitpack::unpack_u8(p.index, u32::from(self.bits), &mut codes);
        let mut buf = vec![0f32; n_el];
        for g in 0..p.groups.count() {
            let (s, z) = (pagebuf::f16_at(p.scales, g), pagebuf::f16_at(p.zeros, g));
            for pos in p.groups.span(g).positions() {
                buf[pos] = group::dequantize_asym(codes[pos], s, z);
            }
        }
        pagebuf::store(out, &buf);
        Ok(())
    }

    fn bits_per_element(&self, _t: &TensorInfo) -> f64 {
        f64::from(self.bits) + 32.0 / f64::from(self.group)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for n in ["kivi:2", "kivi:4", "kivi:3:g64", "kivi:1:g1"] {
            let c = crate::codec::parse(n).unwrap();
            assert_eq!(c.name(), n);
            assert_eq!(Kivi::from_params(&c.params()).unwrap().name(), n);
        }
        assert_eq!(crate::codec::parse("kivi:2:g32").unwrap().name(), "kivi:2");
        for n in [
            "kivi",
            "kivi:",
            "kivi:0",
            "kivi:9",
            "kivi:2:g0",
            "kivi:2:x",
            "kivi2",
        ] {
            assert!(crate::codec::parse(n).is_err(), "{n}");
        }
        assert!(Kivi::from_params(&[2, 1, 32, 0]).is_err());
        assert!(Kivi::from_params(&[2, 0, 0, 0]).is_err());
        assert!(Kivi::from_params(&[2, 0, 32]).is_err());
    }
}
