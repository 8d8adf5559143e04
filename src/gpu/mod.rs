//! GPU decode and encode of kvpack pages (cargo feature `cuda`).
//!
//! On a decode node the cache must become the serving engine's bf16 (or
//! fp16) KV on the GPU; on a prefill node it must be compressed on the GPU
//! before it is sent. This module decodes every codec of the format on the
//! GPU (`raw`, `int{b}`, `bdr{h}`, `hqmq`, `octopus`, `turbo`, `polar`,
//! `innerq`, `kivi`) and encodes every codec: `raw`, `int{b}`, `bdr{h}`,
//! `hqmq` (with and without `+med` outliers), `kivi`, `innerq`, `polar` and
//! the unit-coded pages of `octopus` and `turbo` (with `+qjl`; their `:vg`
//! value-group V pages are kivi value pages):
//!
//! * **Decode** ([`Gpu::plan_decode`]): page bodies in device memory
//!   ([`GpuPages`]) to bf16/fp16 in two layouts ([`Dst`]): contiguous
//!   `[planes, tokens, head_dim]` per tensor (planes = batch x kv_heads,
//!   batch folded into heads), or the vLLM paged layout
//!   `[num_blocks, block_size, kv_heads, head_dim]` through a slot mapping
//!   (token -> slot). Many pages go in one launch through a descriptor
//!   table (`PageDesc`, the kernel ABI in `gpu::abi` and `common.cuh`); results equal the CPU decoder's bit for bit
//!   (same IEEE operations in the same order, no fused multiply-add except
//!   where the product is exact, the Walsh-Hadamard stages in the normative
//!   order). The one exception: an `int`/`bdr` output that is NaN (only
//!   possible from a non-finite scale or zero point) is the canonical NaN,
//!   where the CPU keeps the payload. Codebooks, sign vectors and
//!   normalization factors are rebuilt on the host from the codec's
//!   parameter block (read by the codec's own parser) and placed next to
//!   the pages (each family's side table, packed by `gpu::side`); pages are checked on the host while staging
//!   by the codec's own page layout, the function its CPU decoder uses
//!   (`gpu::family`), so the GPU rejects what the CPU rejects, or, for hqmq's digit groups, by the kernel (a format error
//!   from [`DecodePlan::finish`]).
//! * **Encode** ([`Gpu::plan_encode`]): a contiguous bf16/fp16/f32 tensor
//!   on the device to page bodies whose sections are the CPU encoder's bit
//!   for bit ([`EncodePlan::sections`]; planned by `gpu::encplan` and each
//!   family's `plan_encode` in `gpu::family`), with the CPU's operations
//!   in the CPU's order (no contraction; group minima with the CPU's tie
//!   rule for signed zeros; InnerQ's hybrid errors summed in binary64 in
//!   element order; PolarQuant's radii in binary64 and its direction
//!   search with the CPU's candidates; octopus / turbo norms as f64 sums in
//!   index order and rotations with the normative butterflies).
//!   [`Gpu::encode_paged`] gathers a vLLM paged cache and encodes it so,
//!   window pages as `raw` and InnerQ's key normalization statistics
//!   reduced on the device. The hqmq direction search scores each chunk
//!   against the few candidates of its cell in a per-codebook cell index
//!   built on the device at plan time (`gpu::hqmq_cells`, with a proven
//!   margin), falling back to the CPU's fast exact search (coset filter,
//!   exact rescoring of near-ties). With `+med{C}` the per-page, per-plane
//!   outlier threshold (`C` times the lower median of the chunk radii) is
//!   computed on the device too (a radix select), so the host only cuts
//!   the sections to the outlier count the device wrote.
//! * **File to GPU** ([`FileDecoder`]): pages read from an mmap'd file,
//!   checked (CRC), staged in pinned host memory, copied to the device and
//!   decoded there, with the CPU staging, the host-to-device copy and the
//!   kernels of consecutive chunks overlapped (double-buffered staging,
//!   two streams, events). zstd-compressed pages are decompressed on the
//!   CPU while staging; the kernels only see uncompressed bodies.
//!
//! [`Device`] runs the same operations on the CPU (the reference codecs),
//! on CUDA, or through the SIMT emulator (`gpu::emu`, with or without the
//! `cuda` feature: the same kernel sources compiled for the CPU, for
//! machines without a GPU) and returns host results, so one test body checks all of
//! them.
//!
//! Measured throughput against the device-to-device copy ceiling, and what
//! limits each kernel: `tests/benches/gpu.md`.
//!
//! # Building and running
//! `cargo build --features cuda`. The CUDA driver and NVRTC are loaded at
//! run time (cudarc's dynamic loading): building needs no CUDA toolkit, and
//! a binary built with the feature runs on machines without a GPU, where
//! [`Gpu::new`] returns [`Error::Unsupported`] naming what is missing.
//! Without the feature the same API exists and every constructor returns
//! `Error::Unsupported("built without CUDA ...")`.
//!
//! Kernels are CUDA C sources in `src/gpu/kernels/*.cu` (embedded with
//! `include_str!`, listed in `gpu::sources`), compiled by NVRTC on first use
//! for the device's compute capability with `--fmad=false`, and cached per
//! device for the life of the process.
//!
//! # Adding a codec's kernels
//! 1. Write `src/gpu/kernels/<codec>.cu` with `extern "C" __global__`
//!    kernels named `decode_<codec>_..._{bf16,f16}` (and `encode_...`),
//!    taking `(const PageDesc*, const uint2* work, u64* status)` and
//!    reading everything else from the descriptor: five section offsets
//!    (`sec0..sec4`), four codec parameters (`p0..p3`) and the tensor's
//!    side table (`side`); one work item per thread block, `(descriptor
//!    index, first unit or row)`. Use the helpers of `common.cuh`
//!    (`row_dst` / `RowWalk` for both layouts, `get_bits`, `load_le`,
//!    `st_out8`, the Walsh-Hadamard stages, conversions); write them so that
//!    they also compile as host C++ for the emulator (`KVPACK_EMU`).
//! 2. Add it to `gpu::sources::ALL`.
//! 3. Add its kernel family to `gpu::spec::KernelCodec` and write
//!    `src/gpu/family/<family>.rs` with a unit struct `Family` implementing
//!    `gpu::family::GpuFamily`: the codec ids it reads (`codec_ids`), the
//!    family from the codec's own parameter parser (`kernel_codec`), the
//!    section offsets from the codec's own page layout (`page_sections`),
//!    the kernel name and grid (`decode_kernel`), the descriptor parameters
//!    (`desc_params`), the sections of its canonical body in the order
//!    the CPU encoder writes them (`body_sections`: the staging bound and
//!    the encode body layouts derive from it), the side table
//!    it needs (`side_table`: codebooks, sign vectors, factors), its kernel
//!    names (`kernel_names`) and, with a GPU encoder, `encodes` and
//!    `plan_encode`. Register it in `gpu/family/mod.rs`: `mod <family>;`,
//!    an entry in `FAMILIES` and the match arm of `family::of`.
//! 4. Extend `tests/gpu.rs` (its bodies run on the CPU, CUDA and, with
//!    `KVPACK_GPU_EMU=1`, the emulator) and `tests/benches/gpu.rs`.
//!
//! The container, [`FileDecoder`] and the plans need no change.

// The device-independent internals (kernel families, page staging, side
// tables, encode plans, kernel sources) are public for the tests and
// benchmarks only: `#[doc(hidden)]`, not part of the API.
mod abi;
pub(crate) mod addr;
mod backend;
#[doc(hidden)]
pub mod body;
mod decplan;
#[doc(hidden)]
pub mod encplan;
#[doc(hidden)]
pub mod family;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod frame;
pub mod host;
#[cfg(test)]
mod hostcost;
pub(crate) mod hqmq_cells;
pub mod paged;
#[doc(hidden)]
pub mod side;
#[doc(hidden)]
pub mod sources;
#[doc(hidden)]
pub mod spec;

#[cfg(feature = "cuda")]
mod cuda;
#[doc(hidden)]
pub mod emu;
#[cfg(any(feature = "cuda", test))]
mod ptx_cache;
#[cfg(feature = "cuda")]
pub use cuda::{
    DecodePlan, EncodePlan, FileDecoder, GatherPlan, Gpu, GpuBuffer, GpuElem, GpuPages, PagedJob,
    compile_all,
};
pub use emu::Emulator;

#[cfg(not(feature = "cuda"))]
mod stub;
#[cfg(not(feature = "cuda"))]
pub use stub::{
    DecodePlan, EncodePlan, FileDecoder, GatherPlan, Gpu, GpuBuffer, GpuElem, GpuPages, PagedJob,
};

pub use spec::{KernelOptions, OutType};

use crate::cache::Tensor;
use crate::codec::Codec;
use crate::decode::Archive;
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::format::Section;
use crate::plan::PlannedPage;

/// The message of every GPU entry point in a build without the `cuda`
/// feature.
pub const NO_CUDA: &str = "built without CUDA: rebuild kvpack with `--features cuda`";

/// What [`Gpu::info`] reports about a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// Marketing name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// Compute capability `(major, minor)`, e.g. `(9, 0)`.
    pub compute_capability: (i32, i32),
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// Device memory, bytes.
    pub memory_bytes: u64,
    /// L2 cache, bytes.
    pub l2_bytes: u64,
}

/// Where the decoded rows of one tensor go on the device (16-bit elements,
/// bf16 or fp16 bit patterns).
#[derive(Debug, Clone, Copy)]
pub enum Dst<'a> {
    /// `[planes, tokens, head_dim]` (planes = batch x kv_heads): tensor
    /// token `t` of plane `p` goes to row `p * tokens + (t - first_token)`.
    /// Pages partly outside `[first_token, first_token + tokens)` are
    /// clipped.
    Contiguous {
        /// Output buffer, at least `planes * tokens * head_dim` elements.
        buf: &'a GpuBuffer<u16>,
        /// First tensor token the buffer holds.
        first_token: u32,
        /// Tokens per plane the buffer holds.
        tokens: u32,
    },
    /// vLLM's paged layout `[num_blocks, block_size, kv_heads, head_dim]`
    /// (one of K or V of one layer): token `t` of batch item `b` goes to
    /// slot `slots[b * slot_stride + t]` (block `slot / block_size`, offset
    /// `slot % block_size`); a negative slot is skipped; a slot past the
    /// cache is an error reported by [`DecodePlan::finish`].
    Paged {
        /// The cache, `num_blocks * block_size * kv_heads * head_dim`
        /// elements.
        cache: &'a GpuBuffer<u16>,
        /// The slot mapping (vLLM's `slot_mapping`, i64).
        slots: &'a GpuBuffer<i64>,
        /// Entries between batch items (the tensor's token count for a
        /// `[batch, tokens]` mapping).
        slot_stride: u32,
    },
    /// One of K or V of a paged cache in any [`paged::PagedLayout`]: token
    /// `t` of the (batch 1) tensor goes to slot `slots[t]` (a negative slot
    /// is skipped), addressed as [`paged::PagedAddr`] says.
    Blocks {
        /// The cache.
        cache: &'a paged::PagedCache,
        /// Which of K or V this tensor fills.
        kind: crate::cache::Kind,
        /// The slot mapping, one i64 per token ([`paged::slot_mapping`]).
        slots: &'a GpuBuffer<i64>,
    },
}

/// One tensor of a decode: its index in the file's tensor table and where
/// its rows go.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    /// Tensor index (position in the file's tensor table).
    pub tensor: u32,
    /// Destination.
    pub dst: Dst<'a>,
}

/// Counters of one [`FileDecoder::decode`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StreamStats {
    /// Pages decoded.
    pub pages: u64,
    /// Chunks (host-to-device copies).
    pub chunks: u64,
    /// Page frame bytes read from the file.
    pub file_bytes: u64,
    /// Bytes copied host to device (page bodies and descriptors).
    pub uploaded_bytes: u64,
    /// Output bytes written on the device.
    pub output_bytes: u64,
    /// Wall time from the call to the last kernel's completion, seconds.
    pub seconds: f64,
}

/// Counters of one [`Gpu::decode_paged`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PagedStats {
    /// Pages decoded (K and V).
    pub pages: u64,
    /// Page frame bytes of the layer in the file.
    pub file_bytes: u64,
    /// Bytes copied host to device (bodies, side tables, slots,
    /// descriptors).
    pub uploaded_bytes: u64,
    /// Bytes written into the cache.
    pub output_bytes: u64,
    /// [`Gpu::decode_paged_device`] only: the host staging of the pages
    /// was skipped, because the previous device-checked decode had a file
    /// of identical structure (the previous layer of a handoff: every page
    /// header, section table and index entry equal but for the CRCs) and
    /// its plan was reused; the header CRCs were checked on the host and
    /// the bodies on the device as always.
    pub plan_reused: bool,
}

/// A host-side destination layout for [`Device::decode_tensor`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostLayout {
    /// `[planes, tokens, head_dim]` holding tensor tokens
    /// `[first_token, first_token + tokens)`.
    Contiguous {
        /// First tensor token.
        first_token: u32,
        /// Tokens per plane.
        tokens: u32,
    },
    /// `[num_slots, kv_heads, head_dim]` (= `[num_blocks, block_size, ...]`
    /// flattened): token `t` of batch item `b` goes to slot
    /// `slots[b * tokens + t]` (`tokens` = the tensor's token count),
    /// skipped when negative.
    Paged {
        /// `num_blocks * block_size`.
        num_slots: u32,
        /// The slot mapping, `batch * tokens` entries.
        slots: Vec<i64>,
    },
    /// A paged cache image of one layer ([`paged::PagedShape::image_target`]:
    /// the tensor of a joint layout, or K then V for HND,
    /// `2 * kv_elements` elements); the tensor (batch 1) fills its K or V
    /// part, token `t` in block `block_ids[t / block_size]`.
    Blocks {
        /// The layout.
        layout: paged::PagedLayout,
        /// The geometry (kv_heads and head_dim must match the tensor).
        shape: paged::PagedShape,
        /// The block table ([`paged::slot_mapping`]).
        block_ids: Vec<i64>,
    },
}

/// Bit pattern every element of a [`Device::decode_tensor`] output holds
/// before decoding (a quiet NaN in bf16 and fp16), so unwritten elements
/// are visible.
pub const POISON: u16 = 0x7fc1;

/// Where [`Device`] operations run.
#[derive(Debug, Clone)]
pub enum Device {
    /// The CPU reference codecs.
    Cpu,
    /// A CUDA device.
    Cuda(Gpu),
    /// The CUDA kernels run on the CPU by the SIMT emulator ([`Emulator`];
    /// a development aid for machines without a GPU).
    Emulated(Emulator),
}

impl Device {
    /// CUDA device `ordinal`.
    ///
    /// # Errors
    /// As [`Gpu::new`] ([`Error::Unsupported`] without the feature, driver,
    /// NVRTC or device).
    pub fn cuda(ordinal: usize) -> Result<Device> {
        Gpu::new(ordinal).map(Device::Cuda)
    }

    /// `cpu` or the GPU's name.
    pub fn name(&self) -> String {
        match self {
            Device::Cpu => "cpu".into(),
            Device::Cuda(g) => format!("cuda:{} ({})", g.info().ordinal, g.info().name),
            Device::Emulated(_) => "emulated kernels".into(),
        }
    }

    /// The SIMT emulator ([`Emulator::new`]).
    ///
    /// # Errors
    /// [`Error::Unsupported`] without g++ (the `cuda` feature is not
    /// needed).
    pub fn emulated() -> Result<Device> {
        Emulator::new().map(Device::Emulated)
    }

    /// This device choosing kernels with `options` (benchmark knobs;
    /// results are identical; the CPU ignores them).
    pub fn with_kernel_options(&self, options: KernelOptions) -> Device {
        match self {
            Device::Cpu => Device::Cpu,
            Device::Cuda(g) => Device::Cuda(g.with_kernel_options(options)),
            Device::Emulated(e) => Device::Emulated(e.with_kernel_options(options)),
        }
    }

    /// Decodes every page of tensor `tensor` overlapping `layout` into a
    /// host vector of bf16/fp16 bit patterns laid out as `layout` says
    /// (elements no page writes keep [`POISON`]).
    ///
    /// # Errors
    /// [`Error::Format`] for a corrupted page; [`Error::Parameter`] for a
    /// bad layout; [`Error::Unsupported`] for a codec without GPU kernels
    /// (CUDA only) or an fp8 / MLA latent tensor (emulator and CUDA; the
    /// CPU device decodes them); [`Error::Device`] for a CUDA failure.
    pub fn decode_tensor(
        &self,
        archive: &Archive<'_>,
        tensor: usize,
        out: OutType,
        layout: &HostLayout,
    ) -> Result<Vec<u16>> {
        let info = host::tensor_info(archive, tensor)?;
        let len = host::layout_len(&info, layout)?;
        // Sizes come from header fields: bounded before anything is
        // allocated, as on the CPU path (pages then go through the same
        // reader checks: CRC, limits, private copies, codec vs tensor).
        host::check_output_len(archive, &info, len as u64)?;
        if !matches!(self, Device::Cpu) {
            spec::supported(&info)?;
        }
        match self {
            Device::Cpu => host::decode_tensor(archive, tensor, out, layout),
            Device::Emulated(e) => e.decode_tensor(archive, tensor, out, layout),
            Device::Cuda(gpu) => {
                let (lo, hi) = host::token_range(&info, layout);
                let pages = archive.reader().pages_overlapping(tensor, lo, hi);
                let gp = GpuPages::upload(gpu, archive, &pages)?;
                let buf = gpu.upload(&vec![POISON; len])?;
                let slots;
                let cache;
                let dst = match layout {
                    HostLayout::Contiguous {
                        first_token,
                        tokens,
                    } => Dst::Contiguous {
                        buf: &buf,
                        first_token: *first_token,
                        tokens: *tokens,
                    },
                    HostLayout::Paged { slots: s, .. } => {
                        slots = gpu.upload(s)?;
                        Dst::Paged {
                            cache: &buf,
                            slots: &slots,
                            slot_stride: info.tokens,
                        }
                    }
                    HostLayout::Blocks {
                        layout,
                        shape,
                        block_ids,
                    } => {
                        slots = gpu.upload(&paged::slot_mapping(block_ids, shape, info.tokens)?)?;
                        let at = buf.device_ptr();
                        let v = (!layout.joint()).then_some(at + 2 * shape.kv_elements());
                        // SAFETY: `buf` is a live allocation of
                        // 2 * kv_elements elements (host::layout_len), K
                        // then V for HND, alive until after `finish`.
                        cache = unsafe {
                            paged::PagedCache::from_raw(
                                *layout,
                                out.dtype(),
                                &shape.dims(*layout),
                                at,
                                v,
                            )?
                        };
                        Dst::Blocks {
                            cache: &cache,
                            kind: info.kind,
                            slots: &slots,
                        }
                    }
                };
                let plan = gpu.plan_decode(
                    &gp,
                    &[Target {
                        tensor: tensor as u32,
                        dst,
                    }],
                    out,
                )?;
                plan.launch()?;
                plan.finish()?;
                buf.to_vec()
            }
        }
    }

    /// Decodes layer `layer` (K and V) into a host image of a paged cache
    /// ([`paged::PagedShape::image_target`]: `2 * kv_elements` elements,
    /// initially [`POISON`]) through the block table `block_ids`, as
    /// [`Gpu::decode_paged`] does on CUDA (there on a borrowed handle of
    /// kvpack's stream, [`Gpu::with_stream`]).
    ///
    /// # Errors
    /// As [`Gpu::decode_paged`].
    pub fn decode_paged(
        &self,
        archive: &Archive<'_>,
        layer: u32,
        layout: paged::PagedLayout,
        shape: &paged::PagedShape,
        block_ids: &[i64],
        out: OutType,
    ) -> Result<Vec<u16>> {
        let len = usize::try_from(2 * shape.kv_elements())
            .map_err(|_| crate::error::Error::param("paged cache too large for this host"))?;
        match self {
            Device::Cpu => {
                let mut image = vec![POISON; len];
                let hl = HostLayout::Blocks {
                    layout,
                    shape: *shape,
                    block_ids: block_ids.to_vec(),
                };
                for (t, _) in paged::layer_tensors(archive, layer, shape)? {
                    host::decode_tensor_into(archive, t as usize, out, &hl, &mut image)?;
                }
                Ok(image)
            }
            Device::Emulated(e) => e.decode_paged(archive, layer, layout, shape, block_ids, out),
            Device::Cuda(gpu) => {
                let buf = gpu.upload(&vec![POISON; len])?;
                let at = buf.device_ptr();
                let v = (!layout.joint()).then_some(at + 2 * shape.kv_elements());
                // SAFETY: `buf` is a live allocation of the image (K then V
                // for HND), kept until the job has finished; kvpack's own
                // stream outlives the borrowed handle.
                let job = unsafe {
                    let cache = paged::PagedCache::from_raw(
                        layout,
                        out.dtype(),
                        &shape.dims(layout),
                        at,
                        v,
                    )?;
                    gpu.with_stream(gpu.raw_stream())
                        .decode_paged(archive, layer, &cache, block_ids)?
                };
                job.wait()?;
                buf.to_vec()
            }
        }
    }

    /// Encodes tokens `0..num_tokens` of a host image of a paged cache
    /// (`image`, [`paged::PagedShape::image_target`]; bf16/fp16 bits as
    /// `dtype`) into a kvpack file, as [`Gpu::encode_paged`] does on CUDA.
    /// The CPU gathers the rows and compresses them with the CPU codecs:
    /// the reference every device's bytes are compared with.
    ///
    /// # Errors
    /// As [`Gpu::encode_paged`].
    #[allow(clippy::too_many_arguments)]
    pub fn encode_paged(
        &self,
        image: &[u16],
        layout: paged::PagedLayout,
        shape: &paged::PagedShape,
        dtype: crate::cache::DType,
        block_ids: &[i64],
        num_tokens: u32,
        codec: &dyn Codec,
        layer: u32,
        opts: &crate::compress::CompressOptions,
    ) -> Result<Vec<u8>> {
        if image.len() as u64 != 2 * shape.kv_elements() {
            return Err(crate::error::Error::param(format!(
                "paged cache image of {} elements, {} expected",
                image.len(),
                2 * shape.kv_elements()
            )));
        }
        let r = match self {
            Device::Cpu => {
                if num_tokens == 0 {
                    return Err(crate::error::Error::param(
                        "encode_paged needs at least one token",
                    ));
                }
                let host = paged::gather_host(image, layout, shape, block_ids, num_tokens)?;
                let infos = paged::layer_infos(shape, dtype, layer, num_tokens);
                paged::file_from_host(infos, host, codec, opts, Vec::new())
            }
            Device::Emulated(e) => e.encode_paged(
                image, layout, shape, dtype, block_ids, num_tokens, codec, layer, opts,
            ),
            Device::Cuda(gpu) => {
                let buf = gpu.upload(image)?;
                let at = buf.device_ptr();
                let v = (!layout.joint()).then_some(at + 2 * shape.kv_elements());
                // SAFETY: `buf` is a live allocation of the image (K then V
                // for HND), alive until the call returns (it waits);
                // kvpack's own stream outlives the borrowed handle.
                unsafe {
                    let cache =
                        paged::PagedCache::from_raw(layout, dtype, &shape.dims(layout), at, v)?;
                    gpu.with_stream(gpu.raw_stream()).encode_paged(
                        &cache,
                        block_ids,
                        num_tokens,
                        codec,
                        layer,
                        opts,
                        Vec::new(),
                    )
                }
            }
        };
        r.map(|(bytes, _)| bytes)
    }

    /// Encodes the planned pages of `tensor` with `codec` (on CUDA and the
    /// emulator the codecs with a GPU encoder: `raw`, `int{b}`, `bdr{h}`,
    /// `hqmq` without `+med`, `kivi`, `innerq`, `polar`, the unit-coded
    /// pages of `octopus` / `turbo`; any codec on the CPU), returning each
    /// page's sections as the CPU encoder does. `codec` must be prepared
    /// for the tensor (`Codec::prepare`: innerq's key factors, octopus /
    /// turbo codebooks for the head_dim).
    ///
    /// # Errors
    /// [`Error::Parameter`] for values the codec cannot represent (NaN,
    /// inf), naming the page; [`Error::Unsupported`] for a codec without a
    /// GPU encoder (CUDA only) or an fp8 / MLA latent tensor (emulator and
    /// CUDA); [`Error::Device`] for a CUDA failure.
    pub fn encode_tensor(
        &self,
        tensor: &Tensor,
        codec: &dyn Codec,
        pages: &[PlannedPage],
    ) -> Result<Vec<Vec<Section>>> {
        if !matches!(self, Device::Cpu) {
            spec::supported(&tensor.info)?;
        }
        match self {
            Device::Cpu => host::encode_tensor(tensor, codec, pages),
            Device::Emulated(e) => e.encode_tensor(tensor, codec, pages),
            Device::Cuda(gpu) => {
                let plan = match &tensor.data {
                    crate::cache::TensorData::Bf16(v) => {
                        let src = gpu.upload::<u16>(bytemuck::cast_slice(v))?;
                        let plan = gpu.plan_encode(&src, &tensor.info, codec, pages)?;
                        plan.launch()?;
                        plan.finish()?;
                        plan.sections()?
                    }
                    crate::cache::TensorData::F16(v) => {
                        let src = gpu.upload::<u16>(bytemuck::cast_slice(v))?;
                        let plan = gpu.plan_encode(&src, &tensor.info, codec, pages)?;
                        plan.launch()?;
                        plan.finish()?;
                        plan.sections()?
                    }
                    crate::cache::TensorData::F32(v) => {
                        let src = gpu.upload::<f32>(v)?;
                        let plan = gpu.plan_encode(&src, &tensor.info, codec, pages)?;
                        plan.launch()?;
                        plan.finish()?;
                        plan.sections()?
                    }
                    crate::cache::TensorData::Fp8(..) => {
                        unreachable!("fp8 tensors are refused above (spec::supported)")
                    }
                };
                Ok(plan)
            }
        }
    }
}

/// Every kernel name a launcher can ask for, with its source (the source
/// check test compiles them all): one list over every kernel family.
#[doc(hidden)]
pub fn all_kernel_names() -> Vec<(&'static str, String)> {
    let mut v = vec![("copy", "copy_u128".to_string())];
    for d in [64, 6] {
        let k = paged::gather_kernel(d);
        v.push((k.source, k.name));
    }
    v.extend(family::kernel_names());
    v.sort();
    v.dedup();
    v
}
