//! Encode launches ([`EncodePlan`]): a contiguous tensor on the device to
//! `int{b}` / `bdr{h}` page bodies in device memory.

use std::marker::PhantomData;

use super::{Args, Gpu, GpuBuffer, GpuElem};
use crate::cache::TensorInfo;
use crate::codec::Codec;
use crate::error::{Error, Result};
use crate::format::Section;
use crate::gpu::spec::{self, AffineBody, EncDesc, Grid, KernelChoice, KernelCodec};
use crate::plan::PlannedPage;

use super::decode::BODY_ALIGN;

/// A prepared encode of some pages of one tensor: page bodies (section
/// tables filled in) on the device, descriptors and work list. Launch it as
/// often as needed; the source stays borrowed.
pub struct EncodePlan<'a> {
    gpu: Gpu,
    info: TensorInfo,
    pages: Vec<PlannedPage>,
    layouts: Vec<(AffineBody, usize)>,
    bodies: GpuBuffer<u8>,
    table: GpuBuffer<u8>,
    status: GpuBuffer<u64>,
    kernel: KernelChoice,
    args: (u32, u32, f32),
    work: (usize, u32),
    read: u64,
    written: u64,
    _borrow: PhantomData<&'a ()>,
}

impl std::fmt::Debug for EncodePlan<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EncodePlan")
            .field("kernel", &self.kernel.name)
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
    /// [`Error::Unsupported`] for codecs other than `int{b}` / `bdr{h}`;
    /// [`Error::Io`] for a CUDA failure.
    pub fn plan_encode<'a, T: GpuElem>(
        &self,
        src: &'a GpuBuffer<T>,
        info: &TensorInfo,
        codec: &dyn Codec,
        pages: &[PlannedPage],
    ) -> Result<EncodePlan<'a>> {
        let esize = info.dtype.size();
        if std::mem::size_of::<T>() != esize || (src.len() as u64) < info.elements() {
            return Err(Error::param(format!(
                "source buffer of {} elements of {} bytes does not hold {} ({} {} elements)",
                src.len(),
                std::mem::size_of::<T>(),
                info.describe(),
                info.elements(),
                info.dtype.name()
            )));
        }
        codec.check(info)?;
        let kc = KernelCodec::of(codec, info)?;
        let KernelCodec::Affine { bits, .. } = kc else {
            return Err(Error::Unsupported("GPU encode covers int and bdr".into()));
        };
        let kernel = spec::encode_kernel(kc, info.head_dim, info.dtype)?;
        let d = info.head_dim;
        let mut layouts = Vec::with_capacity(pages.len());
        let mut host = Vec::new();
        let mut descs = Vec::with_capacity(pages.len());
        let mut work = Vec::new();
        let (mut read, mut written) = (0u64, 0u64);
        for (i, p) in pages.iter().enumerate() {
            if p.tokens == 0
                || u64::from(p.token_start) + u64::from(p.tokens) > u64::from(info.tokens)
            {
                return Err(Error::param(format!(
                    "page tokens {}..{} outside {} ({} tokens)",
                    p.token_start,
                    p.token_start + p.tokens,
                    info.describe(),
                    info.tokens
                )));
            }
            let rows = u32::try_from(info.planes() as u64 * u64::from(p.tokens))
                .map_err(|_| Error::param("page over 2^32 rows"))?;
            let l = AffineBody::new(rows, d, bits)?;
            host.resize(host.len().next_multiple_of(BODY_ALIGN), 0);
            let off = host.len();
            host.extend_from_slice(&l.template());
            read += u64::from(rows) * u64::from(d) * esize as u64;
            written += u64::from(l.lens[0]) + u64::from(l.lens[1]) + u64::from(l.lens[2]);
            descs.push(EncDesc {
                src: src.device_ptr() + u64::from(p.token_start) * u64::from(d) * esize as u64,
                body: off as u64, // rebased below
                stride: u64::from(info.tokens) * u64::from(d),
                rows,
                tokens: p.tokens,
                head_dim: d,
                sec_scale: l.offsets[0],
                sec_zero: l.offsets[1],
                sec_index: l.offsets[2],
                page: i as u32,
                m_tokens: spec::magic(p.tokens),
                upr: d.checked_div(kernel.grid.unit()).unwrap_or(0),
                m_upr: spec::magic(d.checked_div(kernel.grid.unit()).unwrap_or(0)),
            });
            kernel.grid.push_items(i as u32, rows, d, &mut work);
            layouts.push((l, off));
        }
        host.resize(host.len().max(BODY_ALIGN), 0);
        let bodies = self.upload(&host)?;
        for dsc in &mut descs {
            dsc.body += bodies.device_ptr();
        }
        let mut table: Vec<u8> = bytemuck::cast_slice(&descs).to_vec();
        table.resize(table.len().next_multiple_of(BODY_ALIGN).max(BODY_ALIGN), 0);
        let w = table.len();
        table.extend_from_slice(bytemuck::cast_slice(&work));
        let table = self.upload(&table)?;
        Ok(EncodePlan {
            gpu: self.clone(),
            info: info.clone(),
            pages: pages.to_vec(),
            layouts,
            bodies,
            table,
            status: self.upload(&[u64::MAX])?,
            args: (u32::from(bits), kc.h(), kc.c()),
            kernel,
            work: (w, work.len() as u32),
            read,
            written,
            _borrow: PhantomData,
        })
    }
}

impl EncodePlan<'_> {
    /// Submits the encode (asynchronous; see [`EncodePlan::finish`]).
    ///
    /// # Errors
    /// [`Error::Io`] when NVRTC, the module load or the launch fails.
    pub fn launch(&self) -> Result<()> {
        let base = self.table.device_ptr();
        let fallback = !matches!(self.kernel.grid, Grid::Units { .. });
        let args = Args {
            bits: fallback.then_some(self.args.0),
            h: Some(self.args.1),
            c: Some(self.args.2),
            status: self.status.device_ptr(),
        };
        self.gpu.launch_items(
            &self.kernel,
            base,
            base + self.work.0 as u64,
            self.work.1,
            &args,
        )
    }

    /// Waits for the launched work and checks that every row was finite.
    ///
    /// # Errors
    /// [`Error::Parameter`] naming the first page row (plane and token)
    /// holding NaN or inf, as the CPU encoder does; [`Error::Io`] for a
    /// failed kernel.
    pub fn finish(&self) -> Result<()> {
        let s = self.status.to_vec()?[0];
        if s == u64::MAX {
            return Ok(());
        }
        let (page, row) = ((s >> 32) as usize, (s & 0xffff_ffff) as u32);
        let p = &self.pages[page.min(self.pages.len() - 1)];
        Err(Error::param(format!(
            "{} ({}) plane {} token {}: non-finite value (NaN or inf) in a row to quantize",
            self.info.name,
            self.info.describe(),
            row / p.tokens,
            p.token_start + row % p.tokens
        )))
    }

    /// Downloads the encoded pages and splits them into the sections the
    /// CPU encoder returns (SCALE, ZERO, INDEX), one list per page.
    ///
    /// # Errors
    /// [`Error::Io`] for a CUDA failure.
    pub fn sections(&self) -> Result<Vec<Vec<Section>>> {
        let bytes = self.bodies.to_vec()?;
        Ok(self
            .layouts
            .iter()
            .map(|(l, off)| l.sections(&bytes[*off..*off + l.body_len as usize]))
            .collect())
    }

    /// The device buffer holding the encoded page bodies (each a canonical
    /// body, format/SPEC.md 6.2, at [`EncodePlan::body_range`]).
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

    /// The kernel this plan launches.
    pub fn kernel(&self) -> &str {
        &self.kernel.name
    }

    /// Bytes the kernel reads (source elements) and writes (scales, zero
    /// points, codes) per launch.
    pub fn bytes(&self) -> (u64, u64) {
        (self.read, self.written)
    }
}
