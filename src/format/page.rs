//! Page frames: a 64-byte page header, the stored body (optionally one zstd
//! frame), zero padding to the alignment.

use std::borrow::Cow;

use crate::error::{Error, FormatCause, Location, Result};

use super::bytes::{Cursor, PutLe, crc32};
use super::section::{self, Section, SectionDesc, SectionKind};
use super::{FRAME_HEADER_LEN, Limits};

/// The 4 magic bytes of a page header: `KVPG`.
pub const PAGE_MAGIC: [u8; 4] = *b"KVPG";
/// Page flag bit 0: the body is stored as one zstd frame.
pub const FLAG_ZSTD: u16 = 1;

/// What a page holds: one tensor (a layer's K or V), a token range, the codec
/// slot that encoded it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageMeta {
    /// Index into the header's tensor table.
    pub tensor: u32,
    /// First token of the page.
    pub token_start: u32,
    /// Number of tokens, at least 1.
    pub tokens: u32,
    /// Index into the header's codec table.
    pub codec: u16,
}

/// A parsed 64-byte page header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageHeader {
    /// Tensor, token range and codec slot.
    pub meta: PageMeta,
    /// Flag bits; only [`FLAG_ZSTD`] is defined.
    pub flags: u16,
    /// Number of sections in the body.
    pub n_sections: u16,
    /// Bytes of the stored body (compressed size when zstd).
    pub stored_len: u64,
    /// Bytes of the uncompressed body (a multiple of 64).
    pub body_len: u64,
    /// CRC-32 of the stored body bytes.
    pub body_crc: u32,
}

impl PageHeader {
    /// Bytes of the whole frame including padding for `align`.
    pub fn frame_len(&self, align: u64) -> u64 {
        (FRAME_HEADER_LEN as u64 + self.stored_len).next_multiple_of(align)
    }

    pub(crate) fn encode(&self) -> [u8; FRAME_HEADER_LEN] {
        let mut v = Vec::with_capacity(FRAME_HEADER_LEN);
        v.extend_from_slice(&PAGE_MAGIC);
        v.put_u32(self.meta.tensor);
        v.put_u32(self.meta.token_start);
        v.put_u32(self.meta.tokens);
        v.put_u16(self.meta.codec);
        v.put_u16(self.flags);
        v.put_u16(self.n_sections);
        v.put_u16(0);
        v.put_u64(self.stored_len);
        v.put_u64(self.body_len);
        v.put_u32(self.body_crc);
        v.extend_from_slice(&[0; 16]);
        let crc = crc32(&[&v]);
        v.put_u32(crc);
        v.try_into().expect("64 bytes")
    }

    /// Checks the declared uncompressed body length against what a page of
    /// `elements` elements may need ([`Limits::max_body_for`]), before the
    /// body is read or inflated.
    ///
    /// # Errors
    /// [`Error::Limits`] naming the page at `at`.
    pub fn check_body_bound(&self, elements: u64, limits: &Limits, at: &Location) -> Result<()> {
        let max = limits.max_body_for(elements);
        if self.body_len > max || self.stored_len > max {
            return Err(Error::Limits(format!(
                "{at}: page body_len {} (stored {}) for {elements} elements; the limit is {max} \
                 ({} bytes per element + 1 MiB)",
                self.body_len, self.stored_len, limits.max_body_bytes_per_element
            )));
        }
        Ok(())
    }

    /// Parses and checks a page header (magic, CRC, reserved bits, limits).
    ///
    /// # Errors
    /// [`Error::Format`] at `at`; [`Error::Limits`] for a body over
    /// `limits.max_page_bytes`.
    pub fn parse(b: &[u8; FRAME_HEADER_LEN], at: &Location, limits: &Limits) -> Result<PageHeader> {
        let mut c = Cursor::new(b, at.clone());
        if c.array::<4>("page magic")? != PAGE_MAGIC {
            return Err(c.err(format!("expected page magic KVPG, found {:02x?}", &b[..4])));
        }
        let stored_crc = u32::from_le_bytes(b[60..64].try_into().expect("4 bytes"));
        let crc = crc32(&[&b[..60]]);
        if crc != stored_crc {
            return Err(c.err_with(
                FormatCause::Checksum,
                format!(
                    "page header CRC mismatch: stored 0x{stored_crc:08x}, computed 0x{crc:08x}"
                ),
            ));
        }
        let tensor = c.u32("tensor")?;
        let token_start = c.u32("token_start")?;
        let tokens = c.u32("tokens")?;
        let codec = c.u16("codec")?;
        let flags = c.u16("flags")?;
        if flags & !FLAG_ZSTD != 0 {
            return Err(c.err(format!("unknown page flag bits 0x{flags:04x}")));
        }
        let n_sections = c.u16("n_sections")?;
        c.zeros(2, "reserved")?;
        let stored_len = c.u64("stored_len")?;
        let body_len = c.u64("body_len")?;
        let body_crc = c.u32("body_crc")?;
        c.zeros(16, "reserved")?;
        if tokens == 0 || token_start.checked_add(tokens).is_none() {
            return Err(c.err(format!("bad token range {token_start}+{tokens}")));
        }
        if n_sections > limits.max_sections {
            return Err(Error::Limits(format!(
                "{at}: {n_sections} sections, limit is {}",
                limits.max_sections
            )));
        }
        if stored_len > limits.max_page_bytes || body_len > limits.max_page_bytes {
            return Err(Error::Limits(format!(
                "{at}: page body of {} bytes, limit is {}",
                stored_len.max(body_len),
                limits.max_page_bytes
            )));
        }
        if flags & FLAG_ZSTD == 0 && stored_len != body_len {
            return Err(c.err(format!(
                "uncompressed page with stored_len {stored_len} != body_len {body_len}"
            )));
        }
        if body_len % super::SECTION_ALIGN as u64 != 0 {
            return Err(c.err(format!("body_len {body_len} is not a multiple of 64")));
        }
        Ok(PageHeader {
            meta: PageMeta {
                tensor,
                token_start,
                tokens,
                codec,
            },
            flags,
            n_sections,
            stored_len,
            body_len,
            body_crc,
        })
    }
}

/// A fully encoded page frame ready to be written: header, stored body and
/// padding for the alignment given to [`PageFrame::encode`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageFrame {
    /// The parsed form of the frame's header.
    pub header: PageHeader,
    /// The frame bytes (header + stored body + zero padding).
    pub bytes: Vec<u8>,
}

impl PageFrame {
    /// Encodes sections into a frame. With `zstd_level = Some(l)` the body is
    /// compressed and kept compressed only when that makes it smaller.
    ///
    /// # Errors
    /// [`Error::Parameter`] for inconsistent sections (see
    /// [`Section`]); [`Error::Io`] if zstd fails.
    pub fn encode(
        meta: PageMeta,
        sections: &[Section],
        zstd_level: Option<i32>,
        align: u64,
    ) -> Result<PageFrame> {
        if meta.tokens == 0 {
            return Err(Error::param("a page must hold at least one token"));
        }
        // Sized for the whole frame up front (table, padded sections,
        // alignment), so it is never reallocated.
        let pad = super::SECTION_ALIGN;
        let body: usize = sections.iter().map(|s| s.data.len() + pad).sum();
        let table = sections.len() * section::SECTION_DESC_LEN + pad;
        let mut bytes = super::pool::take(FRAME_HEADER_LEN + table + body + align as usize);
        bytes.resize(FRAME_HEADER_LEN, 0);
        section::encode_body_into(&mut bytes, sections)?;
        let n_sections =
            u16::try_from(sections.len()).map_err(|_| Error::param("more than 65535 sections"))?;
        Self::finish(meta, bytes, n_sections, zstd_level, align)
    }

    /// A frame around `body`, a canonical page body (format/SPEC.md 6.2)
    /// of `n_sections` sections already laid out (for example by a GPU
    /// encoder): the frame [`PageFrame::encode`] makes of its sections. The
    /// body is copied once and not re-checked.
    ///
    /// # Errors
    /// [`Error::Parameter`] for a page of zero tokens; [`Error::Io`] if
    /// zstd fails.
    pub fn from_body(
        meta: PageMeta,
        body: &[u8],
        n_sections: u16,
        zstd_level: Option<i32>,
        align: u64,
    ) -> Result<PageFrame> {
        if meta.tokens == 0 {
            return Err(Error::param("a page must hold at least one token"));
        }
        let mut bytes = Vec::with_capacity(
            (FRAME_HEADER_LEN + body.len())
                .next_multiple_of(usize::try_from(align).unwrap_or(1).max(1)),
        );
        bytes.resize(FRAME_HEADER_LEN, 0);
        bytes.extend_from_slice(body);
        Self::finish(meta, bytes, n_sections, zstd_level, align)
    }

    /// The header of the uncompressed frame of `body`, a canonical page
    /// body of `n_sections` sections ([`PageFrame::from_body`] without
    /// zstd, without building the frame: [`super::Writer::write_parts`]
    /// writes it from `body`).
    ///
    /// # Errors
    /// [`Error::Parameter`] for a page of zero tokens.
    pub fn body_header(meta: PageMeta, body: &[u8], n_sections: u16) -> Result<PageHeader> {
        if meta.tokens == 0 {
            return Err(Error::param("a page must hold at least one token"));
        }
        Ok(PageHeader {
            meta,
            flags: 0,
            n_sections,
            stored_len: body.len() as u64,
            body_len: body.len() as u64,
            body_crc: crc32(&[body]),
        })
    }

    /// The frame of `bytes` (room for the header, then the body).
    fn finish(
        meta: PageMeta,
        mut bytes: Vec<u8>,
        n_sections: u16,
        zstd_level: Option<i32>,
        align: u64,
    ) -> Result<PageFrame> {
        let body_len = (bytes.len() - FRAME_HEADER_LEN) as u64;
        let mut flags = 0;
        if let Some(level) = zstd_level {
            let z = zstd::bulk::compress(&bytes[FRAME_HEADER_LEN..], level)
                .map_err(|e| Error::io("zstd compression of a page", e))?;
            if (z.len() as u64) < body_len {
                bytes.truncate(FRAME_HEADER_LEN);
                bytes.extend_from_slice(&z);
                flags = FLAG_ZSTD;
            }
        }
        let stored_len = (bytes.len() - FRAME_HEADER_LEN) as u64;
        let header = PageHeader {
            meta,
            flags,
            n_sections,
            stored_len,
            body_len,
            body_crc: crc32(&[&bytes[FRAME_HEADER_LEN..]]),
        };
        bytes[..FRAME_HEADER_LEN].copy_from_slice(&header.encode());
        bytes.resize(header.frame_len(align) as usize, 0);
        Ok(PageFrame { header, bytes })
    }
}

/// The 4 magic bytes of a zstd frame (RFC 8878 section 3.1.1).
const ZSTD_MAGIC: [u8; 4] = [0x28, 0xB5, 0x2F, 0xFD];

/// Checks that `stored` is exactly one zstd frame (no skippable frame, no
/// second frame, no trailing bytes) whose declared content size, when
/// present, is `body_len` (format/SPEC.md section 6.4). Done before any
/// output is allocated.
fn check_one_zstd_frame(stored: &[u8], body_len: u64, at: &Location) -> Result<()> {
    let err = |m: String| Err(Error::format(at.clone(), m));
    if stored.get(..4) != Some(&ZSTD_MAGIC[..]) {
        return err(format!(
            "stored body does not start with a zstd frame (found {:02x?}); skippable \
             frames are not allowed",
            &stored[..stored.len().min(4)]
        ));
    }
    match zstd::zstd_safe::find_frame_compressed_size(stored) {
        Ok(n) if n == stored.len() => {}
        Ok(n) => {
            return err(format!(
                "{} bytes follow the zstd frame of {n} bytes; a page holds exactly one frame",
                stored.len() - n
            ));
        }
        Err(_) => return err("the zstd frame is malformed or truncated".into()),
    }
    match zstd::zstd_safe::get_frame_content_size(stored) {
        Ok(Some(n)) if n != body_len => err(format!(
            "the zstd frame declares {n} decompressed bytes, the page header says body_len {body_len}"
        )),
        Ok(_) => Ok(()),
        Err(_) => err("the zstd frame header is malformed".into()),
    }
}

/// A validated page: header, uncompressed body (borrowed from the file when
/// stored uncompressed, owned after zstd), and its section table.
#[derive(Debug, Clone)]
pub struct PageView<'a> {
    /// The page header.
    pub header: PageHeader,
    /// Position of the page in the index (stream order).
    pub number: u64,
    /// Human description of the page for error messages.
    pub what: String,
    at: Location,
    body: Cow<'a, [u8]>,
    sections: Vec<SectionDesc>,
}

impl<'a> PageView<'a> {
    /// Validates a page from its header and stored body bytes (CRC, zstd,
    /// section table).
    ///
    /// # Errors
    /// [`Error::Format`] naming the page for a CRC mismatch, a zstd frame
    /// that does not decompress to `body_len` bytes, or an invalid section
    /// table.
    pub fn from_stored(
        header: PageHeader,
        stored: Cow<'a, [u8]>,
        number: u64,
        what: String,
        at: &Location,
    ) -> Result<PageView<'a>> {
        let crc = crc32(&[&stored]);
        if crc != header.body_crc {
            return Err(Error::format_with(
                FormatCause::Checksum,
                at.clone(),
                format!(
                    "page body CRC mismatch: stored 0x{:08x}, computed 0x{crc:08x}",
                    header.body_crc
                ),
            ));
        }
        let body: Cow<'a, [u8]> = if header.flags & FLAG_ZSTD != 0 {
            check_one_zstd_frame(&stored, header.body_len, at)?;
            let out = zstd::bulk::decompress(&stored, header.body_len as usize).map_err(|e| {
                Error::format(at.clone(), format!("zstd frame does not decompress: {e}"))
            })?;
            if out.len() as u64 != header.body_len {
                return Err(Error::format(
                    at.clone(),
                    format!(
                        "zstd frame decompressed to {} bytes, header says {}",
                        out.len(),
                        header.body_len
                    ),
                ));
            }
            Cow::Owned(out)
        } else {
            stored
        };
        let sections = section::parse_body(&body, header.n_sections as usize, at)?;
        Ok(PageView {
            header,
            number,
            what,
            at: at.clone(),
            body,
            sections,
        })
    }

    /// A page from its header and uncompressed body bytes of which only
    /// the section table (and its padding) is checked: no CRC, no padding
    /// check after the sections ([`super::Reader::page_structure`]).
    ///
    /// # Errors
    /// [`Error::Format`] naming the page for an invalid section table.
    pub(crate) fn structure(
        header: PageHeader,
        body: &'a [u8],
        number: u64,
        what: String,
        at: &Location,
    ) -> Result<PageView<'a>> {
        let sections = section::parse_table(body, header.n_sections as usize, at)?;
        Ok(PageView {
            header,
            number,
            what,
            at: at.clone(),
            body: Cow::Borrowed(body),
            sections,
        })
    }

    /// The page's section table.
    pub fn sections(&self) -> &[SectionDesc] {
        &self.sections
    }

    /// The uncompressed body.
    pub fn body(&self) -> &[u8] {
        &self.body
    }

    /// Makes the page independent of the file buffer.
    pub fn into_owned(self) -> PageView<'static> {
        PageView {
            header: self.header,
            number: self.number,
            what: self.what,
            at: self.at,
            body: Cow::Owned(self.body.into_owned()),
            sections: self.sections,
        }
    }

    /// The section `(kind, stream)` and its bytes.
    ///
    /// # Errors
    /// [`Error::Format`] naming the page when the section is missing.
    pub fn section(&self, kind: SectionKind, stream: u8) -> Result<(SectionDesc, &[u8])> {
        let d = self
            .sections
            .iter()
            .find(|d| d.kind == kind && d.stream == stream)
            .ok_or_else(|| {
                self.error(format!("missing section {} stream {stream}", kind.name()))
            })?;
        let s = &self.body[d.offset as usize..d.offset as usize + d.len as usize];
        Ok((*d, s))
    }

    /// A [`Error::Format`] of cause [`FormatCause::Codec`] located at this
    /// page, for codec decoders.
    pub fn error(&self, msg: impl Into<String>) -> Error {
        Error::format_with(FormatCause::Codec, self.at.clone(), msg)
    }
}
