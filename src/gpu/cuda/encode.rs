//! Encode launches ([`EncodePlan`]): a contiguous tensor on the device to
//! page bodies in device memory, for every family with a GPU encoder
//! (`raw`, `int{b}` / `bdr{h}`, `hqmq` with or without `+med`, `kivi`,
//! `innerq`, `polar`, and the unit-coded pages of `octopus` / `turbo`; the
//! kernels of each are described in its `gpu::family` file and `.cu`
//! source).

use std::marker::PhantomData;

use super::stage::{Stage, launch_all};
use super::{Gpu, GpuBuffer, GpuElem};
use crate::cache::TensorInfo;
use crate::codec::Codec;
use crate::error::{Error, Result};
use crate::format::Section;
use crate::gpu::backend::{Launch, check_encode_status, place_encode};
use crate::gpu::body::CanonicalBody;
use crate::gpu::encplan::{EncodedBodies, SectionCut};
use crate::plan::PlannedPage;

/// A prepared encode of some pages of one tensor: page bodies (section
/// tables filled in) on the device, descriptors and work lists, scratch
/// and side tables where the codec needs them. Launch it as often as
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
        EncodedBodies::new(self.layouts.clone(), self.cut, self.bodies.to_vec()?)
    }

    /// The device buffer holding the encoded page bodies (each a canonical
    /// body, format/SPEC.md 6.2, at [`EncodePlan::body_range`]; for
    /// `hqmq+med` a body in the worst-case layout, whose sections
    /// [`EncodePlan::sections`] cuts to their lengths).
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
