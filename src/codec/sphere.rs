//! The shared frame of the rotation-preconditioned unit-vector codecs
//! `octopus` (format/codecs/octopus.md) and `turbo` (format/codecs/turbo.md).
//!
//! Every head vector `x` (one token of one kv head, `head_dim = d` values,
//! `d` a power of two) is split into its norm `γ = ||x||` (f32) and the
//! rotated unit vector `u = R x / γ`, `R = H_norm diag(s)` with a random
//! sign vector `s` drawn per (layer, kv head, K/V) from the file's seed
//! (OCTOPUS paper, Boss et al., arXiv:2605.21226, section 3.1,
//! Eq. 1-2). A [`UnitQuantizer`] codes `u` (OCTOPUS: triplets, section
//! 3.2-3.5; TurboQuant-MSE: per coordinate, Eq. 3). Optionally K pages
//! carry the 1-bit QJL sketch of the residual `u - û` (section 3.6,
//! appendix C.15; [`crate::kernels::qjl`]), which the decoder adds back so
//! that `q . k^` is the QJL-corrected score. V pages either use the same
//! unit quantizer or the group-wise asymmetric quantizer
//! (`kivi`'s value path) the paper pairs with its key codec.
//!
//! This module holds what both codecs share: options and their names,
//! the common part of the parameter block, seeds, page encode/decode and
//! the compressed-domain score function.

use half::f16;

use crate::cache::{Kind, Role, TensorInfo};
use crate::error::{Error, Result};
use crate::format::{ElemType, PageView, Section, SectionKind};
use crate::kernels::{bitpack, qjl, rotation, wht};

use super::{PageIn, PageOut, expect_section, expect_section_count, f32_at};

/// Smallest supported head_dim.
pub const MIN_DIM: u32 = 8;
/// Largest supported head_dim.
pub const MAX_DIM: u32 = 4096;
/// Largest value group.
pub const MAX_GROUP: u16 = 1024;
/// Bytes of the common parameter block header.
pub const HEADER_LEN: usize = 16;

/// Seed-derivation purpose of the rotation sign vector `s`.
pub const PURPOSE_ROTATION: u64 = 0;
/// Seed-derivation purpose of the QJL sign vector `s'`.
pub const PURPOSE_QJL: u64 = 1;

/// How V pages are coded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Values {
    /// With the codec's unit quantizer, like K (never with QJL).
    Same,
    /// Group-wise asymmetric INT-`bits`, fp16 scale and zero point per
    /// group of `group` channels (the value path of `kivi`).
    Groups {
        /// Bits per code, 1..=8.
        bits: u8,
        /// Channels per group; must divide head_dim.
        group: u16,
    },
}

/// Options shared by `octopus` and `turbo`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// K pages carry the 1-bit QJL residual sketch (`+qjl`).
    pub qjl: bool,
    /// How V pages are coded.
    pub values: Values,
    /// Seed of all sign vectors (`:seed{n}`; default 0).
    pub seed: u64,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            qjl: false,
            values: Values::Same,
            seed: 0,
        }
    }
}

/// A quantizer of rotated unit vectors of one dimension `d` into one or
/// more bit-packed code streams.
pub trait UnitQuantizer: Send + Sync + std::fmt::Debug {
    /// The dimension `d` (head_dim).
    fn dim(&self) -> usize;

    /// `(bits, codes per vector)` of each INDEX stream, in stream order.
    fn streams(&self) -> Vec<(u8, usize)>;

    /// Codes `u` (length `d`, unit norm or zero): `codes[k]` is this
    /// vector's slice of stream `k`.
    fn quantize(&self, u: &[f32], codes: &mut [&mut [u8]]);

    /// Writes the reconstruction `û` (length `d`) of the codes. Must be the
    /// exact arithmetic of the codec's spec.
    fn reconstruct(&self, codes: &[&[u8]], u_hat: &mut [f32]);

    /// Code bits per vector.
    fn code_bits(&self) -> usize {
        self.streams().iter().map(|&(b, n)| b as usize * n).sum()
    }
}

/// Parsed name options: `+qjl`, `:vg{g}[b{bits}]`, `:seed{n}`, plus the
/// codec-specific options left over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedName {
    /// The `b...` segment (after `family:`), without `+qjl`.
    pub bits: String,
    /// `+qjl` present.
    pub qjl: bool,
    /// `:vg{g}` with optional explicit bits.
    pub groups: Option<(u16, Option<u8>)>,
    /// `:seed{n}`.
    pub seed: u64,
    /// Other options, in order.
    pub rest: Vec<String>,
}

/// Splits `family:...` into options; `None` when the name is not of
/// `family`.
///
/// # Errors
/// [`Error::Parameter`] for malformed common options.
pub fn parse_name(family: &str, s: &str) -> Option<Result<ParsedName>> {
    let rest = s.strip_prefix(family)?.strip_prefix(':')?;
    Some(parse_options(s, rest))
}

fn parse_options(full: &str, rest: &str) -> Result<ParsedName> {
    let qjl = rest.contains("+qjl");
    if rest.matches("+qjl").count() > 1 {
        return Err(Error::param(format!("{full:?}: +qjl given twice")));
    }
    let rest = rest.replacen("+qjl", "", 1);
    let mut parts = rest.split(':');
    let bits = parts.next().unwrap_or("").to_string();
    let mut p = ParsedName {
        bits,
        qjl,
        groups: None,
        seed: 0,
        rest: Vec::new(),
    };
    for opt in parts {
        if let Some(v) = opt.strip_prefix("vg") {
            let (g, b) = match v.split_once('b') {
                Some((g, b)) => (g, Some(b)),
                None => (v, None),
            };
            let g = g
                .parse::<u16>()
                .ok()
                .filter(|g| (2..=MAX_GROUP).contains(g));
            let b = match b {
                None => Some(None),
                Some(b) => b
                    .parse::<u8>()
                    .ok()
                    .filter(|b| (1..=8).contains(b))
                    .map(Some),
            };
            match (g, b) {
                (Some(g), Some(b)) => p.groups = Some((g, b)),
                _ => {
                    return Err(Error::param(format!(
                        "{full:?}: value groups are :vg{{g}} or :vg{{g}}b{{bits}} with g in 2..={MAX_GROUP} and bits in 1..=8, e.g. :vg32"
                    )));
                }
            }
        } else if let Some(v) = opt.strip_prefix("seed") {
            p.seed = v
                .parse::<u64>()
                .map_err(|_| Error::param(format!("{full:?}: :seed takes a u64, e.g. :seed7")))?;
        } else {
            p.rest.push(opt.to_string());
        }
    }
    Ok(p)
}

/// The name suffix for `opts`: `+qjl` is placed by the caller; this returns
/// `:vg{g}[b{bits}]` and `:seed{n}` (when non-zero).
pub fn options_suffix(opts: &Options, nominal_bits: u8) -> String {
    let mut s = String::new();
    if let Values::Groups { bits, group } = opts.values {
        s.push_str(&format!(":vg{group}"));
        if bits != nominal_bits {
            s.push_str(&format!("b{bits}"));
        }
    }
    if opts.seed != 0 {
        s.push_str(&format!(":seed{}", opts.seed));
    }
    s
}

/// Builds [`Options`] from parsed name options.
pub fn options_from(p: &ParsedName, nominal_bits: u8) -> Options {
    Options {
        qjl: p.qjl,
        values: match p.groups {
            None => Values::Same,
            Some((group, bits)) => Values::Groups {
                bits: bits.unwrap_or(nominal_bits),
                group,
            },
        },
        seed: p.seed,
    }
}

/// The common 16-byte parameter header (format/codecs/octopus.md).
pub fn write_header(bits_a: u8, bits_b: u8, encoder: u8, opts: &Options) -> Vec<u8> {
    let (vb, vg) = match opts.values {
        Values::Same => (0u8, 0u16),
        Values::Groups { bits, group } => (bits, group),
    };
    let mut p = vec![bits_a, bits_b, u8::from(opts.qjl), encoder, vb, 0];
    p.extend_from_slice(&vg.to_le_bytes());
    p.extend_from_slice(&opts.seed.to_le_bytes());
    p
}

/// Parses the common header: `(bits_a, bits_b, encoder, options, tail)`.
///
/// # Errors
/// [`Error::Parameter`] for a short block, unknown flags, non-zero
/// reserved bytes or inconsistent value-group fields.
pub fn read_header(p: &[u8]) -> Result<(u8, u8, u8, Options, &[u8])> {
    if p.len() < HEADER_LEN {
        return Err(Error::param(format!(
            "parameter block of {} bytes is shorter than its {HEADER_LEN}-byte header",
            p.len()
        )));
    }
    let (flags, vb, reserved) = (p[2], p[4], p[5]);
    let vg = u16::from_le_bytes([p[6], p[7]]);
    if flags & !1 != 0 || reserved != 0 {
        return Err(Error::param(format!(
            "unknown flags 0x{flags:02x} or reserved byte 0x{reserved:02x} set"
        )));
    }
    let values = match (vb, vg) {
        (0, 0) => Values::Same,
        (1..=8, 2..=MAX_GROUP) => Values::Groups {
            bits: vb,
            group: vg,
        },
        _ => {
            return Err(Error::param(format!(
                "value groups: bits {vb} and group {vg} (expected both 0, or bits 1..=8 and group 2..={MAX_GROUP})"
            )));
        }
    };
    let seed = u64::from_le_bytes(p[8..16].try_into().expect("8 bytes"));
    Ok((
        p[0],
        p[1],
        p[3],
        Options {
            qjl: flags & 1 == 1,
            values,
            seed,
        },
        &p[HEADER_LEN..],
    ))
}

/// Reads `n` little-endian f32 from `b` at `*at`, advancing it.
///
/// # Errors
/// [`Error::Parameter`] when `b` is too short.
pub fn read_f32s(b: &[u8], at: &mut usize, n: usize) -> Result<Vec<f32>> {
    let end = n
        .checked_mul(4)
        .and_then(|l| at.checked_add(l))
        .filter(|&e| e <= b.len())
        .ok_or_else(|| Error::param("parameter block is truncated"))?;
    let v = b[*at..end]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4")))
        .collect();
    *at = end;
    Ok(v)
}

/// Reads a little-endian u32 from `b` at `*at`, advancing it.
///
/// # Errors
/// [`Error::Parameter`] when `b` is too short.
pub fn read_u32(b: &[u8], at: &mut usize) -> Result<u32> {
    let v = b
        .get(*at..*at + 4)
        .ok_or_else(|| Error::param("parameter block is truncated"))?;
    *at += 4;
    Ok(u32::from_le_bytes(v.try_into().expect("4")))
}

/// Checks a stored codebook: `2^bits` finite values, strictly ascending,
/// inside `[lo, hi]`.
///
/// # Errors
/// [`Error::Parameter`] naming `what`.
pub fn check_codebook(what: &str, c: &[f32], lo: f32, hi: f32) -> Result<()> {
    let ok = c.iter().all(|v| v.is_finite() && (lo..=hi).contains(v))
        && c.windows(2).all(|w| w[0] < w[1]);
    if ok {
        Ok(())
    } else {
        Err(Error::param(format!(
            "{what} codebook is not strictly ascending inside [{lo}, {hi}]: {c:?}"
        )))
    }
}

/// Checks a head_dim table key: a power of two in `MIN_DIM..=MAX_DIM`,
/// above the previous one.
///
/// # Errors
/// [`Error::Parameter`].
pub fn check_dim_key(d: u32, prev: Option<u32>) -> Result<()> {
    if !d.is_power_of_two() || !(MIN_DIM..=MAX_DIM).contains(&d) || prev.is_some_and(|p| p >= d) {
        return Err(Error::param(format!(
            "codebook head_dim {d} is not a power of two in {MIN_DIM}..={MAX_DIM} above the previous one"
        )));
    }
    Ok(())
}

/// True when tensors of `kind` are coded with the unit quantizer.
pub fn unit_coded(opts: &Options, kind: Kind) -> bool {
    kind.role() == Role::Key || opts.values == Values::Same
}

/// head_dims of the tensors of `cache` that the unit quantizer codes (the
/// dimensions a codec's per-head_dim codebook tables are trained for in
/// `Codec::prepare`).
pub fn coded_head_dims(opts: &Options, cache: &crate::view::CacheView<'_>) -> Vec<u32> {
    cache
        .tensors
        .iter()
        .filter(|t| unit_coded(opts, t.info.kind))
        .map(|t| t.info.head_dim)
        .collect()
}

/// Appends per-head_dim codebook tables to a parameter block: a u32 count,
/// then per table its head_dim (u32) and centroids (f32), little-endian.
pub fn write_dim_tables<'t>(
    p: &mut Vec<u8>,
    tables: impl ExactSizeIterator<Item = (u32, &'t [f32])>,
) {
    p.extend_from_slice(&(tables.len() as u32).to_le_bytes());
    for (dim, centroids) in tables {
        p.extend_from_slice(&dim.to_le_bytes());
        for c in centroids {
            p.extend_from_slice(&c.to_le_bytes());
        }
    }
}

/// The error of an octopus / turbo codec asked to code a tensor whose
/// head_dim has no `what` codebook: the codec was not prepared for the
/// cache (`Codec::prepare`).
pub fn no_codebook(codec: &str, what: &str, t: &TensorInfo) -> Error {
    Error::param(format!(
        "{codec}: no {what} for head_dim {} ({}); the codec must be prepared for the cache \
         (Codec::prepare)",
        t.head_dim,
        t.describe()
    ))
}

/// Checks that `t` can be coded (`family` names the codec in messages).
///
/// # Errors
/// [`Error::Parameter`] naming the tensor: head_dim not a power of two in
/// range for the rotation, or not divisible by the value group.
pub fn check_tensor(family: &str, opts: &Options, t: &TensorInfo) -> Result<()> {
    if unit_coded(opts, t.kind) {
        if !t.head_dim.is_power_of_two() || !(MIN_DIM..=MAX_DIM).contains(&t.head_dim) {
            return Err(Error::param(format!(
                "{family} rotates head vectors with a Walsh-Hadamard transform, which needs a \
                 power-of-two head_dim in {MIN_DIM}..={MAX_DIM}, but {} ({}) has head_dim {}",
                t.name,
                t.describe(),
                t.head_dim
            )));
        }
    } else if let Values::Groups { group, .. } = opts.values
        && !t.head_dim.is_multiple_of(u32::from(group))
    {
        return Err(Error::param(format!(
            "{family}: value group {group} does not divide head_dim {} of {} ({})",
            t.head_dim,
            t.name,
            t.describe()
        )));
    }
    Ok(())
}

/// The sign vector of `purpose` for (layer, kv head, kind):
/// `signs(derive(seed, [layer, head, kind, purpose]), d)`.
pub fn signs_for(seed: u64, layer: u32, head: u32, kind: Kind, purpose: u64, d: usize) -> Vec<f32> {
    let key = rotation::derive(
        seed,
        &[
            u64::from(layer),
            u64::from(head),
            u64::from(kind.code()),
            purpose,
        ],
    );
    rotation::signs(key, d)
}

/// Sign vectors of one plane: the rotation `s` and, with QJL, `s'`.
#[derive(Debug, Clone)]
pub struct PlaneSigns {
    /// Rotation signs `s`.
    pub rot: Vec<f32>,
    /// QJL projection signs `s'` (empty without QJL).
    pub qjl: Vec<f32>,
}

impl PlaneSigns {
    /// Signs of kv head `head` of `t` (planes are `batch * heads + head`).
    pub fn new(opts: &Options, t: &TensorInfo, head: u32, with_qjl: bool) -> PlaneSigns {
        let d = t.head_dim as usize;
        PlaneSigns {
            rot: signs_for(opts.seed, t.layer, head, t.kind, PURPOSE_ROTATION, d),
            qjl: if with_qjl {
                signs_for(opts.seed, t.layer, head, t.kind, PURPOSE_QJL, d)
            } else {
                Vec::new()
            },
        }
    }
}

/// One coded head vector (the compressed state of a key or value).
#[derive(Debug, Clone, PartialEq)]
pub struct CodedRow {
    /// Norm `γ`.
    pub gamma: f32,
    /// Codes of each stream.
    pub codes: Vec<Vec<u8>>,
    /// QJL residual norm `γ_r` and sign bits (1 = negative), when present.
    pub qjl: Option<(f16, Vec<u8>)>,
}

/// Scratch buffers for one head vector.
#[derive(Debug, Clone)]
pub struct Scratch {
    u: Vec<f32>,
    u_hat: Vec<f32>,
    tmp: Vec<f32>,
}

impl Scratch {
    /// Buffers for head_dim `d`.
    pub fn new(d: usize) -> Scratch {
        Scratch {
            u: vec![0.0; d],
            u_hat: vec![0.0; d],
            tmp: vec![0.0; d],
        }
    }
}

/// Encodes head vector `x` (length `d`): returns `γ` and, with QJL signs,
/// `γ_r`; writes the codes and sign bits.
///
/// # Errors
/// A message (the caller adds the location) when `x` holds NaN or inf or
/// its norm overflows f32.
pub fn encode_row(
    q: &dyn UnitQuantizer,
    x: &[f32],
    signs: &PlaneSigns,
    sc: &mut Scratch,
    codes: &mut [&mut [u8]],
    qjl_bits: Option<&mut [u8]>,
) -> std::result::Result<(f32, Option<f16>), String> {
    let d = x.len();
    let gamma = crate::kernels::l2_norm(x);
    if !gamma.is_finite() {
        return Err("non-finite value (NaN or inf) or a norm beyond f32 in a head vector".into());
    }
    let u = &mut sc.u;
    u.copy_from_slice(x);
    rotation::forward(u, &signs.rot);
    let f = wht::inv_sqrt(d) / gamma;
    if gamma == 0.0 || !f.is_finite() {
        u.fill(0.0);
    } else {
        crate::kernels::scale(u, f);
    }
    q.quantize(u, codes);
    let gr = qjl_bits.map(|bits| {
        let reborrow: Vec<&[u8]> = codes.iter().map(|c| &**c).collect();
        q.reconstruct(&reborrow, &mut sc.u_hat);
        for (r, &h) in sc.u.iter_mut().zip(&sc.u_hat) {
            *r -= h;
        }
        qjl::sketch(&mut sc.u, &signs.qjl, bits)
    });
    Ok((gamma, gr))
}

/// Decodes one head vector into `out` (length `d`): `û` (plus the QJL
/// residual estimate), times `γ c_d`, inverse rotation.
pub fn decode_row(
    q: &dyn UnitQuantizer,
    gamma: f32,
    codes: &[&[u8]],
    qjl: Option<(f16, &[u8])>,
    signs: &PlaneSigns,
    sc: &mut Scratch,
    out: &mut [f32],
) {
    let d = out.len();
    q.reconstruct(codes, out);
    if let Some((gr, bits)) = qjl {
        qjl::add_residual(bits, gr, &signs.qjl, &mut sc.tmp, out);
    }
    crate::kernels::scale(out, gamma * wht::inv_sqrt(d));
    rotation::inverse(out, &signs.rot);
}

/// Encodes a [`CodedRow`] (convenience over [`encode_row`] for experiments
/// and tests).
///
/// # Errors
/// As [`encode_row`], as [`Error::Parameter`].
pub fn encode_coded(
    q: &dyn UnitQuantizer,
    x: &[f32],
    signs: &PlaneSigns,
    with_qjl: bool,
) -> Result<CodedRow> {
    let d = x.len();
    let mut sc = Scratch::new(d);
    let mut codes: Vec<Vec<u8>> = q.streams().iter().map(|&(_, n)| vec![0u8; n]).collect();
    let mut bits = vec![0u8; if with_qjl { d } else { 0 }];
    let (gamma, gr) = {
        let mut views: Vec<&mut [u8]> = codes.iter_mut().map(|c| c.as_mut_slice()).collect();
        encode_row(
            q,
            x,
            signs,
            &mut sc,
            &mut views,
            with_qjl.then_some(bits.as_mut_slice()),
        )
        .map_err(Error::param)?
    };
    Ok(CodedRow {
        gamma,
        codes,
        qjl: gr.map(|g| (g, bits)),
    })
}

/// Decodes a [`CodedRow`] into `out`.
pub fn decode_coded(q: &dyn UnitQuantizer, row: &CodedRow, signs: &PlaneSigns, out: &mut [f32]) {
    let mut sc = Scratch::new(out.len());
    let views: Vec<&[u8]> = row.codes.iter().map(Vec::as_slice).collect();
    decode_row(
        q,
        row.gamma,
        &views,
        row.qjl.as_ref().map(|(g, b)| (*g, b.as_slice())),
        signs,
        &mut sc,
        out,
    );
}

/// A query prepared for compressed-domain scoring against one plane:
/// `q_rot = R q` and, with QJL, `H (s' ⊙ q_rot)`.
#[derive(Debug, Clone)]
pub struct PreparedQuery {
    /// `R q = c_d H (s ⊙ q)`.
    pub rot: Vec<f32>,
    /// `H (s' ⊙ q_rot)` (empty without QJL).
    pub projected: Vec<f32>,
}

impl PreparedQuery {
    /// Rotates `q` with the plane's signs.
    pub fn new(q: &[f32], signs: &PlaneSigns) -> PreparedQuery {
        let mut rot = q.to_vec();
        rotation::forward(&mut rot, &signs.rot);
        crate::kernels::scale(&mut rot, wht::inv_sqrt(q.len()));
        let projected = if signs.qjl.is_empty() {
            Vec::new()
        } else {
            let mut p = rot.clone();
            qjl::project_query(&mut p, &signs.qjl);
            p
        };
        PreparedQuery { rot, projected }
    }
}

/// The score `q . k` of a coded key from the compressed state (paper Eq.
/// 13 and C.15): `γ (q_rot . û + ẑ)` with the QJL estimate `ẑ` when the row
/// has a sketch. Accumulates in f64; equals `q . decode(k)` up to rounding.
/// `u_hat` is scratch of length `d`.
pub fn score(q: &dyn UnitQuantizer, row: &CodedRow, pq: &PreparedQuery, u_hat: &mut [f32]) -> f64 {
    let views: Vec<&[u8]> = row.codes.iter().map(Vec::as_slice).collect();
    q.reconstruct(&views, u_hat);
    score_with(u_hat, row, pq)
}

/// [`score`] with the row's reconstruction `û` already computed (by
/// [`UnitQuantizer::reconstruct`]), for scoring many queries.
pub fn score_with(u_hat: &[f32], row: &CodedRow, pq: &PreparedQuery) -> f64 {
    let mut dot: f64 = pq
        .rot
        .iter()
        .zip(u_hat)
        .map(|(&a, &b)| f64::from(a) * f64::from(b))
        .sum();
    if let Some((gr, bits)) = &row.qjl {
        dot += qjl::estimate(&pq.projected, bits, *gr);
    }
    f64::from(row.gamma) * dot
}

fn f16_section(kind: SectionKind, stream: u8, v: &[f16]) -> Section {
    let mut data = Vec::with_capacity(2 * v.len());
    for x in v {
        data.extend_from_slice(&x.to_le_bytes());
    }
    Section {
        kind,
        stream,
        elem: ElemType::F16,
        count: v.len() as u32,
        data,
    }
}

fn count_u32(n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| Error::param("page over 2^32 elements"))
}

/// Signs for every plane of a page (`plane = batch * heads + head`).
fn plane_signs(opts: &Options, t: &TensorInfo, with_qjl: bool) -> Vec<PlaneSigns> {
    (0..t.planes())
        .map(|p| PlaneSigns::new(opts, t, (p % t.heads as usize) as u32, with_qjl))
        .collect()
}

/// Encodes a page with the unit quantizer: SCALE 0 (f32 `γ` per row),
/// INDEX `k` for each code stream, and with QJL SCALE 1 (f16 `γ_r`) and
/// INDEX `n_streams` (1-bit signs).
///
/// # Errors
/// [`Error::Parameter`] naming the row for non-finite input.
pub fn encode_unit_page(
    q: &dyn UnitQuantizer,
    opts: &Options,
    page: &PageIn<'_>,
) -> Result<Vec<Section>> {
    let d = page.head_dim();
    let rows = page.rows();
    let with_qjl = opts.qjl && page.tensor.kind.role() == Role::Key;
    let streams = q.streams();
    let mut codes: Vec<Vec<u8>> = streams.iter().map(|&(_, n)| vec![0u8; rows * n]).collect();
    let mut gammas = Vec::with_capacity(rows);
    let mut grs = Vec::new();
    let mut bits = vec![0u8; if with_qjl { rows * d } else { 0 }];
    let signs = plane_signs(opts, page.tensor, with_qjl);
    let mut sc = Scratch::new(d);
    let mut x = vec![0f32; d];
    let t = page.tokens as usize;
    for r in 0..rows {
        page.load_row(r, &mut x);
        let mut views: Vec<&mut [u8]> = codes
            .iter_mut()
            .zip(&streams)
            .map(|(c, &(_, n))| &mut c[r * n..(r + 1) * n])
            .collect();
        let qb = with_qjl.then(|| &mut bits[r * d..(r + 1) * d]);
        let (g, gr) = encode_row(q, &x, &signs[r / t], &mut sc, &mut views, qb)
            .map_err(|e| page.row_error(r, e))?;
        gammas.push(g);
        if let Some(gr) = gr {
            grs.push(gr);
        }
    }
    let mut out = vec![Section::f32s(SectionKind::Scale, 0, &gammas)];
    for (k, (c, &(b, _))) in codes.iter().zip(&streams).enumerate() {
        let mut packed = vec![0u8; bitpack::packed_len(c.len(), u32::from(b))];
        bitpack::pack_u8(c, u32::from(b), &mut packed);
        out.push(Section::packed(
            SectionKind::Index,
            k as u8,
            b,
            count_u32(c.len())?,
            packed,
        ));
    }
    if with_qjl {
        out.push(f16_section(SectionKind::Scale, 1, &grs));
        let mut packed = vec![0u8; bitpack::packed_len(bits.len(), 1)];
        bitpack::pack_u8(&bits, 1, &mut packed);
        out.push(Section::packed(
            SectionKind::Index,
            streams.len() as u8,
            1,
            count_u32(bits.len())?,
            packed,
        ));
    }
    Ok(out)
}

/// The unpacked content of a unit-coded page.
struct UnitPage<'p> {
    gammas: &'p [u8],
    codes: Vec<Vec<u8>>,
    qjl: Option<(Vec<f16>, Vec<u8>)>,
}

/// The checked sections of a unit-coded page ([`unit_sections`]).
#[derive(Debug)]
pub(crate) struct UnitSections<'p> {
    /// SCALE 0: f32 norm per row, finite and non-negative.
    pub gammas: &'p [u8],
    /// INDEX `k`: the packed codes of stream `k` of the unit quantizer.
    pub codes: Vec<&'p [u8]>,
    /// With QJL: SCALE 1 (f16 residual norm per row, finite) and INDEX
    /// `streams` (1 sign bit per element).
    pub qjl: Option<(&'p [u8], &'p [u8])>,
}

/// The checked layout of a unit-coded page of `rows` rows of `d` channels
/// whose unit quantizer writes `streams` (`(bits, codes per row)` each),
/// with QJL residual sections when `with_qjl`: exactly those sections with
/// their element types and counts, and finite norms. The CPU decoder and
/// the GPU staging both read pages through it.
///
/// # Errors
/// [`Error::Format`] naming the page for a missing, mistyped or extra
/// section or a non-finite or negative norm.
pub(crate) fn unit_sections<'p>(
    page: &'p PageView<'_>,
    streams: &[(u8, usize)],
    with_qjl: bool,
    rows: usize,
    d: usize,
) -> Result<UnitSections<'p>> {
    let gammas = expect_section(page, SectionKind::Scale, 0, ElemType::F32, rows)?;
    for r in 0..rows {
        let g = f32_at(gammas, r);
        if !(g.is_finite() && g >= 0.0) {
            return Err(page.error(format!("row {r}: norm {g} is not finite and non-negative")));
        }
    }
    let mut codes = Vec::with_capacity(streams.len());
    for (k, &(b, n)) in streams.iter().enumerate() {
        codes.push(expect_section(
            page,
            SectionKind::Index,
            k as u8,
            ElemType::Packed(b),
            rows * n,
        )?);
    }
    let qjl = if with_qjl {
        let g = expect_section(page, SectionKind::Scale, 1, ElemType::F16, rows)?;
        if let Some(r) = g
            .chunks_exact(2)
            .position(|c| !f16::from_le_bytes([c[0], c[1]]).is_finite())
        {
            return Err(page.error(format!("row {r}: QJL residual norm is not finite")));
        }
        let b = expect_section(
            page,
            SectionKind::Index,
            streams.len() as u8,
            ElemType::Packed(1),
            rows * d,
        )?;
        Some((g, b))
    } else {
        None
    };
    expect_section_count(page, 1 + streams.len() + if with_qjl { 2 } else { 0 })?;
    Ok(UnitSections { gammas, codes, qjl })
}

fn read_unit_page<'p>(
    q: &dyn UnitQuantizer,
    opts: &Options,
    page: &'p PageView<'_>,
    kind: Kind,
    rows: usize,
) -> Result<UnitPage<'p>> {
    let d = q.dim();
    let streams = q.streams();
    let s = unit_sections(
        page,
        &streams,
        opts.qjl && kind.role() == Role::Key,
        rows,
        d,
    )?;
    let codes = streams
        .iter()
        .zip(&s.codes)
        .map(|(&(b, n), bytes)| {
            let mut c = vec![0u8; rows * n];
            bitpack::unpack_u8(bytes, u32::from(b), &mut c);
            c
        })
        .collect();
    let qjl = s.qjl.map(|(g, b)| {
        let grs: Vec<f16> = g
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]))
            .collect();
        let mut bits = vec![0u8; rows * d];
        bitpack::unpack_u8(b, 1, &mut bits);
        (grs, bits)
    });
    Ok(UnitPage {
        gammas: s.gammas,
        codes,
        qjl,
    })
}

/// Decodes a unit-coded page (the sections of [`encode_unit_page`]).
///
/// # Errors
/// [`Error::Format`] naming the page for missing, extra or mistyped
/// sections and non-finite norms.
pub fn decode_unit_page(
    q: &dyn UnitQuantizer,
    opts: &Options,
    page: &PageView<'_>,
    out: &mut PageOut<'_>,
) -> Result<()> {
    let d = q.dim();
    let rows = out.rows();
    let p = read_unit_page(q, opts, page, out.tensor.kind, rows)?;
    let signs = plane_signs(opts, out.tensor, p.qjl.is_some());
    let streams = q.streams();
    let mut sc = Scratch::new(d);
    let mut row = vec![0f32; d];
    let t = out.tokens as usize;
    for r in 0..rows {
        let views: Vec<&[u8]> = p
            .codes
            .iter()
            .zip(&streams)
            .map(|(c, &(_, n))| &c[r * n..(r + 1) * n])
            .collect();
        let qjl = p.qjl.as_ref().map(|(g, b)| (g[r], &b[r * d..(r + 1) * d]));
        decode_row(
            q,
            f32_at(p.gammas, r),
            &views,
            qjl,
            &signs[r / t],
            &mut sc,
            &mut row,
        );
        out.store_row(r, &row);
    }
    Ok(())
}

/// Compressed-domain scores `q . k_t` of every token of `plane` in a K page
/// (paper Eq. 13, with the QJL correction of C.15 when present), without
/// decoding the keys. `q` has `head_dim` values.
///
/// # Errors
/// [`Error::Format`] as [`decode_unit_page`]; [`Error::Parameter`] when
/// `plane` or `q.len()` does not fit `t`.
pub fn unit_scores(
    q: &dyn UnitQuantizer,
    opts: &Options,
    page: &PageView<'_>,
    t: &TensorInfo,
    plane: usize,
    query: &[f32],
) -> Result<Vec<f32>> {
    let d = q.dim();
    if plane >= t.planes() || query.len() != d {
        return Err(Error::param(format!(
            "scores: plane {plane} / query of {} values do not fit {} (planes {}, head_dim {d})",
            query.len(),
            t.describe(),
            t.planes()
        )));
    }
    let tokens = page.header.meta.tokens as usize;
    let rows = t.planes() * tokens;
    let p = read_unit_page(q, opts, page, t.kind, rows)?;
    let signs = PlaneSigns::new(opts, t, (plane % t.heads as usize) as u32, p.qjl.is_some());
    let pq = PreparedQuery::new(query, &signs);
    let streams = q.streams();
    let mut u_hat = vec![0f32; d];
    Ok((plane * tokens..(plane + 1) * tokens)
        .map(|r| {
            let row = CodedRow {
                gamma: f32_at(p.gammas, r),
                codes: p
                    .codes
                    .iter()
                    .zip(&streams)
                    .map(|(c, &(_, n))| c[r * n..(r + 1) * n].to_vec())
                    .collect(),
                qjl: p
                    .qjl
                    .as_ref()
                    .map(|(g, b)| (g[r], b[r * d..(r + 1) * d].to_vec())),
            };
            score(q, &row, &pq, &mut u_hat) as f32
        })
        .collect())
}

/// The value-group quantizer of V pages: exactly the value path of `kivi`
/// (format/codecs/kivi.md: per token, groups of `g` channels, asymmetric,
/// fp16 scale and fp16 zero point), reused as is.
fn value_groups(bits: u8, g: u16) -> super::kivi::Kivi {
    super::kivi::Kivi { bits, group: g }
}

/// Encodes a V page with value groups (the sections of a `kivi` value
/// page: SCALE 0 and ZERO 0 f16 per group, INDEX 0 `bits`-bit codes).
///
/// # Errors
/// [`Error::Parameter`] naming the page for NaN/inf or an fp16 overflow.
pub fn encode_group_page(bits: u8, g: u16, page: &PageIn<'_>) -> Result<Vec<Section>> {
    debug_assert_eq!(page.tensor.kind.role(), Role::Value);
    super::Codec::encode(&value_groups(bits, g), page)
}

/// Decodes a V page with value groups.
///
/// # Errors
/// [`Error::Format`] naming the page for missing, extra or mistyped
/// sections, a group that does not divide head_dim, or non-finite
/// scales.
pub fn decode_group_page(
    bits: u8,
    g: u16,
    page: &PageView<'_>,
    out: &mut PageOut<'_>,
) -> Result<()> {
    debug_assert_eq!(out.tensor.kind.role(), Role::Value);
    super::Codec::decode(&value_groups(bits, g), page, out)
}

/// Bits per element of a tensor: `(32 + code bits [+ 16 + d with QJL]) / d`
/// for unit-coded tensors, `bits + 32 / g` for value groups.
pub fn bits_per_element(opts: &Options, t: &TensorInfo, code_bits: usize) -> f64 {
    let d = f64::from(t.head_dim);
    match (unit_coded(opts, t.kind), opts.values) {
        (false, Values::Groups { bits, group }) => f64::from(bits) + 32.0 / f64::from(group),
        _ => {
            let qjl = if opts.qjl && t.kind.role() == Role::Key {
                16.0 + d
            } else {
                0.0
            };
            (32.0 + code_bits as f64 + qjl) / d
        }
    }
}
