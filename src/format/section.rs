//! Typed sections of a page body and the body layout.
//!
//! A body is a section table (`n` entries of 16 bytes) followed by the
//! sections, each starting at a multiple of 64 bytes from the body start,
//! in table order, zero-padded; the body length is a multiple of 64. The
//! layout is canonical: offsets are fully determined by the lengths.

use crate::error::{Error, Location, Result};

use super::SECTION_ALIGN;
use super::bytes::{Cursor, PutLe};

/// What a section holds (format/SPEC.md "Section kinds").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SectionKind {
    /// Per-row (or per-group) scales. Code 1.
    Scale,
    /// Per-row (or per-group) zero points. Code 2.
    Zero,
    /// Bit-packed code stream (indices). Code 3.
    Index,
    /// Outlier side table: positions and fp16 values (format/SPEC.md
    /// "Outlier table"). Code 4.
    Outliers,
    /// Elements at source precision (`raw` pages). Code 5.
    Raw,
    /// Codec-specific side data defined by the codec's bitstream spec. Code 6.
    Aux,
}

impl SectionKind {
    /// File code.
    pub fn code(self) -> u8 {
        match self {
            SectionKind::Scale => 1,
            SectionKind::Zero => 2,
            SectionKind::Index => 3,
            SectionKind::Outliers => 4,
            SectionKind::Raw => 5,
            SectionKind::Aux => 6,
        }
    }

    /// Inverse of [`SectionKind::code`].
    pub fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            1 => SectionKind::Scale,
            2 => SectionKind::Zero,
            3 => SectionKind::Index,
            4 => SectionKind::Outliers,
            5 => SectionKind::Raw,
            6 => SectionKind::Aux,
            _ => return None,
        })
    }

    /// Upper-case name used in messages and `inspect`.
    pub fn name(self) -> &'static str {
        match self {
            SectionKind::Scale => "SCALE",
            SectionKind::Zero => "ZERO",
            SectionKind::Index => "INDEX",
            SectionKind::Outliers => "OUTLIERS",
            SectionKind::Raw => "RAW",
            SectionKind::Aux => "AUX",
        }
    }
}

/// Element encoding of a section.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElemType {
    /// Unsigned codes of `bits` (1..=32) bits, LSB-first bit-packed. Code 0.
    Packed(u8),
    /// bfloat16, little-endian. Code 1.
    Bf16,
    /// IEEE binary16, little-endian. Code 2.
    F16,
    /// IEEE binary32, little-endian. Code 3.
    F32,
    /// u16, little-endian. Code 4.
    U16,
    /// u32, little-endian. Code 5.
    U32,
    /// Opaque bytes with a structure defined by the section kind or codec.
    /// Code 6.
    Bytes,
    /// fp8 E4M3FN codes (format 1.1). Code 7. The scale is the tensor's.
    F8E4M3,
    /// fp8 E5M2 codes (format 1.1). Code 8. The scale is the tensor's.
    F8E5M2,
}

impl ElemType {
    /// `(code, bits)` as stored in the section table.
    pub fn code_bits(self) -> (u8, u8) {
        match self {
            ElemType::Packed(b) => (0, b),
            ElemType::Bf16 => (1, 16),
            ElemType::F16 => (2, 16),
            ElemType::F32 => (3, 32),
            ElemType::U16 => (4, 16),
            ElemType::U32 => (5, 32),
            ElemType::Bytes => (6, 8),
            ElemType::F8E4M3 => (7, 8),
            ElemType::F8E5M2 => (8, 8),
        }
    }

    /// Inverse of [`ElemType::code_bits`]; `None` for unknown codes or a
    /// bits field that does not match the type.
    pub fn from_code_bits(code: u8, bits: u8) -> Option<Self> {
        let t = match code {
            0 if (1..=32).contains(&bits) => return Some(ElemType::Packed(bits)),
            1 => ElemType::Bf16,
            2 => ElemType::F16,
            3 => ElemType::F32,
            4 => ElemType::U16,
            5 => ElemType::U32,
            6 => ElemType::Bytes,
            7 => ElemType::F8E4M3,
            8 => ElemType::F8E5M2,
            _ => return None,
        };
        (t.code_bits().1 == bits).then_some(t)
    }

    /// Byte length of `count` elements.
    pub fn byte_len(self, count: u64) -> Option<u64> {
        let bits = u64::from(self.code_bits().1);
        count.checked_mul(bits).map(|b| b.div_ceil(8))
    }

    /// Element type for a source dtype.
    pub fn from_dtype(d: crate::cache::DType) -> Self {
        match d {
            crate::cache::DType::Bf16 => ElemType::Bf16,
            crate::cache::DType::F16 => ElemType::F16,
            crate::cache::DType::F32 => ElemType::F32,
            crate::cache::DType::Fp8(f) => match f.format() {
                crate::cache::Fp8Format::E4M3Fn => ElemType::F8E4M3,
                crate::cache::Fp8Format::E5M2 => ElemType::F8E5M2,
            },
        }
    }

    /// Short name for `inspect`: `u4`, `f32`, ...
    pub fn name(self) -> String {
        match self {
            ElemType::Packed(b) => format!("u{b}"),
            ElemType::Bf16 => "bf16".into(),
            ElemType::F16 => "f16".into(),
            ElemType::F32 => "f32".into(),
            ElemType::U16 => "u16".into(),
            ElemType::U32 => "u32".into(),
            ElemType::Bytes => "bytes".into(),
            ElemType::F8E4M3 => "f8e4m3".into(),
            ElemType::F8E5M2 => "f8e5m2".into(),
        }
    }
}

/// One parsed section table entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SectionDesc {
    /// What the section holds.
    pub kind: SectionKind,
    /// Distinguishes several sections of the same kind (0-based).
    pub stream: u8,
    /// Element encoding.
    pub elem: ElemType,
    /// Number of elements (codes, floats, or bytes for `Bytes`).
    pub count: u32,
    /// Offset from the body start, a multiple of 64.
    pub offset: u32,
    /// Length in bytes: `elem.byte_len(count)`.
    pub len: u32,
}

/// An owned section produced by an encoder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Section {
    /// What the section holds.
    pub kind: SectionKind,
    /// Stream number among sections of the same kind.
    pub stream: u8,
    /// Element encoding.
    pub elem: ElemType,
    /// Number of elements.
    pub count: u32,
    /// Encoded bytes, exactly `elem.byte_len(count)` long.
    pub data: Vec<u8>,
}

impl Section {
    /// A section of little-endian f32 values.
    pub fn f32s(kind: SectionKind, stream: u8, values: &[f32]) -> Section {
        let mut data = Vec::with_capacity(values.len() * 4);
        for v in values {
            data.extend_from_slice(&v.to_le_bytes());
        }
        Section {
            kind,
            stream,
            elem: ElemType::F32,
            count: values.len() as u32,
            data,
        }
    }

    /// A bit-packed code section of `count` codes, `bits` bits each.
    pub fn packed(kind: SectionKind, stream: u8, bits: u8, count: u32, data: Vec<u8>) -> Section {
        Section {
            kind,
            stream,
            elem: ElemType::Packed(bits),
            count,
            data,
        }
    }
}

/// Size of one section table entry, bytes.
pub(crate) const SECTION_DESC_LEN: usize = 16;

/// Appends the canonical body of `sections` to `out` (body offsets are
/// relative to where the body starts in `out`).
///
/// # Errors
/// [`Error::Parameter`] when a section's data length disagrees with its
/// element type and count, `(kind, stream)` pairs repeat, or the body would
/// exceed 4 GiB.
pub(crate) fn encode_body_into(out: &mut Vec<u8>, sections: &[Section]) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    let mut offset = (sections.len() * SECTION_DESC_LEN).next_multiple_of(SECTION_ALIGN);
    let mut descs = Vec::with_capacity(sections.len());
    for s in sections {
        if !seen.insert((s.kind, s.stream)) {
            return Err(Error::param(format!(
                "section {} stream {} appears twice",
                s.kind.name(),
                s.stream
            )));
        }
        let want = s.elem.byte_len(u64::from(s.count));
        if want != Some(s.data.len() as u64) {
            return Err(Error::param(format!(
                "section {} stream {}: {} bytes for {} {} elements",
                s.kind.name(),
                s.stream,
                s.data.len(),
                s.count,
                s.elem.name()
            )));
        }
        let off =
            u32::try_from(offset).map_err(|_| Error::Limits("page body over 4 GiB".into()))?;
        descs.push((off, s.data.len() as u32));
        offset = (offset + s.data.len()).next_multiple_of(SECTION_ALIGN);
    }
    let base = out.len();
    out.reserve(offset);
    let body = out;
    for (s, (off, len)) in sections.iter().zip(&descs) {
        let (code, bits) = s.elem.code_bits();
        body.put_u8(s.kind.code());
        body.put_u8(s.stream);
        body.put_u8(code);
        body.put_u8(bits);
        body.put_u32(s.count);
        body.put_u32(*off);
        body.put_u32(*len);
    }
    let pad =
        |b: &mut Vec<u8>| b.resize(base + (b.len() - base).next_multiple_of(SECTION_ALIGN), 0);
    pad(body);
    for s in sections {
        body.extend_from_slice(&s.data);
        pad(body);
    }
    debug_assert_eq!(body.len() - base, offset);
    Ok(())
}

/// Parses and validates the section table of an uncompressed body,
/// including canonical offsets and zero padding.
pub(crate) fn parse_body(body: &[u8], n: usize, at: &Location) -> Result<Vec<SectionDesc>> {
    let descs = parse_table(body, n, at)?;
    // Zero padding after each section (the table's is checked by
    // `parse_table`).
    for (i, d) in descs.iter().enumerate() {
        let to = descs.get(i + 1).map_or(body.len(), |n| n.offset as usize);
        check_pad(body, (d.offset + d.len) as usize, to, at)?;
    }
    Ok(descs)
}

/// [`parse_body`] without the padding after the sections: the table, its
/// canonical offsets, the body length, and the zero padding between the
/// table and the first section.
pub(crate) fn parse_table(body: &[u8], n: usize, at: &Location) -> Result<Vec<SectionDesc>> {
    let err = |m: String| Error::format(at.clone(), m);
    let mut c = Cursor::new(body, at.clone());
    let mut descs: Vec<SectionDesc> = Vec::with_capacity(n);
    let mut expect = (n * SECTION_DESC_LEN).next_multiple_of(SECTION_ALIGN);
    let pad_from = n * SECTION_DESC_LEN;
    for i in 0..n {
        let what = format!("section table entry {i}");
        let kind_code = c.u8(&what)?;
        let kind = SectionKind::from_code(kind_code)
            .ok_or_else(|| err(format!("{what}: unknown section kind {kind_code}")))?;
        let stream = c.u8(&what)?;
        let code = c.u8(&what)?;
        let bits = c.u8(&what)?;
        let elem = ElemType::from_code_bits(code, bits).ok_or_else(|| {
            err(format!(
                "{what}: unknown element type {code} with {bits} bits"
            ))
        })?;
        let count = c.u32(&what)?;
        let offset = c.u32(&what)?;
        let len = c.u32(&what)?;
        if elem.byte_len(u64::from(count)) != Some(u64::from(len)) {
            return Err(err(format!(
                "{what} ({} stream {stream}): {len} bytes cannot hold {count} {} elements",
                kind.name(),
                elem.name()
            )));
        }
        if offset as usize != expect {
            return Err(err(format!(
                "{what} ({} stream {stream}): offset {offset}, canonical layout needs {expect}",
                kind.name()
            )));
        }
        if descs.iter().any(|d| d.kind == kind && d.stream == stream) {
            return Err(err(format!(
                "{what}: duplicate section {} stream {stream}",
                kind.name()
            )));
        }
        descs.push(SectionDesc {
            kind,
            stream,
            elem,
            count,
            offset,
            len,
        });
        expect = (expect + len as usize).next_multiple_of(SECTION_ALIGN);
    }
    if body.len() != expect {
        return Err(err(format!(
            "page body is {} bytes, its section table implies {expect}",
            body.len()
        )));
    }
    // Zero padding after the table.
    check_pad(
        body,
        pad_from,
        descs.first().map_or(body.len(), |d| d.offset as usize),
        at,
    )?;
    Ok(descs)
}

fn check_pad(body: &[u8], from: usize, to: usize, at: &Location) -> Result<()> {
    if let Some(i) = body[from..to].iter().position(|&b| b != 0) {
        return Err(Error::format(
            at.clone(),
            format!("page body padding at body offset {} is not zero", from + i),
        ));
    }
    Ok(())
}
