//! Encode launches ([`EncodePlan`]): a contiguous tensor on the device to
//! page bodies in device memory, for every family with a GPU encoder
//! (`raw`, `int{b}` / `bdr{h}`, `hqmq` with or without `+med`, `kivi`,
//! `innerq`, `polar`, and the unit-coded pages of `octopus` / `turbo`; the
//! kernels of each are described in its `gpu::family` file and `.cu`
//! source).

use std::marker::PhantomData;

use super::stage::{Stage, launch_all};
use super::{Gpu, GpuBuffer, GpuElem, cuda_err};
use crate::cache::TensorInfo;
use crate::codec::Codec;
use crate::error::{Error, Result};
use crate::format::Section;
use crate::gpu::backend::{Launch, check_encode_status, place_encode};
use crate::gpu::body::CanonicalBody;
use crate::gpu::encplan::{EncodedBodies, HostBytes, SectionCut};
use crate::plan::PlannedPage;
use cudarc::driver::{PinnedHostSlice, result};

/// A prepared encode of some pages of one tensor: a zeroed bodies buffer
/// on the device for the kernels' sections, descriptors and work lists,
/// scratch and side tables where the codec needs them. Launch it as often as
/// needed; the source stays borrowed.
pub struct EncodePlan<'a> {
    gpu: Gpu,
    info: TensorInfo,
    pages: Vec<PlannedPage>,
    layouts: Vec<(CanonicalBody, usize)>,
    cut: Option<SectionCut>,
    bodies: GpuBuffer<u8>,
    /// The status word.
    status: GpuBuffer<u8>,
    /// Descriptors, work lists, scratch and side tables.
    _bufs: Vec<GpuBuffer<u8>>,
    launches: Vec<Launch>,
    read: u64,
    written: u64,
    _borrow: PhantomData<&'a ()>,
}

impl std::fmt::Debug for EncodePlan<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EncodePlan")
            .field("kernel", &self.kernel())
            .field("pages", &self.pages.len())
            .finish()
    }
}

impl Gpu {
    /// Plans the encode of `pages` of a tensor whose elements are in `src`,
    /// laid out `[planes, tokens, head_dim]` (planes = batch x kv_heads,
    /// `info.tokens` tokens) at `info.dtype` (bf16/fp16 as `u16` bits, or
    /// f32).
    ///
    /// # Errors
    /// [`Error::Parameter`] when `src` does not match `info` or a page lies
    /// outside the tensor, or the codec cannot encode the tensor;
    /// [`Error::Unsupported`] for codecs without a GPU encoder or head_dims
    /// beyond its kernels; [`Error::Device`] for a CUDA failure. An
    /// octopus / turbo codec must be prepared for the tensor's head_dim
    /// (`Codec::prepare`), else [`Error::Parameter`].
    pub fn plan_encode<'a, T: GpuElem>(
        &self,
        src: &'a GpuBuffer<T>,
        info: &TensorInfo,
        codec: &dyn Codec,
        pages: &[PlannedPage],
    ) -> Result<EncodePlan<'a>> {
        if std::mem::size_of::<T>() != info.dtype.size() || (src.len() as u64) < info.elements() {
            return Err(Error::param(format!(
                "source buffer of {} elements of {} bytes does not hold {} ({} {} elements)",
                src.len(),
                std::mem::size_of::<T>(),
                info.describe(),
                info.elements(),
                info.dtype.name()
            )));
        }
        let mut stage = Stage::new(self);
        let plan = place_encode(
            &mut stage,
            src.device_ptr(),
            info,
            codec,
            pages,
            self.options,
        )?;
        let bodies = stage.take(plan.bodies);
        let status = stage.take(plan.status);
        // The setup launches (the hqmq cell index) run once, now: stream
        // order puts them before every launch of the plan.
        let (setup, launches) = plan.launches.split_at(plan.setup);
        launch_all(self, setup)?;
        let launches = launches.to_vec();
        Ok(EncodePlan {
            gpu: self.clone(),
            info: info.clone(),
            pages: pages.to_vec(),
            layouts: plan.layouts,
            cut: plan.cut,
            bodies,
            status,
            _bufs: stage.bufs,
            launches,
            read: plan.read,
            written: plan.written,
            _borrow: PhantomData,
        })
    }
}

impl EncodePlan<'_> {
    /// Submits the encode (asynchronous; see [`EncodePlan::finish`]).
    ///
    /// # Errors
    /// [`Error::Device`] when NVRTC, the module load or a launch fails.
    pub fn launch(&self) -> Result<()> {
        launch_all(&self.gpu, &self.launches)
    }

    /// Waits for the launched work and checks that every row could be
    /// encoded.
    ///
    /// # Errors
    /// [`Error::Parameter`] naming the first page row (plane and token)
    /// holding a value the codec cannot encode (NaN or inf; for hqmq also a
    /// value or radius beyond the fp16 range), as the CPU encoder does;
    /// [`Error::Device`] for a failed kernel.
    pub fn finish(&self) -> Result<()> {
        let s = self.status.to_vec()?;
        let s = u64::from_le_bytes(s[..8].try_into().expect("8 bytes"));
        check_encode_status(s, &self.info, &self.pages)
    }

    /// Downloads the encoded pages and splits them into the sections the
    /// CPU encoder returns, one list per page.
    ///
    /// # Errors
    /// [`Error::Device`] for a CUDA failure.
    pub fn sections(&self) -> Result<Vec<Vec<Section>>> {
        crate::gpu::encplan::sections(&self.layouts, self.cut, &self.bodies.to_vec()?)
    }

    /// Downloads the encoded pages with their layouts (what
    /// [`crate::gpu::paged::file_from_bodies`] frames without cutting
    /// canonical bodies into sections).
    ///
    /// # Errors
    /// [`Error::Device`] for a CUDA failure.
    pub fn download(&self) -> Result<EncodedBodies> {
        let n = self.bodies.len();
        self.gpu.ctx().bind_to_thread().map_err(cuda_err("bind"))?;
        let mut staging = self.gpu.take_pinned(n)?;
        let host = staging.as_mut_slice().map_err(cuda_err("pinned buffer"))?;
        let ptr = host.as_mut_ptr();
        // SAFETY: `n` bytes of the bodies buffer into the first `n` bytes
        // of the pinned staging (at least `n` long); the stream is
        // synchronized before they are read.
        let copied = unsafe {
            result::memcpy_dtoh_async(
                &mut host[..n],
                self.bodies.device_ptr(),
                self.gpu.stream().cu_stream(),
            )
        }
        .map_err(cuda_err("device-to-host copy"))
        .and_then(|()| self.gpu.synchronize());
        if let Err(e) = copied {
            // A copy may still be writing into it: never reused or freed.
            std::mem::forget(staging);
            return Err(e);
        }
        let bytes = Pinned {
            gpu: self.gpu.clone(),
            staging: Some(staging),
            ptr,
            len: n,
        };
        EncodedBodies::new(self.layouts.clone(), self.cut, Box::new(bytes))
    }

    /// The device buffer holding the encoded page bodies (each at
    /// [`EncodePlan::body_range`], laid out as a canonical body,
    /// format/SPEC.md 6.2, whose section table is left zero: the host
    /// writes it, [`EncodePlan::download`]; for `hqmq+med` a body in the
    /// worst-case layout, whose sections [`EncodePlan::sections`] cuts to
    /// their lengths).
    pub fn bodies(&self) -> &GpuBuffer<u8> {
        &self.bodies
    }

    /// Byte range of page `i`'s body in [`EncodePlan::bodies`].
    ///
    /// # Panics
    /// If `i` is out of range.
    pub fn body_range(&self, i: usize) -> std::ops::Range<usize> {
        let (l, off) = &self.layouts[i];
        *off..*off + l.body_len as usize
    }

    /// Page `k`'s body layout and the device address of its body.
    ///
    /// # Panics
    /// If `k` is out of range.
    pub(crate) fn layout(&self, k: usize) -> (&CanonicalBody, u64) {
        let (l, off) = &self.layouts[k];
        (l, self.bodies.device_ptr() + *off as u64)
    }

    /// How the host cuts data-dependent bodies (`hqmq+med`), or `None`
    /// for canonical bodies.
    pub(crate) fn cut(&self) -> Option<SectionCut> {
        self.cut
    }

    /// The kernels this plan launches, `+`-separated.
    pub fn kernel(&self) -> String {
        self.launches
            .iter()
            .map(|l| l.kernel.name.as_str())
            .collect::<Vec<_>>()
            .join("+")
    }

    /// Bytes the kernels read (source elements) and write (the sections)
    /// per launch of the plan.
    pub fn bytes(&self) -> (u64, u64) {
        (self.read, self.written)
    }
}

/// Downloaded bodies in a pinned staging buffer of the pool, returned to
/// it when dropped.
struct Pinned {
    gpu: Gpu,
    staging: Option<PinnedHostSlice<u8>>,
    /// The staging's first byte.
    ptr: *mut u8,
    len: usize,
}

// SAFETY: `ptr` points into `staging`, which this value owns alone
// (`PinnedHostSlice` is Send and Sync); shared access only reads.
unsafe impl Send for Pinned {}
// SAFETY: as for Send.
unsafe impl Sync for Pinned {}

impl HostBytes for Pinned {
    fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes of the live staging, written by a completed
        // copy (the stream was synchronized).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, through the unique borrow of `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if let Some(s) = self.staging.take() {
            self.gpu.give_pinned(s);
        }
    }
}
