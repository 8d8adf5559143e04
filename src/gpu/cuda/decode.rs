//! Page bodies on the device ([`GpuPages`]) and decode launches
//! ([`DecodePlan`]): descriptors grouped by kernel, one launch per group.

use std::collections::BTreeMap;
use std::marker::PhantomData;

use rayon::prelude::*;

use super::stage::{Stage, launch_all};
use super::{Gpu, GpuBuffer};
use crate::decode::Archive;
use crate::error::{Error, Result};
use crate::gpu::Target;
use crate::gpu::backend::{Launch, place_decode, place_pages};
use crate::gpu::decplan::{Staged, check_status, dst_spec, stage_page};
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
        let mut stage = Stage::new(gpu);
        let (pages, base, _) = place_pages(&mut stage, archive, &staged)?;
        Ok(GpuPages {
            gpu: gpu.clone(),
            pages,
            bodies: stage.take(base),
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
    /// Descriptor tables and status words.
    bufs: Vec<GpuBuffer<u8>>,
    status: u64,
    launches: Vec<Launch>,
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
        let mut stage = Stage::new(self);
        let plan = place_decode(&mut stage, &pages.pages, &by_tensor, out, self.options)?;
        Ok(DecodePlan {
            gpu: self.clone(),
            bufs: stage.bufs,
            status: plan.status,
            launches: plan.launches,
            read: plan.read,
            written: plan.written,
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
        launch_all(&self.gpu, &self.launches)
    }

    /// Waits for the launched work and checks the status word.
    ///
    /// # Errors
    /// [`Error::Device`] for a failed kernel; [`Error::Parameter`] when a slot
    /// mapping entry pointed past the paged cache (the row is named);
    /// [`Error::Format`] when a kernel found page content its codec's spec
    /// forbids (hqmq digit groups, scales).
    pub fn finish(&self) -> Result<()> {
        let words = self
            .bufs
            .iter()
            .find(|b| b.device_ptr() == self.status)
            .expect("the status buffer")
            .to_vec()?;
        check_status(&bytemuck::pod_collect_to_vec::<u8, u64>(&words))
    }

    /// Kernel names, one per launch.
    pub fn kernels(&self) -> Vec<String> {
        self.launches
            .iter()
            .map(|l| l.kernel.name.clone())
            .collect()
    }

    /// Bytes the kernels read (page sections) and write (output elements)
    /// per launch of the plan.
    pub fn bytes(&self) -> (u64, u64) {
        (self.read, self.written)
    }
}
