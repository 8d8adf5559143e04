//! Budget planning (`kvpack compress --bits B`): given a size budget in bits
//! per element with everything counted (codes, scales, norms, outlier
//! tables, windows, headers, index), choose for every tensor (one layer's K
//! or V) the codec, its parameters and a sink window, minimising the
//! attention-output distortion of [`distortion`], measured on a token
//! sample of the cache itself (no queries, calibration data or model).
//!
//! Steps ([`plan`]):
//! 1. every candidate codec of `candidates` that accepts a tensor's shape
//!    encodes and decodes the tensor's token sample (`sample`: 16
//!    leading slots and 48 spread over the rest);
//! 2. each (codec, sink window) pair becomes an operating point of the
//!    tensor: estimated bytes of its pages (sample payload scaled to the
//!    tensor, page frames, index entries, the window's `raw` page) and the
//!    distortion of its layer's attention output ([`distortion`]);
//! 3. the points are allocated under the budget minus the header, index
//!    and trailer (`allocate`).
//!
//! [`compress_budget`] then writes the file ([`crate::compress::compress_mixed`]):
//! tensors point at their codec's slot in the codec table and windows are
//! `raw` pages, so the format needs no extension and any kvpack reader
//! decodes the file. When the file comes out larger than the budget (a
//! data-dependent page larger than its sample predicted) the allocation is
//! redone with the excess taken off and the file rewritten. The plan is
//! deterministic: the same cache and budget give the same file.

mod allocate;
mod candidates;
pub mod distortion;
mod sample;
mod study;
mod timing;

use std::io::Write;

use rayon::prelude::*;

use crate::cache::{Elems, Kind, TensorInfo};
use crate::codec::Codec;
use crate::codec::hqmq::{self, Hqmq};
use crate::compress::{CompressOptions, CompressReport, compress_mixed};
use crate::error::{Error, Result};
use crate::format::{CodecEntry, FileHeader, VERSION_MAJOR};
use crate::plan::Layout;
use crate::view::CacheView;

use allocate::Point;
use distortion::{Head, HeadContext};
use sample::{Encoded, RoundTrip, Sample, load_rows, round_trip};

/// What the planner chose for one tensor.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TensorPlan {
    /// Tensor name.
    pub name: String,
    /// Layer index.
    pub layer: u32,
    /// `K`, `V` or `latent`.
    pub kind: String,
    /// Canonical codec name.
    pub codec: String,
    /// Leading cache slots stored `raw` (sink window).
    pub sink: u32,
    /// Estimated bits per element of this tensor, its pages and index
    /// entries counted.
    pub bits: f64,
    /// Estimated distortion (relative squared attention-output error of
    /// its layer, see [`distortion`]).
    pub distortion: f64,
}

/// A budget plan: one codec and window per tensor.
#[derive(Debug)]
pub struct Plan {
    /// The budget, bits per element.
    pub budget_bits: f64,
    /// Per tensor, in the cache's order.
    pub tensors: Vec<TensorPlan>,
    /// Estimated bits per element of the whole file.
    pub estimated_bits: f64,
    /// Summed estimated distortion.
    pub distortion: f64,
    codecs: Vec<Box<dyn Codec>>,
    slots: Vec<usize>,
    /// Per tensor, the index of its candidate in [`Measured::candidates`].
    candidates: Vec<usize>,
}

impl Plan {
    /// Canonical names of the codecs the plan uses, in codec table order.
    pub fn codec_names(&self) -> Vec<String> {
        self.codecs.iter().map(|c| c.name()).collect()
    }
}

/// One candidate codec, prepared for the cache.
#[derive(Debug)]
struct Candidate {
    codec: Box<dyn Codec>,
    /// The same codec when it is an `hqmq` configuration: its sample
    /// encodes share the direction search with the other `hqmq`
    /// candidates of equal `S` and seed.
    hqmq: Option<Hqmq>,
}

impl Candidate {
    /// True when a page's coding depends on which rows share it (hqmq's
    /// `+chan` gains are each channel's largest value in the page, `+ctr`
    /// offsets its mean): its
    /// sample is coded once per sink window, without the window's rows,
    /// as the file codes the pages after the window.
    fn windowed(&self) -> bool {
        self.hqmq.as_ref().is_some_and(|h| h.channels.has_gains())
    }
}

/// One round trip of a tensor's sample by candidate `cand`: for every sink
/// window (`sink: None`), or (windowed candidates) for the one sink window
/// whose rows were left out of the page and copied exactly.
struct Trip {
    cand: usize,
    sink: Option<u32>,
    /// `None` when the candidate cannot code the tensor, `Some(None)` for
    /// `raw` (exact), else the round trip.
    trip: Option<Option<RoundTrip>>,
}

/// Operating points of one tensor: `(candidate, sink)` per point.
#[derive(Debug, Clone)]
struct TensorPoints {
    points: Vec<Point>,
    choice: Vec<(usize, u32)>,
}

/// Everything measured before the allocation.
#[derive(Debug)]
struct Measured {
    candidates: Vec<Candidate>,
    tensors: Vec<TensorPoints>,
    /// Header, index frame (without entries) and trailer, bytes.
    fixed: f64,
    elements: u64,
}

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// Bytes of one page frame holding `len` payload bytes in one section, as
/// `raw` writes it, plus its index entry.
fn raw_frame(len: u64, align: u64) -> u64 {
    align_up(64 + 64 + align_up(len, 64), align) + 40
}

/// Estimated bytes of tensor `info` coded by a codec whose sample page of
/// `n` tokens took `rt` (`None` for `raw`), with a sink window of `sink`
/// slots.
fn tensor_bytes(
    info: &TensorInfo,
    rt: Option<&RoundTrip>,
    sink: u32,
    opts: &CompressOptions,
) -> f64 {
    let align = 1u64 << opts.align_log2;
    let row = info.planes() as u64 * u64::from(info.head_dim) * info.dtype.size() as u64;
    let s = sink.min(info.tokens);
    let body = info.tokens - s;
    let mut bytes = if s > 0 {
        raw_frame(row * u64::from(s), align) as f64
    } else {
        0.0
    };
    let pt = opts.layout.page_tokens.max(1);
    let pages = body.div_ceil(pt);
    match rt {
        None => {
            let full = body / pt;
            bytes += (full as f64) * raw_frame(row * u64::from(pt), align) as f64;
            if !body.is_multiple_of(pt) {
                bytes += raw_frame(row * u64::from(body % pt), align) as f64;
            }
        }
        Some(rt) => {
            let nsec = rt.sections as u64;
            let per_page = 64 + align_up(16 * nsec, 64) + 32 * nsec + align / 2 + 40;
            let rows = rt.payload - rt.per_page.min(rt.payload);
            bytes += rows as f64 * f64::from(body) / rt.tokens.max(1) as f64;
            bytes += (u64::from(pages) * (per_page + rt.per_page)) as f64;
        }
    }
    bytes
}

/// The softmax scale of the cache: `kvpack.attn_scale` when present, else
/// `1/sqrt(head_dim)`.
fn attn_scale(cache: &CacheView<'_>, head_dim: u32) -> f32 {
    cache
        .metadata
        .get(crate::io::safetensors::ATTN_SCALE_KEY)
        .and_then(|s| s.parse::<f32>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .unwrap_or(1.0 / (head_dim as f32).sqrt())
}

/// Sampled rows and round trips of one tensor.
struct Trials {
    sample: Sample,
    rows: Vec<f32>,
    /// The candidates' round trips.
    trips: Vec<Trip>,
    /// The first refusal of the sampled rows by a candidate
    /// ([`Error::Parameter`]: a value its format cannot hold, e.g. an hqmq
    /// chunk radius beyond fp16); such a candidate is left out for the
    /// tensor, and the error is raised only when no coding candidate
    /// remains.
    refused: Option<Error>,
}

fn trials(cache: &CacheView<'_>, t: usize, cands: &[Candidate]) -> Result<Trials> {
    let tv = &cache.tensors[t];
    let sample = Sample::of(tv.info.tokens);
    let rows = timing::time(timing::Section::Sample, || load_rows(tv, &sample));
    let n = sample.len();
    let mut refused = None;
    let trips = timing::time(timing::Section::RoundTrip, || {
        // One candidate's round trip of `rows` (`n` per plane); a refusal
        // of the rows' values leaves the candidate out.
        let mut trip = |c: &Candidate, shared: &mut hqmq::Shared, rows: &[f32], n: usize| {
            if c.codec.check(&tv.info).is_err() {
                return Ok(None);
            }
            // `raw` also takes a tensor without tokens (zero bytes).
            if c.codec.id() == crate::codec::raw::ID {
                return Ok(Some(None));
            }
            if n == 0 {
                return Ok(None);
            }
            let mut encode = |page: &crate::codec::PageIn<'_>, recon: &mut [f32]| match &c.hqmq {
                Some(h) => h.trial(page, shared, recon).map(|t| Encoded::Decoded {
                    payload: t.payload,
                    sections: t.sections,
                    per_page: t.per_page,
                }),
                None => c.codec.encode(page).map(Encoded::Sections),
            };
            match round_trip(c.codec.as_ref(), &mut encode, &tv.info, rows, n) {
                Ok(r) => Ok(Some(Some(r))),
                Err(e @ Error::Parameter(_)) => {
                    refused.get_or_insert(e);
                    Ok(None)
                }
                Err(e) => Err(e),
            }
        };
        let mut out = Vec::new();
        // The chunks and direction searches of the sample page, shared by
        // the hqmq candidates.
        let mut shared = hqmq::Shared::default();
        for (cand, c) in cands.iter().enumerate().filter(|(_, c)| !c.windowed()) {
            out.push(Trip {
                cand,
                sink: None,
                trip: trip(c, &mut shared, &rows, n)?,
            });
        }
        let d = tv.info.head_dim as usize;
        // Windowed candidates only with the first slot in a sink window:
        // an attention-sink token inside such a page sets its channel
        // statistics (gains, means) for every other row, and its damage
        // shows only where attention looks at the sink, which the sampled
        // measure underrates (format/codecs/hqmq.md sections 10-11 advise a
        // sink window for `+chan` and `+ctr`).
        for &sink in candidates::SINKS.iter().filter(|&&s| s > 0) {
            let e = exact_rows(&sample, sink);
            if e >= n {
                continue;
            }
            // The rows after the window and one shared search for the
            // windowed candidates of this window.
            let after = rows_after(&rows, n, d, e);
            let mut shared = hqmq::Shared::default();
            for (cand, c) in cands.iter().enumerate().filter(|(_, c)| c.windowed()) {
                let t = trip(c, &mut shared, &after, n - e)?.map(|t| {
                    t.map(|mut r| {
                        let mut full = rows.clone();
                        for (f, a) in full
                            .chunks_exact_mut(n * d)
                            .zip(r.rows.chunks_exact((n - e) * d))
                        {
                            f[e * d..].copy_from_slice(a);
                        }
                        r.rows = full;
                        r
                    })
                });
                out.push(Trip {
                    cand,
                    sink: Some(sink),
                    trip: t,
                });
            }
        }
        Ok::<_, Error>(out)
    })?;
    Ok(Trials {
        sample,
        rows,
        trips,
        refused,
    })
}

/// Of sampled rows `[planes, n, d]`, the rows `e..n` of every plane,
/// plane-major `[planes, n - e, d]`.
fn rows_after(rows: &[f32], n: usize, d: usize, e: usize) -> Vec<f32> {
    rows.chunks_exact(n * d)
        .flat_map(|p| &p[e * d..])
        .copied()
        .collect()
}

/// Number of sampled slots inside a sink window of `sink` slots.
fn exact_rows(s: &Sample, sink: u32) -> usize {
    s.tokens.iter().take_while(|&&t| t < sink).count()
}

/// Operating points of the tensors of one layer: `ts` are the layer's
/// tensor indices (K and V, or a latent).
fn layer_points(
    cache: &CacheView<'_>,
    ts: &[usize],
    cands: &[Candidate],
    opts: &CompressOptions,
) -> Result<Vec<(usize, TensorPoints)>> {
    let mut tr: Vec<Trials> = ts
        .iter()
        .map(|&t| trials(cache, t, cands))
        .collect::<Result<_>>()?;
    let infos: Vec<&TensorInfo> = ts.iter().map(|&t| &cache.tensors[t].info).collect();
    // Attention pairing: one K and one V of the same shape.
    let pair = match infos.as_slice() {
        [k, v]
            if k.kind == Kind::Key
                && v.kind == Kind::Value
                && k.shape() == v.shape()
                && k.tokens > 0 =>
        {
            Some(())
        }
        _ => None,
    };
    // The reference attention of each kv head, shared by K and V.
    let contexts: Option<Vec<HeadContext>> = pair.map(|_| {
        timing::time(timing::Section::Distortion, || {
            let (d, n) = (infos[0].head_dim as usize, tr[0].sample.len());
            let scale = attn_scale(cache, infos[0].head_dim);
            (0..infos[0].planes())
                .map(|p| {
                    let r = p * n * d..(p + 1) * n * d;
                    let h = Head {
                        k: &tr[0].rows[r.clone()],
                        v: &tr[1].rows[r],
                    };
                    HeadContext::new(h, n, d, &tr[0].sample.weights, scale)
                })
                .collect()
        })
    });
    let mut out = Vec::new();
    for (i, &t) in ts.iter().enumerate() {
        let info = infos[i];
        let d = info.head_dim as usize;
        let n = tr[i].sample.len();
        let plane = n * d;
        let mut points = TensorPoints {
            points: Vec::new(),
            choice: Vec::new(),
        };
        let scale = attn_scale(cache, info.head_dim);
        let value_weight = study::value_weight();
        for Trip {
            cand: c,
            sink: only,
            trip,
        } in &tr[i].trips
        {
            let c = *c;
            let Some(trip) = trip else { continue };
            let one = only.map(|s| [s]);
            let sinks: &[u32] = match (&one, trip) {
                (Some(s), _) => s,
                (None, None) => &[0],
                (None, Some(_)) => candidates::SINKS,
            };
            let hat = trip.as_ref().map(|r| &r.rows[..]);
            // Per plane error pieces shared by every sink.
            let deltas: Vec<Vec<f32>> = match (hat, &contexts) {
                (Some(hat), Some(ctx)) => timing::time(timing::Section::Distortion, || {
                    ctx.iter()
                        .enumerate()
                        .map(|(p, cx)| {
                            let r = p * plane..(p + 1) * plane;
                            let h = Head {
                                k: &tr[0].rows[r.clone()],
                                v: &tr[1].rows[r.clone()],
                            };
                            if info.kind == Kind::Key {
                                cx.key_deltas(h, &hat[r], scale)
                            } else {
                                cx.value_deltas(h, &hat[r])
                            }
                        })
                        .collect()
                }),
                _ => Vec::new(),
            };
            let exacts: Vec<usize> = sinks
                .iter()
                .map(|&s| exact_rows(&tr[i].sample, s))
                .collect();
            // Key errors of every sink per plane (computed together).
            let key_errors: Vec<Vec<f64>> = match (hat, &contexts) {
                (Some(_), Some(ctx)) if info.kind == Kind::Key => {
                    timing::time(timing::Section::Distortion, || {
                        ctx.iter()
                            .enumerate()
                            .map(|(p, cx)| cx.key_errors(&deltas[p], &exacts))
                            .collect()
                    })
                }
                _ => Vec::new(),
            };
            for (si, &exact) in exacts.iter().enumerate() {
                let sink = sinks[si];
                let distortion =
                    timing::time(timing::Section::Distortion, || match (hat, &contexts) {
                        (None, _) => 0.0,
                        (Some(hat), Some(ctx)) => {
                            let (mut num, mut den) = (0.0, 0.0);
                            for (p, cx) in ctx.iter().enumerate() {
                                let r = p * plane..(p + 1) * plane;
                                let h = Head {
                                    k: &tr[0].rows[r.clone()],
                                    v: &tr[1].rows[r.clone()],
                                };
                                den += cx.energy();
                                num += if info.kind == Kind::Key {
                                    key_errors[p][si]
                                } else {
                                    value_weight * cx.value_error(h, &hat[r], &deltas[p], exact)
                                };
                            }
                            if den > 0.0 { num / den } else { num }
                        }
                        (Some(hat), None) => {
                            let (mut num, mut den) = (0.0, 0.0);
                            for p in 0..info.planes() {
                                let r = p * plane..(p + 1) * plane;
                                let (e, s) = distortion::weighted_mse(
                                    &tr[i].rows[r.clone()],
                                    &hat[r],
                                    &tr[i].sample.weights,
                                    d,
                                    exact,
                                );
                                num += e;
                                den += s;
                            }
                            if den > 0.0 { num / den } else { num }
                        }
                    });
                points.points.push(Point {
                    bytes: tensor_bytes(info, trip.as_ref(), sink, opts),
                    distortion,
                });
                points.choice.push((c, sink));
            }
        }
        let coded = points
            .choice
            .iter()
            .any(|&(c, _)| cands[c].codec.id() != crate::codec::raw::ID);
        if !coded && let Some(e) = tr[i].refused.take() {
            // Every coding candidate refused the values (NaN, inf, or
            // beyond every format): the first refusal names the row.
            return Err(e);
        }
        if points.points.is_empty() {
            return Err(Error::param(format!(
                "{}: no candidate codec can encode it",
                info.describe()
            )));
        }
        out.push((t, points));
    }
    Ok(out)
}

/// Header (every candidate in the codec table: an upper bound), index frame
/// without entries, trailer.
fn fixed_bytes(cache: &CacheView<'_>, cands: &[Candidate], opts: &CompressOptions) -> Result<f64> {
    let infos = cache.infos();
    let align = 1u64 << opts.align_log2;
    let mut codecs: Vec<CodecEntry> = cands
        .iter()
        .map(|c| CodecEntry {
            id: c.codec.id(),
            params: c.codec.params(),
        })
        .collect();
    codecs.push(CodecEntry {
        id: crate::codec::raw::ID,
        params: Vec::new(),
    });
    let nt = infos.len() as u64;
    let header = FileHeader {
        version_major: VERSION_MAJOR,
        version_minor: FileHeader::required_minor(&infos),
        align_log2: opts.align_log2,
        tensors: infos,
        codecs,
        metadata: cache.metadata.clone(),
        page_tokens: opts.layout.page_tokens,
        sink_tokens: 0,
        recent_tokens: 0,
    };
    let h = header.encode()?.len() as u64;
    let index = align_up(64 + 4 * nt + 4 * cache.token_ids.len() as u64, align) + align;
    Ok((h + index + 64) as f64)
}

/// The planner's candidate codec names for the head_dims of `cache`
/// ([`candidates::CODECS`], or the patterns of `KVPACK_PLAN_CODECS`, see
/// [`study`]).
fn planner_names(cache: &CacheView<'_>) -> Vec<String> {
    let mut dims: Vec<u32> = cache.tensors.iter().map(|t| t.info.head_dim).collect();
    dims.sort_unstable();
    dims.dedup();
    let mut names: Vec<String> = Vec::new();
    let patterns = study::codecs_override()
        .unwrap_or_else(|| candidates::CODECS.iter().map(|s| s.to_string()).collect());
    for p in &patterns {
        for &d in &dims {
            if let Some(n) = candidates::name_for(p, d)
                && !names.contains(&n)
            {
                names.push(n);
            }
        }
    }
    names
}

/// Prepares the codec `name` for the tensors of `cache` whose shape it
/// accepts ([`Codec::check`]; statistics of codecs that take them, e.g.
/// InnerQ's key normalization, and per-head_dim tables, e.g. TurboQuant's
/// codebooks, which exist only for power-of-two head_dims). `None` when it
/// accepts no tensor of the cache.
fn candidate(cache: &CacheView<'_>, plain: &Layout, name: &str) -> Result<Option<Candidate>> {
    let c = crate::codec::parse(name)?;
    let fit = CacheView {
        tensors: cache
            .tensors
            .iter()
            .filter(|t| c.check(&t.info).is_ok())
            .cloned()
            .collect(),
        metadata: cache.metadata.clone(),
        token_ids: Vec::new(),
    };
    if fit.tensors.is_empty() {
        return Ok(None);
    }
    let codec = match c.prepare(&fit, plain)? {
        Some(p) => p,
        None => c,
    };
    let hqmq = (codec.id() == crate::codec::hqmq::ID)
        .then(|| Hqmq::from_params(&codec.params()))
        .transpose()?;
    Ok(Some(Candidate { codec, hqmq }))
}

fn measure(cache: &CacheView<'_>, opts: &CompressOptions) -> Result<Measured> {
    check_finite(cache)?;
    measure_names(cache, opts, &planner_names(cache), false)
}

/// Refuses a cache holding a NaN or infinity, naming the first one's
/// tensor, plane and token: every coding candidate refuses such a row, and
/// the planner would otherwise keep it only by chance (inside a sink
/// window, or by storing its tensor `raw`).
///
/// # Errors
/// [`Error::Parameter`].
fn check_finite(cache: &CacheView<'_>) -> Result<()> {
    let first: Vec<Option<(usize, usize)>> = cache
        .tensors
        .par_iter()
        .map(|t| {
            let mut row = vec![0.0f32; t.info.head_dim as usize];
            (0..t.info.planes())
                .flat_map(|p| (0..t.info.tokens as usize).map(move |tok| (p, tok)))
                .find(|&(p, tok)| {
                    // All exponent bits set: infinity or NaN (on the bits,
                    // without widening); fp8 rows are widened.
                    match t.row(p, tok) {
                        Elems::Bf16(r) => r.iter().any(|x| x.to_bits() & 0x7f80 == 0x7f80),
                        Elems::F16(r) => r.iter().any(|x| x.to_bits() & 0x7c00 == 0x7c00),
                        Elems::F32(r) => !r.iter().all(|x| x.is_finite()),
                        Elems::Fp8(..) => {
                            t.load_row(p, tok, &mut row);
                            !row.iter().all(|x| x.is_finite())
                        }
                    }
                })
        })
        .collect();
    match first
        .iter()
        .enumerate()
        .find_map(|(i, f)| f.map(|pt| (i, pt)))
    {
        None => Ok(()),
        Some((i, (p, tok))) => {
            let info = &cache.tensors[i].info;
            Err(Error::param(format!(
                "{} ({}) plane {p} token {tok}: non-finite value (NaN or inf); \
                 --bits plans finite caches only",
                info.name,
                info.describe()
            )))
        }
    }
}

/// Measures the codecs `names` on every tensor of `cache`; with
/// `skip_unfit`, a name whose codec cannot be prepared for this cache (a
/// block larger than head_dim, say) is left out instead of failing.
fn measure_names(
    cache: &CacheView<'_>,
    opts: &CompressOptions,
    names: &[String],
    skip_unfit: bool,
) -> Result<Measured> {
    if cache.tensors.is_empty() {
        return Err(Error::param("the cache has no K/V tensors"));
    }
    let plain = Layout {
        sink: 0,
        recent: 0,
        ..opts.layout
    };
    let mut candidates: Vec<Candidate> = Vec::new();
    for n in names {
        match candidate(cache, &plain, n) {
            Ok(None) => {}
            Ok(Some(mut c)) => {
                // hqmq configurations of one S and seed share codebooks.
                if let Some(h) = c.hqmq.take() {
                    let first = candidates.iter().find_map(|o| {
                        o.hqmq
                            .as_ref()
                            .filter(|o| o.secondaries == h.secondaries && o.seed == h.seed)
                    });
                    c.hqmq = Some(match first {
                        Some(o) => h.with_codebooks_of(o),
                        None => h,
                    });
                }
                candidates.push(c)
            }
            Err(_) if skip_unfit => {}
            Err(e) => return Err(e),
        }
    }
    // Layers: consecutive tensors of one layer index.
    let mut layers: Vec<Vec<usize>> = Vec::new();
    for (i, t) in cache.tensors.iter().enumerate() {
        match layers.last_mut() {
            Some(l) if cache.tensors[l[0]].info.layer == t.info.layer => l.push(i),
            _ => layers.push(vec![i]),
        }
    }
    let per_layer = layers
        .par_iter()
        .map(|ts| layer_points(cache, ts, &candidates, opts))
        .collect::<Result<Vec<_>>>()?;
    let mut tensors: Vec<Option<TensorPoints>> = vec![None; cache.tensors.len()];
    for (t, p) in per_layer.into_iter().flatten() {
        tensors[t] = Some(p);
    }
    let m = Measured {
        fixed: fixed_bytes(cache, &candidates, opts)?,
        candidates,
        tensors: tensors
            .into_iter()
            .map(|t| t.expect("every tensor measured"))
            .collect(),
        elements: cache.elements(),
    };
    if let Some(path) = study::points_path() {
        study::write_points(&path, cache, m.study_points())?;
    }
    Ok(m)
}

impl Measured {
    /// Every tensor's operating points as [`study::write_points`] writes
    /// them.
    fn study_points(&self) -> Vec<Vec<study::PointOut>> {
        self.tensors
            .iter()
            .map(|t| {
                t.points
                    .iter()
                    .zip(&t.choice)
                    .map(|(p, &(c, sink))| study::PointOut {
                        codec: self.candidates[c].codec.name(),
                        sink,
                        bytes: p.bytes,
                        distortion: p.distortion,
                    })
                    .collect()
            })
            .collect()
    }

    /// The plan for `bits` per element with `slack` bytes kept free.
    /// `excluded` lists `(tensor, candidate)` pairs not to choose.
    fn plan(
        &self,
        cache: &CacheView<'_>,
        bits: f64,
        slack: f64,
        excluded: &[(usize, usize)],
    ) -> Result<Plan> {
        let budget = bits * self.elements as f64 / 8.0;
        let avail = budget - self.fixed - slack;
        // Per tensor, the indices of its allowed points.
        let allowed: Vec<Vec<usize>> = self
            .tensors
            .iter()
            .enumerate()
            .map(|(t, tp)| {
                (0..tp.points.len())
                    .filter(|&i| !excluded.contains(&(t, tp.choice[i].0)))
                    .collect()
            })
            .collect();
        if let Some(t) = allowed.iter().position(|a| a.is_empty()) {
            return Err(Error::param(format!(
                "{}: every candidate codec refused its values",
                cache.tensors[t].info.describe()
            )));
        }
        let options: Vec<Vec<Point>> = allowed
            .iter()
            .zip(&self.tensors)
            .map(|(a, tp)| a.iter().map(|&i| tp.points[i]).collect())
            .collect();
        let chosen = allocate::allocate(&options, avail).map_err(|least| {
            Error::param(format!(
                "--bits {bits}: the smallest plan of this cache needs about {:.3} bits/element",
                8.0 * (least + self.fixed) / self.elements.max(1) as f64
            ))
        })?;
        let chosen: Vec<usize> = chosen.iter().zip(&allowed).map(|(&i, a)| a[i]).collect();
        let mut used: Vec<usize> = chosen
            .iter()
            .zip(&self.tensors)
            .map(|(&i, t)| t.choice[i].0)
            .collect();
        used.sort_unstable();
        used.dedup();
        let mut tensors = Vec::new();
        let mut slots = Vec::new();
        let mut cands = Vec::new();
        let mut bytes = self.fixed;
        let mut total_d = 0.0;
        for (t, (&i, tp)) in chosen.iter().zip(&self.tensors).enumerate() {
            let (c, sink) = tp.choice[i];
            let info = &cache.tensors[t].info;
            let pt = tp.points[i];
            bytes += pt.bytes;
            total_d += pt.distortion;
            slots.push(used.binary_search(&c).expect("used codec"));
            cands.push(c);
            tensors.push(TensorPlan {
                name: info.name.clone(),
                layer: info.layer,
                kind: info.kind.name().to_string(),
                codec: self.candidates[c].codec.name(),
                sink: sink.min(info.tokens),
                bits: 8.0 * pt.bytes / info.elements().max(1) as f64,
                distortion: pt.distortion,
            });
        }
        let codecs = used
            .iter()
            .map(|&c| match &self.candidates[c].hqmq {
                // The same configuration, with the codebooks the samples
                // built.
                Some(h) => Ok(Box::new(h.clone_with_codebooks()) as Box<dyn Codec>),
                None => {
                    let e = CodecEntry {
                        id: self.candidates[c].codec.id(),
                        params: self.candidates[c].codec.params(),
                    };
                    crate::codec::from_entry(0, &e)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Plan {
            budget_bits: bits,
            tensors,
            estimated_bits: 8.0 * bytes / self.elements.max(1) as f64,
            distortion: total_d,
            codecs,
            slots,
            candidates: cands,
        })
    }
}

/// Plans `cache` for a budget of `bits` per element, everything counted,
/// with the page size, alignment and zstd of `opts` (its windows are
/// ignored: the planner chooses them).
///
/// # Errors
/// [`Error::Parameter`] when `bits` is not a positive finite number, the
/// cache is empty, or the budget is below the smallest plan (the message
/// gives the least bits/element possible).
pub fn plan(cache: &CacheView<'_>, bits: f64, opts: &CompressOptions) -> Result<Plan> {
    check_bits(bits)?;
    measure(cache, opts)?.plan(cache, bits, 0.0, &[])
}

fn check_bits(bits: f64) -> Result<()> {
    if bits.is_finite() && bits > 0.0 {
        Ok(())
    } else {
        Err(Error::param(format!(
            "--bits must be a positive number of bits per element, not {bits}"
        )))
    }
}

/// Plans `cache` for `bits` per element ([`plan`]) and writes the file to
/// `out`; the file never exceeds the budget (`8 * bytes <= bits *
/// elements`). The file is built in memory first (its size, about
/// `bits / 16` of a bf16 source, is held once) so that an over-budget
/// result is re-planned, not written. `progress` is called with the source
/// bytes encoded so far.
///
/// # Errors
/// As [`plan`]; [`Error::Parameter`] when no plan fits after 6 attempts (a
/// codec that refuses a tensor's values outside the sampled rows is left out
/// for that tensor and the cache re-planned);
/// [`Error::Io`] when writing fails.
pub fn compress_budget<W: Write + Send>(
    cache: &CacheView<'_>,
    bits: f64,
    opts: &CompressOptions,
    mut out: W,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<(W, CompressReport, Plan)> {
    check_bits(bits)?;
    let start = std::time::Instant::now();
    let m = measure(cache, opts)?;
    let (buf, mut report, plan) = m.write(cache, bits, opts, progress)?;
    timing::report();
    out.write_all(&buf)
        .map_err(|e| Error::io("writing the planned file", e))?;
    report.seconds = start.elapsed().as_secs_f64();
    Ok((out, report, plan))
}

impl Measured {
    /// The file of the plan for `bits`, in memory, re-planned with the
    /// excess kept free while it comes out over the budget.
    fn write(
        &self,
        cache: &CacheView<'_>,
        bits: f64,
        opts: &CompressOptions,
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<(Vec<u8>, CompressReport, Plan)> {
        let budget = bits * cache.elements() as f64 / 8.0;
        let mut slack = 0.0;
        // (tensor, candidate) pairs whose encode refused the tensor's
        // values outside the sample.
        let mut excluded: Vec<(usize, usize)> = Vec::new();
        for _ in 0..6 {
            let p = timing::time(timing::Section::Allocate, || {
                self.plan(cache, bits, slack, &excluded)
            })?;
            let layouts: Vec<Layout> = p
                .tensors
                .iter()
                .map(|t| Layout {
                    sink: t.sink,
                    recent: 0,
                    ..opts.layout
                })
                .collect();
            let label = format!("plan:{bits}");
            let encoded = timing::time(timing::Section::Encode, || {
                let refs: Vec<&dyn Codec> = p.codecs.iter().map(|c| c.as_ref()).collect();
                compress_mixed(
                    cache,
                    &refs,
                    &p.slots,
                    &layouts,
                    &label,
                    opts,
                    Vec::new(),
                    progress,
                )
            });
            let (buf, report) = match encoded {
                Err(e @ Error::Parameter(_)) => {
                    let refusing = p.refusing(cache, &layouts, opts);
                    if refusing.is_empty() {
                        return Err(e);
                    }
                    excluded.extend(refusing);
                    continue;
                }
                r => r?,
            };
            let len = buf.len() as f64;
            if len <= budget {
                return Ok((buf, report, p));
            }
            slack += (len - budget) * 1.25 + f64::from(1u32 << opts.align_log2);
        }
        Err(Error::param(format!(
            "--bits {bits}: no plan fitted the budget after 6 attempts"
        )))
    }
}

impl Plan {
    /// The `(tensor, candidate)` pairs of this plan whose codec refuses
    /// the whole tensor (a value outside the sampled rows that its format
    /// cannot hold): each tensor encoded alone with its codec and window.
    fn refusing(
        &self,
        cache: &CacheView<'_>,
        layouts: &[Layout],
        opts: &CompressOptions,
    ) -> Vec<(usize, usize)> {
        (0..cache.tensors.len())
            .filter(|&t| {
                let one = CacheView {
                    tensors: vec![cache.tensors[t].clone()],
                    metadata: Default::default(),
                    token_ids: Vec::new(),
                };
                let codec = [self.codecs[self.slots[t]].as_ref()];
                let r = compress_mixed(
                    &one,
                    &codec,
                    &[0],
                    &layouts[t..=t],
                    "probe",
                    opts,
                    std::io::sink(),
                    &|_| {},
                );
                matches!(r, Err(Error::Parameter(_)))
            })
            .map(|t| (t, self.candidates[t]))
            .collect()
    }
}

/// The budgets of the rate-distortion report (`kvpack eval --plot`), bits
/// per element.
pub const REPORT_BUDGETS: &[f64] = &[2.5, 3.0, 3.25, 3.5, 4.0, 4.25, 5.0];

/// One planned file of the rate-distortion report.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PlanPoint {
    /// The budget, bits per element.
    pub budget: f64,
    /// The file's bits per element, everything counted.
    pub bits: f64,
    /// The plan's summed estimated distortion.
    pub distortion: f64,
}

/// Plans and writes (in memory) `cache` at each of `budgets`; budgets
/// below the smallest plan are skipped.
///
/// # Errors
/// As [`compress_budget`], except a budget too small for any plan.
pub fn plan_points(
    cache: &CacheView<'_>,
    budgets: &[f64],
    opts: &CompressOptions,
) -> Result<Vec<PlanPoint>> {
    let m = measure(cache, opts)?;
    let mut out = Vec::new();
    for &b in budgets {
        check_bits(b)?;
        match m.write(cache, b, opts, &|_| {}) {
            Ok((buf, _, p)) => out.push(PlanPoint {
                budget: b,
                bits: 8.0 * buf.len() as f64 / cache.elements().max(1) as f64,
                distortion: p.distortion,
            }),
            Err(Error::Parameter(_)) => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// One codec applied to every tensor (no window), as the planner measures
/// it: a point of the rate-distortion report (`kvpack eval --plot`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct UniformPoint {
    /// Canonical codec name.
    pub codec: String,
    /// Estimated bits per element of the whole file.
    pub bits: f64,
    /// Summed distortion over the tensors (the planner's objective).
    pub distortion: f64,
    /// Of which keys.
    pub distortion_k: f64,
    /// Of which values (and latents).
    pub distortion_v: f64,
}

/// The planner's distortion measure of single codecs applied uniformly to
/// every tensor without windows: the planner's candidates and every
/// registered codec family's example parameter sets (the ones the
/// conformance suite runs), so the report shows every codec next to the
/// planner. Codecs that cannot code some tensor of `cache` (e.g. `bdr128`
/// on head_dim 64) are left out.
///
/// # Errors
/// As [`plan`].
pub fn uniform_points(cache: &CacheView<'_>, opts: &CompressOptions) -> Result<Vec<UniformPoint>> {
    let mut names = planner_names(cache);
    for f in crate::codec::registry::FAMILIES {
        for e in f.examples {
            if !names.iter().any(|n| n == e.name) {
                names.push(e.name.to_string());
            }
        }
    }
    let m = measure_names(cache, opts, &names, true)?;
    let mut out = Vec::new();
    'cand: for (c, cand) in m.candidates.iter().enumerate() {
        let (mut bytes, mut d, mut dk, mut dv) = (m.fixed, 0.0, 0.0, 0.0);
        for (t, tp) in m.tensors.iter().enumerate() {
            let Some(i) = tp.choice.iter().position(|&(cc, s)| cc == c && s == 0) else {
                continue 'cand;
            };
            bytes += tp.points[i].bytes;
            d += tp.points[i].distortion;
            match cache.tensors[t].info.kind {
                Kind::Key => dk += tp.points[i].distortion,
                _ => dv += tp.points[i].distortion,
            }
        }
        out.push(UniformPoint {
            codec: cand.codec.name(),
            bits: 8.0 * bytes / m.elements.max(1) as f64,
            distortion: d,
            distortion_k: dk,
            distortion_v: dv,
        });
    }
    Ok(out)
}

/// How one tensor of a file is stored, read back from its pages.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct TensorCoding {
    /// Codec slots of its coded (non-`raw`) pages, ascending; `raw`'s slot
    /// alone when every page is `raw`.
    pub slots: Vec<u16>,
    /// Leading tokens stored in `raw` pages before the first coded page.
    pub sink: u32,
    /// Trailing tokens stored in `raw` pages after the last coded page.
    pub recent: u32,
}

/// How each of `n_tensors` tensors is stored: from the index `entries`
/// and the codec ids of the codec table (`codec_ids[slot]`). Shows a budget
/// plan (`kvpack inspect`), and any other file's codec and windows.
pub fn coding(
    entries: &[crate::format::IndexEntry],
    codec_ids: &[u16],
    n_tensors: usize,
) -> Vec<TensorCoding> {
    let is_raw = |slot: u16| codec_ids.get(slot as usize) == Some(&crate::codec::raw::ID);
    let mut out = vec![TensorCoding::default(); n_tensors];
    let mut pages: Vec<Vec<crate::format::PageMeta>> = vec![Vec::new(); n_tensors];
    for e in entries {
        if let Some(p) = pages.get_mut(e.meta.tensor as usize) {
            p.push(e.meta);
        }
    }
    for (c, mut p) in out.iter_mut().zip(pages) {
        p.sort_by_key(|m| m.token_start);
        let coded: Vec<&crate::format::PageMeta> = p.iter().filter(|m| !is_raw(m.codec)).collect();
        let (Some(first), Some(last)) = (coded.first(), coded.last()) else {
            c.slots = p.first().map(|m| vec![m.codec]).unwrap_or_default();
            continue;
        };
        c.slots = coded.iter().map(|m| m.codec).collect();
        c.slots.sort_unstable();
        c.slots.dedup();
        c.sink = first.token_start;
        let end = p.last().map(|m| m.token_start + m.tokens).unwrap_or(0);
        c.recent = end - (last.token_start + last.tokens);
    }
    out
}

/// How a cache is coded: one codec everywhere, one for the keys and one
/// for the values, or a budget plan.
#[derive(Debug, Clone, Copy)]
pub enum Method<'a> {
    /// One codec for every tensor, windows from the options.
    Codec(&'a dyn Codec),
    /// `key` for the keys and MLA latents, `value` for the values, both
    /// with the windows of the options ([`compress_split`]; callers
    /// defaulting the windows take both codecs' own, [`split_windows`]).
    Split {
        /// Codec of the keys (and latents).
        key: &'a dyn Codec,
        /// Codec of the values.
        value: &'a dyn Codec,
    },
    /// A plan for this many bits per element, everything counted
    /// ([`compress_budget`]).
    Bits(f64),
}

/// The windows of a K/V split whose caller left `sink` / `recent` unset
/// (`None`): `layout`'s (the value codec's defaults, as for one codec)
/// widened to the key codec's own defaults ([`Codec::default_windows`]),
/// so that neither codec loses the windows it expects.
pub fn split_windows(
    layout: Layout,
    key: &dyn Codec,
    sink: Option<u32>,
    recent: Option<u32>,
) -> Layout {
    let (ks, kr) = key.default_windows();
    Layout {
        sink: sink.unwrap_or(layout.sink.max(ks)),
        recent: recent.unwrap_or(layout.recent.max(kr)),
        ..layout
    }
}

/// Compresses `cache` with `key` on its keys and MLA latents and `value` on
/// its values, every tensor with the sink/recent windows of `opts` (stored
/// raw): each codec is checked against and prepared on the tensors it codes
/// ([`Codec::prepare`]), the codec table holds the codecs used, and each
/// tensor points at its kind's. A K/V split at fixed bit widths, as KIVI
/// and InnerQ choose per kind; `kvpack inspect` shows each tensor's codec.
/// The report's codec is `K {key} / V {value}` (the kinds present).
///
/// # Errors
/// [`Error::Parameter`] when a codec cannot code a tensor of its kind (its
/// check or preparation), or as [`crate::compress::compress_mixed`].
pub fn compress_split<W: Write + Send>(
    cache: &CacheView<'_>,
    key: &dyn Codec,
    value: &dyn Codec,
    opts: &CompressOptions,
    out: W,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<(W, CompressReport)> {
    // Each codec checked against and prepared on the tensors it codes; a
    // kind the cache lacks gets no codec slot.
    // (the prepared codec, if preparing made one; the codec given)
    type Chosen<'c> = (Option<Box<dyn Codec>>, &'c dyn Codec);
    let mut chosen: Vec<Chosen<'_>> = Vec::new();
    let mut label = Vec::new();
    let mut slot_of = [0usize; 2];
    for (i, (c, keys)) in [(key, true), (value, false)].into_iter().enumerate() {
        let part = CacheView {
            tensors: cache
                .tensors
                .iter()
                .filter(|t| (t.info.kind == Kind::Value) != keys)
                .cloned()
                .collect(),
            metadata: cache.metadata.clone(),
            token_ids: Vec::new(),
        };
        if part.tensors.is_empty() {
            continue;
        }
        for t in &part.tensors {
            c.check(&t.info)?;
        }
        slot_of[i] = chosen.len();
        chosen.push((c.prepare(&part, &opts.layout)?, c));
        label.push(format!("{} {}", if keys { "K" } else { "V" }, c.name()));
    }
    let codecs: Vec<&dyn Codec> = chosen
        .iter()
        .map(|(p, c)| p.as_deref().unwrap_or(*c))
        .collect();
    let slots: Vec<usize> = cache
        .tensors
        .iter()
        .map(|t| slot_of[usize::from(t.info.kind == Kind::Value)])
        .collect();
    let layouts = vec![opts.layout; cache.tensors.len()];
    let label = label.join(" / ");
    compress_mixed(
        cache, &codecs, &slots, &layouts, &label, opts, out, progress,
    )
}

/// Compresses `cache` into `out` by `method`: [`crate::compress_view`],
/// [`compress_split`] or [`compress_budget`].
///
/// # Errors
/// As those functions.
pub fn compress_with<W: Write + Send>(
    cache: &CacheView<'_>,
    method: Method<'_>,
    opts: &CompressOptions,
    out: W,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<(W, CompressReport)> {
    compress_with_release(cache, method, opts, out, progress, &|_| {})
}

/// [`compress_with`], calling `tensor_done(i)` once tensor `i` of `cache`
/// is no longer read (the CLI releases a mapped input's pages so), as
/// [`crate::compress::compress_view_with`] does. With [`Method::Bits`] the
/// planner reads every tensor twice (sample, then encode) and the hook is
/// not called, nor with [`Method::Split`].
///
/// # Errors
/// As [`compress_with`].
pub fn compress_with_release<W: Write + Send>(
    cache: &CacheView<'_>,
    method: Method<'_>,
    opts: &CompressOptions,
    out: W,
    progress: &(dyn Fn(u64) + Sync),
    tensor_done: &(dyn Fn(usize) + Sync),
) -> Result<(W, CompressReport)> {
    match method {
        Method::Codec(c) => {
            crate::compress::compress_view_with(cache, c, opts, out, progress, tensor_done)
        }
        Method::Split { key, value } => compress_split(cache, key, value, opts, out, progress),
        Method::Bits(b) => compress_budget(cache, b, opts, out, progress).map(|(w, r, _)| (w, r)),
    }
}

#[cfg(test)]
mod tests;
