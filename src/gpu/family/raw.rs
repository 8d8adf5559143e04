//! `raw`: one RAW section at the tensor's dtype (`kernels/raw.cu`).

use crate::cache::{DType, TensorInfo};
use crate::codec::{self, Codec};
use crate::error::Result;
use crate::format::{ElemType, PageView, SectionKind};
use crate::gpu::body::SectionSpec;

use super::group_enc::{desc, work};
use super::{GpuFamily, OUTS, at, section};
use crate::gpu::body::CanonicalBody;
use crate::gpu::encplan::{EncodeJob, EncodeLayout, Place, empty, page_rows, push_body};
use crate::gpu::spec::EncDesc;
use crate::gpu::spec::{Grid, KernelChoice, KernelCodec, KernelOptions, OutType, W8, src_suffix};

/// The raw family ([`KernelCodec::Raw`]).
pub(crate) struct Family;

impl GpuFamily for Family {
    fn codec_ids(&self) -> &'static [u16] {
        &[codec::raw::ID]
    }

    fn kernel_codec(&self, _codec: &dyn Codec, t: &TensorInfo) -> Result<KernelCodec> {
        Ok(KernelCodec::Raw { src: t.dtype })
    }

    fn page_sections(
        &self,
        kc: KernelCodec,
        page: &PageView<'_>,
        t: &TensorInfo,
    ) -> Result<([u32; 5], u32)> {
        let KernelCodec::Raw { src } = kc else {
            unreachable!("raw family")
        };
        let rows = t.planes() * page.header.meta.tokens as usize;
        let s = codec::raw::page_layout(page, src, rows * t.head_dim as usize)?;
        Ok(([at(page, s), 0, 0, 0, 0], 0))
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
        _opts: KernelOptions,
    ) -> Result<KernelChoice> {
        let KernelCodec::Raw { src } = kc else {
            unreachable!("raw family")
        };
        let o = out.suffix();
        Ok(if head_dim.is_multiple_of(8) {
            KernelChoice {
                source: "raw",
                name: format!("decode_raw_{}_{o}", src_suffix(src)),
                grid: W8,
                shared: 0,
            }
        } else {
            KernelChoice {
                source: "raw",
                name: format!("decode_raw_any_{o}"),
                grid: Grid::Elements,
                shared: 0,
            }
        })
    }

    fn body_sections(
        &self,
        kc: KernelCodec,
        rows: u64,
        _tokens: u64,
        d: u64,
    ) -> Result<Vec<SectionSpec>> {
        let KernelCodec::Raw { src } = kc else {
            unreachable!("raw family")
        };
        Ok(vec![section(
            SectionKind::Raw,
            0,
            ElemType::from_dtype(src),
            rows * d,
        )?])
    }

    fn encodes(&self, _kc: KernelCodec) -> bool {
        true
    }

    fn plan_encode(&self, job: &EncodeJob<'_>, _place: &mut dyn Place) -> Result<EncodeLayout> {
        plan_raw(job)
    }

    fn kernel_names(&self) -> Vec<(&'static str, String)> {
        let mut v = vec![
            ("raw", "encode_raw_u16".to_string()),
            ("raw", "encode_raw_u32".to_string()),
        ];
        for out in OUTS {
            for src in [DType::Bf16, DType::F16, DType::F32] {
                for d in [64, 6] {
                    let k = self
                        .decode_kernel(KernelCodec::Raw { src }, d, out, Default::default())
                        .expect("raw");
                    v.push((k.source, k.name));
                }
            }
        }
        v
    }
}

/// `raw` pages (the raw codec, `polar:...:vraw` value pages): one copy
/// kernel filling the RAW section.
fn plan_raw(job: &EncodeJob<'_>) -> Result<EncodeLayout> {
    let EncodeJob {
        src, info, pages, ..
    } = *job;
    let esize = info.dtype.size() as u64;
    let kernel = KernelChoice {
        source: "raw",
        name: format!("encode_raw_u{}", 8 * esize),
        grid: Grid::Elements,
        shared: 0,
    };
    let d = info.head_dim;
    let mut p = empty();
    let mut items = Vec::new();
    for (i, pg) in pages.iter().enumerate() {
        let rows = page_rows(info, pg)?;
        let el = u64::from(rows) * u64::from(d);
        let l = CanonicalBody::new(vec![section(
            SectionKind::Raw,
            0,
            ElemType::from_dtype(info.dtype),
            el,
        )?])?;
        let off = push_body(&mut p.host_len, &l);
        p.read += el * esize;
        p.written += el * esize;
        p.descs.push(EncDesc {
            sec_index: l.offsets[0],
            ..desc(src, info, pg, i, rows, off)
        });
        Grid::Elements.push_items(i as u32, rows, pg.tokens, d, &mut items);
        p.layouts.push((l, off));
    }
    p.works.push(work(kernel, items));
    Ok(p)
}
