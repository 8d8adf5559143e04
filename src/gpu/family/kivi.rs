//! `kivi` pages and the value-group V pages of `octopus` / `turbo`: f16
//! scale and zero point per group, `bits`-bit codes (`kernels/kivi.cu`).

use crate::cache::{Kind, TensorInfo};
use crate::codec::Codec;
use crate::codec::kivi::{self, Kivi};
use crate::error::Result;
use crate::format::{ElemType, PageView, SectionKind};
use crate::gpu::body::SectionSpec;

use super::group_enc;
use super::{GROUP_UNITS, GpuFamily, OUTS, at, choice, chunked, group_count, section, units};
use crate::gpu::encplan::{EncodeJob, EncodeLayout, Place};
use crate::gpu::spec::{
    KernelChoice, KernelCodec, KernelOptions, OutType, UNITS_PER_THREAD, magic,
};

/// The kivi family ([`KernelCodec::Kivi`]).
pub(crate) struct Family;

fn fields(kc: KernelCodec) -> (u8, u16, bool) {
    let KernelCodec::Kivi {
        bits,
        group,
        tokens,
    } = kc
    else {
        unreachable!("kivi family")
    };
    (bits, group, tokens)
}

impl GpuFamily for Family {
    fn codec_ids(&self) -> &'static [u16] {
        &[kivi::ID]
    }

    fn kernel_codec(&self, codec: &dyn Codec, t: &TensorInfo) -> Result<KernelCodec> {
        let c = Kivi::from_params(&codec.params())?;
        Ok(KernelCodec::Kivi {
            bits: c.bits,
            group: c.group,
            tokens: t.kind.role() == crate::cache::Role::Key,
        })
    }

    fn page_sections(
        &self,
        kc: KernelCodec,
        page: &PageView<'_>,
        t: &TensorInfo,
    ) -> Result<([u32; 5], u32)> {
        let (bits, group, tok) = fields(kc);
        let kind = if tok { Kind::Key } else { Kind::Value };
        let tokens = page.header.meta.tokens as usize;
        let p = Kivi { bits, group }.page(page, kind, t.planes(), tokens, t.head_dim as usize)?;
        Ok((
            [
                at(page, p.scales),
                at(page, p.zeros),
                at(page, p.index),
                0,
                0,
            ],
            0,
        ))
    }

    /// The page checks read the scales and zero points finite.
    fn host_checked(&self) -> &'static [SectionKind] {
        &[SectionKind::Scale, SectionKind::Zero]
    }

    fn decode_kernel(
        &self,
        kc: KernelCodec,
        head_dim: u32,
        out: OutType,
        _opts: KernelOptions,
    ) -> Result<KernelChoice> {
        let (bits, group, tokens) = fields(kc);
        let o = out.suffix();
        Ok(
            if head_dim.is_multiple_of(8) && (tokens || group.is_multiple_of(8)) {
                let ax = if tokens { "tok" } else { "ch" };
                chunked(
                    "kivi",
                    &format!("decode_kivi_{ax}"),
                    &format!("_b{bits}_{o}"),
                    head_dim,
                    8,
                    GROUP_UNITS,
                )
            } else {
                choice(
                    "kivi",
                    format!("decode_kivi_any_{o}"),
                    units(1, UNITS_PER_THREAD),
                )
            },
        )
    }

    fn desc_params(&self, kc: KernelCodec, _head_dim: u32, _extra: u32) -> [u32; 4] {
        let (bits, group, tokens) = fields(kc);
        [
            u32::from(group),
            magic(u32::from(group)),
            u32::from(bits),
            u32::from(!tokens),
        ]
    }

    fn body_sections(
        &self,
        kc: KernelCodec,
        rows: u64,
        tokens: u64,
        d: u64,
    ) -> Result<Vec<SectionSpec>> {
        let (bits, group, tok) = fields(kc);
        let planes = rows.checked_div(tokens).unwrap_or(0);
        let ng = group_count(tok, u32::from(group), planes, tokens, d);
        Ok(vec![
            section(SectionKind::Scale, 0, ElemType::F16, ng)?,
            section(SectionKind::Zero, 0, ElemType::F16, ng)?,
            section(SectionKind::Index, 0, ElemType::Packed(bits), rows * d)?,
        ])
    }

    fn encodes(&self, _kc: KernelCodec) -> bool {
        true
    }

    fn encodes_shape(&self, kc: KernelCodec, t: &TensorInfo) -> bool {
        group_enc::fits(kc, t)
    }

    /// One kernel writing every section (`kernels/group_enc.cu`).
    fn plan_encode(&self, job: &EncodeJob<'_>, place: &mut dyn Place) -> Result<EncodeLayout> {
        group_enc::plan_group(job, place)
    }

    fn kernel_names(&self) -> Vec<(&'static str, String)> {
        let mut v = group_enc::kernel_names();
        for out in OUTS {
            let o = out.suffix();
            for bits in 1..=8 {
                for ax in ["tok", "ch", "tokq", "chq"] {
                    v.push(("kivi", format!("decode_kivi_{ax}_b{bits}_{o}")));
                }
            }
            v.push(("kivi", format!("decode_kivi_any_{o}")));
        }
        v
    }
}
