//! GPU encode planning of the group-wise codecs `kivi` and `innerq`
//! (`kernels/group_enc.cu`, used by the kivi and innerq families; the kivi
//! family also covers the value-group V pages of `octopus` / `turbo`,
//! whose sections are `kivi`'s), and the small planning helpers the raw
//! and polar encoders share.
//!
//! What runs where: every per-page quantity (group minima and maxima,
//! scales, zero points, InnerQ's symmetric/asymmetric choice and sign
//! slots, PolarQuant's per-page radius scales, codes) is computed on the
//! GPU. Computed once on the host: the parameter blocks; InnerQ's key
//! normalization factors are whole-layer statistics (the compressor's
//! [`crate::codec::Codec::prepare`], stored in the parameter block): the
//! encode reads them from the prepared codec and uploads them as a side
//! table (an unprepared normalizing codec is refused exactly as by the CPU
//! encoder), and a paged encode first reduces them on the device
//! ([`plan_key_amax`], `gpu::paged::prepare_on_gpu`) and downloads only
//! the `heads * head_dim` maxima, whose square roots the host takes.

use crate::cache::TensorInfo;
use crate::codec::Codec;
use crate::codec::innerq::{self, InnerQ};
use crate::error::{Error, Result};
use crate::format::{ElemType, SectionKind};
use crate::plan::PlannedPage;

use super::section;
use crate::gpu::body::CanonicalBody;
use crate::gpu::encplan::{EncWork, EncodeJob, EncodeLayout, Place, empty, page_rows, push_body};
use crate::gpu::spec::{self, EncDesc, Grid, KernelChoice, KernelCodec, src_suffix};

/// Elements of a row run staged per block by the polar kernel
/// (`PE_TILE`); also the largest head_dim of the channel-group kernel.
pub(crate) const TILE: u32 = 4096;
/// Elements of a row run staged per block by the channel-group kernel
/// (`GE_TILE`).
const CH_TILE: u32 = 8192;
/// Largest head_dim of the token-group kernel (`GE_CPT * BLOCK`).
const MAX_TOKEN_GROUP_DIM: u32 = 4 * spec::BLOCK;

/// Kernel mode code of kivi in `group_enc.cu` (`GE_KIVI`; 0..=2 are
/// InnerQ's own mode codes).
const MODE_KIVI: u32 = 3;

/// True when the group kernels take tensors of `info` under `kc` (a `Kivi`
/// or `InnerQ` family): channel groups up to head_dim 4096, token groups
/// up to head_dim 1024.
pub(crate) fn fits(kc: KernelCodec, info: &TensorInfo) -> bool {
    let tokens = matches!(
        kc,
        KernelCodec::Kivi { tokens: true, .. } | KernelCodec::InnerQ { tokens: true, .. }
    );
    info.head_dim <= if tokens { MAX_TOKEN_GROUP_DIM } else { TILE }
}

/// The name of kernel mode `mode` in `group_enc.cu`'s kernel names: the
/// coding mode is a template parameter there (InnerQ's mode codes 0..=2,
/// then [`MODE_KIVI`]).
fn mode_name(mode: u32) -> &'static str {
    match mode {
        0 => "asym",
        1 => "sym",
        2 => "hybrid",
        _ => "kivi",
    }
}

/// The kernels of `group_enc.cu`.
pub(crate) fn kernel_names() -> Vec<(&'static str, String)> {
    let mut v = Vec::new();
    for sfx in ["bf16", "f16", "f32"] {
        for k in ["ch", "tok", "tok1"] {
            for mode in 0..=MODE_KIVI {
                let m = mode_name(mode);
                v.push(("group_enc", format!("encode_groups_{k}_{m}_{sfx}")));
            }
        }
        v.push(("group_enc", format!("innerq_key_amax_{sfx}")));
    }
    v
}

/// The descriptor fields every kernel here shares for page `i`.
pub(crate) fn desc(
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
pub(crate) fn plane_items(page: u32, rows: u32, tokens: u32, item: u32, out: &mut Vec<[u32; 2]>) {
    Grid::PlaneRows {
        tokens: item,
        unit: 1,
    }
    .push_items(page, rows, tokens, 0, out);
}

/// An encode kernel of `source` whose work items hold `item` rows of one
/// plane (threads: `BLOCK`).
pub(crate) fn enc_choice(source: &'static str, name: String, item: u32) -> KernelChoice {
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

/// A launch of `kernel` over `items` without uniform arguments.
pub(crate) fn work(kernel: KernelChoice, items: Vec<[u32; 2]>) -> EncWork {
    EncWork {
        kernel,
        items,
        bits: None,
        h: None,
        c: None,
    }
}

/// `kivi` and `innerq` pages: one kernel writing every section.
pub(crate) fn plan_group(job: &EncodeJob<'_>, place: &mut dyn Place) -> Result<EncodeLayout> {
    let EncodeJob {
        src,
        info,
        codec,
        kc,
        pages,
        ..
    } = *job;
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
        place.place(bytemuck::cast_slice(&e.factors))?
    } else {
        0
    };
    let d = info.head_dim;
    let g = u32::from(group);
    // Token groups: as many per item as fill the block's threads.
    let per_item = if tokens { (spec::BLOCK / d).max(1) } else { 1 };
    let rows_per_item = if tokens {
        per_item * g
    } else {
        (CH_TILE / d).max(1)
    };
    // One group per thread (`tok1`) when an item's groups fit the block.
    let kind = if !tokens {
        "ch"
    } else if per_item * d <= spec::BLOCK {
        "tok1"
    } else {
        "tok"
    };
    let kernel = enc_choice(
        "group_enc",
        format!(
            "encode_groups_{kind}_{}_{}",
            mode_name(mode),
            src_suffix(info.dtype)
        ),
        rows_per_item,
    );
    let mut p = empty();
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
        let mut specs = vec![section(SectionKind::Scale, 0, ElemType::F16, n)?];
        if mode == MODE_KIVI {
            specs.push(section(SectionKind::Zero, 0, ElemType::F16, n)?);
        } else {
            let w = u64::from(g / 32);
            specs.push(section(SectionKind::Zero, 0, ElemType::U32, n * w)?);
        }
        if mode == u32::from(innerq::Mode::Hybrid.code()) {
            specs.push(section(SectionKind::Aux, 0, ElemType::Packed(1), n)?);
        }
        specs.push(section(SectionKind::Index, 0, ElemType::Packed(bits), el)?);
        let l = CanonicalBody::new(specs)?;
        let off = push_body(&mut p.host_len, &l);
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
    let l = CanonicalBody::new(vec![section(SectionKind::Aux, 0, ElemType::U32, n)?])?;
    let mut p = empty();
    let off = push_body(&mut p.host_len, &l);
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
    let kernel = enc_choice(
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
    c.norms = Some(std::sync::Arc::new(vec![innerq::NormEntry {
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
    codec.id() == innerq::ID && InnerQ::from_params(&codec.params()).is_ok_and(|c| c.normalize)
}
