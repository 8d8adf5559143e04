//! The canonical body layout of an encoded page (format/SPEC.md 6.2) for a
//! list of sections known before encoding: the section table filled in and
//! every section zeroed, for encode kernels to write into, and the split of
//! the finished body back into the sections the CPU encoder returns.

use crate::error::{Error, Result};
use crate::format::{ElemType, Section, SectionKind};

/// One section of a body: kind, stream, element type, element count and
/// byte length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SectionSpec {
    /// Section kind.
    pub kind: SectionKind,
    /// Stream number.
    pub stream: u8,
    /// Element type.
    pub elem: ElemType,
    /// Element count.
    pub count: u32,
    /// Byte length.
    pub len: u32,
}

/// A canonical body: section table, then each section 64-aligned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CanonicalBody {
    /// The sections, in table order.
    pub specs: Vec<SectionSpec>,
    /// Offset of each section from the body start.
    pub offsets: Vec<u32>,
    /// Body length (a multiple of 64).
    pub body_len: u32,
}

impl CanonicalBody {
    /// The layout of `specs`.
    ///
    /// # Errors
    /// [`Error::Parameter`] for a body over 4 GiB.
    pub fn new(specs: Vec<SectionSpec>) -> Result<CanonicalBody> {
        let a = |x: u64| x.next_multiple_of(64);
        let mut at = a(16 * specs.len() as u64);
        let mut offsets = Vec::with_capacity(specs.len());
        for s in &specs {
            offsets.push(u32::try_from(at).map_err(|_| Error::param("page body over 4 GiB"))?);
            at = a(at + u64::from(s.len));
        }
        Ok(CanonicalBody {
            specs,
            offsets,
            body_len: u32::try_from(at).map_err(|_| Error::param("page body over 4 GiB"))?,
        })
    }

    /// The body with its section table filled in and every section zeroed.
    pub fn template(&self) -> Vec<u8> {
        let mut b = vec![0u8; self.body_len as usize];
        self.write_table(&mut b);
        b
    }

    /// Writes the section table (its first `16 * specs.len()` bytes) into
    /// `body`, which then is the canonical body of the sections it holds
    /// when the padding between them is zero.
    ///
    /// # Panics
    /// If `body` is shorter than the table.
    pub fn write_table(&self, body: &mut [u8]) {
        for (i, (s, &off)) in self.specs.iter().zip(&self.offsets).enumerate() {
            let (code, bits) = s.elem.code_bits();
            let e = &mut body[16 * i..16 * (i + 1)];
            e[0] = s.kind.code();
            e[1] = s.stream;
            e[2] = code;
            e[3] = bits;
            e[4..8].copy_from_slice(&s.count.to_le_bytes());
            e[8..12].copy_from_slice(&off.to_le_bytes());
            e[12..16].copy_from_slice(&s.len.to_le_bytes());
        }
    }

    /// The sections of an encoded body, in table order.
    ///
    /// # Panics
    /// If `body` is shorter than [`CanonicalBody::body_len`].
    pub fn sections(&self, body: &[u8]) -> Vec<Section> {
        self.specs
            .iter()
            .zip(&self.offsets)
            .map(|(s, &o)| Section {
                kind: s.kind,
                stream: s.stream,
                elem: s.elem,
                count: s.count,
                data: body[o as usize..o as usize + s.len as usize].to_vec(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The template of an affine page's sections (the GPU family's
    /// `body_sections`) is the body the format's page writer lays out.
    #[test]
    fn template_is_the_page_writers_body() {
        use crate::format::{PageFrame, PageMeta};
        use crate::gpu::family::body_sections;
        use crate::gpu::spec::KernelCodec;
        for (rows, d, bits) in [(10u32, 128u32, 4u8), (7, 6, 3), (1, 1, 1), (33, 96, 8)] {
            let kc = KernelCodec::Affine { bits, block: None };
            let l =
                CanonicalBody::new(body_sections(kc, rows.into(), 1, d.into()).unwrap()).unwrap();
            let n = (rows * d) as usize;
            let sections = vec![
                Section::f32s(SectionKind::Scale, 0, &vec![0.0; rows as usize]),
                Section::f32s(SectionKind::Zero, 0, &vec![0.0; rows as usize]),
                Section::packed(
                    SectionKind::Index,
                    0,
                    bits,
                    n as u32,
                    vec![0; crate::kernels::bitpack::packed_len(n, u32::from(bits))],
                ),
            ];
            let meta = PageMeta {
                tensor: 0,
                token_start: 0,
                tokens: 1,
                codec: 0,
            };
            let frame = PageFrame::encode(meta, &sections, None, 64).unwrap();
            let body = &frame.bytes[64..64 + frame.header.body_len as usize];
            assert_eq!(l.template(), body, "rows {rows} d {d} bits {bits}");
            assert_eq!(l.sections(body), sections);
            assert_eq!(CanonicalBody::new(l.specs.clone()).unwrap(), l);
        }
    }
}
