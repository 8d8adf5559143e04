//! Page frames built on the device (`kernels/frame.cu`): the plan that
//! turns page bodies encoded in device memory into a complete kvpack file
//! in another device buffer, without the bodies passing through the host.
//!
//! The host writes everything but the bodies with the ordinary
//! [`Writer`] into a [`Skeleton`] (the header, each page header with a
//! placeholder body CRC, each body's section table, the index and the
//! trailer: a few kB per layer). The device then
//!
//! 1. zeroes the output (frame padding),
//! 2. copies the skeleton's pieces and each body's sections to their file
//!    offsets (`frame_copy`),
//! 3. computes the CRC-32 of every stored body (`frame_crc`),
//! 4. writes each body CRC into its page header and index entry and the
//!    page header's own CRC (`frame_seal_pages`),
//! 5. computes the index body's CRC and writes it and the index header's
//!    CRC (`frame_crc`, `frame_seal_index`).
//!
//! The trailer does not depend on any CRC of the data and is final on the
//! host. The result is byte-identical to the file the host writes from the
//! same bodies (format/SPEC.md sections 5 and 6; tests/gpu.rs compares
//! them). Nothing here touches a device.

use bytemuck::{Pod, Zeroable};

use crate::error::{Error, Result};
use crate::format::{FRAME_HEADER_LEN, FileHeader, PageHeader, PageMeta, Skeleton, Writer};
use crate::gpu::body::CanonicalBody;

/// One copy of `frame_copy` (mirrors `FrameCopy` in `kernels/frame.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub(crate) struct FrameCopy {
    /// Source device address.
    pub src: u64,
    /// Destination device address.
    pub dst: u64,
    /// Bytes.
    pub len: u64,
}

/// One span of `frame_crc` (mirrors `FrameCrcSpan`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub(crate) struct FrameCrcSpan {
    /// Device address of the first byte.
    pub at: u64,
    /// Bytes.
    pub len: u64,
}

/// One page of `frame_seal_pages` (mirrors `FrameSeal`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub(crate) struct FrameSeal {
    /// Device address of the page header.
    pub header: u64,
    /// Device address of the page's index entry's `body_crc` field.
    pub entry_crc: u64,
}

/// Bytes a `frame_copy` work item moves (one thread block).
pub(crate) const COPY_CHUNK: u64 = 1 << 16;

/// Offset of an index entry's `body_crc` field in the entry (SPEC 5.2).
const ENTRY_CRC: u64 = 32;

/// One page of a [`DeviceFile`]: where its header and body go, and its
/// section table's length (the device copies the body after it).
#[derive(Debug, Clone, Copy)]
pub(crate) struct DevicePage {
    /// File offset of the page header.
    pub header_at: u64,
    /// File offset of the stored body.
    pub body_at: u64,
    /// Body length, bytes.
    pub body_len: u64,
    /// Bytes of the section table and its padding at the body's start.
    pub table_len: u64,
}

/// A kvpack file whose page bodies are in device memory: every other byte
/// (module docs), where each body goes, and where the CRCs are.
#[derive(Debug)]
pub(crate) struct DeviceFile {
    /// The header, page headers, section tables, index and trailer with
    /// their file offsets.
    pub skeleton: Skeleton,
    /// The pages, in file order.
    pub pages: Vec<DevicePage>,
    /// File offset of the index frame.
    pub index_at: u64,
    /// Bytes of the index body.
    pub index_body_len: u64,
    /// File offset of the first index entry.
    pub entries_at: u64,
}

impl DeviceFile {
    /// The file with header `header` and one page per `(meta, body)` of
    /// `pages` (in file order, each body a canonical body laid out by
    /// `body`), stored uncompressed, with the token ids `token_ids`.
    ///
    /// # Errors
    /// As [`Writer::write_parts`] (pages out of order, tokens that do not
    /// tile the tensors); [`Error::Parameter`] for a body with over 65535
    /// sections.
    pub fn new(
        header: &FileHeader,
        pages: &[(PageMeta, &CanonicalBody)],
        token_ids: &[u32],
    ) -> Result<DeviceFile> {
        let mut w = Writer::new(Skeleton::default(), header)?;
        let mut placed = Vec::with_capacity(pages.len());
        for (meta, body) in pages {
            let n = u16::try_from(body.specs.len())
                .map_err(|_| Error::param("internal: over 65535 sections"))?;
            let len = u64::from(body.body_len);
            let h = PageHeader {
                meta: *meta,
                flags: 0,
                n_sections: n,
                stored_len: len,
                body_len: len,
                body_crc: 0,
            };
            let at = w.write_header_only(&h)?;
            let mut table = vec![0u8; (16 * body.specs.len()).next_multiple_of(64)];
            body.write_table(&mut table);
            w.skeleton().place(at, &table);
            placed.push(DevicePage {
                header_at: at - FRAME_HEADER_LEN as u64,
                body_at: at,
                body_len: len,
                table_len: table.len() as u64,
            });
        }
        let (skeleton, trailer) = w.commit(token_ids)?;
        let index_at = trailer.header_len + trailer.index_offset;
        let entries_at = index_at + FRAME_HEADER_LEN as u64 + 4 * header.tensors.len() as u64;
        let index_body_len = 4 * header.tensors.len() as u64
            + crate::format::ENTRY_LEN as u64 * placed.len() as u64
            + 4 * token_ids.len() as u64;
        Ok(DeviceFile {
            skeleton,
            pages: placed,
            index_at,
            index_body_len,
            entries_at,
        })
    }

    /// File length, bytes.
    pub fn len(&self) -> u64 {
        self.skeleton.len
    }

    /// The launches' tables for the file written at device address `out`,
    /// the skeleton's bytes at `skeleton` and page `i`'s body at
    /// `bodies[i]`: the copies and their work items `(copy, chunk)`, the
    /// CRC spans of the page bodies, the seals, and the index body's span.
    ///
    /// # Errors
    /// [`Error::Parameter`] (internal) when `bodies` does not hold one
    /// address per page or a copy needs over 2^32 work items.
    pub fn launches(&self, out: u64, skeleton: u64, bodies: &[u64]) -> Result<FrameLaunches> {
        if bodies.len() != self.pages.len() {
            return Err(Error::param("internal: one body address per page"));
        }
        let mut copies: Vec<FrameCopy> = self
            .skeleton
            .pieces
            .iter()
            .map(|&(at, off, len)| FrameCopy {
                src: skeleton + off as u64,
                dst: out + at,
                len: len as u64,
            })
            .collect();
        let mut spans = Vec::with_capacity(self.pages.len());
        let mut seals = Vec::with_capacity(self.pages.len());
        for (i, (p, &b)) in self.pages.iter().zip(bodies).enumerate() {
            copies.push(FrameCopy {
                src: b + p.table_len,
                dst: out + p.body_at + p.table_len,
                len: p.body_len - p.table_len,
            });
            spans.push(FrameCrcSpan {
                at: out + p.body_at,
                len: p.body_len,
            });
            seals.push(FrameSeal {
                header: out + p.header_at,
                entry_crc: out
                    + self.entries_at
                    + crate::format::ENTRY_LEN as u64 * i as u64
                    + ENTRY_CRC,
            });
        }
        let mut work = Vec::new();
        for (i, c) in copies.iter().enumerate() {
            for j in 0..c.len.div_ceil(COPY_CHUNK) {
                work.push([
                    u32::try_from(i).map_err(|_| Error::param("internal: too many copies"))?,
                    u32::try_from(j).map_err(|_| Error::param("internal: copy too long"))?,
                ]);
            }
        }
        Ok(FrameLaunches {
            copies,
            work,
            spans,
            seals,
            index_span: FrameCrcSpan {
                at: out + self.index_at + FRAME_HEADER_LEN as u64,
                len: self.index_body_len,
            },
            index_header: out + self.index_at,
        })
    }
}

/// The tables of one device framing ([`DeviceFile::launches`]).
#[derive(Debug)]
pub(crate) struct FrameLaunches {
    /// `frame_copy` copies.
    pub copies: Vec<FrameCopy>,
    /// `frame_copy` work items `(copy, chunk)`, one per block.
    pub work: Vec<[u32; 2]>,
    /// `frame_crc` spans of the page bodies, in page order.
    pub spans: Vec<FrameCrcSpan>,
    /// `frame_seal_pages` seals, in page order.
    pub seals: Vec<FrameSeal>,
    /// The index body.
    pub index_span: FrameCrcSpan,
    /// Device address of the index frame header.
    pub index_header: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{DType, Kind, TensorInfo};
    use crate::format::{CodecEntry, PageFrame, Section, SectionKind, VERSION_MAJOR};

    /// Replays the device's steps on the host (zeroed file, pieces, bodies,
    /// CRCs, seals) and compares with the host writer's file.
    #[test]
    fn replayed_skeleton_is_the_writers_file() {
        let info = |kind, name: &str| TensorInfo {
            name: name.into(),
            layer: 0,
            kind,
            dtype: DType::Bf16,
            batch: 1,
            heads: 2,
            tokens: 5,
            head_dim: 8,
        };
        for align_log2 in [6u8, 8] {
            let header = FileHeader {
                version_major: VERSION_MAJOR,
                version_minor: 0,
                align_log2,
                tensors: vec![info(Kind::Key, "k"), info(Kind::Value, "v")],
                codecs: vec![CodecEntry {
                    id: crate::codec::raw::ID,
                    params: Vec::new(),
                }],
                metadata: Default::default(),
                page_tokens: 3,
                sink_tokens: 0,
                recent_tokens: 0,
            };
            let mut bodies = Vec::new();
            let mut metas = Vec::new();
            for (t, (start, tokens)) in
                [(0u32, (0u32, 3u32)), (0, (3, 2)), (1, (0, 3)), (1, (3, 2))]
            {
                let n = 2 * tokens as usize * 8;
                let vals: Vec<u16> = (0..n)
                    .map(|i| (i as u16).wrapping_mul(7919) ^ (t as u16) << 9)
                    .collect();
                let sections = vec![Section {
                    kind: SectionKind::Raw,
                    stream: 0,
                    elem: crate::format::ElemType::Bf16,
                    count: n as u32,
                    data: bytemuck::cast_slice(&vals).to_vec(),
                }];
                let meta = PageMeta {
                    tensor: t,
                    token_start: start,
                    tokens,
                    codec: 0,
                };
                let f = PageFrame::encode(meta, &sections, None, 1 << align_log2).unwrap();
                let body = f.bytes[64..64 + f.header.body_len as usize].to_vec();
                let layout = CanonicalBody::new(vec![crate::gpu::body::SectionSpec {
                    kind: SectionKind::Raw,
                    stream: 0,
                    elem: crate::format::ElemType::Bf16,
                    count: n as u32,
                    len: 2 * n as u32,
                }])
                .unwrap();
                metas.push((meta, layout));
                bodies.push((f, body));
            }
            let mut w = Writer::new(Vec::new(), &header).unwrap();
            for (f, _) in &bodies {
                w.write_page(f).unwrap();
            }
            let (want, _) = w.commit(&[7, 8]).unwrap();

            let pages: Vec<(PageMeta, &CanonicalBody)> =
                metas.iter().map(|(m, l)| (*m, l)).collect();
            let file = DeviceFile::new(&header, &pages, &[7, 8]).unwrap();
            assert_eq!(file.len(), want.len() as u64);
            // "Device" memory: the file at 1 << 20, skeleton at 1 << 24,
            // bodies at (1 << 28) + i << 16.
            let (out, sk) = (1u64 << 20, 1u64 << 24);
            let addrs: Vec<u64> = (0..bodies.len() as u64)
                .map(|i| (1 << 28) + (i << 16))
                .collect();
            let l = file.launches(out, sk, &addrs).unwrap();
            let mut got = vec![0u8; file.len() as usize];
            for c in &l.copies {
                let dst = (c.dst - out) as usize..(c.dst - out + c.len) as usize;
                if c.src >= 1 << 28 {
                    let i = ((c.src - (1 << 28)) >> 16) as usize;
                    let off = (c.src - addrs[i]) as usize;
                    got[dst].copy_from_slice(&bodies[i].1[off..off + c.len as usize]);
                } else {
                    let off = (c.src - sk) as usize;
                    got[dst].copy_from_slice(&file.skeleton.bytes[off..off + c.len as usize]);
                }
            }
            for (s, seal) in l.spans.iter().zip(&l.seals) {
                let at = (s.at - out) as usize;
                let crc = crc32fast::hash(&got[at..at + s.len as usize]).to_le_bytes();
                let h = (seal.header - out) as usize;
                got[h + 40..h + 44].copy_from_slice(&crc);
                let e = (seal.entry_crc - out) as usize;
                got[e..e + 4].copy_from_slice(&crc);
                let hc = crc32fast::hash(&got[h..h + 60]).to_le_bytes();
                got[h + 60..h + 64].copy_from_slice(&hc);
            }
            let at = (l.index_span.at - out) as usize;
            let crc = crc32fast::hash(&got[at..at + l.index_span.len as usize]).to_le_bytes();
            let h = (l.index_header - out) as usize;
            got[h + 40..h + 44].copy_from_slice(&crc);
            let hc = crc32fast::hash(&got[h..h + 60]).to_le_bytes();
            got[h + 60..h + 64].copy_from_slice(&hc);
            assert_eq!(got, want, "align_log2 {align_log2}");
        }
    }
}
