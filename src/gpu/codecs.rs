//! What the GPU kernels need to know about the VQ and group codecs
//! (`hqmq`, `octopus`, `turbo`, `polar`, `innerq`, `kivi`): the kernel
//! family of a (codec, tensor) pair read from the codec's id and parameter
//! block, the checked section offsets of a page, the kernel that decodes it
//! and the codec parameters its descriptor carries.
//!
//! Everything is derived from the normative parameter blocks and page
//! layouts (format/codecs/*.md), so the same bytes the CPU decoder reads
//! drive the kernels. Page content the kernels do not check themselves
//! (finite scales and zero points, InnerQ slots, the outlier table) is
//! checked here, as the CPU decoders do.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::cache::{Role, TensorInfo};
use crate::codec::outliers::OutlierTable;
use crate::codec::sphere::{self, Values};
use crate::codec::{self, Codec, expect_section};
use crate::error::{Error, Result};
use crate::format::{ElemType, PageView, SectionKind};
use crate::kernels::bitpack;
use crate::kernels::radix::Groups;

use super::spec::{
    BLOCK, Grid, HQ_ITEM, KernelChoice, KernelCodec, OutType, UNITS_PER_THREAD, magic,
};

/// Units (8 channels) per thread of the fast kivi / innerq kernels
/// (`KIVI_U`, `INNERQ_U`).
pub const GROUP_UNITS: u32 = 4;
/// Units (8 pairs) per thread of the fast polar kernels (`POLAR_U`).
pub const POLAR_UNITS: u32 = 4;
/// Units (8 elements, or 8 polar pairs) per thread of the quad kernels:
/// `QUADS` quads of 4 rows (`kernels/common.cuh`).
pub const QUAD_UNITS: u32 = 4;

/// Whether the quad kernels handle rows of `upr` chunks (a power of two
/// <= 256, so a block's rows start at a multiple of 4).
fn quad_chunks(upr: u32) -> bool {
    upr.is_power_of_two() && upr <= 256
}
/// Chunks per hqmq decode sub-block (`HQ_NPOS`): head_dim / 4 may not
/// exceed it.
pub const HQ_NPOS: u32 = 2048;
/// Largest joint codebook (bytes) the hqmq decode kernels keep in shared
/// memory (`24 S` float4; S <= 256). Larger ones are read through L1.
pub const HQ_SMEM_MAX: u32 = 24 * 256 * 16;

static HQ_GLOBAL: AtomicBool = AtomicBool::new(false);

/// Makes hqmq decode plans built from now on read the joint codebook
/// through L1 instead of copying it to shared memory once per work item
/// (`HQ_ITEM` rows): a benchmark knob that isolates the cost of the copy.
/// Results are identical. Default off.
pub fn prefer_global_hqmq_codebook(on: bool) {
    HQ_GLOBAL.store(on, Ordering::Relaxed);
}

fn bad_params(codec: &dyn Codec) -> Error {
    Error::param(format!(
        "{}: parameter block of {} bytes does not match the codec spec",
        codec.name(),
        codec.params().len()
    ))
}

/// The kernel family of pages of `t` encoded by `codec`, for the codecs of
/// this module.
///
/// # Errors
/// [`Error::Unsupported`] for a codec without GPU kernels;
/// [`Error::Parameter`] for a parameter block that does not parse.
pub fn of(codec: &dyn Codec, t: &TensorInfo) -> Result<KernelCodec> {
    let p = codec.params();
    let key = t.kind.role() == Role::Key;
    match codec.id() {
        codec::hqmq::ID => {
            if p.len() != 24 {
                return Err(bad_params(codec));
            }
            let s = u32::from_le_bytes(p[0..4].try_into().expect("4 bytes"));
            let (b, g, med) = (p[4], p[5], p[6] & 1 == 1);
            let m = (24 * u64::from(s)) << b;
            let e = m.trailing_zeros();
            let o = m >> e;
            let groups = Groups::new(o, u32::from(g)).ok_or_else(|| bad_params(codec))?;
            Ok(KernelCodec::Hqmq {
                s,
                b,
                e: e as u8,
                g,
                w: groups.bits as u8,
                o: u32::try_from(o).map_err(|_| bad_params(codec))?,
                med,
            })
        }
        codec::octopus::ID | codec::turbo::ID => {
            let (a, b, _, opts, _) = sphere::read_header(&p)?;
            if let (false, Values::Groups { bits, group }) =
                (sphere::unit_coded(&opts, t.kind), opts.values)
            {
                return Ok(KernelCodec::Kivi {
                    bits,
                    group,
                    tokens: false,
                    exact: true,
                });
            }
            let octopus = codec.id() == codec::octopus::ID;
            Ok(KernelCodec::Sphere {
                octopus,
                a,
                b: if octopus { b } else { 0 },
                qjl: opts.qjl && key,
            })
        }
        codec::polar::ID => {
            if p.len() < 8 {
                return Err(bad_params(codec));
            }
            Ok(match (key, p[3]) {
                (true, _) => KernelCodec::Polar {
                    m: p[0],
                    n: p[1],
                    adjacent: p[2] == 1,
                },
                (false, 0) => KernelCodec::Raw { src: t.dtype },
                (false, bits) => KernelCodec::Affine { bits, block: None },
            })
        }
        codec::innerq::ID => {
            if p.len() < 12 {
                return Err(bad_params(codec));
            }
            Ok(KernelCodec::InnerQ {
                bits: if key { p[0] } else { p[1] },
                mode: p[2],
                group: u16::from_le_bytes([p[4], p[5]]),
                tokens: !key,
                norm: key && p[3] & 1 == 1,
            })
        }
        codec::kivi::ID => match p[..] {
            [bits, 0, g0, g1] => Ok(KernelCodec::Kivi {
                bits,
                group: u16::from_le_bytes([g0, g1]),
                tokens: key,
                exact: false,
            }),
            _ => Err(bad_params(codec)),
        },
        _ => Err(Error::Unsupported(format!(
            "no GPU kernels for codec {} (id {}) yet; decode it on the CPU",
            codec.name(),
            codec.id()
        ))),
    }
}

/// Groups of a kivi / innerq page: `ceil(T / G) * D` per plane along
/// tokens, `D / G` per row along channels.
fn group_count(tokens_axis: bool, group: u32, planes: u64, tokens: u64, d: u64) -> u64 {
    if tokens_axis {
        planes * tokens.div_ceil(u64::from(group)) * d
    } else {
        planes * tokens * (d / u64::from(group))
    }
}

/// Offset of section `(kind, stream)` (present: checked before).
fn offset(page: &PageView<'_>, kind: SectionKind, stream: u8) -> u32 {
    page.sections()
        .iter()
        .find(|s| s.kind == kind && s.stream == stream)
        .map(|s| s.offset)
        .expect("section checked by expect_section")
}

fn f16_finite(b: &[u8]) -> Option<usize> {
    b.chunks_exact(2)
        .position(|c| u16::from_le_bytes([c[0], c[1]]) & 0x7c00 == 0x7c00)
}

/// Checked section offsets `[s0..s4]` of a page of a codec of this module
/// and its page-specific parameter (hqmq: inlier chunks; else 0). The
/// meaning of each offset is the kernel's (see each `.cu` file).
///
/// # Errors
/// [`Error::Format`] naming the page when a section is missing, has the
/// wrong type or count, or content the CPU decoder rejects (listed in the
/// module docs).
pub fn sections(kc: KernelCodec, page: &PageView<'_>, t: &TensorInfo) -> Result<([u32; 5], u32)> {
    let planes = t.planes() as u64;
    let tokens = u64::from(page.header.meta.tokens);
    let rows = planes * tokens;
    let d = u64::from(t.head_dim);
    let n = |v: u64| v as usize;
    match kc {
        KernelCodec::Kivi {
            bits,
            group,
            tokens: tok,
            exact,
        } => {
            let g = u32::from(group);
            if !tok && !t.head_dim.is_multiple_of(g) {
                return Err(page.error(format!(
                    "value page with head_dim {d}, not a multiple of the group size {group}"
                )));
            }
            let ng = group_count(tok, g, planes, tokens, d);
            let s = expect_section(page, SectionKind::Scale, 0, ElemType::F16, n(ng))?;
            let z = expect_section(page, SectionKind::Zero, 0, ElemType::F16, n(ng))?;
            expect_section(
                page,
                SectionKind::Index,
                0,
                ElemType::Packed(bits),
                n(rows * d),
            )?;
            if let Some(i) = f16_finite(s).or(f16_finite(z)) {
                return Err(page.error(format!("group {i}: scale or zero point not finite")));
            }
            if exact && page.sections().len() != 3 {
                return Err(page.error(format!(
                    "{} sections, the codec defines 3 for this page",
                    page.sections().len()
                )));
            }
            Ok((
                [
                    offset(page, SectionKind::Scale, 0),
                    offset(page, SectionKind::Zero, 0),
                    offset(page, SectionKind::Index, 0),
                    0,
                    0,
                ],
                0,
            ))
        }
        KernelCodec::InnerQ {
            bits,
            mode,
            group,
            tokens: tok,
            ..
        } => innerq_sections(page, bits, mode, u32::from(group), tok, planes, tokens, d),
        KernelCodec::Polar { m, n: nb, .. } => {
            if !d.is_multiple_of(2) {
                return Err(page.error(format!(
                    "polar key page of a tensor with the odd head_dim {d}"
                )));
            }
            expect_section(
                page,
                SectionKind::Scale,
                0,
                ElemType::F32,
                n(planes * d / 2),
            )?;
            expect_section(
                page,
                SectionKind::Index,
                0,
                ElemType::Packed(m + nb),
                n(rows * d / 2),
            )?;
            Ok((
                [
                    offset(page, SectionKind::Scale, 0),
                    offset(page, SectionKind::Index, 0),
                    0,
                    0,
                    0,
                ],
                0,
            ))
        }
        KernelCodec::Sphere { octopus, a, b, qjl } => {
            let gam = expect_section(page, SectionKind::Scale, 0, ElemType::F32, n(rows))?;
            if let Some(r) = (0..n(rows)).find(|&r| {
                let g = codec::f32_at(gam, r);
                !(g.is_finite() && g >= 0.0)
            }) {
                return Err(page.error(format!(
                    "row {r}: norm {} is not finite and non-negative",
                    codec::f32_at(gam, r)
                )));
            }
            let triplets = d.div_ceil(3);
            let mut s = [offset(page, SectionKind::Scale, 0), 0, 0, 0, 0];
            let streams = if octopus {
                expect_section(
                    page,
                    SectionKind::Index,
                    0,
                    ElemType::Packed(a),
                    n(2 * rows * triplets),
                )?;
                expect_section(
                    page,
                    SectionKind::Index,
                    1,
                    ElemType::Packed(b),
                    n(rows * triplets),
                )?;
                s[2] = offset(page, SectionKind::Index, 1);
                2
            } else {
                expect_section(
                    page,
                    SectionKind::Index,
                    0,
                    ElemType::Packed(a),
                    n(rows * d),
                )?;
                1
            };
            s[1] = offset(page, SectionKind::Index, 0);
            if qjl {
                let g = expect_section(page, SectionKind::Scale, 1, ElemType::F16, n(rows))?;
                if let Some(r) = f16_finite(g) {
                    return Err(page.error(format!("row {r}: QJL residual norm is not finite")));
                }
                expect_section(
                    page,
                    SectionKind::Index,
                    streams,
                    ElemType::Packed(1),
                    n(rows * d),
                )?;
                s[3] = offset(page, SectionKind::Scale, 1);
                s[4] = offset(page, SectionKind::Index, streams);
            }
            let want = 1 + usize::from(streams) + if qjl { 2 } else { 0 };
            if page.sections().len() != want {
                return Err(page.error(format!(
                    "{} sections, the codec defines {want} for this page",
                    page.sections().len()
                )));
            }
            Ok((s, 0))
        }
        KernelCodec::Hqmq {
            b, e, g, w, o, med, ..
        } => hqmq_sections(page, t, rows, b, e, g, w, o, med),
        KernelCodec::Raw { .. } | KernelCodec::Affine { .. } => {
            unreachable!("raw and affine sections are checked in spec")
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn innerq_sections(
    page: &PageView<'_>,
    bits: u8,
    mode: u8,
    group: u32,
    tok: bool,
    planes: u64,
    tokens: u64,
    d: u64,
) -> Result<([u32; 5], u32)> {
    let rows = planes * tokens;
    if !tok && !d.is_multiple_of(u64::from(group)) {
        return Err(page.error(format!(
            "key page with head_dim {d}, not a multiple of the group size {group}"
        )));
    }
    let w = (group / 32) as usize;
    let ng = group_count(tok, group, planes, tokens, d) as usize;
    let scales = expect_section(page, SectionKind::Scale, 0, ElemType::F16, ng)?;
    let slots = expect_section(page, SectionKind::Zero, 0, ElemType::U32, ng * w)?;
    let flags = if mode == 2 {
        Some(expect_section(
            page,
            SectionKind::Aux,
            0,
            ElemType::Packed(1),
            ng,
        )?)
    } else {
        None
    };
    expect_section(
        page,
        SectionKind::Index,
        0,
        ElemType::Packed(bits),
        (rows * d) as usize,
    )?;
    if let Some(gi) = f16_finite(scales) {
        return Err(page.error(format!("group {gi}: scale is not finite")));
    }
    let slot = |i: usize| codec::pagebuf::u32_at(slots, i);
    let per_plane = tokens.div_ceil(u64::from(group)) as usize * d as usize;
    for gi in 0..ng {
        let sym = match (mode, flags) {
            (1, _) => true,
            (2, Some(m)) => m[gi / 8] >> (gi % 8) & 1 == 1,
            _ => false,
        };
        if sym {
            let len = if tok {
                let j = (gi % per_plane) / d as usize;
                (tokens as usize - j * group as usize).min(group as usize)
            } else {
                group as usize
            };
            for k in 0..w {
                let used = len.saturating_sub(32 * k).min(32);
                let unused = if used == 32 { 0 } else { u32::MAX << used };
                if slot(gi * w + k) & unused != 0 {
                    return Err(
                        page.error(format!("group {gi}: sign bits set past its {len} elements"))
                    );
                }
            }
        } else {
            let z = f32::from_bits(slot(gi * w));
            if !z.is_finite() || (1..w).any(|k| slot(gi * w + k) != 0) {
                return Err(page.error(format!(
                    "group {gi}: zero point {z} not finite or reserved slot words set"
                )));
            }
        }
    }
    Ok((
        [
            offset(page, SectionKind::Scale, 0),
            offset(page, SectionKind::Zero, 0),
            offset(page, SectionKind::Index, 0),
            if mode == 2 {
                offset(page, SectionKind::Aux, 0)
            } else {
                0
            },
            0,
        ],
        0,
    ))
}

#[allow(clippy::too_many_arguments)]
fn hqmq_sections(
    page: &PageView<'_>,
    t: &TensorInfo,
    rows: u64,
    b: u8,
    e: u8,
    g: u8,
    w: u8,
    o: u32,
    med: bool,
) -> Result<([u32; 5], u32)> {
    let _ = b;
    if !t.head_dim.is_multiple_of(4) {
        return Err(page.error(format!(
            "hqmq needs head_dim divisible by 4, not {}",
            t.head_dim
        )));
    }
    let n = rows * u64::from(t.head_dim / 4);
    let universe = u32::try_from(n).map_err(|_| page.error("page over 2^32 chunks"))?;
    let scales = expect_section(page, SectionKind::Scale, 0, ElemType::F16, rows as usize)?;
    if let Some(r) = scales
        .chunks_exact(2)
        .position(|c| u16::from_le_bytes([c[0], c[1]]) & 0xfc00 >= 0x7c00)
    {
        return Err(page.error(format!(
            "SCALE of row {r}: radius scales must be finite and non-negative"
        )));
    }
    let has_table = page
        .sections()
        .iter()
        .any(|s| s.kind == SectionKind::Outliers);
    let n_out = match (med, has_table) {
        (true, true) => {
            let table = OutlierTable::from_page(page, 4, universe)?;
            if table.values.iter().any(|v| !v.is_finite()) {
                return Err(page.error("outlier table holds a non-finite value"));
            }
            table.positions.len() as u64
        }
        (false, false) => 0,
        (true, false) => return Err(page.error("missing OUTLIERS section (+med codec)")),
        (false, true) => {
            return Err(
                page.error("OUTLIERS section present, but the codec does not extract outliers")
            );
        }
    };
    let n_in = (n - n_out) as usize;
    let groups = Groups::new(u64::from(o), u32::from(g)).expect("grouping checked");
    debug_assert_eq!(groups.bits, u32::from(w));
    let low = expect_section(page, SectionKind::Index, 0, ElemType::Packed(e), n_in)?;
    expect_section(
        page,
        SectionKind::Index,
        1,
        ElemType::Bytes,
        groups.packed_len(n_in),
    )?;
    if !bitpack::tail_is_zero(low, n_in, u32::from(e)) {
        return Err(page.error("INDEX stream 0: padding bits after the last code are set"));
    }
    let digits = page.section(SectionKind::Index, 1)?.1;
    if !bitpack::tail_is_zero(digits, n_in.div_ceil(usize::from(g)), u32::from(w)) {
        return Err(page.error("INDEX stream 1: bits after the last digit group are set"));
    }
    Ok((
        [
            offset(page, SectionKind::Scale, 0),
            offset(page, SectionKind::Index, 0),
            offset(page, SectionKind::Index, 1),
            if med {
                offset(page, SectionKind::Outliers, 0)
            } else {
                0
            },
            0,
        ],
        n_in as u32,
    ))
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

/// The codec parameters `p0..p3` of a page descriptor (see each kernel's
/// header comment).
pub fn desc_params(kc: KernelCodec, head_dim: u32, extra: u32) -> [u32; 4] {
    match kc {
        KernelCodec::Kivi {
            bits,
            group,
            tokens,
            ..
        } => [
            u32::from(group),
            magic(u32::from(group)),
            u32::from(bits),
            u32::from(!tokens),
        ],
        KernelCodec::InnerQ {
            bits,
            mode,
            group,
            tokens,
            norm,
        } => [
            u32::from(group),
            magic(u32::from(group)),
            u32::from(mode) | u32::from(norm) << 8 | (u32::from(group) / 32) << 16,
            u32::from(bits) | u32::from(tokens) << 8,
        ],
        KernelCodec::Polar { m, n, adjacent } => [
            u32::from(m),
            u32::from(m) + u32::from(n),
            u32::from(adjacent),
            0,
        ],
        KernelCodec::Sphere { octopus, a, b, qjl } => [
            u32::from(a),
            u32::from(b) | u32::from(octopus) << 8 | u32::from(qjl) << 9,
            sphere_sign_offset(octopus, a, b),
            crate::kernels::wht::inv_sqrt(head_dim as usize).to_bits(),
        ],
        KernelCodec::Hqmq {
            s, b, e, g, w, o, ..
        } => [
            s,
            u32::from(b) | u32::from(e) << 8 | u32::from(g) << 16 | u32::from(w) << 24,
            o,
            extra,
        ],
        KernelCodec::Raw { .. } | KernelCodec::Affine { .. } => [0; 4],
    }
}

fn choice(source: &'static str, name: String, grid: Grid) -> KernelChoice {
    KernelChoice {
        source,
        name,
        grid,
        shared: 0,
    }
}

/// Units of `w` elements, `per_thread` per thread.
fn units(w: u32, per_thread: u32) -> Grid {
    Grid::Units { w, per_thread }
}

/// A decode kernel over units of `w` elements (8-element chunks; 16 for
/// polar's 8 pairs): the quad kernel `{prefix}q{suffix}` when a row's
/// chunks (`head_dim / w`) are a power of two <= 256, else the per-unit
/// kernel `{prefix}{suffix}` with `per_thread` units per thread.
fn chunked(
    codec: &'static str,
    prefix: &str,
    suffix: &str,
    head_dim: u32,
    w: u32,
    per_thread: u32,
) -> KernelChoice {
    if quad_chunks(head_dim / w) {
        choice(codec, format!("{prefix}q{suffix}"), units(w, QUAD_UNITS))
    } else {
        choice(codec, format!("{prefix}{suffix}"), units(w, per_thread))
    }
}

/// The decode kernel for pages of a codec of this module.
///
/// # Errors
/// [`Error::Unsupported`] for shapes no kernel handles (hqmq head_dim above
/// 8192, octopus / turbo head_dim above 4096).
pub fn decode_kernel(kc: KernelCodec, head_dim: u32, out: OutType) -> Result<KernelChoice> {
    let o = out.suffix();
    let d8 = head_dim.is_multiple_of(8);
    match kc {
        KernelCodec::Kivi {
            bits,
            group,
            tokens,
            ..
        } => Ok(if d8 && (tokens || group.is_multiple_of(8)) {
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
        }),
        KernelCodec::InnerQ { bits, tokens, .. } => Ok(if d8 {
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
        }),
        KernelCodec::Polar { m, n, adjacent } => {
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
        KernelCodec::Sphere { octopus, qjl, .. } => {
            if !head_dim.is_power_of_two() || head_dim > 4096 {
                return Err(Error::Unsupported(format!(
                    "GPU octopus/turbo kernels handle power-of-two head_dim up to 4096, not {head_dim}"
                )));
            }
            Ok(if (32..=1024).contains(&head_dim) {
                let kind = match (octopus, kc) {
                    (false, _) => "turbo",
                    (true, KernelCodec::Sphere { a, b, .. }) if octopus_product_table(a, b) => {
                        "octt"
                    }
                    _ => "oct",
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
        KernelCodec::Hqmq { s, o: base, .. } => {
            if head_dim / 4 > HQ_NPOS {
                return Err(Error::Unsupported(format!(
                    "GPU hqmq kernels handle head_dim up to {}, not {head_dim}",
                    4 * HQ_NPOS
                )));
            }
            let ob = if matches!(base, 3 | 9) { base } else { 0 };
            let bytes = 24 * 16 * u64::from(s);
            let smem = bytes <= u64::from(HQ_SMEM_MAX) && !HQ_GLOBAL.load(Ordering::Relaxed);
            Ok(KernelChoice {
                source: "hqmq",
                name: format!("decode_hqmq_o{ob}_{}_{o}", if smem { "s" } else { "g" }),
                grid: Grid::PlaneRows {
                    tokens: HQ_ITEM,
                    unit: 4,
                },
                shared: if smem { bytes as u32 } else { 0 },
            })
        }
        KernelCodec::Raw { .. } | KernelCodec::Affine { .. } => {
            unreachable!("raw and affine kernels are chosen in spec")
        }
    }
}

/// Upper bound of the canonical body of a page (the exact length where
/// it does not depend on the data).
pub fn body_len_bound(kc: KernelCodec, rows: u64, tokens: u64, d: u64) -> u64 {
    let a = |x: u64| x.next_multiple_of(64);
    let planes = rows.checked_div(tokens).unwrap_or(0);
    let packed = |n: u64, bits: u64| (n * bits).div_ceil(8);
    match kc {
        KernelCodec::Kivi {
            bits,
            group,
            tokens: tok,
            ..
        } => {
            let ng = group_count(tok, u32::from(group), planes, tokens, d);
            64 + 2 * a(2 * ng) + a(packed(rows * d, u64::from(bits)))
        }
        KernelCodec::InnerQ {
            bits,
            group,
            tokens: tok,
            ..
        } => {
            let ng = group_count(tok, u32::from(group), planes, tokens, d);
            64 + a(2 * ng)
                + a(4 * ng * u64::from(group / 32))
                + a(ng.div_ceil(8))
                + a(packed(rows * d, u64::from(bits)))
        }
        KernelCodec::Polar { m, n, .. } => {
            64 + a(4 * planes * d / 2) + a(packed(rows * d / 2, u64::from(m + n)))
        }
        KernelCodec::Sphere {
            octopus, a: ba, b, ..
        } => {
            let t = d.div_ceil(3);
            let codes = if octopus {
                a(packed(2 * rows * t, u64::from(ba))) + a(packed(rows * t, u64::from(b)))
            } else {
                a(packed(rows * d, u64::from(ba)))
            };
            128 + a(4 * rows) + codes + a(2 * rows) + a(rows * d / 8)
        }
        KernelCodec::Hqmq { e, g, w, med, .. } => {
            let n = rows * d / 4;
            let digits = a(packed(n.div_ceil(u64::from(g)), u64::from(w)));
            let table = if med {
                a(12 + n.div_ceil(8) + 8 * n)
            } else {
                0
            };
            64 + a(2 * rows) + a(packed(n, u64::from(e))) + digits + table
        }
        KernelCodec::Raw { .. } | KernelCodec::Affine { .. } => {
            unreachable!("raw and affine bodies are sized in spec")
        }
    }
}

/// Every kernel name [`decode_kernel`] and the hqmq encoder can ask for.
pub fn all_kernel_names() -> Vec<(&'static str, String)> {
    let mut v = Vec::new();
    for out in [OutType::Bf16, OutType::F16] {
        let o = out.suffix();
        for bits in 1..=8 {
            for ax in ["tok", "ch", "tokq", "chq"] {
                v.push(("kivi", format!("decode_kivi_{ax}_b{bits}_{o}")));
            }
            for ax in ["k", "v", "kq", "vq"] {
                v.push(("innerq", format!("decode_innerq_{ax}_b{bits}_{o}")));
            }
        }
        v.push(("kivi", format!("decode_kivi_any_{o}")));
        v.push(("innerq", format!("decode_innerq_any_{o}")));
        for pairing in ["half", "adj", "halfq"] {
            for c in [0, 4, 6, 8] {
                v.push(("polar", format!("decode_polar_{pairing}_c{c}_{o}")));
            }
        }
        v.push(("polar", format!("decode_polar_any_{o}")));
        for kind in ["turbo", "oct", "octt"] {
            for q in ["", "_qjl"] {
                v.push(("sphere", format!("decode_sphere_{kind}{q}_{o}")));
            }
        }
        v.push(("sphere", format!("decode_sphere_any_{o}")));
        for base in [0, 3, 9] {
            for m in ["s", "g"] {
                v.push(("hqmq", format!("decode_hqmq_o{base}_{m}_{o}")));
            }
        }
    }
    for s in ["bf16", "f16", "f32"] {
        v.push(("hqmq_enc", format!("encode_hqmq_{s}")));
    }
    v.push(("hqmq_enc", "encode_hqmq_pack".to_string()));
    let _ = BLOCK;
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::Kind;

    #[test]
    fn families_from_parameter_blocks() {
        let t = |kind| TensorInfo {
            name: "t".into(),
            layer: 0,
            kind,
            dtype: crate::cache::DType::Bf16,
            batch: 1,
            heads: 2,
            tokens: 10,
            head_dim: 128,
        };
        let kc = |name: &str, kind| of(codec::parse(name).unwrap().as_ref(), &t(kind)).unwrap();
        assert_eq!(
            kc("hqmq:s96r4", Kind::Key),
            KernelCodec::Hqmq {
                s: 96,
                b: 4,
                e: 12,
                g: 17,
                w: 54,
                o: 9,
                med: false
            }
        );
        assert_eq!(
            kc("kivi:2", Kind::Key),
            KernelCodec::Kivi {
                bits: 2,
                group: 32,
                tokens: true,
                exact: false
            }
        );
        assert_eq!(
            kc("polar:m4n4:vraw", Kind::Value),
            KernelCodec::Raw {
                src: crate::cache::DType::Bf16
            }
        );
        assert_eq!(
            kc("polar:m4n2:adjacent", Kind::Key),
            KernelCodec::Polar {
                m: 4,
                n: 2,
                adjacent: true
            }
        );
        assert_eq!(
            kc("innerq:k2v3", Kind::Value),
            KernelCodec::InnerQ {
                bits: 3,
                mode: 2,
                group: 32,
                tokens: true,
                norm: false
            }
        );
        assert_eq!(
            kc("turbo:b3+qjl", Kind::Key),
            KernelCodec::Sphere {
                octopus: false,
                a: 3,
                b: 0,
                qjl: true
            }
        );
        assert_eq!(
            kc("octopus:b3+qjl:vg32", Kind::Value),
            KernelCodec::Kivi {
                bits: 3,
                group: 32,
                tokens: false,
                exact: true
            }
        );
        assert!(matches!(
            kc("octopus:b3+qjl", Kind::Value),
            KernelCodec::Sphere {
                octopus: true,
                a: 4,
                b: 2,
                qjl: false
            }
        ));
    }

    #[test]
    fn kernel_names_exist_for_every_family() {
        let names = all_kernel_names();
        for (kc, d) in [
            (
                KernelCodec::Hqmq {
                    s: 5,
                    b: 2,
                    e: 5,
                    g: 3,
                    w: 20,
                    o: 15,
                    med: true,
                },
                12,
            ),
            (
                KernelCodec::Polar {
                    m: 3,
                    n: 2,
                    adjacent: false,
                },
                64,
            ),
            (
                KernelCodec::Sphere {
                    octopus: true,
                    a: 4,
                    b: 2,
                    qjl: false,
                },
                2048,
            ),
        ] {
            let k = decode_kernel(kc, d, OutType::Bf16).unwrap();
            assert!(
                names.iter().any(|(s, n)| *s == k.source && *n == k.name),
                "{k:?}"
            );
        }
    }
}
