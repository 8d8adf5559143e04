//! The footer index (one per commit) and the trailer that ends a commit.

use crate::error::{Error, FormatCause, Location, Result};

use super::bytes::{Cursor, PutLe, crc32};
use super::{FRAME_HEADER_LEN, Limits, MAGIC};

/// The 4 magic bytes of an index frame: `KVIX`.
pub const INDEX_MAGIC: [u8; 4] = *b"KVIX";
/// The 4 magic bytes opening a trailer: `KVTR`.
pub const TRAILER_MAGIC: [u8; 4] = *b"KVTR";
/// Size of one index entry, bytes.
pub const ENTRY_LEN: usize = 40;
/// `prev_index` value meaning "no previous commit".
pub const NO_PREV: u64 = u64::MAX;

/// One page as listed in the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexEntry {
    /// Data offset (from the end of the header) of the page frame.
    pub offset: u64,
    /// Frame length including padding.
    pub frame_len: u64,
    /// Tensor, token range and codec slot (must equal the page header's).
    pub meta: super::PageMeta,
    /// Page flags (must equal the page header's).
    pub flags: u16,
    /// Body CRC (must equal the page header's).
    pub body_crc: u32,
}

/// A parsed index: the state of the cache as of one commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Index {
    /// 0 for the first commit, +1 per append.
    pub generation: u32,
    /// Data offset of the previous commit's index frame.
    pub prev_index: Option<u64>,
    /// Current token count of every tensor of the header's tensor table.
    pub token_counts: Vec<u32>,
    /// Every page of the cache, in file order.
    pub entries: Vec<IndexEntry>,
    /// Token ids of the cached prefix (may be empty).
    pub token_ids: Vec<u32>,
}

impl Index {
    /// Serializes the index frame (header, body, zero padding to `align`).
    pub fn encode(&self, align: u64) -> Vec<u8> {
        let mut body = Vec::with_capacity(
            4 * self.token_counts.len() + ENTRY_LEN * self.entries.len() + 4 * self.token_ids.len(),
        );
        for &t in &self.token_counts {
            body.put_u32(t);
        }
        for e in &self.entries {
            body.put_u64(e.offset);
            body.put_u64(e.frame_len);
            body.put_u32(e.meta.tensor);
            body.put_u32(e.meta.token_start);
            body.put_u32(e.meta.tokens);
            body.put_u16(e.meta.codec);
            body.put_u16(e.flags);
            body.put_u32(e.body_crc);
            body.put_u32(0);
        }
        for &t in &self.token_ids {
            body.put_u32(t);
        }
        let mut v = Vec::with_capacity(FRAME_HEADER_LEN + body.len() + align as usize);
        v.extend_from_slice(&INDEX_MAGIC);
        v.put_u32(self.generation);
        v.put_u32(self.token_counts.len() as u32);
        v.put_u32(self.entries.len() as u32);
        v.put_u32(self.token_ids.len() as u32);
        v.put_u32(0);
        v.put_u64(self.prev_index.unwrap_or(NO_PREV));
        v.put_u64(body.len() as u64);
        v.put_u32(crc32(&[&body]));
        v.extend_from_slice(&[0; 16]);
        let crc = crc32(&[&v]);
        v.put_u32(crc);
        v.extend_from_slice(&body);
        v.pad_to(align as usize);
        v
    }

    /// Parses an index frame header; returns the body length to read next
    /// and the header's fields.
    pub(crate) fn parse_header(
        b: &[u8; FRAME_HEADER_LEN],
        at: &Location,
        limits: &Limits,
    ) -> Result<IndexHeader> {
        let mut c = Cursor::new(b, at.clone());
        if c.array::<4>("index magic")? != INDEX_MAGIC {
            return Err(c.err(format!("expected index magic KVIX, found {:02x?}", &b[..4])));
        }
        let stored_crc = u32::from_le_bytes(b[60..64].try_into().expect("4 bytes"));
        if crc32(&[&b[..60]]) != stored_crc {
            return Err(c.err_with(FormatCause::Checksum, "index header CRC mismatch"));
        }
        let generation = c.u32("generation")?;
        let n_tensors = c.u32("n_tensors")?;
        let n_pages = c.u32("n_pages")?;
        let n_token_ids = c.u32("n_token_ids")?;
        c.zeros(4, "index flags")?;
        let prev = c.u64("prev_index")?;
        let body_len = c.u64("body_len")?;
        let body_crc = c.u32("body_crc")?;
        c.zeros(16, "reserved")?;
        let want = 4 * u64::from(n_tensors)
            + ENTRY_LEN as u64 * u64::from(n_pages)
            + 4 * u64::from(n_token_ids);
        if body_len != want {
            return Err(c.err(format!(
                "index body_len {body_len} does not match its counts (needs {want})"
            )));
        }
        if body_len > limits.max_index_bytes {
            return Err(Error::Limits(format!(
                "{at}: index body of {body_len} bytes, limit is {}",
                limits.max_index_bytes
            )));
        }
        Ok(IndexHeader {
            generation,
            n_tensors,
            n_pages,
            n_token_ids,
            prev_index: (prev != NO_PREV).then_some(prev),
            body_len,
            body_crc,
        })
    }

    /// Parses the index body that follows `h`.
    pub(crate) fn parse_body(h: &IndexHeader, body: &[u8], at: &Location) -> Result<Index> {
        if crc32(&[body]) != h.body_crc {
            return Err(Error::format_with(
                FormatCause::Checksum,
                at.clone(),
                "index body CRC mismatch",
            ));
        }
        let mut c = Cursor::new(body, at.clone());
        let mut token_counts = Vec::with_capacity(h.n_tensors as usize);
        for _ in 0..h.n_tensors {
            token_counts.push(c.u32("token count")?);
        }
        let mut entries = Vec::with_capacity(h.n_pages as usize);
        for i in 0..h.n_pages {
            let what = format!("index entry {i}");
            let offset = c.u64(&what)?;
            let frame_len = c.u64(&what)?;
            let tensor = c.u32(&what)?;
            let token_start = c.u32(&what)?;
            let tokens = c.u32(&what)?;
            let codec = c.u16(&what)?;
            let flags = c.u16(&what)?;
            let body_crc = c.u32(&what)?;
            c.zeros(4, &what)?;
            entries.push(IndexEntry {
                offset,
                frame_len,
                meta: super::PageMeta {
                    tensor,
                    token_start,
                    tokens,
                    codec,
                },
                flags,
                body_crc,
            });
        }
        let mut token_ids = Vec::with_capacity(h.n_token_ids as usize);
        for _ in 0..h.n_token_ids {
            token_ids.push(c.u32("token id")?);
        }
        c.expect_end("index body")?;
        Ok(Index {
            generation: h.generation,
            prev_index: h.prev_index,
            token_counts,
            entries,
            token_ids,
        })
    }
}

/// Fields of an index frame header.
#[derive(Debug, Clone, Copy)]
pub(crate) struct IndexHeader {
    pub generation: u32,
    pub n_tensors: u32,
    pub n_pages: u32,
    pub n_token_ids: u32,
    pub prev_index: Option<u64>,
    pub body_len: u64,
    pub body_crc: u32,
}

/// The 64-byte trailer that ends every commit; its last 8 bytes are the file
/// magic, so a complete file ends with the magic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trailer {
    /// Generation of the commit.
    pub generation: u32,
    /// Data offset of the commit's index frame.
    pub index_offset: u64,
    /// Length of the index frame including padding.
    pub index_frame_len: u64,
    /// Data offset just past this trailer (the committed data length).
    pub commit_end: u64,
    /// The file's header length (cross-check).
    pub header_len: u64,
}

impl Trailer {
    /// Serializes the trailer.
    pub fn encode(&self) -> [u8; FRAME_HEADER_LEN] {
        let mut v = Vec::with_capacity(FRAME_HEADER_LEN);
        v.extend_from_slice(&TRAILER_MAGIC);
        v.put_u32(self.generation);
        v.put_u64(self.index_offset);
        v.put_u64(self.index_frame_len);
        v.put_u64(self.commit_end);
        v.put_u64(self.header_len);
        v.extend_from_slice(&[0; 12]);
        let crc = crc32(&[&v]);
        v.put_u32(crc);
        v.extend_from_slice(&MAGIC);
        v.try_into().expect("64 bytes")
    }

    /// Parses a trailer and checks that it is self-consistent: magic at both
    /// ends, CRC, `index_offset + index_frame_len + 64 == commit_end`, and
    /// (when `expect_end` is given) that it ends at that data offset.
    pub fn parse(
        b: &[u8; FRAME_HEADER_LEN],
        at: &Location,
        header_len: u64,
        expect_end: Option<u64>,
    ) -> Result<Trailer> {
        let mut c = Cursor::new(b, at.clone());
        if c.array::<4>("trailer magic")? != TRAILER_MAGIC || b[56..] != MAGIC {
            return Err(c.err("not a trailer: magic bytes missing (file truncated or corrupted)"));
        }
        let stored = u32::from_le_bytes(b[52..56].try_into().expect("4 bytes"));
        if crc32(&[&b[..52]]) != stored {
            return Err(c.err_with(FormatCause::Checksum, "trailer CRC mismatch"));
        }
        let generation = c.u32("generation")?;
        let index_offset = c.u64("index_offset")?;
        let index_frame_len = c.u64("index_frame_len")?;
        let commit_end = c.u64("commit_end")?;
        let hl = c.u64("header_len")?;
        c.zeros(12, "reserved")?;
        if hl != header_len {
            return Err(c.err(format!(
                "trailer says header_len {hl}, file header is {header_len}"
            )));
        }
        if index_offset
            .checked_add(index_frame_len)
            .and_then(|x| x.checked_add(FRAME_HEADER_LEN as u64))
            != Some(commit_end)
        {
            return Err(c.err("trailer offsets are inconsistent (index + trailer != commit end)"));
        }
        if let Some(e) = expect_end
            && e != commit_end
        {
            return Err(c.err(format!(
                "trailer says the commit ends at {commit_end}, it ends at {e}"
            )));
        }
        Ok(Trailer {
            generation,
            index_offset,
            index_frame_len,
            commit_end,
            header_len,
        })
    }
}
