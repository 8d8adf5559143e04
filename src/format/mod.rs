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
pub(crate) mod pool;
mod reader;
mod section;
mod stream;
mod writer;

pub use bytes::align_up;
pub use header::{CodecEntry, FileHeader};
pub use index::{ENTRY_LEN, Index, IndexEntry, Trailer};
pub use page::{FLAG_ZSTD, PageFrame, PageHeader, PageMeta, PageView};
pub use reader::{Reader, Release};
pub use section::{ElemType, Section, SectionDesc, SectionKind};
pub use stream::{StreamEvent, StreamReader};
pub(crate) use writer::Skeleton;
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

/// Bounds every reader (file, stream, CLI) enforces before allocating or
/// trusting a length, in the manner of image-png's `Limits`: a file or
/// stream can make a reader allocate at most what these allow, whatever it
/// declares.
///
/// | field | default |
/// |---|---|
/// | `max_header_bytes` | 16 MiB |
/// | `max_page_bytes` (stored and uncompressed body) | 1 GiB |
/// | `max_index_bytes` | 1 GiB |
/// | `max_tensors` | 2^20 |
/// | `max_sections` | 64 |
/// | `max_codecs` (codec table slots) | 256 |
/// | `max_layer` (largest layer index) | 65535 |
/// | `max_memory` (declared decoded output of one decode, bytes) | 8 GiB |
/// | `max_body_bytes_per_element` (uncompressed body, plus 1 MiB slack per page) | 16 |
/// | `max_codebook_bytes` (codebooks cached by all codecs of the process) | 512 MiB |
///
/// Every size derived from header fields (elements of a tensor, output
/// bytes, generations) is checked against these before anything is
/// allocated. Output buffers are allocated zeroed (untouched pages cost no
/// memory), so resident memory grows with the pages actually validated and
/// decoded, never with declared sizes alone.
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
    /// Largest accepted codec table (slots).
    pub max_codecs: u32,
    /// Largest accepted layer index (layer indices index per-layer tables).
    pub max_layer: u32,
    /// Largest decoded output one decode may produce (all selected
    /// tensors at the output dtype), bytes: in memory, or written to a
    /// file by a streaming decode (which itself holds a few pages per
    /// thread); a file declaring more is refused before anything is
    /// allocated or written.
    pub max_memory: u64,
    /// A page's uncompressed body may hold at most this many bytes per
    /// element of the page (`planes * tokens * head_dim`), plus 1 MiB: the
    /// bound on what one zstd frame may inflate to.
    pub max_body_bytes_per_element: u64,
    /// Codebook memory that codecs may keep cached, process-wide, bytes
    /// (applied with [`crate::codec::set_codebook_budget`]).
    pub max_codebook_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_header_bytes: 16 << 20,
            max_page_bytes: 1 << 30,
            max_index_bytes: 1 << 30,
            max_tensors: 1 << 20,
            max_sections: 64,
            max_codecs: 256,
            max_layer: u16::MAX as u32,
            max_memory: 8 << 30,
            max_body_bytes_per_element: 16,
            max_codebook_bytes: 512 << 20,
        }
    }
}

impl Limits {
    /// Largest uncompressed body accepted for a page of `elements`
    /// elements: `min(max_page_bytes, elements * max_body_bytes_per_element
    /// + 1 MiB)`.
    pub fn max_body_for(&self, elements: u64) -> u64 {
        elements
            .saturating_mul(self.max_body_bytes_per_element)
            .saturating_add(1 << 20)
            .min(self.max_page_bytes)
    }

    /// Checks that decoding `bytes` of output fits `max_memory`; `what`
    /// names the output in the error.
    ///
    /// # Errors
    /// [`crate::Error::Limits`] naming `what`, the size and the limit.
    pub fn check_memory(&self, bytes: u64, what: &str) -> crate::Result<()> {
        if bytes > self.max_memory {
            return Err(crate::Error::Limits(format!(
                "{what} needs {bytes} bytes of memory, the limit is {} (raise it with --max-memory)",
                self.max_memory
            )));
        }
        Ok(())
    }
}
