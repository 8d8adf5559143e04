//! `innerq:k{bk}v{bv}`: InnerQ (Tayaranian Hosseini et al., "InnerQ:
//! Hardware-aware Tuning-free Quantization of KV Cache for Large Language
//! Models", arXiv:2602.23200; format/codecs/innerq.md).
//!
//! Group-wise quantization over the *inner* dimension of each decode
//! product (section 4.4): keys in groups of `G` channels within a token
//! (the inner dimension of `q K^T`), values in groups of `G` tokens within a
//! channel (the inner dimension of `P V`); `G = 32` by default.
//!
//! * Modes (section 4.1): asymmetric (`S = (max-min)/(2^b-1)`, fp32 zero
//!   point `Z = min`, Eq. 10-12), symmetric (`S = max|x|/(2^b-1)`, `b`-bit
//!   magnitudes plus a sign bit per element, Eq. 13) or hybrid (section
//!   4.1.2: per group, whichever of the two has the lower squared error,
//!   with a 1-bit mode flag). The paper's unified representation stores the
//!   32-bit zero point of an asymmetric group and the `G` sign bits of a
//!   symmetric group in the same `G`-bit slot (`G >= 32`, a multiple of 32).
//!   Scales are fp16.
//! * High-precision windows (section 4.2): 32 sink and 96 recent tokens at
//!   source precision ([`Codec::default_windows`]).
//! * Key normalization (section 4.3, Algorithm 2 line 18): per (layer, kv
//!   head, channel) `n_c = sqrt(max_t |K_{t,c}|)` over the compressed tokens,
//!   computed by [`Codec::prepare`] and stored in the parameter block. Keys
//!   are divided by `n_c` before quantization and multiplied back at decode.
//!   A fused attention kernel skips the multiplication by scaling the query
//!   once instead: `q . k = sum_c (q_c n_c) k'_c` where `k'` is the
//!   dequantized normalized key (the paper folds `n` into `W_Q` and `1/n`
//!   into `W_K`).
//!
//! Bits per element of the quantized body: `b + 48 / G` (fp16 scale + the
//! 32-bit zero/sign slot per group), plus `1 / G` in hybrid mode.
//!
//! Sections per page: SCALE stream 0 (f16 per group), ZERO stream 0 (u32,
//! `G/32` words per group: the unified zero point / sign slot), AUX stream
//! 0 (hybrid only: 1-bit mode flags, 1 = symmetric), INDEX stream 0 (`b`-bit
//! codes in element order). Group order: `codec/groups.rs`.

use std::sync::Arc;

use crate::cache::{Kind, Role, TensorInfo};
use crate::error::{Error, Result};
use crate::format::{ElemType, PageView, Section, SectionKind};
use crate::kernels::{bitpack, group};
use crate::plan::Layout;

use super::groups::{Axis, Groups};
use super::{
    Codec, Example, Family, PageIn, PageOut, expect_section, expect_section_count, f32_at, pagebuf,
};

/// Codec id of `innerq`.
pub const ID: u16 = 7;
/// Default group size `G`.
pub const DEFAULT_GROUP: u16 = 32;
/// Largest group size.
pub const MAX_GROUP: u16 = 1024;
/// Default sink window (attention sinks), tokens (paper section 5.1).
pub const DEFAULT_SINK: u32 = 32;
/// Default recent window, tokens (paper section 5.1).
pub const DEFAULT_RECENT: u32 = 96;

/// How each group is quantized (paper section 4.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Asymmetric: scale and fp32 zero point (the group minimum).
    Asym,
    /// Symmetric: scale and one sign bit per element.
    Sym,
    /// Per group, the mode with the lower squared error; a 1-bit flag says
    /// which.
    Hybrid,
}

impl Mode {
    /// The mode's code in the parameter block (0 asym, 1 sym, 2 hybrid).
    pub(crate) fn code(self) -> u8 {
        match self {
            Mode::Asym => 0,
            Mode::Sym => 1,
            Mode::Hybrid => 2,
        }
    }

    /// The mode of parameter-block code `c`.
    pub(crate) fn from_code(c: u8) -> Option<Mode> {
        Some(match c {
            0 => Mode::Asym,
            1 => Mode::Sym,
            2 => Mode::Hybrid,
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        match self {
            Mode::Asym => "asym",
            Mode::Sym => "sym",
            Mode::Hybrid => "hybrid",
        }
    }
}

/// Key normalization factors of one layer: `factors[h * head_dim + c]` =
/// `sqrt(max |K|)` of channel `c` of kv head `h` (shared by the batch).
#[derive(Debug, Clone, PartialEq)]
pub struct NormEntry {
    /// Layer index.
    pub layer: u32,
    /// KV heads.
    pub heads: u32,
    /// Elements per head vector.
    pub head_dim: u32,
    /// `heads * head_dim` positive finite factors.
    pub factors: Vec<f32>,
}

/// The InnerQ codec.
#[derive(Debug, Clone, PartialEq)]
pub struct InnerQ {
    /// Key code bits, 1..=8.
    pub key_bits: u8,
    /// Value code bits, 1..=8.
    pub value_bits: u8,
    /// Quantization mode of every group.
    pub mode: Mode,
    /// Group size `G`: a multiple of 32, at most [`MAX_GROUP`].
    pub group: u16,
    /// Whether keys are normalized per channel.
    pub normalize: bool,
    /// Normalization factors per layer, ascending; `None` until
    /// [`Codec::prepare`] (or reading a file) provides them.
    pub norms: Option<Arc<Vec<NormEntry>>>,
}

/// Registry entry of `innerq`.
pub const FAMILY: Family = Family {
    id: ID,
    name: "innerq",
    syntax: "innerq:k{b}v{b}[:hybrid|:sym|:asym][:g{G}][:nonorm] e.g. innerq:k2v2",
    summary: "InnerQ: inner-dimension groups of 32, hybrid sym/asym, key normalization, 32 sink + 96 recent raw",
    parse,
    from_params: |p| Ok(Box::new(InnerQ::from_params(p)?)),
    examples: &[
        Example {
            name: "innerq:k2v2",
            min_snr_db: 11.0,
        },
        Example {
            name: "innerq:k3v2:sym",
            min_snr_db: 11.0,
        },
        Example {
            name: "innerq:k4v3:asym:nonorm",
            min_snr_db: 14.0,
        },
    ],
};

fn valid_group(g: u16) -> bool {
    (32..=MAX_GROUP).contains(&g) && g.is_multiple_of(32)
}

fn parse(s: &str) -> Option<Result<Box<dyn Codec>>> {
    let rest = s.strip_prefix("innerq")?;
    let bad = || {
        Some(Err(Error::param(format!(
            "{s:?}: InnerQ takes innerq:k{{bits}}v{{bits}}[:hybrid|:sym|:asym][:g{{G}}][:nonorm] \
             with bits 1..8 and G a multiple of 32 up to {MAX_GROUP}, e.g. innerq:k2v2"
        ))))
    };
    let mut parts = rest.split(':');
    if parts.next() != Some("") {
        return bad();
    }
    let Some((k, v)) = parts
        .next()
        .and_then(|kv| kv.strip_prefix('k'))
        .and_then(|kv| kv.split_once('v'))
    else {
        return bad();
    };
    let (Ok(key_bits), Ok(value_bits)) = (k.parse::<u8>(), v.parse::<u8>()) else {
        return bad();
    };
    let mut c = InnerQ {
        key_bits,
        value_bits,
        mode: Mode::Hybrid,
        group: DEFAULT_GROUP,
        normalize: true,
        norms: None,
    };
    for opt in parts {
        match opt {
            "hybrid" => c.mode = Mode::Hybrid,
            "sym" => c.mode = Mode::Sym,
            "asym" => c.mode = Mode::Asym,
            "nonorm" => c.normalize = false,
            _ => match opt.strip_prefix('g').and_then(|g| g.parse::<u16>().ok()) {
                Some(g) => c.group = g,
                None => return bad(),
            },
        }
    }
    if !(1..=8).contains(&key_bits) || !(1..=8).contains(&value_bits) || !valid_group(c.group) {
        return bad();
    }
    Some(Ok(Box::new(c)))
}

/// Fixed part of the parameter block, bytes.
const FIXED_PARAMS: usize = 12;

impl InnerQ {
    /// Parses the parameter block (format/codecs/innerq.md): the codec's
    /// one reader of it, used by its registry entry and the GPU staging.
    ///
    /// # Errors
    /// [`Error::Parameter`] for a short block, an unknown mode, fields out
    /// of range, set reserved bytes or a malformed normalization entry.
    pub fn from_params(p: &[u8]) -> Result<InnerQ> {
        let err = |m: String| Error::param(format!("innerq parameters: {m}"));
        if p.len() < FIXED_PARAMS {
            return Err(err(format!(
                "{} bytes, need at least {FIXED_PARAMS}",
                p.len()
            )));
        }
        let (key_bits, value_bits, mode, flags) = (p[0], p[1], p[2], p[3]);
        let group = u16::from_le_bytes([p[4], p[5]]);
        let n = u32::from_le_bytes(p[8..12].try_into().expect("4")) as usize;
        let mode = Mode::from_code(mode).ok_or_else(|| err(format!("unknown mode {mode}")))?;
        if !(1..=8).contains(&key_bits)
            || !(1..=8).contains(&value_bits)
            || !valid_group(group)
            || flags > 1
            || p[6..8] != [0, 0]
        {
            return Err(err(format!(
                "out of range: key bits {key_bits}, value bits {value_bits}, group {group}, \
             flags {flags}, reserved {:02x?}",
                &p[6..8]
            )));
        }
        let normalize = flags & 1 == 1;
        if !normalize && n != 0 {
            return Err(err(format!("{n} normalization entries without the flag")));
        }
        let mut rest = &p[FIXED_PARAMS..];
        let mut entries: Vec<NormEntry> = Vec::new();
        for i in 0..n {
            if rest.len() < 12 {
                return Err(err(format!("entry {i} is truncated")));
            }
            let word = |k: usize| u32::from_le_bytes(rest[4 * k..4 * k + 4].try_into().expect("4"));
            let (layer, heads, head_dim) = (word(0), word(1), word(2));
            let nf = (heads as usize)
                .checked_mul(head_dim as usize)
                .filter(|&nf| nf >= 1 && nf.checked_mul(4).is_some_and(|b| b <= rest.len() - 12))
                .ok_or_else(|| {
                    err(format!(
                        "entry {i}: {heads} heads x {head_dim} channels do not fit the block"
                    ))
                })?;
            if entries.last().is_some_and(|e| e.layer >= layer) {
                return Err(err(format!("entry {i}: layers not strictly ascending")));
            }
            let factors: Vec<f32> = (0..nf).map(|k| f32_at(&rest[12..], k)).collect();
            if let Some(k) = factors.iter().position(|f| !(f.is_finite() && *f > 0.0)) {
                return Err(err(format!(
                    "layer {layer}: factor {k} is {}, must be positive and finite",
                    factors[k]
                )));
            }
            entries.push(NormEntry {
                layer,
                heads,
                head_dim,
                factors,
            });
            rest = &rest[12 + 4 * nf..];
        }
        if !rest.is_empty() {
            return Err(err(format!("{} bytes left over", rest.len())));
        }
        Ok(InnerQ {
            key_bits,
            value_bits,
            mode,
            group,
            normalize,
            norms: normalize.then(|| Arc::new(entries)),
        })
    }
}

/// The checked sections of one InnerQ page ([`InnerQ::page`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct InnerQPage<'p> {
    /// The page's quantization groups.
    pub groups: Groups,
    /// SCALE stream 0: f16 per group, all finite.
    pub scales: &'p [u8],
    /// ZERO stream 0: `G / 32` u32 slot words per group (fp32 zero point
    /// then zero words, or sign bits with no bit set past the group).
    pub slots: &'p [u8],
    /// AUX stream 0 (hybrid mode only): 1 bit per group, 1 = symmetric.
    pub flags: Option<&'p [u8]>,
    /// INDEX stream 0: `bits`-bit codes in element order.
    pub index: &'p [u8],
    mode: Mode,
}

impl InnerQPage<'_> {
    /// Whether group `g` is coded symmetrically (sign bits in its slot).
    pub fn symmetric(&self, g: usize) -> bool {
        match (self.mode, self.flags) {
            (Mode::Sym, _) => true,
            (Mode::Hybrid, Some(m)) => m[g / 8] >> (g % 8) & 1 == 1,
            _ => false,
        }
    }
}

/// Groups of `group` elements of a page: keys along channels, values
/// along tokens (format/codecs/innerq.md).
fn groups_of(group: u16, kind: Kind, planes: usize, tokens: usize, head_dim: usize) -> Groups {
    Groups {
        axis: match kind.role() {
            Role::Key => Axis::Channels,
            Role::Value => Axis::Tokens,
        },
        size: usize::from(group),
        planes,
        tokens,
        head_dim,
    }
}

/// The checked layout of a page of `planes x tokens` rows of a tensor of
/// `kind` and `head_dim`, for groups of `group` elements, `mode` and
/// `bits`-bit codes: exactly the sections of the mode with their element
/// types and counts, finite scales, and slots the decoder accepts. The CPU
/// decoder and the GPU staging both read pages through it.
///
/// # Errors
/// [`Error::Format`] naming the page for a key page whose head_dim is not
/// a multiple of the group, a missing, mistyped or extra section, a
/// non-finite scale or zero point, set reserved slot words or sign bits
/// past a group's elements.
#[allow(clippy::too_many_arguments)]
pub(crate) fn page_layout<'p>(
    page: &'p PageView<'_>,
    mode: Mode,
    group: u16,
    bits: u8,
    kind: Kind,
    planes: usize,
    tokens: usize,
    head_dim: usize,
) -> Result<InnerQPage<'p>> {
    let d = head_dim;
    if kind.role() == Role::Key && !d.is_multiple_of(usize::from(group)) {
        return Err(page.error(format!(
            "key page with head_dim {d}, not a multiple of the group size {group}"
        )));
    }
    let groups = groups_of(group, kind, planes, tokens, head_dim);
    let n = groups.count();
    let w = usize::from(group) / 32;
    let scales = expect_section(page, SectionKind::Scale, 0, ElemType::F16, n)?;
    let slots = expect_section(page, SectionKind::Zero, 0, ElemType::U32, n * w)?;
    let flags = match mode {
        Mode::Hybrid => Some(expect_section(
            page,
            SectionKind::Aux,
            0,
            ElemType::Packed(1),
            n,
        )?),
        _ => None,
    };
    let index = expect_section(
        page,
        SectionKind::Index,
        0,
        ElemType::Packed(bits),
        planes * tokens * d,
    )?;
    expect_section_count(page, 3 + usize::from(flags.is_some()))?;
    let p = InnerQPage {
        groups,
        scales,
        slots,
        flags,
        index,
        mode,
    };
    for g in 0..n {
        let s = pagebuf::f16_at(scales, g);
        if !s.is_finite() {
            return Err(page.error(format!("group {g}: scale is {s}")));
        }
        let slot = |k: usize| pagebuf::u32_at(slots, g * w + k);
        if p.symmetric(g) {
            // Sign bits past the group's elements must be zero.
            let len = groups.span(g).len;
            for k in 0..w {
                let used = len.saturating_sub(32 * k).min(32);
                let unused = if used == 32 { 0 } else { u32::MAX << used };
                if slot(k) & unused != 0 {
                    return Err(
                        page.error(format!("group {g}: sign bits set past its {len} elements"))
                    );
                }
            }
        } else {
            let z = f32::from_bits(slot(0));
            if !z.is_finite() || (1..w).any(|k| slot(k) != 0) {
                return Err(page.error(format!(
                    "group {g}: zero point {z} not finite or reserved slot words set"
                )));
            }
        }
    }
    Ok(p)
}

impl InnerQ {
    /// Code bits of tensors of `kind`.
    pub(crate) fn bits_for(&self, kind: Kind) -> u8 {
        match kind.role() {
            Role::Key => self.key_bits,
            Role::Value => self.value_bits,
        }
    }

    /// Words of the zero point / sign slot per group: `G / 32`.
    fn words(&self) -> usize {
        usize::from(self.group) / 32
    }

    fn groups(&self, kind: Kind, planes: usize, tokens: usize, head_dim: usize) -> Groups {
        groups_of(self.group, kind, planes, tokens, head_dim)
    }

    /// The normalization factors of a key tensor: `None` when keys are not
    /// normalized.
    ///
    /// # Errors
    /// A message when normalization is on but the codec was not prepared or
    /// has no matching entry for the tensor's layer and shape.
    pub(crate) fn factors_for(
        &self,
        t: &TensorInfo,
    ) -> std::result::Result<Option<&NormEntry>, String> {
        if !self.normalize || t.kind.role() != Role::Key {
            return Ok(None);
        }
        let norms = self.norms.as_ref().ok_or_else(|| {
            "InnerQ key normalization needs Codec::prepare before encoding".to_string()
        })?;
        let e = norms
            .iter()
            .find(|e| e.layer == t.layer)
            .ok_or_else(|| format!("no key normalization entry for layer {}", t.layer))?;
        if (e.heads, e.head_dim) != (t.heads, t.head_dim) {
            return Err(format!(
                "the key normalization entry of layer {} is for {} heads x {} channels, \
                 the tensor has {} x {}",
                t.layer, e.heads, e.head_dim, t.heads, t.head_dim
            ));
        }
        Ok(Some(e))
    }
}

/// Applies `op(x, n_{h,c})` to every element of a page buffer (plane-major
/// rows of `head_dim`, plane `p` of head `p % heads`).
fn apply_factors(e: &NormEntry, tokens: usize, buf: &mut [f32], op: impl Fn(f32, f32) -> f32) {
    let d = e.head_dim as usize;
    for (r, row) in buf.chunks_exact_mut(d).enumerate() {
        let head = (r / tokens.max(1)) % e.heads as usize;
        for (x, &f) in row.iter_mut().zip(&e.factors[head * d..(head + 1) * d]) {
            *x = op(*x, f);
        }
    }
}

/// One quantized group: codes are written by the caller's buffer.
struct Coded {
    scale: half::f16,
    sym: bool,
    /// Zero point bits (asym) or sign words (sym), `G/32` words.
    slot: [u32; MAX_GROUP as usize / 32],
}

impl InnerQ {
    /// Quantizes one group (`vals`, at most `G` values) into `codes`.
    fn quantize_group(
        &self,
        vals: &[f32],
        levels: u32,
        codes: &mut [u8],
        alt: &mut [u8],
    ) -> Result<Coded> {
        let (mn, mx) = group::min_max(vals)?;
        let mut slot = [0u32; MAX_GROUP as usize / 32];
        let asym = |codes: &mut [u8]| -> Result<group::AsymParams> {
            let p = group::asym_params(mn, mx, levels, false)?;
            group::quantize_asym(vals, p, levels, codes);
            Ok(p)
        };
        let sym = |codes: &mut [u8], slot: &mut [u32]| -> Result<half::f16> {
            let s = group::sym_scale(mn.abs().max(mx.abs()), levels)?;
            group::quantize_sym(vals, s, levels, codes, slot);
            Ok(s)
        };
        match self.mode {
            Mode::Asym => {
                let p = asym(codes)?;
                slot[0] = p.zero.to_bits();
                Ok(Coded {
                    scale: p.scale,
                    sym: false,
                    slot,
                })
            }
            Mode::Sym => {
                let s = sym(codes, &mut slot)?;
                Ok(Coded {
                    scale: s,
                    sym: true,
                    slot,
                })
            }
            Mode::Hybrid => {
                // Symmetric into `codes`, asymmetric into `alt`; keep the
                // one with the lower squared error (ties: symmetric).
                let s = sym(codes, &mut slot)?;
                let p = asym(alt)?;
                let (sf, af) = (s.to_f32(), p.scale.to_f32());
                let (mut e_sym, mut e_asym) = (0f64, 0f64);
                for (i, ((&x, &qs), &qa)) in
                    vals.iter().zip(codes.iter()).zip(alt.iter()).enumerate()
                {
                    let neg = slot[i / 32] >> (i % 32) & 1 == 1;
                    let es = f64::from(x) - f64::from(group::dequantize_sym(qs, sf, neg));
                    let ea = f64::from(x) - f64::from(group::dequantize_asym(qa, af, p.zero));
                    e_sym += es * es;
                    e_asym += ea * ea;
                }
                if e_sym <= e_asym {
                    Ok(Coded {
                        scale: s,
                        sym: true,
                        slot,
                    })
                } else {
                    codes.copy_from_slice(alt);
                    let mut slot = [0u32; MAX_GROUP as usize / 32];
                    slot[0] = p.zero.to_bits();
                    Ok(Coded {
                        scale: p.scale,
                        sym: false,
                        slot,
                    })
                }
            }
        }
    }
}

impl Codec for InnerQ {
    fn size_depends_only_on_shape(&self) -> bool {
        true
    }

    fn name(&self) -> String {
        let mut n = format!("innerq:k{}v{}", self.key_bits, self.value_bits);
        if self.mode != Mode::Hybrid {
            n.push(':');
            n.push_str(self.mode.name());
        }
        if self.group != DEFAULT_GROUP {
            n.push_str(&format!(":g{}", self.group));
        }
        if !self.normalize {
            n.push_str(":nonorm");
        }
        n
    }

    fn id(&self) -> u16 {
        ID
    }

    fn params(&self) -> Vec<u8> {
        let g = self.group.to_le_bytes();
        let mut p = vec![
            self.key_bits,
            self.value_bits,
            self.mode.code(),
            u8::from(self.normalize),
            g[0],
            g[1],
            0,
            0,
        ];
        let entries: &[NormEntry] = self.norms.as_deref().map_or(&[], |v| v.as_slice());
        p.extend((entries.len() as u32).to_le_bytes());
        for e in entries {
            for w in [e.layer, e.heads, e.head_dim] {
                p.extend(w.to_le_bytes());
            }
            for f in &e.factors {
                p.extend(f.to_le_bytes());
            }
        }
        p
    }

    fn check(&self, t: &TensorInfo) -> Result<()> {
        if t.kind.role() == Role::Key && !t.head_dim.is_multiple_of(u32::from(self.group)) {
            return Err(Error::param(format!(
                "{} groups keys over {} channels, but {} ({}) has head_dim {}",
                self.name(),
                self.group,
                t.name,
                t.describe(),
                t.head_dim
            )));
        }
        if self.norms.is_some() {
            self.factors_for(t)
                .map_err(|m| Error::param(format!("{} ({}): {m}", t.name, t.describe())))?;
        }
        Ok(())
    }

    fn prepare(
        &self,
        cache: &crate::view::CacheView<'_>,
        layout: &Layout,
    ) -> Result<Option<Box<dyn Codec>>> {
        if !self.normalize {
            return Ok(None);
        }
        let mut entries = Vec::new();
        for t in cache
            .tensors
            .iter()
            .filter(|t| t.info.kind.role() == Role::Key)
        {
            let i = &t.info;
            let (d, total) = (i.head_dim as usize, i.tokens);
            // The body as crate::plan cuts it: after the sink window, before
            // the recent window.
            let sink_end = layout.sink.min(total);
            let recent_start = total.saturating_sub(layout.recent).max(sink_end);
            let mut amax = vec![0f32; i.heads as usize * d];
            let mut row = vec![0f32; d];
            for p in 0..i.planes() {
                let h = p % i.heads as usize;
                for tok in sink_end as usize..recent_start as usize {
                    t.load_row(p, tok, &mut row);
                    for (m, &x) in amax[h * d..(h + 1) * d].iter_mut().zip(&row) {
                        if !x.is_finite() {
                            return Err(Error::param(format!(
                                "{} ({}) token {tok}: non-finite key (NaN or inf)",
                                i.name,
                                i.describe()
                            )));
                        }
                        *m = m.max(x.abs());
                    }
                }
            }
            let factors = amax
                .iter()
                .map(|&m| if m > 0.0 { m.sqrt() } else { 1.0 })
                .collect();
            entries.push(NormEntry {
                layer: i.layer,
                heads: i.heads,
                head_dim: i.head_dim,
                factors,
            });
        }
        Ok(Some(Box::new(InnerQ {
            norms: Some(Arc::new(entries)),
            ..self.clone()
        })))
    }

    fn default_windows(&self) -> (u32, u32) {
        (DEFAULT_SINK, DEFAULT_RECENT)
    }

    fn encode(&self, page: &PageIn<'_>) -> Result<Vec<Section>> {
        let d = page.head_dim();
        let tokens = page.tokens as usize;
        let kind = page.tensor.kind;
        let bits = self.bits_for(kind);
        let levels = (1u32 << bits) - 1;
        let mut buf = pagebuf::load(page);
        let norm = self
            .factors_for(page.tensor)
            .map_err(|m| Error::param(format!("{}: {m}", pagebuf::label(page))))?;
        if let Some(e) = norm {
            apply_factors(e, tokens, &mut buf, |x, n| x / n);
        }
        let gr = self.groups(kind, page.planes.len(), tokens, d);
        let n = gr.count();
        let w = self.words();
        let mut scales = Vec::with_capacity(n);
        let mut slots = Vec::with_capacity(n * w);
        let mut modes = Vec::with_capacity(if self.mode == Mode::Hybrid { n } else { 0 });
        let mut codes = vec![0u8; buf.len()];
        let mut vals = Vec::with_capacity(gr.size);
        let (mut q, mut alt) = (vec![0u8; gr.size], vec![0u8; gr.size]);
        for g in 0..n {
            let span = gr.span(g);
            vals.clear();
            vals.extend(span.positions().map(|p| buf[p]));
            let q = &mut q[..span.len];
            let c = self
                .quantize_group(&vals, levels, q, &mut alt[..span.len])
                .map_err(|e| pagebuf::at(page, span.start, e))?;
            for (pos, &code) in span.positions().zip(q.iter()) {
                codes[pos] = code;
            }
            scales.push(c.scale);
            slots.extend_from_slice(&c.slot[..w]);
            if self.mode == Mode::Hybrid {
                modes.push(u8::from(c.sym));
            }
        }
        let mut index = vec![0u8; bitpack::packed_len(codes.len(), u32::from(bits))];
        bitpack::pack_u8(&codes, u32::from(bits), &mut index);
        let mut out = vec![
            pagebuf::f16s(SectionKind::Scale, 0, &scales),
            pagebuf::u32s(SectionKind::Zero, 0, &slots),
        ];
        if self.mode == Mode::Hybrid {
            let mut mask = vec![0u8; bitpack::packed_len(n, 1)];
            bitpack::pack_u8(&modes, 1, &mut mask);
            out.push(Section::packed(
                SectionKind::Aux,
                0,
                1,
                pagebuf::count(n)?,
                mask,
            ));
        }
        out.push(Section::packed(
            SectionKind::Index,
            0,
            bits,
            pagebuf::count(codes.len())?,
            index,
        ));
        Ok(out)
    }

    fn decode(&self, page: &PageView<'_>, out: &mut PageOut<'_>) -> Result<()> {
        let d = out.tensor.head_dim as usize;
        let tokens = out.tokens as usize;
        let n_el = out.rows() * d;
        let kind = out.tensor.kind;
        let bits = self.bits_for(kind);
        let w = self.words();
        let norm = self.factors_for(out.tensor).map_err(|m| page.error(m))?;
        let p = page_layout(
            page,
            self.mode,
            self.group,
            bits,
            kind,
            out.planes.len(),
            tokens,
            d,
        )?;
        let mut codes = vec![0u8; n_el];
        bitpack::unpack_u8(p.index, u32::from(bits), &mut codes);
        let mut buf = vec![0f32; n_el];
        for g in 0..p.groups.count() {
            let span = p.groups.span(g);
            let s = pagebuf::f16_at(p.scales, g);
            let slot = |k: usize| pagebuf::u32_at(p.slots, g * w + k);
            if p.symmetric(g) {
                for (i, pos) in span.positions().enumerate() {
                    let neg = slot(i / 32) >> (i % 32) & 1 == 1;
                    buf[pos] = group::dequantize_sym(codes[pos], s, neg);
                }
            } else {
                let z = f32::from_bits(slot(0));
                for pos in span.positions() {
                    buf[pos] = group::dequantize_asym(codes[pos], s, z);
                }
            }
        }
        if let Some(e) = norm {
            apply_factors(e, tokens, &mut buf, |x, n| x * n);
        }
        pagebuf::store(out, &buf);
        Ok(())
    }

    fn bits_per_element(&self, t: &TensorInfo) -> f64 {
        let g = f64::from(self.group);
        let flag = if self.mode == Mode::Hybrid { 1.0 } else { 0.0 };
        f64::from(self.bits_for(t.kind)) + (48.0 + flag) / g
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for n in [
            "innerq:k2v2",
            "innerq:k3v2",
            "innerq:k3v3:sym",
            "innerq:k2v2:asym",
            "innerq:k4v4:g64",
            "innerq:k2v2:sym:nonorm",
        ] {
            let c = crate::codec::parse(n).unwrap();
            assert_eq!(c.name(), n);
            assert_eq!(InnerQ::from_params(&c.params()).unwrap().name(), n);
        }
        assert_eq!(
            crate::codec::parse("innerq:k2v2:hybrid").unwrap().name(),
            "innerq:k2v2"
        );
        for n in [
            "innerq",
            "innerq:k2",
            "innerq:k0v2",
            "innerq:k2v9",
            "innerq:k2v2:g16",
            "innerq:k2v2:g48",
            "innerq:k2v2:foo",
            "innerqk2v2",
        ] {
            assert!(crate::codec::parse(n).is_err(), "{n}");
        }
    }

    #[test]
    fn bad_parameter_blocks_are_rejected() {
        let good = crate::codec::parse("innerq:k2v2").unwrap();
        let mut p = good.params();
        assert!(InnerQ::from_params(&p).is_ok());
        p[2] = 3;
        assert!(InnerQ::from_params(&p).is_err());
        let mut p = good.params();
        p[6] = 1;
        assert!(InnerQ::from_params(&p).is_err());
        // One entry with a zero factor, then a truncated one.
        let mut p = good.params();
        p[8] = 1;
        for w in [0u32, 1, 2] {
            p.extend(w.to_le_bytes());
        }
        p.extend(1.0f32.to_le_bytes());
        p.extend(0.0f32.to_le_bytes());
        assert!(InnerQ::from_params(&p).is_err());
        let n = p.len();
        p[n - 4..].copy_from_slice(&2.0f32.to_le_bytes());
        assert!(InnerQ::from_params(&p).is_ok());
        assert!(InnerQ::from_params(&p[..n - 1]).is_err());
        // Entries without the flag.
        p[3] = 0;
        assert!(InnerQ::from_params(&p).is_err());
    }
}
