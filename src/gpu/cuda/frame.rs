//! Page frames built on the device ([`Gpu::frame_file`], the launches of
//! `kernels/frame.cu` planned by [`crate::gpu::frame`]), checked on the
//! device ([`Gpu::decode_paged_device`]), and the CRC-32 of device memory
//! ([`Gpu::crc32_spans`]).

use cudarc::driver::{LaunchConfig, PushKernelArg, result};

use super::{Gpu, GpuBuffer, PagedJob, cuda_err};
use crate::cache::Kind;
use crate::decode::Archive;
use crate::error::{Error, Location, Result};
use crate::gpu::decplan::{
    BodyCheck, PagedImage, any_host_checked, host_checked_spans, layer_pages, plan_key,
};
use crate::gpu::frame::{DeviceFile, FrameCopy, FrameCrcSpan, FrameLaunches};
use crate::gpu::paged::PagedCache;

/// Bytes of the head and of the tail of a file read back first (header;
/// index and trailer).
const WINDOW: u64 = 1 << 16;

/// Bytes of each page frame read back first: the page header and a
/// section table of up to 20 sections (every codec has fewer).
const PAGE_HEAD: u64 = 64 + 320;

/// Threads per block of the frame kernels (`FRAME_THREADS`).
const THREADS: u32 = 256;

/// `blocks` (at least 1) blocks of [`THREADS`] threads.
fn grid(blocks: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks.max(1), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A host image of a device file for the device-checked decode: zero
/// except the `written` spans read back from the device.
pub(super) struct Shadow {
    bytes: Vec<u8>,
    written: Vec<(u64, u64)>,
}

/// The plan of a device-checked decode, kept for the next file of the
/// same structure ([`crate::gpu::decplan::plan_key`]): the next layer of a
/// handoff, whose pages differ only in their CRCs, skips the host staging
/// of every page.
pub(super) struct CachedPlan {
    /// Distinguishes plans (an early launch names the plan it ran).
    id: u64,
    key: Vec<u8>,
    /// Length of that file.
    len: u64,
    /// Device address of the file the image's resident addresses point into.
    file: u64,
    img: PagedImage<'static>,
}

/// `m` locked; a panic of another holder leaves nothing half-done here
/// (each value is replaced whole), so a poisoned lock is taken as is.
fn locked<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The body CRC of each page of `pages` when every page header in `buf`
/// (opened as `archive`) carries a valid header CRC and the body CRC of
/// its index entry; `None` otherwise (the full checks then name the
/// fault).
fn page_crcs(archive: &Archive<'_>, buf: &[u8], pages: &[usize]) -> Option<Vec<u32>> {
    let r = archive.reader();
    let u32_at = |b: &[u8], at: usize| {
        b.get(at..at + 4)
            .map(|x| u32::from_le_bytes([x[0], x[1], x[2], x[3]]))
    };
    pages
        .iter()
        .map(|&p| {
            let e = &r.index().entries[p];
            let at = usize::try_from(r.header_len() + e.offset).ok()?;
            let head = buf.get(at..at.checked_add(64)?)?;
            let body_crc = u32_at(head, 40)?;
            (crc32fast::hash(&head[..60]) == u32_at(head, 60)? && body_crc == e.body_crc)
                .then_some(body_crc)
        })
        .collect()
}

/// Span checks launched on the device (`frame_crc`, `frame_zero`), not
/// yet read back: one u32 per span, the CRCs first.
pub(super) struct SpanLaunch {
    out: Option<GpuBuffer<u32>>,
    /// The span table the kernels read, kept until they are done.
    _table: Option<GpuBuffer<u8>>,
    crcs: usize,
}

/// `(offset, len)` file spans as device spans of the file at `file`.
fn spans_at(file: u64, v: &[(u64, u64)]) -> Vec<FrameCrcSpan> {
    v.iter()
        .map(|&(o, l)| FrameCrcSpan {
            at: file + o,
            len: l,
        })
        .collect()
}

/// `[tables][crcs]` of one framing, and where each table starts.
struct Tables {
    bytes: Vec<u8>,
    copies: usize,
    work: usize,
    spans: usize,
    seals: usize,
    index_span: usize,
    crcs: usize,
}

fn pack(skeleton: &[u8], l: &FrameLaunches) -> Tables {
    let mut bytes = skeleton.to_vec();
    let mut put = |b: &[u8]| {
        bytes.resize(bytes.len().next_multiple_of(256), 0);
        let at = bytes.len();
        bytes.extend_from_slice(b);
        at
    };
    let copies = put(bytemuck::cast_slice(&l.copies));
    let work = put(bytemuck::cast_slice(&l.work));
    let spans = put(bytemuck::cast_slice(&l.spans));
    let seals = put(bytemuck::cast_slice(&l.seals));
    let index_span = put(bytemuck::bytes_of(&l.index_span));
    let crcs = put(&vec![0u8; 4 * (l.spans.len() + 1)]);
    Tables {
        bytes,
        copies,
        work,
        spans,
        seals,
        index_span,
        crcs,
    }
}

impl Gpu {
    /// Writes the kvpack file `file` into device memory at `out` (at least
    /// `file.len()` bytes) from its page bodies at device addresses
    /// `bodies` (page order), on this handle's stream: zeroes the output,
    /// places the skeleton and the bodies, and fills in every CRC
    /// (`gpu::frame` module docs). Asynchronous: the returned buffer holds
    /// the launches' tables and must live until the stream has passed
    /// them (the caller synchronizes).
    ///
    /// # Safety
    /// `out` must be device memory of this handle's device holding at least
    /// `file.len()` writable bytes, and each of `bodies` a device address of
    /// a finished page body of its page's `body_len` bytes, all valid until
    /// the stream has passed the launches.
    ///
    /// # Errors
    /// [`Error::Parameter`] (internal) for a body count that does not
    /// match; [`Error::Device`] for a CUDA failure.
    pub(crate) unsafe fn frame_file(
        &self,
        file: &DeviceFile,
        out: u64,
        bodies: &[u64],
    ) -> Result<GpuBuffer<u8>> {
        let sized = pack(&file.skeleton.bytes, &file.launches(0, 0, bodies)?);
        let dev = self.alloc_uninit::<u8>(sized.bytes.len())?;
        let base = dev.device_ptr();
        let l = file.launches(out, base, bodies)?;
        let t = pack(&file.skeleton.bytes, &l);
        // SAFETY: `t.bytes` (pageable) fits `dev` (the same packing);
        // ordered on our stream before the launches.
        unsafe { result::memcpy_htod_async(base, &t.bytes[..], self.stream().cu_stream()) }
            .map_err(cuda_err("host-to-device copy"))?;
        let s = self.stream().cu_stream();
        // SAFETY: `out` holds `file.len()` bytes (the caller's contract).
        unsafe { result::memset_d8_async(out, 0, file.len() as usize, s) }
            .map_err(cuda_err("memset"))?;
        let at = |o: usize| base + o as u64;
        let n = l.spans.len() as u32;
        let cfg = grid;
        let (copies, work, spans, seals) = (at(t.copies), at(t.work), at(t.spans), at(t.seals));
        let (index_span, crcs) = (at(t.index_span), at(t.crcs));
        let index_crc = crcs + 4 * u64::from(n);
        // SAFETY (every launch below): the tables were built by
        // `DeviceFile::launches` for this output, these bodies and this
        // upload; every copy and span lies inside `out`, the upload or a
        // body; the kernels' signatures are those of kernels/frame.cu.
        if !l.work.is_empty() {
            let f = self.function("frame", "frame_copy")?;
            let mut b = self.stream().launch_builder(&f);
            b.arg(&copies).arg(&work);
            unsafe { b.launch(cfg(l.work.len() as u32)) }.map_err(cuda_err("launch frame_copy"))?;
        }
        if n > 0 {
            let f = self.function("frame", "frame_crc")?;
            let mut b = self.stream().launch_builder(&f);
            b.arg(&spans).arg(&crcs);
            unsafe { b.launch(cfg(n)) }.map_err(cuda_err("launch frame_crc"))?;
            let f = self.function("frame", "frame_seal_pages")?;
            let mut b = self.stream().launch_builder(&f);
            b.arg(&seals).arg(&crcs).arg(&n);
            unsafe { b.launch(cfg(n.div_ceil(THREADS))) }
                .map_err(cuda_err("launch frame_seal_pages"))?;
        }
        let f = self.function("frame", "frame_crc")?;
        let mut b = self.stream().launch_builder(&f);
        b.arg(&index_span).arg(&index_crc);
        unsafe { b.launch(cfg(1)) }.map_err(cuda_err("launch frame_crc"))?;
        let f = self.function("frame", "frame_seal_index")?;
        let mut b = self.stream().launch_builder(&f);
        b.arg(&l.index_header).arg(&index_crc);
        unsafe { b.launch(cfg(1)) }.map_err(cuda_err("launch frame_seal_index"))?;
        Ok(dev)
    }

    /// The CRC-32 (ISO-HDLC, as `crc32fast`) of each `(offset, len)` span
    /// of `buf`, computed on the device (`frame_crc`). Waits for the
    /// result.
    ///
    /// # Errors
    /// [`Error::Parameter`] for a span outside `buf`; [`Error::Device`]
    /// for a CUDA failure.
    pub fn crc32_spans(&self, buf: &GpuBuffer<u8>, spans: &[(usize, usize)]) -> Result<Vec<u32>> {
        if spans
            .iter()
            .any(|&(o, n)| o.checked_add(n).is_none_or(|e| e > buf.len()))
        {
            return Err(Error::param("CRC span outside the buffer"));
        }
        let table: Vec<FrameCrcSpan> = spans
            .iter()
            .map(|&(o, n)| FrameCrcSpan {
                at: buf.device_ptr() + o as u64,
                len: n as u64,
            })
            .collect();
        self.span_kernels(&table, &[]).map(|(crcs, _)| crcs)
    }

    /// Decodes layer `layer` of a kvpack file that is in device memory
    /// only (`len` bytes at `file`, e.g. a NIXL landing buffer) into the
    /// paged cache `cache`, as [`Gpu::decode_paged`] does, without copying
    /// the file to the host where it can be avoided: the host reads back
    /// the head and tail of the file (header, index, trailer) and each
    /// page's header and section table, and checks them as
    /// [`crate::format::Reader`] does; the device computes each page body's
    /// CRC-32 and checks the padding after each section and body; the
    /// kernels then read the bodies in place. Pages whose codec checks
    /// section content on the host (kivi, innerq, octopus, turbo, hqmq),
    /// zstd pages, and any file the quick path finds at fault go the
    /// authoritative way: the whole file is read back, validated on the
    /// host (whose error names the page) and decoded from `file` as
    /// [`Gpu::decode_paged_resident`] does.
    ///
    /// # Safety
    /// `file` must be the device address of `len` readable bytes on this
    /// handle's device, unchanged until the job is done.
    ///
    /// # Errors
    /// As [`Gpu::decode_paged`].
    pub unsafe fn decode_paged_device(
        &self,
        file: u64,
        len: u64,
        layer: u32,
        cache: &PagedCache,
        block_ids: &[i64],
    ) -> Result<PagedJob> {
        match self.decode_checked_here(file, len, layer, cache, block_ids) {
            Err(Error::Format { .. } | Error::Unsupported(_) | Error::Limits(_)) => {
                let n = usize::try_from(len).map_err(|_| Error::param("file too large"))?;
                let mut staging = self.take_pinned(n)?;
                let copied = (|| {
                    let host = staging.as_mut_slice().map_err(cuda_err("pinned buffer"))?;
                    // SAFETY: `file` holds `len` bytes (the caller's
                    // contract), the staging at least as many; synchronized
                    // before they are read.
                    unsafe {
                        result::memcpy_dtoh_async(&mut host[..n], file, self.stream().cu_stream())
                    }
                    .map_err(cuda_err("device-to-host copy"))?;
                    self.synchronize()
                })();
                if let Err(e) = copied {
                    // A copy may still be writing into it: never reused.
                    std::mem::forget(staging);
                    return Err(e);
                }
                let r = (|| {
                    let host = &staging.as_slice().map_err(cuda_err("pinned buffer"))?[..n];
                    let archive = Archive::open(host)?;
                    // SAFETY: `host` is a copy of the device bytes, which
                    // stay unchanged (the caller's contract). The job does
                    // not borrow the staging.
                    unsafe { self.decode_paged_resident(&archive, file, layer, cache, block_ids) }
                })();
                self.give_pinned(staging);
                r
            }
            r => r,
        }
    }

    /// The quick path of [`Gpu::decode_paged_device`]: structure on the
    /// host from read-back headers, bodies checked on the device.
    fn decode_checked_here(
        &self,
        file: u64,
        len: u64,
        layer: u32,
        cache: &PagedCache,
        block_ids: &[i64],
    ) -> Result<PagedJob> {
        let n = usize::try_from(len).map_err(|_| Error::param("file too large"))?;
        let mut shadow = self.take_shadow(n);
        let r = self.decode_checked_in(&mut shadow, file, len, layer, cache, block_ids);
        *locked(&self.inner.shadow) = Some(shadow);
        r
    }

    /// A zeroed host image of `n` bytes: the last call's, with the spans it
    /// read back zeroed again (a handoff's layers share one length: no
    /// fresh mapping to fault in per layer), or a new one.
    fn take_shadow(&self, n: usize) -> Shadow {
        let last = locked(&self.inner.shadow).take();
        match last {
            Some(mut s) if s.bytes.len() == n => {
                for (o, l) in s.written.drain(..) {
                    s.bytes[o as usize..(o + l) as usize].fill(0);
                }
                s
            }
            _ => Shadow {
                bytes: vec![0u8; n],
                written: Vec::new(),
            },
        }
    }

    /// [`Gpu::decode_checked_here`] into the host image `shadow`, filled
    /// with what the host checks.
    fn decode_checked_in(
        &self,
        shadow: &mut Shadow,
        file: u64,
        len: u64,
        layer: u32,
        cache: &PagedCache,
        block_ids: &[i64],
    ) -> Result<PagedJob> {
        let mut clock = super::paged::Stages::new();
        let w = WINDOW.min(len);
        // Head and tail, and the page heads of the last file of this length
        // (the previous layer of a handoff: the same layout), in one read
        // back; the page heads this file's index names are read after
        // only when they differ.
        let guess: Vec<(u64, u64)> = {
            let last = locked(&self.inner.frame_heads);
            match &*last {
                Some((l, h)) if *l == len => h.clone(),
                _ => Vec::new(),
            }
        };
        let mut first = vec![(0, w), (len - w, w)];
        first.extend(guess.iter().filter(|&&(o, l)| o + l <= len));
        // With a plan kept from a file of this length, its body checks are
        // launched before the read-back (spans that lay inside that file
        // lie inside this one), so one wait covers both; they count only
        // if this file turns out to have the plan's structure.
        let early = {
            let last = locked(&self.inner.plan);
            match &*last {
                Some(c) if c.len == len => {
                    let checks = c.img.device_checks();
                    Some((
                        c.id,
                        self.span_launch(
                            &spans_at(file, &checks.crc),
                            &spans_at(file, &checks.zero),
                        )?,
                    ))
                }
                _ => None,
            }
        };
        self.read_back(file, &first, shadow)?;
        clock.mark("head, tail (and page headers) read back");
        let (heads, content) = {
            let a = Archive::open(&shadow.bytes)?;
            let (_, _, pages) = layer_pages(&a, layer, &cache.shape())?;
            let r = a.reader();
            let entries = &r.index().entries;
            let heads: Vec<(u64, u64)> = pages
                .iter()
                .map(|&p| {
                    (
                        r.header_len() + entries[p].offset,
                        entries[p].frame_len.min(PAGE_HEAD),
                    )
                })
                .collect();
            (heads, any_host_checked(&a, &pages)?)
        };
        if heads != guess {
            self.read_back(file, &heads, shadow)?;
            clock.mark("page headers read back");
            *locked(&self.inner.frame_heads) = Some((len, heads));
        }
        if content {
            let spans = {
                let a = Archive::open(&shadow.bytes)?;
                let (_, _, pages) = layer_pages(&a, layer, &cache.shape())?;
                host_checked_spans(&a, &pages)?
            };
            self.read_back(file, &spans, shadow)?;
            clock.mark("checked sections read back");
        }
        let archive = Archive::open(&shadow.bytes)?;
        let shape = cache.shape();
        let key = {
            let (tensors, _, pages) = layer_pages(&archive, layer, &shape)?;
            let mut extra: Vec<u8> = bytemuck::cast_slice(block_ids).to_vec();
            let dst = (cache.target(Kind::Key).2, cache.target(Kind::Value).2);
            extra.extend_from_slice(
                format!("{shape:?};{:?};{dst:?};{:?}", cache.dtype(), self.options).as_bytes(),
            );
            let key = plan_key(&archive, &shadow.bytes, &tensors, &pages, PAGE_HEAD, &extra)?;
            let last = locked(&self.inner.plan).take();
            match last {
                Some(mut c) if !content && c.key == key => {
                    match page_crcs(&archive, &shadow.bytes, &pages) {
                        Some(want) => {
                            c.img.reuse(c.file, file, want)?;
                            c.file = file;
                            Ok(c)
                        }
                        None => Err(key),
                    }
                }
                _ => Err(key),
            }
        };
        let reused = key.is_ok();
        let plan = match key {
            Ok(c) => {
                clock.mark("plan reused");
                c
            }
            Err(key) => {
                let img = PagedImage::resident(
                    &archive,
                    layer,
                    &shape,
                    block_ids,
                    Some(file),
                    BodyCheck::Device,
                )?;
                clock.mark("pages staged");
                if !img.detachable() {
                    return self.check_and_enqueue(file, &img, cache, clock, false, None);
                }
                let img = img
                    .detach()
                    .ok_or_else(|| Error::param("plan not detachable"))?;
                static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                CachedPlan {
                    id: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                    key,
                    len,
                    file,
                    img,
                }
            }
        };
        // The early checks ran the kept plan's spans: this file's only
        // when the plan was reused.
        let early = early
            .filter(|&(id, _)| reused && id == plan.id)
            .map(|(_, l)| l);
        let r = self.check_and_enqueue(file, &plan.img, cache, clock, reused, early);
        *locked(&self.inner.plan) = Some(plan);
        r
    }

    /// The device checks of `img` (body CRCs, zero padding), then its
    /// decode enqueued: the tail of [`Gpu::decode_checked_in`].
    fn check_and_enqueue(
        &self,
        file: u64,
        img: &PagedImage<'_>,
        cache: &PagedCache,
        mut clock: super::paged::Stages,
        reused: bool,
        early: Option<SpanLaunch>,
    ) -> Result<PagedJob> {
        let checks = img.device_checks();
        let (crcs, nonzero) = match early {
            Some(l) => self.span_results(l)?,
            None => {
                self.span_kernels(&spans_at(file, &checks.crc), &spans_at(file, &checks.zero))?
            }
        };
        if let Some(i) = (0..crcs.len()).find(|&i| crcs[i] != checks.want[i]) {
            return Err(Error::format(
                Location::Data {
                    offset: checks.crc[i].0,
                },
                format!(
                    "page body CRC mismatch on the device: stored 0x{:08x}, computed 0x{:08x}",
                    checks.want[i], crcs[i]
                ),
            ));
        }
        if let Some(i) = nonzero.iter().position(|&z| z != 0) {
            return Err(Error::format(
                Location::Data {
                    offset: checks.zero[i].0,
                },
                "page padding is not zero",
            ));
        }
        clock.mark("bodies checked");
        let job = self.enqueue_image(img, cache).map(|mut j| {
            j.stats.plan_reused = reused;
            j
        });
        clock.mark("enqueued");
        clock.print_as("decode_paged_device");
        job
    }

    /// [`Gpu::gather_into`] the host image, recording the spans written.
    fn read_back(&self, file: u64, spans: &[(u64, u64)], shadow: &mut Shadow) -> Result<()> {
        shadow.written.extend_from_slice(spans);
        self.gather_into(file, spans, &mut shadow.bytes)
    }

    /// Copies the `(offset, len)` spans of the device file at `file` into
    /// the same offsets of `host` (one `frame_copy` launch into a packed
    /// buffer, one read-back).
    fn gather_into(&self, file: u64, spans: &[(u64, u64)], host: &mut [u8]) -> Result<()> {
        let total: u64 = spans.iter().map(|s| s.1).sum();
        if total == 0 {
            return Ok(());
        }
        let out = self.alloc_uninit::<u8>(total as usize)?;
        let mut at = 0;
        let copies: Vec<FrameCopy> = spans
            .iter()
            .map(|&(o, l)| {
                let c = FrameCopy {
                    src: file + o,
                    dst: out.device_ptr() + at,
                    len: l,
                };
                at += l;
                c
            })
            .collect();
        let mut work = Vec::new();
        for (i, c) in copies.iter().enumerate() {
            for j in 0..c.len.div_ceil(crate::gpu::frame::COPY_CHUNK) {
                work.push([i as u32, j as u32]);
            }
        }
        let c = self.upload_pageable::<u8>(bytemuck::cast_slice(&copies))?;
        let w = self.upload_pageable::<u32>(bytemuck::cast_slice(&work))?;
        let f = self.function("frame", "frame_copy")?;
        let mut b = self.stream().launch_builder(&f);
        let (cp, wp) = (c.device_ptr(), w.device_ptr());
        b.arg(&cp).arg(&wp);
        let cfg = grid(work.len() as u32);
        // SAFETY: frame_copy(const FrameCopy*, const uint2*): each copy
        // reads a span of the file (inside its `len` bytes: spans come from
        // index entries and section tables the reader checked against the
        // file) and writes its own range of `out`; one work item per 64 KiB.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launch frame_copy"))?;
        // Read back through pinned staging (a pageable read-back is
        // several times slower for the MBs of scales some codecs check).
        let n = total as usize;
        let mut staging = self.take_pinned(n)?;
        let copied = (|| {
            let h = staging.as_mut_slice().map_err(cuda_err("pinned buffer"))?;
            // SAFETY: `out` holds `n` bytes, the staging at least as many;
            // synchronized before they are read.
            unsafe {
                result::memcpy_dtoh_async(&mut h[..n], out.device_ptr(), self.stream().cu_stream())
            }
            .map_err(cuda_err("device-to-host copy"))?;
            self.synchronize()
        })();
        if let Err(e) = copied {
            // A copy may still be writing into it: never reused.
            std::mem::forget(staging);
            return Err(e);
        }
        let r = staging
            .as_slice()
            .map_err(cuda_err("pinned buffer"))
            .map(|got| {
                let mut at = 0usize;
                for &(o, l) in spans {
                    host[o as usize..(o + l) as usize].copy_from_slice(&got[at..at + l as usize]);
                    at += l as usize;
                }
            });
        self.give_pinned(staging);
        r
    }

    /// Runs `frame_crc` over `crc` and `frame_zero` over `zero` (one block
    /// per span each) and reads back one u32 per span of each, with one
    /// synchronization.
    fn span_kernels(
        &self,
        crc: &[FrameCrcSpan],
        zero: &[FrameCrcSpan],
    ) -> Result<(Vec<u32>, Vec<u32>)> {
        let l = self.span_launch(crc, zero)?;
        self.span_results(l)
    }

    /// The results of [`Gpu::span_launch`]: waits for them.
    fn span_results(&self, l: SpanLaunch) -> Result<(Vec<u32>, Vec<u32>)> {
        let Some(out) = l.out else {
            return Ok((Vec::new(), Vec::new()));
        };
        let mut got = out.to_vec()?;
        let zeros = got.split_off(l.crcs);
        Ok((got, zeros))
    }

    /// Launches [`Gpu::span_kernels`] without waiting.
    fn span_launch(&self, crc: &[FrameCrcSpan], zero: &[FrameCrcSpan]) -> Result<SpanLaunch> {
        let total = crc.len() + zero.len();
        if total == 0 {
            return Ok(SpanLaunch {
                out: None,
                _table: None,
                crcs: 0,
            });
        }
        let all: Vec<FrameCrcSpan> = crc.iter().chain(zero).copied().collect();
        let t = self.upload_pageable::<u8>(bytemuck::cast_slice(&all))?;
        let out = self.alloc_uninit::<u32>(total)?;
        for (name, at, count) in [
            ("frame_crc", 0, crc.len()),
            ("frame_zero", crc.len(), zero.len()),
        ] {
            if count == 0 {
                continue;
            }
            let f = self.function("frame", name)?;
            let mut b = self.stream().launch_builder(&f);
            let size = std::mem::size_of::<FrameCrcSpan>() as u64;
            let (tp, op) = (
                t.device_ptr() + at as u64 * size,
                out.device_ptr() + at as u64 * 4,
            );
            b.arg(&tp).arg(&op);
            let cfg = grid(count as u32);
            // SAFETY: (const FrameCrcSpan*, u32*): one block per span of
            // `all[at..at + count]`, every span inside the caller's
            // buffer, one u32 out per span into `out[at..at + count]`.
            unsafe { b.launch(cfg) }.map_err(cuda_err(&format!("launch {name}")))?;
        }
        Ok(SpanLaunch {
            out: Some(out),
            _table: Some(t),
            crcs: crc.len(),
        })
    }
}
