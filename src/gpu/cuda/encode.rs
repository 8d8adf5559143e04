//! Encode launches ([`EncodePlan`]): a contiguous tensor on the device to
//! page bodies in device memory, for `int{b}` / `bdr{h}` (one kernel) and
//! `hqmq` (a search kernel writing one symbol per chunk to a scratch
//! buffer, then a kernel packing the code streams; with `+med{C}` also a
//! median kernel before and an outlier-table kernel between them).

use std::marker::PhantomData;

use super::{Args, Gpu, GpuBuffer, GpuElem};
use crate::cache::TensorInfo;
use crate::codec::Codec;
use crate::error::{Error, Result};
use crate::format::Section;
use crate::gpu::encplan::{BODY_ALIGN, EncodeLayout};
use crate::gpu::spec::KernelChoice;
use crate::plan::PlannedPage;

/// One kernel launch of an encode: kernel, work list offset in the plan's
/// table, blocks, and the optional arguments.
#[derive(Debug, Clone)]
struct EncLaunch {
    kernel: KernelChoice,
    work: usize,
    blocks: u32,
    bits: Option<u32>,
    h: Option<u32>,
    c: Option<f32>,
}

/// A prepared encode of some pages of one tensor: page bodies (section
/// tables filled in) on the device, descriptors and work lists, scratch
/// and side tables where the codec needs them. Launch it as often as
/// needed; the source stays borrowed.
pub struct EncodePlan<'a> {
    gpu: Gpu,
    info: TensorInfo,
    pages: Vec<PlannedPage>,
    layout: EncodeLayout,
    bodies: GpuBuffer<u8>,
    table: GpuBuffer<u8>,
    _extra: Vec<GpuBuffer<u8>>,
    status: GpuBuffer<u64>,
    launches: Vec<EncLaunch>,
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
    /// [`Error::Unsupported`] for codecs other than `int{b}`, `bdr{h}` and
    /// `hqmq`; [`Error::Device`] for a CUDA failure.
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
        let mut extra = Vec::new();
        let mut layout = crate::gpu::encplan::plan(
            src.device_ptr(),
            info,
            codec,
            pages,
            self.options,
            &mut |b| {
                let buf = self.upload(b)?;
                let at = buf.device_ptr();
                extra.push(buf);
                Ok(at)
            },
        )?;
        let mut host = std::mem::take(&mut layout.host);
        host.resize(host.len().max(BODY_ALIGN), 0);
        let bodies = self.upload(&host)?;
        drop(host);
        let mut descs = std::mem::take(&mut layout.descs);
        for dsc in &mut descs {
            dsc.body += bodies.device_ptr();
        }
        let mut table: Vec<u8> = bytemuck::cast_slice(&descs).to_vec();
        let mut launches = Vec::new();
        let setup = std::mem::take(&mut layout.setup);
        let n_setup = setup.len();
        for w in setup.into_iter().chain(std::mem::take(&mut layout.works)) {
            table.resize(table.len().next_multiple_of(BODY_ALIGN).max(BODY_ALIGN), 0);
            launches.push(EncLaunch {
                kernel: w.kernel,
                work: table.len(),
                blocks: w.items.len() as u32,
                bits: w.bits,
                h: w.h,
                c: w.c,
            });
            table.extend_from_slice(bytemuck::cast_slice(&w.items));
        }
        let table = self.upload(&table)?;
        let status = self.upload(&[u64::MAX])?;
        // The setup launches run once, now (stream-ordered before any
        // launch of the plan).
        let (setup, launches) = launches.split_at(n_setup);
        for l in setup {
            let args = Args {
                bits: l.bits,
                h: l.h,
                c: l.c,
                status: status.device_ptr(),
            };
            let base = table.device_ptr();
            self.launch_items(&l.kernel, base, base + l.work as u64, l.blocks, &args)?;
        }
        let launches = launches.to_vec();
        Ok(EncodePlan {
            gpu: self.clone(),
            info: info.clone(),
            pages: pages.to_vec(),
            layout,
            bodies,
            table,
            _extra: extra,
            status,
            launches,
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
        let base = self.table.device_ptr();
        for l in &self.launches {
            let args = Args {
                bits: l.bits,
                h: l.h,
                c: l.c,
                status: self.status.device_ptr(),
            };
            self.gpu
                .launch_items(&l.kernel, base, base + l.work as u64, l.blocks, &args)?;
        }
        Ok(())
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
        let s = self.status.to_vec()?[0];
        if s == u64::MAX {
            return Ok(());
        }
        let (page, row) = ((s >> 32) as usize, (s & 0xffff_ffff) as u32);
        let p = &self.pages[page.min(self.pages.len() - 1)];
        Err(Error::param(format!(
            "{} ({}) plane {} token {}: non-finite value (NaN or inf), or a value the codec \
             cannot represent, in a row to quantize",
            self.info.name,
            self.info.describe(),
            row / p.tokens,
            p.token_start + row % p.tokens
        )))
    }

    /// Downloads the encoded pages and splits them into the sections the
    /// CPU encoder returns, one list per page.
    ///
    /// # Errors
    /// [`Error::Device`] for a CUDA failure.
    pub fn sections(&self) -> Result<Vec<Vec<Section>>> {
        let bytes = self.bodies.to_vec()?;
        (0..self.layout.layouts.len())
            .map(|i| self.layout.sections(i, &bytes[self.body_range(i)]))
            .collect()
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
        let (l, off) = &self.layout.layouts[i];
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
        (self.layout.read, self.layout.written)
    }
}
