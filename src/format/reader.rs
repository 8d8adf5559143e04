//! Random-access reader over a byte slice (typically a memory-mapped file;
//! mapping is the caller's business). Opening validates the header, the last
//! commit's index and trailer, every earlier commit, and that frames tile
//! the data section exactly. Pages are validated (CRC, section table) when
//! they are accessed.

use std::borrow::Cow;

use crate::error::{Error, FormatCause, Location, Result};

use super::bytes::check_zero_padding;
use super::index::{Index, IndexEntry, Trailer};
use super::page::{PageHeader, PageView};
use super::{FRAME_HEADER_LEN, FileHeader, Limits};

/// A validated kvpack file borrowed from `buf`.
#[derive(Debug)]
pub struct Reader<'a> {
    buf: &'a [u8],
    header: FileHeader,
    header_len: u64,
    index: Index,
    trailer: Trailer,
    torn_tail: u64,
    limits: Limits,
    by_tensor: Vec<Vec<usize>>,
    private_pages: bool,
    release: Option<&'a dyn Release>,
}

/// Drops parts of a reader's buffer from memory once they were used: for a
/// memory-mapped file, so that resident memory follows the pages being
/// decoded, not the file size (see [`Reader::set_release`]).
pub trait Release: Sync + std::fmt::Debug {
    /// Bytes `range` of the buffer are no longer needed by this reader
    /// (they may still be read again; this is advice, never required).
    fn release(&self, range: std::ops::Range<usize>);
}

fn frame<'b>(data: &'b [u8], off: u64, len: u64, at: &Location) -> Result<&'b [u8]> {
    off.checked_add(len)
        .and_then(|end| data.get(off as usize..end as usize))
        .ok_or_else(|| {
            Error::format(
                at.clone(),
                format!("frame at data offset {off} of {len} bytes runs past the end of the data ({} bytes)", data.len()),
            )
        })
}

fn head64(b: &[u8]) -> &[u8; FRAME_HEADER_LEN] {
    b[..FRAME_HEADER_LEN]
        .try_into()
        .expect("caller checked length >= 64")
}

/// Parses the index frame a trailer points to.
fn load_index(data: &[u8], t: &Trailer, limits: &Limits, align: u64) -> Result<Index> {
    let at = Location::Index {
        generation: t.generation,
    };
    let f = frame(data, t.index_offset, t.index_frame_len, &at)?;
    if f.len() < FRAME_HEADER_LEN {
        return Err(Error::format(at, "index frame shorter than its header"));
    }
    let h = Index::parse_header(head64(f), &at, limits)?;
    let body_end = FRAME_HEADER_LEN as u64 + h.body_len;
    if body_end.next_multiple_of(align) != t.index_frame_len {
        return Err(Error::format(
            at,
            "index frame length disagrees with the trailer",
        ));
    }
    let body = &f[FRAME_HEADER_LEN..body_end as usize];
    check_zero_padding(
        &f[body_end as usize..],
        t.index_offset + body_end,
        at.clone(),
    )?;
    let idx = Index::parse_body(&h, body, &at)?;
    if idx.generation != t.generation {
        return Err(Error::format(
            at,
            "index generation disagrees with the trailer",
        ));
    }
    Ok(idx)
}

/// Checks an index against the header: entry fields, offsets, per-commit
/// layer-major order, per-tensor token tiling. `gen_starts[g]` is the first
/// entry of generation `g`.
pub(crate) fn validate_index(
    header: &FileHeader,
    idx: &Index,
    gen_starts: &[usize],
    end: u64,
) -> Result<Vec<Vec<usize>>> {
    let at = Location::Index {
        generation: idx.generation,
    };
    let err = |m: String| Err(Error::format(at.clone(), m));
    let n = header.tensors.len();
    if idx.token_counts.len() != n {
        return err(format!(
            "index lists {} tensors, header has {n}",
            idx.token_counts.len()
        ));
    }
    let align = header.align();
    let mut by_tensor: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut prev_end = 0u64;
    for (i, e) in idx.entries.iter().enumerate() {
        let m = e.meta;
        if m.tensor as usize >= n {
            return err(format!("entry {i}: tensor {} out of range", m.tensor));
        }
        if m.codec as usize >= header.codecs.len() {
            return err(format!("entry {i}: codec slot {} out of range", m.codec));
        }
        if m.tokens == 0 || e.flags & !super::page::FLAG_ZSTD != 0 {
            return err(format!("entry {i}: zero tokens or unknown flags"));
        }
        if e.offset % align != 0
            || e.frame_len % align != 0
            || e.frame_len < FRAME_HEADER_LEN as u64
        {
            return err(format!(
                "entry {i}: frame at {} len {} is not aligned",
                e.offset, e.frame_len
            ));
        }
        if e.offset < prev_end || e.offset.checked_add(e.frame_len).is_none_or(|x| x > end) {
            return err(format!(
                "entry {i}: frame at {} overlaps another or runs past the commit",
                e.offset
            ));
        }
        prev_end = e.offset + e.frame_len;
        by_tensor[m.tensor as usize].push(i);
    }
    // Layer-major order inside each commit.
    for g in 0..gen_starts.len() {
        let lo = gen_starts[g];
        let hi = gen_starts.get(g + 1).copied().unwrap_or(idx.entries.len());
        for i in lo + 1..hi {
            let (a, b) = (idx.entries[i - 1].meta, idx.entries[i].meta);
            if (a.tensor, a.token_start) >= (b.tensor, b.token_start) {
                return err(format!(
                    "entry {i}: pages of commit {g} are not in layer-major order"
                ));
            }
        }
    }
    for (t, list) in by_tensor.iter_mut().enumerate() {
        list.sort_by_key(|&i| idx.entries[i].meta.token_start);
        let mut next = 0u32;
        for &i in list.iter() {
            let m = idx.entries[i].meta;
            if m.token_start != next {
                return err(format!(
                    "tensor {t} ({}): pages leave a gap or overlap at token {next} (page starts at {})",
                    header.tensors[t].describe(),
                    m.token_start
                ));
            }
            next = m
                .token_start
                .checked_add(m.tokens)
                .ok_or_else(|| Error::format(at.clone(), "token overflow"))?;
        }
        if next != idx.token_counts[t] {
            return err(format!(
                "tensor {t} ({}): pages cover {next} tokens, index says {}",
                header.tensors[t].describe(),
                idx.token_counts[t]
            ));
        }
    }
    Ok(by_tensor)
}

impl<'a> Reader<'a> {
    /// Opens a file with default [`Limits`].
    ///
    /// # Errors
    /// See [`Reader::open_with`].
    pub fn open(buf: &'a [u8]) -> Result<Reader<'a>> {
        Self::open_with(buf, Limits::default())
    }

    /// Opens and validates a file.
    ///
    /// If the bytes after the last complete commit are not a valid trailer
    /// (an append interrupted by a crash), the reader falls back to the last
    /// complete commit and reports the ignored bytes in
    /// [`Reader::torn_tail`].
    ///
    /// # Errors
    /// [`Error::Format`] naming the structure at fault (header, trailer,
    /// index, data offset) for any malformed, truncated or corrupted file;
    /// [`Error::Limits`] for sizes above `limits`.
    pub fn open_with(buf: &'a [u8], limits: Limits) -> Result<Reader<'a>> {
        let prefix: &[u8; FRAME_HEADER_LEN] = buf
            .get(..FRAME_HEADER_LEN)
            .and_then(|p| p.try_into().ok())
            .ok_or_else(|| {
                Error::format_with(
                    FormatCause::Truncated,
                    Location::Header,
                    format!("file is {} bytes, too short for a kvpack header", buf.len()),
                )
            })?;
        let header_len = FileHeader::prefix_len(prefix, &limits)?;
        let hb = buf.get(..header_len as usize).ok_or_else(|| {
            Error::format_with(
                FormatCause::Truncated,
                Location::Header,
                format!("file is {} bytes, header needs {header_len}", buf.len()),
            )
        })?;
        let header = FileHeader::parse(hb, &limits)?;
        let data = &buf[header_len as usize..];
        let align = header.align();

        let (trailer, torn_tail) = find_commit(data, header_len, align, &limits)?;
        // Every commit takes at least an index frame and a trailer (128
        // bytes): a generation the data cannot hold is rejected before the
        // per-commit table is allocated.
        let max_generation = trailer.commit_end / (2 * FRAME_HEADER_LEN as u64);
        if u64::from(trailer.generation) >= max_generation.max(1) {
            return Err(Error::format(
                Location::Trailer {
                    offset: header_len + trailer.commit_end - FRAME_HEADER_LEN as u64,
                },
                format!(
                    "trailer generation {} needs more commits than {} data bytes can hold",
                    trailer.generation, trailer.commit_end
                ),
            ));
        }
        let index = load_index(data, &trailer, &limits, align)?;

        // Walk earlier commits: each is a prefix of the next.
        let mut occupied: Vec<(u64, u64)> = vec![(trailer.index_offset, trailer.commit_end)];
        let mut gen_starts = vec![0usize; index.generation as usize + 1];
        let mut cur = index.clone();
        while let Some(prev_off) = cur.prev_index {
            let g = cur.generation.checked_sub(1).ok_or_else(|| {
                Error::format(
                    Location::Index { generation: 0 },
                    "commit 0 points to a previous commit",
                )
            })?;
            let at = Location::Index { generation: g };
            // The previous trailer follows its index frame; read the index
            // header to learn the frame length.
            let h = Index::parse_header(
                head64(frame(data, prev_off, FRAME_HEADER_LEN as u64, &at)?),
                &at,
                &limits,
            )?;
            let frame_len = (FRAME_HEADER_LEN as u64 + h.body_len).next_multiple_of(align);
            let toff = prev_off + frame_len;
            let tb = frame(data, toff, FRAME_HEADER_LEN as u64, &at)?;
            let pt = Trailer::parse(
                head64(tb),
                &Location::Trailer {
                    offset: header_len + toff,
                },
                header_len,
                Some(toff + 64),
            )?;
            if pt.generation != g || pt.index_offset != prev_off {
                return Err(Error::format(
                    at,
                    "previous commit's trailer does not match its index",
                ));
            }
            let prev = load_index(data, &pt, &limits, align)?;
            if prev.entries.len() > cur.entries.len()
                || prev.entries[..] != cur.entries[..prev.entries.len()]
            {
                return Err(Error::format(
                    at,
                    "a later commit does not extend this commit's pages",
                ));
            }
            if prev.token_ids.len() > cur.token_ids.len()
                || prev.token_ids[..] != cur.token_ids[..prev.token_ids.len()]
            {
                return Err(Error::format(
                    at,
                    "a later commit changes this commit's token ids",
                ));
            }
            gen_starts[g as usize + 1] = prev.entries.len();
            occupied.push((pt.index_offset, pt.commit_end));
            cur = prev;
        }
        if cur.generation != 0 {
            return Err(Error::format(
                Location::Index {
                    generation: cur.generation,
                },
                "commit chain does not reach commit 0",
            ));
        }
        for (t, info) in header.tensors.iter().enumerate() {
            if cur.token_counts.get(t) != Some(&info.tokens) {
                return Err(Error::format(
                    Location::Index { generation: 0 },
                    format!(
                        "{}: header says {} tokens, commit 0 has {:?}",
                        info.describe(),
                        info.tokens,
                        cur.token_counts.get(t)
                    ),
                ));
            }
        }
        let by_tensor = validate_index(&header, &index, &gen_starts, trailer.index_offset)?;

        // Frames tile the committed data exactly (gaps only as alignment
        // padding after a trailer).
        occupied.extend(
            index
                .entries
                .iter()
                .map(|e| (e.offset, e.offset + e.frame_len)),
        );
        occupied.sort_unstable();
        let mut pos = 0u64;
        for &(s, e) in &occupied {
            if s < pos {
                return Err(Error::format(
                    Location::Data {
                        offset: header_len + s,
                    },
                    "frames overlap",
                ));
            }
            if s > pos {
                if s - pos >= align || pos.is_multiple_of(align) {
                    return Err(Error::format(
                        Location::Data {
                            offset: header_len + pos,
                        },
                        format!("{} bytes belong to no frame", s - pos),
                    ));
                }
                check_zero_padding(
                    &data[pos as usize..s as usize],
                    header_len + pos,
                    Location::Data {
                        offset: header_len + pos,
                    },
                )?;
            }
            pos = e;
        }
        if pos != trailer.commit_end {
            return Err(Error::format(
                Location::Data {
                    offset: header_len + pos,
                },
                "frames do not reach the trailer",
            ));
        }
        Ok(Reader {
            buf,
            header,
            header_len,
            index,
            trailer,
            torn_tail,
            limits,
            by_tensor,
            private_pages: false,
            release: None,
        })
    }

    /// With `on`, [`Reader::page`] copies a page's stored bytes out of the
    /// buffer before verifying its checksum, and the page is decoded from
    /// that copy: what is decoded is exactly what was verified, even when
    /// the buffer is a shared mapping of a file that another process
    /// rewrites in place. Use it for memory-mapped files; a buffer owned by
    /// this process cannot change and needs no copy (the default, `off`).
    pub fn set_private_pages(&mut self, on: bool) {
        self.private_pages = on;
    }

    /// With private pages on ([`Reader::set_private_pages`]), `release` is
    /// told the buffer range of each page frame once the page was copied
    /// out of it: a memory-mapped input then stays resident only for the
    /// pages in flight.
    pub fn set_release(&mut self, release: Option<&'a dyn Release>) {
        self.release = release;
    }

    /// The limits this reader enforces.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// The file header.
    pub fn header(&self) -> &FileHeader {
        &self.header
    }

    /// Length of the header in bytes (the data section starts here).
    pub fn header_len(&self) -> u64 {
        self.header_len
    }

    /// The index of the last complete commit.
    pub fn index(&self) -> &Index {
        &self.index
    }

    /// The trailer of the last complete commit.
    pub fn trailer(&self) -> &Trailer {
        &self.trailer
    }

    /// Bytes after the last complete commit that were ignored (0 for a
    /// cleanly written file; non-zero after an interrupted append).
    pub fn torn_tail(&self) -> u64 {
        self.torn_tail
    }

    /// Bytes of the committed file (header + committed data).
    pub fn committed_len(&self) -> u64 {
        self.header_len + self.trailer.commit_end
    }

    /// Current token count of tensor `t`.
    ///
    /// # Panics
    /// If `t` is out of range.
    pub fn tokens(&self, t: usize) -> u32 {
        self.index.token_counts[t]
    }

    /// Index entries (positions into [`Index::entries`]) of tensor `t`
    /// sorted by token, restricted to pages overlapping tokens `[lo, hi)`.
    ///
    /// # Panics
    /// If `t` is out of range.
    pub fn pages_overlapping(&self, t: usize, lo: u32, hi: u32) -> Vec<usize> {
        self.by_tensor[t]
            .iter()
            .copied()
            .filter(|&i| {
                let m = self.index.entries[i].meta;
                m.token_start < hi && m.token_start + m.tokens > lo
            })
            .collect()
    }

    /// Validates and returns page `i` (position in the index), borrowing
    /// the body from the buffer unless it is zstd-compressed or
    /// [`Reader::set_private_pages`] is on.
    ///
    /// # Errors
    /// [`Error::Format`] naming the page for a header or body CRC mismatch,
    /// a header that disagrees with the index, non-zero padding or an
    /// invalid section table.
    pub fn page(&self, i: usize) -> Result<PageView<'a>> {
        self.page_checked(i, true)
    }

    /// Page `i` checked as [`Reader::page`] does except for what lies in
    /// its body past the section table: no body CRC and no check that the
    /// padding after each section and after the body is zero. For a buffer
    /// that holds only headers and section tables of the pages (the
    /// bodies stay in device memory, where `gpu` checks CRC and padding).
    ///
    /// # Errors
    /// As [`Reader::page`]; [`Error::Unsupported`] for a zstd page (its
    /// table is inside the compressed bytes).
    pub(crate) fn page_structure(&self, i: usize) -> Result<PageView<'a>> {
        self.page_checked(i, false)
    }

    fn page_checked(&self, i: usize, body: bool) -> Result<PageView<'a>> {
        let e: &IndexEntry = self.index.entries.get(i).ok_or_else(|| {
            Error::param(format!(
                "page {i} does not exist ({} pages)",
                self.index.entries.len()
            ))
        })?;
        let info = &self.header.tensors[e.meta.tensor as usize];
        let what = format!(
            "{} tokens {}..{}",
            info.describe(),
            e.meta.token_start,
            e.meta.token_start + e.meta.tokens
        );
        let at = Location::Page {
            page: i as u64,
            offset: self.header_len + e.offset,
            what: Some(what.clone()),
        };
        let data = &self.buf[self.header_len as usize..];
        let f = frame(data, e.offset, e.frame_len, &at)?;
        let h = PageHeader::parse(head64(f), &at, &self.limits)?;
        if h.meta != e.meta || h.flags != e.flags || h.body_crc != e.body_crc {
            return Err(Error::format(
                at,
                "page header disagrees with its index entry",
            ));
        }
        if h.frame_len(self.header.align()) != e.frame_len {
            return Err(Error::format(
                at,
                "page frame length disagrees with its index entry",
            ));
        }
        let elements = (info.planes() as u64)
            .saturating_mul(u64::from(e.meta.tokens))
            .saturating_mul(u64::from(info.head_dim));
        h.check_body_bound(elements, &self.limits, &at)?;
        let end = FRAME_HEADER_LEN + h.stored_len as usize;
        if !body {
            if h.flags & super::FLAG_ZSTD != 0 {
                return Err(Error::Unsupported(
                    "a zstd page's section table is checked on the host".into(),
                ));
            }
            return PageView::structure(h, &f[FRAME_HEADER_LEN..end], i as u64, what, &at);
        }
        check_zero_padding(
            &f[end..],
            self.header_len + e.offset + end as u64,
            at.clone(),
        )?;
        let stored = &f[FRAME_HEADER_LEN..end];
        let stored = if self.private_pages {
            let copy = stored.to_vec();
            if let Some(r) = self.release {
                let start = (self.header_len + e.offset) as usize;
                r.release(start..start + e.frame_len as usize);
            }
            Cow::Owned(copy)
        } else {
            Cow::Borrowed(stored)
        };
        PageView::from_stored(h, stored, i as u64, what, &at)
    }
}

/// Finds the last complete commit: the trailer ending the data, or, after
/// an interrupted append, the last valid trailer before it.
fn find_commit(
    data: &[u8],
    header_len: u64,
    align: u64,
    limits: &Limits,
) -> Result<(Trailer, u64)> {
    let n = data.len() as u64;
    let at_end = |end: u64| -> Result<Trailer> {
        let off = end - FRAME_HEADER_LEN as u64;
        Trailer::parse(
            head64(&data[off as usize..end as usize]),
            &Location::Trailer {
                offset: header_len + off,
            },
            header_len,
            Some(end),
        )
    };
    if n < FRAME_HEADER_LEN as u64 {
        return Err(Error::format_with(
            FormatCause::Truncated,
            Location::Data { offset: header_len },
            format!("file ends {n} bytes after the header: no commit (truncated)"),
        ));
    }
    let first_err = match at_end(n) {
        Ok(t) => return Ok((t, 0)),
        Err(e) => e,
    };
    // Interrupted append: look for an earlier trailer on a 64-byte boundary.
    let mut end = (n / 64) * 64;
    if end == n {
        end -= 64;
    }
    while end >= FRAME_HEADER_LEN as u64 {
        if data[end as usize - 8..end as usize] == super::MAGIC
            && let Ok(t) = at_end(end)
        {
            if let Some(why) = damaged_final_trailer(data, end, align, limits) {
                return Err(Error::format(
                    Location::Trailer {
                        offset: header_len + n - FRAME_HEADER_LEN as u64,
                    },
                    format!(
                        "the final trailer is damaged ({}): {why}; this is corruption, not an \
                         interrupted append (commit {} before it is intact)",
                        match &first_err {
                            Error::Format { msg, .. } => msg.clone(),
                            other => other.to_string(),
                        },
                        t.generation
                    ),
                ));
            }
            return Ok((t, n - end));
        }
        end -= 64;
    }
    Err(first_err)
}

/// Tells a damaged final trailer from the torn tail of an interrupted
/// append (format/SPEC.md section 10.2). The tail after the last valid
/// trailer (ending at data offset `end`) is damage, not a torn append, when
/// the file's last 64 bytes carry both trailer magics (a trailer was
/// written there completely, then altered), or when a complete, valid index
/// frame ends exactly 64 bytes before the end of the file and those 64
/// bytes are not all zero (the trailer is written only after its index was
/// made durable, so a crash can leave it missing or zero-filled, never
/// other bytes). Returns what was found.
fn damaged_final_trailer(data: &[u8], end: u64, align: u64, limits: &Limits) -> Option<String> {
    use super::index::{INDEX_MAGIC, TRAILER_MAGIC};
    let n = data.len() as u64;
    if n < end + FRAME_HEADER_LEN as u64 {
        return None;
    }
    let last = &data[(n - 64) as usize..];
    if last[..4] == TRAILER_MAGIC && last[56..] == super::MAGIC {
        return Some("the last 64 bytes are a trailer that fails its checks".into());
    }
    if last.iter().all(|&b| b == 0) {
        return None;
    }
    let index_end = n - FRAME_HEADER_LEN as u64;
    let mut p = end.next_multiple_of(align);
    while p + (FRAME_HEADER_LEN as u64) <= index_end {
        let h = &data[p as usize..p as usize + FRAME_HEADER_LEN];
        if h[..4] == INDEX_MAGIC
            && let Ok(ih) = Index::parse_header(head64(h), &Location::Data { offset: p }, limits)
            && (p + FRAME_HEADER_LEN as u64 + ih.body_len).next_multiple_of(align) == index_end
        {
            return Some(format!(
                "a complete index frame (commit {}) ends right before them",
                ih.generation
            ));
        }
        p += align;
    }
    None
}
