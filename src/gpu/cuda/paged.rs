//! Decode of one layer into a paged KV cache on a caller's stream
//! ([`Gpu::decode_paged`], [`PagedJob`]), and the host-side image it
//! uploads ([`PagedImage`], shared with the emulator).
//!
//! One call stages the layer's pages on the CPU (CRC, zstd, section checks;
//! all threads) straight into pinned host memory laid out as
//!
//! ```text
//! [page bodies][side tables][slot mapping][status][descriptors + work lists]
//! ```
//!
//! and enqueues on the stream: one host-to-device copy of that image, the
//! decode kernels (one launch per kernel), and a 16-byte copy of the status
//! words back into the pinned buffer, followed by an event. Nothing waits
//! on the host until [`PagedJob::wait`].

use cudarc::driver::{CudaEvent, PinnedHostSlice, result, sys};

use super::{Gpu, GpuBuffer, cuda_err};
use crate::cache::Kind;
use crate::decode::Archive;
use crate::error::{Error, Result};
use crate::gpu::decplan::{PagedImage, check_status};
use crate::gpu::paged::{PagedCache, slot_mapping};
use crate::gpu::{OutType, PagedStats};

/// Decode work enqueued on a stream by [`Gpu::decode_paged`]. Holds the
/// pinned host staging and the device buffer until the work is done.
///
/// Dropping it without [`PagedJob::wait`] is safe: the drop waits for the
/// job's event (the work this job enqueued, and what the stream held
/// before it; never the device) before the staging is reused, and the
/// device buffer is freed in stream order. Errors the kernels report (a
/// page failing its codec's content checks) are only seen by `wait`.
pub struct PagedJob {
    gpu: Gpu,
    _dev: GpuBuffer<u8>,
    staging: Option<PinnedHostSlice<u8>>,
    status_at: usize,
    event: CudaEvent,
    pub(super) stats: PagedStats,
}

impl std::fmt::Debug for PagedJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagedJob")
            .field("stats", &self.stats)
            .finish()
    }
}

impl PagedJob {
    /// True when the enqueued work has finished (does not block).
    pub fn is_complete(&self) -> bool {
        self.event.is_complete()
    }

    /// Blocks the calling thread until the job's work on its stream is
    /// done (an event wait: the device and other streams keep running),
    /// then checks what the kernels reported.
    ///
    /// # Errors
    /// [`Error::Format`] when a kernel found page content its codec's spec
    /// forbids; [`Error::Device`] when the copy or a kernel failed.
    pub fn wait(mut self) -> Result<PagedStats> {
        self.event.synchronize().map_err(cuda_err("event wait"))?;
        let staging = self.staging.take().expect("present until drop");
        let r = {
            // SAFETY: the event covers the status copy into these bytes;
            // the host reads them only after it completed.
            let bytes = unsafe {
                std::slice::from_raw_parts(
                    staging.as_ptr().map_err(cuda_err("pinned buffer"))?,
                    staging.len(),
                )
            };
            let words: Vec<u64> =
                bytemuck::pod_collect_to_vec(&bytes[self.status_at..self.status_at + 16]);
            check_status(&words)
        };
        self.gpu.give_pinned(staging);
        r.map(|()| self.stats.clone())
    }

    /// What the job moves.
    pub fn stats(&self) -> &PagedStats {
        &self.stats
    }
}

impl Drop for PagedJob {
    fn drop(&mut self) {
        if let Some(s) = self.staging.take() {
            // The copies out of and into the staging must be done before
            // it is reused or freed.
            if self.event.synchronize().is_ok() {
                self.gpu.give_pinned(s);
            } else {
                std::mem::forget(s);
            }
        }
    }
}

impl Gpu {
    /// Decodes layer `layer` of `archive` (its K and V tensors, batch 1,
    /// all committed tokens) into the paged cache `cache`: token `t` goes to
    /// row `t % block_size` of block `block_ids[t / block_size]`, as
    /// `cache.dtype()` (bf16 or fp16), bit-exact with the CPU decoder. Rows
    /// of other blocks are not touched.
    ///
    /// Stream-ordered and asynchronous: the host-to-device copy of the
    /// staged pages, the kernels and the status read-back are enqueued on
    /// this handle's stream (see [`Gpu::with_stream`]) after whatever the
    /// caller enqueued there; the call returns once the CPU staging (CRC,
    /// zstd) is done and the work is enqueued. Call [`PagedJob::wait`]
    /// before reading its status, or keep using the cache on the same
    /// stream.
    ///
    /// # Errors
    /// [`Error::Parameter`] when the file lacks the layer, its tensors do
    /// not fit the cache (kv_heads, head_dim, batch 1), or the block table
    /// is too short, out of range or repeats a block; [`Error::Format`]
    /// for a corrupted page; [`Error::Unsupported`] for a codec or head_dim
    /// the GPU kernels do not take; [`Error::Device`] for a CUDA failure.
    pub fn decode_paged(
        &self,
        archive: &Archive<'_>,
        layer: u32,
        cache: &PagedCache,
        block_ids: &[i64],
    ) -> Result<PagedJob> {
        self.decode_paged_at(archive, layer, cache, block_ids, None)
    }

    /// As [`Gpu::decode_paged`] for a file that is also in device memory
    /// (a NIXL landing buffer, say) at `file`: the pages are validated on
    /// the host from `archive`, which must be a copy of those device
    /// bytes, and the kernels read every uncompressed page body in place
    /// from `file`, so only descriptors and side tables are uploaded
    /// (zstd pages are inflated on the host and uploaded as before).
    ///
    /// # Safety
    /// `file` must be the device address of `archive.len()` bytes on this
    /// handle's device, equal to the archive's bytes and unchanged until
    /// the job is done: the host checks the copy, the kernels read the
    /// device bytes (a body that differs is decoded unchecked; a shorter
    /// buffer is read past its end).
    ///
    /// # Errors
    /// As [`Gpu::decode_paged`].
    pub unsafe fn decode_paged_resident(
        &self,
        archive: &Archive<'_>,
        file: u64,
        layer: u32,
        cache: &PagedCache,
        block_ids: &[i64],
    ) -> Result<PagedJob> {
        self.decode_paged_at(archive, layer, cache, block_ids, Some(file))
    }

    fn decode_paged_at(
        &self,
        archive: &Archive<'_>,
        layer: u32,
        cache: &PagedCache,
        block_ids: &[i64],
        file: Option<u64>,
    ) -> Result<PagedJob> {
        let img = PagedImage::resident(
            archive,
            layer,
            &cache.shape(),
            block_ids,
            file,
            crate::gpu::decplan::BodyCheck::Host,
        )?;
        self.enqueue_image(&img, cache)
    }

    /// Uploads the image's staged part and tables and enqueues its decode
    /// kernels and status read-back (the second half of
    /// [`Gpu::decode_paged`]).
    pub(super) fn enqueue_image(
        &self,
        img: &PagedImage<'_>,
        cache: &PagedCache,
    ) -> Result<PagedJob> {
        let out = OutType::from_dtype(cache.dtype())?;
        let target = |k: Kind| cache.target(k);
        // The tables' size does not depend on the base address.
        let tlen = img.tables_len(target, out, self.options)?;
        let total = img.fixed + tlen;
        let dev = self.alloc_uninit(total)?;
        let base = dev.device_ptr();
        let (tables, launches, written) = img.tables(base, target, out, self.options)?;
        let status_at = total.next_multiple_of(16);
        let mut staging = self.take_pinned(status_at + 16)?;
        {
            let host = staging.as_mut_slice().map_err(cuda_err("pinned buffer"))?;
            img.fill(&mut host[..img.fixed]);
            host[img.fixed..total].copy_from_slice(&tables);
        }
        let s = self.stream().cu_stream();
        let status = base + img.status0 as u64;
        let enqueue = || -> Result<()> {
            let host = staging.as_slice().map_err(cuda_err("pinned buffer"))?;
            // SAFETY: `dev` holds `total` bytes; the pinned staging stays
            // alive and unchanged until the job's event completes (PagedJob).
            unsafe { result::memcpy_htod_async(base, &host[..total], s) }
                .map_err(cuda_err("host-to-device copy"))?;
            for (key, d, w, blocks) in &launches {
                let args = crate::gpu::decplan::group_args(key, status);
                self.launch_items(&key.0, base + *d as u64, base + *w as u64, *blocks, &args)?;
            }
            Ok(())
        };
        let r = enqueue();
        let event = self
            .ctx()
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(cuda_err("event"))?;
        let read_back = r.and_then(|()| {
            let host = staging.as_mut_slice().map_err(cuda_err("pinned buffer"))?;
            // SAFETY: 16 bytes of status on the device into 16 bytes of
            // the pinned staging, which outlives the copy (PagedJob).
            unsafe { result::memcpy_dtoh_async(&mut host[status_at..status_at + 16], status, s) }
                .map_err(cuda_err("device-to-host copy"))
        });
        // Record even after a failure, so the drop of the job waits for
        // whatever was enqueued.
        event
            .record(self.stream())
            .map_err(cuda_err("event record"))?;
        let job = PagedJob {
            gpu: self.clone(),
            _dev: dev,
            staging: Some(staging),
            status_at,
            event,
            stats: PagedStats {
                pages: img.bodies.len() as u64,
                file_bytes: img.file_bytes,
                uploaded_bytes: total as u64,
                output_bytes: written,
                plan_reused: false,
            },
        };
        read_back.map(|()| job)
    }
}

impl Gpu {
    /// Encodes tokens `0..num_tokens` of the paged cache `cache` (K and V of
    /// one layer; token `t` in row `t % block_size` of block
    /// `block_ids[t / block_size]`) with `codec` into a complete kvpack
    /// file written to `out` (tensors `past_key_values.{layer}.key` /
    /// `.value`, batch 1, `cache.dtype()`), byte-identical to what the CPU
    /// writes for the same tensors (`kvpack inspect` and the CPU reader
    /// open it). Returns `out` and the compression report.
    ///
    /// The rows are first gathered on this handle's stream into contiguous
    /// `[kv_heads, num_tokens, head_dim]` device buffers. Codecs with a GPU
    /// encoder (`raw`, `int{b}`, `bdr{h}`, `hqmq` with or without `+med`,
    /// `kivi`, `innerq`, `polar`, `octopus` and `turbo`; sink/recent window
    /// pages as `raw`) encode there and only the page bodies come back;
    /// octopus and turbo codebooks are prepared from the shapes
    /// (`gpu::family::sphere::prepare_shapes`); for InnerQ with key
    /// normalization the per-channel factors (the compressor's
    /// `Codec::prepare`) are reduced on the device first and the few
    /// maxima downloaded. Every other case (and `raw_fallback`) takes the
    /// documented fallback: the gathered tensors are copied to the host on
    /// the same stream and encoded by the CPU codec
    /// ([`crate::gpu::paged::file_from_host`]).
    ///
    /// Returns when the file is on the host: the call waits for the work it
    /// enqueued (stream synchronizes of this handle's stream, so also for
    /// the work the caller enqueued there before; never the device).
    ///
    /// Host side: the page bodies are written by the kernels into a buffer
    /// cleared on the device, downloaded into pinned staging, and framed
    /// (section tables, CRCs on all threads) straight into `out`. With the
    /// environment variable `KVPACK_GPU_TIMING` set, the wall time of each
    /// stage is printed to stderr.
    ///
    /// # Errors
    /// [`Error::Parameter`] when `num_tokens` is 0, the block table is too
    /// short, out of range or repeats a block, or the codec cannot encode
    /// the tensors (shape, NaN or inf: the row is named);
    /// [`Error::Device`] for a CUDA failure.
    #[allow(clippy::too_many_arguments)]
    pub fn encode_paged<W: std::io::Write + Send>(
        &self,
        cache: &PagedCache,
        block_ids: &[i64],
        num_tokens: u32,
        codec: &dyn crate::codec::Codec,
        layer: u32,
        opts: &crate::compress::CompressOptions,
        out: W,
    ) -> Result<(W, crate::compress::CompressReport)> {
        let mut clock = Stages::new();
        let r = self.encode_layer(
            cache,
            block_ids,
            num_tokens,
            codec,
            layer,
            opts,
            &mut clock,
            |e| e.write_on_host(opts, out),
        );
        clock.mark("file written");
        clock.print();
        r
    }

    /// As [`Gpu::encode_paged`], but the file is written into device memory
    /// at `out` (`cap` bytes), on this handle's stream, and its length is
    /// returned with the report: for codecs whose pages the GPU encodes
    /// into fixed layouts, the page frames are built and checksummed on
    /// the device (`gpu::frame`) and no byte of the file passes through
    /// the host. The other cases (`hqmq` with `+med`, whose outlier tables
    /// size the pages; zstd; the CPU fallback) are written on the host as
    /// by [`Gpu::encode_paged`] and copied to `out`. Byte-identical to
    /// [`Gpu::encode_paged`] either way. Returns when the file is in `out`
    /// (a stream synchronize); on an error the content of `out` is
    /// unspecified.
    ///
    /// # Safety
    /// `out` must be device memory of this handle's device holding `cap`
    /// writable bytes, not used by other work until the call returns.
    ///
    /// # Errors
    /// As [`Gpu::encode_paged`]; [`Error::Parameter`] when the file is
    /// longer than `cap`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn encode_paged_device(
        &self,
        cache: &PagedCache,
        block_ids: &[i64],
        num_tokens: u32,
        codec: &dyn crate::codec::Codec,
        layer: u32,
        opts: &crate::compress::CompressOptions,
        out: u64,
        cap: u64,
    ) -> Result<(u64, crate::compress::CompressReport)> {
        let too_long = |n: u64| {
            Error::param(format!(
                "the encoded layer takes {n} bytes, the output holds {cap}"
            ))
        };
        let host_file = |file: Vec<u8>, report: crate::compress::CompressReport| {
            if file.len() as u64 > cap {
                return Err(too_long(file.len() as u64));
            }
            // SAFETY: `out` holds `cap` >= file.len() bytes (the caller's
            // contract); the stream is synchronized before `file` drops.
            unsafe { result::memcpy_htod_async(out, &file[..], self.stream().cu_stream()) }
                .map_err(cuda_err("host-to-device copy"))?;
            self.synchronize()?;
            Ok((file.len() as u64, report))
        };
        let mut clock = Stages::new();
        let r = self.encode_layer(
            cache,
            block_ids,
            num_tokens,
            codec,
            layer,
            opts,
            &mut clock,
            |e| {
                match e {
                    Encoded::Device(d)
                        if d.plans.iter().all(|p| p.cut().is_none())
                            && opts.zstd_level.is_none() =>
                    {
                        let start = std::time::Instant::now();
                        let mut sub = Stages::new();
                        let file = crate::compress::EncodedFile::new(
                            d.infos.clone(),
                            &Default::default(),
                            d.codec,
                            opts,
                            &d.pages,
                        )?;
                        let mut at = vec![(0usize, 0usize); d.pages.len()];
                        for (g, group) in d.groups.iter().enumerate() {
                            for (k, &i) in group.at.iter().enumerate() {
                                at[i] = (g, k);
                            }
                        }
                        let layouts: Vec<_> =
                            at.iter().map(|&(g, k)| d.plans[g].layout(k)).collect();
                        let pages: Vec<_> = d
                            .pages
                            .iter()
                            .zip(&layouts)
                            .map(|(p, (l, _))| (file.meta(p), *l))
                            .collect();
                        sub.mark("file header");
                        let framed = crate::gpu::frame::DeviceFile::new(&file.header, &pages, &[])?;
                        sub.mark("frames planned");
                        if framed.len() > cap {
                            return Err(too_long(framed.len()));
                        }
                        let bodies: Vec<u64> = layouts.iter().map(|(_, a)| *a).collect();
                        // SAFETY: `out` holds `cap` >= framed.len() bytes (the
                        // caller's contract); the bodies live in `d.plans`,
                        // finished, until the synchronize below.
                        let tables = unsafe { self.frame_file(&framed, out, &bodies)? };
                        sub.mark("framing enqueued");
                        // One wait for the gather, the encodes and the
                        // framing (enqueued in that order on the stream);
                        // a refused row leaves `out` unspecified.
                        let waited = self.synchronize();
                        sub.mark("synchronized");
                        let waited = waited.and_then(|()| d.wait());
                        sub.mark("status checked");
                        sub.print_as("encode_paged framing");
                        drop(tables);
                        waited?;
                        Ok((framed.len(), file.report(d.codec, framed.len(), start)))
                    }
                    // Data-dependent page sizes (hqmq+med), zstd, the CPU
                    // fallback: framed on the host, then copied.
                    other => {
                        let (f, r) = other.write_on_host(opts, Vec::new())?;
                        host_file(f, r)
                    }
                }
            },
        );
        clock.mark("file framed on the device");
        clock.print();
        r
    }

    /// The encode of one layer up to its page bodies: the gather, the
    /// codec's preparation, every page group planned, launched and
    /// finished on the device; or, where the GPU has no encoder, the
    /// gathered rows on the host. `finish` turns either into the result.
    #[allow(clippy::too_many_arguments)]
    fn encode_layer<R>(
        &self,
        cache: &PagedCache,
        block_ids: &[i64],
        num_tokens: u32,
        codec: &dyn crate::codec::Codec,
        layer: u32,
        opts: &crate::compress::CompressOptions,
        clock: &mut Stages,
        finish: impl FnOnce(Encoded<'_>) -> Result<R>,
    ) -> Result<R> {
        if num_tokens == 0 {
            return Err(Error::param("encode_paged needs at least one token"));
        }
        let shape = cache.shape();
        let infos = crate::gpu::paged::layer_infos(&shape, cache.dtype(), layer, num_tokens);
        let slots = self.upload_pageable(&slot_mapping(block_ids, &shape, num_tokens)?)?;
        let n = infos[0].elements() as usize;
        let gathered = [self.alloc_uninit::<u16>(n)?, self.alloc_uninit::<u16>(n)?];
        let gather = self.plan_gather(cache, &slots, num_tokens, [&gathered[0], &gathered[1]])?;
        gather.launch()?;
        clock.mark("gather planned, launched");
        let pages = crate::plan::plan(&infos, &[0, 0], opts.layout)?;
        let prepared = match crate::gpu::family::sphere::prepare_shapes(codec, &infos)? {
            Some(c) => Some(c),
            None => crate::gpu::paged::prepare_on_gpu(codec, &infos, &pages, opts, |body| {
                gather.finish()?;
                let mut stage = super::stage::Stage::new(self);
                crate::gpu::backend::key_amax(&mut stage, gathered[0].device_ptr(), &infos[0], body)
                    .map(Some)
            })?,
        };
        let codec = prepared.as_deref().unwrap_or(codec);
        if !crate::gpu::paged::encodes_on_gpu(&infos, &pages, codec, opts) {
            gather.finish()?;
            let host = [gathered[0].to_vec()?, gathered[1].to_vec()?];
            return finish(Encoded::Host { infos, host, codec });
        }
        clock.mark("codec prepared");
        // Every group planned and launched before the first wait, so the
        // host plans the next while the device encodes the last.
        let groups = crate::gpu::paged::page_groups(&pages, 2);
        let plans = groups
            .iter()
            .map(|g| {
                let plan = self.plan_encode(
                    &gathered[g.tensor],
                    &infos[g.tensor],
                    g.codec(codec),
                    &g.pages,
                )?;
                plan.launch()?;
                Ok(plan)
            })
            .collect::<Result<Vec<_>>>()?;
        clock.mark("encodes planned, launched");
        // No wait here: `finish` enqueues what follows (the device
        // framing) first, then waits once (`DeviceBodies::wait`).
        finish(Encoded::Device(Box::new(DeviceBodies {
            infos,
            codec,
            pages,
            groups,
            plans,
            gather,
        })))
    }
}

/// What [`Gpu::encode_layer`] hands to its `finish`.
enum Encoded<'a> {
    /// No GPU encoder: the gathered K and V rows on the host, and the
    /// (prepared) codec.
    Host {
        infos: Vec<crate::cache::TensorInfo>,
        host: [Vec<u16>; 2],
        codec: &'a dyn crate::codec::Codec,
    },
    /// The page bodies in device memory.
    Device(Box<DeviceBodies<'a>>),
}

/// Page bodies encoded on the device, per page group: enqueued, not yet
/// waited for ([`DeviceBodies::wait`]).
struct DeviceBodies<'a> {
    infos: Vec<crate::cache::TensorInfo>,
    codec: &'a dyn crate::codec::Codec,
    pages: Vec<crate::plan::PlannedPage>,
    groups: Vec<crate::gpu::paged::PageGroup>,
    plans: Vec<super::EncodePlan<'a>>,
    gather: GatherPlan<'a>,
}

impl Encoded<'_> {
    /// The kvpack file written on the host into `out`: the CPU codec's
    /// encode of the gathered rows, or the device's bodies downloaded and
    /// framed (section tables, CRCs).
    fn write_on_host<W: std::io::Write + Send>(
        self,
        opts: &crate::compress::CompressOptions,
        out: W,
    ) -> Result<(W, crate::compress::CompressReport)> {
        match self {
            Encoded::Host { infos, host, codec } => {
                crate::gpu::paged::file_from_host(infos, host, codec, opts, out)
            }
            Encoded::Device(d) => {
                d.wait()?;
                let bodies = d.download()?;
                crate::gpu::paged::file_from_bodies(d.infos, d.codec, opts, &d.pages, &bodies, out)
            }
        }
    }
}

impl DeviceBodies<'_> {
    /// Waits for the gather and every encode launch and checks their
    /// status words (a row the codec refuses is named here).
    fn wait(&self) -> Result<()> {
        self.gather.finish()?;
        for p in &self.plans {
            p.finish()?;
        }
        Ok(())
    }

    /// The bodies downloaded into pinned staging, in plan order.
    fn download(&self) -> Result<crate::gpu::paged::PagedBodies> {
        let bodies = self
            .plans
            .iter()
            .map(|p| p.download())
            .collect::<Result<Vec<_>>>()?;
        crate::gpu::paged::PagedBodies::new(self.pages.len(), &self.groups, bodies)
    }
}

/// Wall-clock stages of one call, printed to stderr when the environment
/// variable `KVPACK_GPU_TIMING` is set (a profiling aid for the host side
/// of [`Gpu::encode_paged`] on a device).
pub(super) struct Stages {
    on: bool,
    last: std::time::Instant,
    marks: Vec<(&'static str, f64)>,
}

impl Stages {
    pub(super) fn new() -> Stages {
        Stages {
            on: std::env::var_os("KVPACK_GPU_TIMING").is_some(),
            last: std::time::Instant::now(),
            marks: Vec::new(),
        }
    }

    /// Ends the stage `what`.
    pub(super) fn mark(&mut self, what: &'static str) {
        if self.on {
            let now = std::time::Instant::now();
            self.marks
                .push((what, (now - self.last).as_secs_f64() * 1e3));
            self.last = now;
        }
    }

    pub(super) fn print(&self) {
        self.print_as("encode_paged");
    }

    /// Prints the stages as those of `call`.
    pub(super) fn print_as(&self, call: &str) {
        if self.on {
            let total: f64 = self.marks.iter().map(|m| m.1).sum();
            let parts: Vec<String> = self
                .marks
                .iter()
                .map(|(w, ms)| format!("{w} {ms:.3}"))
                .collect();
            eprintln!("kvpack {call} ms: {} | total {total:.3}", parts.join(" | "));
        }
    }
}

/// A prepared gather of K and V out of a paged cache into contiguous
/// `[kv_heads, tokens, head_dim]` buffers (the first step of
/// [`Gpu::encode_paged`]). Launch it as often as needed; the buffers stay
/// borrowed.
pub struct GatherPlan<'a> {
    gpu: Gpu,
    kernel: crate::gpu::spec::KernelChoice,
    table: GpuBuffer<u8>,
    items: GpuBuffer<u32>,
    blocks: u32,
    status: GpuBuffer<u64>,
    bytes: u64,
    _borrow: std::marker::PhantomData<&'a ()>,
}

impl std::fmt::Debug for GatherPlan<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatherPlan")
            .field("kernel", &self.kernel.name)
            .field("blocks", &self.blocks)
            .finish()
    }
}

impl Gpu {
    /// Plans the gather of tokens `0..tokens` of K and V of `cache`, the
    /// rows of slots `slots` ([`slot_mapping`], one i64 per token), into
    /// `outs[0]` (K) and `outs[1]` (V), each `[kv_heads, tokens, head_dim]`.
    ///
    /// # Errors
    /// [`Error::Parameter`] when `slots` has fewer than `tokens` entries or
    /// an output is too small; [`Error::Device`] for a CUDA failure.
    pub fn plan_gather<'a>(
        &self,
        cache: &PagedCache,
        slots: &'a GpuBuffer<i64>,
        tokens: u32,
        outs: [&'a GpuBuffer<u16>; 2],
    ) -> Result<GatherPlan<'a>> {
        let shape = cache.shape();
        let n = u64::from(shape.kv_heads) * u64::from(tokens) * u64::from(shape.head_dim);
        if (slots.len() as u64) < u64::from(tokens) || outs.iter().any(|o| (o.len() as u64) < n) {
            return Err(Error::param(format!(
                "gather of {tokens} tokens needs {tokens} slots and outputs of {n} elements"
            )));
        }
        let (kernel, descs, work) = crate::gpu::paged::gather_plan(
            &shape,
            [cache.target(Kind::Key), cache.target(Kind::Value)],
            slots.device_ptr(),
            tokens,
            [outs[0].device_ptr(), outs[1].device_ptr()],
        )?;
        Ok(GatherPlan {
            gpu: self.clone(),
            kernel,
            table: self.upload_pageable::<u8>(bytemuck::cast_slice(&descs))?,
            items: self.upload_pageable::<u32>(bytemuck::cast_slice(&work))?,
            blocks: work.len() as u32,
            status: self.upload_pageable(&[u64::MAX; 2])?,
            bytes: 2 * n * 2,
            _borrow: std::marker::PhantomData,
        })
    }
}

impl GatherPlan<'_> {
    /// Submits the gather (asynchronous).
    ///
    /// # Errors
    /// [`Error::Device`] when the launch fails.
    pub fn launch(&self) -> Result<()> {
        let args = super::Args {
            bits: None,
            h: None,
            c: None,
            status: self.status.device_ptr(),
        };
        self.gpu.launch_items(
            &self.kernel,
            self.table.device_ptr(),
            self.items.device_ptr(),
            self.blocks,
            &args,
        )
    }

    /// Waits for the stream and checks the status words.
    ///
    /// # Errors
    /// [`Error::Device`] for a failed kernel; [`Error::Parameter`] for a slot
    /// past the cache.
    pub fn finish(&self) -> Result<()> {
        check_status(&self.status.to_vec()?)
    }

    /// Bytes the kernel reads and writes, `(read, written)`.
    pub fn bytes(&self) -> (u64, u64) {
        (self.bytes / 2, self.bytes / 2)
    }

    /// The kernel's name.
    pub fn kernel(&self) -> &str {
        &self.kernel.name
    }
}
