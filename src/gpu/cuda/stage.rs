//! CUDA as a [`Backend`]: device buffers uploaded on kvpack's stream and
//! kept with the plan that uses them, launches through
//! [`Gpu::launch_items`].

use super::{Gpu, GpuBuffer};
use crate::error::{Error, Result};
use crate::gpu::backend::{Backend, Launch};
use crate::gpu::decplan::BODY_ALIGN;
use crate::gpu::encplan::{Place, check_words};
use cudarc::driver::{result, sys};

/// The buffers placed for one plan on one device.
pub(crate) struct Stage<'g> {
    gpu: &'g Gpu,
    /// Every buffer placed so far, in order.
    pub bufs: Vec<GpuBuffer<u8>>,
}

impl<'g> Stage<'g> {
    /// An empty stage on `gpu`.
    pub fn new(gpu: &'g Gpu) -> Stage<'g> {
        Stage {
            gpu,
            bufs: Vec::new(),
        }
    }

    /// Removes and returns the buffer placed at `addr`.
    ///
    /// # Panics
    /// When no buffer was placed at `addr` (a bug of the caller).
    pub fn take(&mut self, addr: u64) -> GpuBuffer<u8> {
        let i = self
            .bufs
            .iter()
            .position(|b| b.device_ptr() == addr)
            .expect("a buffer placed on this stage");
        self.bufs.remove(i)
    }
}

/// Runs `launches` on `gpu`'s stream, in order (asynchronous).
///
/// # Errors
/// [`Error::Device`] when NVRTC, the module load or a launch fails.
pub(crate) fn launch_all(gpu: &Gpu, launches: &[Launch]) -> Result<()> {
    for l in launches {
        gpu.launch_items(&l.kernel, l.descs, l.work, l.blocks, &l.args)?;
    }
    Ok(())
}

impl Place for Stage<'_> {
    fn place(&mut self, bytes: &[u8]) -> Result<u64> {
        // Descriptor tables and side tables built in ordinary (pageable)
        // host memory.
        let buf = if bytes.is_empty() {
            self.gpu.upload_pageable(&[0u8; BODY_ALIGN])?
        } else {
            self.gpu.upload_pageable(bytes)?
        };
        let at = buf.device_ptr();
        self.bufs.push(buf);
        Ok(at)
    }

    fn zeroed(&mut self, len: usize) -> Result<u64> {
        // Allocated and cleared on the stream (a memset): no copy, no wait.
        let buf = self.gpu.alloc::<u8>(len.max(BODY_ALIGN))?;
        let at = buf.device_ptr();
        self.bufs.push(buf);
        Ok(at)
    }

    fn place_padded(&mut self, bytes: &[u8], len: usize) -> Result<u64> {
        let buf = self.gpu.alloc::<u8>(len.max(bytes.len()).max(BODY_ALIGN))?;
        let at = buf.device_ptr();
        self.bufs.push(buf);
        if !bytes.is_empty() {
            // SAFETY: `bytes.len()` bytes into the buffer just allocated
            // (at least that long, cleared first on the same stream); the
            // stream is synchronized before `bytes` may be freed.
            unsafe { result::memcpy_htod_async(at, bytes, self.gpu.stream().cu_stream()) }
                .map_err(super::cuda_err("host-to-device copy"))?;
            self.gpu.synchronize()?;
        }
        Ok(at)
    }

    fn zeroed_with(&mut self, len: usize, value: u32, at: &[usize]) -> Result<u64> {
        check_words(len, at)?;
        let base = self.zeroed(len)?;
        // One strided 32-bit memset per run of offsets with equal spacing
        // (every full page, then the last), after the clear on the stream.
        let mut i = 0;
        while i < at.len() {
            let pitch = at.get(i + 1).map_or(4, |&n| n - at[i]);
            let mut rows = 1;
            while at
                .get(i + rows)
                .is_some_and(|&n| n - at[i + rows - 1] == pitch)
            {
                rows += 1;
            }
            // SAFETY: `rows` words `pitch` bytes apart from `base + at[i]`,
            // each inside the `len` bytes just allocated (check_words), on
            // the stream the buffer was allocated and cleared on.
            unsafe {
                sys::cuMemsetD2D32Async(
                    base + at[i] as u64,
                    pitch,
                    value,
                    1,
                    rows,
                    self.gpu.stream().cu_stream(),
                )
            }
            .result()
            .map_err(super::cuda_err("memset"))?;
            i += rows;
        }
        Ok(base)
    }
}

impl Backend for Stage<'_> {
    fn launch(&mut self, launches: &[Launch]) -> Result<()> {
        launch_all(self.gpu, launches)
    }

    fn read(&mut self, addr: u64, len: usize) -> Result<Vec<u8>> {
        let b = self
            .bufs
            .iter()
            .find(|b| {
                let p = b.device_ptr();
                p <= addr && addr + len as u64 <= p + b.len() as u64
            })
            .ok_or_else(|| Error::param("internal: read outside the placed buffers"))?;
        let o = (addr - b.device_ptr()) as usize;
        Ok(b.to_vec()?[o..o + len].to_vec())
    }
}
