//! Compression: a [`KvCache`] through a codec into a kvpack file or stream,
//! with page encoding on all threads overlapped with writing.

use std::io::Write;
use std::time::Instant;

use rayon::prelude::*;

use crate::cache::{KvCache, Tensor, TensorInfo};
use crate::codec::{Codec, PageIn, raw::Raw};
use crate::error::{Error, Result};
use crate::format::{
    CodecEntry, FileHeader, PageFrame, PageMeta, Reader, Section, Trailer, VERSION_MAJOR,
    VERSION_MINOR, Writer,
};
use crate::plan::{Layout, PlannedPage, plan};

/// How to compress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompressOptions {
    /// Page size and sink/recent windows.
    pub layout: Layout,
    /// zstd level applied to each page body (kept only when smaller), or
    /// `None`.
    pub zstd_level: Option<i32>,
    /// Frame alignment as a power of two (6 = 64 B, 12 = 4096 B).
    pub align_log2: u8,
}

impl Default for CompressOptions {
    fn default() -> Self {
        CompressOptions {
            layout: Layout::default(),
            zstd_level: None,
            align_log2: crate::format::DEFAULT_ALIGN_LOG2,
        }
    }
}

/// What a compression produced.
#[derive(Debug, Clone, PartialEq)]
pub struct CompressReport {
    /// Canonical codec name.
    pub codec: String,
    /// Pages written.
    pub pages: usize,
    /// Of which sink/recent `raw` pages.
    pub raw_pages: usize,
    /// Elements compressed.
    pub elements: u64,
    /// Bytes of the source tensors at source precision.
    pub source_bytes: u64,
    /// Bytes written (the whole file, or the appended bytes).
    pub output_bytes: u64,
    /// Wall time, seconds.
    pub seconds: f64,
}

impl CompressReport {
    /// Output bits per source element, everything included.
    pub fn bits_per_element(&self) -> f64 {
        if self.elements == 0 {
            0.0
        } else {
            8.0 * self.output_bytes as f64 / self.elements as f64
        }
    }

    /// Source bytes / output bytes.
    pub fn ratio(&self) -> f64 {
        if self.output_bytes == 0 {
            0.0
        } else {
            self.source_bytes as f64 / self.output_bytes as f64
        }
    }
}

/// The sections of planned page `p` of `tensor` encoded by `codec`.
fn encode_sections(tensor: &Tensor, p: &PlannedPage, codec: &dyn Codec) -> Result<Vec<Section>> {
    let planes = (0..tensor.info.planes())
        .map(|pl| tensor.plane_rows(pl, p.token_start as usize, p.tokens as usize))
        .collect();
    codec.encode(&PageIn {
        tensor: &tensor.info,
        token_start: p.token_start,
        tokens: p.tokens,
        planes,
    })
}

/// The frame of planned page `p` with codec table slot `slot`.
fn page_frame(
    p: &PlannedPage,
    sections: &[Section],
    slot: usize,
    opts: &CompressOptions,
) -> Result<PageFrame> {
    let meta = PageMeta {
        tensor: p.tensor,
        token_start: p.token_start,
        tokens: p.tokens,
        codec: slot as u16,
    };
    PageFrame::encode(meta, sections, opts.zstd_level, 1 << opts.align_log2)
}

/// Source bytes of planned page `p` of a tensor described by `i`.
fn page_source_bytes(i: &TensorInfo, p: &PlannedPage) -> u64 {
    i.planes() as u64 * p.tokens as u64 * i.head_dim as u64 * i.dtype.size() as u64
}

/// Runs `f` over `items` on the current rayon pool in batches of about
/// `4 MiB / item_bytes` items (at least two per thread) and hands the
/// results to `sink` in order; while batch `k` is being written, batch
/// `k + 1` is being computed (`rayon::join`). At most two batches are held
/// in memory. Everything runs in the pool the caller is in (e.g. inside
/// `ThreadPool::install`), so a one-thread pool really uses one thread.
pub(crate) fn ordered_map<T: Sync, U: Send>(
    items: &[T],
    item_bytes: u64,
    f: impl Fn(&T) -> Result<U> + Sync,
    mut sink: impl FnMut(U) -> Result<()> + Send,
) -> Result<()> {
    const BATCH_BYTES: u64 = 4 << 20;
    let per_thread = (rayon::current_num_threads() * 2).max(2);
    let batch = per_thread.max((BATCH_BYTES / item_bytes.max(1)) as usize);
    let mut pending: Vec<U> = Vec::new();
    for chunk in items.chunks(batch) {
        let ready = std::mem::take(&mut pending);
        let (next, written) = rayon::join(
            || chunk.par_iter().map(&f).collect::<Result<Vec<U>>>(),
            || ready.into_iter().try_for_each(&mut sink),
        );
        written?;
        pending = next?;
    }
    pending.into_iter().try_for_each(&mut sink)
}

/// Encodes `pages` on all threads (`encode(page, codec table slot)` gives
/// its sections) and writes them in order. Window pages use table slot
/// `raw_slot`, others slot 0. Returns (elements, source bytes) written.
fn write_pages<W: Write + Send>(
    w: &mut Writer<W>,
    infos: &[TensorInfo],
    pages: &[PlannedPage],
    encode: &(dyn Fn(&PlannedPage, usize) -> Result<Vec<Section>> + Sync),
    raw_slot: usize,
    opts: &CompressOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<(u64, u64)> {
    let total: u64 = pages
        .iter()
        .map(|p| page_source_bytes(&infos[p.tensor as usize], p))
        .sum();
    let mut source_bytes = 0u64;
    let mut elements = 0u64;
    ordered_map(
        pages,
        total / pages.len().max(1) as u64,
        |p| {
            let slot = if p.raw { raw_slot } else { 0 };
            page_frame(p, &encode(p, slot)?, slot, opts).map(|f| (f, *p))
        },
        |(frame, p)| {
            w.write_page(&frame)?;
            let i = &infos[p.tensor as usize];
            let b = page_source_bytes(i, &p);
            source_bytes += b;
            elements += b / i.dtype.size() as u64;
            progress(source_bytes);
            Ok(())
        },
    )?;
    Ok((elements, source_bytes))
}

/// The header of a new file holding `infos` encoded by `codec` (plus the
/// `raw` codec in table slot 1 when `raw_pages`), and the codec table.
fn new_header<'c>(
    infos: Vec<TensorInfo>,
    metadata: &std::collections::BTreeMap<String, String>,
    codec: &'c dyn Codec,
    opts: &CompressOptions,
    raw_pages: bool,
) -> (FileHeader, Vec<&'c dyn Codec>) {
    let mut codecs: Vec<&dyn Codec> = vec![codec];
    let mut table = vec![CodecEntry {
        id: codec.id(),
        params: codec.params(),
    }];
    if raw_pages && codec.id() != crate::codec::raw::ID {
        codecs.push(&Raw);
        table.push(CodecEntry {
            id: Raw.id(),
            params: Raw.params(),
        });
    }
    let header = FileHeader {
        version_major: VERSION_MAJOR,
        version_minor: VERSION_MINOR,
        align_log2: opts.align_log2,
        tensors: infos,
        codecs: table,
        metadata: metadata.clone(),
        page_tokens: opts.layout.page_tokens,
        sink_tokens: opts.layout.sink,
        recent_tokens: opts.layout.recent,
    };
    (header, codecs)
}

/// Writes a new kvpack file of tensors `infos` whose codec pages were
/// encoded elsewhere (e.g. on the GPU): `sections(i)` returns the sections
/// of `pages[i]` as `codec`'s encoder would. `pages` must be the plan of
/// `infos` under `opts.layout` without window (raw) pages. Frames (and
/// zstd) are built on all threads; the result is a file the CPU reader
/// opens.
///
/// # Errors
/// [`Error::Parameter`] when `pages` is not that plan or has window pages;
/// the error of `sections`; [`Error::Io`] when writing fails.
#[allow(clippy::too_many_arguments)]
pub fn write_encoded<W: Write + Send>(
    infos: Vec<TensorInfo>,
    metadata: &std::collections::BTreeMap<String, String>,
    token_ids: &[u32],
    codec: &dyn Codec,
    opts: &CompressOptions,
    pages: &[PlannedPage],
    sections: &(dyn Fn(usize) -> Result<Vec<Section>> + Sync),
    out: W,
) -> Result<(W, CompressReport)> {
    let start = Instant::now();
    if pages != plan(&infos, &vec![0; infos.len()], opts.layout)?.as_slice()
        || pages.iter().any(|p| p.raw)
    {
        return Err(Error::param(
            "encoded pages are not the layout's plan without window pages",
        ));
    }
    let elements: u64 = infos.iter().map(|i| i.elements()).sum();
    let source: u64 = infos
        .iter()
        .map(|i| i.elements() * i.dtype.size() as u64)
        .sum();
    let (header, _) = new_header(infos.clone(), metadata, codec, opts, false);
    let mut w = Writer::new(out, &header)?;
    // Planned pages are distinct by (tensor, token_start).
    let index: std::collections::BTreeMap<(u32, u32), usize> = pages
        .iter()
        .enumerate()
        .map(|(i, p)| ((p.tensor, p.token_start), i))
        .collect();
    write_pages(
        &mut w,
        &infos,
        pages,
        &|p, _| sections(index[&(p.tensor, p.token_start)]),
        0,
        opts,
        &|_| {},
    )?;
    let (out, trailer) = w.commit(token_ids)?;
    Ok((
        out,
        CompressReport {
            codec: codec.name(),
            pages: pages.len(),
            raw_pages: 0,
            elements,
            source_bytes: source,
            output_bytes: trailer.header_len + trailer.commit_end,
            seconds: start.elapsed().as_secs_f64(),
        },
    ))
}

/// Compresses a whole cache into `out` as a new kvpack file (one commit).
/// `progress` is called with the source bytes encoded so far.
///
/// # Errors
/// [`Error::Parameter`] when the codec cannot encode a tensor (shape, NaN),
/// [`Error::Io`] when writing fails.
pub fn compress<W: Write + Send>(
    cache: &KvCache,
    codec: &dyn Codec,
    opts: &CompressOptions,
    out: W,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<(W, CompressReport)> {
    let start = Instant::now();
    if cache.tensors.is_empty() {
        return Err(Error::param("the cache has no K/V tensors"));
    }
    for t in &cache.tensors {
        codec.check(&t.info)?;
    }
    let prepared = codec.prepare(cache, &opts.layout)?;
    let codec: &dyn Codec = prepared.as_deref().unwrap_or(codec);
    let infos: Vec<_> = cache.tensors.iter().map(|t| t.info.clone()).collect();
    let pages = plan(&infos, &vec![0; infos.len()], opts.layout)?;
    let raw_pages = pages.iter().filter(|p| p.raw).count();
    let (header, codecs) = new_header(infos, &cache.metadata, codec, opts, raw_pages > 0);
    let mut w = Writer::new(out, &header)?;
    write_pages(
        &mut w,
        &header.tensors,
        &pages,
        &|p, slot| encode_sections(&cache.tensors[p.tensor as usize], p, codecs[slot]),
        codecs.len() - 1,
        opts,
        progress,
    )?;
    let (out, trailer) = w.commit(&cache.token_ids)?;
    let output_bytes = trailer.header_len + trailer.commit_end;
    Ok((
        out,
        CompressReport {
            codec: codec.name(),
            pages: pages.len(),
            raw_pages,
            elements: cache.elements(),
            source_bytes: cache.source_bytes(),
            output_bytes,
            seconds: start.elapsed().as_secs_f64(),
        },
    ))
}

/// Appends the tokens of `longer` that follow those stored in `existing`
/// as a new commit written to `out`, which must be positioned at the end of
/// the last commit. Existing pages are not rewritten. `sync` is called after
/// the pages and index and again after the trailer (see
/// [`crate::format::Writer::commit_durable`]).
///
/// The prefix check: when the stored cache has token ids, `longer` must
/// carry token ids that start with them; when neither has token ids the
/// append is refused unless `unverified_ok` (nothing proves the new tokens
/// follow the stored ones). A different `kvpack.model` is always refused.
/// Every tensor must gain the same number of tokens, equal to the growth of
/// the token ids when both have them: a sliding-window layer whose window
/// rolled is refused rather than extended with shifted slots.
///
/// # Errors
/// [`Error::Parameter`] when `longer` does not extend the stored cache
/// (different model, tensors, shapes, fewer tokens, or token ids that do not
/// start with the stored ones).
pub fn append<W: Write + Send>(
    existing: &Reader<'_>,
    longer: &KvCache,
    unverified_ok: bool,
    opts: &CompressOptions,
    out: W,
    progress: &(dyn Fn(u64) + Sync),
    sync: &mut dyn FnMut(&mut W) -> std::io::Result<()>,
) -> Result<(W, CompressReport, Trailer)> {
    let start = Instant::now();
    let h = existing.header();
    let idx = existing.index();
    if longer.tensors.len() != h.tensors.len() {
        return Err(Error::param(format!(
            "the new cache has {} K/V tensors, the stored one {}",
            longer.tensors.len(),
            h.tensors.len()
        )));
    }
    for (t, (new, old)) in longer.tensors.iter().zip(&h.tensors).enumerate() {
        let n = &new.info;
        if (n.layer, n.kind, n.batch, n.heads, n.head_dim, n.dtype)
            != (
                old.layer,
                old.kind,
                old.batch,
                old.heads,
                old.head_dim,
                old.dtype,
            )
        {
            return Err(Error::param(format!(
                "{}: shape or dtype differs from the stored cache ({:?} {} vs {:?} {})",
                n.describe(),
                n.shape(),
                n.dtype.name(),
                [old.batch, old.heads, idx.token_counts[t], old.head_dim],
                old.dtype.name()
            )));
        }
        if n.tokens < idx.token_counts[t] {
            return Err(Error::param(format!(
                "{}: the new cache has {} tokens, fewer than the {} stored",
                n.describe(),
                n.tokens,
                idx.token_counts[t]
            )));
        }
    }
    const MODEL: &str = "kvpack.model";
    if let (Some(a), Some(b)) = (h.metadata.get(MODEL), longer.metadata.get(MODEL))
        && a != b
    {
        return Err(Error::param(format!(
            "the stored cache is for model {a:?}, the new one for {b:?}"
        )));
    }
    if idx.token_ids.is_empty() && !unverified_ok {
        return Err(Error::param(
            "the stored cache has no token ids, so the new tokens cannot be checked to follow them \
             (pass --force to append anyway)",
        ));
    }
    if !idx.token_ids.is_empty() && !longer.token_ids.starts_with(&idx.token_ids) {
        let at = idx
            .token_ids
            .iter()
            .zip(&longer.token_ids)
            .position(|(a, b)| a != b);
        return Err(Error::param(match at {
            Some(i) => format!(
                "prefix mismatch: token {i} is {} in the stored cache but {} in the new one",
                idx.token_ids[i], longer.token_ids[i]
            ),
            None => format!(
                "prefix mismatch: the stored cache has {} token ids, the new one {}",
                idx.token_ids.len(),
                longer.token_ids.len()
            ),
        }));
    }
    // Every layer must gain the same number of tokens, and as many as the
    // prompt grew: a sliding-window layer whose window rolled holds other
    // positions in the same slots and cannot be extended in place.
    let deltas: Vec<u32> = longer
        .tensors
        .iter()
        .zip(&idx.token_counts)
        .map(|(t, &n)| t.info.tokens - n)
        .collect();
    let grew_ids = (!idx.token_ids.is_empty() && !longer.token_ids.is_empty())
        .then(|| longer.token_ids.len() - idx.token_ids.len());
    let want = grew_ids.map(|d| d as u32).unwrap_or(deltas[0]);
    if let Some(t) = deltas.iter().position(|&d| d != want) {
        return Err(Error::param(format!(
            "{} gains {} tokens but the cache gains {want}: its sliding window rolled (the stored slots now hold other \
             positions), so it cannot be extended in place; compress the new cache instead",
            longer.tensors[t].info.describe(),
            deltas[t]
        )));
    }
    let codecs: Vec<Box<dyn Codec>> = h
        .codecs
        .iter()
        .enumerate()
        .map(|(i, e)| crate::codec::from_entry(i, e))
        .collect::<Result<_>>()?;
    let layout = Layout {
        page_tokens: h.page_tokens.max(1),
        sink: h.sink_tokens,
        recent: h.recent_tokens,
    };
    let infos: Vec<_> = longer.tensors.iter().map(|t| t.info.clone()).collect();
    let pages = plan(&infos, &idx.token_counts, layout)?;
    let raw_slot = h.codecs.iter().position(|c| c.id == crate::codec::raw::ID);
    if pages.iter().any(|p| p.raw) && raw_slot.is_none() {
        return Err(Error::param(
            "the stored file has windows but no raw codec slot",
        ));
    }
    for t in &longer.tensors {
        codecs[0].check(&t.info)?;
    }
    let opts = CompressOptions {
        align_log2: h.align_log2,
        layout,
        ..*opts
    };
    let mut w = Writer::resume(out, h, existing.header_len(), idx, existing.trailer())?;
    let refs: Vec<&dyn Codec> = codecs.iter().map(|c| c.as_ref()).collect();
    let (elements, source_bytes) = write_pages(
        &mut w,
        &infos,
        &pages,
        &|p, slot| encode_sections(&longer.tensors[p.tensor as usize], p, refs[slot]),
        raw_slot.unwrap_or(0),
        &opts,
        progress,
    )?;
    let before = existing.trailer().commit_end;
    let (out, trailer) = w.commit_durable(&longer.token_ids, sync)?;
    Ok((
        out,
        CompressReport {
            codec: codecs[0].name(),
            pages: pages.len(),
            raw_pages: pages.iter().filter(|p| p.raw).count(),
            elements,
            source_bytes,
            output_bytes: trailer.commit_end - before,
            seconds: start.elapsed().as_secs_f64(),
        },
        trailer,
    ))
}
