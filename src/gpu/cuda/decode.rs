//! Page bodies on the device ([`GpuPages`]) and decode launches
//! ([`DecodePlan`]): descriptors grouped by kernel, one launch per group.

use std::collections::BTreeMap;
use std::marker::PhantomData;

use rayon::prelude::*;

use super::{Args, Gpu, GpuBuffer};
use crate::decode::Archive;
use crate::error::{Error, Result};
use crate::gpu::codecs::{decode_kernel, desc_params, page_sections};
use crate::gpu::spec::{
    self, DstSpec, KernelChoice, KernelCodec, KernelOptions, OutType, PageDesc, PageGeom, page_desc,
};
use crate::gpu::{Dst, Target};

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
    let view = archive.reader().page(pi)?;
    let m = view.header.meta;
    let h = archive.reader().header();
    let info = crate::cache::TensorInfo {
        tokens: archive.reader().tokens(m.tensor as usize),
        ..h.tensors[m.tensor as usize].clone()
    };
    let kc = KernelCodec::of(archive.codec(m.codec as usize), &info)?;
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

/// Validated page bodies resident in device memory, with what the
/// kernels need to know about each page.
pub struct GpuPages {
    gpu: Gpu,
    bodies: GpuBuffer<u8>,
    pages: Vec<(u32, PageGeom, u64)>,
}

impl std::fmt::Debug for GpuPages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuPages")
            .field("pages", &self.pages.len())
            .field("bytes", &self.bodies.len())
            .finish()
    }
}

impl GpuPages {
    /// Validates pages `pages` (index positions) of `archive` on all CPU
    /// threads (CRC, zstd decompression, sections) and copies their bodies
    /// to the device in one transfer.
    ///
    /// # Errors
    /// [`Error::Format`] for a corrupted page; [`Error::Unsupported`] for a
    /// codec without GPU kernels; [`Error::Device`] for a CUDA failure.
    pub fn upload(gpu: &Gpu, archive: &Archive<'_>, pages: &[usize]) -> Result<GpuPages> {
        let staged: Vec<Staged<'_>> = pages
            .par_iter()
            .map(|&pi| stage_page(archive, pi))
            .collect::<Result<_>>()?;
        let mut offsets = Vec::with_capacity(staged.len());
        let mut total = 0usize;
        for s in &staged {
            offsets.push(total);
            total += s.view.body().len().next_multiple_of(BODY_ALIGN);
        }
        // Side tables (codebooks, signs, factors) after the bodies.
        let (tables, at) =
            crate::gpu::side::for_archive(archive, staged.iter().map(|s| (s.codec, s.tensor)))?;
        let side0 = total;
        total += tables.len().next_multiple_of(BODY_ALIGN);
        let mut host = vec![0u8; total.max(BODY_ALIGN)];
        for (s, &o) in staged.iter().zip(&offsets) {
            let b = s.view.body();
            host[o..o + b.len()].copy_from_slice(b);
        }
        host[side0..side0 + tables.len()].copy_from_slice(&tables);
        let bodies = gpu.upload(&host)?;
        let base = bodies.device_ptr();
        Ok(GpuPages {
            gpu: gpu.clone(),
            pages: staged
                .iter()
                .zip(&offsets)
                .map(|(s, &o)| {
                    let mut g = s.geom;
                    if let Some(&t) = at.get(&(s.codec, s.tensor)) {
                        g.side = base + (side0 as u64) + t;
                    }
                    (s.tensor, g, base + o as u64)
                })
                .collect(),
            bodies,
        })
    }

    /// Number of pages.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// True when no page was uploaded.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// Device bytes held (bodies and alignment padding).
    pub fn bytes(&self) -> usize {
        self.bodies.len()
    }

    /// The device the pages live on.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }
}

/// The plain-address form of a [`Dst`].
pub(crate) fn dst_spec(d: &Dst<'_>) -> DstSpec {
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

/// A prepared decode: descriptor tables and work lists on the device, one
/// launch per kernel. Launch it as often as needed (benchmarks); the
/// targets and pages it was planned for stay borrowed.
pub struct DecodePlan<'a> {
    gpu: Gpu,
    table: GpuBuffer<u8>,
    status: GpuBuffer<u64>,
    launches: Vec<(GroupKey, usize, usize, u32)>,
    read: u64,
    written: u64,
    _borrow: PhantomData<&'a ()>,
}

impl std::fmt::Debug for DecodePlan<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodePlan")
            .field("kernels", &self.kernels())
            .field("read", &self.read)
            .field("written", &self.written)
            .finish()
    }
}

impl Gpu {
    /// Plans the decode of every page of `pages` whose tensor has a target,
    /// into that target, as `out` elements.
    ///
    /// # Errors
    /// [`Error::Parameter`] for a destination that is too small, a tensor
    /// with two targets, or pages of another device; [`Error::Unsupported`]
    /// for head_dim above 1024 (int/bdr); [`Error::Device`] for a CUDA failure.
    pub fn plan_decode<'a>(
        &self,
        pages: &'a GpuPages,
        targets: &[Target<'a>],
        out: OutType,
    ) -> Result<DecodePlan<'a>> {
        if !std::sync::Arc::ptr_eq(&pages.gpu.inner, &self.inner) {
            return Err(Error::param("pages were uploaded to another device"));
        }
        let mut by_tensor = BTreeMap::new();
        for t in targets {
            if by_tensor.insert(t.tensor, dst_spec(&t.dst)).is_some() {
                return Err(Error::param(format!("tensor {} has two targets", t.tensor)));
            }
        }
        let mut groups = BTreeMap::new();
        let (mut read, mut written) = (0, 0);
        for (tensor, g, body) in &pages.pages {
            if let Some(dst) = by_tensor.get(tensor) {
                let (r, w) = add_page(&mut groups, g, *body, dst, out, self.options)?;
                read += r;
                written += w;
            }
        }
        let mut bytes = Vec::new();
        let launches = pack_groups(groups, &mut bytes);
        let table = self.upload(&bytes)?;
        let status = self.upload(&[u64::MAX; 2])?;
        Ok(DecodePlan {
            gpu: self.clone(),
            table,
            status,
            launches,
            read,
            written,
            _borrow: PhantomData,
        })
    }
}

impl DecodePlan<'_> {
    /// Submits the decode (asynchronous; see [`DecodePlan::finish`]).
    ///
    /// # Errors
    /// [`Error::Device`] when NVRTC, the module load or a launch fails.
    pub fn launch(&self) -> Result<()> {
        let base = self.table.device_ptr();
        for (key, d, w, blocks) in &self.launches {
            let args = group_args(key, self.status.device_ptr());
            self.gpu
                .launch_items(&key.0, base + *d as u64, base + *w as u64, *blocks, &args)?;
        }
        Ok(())
    }

    /// Waits for the launched work and checks the status word.
    ///
    /// # Errors
    /// [`Error::Device`] for a failed kernel; [`Error::Parameter`] when a slot
    /// mapping entry pointed past the paged cache (the row is named);
    /// [`Error::Format`] when a kernel found page content its codec's spec
    /// forbids (hqmq digit groups, scales).
    pub fn finish(&self) -> Result<()> {
        check_status(&self.status.to_vec()?)
    }

    /// Kernel names, one per launch.
    pub fn kernels(&self) -> Vec<String> {
        self.launches.iter().map(|l| l.0.0.name.clone()).collect()
    }

    /// Bytes the kernels read (page sections) and write (output elements)
    /// per launch of the plan.
    pub fn bytes(&self) -> (u64, u64) {
        (self.read, self.written)
    }
}
