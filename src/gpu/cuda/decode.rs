//! Page bodies on the device ([`GpuPages`]) and decode launches
//! ([`DecodePlan`]): descriptors grouped by kernel, one launch per group.

use std::collections::BTreeMap;
use std::marker::PhantomData;

use rayon::prelude::*;

use super::{Gpu, GpuBuffer};
use crate::decode::Archive;
use crate::error::{Error, Result};
use crate::gpu::Target;
use crate::gpu::decplan::{
    BODY_ALIGN, GroupKey, Staged, add_page, check_status, dst_spec, group_args, pack_groups,
    stage_page,
};
use crate::gpu::spec::{OutType, PageGeom};

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
