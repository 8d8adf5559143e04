//! `polar` key pages: per-pair radius and angle codes (`kernels/polar.cu`);
//! polar's V pages are raw or `int{b}` and decode through those families.

use crate::cache::{Role, TensorInfo};
use crate::codec::Codec;
use crate::codec::polar::{self, Pairing, Polar, Values};
use crate::error::Result;
use crate::format::{ElemType, PageView, SectionKind};
use crate::gpu::body::SectionSpec;

use super::group_enc::{self, desc, enc_choice, plane_items, work};
use super::{GpuFamily, OUTS, POLAR_UNITS, at, choice, chunked, section, units};
use crate::gpu::body::CanonicalBody;
use crate::gpu::encplan::{EncodeJob, EncodeLayout, Place, empty, page_rows, push_body};
use crate::gpu::spec::{EncDesc, src_suffix};
use crate::gpu::spec::{KernelChoice, KernelCodec, KernelOptions, OutType, UNITS_PER_THREAD};
use crate::kernels::polar::uniform_directions;

/// The polar family ([`KernelCodec::Polar`]).
pub(crate) struct Family;

fn fields(kc: KernelCodec) -> (u8, u8, bool) {
    let KernelCodec::Polar { m, n, adjacent } = kc else {
        unreachable!("polar family")
    };
    (m, n, adjacent)
}

impl GpuFamily for Family {
    fn codec_ids(&self) -> &'static [u16] {
        &[polar::ID]
    }

    fn kernel_codec(&self, codec: &dyn Codec, t: &TensorInfo) -> Result<KernelCodec> {
        let c = Polar::from_params(&codec.params())?;
        Ok(match (t.kind.role() == Role::Key, c.values) {
            (true, _) => KernelCodec::Polar {
                m: c.angle_bits,
                n: c.radius_bits,
                adjacent: c.pairing == Pairing::Adjacent,
            },
            (false, Values::Raw) => KernelCodec::Raw { src: t.dtype },
            (false, Values::Int(bits)) => KernelCodec::Affine { bits, block: None },
        })
    }

    fn page_sections(
        &self,
        kc: KernelCodec,
        page: &PageView<'_>,
        t: &TensorInfo,
    ) -> Result<([u32; 5], u32)> {
        let (m, n, _) = fields(kc);
        let tokens = page.header.meta.tokens as usize;
        let (s, i) = polar::key_sections(m + n, page, t.planes(), tokens, t.head_dim as usize)?;
        Ok(([at(page, s), at(page, i), 0, 0, 0], 0))
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
        let (m, n, adjacent) = fields(kc);
        let o = out.suffix();
        let c = u32::from(m) + u32::from(n);
        Ok(if head_dim.is_multiple_of(16) && c <= 8 {
            let pairing = if adjacent { "adj" } else { "half" };
            let cc = if matches!(c, 4 | 6 | 8) { c } else { 0 };
            if adjacent {
                // The per-unit kernel: measured faster than a quad
                // kernel for adjacent pairs (tests/benches/gpu.md).
                choice(
                    "polar",
                    format!("decode_polar_adj_c{cc}_{o}"),
                    units(16, POLAR_UNITS),
                )
            } else {
                chunked(
                    "polar",
                    &format!("decode_polar_{pairing}"),
                    &format!("_c{cc}_{o}"),
                    head_dim,
                    16,
                    POLAR_UNITS,
                )
            }
        } else {
            choice(
                "polar",
                format!("decode_polar_any_{o}"),
                units(2, UNITS_PER_THREAD),
            )
        })
    }

    fn desc_params(&self, kc: KernelCodec, _head_dim: u32, _extra: u32) -> [u32; 4] {
        let (m, n, adjacent) = fields(kc);
        [
            u32::from(m),
            u32::from(m) + u32::from(n),
            u32::from(adjacent),
            0,
        ]
    }

    fn body_sections(
        &self,
        kc: KernelCodec,
        rows: u64,
        tokens: u64,
        d: u64,
    ) -> Result<Vec<SectionSpec>> {
        let (m, n, _) = fields(kc);
        let planes = rows.checked_div(tokens).unwrap_or(0);
        Ok(vec![
            section(SectionKind::Scale, 0, ElemType::F32, planes * (d / 2))?,
            section(
                SectionKind::Index,
                0,
                ElemType::Packed(m + n),
                rows * (d / 2),
            )?,
        ])
    }

    /// The `2^m` directions `(cos, sin)` of the parameter block, f32 pairs.
    fn side_table(
        &self,
        codec: &dyn Codec,
        _kc: KernelCodec,
        _t: &TensorInfo,
    ) -> Result<Option<Vec<u8>>> {
        let mut out = Vec::new();
        for d in Polar::from_params(&codec.params())?.directions() {
            out.extend_from_slice(&super::f32_bytes(d));
        }
        Ok(Some(out))
    }

    /// Key pages up to head_dim 1024 (`2 * PE_MAX_PAIRS`).
    fn encodes(&self, _kc: KernelCodec) -> bool {
        true
    }

    fn encodes_shape(&self, _kc: KernelCodec, t: &TensorInfo) -> bool {
        t.head_dim <= MAX_ENCODE_DIM
    }

    fn plan_encode(&self, job: &EncodeJob<'_>, place: &mut dyn Place) -> Result<EncodeLayout> {
        plan_polar(job, place)
    }

    fn kernel_names(&self) -> Vec<(&'static str, String)> {
        let mut v = Vec::new();
        for sfx in ["bf16", "f16", "f32"] {
            v.push(("polar_enc", format!("encode_polar_scale_{sfx}")));
            v.push(("polar_enc", format!("encode_polar_{sfx}")));
        }
        for out in OUTS {
            let o = out.suffix();
            for pairing in ["half", "adj", "halfq"] {
                for c in [0, 4, 6, 8] {
                    v.push(("polar", format!("decode_polar_{pairing}_c{c}_{o}")));
                }
            }
            v.push(("polar", format!("decode_polar_any_{o}")));
        }
        v
    }
}

/// Largest head_dim of the polar encode kernels (`2 * PE_MAX_PAIRS`).
const MAX_ENCODE_DIM: u32 = 1024;

/// Pairs per thread of the kernels' vectorized path (`PE_V`).
const FAST_PAIRS: u32 = 8;

/// Longest page of the fused polar encode (one work item per plane of a
/// page: 1024 work items for a 32768-token layer of 8 heads at 256-token
/// pages).
const FUSED_MAX_TOKENS: u32 = 512;

/// Staging tiles (`PE_TILE` codes) per work item of `encode_polar_{src}`:
/// 256 rows at head_dim 128.
const CODE_TILES: u32 = 4;

/// `polar` key pages: the radius-scale kernel (SCALE), then the code
/// kernel (INDEX); or, on the vectorized path with pages of at most
/// [`FUSED_MAX_TOKENS`] tokens, the code kernel alone, computing both per
/// plane of a page.
fn plan_polar(job: &EncodeJob<'_>, place: &mut dyn Place) -> Result<EncodeLayout> {
    let EncodeJob {
        src,
        info,
        codec,
        kc,
        pages,
        ..
    } = *job;
    let KernelCodec::Polar { m, n, adjacent } = kc else {
        unreachable!("polar keys")
    };
    let c = Polar::from_params(&codec.params())?;
    let dirs = c.directions();
    // The CPU's NearestDirection takes its fast path exactly for the
    // canonical uniform table of at least 8 directions.
    let uniform = dirs.len() >= 8 && uniform_directions(u32::from(m)) == dirs;
    let table: Vec<f32> = dirs.iter().flat_map(|u| [u[0], u[1]]).collect();
    let side = place.place(bytemuck::cast_slice(&table))?;
    let d = info.head_dim;
    let pairs = d / 2;
    let bits = u32::from(m) + u32::from(n);
    // Rows per work item of the code kernel: CODE_TILES staging tiles (the
    // kernel packs one tile at a time; m + n = 8 codes need none), so that a
    // block's set-up is spread over many rows.
    let rows_per_item = (CODE_TILES * group_enc::TILE / pairs.max(1)).max(1);
    // Fused (one kernel, a whole plane of a page per work item, SCALE
    // computed in it): the kernels' vectorized path (pairs a multiple of
    // 8, 16-byte aligned rows: every row is, at head_dim a multiple of 16,
    // when the source is) with pages short enough to give many work items.
    let fused = uniform
        && pairs.is_multiple_of(FAST_PAIRS)
        && src.is_multiple_of(16)
        && pages.iter().all(|pg| pg.tokens <= FUSED_MAX_TOKENS);
    let rows_per_item = if fused {
        pages.iter().map(|pg| pg.tokens).max().unwrap_or(1).max(1)
    } else {
        rows_per_item
    };
    let sfx = src_suffix(info.dtype);
    let scale_kernel = enc_choice("polar_enc", format!("encode_polar_scale_{sfx}"), u32::MAX);
    let code_kernel = enc_choice("polar_enc", format!("encode_polar_{sfx}"), rows_per_item);
    let mut p = empty();
    let (mut w1, mut w2) = (Vec::new(), Vec::new());
    let esize = info.dtype.size() as u64;
    for (i, pg) in pages.iter().enumerate() {
        let rows = page_rows(info, pg)?;
        let planes = u64::from(rows / pg.tokens);
        let ns = planes * u64::from(pairs);
        let nc = u64::from(rows) * u64::from(pairs);
        let l = CanonicalBody::new(vec![
            section(SectionKind::Scale, 0, ElemType::F32, ns)?,
            section(SectionKind::Index, 0, ElemType::Packed(bits as u8), nc)?,
        ])?;
        let off = push_body(&mut p.host_len, &l);
        p.read += u64::from(rows) * u64::from(d) * esize;
        p.written += l.specs.iter().map(|s| u64::from(s.len)).sum::<u64>();
        p.descs.push(EncDesc {
            sec_scale: l.offsets[0],
            sec_index: l.offsets[1],
            side,
            p0: u32::from(m),
            p1: u32::from(n),
            p2: u32::from(adjacent) | u32::from(uniform) << 1 | u32::from(fused) << 2,
            p3: rows_per_item,
            ..desc(src, info, pg, i, rows, off)
        });
        for pl in 0..rows / pg.tokens {
            w1.push([i as u32, pl * pg.tokens]);
        }
        plane_items(i as u32, rows, pg.tokens, rows_per_item, &mut w2);
        p.layouts.push((l, off));
    }
    if !fused {
        p.works.push(work(scale_kernel, w1));
    }
    p.works.push(work(code_kernel, w2));
    Ok(p)
}
