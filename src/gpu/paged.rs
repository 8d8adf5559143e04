//! Paged KV caches as serving engines hold them on the GPU: the layouts
//! ([`PagedLayout`]), their geometry ([`PagedShape`]), the element
//! addressing of one of K or V ([`PagedAddr`]) shared by every decode
//! kernel (`row_dst` in `kernels/common.cuh`), a cache in device memory
//! described by raw pointers ([`PagedCache`]) and the block-table to slot
//! mapping ([`slot_mapping`]).
//!
//! Token `t` of a sequence lives in block `block_ids[t / block_size]`, row
//! `t % block_size` (vLLM's block table). Plain data: nothing here touches
//! a device, so it is tested without CUDA.

pub use super::addr::{PagedAddr, PagedStrides};
use super::encplan::EncodedBodies;
use super::spec::{DstSpec, Grid, KernelChoice, KernelCodec, PageDesc, PageGeom, page_desc};
use crate::cache::{DType, Kind, KvCache, Tensor, TensorData, TensorInfo};
use crate::codec::Codec;
use crate::compress::{CompressOptions, CompressReport, EncodedPage};
use crate::decode::Archive;
use crate::error::{Error, Result};
use crate::plan::PlannedPage;

/// How a paged KV cache tensor is laid out (the layouts vLLM's attention
/// back ends allocate). All element strides are in elements of the cache's
/// dtype; every tensor is C-contiguous.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PagedLayout {
    /// FlashAttention: one tensor per layer `[2, num_blocks, block_size,
    /// kv_heads, head_dim]`, K at index 0 of the first axis, V at 1.
    FlashAttn,
    /// FlashInfer: one tensor per layer `[num_blocks, 2, block_size,
    /// kv_heads, head_dim]`, K at index 0 of the second axis, V at 1.
    FlashInfer,
    /// HND: one tensor for K and one for V, each `[num_blocks, kv_heads,
    /// block_size, head_dim]`.
    Hnd,
}

impl PagedLayout {
    /// Parses `flash_attn`, `flashinfer` or `hnd` (the Python names).
    ///
    /// # Errors
    /// [`Error::Parameter`] for another name.
    pub fn parse(s: &str) -> Result<PagedLayout> {
        match s {
            "flash_attn" => Ok(PagedLayout::FlashAttn),
            "flashinfer" => Ok(PagedLayout::FlashInfer),
            "hnd" => Ok(PagedLayout::Hnd),
            _ => Err(Error::param(format!(
                "unknown paged layout {s:?}: expected \"flash_attn\", \"flashinfer\" or \"hnd\""
            ))),
        }
    }

    /// The name [`PagedLayout::parse`] accepts.
    pub fn name(self) -> &'static str {
        match self {
            PagedLayout::FlashAttn => "flash_attn",
            PagedLayout::FlashInfer => "flashinfer",
            PagedLayout::Hnd => "hnd",
        }
    }

    /// True when K and V live in one tensor (FlashAttention, FlashInfer);
    /// false when they are two tensors (HND).
    pub fn joint(self) -> bool {
        !matches!(self, PagedLayout::Hnd)
    }

    /// The axis names of one tensor of this layout.
    pub fn axes(self) -> &'static str {
        match self {
            PagedLayout::FlashAttn => "[2, num_blocks, block_size, kv_heads, head_dim]",
            PagedLayout::FlashInfer => "[num_blocks, 2, block_size, kv_heads, head_dim]",
            PagedLayout::Hnd => "[num_blocks, kv_heads, block_size, head_dim]",
        }
    }
}

/// The geometry of a paged cache: blocks, rows (tokens) per block, KV
/// heads, elements per head vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PagedShape {
    /// Blocks in the cache.
    pub num_blocks: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// KV heads.
    pub kv_heads: u32,
    /// Elements per head vector.
    pub head_dim: u32,
}

impl PagedShape {
    /// The geometry of a tensor of `layout` with shape `dims` (see
    /// [`PagedLayout::axes`]).
    ///
    /// # Errors
    /// [`Error::Parameter`] for a wrong rank, a K/V axis that is not 2, a
    /// zero or over-2^32 dimension, or more than 2^32 slots.
    pub fn from_dims(layout: PagedLayout, dims: &[usize]) -> Result<PagedShape> {
        let bad = |why: &str| {
            Error::param(format!(
                "paged cache shape {dims:?} does not match the {} layout {}: {why}",
                layout.name(),
                layout.axes()
            ))
        };
        let [nb, bs, h, d] = match (layout, dims) {
            (PagedLayout::FlashAttn, &[two, nb, bs, h, d]) => {
                if two != 2 {
                    return Err(bad("axis 0 must be 2 (K, V)"));
                }
                [nb, bs, h, d]
            }
            (PagedLayout::FlashInfer, &[nb, two, bs, h, d]) => {
                if two != 2 {
                    return Err(bad("axis 1 must be 2 (K, V)"));
                }
                [nb, bs, h, d]
            }
            (PagedLayout::Hnd, &[nb, h, bs, d]) => [nb, bs, h, d],
            _ => return Err(bad("wrong number of dimensions")),
        };
        let u = |x: usize| u32::try_from(x).ok().filter(|&v| v > 0);
        let (Some(num_blocks), Some(block_size), Some(kv_heads), Some(head_dim)) =
            (u(nb), u(bs), u(h), u(d))
        else {
            return Err(bad("every dimension must be between 1 and 2^32 - 1"));
        };
        if u64::from(num_blocks) * u64::from(block_size) > u64::from(u32::MAX) {
            return Err(bad("more than 2^32 - 1 slots (num_blocks x block_size)"));
        }
        Ok(PagedShape {
            num_blocks,
            block_size,
            kv_heads,
            head_dim,
        })
    }

    /// The shape of one tensor of `layout` (inverse of
    /// [`PagedShape::from_dims`]).
    pub fn dims(&self, layout: PagedLayout) -> Vec<usize> {
        let [nb, bs, h, d] = [
            self.num_blocks,
            self.block_size,
            self.kv_heads,
            self.head_dim,
        ]
        .map(|x| x as usize);
        match layout {
            PagedLayout::FlashAttn => vec![2, nb, bs, h, d],
            PagedLayout::FlashInfer => vec![nb, 2, bs, h, d],
            PagedLayout::Hnd => vec![nb, h, bs, d],
        }
    }

    /// Elements of one of K or V: `num_blocks * block_size * kv_heads *
    /// head_dim`.
    pub fn kv_elements(&self) -> u64 {
        u64::from(self.num_blocks)
            * u64::from(self.block_size)
            * u64::from(self.kv_heads)
            * u64::from(self.head_dim)
    }

    /// Elements of one tensor of `layout` (both K and V for the joint
    /// layouts, one of them for HND).
    pub fn tensor_elements(&self, layout: PagedLayout) -> u64 {
        if layout.joint() {
            2 * self.kv_elements()
        } else {
            self.kv_elements()
        }
    }

    /// Where K or V lives in a tensor of `layout`: element offset of
    /// (block 0, row 0, head 0) from the tensor's first element, and the
    /// strides.
    pub fn addr(&self, layout: PagedLayout, kind: Kind) -> (u64, PagedAddr) {
        let (bs, h, d) = (
            u64::from(self.block_size),
            u64::from(self.kv_heads),
            u64::from(self.head_dim),
        );
        let v = kind == Kind::Value;
        let (offset, strides) = match layout {
            PagedLayout::FlashAttn => (
                if v { self.kv_elements() } else { 0 },
                PagedStrides {
                    block: bs * h * d,
                    token: h * d,
                    head: d,
                },
            ),
            PagedLayout::FlashInfer => (
                if v { bs * h * d } else { 0 },
                PagedStrides {
                    block: 2 * bs * h * d,
                    token: h * d,
                    head: d,
                },
            ),
            PagedLayout::Hnd => (
                0,
                PagedStrides {
                    block: h * bs * d,
                    token: d,
                    head: bs * d,
                },
            ),
        };
        (
            offset,
            PagedAddr {
                num_blocks: u64::from(self.num_blocks),
                block_size: self.block_size,
                strides,
            },
        )
    }

    /// Where K or V lives in a host-side image of one layer's cache (the
    /// tensor of a joint layout, or the K tensor followed by the V tensor
    /// for HND; `2 * kv_elements()` elements in all layouts): element
    /// offset of (block 0, row 0, head 0), elements from there to the end
    /// of the image, and the addressing.
    pub fn image_target(&self, layout: PagedLayout, kind: Kind) -> (u64, u64, PagedAddr) {
        let (mut off, addr) = self.addr(layout, kind);
        if !layout.joint() && kind == Kind::Value {
            off += self.kv_elements();
        }
        (off, 2 * self.kv_elements() - off, addr)
    }

    /// Blocks that hold `tokens` tokens: `ceil(tokens / block_size)`.
    pub fn blocks_for(&self, tokens: u32) -> usize {
        tokens.div_ceil(self.block_size) as usize
    }
}

/// A paged KV cache of one layer in device memory, described by raw
/// device addresses (for example `tensor.data_ptr()` of a torch CUDA
/// tensor). K and V of a joint layout share one address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedCache {
    layout: PagedLayout,
    shape: PagedShape,
    dtype: DType,
    k: u64,
    v: u64,
}

impl PagedCache {
    /// Describes a cache at device address `k` (the one tensor of a joint
    /// layout, or the K tensor of HND) and `v` (the V tensor of HND; must
    /// be `None` for the joint layouts), of shape `dims` (see
    /// [`PagedLayout::axes`]) and 16-bit `dtype`.
    ///
    /// # Safety
    /// `k` (and `v`) must be the addresses of live, C-contiguous device
    /// allocations of the CUDA device the cache is used with, each holding
    /// [`PagedShape::tensor_elements`] elements of `dtype`, that stay
    /// allocated until every operation using this description has
    /// completed on its stream. kvpack cannot check any of this: a wrong
    /// address or shape makes kernels read or write arbitrary device
    /// memory.
    ///
    /// # Errors
    /// [`Error::Parameter`] for a bad shape ([`PagedShape::from_dims`]), a
    /// dtype other than bf16/fp16, a null or not 16-byte aligned address,
    /// a missing V address for HND or an extra one for a joint layout.
    pub unsafe fn from_raw(
        layout: PagedLayout,
        dtype: DType,
        dims: &[usize],
        k: u64,
        v: Option<u64>,
    ) -> Result<PagedCache> {
        let shape = PagedShape::from_dims(layout, dims)?;
        if !matches!(dtype, DType::Bf16 | DType::F16) {
            return Err(Error::param(format!(
                "paged caches are bf16 or fp16 (got {})",
                dtype.name()
            )));
        }
        let v = match (layout.joint(), v) {
            (true, None) => k,
            (false, Some(v)) => v,
            (true, Some(_)) => {
                return Err(Error::param(format!(
                    "the {} layout holds K and V in one tensor: pass no separate V tensor",
                    layout.name()
                )));
            }
            (false, None) => {
                return Err(Error::param(
                    "the hnd layout needs a K and a V tensor".to_string(),
                ));
            }
        };
        for (what, p) in [("K", k), ("V", v)] {
            if p == 0 || !p.is_multiple_of(16) {
                return Err(Error::param(format!(
                    "{what} cache address 0x{p:x} is null or not 16-byte aligned"
                )));
            }
        }
        Ok(PagedCache {
            layout,
            shape,
            dtype,
            k,
            v,
        })
    }

    /// The layout.
    pub fn layout(&self) -> PagedLayout {
        self.layout
    }

    /// The geometry.
    pub fn shape(&self) -> PagedShape {
        self.shape
    }

    /// The element type (bf16 or fp16).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Device address of element (block 0, row 0, head 0) of K or V, the
    /// elements from there to the end of its tensor, and its addressing.
    pub fn target(&self, kind: Kind) -> (u64, u64, PagedAddr) {
        let base = if kind == Kind::Key { self.k } else { self.v };
        let (off, addr) = self.shape.addr(self.layout, kind);
        let len = self.shape.tensor_elements(self.layout) - off;
        (base + 2 * off, len, addr)
    }
}

/// The slot of every token `0..tokens` of a sequence whose blocks are
/// `block_ids` (`slot = block_ids[t / block_size] * block_size + t %
/// block_size`). Ids past the first `ceil(tokens / block_size)` are ignored
/// (block tables are often padded).
///
/// # Errors
/// [`Error::Parameter`] when `block_ids` holds fewer than `ceil(tokens /
/// block_size)` ids, or a used id is negative, not below `num_blocks`, or
/// used twice (two tokens would share a row).
pub fn slot_mapping(block_ids: &[i64], shape: &PagedShape, tokens: u32) -> Result<Vec<i64>> {
    let need = shape.blocks_for(tokens);
    if block_ids.len() < need {
        return Err(Error::param(format!(
            "{} block ids for {tokens} tokens in blocks of {}: {need} needed",
            block_ids.len(),
            shape.block_size
        )));
    }
    let mut seen = vec![false; shape.num_blocks as usize];
    for (i, &b) in block_ids[..need].iter().enumerate() {
        if b < 0 || b >= i64::from(shape.num_blocks) {
            return Err(Error::param(format!(
                "block id {b} (position {i}) is outside the cache's {} blocks",
                shape.num_blocks
            )));
        }
        if std::mem::replace(&mut seen[b as usize], true) {
            return Err(Error::param(format!(
                "block id {b} (position {i}) is used twice"
            )));
        }
    }
    let bs = i64::from(shape.block_size);
    Ok((0..i64::from(tokens))
        .map(|t| block_ids[(t / bs) as usize] * bs + t % bs)
        .collect())
}

/// The K and V tensors (table positions) of `layer`.
///
/// # Errors
/// [`Error::Parameter`] when the file lacks either, or a tensor does not
/// fit `shape` (batch 1, same kv_heads and head_dim);
/// [`Error::Unsupported`] for an fp8 tensor or an MLA latent layer
/// ([`super::spec::supported`]: the CPU decodes those).
pub fn layer_tensors(
    archive: &Archive<'_>,
    layer: u32,
    shape: &PagedShape,
) -> Result<[(u32, Kind); 2]> {
    let infos = archive.tensors();
    if let Some(latent) = infos
        .iter()
        .find(|t| t.layer == layer && t.kind == Kind::Latent)
    {
        super::spec::supported(latent)?;
    }
    let found = layer_kv(&infos, layer, shape)?;
    for (i, _) in found {
        super::spec::supported(&infos[i as usize])?;
    }
    Ok(found)
}

/// The K and V tensors (table positions in `infos`, a file's tensor
/// table) of `layer`, checked to fit a paged cache of `shape` (batch 1,
/// same kv_heads and head_dim).
///
/// # Errors
/// [`Error::Parameter`] when the file lacks either or a tensor does not fit.
pub fn layer_kv(infos: &[TensorInfo], layer: u32, shape: &PagedShape) -> Result<[(u32, Kind); 2]> {
    let find = |kind: Kind| -> Result<(u32, Kind)> {
        let (i, info) = infos
            .iter()
            .enumerate()
            .find(|(_, t)| t.layer == layer && t.kind == kind)
            .ok_or_else(|| {
                Error::param(format!(
                    "the file has no {} tensor for layer {layer} ({} layers)",
                    kind.letter(),
                    infos.iter().map(|t| t.layer + 1).max().unwrap_or(0)
                ))
            })?;
        if info.batch != 1 || info.heads != shape.kv_heads || info.head_dim != shape.head_dim {
            return Err(Error::param(format!(
                "{} ({}) does not fit a paged cache of {} kv heads x head_dim {} (batch 1 needed)",
                info.name,
                info.describe(),
                shape.kv_heads,
                shape.head_dim
            )));
        }
        Ok((i as u32, kind))
    };
    Ok([find(Kind::Key)?, find(Kind::Value)?])
}

/// The tensor table entries of one layer's K and V read out of a paged
/// cache: batch 1, `shape.kv_heads` heads, `tokens` tokens, named
/// `past_key_values.{layer}.key` / `.value` (the safetensors convention of
/// the CLI).
pub fn layer_infos(shape: &PagedShape, dtype: DType, layer: u32, tokens: u32) -> Vec<TensorInfo> {
    [(Kind::Key, "key"), (Kind::Value, "value")]
        .into_iter()
        .map(|(kind, n)| TensorInfo {
            name: format!("past_key_values.{layer}.{n}"),
            layer,
            kind,
            dtype,
            batch: 1,
            heads: shape.kv_heads,
            tokens,
            head_dim: shape.head_dim,
        })
        .collect()
}

/// The gather kernel for rows of `head_dim` elements (`raw.cu`).
pub fn gather_kernel(head_dim: u32) -> KernelChoice {
    if head_dim.is_multiple_of(8) {
        KernelChoice {
            source: "raw",
            name: "gather_paged_w8".into(),
            grid: Grid::Units {
                w: 8,
                per_thread: super::spec::UNITS_PER_THREAD,
            },
            shared: 0,
        }
    } else {
        KernelChoice {
            source: "raw",
            name: "gather_paged_any".into(),
            grid: Grid::Elements,
            shared: 0,
        }
    }
}

/// The gather launch of K and V (`gather_paged_*` in `kernels/raw.cu`):
/// rows of slots `slots` (device address, `tokens` i64 entries) of the
/// paged `targets[i]` = (address of (block 0, row 0, head 0), elements from
/// there, addressing) into the contiguous `[kv_heads, tokens, head_dim]`
/// buffers at `outs[i]`. Returns the kernel, the two descriptors and the
/// work list.
///
/// # Errors
/// [`Error::Parameter`] when a target does not hold the cache's rows.
pub fn gather_plan(
    shape: &PagedShape,
    targets: [(u64, u64, PagedAddr); 2],
    slots: u64,
    tokens: u32,
    outs: [u64; 2],
) -> Result<(KernelChoice, Vec<PageDesc>, Vec<[u32; 2]>)> {
    let kernel = gather_kernel(shape.head_dim);
    let geom = PageGeom {
        kc: KernelCodec::Raw { src: DType::Bf16 },
        token_start: 0,
        tokens,
        batch: 1,
        heads: shape.kv_heads,
        head_dim: shape.head_dim,
        sections: [0; 5],
        params: [0; 4],
        side: 0,
        read: 0,
    };
    let (mut descs, mut work) = (Vec::new(), Vec::new());
    for (i, ((ptr, len, addr), out)) in targets.into_iter().zip(outs).enumerate() {
        let dst = DstSpec::Paged {
            ptr,
            len,
            slots,
            slots_len: u64::from(tokens),
            slot_stride: 0,
            addr: Some(addr),
        };
        if let Some((d, _)) = page_desc(&geom, out, &dst, kernel.grid.unit())? {
            descs.push(d);
            kernel
                .grid
                .push_items(i as u32, d.rows, tokens, shape.head_dim, &mut work);
        }
    }
    Ok((kernel, descs, work))
}

/// The kvpack file of one layer gathered to the host (`data[0]` K,
/// `data[1]` V, each `[kv_heads, tokens, head_dim]` bf16/fp16 bits),
/// written to `out`, compressed with the CPU codecs: the fallback of a paged encode for
/// codecs without a GPU encoder (and for layouts with raw windows).
///
/// # Errors
/// As [`crate::compress::compress`].
pub fn file_from_host<W: std::io::Write + Send>(
    infos: Vec<TensorInfo>,
    data: [Vec<u16>; 2],
    codec: &dyn Codec,
    opts: &CompressOptions,
    out: W,
) -> Result<(W, CompressReport)> {
    let tensors = infos
        .into_iter()
        .zip(data)
        .map(|(info, v)| host_tensor(info, v))
        .collect::<Result<Vec<_>>>()?;
    let cache = KvCache {
        tensors,
        metadata: Default::default(),
        token_ids: Vec::new(),
    };
    crate::compress::compress(&cache, codec, opts, out, &|_| {})
}

/// A tensor of 16-bit elements (`info.dtype` bf16 or fp16) from their bit
/// patterns.
///
/// # Errors
/// [`Error::Parameter`] for fp32 or a length that does not match `info`.
pub fn host_tensor(info: TensorInfo, bits: Vec<u16>) -> Result<Tensor> {
    let d = match info.dtype {
        DType::Bf16 => TensorData::Bf16(bytemuck::allocation::cast_vec(bits)),
        DType::F16 => TensorData::F16(bytemuck::allocation::cast_vec(bits)),
        DType::F32 | DType::Fp8(_) => {
            return Err(Error::param(format!(
                "paged caches are bf16 or fp16 (got {})",
                info.dtype.name()
            )));
        }
    };
    Tensor::new(info, d)
}

/// True when a paged encode of `infos` planned as `pages` runs on the GPU
/// (no `raw_fallback`, and `gpu::family::gpu_encodes` for every
/// tensor, with `codec` for the codec pages and `raw` for sink/recent
/// window pages); otherwise it takes the host fallback
/// ([`file_from_host`]).
pub fn encodes_on_gpu(
    infos: &[TensorInfo],
    pages: &[PlannedPage],
    codec: &dyn Codec,
    opts: &CompressOptions,
) -> bool {
    let windows = pages.iter().any(|p| p.raw);
    !opts.raw_fallback
        && infos.iter().all(|i| {
            super::family::gpu_encodes(codec, i)
                && (!windows || super::family::gpu_encodes(&crate::codec::raw::Raw, i))
        })
}

/// The codec a layer encode on the GPU writes when `codec` needs
/// whole-layer statistics first (InnerQ with key normalization, which the
/// compressor prepares from the key tensor's body tokens): `codec`
/// prepared with the key factors computed from `amax(body pages of the key
/// tensor infos[0])` (a device launch returning the statistics section of
/// `gpu::family::group_enc::plan_key_amax`). `None` when `codec` needs no statistics or
/// the layer does not encode on the GPU (the host fallback prepares it).
///
/// # Errors
/// The error of `amax` (a NaN or infinity in a key names its row).
pub fn prepare_on_gpu(
    codec: &dyn Codec,
    infos: &[TensorInfo],
    pages: &[PlannedPage],
    opts: &CompressOptions,
    amax: impl FnOnce(&[PlannedPage]) -> Result<Option<Vec<u8>>>,
) -> Result<Option<Box<dyn Codec>>> {
    if !super::family::group_enc::needs_key_amax(codec) {
        return Ok(None);
    }
    // The shapes and windows decide whether the GPU encodes; the factors
    // do not.
    let ones = super::family::group_enc::norm_entry(codec, &infos[0], None)?;
    if !encodes_on_gpu(infos, pages, ones.as_ref(), opts) {
        return Ok(None);
    }
    let body: Vec<PlannedPage> = pages
        .iter()
        .filter(|p| p.tensor == 0 && !p.raw)
        .copied()
        .collect();
    if body.is_empty() {
        return Ok(Some(ones));
    }
    let stats = amax(&body)?;
    super::family::group_enc::norm_entry(codec, &infos[0], stats.as_deref()).map(Some)
}

/// The encoded pages of a layer: the bodies of each `(tensor, codec)`
/// group of pages and where each page of the plan is among them.
#[derive(Debug)]
pub struct PagedBodies {
    groups: Vec<EncodedBodies>,
    /// `(group, index in the group)` of each page of the plan.
    at: Vec<(usize, usize)>,
}

impl PagedBodies {
    /// Page `i` of the plan, as the frame writer takes it.
    ///
    /// # Errors
    /// As [`EncodedBodies::page`]; [`Error::Parameter`] (internal) for a
    /// page no group encoded.
    pub fn page(&self, i: usize) -> Result<EncodedPage<'_>> {
        let &(g, k) = self
            .at
            .get(i)
            .ok_or_else(|| Error::param("internal: page out of range"))?;
        self.groups
            .get(g)
            .ok_or_else(|| Error::param("internal: page not encoded"))?
            .page(k)
    }
}

/// The pages of one tensor a paged encode encodes together: its codec
/// pages (`raw` false) or its window pages (`raw` true, encoded as `raw`),
/// their indices in the plan and the pages.
#[derive(Debug, Clone)]
pub struct PageGroup {
    /// The tensor.
    pub tensor: usize,
    /// Window pages (encoded as `raw`)?
    pub raw: bool,
    /// Index in the plan of each page.
    pub at: Vec<usize>,
    /// The pages, in plan order.
    pub pages: Vec<PlannedPage>,
}

impl PageGroup {
    /// The codec of the group: `codec`, or `raw` for window pages.
    pub fn codec<'c>(&self, codec: &'c dyn Codec) -> &'c dyn Codec {
        if self.raw {
            &crate::codec::raw::Raw
        } else {
            codec
        }
    }
}

/// The groups of `pages` (of `tensors` tensors), per tensor its codec
/// pages then its window pages (empty groups left out).
pub fn page_groups(pages: &[PlannedPage], tensors: usize) -> Vec<PageGroup> {
    let mut out = Vec::new();
    for t in 0..tensors {
        for raw in [false, true] {
            let (at, mine): (Vec<usize>, Vec<PlannedPage>) = pages
                .iter()
                .enumerate()
                .filter(|(_, p)| p.tensor == t as u32 && p.raw == raw)
                .map(|(i, p)| (i, *p))
                .unzip();
            if !mine.is_empty() {
                out.push(PageGroup {
                    tensor: t,
                    raw,
                    at,
                    pages: mine,
                });
            }
        }
    }
    out
}

impl PagedBodies {
    /// The bodies of `groups` (of a plan of `pages` pages), `bodies[i]`
    /// those of `groups[i]`.
    ///
    /// # Errors
    /// [`Error::Parameter`] (internal) when a group's bodies hold another
    /// number of pages than it.
    pub fn new(
        pages: usize,
        groups: &[PageGroup],
        bodies: Vec<EncodedBodies>,
    ) -> Result<PagedBodies> {
        let mut at = vec![(usize::MAX, 0); pages];
        if groups.len() != bodies.len() {
            return Err(Error::param("internal: one set of bodies per page group"));
        }
        for (g, (group, b)) in groups.iter().zip(&bodies).enumerate() {
            if b.len() != group.pages.len() {
                return Err(Error::param(
                    "internal: encoder returned the wrong page count",
                ));
            }
            for (k, &i) in group.at.iter().enumerate() {
                if let Some(slot) = at.get_mut(i) {
                    *slot = (g, k);
                }
            }
        }
        Ok(PagedBodies { groups: bodies, at })
    }
}

/// Every page of `pages` encoded by `encode(tensor, its pages in plan
/// order, codec)`, called for each of its [`page_groups`] in order.
///
/// # Errors
/// The error of `encode`; [`Error::Parameter`] when it returns the wrong
/// number of pages.
pub fn bodies_by_tensor(
    pages: &[PlannedPage],
    tensors: usize,
    codec: &dyn Codec,
    mut encode: impl FnMut(usize, &[PlannedPage], &dyn Codec) -> Result<EncodedBodies>,
) -> Result<PagedBodies> {
    let groups = page_groups(pages, tensors);
    let bodies = groups
        .iter()
        .map(|g| encode(g.tensor, &g.pages, g.codec(codec)))
        .collect::<Result<Vec<_>>>()?;
    PagedBodies::new(pages.len(), &groups, bodies)
}

/// The kvpack file of one layer whose pages `pages` (the plan of `infos`)
/// were encoded on the GPU into `bodies`, written to `out`.
///
/// # Errors
/// As [`crate::compress::write_encoded`].
pub fn file_from_bodies<W: std::io::Write + Send>(
    infos: Vec<TensorInfo>,
    codec: &dyn Codec,
    opts: &CompressOptions,
    pages: &[PlannedPage],
    bodies: &PagedBodies,
    out: W,
) -> Result<(W, CompressReport)> {
    crate::compress::write_encoded(
        infos,
        &Default::default(),
        &[],
        codec,
        opts,
        pages,
        &|i| bodies.page(i),
        out,
    )
}

/// Gathers tokens `0..tokens` of K and V out of a host image of a paged
/// cache ([`PagedShape::image_target`]) into `[kv_heads, tokens,
/// head_dim]` each: the CPU reference of the GPU gather.
///
/// # Errors
/// [`Error::Parameter`] as [`slot_mapping`], or when `image` does not have
/// `2 * kv_elements` elements.
pub fn gather_host(
    image: &[u16],
    layout: PagedLayout,
    shape: &PagedShape,
    block_ids: &[i64],
    tokens: u32,
) -> Result<[Vec<u16>; 2]> {
    if image.len() as u64 != 2 * shape.kv_elements() {
        return Err(Error::param(format!(
            "paged cache image of {} elements, {} expected",
            image.len(),
            2 * shape.kv_elements()
        )));
    }
    let slots = slot_mapping(block_ids, shape, tokens)?;
    let d = shape.head_dim as usize;
    Ok([Kind::Key, Kind::Value].map(|kind| {
        let (off, _, addr) = shape.image_target(layout, kind);
        let mut out = Vec::with_capacity(shape.kv_heads as usize * tokens as usize * d);
        for h in 0..shape.kv_heads {
            for &s in &slots {
                let at = (off + addr.offset(s as u64, h)) as usize;
                out.extend_from_slice(&image[at..at + d]);
            }
        }
        out
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: PagedShape = PagedShape {
        num_blocks: 5,
        block_size: 4,
        kv_heads: 3,
        head_dim: 8,
    };

    #[test]
    fn shapes_round_trip_and_bad_shapes_are_refused() {
        for l in [
            PagedLayout::FlashAttn,
            PagedLayout::FlashInfer,
            PagedLayout::Hnd,
        ] {
            assert_eq!(PagedShape::from_dims(l, &SHAPE.dims(l)).unwrap(), SHAPE);
            assert_eq!(PagedLayout::parse(l.name()).unwrap(), l);
        }
        assert!(PagedShape::from_dims(PagedLayout::FlashAttn, &[3, 5, 4, 3, 8]).is_err());
        assert!(PagedShape::from_dims(PagedLayout::FlashInfer, &[5, 1, 4, 3, 8]).is_err());
        assert!(PagedShape::from_dims(PagedLayout::Hnd, &[5, 3, 4]).is_err());
        assert!(PagedShape::from_dims(PagedLayout::Hnd, &[5, 0, 4, 8]).is_err());
        assert!(PagedLayout::parse("nhd").is_err());
    }

    /// Every (slot, head) of K and V maps to a distinct element in bounds,
    /// and the addresses are the C-contiguous index of each layout.
    #[test]
    fn addresses_are_the_layouts_indices() {
        let (nb, bs, h, d) = (5u64, 4u64, 3u64, 8u64);
        for l in [
            PagedLayout::FlashAttn,
            PagedLayout::FlashInfer,
            PagedLayout::Hnd,
        ] {
            for (ki, kind) in [Kind::Key, Kind::Value].into_iter().enumerate() {
                let (off, a) = SHAPE.addr(l, kind);
                a.check(SHAPE.tensor_elements(l) - off, 3, 8).unwrap();
                for s in 0..nb * bs {
                    for hh in 0..h {
                        let (b, r) = (s / bs, s % bs);
                        let want = match l {
                            PagedLayout::FlashAttn => {
                                (((ki as u64 * nb + b) * bs + r) * h + hh) * d
                            }
                            PagedLayout::FlashInfer => {
                                (((b * 2 + ki as u64) * bs + r) * h + hh) * d
                            }
                            PagedLayout::Hnd => ((b * h + hh) * bs + r) * d,
                        };
                        assert_eq!(off + a.offset(s, hh as u32), want, "{l:?} {kind:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn bounds_and_alignment_are_checked() {
        let (_, a) = SHAPE.addr(PagedLayout::Hnd, Kind::Key);
        assert!(a.check(SHAPE.kv_elements() - 1, 3, 8).is_err());
        let mut odd = a;
        odd.strides.token = 4;
        assert!(odd.check(1 << 20, 3, 8).is_err());
        assert!(odd.check(1 << 20, 3, 4).is_ok());
    }

    #[test]
    fn slot_mapping_follows_the_block_table() {
        let s = slot_mapping(&[3, 0, 4, 9], &SHAPE, 10).unwrap();
        assert_eq!(s, [12, 13, 14, 15, 0, 1, 2, 3, 16, 17]);
        assert!(slot_mapping(&[3, 0], &SHAPE, 10).is_err());
        assert!(slot_mapping(&[3, 5, 1], &SHAPE, 10).is_err());
        assert!(slot_mapping(&[3, -1, 1], &SHAPE, 10).is_err());
        assert!(slot_mapping(&[3, 1, 3], &SHAPE, 10).is_err());
    }

    #[test]
    fn raw_caches_are_validated() {
        let dims = SHAPE.dims(PagedLayout::Hnd);
        // SAFETY: the descriptions are only validated, never used.
        unsafe {
            assert!(PagedCache::from_raw(PagedLayout::Hnd, DType::Bf16, &dims, 256, None).is_err());
            assert!(
                PagedCache::from_raw(PagedLayout::Hnd, DType::Bf16, &dims, 256, Some(8)).is_err()
            );
            assert!(
                PagedCache::from_raw(PagedLayout::Hnd, DType::F32, &dims, 256, Some(512)).is_err()
            );
            let fp8 = DType::Fp8(crate::cache::Fp8::unscaled(crate::cache::Fp8Format::E4M3Fn));
            let e = PagedCache::from_raw(PagedLayout::Hnd, fp8, &dims, 256, Some(512)).unwrap_err();
            assert!(e.to_string().contains("fp8_e4m3"), "{e}");
            let c =
                PagedCache::from_raw(PagedLayout::Hnd, DType::F16, &dims, 256, Some(512)).unwrap();
            assert_eq!(c.target(Kind::Value).0, 512);
            let fa = SHAPE.dims(PagedLayout::FlashAttn);
            let c =
                PagedCache::from_raw(PagedLayout::FlashAttn, DType::F16, &fa, 256, None).unwrap();
            assert_eq!(c.target(Kind::Value).0, 256 + 2 * SHAPE.kv_elements());
        }
    }
}
