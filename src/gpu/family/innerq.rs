//! `innerq` pages: per-group scales, slots and hybrid flags, `bits`-bit
//! codes, K optionally normalized by the layer's factors
//! (`kernels/innerq.cu`).

use crate::cache::{Kind, Role, TensorInfo};
use crate::codec::Codec;
use crate::codec::innerq::{self, InnerQ};
use crate::error::{Error, Result};
use crate::format::{ElemType, PageView, SectionKind};
use crate::gpu::body::SectionSpec;

use super::group_enc;
use super::{GROUP_UNITS, GpuFamily, OUTS, at, choice, chunked, group_count, section, units};
use crate::gpu::encplan::{EncodeJob, EncodeLayout, Place};
use crate::gpu::spec::{
    KernelChoice, KernelCodec, KernelOptions, OutType, UNITS_PER_THREAD, magic,
};

/// The InnerQ family ([`KernelCodec::InnerQ`]).
pub(crate) struct Family;

/// `(bits, mode, group, tokens, norm)` of an InnerQ kernel codec.
fn fields(kc: KernelCodec) -> (u8, u8, u16, bool, bool) {
    let KernelCodec::InnerQ {
        bits,
        mode,
        group,
        tokens,
        norm,
    } = kc
    else {
        unreachable!("innerq family")
    };
    (bits, mode, group, tokens, norm)
}

impl GpuFamily for Family {
    fn codec_ids(&self) -> &'static [u16] {
        &[innerq::ID]
    }

    fn kernel_codec(&self, codec: &dyn Codec, t: &TensorInfo) -> Result<KernelCodec> {
        let c = InnerQ::from_params(&codec.params())?;
        let key = t.kind.role() == Role::Key;
        Ok(KernelCodec::InnerQ {
            bits: c.bits_for(t.kind),
            mode: c.mode.code(),
            group: c.group,
            tokens: !key,
            norm: key && c.normalize,
        })
    }

    fn page_sections(
        &self,
        kc: KernelCodec,
        page: &PageView<'_>,
        t: &TensorInfo,
    ) -> Result<([u32; 5], u32)> {
        let (bits, mode, group, tok, _) = fields(kc);
        let kind = if tok { Kind::Value } else { Kind::Key };
        let mode = innerq::Mode::from_code(mode)
            .ok_or_else(|| page.error(format!("innerq: unknown mode {mode}")))?;
        let tokens = page.header.meta.tokens as usize;
        let d = t.head_dim as usize;
        let p = innerq::page_layout(page, mode, group, bits, kind, t.planes(), tokens, d)?;
        Ok((
            [
                at(page, p.scales),
                at(page, p.slots),
                at(page, p.index),
                p.flags.map_or(0, |f| at(page, f)),
                0,
            ],
            0,
        ))
    }

    /// The page checks read the scales, zero points / slot words and the hybrid flags.
    fn host_checked(&self) -> &'static [SectionKind] {
        &[SectionKind::Scale, SectionKind::Zero, SectionKind::Aux]
    }

    fn decode_kernel(
        &self,
        kc: KernelCodec,
        head_dim: u32,
        out: OutType,
        _opts: KernelOptions,
    ) -> Result<KernelChoice> {
        let (bits, _, _, tokens, _) = fields(kc);
        let o = out.suffix();
        Ok(if head_dim.is_multiple_of(8) {
            let ax = if tokens { "v" } else { "k" };
            chunked(
                "innerq",
                &format!("decode_innerq_{ax}"),
                &format!("_b{bits}_{o}"),
                head_dim,
                8,
                GROUP_UNITS,
            )
        } else {
            choice(
                "innerq",
                format!("decode_innerq_any_{o}"),
                units(1, UNITS_PER_THREAD),
            )
        })
    }

    fn desc_params(&self, kc: KernelCodec, _head_dim: u32, _extra: u32) -> [u32; 4] {
        let (bits, mode, group, tokens, norm) = fields(kc);
        [
            u32::from(group),
            magic(u32::from(group)),
            u32::from(mode) | u32::from(norm) << 8 | (u32::from(group) / 32) << 16,
            u32::from(bits) | u32::from(tokens) << 8,
        ]
    }

    fn body_sections(
        &self,
        kc: KernelCodec,
        rows: u64,
        tokens: u64,
        d: u64,
    ) -> Result<Vec<SectionSpec>> {
        let (bits, mode, group, tok, _) = fields(kc);
        let planes = rows.checked_div(tokens).unwrap_or(0);
        let ng = group_count(tok, u32::from(group), planes, tokens, d);
        let mut v = vec![
            section(SectionKind::Scale, 0, ElemType::F16, ng)?,
            section(
                SectionKind::Zero,
                0,
                ElemType::U32,
                ng * u64::from(group / 32),
            )?,
        ];
        if mode == innerq::Mode::Hybrid.code() {
            v.push(section(SectionKind::Aux, 0, ElemType::Packed(1), ng)?);
        }
        v.push(section(
            SectionKind::Index,
            0,
            ElemType::Packed(bits),
            rows * d,
        )?);
        Ok(v)
    }

    /// The layer's normalization factors, f32 `[heads][head_dim]` (K with
    /// normalization only).
    fn side_table(
        &self,
        codec: &dyn Codec,
        kc: KernelCodec,
        t: &TensorInfo,
    ) -> Result<Option<Vec<u8>>> {
        let (.., norm) = fields(kc);
        if !norm {
            return Ok(None);
        }
        let c = InnerQ::from_params(&codec.params())?;
        Ok(c.factors_for(t)
            .map_err(Error::param)?
            .map(|e| super::f32_bytes(&e.factors)))
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
                for ax in ["k", "v", "kq", "vq"] {
                    v.push(("innerq", format!("decode_innerq_{ax}_b{bits}_{o}")));
                }
            }
            v.push(("innerq", format!("decode_innerq_any_{o}")));
        }
        v
    }
}
