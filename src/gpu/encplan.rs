//! Device-independent planning of a GPU encode: page body layouts,
//! descriptors ([`EncDesc`]) and the work lists of each kernel launch. The
//! per-codec part is each family's `gpu::family::GpuFamily::plan_encode`
//! (`int{b}` / `bdr{h}`: one kernel, `family/affine.rs`; `hqmq`: a search
//! and a pack kernel, with `+med` also a median and an outlier-table
//! kernel, after a cell-index build at plan time, `family/hqmq.rs`;
//! `kivi` / `innerq`: one kernel, `family/group_enc.rs`; `polar` keys: a
//! scale and a code kernel, `family/polar.rs`; `raw`: a copy,
//! `family/raw.rs`; `octopus` / `turbo` unit-coded pages: one kernel,
//! `family/sphere.rs`); this module holds the plan types, the dispatch and
//! the shared helpers.
//!
//! The planner places the buffers it needs besides the bodies (hqmq side
//! tables and scratch) through a callback, so the CUDA backend and the SIMT
//! emulator (`gpu::emu`) share it.

use crate::cache::TensorInfo;
use crate::codec::Codec;
use crate::error::{Error, Result};
use crate::plan::PlannedPage;

use super::body::CanonicalBody;
use super::spec::{EncDesc, KernelChoice, KernelCodec, KernelOptions, magic};
use crate::compress::EncodedPage;
use crate::format::Section;

/// Device memory for the buffers an encode planner needs besides the
/// bodies (side tables, scratch): a backend's (`gpu::backend::Backend`,
/// of which this is the supertrait).
pub(crate) trait Place {
    /// Copies `bytes` to new device memory ([`BODY_ALIGN`]-aligned, kept
    /// as long as the backend) and returns its address.
    ///
    /// # Errors
    /// [`Error::Device`] (or [`Error::Io`]) when the memory cannot be had.
    fn place(&mut self, bytes: &[u8]) -> Result<u64>;

    /// New device memory of `len` bytes ([`BODY_ALIGN`]-aligned, kept as
    /// long as the backend), every byte zero (set on the device: nothing
    /// is copied); returns its address.
    ///
    /// # Errors
    /// As [`Place::place`].
    fn zeroed(&mut self, len: usize) -> Result<u64>;

    /// New device memory of `len` bytes (at least `bytes.len()`): `bytes`,
    /// then zeros (cleared on the device; only `bytes` is copied); returns
    /// its address. The default builds the whole buffer on the host.
    ///
    /// # Errors
    /// As [`Place::place`].
    fn place_padded(&mut self, bytes: &[u8], len: usize) -> Result<u64> {
        let mut host = bytes.to_vec();
        host.resize(len.max(bytes.len()), 0);
        self.place(&host)
    }

    /// [`Place::zeroed`] memory with the little-endian u32 `value` at each
    /// byte offset of `at` (4-aligned, ascending, each `+ 4 <= len`); the
    /// default builds the bytes on the host and places them.
    ///
    /// # Errors
    /// As [`Place::place`]; [`Error::Parameter`] (internal) for offsets
    /// that break the rules.
    fn zeroed_with(&mut self, len: usize, value: u32, at: &[usize]) -> Result<u64> {
        check_words(len, at)?;
        let mut host = vec![0u8; len];
        for &o in at {
            host[o..o + 4].copy_from_slice(&value.to_le_bytes());
        }
        self.place(&host)
    }
}

/// Checks the offsets of [`Place::zeroed_with`].
///
/// # Errors
/// [`Error::Parameter`] (internal) for an offset not 4-aligned, not above
/// the previous one, or past `len - 4`.
pub(crate) fn check_words(len: usize, at: &[usize]) -> Result<()> {
    let bad = at
        .iter()
        .enumerate()
        .any(|(i, &o)| !o.is_multiple_of(4) || o + 4 > len || (i > 0 && o <= at[i - 1]));
    if bad {
        return Err(Error::param("internal: u32 offsets of a zeroed buffer"));
    }
    Ok(())
}

/// Alignment of page bodies in the body buffer, bytes.
pub const BODY_ALIGN: usize = 256;

/// One kernel launch of an encode.
#[derive(Debug, Clone)]
pub struct EncWork {
    /// The kernel.
    pub kernel: KernelChoice,
    /// Work items `(descriptor, first unit / row / word)`.
    pub items: Vec<[u32; 2]>,
    /// `bits` argument (affine fallback kernels).
    pub bits: Option<u32>,
    /// `h` argument (affine kernels).
    pub h: Option<u32>,
    /// `c` argument (affine kernels).
    pub c: Option<f32>,
}

/// A planned encode. `descs[i].body` is the offset of page `i`'s body in
/// the bodies buffer (`host_len` bytes, zeroed on the device); the caller
/// rebases it to the buffer's device address.
#[derive(Debug, Clone)]
pub struct EncodeLayout {
    /// Each page's body layout and its offset in the bodies buffer.
    pub layouts: Vec<(CanonicalBody, usize)>,
    /// Bytes of the bodies buffer: every body, [`BODY_ALIGN`]-aligned.
    /// The device buffer starts zeroed and the kernels write the sections;
    /// the section tables are written on the host
    /// ([`EncodedBodies::page`]), so nothing of the size of the
    /// output is built or uploaded.
    pub host_len: usize,
    /// One descriptor per page.
    pub descs: Vec<EncDesc>,
    /// Launches to run once, before the first launch of `works` (they
    /// build tables that `works` read, such as the hqmq cell index).
    pub setup: Vec<EncWork>,
    /// The launches, in order.
    pub works: Vec<EncWork>,
    /// Bytes the kernels read (source elements).
    pub read: u64,
    /// Bytes the kernels write (the sections; an estimate where they
    /// depend on the data).
    pub written: u64,
    /// For bodies whose section lengths depend on the data (written in a
    /// worst-case layout): how the host cuts them; `None` for canonical
    /// bodies.
    pub cut: Option<SectionCut>,
}

/// A cut of a worst-case body into sections: `(layout, body, args)`.
pub type CutFn = fn(&CanonicalBody, &[u8], [u64; 4]) -> Result<Vec<Section>>;

/// How the host turns a body written in a worst-case layout into the CPU
/// encoder's sections, from counts the device wrote into the body (e.g.
/// `hqmq+med`'s outlier count): `cut(layout, body, args)`.
#[derive(Debug, Clone, Copy)]
pub struct SectionCut {
    /// The cut: the body's worst-case layout, the body bytes and `args`.
    pub cut: CutFn,
    /// Codec parameters of the cut.
    pub args: [u64; 4],
}

/// The sections of each page of `layouts` from the downloaded bodies
/// buffer `bodies` (each body at its offset), as the CPU encoder returns
/// them: [`CanonicalBody::sections`], or `cut` for data-dependent layouts.
///
/// # Errors
/// The error of `cut` (an impossible count written by the device).
///
/// # Panics
/// If `bodies` does not hold every body.
pub fn sections(
    layouts: &[(CanonicalBody, usize)],
    cut: Option<SectionCut>,
    bodies: &[u8],
) -> Result<Vec<Vec<Section>>> {
    layouts
        .iter()
        .map(|(l, off)| {
            let body = &bodies[*off..*off + l.body_len as usize];
            match cut {
                Some(c) => (c.cut)(l, body, c.args),
                None => Ok(l.sections(body)),
            }
        })
        .collect()
}

/// Host memory holding a downloaded bodies buffer (a `Vec`, or the CUDA
/// backend's pinned staging).
pub trait HostBytes: Send + Sync {
    /// The bytes.
    fn bytes(&self) -> &[u8];
    /// The bytes, writable.
    fn bytes_mut(&mut self) -> &mut [u8];
}

impl HostBytes for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}

/// The bodies buffer of an encode, downloaded, with the plan's layouts:
/// each page's canonical body (section tables written on the host), or
/// for data-dependent layouts the worst-case body to cut.
pub struct EncodedBodies {
    layouts: Vec<(CanonicalBody, usize)>,
    cut: Option<SectionCut>,
    bytes: Box<dyn HostBytes>,
}

impl std::fmt::Debug for EncodedBodies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EncodedBodies")
            .field("pages", &self.layouts.len())
            .field("bytes", &self.bytes.bytes().len())
            .finish()
    }
}

impl EncodedBodies {
    /// The downloaded bodies buffer `bytes` of a plan with `layouts` and
    /// `cut`; writes each body's section table (the device writes only
    /// the sections into a zeroed buffer).
    ///
    /// # Errors
    /// [`Error::Parameter`] (internal) when `bytes` does not hold every
    /// body.
    pub fn new(
        layouts: Vec<(CanonicalBody, usize)>,
        cut: Option<SectionCut>,
        mut bytes: Box<dyn HostBytes>,
    ) -> Result<EncodedBodies> {
        let b = bytes.bytes_mut();
        if layouts
            .iter()
            .any(|(l, off)| off + l.body_len as usize > b.len())
        {
            return Err(Error::param("internal: bodies buffer too short"));
        }
        if cut.is_none() {
            for (l, off) in &layouts {
                l.write_table(&mut b[*off..]);
            }
        }
        Ok(EncodedBodies {
            layouts,
            cut,
            bytes,
        })
    }

    /// Pages encoded.
    pub fn len(&self) -> usize {
        self.layouts.len()
    }

    /// True when no page was encoded.
    pub fn is_empty(&self) -> bool {
        self.layouts.is_empty()
    }

    /// Page `i` as the frame writer takes it: its canonical body, or the
    /// sections cut out of a data-dependent body.
    ///
    /// # Errors
    /// The error of the cut (an impossible count written by the device);
    /// [`Error::Parameter`] (internal) for `i` out of range or over 65535
    /// sections.
    pub fn page(&self, i: usize) -> Result<EncodedPage<'_>> {
        let (l, off) = self
            .layouts
            .get(i)
            .ok_or_else(|| Error::param("internal: encoded page out of range"))?;
        let body = &self.bytes.bytes()[*off..*off + l.body_len as usize];
        match self.cut {
            Some(c) => (c.cut)(l, body, c.args).map(EncodedPage::Sections),
            None => Ok(EncodedPage::Body {
                body,
                sections: u16::try_from(l.specs.len())
                    .map_err(|_| Error::param("internal: over 65535 sections"))?,
            }),
        }
    }

    /// The sections of every page, as the CPU encoder returns them.
    ///
    /// # Errors
    /// As [`sections`].
    pub fn sections(&self) -> Result<Vec<Vec<Section>>> {
        sections(&self.layouts, self.cut, self.bytes.bytes())
    }
}

/// Checks that a page lies inside the tensor; returns its rows.
pub(crate) fn page_rows(info: &TensorInfo, p: &PlannedPage) -> Result<u32> {
    if p.tokens == 0 || u64::from(p.token_start) + u64::from(p.tokens) > u64::from(info.tokens) {
        return Err(Error::param(format!(
            "page tokens {}..{} outside {} ({} tokens)",
            p.token_start,
            p.token_start + p.tokens,
            info.describe(),
            info.tokens
        )));
    }
    u32::try_from(info.planes() as u64 * u64::from(p.tokens))
        .map_err(|_| Error::param("page over 2^32 rows"))
}

/// The descriptor fields every encode kernel reads, for page `page` (`rows`
/// rows, body at offset `body` of the plan's bodies buffer) of a
/// tensor `info` whose elements start at device address `src`, cut into
/// `upr` units per row; the codec-specific fields (sections, side table,
/// scratch, parameters) are zero.
pub(crate) fn page_desc(
    info: &TensorInfo,
    src: u64,
    pg: &PlannedPage,
    page: usize,
    rows: u32,
    body: usize,
    upr: u32,
) -> EncDesc {
    let esize = info.dtype.size() as u64;
    let d = info.head_dim;
    EncDesc {
        src: src + u64::from(pg.token_start) * u64::from(d) * esize,
        body: body as u64,
        stride: u64::from(info.tokens) * u64::from(d),
        rows,
        tokens: pg.tokens,
        head_dim: d,
        page: page as u32,
        m_tokens: magic(pg.tokens),
        upr,
        m_upr: magic(upr),
        heads: info.heads,
        ..bytemuck::Zeroable::zeroed()
    }
}

/// Reserves room for a body of layout `l` at the end of a bodies buffer
/// of `len` bytes, [`BODY_ALIGN`]-aligned; returns its offset.
pub(crate) fn push_body(len: &mut usize, l: &CanonicalBody) -> usize {
    let off = len.next_multiple_of(BODY_ALIGN);
    *len = off + l.body_len as usize;
    off
}

/// What a family's encode planner (`GpuFamily::plan_encode`)
/// gets: the pages of one tensor to encode and where its elements are.
#[derive(Clone, Copy)]
pub(crate) struct EncodeJob<'a> {
    /// Device address of the source elements, `[planes, tokens, head_dim]`
    /// at `info.dtype`.
    pub src: u64,
    /// The tensor.
    pub info: &'a TensorInfo,
    /// The codec (checked against `info`).
    pub codec: &'a dyn Codec,
    /// Its kernel family for `info`.
    pub kc: KernelCodec,
    /// The pages to encode.
    pub pages: &'a [PlannedPage],
    /// Kernel choice options.
    pub opts: KernelOptions,
}

/// An empty plan.
pub(crate) fn empty() -> EncodeLayout {
    EncodeLayout {
        layouts: Vec::new(),
        host_len: 0,
        descs: Vec::new(),
        setup: Vec::new(),
        works: Vec::new(),
        read: 0,
        written: 0,
        cut: None,
    }
}

/// A [`Place`] for planner tests: records the length of each buffer and
/// returns `0x10_0000 * (its number)` as its address.
#[cfg(test)]
#[derive(Debug, Default)]
pub(crate) struct Counting {
    /// The length of each buffer placed, in order.
    pub sizes: Vec<usize>,
}

#[cfg(test)]
impl Place for Counting {
    fn place(&mut self, bytes: &[u8]) -> Result<u64> {
        self.zeroed(bytes.len())
    }

    fn zeroed(&mut self, len: usize) -> Result<u64> {
        self.sizes.push(len);
        Ok(0x10_0000 * self.sizes.len() as u64)
    }
}
