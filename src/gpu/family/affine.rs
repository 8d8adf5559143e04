//! `int{b}` / `bdr{h}`: SCALE, ZERO, INDEX sections with an optional
//! block Hadamard rotation (`kernels/affine.cu`); the one family whose
//! encoder is a single kernel.

use crate::cache::{DType, TensorInfo};
use crate::codec::{self, Codec};
use crate::error::{Error, Result};
use crate::format::{ElemType, PageView, SectionKind};

use super::{GpuFamily, OUTS, at, section};
use crate::gpu::body::{CanonicalBody, SectionSpec};
use crate::gpu::encplan::{
    EncWork, EncodeJob, EncodeLayout, Place, empty, page_desc, page_rows, push_body,
};
use crate::gpu::spec::{
    self, DEC_UNITS_W32, EncDesc, Grid, KernelChoice, KernelCodec, KernelOptions,
    MAX_SHUFFLE_BLOCK, OutType, SEG_MAX, W8,
};

/// The affine family ([`KernelCodec::Affine`]).
pub(crate) struct Family;

fn bits_of(kc: KernelCodec) -> (u8, Option<u32>) {
    let KernelCodec::Affine { bits, block } = kc else {
        unreachable!("affine family")
    };
    (bits, block)
}

impl GpuFamily for Family {
    fn codec_ids(&self) -> &'static [u16] {
        &[codec::affine::INT_ID, codec::affine::BDR_ID]
    }

    fn kernel_codec(&self, codec: &dyn Codec, t: &TensorInfo) -> Result<KernelCodec> {
        let p = codec.params();
        if codec.id() == codec::affine::INT_ID {
            return Ok(KernelCodec::Affine {
                bits: codec::affine::int_params(&p)?.bits,
                block: None,
            });
        }
        let c = codec::affine::bdr_params(&p)?;
        let block = c.block_for(t.kind).map(|b| b as u32);
        if let Some(h) = block
            && !t.head_dim.is_multiple_of(h)
        {
            return Err(Error::param(format!(
                "{}: head_dim {} is not a multiple of the bdr block {h}",
                t.describe(),
                t.head_dim
            )));
        }
        Ok(KernelCodec::Affine {
            bits: c.bits,
            block,
        })
    }

    fn page_sections(
        &self,
        kc: KernelCodec,
        page: &PageView<'_>,
        t: &TensorInfo,
    ) -> Result<([u32; 5], u32)> {
        let (bits, _) = bits_of(kc);
        let rows = t.planes() * page.header.meta.tokens as usize;
        let [s, z, i] = codec::affine::page_layout(page, bits, rows, t.head_dim as usize)?;
        Ok(([at(page, s), at(page, z), at(page, i), 0, 0], 0))
    }

    /// The page checks are the section table's (`expect_section`).
    fn host_checked(&self) -> &'static [SectionKind] {
        &[]
    }

    fn decode_kernel(
        &self,
        kc: KernelCodec,
        head_dim: u32,
        out: OutType,
        opts: KernelOptions,
    ) -> Result<KernelChoice> {
        let (bits, block) = bits_of(kc);
        let o = out.suffix();
        if head_dim > SEG_MAX {
            return Err(Error::Unsupported(format!(
                "GPU int/bdr kernels handle head_dim up to {SEG_MAX}, not {head_dim}"
            )));
        }
        let h = block.unwrap_or(0);
        let w8 = head_dim.is_multiple_of(8) && h <= MAX_SHUFFLE_BLOCK;
        let w32 = head_dim.is_multiple_of(32) && (head_dim / 32).is_power_of_two();
        if w32 && !(w8 && opts.narrow) {
            // A block spanning the whole row (bdr{head_dim}) has its own
            // kernel with every butterfly stage unconditional.
            let kind = if h == head_dim { "rowrot_" } else { "" };
            Ok(KernelChoice {
                source: "affine",
                name: format!("decode_affine_{kind}b{bits}_{o}"),
                grid: Grid::Units {
                    w: 32,
                    per_thread: DEC_UNITS_W32,
                },
                shared: 0,
            })
        } else if w8 {
            Ok(KernelChoice {
                source: "affine",
                name: format!("decode_affine_w8_b{bits}_{o}"),
                grid: W8,
                shared: 0,
            })
        } else {
            let seg = if h > 1 { h } else { head_dim };
            Ok(KernelChoice {
                source: "affine",
                name: format!("decode_affine_any_{o}"),
                grid: Grid::Segments { seg },
                shared: 0,
            })
        }
    }

    fn body_sections(
        &self,
        kc: KernelCodec,
        rows: u64,
        _tokens: u64,
        d: u64,
    ) -> Result<Vec<SectionSpec>> {
        let (bits, _) = bits_of(kc);
        Ok(vec![
            section(SectionKind::Scale, 0, ElemType::F32, rows)?,
            section(SectionKind::Zero, 0, ElemType::F32, rows)?,
            section(SectionKind::Index, 0, ElemType::Packed(bits), rows * d)?,
        ])
    }

    fn kernel_names(&self) -> Vec<(&'static str, String)> {
        let mut v = Vec::new();
        for out in OUTS {
            for bits in 1..=8 {
                for (d, h) in [
                    (128, None),
                    (128, Some(128)),
                    (128, Some(512)),
                    (6, None),
                    (40, Some(8)),
                ] {
                    let kc = KernelCodec::Affine { bits, block: h };
                    let k = self
                        .decode_kernel(kc, d, out, Default::default())
                        .expect("affine");
                    v.push((k.source, k.name));
                }
            }
        }
        for src in [DType::Bf16, DType::F16, DType::F32] {
            for bits in 1..=8 {
                for d in [128, 96, 16] {
                    let kc = KernelCodec::Affine { bits, block: None };
                    let k = spec::encode_kernel(kc, d, src, Default::default()).expect("affine");
                    v.push((k.source, k.name));
                }
            }
        }
        v
    }

    fn encodes(&self, _kc: KernelCodec) -> bool {
        true
    }

    /// One kernel writing SCALE, ZERO and INDEX.
    fn plan_encode(&self, job: &EncodeJob<'_>, _place: &mut dyn Place) -> Result<EncodeLayout> {
        let EncodeJob {
            src,
            info,
            kc,
            pages,
            opts,
            ..
        } = *job;
        let (bits, _) = bits_of(kc);
        let esize = info.dtype.size() as u64;
        let kernel = spec::encode_kernel(kc, info.head_dim, info.dtype, opts)?;
        let d = info.head_dim;
        let mut p = empty();
        let mut work = Vec::new();
        for (i, pg) in pages.iter().enumerate() {
            let rows = page_rows(info, pg)?;
            let sections = self.body_sections(kc, rows.into(), pg.tokens.into(), d.into())?;
            let cl = CanonicalBody::new(sections)?;
            let off = push_body(&mut p.host_len, &cl);
            p.read += u64::from(rows) * u64::from(d) * esize;
            p.written += cl.specs.iter().map(|s| u64::from(s.len)).sum::<u64>();
            let upr = d.checked_div(kernel.grid.unit()).unwrap_or(0);
            p.descs.push(EncDesc {
                sec_scale: cl.offsets[0],
                sec_zero: cl.offsets[1],
                sec_index: cl.offsets[2],
                ..page_desc(info, src, pg, i, rows, off, upr)
            });
            kernel
                .grid
                .push_items(i as u32, rows, pg.tokens, d, &mut work);
            p.layouts.push((cl, off));
        }
        let fallback = !matches!(kernel.grid, Grid::Units { .. });
        p.works.push(EncWork {
            kernel,
            items: work,
            bits: fallback.then_some(u32::from(bits)),
            h: Some(kc.h()),
            c: Some(kc.c()),
        });
        Ok(p)
    }
}
