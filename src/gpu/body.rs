//! The canonical body layout of an encoded page (format/SPEC.md 6.2) for a
//! list of sections known before encoding: the section table filled in and
//! every section zeroed, for encode kernels to write into, and the split of
//! the finished body back into the sections the CPU encoder returns.

use crate::error::{Error, Result};
use crate::format::{ElemType, Section, SectionKind};

use super::spec::AffineBody;

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
        for (i, (s, &off)) in self.specs.iter().zip(&self.offsets).enumerate() {
            let (code, bits) = s.elem.code_bits();
            let e = &mut b[16 * i..16 * (i + 1)];
            e[0] = s.kind.code();
            e[1] = s.stream;
            e[2] = code;
            e[3] = bits;
            e[4..8].copy_from_slice(&s.count.to_le_bytes());
            e[8..12].copy_from_slice(&off.to_le_bytes());
            e[12..16].copy_from_slice(&s.len.to_le_bytes());
        }
        b
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

impl From<&AffineBody> for CanonicalBody {
    fn from(l: &AffineBody) -> CanonicalBody {
        let spec = |kind, elem, count, len| SectionSpec {
            kind,
            stream: 0,
            elem,
            count,
            len,
        };
        CanonicalBody {
            specs: vec![
                spec(SectionKind::Scale, ElemType::F32, l.rows, l.lens[0]),
                spec(SectionKind::Zero, ElemType::F32, l.rows, l.lens[1]),
                spec(
                    SectionKind::Index,
                    ElemType::Packed(l.bits),
                    l.rows * l.head_dim,
                    l.lens[2],
                ),
            ],
            offsets: l.offsets.to_vec(),
            body_len: l.body_len,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn affine_layout_is_the_same_canonical_body() {
        let l = AffineBody::new(33, 96, 3).unwrap();
        let c = CanonicalBody::from(&l);
        assert_eq!(c.template(), l.template());
        assert_eq!(CanonicalBody::new(c.specs.clone()).unwrap(), c);
        let body = l.template();
        assert_eq!(c.sections(&body), l.sections(&body));
    }
}
