//! Planning of the GPU encode of `octopus` and `turbo` unit-coded pages
//! (`kernels/sphere_enc.cu`; OCTOPUS paper, Boss et al., arXiv:2605.21226,
//! sections 3.1-3.6; TurboQuant, Zandieh et al., arXiv:2504.19874): the
//! page bodies (SCALE 0, the INDEX streams of the unit quantizer, and on K
//! pages with `+qjl` SCALE 1 and the sign-bit INDEX), one descriptor per
//! page, one kernel launch, and the side table the kernels read: the
//! tensor's decode side table (`gpu::side`: direction products, centroids,
//! rotation and QJL sign bits) followed by the encoder's decision bounds
//! ([`crate::kernels::lloyd_max::boundaries`] of the codec's own
//! codebooks). Value-group V pages (`:vg{g}`) are `kivi` value pages
//! ([`KernelCodec::Kivi`]) and are not planned here.
//!
//! Codebooks and sign vectors come from the codec's parameter block, so the
//! codec must be prepared for the tensor's head_dim (`Codec::prepare`, done
//! by [`prepare_shapes`] for a paged encode).

use crate::cache::TensorInfo;
use crate::codec::octopus::Octopus;
use crate::codec::turbo::Turbo;
use crate::codec::{self, Codec};
use crate::error::{Error, Result};
use crate::format::{ElemType, SectionKind};
use crate::kernels::lloyd_max;
use crate::plan::PlannedPage;

use super::body::{CanonicalBody, SectionSpec};
use super::codecs::sphere_sign_offset;
use super::encplan::{EncWork, EncodeLayout, empty, page_rows, push_body};
use super::spec::{BLOCK, EncDesc, Grid, KernelChoice, KernelCodec, magic, src_suffix};

/// Largest head_dim of the fast kernels (32 lanes of 32 elements).
pub const FAST_MAX_DIM: u32 = 1024;

/// The fast kernels' shared row stride in floats (`se_row_stride`): units
/// of 32 elements 36 floats apart, rows an odd number of 16-byte words
/// apart.
fn row_stride(lpr: u32) -> u32 {
    if lpr == 1 { 36 } else { 36 * lpr + 4 }
}

/// The kernel for a tensor of head_dim `d` and source type `src`, and the
/// dynamic shared memory it needs.
fn kernel(kc: KernelCodec, d: u32, src: crate::cache::DType) -> KernelChoice {
    let KernelCodec::Sphere { octopus, a, b, qjl } = kc else {
        unreachable!("sphere family")
    };
    let s = src_suffix(src);
    if !(d.is_multiple_of(32) && (32..=FAST_MAX_DIM).contains(&d)) {
        return KernelChoice {
            source: "sphere_enc",
            name: format!("encode_sphere_any_{s}"),
            grid: Grid::Rows,
            shared: 0,
        };
    }
    let lpr = d / 32;
    let rows = BLOCK / lpr;
    let mut shared = 4 * rows * row_stride(lpr);
    let q = if qjl { "_qjl" } else { "" };
    let name = if octopus {
        // The per-block code word buffers (`wd`, `wn`).
        let t = d.div_ceil(3);
        let words = |bits: u32| (rows * t * bits).div_ceil(32) + 1;
        shared += 4 * (words(2 * u32::from(a)) + words(u32::from(b)));
        format!("encode_sphere_oct{q}_{s}")
    } else {
        format!("encode_sphere_turbo{q}_b{a}_{s}")
    };
    KernelChoice {
        source: "sphere_enc",
        name,
        grid: Grid::Units {
            w: 32,
            per_thread: 1,
        },
        shared,
    }
}

/// The side table of `info` for the encode kernels and the offset of the
/// encoder bounds in it: the decode table, then (16-aligned) the octopus
/// direction bounds and the norm bounds, or the turbo coordinate bounds
/// (`2^bits` f32 each, `+inf` padded).
///
/// # Errors
/// [`Error::Parameter`] when the codec has no codebook for the head_dim
/// (not prepared) or its parameter block does not parse.
pub fn side_table(codec: &dyn Codec, kc: KernelCodec, info: &TensorInfo) -> Result<(Vec<u8>, u64)> {
    let KernelCodec::Sphere { octopus, .. } = kc else {
        unreachable!("sphere family")
    };
    let mut out = super::side::table(codec, kc, info)?.unwrap_or_default();
    out.resize(out.len().next_multiple_of(16), 0);
    let at = out.len() as u64;
    let p = codec.params();
    let missing = || codec::sphere::no_codebook(&codec.name(), "codebook", info);
    let bounds: Vec<f32> = if octopus {
        let o = Octopus::from_params(&p)?;
        let norm = o.norm_codebook(info.head_dim).ok_or_else(missing)?;
        let mut v = o.dir_tables().bounds.clone();
        v.extend(lloyd_max::boundaries(norm));
        v
    } else {
        let t = Turbo::from_params(&p)?;
        lloyd_max::boundaries(t.coord_codebook(info.head_dim).ok_or_else(missing)?)
    };
    for b in bounds {
        out.extend_from_slice(&b.to_le_bytes());
    }
    Ok((out, at))
}

/// The encoder search of an octopus codec (0 local, 1 full, 2 scalar; 0
/// for turbo).
fn rounding(codec: &dyn Codec, octopus: bool) -> Result<u32> {
    Ok(if octopus {
        u32::from(Octopus::from_params(&codec.params())?.rounding.code())
    } else {
        0
    })
}

/// The sections of a unit-coded page of `rows` rows of `d` channels, in the
/// CPU encoder's order (`sphere::encode_unit_page`).
fn body(kc: KernelCodec, rows: u32, d: u32) -> Result<CanonicalBody> {
    let KernelCodec::Sphere { octopus, a, b, qjl } = kc else {
        unreachable!("sphere family")
    };
    let count = |n: u64| u32::try_from(n).map_err(|_| Error::param("page over 2^32 elements"));
    let packed = |stream: u8, bits: u8, n: u64| -> Result<SectionSpec> {
        Ok(SectionSpec {
            kind: SectionKind::Index,
            stream,
            elem: ElemType::Packed(bits),
            count: count(n)?,
            len: count((n * u64::from(bits)).div_ceil(8))?,
        })
    };
    let rows64 = u64::from(rows);
    let mut specs = vec![SectionSpec {
        kind: SectionKind::Scale,
        stream: 0,
        elem: ElemType::F32,
        count: rows,
        len: count(4 * rows64)?,
    }];
    let t = u64::from(d.div_ceil(3));
    let streams = if octopus {
        specs.push(packed(0, a, rows64 * 2 * t)?);
        specs.push(packed(1, b, rows64 * t)?);
        2
    } else {
        specs.push(packed(0, a, rows64 * u64::from(d))?);
        1
    };
    if qjl {
        specs.push(SectionSpec {
            kind: SectionKind::Scale,
            stream: 1,
            elem: ElemType::F16,
            count: rows,
            len: count(2 * rows64)?,
        });
        specs.push(packed(streams, 1, rows64 * u64::from(d))?);
    }
    CanonicalBody::new(specs)
}

/// Plans the encode of `pages` of tensor `info` (source at device address
/// `src`, `[planes, tokens, head_dim]`) with the unit quantizer of an
/// `octopus` / `turbo` codec (`kc` = [`KernelCodec::Sphere`]). `place`
/// stores the side table on the device.
///
/// # Errors
/// [`Error::Parameter`] for a page outside the tensor or a codec without a
/// codebook for the head_dim; the errors of `place`.
pub fn plan(
    src: u64,
    info: &TensorInfo,
    codec: &dyn Codec,
    kc: KernelCodec,
    pages: &[PlannedPage],
    place: &mut dyn FnMut(&[u8]) -> Result<u64>,
) -> Result<EncodeLayout> {
    let KernelCodec::Sphere { octopus, a, b, qjl } = kc else {
        unreachable!("sphere family")
    };
    let d = info.head_dim;
    let esize = info.dtype.size() as u64;
    let kernel = kernel(kc, d, info.dtype);
    let (table, bounds_at) = side_table(codec, kc, info)?;
    let side = place(&table)?;
    let p0 = u32::from(a)
        | u32::from(b) << 8
        | rounding(codec, octopus)? << 16
        | u32::from(octopus) << 24
        | u32::from(qjl) << 25;
    let upr = d / 32;
    let mut p = empty();
    let mut items = Vec::new();
    for (i, pg) in pages.iter().enumerate() {
        let rows = page_rows(info, pg)?;
        let l = body(kc, rows, d)?;
        let off = push_body(&mut p.host, &l);
        p.read += u64::from(rows) * u64::from(d) * esize;
        p.written += l.specs.iter().map(|s| u64::from(s.len)).sum::<u64>();
        let o = |k: usize| l.offsets.get(k).copied().unwrap_or(0);
        let (norms, scale1, bits) = match (octopus, qjl) {
            (true, true) => (o(2), o(3), o(4)),
            (true, false) => (o(2), 0, 0),
            (false, true) => (0, o(2), o(3)),
            (false, false) => (0, 0, 0),
        };
        p.descs.push(EncDesc {
            src: src + u64::from(pg.token_start) * u64::from(d) * esize,
            body: off as u64,
            stride: u64::from(info.tokens) * u64::from(d),
            rows,
            tokens: pg.tokens,
            head_dim: d,
            sec_scale: o(0),
            sec_zero: norms,
            sec_index: o(1),
            page: i as u32,
            m_tokens: magic(pg.tokens),
            upr,
            m_upr: magic(upr),
            side,
            aux: side + bounds_at,
            sec3: scale1,
            heads: info.heads,
            p0,
            p1: sphere_sign_offset(octopus, a, b),
            p2: crate::kernels::wht::inv_sqrt(d as usize).to_bits(),
            p3: bits,
        });
        kernel
            .grid
            .push_items(i as u32, rows, pg.tokens, d, &mut items);
        p.layouts.push((l, off));
    }
    p.works.push(EncWork {
        kernel,
        items,
        bits: None,
        h: None,
        c: None,
    });
    Ok(p)
}

/// Every kernel name of `sphere_enc.cu` a plan can launch (for the source
/// check test).
pub fn kernel_names() -> Vec<(&'static str, String)> {
    let mut v = Vec::new();
    for s in ["bf16", "f16", "f32"] {
        for q in ["", "_qjl"] {
            for b in 1..=6 {
                v.push(("sphere_enc", format!("encode_sphere_turbo{q}_b{b}_{s}")));
            }
            v.push(("sphere_enc", format!("encode_sphere_oct{q}_{s}")));
        }
        v.push(("sphere_enc", format!("encode_sphere_any_{s}")));
    }
    v
}

/// `codec` prepared for tensors shaped like `infos` when its parameter
/// block depends only on their shapes (`octopus` / `turbo`: a codebook per
/// unit-coded head_dim), for encoders that see no host copy of the data
/// (a paged GPU encode). `None` when the codec needs no preparation or
/// prepares from the data (it is then used as given).
///
/// # Errors
/// As [`Codec::prepare`] ([`Error::Parameter`] for an unsupported
/// head_dim).
pub fn prepare_shapes(codec: &dyn Codec, infos: &[TensorInfo]) -> Result<Option<Box<dyn Codec>>> {
    let dims = |opts: &codec::sphere::Options| -> Vec<u32> {
        infos
            .iter()
            .filter(|i| codec::sphere::unit_coded(opts, i.kind))
            .map(|i| i.head_dim)
            .collect()
    };
    Ok(match codec.id() {
        codec::octopus::ID => {
            let c = Octopus::from_params(&codec.params())?;
            Some(Box::new(c.with_head_dims(&dims(&c.options))?))
        }
        codec::turbo::ID => {
            let c = Turbo::from_params(&codec.params())?;
            Some(Box::new(c.with_head_dims(&dims(&c.options))?))
        }
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{DType, Kind};

    fn info(d: u32, tokens: u32) -> TensorInfo {
        TensorInfo {
            name: "t".into(),
            layer: 1,
            kind: Kind::Key,
            dtype: DType::Bf16,
            batch: 1,
            heads: 2,
            tokens,
            head_dim: d,
        }
    }

    #[test]
    fn bodies_are_the_cpu_section_layout() {
        let t = info(64, 40);
        for name in ["turbo:b3+qjl", "octopus:b3+qjl", "turbo:b2", "octopus:b4"] {
            let c = prepare_shapes(
                crate::codec::parse(name).unwrap().as_ref(),
                std::slice::from_ref(&t),
            )
            .unwrap()
            .unwrap();
            let kc = KernelCodec::of(c.as_ref(), &t).unwrap();
            let pages = [PlannedPage {
                tensor: 0,
                token_start: 8,
                tokens: 32,
                raw: false,
            }];
            let mut placed = 0;
            let l = plan(0x1000, &t, c.as_ref(), kc, &pages, &mut |_| {
                placed += 1;
                Ok(0x8000)
            })
            .unwrap();
            assert_eq!(placed, 1);
            let rows = 2 * 32;
            let cpu = crate::gpu::host::encode_tensor(
                &crate::cache::Tensor::new(
                    t.clone(),
                    crate::cache::TensorData::Bf16(vec![half::bf16::ONE; 2 * 40 * 64]),
                )
                .unwrap(),
                c.as_ref(),
                &pages,
            )
            .unwrap();
            let (body, _) = &l.layouts[0];
            let specs: Vec<_> = cpu[0]
                .iter()
                .map(|s| (s.kind, s.stream, s.elem, s.count, s.data.len() as u32))
                .collect();
            let mine: Vec<_> = body
                .specs
                .iter()
                .map(|s| (s.kind, s.stream, s.elem, s.count, s.len))
                .collect();
            assert_eq!(mine, specs, "{name}");
            // 64 channels: 2 lanes of 32 per row, 128 rows per block.
            assert_eq!(l.works[0].items.len(), (rows * 2usize).div_ceil(256));
            assert_eq!(l.descs[0].src, 0x1000 + 8 * 64 * 2);
        }
    }

    #[test]
    fn small_and_large_heads_take_the_row_kernel() {
        let c = crate::codec::parse("turbo:b3").unwrap();
        for (d, fast) in [
            (8, false),
            (16, false),
            (32, true),
            (1024, true),
            (2048, false),
        ] {
            let c = prepare_shapes(c.as_ref(), &[info(d, 4)]).unwrap().unwrap();
            let kc = KernelCodec::of(c.as_ref(), &info(d, 4)).unwrap();
            let k = kernel(kc, d, DType::F16);
            assert_eq!(k.grid != Grid::Rows, fast, "{d}");
            assert!(k.shared <= 64 * 1024, "{d}");
        }
    }
}
