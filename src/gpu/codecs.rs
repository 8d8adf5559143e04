//! What the GPU kernels need to know about the VQ and group codecs
//! (`hqmq`, `octopus`, `turbo`, `polar`, `innerq`, `kivi`): the kernel
//! family of a (codec, tensor) pair read from the codec's id and parameter
//! block, the checked section offsets of a page, the kernel that decodes it
//! and the codec parameters its descriptor carries.
//!
//! Nothing here reads a codec's bytes: parameters come from each codec's
//! own parser (`Kivi::from_params`, `InnerQ::from_params`, ...) and every
//! page is checked by the codec's own page layout, the function its CPU
//! decoder uses (section kinds, streams, element types, counts, no extra
//! section, and content the kernels do not check themselves: finite scales
//! and zero points, InnerQ slots, the outlier table). The GPU therefore
//! accepts exactly the pages the CPU accepts.

use crate::cache::{Kind, Role, TensorInfo};
use crate::codec::hqmq::Hqmq;
use crate::codec::innerq::{self, InnerQ};
use crate::codec::kivi::Kivi;
use crate::codec::polar::{self, Pairing, Polar, Values as PolarValues};
use crate::codec::sphere::{self, Values};
use crate::codec::{self, Codec, affine, raw};
use crate::error::{Error, Result};
use crate::format::{PageView, SectionKind};
use crate::kernels::radix::Groups;

use super::spec::{
    BLOCK, DEC_UNITS_W32, Grid, HQ_ITEM, KernelChoice, KernelCodec, KernelOptions,
    MAX_SHUFFLE_BLOCK, OutType, SEG_MAX, UNITS_PER_THREAD, W8, magic, src_suffix,
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

fn bad_params(codec: &dyn Codec) -> Error {
    Error::param(format!(
        "{}: parameter block of {} bytes does not match the codec spec",
        codec.name(),
        codec.params().len()
    ))
}

impl KernelCodec {
    /// The kernel family of pages of `t` encoded by `codec`, from the
    /// codec's own parameter parser.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for a codec without GPU kernels;
    /// [`Error::Parameter`] for a parameter block that does not parse or a
    /// bdr block that does not divide head_dim.
    pub fn of(codec: &dyn Codec, t: &TensorInfo) -> Result<KernelCodec> {
        let p = codec.params();
        super::spec::supported(t)?;
        let key = t.kind.role() == Role::Key;
        match codec.id() {
            codec::raw::ID => Ok(KernelCodec::Raw { src: t.dtype }),
            codec::affine::INT_ID => Ok(KernelCodec::Affine {
                bits: codec::affine::int_params(&p)?.bits,
                block: None,
            }),
            codec::affine::BDR_ID => {
                let c = codec::affine::bdr_params(&p)?;
                let block = c.block_for(t.kind).map(|b| b as u32);
                if let Some(h) = block
                    && !t.head_dim.is_multiple_of(h)
                {
                    return Err(Error::param(format!(
                        "{}: head_dim {} is not a multiple of the bdr block {h}",
                        t.describe(),
                        t.head_dim
                    )));
                }
                Ok(KernelCodec::Affine {
                    bits: c.bits,
                    block,
                })
            }
            codec::hqmq::ID => {
                let h = Hqmq::from_params(&p)?;
                let (e, o) = codec::hqmq::symbol_split(h.secondaries, h.radius_bits);
                Ok(KernelCodec::Hqmq {
                    s: h.secondaries,
                    b: h.radius_bits,
                    e: e as u8,
                    g: h.groups.digits as u8,
                    w: h.groups.bits as u8,
                    o: u32::try_from(o).map_err(|_| bad_params(codec))?,
                    med: h.outlier_multiplier.is_some(),
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
                let c = Polar::from_params(&p)?;
                Ok(match (key, c.values) {
                    (true, _) => KernelCodec::Polar {
                        m: c.angle_bits,
                        n: c.radius_bits,
                        adjacent: c.pairing == Pairing::Adjacent,
                    },
                    (false, PolarValues::Raw) => KernelCodec::Raw { src: t.dtype },
                    (false, PolarValues::Int(bits)) => KernelCodec::Affine { bits, block: None },
                })
            }
            codec::innerq::ID => {
                let c = InnerQ::from_params(&p)?;
                Ok(KernelCodec::InnerQ {
                    bits: c.bits_for(t.kind),
                    mode: c.mode.code(),
                    group: c.group,
                    tokens: !key,
                    norm: key && c.normalize,
                })
            }
            codec::kivi::ID => {
                let c = Kivi::from_params(&p)?;
                Ok(KernelCodec::Kivi {
                    bits: c.bits,
                    group: c.group,
                    tokens: key,
                })
            }
            _ => Err(Error::Unsupported(format!(
                "no GPU kernels for codec {} (id {}) yet; decode it on the CPU",
                codec.name(),
                codec.id()
            ))),
        }
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

/// Offset in the page body of `bytes`, a section slice of `page`.
fn at(page: &PageView<'_>, bytes: &[u8]) -> u32 {
    let o = bytes.as_ptr() as usize - page.body().as_ptr() as usize;
    debug_assert!(o + bytes.len() <= page.body().len());
    o as u32
}

/// Offset of section `(kind, stream)` (present: checked before).
fn offset(page: &PageView<'_>, kind: SectionKind, stream: u8) -> u32 {
    page.sections()
        .iter()
        .find(|s| s.kind == kind && s.stream == stream)
        .map(|s| s.offset)
        .expect("section checked by the codec's page layout")
}

/// Checked section offsets `[s0..s4]` of a page and its page-specific
/// parameter (hqmq: inlier chunks; else 0). The meaning of each offset is
/// the kernel's (see each `.cu` file). Every page is checked by its
/// codec's own page layout (`page_layout` / `page` / `key_sections` /
/// `unit_sections` in `crate::codec`), the function its CPU decoder uses,
/// so the GPU accepts exactly the pages the CPU accepts.
///
/// # Errors
/// [`Error::Format`] naming the page when a section is missing, extra, has
/// the wrong type or count, or content the CPU decoder rejects.
pub fn page_sections(
    kc: KernelCodec,
    page: &PageView<'_>,
    t: &TensorInfo,
) -> Result<([u32; 5], u32)> {
    let planes = t.planes();
    let tokens = page.header.meta.tokens as usize;
    let rows = planes * tokens;
    let d = t.head_dim as usize;
    let s = match kc {
        KernelCodec::Raw { src } => [at(page, raw::page_layout(page, src, rows * d)?), 0, 0, 0, 0],
        KernelCodec::Affine { bits, .. } => {
            let [s, z, i] = affine::page_layout(page, bits, rows, d)?;
            [at(page, s), at(page, z), at(page, i), 0, 0]
        }
        KernelCodec::Kivi {
            bits,
            group,
            tokens: tok,
        } => {
            let kind = if tok { Kind::Key } else { Kind::Value };
            let p = Kivi { bits, group }.page(page, kind, planes, tokens, d)?;
            [
                at(page, p.scales),
                at(page, p.zeros),
                at(page, p.index),
                0,
                0,
            ]
        }
        KernelCodec::InnerQ {
            bits,
            mode,
            group,
            tokens: tok,
            ..
        } => {
            let kind = if tok { Kind::Value } else { Kind::Key };
            let mode = innerq::Mode::from_code(mode)
                .ok_or_else(|| page.error(format!("innerq: unknown mode {mode}")))?;
            let p = innerq::page_layout(page, mode, group, bits, kind, planes, tokens, d)?;
            [
                at(page, p.scales),
                at(page, p.slots),
                at(page, p.index),
                p.flags.map_or(0, |f| at(page, f)),
                0,
            ]
        }
        KernelCodec::Polar { m, n, .. } => {
            let (s, i) = polar::key_sections(m + n, page, planes, tokens, d)?;
            [at(page, s), at(page, i), 0, 0, 0]
        }
        KernelCodec::Sphere { octopus, a, b, qjl } => {
            let triplets = d.div_ceil(3);
            let streams: &[(u8, usize)] = if octopus {
                &[(a, 2 * triplets), (b, triplets)]
            } else {
                &[(a, d)]
            };
            let u = sphere::unit_sections(page, streams, qjl, rows, d)?;
            let (g, bits) = u.qjl.map_or((0, 0), |(g, b)| (at(page, g), at(page, b)));
            [
                at(page, u.gammas),
                at(page, u.codes[0]),
                u.codes.get(1).map_or(0, |c| at(page, c)),
                g,
                bits,
            ]
        }
        KernelCodec::Hqmq { e, g, o, med, .. } => {
            let groups = Groups::new(u64::from(o), u32::from(g))
                .ok_or_else(|| page.error("hqmq: invalid digit grouping"))?;
            let p = codec::hqmq::page_layout(page, med, u32::from(e), &groups, rows, d)?;
            let table = if med {
                offset(page, SectionKind::Outliers, 0)
            } else {
                0
            };
            let s = [
                at(page, p.scales),
                at(page, p.low),
                at(page, p.high),
                table,
                0,
            ];
            return Ok((s, p.n_in as u32));
        }
    };
    Ok((s, 0))
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

/// The decode kernel for pages of one kernel family, head_dim and output
/// type.
///
/// # Errors
/// [`Error::Unsupported`] for shapes no kernel handles (`int`/`bdr`
/// head_dim above [`SEG_MAX`], hqmq head_dim above 8192, octopus / turbo
/// head_dim above 4096).
pub fn decode_kernel(
    kc: KernelCodec,
    head_dim: u32,
    out: OutType,
    opts: KernelOptions,
) -> Result<KernelChoice> {
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
            let smem = bytes <= u64::from(HQ_SMEM_MAX) && !opts.global_hqmq_codebook;
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
        KernelCodec::Raw { src } => Ok(if head_dim.is_multiple_of(8) {
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
        }),
        KernelCodec::Affine { bits, block } => {
            if head_dim > SEG_MAX {
                return Err(Error::Unsupported(format!(
                    "GPU int/bdr kernels handle head_dim up to {SEG_MAX}, not {head_dim}"
                )));
            }
            let h = block.unwrap_or(0);
            let w8 = head_dim.is_multiple_of(8) && h <= MAX_SHUFFLE_BLOCK;
            let w32 = head_dim.is_multiple_of(32) && (head_dim / 32).is_power_of_two();
            if w32 && !(w8 && opts.narrow) {
                // A block spanning the whole row (bdr{head_dim}) has its own
                // kernel with every butterfly stage unconditional.
                let kind = if h == head_dim { "rowrot_" } else { "" };
                Ok(KernelChoice {
                    source: "affine",
                    name: format!("decode_affine_{kind}b{bits}_{o}"),
                    grid: Grid::Units {
                        w: 32,
                        per_thread: DEC_UNITS_W32,
                    },
                    shared: 0,
                })
            } else if w8 {
                Ok(KernelChoice {
                    source: "affine",
                    name: format!("decode_affine_w8_b{bits}_{o}"),
                    grid: W8,
                    shared: 0,
                })
            } else {
                let seg = if h > 1 { h } else { head_dim };
                Ok(KernelChoice {
                    source: "affine",
                    name: format!("decode_affine_any_{o}"),
                    grid: Grid::Segments { seg },
                    shared: 0,
                })
            }
        }
    }
}

/// Length of the canonical body (format/SPEC.md 6.2) of a page of `rows`
/// rows (`tokens` per plane) of `d` channels for a kernel family: what the
/// CPU encoders write (an upper bound where the body depends on the data),
/// used to size staging for zstd pages before they are decompressed.
pub fn canonical_body_len(kc: KernelCodec, rows: u64, tokens: u64, d: u64) -> u64 {
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
        KernelCodec::Raw { src } => 64 + a(rows * d * src.size() as u64),
        KernelCodec::Affine { bits, .. } => {
            64 + 2 * a(4 * rows) + a(packed(rows * d, u64::from(bits)))
        }
    }
}

/// Every kernel name [`decode_kernel`] asks for with the VQ and group
/// families, and the hqmq encoder's.
pub(crate) fn vq_kernel_names() -> Vec<(&'static str, String)> {
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
        for k in ["", "med_", "compact_"] {
            v.push(("hqmq_enc", format!("encode_hqmq_{k}{s}")));
        }
    }
    v.push(("hqmq_enc", "encode_hqmq_pack".to_string()));
    v.push(("hqmq_enc", "encode_hqmq_cells".to_string()));
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
        let kc = |name: &str, kind| {
            KernelCodec::of(codec::parse(name).unwrap().as_ref(), &t(kind)).unwrap()
        };
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
        let names = vq_kernel_names();
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
            let k = decode_kernel(kc, d, OutType::Bf16, KernelOptions::default()).unwrap();
            assert!(
                names.iter().any(|(s, n)| *s == k.source && *n == k.name),
                "{k:?}"
            );
        }
    }

    #[test]
    fn kernel_choice() {
        let bdr = |h| KernelCodec::Affine {
            bits: 4,
            block: Some(h),
        };
        assert_eq!(
            decode_kernel(bdr(128), 128, OutType::Bf16, KernelOptions::default())
                .unwrap()
                .name,
            "decode_affine_rowrot_b4_bf16"
        );
        assert_eq!(
            decode_kernel(bdr(64), 128, OutType::Bf16, KernelOptions::default())
                .unwrap()
                .name,
            "decode_affine_b4_bf16"
        );
        assert_eq!(
            decode_kernel(bdr(512), 512, OutType::F16, KernelOptions::default())
                .unwrap()
                .grid,
            Grid::Units {
                w: 32,
                per_thread: DEC_UNITS_W32
            }
        );
        assert_eq!(
            decode_kernel(bdr(512), 1024 + 512, OutType::F16, KernelOptions::default()).ok(),
            None
        );
        assert_eq!(
            decode_kernel(bdr(16), 48, OutType::F16, KernelOptions::default())
                .unwrap()
                .name,
            "decode_affine_w8_b4_f16"
        );
        assert_eq!(
            decode_kernel(bdr(32), 96, OutType::F16, KernelOptions::default())
                .unwrap()
                .name,
            "decode_affine_w8_b4_f16"
        );
        assert_eq!(
            decode_kernel(bdr(2), 6, OutType::F16, KernelOptions::default())
                .unwrap()
                .grid,
            Grid::Segments { seg: 2 }
        );
        assert_eq!(
            super::super::spec::encode_kernel(
                bdr(16),
                96,
                crate::cache::DType::Bf16,
                KernelOptions::default()
            )
            .unwrap()
            .name,
            "encode_affine_any_bf16"
        );
        assert!(decode_kernel(bdr(2048), 2048, OutType::Bf16, KernelOptions::default()).is_err());
    }
}
