//! `raw`: one RAW section at the tensor's dtype (`kernels/raw.cu`).

use crate::cache::{DType, TensorInfo};
use crate::codec::{self, Codec};
use crate::error::Result;
use crate::format::PageView;

use super::{GpuFamily, OUTS, a64, at};
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

    fn canonical_body_len(&self, kc: KernelCodec, rows: u64, _tokens: u64, d: u64) -> u64 {
        let KernelCodec::Raw { src } = kc else {
            unreachable!("raw family")
        };
        64 + a64(rows * d * src.size() as u64)
    }

    fn kernel_names(&self) -> Vec<(&'static str, String)> {
        let mut v = Vec::new();
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
