//! Python bindings (cargo feature `python`): the extension module
//! `kvpack._native`, wrapped by the pure-Python package in `python/kvpack`.
//!
//! Build with maturin (`pip install .` reads `pyproject.toml`). Tensors
//! cross the boundary through DLPack ([`dlpack`]) without copies: inputs
//! are borrowed from numpy arrays or torch tensors, decode outputs are
//! either caller-owned arrays (`decode_into`) or Rust-owned
//! [`arrays::OwnedArray`]s that numpy/torch wrap. Encoding and decoding run
//! on the library's rayon pool with the GIL released. Library errors become
//! the exceptions of `kvpack.errors` ([`errors`]). No codec logic lives
//! here: everything goes through [`crate::compress`] and
//! [`crate::decode`].

mod archive;
mod arrays;
mod cuda;
mod dlpack;
mod errors;
mod frames;
mod paged;

use std::collections::BTreeMap;
use std::io::Write;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use self::archive::{Archive, import_outputs, output_specs, run_decode_into};
use self::arrays::{OwnedArray, dtype_of, host_elems, kv_info, kv_layout, parse_kind};
use self::errors::IntoPy;
use crate::budget::{Method, compress_with};
use crate::cache::{DType, TensorInfo};
use crate::codec::Codec;
use crate::compress::{CompressOptions, CompressReport};
use crate::plan::Layout;
use crate::view::{CacheView, TensorView};

/// Options shared by `compress` and `max_size`.
#[derive(Debug, Clone, Copy)]
struct Opts {
    page_tokens: Option<u32>,
    sink: Option<u32>,
    recent: Option<u32>,
    zstd_level: Option<i32>,
    align_log2: u8,
    raw_fallback: bool,
}

impl Opts {
    /// Compress options, windows defaulting to the codec's own.
    fn resolve(&self, codec: &dyn Codec) -> PyResult<CompressOptions> {
        let (sink, recent) = codec.default_windows();
        if !(6..=16).contains(&self.align_log2) {
            return Err(PyValueError::new_err(format!(
                "align_log2 {} out of range 6..=16",
                self.align_log2
            )));
        }
        Ok(CompressOptions {
            layout: Layout {
                page_tokens: self.page_tokens.unwrap_or(256),
                sink: self.sink.unwrap_or(sink),
                recent: self.recent.unwrap_or(recent),
            },
            zstd_level: self.zstd_level,
            align_log2: self.align_log2,
            raw_fallback: self.raw_fallback,
        })
    }
}

/// Parses a codec name and builds its compress options (windows default to
/// the codec's own), as every encoding entry point takes them.
pub(crate) fn codec_and_options(
    name: &str,
    page_tokens: Option<u32>,
    sink: Option<u32>,
    recent: Option<u32>,
    zstd_level: Option<i32>,
    align_log2: u8,
    raw_fallback: bool,
) -> PyResult<(Box<dyn Codec>, CompressOptions)> {
    let codec = crate::codec::parse(name).py_err()?;
    let opts = Opts {
        page_tokens,
        sink,
        recent,
        zstd_level,
        align_log2,
        raw_fallback,
    }
    .resolve(codec.as_ref())?;
    Ok((codec, opts))
}

/// A compression report as a dict.
fn report_dict<'py>(
    py: Python<'py>,
    r: &CompressReport,
) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
    let d = pyo3::types::PyDict::new(py);
    d.set_item("codec", &r.codec)?;
    d.set_item("pages", r.pages)?;
    d.set_item("raw_pages", r.raw_pages)?;
    d.set_item("elements", r.elements)?;
    d.set_item("source_bytes", r.source_bytes)?;
    d.set_item("output_bytes", r.output_bytes)?;
    d.set_item("bits_per_element", r.bits_per_element())?;
    d.set_item("ratio", r.ratio())?;
    d.set_item("seconds", r.seconds)?;
    Ok(d)
}

/// A full caller `out` buffer is the caller's sizing, not the OS: the
/// [`SliceWriter`] error becomes a parameter error; others pass through.
fn full_buffer_is_param(e: crate::Error) -> crate::Error {
    match e {
        crate::Error::Io { source, .. } if source.kind() == std::io::ErrorKind::WriteZero => {
            crate::Error::param(source.to_string())
        }
        e => e,
    }
}

/// Writes into a caller buffer; running out of room is an error that says
/// how to size the buffer.
struct SliceWriter<'a> {
    buf: &'a mut [u8],
    pos: usize,
}

impl Write for SliceWriter<'_> {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let end = self.pos + data.len();
        if end > self.buf.len() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::WriteZero,
                format!(
                    "the output buffer holds {} bytes, more are needed (size it with \
                     kvpack.max_size / chunk_max_size and raw_fallback)",
                    self.buf.len()
                ),
            ));
        }
        self.buf[self.pos..end].copy_from_slice(data);
        self.pos = end;
        Ok(data.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What `compress` returns: the report, the file as `bytes` (no path or
/// out buffer given), the bytes written into `out`.
type Compressed<'py> = (
    Bound<'py, pyo3::types::PyDict>,
    Option<Bound<'py, PyBytes>>,
    Option<usize>,
);

/// Compresses tensors given as `(layer, kind, array[, dtype_hint])`:
/// `array` is a host tensor `[batch, kv_heads, tokens, head_dim]` (or 3-d
/// without batch) of bf16/fp16/fp32 in any strides with a contiguous
/// head_dim axis, borrowed without copying. Writes atomically to `path`
/// (never replacing an existing file unless `force`), or into `out` (a
/// writable contiguous uint8 host array, returning the byte count), or
/// returns the file as `bytes`. Returns `(report, bytes | None, written |
/// None)`. The GIL is released while encoding.
#[pyfunction]
#[pyo3(signature = (tensors, codec, *, path=None, force=false, out=None, page_tokens=None,
    sink=None, recent=None, zstd_level=None, align_log2=6, raw_fallback=false,
    metadata=None, token_ids=None, bits=None, key_codec=None))]
#[allow(clippy::too_many_arguments)]
fn compress<'py>(
    py: Python<'py>,
    tensors: Vec<Bound<'py, PyAny>>,
    codec: &str,
    path: Option<std::path::PathBuf>,
    force: bool,
    out: Option<Bound<'py, PyAny>>,
    page_tokens: Option<u32>,
    sink: Option<u32>,
    recent: Option<u32>,
    zstd_level: Option<i32>,
    align_log2: u8,
    raw_fallback: bool,
    metadata: Option<BTreeMap<String, String>>,
    token_ids: Option<Vec<u32>>,
    bits: Option<f64>,
    key_codec: Option<&str>,
) -> PyResult<Compressed<'py>> {
    let (codec, opts) = codec_and_options(
        codec,
        page_tokens,
        sink,
        recent,
        zstd_level,
        align_log2,
        raw_fallback,
    )?;
    let key = key_codec.map(crate::codec::parse).transpose().py_err()?;
    let opts = split_options(opts, key.as_deref(), sink, recent);
    let method = method_of(codec.as_ref(), key.as_deref(), bits, sink, recent)?;
    // Import every tensor, then borrow views of them.
    let mut imported = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        type Entry<'p> = (u32, String, Bound<'p, PyAny>, Option<String>, Option<f32>);
        let (layer, kind, arr, hint, scale): Entry<'_> =
            if let Ok((l, k, a)) = t.extract::<(u32, String, Bound<'_, PyAny>)>() {
                (l, k, a, None, None)
            } else if let Ok((l, k, a, h)) = t.extract() {
                (l, k, a, h, None)
            } else {
                t.extract().map_err(|_| {
                    PyValueError::new_err(format!(
                        "tensor {i}: expected (layer, kind, array[, dtype[, fp8 scale]])"
                    ))
                })?
            };
        let kind = parse_kind(&kind)?;
        imported.push((layer, kind, self::dlpack::import(&arr, None)?, hint, scale));
    }
    imported.sort_by_key(|x| (x.0, x.1));
    let mut views = Vec::new();
    for (layer, kind, t, hint, scale) in &imported {
        let what = format!("layer {layer} {}", kind.letter());
        let dtype = match (dtype_of(t, hint.as_deref(), &what)?, scale) {
            (DType::Fp8(f), Some(s)) => {
                DType::Fp8(crate::cache::Fp8::new(f.format(), *s).py_err()?)
            }
            (DType::Fp8(f), None) => DType::Fp8(f),
            (_, Some(_)) => {
                return Err(PyValueError::new_err(format!(
                    "{what}: a scale is given but the tensor is not fp8"
                )));
            }
            (d, None) => d,
        };
        let (shape, strides) = kv_layout(t, &what)?;
        let info = kv_info(*layer, *kind, dtype, shape);
        views.push(TensorView::new(info, host_elems(t, dtype, &what)?, strides).py_err()?);
    }
    if let Some(w) = views
        .windows(2)
        .find(|w| (w[0].info.layer, w[0].info.kind) == (w[1].info.layer, w[1].info.kind))
    {
        return Err(PyValueError::new_err(format!(
            "two tensors for {}",
            w[0].info.describe()
        )));
    }
    let view = CacheView {
        tensors: views,
        metadata: metadata.unwrap_or_default(),
        token_ids: token_ids.unwrap_or_default(),
    };
    write_out(py, &view, method, &opts, path, force, out)
}

/// `opts` with the windows of a K/V split left unset (`sink`, `recent`)
/// widened to the key codec's own ([`crate::budget::split_windows`]).
fn split_options(
    mut opts: CompressOptions,
    key: Option<&dyn Codec>,
    sink: Option<u32>,
    recent: Option<u32>,
) -> CompressOptions {
    if let Some(k) = key {
        opts.layout = crate::budget::split_windows(opts.layout, k, sink, recent);
    }
    opts
}

/// The coding method: `codec`, `key` on the keys and `codec` on the values,
/// or a budget plan when `bits` is given (then the planner chooses the
/// codecs and windows, so `key`, `sink` and `recent` must be unset).
fn method_of<'a>(
    codec: &'a dyn Codec,
    key: Option<&'a dyn Codec>,
    bits: Option<f64>,
    sink: Option<u32>,
    recent: Option<u32>,
) -> PyResult<Method<'a>> {
    match (bits, key) {
        (None, None) => Ok(Method::Codec(codec)),
        (None, Some(key)) => Ok(Method::Split { key, value: codec }),
        (Some(_), Some(_)) => Err(PyValueError::new_err(
            "bits= plans the codecs itself: do not give key_codec",
        )),
        (Some(_), None) if sink.is_some() || recent.is_some() => Err(PyValueError::new_err(
            "bits= plans the windows itself: do not give sink or recent",
        )),
        (Some(b), None) => Ok(Method::Bits(b)),
    }
}

/// Compresses `view` to a file at `path` (atomic, no clobber without
/// `force`), into the caller buffer `out`, or to `bytes`, with the GIL
/// released while encoding.
fn write_out<'py>(
    py: Python<'py>,
    view: &CacheView<'_>,
    c: Method<'_>,
    opts: &CompressOptions,
    path: Option<std::path::PathBuf>,
    force: bool,
    out: Option<Bound<'py, PyAny>>,
) -> PyResult<Compressed<'py>> {
    let none = |_: u64| {};
    if let Some(path) = path {
        let report = py
            .detach(|| {
                let mut rep = None;
                crate::io::file::write_atomic(&path, force, |w| {
                    rep = Some(compress_with(view, c, opts, w, &none)?.1);
                    Ok(())
                })?;
                Ok(rep.expect("write_atomic ran the writer"))
            })
            .py_err()?;
        return Ok((report_dict(py, &report)?, None, None));
    }
    encoded(py, out, |w| Ok(compress_with(view, c, opts, w, &none)?.1))
}

/// A writer the encoders can run on from the GIL-released side.
trait SendWrite: Write + Send {}
impl<W: Write + Send> SendWrite for W {}

/// Runs `encode` (GIL released) into `out`, a writable contiguous uint8
/// host array (returning the bytes written), or into a new `bytes`.
fn encoded<'py>(
    py: Python<'py>,
    out: Option<Bound<'py, PyAny>>,
    encode: impl Fn(&mut dyn SendWrite) -> crate::Result<CompressReport> + Send + Sync,
) -> PyResult<Compressed<'py>> {
    if let Some(out) = out {
        let buf = self::dlpack::import(&out, None)?;
        let mut w = SliceWriter {
            buf: buf.host_bytes_mut("out")?,
            pos: 0,
        };
        let report = py
            .detach(|| encode(&mut w))
            .map_err(full_buffer_is_param)
            .py_err()?;
        return Ok((report_dict(py, &report)?, None, Some(w.pos)));
    }
    let mut file = Vec::new();
    let report = py.detach(|| encode(&mut file)).py_err()?;
    Ok((
        report_dict(py, &report)?,
        Some(PyBytes::new(py, &file)),
        None,
    ))
}

/// Compresses a safetensors KV cache file (HF names
/// `past_key_values.{layer}.key/.value`, `[batch, kv_heads, tokens,
/// head_dim]`, as `kvpack compress` reads it; its metadata and token ids
/// are carried over) like `compress`. The input is memory-mapped.
#[pyfunction]
#[pyo3(signature = (source, codec, *, path=None, force=false, out=None, page_tokens=None,
    sink=None, recent=None, zstd_level=None, align_log2=6, raw_fallback=false, bits=None,
    key_codec=None))]
#[allow(clippy::too_many_arguments)]
fn compress_file<'py>(
    py: Python<'py>,
    source: std::path::PathBuf,
    codec: &str,
    path: Option<std::path::PathBuf>,
    force: bool,
    out: Option<Bound<'py, PyAny>>,
    page_tokens: Option<u32>,
    sink: Option<u32>,
    recent: Option<u32>,
    zstd_level: Option<i32>,
    align_log2: u8,
    raw_fallback: bool,
    bits: Option<f64>,
    key_codec: Option<&str>,
) -> PyResult<Compressed<'py>> {
    let (codec, opts) = codec_and_options(
        codec,
        page_tokens,
        sink,
        recent,
        zstd_level,
        align_log2,
        raw_fallback,
    )?;
    let key = key_codec.map(crate::codec::parse).transpose().py_err()?;
    let opts = split_options(opts, key.as_deref(), sink, recent);
    let method = method_of(codec.as_ref(), key.as_deref(), bits, sink, recent)?;
    let name = source.to_string_lossy().into_owned();
    let input = py.detach(|| crate::io::file::open_input(&name)).py_err()?;
    let cache = py
        .detach(|| crate::io::safetensors::parse(&input, &name))
        .py_err()?
        .cache;
    write_out(py, &cache.view(), method, &opts, path, force, out)
}

/// An upper bound of the size in bytes of `compress(..., raw_fallback=True)`
/// output for tensors described as `(layer, kind, [batch, kv_heads, tokens,
/// head_dim], dtype)`, exact for the file's structure (see
/// `kvpack::compress::max_compressed_size`).
#[pyfunction]
#[pyo3(signature = (tensors, codec, *, page_tokens=None, sink=None, recent=None,
    zstd_level=None, align_log2=6, metadata=None, token_ids=0))]
#[allow(clippy::too_many_arguments)]
fn max_size(
    py: Python<'_>,
    tensors: Vec<(u32, String, [u32; 4], String)>,
    codec: &str,
    page_tokens: Option<u32>,
    sink: Option<u32>,
    recent: Option<u32>,
    zstd_level: Option<i32>,
    align_log2: u8,
    metadata: Option<BTreeMap<String, String>>,
    token_ids: usize,
) -> PyResult<u64> {
    let (codec, opts) = codec_and_options(
        codec,
        page_tokens,
        sink,
        recent,
        zstd_level,
        align_log2,
        true,
    )?;
    let mut infos: Vec<TensorInfo> = tensors
        .into_iter()
        .map(|(layer, kind, shape, dtype)| {
            Ok(kv_info(
                layer,
                parse_kind(&kind)?,
                DType::parse(&dtype).py_err()?,
                shape,
            ))
        })
        .collect::<PyResult<_>>()?;
    infos.sort_by_key(|i| (i.layer, i.kind));
    let metadata = metadata.unwrap_or_default();
    py.detach(|| {
        crate::compress::max_compressed_size(&infos, &metadata, token_ids, codec.as_ref(), &opts)
    })
    .py_err()
}

/// Decodes a whole kvpack file held in `data` (`bytes`, or a contiguous
/// uint8 host array: borrowed, not copied) into caller-owned outputs, as
/// `Archive.decode_into` does.
#[pyfunction]
fn decode_bytes_into(
    py: Python<'_>,
    data: &Bound<'_, PyAny>,
    outputs: Vec<Bound<'_, PyAny>>,
) -> PyResult<()> {
    let imported = import_outputs(&outputs)?;
    let specs = output_specs(&imported)?;
    let held;
    let bytes: &[u8] = if let Ok(b) = data.cast::<PyBytes>() {
        b.as_bytes()
    } else {
        held = self::dlpack::import(data, None)?;
        held.host_bytes("data")?
    };
    py.detach(|| {
        let a = crate::decode::Archive::open(bytes)?;
        run_decode_into(&a, specs)
    })
    .py_err()
}

/// The tensor table of a kvpack file held in `data` (`bytes` or a
/// contiguous uint8 host array, borrowed), as `Archive.tensors()` gives it,
/// reading only the header and index.
#[pyfunction]
fn tensor_table(
    py: Python<'_>,
    data: &Bound<'_, PyAny>,
) -> PyResult<Vec<self::archive::InfoTuple>> {
    let held;
    let bytes: &[u8] = if let Ok(b) = data.cast::<PyBytes>() {
        b.as_bytes()
    } else {
        held = self::dlpack::import(data, None)?;
        held.host_bytes("data")?
    };
    py.detach(|| {
        let r = crate::format::Reader::open(bytes)?;
        Ok((0..r.header().tensors.len())
            .map(|i| {
                self::archive::info_tuple(&TensorInfo {
                    tokens: r.tokens(i),
                    ..r.header().tensors[i].clone()
                })
            })
            .collect())
    })
    .py_err()
}

/// Times the library's own decode of the kvpack file in `data`, with no
/// Python in the loop: every tensor into preallocated Rust buffers of
/// `dtype` (default: source), `runs` times. Returns seconds per run. For
/// comparing the Python path against the Rust library on the same data in
/// the same process (`tools/bench_python.py`).
#[pyfunction]
#[pyo3(signature = (data, runs, dtype=None))]
fn bench_decode_into(
    py: Python<'_>,
    data: &Bound<'_, PyBytes>,
    runs: usize,
    dtype: Option<&str>,
) -> PyResult<Vec<f64>> {
    let bytes = data.as_bytes();
    let dtype = dtype.map(DType::parse).transpose().py_err()?;
    py.detach(|| {
        let a = crate::decode::Archive::open(bytes)?;
        let infos: Vec<TensorInfo> = a
            .tensors()
            .into_iter()
            .map(|i| TensorInfo {
                dtype: dtype.unwrap_or(i.dtype),
                ..i
            })
            .collect();
        let mut bufs: Vec<crate::cache::TensorData> = infos
            .iter()
            .map(|i| crate::cache::TensorData::zeros(i.dtype, i.elements() as usize))
            .collect();
        let mut times = Vec::with_capacity(runs);
        for _ in 0..runs {
            let t0 = std::time::Instant::now();
            let outs = infos
                .iter()
                .zip(bufs.iter_mut())
                .enumerate()
                .map(|(tensor, (i, b))| {
                    Ok(crate::decode::Destination {
                        tensor,
                        first_token: 0,
                        view: crate::view::TensorViewMut::new(
                            i.clone(),
                            b.as_elems_mut(),
                            crate::view::Strides::head_major(i),
                        )?,
                    })
                })
                .collect::<crate::Result<Vec<_>>>()?;
            a.decode_into(outs, None)?;
            times.push(t0.elapsed().as_secs_f64());
        }
        Ok(times)
    })
    .py_err()
}

/// The registered codec families: `(id, name, syntax, summary)`.
#[pyfunction]
fn codec_families() -> Vec<(u16, &'static str, &'static str, &'static str)> {
    crate::codec::registry::FAMILIES
        .iter()
        .map(|f| (f.id, f.name, f.syntax, f.summary))
        .collect()
}

/// Canonical name of a codec name (raises `ParameterError` for an unknown
/// or invalid name).
#[pyfunction]
fn canonical_codec(name: &str) -> PyResult<String> {
    Ok(crate::codec::parse(name).py_err()?.name())
}

/// The extension module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Archive>()?;
    m.add_class::<OwnedArray>()?;
    m.add_class::<arrays::OwnedBytes>()?;
    m.add_function(wrap_pyfunction!(compress, m)?)?;
    m.add_function(wrap_pyfunction!(compress_file, m)?)?;
    m.add_function(wrap_pyfunction!(max_size, m)?)?;
    m.add_function(wrap_pyfunction!(decode_bytes_into, m)?)?;
    m.add_function(wrap_pyfunction!(codec_families, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_table, m)?)?;
    m.add_function(wrap_pyfunction!(bench_decode_into, m)?)?;
    m.add_function(wrap_pyfunction!(canonical_codec, m)?)?;
    m.add_function(wrap_pyfunction!(frames::page_faults, m)?)?;
    m.add_function(wrap_pyfunction!(paged::encode_paged_host, m)?)?;
    m.add_function(wrap_pyfunction!(paged::decode_paged_host, m)?)?;
    m.add_class::<cuda::CudaJob>()?;
    m.add_function(wrap_pyfunction!(cuda::cuda_decode_paged, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_encode_paged, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_bench_decode_paged, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_bench_encode_paged, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_built, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add(
        "FORMAT_VERSION",
        (crate::format::VERSION_MAJOR, crate::format::VERSION_MINOR),
    )?;
    Ok(())
}
