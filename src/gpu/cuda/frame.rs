//! Page frames built on the device ([`Gpu::frame_file`], the launches of
//! `kernels/frame.cu` planned by [`crate::gpu::frame`]) and the CRC-32 of
//! device memory ([`Gpu::crc32_spans`]).

use cudarc::driver::{LaunchConfig, PushKernelArg, result};

use super::{Gpu, GpuBuffer, cuda_err};
use crate::error::{Error, Result};
use crate::gpu::frame::{DeviceFile, FrameCrcSpan, FrameLaunches};

/// Threads per block of the frame kernels (`FRAME_THREADS`).
const THREADS: u32 = 256;

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
        dev.write(&t.bytes)?;
        let s = self.stream().cu_stream();
        // SAFETY: `out` holds `file.len()` bytes (the caller's contract).
        unsafe { result::memset_d8_async(out, 0, file.len() as usize, s) }
            .map_err(cuda_err("memset"))?;
        let at = |o: usize| base + o as u64;
        let n = l.spans.len() as u32;
        let cfg = |blocks: u32| LaunchConfig {
            grid_dim: (blocks.max(1), 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
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
        if spans.is_empty() {
            return Ok(Vec::new());
        }
        let table: Vec<FrameCrcSpan> = spans
            .iter()
            .map(|&(o, n)| FrameCrcSpan {
                at: buf.device_ptr() + o as u64,
                len: n as u64,
            })
            .collect();
        let t = self.upload::<u8>(bytemuck::cast_slice(&table))?;
        let out = self.alloc::<u32>(spans.len())?;
        let f = self.function("frame", "frame_crc")?;
        let mut b = self.stream().launch_builder(&f);
        let (tp, op) = (t.device_ptr(), out.device_ptr());
        b.arg(&tp).arg(&op);
        let cfg = LaunchConfig {
            grid_dim: (spans.len() as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: frame_crc(const FrameCrcSpan*, u32*): one block per span,
        // every span inside `buf` (checked above), one u32 out per span.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launch frame_crc"))?;
        out.to_vec()
    }
}
