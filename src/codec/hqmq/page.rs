//! HQMQ page sections (format/codecs/hqmq.md "Page sections"): encoding
//! and decoding of one page.
//!
//! With `R` rows (plane-major, format/SPEC.md section 6.3), `n_c =
//! head_dim / 4` chunks per row and `n_in` inlier chunks:
//!
//! | kind | stream | element type | count | content |
//! |---|---|---|---|---|
//! | SCALE | 0 | f16 | `R` | per-row radius scale `sigma_r` |
//! | SCALE | 1 | f16 | `planes * head_dim` | only with `+chan`: per-channel gain `g_{p,c}` |
//! | SCALE | 1 | f16 | `2 * planes * head_dim` | only with `+ctr`: per plane the gains `g_{p,c}`, then the offsets `m_{p,c}` |
//! | INDEX | 0 | packed, `E` bits | `n_in` | low `E` bits of each inlier symbol |
//! | INDEX | 1 | bytes | `ceil(ceil(n_in/G) W / 8)` | base-`O` digits of the symbols, mixed radix |
//! | OUTLIERS | 0 | bytes | table | only with `+med{C}`: unit 4, fp16 chunks |

use half::f16;

use crate::error::{Error, Result};
use crate::format::{ElemType, PageView, Section, SectionKind};
use crate::kernels::bitpack;

use super::super::outliers::OutlierTable;
use super::super::{PageIn, PageOut, expect_section, expect_section_count};
use super::{Channels, Directions, Hqmq, Shared, search};

/// `1.5 * 2^23`: `(t + M) - M` rounds `t` in `[0, 2^22]` to the nearest
/// integer, ties to even.
const RNE_MAGIC: f32 = 12_582_912.0;

/// Largest finite fp16 value: scales and outlier values are stored in fp16.
const F16_MAX: f32 = 65504.0;

/// The smallest fp16 value `>= v` (`v` finite, `>= 0`), or `None` above
/// the fp16 range.
fn f16_ceil(v: f32) -> Option<f16> {
    let h = f16::from_f32(v);
    let h = if h.to_f32() < v {
        f16::from_bits(h.to_bits() + 1)
    } else {
        h
    };
    h.is_finite().then_some(h)
}

/// A page's chunks in structure-of-arrays form and their radii: what
/// every configuration encoding the page computes first.
#[derive(Debug, Clone)]
pub(super) struct Chunks {
    /// Component `k` of chunk `i` (row `i / n_c`, chunk `i % n_c`) at
    /// `xs[k][i]`, divided by its channel's gain with `+chan`, less its
    /// channel's offset and then divided by its gain with `+ctr`.
    xs: [Vec<f32>; 4],
    /// With `+chan` or `+ctr`: the gain of channel `c` of plane `p` at `[p
    /// * head_dim + c]` (fp16 values), else empty.
    gains: Vec<f32>,
    /// With `+ctr`: the offset of channel `c` of plane `p` at `[p *
    /// head_dim + c]` (fp16 values), else empty.
    offsets: Vec<f32>,
    /// `|x_i|`: `sqrt(((a*a + b*b) + c*c) + d*d)` in binary32.
    radii: Vec<f32>,
}

/// The chunks of `page` (`n` of them, `nc` per row) and their radii; with
/// `+chan`, each channel of each plane divided by its gain first
/// (format/codecs/hqmq.md encoding rule 1, "Gains"); with `+ctr`, centred
/// and divided by its gain (rule 1, "Centring").
///
/// # Errors
/// [`Error::Parameter`] naming the row of a value that is not finite or
/// outside the fp16 range.
#[inline(always)]
fn load_chunks(
    page: &PageIn<'_>,
    n: usize,
    nc: usize,
    channels: Channels,
    at_row: impl Fn(usize) -> String,
) -> Result<Chunks> {
    let d = 4 * nc;
    let mut xs: [Vec<f32>; 4] = std::array::from_fn(|_| vec![0f32; n]);
    let mut row = vec![0f32; d];
    for r in 0..page.rows() {
        page.load_row(r, &mut row);
        // Branch-free check (vectorizes); NaN fails the comparison.
        if !row.iter().fold(true, |ok, v| ok & (v.abs() <= F16_MAX))
            && let Some(v) = row
                .iter()
                .find(|v| v.abs().partial_cmp(&F16_MAX).is_none_or(|o| o.is_gt()))
        {
            return Err(Error::param(format!(
                "{}: value {v} cannot be encoded by hqmq (its scales and outliers are fp16: \
                 values must be finite and within +-65504)",
                at_row(r)
            )));
        }
        for (k, comp) in xs.iter_mut().enumerate() {
            for (dst, c) in comp[r * nc..(r + 1) * nc]
                .iter_mut()
                .zip(row.chunks_exact(4))
            {
                *dst = c[k];
            }
        }
    }
    let (gains, offsets) = match channels {
        Channels::Off => (Vec::new(), Vec::new()),
        Channels::Gains => channel_statistics(&mut xs, page.tokens as usize, nc, false),
        Channels::Centred => channel_statistics(&mut xs, page.tokens as usize, nc, true),
    };
    let mut radii = vec![0f32; n];
    for ((((r, &a), &b), &c), &e) in radii
        .iter_mut()
        .zip(&xs[0])
        .zip(&xs[1])
        .zip(&xs[2])
        .zip(&xs[3])
    {
        *r = (((a * a + b * b) + c * c) + e * e).sqrt();
    }
    Ok(Chunks {
        xs,
        radii,
        gains,
        offsets,
    })
}

/// Per-channel gains and centring (format/codecs/hqmq.md encoding rule 1,
/// "Gains" and "Centring"): for every plane of `t` rows of `nc` chunks and
/// channel `c` (component `c % 4` of chunk `c / 4`), with `centred` the
/// offset `m_c` = the fp16 rounding (nearest, ties to even) of `s_c /
/// f32(t)`, `s_c` the binary32 sum of the channel's values in row order
/// (without, `m_c = 0`); `dev_c` = the largest `|x - m_c|` (binary32); the
/// gain `g_c` = the smallest fp16 value `>= sqrt(dev_c)` with `centred`
/// (correctly rounded square root), `>= dev_c` without; every value
/// becomes `(x - m_c) / g_c` (`0` where `g_c = 0`; `x - 0` is `x` exactly,
/// so without centring this is `x / g_c`). Returns `(gains, offsets)`, each
/// `[plane][head_dim]`, the offsets empty without `centred`.
fn channel_statistics(
    xs: &mut [Vec<f32>; 4],
    t: usize,
    nc: usize,
    centred: bool,
) -> (Vec<f32>, Vec<f32>) {
    let planes = xs[0].len() / (t * nc).max(1);
    let mut gains = vec![0f32; planes * 4 * nc];
    let mut offsets = vec![0f32; if centred { planes * 4 * nc } else { 0 }];
    for p in 0..planes {
        let span = p * t * nc..(p + 1) * t * nc;
        for (k, comp) in xs.iter_mut().enumerate() {
            let plane = &mut comp[span.clone()];
            let mut mean = vec![0f32; nc];
            if centred {
                // Sums in row order (the loop over c vectorizes; each
                // channel's additions stay in row order, as the rule says).
                for row in plane.chunks_exact(nc) {
                    for (s, v) in mean.iter_mut().zip(row) {
                        *s += v;
                    }
                }
                // |x| <= 65504, so the mean is in the fp16 range.
                for m in &mut mean {
                    *m = f16::from_f32(*m / t as f32).to_f32();
                }
            }
            let mut dev = vec![0f32; nc];
            for row in plane.chunks_exact(nc) {
                for ((d, v), m) in dev.iter_mut().zip(row).zip(&mean) {
                    *d = d.max((v - m).abs());
                }
            }
            for c in 0..nc {
                // |x| <= 65504 was checked: dev <= 131008 and sqrt(dev) <
                // 362, so the ceilings exist (65504 caps the guard).
                let g = if centred { dev[c].sqrt() } else { dev[c] };
                gains[p * 4 * nc + 4 * c + k] = f16_ceil(g).map_or(F16_MAX, f16::to_f32);
                if centred {
                    offsets[p * 4 * nc + 4 * c + k] = mean[c];
                }
            }
            let g = &gains[p * 4 * nc..(p + 1) * 4 * nc];
            for row in plane.chunks_exact_mut(nc) {
                for ((c, v), m) in row.iter_mut().enumerate().zip(&mean) {
                    let gc = g[4 * c + k];
                    *v = if gc > 0.0 { (*v - m) / gc } else { 0.0 };
                }
            }
        }
    }
    (gains, offsets)
}

/// What [`encode`] returns: the page's sections, or (with a
/// reconstruction) only their payload bytes and number.
pub(super) enum Coded {
    Sections(Vec<Section>),
    Sizes(super::Trial),
}

impl Coded {
    /// The sections (encodes without a reconstruction return them).
    pub(super) fn into_sections(self) -> Vec<Section> {
        match self {
            Coded::Sections(s) => s,
            Coded::Sizes(_) => unreachable!("sizes come only with a reconstruction"),
        }
    }
}

/// Encodes one page (format/codecs/hqmq.md "Encoding"). With `shared`,
/// the chunks and the direction search are taken from it when it holds
/// them for as many chunks (the search for `h`'s `S` and seed), else
/// computed and stored there ([`super::Hqmq::encode_shared`]). With
/// `recon`, the page as [`decode`] would return it is written there
/// (`[planes, tokens, head_dim]` f32, the page's row order) and only the
/// sizes of the sections are returned ([`super::Hqmq::trial`]).
pub(super) fn encode(
    h: &Hqmq,
    page: &PageIn<'_>,
    shared: Option<&mut Shared>,
    recon: Option<&mut [f32]>,
) -> Result<Coded> {
    // The loops vectorize 8 wide in the AVX2 build, with the same results.
    crate::kernels::with_avx2(
        #[inline(always)]
        || encode_page(h, page, shared, recon),
    )
}

/// [`encode`]'s body.
#[inline(always)]
fn encode_page(
    h: &Hqmq,
    page: &PageIn<'_>,
    shared: Option<&mut Shared>,
    recon: Option<&mut [f32]>,
) -> Result<Coded> {
    let info = page.tensor;
    let d = page.head_dim();
    if !d.is_multiple_of(4) {
        return Err(Error::param(format!(
            "{} ({}): head_dim {d} is not a multiple of 4",
            info.name,
            info.describe()
        )));
    }
    let nc = d / 4;
    let t = page.tokens as usize;
    let rows = page.rows();
    let planes = page.planes.len();
    let n = rows * nc;
    let at_row = |r: usize| {
        format!(
            "{} ({}) plane {} token {}",
            info.name,
            info.describe(),
            r / t,
            page.token_start as usize + r % t
        )
    };
    let universe = u32::try_from(n).map_err(|_| Error::param("hqmq page over 2^32 chunks"))?;
    if let Some(out) = &recon
        && out.len() != n * 4
    {
        return Err(Error::param(format!(
            "hqmq reconstruction buffer of {} values for a page of {}",
            out.len(),
            n * 4
        )));
    }

    // Chunks (structure of arrays) and their radii.
    let fresh_chunks;
    let (chunks, dirs): (&Chunks, Option<&mut Vec<Directions>>) = match shared {
        Some(shared) => {
            let super::Slot { chunks, directions } = &mut shared.slots[h.channels as usize];
            if chunks.as_ref().is_none_or(|c| c.radii.len() != n) {
                *chunks = Some(load_chunks(page, n, nc, h.channels, at_row)?);
                directions.clear();
            }
            (
                chunks.as_ref().expect("chunks just stored"),
                Some(directions),
            )
        }
        None => {
            fresh_chunks = load_chunks(page, n, nc, h.channels, at_row)?;
            (&fresh_chunks, None)
        }
    };
    let (xs, radii) = (&chunks.xs, &chunks.radii);
    let (gains, offsets) = (&chunks.gains, &chunks.offsets);

    // Med-C outlier extraction per plane: r > C * lower median.
    let per_plane = t * nc;
    let mut outlier = vec![false; n];
    if let Some(c) = h.outlier_multiplier {
        let mut tmp = Vec::with_capacity(per_plane);
        for (o, rr) in outlier
            .chunks_exact_mut(per_plane)
            .zip(radii.chunks_exact(per_plane))
        {
            tmp.clear();
            tmp.extend_from_slice(rr);
            let (_, med, _) = tmp.select_nth_unstable_by((per_plane - 1) / 2, f32::total_cmp);
            let threshold = c * *med;
            for (flag, &r) in o.iter_mut().zip(rr) {
                *flag = r > threshold;
            }
        }
    }

    // Per-row scale: the largest inlier radius, rounded up to fp16.
    let levels = h.levels() as f32;
    let mut scales = Vec::with_capacity(2 * rows);
    let mut steps = Vec::with_capacity(rows);
    for r in 0..rows {
        let span = r * nc..(r + 1) * nc;
        let mx = radii[span.clone()]
            .iter()
            .zip(&outlier[span])
            .fold(0.0f32, |m, (&v, &o)| if !o && v > m { v } else { m });
        let sigma = f16_ceil(mx).ok_or_else(|| {
            Error::param(format!(
                "{}: chunk radius {mx} exceeds the fp16 range of the hqmq radius scale",
                at_row(r)
            ))
        })?;
        scales.extend_from_slice(&sigma.to_le_bytes());
        steps.push(sigma.to_f32() / levels);
    }

    // Direction search, one codebook per (layer, kv head, K|V). Outlier
    // chunks are searched too (their result is unused): simpler than
    // compacting, and they are a few percent. Radius bits and outlier
    // extraction do not change it. With `progress` (one per plane) the
    // filter pass continues from a smaller codebook's and is left there.
    let search_all = |mut progress: Option<&mut [search::Progress]>| {
        let mut js = vec![0u32; n];
        for p in 0..planes {
            let cb = h.codebook(info.layer, p as u32 % info.heads, info.kind);
            let span = p * per_plane..(p + 1) * per_plane;
            let x = [
                &xs[0][span.clone()],
                &xs[1][span.clone()],
                &xs[2][span.clone()],
                &xs[3][span.clone()],
            ];
            match progress.as_deref_mut() {
                Some(pr) => search::search_resume(&cb, x, &mut pr[p], &mut js[span]),
                None => search::search(&cb, x, &mut js[span]),
            }
        }
        js
    };
    let fresh;
    let js: &[u32] = match dirs {
        None => {
            fresh = search_all(None);
            &fresh
        }
        Some(list) => {
            let found = list
                .iter()
                .position(|d| d.secondaries == h.secondaries && d.seed == h.seed);
            let i = match found {
                Some(i) => i,
                None => {
                    // Secondaries of one seed extend each other
                    // (codebook::secondaries): continue the largest
                    // smaller search of this seed.
                    let mut progress = list
                        .iter()
                        .filter(|d| d.seed == h.seed && d.secondaries < h.secondaries)
                        .max_by_key(|d| d.secondaries)
                        .map(|d| d.progress.clone())
                        .unwrap_or_else(|| vec![search::Progress::default(); planes]);
                    let js = search_all(Some(&mut progress));
                    list.push(Directions {
                        secondaries: h.secondaries,
                        seed: h.seed,
                        js,
                        progress,
                    });
                    list.len() - 1
                }
            };
            &list[i].js
        }
    };

    // Radius levels (format/codecs/hqmq.md encoding rule 5).
    let mut qs = vec![0u32; n];
    for ((q, rr), &step) in qs
        .chunks_exact_mut(nc)
        .zip(radii.chunks_exact(nc))
        .zip(&steps)
    {
        if step != 0.0 {
            for (q, &rho) in q.iter_mut().zip(rr) {
                // Round to nearest, ties to even (exact for 0 <= t <= 2^22).
                *q = (((rho / step).min(levels) + RNE_MAGIC) - RNE_MAGIC) as i32 as u32;
            }
        }
    }

    // What the decoder returns (format/codecs/hqmq.md "Decoding"): the
    // same operations on the same numbers, so the same bits.
    let sizes_only = recon.is_some();
    if let Some(out) = recon {
        for p in 0..planes {
            let cb = h.codebook(info.layer, p as u32 % info.heads, info.kind);
            for (r, &step) in steps.iter().enumerate().take((p + 1) * t).skip(p * t) {
                let span = r * nc..(r + 1) * nc;
                for (((i, o), &j), &q) in span
                    .clone()
                    .zip(out[4 * span.start..4 * span.end].chunks_exact_mut(4))
                    .zip(&js[span.clone()])
                    .zip(&qs[span])
                {
                    if outlier[i] {
                        for (k, v) in o.iter_mut().enumerate() {
                            *v = f16::from_f32(xs[k][i]).to_f32();
                        }
                    } else {
                        let cw = cb.joint[j as usize];
                        let rh = q as f32 * step;
                        for (v, c) in o.iter_mut().zip(cw) {
                            *v = rh * c;
                        }
                    }
                    if !gains.is_empty() {
                        let g = &gains[p * d + 4 * (i % nc)..][..4];
                        for (v, g) in o.iter_mut().zip(g) {
                            *v *= g;
                        }
                    }
                    if !offsets.is_empty() {
                        let m = &offsets[p * d + 4 * (i % nc)..][..4];
                        for (v, m) in o.iter_mut().zip(m) {
                            *v += m;
                        }
                    }
                }
            }
        }
    }

    // Symbols v = j * 2^b + q, split into low E bits and a base-O digit.
    let (e, _) = h.split();
    let b = u32::from(h.radius_bits);
    let low_mask = (1u32 << e) - 1;
    let mut table = OutlierTable::new(4, universe);
    if sizes_only {
        // The sizes of the sections below, without packing the symbols.
        let mut n_in = n;
        let mut sections = 3 + usize::from(!gains.is_empty());
        let side = 2 * (gains.len() + offsets.len());
        let mut payload = scales.len() + side;
        if h.outlier_multiplier.is_some() {
            for (i, _) in outlier.iter().enumerate().filter(|(_, o)| **o) {
                table.push(i as u32, &[xs[0][i], xs[1][i], xs[2][i], xs[3][i]]);
            }
            n_in -= table.positions.len();
            sections += 1;
            payload += table.to_section().data.len();
        }
        payload += bitpack::packed_len(n_in, e) + h.groups.packed_len(n_in);
        return Ok(Coded::Sizes(super::Trial {
            payload: payload as u64,
            per_page: side as u64,
            sections,
        }));
    }
    let (low, high): (Vec<u32>, Vec<u32>) = if h.outlier_multiplier.is_none() {
        // v < 24 * 65536 * 256 < 2^32.
        let v = js.iter().zip(&qs).map(|(&j, &q)| (j << b) | q);
        (
            v.clone().map(|v| v & low_mask).collect(),
            v.map(|v| v >> e).collect(),
        )
    } else {
        let mut low = Vec::with_capacity(n);
        let mut high = Vec::with_capacity(n);
        for i in 0..n {
            if outlier[i] {
                table.push(i as u32, &[xs[0][i], xs[1][i], xs[2][i], xs[3][i]]);
            } else {
                let v = (js[i] << b) | qs[i];
                low.push(v & low_mask);
                high.push(v >> e);
            }
        }
        (low, high)
    };
    let n_in = low.len();
    let count = |v: usize| u32::try_from(v).map_err(|_| Error::param("hqmq page too large"));
    let mut low_bytes = vec![0u8; bitpack::packed_len(n_in, e)];
    bitpack::pack_u32(&low, e, &mut low_bytes);
    let mut high_bytes = vec![0u8; h.groups.packed_len(n_in)];
    h.groups.pack(&high, &mut high_bytes);
    let mut sections = vec![Section {
        kind: SectionKind::Scale,
        stream: 0,
        elem: ElemType::F16,
        count: count(rows)?,
        data: scales,
    }];
    if !gains.is_empty() {
        // Per plane its gains, then (+ctr) its offsets.
        let mut data = Vec::with_capacity(2 * (gains.len() + offsets.len()));
        for p in 0..planes {
            for side in [gains, offsets] {
                for v in side.get(p * d..(p + 1) * d).unwrap_or_default() {
                    data.extend_from_slice(&f16::from_f32(*v).to_le_bytes());
                }
            }
        }
        sections.push(Section {
            kind: SectionKind::Scale,
            stream: 1,
            elem: ElemType::F16,
            count: count(data.len() / 2)?,
            data,
        });
    }
    sections.extend([
        Section::packed(SectionKind::Index, 0, e as u8, count(n_in)?, low_bytes),
        Section {
            kind: SectionKind::Index,
            stream: 1,
            elem: ElemType::Bytes,
            count: count(high_bytes.len())?,
            data: high_bytes,
        },
    ]);
    if h.outlier_multiplier.is_some() {
        sections.push(table.to_section());
    }
    Ok(Coded::Sections(sections))
}

/// The checked sections of one hqmq page ([`page_layout`]).
#[derive(Debug)]
pub(crate) struct HqmqPage<'p> {
    /// SCALE stream 0: f16 radius scale per row, finite and non-negative.
    pub scales: &'p [u8],
    /// SCALE stream 1, `[plane][head_dim]` f16 gains (`+chan`, finite and
    /// non-negative) or `[plane][2][head_dim]` gains then offsets (`+ctr`,
    /// offsets finite); empty without either.
    pub gains: &'p [u8],
    /// The outlier table (empty without `+med`), finite values.
    pub table: OutlierTable,
    /// Inlier chunks: `rows * head_dim / 4` minus the outliers.
    pub n_in: usize,
    /// INDEX stream 0: `E`-bit low symbols, padding bits zero.
    pub low: &'p [u8],
    /// INDEX stream 1: mixed-radix digit groups, padding bits zero.
    pub high: &'p [u8],
}

/// The checked layout of a page of `rows` rows (`planes` planes) of
/// `head_dim` channels for a codec with outlier extraction `med`, channel
/// treatment `channels`, `e` low bits and digit grouping `groups`: exactly
/// the sections of format/codecs/hqmq.md with their element types and
/// counts, finite non-negative scales and gains, finite offsets, a valid outlier
/// table with finite values, zero padding bits. The CPU decoder and the
/// GPU staging both read pages through it.
///
/// # Errors
/// [`Error::Format`] naming the page for a head_dim not divisible by 4, a
/// missing, mistyped or extra section, or content listed above.
#[allow(clippy::too_many_arguments)]
pub(crate) fn page_layout<'p>(
    page: &'p PageView<'_>,
    med: bool,
    channels: Channels,
    planes: usize,
    e: u32,
    groups: &crate::kernels::radix::Groups,
    rows: usize,
    d: usize,
) -> Result<HqmqPage<'p>> {
    if !d.is_multiple_of(4) {
        return Err(page.error(format!("hqmq needs head_dim divisible by 4, not {d}")));
    }
    let n = rows * (d / 4);
    let universe = u32::try_from(n).map_err(|_| page.error("page over 2^32 chunks"))?;
    let scales = expect_section(page, SectionKind::Scale, 0, ElemType::F16, rows)?;
    if let Some(r) = first_bad_f16(scales) {
        let s = f16::from_le_bytes([scales[2 * r], scales[2 * r + 1]]);
        return Err(page.error(format!(
            "SCALE of row {r} holds {s}; radius scales must be finite and non-negative"
        )));
    }
    let gains = if channels.has_gains() {
        // Per plane: head_dim gains, then with +ctr head_dim offsets.
        let per = if channels.has_offsets() { 2 * d } else { d };
        let g = expect_section(page, SectionKind::Scale, 1, ElemType::F16, planes * per)?;
        for (p, block) in g.chunks_exact(2 * per).enumerate() {
            let (gs, ms) = block.split_at(2 * d);
            if let Some(c) = first_bad_f16(gs) {
                let v = f16::from_le_bytes([gs[2 * c], gs[2 * c + 1]]);
                return Err(page.error(format!(
                    "SCALE stream 1 (channel gains) of plane {p} channel {c} holds {v}; gains \
                     must be finite and non-negative"
                )));
            }
            if let Some(c) = ms
                .chunks_exact(2)
                .position(|x| u16::from_le_bytes([x[0], x[1]]) & 0x7c00 == 0x7c00)
            {
                let v = f16::from_le_bytes([ms[2 * c], ms[2 * c + 1]]);
                return Err(page.error(format!(
                    "SCALE stream 1 (channel offsets) of plane {p} channel {c} holds {v}; \
                     offsets must be finite"
                )));
            }
        }
        g
    } else {
        &[]
    };
    // Stream 0 only: an OUTLIERS section of another stream is extra (the
    // section count below rejects it).
    let has_table = page
        .sections()
        .iter()
        .any(|s| s.kind == SectionKind::Outliers && s.stream == 0);
    let table = match (med, has_table) {
        (true, true) => OutlierTable::from_page(page, 4, universe)?,
        (false, false) => OutlierTable::new(4, universe),
        (true, false) => return Err(page.error("missing OUTLIERS section (+med codec)")),
        (false, true) => {
            return Err(
                page.error("OUTLIERS section present, but the codec does not extract outliers")
            );
        }
    };
    if table.values.iter().any(|v| !v.is_finite()) {
        return Err(page.error("outlier table holds a non-finite value"));
    }
    let n_in = n - table.positions.len();
    let low = expect_section(page, SectionKind::Index, 0, ElemType::Packed(e as u8), n_in)?;
    let high = expect_section(
        page,
        SectionKind::Index,
        1,
        ElemType::Bytes,
        groups.packed_len(n_in),
    )?;
    expect_section_count(
        page,
        3 + usize::from(has_table) + usize::from(channels.has_gains()),
    )?;
    if !bitpack::tail_is_zero(low, n_in, e) {
        return Err(page.error("INDEX stream 0: padding bits after the last code are set"));
    }
    if !bitpack::tail_is_zero(high, n_in.div_ceil(groups.digits as usize), groups.bits) {
        return Err(page.error("INDEX stream 1: bits after the last digit group are set"));
    }
    Ok(HqmqPage {
        scales,
        gains,
        table,
        n_in,
        low,
        high,
    })
}

/// The first of the f16 values in `bytes` that is negative (sign bit set),
/// infinite or NaN.
fn first_bad_f16(bytes: &[u8]) -> Option<usize> {
    bytes
        .chunks_exact(2)
        .position(|c| u16::from_le_bytes([c[0], c[1]]) & 0xfc00 >= 0x7c00)
}

/// Decodes one page (format/codecs/hqmq.md "Decoding").
pub(super) fn decode(h: &Hqmq, page: &PageView<'_>, out: &mut PageOut<'_>) -> Result<()> {
    // The loops vectorize 8 wide in the AVX2 build, with the same results.
    crate::kernels::with_avx2(
        #[inline(always)]
        || decode_page(h, page, out),
    )
}

/// [`decode`]'s body.
#[inline(always)]
fn decode_page(h: &Hqmq, page: &PageView<'_>, out: &mut PageOut<'_>) -> Result<()> {
    let info = out.tensor;
    let d = info.head_dim as usize;
    let nc = d / 4;
    let rows = out.rows();
    let t = out.tokens as usize;
    let (e, _) = h.split();
    let planes = rows / t.max(1);
    let HqmqPage {
        scales,
        gains,
        table,
        n_in,
        low: low_bytes,
        high: high_bytes,
    } = page_layout(
        page,
        h.outlier_multiplier.is_some(),
        h.channels,
        planes,
        e,
        &h.groups,
        rows,
        d,
    )?;
    let widen = |b: &[u8]| -> Vec<f32> {
        b.chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect()
    };
    let side = widen(gains);
    // Per plane: gains at [0, d), offsets (+ctr) at [d, 2d).
    let per = if h.channels.has_offsets() { 2 * d } else { d };
    let mut low = vec![0u32; n_in];
    bitpack::unpack_u32(low_bytes, e, &mut low);
    let mut high = vec![0u32; n_in];
    h.groups
        .unpack(high_bytes, &mut high)
        .map_err(|err| page.error(format!("INDEX stream 1: {err}")))?;
    let levels = h.levels() as f32;
    let mut steps = Vec::with_capacity(rows);
    for c in scales.chunks_exact(2) {
        steps.push(f16::from_le_bytes([c[0], c[1]]).to_f32() / levels);
    }

    let b = h.radius_bits;
    let q_mask = (1u64 << b) - 1;
    let mut row = vec![0f32; d];
    let (mut k, mut o) = (0usize, 0usize);
    let mut next_outlier = table.positions.first().map_or(usize::MAX, |&p| p as usize);
    for p in 0..out.planes.len() {
        let cb = h.codebook(info.layer, p as u32 % info.heads, info.kind);
        let joint = &cb.joint[..];
        for (r, &step) in steps.iter().enumerate().take((p + 1) * t).skip(p * t) {
            for (c, dst) in row.chunks_exact_mut(4).enumerate() {
                if r * nc + c == next_outlier {
                    for (m, v) in dst.iter_mut().enumerate() {
                        *v = table.values[4 * o + m].to_f32();
                    }
                    o += 1;
                    next_outlier = table.positions.get(o).map_or(usize::MAX, |&p| p as usize);
                    continue;
                }
                let v = (u64::from(high[k]) << e) | u64::from(low[k]);
                k += 1;
                // v < 24 S 2^b because every digit is < O, so j < 24 S.
                let cw = joint[(v >> b) as usize];
                let rh = (v & q_mask) as f32 * step;
                dst[0] = rh * cw[0];
                dst[1] = rh * cw[1];
                dst[2] = rh * cw[2];
                dst[3] = rh * cw[3];
            }
            if !side.is_empty() {
                let plane = &side[p * per..(p + 1) * per];
                for (v, g) in row.iter_mut().zip(&plane[..d]) {
                    *v *= g;
                }
                for (v, m) in row.iter_mut().zip(&plane[d..]) {
                    *v += m;
                }
            }
            out.store_row(r, &row);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::cache::{DType, Elems, ElemsMut, Kind, TensorInfo};
    use crate::codec::Codec;
    use crate::format::{Limits, PageFrame, PageHeader, PageMeta};

    const D: usize = 16;
    const T: usize = 6;

    fn info() -> TensorInfo {
        TensorInfo {
            name: "past_key_values.2.value".into(),
            layer: 2,
            kind: Kind::Value,
            dtype: DType::F32,
            batch: 1,
            heads: 2,
            tokens: T as u32,
            head_dim: D as u32,
        }
    }

    fn values() -> Vec<f32> {
        (0..2 * T * D)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * if i % 29 == 3 { 9.0 } else { 0.25 })
            .collect()
    }

    fn encode(h: &Hqmq) -> Vec<Section> {
        let (ti, v) = (info(), values());
        let page = PageIn {
            source: None,
            tensor: &ti,
            token_start: 0,
            tokens: T as u32,
            planes: v.chunks(T * D).map(Elems::F32).collect(),
        };
        h.encode(&page).unwrap()
    }

    /// Decodes `sections` as one page through the public frame path.
    fn decode(h: &Hqmq, sections: &[Section]) -> Result<Vec<f32>> {
        let frame = PageFrame::encode(
            PageMeta {
                tensor: 0,
                token_start: 0,
                tokens: T as u32,
                codec: 0,
            },
            sections,
            None,
            64,
        )?;
        let at = crate::Location::Header;
        let hd = PageHeader::parse(
            frame.bytes[..64].try_into().unwrap(),
            &at,
            &Limits::default(),
        )?;
        let body = std::borrow::Cow::Borrowed(&frame.bytes[64..64 + hd.stored_len as usize]);
        let view = PageView::from_stored(hd, body, 0, "test page".into(), &at)?;
        let ti = info();
        let mut out = vec![0f32; 2 * T * D];
        let (a, b) = out.split_at_mut(T * D);
        let mut po = PageOut {
            scatter: None,
            tensor: &ti,
            tokens: T as u32,
            planes: vec![ElemsMut::F32(a), ElemsMut::F32(b)],
        };
        h.decode(&view, &mut po)?;
        Ok(out)
    }

    /// An edit of a page's sections.
    type Edit = fn(&mut Vec<Section>);

    /// Every edit of `good` is refused by the decoder with a format error.
    fn assert_rejected(h: &Hqmq, good: &[Section], edits: &[(&str, Edit)]) {
        for (what, edit) in edits {
            let mut s = good.to_vec();
            edit(&mut s);
            match decode(h, &s) {
                Err(e) => assert!(e.is_format(), "{what}: {e}"),
                Ok(_) => panic!("{what}: accepted"),
            }
        }
    }

    fn section_mut(s: &mut [Section], kind: SectionKind, stream: u8) -> &mut Section {
        s.iter_mut()
            .find(|x| x.kind == kind && x.stream == stream)
            .unwrap()
    }

    #[test]
    fn round_trip_and_invalid_sections_are_format_errors() {
        let h = Hqmq::new(24, 3, Some(3.0), 5).unwrap();
        let good = encode(&h);
        let ok = decode(&h, &good).unwrap();
        assert!(
            ok.iter().zip(values()).any(|(a, b)| a == &b),
            "outliers exact"
        );

        let edits: [(&str, Edit); 10] = [
            ("missing scale", |s| {
                s.retain(|x| x.kind != SectionKind::Scale)
            }),
            ("missing outliers", |s| {
                s.retain(|x| x.kind != SectionKind::Outliers)
            }),
            ("scale count", |s| {
                let x = section_mut(s, SectionKind::Scale, 0);
                x.count -= 1;
                x.data.truncate(x.data.len() - 2);
            }),
            ("negative scale", |s| {
                section_mut(s, SectionKind::Scale, 0).data[1] |= 0x80
            }),
            ("infinite scale", |s| {
                let x = section_mut(s, SectionKind::Scale, 0);
                x.data[0] = 0x00;
                x.data[1] = 0x7C;
            }),
            ("low code width", |s| {
                let x = section_mut(s, SectionKind::Index, 0);
                x.elem = ElemType::Packed(8);
                x.data.resize(x.count as usize, 0);
            }),
            ("digit group out of range", |s| {
                // 0xFF... in the first 54-bit group exceeds 9^17.
                let x = section_mut(s, SectionKind::Index, 1);
                for b in &mut x.data[..6] {
                    *b = 0xFF;
                }
                x.data[6] |= 0x3F;
            }),
            ("digit stream length", |s| {
                let x = section_mut(s, SectionKind::Index, 1);
                x.data.push(0);
                x.count += 1;
            }),
            ("stray bit after the digits", |s| {
                let x = section_mut(s, SectionKind::Index, 1);
                let last = x.data.len() - 1;
                x.data[last] |= 0x80;
            }),
            ("outlier unit", |s| {
                section_mut(s, SectionKind::Outliers, 0).data[4] = 1
            }),
        ];
        assert_rejected(&h, &good, &edits);
        // An OUTLIERS section for a codec without +med.
        let plain = Hqmq::new(24, 3, None, 5).unwrap();
        assert!(decode(&plain, &good).unwrap_err().is_format());
        assert!(decode(&plain, &encode(&plain)).is_ok());
    }

    /// `+chan`: the gains are each channel's largest magnitude rounded up
    /// to fp16 (a zero channel gets 0 and decodes to 0), the page decodes
    /// closer than without gains on rows with one large channel, and
    /// missing, extra, negative or infinite gains are format errors.
    #[test]
    fn channel_gains() {
        let h = Hqmq::new(24, 3, None, 5)
            .unwrap()
            .with_channels(Channels::Gains);
        let mut v = values();
        for (i, x) in v.iter_mut().enumerate() {
            if i % D == 3 {
                *x *= 40.0; // one large channel
            }
            if i % D == 9 {
                *x = 0.0; // one zero channel
            }
        }
        let ti = info();
        let page = page_of(&ti, &v);
        let good = h.encode(&page).unwrap();
        let gains = &section_mut(&mut good.clone(), SectionKind::Scale, 1)
            .data
            .clone();
        for p in 0..2 {
            for c in 0..D {
                let mx = (0..T)
                    .map(|t| v[p * T * D + t * D + c].abs())
                    .fold(0f32, f32::max);
                let g = f16::from_le_bytes([gains[2 * (p * D + c)], gains[2 * (p * D + c) + 1]]);
                if mx == 0.0 {
                    assert_eq!(g.to_f32(), 0.0, "plane {p} channel {c}");
                } else {
                    let below = f16::from_bits(g.to_bits() - 1).to_f32();
                    assert!(
                        g.to_f32() >= mx && below < mx,
                        "plane {p} channel {c}: {g} for {mx}"
                    );
                }
            }
        }
        let frame_decode = |h: &Hqmq, s: &[Section]| decode_page_of(h, &ti, s);
        let dec = frame_decode(&h, &good);
        let plain = Hqmq::new(24, 3, None, 5).unwrap();
        let dec0 = frame_decode(&plain, &plain.encode(&page).unwrap());
        let err = |d: &[f32]| -> f32 {
            d.iter()
                .zip(&v)
                .enumerate()
                .filter(|(i, _)| i % D != 3)
                .map(|(_, (a, b))| (a - b) * (a - b))
                .sum()
        };
        assert!(
            err(&dec) < 0.5 * err(&dec0),
            "{} vs {}",
            err(&dec),
            err(&dec0)
        );
        assert!(dec.iter().enumerate().all(|(i, x)| i % D != 9 || *x == 0.0));

        let edits: [(&str, Edit); 4] = [
            ("missing gains", |s| {
                s.retain(|x| !(x.kind == SectionKind::Scale && x.stream == 1))
            }),
            ("gain count", |s| {
                let x = section_mut(s, SectionKind::Scale, 1);
                x.count -= 1;
                x.data.truncate(x.data.len() - 2);
            }),
            ("negative gain", |s| {
                section_mut(s, SectionKind::Scale, 1).data[7] |= 0x80
            }),
            ("NaN gain", |s| {
                let x = section_mut(s, SectionKind::Scale, 1);
                x.data[4] = 0x01;
                x.data[5] = 0x7C;
            }),
        ];
        assert_rejected(&h, &good, &edits);
        // Gains where the codec has none.
        assert!(decode(&plain, &good).unwrap_err().is_format());
    }

    /// `+ctr`: the offsets are each channel's mean (row-order binary32
    /// sum over the page's tokens, rounded to fp16), the gains the fp16
    /// ceiling of the square root of the largest centred magnitude; a page
    /// whose channels carry large common offsets decodes far closer than
    /// without centring; missing, extra or non-finite offsets, gains
    /// without offsets and offsets under another codec are format errors.
    #[test]
    fn channel_centring() {
        let h = Hqmq::new(24, 3, None, 5)
            .unwrap()
            .with_channels(Channels::Centred);
        let mut v = values();
        for (i, x) in v.iter_mut().enumerate() {
            match i % D {
                3 => *x += 40.0,           // a large common offset
                5 => *x = 0.25 * *x - 7.5, // a small channel around an offset
                9 => *x = -3.0,            // constant: gain 0, decodes exactly
                _ => {}
            }
        }
        let ti = info();
        let page = page_of(&ti, &v);
        let good = h.encode(&page).unwrap();
        let side = section_mut(&mut good.clone(), SectionKind::Scale, 1)
            .data
            .clone();
        let at = |i: usize| f16::from_le_bytes([side[2 * i], side[2 * i + 1]]).to_f32();
        assert_eq!(side.len(), 2 * 2 * 2 * D);
        for p in 0..2 {
            for c in 0..D {
                let col = |t: usize| v[p * T * D + t * D + c];
                let sum = (0..T).fold(0f32, |s, t| s + col(t));
                let m = f16::from_f32(sum / T as f32).to_f32();
                assert_eq!(at(2 * p * D + D + c), m, "plane {p} channel {c}");
                let dev = (0..T).map(|t| (col(t) - m).abs()).fold(0f32, f32::max);
                let g = at(2 * p * D + c);
                if dev == 0.0 {
                    assert_eq!(g, 0.0, "plane {p} channel {c}");
                } else {
                    let below = f16::from_bits(f16::from_f32(g).to_bits() - 1).to_f32();
                    let r = dev.sqrt();
                    assert!(g >= r && below < r, "plane {p} channel {c}: {g} for {r}");
                }
            }
        }
        let dec = decode_page_of(&h, &ti, &good);
        let plain = Hqmq::new(24, 3, None, 5).unwrap();
        let dec0 = decode_page_of(&plain, &ti, &plain.encode(&page).unwrap());
        let err = |d: &[f32]| -> f32 { d.iter().zip(&v).map(|(a, b)| (a - b) * (a - b)).sum() };
        assert!(
            err(&dec) < 0.25 * err(&dec0),
            "{} vs {}",
            err(&dec),
            err(&dec0)
        );
        assert!(
            dec.iter()
                .enumerate()
                .all(|(i, x)| i % D != 9 || *x == -3.0)
        );

        // Plane 1's offsets start at f16 3 D (byte 6 D).
        let edits: [(&str, Edit); 6] = [
            ("missing gains and offsets", |s| {
                s.retain(|x| !(x.kind == SectionKind::Scale && x.stream == 1))
            }),
            ("offsets cut (a +chan count)", |s| {
                let x = section_mut(s, SectionKind::Scale, 1);
                x.count /= 2;
                x.data.truncate(x.data.len() / 2);
            }),
            ("infinite offset", |s| {
                let x = section_mut(s, SectionKind::Scale, 1);
                x.data[6 * D + 2] = 0x00;
                x.data[6 * D + 3] = 0xFC;
            }),
            ("NaN offset", |s| {
                let x = section_mut(s, SectionKind::Scale, 1);
                x.data[2 * D + 4] = 0x01;
                x.data[2 * D + 5] = 0x7C;
            }),
            ("negative gain of plane 1", |s| {
                section_mut(s, SectionKind::Scale, 1).data[4 * D + 1] |= 0x80
            }),
            ("an extra stream", |s| {
                let mut x = section_mut(s, SectionKind::Scale, 1).clone();
                x.stream = 2;
                s.push(x);
            }),
        ];
        assert_rejected(&h, &good, &edits);
        // Offsets where the codec has none.
        let chan = Hqmq::new(24, 3, None, 5)
            .unwrap()
            .with_channels(Channels::Gains);
        assert!(decode(&plain, &good).unwrap_err().is_format());
        assert!(decode(&chan, &good).unwrap_err().is_format());
    }

    /// The page of `T` tokens of `ti` holding `values` (`[planes, T, D]`).
    fn page_of<'a>(ti: &'a TensorInfo, values: &'a [f32]) -> PageIn<'a> {
        PageIn {
            source: None,
            tensor: ti,
            token_start: 0,
            tokens: T as u32,
            planes: values.chunks(T * D).map(Elems::F32).collect(),
        }
    }

    /// Decodes `sections` as one page of `ti` (`tokens` rows per plane,
    /// f32) through the public frame path.
    fn decode_page_of(h: &Hqmq, ti: &TensorInfo, sections: &[Section]) -> Vec<f32> {
        let meta = PageMeta {
            tensor: 0,
            token_start: 0,
            tokens: ti.tokens,
            codec: 0,
        };
        let frame = PageFrame::encode(meta, sections, None, 64).unwrap();
        let at = crate::Location::Header;
        let hd = PageHeader::parse(
            frame.bytes[..64].try_into().unwrap(),
            &at,
            &Limits::default(),
        )
        .unwrap();
        let body = std::borrow::Cow::Borrowed(&frame.bytes[64..64 + hd.stored_len as usize]);
        let view = PageView::from_stored(hd, body, 0, "test page".into(), &at).unwrap();
        let per_plane = ti.tokens as usize * ti.head_dim as usize;
        let mut out = vec![0f32; ti.planes() * per_plane];
        let mut po = PageOut {
            scatter: None,
            tensor: ti,
            tokens: ti.tokens,
            planes: out.chunks_exact_mut(per_plane).map(ElemsMut::F32).collect(),
        };
        h.decode(&view, &mut po).unwrap();
        out
    }

    /// `trial` (the planner's round trip) gives the payload bytes and
    /// section count of a plain encode and, bit for bit, the values the
    /// decoder returns from its sections (`encode_shared` the sections), for configurations sharing one `Shared` in turn: every
    /// tensor of the real fixture (whole, and as a 64-token page), and
    /// synthetic pages with zero rows (a zero scale: `-0.0` products),
    /// huge outlier chunks and values at the fp16 limit.
    #[test]
    fn reconstruction_equals_decode() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/fixtures/gemma3-270m-gpl3-520.safetensors"
        );
        let bytes = std::fs::read(path).expect("fixture");
        let cache = crate::io::safetensors::parse(&bytes, path).unwrap().cache;
        let names = [
            "hqmq:s6r2",
            "hqmq:s24r3",
            "hqmq:s24r3+med3",
            "hqmq:s96r4",
            "hqmq:s96r5+med3",
            "hqmq:s96r6+med1.5",
            "hqmq:s24r3:seed9",
            "hqmq:s5r8+med2",
            "hqmq:s24r3+chan",
            "hqmq:s96r4+chan",
            "hqmq:s12r2+med3+chan",
            "hqmq:s24r3+ctr",
            "hqmq:s96r4+ctr",
            "hqmq:s12r2+med3+ctr",
        ];
        let codecs: Vec<Hqmq> = names
            .iter()
            .map(|n| super::super::params::parse_name(n).unwrap())
            .collect();
        let mut pages: Vec<(TensorInfo, Vec<f32>)> = Vec::new();
        for t in cache.tensors.iter().step_by(5) {
            let x = t.data.to_f32();
            let mut ti = t.info.clone();
            ti.dtype = DType::F32;
            pages.push((ti.clone(), x.clone()));
            ti.tokens = 64;
            pages.push((ti, x[..64 * t.info.head_dim as usize].to_vec()));
        }
        let mut v = values();
        v[..D].fill(0.0);
        v[3 * D + 5] = 65504.0;
        v[4 * D + 2] = -65504.0;
        v[5 * D + 7] = 1e-7;
        // Outlier chunks whose values fp16 rounds.
        v[2 * D + 1] = 1000.123;
        v[8 * D + 9] = -777.77;
        pages.push((info(), v));
        for (ti, x) in &pages {
            let per_plane = ti.tokens as usize * ti.head_dim as usize;
            let page = PageIn {
                source: None,
                tensor: ti,
                token_start: 0,
                tokens: ti.tokens,
                planes: x.chunks(per_plane).map(Elems::F32).collect(),
            };
            let mut shared = Shared::default();
            for (n, h) in names.iter().zip(&codecs) {
                let mut recon = vec![f32::NAN; x.len()];
                let trial = h.trial(&page, &mut shared, &mut recon).unwrap();
                let s = h.encode(&page).unwrap();
                let payload: usize = s.iter().map(|s| s.data.len()).sum();
                assert_eq!(trial.payload, payload as u64, "{n} {}", ti.name);
                assert_eq!(trial.sections, s.len(), "{n} {}", ti.name);
                assert_eq!(s, h.encode_shared(&page, &mut shared).unwrap());
                let dec = decode_page_of(h, ti, &s);
                let bad = recon
                    .iter()
                    .zip(&dec)
                    .position(|(a, b)| a.to_bits() != b.to_bits());
                assert_eq!(bad, None, "{n} {} ({} tokens)", ti.name, ti.tokens);
            }
        }
        // A buffer of the wrong size is an error.
        let (ti, x) = &pages[0];
        let page = PageIn {
            source: None,
            tensor: ti,
            token_start: 0,
            tokens: ti.tokens,
            planes: vec![Elems::F32(x)],
        };
        let mut short = vec![0f32; x.len() - 1];
        assert!(
            codecs[0]
                .trial(&page, &mut Shared::default(), &mut short)
                .is_err()
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        /// Any byte of any section replaced: an error or a decode, never a
        /// panic.
        #[test]
        fn corrupted_sections_never_panic(sec in 0usize..4, pos in any::<usize>(), byte in any::<u8>()) {
            let h = Hqmq::new(5, 2, Some(2.0), 1).unwrap();
            let mut s = encode(&h);
            let n = s.len();
            let x = &mut s[sec % n];
            if !x.data.is_empty() {
                let i = pos % x.data.len();
                x.data[i] = byte;
            }
            let _ = decode(&h, &s);
        }
    }
}
