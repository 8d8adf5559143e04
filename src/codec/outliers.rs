//! The outlier side table (format/SPEC.md section 6.5): values a codec
//! stores exactly (fp16) instead of quantizing, with their positions as a
//! sorted list or a bitmap, whichever is smaller.

use half::f16;

use crate::error::{Error, Result};
use crate::format::{ElemType, PageView, Section, SectionKind};

/// A decoded outlier table.
///
/// Positions count entries of `unit` values in plane-major row order:
/// `position = row * (head_dim / unit) + j` for entry `j` of a row.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct OutlierTable {
    /// Values per entry (1 for single elements, 4 for a quaternion chunk).
    pub unit: u8,
    /// Number of possible positions (rows x entries per row).
    pub universe: u32,
    /// Strictly ascending positions.
    pub positions: Vec<u32>,
    /// `positions.len() * unit` values in position order.
    pub values: Vec<f16>,
}

const LIST: u8 = 0;
const BITMAP: u8 = 1;

impl OutlierTable {
    /// An empty table for `universe` positions of `unit` values.
    pub fn new(unit: u8, universe: u32) -> Self {
        OutlierTable {
            unit,
            universe,
            positions: Vec::new(),
            values: Vec::new(),
        }
    }

    /// Adds an entry; positions must be pushed in ascending order.
    ///
    /// # Panics
    /// If `pos` is not above the last position, not below `universe`, or
    /// `vals.len() != unit`.
    pub fn push(&mut self, pos: u32, vals: &[f32]) {
        assert!(pos < self.universe && self.positions.last().is_none_or(|&l| l < pos));
        assert_eq!(vals.len(), self.unit as usize);
        self.positions.push(pos);
        self.values.extend(vals.iter().map(|&v| f16::from_f32(v)));
    }

    /// Bytes of the list encoding and of the bitmap encoding.
    fn sizes(&self) -> (usize, usize) {
        (
            4 * self.positions.len(),
            (self.universe as usize).div_ceil(8),
        )
    }

    /// Serializes into an OUTLIERS section (stream 0), picking the smaller
    /// position encoding.
    pub fn to_section(&self) -> Section {
        let (list, bitmap) = self.sizes();
        let enc = if bitmap < list { BITMAP } else { LIST };
        let mut d = Vec::with_capacity(12 + list.min(bitmap) + 2 * self.values.len());
        d.extend_from_slice(&(self.positions.len() as u32).to_le_bytes());
        d.extend_from_slice(&[self.unit, enc, 0, 0]);
        d.extend_from_slice(&self.universe.to_le_bytes());
        if enc == LIST {
            for p in &self.positions {
                d.extend_from_slice(&p.to_le_bytes());
            }
        } else {
            let mut bm = vec![0u8; bitmap];
            for &p in &self.positions {
                bm[p as usize / 8] |= 1 << (p % 8);
            }
            d.extend_from_slice(&bm);
        }
        for v in &self.values {
            d.extend_from_slice(&v.to_le_bytes());
        }
        Section {
            kind: SectionKind::Outliers,
            stream: 0,
            elem: ElemType::Bytes,
            count: d.len() as u32,
            data: d,
        }
    }

    /// Reads the OUTLIERS section of `page`, checking it against the
    /// expected `unit` and `universe`. A missing section is an empty table.
    ///
    /// # Errors
    /// [`Error::Format`] naming the page for any inconsistency (counts,
    /// unsorted or out-of-range positions, wrong bitmap population, length).
    pub fn from_page(page: &PageView<'_>, unit: u8, universe: u32) -> Result<OutlierTable> {
        let Some(d) = page
            .sections()
            .iter()
            .find(|d| d.kind == SectionKind::Outliers && d.stream == 0)
        else {
            return Ok(OutlierTable::new(unit, universe));
        };
        if d.elem != ElemType::Bytes {
            return Err(page.error("OUTLIERS section must have element type bytes"));
        }
        let (_, b) = page.section(SectionKind::Outliers, 0)?;
        let bad = |m: &str| -> Error { page.error(format!("outlier table: {m}")) };
        if b.len() < 12 {
            return Err(bad("shorter than its 12-byte header"));
        }
        let n = u32::from_le_bytes(b[0..4].try_into().expect("4")) as usize;
        let (u, enc) = (b[4], b[5]);
        let uni = u32::from_le_bytes(b[8..12].try_into().expect("4"));
        if u != unit || uni != universe || b[6] != 0 || b[7] != 0 {
            return Err(bad(&format!(
                "unit {u} / universe {uni} (expected {unit} / {universe}) or reserved bytes set"
            )));
        }
        if n > universe as usize {
            return Err(bad("more entries than positions"));
        }
        let pos_len = match enc {
            LIST => 4 * n,
            BITMAP => (universe as usize).div_ceil(8),
            _ => return Err(bad(&format!("unknown position encoding {enc}"))),
        };
        let want = 12 + pos_len + 2 * n * unit as usize;
        if b.len() != want {
            return Err(bad(&format!("{} bytes, expected {want}", b.len())));
        }
        let pb = &b[12..12 + pos_len];
        let mut positions = Vec::with_capacity(n);
        if enc == LIST {
            for c in pb.chunks_exact(4) {
                let p = u32::from_le_bytes(c.try_into().expect("4"));
                if p >= universe || positions.last().is_some_and(|&l| l >= p) {
                    return Err(bad("positions not strictly ascending or out of range"));
                }
                positions.push(p);
            }
        } else {
            for (i, &byte) in pb.iter().enumerate() {
                for k in 0..8 {
                    if byte >> k & 1 == 1 {
                        let p = (i * 8 + k) as u32;
                        if p >= universe {
                            return Err(bad("bitmap bit set past the universe"));
                        }
                        positions.push(p);
                    }
                }
            }
            if positions.len() != n {
                return Err(bad("bitmap population differs from the entry count"));
            }
        }
        let values = b[12 + pos_len..]
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]))
            .collect();
        Ok(OutlierTable {
            unit,
            universe,
            positions,
            values,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{PageFrame, PageMeta};

    #[test]
    fn list_and_bitmap_round_trip_and_the_smaller_is_chosen() {
        for (universe, positions) in [
            (1000u32, vec![3u32, 17, 999]),
            (64, (0..40).collect::<Vec<_>>()),
        ] {
            let mut t = OutlierTable::new(4, universe);
            for &p in &positions {
                t.push(p, &[p as f32, 1.0, -2.0, 0.5]);
            }
            let s = t.to_section();
            assert_eq!(
                s.data[5],
                if positions.len() * 4 > (universe as usize).div_ceil(8) {
                    BITMAP
                } else {
                    LIST
                }
            );
            // Put it in a page to read it back through the public path.
            let frame = PageFrame::encode(
                PageMeta {
                    tensor: 0,
                    token_start: 0,
                    tokens: 1,
                    codec: 0,
                },
                &[s],
                None,
                64,
            )
            .unwrap();
            let h = crate::format::PageHeader::parse(
                frame.bytes[..64].try_into().unwrap(),
                &crate::Location::Header,
                &Default::default(),
            )
            .unwrap();
            let view = PageView::from_stored(
                h,
                std::borrow::Cow::Borrowed(&frame.bytes[64..64 + h.stored_len as usize]),
                0,
                "t".into(),
                &crate::Location::Header,
            )
            .unwrap();
            let back = OutlierTable::from_page(&view, 4, universe).unwrap();
            assert_eq!(back, t);
            assert!(OutlierTable::from_page(&view, 1, universe).is_err());
        }
    }
}
