//! `turbo` and `octopus` coded pages: norm, rotated unit-vector codes
//! (TurboQuant per coordinate, OCTOPUS per triplet), optional QJL residual
//! (decode: `kernels/sphere.cu`; encode: `kernels/sphere_enc.cu`). Their
//! value-group V pages are the kivi family.
//!
//! Encode (OCTOPUS paper, Boss et al., arXiv:2605.21226, sections 3.1-3.6;
//! TurboQuant, Zandieh et al., arXiv:2504.19874): the page bodies (SCALE 0,
//! the INDEX streams of the unit quantizer, and on K pages with `+qjl`
//! SCALE 1 and the sign-bit INDEX), one descriptor per page, one kernel
//! launch, and the side table the kernels read: the decode side table
//! followed by the encoder's decision bounds
//! ([`crate::kernels::lloyd_max::boundaries`] of the codec's own
//! codebooks). Codebooks and sign vectors come from the codec's parameter
//! block, so the codec must be prepared for the tensor's head_dim
//! (`Codec::prepare`; [`prepare_shapes`] for a paged encode).

use crate::cache::{Role, TensorInfo};
use crate::codec::Codec;
use crate::codec::octopus::{self, Octopus};
use crate::codec::sphere::{self, PURPOSE_QJL, PURPOSE_ROTATION, Values};
use crate::codec::turbo::{self, Turbo};
use crate::error::{Error, Result};
use crate::format::{ElemType, PageView, SectionKind};
use crate::kernels::lloyd_max;

use super::{GpuFamily, OUTS, at, choice, section, units};
use super::{f32_bytes, sign_bits};
use crate::gpu::body::{CanonicalBody, SectionSpec};
use crate::gpu::encplan::{
    EncWork, EncodeJob, EncodeLayout, Place, empty, page_desc, page_rows, push_body,
};
use crate::gpu::spec::{
    BLOCK, EncDesc, Grid, KernelChoice, KernelCodec, KernelOptions, OutType, src_suffix,
};

/// The sphere family ([`KernelCodec::Sphere`]).
pub(crate) struct Family;

fn fields(kc: KernelCodec) -> (bool, u8, u8, bool) {
    let KernelCodec::Sphere { octopus, a, b, qjl } = kc else {
        unreachable!("sphere family")
    };
    (octopus, a, b, qjl)
}

/// True when an octopus split's products `n(a, b) * C_rho[jn]` fit the
/// 1024-entry shared table of the `octt` kernels (`2 b_dir + b_norm <= 10`).
pub fn octopus_product_table(b_dir: u8, b_norm: u8) -> bool {
    2 * u32::from(b_dir) + u32::from(b_norm) <= 10
}

/// Byte offset of the sign vectors in a sphere side table: after the
/// direction (octopus, float4 per code pair) and norm / coordinate
/// codebooks, 16-aligned.
pub fn sphere_sign_offset(octopus: bool, a: u8, b: u8) -> u32 {
    let tables = if octopus {
        16 * (1u32 << (2 * a)) + 4 * (1u32 << b)
    } else {
        4 * (1u32 << a)
    };
    tables.next_multiple_of(16)
}

impl GpuFamily for Family {
    fn codec_ids(&self) -> &'static [u16] {
        &[octopus::ID, turbo::ID]
    }

    fn kernel_codec(&self, codec: &dyn Codec, t: &TensorInfo) -> Result<KernelCodec> {
        let (a, b, _, opts, _) = sphere::read_header(&codec.params())?;
        if let (false, Values::Groups { bits, group }) =
            (sphere::unit_coded(&opts, t.kind), opts.values)
        {
            return Ok(KernelCodec::Kivi {
                bits,
                group,
                tokens: false,
            });
        }
        let octopus = codec.id() == octopus::ID;
        Ok(KernelCodec::Sphere {
            octopus,
            a,
            b: if octopus { b } else { 0 },
            qjl: opts.qjl && t.kind.role() == Role::Key,
        })
    }

    fn page_sections(
        &self,
        kc: KernelCodec,
        page: &PageView<'_>,
        t: &TensorInfo,
    ) -> Result<([u32; 5], u32)> {
        let (octopus, a, b, qjl) = fields(kc);
        let rows = t.planes() * page.header.meta.tokens as usize;
        let d = t.head_dim as usize;
        let triplets = d.div_ceil(3);
        let streams: &[(u8, usize)] = if octopus {
            &[(a, 2 * triplets), (b, triplets)]
        } else {
            &[(a, d)]
        };
        let u = sphere::unit_sections(page, streams, qjl, rows, d)?;
        let (g, bits) = u.qjl.map_or((0, 0), |(g, b)| (at(page, g), at(page, b)));
        Ok((
            [
                at(page, u.gammas),
                at(page, u.codes[0]),
                u.codes.get(1).map_or(0, |c| at(page, c)),
                g,
                bits,
            ],
            0,
        ))
    }

    /// The page checks read the row norms (and QJL residual norms) finite and non-negative.
    fn host_checked(&self) -> &'static [SectionKind] {
        &[SectionKind::Scale]
    }

    fn decode_kernel(
        &self,
        kc: KernelCodec,
        head_dim: u32,
        out: OutType,
        _opts: KernelOptions,
    ) -> Result<KernelChoice> {
        let (octopus, a, b, qjl) = fields(kc);
        let o = out.suffix();
        if !head_dim.is_power_of_two() || head_dim > 4096 {
            return Err(Error::Unsupported(format!(
                "GPU octopus/turbo kernels handle power-of-two head_dim up to 4096, not {head_dim}"
            )));
        }
        Ok(if (32..=1024).contains(&head_dim) {
            let kind = match octopus {
                false => "turbo",
                true if octopus_product_table(a, b) => "octt",
                true => "oct",
            };
            let q = if qjl { "_qjl" } else { "" };
            choice(
                "sphere",
                format!("decode_sphere_{kind}{q}_{o}"),
                units(32, 1),
            )
        } else {
            choice("sphere", format!("decode_sphere_any_{o}"), Grid::Rows)
        })
    }

    fn desc_params(&self, kc: KernelCodec, head_dim: u32, _extra: u32) -> [u32; 4] {
        let (octopus, a, b, qjl) = fields(kc);
        [
            u32::from(a),
            u32::from(b) | u32::from(octopus) << 8 | u32::from(qjl) << 9,
            sphere_sign_offset(octopus, a, b),
            crate::kernels::wht::inv_sqrt(head_dim as usize).to_bits(),
        ]
    }

    fn body_sections(
        &self,
        kc: KernelCodec,
        rows: u64,
        _tokens: u64,
        d: u64,
    ) -> Result<Vec<SectionSpec>> {
        let (octopus, a, b, qjl) = fields(kc);
        let t = d.div_ceil(3);
        let streams: &[(u8, u64)] = if octopus {
            &[(a, 2 * t), (b, t)]
        } else {
            &[(a, d)]
        };
        let mut v = vec![section(SectionKind::Scale, 0, ElemType::F32, rows)?];
        for (k, &(bits, n)) in streams.iter().enumerate() {
            v.push(section(
                SectionKind::Index,
                k as u8,
                ElemType::Packed(bits),
                rows * n,
            )?);
        }
        if qjl {
            v.push(section(SectionKind::Scale, 1, ElemType::F16, rows)?);
            let k = streams.len() as u8;
            v.push(section(
                SectionKind::Index,
                k,
                ElemType::Packed(1),
                rows * d,
            )?);
        }
        Ok(v)
    }

    /// Octopus: float4 directions, the norm centroids, then per kv head the
    /// rotation (and QJL) sign bits, then the product table when it fits;
    /// turbo: the coordinate centroids, then the signs ([`super::super::side`]).
    fn side_table(
        &self,
        codec: &dyn Codec,
        kc: KernelCodec,
        t: &TensorInfo,
    ) -> Result<Option<Vec<u8>>> {
        let (octopus, a, b, qjl) = fields(kc);
        let p = codec.params();
        let missing = || sphere::no_codebook(&codec.name(), "codebook", t);
        let (oct, tur);
        let (opts, dirs_table, book) = if octopus {
            oct = Octopus::from_params(&p)?;
            let book = oct.norm_codebook(t.head_dim).ok_or_else(missing)?;
            (oct.options, Some(oct.dir_tables()), book)
        } else {
            tur = Turbo::from_params(&p)?;
            let book = tur.coord_codebook(t.head_dim).ok_or_else(missing)?;
            (tur.options, None, book)
        };
        let mut out = Vec::new();
        if let Some(tables) = dirs_table {
            for x in 0..1usize << a {
                for y in 0..1usize << a {
                    let n = tables.dir(x, y);
                    out.extend_from_slice(&f32_bytes(&[n[0], n[1], n[2], 0.0]));
                }
            }
        }
        out.extend_from_slice(&f32_bytes(book));
        out.resize(sphere_sign_offset(octopus, a, b) as usize, 0);
        let d = t.head_dim as usize;
        for head in 0..t.heads {
            let s = sphere::signs_for(opts.seed, t.layer, head, t.kind, PURPOSE_ROTATION, d);
            out.extend_from_slice(&sign_bits(&s));
            if qjl {
                let s2 = sphere::signs_for(opts.seed, t.layer, head, t.kind, PURPOSE_QJL, d);
                out.extend_from_slice(&sign_bits(&s2));
            }
        }
        if let Some(dirs) = dirs_table.filter(|_| octopus_product_table(a, b)) {
            // Products n(x, y)_k * C_rho[jn] (the decoder's f32 products), at
            // ((x | y << b_dir) << b_norm) | jn.
            out.resize(out.len().next_multiple_of(16), 0);
            for pair in 0..1usize << (2 * a) {
                let (x, y) = (pair & ((1 << a) - 1), pair >> a);
                let n = dirs.dir(x, y);
                for &rho in book {
                    out.extend_from_slice(&f32_bytes(&[n[0] * rho, n[1] * rho, n[2] * rho, 0.0]));
                }
            }
        }
        Ok(Some(out))
    }

    fn kernel_names(&self) -> Vec<(&'static str, String)> {
        let mut v = Vec::new();
        for out in OUTS {
            let o = out.suffix();
            for kind in ["turbo", "oct", "octt"] {
                for q in ["", "_qjl"] {
                    v.push(("sphere", format!("decode_sphere_{kind}{q}_{o}")));
                }
            }
            v.push(("sphere", format!("decode_sphere_any_{o}")));
        }
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

    fn encodes(&self, _kc: KernelCodec) -> bool {
        true
    }

    /// One kernel (`kernels/sphere_enc.cu`) writing every section.
    fn plan_encode(&self, job: &EncodeJob<'_>, place: &mut dyn Place) -> Result<EncodeLayout> {
        let EncodeJob {
            src,
            info,
            codec,
            kc,
            pages,
            ..
        } = *job;
        let (octopus, a, b, qjl) = fields(kc);
        let d = info.head_dim;
        let esize = info.dtype.size() as u64;
        let kernel = encode_kernel(kc, d, info.dtype);
        let (table, bounds_at) = encode_table(codec, kc, info)?;
        let side = place.place(&table)?;
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
            let l = encode_body(kc, rows, d)?;
            let off = push_body(&mut p.host_len, &l);
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
                sec_scale: o(0),
                sec_zero: norms,
                sec_index: o(1),
                side,
                aux: side + bounds_at,
                sec3: scale1,
                p0,
                p1: sphere_sign_offset(octopus, a, b),
                p2: crate::kernels::wht::inv_sqrt(d as usize).to_bits(),
                p3: bits,
                ..page_desc(info, src, pg, i, rows, off, upr)
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
}

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
fn encode_kernel(kc: KernelCodec, d: u32, src: crate::cache::DType) -> KernelChoice {
    let (octopus, a, b, qjl) = fields(kc);
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
fn encode_table(codec: &dyn Codec, kc: KernelCodec, info: &TensorInfo) -> Result<(Vec<u8>, u64)> {
    let (octopus, ..) = fields(kc);
    let mut out = Family.side_table(codec, kc, info)?.unwrap_or_default();
    out.resize(out.len().next_multiple_of(16), 0);
    let at = out.len() as u64;
    let p = codec.params();
    let missing = || sphere::no_codebook(&codec.name(), "codebook", info);
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
fn encode_body(kc: KernelCodec, rows: u32, d: u32) -> Result<CanonicalBody> {
    let (octopus, a, b, qjl) = fields(kc);
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

/// `codec` prepared for tensors shaped like `infos` when its parameter
/// block depends only on their shapes (`octopus` / `turbo`: a codebook per
/// unit-coded head_dim), for encoders that see no host copy of the data
/// (a paged GPU encode). `None` when the codec needs no preparation or
/// prepares from the data (it is then used as given).
///
/// # Errors
/// As [`Codec::prepare`] ([`Error::Parameter`] for an unsupported
/// head_dim).
pub(crate) fn prepare_shapes(
    codec: &dyn Codec,
    infos: &[TensorInfo],
) -> Result<Option<Box<dyn Codec>>> {
    let dims = |opts: &sphere::Options| -> Vec<u32> {
        infos
            .iter()
            .filter(|i| sphere::unit_coded(opts, i.kind))
            .map(|i| i.head_dim)
            .collect()
    };
    Ok(match codec.id() {
        octopus::ID => {
            let c = Octopus::from_params(&codec.params())?;
            Some(Box::new(c.with_head_dims(&dims(&c.options))?))
        }
        turbo::ID => {
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
    use crate::plan::PlannedPage;

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
            let mut placed = crate::gpu::encplan::Counting::default();
            let job = EncodeJob {
                src: 0x1000,
                info: &t,
                codec: c.as_ref(),
                kc,
                pages: &pages,
                opts: KernelOptions::default(),
            };
            let l = Family.plan_encode(&job, &mut placed).unwrap();
            assert_eq!(placed.sizes.len(), 1);
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
            let k = encode_kernel(kc, d, DType::F16);
            assert_eq!(k.grid != Grid::Rows, fast, "{d}");
            assert!(k.shared <= 64 * 1024, "{d}");
        }
    }
}
