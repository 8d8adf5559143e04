//! The kvpack container, format version 1 (normative text:
//! `format/SPEC.md`).
//!
//! ```text
//! file   := header data
//! header := 64-byte prefix, body (tensor table, codec table, metadata),
//!           zero padding to the alignment
//! data   := commit+            (one commit per write; appends add commits)
//! commit := page-frame* index-frame trailer
//! ```
//!
//! Every frame starts at an aligned data offset (64 bytes by default) and is
//! zero-padded to the next one. A stream is the same byte sequence read front
//! to back: the trailer is the end marker. This module knows nothing about
//! codec math: pages are typed byte sections.

mod bytes;
mod header;
mod index;
mod page;
mod reader;
mod section;
mod stream;
mod writer;

pub use bytes::align_up;
pub use header::{CodecEntry, FileHeader};
pub use index::{Index, IndexEntry, Trailer};
pub use page::{FLAG_ZSTD, PageFrame, PageHeader, PageMeta, PageView};
pub use reader::Reader;
pub use section::{ElemType, Section, SectionDesc, SectionKind};
pub use stream::{StreamEvent, StreamReader};
pub use writer::Writer;

/// The 8 magic bytes at the start of every file and at the end of every
/// trailer: `89 4B 56 50 0D 0A 1A 0A` (`\x89KVP\r\n\x1a\n`), PNG style so
/// that text-mode transfers and truncation to 7 bits are detected.
pub const MAGIC: [u8; 8] = [0x89, b'K', b'V', b'P', b'\r', b'\n', 0x1A, b'\n'];
/// Major format version written and read by this crate.
pub const VERSION_MAJOR: u16 = 1;
/// Newest minor format version this crate reads and writes (1.1 adds fp8
/// element types and MLA latent tensors). Readers accept any minor; a
/// writer emits the lowest minor the file needs
/// ([`FileHeader::required_minor`]), so files without 1.1 features stay
/// 1.0, byte for byte.
pub const VERSION_MINOR: u16 = 1;
/// Default frame alignment in bytes (`2^6`).
pub const DEFAULT_ALIGN_LOG2: u8 = 6;
/// Alignment of sections inside a page body, bytes.
pub const SECTION_ALIGN: usize = 64;
/// Size of every fixed frame header (file prefix, page, index, trailer).
pub const FRAME_HEADER_LEN: usize = 64;

/// Bounds a reader enforces before allocating or trusting lengths.
///
/// Defaults: 16 MiB header, 1 GiB page body, 1 GiB index, 1 Mi tensors,
/// 64 sections per page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest accepted `header_len`, bytes.
    pub max_header_bytes: u64,
    /// Largest accepted page body (stored or uncompressed), bytes.
    pub max_page_bytes: u64,
    /// Largest accepted index body, bytes.
    pub max_index_bytes: u64,
    /// Largest accepted tensor count.
    pub max_tensors: u32,
    /// Largest accepted section count in one page.
    pub max_sections: u16,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_header_bytes: 16 << 20,
            max_page_bytes: 1 << 30,
            max_index_bytes: 1 << 30,
            max_tensors: 1 << 20,
            max_sections: 64,
        }
    }
}
