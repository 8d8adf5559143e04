//! The container writer over any `Write`: header, page frames in layer-major
//! order, then the index and trailer of the commit. The same bytes serve as
//! a random-access file and as a stream.

use std::io::{Read, Write};

use crate::error::{Error, Result};

use super::index::{Index, IndexEntry, Trailer};
use super::page::{PageFrame, PageHeader};
use super::{FRAME_HEADER_LEN, FileHeader};

/// Writes one commit (a new file, or an append to an existing one).
///
/// Pages must arrive in layer-major order: ascending tensor index, and for
/// each tensor contiguous token ranges continuing where the previous commit
/// stopped. [`Writer::commit`] writes the index and trailer; until then a
/// reader of the file still sees the previous commit.
#[derive(Debug)]
pub struct Writer<W: Write> {
    out: W,
    header_len: u64,
    align: u64,
    pos: u64,
    generation: u32,
    prev_index: Option<u64>,
    expected_tokens: Option<Vec<u32>>,
    next_token: Vec<u32>,
    last_tensor: Option<u32>,
    entries: Vec<IndexEntry>,
    bytes_written: u64,
}

impl<W: Write> Writer<W> {
    /// Starts a new file: writes the header. The commit must cover exactly
    /// the token counts of `header.tensors`.
    ///
    /// # Errors
    /// [`Error::Parameter`] for an invalid header; [`Error::Io`] on write
    /// failure.
    pub fn new(mut out: W, header: &FileHeader) -> Result<Writer<W>> {
        let bytes = header.encode()?;
        out.write_all(&bytes)
            .map_err(|e| Error::io("writing the kvpack header", e))?;
        Ok(Writer {
            out,
            header_len: bytes.len() as u64,
            align: header.align(),
            pos: 0,
            generation: 0,
            prev_index: None,
            expected_tokens: Some(header.tensors.iter().map(|t| t.tokens).collect()),
            next_token: vec![0; header.tensors.len()],
            last_tensor: None,
            entries: Vec::new(),
            bytes_written: bytes.len() as u64,
        })
    }

    /// Continues an existing file after its last commit (append). `out`
    /// must be positioned at file offset `header_len + trailer.commit_end`.
    /// New pages extend tensors past `index.token_counts`.
    ///
    /// # Errors
    /// [`Error::Io`] when writing alignment padding fails.
    pub fn resume(
        mut out: W,
        header: &FileHeader,
        header_len: u64,
        index: &Index,
        trailer: &Trailer,
    ) -> Result<Writer<W>> {
        let align = header.align();
        let pos = super::align_up(trailer.commit_end, align);
        let pad = (pos - trailer.commit_end) as usize;
        out.write_all(&vec![0u8; pad])
            .map_err(|e| Error::io("writing padding", e))?;
        Ok(Writer {
            out,
            header_len,
            align,
            pos,
            generation: index.generation + 1,
            prev_index: Some(trailer.index_offset),
            expected_tokens: None,
            next_token: index.token_counts.clone(),
            last_tensor: None,
            entries: index.entries.clone(),
            bytes_written: pad as u64,
        })
    }

    /// Writes one page frame (from [`PageFrame::encode`] with this file's
    /// alignment).
    ///
    /// # Errors
    /// [`Error::Parameter`] when the page breaks layer-major order or leaves
    /// a gap in its tensor's tokens; [`Error::Io`] on write failure.
    pub fn write_page(&mut self, frame: &PageFrame) -> Result<()> {
        self.check_page(&frame.header, frame.bytes.len() as u64)?;
        self.out.write_all(&frame.bytes).map_err(|e| {
            Error::io(
                format!("writing page for tensor {}", frame.header.meta.tensor),
                e,
            )
        })?;
        self.push_entry(&frame.header, frame.bytes.len() as u64);
        Ok(())
    }

    /// Appends the frame of `header` whose stored body is `stored` (its
    /// `header.stored_len` bytes, CRC in the header): header, body and zero
    /// padding, written straight from `stored` (no frame buffer). Same
    /// rules as [`Writer::write_page`].
    ///
    /// # Errors
    /// As [`Writer::write_page`]; [`Error::Parameter`] when `stored` is not
    /// `header.stored_len` bytes long.
    pub fn write_parts(&mut self, header: &PageHeader, stored: &[u8]) -> Result<()> {
        if stored.len() as u64 != header.stored_len {
            return Err(Error::param("page body length differs from its header"));
        }
        let len = header.frame_len(self.align);
        self.check_page(header, len)?;
        let pad = len - FRAME_HEADER_LEN as u64 - header.stored_len;
        let what = || format!("writing page for tensor {}", header.meta.tensor);
        self.out
            .write_all(&header.encode())
            .and_then(|()| self.out.write_all(stored))
            .and_then(|()| {
                std::io::copy(&mut std::io::repeat(0).take(pad), &mut self.out).map(|_| ())
            })
            .map_err(|e| Error::io(what(), e))?;
        self.push_entry(header, len);
        Ok(())
    }

    /// Checks that a frame of `header`, `len` bytes, may come next.
    fn check_page(&self, header: &PageHeader, len: u64) -> Result<()> {
        let m = header.meta;
        let t = m.tensor as usize;
        if t >= self.next_token.len() {
            return Err(Error::param(format!(
                "page for tensor {t}, the file has {}",
                self.next_token.len()
            )));
        }
        if self.last_tensor.is_some_and(|l| l > m.tensor) {
            return Err(Error::param(format!(
                "page for tensor {} after tensor {}: pages must be written in layer-major order",
                m.tensor,
                self.last_tensor.unwrap_or(0)
            )));
        }
        if m.token_start != self.next_token[t] {
            return Err(Error::param(format!(
                "page for tensor {t} starts at token {}, expected {}",
                m.token_start, self.next_token[t]
            )));
        }
        if !len.is_multiple_of(self.align) {
            return Err(Error::param("page frame was encoded for another alignment"));
        }
        Ok(())
    }

    /// Records a written frame of `header`, `len` bytes.
    fn push_entry(&mut self, header: &PageHeader, len: u64) {
        let m = header.meta;
        self.entries.push(IndexEntry {
            offset: self.pos,
            frame_len: len,
            meta: m,
            flags: header.flags,
            body_crc: header.body_crc,
        });
        self.next_token[m.tensor as usize] = m.token_start + m.tokens;
        self.last_tensor = Some(m.tensor);
        self.pos += len;
        self.bytes_written += len;
    }

    /// Bytes written so far (header included for a new file).
    pub fn bytes_written(&self) -> u64 {
        self.bytes_written
    }

    /// Writes the index and trailer, flushes, and returns the sink and the
    /// trailer. After this the commit is complete.
    ///
    /// # Errors
    /// [`Error::Parameter`] when a new file's tensors are not fully covered
    /// by pages; [`Error::Io`] on write failure.
    pub fn commit(self, token_ids: &[u32]) -> Result<(W, Trailer)> {
        self.commit_durable(token_ids, &mut |_| Ok(()))
    }

    /// Like [`Writer::commit`], calling `sync` after the index is written
    /// and again after the trailer, so that the trailer reaches the disk only
    /// after the pages and index it commits (format/SPEC.md section 10.1).
    /// For a file, `sync` flushes user-space buffers and calls
    /// `File::sync_data`.
    ///
    /// # Errors
    /// As [`Writer::commit`]; [`Error::Io`] when `sync` fails.
    pub fn commit_durable(
        mut self,
        token_ids: &[u32],
        sync: &mut dyn FnMut(&mut W) -> std::io::Result<()>,
    ) -> Result<(W, Trailer)> {
        if let Some(exp) = &self.expected_tokens
            && let Some(t) = (0..exp.len()).find(|&t| exp[t] != self.next_token[t])
        {
            return Err(Error::param(format!(
                "tensor {t} has {} tokens but pages cover {}",
                exp[t], self.next_token[t]
            )));
        }
        let index = Index {
            generation: self.generation,
            prev_index: self.prev_index,
            token_counts: self.next_token.clone(),
            entries: std::mem::take(&mut self.entries),
            token_ids: token_ids.to_vec(),
        };
        let frame = index.encode(self.align);
        let trailer = Trailer {
            generation: self.generation,
            index_offset: self.pos,
            index_frame_len: frame.len() as u64,
            commit_end: self.pos + frame.len() as u64 + FRAME_HEADER_LEN as u64,
            header_len: self.header_len,
        };
        self.out
            .write_all(&frame)
            .map_err(|e| Error::io("writing the index", e))?;
        self.out.flush().map_err(|e| Error::io("flushing", e))?;
        sync(&mut self.out).map_err(|e| Error::io("syncing pages and index", e))?;
        self.out
            .write_all(&trailer.encode())
            .map_err(|e| Error::io("writing the trailer", e))?;
        self.out.flush().map_err(|e| Error::io("flushing", e))?;
        sync(&mut self.out).map_err(|e| Error::io("syncing the trailer", e))?;
        Ok((self.out, trailer))
    }
}

/// A [`Write`] sink for a file whose page bodies are written elsewhere (a
/// device buffer, `gpu::frame`): it keeps every byte the [`Writer`] emits
/// (header, page headers, index, trailer) with its file offset, and
/// [`Writer::write_header_only`] advances it past each body and its padding
/// without bytes.
#[derive(Debug, Default)]
pub(crate) struct Skeleton {
    /// File length so far, bytes.
    pub len: u64,
    /// The kept bytes, in file order.
    pub bytes: Vec<u8>,
    /// `(file offset, offset in bytes, length)` of each contiguous piece.
    pub pieces: Vec<(u64, usize, usize)>,
}

impl Skeleton {
    /// Keeps `b` at file offset `at` (a piece the writer does not emit,
    /// such as a body's section table).
    pub(crate) fn place(&mut self, at: u64, b: &[u8]) {
        match self.pieces.last_mut() {
            Some((off, _, n)) if *off + *n as u64 == at => *n += b.len(),
            _ => self.pieces.push((at, self.bytes.len(), b.len())),
        }
        self.bytes.extend_from_slice(b);
    }
}

impl Write for Skeleton {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.place(self.len, b);
        self.len += b.len() as u64;
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Writer<Skeleton> {
    /// Emits the page header `header` (whose `body_crc` and header CRC the
    /// body's owner fills in later) and skips the stored body and the
    /// frame padding, which the caller writes (the padding as zeros).
    /// Returns the file offset of the stored body.
    ///
    /// # Errors
    /// As [`Writer::write_parts`].
    pub(crate) fn write_header_only(&mut self, header: &PageHeader) -> Result<u64> {
        let len = header.frame_len(self.align);
        self.check_page(header, len)?;
        self.out
            .write_all(&header.encode())
            .map_err(|e| Error::io("writing a page header", e))?;
        let at = self.out.len;
        self.out.len += len - FRAME_HEADER_LEN as u64;
        self.push_entry(header, len);
        Ok(at)
    }

    /// The sink, to [`Skeleton::place`] bytes the writer does not emit.
    pub(crate) fn skeleton(&mut self) -> &mut Skeleton {
        &mut self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{DType, Kind, TensorInfo};
    use crate::format::{CodecEntry, PageMeta, Section, SectionKind, VERSION_MAJOR};

    /// A frame written from its canonical body ([`Writer::write_parts`])
    /// is the frame [`PageFrame::encode`] makes of its sections, for both
    /// alignments (64: no padding; 4096: padded), and so is the file.
    #[test]
    fn frames_from_bodies_equal_frames_from_sections() {
        let sections = vec![
            Section::f32s(SectionKind::Scale, 0, &[1.5, -2.0, 3.25]),
            Section::packed(SectionKind::Index, 0, 3, 7, vec![0xa5, 0x3c, 0x7e]),
        ];
        for align_log2 in [6u8, 12] {
            let header = FileHeader {
                version_major: VERSION_MAJOR,
                version_minor: 0,
                align_log2,
                tensors: vec![TensorInfo {
                    name: "k".into(),
                    layer: 0,
                    kind: Kind::Key,
                    dtype: DType::Bf16,
                    batch: 1,
                    heads: 1,
                    tokens: 4,
                    head_dim: 8,
                }],
                codecs: vec![CodecEntry {
                    id: crate::codec::raw::ID,
                    params: Vec::new(),
                }],
                metadata: Default::default(),
                page_tokens: 4,
                sink_tokens: 0,
                recent_tokens: 0,
            };
            let meta = PageMeta {
                tensor: 0,
                token_start: 0,
                tokens: 4,
                codec: 0,
            };
            let align = 1u64 << align_log2;
            let frame = PageFrame::encode(meta, &sections, None, align).unwrap();
            let body =
                &frame.bytes[crate::format::FRAME_HEADER_LEN..][..frame.header.body_len as usize];
            let h = PageFrame::body_header(meta, body, 2).unwrap();
            assert_eq!(h, frame.header);
            let from = PageFrame::from_body(meta, body, 2, None, align).unwrap();
            assert_eq!(from, frame);
            let mut a = Writer::new(Vec::new(), &header).unwrap();
            a.write_page(&frame).unwrap();
            let mut b = Writer::new(Vec::new(), &header).unwrap();
            b.write_parts(&h, body).unwrap();
            assert!(b.write_parts(&h, &body[1..]).is_err());
            assert_eq!(a.commit(&[]).unwrap().0, b.commit(&[]).unwrap().0);
        }
    }
}
