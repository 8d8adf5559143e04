//! File to GPU: pages of an mmap'd kvpack file (or any host buffer) decoded
//! into device memory with the CPU staging, the host-to-device copy and the
//! kernels of consecutive chunks overlapped.
//!
//! ```text
//! chunk k:   CPU: CRC + zstd + copy into pinned staging[k % 2] (all threads)
//!            copy stream:    wait done[k % 2]; H2D staging -> dev[k % 2]; record h2d[k % 2]
//!            compute stream: wait h2d[k % 2]; decode kernels;            record done[k % 2]
//! ```
//! While the GPU copies and decodes chunk k, the CPU stages chunk k + 1.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaEvent, CudaStream, PinnedHostSlice, result};
use rayon::prelude::*;

use super::{Gpu, GpuBuffer, cuda_err};
use crate::decode::Archive;
use crate::error::{Error, Result};
use crate::format::FLAG_ZSTD;
use crate::gpu::decplan::{
    BODY_ALIGN, add_page, check_status, dst_spec, group_args, pack_groups, stage_page,
};
use crate::gpu::spec::{self, DstSpec, KernelCodec};
use crate::gpu::{OutType, StreamStats, Target};

/// Space kept free in every chunk for descriptors' alignment padding.
const META_SLACK: usize = 16 * BODY_ALIGN;

/// Decodes pages of a file into device memory through double-buffered
/// pinned staging (see the module docs). Reusable across files; holds two
/// pinned host buffers and two device buffers of `chunk_bytes` each.
pub struct FileDecoder {
    gpu: Gpu,
    chunk: usize,
    staging: [PinnedHostSlice<u8>; 2],
    dev: [GpuBuffer<u8>; 2],
    copy: Arc<CudaStream>,
    h2d: [CudaEvent; 2],
    done: [CudaEvent; 2],
    status: GpuBuffer<u64>,
}

impl std::fmt::Debug for FileDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileDecoder")
            .field("chunk", &self.chunk)
            .finish()
    }
}

/// One page of a chunk: index position, offset of its body in the chunk,
/// bytes reserved for it.
struct Slot {
    page: usize,
    off: usize,
    reserve: usize,
}

impl FileDecoder {
    /// A decoder with two staging chunks of `chunk_bytes` (at least 1 MiB;
    /// 64 MiB is a good default: large enough to amortize a copy, small
    /// enough to start the GPU early).
    ///
    /// # Errors
    /// [`Error::Device`] when pinned or device memory cannot be allocated.
    pub fn new(gpu: &Gpu, chunk_bytes: usize) -> Result<FileDecoder> {
        let chunk = chunk_bytes.max(1 << 20).next_multiple_of(BODY_ALIGN);
        let ctx = gpu.ctx();
        let pin = || {
            // SAFETY: the buffer is written (staged) before any byte of it
            // is copied to the device.
            unsafe { ctx.alloc_pinned::<u8>(chunk) }.map_err(cuda_err("pinned allocation"))
        };
        let staging = [pin()?, pin()?];
        let dev = [gpu.alloc::<u8>(chunk)?, gpu.alloc::<u8>(chunk)?];
        let copy = ctx.new_stream().map_err(cuda_err("stream creation"))?;
        let ev = || ctx.new_event(None).map_err(cuda_err("event"));
        let d = FileDecoder {
            gpu: gpu.clone(),
            chunk,
            staging,
            dev,
            copy,
            h2d: [ev()?, ev()?],
            done: [ev()?, ev()?],
            status: gpu.upload(&[u64::MAX; 2])?,
        };
        // The device buffers were allocated on the compute stream; the copy
        // stream may use them only after that.
        gpu.synchronize()?;
        Ok(d)
    }

    /// Staging chunk size, bytes.
    pub fn chunk_bytes(&self) -> usize {
        self.chunk
    }

    /// Decodes every page of `archive` whose tensor has a target (and, for
    /// a contiguous target, overlaps its token range) into the targets, in
    /// file order. Returns when the last kernel has finished.
    ///
    /// # Errors
    /// [`Error::Format`] for a corrupted page (CRC, zstd, sections);
    /// [`Error::Limits`] for a page larger than a chunk;
    /// [`Error::Parameter`] for a bad target; [`Error::Unsupported`] for a
    /// codec without GPU kernels; [`Error::Device`] for a CUDA failure.
    pub fn decode(
        &mut self,
        archive: &Archive<'_>,
        targets: &[Target<'_>],
        out: OutType,
    ) -> Result<StreamStats> {
        let start = Instant::now();
        let r = self.run(archive, targets, out);
        // Leave no copy in flight from our staging buffers, whatever happened.
        let synced = self
            .copy
            .synchronize()
            .map_err(cuda_err("synchronize"))
            .and(self.gpu.synchronize());
        let mut stats = r?;
        synced?;
        check_status(&self.status.to_vec()?)?;
        stats.seconds = start.elapsed().as_secs_f64();
        Ok(stats)
    }

    /// Plans chunks of pages; each chunk's bodies and metadata fit `chunk`.
    fn chunks(
        &self,
        archive: &Archive<'_>,
        by_tensor: &BTreeMap<u32, DstSpec>,
    ) -> Result<Vec<Vec<Slot>>> {
        let reader = archive.reader();
        let infos = archive.tensors();
        let mut chunks: Vec<Vec<Slot>> = Vec::new();
        let mut cur: Vec<Slot> = Vec::new();
        let (mut used, mut meta) = (0usize, 0usize);
        for (pi, e) in reader.index().entries.iter().enumerate() {
            let m = e.meta;
            let Some(dst) = by_tensor.get(&m.tensor) else {
                continue;
            };
            if let DstSpec::Contiguous {
                first_token,
                tokens,
                ..
            } = *dst
            {
                let end = u64::from(first_token) + u64::from(tokens);
                if u64::from(m.token_start) >= end || m.token_start + m.tokens <= first_token {
                    continue;
                }
            }
            let info = &infos[m.tensor as usize];
            let kc = KernelCodec::of(archive.codec(m.codec as usize), info)?;
            let rows = info.planes() as u64 * u64::from(m.tokens);
            let reserve = if e.flags & FLAG_ZSTD == 0 {
                e.frame_len.saturating_sub(64)
            } else {
                crate::gpu::family::canonical_body_len(
                    kc,
                    rows,
                    u64::from(m.tokens),
                    u64::from(info.head_dim),
                )
            };
            let reserve = (reserve as usize).next_multiple_of(BODY_ALIGN);
            let k = crate::gpu::family::decode_kernel(
                kc,
                info.head_dim,
                OutType::Bf16,
                self.gpu.options,
            )?;
            let mut items = Vec::new();
            k.grid
                .push_items(0, rows as u32, m.tokens, info.head_dim, &mut items);
            let page_meta = std::mem::size_of::<spec::PageDesc>() + 8 * items.len();
            if reserve + page_meta + META_SLACK > self.chunk {
                return Err(Error::Limits(format!(
                    "page {pi} needs {} bytes of staging, more than the {}-byte chunk",
                    reserve + page_meta,
                    self.chunk
                )));
            }
            if used + reserve + meta + page_meta + META_SLACK > self.chunk {
                chunks.push(std::mem::take(&mut cur));
                used = 0;
                meta = 0;
            }
            cur.push(Slot {
                page: pi,
                off: used,
                reserve,
            });
            used += reserve;
            meta += page_meta;
        }
        if !cur.is_empty() {
            chunks.push(cur);
        }
        Ok(chunks)
    }

    fn run(
        &mut self,
        archive: &Archive<'_>,
        targets: &[Target<'_>],
        out: OutType,
    ) -> Result<StreamStats> {
        let mut by_tensor = BTreeMap::new();
        for t in targets {
            if by_tensor.insert(t.tensor, dst_spec(&t.dst)).is_some() {
                return Err(Error::param(format!("tensor {} has two targets", t.tensor)));
            }
        }
        let chunks = self.chunks(archive, &by_tensor)?;
        self.status.write(&[u64::MAX; 2])?;
        // Side tables (codebooks, signs, factors) of every (codec, tensor)
        // pair decoded, uploaded once for the whole file.
        let entries_all = &archive.reader().index().entries;
        let (tables, side_at) = crate::gpu::side::for_archive(
            archive,
            chunks.iter().flatten().map(|s| {
                (
                    entries_all[s.page].meta.codec,
                    entries_all[s.page].meta.tensor,
                )
            }),
        )?;
        let side_buf = if tables.is_empty() {
            None
        } else {
            Some(self.gpu.upload(&tables)?)
        };
        let side_addr = |codec: u16, tensor: u32| -> u64 {
            match (&side_buf, side_at.get(&(codec, tensor))) {
                (Some(b), Some(&o)) => b.device_ptr() + o,
                _ => 0,
            }
        };
        let mut stats = StreamStats::default();
        let entries = &archive.reader().index().entries;
        let compute = self.gpu.stream().clone();
        for (ci, chunk) in chunks.iter().enumerate() {
            let slot = ci % 2;
            // The previous copy out of this staging buffer must be done.
            self.h2d[slot]
                .synchronize()
                .map_err(cuda_err("event wait"))?;
            let staging = self.staging[slot]
                .as_mut_slice()
                .map_err(cuda_err("pinned buffer"))?;
            // Stage every page of the chunk on all threads: validate (CRC,
            // zstd, sections) and copy the body into its reserved range.
            let mut parts = Vec::with_capacity(chunk.len());
            let mut rest = &mut staging[..];
            let mut at = 0;
            for s in chunk {
                let (_, r) = std::mem::take(&mut rest).split_at_mut(s.off - at);
                let (mine, r) = r.split_at_mut(s.reserve);
                parts.push((s, mine));
                rest = r;
                at = s.off + s.reserve;
            }
            let staged = parts
                .into_par_iter()
                .map(|(s, buf)| {
                    let st = stage_page(archive, s.page)?;
                    let body = st.view.body();
                    if body.len() > buf.len() {
                        return Err(Error::format(
                            crate::error::Location::Page {
                                page: s.page as u64,
                                offset: archive.reader().header_len() + entries[s.page].offset,
                                what: None,
                            },
                            "page body is larger than its codec's canonical layout",
                        ));
                    }
                    buf[..body.len()].copy_from_slice(body);
                    let mut g = st.geom;
                    g.side = side_addr(st.codec, st.tensor);
                    Ok((st.tensor, g, s.off))
                })
                .collect::<Result<Vec<_>>>()?;
            // Descriptors point into this chunk's device buffer.
            let dev = self.dev[slot].device_ptr();
            let mut groups = BTreeMap::new();
            for (tensor, g, off) in &staged {
                let dst = &by_tensor[tensor];
                let (_, w) = add_page(
                    &mut groups,
                    g,
                    dev + *off as u64,
                    dst,
                    out,
                    self.gpu.options,
                )?;
                stats.output_bytes += w;
            }
            let mut meta = Vec::new();
            let launches = pack_groups(groups, &mut meta);
            let meta_off = chunk
                .last()
                .map_or(0, |s| s.off + s.reserve)
                .next_multiple_of(BODY_ALIGN);
            let used = meta_off + meta.len();
            if used > self.chunk {
                return Err(Error::Limits("chunk metadata overflowed its slack".into()));
            }
            staging[meta_off..used].copy_from_slice(&meta);
            // Copy once the kernels that read this device buffer are done.
            self.copy
                .wait(&self.done[slot])
                .map_err(cuda_err("stream wait"))?;
            self.gpu.ctx().bind_to_thread().map_err(cuda_err("bind"))?;
            // SAFETY: `dev` holds `chunk` >= `used` bytes; the staging slice
            // stays untouched until h2d[slot] completes (waited on before
            // the next fill of this slot and before returning).
            unsafe {
                result::memcpy_htod_async(dev, &staging[..used], self.copy.cu_stream())
                    .map_err(cuda_err("host-to-device copy"))?;
            }
            self.h2d[slot]
                .record(&self.copy)
                .map_err(cuda_err("event record"))?;
            compute
                .wait(&self.h2d[slot])
                .map_err(cuda_err("stream wait"))?;
            let base = dev + meta_off as u64;
            for (key, d, w, blocks) in &launches {
                let args = group_args(key, self.status.device_ptr());
                self.gpu.launch_items(
                    &key.0,
                    base + *d as u64,
                    base + *w as u64,
                    *blocks,
                    &args,
                )?;
            }
            self.done[slot]
                .record(&compute)
                .map_err(cuda_err("event record"))?;
            stats.pages += chunk.len() as u64;
            stats.chunks += 1;
            stats.uploaded_bytes += used as u64;
            stats.file_bytes += chunk.iter().map(|s| entries[s.page].frame_len).sum::<u64>();
        }
        Ok(stats)
    }
}

impl Drop for FileDecoder {
    fn drop(&mut self) {
        // No copy may still read the pinned buffers when they are freed.
        let _ = self.copy.synchronize();
        let _ = self.gpu.synchronize();
    }
}
