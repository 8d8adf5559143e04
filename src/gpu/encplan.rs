//! Device-independent planning of a GPU encode: page body templates,
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
use crate::format::Section;

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
/// `host`; the caller rebases it to the device address of the uploaded
/// `host`.
#[derive(Debug, Clone)]
pub struct EncodeLayout {
    /// Each page's body layout and its offset in `host`.
    pub layouts: Vec<(CanonicalBody, usize)>,
    /// The body templates (section tables filled in, sections zeroed).
    pub host: Vec<u8>,
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
/// rows, body template at offset `body` of the plan's host buffer) of a
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

/// Appends a body template, [`BODY_ALIGN`]-aligned; returns its offset.
pub(crate) fn push_body(host: &mut Vec<u8>, l: &CanonicalBody) -> usize {
    host.resize(host.len().next_multiple_of(BODY_ALIGN), 0);
    let off = host.len();
    host.extend_from_slice(&l.template());
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
        host: Vec::new(),
        descs: Vec::new(),
        setup: Vec::new(),
        works: Vec::new(),
        read: 0,
        written: 0,
        cut: None,
    }
}
