//! Device-independent planning of a GPU encode: page body templates,
//! descriptors ([`EncDesc`]) and the work lists of each kernel launch. The
//! per-codec part is each family's `gpu::family::GpuFamily::plan_encode`
//! (`int{b}` / `bdr{h}`: one kernel, `family/affine.rs`; `hqmq` without
//! outlier extraction: a search and a pack kernel, `family/hqmq.rs`); this
//! module holds the plan types, the dispatch and the shared helpers.
//!
//! The planner places the buffers it needs besides the bodies (hqmq side
//! tables and scratch) through a callback, so the CUDA backend and the SIMT
//! emulator (`gpu::emu`) share it.

use crate::cache::TensorInfo;
use crate::codec::Codec;
use crate::error::{Error, Result};
use crate::plan::PlannedPage;

use super::body::CanonicalBody;
use super::spec::{EncDesc, KernelChoice, KernelCodec, KernelOptions};

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
    /// The launches, in order.
    pub works: Vec<EncWork>,
    /// Bytes the kernels read (source elements).
    pub read: u64,
    /// Bytes the kernels write (the sections).
    pub written: u64,
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
        works: Vec::new(),
        read: 0,
        written: 0,
    }
}
