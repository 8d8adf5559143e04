//! The GPU API in a build without the `cuda` feature: the same types and
//! signatures, every constructor returning [`Error::Unsupported`] with
//! [`NO_CUDA`]. No value of [`Gpu`] can exist, so the other methods are
//! unreachable.

use std::convert::Infallible;
use std::marker::PhantomData;

use super::paged::PagedCache;
use super::{GpuInfo, NO_CUDA, OutType, PagedStats, StreamStats, Target};
use crate::cache::TensorInfo;
use crate::codec::Codec;
use crate::compress::{CompressOptions, CompressReport};
use crate::decode::Archive;
use crate::error::{Error, Result};
use crate::format::Section;
use crate::plan::PlannedPage;

fn no_cuda<T>() -> Result<T> {
    Err(Error::Unsupported(NO_CUDA.into()))
}

/// A CUDA device (never constructed in this build).
#[derive(Debug, Clone)]
pub struct Gpu {
    never: Infallible,
}

impl Gpu {
    /// Number of CUDA devices: always 0 in this build.
    pub fn device_count() -> usize {
        0
    }

    /// Opens device `ordinal`.
    ///
    /// # Errors
    /// Always [`Error::Unsupported`] ([`NO_CUDA`]).
    pub fn new(_ordinal: usize) -> Result<Gpu> {
        no_cuda()
    }

    /// This handle with kernel selection options.
    pub fn with_kernel_options(&self, _options: super::KernelOptions) -> Gpu {
        match self.never {}
    }

    /// Name, compute capability and sizes of the device.
    pub fn info(&self) -> &GpuInfo {
        match self.never {}
    }

    /// Waits for submitted work.
    ///
    /// # Errors
    /// Unreachable in this build.
    pub fn synchronize(&self) -> Result<()> {
        match self.never {}
    }

    /// Compiles every kernel source.
    ///
    /// # Errors
    /// Unreachable in this build.
    pub fn warm_up(&self) -> Result<()> {
        match self.never {}
    }

    /// A zero-filled buffer.
    ///
    /// # Errors
    /// Unreachable in this build.
    pub fn alloc<T: GpuElem>(&self, _len: usize) -> Result<GpuBuffer<T>> {
        match self.never {}
    }

    /// A buffer holding a copy of `data`.
    ///
    /// # Errors
    /// Unreachable in this build.
    pub fn upload<T: GpuElem>(&self, _data: &[T]) -> Result<GpuBuffer<T>> {
        match self.never {}
    }

    /// Copies a buffer to the host.
    ///
    /// # Errors
    /// Unreachable in this build.
    pub fn download<T: GpuElem>(&self, _buf: &GpuBuffer<T>) -> Result<Vec<T>> {
        match self.never {}
    }

    /// Times submitted work with CUDA events, milliseconds.
    ///
    /// # Errors
    /// Unreachable in this build.
    pub fn time_ms(&self, _f: impl FnOnce() -> Result<()>) -> Result<f64> {
        match self.never {}
    }

    /// Device-to-device copy (kernel or driver).
    ///
    /// # Errors
    /// Unreachable in this build.
    pub fn copy(&self, _src: &GpuBuffer<u8>, _dst: &GpuBuffer<u8>, _driver: bool) -> Result<()> {
        match self.never {}
    }

    /// Plans a decode.
    ///
    /// # Errors
    /// Unreachable in this build.
    pub fn plan_decode<'a>(
        &self,
        _pages: &'a GpuPages,
        _targets: &[Target<'a>],
        _out: OutType,
    ) -> Result<DecodePlan<'a>> {
        match self.never {}
    }

    /// Plans an encode.
    ///
    /// # Errors
    /// Unreachable in this build.
    pub fn plan_encode<'a, T: GpuElem>(
        &self,
        _src: &'a GpuBuffer<T>,
        _info: &TensorInfo,
        _codec: &dyn Codec,
        _pages: &[PlannedPage],
    ) -> Result<EncodePlan<'a>> {
        match self.never {}
    }
}

/// Element types a [`GpuBuffer`] can hold.
pub trait GpuElem: Copy + bytemuck::Pod + Send + Sync + 'static {}
impl GpuElem for u8 {}
impl GpuElem for u16 {}
impl GpuElem for u32 {}
impl GpuElem for u64 {}
impl GpuElem for i32 {}
impl GpuElem for i64 {}
impl GpuElem for f32 {}

/// A device buffer (never constructed in this build).
#[derive(Debug)]
pub struct GpuBuffer<T: GpuElem> {
    gpu: Gpu,
    _t: PhantomData<T>,
}

impl<T: GpuElem> GpuBuffer<T> {
    /// Wraps device memory owned elsewhere.
    ///
    /// # Safety
    /// See the CUDA build; nothing is accessed in this build.
    ///
    /// # Errors
    /// Unreachable in this build (no [`Gpu`] exists).
    pub unsafe fn from_raw_parts(gpu: &Gpu, _ptr: u64, _len: usize) -> Result<GpuBuffer<T>> {
        match gpu.never {}
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self.gpu.never {}
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        match self.gpu.never {}
    }

    /// The device address.
    pub fn device_ptr(&self) -> u64 {
        match self.gpu.never {}
    }

    /// The device.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Overwrites the first elements.
    ///
    /// # Errors
    /// Unreachable in this build.
    pub fn write(&self, _data: &[T]) -> Result<()> {
        match self.gpu.never {}
    }

    /// Sets every byte.
    ///
    /// # Errors
    /// Unreachable in this build.
    pub fn fill_bytes(&self, _byte: u8) -> Result<()> {
        match self.gpu.never {}
    }

    /// Copies the buffer to the host.
    ///
    /// # Errors
    /// Unreachable in this build.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        match self.gpu.never {}
    }
}

/// Page bodies on a device (never constructed in this build).
#[derive(Debug)]
pub struct GpuPages {
    gpu: Gpu,
}

impl GpuPages {
    /// Uploads pages.
    ///
    /// # Errors
    /// Unreachable in this build (no [`Gpu`] exists).
    pub fn upload(gpu: &Gpu, _archive: &Archive<'_>, _pages: &[usize]) -> Result<GpuPages> {
        match gpu.never {}
    }

    /// Number of pages.
    pub fn len(&self) -> usize {
        match self.gpu.never {}
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        match self.gpu.never {}
    }

    /// Device bytes held.
    pub fn bytes(&self) -> usize {
        match self.gpu.never {}
    }

    /// The device.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }
}

/// A prepared decode (never constructed in this build).
#[derive(Debug)]
pub struct DecodePlan<'a> {
    gpu: Gpu,
    _borrow: PhantomData<&'a ()>,
}

impl DecodePlan<'_> {
    /// Submits the decode.
    ///
    /// # Errors
    /// Unreachable in this build.
    pub fn launch(&self) -> Result<()> {
        match self.gpu.never {}
    }

    /// Waits and checks the status.
    ///
    /// # Errors
    /// Unreachable in this build.
    pub fn finish(&self) -> Result<()> {
        match self.gpu.never {}
    }

    /// Kernel names.
    pub fn kernels(&self) -> Vec<String> {
        match self.gpu.never {}
    }

    /// Bytes read and written per launch.
    pub fn bytes(&self) -> (u64, u64) {
        match self.gpu.never {}
    }
}

/// A prepared encode (never constructed in this build).
#[derive(Debug)]
pub struct EncodePlan<'a> {
    gpu: Gpu,
    _borrow: PhantomData<&'a ()>,
}

impl EncodePlan<'_> {
    /// Submits the encode.
    ///
    /// # Errors
    /// Unreachable in this build.
    pub fn launch(&self) -> Result<()> {
        match self.gpu.never {}
    }

    /// Waits and checks for non-finite rows.
    ///
    /// # Errors
    /// Unreachable in this build.
    pub fn finish(&self) -> Result<()> {
        match self.gpu.never {}
    }

    /// The encoded sections, per page.
    ///
    /// # Errors
    /// Unreachable in this build.
    pub fn sections(&self) -> Result<Vec<Vec<Section>>> {
        match self.gpu.never {}
    }

    /// The encoded bodies with their layouts.
    ///
    /// # Errors
    /// Unreachable in this build.
    pub fn download(&self) -> Result<crate::gpu::encplan::EncodedBodies> {
        match self.gpu.never {}
    }

    /// The device buffer of encoded bodies.
    pub fn bodies(&self) -> &GpuBuffer<u8> {
        match self.gpu.never {}
    }

    /// Byte range of page `i`'s body.
    pub fn body_range(&self, _i: usize) -> std::ops::Range<usize> {
        match self.gpu.never {}
    }

    /// The kernel names, `+`-separated.
    pub fn kernel(&self) -> String {
        match self.gpu.never {}
    }

    /// Bytes read and written per launch.
    pub fn bytes(&self) -> (u64, u64) {
        match self.gpu.never {}
    }
}

/// File-to-GPU decoder (never constructed in this build).
#[derive(Debug)]
pub struct FileDecoder {
    gpu: Gpu,
}

impl FileDecoder {
    /// A decoder with two staging chunks.
    ///
    /// # Errors
    /// Unreachable in this build (no [`Gpu`] exists).
    pub fn new(gpu: &Gpu, _chunk_bytes: usize) -> Result<FileDecoder> {
        match gpu.never {}
    }

    /// Staging chunk size, bytes.
    pub fn chunk_bytes(&self) -> usize {
        match self.gpu.never {}
    }

    /// Decodes pages of a file into targets.
    ///
    /// # Errors
    /// Unreachable in this build.
    pub fn decode(
        &mut self,
        _archive: &Archive<'_>,
        _targets: &[Target<'_>],
        _out: OutType,
    ) -> Result<StreamStats> {
        match self.gpu.never {}
    }
}

/// Paged decode work on a stream (never constructed in this build).
#[derive(Debug)]
pub struct PagedJob {
    gpu: Gpu,
}

impl PagedJob {
    /// True when the work has finished.
    pub fn is_complete(&self) -> bool {
        match self.gpu.never {}
    }

    /// Waits for the work and checks its status.
    ///
    /// # Errors
    /// Unreachable in this build.
    pub fn wait(self) -> Result<PagedStats> {
        match self.gpu.never {}
    }

    /// What the job moves.
    pub fn stats(&self) -> &PagedStats {
        match self.gpu.never {}
    }
}

/// A prepared paged gather (never constructed in this build).
#[derive(Debug)]
pub struct GatherPlan<'a> {
    gpu: Gpu,
    _b: PhantomData<&'a ()>,
}

impl GatherPlan<'_> {
    /// Submits the gather.
    ///
    /// # Errors
    /// Unreachable in this build.
    pub fn launch(&self) -> Result<()> {
        match self.gpu.never {}
    }

    /// Waits and checks the status.
    ///
    /// # Errors
    /// Unreachable in this build.
    pub fn finish(&self) -> Result<()> {
        match self.gpu.never {}
    }

    /// Bytes read and written.
    pub fn bytes(&self) -> (u64, u64) {
        match self.gpu.never {}
    }

    /// The kernel's name.
    pub fn kernel(&self) -> &str {
        match self.gpu.never {}
    }
}

impl Gpu {
    /// Plans a paged gather.
    ///
    /// # Errors
    /// Unreachable in this build.
    pub fn plan_gather<'a>(
        &self,
        _cache: &PagedCache,
        _slots: &'a GpuBuffer<i64>,
        _tokens: u32,
        _outs: [&'a GpuBuffer<u16>; 2],
    ) -> Result<GatherPlan<'a>> {
        match self.never {}
    }

    /// This handle for submitting to a caller's stream.
    ///
    /// # Safety
    /// As the CUDA build's `Gpu::with_stream`; unreachable in this build.
    pub unsafe fn with_stream(&self, _stream: u64) -> Gpu {
        match self.never {}
    }

    /// The raw stream this handle submits to.
    pub fn raw_stream(&self) -> u64 {
        match self.never {}
    }

    /// Decodes a layer into a paged cache.
    ///
    /// # Errors
    /// Unreachable in this build.
    pub fn decode_paged(
        &self,
        _archive: &Archive<'_>,
        _layer: u32,
        _cache: &PagedCache,
        _block_ids: &[i64],
    ) -> Result<PagedJob> {
        match self.never {}
    }

    /// Encodes a layer of a paged cache into a kvpack file.
    ///
    /// # Errors
    /// Unreachable in this build.
    #[allow(clippy::too_many_arguments)]
    pub fn encode_paged<W: std::io::Write + Send>(
        &self,
        _cache: &PagedCache,
        _block_ids: &[i64],
        _num_tokens: u32,
        _codec: &dyn Codec,
        _layer: u32,
        _opts: &CompressOptions,
        _out: W,
    ) -> Result<(W, CompressReport)> {
        match self.never {}
    }

    /// Encodes a layer of a paged cache into a kvpack file in device
    /// memory.
    ///
    /// # Safety
    /// As the CUDA build's.
    ///
    /// # Errors
    /// Unreachable in this build.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn encode_paged_device(
        &self,
        _cache: &PagedCache,
        _block_ids: &[i64],
        _num_tokens: u32,
        _codec: &dyn Codec,
        _layer: u32,
        _opts: &CompressOptions,
        _out: u64,
        _cap: u64,
    ) -> Result<(u64, CompressReport)> {
        match self.never {}
    }

    /// Decodes a layer of a file also held in device memory.
    ///
    /// # Safety
    /// As the CUDA build's.
    ///
    /// # Errors
    /// Unreachable in this build.
    pub unsafe fn decode_paged_resident(
        &self,
        _archive: &Archive<'_>,
        _file: u64,
        _layer: u32,
        _cache: &PagedCache,
        _block_ids: &[i64],
    ) -> Result<PagedJob> {
        match self.never {}
    }

    /// Decodes a layer of a file held in device memory only.
    ///
    /// # Safety
    /// As the CUDA build's.
    ///
    /// # Errors
    /// Unreachable in this build.
    pub unsafe fn decode_paged_device(
        &self,
        _file: u64,
        _len: u64,
        _layer: u32,
        _cache: &PagedCache,
        _block_ids: &[i64],
    ) -> Result<PagedJob> {
        match self.never {}
    }

    /// CRC-32 of spans of a device buffer.
    ///
    /// # Errors
    /// Unreachable in this build.
    pub fn crc32_spans(&self, _buf: &GpuBuffer<u8>, _spans: &[(usize, usize)]) -> Result<Vec<u32>> {
        match self.never {}
    }
}
