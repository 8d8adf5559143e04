//! Compression: a [`KvCache`] through a codec into a kvpack file or stream,
//! with page encoding on all threads overlapped with writing.

use std::io::Write;
use std::time::Instant;

use rayon::prelude::*;

use std::collections::BTreeMap;

use crate::cache::{KvCache, TensorData, TensorInfo};
use crate::codec::{Codec, PageIn, raw::Raw};
use crate::error::{Error, Result};
use crate::format::{
    CodecEntry, FileHeader, PageFrame, PageHeader, PageMeta, Reader, Section, Trailer,
    VERSION_MAJOR, Writer, pool,
};
use crate::plan::{Layout, PlannedPage, plan};
use crate::view::{CacheView, Strides, TensorView};

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
    /// Store a page with `raw` when the codec's frame would be larger (data
    /// dependent side tables such as outliers can exceed the source size).
    /// The codec table then always holds a `raw` slot, and the file is never
    /// larger than [`max_compressed_size`]. Default `false`.
    pub raw_fallback: bool,
}

impl Default for CompressOptions {
    fn default() -> Self {
        CompressOptions {
            layout: Layout::default(),
            zstd_level: None,
            align_log2: crate::format::DEFAULT_ALIGN_LOG2,
            raw_fallback: false,
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

/// Encodes planned page `p` of `tensor` with the codec in table slot
/// `slot` into a frame.
fn encode_page(
    tensor: &TensorView<'_>,
    p: &PlannedPage,
    codec: &dyn Codec,
    slot: usize,
    opts: &CompressOptions,
) -> Result<PageFrame> {
    let (t0, n) = (p.token_start as usize, p.tokens as usize);
    let (count, len) = (tensor.info.planes(), n * tensor.info.head_dim as usize);
    let scratch;
    let mut source = None;
    let planes = match (0..count)
        .map(|pl| tensor.plane_rows(pl, t0, n))
        .collect::<Option<Vec<_>>>()
    {
        Some(planes) => planes,
        // A row-wise codec reads the rows where they are.
        None if codec.row_wise() => {
            source = Some(tensor);
            Vec::new()
        }
        None => {
            // Rows are not contiguous (e.g. token-major memory): gather
            // this page into kvpack's order.
            let mut buf = TensorData::zeros(tensor.info.dtype, count * len);
            tensor.gather(t0, n, &mut buf);
            scratch = buf;
            (0..count)
                .map(|pl| scratch.as_elems().slice(pl * len, len))
                .collect()
        }
    };
    let page = PageIn {
        source,
        tensor: &tensor.info,
        token_start: p.token_start,
        tokens: p.tokens,
        planes,
    };
    let sections = codec.encode(&page)?;
    let frame = page_frame(p, &sections, slot, opts);
    // The payloads were copied into the frame: their buffers serve the
    // next pages.
    sections.into_iter().for_each(|s| pool::give(s.data));
    frame
}

/// The frame of planned page `p` holding `sections`, with codec table slot
/// `slot`.
fn page_frame(
    p: &PlannedPage,
    sections: &[Section],
    slot: usize,
    opts: &CompressOptions,
) -> Result<PageFrame> {
    PageFrame::encode(
        page_meta(p, slot),
        sections,
        opts.zstd_level,
        1 << opts.align_log2,
    )
}

/// The frame header fields of planned page `p` encoded by codec `slot`.
fn page_meta(p: &PlannedPage, slot: usize) -> PageMeta {
    PageMeta {
        tensor: p.tensor,
        token_start: p.token_start,
        tokens: p.tokens,
        codec: slot as u16,
    }
}

/// Source bytes of planned page `p`.
fn page_source_bytes(tensor: &TensorView<'_>, p: &PlannedPage) -> u64 {
    let i = &tensor.info;
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

/// Callbacks of [`write_pages`]: source bytes written so far, and a
/// tensor's last page written.
#[derive(Clone, Copy)]
struct Hooks<'a> {
    progress: &'a (dyn Fn(u64) + Sync),
    tensor_done: &'a (dyn Fn(usize) + Sync),
}

/// Encodes `pages` of `tensors` on all threads and writes them in order.
/// Window pages use the codec of table slot `raw_slot`, others the slot
/// `slot_of(page)`. Returns (elements, source bytes) written.
#[allow(clippy::too_many_arguments)]
fn write_pages<W: Write + Send>(
    w: &mut Writer<W>,
    tensors: &[TensorView<'_>],
    pages: &[PlannedPage],
    codecs: &[&dyn Codec],
    raw_slot: usize,
    slot_of: &(dyn Fn(&PlannedPage) -> usize + Sync),
    opts: &CompressOptions,
    hooks: Hooks<'_>,
) -> Result<(u64, u64)> {
    let Hooks {
        progress,
        tensor_done,
    } = hooks;
    let total: u64 = pages
        .iter()
        .map(|p| page_source_bytes(&tensors[p.tensor as usize], p))
        .sum();
    let mut source_bytes = 0u64;
    let mut elements = 0u64;
    ordered_map(
        pages,
        total / pages.len().max(1) as u64,
        |p| {
            let t = &tensors[p.tensor as usize];
            let slot = if p.raw { raw_slot } else { slot_of(p) };
            let frame = encode_page(t, p, codecs[slot], slot, opts)?;
            // A raw frame is never smaller than the source bytes, so only
            // a frame larger than those can lose to raw.
            if opts.raw_fallback
                && slot != raw_slot
                && frame.bytes.len() as u64 > page_source_bytes(t, p)
            {
                let raw = encode_page(t, p, codecs[raw_slot], raw_slot, opts)?;
                if raw.bytes.len() < frame.bytes.len() {
                    pool::give(frame.bytes);
                    return Ok((raw, *p));
                }
                pool::give(raw.bytes);
            }
            Ok((frame, *p))
        },
        |(frame, p)| {
            w.write_page(&frame)?;
            pool::give(frame.bytes);
            let t = &tensors[p.tensor as usize];
            let b = page_source_bytes(t, &p);
            source_bytes += b;
            elements += b / t.info.dtype.size() as u64;
            progress(source_bytes);
            if p.token_start + p.tokens == t.info.tokens {
                tensor_done(p.tensor as usize);
            }
            Ok(())
        },
    )?;
    Ok((elements, source_bytes))
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
    compress_view(&cache.view(), codec, opts, out, progress)
}

/// Like [`compress`], from tensors borrowed in caller memory in any axis
/// order ([`CacheView`]): nothing is copied but one page at a time when
/// the rows are not contiguous. Memory use is a few pages per thread plus
/// the output writer's.
///
/// # Errors
/// As [`compress`].
pub fn compress_view<W: Write + Send>(
    cache: &CacheView<'_>,
    codec: &dyn Codec,
    opts: &CompressOptions,
    out: W,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<(W, CompressReport)> {
    compress_view_with(cache, codec, opts, out, progress, &|_| {})
}

/// [`compress_view`] that also calls `tensor_done(t)` once the last page
/// of `cache.tensors[t]` is written (pages are written in layer-major
/// order): a caller reading a memory-mapped input drops that tensor's
/// bytes from memory then, so resident memory stays at a few pages per
/// thread, not the input's size.
///
/// # Errors
/// As [`compress`].
pub fn compress_view_with<W: Write + Send>(
    cache: &CacheView<'_>,
    codec: &dyn Codec,
    opts: &CompressOptions,
    out: W,
    progress: &(dyn Fn(u64) + Sync),
    tensor_done: &(dyn Fn(usize) + Sync),
) -> Result<(W, CompressReport)> {
    let start = Instant::now();
    let file = FilePlan::new(cache, codec, opts)?;
    let codec = file.codec(codec);
    let mut codecs: Vec<&dyn Codec> = vec![codec];
    if file.header.codecs.len() > 1 {
        codecs.push(&Raw);
    }
    let (header, pages, raw_pages) = (&file.header, &file.pages, file.raw_pages);
    let mut w = Writer::new(out, header)?;
    write_pages(
        &mut w,
        &cache.tensors,
        pages,
        &codecs,
        codecs.len() - 1,
        &|_| 0,
        opts,
        Hooks {
            progress,
            tensor_done,
        },
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

/// Compresses `cache` into a new file whose tensors use different codecs
/// and windows (a budget plan, [`crate::budget`]): tensor `t` is coded by
/// `codecs[tensor_codec[t]]` outside its own sink/recent windows
/// `layouts[t]`, which are stored `raw`. The codecs must be ready to encode
/// (already [`Codec::prepare`]d); the codec table is `codecs` in order,
/// plus a `raw` slot when a window page needs one and none is listed.
/// `opts.layout` is ignored but for being recorded in the header (page size,
/// and windows 0: the windows are in the pages). `label` becomes
/// [`CompressReport::codec`].
///
/// # Errors
/// [`Error::Parameter`] when the lengths disagree, a slot is out of range,
/// a codec cannot encode its tensor, or as [`compress`].
#[allow(clippy::too_many_arguments)]
pub fn compress_mixed<W: Write + Send>(
    cache: &CacheView<'_>,
    codecs: &[&dyn Codec],
    tensor_codec: &[usize],
    layouts: &[Layout],
    label: &str,
    opts: &CompressOptions,
    out: W,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<(W, CompressReport)> {
    let start = Instant::now();
    let n = cache.tensors.len();
    if n == 0 {
        return Err(Error::param("the cache has no K/V tensors"));
    }
    if tensor_codec.len() != n || layouts.len() != n {
        return Err(Error::param(
            "a codec slot and a layout are needed for every tensor",
        ));
    }
    for (t, &slot) in cache.tensors.iter().zip(tensor_codec) {
        let c = codecs
            .get(slot)
            .ok_or_else(|| Error::param(format!("codec slot {slot} does not exist")))?;
        c.check(&t.info)?;
    }
    let infos = cache.infos();
    let pages = crate::plan::plan_each(&infos, &vec![0; n], layouts)?;
    let raw_pages = pages.iter().filter(|p| p.raw).count();
    let mut table: Vec<&dyn Codec> = codecs.to_vec();
    let raw_slot = match table.iter().position(|c| c.id() == crate::codec::raw::ID) {
        Some(i) => i,
        None if raw_pages > 0 || opts.raw_fallback => {
            table.push(&Raw);
            table.len() - 1
        }
        None => usize::MAX,
    };
    let header = FileHeader {
        version_major: VERSION_MAJOR,
        version_minor: FileHeader::required_minor(&infos),
        align_log2: opts.align_log2,
        tensors: infos,
        codecs: table
            .iter()
            .map(|c| CodecEntry {
                id: c.id(),
                params: c.params(),
            })
            .collect(),
        metadata: cache.metadata.clone(),
        page_tokens: opts.layout.page_tokens,
        sink_tokens: 0,
        recent_tokens: 0,
    };
    let mut w = Writer::new(out, &header)?;
    write_pages(
        &mut w,
        &cache.tensors,
        &pages,
        &table,
        raw_slot,
        &|p| tensor_codec[p.tensor as usize],
        opts,
        Hooks {
            progress,
            tensor_done: &|_| {},
        },
    )?;
    let (out, trailer) = w.commit(&cache.token_ids)?;
    Ok((
        out,
        CompressReport {
            codec: label.to_string(),
            pages: pages.len(),
            raw_pages,
            elements: cache.elements(),
            source_bytes: cache.source_bytes(),
            output_bytes: trailer.header_len + trailer.commit_end,
            seconds: start.elapsed().as_secs_f64(),
        },
    ))
}

/// What a new file will hold before any page is encoded: the prepared
/// codec, the header and the planned pages.
struct FilePlan {
    prepared: Option<Box<dyn Codec>>,
    header: FileHeader,
    pages: Vec<PlannedPage>,
    raw_pages: usize,
}

impl FilePlan {
    fn new(cache: &CacheView<'_>, codec: &dyn Codec, opts: &CompressOptions) -> Result<FilePlan> {
        if cache.tensors.is_empty() {
            return Err(Error::param("the cache has no K/V tensors"));
        }
        for t in &cache.tensors {
            codec.check(&t.info)?;
        }
        let prepared = codec.prepare(cache, &opts.layout)?;
        let c: &dyn Codec = prepared.as_deref().unwrap_or(codec);
        let mut file = FilePlan::unprepared(cache.infos(), &cache.metadata, c, opts)?;
        file.prepared = prepared;
        Ok(file)
    }

    /// The plan of a file of tensors `infos` encoded by `c` as it is (no
    /// [`Codec::prepare`]).
    fn unprepared(
        infos: Vec<TensorInfo>,
        metadata: &BTreeMap<String, String>,
        c: &dyn Codec,
        opts: &CompressOptions,
    ) -> Result<FilePlan> {
        let pages = plan(&infos, &vec![0; infos.len()], opts.layout)?;
        let raw_pages = pages.iter().filter(|p| p.raw).count();
        let mut table = vec![CodecEntry {
            id: c.id(),
            params: c.params(),
        }];
        if (raw_pages > 0 || opts.raw_fallback) && c.id() != crate::codec::raw::ID {
            table.push(CodecEntry {
                id: Raw.id(),
                params: Raw.params(),
            });
        }
        let header = FileHeader {
            version_major: VERSION_MAJOR,
            version_minor: FileHeader::required_minor(&infos),
            align_log2: opts.align_log2,
            tensors: infos,
            codecs: table,
            metadata: metadata.clone(),
            page_tokens: opts.layout.page_tokens,
            sink_tokens: opts.layout.sink,
            recent_tokens: opts.layout.recent,
        };
        Ok(FilePlan {
            prepared: None,
            header,
            pages,
            raw_pages,
        })
    }

    /// The codec pages are encoded with: the prepared one, or `codec`.
    fn codec<'c>(&'c self, codec: &'c dyn Codec) -> &'c dyn Codec {
        self.prepared.as_deref().unwrap_or(codec)
    }
}

/// A page encoded elsewhere (e.g. on the GPU), as [`write_encoded`] takes
/// it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EncodedPage<'a> {
    /// Its sections.
    Sections(Vec<Section>),
    /// Its canonical body (format/SPEC.md 6.2: section table, sections
    /// 64-aligned, zero padding), the body [`PageFrame::encode`] lays out
    /// for its sections, and the number of sections: framed without
    /// re-laying it out.
    Body {
        /// The body bytes.
        body: &'a [u8],
        /// Sections in the body's table.
        sections: u16,
    },
}

/// A page of [`write_encoded`] ready to write.
enum Framed<'a> {
    /// A whole frame.
    Frame(PageFrame),
    /// The header of an uncompressed frame and its body.
    Parts(PageHeader, &'a [u8]),
}

/// Writes a new kvpack file of tensors `infos` whose pages were encoded
/// elsewhere (e.g. on the GPU): `sections(i)` returns `pages[i]` encoded
/// as `codec`'s encoder would (for window pages, as `raw`'s).
/// `pages` must be the plan of `infos` under `opts.layout`; `codec` must
/// be prepared already (it is written as given: [`Codec::prepare`] is not
/// called) and `opts.raw_fallback` be off. Frames (and zstd) are built on
/// all threads; the result is the file [`compress`] writes for the same
/// tensors with the same prepared codec.
///
/// # Errors
/// [`Error::Parameter`] when `pages` is not that plan or `raw_fallback` is
/// set; the error of `sections`; [`Error::Io`] when writing fails.
#[allow(clippy::too_many_arguments)]
pub fn write_encoded<'a, W: Write + Send>(
    infos: Vec<TensorInfo>,
    metadata: &BTreeMap<String, String>,
    token_ids: &[u32],
    codec: &dyn Codec,
    opts: &CompressOptions,
    pages: &[PlannedPage],
    sections: &(dyn Fn(usize) -> Result<EncodedPage<'a>> + Sync),
    out: W,
) -> Result<(W, CompressReport)> {
    let start = Instant::now();
    let file = EncodedFile::new(infos, metadata, codec, opts, pages)?;
    let mut w = Writer::new(out, &file.header)?;
    let index: Vec<usize> = (0..pages.len()).collect();
    ordered_map(
        &index,
        file.source_bytes / pages.len().max(1) as u64,
        |&i| {
            let slot = file.slot(&pages[i]);
            let meta = page_meta(&pages[i], slot);
            Ok(match sections(i)? {
                EncodedPage::Sections(s) => Framed::Frame(page_frame(&pages[i], &s, slot, opts)?),
                // Uncompressed bodies are written straight from `body`.
                EncodedPage::Body { body, sections } if opts.zstd_level.is_none() => {
                    Framed::Parts(PageFrame::body_header(meta, body, sections)?, body)
                }
                EncodedPage::Body { body, sections } => Framed::Frame(PageFrame::from_body(
                    meta,
                    body,
                    sections,
                    opts.zstd_level,
                    1 << opts.align_log2,
                )?),
            })
        },
        |framed| match framed {
            Framed::Frame(f) => w.write_page(&f),
            Framed::Parts(h, body) => w.write_parts(&h, body),
        },
    )?;
    let (out, trailer) = w.commit(token_ids)?;
    Ok((
        out,
        file.report(codec, trailer.header_len + trailer.commit_end, start),
    ))
}

/// The file of tensors `infos` whose pages `pages` were encoded elsewhere
/// (the GPU encoders) by `codec`: its header and what its report counts,
/// after the checks of [`write_encoded`].
#[derive(Debug)]
pub(crate) struct EncodedFile {
    /// The file header.
    pub header: FileHeader,
    raw_slot: usize,
    raw_pages: usize,
    pages: usize,
    elements: u64,
    source_bytes: u64,
}

impl EncodedFile {
    /// Checks `infos` against `codec` and `pages` against the layout's
    /// plan (no raw fallback) and builds the header.
    ///
    /// # Errors
    /// As [`write_encoded`].
    pub(crate) fn new(
        infos: Vec<TensorInfo>,
        metadata: &BTreeMap<String, String>,
        codec: &dyn Codec,
        opts: &CompressOptions,
        pages: &[PlannedPage],
    ) -> Result<EncodedFile> {
        for i in &infos {
            codec.check(i)?;
        }
        let elements: u64 = infos.iter().map(|i| i.elements()).sum();
        let source_bytes: u64 = infos
            .iter()
            .map(|i| i.elements() * i.dtype.size() as u64)
            .sum();
        let file = FilePlan::unprepared(infos, metadata, codec, opts)?;
        if pages != file.pages.as_slice() || opts.raw_fallback {
            return Err(Error::param(
                "encoded pages must be the layout's plan, without raw fallback",
            ));
        }
        Ok(EncodedFile {
            raw_slot: file.header.codecs.len() - 1,
            header: file.header,
            raw_pages: file.raw_pages,
            pages: pages.len(),
            elements,
            source_bytes,
        })
    }

    /// The codec slot of planned page `p`.
    pub(crate) fn slot(&self, p: &PlannedPage) -> usize {
        if p.raw { self.raw_slot } else { 0 }
    }

    /// The page meta of planned page `p`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn meta(&self, p: &PlannedPage) -> PageMeta {
        page_meta(p, self.slot(p))
    }

    /// The report of the file once written: `output_bytes` long, begun at
    /// `start`.
    pub(crate) fn report(
        &self,
        codec: &dyn Codec,
        output_bytes: u64,
        start: Instant,
    ) -> CompressReport {
        CompressReport {
            codec: codec.name(),
            pages: self.pages,
            raw_pages: self.raw_pages,
            elements: self.elements,
            source_bytes: self.source_bytes,
            output_bytes,
            seconds: start.elapsed().as_secs_f64(),
        }
    }
}

/// An upper bound of the size in bytes of [`compress`] output for tensors
/// shaped like `infos` with `metadata` and `token_ids` token ids, when
/// `opts.raw_fallback` is set, computed without the data: the header (with
/// the codec's parameter block, prepared on zeros: parameter block sizes
/// depend only on shapes), the index, the trailer, and per page the smaller
/// of its `raw` frame and, for codecs whose page size depends only on the
/// shape ([`Codec::size_depends_only_on_shape`]), the codec's own frame.
/// For such codecs without zstd the bound is the exact size; zstd only
/// makes pages smaller; codecs with data-dependent side tables (e.g.
/// `hqmq:...+med3` outliers) are bounded by the raw size. Without
/// `raw_fallback` such a codec may exceed it.
///
/// # Errors
/// [`Error::Parameter`] when the codec cannot encode these shapes or a
/// shape is too large to allocate.
pub fn max_compressed_size(
    infos: &[TensorInfo],
    metadata: &BTreeMap<String, String>,
    token_ids: usize,
    codec: &dyn Codec,
    opts: &CompressOptions,
) -> Result<u64> {
    let zeros: Vec<TensorData> = infos
        .iter()
        .map(|i| {
            usize::try_from(i.elements())
                .map(|n| TensorData::zeros(i.dtype, n))
                .map_err(|_| Error::param(format!("{}: too many elements", i.describe())))
        })
        .collect::<Result<_>>()?;
    let view = CacheView {
        tensors: infos
            .iter()
            .zip(&zeros)
            .map(|(i, z)| TensorView::new(i.clone(), z.as_elems(), Strides::head_major(i)))
            .collect::<Result<_>>()?,
        metadata: metadata.clone(),
        token_ids: Vec::new(),
    };
    let file = FilePlan::new(&view, codec, opts)?;
    let coder = file.codec(codec);
    let raw_slot = file.header.codecs.len() - 1;
    // Uncompressed frames: a zstd frame is kept only when smaller.
    let plain = CompressOptions {
        zstd_level: None,
        ..*opts
    };
    let frames: Vec<PageFrame> = file
        .pages
        .par_iter()
        .map(|p| {
            let t = &view.tensors[p.tensor as usize];
            let raw = encode_page(t, p, &Raw, raw_slot, &plain)?;
            if p.raw || !coder.size_depends_only_on_shape() {
                return Ok(raw);
            }
            let own = encode_page(t, p, coder, 0, &plain)?;
            Ok(if own.bytes.len() < raw.bytes.len() {
                own
            } else {
                raw
            })
        })
        .collect::<Result<_>>()?;
    let mut w = Writer::new(std::io::sink(), &file.header)?;
    for f in &frames {
        w.write_page(f)?;
    }
    let (_, trailer) = w.commit(&vec![0; token_ids])?;
    Ok(trailer.header_len + trailer.commit_end)
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
    longer: &CacheView<'_>,
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
    let infos = longer.infos();
    let pages = plan(&infos, &idx.token_counts, layout)?;
    let raw_slot = h.codecs.iter().position(|c| c.id == crate::codec::raw::ID);
    if pages.iter().any(|p| p.raw) && raw_slot.is_none() {
        return Err(Error::param(
            "the stored file has windows but no raw codec slot",
        ));
    }
    // Each tensor keeps the codec of its last coded page (a budget plan
    // gives tensors different codecs); slot 0 for a tensor with none.
    let mut tensor_slot = vec![0usize; h.tensors.len()];
    for e in &idx.entries {
        if Some(e.meta.codec as usize) != raw_slot {
            tensor_slot[e.meta.tensor as usize] = e.meta.codec as usize;
        }
    }
    for (t, &slot) in longer.tensors.iter().zip(&tensor_slot) {
        codecs[slot].check(&t.info)?;
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
        &longer.tensors,
        &pages,
        &refs,
        raw_slot.unwrap_or(0),
        &|p| tensor_slot[p.tensor as usize],
        &opts,
        Hooks {
            progress,
            tensor_done: &|_| {},
        },
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
