//! Device-independent decode planning, shared by the CUDA backend and the
//! SIMT emulator: staging a page (checked through its codec's page layout),
//! the descriptor of each page and its kernel's group, the uniform kernel
//! arguments, the packed descriptor and work tables, the status words, and
//! the image of a paged-cache decode. Nothing here touches a device, so the
//! emulator builds and runs without the `cuda` feature.

use std::collections::BTreeMap;

use rayon::prelude::*;

use crate::cache::Kind;
use crate::decode::Archive;
use crate::error::{Error, Result};
use crate::gpu::family::{decode_kernel, desc_params, page_sections};
use crate::gpu::paged::{PagedAddr, PagedShape, layer_tensors, slot_mapping};
use crate::gpu::spec::{
    self, DstSpec, KernelChoice, KernelCodec, KernelOptions, OutType, PageDesc, PageGeom, page_desc,
};

/// Optional kernel arguments after (descriptors, work list).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Args {
    /// Bits (fallback affine kernels) or source type code (raw fallback).
    pub bits: Option<u32>,
    /// Rotation block (affine kernels).
    pub h: Option<u32>,
    /// `1/sqrt(h)` (affine kernels).
    pub c: Option<f32>,
    /// Address of the u64 status word.
    pub status: u64,
}

/// Alignment of page bodies inside a device buffer, bytes.
pub(crate) const BODY_ALIGN: usize = 256;

/// A page ready for the device: geometry, tensor, codec slot, and its
/// validated view (whose `body()` is the uncompressed body). The geometry's
/// side-table address is set when the page is placed on the device.
pub(crate) struct Staged<'a> {
    pub tensor: u32,
    pub codec: u16,
    pub geom: PageGeom,
    pub view: crate::format::PageView<'a>,
}

/// Validates page `pi` of `archive` (CRC, zstd, sections against the
/// codec's spec) and returns its uncompressed body.
pub(crate) fn stage_page<'a>(archive: &Archive<'a>, pi: usize) -> Result<Staged<'a>> {
    stage_view(archive, archive.reader().page(pi)?, BodyCheck::Host)
}

/// Where page bodies are checked: on the host (CRC, padding, and content
/// the codec checks on the host) or, for a file whose bodies are only in
/// device memory, on the device (CRC and padding; only pages whose codec
/// checks no section content on the host qualify).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyCheck {
    /// Bodies validated on the host ([`Reader::page`]).
    Host,
    /// Only headers and section tables on the host
    /// ([`Reader::page_structure`]); [`PagedImage::device_checks`] lists
    /// the rest.
    Device,
}

/// [`stage_page`] of a page read already (`check` says how).
///
/// # Errors
/// As [`stage_page`]; with [`BodyCheck::Device`], [`Error::Unsupported`]
/// for a page whose codec checks section content on the host.
fn stage_view<'a>(
    archive: &Archive<'a>,
    view: crate::format::PageView<'a>,
    check: BodyCheck,
) -> Result<Staged<'a>> {
    let m = view.header.meta;
    let h = archive.reader().header();
    let info = crate::cache::TensorInfo {
        tokens: archive.reader().tokens(m.tensor as usize),
        ..h.tensors[m.tensor as usize].clone()
    };
    let kc = KernelCodec::of(archive.codec(m.codec as usize), &info)?;
    if check == BodyCheck::Device {
        bulk_checked(kc)?;
    }
    let (sections, extra) = page_sections(kc, &view, &info)?;
    let geom = PageGeom {
        kc,
        token_start: m.token_start,
        tokens: m.tokens,
        batch: info.batch,
        heads: info.heads,
        head_dim: info.head_dim,
        sections,
        params: desc_params(kc, info.head_dim, extra),
        side: 0,
        read: spec::section_bytes(&view),
    };
    Ok(Staged {
        tensor: m.tensor,
        codec: m.codec,
        geom,
        view,
    })
}

/// The plain-address form of a [`crate::gpu::Dst`].
#[cfg(feature = "cuda")]
pub(crate) fn dst_spec(d: &crate::gpu::Dst<'_>) -> DstSpec {
    use crate::gpu::Dst;
    match *d {
        Dst::Contiguous {
            buf,
            first_token,
            tokens,
        } => DstSpec::Contiguous {
            ptr: buf.device_ptr(),
            len: buf.len() as u64,
            first_token,
            tokens,
        },
        Dst::Paged {
            cache,
            slots,
            slot_stride,
        } => DstSpec::Paged {
            ptr: cache.device_ptr(),
            len: cache.len() as u64,
            slots: slots.device_ptr(),
            slots_len: slots.len() as u64,
            slot_stride,
            addr: None,
        },
        Dst::Blocks { cache, kind, slots } => {
            let (ptr, len, addr) = cache.target(kind);
            DstSpec::Paged {
                ptr,
                len,
                slots: slots.device_ptr(),
                slots_len: slots.len() as u64,
                slot_stride: 0,
                addr: Some(addr),
            }
        }
    }
}

/// Descriptors and work items of one kernel launch.
#[derive(Debug, Default)]
pub(crate) struct Group {
    pub descs: Vec<PageDesc>,
    pub work: Vec<[u32; 2]>,
}

/// Launch key: the kernel and its uniform arguments.
pub(crate) type GroupKey = (KernelChoice, u32, u32, u32);

/// Adds page `g` (body at `body`) for `dst` to its kernel's group.
/// Returns `(bytes read, bytes written)` by the kernel for this page.
pub(crate) fn add_page(
    groups: &mut BTreeMap<GroupKey, Group>,
    g: &PageGeom,
    body: u64,
    dst: &DstSpec,
    out: OutType,
    opts: KernelOptions,
) -> Result<(u64, u64)> {
    let k = decode_kernel(g.kc, g.head_dim, out, opts)?;
    let Some((desc, rows_written)) = page_desc(g, body, dst, k.grid.unit())? else {
        return Ok((0, 0));
    };
    let bits = match g.kc {
        KernelCodec::Raw { src } => u32::from(src.code()),
        KernelCodec::Affine { bits, .. } => u32::from(bits),
        _ => 0,
    };
    let key = (k.clone(), bits, g.kc.h(), g.kc.c().to_bits());
    let grp = groups.entry(key).or_default();
    let i = grp.descs.len() as u32;
    grp.descs.push(desc);
    k.grid
        .push_items(i, desc.rows, desc.tokens, g.head_dim, &mut grp.work);
    Ok(spec::decode_bytes(g, rows_written))
}

/// The kernel arguments after (descriptors, work) for a group.
pub(crate) fn group_args(key: &GroupKey, status: u64) -> Args {
    let (k, bits, h, c) = key;
    let fallback = !matches!(k.grid, spec::Grid::Units { .. });
    match k.source {
        "raw" => Args {
            bits: fallback.then_some(*bits),
            h: None,
            c: None,
            status,
        },
        "affine" => Args {
            bits: fallback.then_some(*bits),
            h: Some(*h),
            c: Some(f32::from_bits(*c)),
            status,
        },
        // The kernels of the other codecs read everything from their
        // descriptors.
        _ => Args {
            bits: None,
            h: None,
            c: None,
            status,
        },
    }
}

/// Checks the two status words of a decode: word 0, the smallest page row
/// whose slot-mapping entry pointed past the paged cache; word 1, the
/// smallest descriptor whose page failed a content check in a kernel (hqmq
/// digit groups and scales). Both `u64::MAX` when all is well.
///
/// # Errors
/// [`Error::Parameter`] for word 0, [`Error::Format`] for word 1.
pub(crate) fn check_status(s: &[u64]) -> Result<()> {
    if s[0] != u64::MAX {
        return Err(Error::param(format!(
            "a slot mapping entry (page row {}) points past the paged cache",
            s[0]
        )));
    }
    if s.get(1).is_some_and(|&w| w != u64::MAX) {
        return Err(Error::format(
            crate::error::Location::Header,
            "a page failed its codec's content checks on the GPU (a digit group or padding \
             digit out of range, or a scale that is not finite and non-negative); decode it on \
             the CPU for the page's name",
        ));
    }
    Ok(())
}

/// The checks of pages whose bodies are only in device memory
/// ([`PagedImage::device_checks`]); offsets are file offsets.
#[derive(Debug, Default)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct DeviceChecks {
    /// `(offset, len)` of each page's stored body.
    pub crc: Vec<(u64, u64)>,
    /// The body CRC each page's header declares.
    pub want: Vec<u32>,
    /// `(offset, len)` spans that must be zero.
    pub zero: Vec<(u64, u64)>,
}

/// The [`DeviceChecks`] of `staged` pages whose frames are `frames`
/// (file offset, length).
fn device_checks_of(staged: &[Staged<'_>], frames: &[(u64, u64)]) -> DeviceChecks {
    let mut c = DeviceChecks::default();
    for (s, &(frame, frame_len)) in staged.iter().zip(frames) {
        let h = &s.view.header;
        let body = frame + crate::format::FRAME_HEADER_LEN as u64;
        c.crc.push((body, h.stored_len));
        c.want.push(h.body_crc);
        let secs = s.view.sections();
        for (i, d) in secs.iter().enumerate() {
            let end = u64::from(d.offset) + u64::from(d.len);
            let to = secs.get(i + 1).map_or(h.body_len, |n| u64::from(n.offset));
            c.zero.push((body + end, to - end));
        }
        c.zero
            .push((body + h.stored_len, frame + frame_len - body - h.stored_len));
    }
    c.zero.retain(|&(_, n)| n > 0);
    c
}

/// [`Error::Unsupported`] for pages whose host checks read their code
/// streams or raw elements (the bulk of a body, `hqmq`): those are checked
/// with the whole body on the host.
fn bulk_checked(kc: KernelCodec) -> Result<()> {
    use crate::format::SectionKind;
    let kinds = crate::gpu::family::host_checked(kc);
    if kinds.contains(&SectionKind::Index) || kinds.contains(&SectionKind::Raw) {
        return Err(Error::Unsupported(format!(
            "{kc:?} pages check their code streams on the host"
        )));
    }
    Ok(())
}

/// The file spans `(offset, len)` of the sections the host checks the
/// content of (`GpuFamily::host_checked`) in `pages` of `archive`, a host
/// image holding only the headers and section tables of those pages
/// ([`BodyCheck::Device`]).
///
/// # Errors
/// As [`crate::format::Reader::page_structure`]; [`Error::Unsupported`]
/// for pages whose checks read their code streams.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn host_checked_spans(
    archive: &Archive<'_>,
    pages: &[usize],
) -> Result<Vec<(u64, u64)>> {
    let per_page = pages
        .par_iter()
        .map(|&pi| page_checked_spans(archive, pi))
        .collect::<Result<Vec<_>>>()?;
    Ok(per_page.concat())
}

/// [`host_checked_spans`] of page `pi`.
fn page_checked_spans(archive: &Archive<'_>, pi: usize) -> Result<Vec<(u64, u64)>> {
    let r = archive.reader();
    let mut spans = Vec::new();
    {
        let view = r.page_structure(pi)?;
        let m = view.header.meta;
        let info = crate::cache::TensorInfo {
            tokens: r.tokens(m.tensor as usize),
            ..r.header().tensors[m.tensor as usize].clone()
        };
        let kc = KernelCodec::of(archive.codec(m.codec as usize), &info)?;
        bulk_checked(kc)?;
        let kinds = crate::gpu::family::host_checked(kc);
        let body =
            r.header_len() + r.index().entries[pi].offset + crate::format::FRAME_HEADER_LEN as u64;
        spans.extend(
            view.sections()
                .iter()
                .filter(|d| kinds.contains(&d.kind))
                .map(|d| (body + u64::from(d.offset), u64::from(d.len))),
        );
    }
    Ok(spans)
}

/// True when some page of `pages` has sections the host checks the content
/// of ([`host_checked_spans`] would list spans), judged from the codec
/// slots alone (no page is read).
///
/// # Errors
/// As [`KernelCodec::of`].
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn any_host_checked(archive: &Archive<'_>, pages: &[usize]) -> Result<bool> {
    let r = archive.reader();
    let mut seen = std::collections::BTreeSet::new();
    for &pi in pages {
        let m = r.index().entries[pi].meta;
        if seen.insert((m.tensor, m.codec)) {
            let info = crate::cache::TensorInfo {
                tokens: r.tokens(m.tensor as usize),
                ..r.header().tensors[m.tensor as usize].clone()
            };
            let kc = KernelCodec::of(archive.codec(m.codec as usize), &info)?;
            if !crate::gpu::family::host_checked(kc).is_empty() {
                return Ok(true);
            }
        }
    }
    Ok(false)
}

/// A layer's K and V tensors (index, kind), token count and pages.
pub(crate) type LayerPages = ([(u32, Kind); 2], u32, Vec<usize>);

/// The K and V tensors of layer `layer` (which must fit `shape`), their
/// token count, and the pages holding them, in file order.
///
/// # Errors
/// [`Error::Parameter`] when the file lacks the layer, its tensors do not
/// fit the cache, or K and V hold different token counts.
pub(crate) fn layer_pages(
    archive: &Archive<'_>,
    layer: u32,
    shape: &PagedShape,
) -> Result<LayerPages> {
    let tensors = layer_tensors(archive, layer, shape)?;
    let tokens = archive.reader().tokens(tensors[0].0 as usize);
    let v_tokens = archive.reader().tokens(tensors[1].0 as usize);
    if v_tokens != tokens {
        return Err(Error::param(format!(
            "layer {layer} holds {tokens} K tokens but {v_tokens} V tokens"
        )));
    }
    let pages = tensors
        .iter()
        .flat_map(|&(t, _)| archive.reader().pages_overlapping(t as usize, 0, tokens))
        .collect();
    Ok((tensors, tokens, pages))
}

/// The bytes that decide a [`BodyCheck::Device`] plan of layer pages
/// `pages` (tensors `tensors`) of `archive` (opened on `buf`), apart from
/// the layer's name and the CRCs: the format version and alignment, the
/// codec table, the two tensors' descriptions (without name and layer),
/// and per page its index entry (offset, frame length, tensor, tokens,
/// codec slot, flags) and its page header and section table with its
/// padding (at most `head` bytes of the frame), with the body CRC (header
/// bytes 40..44) and the header CRC (60..64) zeroed. Two files with equal
/// keys have pages of identical structure, so every check of
/// [`PagedImage::resident`] but the CRCs gives the same result on both;
/// `extra` (the destination: block table, cache shape, element type) is
/// appended.
///
/// # Errors
/// [`Error::Parameter`] when a page's head lies outside the archive's
/// buffer.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn plan_key(
    archive: &Archive<'_>,
    buf: &[u8],
    tensors: &[(u32, Kind); 2],
    pages: &[usize],
    head: u64,
    extra: &[u8],
) -> Result<Vec<u8>> {
    let r = archive.reader();
    let h = r.header();
    let mut key = Vec::with_capacity(pages.len() * (head as usize + 40) + 1024);
    key.extend_from_slice(&h.version_major.to_le_bytes());
    key.extend_from_slice(&h.version_minor.to_le_bytes());
    key.push(h.align_log2);
    for c in &h.codecs {
        key.extend_from_slice(&c.id.to_le_bytes());
        key.extend_from_slice(&(c.params.len() as u64).to_le_bytes());
        key.extend_from_slice(&c.params);
    }
    for &(t, _) in tensors {
        let info = crate::cache::TensorInfo {
            name: String::new(),
            layer: 0,
            tokens: r.tokens(t as usize),
            ..h.tensors[t as usize].clone()
        };
        key.extend_from_slice(format!("{info:?};").as_bytes());
    }
    for &p in pages {
        let e = &r.index().entries[p];
        key.extend_from_slice(&e.offset.to_le_bytes());
        key.extend_from_slice(&e.frame_len.to_le_bytes());
        key.extend_from_slice(&e.meta.tensor.to_le_bytes());
        key.extend_from_slice(&e.meta.token_start.to_le_bytes());
        key.extend_from_slice(&e.meta.tokens.to_le_bytes());
        key.extend_from_slice(&e.meta.codec.to_le_bytes());
        key.extend_from_slice(&e.flags.to_le_bytes());
        let at = r.header_len() + e.offset;
        let n = e.frame_len.min(head);
        let frame = usize::try_from(at)
            .ok()
            .zip(usize::try_from(at + n).ok())
            .and_then(|(a, b)| buf.get(a..b))
            .ok_or_else(|| Error::param("page head outside the buffer"))?;
        // The header and the section table with its padding: the
        // sections' content (which follows within `head` bytes) differs
        // from file to file and is checked on the device.
        let sections = frame
            .get(20..22)
            .map_or(0, |b| u16::from_le_bytes([b[0], b[1]]));
        let table = (64 + (16 * usize::from(sections)).next_multiple_of(64)).min(frame.len());
        let start = key.len();
        key.extend_from_slice(&frame[..table]);
        for i in (40..44).chain(60..64) {
            if let Some(b) = key.get_mut(start + i) {
                *b = 0;
            }
        }
    }
    key.extend_from_slice(extra);
    Ok(key)
}

/// Serializes groups as `[descs of group 0][work of group 0][descs of
/// group 1]...` (each part 256-aligned) into `out`, returning per group
/// `(key, descs offset, work offset, blocks)`.
pub(crate) fn pack_groups(
    groups: BTreeMap<GroupKey, Group>,
    out: &mut Vec<u8>,
) -> Vec<(GroupKey, usize, usize, u32)> {
    let mut v = Vec::new();
    for (key, g) in groups {
        out.resize(out.len().next_multiple_of(BODY_ALIGN), 0);
        let d = out.len();
        out.extend_from_slice(bytemuck::cast_slice(&g.descs));
        out.resize(out.len().next_multiple_of(BODY_ALIGN), 0);
        let w = out.len();
        out.extend_from_slice(bytemuck::cast_slice(&g.work));
        v.push((key, d, w, g.work.len() as u32));
    }
    v
}

/// One launch of an image: key, descriptors offset, work offset (from
/// the image's base), blocks.
pub(crate) type Launch = (GroupKey, usize, usize, u32);

/// The validated pages of one layer and the fixed part of the image that
/// carries them to the device (module docs).
pub(crate) struct PagedImage<'a> {
    /// Tensor, codec slot and geometry of each page of the layer.
    pages: Vec<PagePlan>,
    /// The validated view of each page whose body is carried in the image
    /// (`None` for pages read in place, `resident`).
    host: Vec<Option<crate::format::PageView<'a>>>,
    /// What the device checks of the bodies ([`BodyCheck::Device`];
    /// empty otherwise).
    checks: DeviceChecks,
    /// Body offset of each staged page in the image (unused for pages
    /// read in place, `resident`).
    pub bodies: Vec<usize>,
    /// Device address of each staged page's body when it is read in place
    /// from a copy of the file in device memory ([`PagedImage::resident`]).
    resident: Vec<Option<u64>>,
    /// File offset and length of each staged page's frame.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    frames: Vec<(u64, u64)>,
    tables: Vec<u8>,
    side_at: BTreeMap<(u16, u32), u64>,
    side0: usize,
    slots: Vec<i64>,
    slots0: usize,
    /// Offset of the two u64 status words.
    pub status0: usize,
    /// Length of bodies, side tables, slots and status (where the
    /// descriptor tables start).
    pub fixed: usize,
    tensors: [(u32, Kind); 2],
    /// Page frame bytes of the layer (for statistics).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub file_bytes: u64,
    /// Length of the descriptor tables ([`PagedImage::tables`]; it does not
    /// depend on the addresses), once computed.
    table_len: std::sync::OnceLock<usize>,
}

/// A staged page without its view: what the descriptor tables need.
#[derive(Clone)]
struct PagePlan {
    tensor: u32,
    codec: u16,
    geom: PageGeom,
}

impl<'a> PagedImage<'a> {
    /// Validates every page of layer `layer` (CRC, zstd, sections; all
    /// threads) and the block table.
    ///
    /// # Errors
    /// As [`Gpu::decode_paged`].
    pub fn new(
        archive: &Archive<'a>,
        layer: u32,
        shape: &PagedShape,
        block_ids: &[i64],
    ) -> Result<PagedImage<'a>> {
        Self::resident(archive, layer, shape, block_ids, None, BodyCheck::Host)
    }

    /// What the device must check of pages staged with
    /// [`BodyCheck::Device`]: per page the file offset and length of its
    /// stored body and the CRC its header declares, and the file spans
    /// that must be zero (the padding after each section and after the
    /// body).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn device_checks(&self) -> &DeviceChecks {
        &self.checks
    }

    /// As [`PagedImage::new`]; with `file = Some(address)`, the device
    /// holds a copy of the archive's bytes at `address`, and every page
    /// stored uncompressed is decoded from there: its body is validated on
    /// the host (from the archive) but takes no room in the image. zstd
    /// pages are inflated into the image as before.
    ///
    /// # Errors
    /// As [`Gpu::decode_paged`].
    pub fn resident(
        archive: &Archive<'a>,
        layer: u32,
        shape: &PagedShape,
        block_ids: &[i64],
        file: Option<u64>,
        check: BodyCheck,
    ) -> Result<PagedImage<'a>> {
        let (tensors, tokens, pages) = layer_pages(archive, layer, shape)?;
        let slots = slot_mapping(block_ids, shape, tokens)?;
        let entries = &archive.reader().index().entries;
        let file_bytes = pages.iter().map(|&p| entries[p].frame_len).sum();
        let staged: Vec<Staged<'a>> = pages
            .par_iter()
            .map(|&pi| match check {
                BodyCheck::Host => stage_page(archive, pi),
                BodyCheck::Device => {
                    stage_view(archive, archive.reader().page_structure(pi)?, check)
                }
            })
            .collect::<Result<_>>()?;
        let header_len = archive.reader().header_len();
        let frames: Vec<(u64, u64)> = pages
            .iter()
            .map(|&p| (header_len + entries[p].offset, entries[p].frame_len))
            .collect();
        let resident: Vec<Option<u64>> = pages
            .iter()
            .map(|&p| {
                let e = &entries[p];
                let stored = header_len + e.offset + crate::format::FRAME_HEADER_LEN as u64;
                file.filter(|_| e.flags & crate::format::FLAG_ZSTD == 0)
                    .map(|f| f + stored)
            })
            .collect();
        let mut bodies = Vec::with_capacity(staged.len());
        let mut at = 0usize;
        for (s, r) in staged.iter().zip(&resident) {
            bodies.push(at);
            if r.is_none() {
                at += s.view.body().len().next_multiple_of(BODY_ALIGN);
            }
        }
        let (tables, side_at) =
            crate::gpu::side::for_archive(archive, staged.iter().map(|s| (s.codec, s.tensor)))?;
        let checks = if check == BodyCheck::Device {
            device_checks_of(&staged, &frames)
        } else {
            DeviceChecks::default()
        };
        let (pages, host) = staged
            .into_iter()
            .zip(&resident)
            .map(|(s, r)| {
                let plan = PagePlan {
                    tensor: s.tensor,
                    codec: s.codec,
                    geom: s.geom,
                };
                (plan, r.is_none().then_some(s.view))
            })
            .unzip();
        let side0 = at;
        let slots0 = side0 + tables.len().next_multiple_of(BODY_ALIGN);
        let status0 = slots0 + (8 * slots.len()).next_multiple_of(BODY_ALIGN);
        let fixed = status0 + BODY_ALIGN;
        Ok(PagedImage {
            pages,
            host,
            checks,
            bodies,
            resident,
            frames,
            tables,
            side_at,
            side0,
            slots,
            slots0,
            status0,
            fixed,
            tensors,
            file_bytes,
            table_len: std::sync::OnceLock::new(),
        })
    }

    /// True when every page is read in place (`resident`, no body
    /// carried in the image), so [`PagedImage::detach`] keeps it whole.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn detachable(&self) -> bool {
        self.host.iter().all(Option::is_none)
    }

    /// This image without borrows, for reusing the plan of one layer for
    /// the next layer of the same structure ([`PagedImage::reuse`]); `None`
    /// unless [`PagedImage::detachable`].
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn detach(self) -> Option<PagedImage<'static>> {
        if !self.detachable() {
            return None;
        }
        Some(PagedImage {
            host: self.host.iter().map(|_| None).collect(),
            pages: self.pages,
            checks: self.checks,
            bodies: self.bodies,
            resident: self.resident,
            frames: self.frames,
            tables: self.tables,
            side_at: self.side_at,
            side0: self.side0,
            slots: self.slots,
            slots0: self.slots0,
            status0: self.status0,
            fixed: self.fixed,
            tensors: self.tensors,
            file_bytes: self.file_bytes,
            table_len: self.table_len,
        })
    }

    /// The same plan for another file of identical structure (every page
    /// header, section table and index entry equal but for the CRCs) that
    /// lies at device address `file` (this image's file was at `was`),
    /// whose pages declare the body CRCs `want` (in page order).
    ///
    /// # Errors
    /// [`Error::Parameter`] when `want` does not have one CRC per page.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn reuse(&mut self, was: u64, file: u64, want: Vec<u32>) -> Result<()> {
        if want.len() != self.checks.want.len() {
            return Err(Error::param("plan reuse: one body CRC per page needed"));
        }
        for r in self.resident.iter_mut().flatten() {
            *r = *r - was + file;
        }
        self.checks.want = want;
        Ok(())
    }

    /// Writes bodies, side tables, slot mapping and status words (all
    /// `u64::MAX`) into `out[..self.fixed]`, bodies on all threads.
    pub fn fill(&self, out: &mut [u8]) {
        let (head, rest) = out.split_at_mut(self.side0);
        let mut parts = Vec::with_capacity(self.pages.len());
        let mut tail = head;
        let mut pos = 0;
        for (view, &o) in self.host.iter().zip(&self.bodies) {
            let Some(view) = view else {
                continue;
            };
            let (_, r) = std::mem::take(&mut tail).split_at_mut(o - pos);
            let n = view.body().len();
            let (mine, r) = r.split_at_mut(n);
            parts.push((mine, view.body()));
            tail = r;
            pos = o + n;
        }
        parts
            .into_par_iter()
            .for_each(|(d, b)| d.copy_from_slice(b));
        let rest = &mut rest[..self.fixed - self.side0];
        rest[..self.tables.len()].copy_from_slice(&self.tables);
        let s = self.slots0 - self.side0;
        rest[s..s + 8 * self.slots.len()].copy_from_slice(bytemuck::cast_slice(&self.slots));
        let st = self.status0 - self.side0;
        rest[st..st + 16].fill(0xff);
    }

    /// The length of [`PagedImage::tables`] (which does not depend on the
    /// addresses), computed once per image.
    ///
    /// # Errors
    /// As [`PagedImage::tables`].
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn tables_len(
        &self,
        target: impl Fn(Kind) -> (u64, u64, PagedAddr),
        out: OutType,
        opts: KernelOptions,
    ) -> Result<usize> {
        if let Some(&n) = self.table_len.get() {
            return Ok(n);
        }
        let n = self.tables(0, target, out, opts)?.0.len();
        let _ = self.table_len.set(n);
        Ok(n)
    }

    /// The descriptor tables for the image placed at device address `base`
    /// (to be written at `base + self.fixed`), decoding into `target(kind)`
    /// = (address of (block 0, row 0, head 0), elements from there, the
    /// addressing), with each launch's (key, descriptors offset, work
    /// offset, blocks), offsets from `base`.
    ///
    /// # Errors
    /// [`Error::Parameter`] when a destination does not hold the tensor;
    /// [`Error::Unsupported`] for a head_dim the kernels do not take.
    pub fn tables(
        &self,
        base: u64,
        target: impl Fn(Kind) -> (u64, u64, PagedAddr),
        out: OutType,
        opts: KernelOptions,
    ) -> Result<(Vec<u8>, Vec<Launch>, u64)> {
        let dst = |kind: Kind| {
            let (ptr, len, addr) = target(kind);
            DstSpec::Paged {
                ptr,
                len,
                slots: base + self.slots0 as u64,
                slots_len: self.slots.len() as u64,
                slot_stride: 0,
                addr: Some(addr),
            }
        };
        let by_tensor: BTreeMap<u32, DstSpec> =
            self.tensors.iter().map(|&(t, k)| (t, dst(k))).collect();
        let mut groups = BTreeMap::new();
        let mut written = 0;
        for ((s, &o), r) in self.pages.iter().zip(&self.bodies).zip(&self.resident) {
            let mut g = s.geom;
            if let Some(&t) = self.side_at.get(&(s.codec, s.tensor)) {
                g.side = base + (self.side0 as u64) + t;
            }
            let (_, w) = add_page(
                &mut groups,
                &g,
                r.unwrap_or(base + o as u64),
                &by_tensor[&s.tensor],
                out,
                opts,
            )?;
            written += w;
        }
        // pack_groups aligns each part relative to the start of its vector;
        // `fixed` is a multiple of BODY_ALIGN, so alignment holds on the
        // device too.
        let mut bytes = Vec::new();
        let launches = pack_groups(groups, &mut bytes)
            .into_iter()
            .map(|(k, d, w, b)| (k, self.fixed + d, self.fixed + w, b))
            .collect();
        Ok((bytes, launches, written))
    }
}
