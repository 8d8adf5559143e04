//! Device-independent planning of the GPU encode of the group-wise codecs
//! `kivi` and `innerq` (`kernels/group_enc.cu`) and of `polar` key pages
//! (`kernels/polar_enc.cu`); `polar` value pages are `int{b}` pages and
//! take the affine encoder of [`super::encplan`].
//!
//! What runs where: every per-page quantity (group minima and maxima,
//! scales, zero points, InnerQ's symmetric/asymmetric choice and sign
//! slots, PolarQuant's per-page radius scales, codes) is computed on the
//! GPU. Computed once on the host: the parameter blocks, InnerQ's key
//! normalization factors (whole-cache statistics made by
//! [`crate::codec::Codec::prepare`] and stored in the parameter block; the
//! encode reads them from the prepared codec and uploads them as a side
//! table, so an unprepared normalizing InnerQ codec is refused exactly as
//! the CPU encoder refuses it), and PolarQuant's direction table (uploaded
//! as a side table, with a flag telling the kernel whether it is the
//! canonical uniform table whose three-candidate search the CPU uses).

use crate::cache::TensorInfo;
use crate::codec::innerq::InnerQ;
use crate::codec::polar::Polar;
use crate::codec::{self, Codec};
use crate::error::{Error, Result};
use crate::format::{ElemType, SectionKind};
use crate::kernels::bitpack::packed_len;
use crate::kernels::polar::uniform_directions;
use crate::plan::PlannedPage;

use super::body::{CanonicalBody, SectionSpec};
use super::encplan::{EncWork, EncodeLayout, page_rows, push_body};
use super::spec::{self, EncDesc, Grid, KernelChoice, KernelCodec, src_suffix};

/// Elements of a row run staged per block by the channel-group and polar
/// kernels (`GE_TILE`, `PE_TILE`).
const TILE: u32 = 4096;
/// Largest head_dim of the token-group kernel (`GE_CPT * BLOCK`).
const MAX_TOKEN_GROUP_DIM: u32 = 4 * spec::BLOCK;
/// Largest head_dim of the polar kernels (`2 * PE_MAX_PAIRS`).
const MAX_POLAR_DIM: u32 = 1024;

/// Kernel mode codes of `group_enc.cu` (`GE_KIVI` is 3; 0..=2 are
/// InnerQ's own mode codes).
const MODE_KIVI: u32 = 3;

/// True when these kernels encode pages of `info` under `kc` (produced
/// from `codec`): `raw` pages, or a `kivi`, `innerq` or `polar` key family
/// within the kernels' shape limits (channel groups: head_dim <= 4096;
/// token groups and polar: head_dim <= 1024).
pub(crate) fn encodes(codec: &dyn Codec, kc: KernelCodec, info: &TensorInfo) -> bool {
    let d = info.head_dim;
    match kc {
        KernelCodec::Kivi { tokens, .. } if codec.id() == codec::kivi::ID => {
            d <= if tokens { MAX_TOKEN_GROUP_DIM } else { TILE }
        }
        KernelCodec::InnerQ { tokens, .. } => d <= if tokens { MAX_TOKEN_GROUP_DIM } else { TILE },
        KernelCodec::Polar { .. } => d <= MAX_POLAR_DIM,
        KernelCodec::Raw { .. } => true,
        _ => false,
    }
}

fn too_large(info: &TensorInfo, codec: &dyn Codec) -> Error {
    Error::Unsupported(format!(
        "{} ({}): head_dim {} is beyond the GPU {} encoder's limit; encode it on the CPU",
        info.name,
        info.describe(),
        info.head_dim,
        codec.name()
    ))
}

fn count(v: u64) -> Result<u32> {
    u32::try_from(v).map_err(|_| Error::param("page too large for the GPU encoder"))
}

fn section(kind: SectionKind, elem: ElemType, count: u32, len: u64) -> Result<SectionSpec> {
    Ok(SectionSpec {
        kind,
        stream: 0,
        elem,
        count,
        len: u32::try_from(len).map_err(|_| Error::param("page section over 4 GiB"))?,
    })
}

/// The descriptor fields every kernel here shares for page `i`.
fn desc(
    src: u64,
    info: &TensorInfo,
    pg: &PlannedPage,
    i: usize,
    rows: u32,
    body: usize,
) -> EncDesc {
    let d = info.head_dim;
    EncDesc {
        src: src + u64::from(pg.token_start) * u64::from(d) * info.dtype.size() as u64,
        body: body as u64,
        stride: u64::from(info.tokens) * u64::from(d),
        rows,
        tokens: pg.tokens,
        head_dim: d,
        page: i as u32,
        m_tokens: spec::magic(pg.tokens),
        heads: info.heads,
        ..bytemuck::Zeroable::zeroed()
    }
}

/// Work items `(page, first row)` of `item` rows each, never crossing a
/// plane.
fn plane_items(page: u32, rows: u32, tokens: u32, item: u32, out: &mut Vec<[u32; 2]>) {
    Grid::PlaneRows {
        tokens: item,
        unit: 1,
    }
    .push_items(page, rows, tokens, 0, out);
}

fn choice(source: &'static str, name: String, item: u32) -> KernelChoice {
    KernelChoice {
        source,
        name,
        grid: Grid::PlaneRows {
            tokens: item,
            unit: 1,
        },
        shared: 0,
    }
}

fn work(kernel: KernelChoice, items: Vec<[u32; 2]>) -> EncWork {
    EncWork {
        kernel,
        items,
        bits: None,
        h: None,
        c: None,
    }
}

/// `kivi` and `innerq` pages: one kernel writing every section.
pub(crate) fn plan_group(
    src: u64,
    info: &TensorInfo,
    codec: &dyn Codec,
    kc: KernelCodec,
    pages: &[PlannedPage],
    place: &mut dyn FnMut(&[u8]) -> Result<u64>,
) -> Result<EncodeLayout> {
    if !encodes(codec, kc, info) {
        return Err(too_large(info, codec));
    }
    let (bits, group, tokens, mode, norm) = match kc {
        KernelCodec::Kivi {
            bits,
            group,
            tokens,
        } => (bits, group, tokens, MODE_KIVI, false),
        KernelCodec::InnerQ {
            bits,
            mode,
            group,
            tokens,
            norm,
        } => (bits, group, tokens, u32::from(mode), norm),
        _ => unreachable!("group codecs"),
    };
    let side = if norm {
        let c = InnerQ::from_params(&codec.params())?;
        let e = c
            .factors_for(info)
            .map_err(|m| Error::param(format!("{} ({}): {m}", info.name, info.describe())))?
            .ok_or_else(|| Error::param("internal: normalized keys without factors"))?;
        place(bytemuck::cast_slice(&e.factors))?
    } else {
        0
    };
    let d = info.head_dim;
    let g = u32::from(group);
    // Token groups: as many per item as fill the block's threads.
    let per_item = if tokens { (spec::BLOCK / d).max(1) } else { 1 };
    let rows_per_item = if tokens { per_item * g } else { (TILE / d).max(1) };
    let kind = if tokens { "tok" } else { "ch" };
    let kernel = choice(
        "group_enc",
        format!("encode_groups_{kind}_{}", src_suffix(info.dtype)),
        rows_per_item,
    );
    let mut p = EncodeLayout::default();
    let mut items = Vec::new();
    let esize = info.dtype.size() as u64;
    for (i, pg) in pages.iter().enumerate() {
        let rows = page_rows(info, pg)?;
        let planes = u64::from(rows / pg.tokens);
        let n = if tokens {
            planes * u64::from(pg.tokens.div_ceil(g)) * u64::from(d)
        } else {
            u64::from(rows) * u64::from(d / g)
        };
        let el = u64::from(rows) * u64::from(d);
        let code_len = packed_len(el as usize, u32::from(bits)) as u64;
        let mut specs = vec![section(
            SectionKind::Scale,
            ElemType::F16,
            count(n)?,
            2 * n,
        )?];
        if mode == MODE_KIVI {
            specs.push(section(SectionKind::Zero, ElemType::F16, count(n)?, 2 * n)?);
        } else {
            let w = u64::from(g / 32);
            specs.push(section(
                SectionKind::Zero,
                ElemType::U32,
                count(n * w)?,
                4 * n * w,
            )?);
        }
        if mode == u32::from(crate::codec::innerq::Mode::Hybrid.code()) {
            specs.push(section(
                SectionKind::Aux,
                ElemType::Packed(1),
                count(n)?,
                n.div_ceil(8),
            )?);
        }
        specs.push(section(
            SectionKind::Index,
            ElemType::Packed(bits),
            count(el)?,
            code_len,
        )?);
        let l = CanonicalBody::new(specs)?;
        let off = push_body(&mut p.host, &l);
        p.read += el * esize;
        p.written += l.specs.iter().map(|s| u64::from(s.len)).sum::<u64>();
        let hybrid = l.specs.len() == 4;
        p.descs.push(EncDesc {
            sec_scale: l.offsets[0],
            sec_zero: l.offsets[1],
            sec3: if hybrid { l.offsets[2] } else { 0 },
            sec_index: *l.offsets.last().expect("sections"),
            side,
            p0: g,
            p1: u32::from(bits) | mode << 8 | u32::from(norm) << 16,
            p2: per_item,
            p3: rows_per_item,
            ..desc(src, info, pg, i, rows, off)
        });
        plane_items(i as u32, rows, pg.tokens, rows_per_item, &mut items);
        p.layouts.push((l, off));
    }
    p.works.push(work(kernel, items));
    Ok(p)
}

/// `polar` key pages: the radius-scale kernel (SCALE), then the code
/// kernel (INDEX).
pub(crate) fn plan_polar(
    src: u64,
    info: &TensorInfo,
    codec: &dyn Codec,
    kc: KernelCodec,
    pages: &[PlannedPage],
    place: &mut dyn FnMut(&[u8]) -> Result<u64>,
) -> Result<EncodeLayout> {
    if !encodes(codec, kc, info) {
        return Err(too_large(info, codec));
    }
    let KernelCodec::Polar { m, n, adjacent } = kc else {
        unreachable!("polar keys")
    };
    let c = Polar::from_params(&codec.params())?;
    let dirs = c.directions();
    // The CPU's NearestDirection takes its fast path exactly for the
    // canonical uniform table of at least 8 directions.
    let uniform = dirs.len() >= 8 && uniform_directions(u32::from(m)) == dirs;
    let table: Vec<f32> = dirs.iter().flat_map(|u| [u[0], u[1]]).collect();
    let side = place(bytemuck::cast_slice(&table))?;
    let d = info.head_dim;
    let pairs = d / 2;
    let bits = u32::from(m) + u32::from(n);
    let rows_per_item = (TILE / pairs.max(1)).max(1);
    let sfx = src_suffix(info.dtype);
    let scale_kernel = choice("polar_enc", format!("encode_polar_scale_{sfx}"), u32::MAX);
    let code_kernel = choice("polar_enc", format!("encode_polar_{sfx}"), rows_per_item);
    let mut p = EncodeLayout::default();
    let (mut w1, mut w2) = (Vec::new(), Vec::new());
    let esize = info.dtype.size() as u64;
    for (i, pg) in pages.iter().enumerate() {
        let rows = page_rows(info, pg)?;
        let planes = u64::from(rows / pg.tokens);
        let ns = planes * u64::from(pairs);
        let nc = u64::from(rows) * u64::from(pairs);
        let l = CanonicalBody::new(vec![
            section(SectionKind::Scale, ElemType::F32, count(ns)?, 4 * ns)?,
            section(
                SectionKind::Index,
                ElemType::Packed(bits as u8),
                count(nc)?,
                packed_len(nc as usize, bits) as u64,
            )?,
        ])?;
        let off = push_body(&mut p.host, &l);
        p.read += u64::from(rows) * u64::from(d) * esize;
        p.written += l.specs.iter().map(|s| u64::from(s.len)).sum::<u64>();
        p.descs.push(EncDesc {
            sec_scale: l.offsets[0],
            sec_index: l.offsets[1],
            side,
            p0: u32::from(m),
            p1: u32::from(n),
            p2: u32::from(adjacent) | u32::from(uniform) << 1,
            p3: rows_per_item,
            ..desc(src, info, pg, i, rows, off)
        });
        for pl in 0..rows / pg.tokens {
            w1.push([i as u32, pl * pg.tokens]);
        }
        plane_items(i as u32, rows, pg.tokens, rows_per_item, &mut w2);
        p.layouts.push((l, off));
    }
    p.works.push(work(scale_kernel, w1));
    p.works.push(work(code_kernel, w2));
    Ok(p)
}

/// `raw` pages (the raw codec, `polar:...:vraw` value pages): one copy
/// kernel filling the RAW section.
pub(crate) fn plan_raw(src: u64, info: &TensorInfo, pages: &[PlannedPage]) -> Result<EncodeLayout> {
    let esize = info.dtype.size() as u64;
    let kernel = KernelChoice {
        source: "raw",
        name: format!("encode_raw_u{}", 8 * esize),
        grid: Grid::Elements,
        shared: 0,
    };
    let d = info.head_dim;
    let mut p = EncodeLayout::default();
    let mut items = Vec::new();
    for (i, pg) in pages.iter().enumerate() {
        let rows = page_rows(info, pg)?;
        let el = u64::from(rows) * u64::from(d);
        let l = CanonicalBody::new(vec![section(
            SectionKind::Raw,
            ElemType::from_dtype(info.dtype),
            count(el)?,
            el * esize,
        )?])?;
        let off = push_body(&mut p.host, &l);
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

/// The InnerQ key statistics of `pages` (the key tensor's body pages): one
/// body holding `heads * head_dim` u32 (f32 bits of `max |x|` per kv head
/// and channel), filled by `innerq_key_amax_{src}`; read it back with
/// [`norm_entry`].
pub(crate) fn plan_key_amax(
    src: u64,
    info: &TensorInfo,
    pages: &[PlannedPage],
) -> Result<EncodeLayout> {
    let n = u64::from(info.heads) * u64::from(info.head_dim);
    let l = CanonicalBody::new(vec![section(
        SectionKind::Aux,
        ElemType::U32,
        count(n)?,
        4 * n,
    )?])?;
    let mut p = EncodeLayout::default();
    let off = push_body(&mut p.host, &l);
    let mut items = Vec::new();
    for (i, pg) in pages.iter().enumerate() {
        let rows = page_rows(info, pg)?;
        p.read += u64::from(rows) * u64::from(info.head_dim) * info.dtype.size() as u64;
        p.descs.push(EncDesc {
            sec_index: l.offsets[0],
            ..desc(src, info, pg, i, rows, off)
        });
        for pl in 0..rows / pg.tokens {
            items.push([i as u32, pl * pg.tokens]);
        }
    }
    p.written = 4 * n;
    p.layouts.push((l, off));
    let kernel = choice(
        "group_enc",
        format!("innerq_key_amax_{}", src_suffix(info.dtype)),
        u32::MAX,
    );
    p.works.push(work(kernel, items));
    Ok(p)
}

/// `codec` (InnerQ with key normalization) prepared with the factors of
/// key tensor `info` from its statistics `amax` (the section of
/// [`plan_key_amax`]; `None` when the tensor has no body pages): `n =
/// sqrt(max |x|)`, 1 where the maximum is 0, as
/// [`crate::codec::Codec::prepare`] computes them.
///
/// # Errors
/// [`Error::Parameter`] when `codec` is not an InnerQ codec.
pub(crate) fn norm_entry(
    codec: &dyn Codec,
    info: &TensorInfo,
    amax: Option<&[u8]>,
) -> Result<Box<dyn Codec>> {
    let mut c = InnerQ::from_params(&codec.params())?;
    let n = info.heads as usize * info.head_dim as usize;
    let factors = match amax {
        Some(b) => b
            .chunks_exact(4)
            .map(|w| f32::from_le_bytes(w.try_into().expect("4 bytes")))
            .map(|m| if m > 0.0 { m.sqrt() } else { 1.0 })
            .collect(),
        None => vec![1.0; n],
    };
    c.norms = Some(std::sync::Arc::new(vec![crate::codec::innerq::NormEntry {
        layer: info.layer,
        heads: info.heads,
        head_dim: info.head_dim,
        factors,
    }]));
    Ok(Box::new(c))
}

/// True when a layer encode with `codec` needs the key statistics of
/// [`plan_key_amax`] first (InnerQ with key normalization).
pub(crate) fn needs_key_amax(codec: &dyn Codec) -> bool {
    codec.id() == codec::innerq::ID
        && InnerQ::from_params(&codec.params()).is_ok_and(|c| c.normalize)
}

/// Every kernel name these planners can launch, with its source.
pub(crate) fn kernel_names() -> Vec<(&'static str, String)> {
    let mut v = Vec::new();
    for sfx in ["bf16", "f16", "f32"] {
        for k in ["ch", "tok"] {
            v.push(("group_enc", format!("encode_groups_{k}_{sfx}")));
        }
        v.push(("polar_enc", format!("encode_polar_scale_{sfx}")));
        v.push(("polar_enc", format!("encode_polar_{sfx}")));
        v.push(("group_enc", format!("innerq_key_amax_{sfx}")));
    }
    v.push(("raw", "encode_raw_u16".into()));
    v.push(("raw", "encode_raw_u32".into()));
    v
}
