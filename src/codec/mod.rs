//! Codecs: how one page of a K or V tensor becomes typed sections and back.
//!
//! A codec is a value implementing [`Codec`]. The [`registry`] turns a name
//! such as `bdr128` or `int4` into a codec for encoding, and a codec table
//! entry `(id, params)` from a file back into the same codec for decoding,
//! so a file decodes without out-of-band knowledge.
//!
//! # Adding a codec
//! 1. Write `src/codec/<name>.rs` with a type implementing [`Codec`]: pure
//!    functions over slices, no I/O, shared math from [`crate::kernels`].
//! 2. Give it a [`registry::Family`] (id, name parser, parameter decoder,
//!    example parameter sets with their quality floors) and add that to
//!    [`registry::FAMILIES`]. `tests/conformance.rs` then runs every
//!    example through round trip, re-encode determinism, tampered sections,
//!    random shapes and (with `cuda`) CPU vs GPU.
//! 3. Specify its parameter block and sections in `format/codecs/<name>.md`
//!    and commit a golden vector under `format/vectors/`.
//!
//! The container, the pipeline and the CLI need no change. `ARCHITECTURE.md`
//! has the full checklist, GPU side included.

pub mod affine;
pub(crate) mod groups;
pub mod hqmq;
pub mod innerq;
pub mod kivi;
pub mod octopus;
pub(crate) mod outliers;
pub(crate) mod pagebuf;
pub mod polar;
pub mod raw;
pub mod registry;
pub mod sphere;
pub mod turbo;

use crate::cache::{Elems, ElemsMut, TensorInfo};
use crate::error::Result;
use crate::format::{PageView, Section};
use crate::plan::Layout;
use crate::view::{CacheView, RowsOut, TensorView};

pub use registry::{Example, Family, from_entry, parse};

/// One page to encode: tokens `[token_start, token_start + tokens)` of every
/// plane (`batch * kv_heads` of them) of one tensor, at source precision.
#[derive(Debug)]
pub struct PageIn<'a> {
    /// The tensor the page belongs to (shape, dtype, layer, K/V).
    pub tensor: &'a TensorInfo,
    /// First token of the page.
    pub token_start: u32,
    /// Tokens in the page.
    pub tokens: u32,
    /// One `[tokens, head_dim]` row-major slice per plane (empty when
    /// `source` is set).
    pub planes: Vec<Elems<'a>>,
    /// For codecs that read rows one at a time ([`Codec::row_wise`]): the
    /// tensor the rows are read from in place (any strides, or a paged
    /// cache), instead of `planes`.
    pub source: Option<&'a TensorView<'a>>,
}

impl<'a> PageIn<'a> {
    /// Elements per head vector.
    pub fn head_dim(&self) -> usize {
        self.tensor.head_dim as usize
    }

    /// Number of rows (`planes * tokens`), in plane-major order.
    pub fn rows(&self) -> usize {
        let planes = match self.source {
            Some(v) => v.info.planes(),
            None => self.planes.len(),
        };
        planes * self.tokens as usize
    }

    /// Row `r` (plane `r / tokens`, token `r % tokens`): its `head_dim`
    /// elements.
    ///
    /// # Panics
    /// If `r >= rows()`.
    pub fn row(&self, r: usize) -> Elems<'a> {
        let (t, d) = (self.tokens as usize, self.head_dim());
        match self.source {
            Some(v) => v.row(r / t, self.token_start as usize + r % t),
            None => self.planes[r / t].slice((r % t) * d, d),
        }
    }

    /// Hints the CPU to start loading row `r` into cache (a codec about to
    /// read rows in a paged cache's order calls it a few tokens ahead, so
    /// the jumps between blocks do not stall). Does nothing for `r >=
    /// rows()` or on CPUs without a prefetch instruction.
    pub fn prefetch_row(&self, r: usize) {
        if r < self.rows() {
            prefetch(self.row(r).bytes());
        }
    }

    /// Widens row `r` (plane `r / tokens`, token `r % tokens`) to f32.
    ///
    /// # Panics
    /// If `r >= rows()` or `out.len() != head_dim()`.
    pub fn load_row(&self, r: usize, out: &mut [f32]) {
        self.row(r).load(0, out);
    }

    /// A parameter error `e` located at row `r` (tensor, plane, token).
    pub fn row_error(&self, r: usize, e: impl std::fmt::Display) -> crate::Error {
        let t = self.tokens as usize;
        crate::Error::param(format!(
            "{} ({}) plane {} token {}: {e}",
            self.tensor.name,
            self.tensor.describe(),
            r / t,
            self.token_start as usize + r % t
        ))
    }
}

/// Destination of one decoded page: the same token range of every plane, in
/// the caller's output element type.
#[derive(Debug)]
pub struct PageOut<'a> {
    /// The tensor the page belongs to.
    pub tensor: &'a TensorInfo,
    /// Tokens in the page.
    pub tokens: u32,
    /// One `[tokens, head_dim]` row-major slice per plane (empty when
    /// `scatter` is set).
    pub planes: Vec<ElemsMut<'a>>,
    /// For codecs that write rows one at a time ([`Codec::row_wise`]):
    /// the destination's rows written in place (any strides, or a paged
    /// cache), instead of `planes`.
    pub scatter: Option<RowsOut<'a>>,
}

impl PageOut<'_> {
    /// Number of rows (`planes * tokens`).
    pub fn rows(&self) -> usize {
        let planes = match &self.scatter {
            Some(_) => self.tensor.planes(),
            None => self.planes.len(),
        };
        planes * self.tokens as usize
    }

    /// Row `r` (plane `r / tokens`, token `r % tokens`): its `head_dim`
    /// elements, writable.
    ///
    /// # Panics
    /// If `r >= rows()`.
    pub fn row_mut(&mut self, r: usize) -> ElemsMut<'_> {
        let (t, d) = (self.tokens as usize, self.tensor.head_dim as usize);
        match &mut self.scatter {
            Some(s) => s.row(r / t, r % t),
            None => self.planes[r / t].slice_mut((r % t) * d, d),
        }
    }

    /// Hints the CPU to start loading row `r` into cache (see
    /// [`PageIn::prefetch_row`]).
    pub fn prefetch_row(&mut self, r: usize) {
        if r < self.rows() {
            prefetch(self.row_mut(r).bytes_mut());
        }
    }

    /// Narrows `row` (f32, `head_dim` values) into row `r`.
    ///
    /// # Panics
    /// If `r >= rows()`.
    pub fn store_row(&mut self, r: usize, row: &[f32]) {
        self.row_mut(r).store(0, row);
    }
}

/// Asks the CPU to load the cache lines of `bytes` (a hint: it never
/// faults; nothing on CPUs without a prefetch instruction).
fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in bytes.chunks(64) {
        // SAFETY: a prefetch hint to an address inside a live slice; it
        // never faults and reads nothing.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                line.as_ptr().cast(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// The order to visit a page's `rows` (plane-major, `tokens` per plane)
/// in: as stored, or token by token (every plane of a token, then the
/// next token) when `token_major`, i.e. when the rows live in the caller's
/// token-major or paged memory ([`PageIn::source`], [`PageOut::scatter`]),
/// so that memory is walked forward.
pub(crate) fn row_order(
    rows: usize,
    tokens: usize,
    token_major: bool,
) -> impl Iterator<Item = usize> {
    let planes = rows / tokens.max(1);
    (0..rows).map(move |i| {
        if token_major {
            (i % planes) * tokens + i / planes
        } else {
            i
        }
    })
}

/// A KV cache codec.
///
/// Implementations are immutable values; `encode` and `decode` may be called
/// from many threads at once.
pub trait Codec: Send + Sync + std::fmt::Debug {
    /// Canonical name, accepted by [`registry::parse`] (e.g. `bdr128:k`).
    fn name(&self) -> String;

    /// Registered codec id written in the codec table.
    fn id(&self) -> u16;

    /// The parameter block written in the codec table (layout defined in
    /// `format/codecs/<codec>.md`).
    fn params(&self) -> Vec<u8>;

    /// Checks that the codec can encode `tensor` (e.g. head_dim divisible
    /// by a block size).
    ///
    /// # Errors
    /// [`crate::Error::Parameter`] naming the tensor and the constraint.
    fn check(&self, tensor: &TensorInfo) -> Result<()>;

    /// Data-dependent preparation over the whole cache before encoding
    /// (calibration that ends up in the parameter block). `layout` tells
    /// which tokens will be coded (outside the sink/recent windows). Returns the codec
    /// to use instead of `self`, or `None` when there is nothing to
    /// prepare (the default).
    ///
    /// # Errors
    /// As [`Codec::check`].
    fn prepare(&self, _cache: &CacheView<'_>, _layout: &Layout) -> Result<Option<Box<dyn Codec>>> {
        Ok(None)
    }

    /// Sink and recent windows (tokens kept at source precision) this codec
    /// uses when the caller does not choose them, e.g. InnerQ's 32 + 96 or
    /// KIVI's 128-token residual. Default: none.
    fn default_windows(&self) -> (u32, u32) {
        (0, 0)
    }

    /// True when the encoded size of a page depends only on its shape
    /// (tensor info and token count), never on the values: no
    /// data-dependent side tables such as outliers. Then
    /// [`crate::compress::max_compressed_size`] bounds such pages by their
    /// exact size instead of the raw size. Default `false` (always safe);
    /// `tests/views.rs` checks every codec that claims it.
    fn size_depends_only_on_shape(&self) -> bool {
        false
    }

    /// True when [`Codec::encode`] reads the page only through
    /// [`PageIn::row`] / [`PageIn::load_row`] and [`Codec::decode`] writes
    /// it only through [`PageOut::row_mut`] / [`PageOut::store_row`]: then
    /// pages of tensors in other memory orders (token-major, paged caches)
    /// are read and written in place ([`PageIn::source`],
    /// [`PageOut::scatter`]) instead of through a page-sized copy.
    /// Default `false`.
    fn row_wise(&self) -> bool {
        false
    }

    /// Encodes one page into sections.
    ///
    /// # Errors
    /// [`crate::Error::Parameter`] for values the codec cannot represent
    /// (NaN/inf for quantizing codecs), naming the page.
    fn encode(&self, page: &PageIn<'_>) -> Result<Vec<Section>>;

    /// Decodes one page into `out`.
    ///
    /// # Errors
    /// [`crate::Error::Format`] naming the page when a section is missing
    /// or has the wrong type or size.
    fn decode(&self, page: &PageView<'_>, out: &mut PageOut<'_>) -> Result<()>;

    /// Nominal bits per element for pages of `tensor`: codec payload only
    /// (scales, zero points, codes, per-vector side data), excluding
    /// container framing and data-dependent outliers.
    fn bits_per_element(&self, tensor: &TensorInfo) -> f64;
}

/// Checks, before any page is decoded, that every codec slot can decode
/// every tensor it has pages for ([`Codec::check`]): parameters that do
/// not fit the tensor (a BDR block larger than head_dim, hqmq chunks that
/// do not divide it, ...) are a format error of the file, never a panic in
/// a kernel.
///
/// # Errors
/// [`crate::Error::Format`] at the header naming the codec slot, the tensor
/// and the constraint; also when a page names a slot or tensor that does
/// not exist.
pub fn check_pages_fit(
    codecs: &[Box<dyn Codec>],
    tensors: &[TensorInfo],
    pages: impl Iterator<Item = crate::format::PageMeta>,
) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for m in pages {
        if seen.insert((m.codec, m.tensor)) {
            check_page_fits(codecs, tensors, m)?;
        }
    }
    Ok(())
}

/// [`check_pages_fit`] for one page.
///
/// # Errors
/// As [`check_pages_fit`].
pub fn check_page_fits(
    codecs: &[Box<dyn Codec>],
    tensors: &[TensorInfo],
    m: crate::format::PageMeta,
) -> Result<()> {
    use crate::error::{Error, Location};
    let (Some(c), Some(t)) = (codecs.get(m.codec as usize), tensors.get(m.tensor as usize)) else {
        return Err(Error::format(
            Location::Header,
            format!(
                "a page names codec slot {} and tensor {}, which do not exist",
                m.codec, m.tensor
            ),
        ));
    };
    c.check(t).map_err(|e| {
        Error::format(
            Location::Header,
            format!(
                "codec slot {} ({}) cannot decode {} ({}): {e}",
                m.codec,
                c.name(),
                t.name,
                t.describe()
            ),
        )
    })
}

/// Sets the process-wide budget, in bytes, for codebooks that codecs keep
/// cached between pages (hqmq builds one per layer, kv head and K/V). Past
/// it, codebooks are built per page and not kept. Default: 512 MiB
/// ([`crate::format::Limits::max_codebook_bytes`]).
pub fn set_codebook_budget(bytes: u64) {
    hqmq::codebook::set_budget(bytes);
}

/// Checks that a section holds exactly `count` elements of `elem`.
///
/// # Errors
/// [`crate::Error::Format`] naming the page.
pub fn expect_section<'p>(
    page: &'p PageView<'_>,
    kind: crate::format::SectionKind,
    stream: u8,
    elem: crate::format::ElemType,
    count: usize,
) -> Result<&'p [u8]> {
    let (d, bytes) = page.section(kind, stream)?;
    if d.elem != elem || d.count as usize != count {
        return Err(page.error(format!(
            "section {} stream {stream} holds {} {} elements, expected {count} {}",
            kind.name(),
            d.count,
            d.elem.name(),
            elem.name()
        )));
    }
    Ok(bytes)
}

/// Checks that the page has exactly `n` sections. Codec decoders call it
/// after finding the sections they expect, so that a page carrying a
/// section its codec does not define is rejected (format/SPEC.md 6.3).
///
/// # Errors
/// [`crate::Error::Format`] naming the page.
pub fn expect_section_count(page: &PageView<'_>, n: usize) -> Result<()> {
    if page.sections().len() != n {
        return Err(page.error(format!(
            "{} sections, the codec defines {n} for this page",
            page.sections().len()
        )));
    }
    Ok(())
}

/// Reads little-endian f32 number `i` of `bytes`.
///
/// # Panics
/// If out of bounds (callers check section sizes with [`expect_section`]).
#[inline]
pub fn f32_at(bytes: &[u8], i: usize) -> f32 {
    f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().expect("4 bytes"))
}
