//! Decoding while receiving: pages are decoded on the rayon pool as soon as
//! they arrive from a [`StreamReader`], straight into preallocated output
//! tensors, with a bounded number of pages in flight (memory stays bounded)
//! and a callback when every tensor of a layer is complete.

use std::io::Read;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::cache::{DType, ElemsMut, KvCache, Tensor, TensorData, TensorInfo};
use crate::codec::{Codec, PageOut};
use crate::decode::Piece;
use crate::error::{Error, Location, Result};
use crate::format::{FileHeader, Limits, PageView, StreamEvent, StreamReader};

/// The result of [`decode_stream`].
#[derive(Debug)]
pub struct StreamDecoded {
    /// The decoded cache (names, shapes, metadata, token ids).
    pub cache: KvCache,
    /// The stream's header.
    pub header: FileHeader,
    /// Pages received and decoded.
    pub pages: usize,
    /// Bytes received.
    pub bytes: u64,
    /// Time from the call until the commit (end marker) arrived.
    pub received: Duration,
    /// Time from the call until the last page was decoded.
    pub decoded: Duration,
    /// Per layer: time from the call until all its tensors were decoded.
    pub layer_done: Vec<(u32, Duration)>,
}

/// Output tensors shared by decode tasks that write disjoint token ranges.
struct Outputs {
    tensors: Vec<(TensorInfo, *mut u8)>,
}

// SAFETY: the raw pointers are only used to build slices for token ranges
// that the stream reader proved disjoint (contiguous, non-overlapping pages
// per tensor, bounds checked in `page_out`); the backing Vecs outlive every
// task (they are owned by the caller's stack frame across the scope).
unsafe impl Send for Outputs {}
// SAFETY: as above; tasks never touch the same bytes.
unsafe impl Sync for Outputs {}

impl Outputs {
    /// Mutable per-plane slices for tokens `[t0, t0 + n)` of tensor `t`.
    ///
    /// # Safety
    /// No other live slice may cover the same tokens of the same tensor.
    unsafe fn page_out(&self, t: usize, t0: usize, n: usize) -> Vec<ElemsMut<'_>> {
        let (info, base) = &self.tensors[t];
        let d = info.head_dim as usize;
        let tt = info.tokens as usize;
        (0..info.planes())
            .map(|p| {
                let start = (p * tt + t0) * d;
                let len = n * d;
                // SAFETY: start + len <= planes * tokens * d (checked by the
                // caller against `tokens`); the range is exclusively ours.
                unsafe {
                    match info.dtype {
                        DType::Bf16 => ElemsMut::Bf16(std::slice::from_raw_parts_mut(
                            (*base as *mut half::bf16).add(start),
                            len,
                        )),
                        DType::F16 => ElemsMut::F16(std::slice::from_raw_parts_mut(
                            (*base as *mut half::f16).add(start),
                            len,
                        )),
                        DType::F32 => ElemsMut::F32(std::slice::from_raw_parts_mut(
                            (*base as *mut f32).add(start),
                            len,
                        )),
                        DType::Fp8(f) => {
                            ElemsMut::Fp8(f, std::slice::from_raw_parts_mut(base.add(start), len))
                        }
                    }
                }
            })
            .collect()
    }
}

fn data_ptr(d: &mut TensorData) -> *mut u8 {
    match d {
        TensorData::Bf16(v) => v.as_mut_ptr() as *mut u8,
        TensorData::F16(v) => v.as_mut_ptr() as *mut u8,
        TensorData::F32(v) => v.as_mut_ptr() as *mut u8,
        TensorData::Fp8(_, v) => v.as_mut_ptr(),
    }
}

/// Reads a whole single-commit stream from `r` and decodes it while it
/// arrives. `dtype` overrides the output element type. `on_layer(layer,
/// elapsed)` is called (from a worker thread) when every tensor of a layer
/// has been decoded. At most `4 * threads` received pages wait for decoding.
///
/// Nothing is returned unless the stream's commit arrived and validated:
/// a truncated or corrupted stream is an error naming the page.
///
/// # Errors
/// [`Error::Format`] for a malformed, truncated or corrupted stream, a page
/// outside the header's token counts, or a second commit (appended streams
/// must be saved as .kvpack); [`Error::Io`] for read errors.
pub fn decode_stream<R: Read>(
    r: R,
    dtype: Option<DType>,
    on_layer: &(dyn Fn(u32, Duration) + Sync),
) -> Result<StreamDecoded> {
    decode_stream_with(r, dtype, Limits::default(), on_layer)
}

/// [`decode_stream`] with explicit [`Limits`]: the output the header
/// declares must fit `limits.max_memory` (checked before anything is
/// allocated), and every page is checked against the limits and its
/// codec's constraints before it is decoded.
///
/// # Errors
/// As [`decode_stream`]; [`Error::Limits`] when the declared output
/// exceeds `limits.max_memory`.
pub fn decode_stream_with<R: Read>(
    r: R,
    dtype: Option<DType>,
    limits: Limits,
    on_layer: &(dyn Fn(u32, Duration) + Sync),
) -> Result<StreamDecoded> {
    let start = Instant::now();
    let (reader, codecs, out_infos) = open_stream(r, dtype, &limits)?;
    let mut tensors: Vec<Tensor> = out_infos
        .into_iter()
        .map(|info| {
            let data = TensorData::zeros(info.dtype, info.elements() as usize);
            Tensor { info, data }
        })
        .collect();
    let outputs = Outputs {
        tensors: tensors
            .iter_mut()
            .map(|t| (t.info.clone(), data_ptr(&mut t.data)))
            .collect(),
    };
    let header = reader.header().clone();
    let run = run_stream(reader, &codecs, start, on_layer, &|page, codec| {
        let m = page.header.meta;
        let t = m.tensor as usize;
        // SAFETY: the stream reader checked that pages of a tensor arrive in
        // contiguous, non-overlapping token order; the bound is checked by
        // `run_stream` against the header's token count.
        let planes = unsafe { outputs.page_out(t, m.token_start as usize, m.tokens as usize) };
        let mut out = PageOut {
            scatter: None,
            tensor: &header.tensors[t],
            tokens: m.tokens,
            planes,
        };
        codec.decode(page, &mut out)
    })?;
    drop(outputs);
    Ok(StreamDecoded {
        cache: KvCache {
            tensors,
            metadata: run.header.metadata.clone(),
            token_ids: run.token_ids,
        },
        bytes: run.bytes,
        header: run.header,
        pages: run.pages,
        received: run.received,
        decoded: run.decoded,
        layer_done: run.layer_done,
    })
}

/// What [`decode_stream_pieces`] received, besides the pieces.
#[derive(Debug)]
pub struct StreamReport {
    /// The stream's header.
    pub header: FileHeader,
    /// Token ids of the cached prefix (from the commit; may be empty).
    pub token_ids: Vec<u32>,
    /// Pages received and decoded.
    pub pages: usize,
    /// Bytes received.
    pub bytes: u64,
    /// Time from the call until the commit (end marker) arrived.
    pub received: Duration,
    /// Time from the call until the last page was decoded.
    pub decoded: Duration,
    /// Per layer: time from the call until all its tensors were decoded.
    pub layer_done: Vec<(u32, Duration)>,
}

/// Like [`decode_stream_with`], without holding the output: once the
/// stream's header arrived, `on_header(header, outputs)` is called with
/// the output tensors (the header's, at the output dtype), then every page
/// is decoded on the rayon pool as it arrives and handed to `sink` as a
/// [`Piece`] (`output` = the tensor's index in the header, `token` = its
/// first token), in no particular order, from worker threads. At most
/// `4 * threads` pages are in flight: memory stays at a few pages per
/// thread whatever the stream's size (a receiver writes each piece at its
/// offset in a file). The declared output must still fit
/// `limits.max_memory` (the bound on what a stream may make a receiver
/// write), checked before `on_header`.
///
/// Returns only once the stream's commit arrived and every page was
/// decoded and accepted by `sink`.
///
/// # Errors
/// As [`decode_stream_with`]; the first error of `on_header` or `sink`.
pub fn decode_stream_pieces<R: Read>(
    r: R,
    dtype: Option<DType>,
    limits: Limits,
    on_header: impl FnOnce(&FileHeader, &[TensorInfo]) -> Result<()>,
    on_layer: &(dyn Fn(u32, Duration) + Sync),
    sink: &(dyn Fn(Piece<'_>) -> Result<()> + Sync),
) -> Result<StreamReport> {
    let start = Instant::now();
    let (reader, codecs, out_infos) = open_stream(r, dtype, &limits)?;
    on_header(reader.header(), &out_infos)?;
    let header = reader.header().clone();
    run_stream(reader, &codecs, start, on_layer, &|page, codec| {
        let m = page.header.meta;
        let t = m.tensor as usize;
        let info = &out_infos[t];
        let (n, d, planes) = (m.tokens as usize, info.head_dim as usize, info.planes());
        let mut scratch = TensorData::zeros(info.dtype, planes * n * d);
        {
            let sp = scratch.as_elems_mut().split_planes(n * d, planes);
            let mut out = PageOut {
                scatter: None,
                tensor: &header.tensors[t],
                tokens: m.tokens,
                planes: sp,
            };
            codec.decode(page, &mut out)?;
        }
        sink(Piece {
            output: t,
            token: m.token_start,
            tokens: m.tokens,
            elems: scratch.as_elems(),
        })
    })
}

/// A stream whose header was read: the reader, the codecs of its codec
/// table and the output tensors.
type Opened<R> = (StreamReader<R>, Vec<Box<dyn Codec>>, Vec<TensorInfo>);

/// Starts a stream decode: reads the header, builds the codecs and checks
/// the declared output (at the output dtype) against `limits.max_memory`;
/// returns the output tensors' infos.
fn open_stream<R: Read>(r: R, dtype: Option<DType>, limits: &Limits) -> Result<Opened<R>> {
    let reader = StreamReader::with_limits(r, *limits)?;
    let header = reader.header();
    let codecs: Vec<Box<dyn Codec>> = header
        .codecs
        .iter()
        .enumerate()
        .map(|(i, e)| crate::codec::from_entry(i, e))
        .collect::<Result<_>>()?;
    let infos: Vec<TensorInfo> = header
        .tensors
        .iter()
        .map(|t| TensorInfo {
            dtype: dtype.map_or(t.dtype, |d| d.for_source(t.dtype)),
            ..t.clone()
        })
        .collect();
    let mut out_bytes = 0u64;
    for t in &infos {
        out_bytes = out_bytes.saturating_add(t.elements().saturating_mul(t.dtype.size() as u64));
        limits.check_memory(out_bytes, &format!("receiving up to {}", t.name))?;
    }
    Ok((reader, codecs, infos))
}

/// Reads the stream's events, checks each page (tokens inside the header's
/// count, a single commit, the codec's constraints on the tensor) and
/// decodes it on the rayon pool with `decode(page, codec)`, at most
/// `4 * threads` pages in flight; tracks completed layers for `on_layer`.
fn run_stream<R: Read>(
    mut reader: StreamReader<R>,
    codecs: &[Box<dyn Codec>],
    start: Instant,
    on_layer: &(dyn Fn(u32, Duration) + Sync),
    decode: &(dyn Fn(&PageView<'static>, &dyn Codec) -> Result<()> + Sync),
) -> Result<StreamReport> {
    let header = reader.header().clone();
    // Per-layer tables are indexed by the layer's position among the
    // layers present (dense), never by the layer number itself.
    let mut layer_ids: Vec<u32> = header.tensors.iter().map(|t| t.layer).collect();
    layer_ids.dedup();
    let pos = |layer: u32| layer_ids.binary_search(&layer).unwrap_or(0);
    let layers = layer_ids.len();
    let mut per_layer = vec![0u32; layers];
    for t in &header.tensors {
        per_layer[pos(t.layer)] += 1;
    }
    let decoded_tokens: Vec<AtomicU32> = header.tensors.iter().map(|_| AtomicU32::new(0)).collect();
    // Tensors with zero tokens are complete from the start.
    let mut empty = vec![0u32; layers];
    for t in header.tensors.iter().filter(|t| t.tokens == 0) {
        empty[pos(t.layer)] += 1;
    }
    let layer_tensors_done: Vec<AtomicU32> = empty.iter().map(|&z| AtomicU32::new(z)).collect();
    let layer_done = Mutex::new(
        (0..layers)
            .filter(|&l| per_layer[l] > 0 && empty[l] == per_layer[l])
            .map(|l| (layer_ids[l], Duration::ZERO))
            .collect::<Vec<_>>(),
    );
    let mut checked = std::collections::HashSet::new();
    let first_err: Mutex<Option<Error>> = Mutex::new(None);
    let slots = (rayon::current_num_threads() * 4).max(2);
    let (tok_tx, tok_rx) = mpsc::sync_channel::<()>(slots);
    for _ in 0..slots {
        tok_tx.send(()).expect("capacity");
    }
    let mut pages = 0usize;
    let mut commit = None;
    let decode_one = |page: PageView<'static>| -> Result<()> {
        let m = page.header.meta;
        let t = m.tensor as usize;
        let info = &header.tensors[t];
        decode(&page, codecs[m.codec as usize].as_ref())?;
        let done = decoded_tokens[t].fetch_add(m.tokens, Ordering::AcqRel) + m.tokens;
        if done == info.tokens {
            let l = pos(info.layer);
            if layer_tensors_done[l].fetch_add(1, Ordering::AcqRel) + 1 == per_layer[l] {
                let el = start.elapsed();
                layer_done.lock().expect("lock").push((info.layer, el));
                on_layer(info.layer, el);
            }
        }
        Ok(())
    };
    let read_result: Result<()> = rayon::in_place_scope(|s| {
        loop {
            let ev = match reader.next_event() {
                Ok(Some(ev)) => ev,
                Ok(None) => return Ok(()),
                Err(e) => return Err(e),
            };
            match ev {
                StreamEvent::Page(page) => {
                    let m = page.header.meta;
                    let info = &header.tensors[m.tensor as usize];
                    if m.token_start as u64 + m.tokens as u64 > info.tokens as u64
                        || commit.is_some()
                    {
                        return Err(Error::format(
                            Location::Page {
                                page: pages as u64,
                                offset: 0,
                                what: Some(page.what.clone()),
                            },
                            if commit.is_some() {
                                "a second commit follows: this is an appended cache; receive it as .kvpack".to_string()
                            } else {
                                format!(
                                    "page ends past the {} tokens the header announces",
                                    info.tokens
                                )
                            },
                        ));
                    }
                    if checked.insert((m.codec, m.tensor)) {
                        crate::codec::check_page_fits(codecs, &header.tensors, m)?;
                    }
                    pages += 1;
                    tok_rx.recv().expect("token");
                    let (tok_tx, decode_one, first_err) = (&tok_tx, &decode_one, &first_err);
                    s.spawn(move |_| {
                        if let Err(e) = decode_one(page) {
                            first_err.lock().expect("lock").get_or_insert(e);
                        }
                        let _ = tok_tx.send(());
                    });
                }
                StreamEvent::Commit(idx, _) => commit = Some(idx),
            }
        }
    });
    // A page that failed to decode explains more than the read error that
    // may follow it (the sender seeing the receiver stop, a reset).
    if let Some(e) = first_err.into_inner().expect("lock") {
        return Err(e);
    }
    read_result?;
    let received = start.elapsed();
    let idx = commit.ok_or_else(|| {
        Error::format(
            Location::Index { generation: 0 },
            "stream ended without a commit",
        )
    })?;
    let mut layer_done = layer_done.into_inner().expect("lock");
    layer_done.sort_by_key(|x| x.1);
    let decoded = layer_done.last().map(|x| x.1).unwrap_or(received);
    Ok(StreamReport {
        bytes: reader.bytes_read(),
        header,
        token_ids: idx.token_ids,
        pages,
        received,
        decoded,
        layer_done,
    })
}

/// Decodes `page` into a scratch buffer and discards the result: the
/// codec's own validation of its sections ([`Codec::decode`]) and its
/// constraints on the tensor ([`crate::codec::check_page_fits`]), for a
/// receiver that stores the stream as is (`recv -o x.kvpack`) and must not
/// commit pages a decoder would reject. The scratch buffer (the page's
/// elements as f32) is checked against `limits.max_memory` first.
///
/// # Errors
/// [`Error::Format`] naming the page; [`Error::Limits`] when the page's
/// elements exceed the memory limit.
pub fn check_page(
    codecs: &[Box<dyn Codec>],
    header: &FileHeader,
    page: &PageView<'_>,
    limits: &Limits,
) -> Result<()> {
    let m = page.header.meta;
    crate::codec::check_page_fits(codecs, &header.tensors, m)?;
    let info = &header.tensors[m.tensor as usize];
    let d = info.head_dim as usize;
    let per_plane = m.tokens as u64 * d as u64;
    limits.check_memory(
        per_plane
            .saturating_mul(info.planes() as u64)
            .saturating_mul(4),
        &format!("checking {}", page.what),
    )?;
    let mut scratch = TensorData::zeros(DType::F32, per_plane as usize * info.planes());
    let planes = scratch
        .as_elems_mut()
        .split_planes(per_plane as usize, info.planes());
    let mut out = PageOut {
        scatter: None,
        tensor: info,
        tokens: m.tokens,
        planes,
    };
    codecs[m.codec as usize].decode(page, &mut out)
}
