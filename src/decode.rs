//! Decompression: a kvpack file (borrowed bytes, e.g. an mmap) back into a
//! [`KvCache`], in whole or in part, decoding pages on all threads.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use rayon::prelude::*;

use crate::cache::{DType, Elems, ElemsMut, Kind, KvCache, Tensor, TensorData, TensorInfo};
use crate::codec::{Codec, PageOut};
use crate::error::{Error, Result};
use crate::format::{Limits, Reader, Release};
use crate::view::{RawDst, Rows, RowsOut, Strides, TensorViewMut, plane_offset};

/// Where [`Archive::decode_into`] writes one tensor.
#[derive(Debug)]
pub struct Destination<'a> {
    /// Index of the tensor in the file's tensor table.
    pub tensor: usize,
    /// First stored token (cache slot) to decode.
    pub first_token: u32,
    /// The caller's memory; `view.info.tokens` tokens are decoded.
    pub view: TensorViewMut<'a>,
}

/// One page's share of a destination.
struct PageJob<'o> {
    page: usize,
    info: TensorInfo,
    lo: u32,
    hi: u32,
    dst: PageDst<'o>,
}

enum PageDst<'o> {
    /// Per-plane slices of the page's overlap (kvpack's axis order).
    Planes(Vec<ElemsMut<'o>>),
    /// Any other axis order: decode to scratch, scatter rows.
    Scatter(RawDst, Rows<'o>),
}

/// Which part of a cache to decode. The default selects everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selection {
    /// Layers `[start, end)`; `None` for all.
    pub layers: Option<Range<u32>>,
    /// Cache slots `[start, end)` of each layer (clamped to the layer's
    /// token count); `None` for all.
    pub tokens: Option<Range<u32>>,
    /// Only K, only V or only MLA latents; `None` for all.
    pub kind: Option<Kind>,
}

/// One output tensor of a selection ([`Archive::select`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selected {
    /// Index of the tensor in the file's tensor table.
    pub tensor: usize,
    /// First stored token (cache slot) of the output.
    pub first_token: u32,
    /// The output: the file tensor's name and shape with `tokens` the
    /// selected count, `dtype` the output element type.
    pub info: TensorInfo,
}

/// A decoded part of one output tensor, as [`Archive::decode_pieces`] and
/// [`crate::stream_decode::decode_stream_pieces`] hand it to their sink.
#[derive(Debug)]
pub struct Piece<'a> {
    /// Position of the output tensor in the selection.
    pub output: usize,
    /// First token of the piece within the output tensor.
    pub token: u32,
    /// Tokens in the piece.
    pub tokens: u32,
    /// The elements `[planes, tokens, head_dim]` (planes = batch *
    /// kv_heads, plane-major like the output tensor), in the output dtype.
    pub elems: Elems<'a>,
}

/// Counters of one decode, for locality checks and throughput.
#[derive(Debug, Default)]
pub struct DecodeStats {
    /// Pages decoded.
    pub pages: AtomicU64,
    /// Stored page bytes read (frames).
    pub bytes_read: AtomicU64,
}

/// A validated kvpack file with its codecs instantiated.
#[derive(Debug)]
pub struct Archive<'a> {
    reader: Reader<'a>,
    codecs: Vec<Box<dyn Codec>>,
}

impl<'a> Archive<'a> {
    /// Opens `buf` (see [`Reader::open_with`]) and builds its codecs.
    ///
    /// # Errors
    /// [`Error::Format`] for an invalid file or an unknown codec id.
    pub fn open(buf: &'a [u8]) -> Result<Archive<'a>> {
        Self::open_with(buf, Limits::default())
    }

    /// Like [`Archive::open`] with explicit limits.
    ///
    /// # Errors
    /// As [`Archive::open`].
    pub fn open_with(buf: &'a [u8], limits: Limits) -> Result<Archive<'a>> {
        let reader = Reader::open_with(buf, limits)?;
        let codecs = reader
            .header()
            .codecs
            .iter()
            .enumerate()
            .map(|(i, e)| crate::codec::from_entry(i, e))
            .collect::<Result<Vec<_>>>()?;
        crate::codec::check_pages_fit(
            &codecs,
            &reader.header().tensors,
            reader.index().entries.iter().map(|e| e.meta),
        )?;
        Ok(Archive { reader, codecs })
    }

    /// Pages are copied out of the buffer before they are verified and
    /// decoded ([`Reader::set_private_pages`]); for memory-mapped files
    /// that another process could rewrite.
    pub fn with_private_pages(mut self, on: bool) -> Self {
        self.reader.set_private_pages(on);
        self
    }

    /// With private pages on, each page frame's bytes are handed to
    /// `release` once copied ([`Reader::set_release`]): for a memory-mapped
    /// input, resident memory then follows the pages in flight.
    pub fn with_release(mut self, release: Option<&'a dyn Release>) -> Self {
        self.reader.set_release(release);
        self
    }

    /// The underlying container reader.
    pub fn reader(&self) -> &Reader<'a> {
        &self.reader
    }

    /// The codec of table slot `slot`.
    ///
    /// # Panics
    /// If `slot` is out of range (the reader validated every page's slot).
    pub fn codec(&self, slot: usize) -> &dyn Codec {
        self.codecs[slot].as_ref()
    }

    /// The codecs of the codec table.
    pub fn codecs(&self) -> &[Box<dyn Codec>] {
        &self.codecs
    }

    /// Tensor infos with the current (latest commit) token counts.
    pub fn tensors(&self) -> Vec<TensorInfo> {
        let h = self.reader.header();
        h.tensors
            .iter()
            .enumerate()
            .map(|(i, t)| TensorInfo {
                tokens: self.reader.tokens(i),
                ..t.clone()
            })
            .collect()
    }

    /// Decodes the selected part of the cache. Output tensors keep their
    /// names; `dtype` overrides the element type (default: source dtype; an
    /// fp8 request takes its scale from the source, [`DType::for_source`]).
    /// Only pages overlapping the selection are read.
    ///
    /// # Errors
    /// [`Error::Format`] naming the page for a corrupted page or section.
    pub fn decode(
        &self,
        sel: &Selection,
        dtype: Option<DType>,
        stats: Option<&DecodeStats>,
    ) -> Result<KvCache> {
        let h = self.reader.header();
        let selected = self.select(sel, dtype);
        self.check_output(&selected)?;
        let mut tensors = Vec::new();
        let mut wanted = Vec::new();
        for s in selected {
            let data = TensorData::zeros(s.info.dtype, s.info.elements() as usize);
            tensors.push(Tensor { info: s.info, data });
            wanted.push((s.tensor, s.first_token));
        }
        let outs = tensors
            .iter_mut()
            .zip(&wanted)
            .map(|(t, &(tensor, first_token))| {
                let strides = Strides::head_major(&t.info);
                Ok(Destination {
                    tensor,
                    first_token,
                    view: TensorViewMut::new(t.info.clone(), t.data.as_elems_mut(), strides)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        self.decode_into(outs, stats)?;
        Ok(KvCache {
            tensors,
            metadata: h.metadata.clone(),
            token_ids: self.reader.index().token_ids.clone(),
        })
    }

    /// The output tensors of `sel`, in file order: the file tensors of the
    /// selected layers and kind, restricted to the selected tokens
    /// (clamped to each tensor's count), with element type `dtype` (default:
    /// the source dtype; an fp8 request takes its scale from the source,
    /// [`DType::for_source`]).
    pub fn select(&self, sel: &Selection, dtype: Option<DType>) -> Vec<Selected> {
        self.tensors()
            .into_iter()
            .enumerate()
            .filter(|(_, info)| {
                sel.layers.as_ref().is_none_or(|r| r.contains(&info.layer))
                    && sel.kind.is_none_or(|k| k == info.kind)
            })
            .map(|(tensor, info)| {
                let (lo, hi) = match &sel.tokens {
                    Some(r) => (
                        r.start.min(info.tokens),
                        r.end.min(info.tokens).max(r.start.min(info.tokens)),
                    ),
                    None => (0, info.tokens),
                };
                Selected {
                    tensor,
                    first_token: lo,
                    info: TensorInfo {
                        tokens: hi - lo,
                        dtype: dtype.map_or(info.dtype, |d| d.for_source(info.dtype)),
                        ..info
                    },
                }
            })
            .collect()
    }

    /// Checks the output that `outs` declare (from header fields, before
    /// anything is allocated or written) against the reader's
    /// [`Limits::max_memory`]; returns its size in bytes.
    ///
    /// # Errors
    /// [`Error::Limits`] naming the first tensor (name, layer, kind and
    /// shape) at which the running total exceeds the limit.
    pub fn check_output(&self, outs: &[Selected]) -> Result<u64> {
        check_declared(self.reader.limits(), outs.iter().map(|s| &s.info))
    }

    /// Decodes the pages of `outs` on all threads of the current rayon
    /// pool and hands each decoded page (its overlap with the selected
    /// tokens) to `sink`, in no particular order, from the worker threads.
    /// At most one page per thread is held in memory (plus what `sink`
    /// keeps), whatever the size of the outputs: a caller writes pieces to
    /// a file at their offsets or compares them with a reference as they
    /// come. The declared output is not checked here (see
    /// [`Archive::check_output`]).
    ///
    /// # Errors
    /// [`Error::Format`] naming the page for a corrupted page or section;
    /// the first error of `sink`.
    pub fn decode_pieces(
        &self,
        outs: &[Selected],
        stats: Option<&DecodeStats>,
        sink: &(dyn Fn(Piece<'_>) -> Result<()> + Sync),
    ) -> Result<()> {
        let jobs: Vec<(usize, usize)> = outs
            .iter()
            .enumerate()
            // An empty selection decodes nothing: never walk the declared
            // planes (a hostile header may declare 2^30 of them).
            .filter(|(_, s)| s.info.tokens > 0)
            .flat_map(|(o, s)| {
                let hi = s.first_token + s.info.tokens;
                self.reader
                    .pages_overlapping(s.tensor, s.first_token, hi)
                    .into_iter()
                    .map(move |pi| (o, pi))
            })
            .collect();
        jobs.into_par_iter().try_for_each(|(o, pi)| {
            let s = &outs[o];
            let (a, n, scratch) = self.decode_page_scratch(
                pi,
                &s.info,
                s.first_token,
                s.first_token + s.info.tokens,
                stats,
            )?;
            sink(Piece {
                output: o,
                token: a - s.first_token,
                tokens: n as u32,
                elems: scratch.as_elems(),
            })
        })
    }

    /// Decodes tensors into caller-owned memory: each [`Destination`]
    /// receives tokens `[first_token, first_token + view.info.tokens)` of
    /// file tensor `tensor`, converted to the view's dtype, at the view's
    /// strides (any axis order; kvpack's own order is decoded in place,
    /// others page by page through a page-sized scratch buffer). Pages are
    /// decoded on all threads of the current rayon pool. Only pages
    /// overlapping the requested tokens are read.
    ///
    /// # Errors
    /// [`Error::Parameter`] when a destination names a tensor the file does
    /// not have, its shape (layer, K/V, batch, kv_heads, head_dim) differs
    /// from the file's, its token range exceeds the stored tokens, or two
    /// destinations name the same tensor; [`Error::Format`] naming the page
    /// for a corrupted page or section.
    pub fn decode_into(
        &self,
        outs: Vec<Destination<'_>>,
        stats: Option<&DecodeStats>,
    ) -> Result<()> {
        let infos = self.tensors();
        let mut seen = vec![false; infos.len()];
        let mut jobs: Vec<PageJob<'_>> = Vec::new();
        for out in outs {
            let Some(src) = infos.get(out.tensor) else {
                return Err(Error::param(format!(
                    "destination names tensor {}, the file has {}",
                    out.tensor,
                    infos.len()
                )));
            };
            let v = &out.view.info;
            if (v.layer, v.kind, v.batch, v.heads, v.head_dim)
                != (src.layer, src.kind, src.batch, src.heads, src.head_dim)
            {
                return Err(Error::param(format!(
                    "destination for {} ({}) is shaped {:?} for layer {} {}, the file holds {:?}",
                    src.name,
                    src.describe(),
                    v.shape(),
                    v.layer,
                    v.kind.letter(),
                    src.shape()
                )));
            }
            let lo = out.first_token;
            let hi = lo.checked_add(v.tokens).filter(|&hi| hi <= src.tokens);
            let Some(hi) = hi else {
                return Err(Error::param(format!(
                    "{} ({}): tokens {lo}..{} requested, {} stored",
                    src.name,
                    src.describe(),
                    lo as u64 + v.tokens as u64,
                    src.tokens
                )));
            };
            if std::mem::replace(&mut seen[out.tensor], true) {
                return Err(Error::param(format!(
                    "two destinations for {} ({})",
                    src.name,
                    src.describe()
                )));
            }
            self.plan_jobs(out.tensor, lo, hi, out.view, &mut jobs);
        }
        jobs.into_par_iter()
            .try_for_each(|job| self.decode_job(job, stats))
    }

    /// Splits one destination into per-page jobs.
    fn plan_jobs<'o>(
        &self,
        src: usize,
        lo: u32,
        hi: u32,
        mut view: TensorViewMut<'o>,
        jobs: &mut Vec<PageJob<'o>>,
    ) {
        let pages = self.reader.pages_overlapping(src, lo, hi);
        if pages.is_empty() || lo >= hi {
            // Nothing to decode: never walk the declared planes (a hostile
            // header may declare 2^30 of them for an empty selection).
            return;
        }
        let info = view.info.clone();
        if !view.is_head_major() {
            let (dst, strides) = view.raw_parts();
            for pi in pages {
                jobs.push(PageJob {
                    page: pi,
                    info: info.clone(),
                    lo,
                    hi,
                    dst: PageDst::Scatter(dst, strides),
                });
            }
            return;
        }
        let d = info.head_dim as usize;
        let n = (hi - lo) as usize;
        let mut per_page: Vec<Vec<ElemsMut<'o>>> = (0..pages.len()).map(|_| Vec::new()).collect();
        let mut rest = view.into_elems();
        for _plane in 0..info.planes() {
            let (mut plane, r) = rest.split_at(n * d);
            rest = r;
            for (k, &pi) in pages.iter().enumerate() {
                let m = self.reader.index().entries[pi].meta;
                let a = m.token_start.max(lo);
                let b = (m.token_start + m.tokens).min(hi);
                let (head, tail) = plane.split_at((b - a) as usize * d);
                per_page[k].push(head);
                plane = tail;
            }
        }
        for (k, planes) in per_page.into_iter().enumerate() {
            jobs.push(PageJob {
                page: pages[k],
                info: info.clone(),
                lo,
                hi,
                dst: PageDst::Planes(planes),
            });
        }
    }

    fn decode_job(&self, job: PageJob<'_>, stats: Option<&DecodeStats>) -> Result<()> {
        match job.dst {
            PageDst::Planes(planes) => {
                self.decode_page(job.page, &job.info, job.lo, job.hi, planes, None, stats)
            }
            PageDst::Scatter(dst, rows) => {
                let m = self.reader.index().entries[job.page].meta;
                let inside = m.token_start >= job.lo && m.token_start + m.tokens <= job.hi;
                if inside && self.codec(m.codec as usize).row_wise() {
                    // A row-wise codec writes the page's rows in place.
                    // SAFETY: `decode_into` checked that the view's extent
                    // fits its buffer and that no two elements share an
                    // address; this job is the only one writing the page's
                    // rows (distinct pages hold distinct tokens); the buffer
                    // stays mutably borrowed by `decode_into` until every
                    // job has finished.
                    let out = unsafe {
                        RowsOut::new(dst, rows, &job.info, (m.token_start - job.lo) as usize)
                    };
                    let (lo, hi) = (job.lo, job.hi);
                    return self.decode_page(job.page, &job.info, lo, hi, vec![], Some(out), stats);
                }
                let (a, n, scratch) =
                    self.decode_page_scratch(job.page, &job.info, job.lo, job.hi, stats)?;
                let d = job.info.head_dim as usize;
                let planes = job.info.planes();
                let src = scratch.as_elems();
                let heads = job.info.heads as usize;
                let mut row = vec![0f32; d];
                // Token by token: the destination is token-major or paged.
                for t in 0..n {
                    for p in 0..planes {
                        let at = plane_offset(&rows, heads, p, (a - job.lo) as usize + t);
                        let from = (p * n + t) * d;
                        // SAFETY: `decode_into` checked that the view's
                        // extent fits its buffer and that no two elements
                        // share an address; rows of distinct (page, plane,
                        // token) are disjoint and each is written by one job
                        // only; the buffer stays mutably borrowed by
                        // `decode_into` until every job has finished.
                        let mut out = unsafe { dst.row(at, d) };
                        // The scratch has the destination's element type:
                        // copy the row's bits (fp8 goes through its scale).
                        match (&src, &mut out) {
                            (Elems::Bf16(s), ElemsMut::Bf16(o)) => {
                                o.copy_from_slice(&s[from..from + d])
                            }
                            (Elems::F16(s), ElemsMut::F16(o)) => {
                                o.copy_from_slice(&s[from..from + d])
                            }
                            (Elems::F32(s), ElemsMut::F32(o)) => {
                                o.copy_from_slice(&s[from..from + d])
                            }
                            _ => {
                                src.load(from, &mut row);
                                out.store(0, &row);
                            }
                        }
                    }
                }
                Ok(())
            }
        }
    }

    /// Decodes the overlap of page `pi` with slots `[lo, hi)` into a new
    /// buffer `[planes, overlap tokens, head_dim]` of `info.dtype`; returns
    /// the overlap's first slot, its token count and the buffer.
    fn decode_page_scratch(
        &self,
        pi: usize,
        info: &TensorInfo,
        lo: u32,
        hi: u32,
        stats: Option<&DecodeStats>,
    ) -> Result<(u32, usize, TensorData)> {
        let m = self.reader.index().entries[pi].meta;
        let (a, b) = (m.token_start.max(lo), (m.token_start + m.tokens).min(hi));
        let d = info.head_dim as usize;
        let n = (b - a) as usize;
        let planes = info.planes();
        let mut scratch = TensorData::zeros(info.dtype, planes * n * d);
        {
            let sp = scratch.as_elems_mut().split_planes(n * d, planes);
            self.decode_page(pi, info, a, b, sp, None, stats)?;
        }
        Ok((a, n, scratch))
    }

    /// Decodes page `pi` into `planes`, which hold the page's overlap with
    /// slots `[lo, hi)`, or, for a page inside `[lo, hi)` of a row-wise
    /// codec, into the destination rows `scatter`.
    #[allow(clippy::too_many_arguments)]
    fn decode_page(
        &self,
        pi: usize,
        info: &TensorInfo,
        lo: u32,
        hi: u32,
        planes: Vec<ElemsMut<'_>>,
        scatter: Option<RowsOut<'_>>,
        stats: Option<&DecodeStats>,
    ) -> Result<()> {
        let entry = self.reader.index().entries[pi];
        let m = entry.meta;
        let view = self.reader.page(pi)?;
        if let Some(s) = stats {
            s.pages.fetch_add(1, Ordering::Relaxed);
            s.bytes_read.fetch_add(entry.frame_len, Ordering::Relaxed);
        }
        let codec = self.codec(m.codec as usize);
        let src_info = TensorInfo {
            tokens: self.reader.tokens(m.tensor as usize),
            ..self.reader.header().tensors[m.tensor as usize].clone()
        };
        let inside = m.token_start >= lo && m.token_start + m.tokens <= hi;
        if inside {
            let mut out = PageOut {
                scatter,
                tensor: &src_info,
                tokens: m.tokens,
                planes,
            };
            return codec.decode(&view, &mut out);
        }
        // Partial page: decode into a scratch page, copy the overlap. The
        // scratch size comes from the page's declared tokens: bounded first.
        let d = info.head_dim as usize;
        self.reader.limits().check_memory(
            (info.planes() as u64 * u64::from(m.tokens) * d as u64)
                .saturating_mul(info.dtype.size() as u64),
            &format!("decoding part of {}", view.what),
        )?;
        let mut scratch = TensorData::zeros(info.dtype, info.planes() * m.tokens as usize * d);
        {
            let sp = scratch
                .as_elems_mut()
                .split_planes(m.tokens as usize * d, info.planes());
            let mut out = PageOut {
                scatter: None,
                tensor: &src_info,
                tokens: m.tokens,
                planes: sp,
            };
            codec.decode(&view, &mut out)?;
        }
        let skip = (lo.max(m.token_start) - m.token_start) as usize;
        let src = scratch.as_elems();
        let mut row = vec![0f32; d];
        for (p, mut dst) in planes.into_iter().enumerate() {
            let rows = dst.len() / d;
            for t in 0..rows {
                src.load((p * m.tokens as usize + skip + t) * d, &mut row);
                dst.store(t * d, &row);
            }
        }
        Ok(())
    }

    /// Validates every page (checksums, section tables) and decodes each
    /// one, discarding the output. Returns the number of pages checked.
    ///
    /// # Errors
    /// The first page error found.
    pub fn verify_pages(&self) -> Result<usize> {
        let all = self.select(&Selection::default(), Some(DType::F32));
        self.decode_pieces(&all, None, &|_| Ok(()))?;
        Ok(self.reader.index().entries.len())
    }
}

/// Checks the running total of the output bytes that `infos` declare
/// (elements times the dtype's size, from header fields) against
/// `limits.max_memory`; returns the total.
///
/// # Errors
/// [`Error::Limits`] naming the first tensor (name, layer, kind, shape) at
/// which the total exceeds the limit.
pub fn check_declared<'i>(
    limits: &Limits,
    infos: impl IntoIterator<Item = &'i TensorInfo>,
) -> Result<u64> {
    let mut total = 0u64;
    for t in infos {
        total = total.saturating_add(t.elements().saturating_mul(t.dtype.size() as u64));
        limits.check_memory(
            total,
            &format!(
                "decoding up to {} ({}, shape [batch, kv_heads, tokens, head_dim] = {:?})",
                t.name,
                t.describe(),
                t.shape()
            ),
        )?;
    }
    Ok(total)
}

/// Parses `a..b` (either end may be omitted: `..b`, `a..`) as a half-open
/// range of u32.
///
/// # Errors
/// [`Error::Parameter`] for malformed input or `a > b`.
pub fn parse_range(s: &str) -> Result<Range<u32>> {
    let bad = || {
        Error::param(format!(
            "{s:?} is not a range like 0..4, 128..512, ..8 or 16.."
        ))
    };
    let (a, b) = s.split_once("..").ok_or_else(bad)?;
    let a = if a.is_empty() {
        0
    } else {
        a.trim().parse().map_err(|_| bad())?
    };
    let b = if b.is_empty() {
        u32::MAX
    } else {
        b.trim().parse().map_err(|_| bad())?
    };
    if a > b {
        return Err(bad());
    }
    Ok(a..b)
}

/// Metadata key naming the model a cache belongs to.
pub const MODEL_KEY: &str = "kvpack.model";

impl Archive<'_> {
    /// The model name recorded in the file (`kvpack.model`), if any.
    pub fn model(&self) -> Option<&str> {
        self.reader
            .header()
            .metadata
            .get(MODEL_KEY)
            .map(String::as_str)
    }

    /// Token ids of the cached prefix (empty when not recorded).
    pub fn token_ids(&self) -> &[u32] {
        &self.reader.index().token_ids
    }

    /// How many leading tokens of `prompt` this cache holds: the length of
    /// the longest common prefix of the stored token ids and `prompt`. A
    /// loader reuses that many tokens and prefills the rest.
    ///
    /// # Errors
    /// [`Error::Parameter`] when `model` differs from the recorded model, or
    /// the file records no token ids (nothing can be matched).
    pub fn matching_prefix(&self, model: &str, prompt: &[u32]) -> Result<usize> {
        match self.model() {
            Some(m) if m != model => {
                return Err(Error::param(format!(
                    "the cache is for model {m:?}, not {model:?}"
                )));
            }
            None => {
                return Err(Error::param(
                    "the cache records no model name (kvpack.model)",
                ));
            }
            _ => {}
        }
        let ids = self.token_ids();
        if ids.is_empty() {
            return Err(Error::param("the cache records no token ids"));
        }
        Ok(ids.iter().zip(prompt).take_while(|(a, b)| a == b).count())
    }
}
