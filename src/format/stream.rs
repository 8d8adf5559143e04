//! Streaming reader over any `Read`: yields each page as soon as its bytes
//! and checksum have arrived, holding one page in memory at a time, and
//! the commit (index + trailer) that ends the stream.

use std::borrow::Cow;
use std::io::{ErrorKind, Read};

use crate::error::{Error, FormatCause, Location, Result};

use super::bytes::check_zero_padding;
use super::index::{INDEX_MAGIC, Index, IndexEntry, Trailer};
use super::page::{PAGE_MAGIC, PageHeader, PageView};
use super::reader::validate_index;
use super::{FRAME_HEADER_LEN, FileHeader, Limits};

/// One item of a stream.
#[derive(Debug)]
pub enum StreamEvent {
    /// A validated page (CRC checked, section table parsed).
    Page(PageView<'static>),
    /// A commit: the index listing every page so far, and its trailer. The
    /// pages received so far are now complete and consistent.
    Commit(Index, Trailer),
}

/// Reads a kvpack byte stream front to back.
#[derive(Debug)]
pub struct StreamReader<R: Read> {
    r: R,
    header: FileHeader,
    header_len: u64,
    limits: Limits,
    pos: u64,
    entries: Vec<IndexEntry>,
    gen_starts: Vec<usize>,
    next_token: Vec<u32>,
    last_tensor: Option<u32>,
    generation: u32,
    prev_index: Option<u64>,
    committed: bool,
    done: bool,
}

/// Reads exactly `buf.len()` bytes; `Ok(false)` on a clean EOF before the
/// first byte.
fn read_full<R: Read>(r: &mut R, buf: &mut [u8], what: &dyn Fn() -> Location) -> Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => {
                return Err(Error::format_with(
                    FormatCause::Truncated,
                    what(),
                    format!("stream truncated: {got} of {} bytes arrived", buf.len()),
                ));
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io(format!("reading {}", what()), e)),
        }
    }
    Ok(true)
}

/// Reads exactly `n` bytes into a buffer that grows with the bytes that
/// actually arrive (a sender declaring a huge frame and sending nothing
/// costs nothing); `Ok(None)` on a clean EOF before the first byte.
fn read_growing<R: Read>(
    r: &mut R,
    n: u64,
    what: &dyn Fn() -> Location,
) -> Result<Option<Vec<u8>>> {
    const CHUNK: u64 = 1 << 20;
    let mut buf = Vec::with_capacity(n.min(CHUNK) as usize);
    while (buf.len() as u64) < n {
        let start = buf.len();
        let step = (n - start as u64).min(CHUNK.max(start as u64)) as usize;
        buf.resize(start + step, 0);
        let got = read_full(r, &mut buf[start..], what);
        match got {
            Ok(true) => {}
            Ok(false) if start == 0 => return Ok(None),
            Ok(false) => {
                return Err(Error::format(
                    what(),
                    format!("stream truncated: {start} of {n} bytes arrived"),
                ));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(Some(buf))
}

impl<R: Read> StreamReader<R> {
    /// Reads and validates the header.
    ///
    /// # Errors
    /// [`Error::Format`] for a bad or truncated header; [`Error::Io`] when
    /// reading fails.
    pub fn new(r: R) -> Result<Self> {
        Self::with_limits(r, Limits::default())
    }

    /// Like [`StreamReader::new`] with explicit limits.
    ///
    /// # Errors
    /// As [`StreamReader::new`].
    pub fn with_limits(mut r: R, limits: Limits) -> Result<Self> {
        let mut prefix = [0u8; FRAME_HEADER_LEN];
        if !read_full(&mut r, &mut prefix, &|| Location::Header)? {
            return Err(Error::format_with(
                FormatCause::NotKvpack,
                Location::Header,
                "empty stream",
            ));
        }
        let header_len = FileHeader::prefix_len(&prefix, &limits)?;
        let mut buf = vec![0u8; header_len as usize];
        buf[..FRAME_HEADER_LEN].copy_from_slice(&prefix);
        if !read_full(&mut r, &mut buf[FRAME_HEADER_LEN..], &|| Location::Header)?
            && header_len > 64
        {
            return Err(Error::format_with(
                FormatCause::Truncated,
                Location::Header,
                "stream truncated inside the header",
            ));
        }
        let header = FileHeader::parse(&buf, &limits)?;
        let n = header.tensors.len();
        Ok(StreamReader {
            r,
            header,
            header_len,
            limits,
            pos: 0,
            entries: Vec::new(),
            gen_starts: vec![0],
            next_token: vec![0; n],
            last_tensor: None,
            generation: 0,
            prev_index: None,
            committed: false,
            done: false,
        })
    }

    /// The stream's header.
    pub fn header(&self) -> &FileHeader {
        &self.header
    }

    /// Header length in bytes.
    pub fn header_len(&self) -> u64 {
        self.header_len
    }

    /// Bytes consumed so far (header included).
    pub fn bytes_read(&self) -> u64 {
        self.header_len + self.pos
    }

    /// Number of pages received so far.
    pub fn pages_read(&self) -> usize {
        self.entries.len()
    }

    fn describe(&self, h: &PageHeader) -> String {
        match self.header.tensors.get(h.meta.tensor as usize) {
            Some(t) => format!(
                "{} tokens {}..{}",
                t.describe(),
                h.meta.token_start,
                h.meta.token_start as u64 + h.meta.tokens as u64
            ),
            None => format!("tensor {}", h.meta.tensor),
        }
    }

    /// The next page or commit; `Ok(None)` at the end of a complete stream.
    ///
    /// # Errors
    /// [`Error::Format`] naming the page for truncation (the stream ends
    /// before a commit), checksum mismatch, out-of-order pages or an index
    /// that does not list exactly the pages received.
    pub fn next_event(&mut self) -> Result<Option<StreamEvent>> {
        if self.done {
            return Ok(None);
        }
        let align = self.header.align();
        let hl = self.header_len;
        if self.committed && !self.pos.is_multiple_of(align) {
            let pad = (self.pos.next_multiple_of(align) - self.pos) as usize;
            let mut b = vec![0u8; pad];
            let off = self.pos;
            if !read_full(&mut self.r, &mut b, &|| Location::Data { offset: hl + off })? {
                self.done = true;
                return Ok(None);
            }
            check_zero_padding(&b, hl + off, Location::Data { offset: hl + off })?;
            self.pos += pad as u64;
        }
        let mut fh = [0u8; FRAME_HEADER_LEN];
        let off = self.pos;
        let n_pages = self.entries.len();
        let last = self.entries.last().map(|e| e.meta);
        let hdr = &self.header;
        let truncated_at = || match last {
            Some(m) => Location::Page {
                page: n_pages as u64,
                offset: hl + off,
                what: Some(format!(
                    "after page #{} (tensor {} tokens {}..{})",
                    n_pages - 1,
                    hdr.tensors
                        .get(m.tensor as usize)
                        .map(|t| t.describe())
                        .unwrap_or_default(),
                    m.token_start,
                    m.token_start + m.tokens
                )),
            },
            None => Location::Page {
                page: 0,
                offset: hl + off,
                what: None,
            },
        };
        if !read_full(&mut self.r, &mut fh, &truncated_at)? {
            if self.committed {
                self.done = true;
                return Ok(None);
            }
            return Err(Error::format_with(
                FormatCause::Truncated,
                truncated_at(),
                "stream ended before its end marker (index and trailer): truncated",
            ));
        }
        self.committed = false;
        let magic: [u8; 4] = fh[..4].try_into().expect("4 bytes");
        if magic == PAGE_MAGIC {
            self.read_page(fh).map(|p| Some(StreamEvent::Page(p)))
        } else if magic == INDEX_MAGIC {
            self.read_commit(fh)
                .map(|(i, t)| Some(StreamEvent::Commit(i, t)))
        } else {
            Err(Error::format(
                Location::Data { offset: hl + off },
                format!(
                    "expected a page (KVPG) or index (KVIX) frame, found {:02x?}",
                    &fh[..4]
                ),
            ))
        }
    }

    fn read_page(&mut self, fh: [u8; FRAME_HEADER_LEN]) -> Result<PageView<'static>> {
        let number = self.entries.len() as u64;
        let off = self.pos;
        let mut at = Location::Page {
            page: number,
            offset: self.header_len + off,
            what: None,
        };
        let h = PageHeader::parse(&fh, &at, &self.limits)?;
        let what = self.describe(&h);
        at = Location::Page {
            page: number,
            offset: self.header_len + off,
            what: Some(what.clone()),
        };
        let m = h.meta;
        let t = m.tensor as usize;
        if t >= self.header.tensors.len() || m.codec as usize >= self.header.codecs.len() {
            return Err(Error::format(
                at,
                "page refers to a tensor or codec slot that does not exist",
            ));
        }
        if self.last_tensor.is_some_and(|l| l > m.tensor) || m.token_start != self.next_token[t] {
            return Err(Error::format(
                at,
                format!(
                    "page out of order: expected tensor >= {} and token {} for this tensor",
                    self.last_tensor.unwrap_or(0),
                    self.next_token[t]
                ),
            ));
        }
        let info = &self.header.tensors[t];
        let elements = (info.planes() as u64)
            .saturating_mul(u64::from(m.tokens))
            .saturating_mul(u64::from(info.head_dim));
        h.check_body_bound(elements, &self.limits, &at)?;
        let frame_len = h.frame_len(self.header.align());
        let at2 = at.clone();
        let Some(mut rest) =
            read_growing(&mut self.r, frame_len - FRAME_HEADER_LEN as u64, &|| {
                at2.clone()
            })?
        else {
            return Err(Error::format_with(
                FormatCause::Truncated,
                at,
                "stream truncated inside the page",
            ));
        };
        let stored_len = h.stored_len as usize;
        check_zero_padding(
            &rest[stored_len..],
            self.header_len + off + 64 + stored_len as u64,
            at.clone(),
        )?;
        rest.truncate(stored_len);
        let page = PageView::from_stored(h, Cow::Owned(rest), number, what, &at)?;
        self.entries.push(IndexEntry {
            offset: off,
            frame_len,
            meta: m,
            flags: h.flags,
            body_crc: h.body_crc,
        });
        self.next_token[t] = m.token_start + m.tokens;
        self.last_tensor = Some(m.tensor);
        self.pos += frame_len;
        Ok(page)
    }

    fn read_commit(&mut self, fh: [u8; FRAME_HEADER_LEN]) -> Result<(Index, Trailer)> {
        let at = Location::Index {
            generation: self.generation,
        };
        let h = Index::parse_header(&fh, &at, &self.limits)?;
        let align = self.header.align();
        let frame_len = (FRAME_HEADER_LEN as u64 + h.body_len).next_multiple_of(align);
        let at2 = at.clone();
        let Some(rest) = read_growing(&mut self.r, frame_len - FRAME_HEADER_LEN as u64, &|| {
            at2.clone()
        })?
        else {
            return Err(Error::format_with(
                FormatCause::Truncated,
                at,
                "stream truncated inside the index",
            ));
        };
        let body_len = h.body_len as usize;
        check_zero_padding(
            &rest[body_len..],
            self.header_len + self.pos + 64 + h.body_len,
            at.clone(),
        )?;
        let idx = Index::parse_body(&h, &rest[..body_len], &at)?;
        if idx.generation != self.generation || idx.prev_index != self.prev_index {
            return Err(Error::format(
                at,
                "index generation or previous-commit pointer is wrong",
            ));
        }
        if idx.entries != self.entries {
            return Err(Error::format(
                at,
                format!(
                    "index lists {} pages, the stream carried {} (or they differ)",
                    idx.entries.len(),
                    self.entries.len()
                ),
            ));
        }
        if idx.generation == 0
            && let Some(t) = (0..self.header.tensors.len())
                .find(|&t| idx.token_counts[t] != self.header.tensors[t].tokens)
        {
            return Err(Error::format(
                at,
                format!("tensor {t} token count differs from the header"),
            ));
        }
        validate_index(&self.header, &idx, &self.gen_starts, self.pos)?;
        let index_offset = self.pos;
        self.pos += frame_len;
        let mut tb = [0u8; FRAME_HEADER_LEN];
        let toff = self.header_len + self.pos;
        if !read_full(&mut self.r, &mut tb, &|| Location::Trailer { offset: toff })? {
            return Err(Error::format(
                Location::Trailer { offset: toff },
                "stream ended before the trailer",
            ));
        }
        let tr = Trailer::parse(
            &tb,
            &Location::Trailer { offset: toff },
            self.header_len,
            Some(self.pos + 64),
        )?;
        if tr.index_offset != index_offset || tr.generation != self.generation {
            return Err(Error::format(
                Location::Trailer { offset: toff },
                "trailer does not point to the index before it",
            ));
        }
        self.pos += FRAME_HEADER_LEN as u64;
        self.prev_index = Some(index_offset);
        self.generation += 1;
        self.gen_starts.push(self.entries.len());
        self.last_tensor = None;
        self.committed = true;
        Ok((idx, tr))
    }
}
