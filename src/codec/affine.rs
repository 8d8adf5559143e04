//! Token-wise asymmetric INT-b quantization, optionally after a
//! block-diagonal Walsh-Hadamard rotation: the `int{b}` and `bdr{h}`
//! codecs (format/codecs/int.md, format/codecs/bdr.md).
//!
//! * `int{b}` (b in 1..=8): every head vector (one token of one kv head) is
//!   quantized with its own fp32 scale and zero point
//!   ([`crate::kernels::affine`]); `b + 64/head_dim` bits/element. The
//!   papers' naive baseline (BDR paper appendix A.1, Eq. 3-4).
//! * `bdr{h}` (h a power of two dividing head_dim): each head vector is
//!   cut into contiguous blocks of `h` channels, each block rotated by the
//!   normalized Sylvester Walsh-Hadamard matrix `H_h / sqrt(h)` (BDR paper
//!   section 3, Eq. 15-16), then the whole rotated vector is quantized as
//!   INT4 like `int4`. `bdr{h}:k` rotates K only and stores V as plain
//!   INT4 (the paper's BDR(K) variant). A fused attention kernel may skip
//!   the inverse rotation of K by rotating the query the same way (the
//!   rotation is orthogonal, so `q.k = (Hq).(Hk)`).
//!
//! Sections per page (rows = planes x tokens, plane-major): SCALE stream 0
//! (f32 per row), ZERO stream 0 (f32 per row), INDEX stream 0 (`b`-bit
//! codes, row-major, LSB-first).

use crate::cache::{Elems, ElemsMut, Kind, Role, TensorInfo};
use crate::error::{Error, Result};
use crate::format::{ElemType, PageView, Section, SectionKind};
use crate::kernels::affine::{RowDst, RowSrc};
use crate::kernels::{affine, bitpack, wht};

use super::{
    Codec, Example, Family, PageIn, PageOut, expect_section, expect_section_count, f32_at,
    row_order,
};

/// Codec id of `int{b}`.
pub const INT_ID: u16 = 1;
/// Codec id of `bdr{h}`.
pub const BDR_ID: u16 = 2;
/// Largest supported rotation block.
pub const MAX_BLOCK: u32 = 4096;

/// An affine (scale + zero point per head vector) quantizer with an optional
/// block-diagonal Hadamard rotation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Affine {
    /// Bits per code, 1..=8.
    pub bits: u8,
    /// Rotation block size `h` (power of two), or `None` for plain `int{b}`.
    pub block: Option<u32>,
    /// With a rotation: rotate keys only, values stay unrotated.
    pub keys_only: bool,
}

/// Registry entry of `int{b}`.
pub const INT_FAMILY: Family = Family {
    id: INT_ID,
    name: "int",
    syntax: "int{b}            b = 1..8, e.g. int4",
    summary: "naive token-wise asymmetric INT-b, fp32 scale + zero point per head vector",
    parse: parse_int,
    from_params: |p| Ok(Box::new(int_params(p)?)),
    examples: &[
        Example {
            name: "int2",
            min_snr_db: -6.0,
        },
        Example {
            name: "int3",
            min_snr_db: 2.0,
        },
        Example {
            name: "int4",
            min_snr_db: 9.0,
        },
        Example {
            name: "int8",
            min_snr_db: 33.0,
        },
    ],
};

/// Registry entry of `bdr{h}`.
pub const BDR_FAMILY: Family = Family {
    id: BDR_ID,
    name: "bdr",
    syntax: "bdr{h}[:k][:b{bits}] h = 2..4096 power of two, e.g. bdr128, bdr128:k",
    summary: "block-diagonal Walsh-Hadamard rotation (block h) + token-wise INT4",
    parse: parse_bdr,
    from_params: |p| Ok(Box::new(bdr_params(p)?)),
    examples: &[
        Example {
            name: "bdr16",
            min_snr_db: 11.0,
        },
        Example {
            name: "bdr32",
            min_snr_db: 13.0,
        },
        Example {
            name: "bdr64",
            min_snr_db: 16.0,
        },
        Example {
            name: "bdr64:k",
            min_snr_db: 11.0,
        },
        Example {
            name: "bdr128",
            min_snr_db: 18.0,
        },
        Example {
            name: "bdr64:b3",
            min_snr_db: 8.0,
        },
    ],
};

fn parse_bits(s: &str) -> Option<u8> {
    s.parse::<u8>().ok().filter(|b| (1..=8).contains(b))
}

fn parse_int(s: &str) -> Option<Result<Box<dyn Codec>>> {
    let b = s.strip_prefix("int")?;
    Some(
        parse_bits(b)
            .map(|bits| {
                Box::new(Affine {
                    bits,
                    block: None,
                    keys_only: false,
                }) as Box<dyn Codec>
            })
            .ok_or_else(|| Error::param(format!("{s:?}: int codecs take 1 to 8 bits, e.g. int4"))),
    )
}

fn parse_bdr(s: &str) -> Option<Result<Box<dyn Codec>>> {
    let rest = s.strip_prefix("bdr")?;
    let mut parts = rest.split(':');
    let h = parts.next().unwrap_or("");
    let block = match h.parse::<u32>() {
        Ok(h) if h.is_power_of_two() && (2..=MAX_BLOCK).contains(&h) => h,
        _ => {
            return Some(Err(Error::param(format!(
                "{s:?}: the BDR block must be a power of two from 2 to {MAX_BLOCK}, e.g. bdr128"
            ))));
        }
    };
    let mut c = Affine {
        bits: 4,
        block: Some(block),
        keys_only: false,
    };
    for opt in parts {
        if opt == "k" {
            c.keys_only = true;
        } else if let Some(b) = opt.strip_prefix('b').and_then(parse_bits) {
            c.bits = b;
        } else {
            return Some(Err(Error::param(format!(
                "{s:?}: unknown BDR option {opt:?} (use :k for keys only, :b{{bits}} for 1..=8 bits)"
            ))));
        }
    }
    Some(Ok(Box::new(c)))
}

/// Parses an `int{b}` parameter block (format/codecs/int.md): the codec's
/// one reader of it, used by its registry entry and the GPU staging.
///
/// # Errors
/// [`Error::Parameter`] for a wrong length, set reserved bytes or bits
/// outside 1..=8.
pub(crate) fn int_params(p: &[u8]) -> Result<Affine> {
    match p {
        [bits, 0, 0, 0] if (1..=8).contains(bits) => Ok(Affine {
            bits: *bits,
            block: None,
            keys_only: false,
        }),
        _ => Err(Error::param(format!(
            "int parameters must be [bits 1..8, 0, 0, 0], found {p:02x?}"
        ))),
    }
}

/// Parses a `bdr{h}` parameter block (format/codecs/bdr.md): the codec's
/// one reader of it, used by its registry entry and the GPU staging.
///
/// # Errors
/// [`Error::Parameter`] for a wrong length, set reserved bytes, or a block
/// size, bit width or flag out of range.
pub(crate) fn bdr_params(p: &[u8]) -> Result<Affine> {
    if p.len() != 8 || p[4..] != [0, 0, 0, 0] {
        return Err(Error::param(format!(
            "bdr parameters must be 8 bytes ending in zeros, found {p:02x?}"
        )));
    }
    let block = u32::from(u16::from_le_bytes([p[0], p[1]]));
    let (bits, flags) = (p[2], p[3]);
    if !block.is_power_of_two()
        || !(2..=MAX_BLOCK).contains(&block)
        || !(1..=8).contains(&bits)
        || flags > 1
    {
        return Err(Error::param(format!(
            "bdr parameters out of range: block {block}, bits {bits}, flags {flags}"
        )));
    }
    Ok(Affine {
        bits,
        block: Some(block),
        keys_only: flags & 1 == 1,
    })
}

impl Affine {
    /// The rotation block applied to tensors of `kind` (`:k` rotates keys
    /// and MLA latents, which take the key role, and leaves values plain).
    pub(crate) fn block_for(&self, kind: Kind) -> Option<usize> {
        match (self.block, kind.role()) {
            (Some(_), Role::Value) if self.keys_only => None,
            (b, _) => b.map(|b| b as usize),
        }
    }
}

/// How many tokens ahead the 4-bit rows are prefetched when they live in
/// the caller's (token-major or paged) memory: the jumps between a paged
/// cache's blocks then do not stall (measured: bdr128 encode of a layer
/// with a shuffled block table 4.6 -> 3.6 ms on one thread, as with
/// contiguous blocks).
const PREFETCH_TOKENS: usize = 4;

impl Codec for Affine {
    fn size_depends_only_on_shape(&self) -> bool {
        true
    }

    fn row_wise(&self) -> bool {
        true
    }

    fn name(&self) -> String {
        match self.block {
            None => format!("int{}", self.bits),
            Some(h) => {
                let mut n = format!("bdr{h}");
                if self.keys_only {
                    n.push_str(":k");
                }
                if self.bits != 4 {
                    n.push_str(&format!(":b{}", self.bits));
                }
                n
            }
        }
    }

    fn id(&self) -> u16 {
        if self.block.is_some() { BDR_ID } else { INT_ID }
    }

    fn params(&self) -> Vec<u8> {
        match self.block {
            None => vec![self.bits, 0, 0, 0],
            Some(h) => {
                let mut p = (h as u16).to_le_bytes().to_vec();
                p.extend([self.bits, u8::from(self.keys_only), 0, 0, 0, 0]);
                p
            }
        }
    }

    fn check(&self, t: &TensorInfo) -> Result<()> {
        if t.head_dim > 1024 {
            return Err(Error::param(format!(
                "{} ({}): head_dim {} is above the 1024 this codec supports",
                t.name,
                t.describe(),
                t.head_dim
            )));
        }
        if let Some(h) = self.block_for(t.kind)
            && !(t.head_dim as usize).is_multiple_of(h)
        {
            let largest = 1u32 << t.head_dim.trailing_zeros().min(MAX_BLOCK.trailing_zeros());
            let hint = if largest >= 2 {
                format!("the largest valid block for this cache is bdr{largest}")
            } else {
                "no BDR block fits an odd head_dim; use int4".to_string()
            };
            return Err(Error::param(format!(
                "{} needs head_dim divisible by {h}, but {} ({}) has head_dim {}; {hint}",
                self.name(),
                t.name,
                t.describe(),
                t.head_dim
            )));
        }
        Ok(())
    }

    fn encode(&self, page: &PageIn<'_>) -> Result<Vec<Section>> {
        let d = page.head_dim();
        let rows = page.rows();
        let bits = u32::from(self.bits);
        let block = self.block_for(page.tensor.kind);
        let c = block.map(wht::inv_sqrt).unwrap_or(1.0);
        let mut scales = Vec::with_capacity(rows);
        let mut zeros = Vec::with_capacity(rows);
        let n_codes = rows * d;
        let mut index = crate::format::pool::zeroed(bitpack::packed_len(n_codes, bits));
        let row_aligned = (d * bits as usize).is_multiple_of(8);
        let row_bytes = d * bits as usize / 8;
        let mut all_codes = if row_aligned {
            Vec::new()
        } else {
            vec![0u8; n_codes]
        };
        let mut buf = vec![0f32; d];
        let mut codes = vec![0u8; d];
        if bits == 4 && row_aligned {
            // The 4-bit row step, straight from the page's elements.
            let mut wide = vec![0f32; d];
            scales.resize(rows, 0.0);
            zeros.resize(rows, 0.0);
            let (t, ahead) = (
                page.tokens as usize,
                page.source.map_or(0, |_| PREFETCH_TOKENS),
            );
            for r in row_order(rows, t, page.source.is_some()) {
                if ahead > 0 && r % t + ahead < t {
                    page.prefetch_row(r + ahead);
                }
                let src = match page.row(r) {
                    Elems::Bf16(v) => RowSrc::Bf16(v),
                    Elems::F32(v) => RowSrc::F32(v),
                    _ => {
                        page.load_row(r, &mut wide);
                        RowSrc::F32(&wide)
                    }
                };
                let out = &mut index[r * row_bytes..(r + 1) * row_bytes];
                let p = affine::encode_row4(src, block, &mut buf, out)
                    .map_err(|e| page.row_error(r, e))?;
                (scales[r], zeros[r]) = (p.scale, p.zero);
            }
            let count =
                u32::try_from(n_codes).map_err(|_| Error::param("page over 2^32 elements"))?;
            return Ok(vec![
                Section::f32s(SectionKind::Scale, 0, &scales),
                Section::f32s(SectionKind::Zero, 0, &zeros),
                Section::packed(SectionKind::Index, 0, self.bits, count, index),
            ]);
        }
        for r in 0..rows {
            page.load_row(r, &mut buf);
            let range = match block {
                Some(h) => {
                    wht::fwht_blocks(&mut buf, h);
                    affine::scale_min_max(&mut buf, c)
                }
                None => affine::min_max(&buf),
            };
            let p = range
                .map(|(mn, mx)| {
                    if row_aligned {
                        affine::quantize_row_in_range(
                            &buf,
                            mn,
                            mx,
                            bits,
                            &mut index[r * row_bytes..(r + 1) * row_bytes],
                        )
                    } else {
                        let (p, inv) = affine::params(mn, mx, (1 << bits) - 1);
                        affine::quantize_codes(&buf, inv, p.zero, (1 << bits) - 1, &mut codes);
                        all_codes[r * d..(r + 1) * d].copy_from_slice(&codes);
                        p
                    }
                })
                .map_err(|e| page.row_error(r, e))?;
            scales.push(p.scale);
            zeros.push(p.zero);
        }
        if !row_aligned {
            bitpack::pack_u8(&all_codes, bits, &mut index);
        }
        let count = u32::try_from(n_codes).map_err(|_| Error::param("page over 2^32 elements"))?;
        Ok(vec![
            Section::f32s(SectionKind::Scale, 0, &scales),
            Section::f32s(SectionKind::Zero, 0, &zeros),
            Section::packed(SectionKind::Index, 0, self.bits, count, index),
        ])
    }

    fn decode(&self, page: &PageView<'_>, out: &mut PageOut<'_>) -> Result<()> {
        let d = out.tensor.head_dim as usize;
        let rows = out.rows();
        let bits = u32::from(self.bits);
        let [scales, zeros, index] = page_layout(page, self.bits, rows, d)?;
        let block = self.block_for(out.tensor.kind);
        let c = block.map(wht::inv_sqrt).unwrap_or(1.0);
        let row_aligned = (d * bits as usize).is_multiple_of(8);
        let row_bytes = d * bits as usize / 8;
        let all_codes = if row_aligned {
            Vec::new()
        } else {
            let mut v = vec![0u8; rows * d];
            bitpack::unpack_u8(index, bits, &mut v);
            v
        };
        let mut buf = vec![0f32; d];
        if bits == 4 && row_aligned {
            // The 4-bit row step, straight into the output's elements
            // (rows of whole bytes: an even head_dim; an odd one's rows
            // share bytes and take the general path below).
            let mut wide = vec![0f32; d];
            let (t, ahead) = (
                out.tokens as usize,
                out.scatter.as_ref().map_or(0, |_| PREFETCH_TOKENS),
            );
            for r in row_order(rows, t, out.scatter.is_some()) {
                if ahead > 0 && r % t + ahead < t {
                    out.prefetch_row(r + ahead);
                }
                let p = affine::RowParams {
                    scale: f32_at(scales, r) * c,
                    zero: f32_at(zeros, r),
                };
                let codes = &index[r * row_bytes..(r + 1) * row_bytes];
                match out.row_mut(r) {
                    ElemsMut::Bf16(v) => {
                        affine::decode_row4(codes, p, block, &mut buf, RowDst::Bf16(v))
                    }
                    ElemsMut::F32(v) => {
                        affine::decode_row4(codes, p, block, &mut buf, RowDst::F32(v))
                    }
                    mut other => {
                        affine::decode_row4(codes, p, block, &mut buf, RowDst::F32(&mut wide));
                        other.store(0, &wide);
                    }
                }
            }
            return Ok(());
        }
        for r in 0..rows {
            let p = affine::RowParams {
                scale: f32_at(scales, r) * c,
                zero: f32_at(zeros, r),
            };
            if row_aligned {
                affine::dequantize_row(
                    &index[r * row_bytes..(r + 1) * row_bytes],
                    bits,
                    p,
                    &mut buf,
                );
            } else {
                for (o, &q) in buf.iter_mut().zip(&all_codes[r * d..(r + 1) * d]) {
                    *o = (q as f32 - p.zero) * p.scale;
                }
            }
            if let Some(h) = block {
                wht::fwht_blocks(&mut buf, h);
            }
            out.store_row(r, &buf);
        }
        Ok(())
    }

    fn bits_per_element(&self, t: &TensorInfo) -> f64 {
        f64::from(self.bits) + 64.0 / f64::from(t.head_dim)
    }
}

/// The checked layout of an affine page of `rows` rows of `head_dim`
/// codes of `bits` bits: exactly SCALE 0 and ZERO 0 (f32 per row) and
/// INDEX 0 (packed codes), returned in that order. The CPU decoder and the
/// GPU staging both read pages through it.
///
/// # Errors
/// [`Error::Format`] naming the page for a missing, mistyped or extra
/// section.
pub(crate) fn page_layout<'p>(
    page: &'p PageView<'_>,
    bits: u8,
    rows: usize,
    head_dim: usize,
) -> Result<[&'p [u8]; 3]> {
    let scales = expect_section(page, SectionKind::Scale, 0, ElemType::F32, rows)?;
    let zeros = expect_section(page, SectionKind::Zero, 0, ElemType::F32, rows)?;
    let index = expect_section(
        page,
        SectionKind::Index,
        0,
        ElemType::Packed(bits),
        rows * head_dim,
    )?;
    expect_section_count(page, 3)?;
    Ok([scales, zeros, index])
}
