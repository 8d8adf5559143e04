//! CUDA paged I/O for Python (`kvpack.cuda`): decode a layer of a kvpack
//! file into a serving engine's paged KV cache, and encode one out of it,
//! on the caller's CUDA stream ([`crate::gpu::Gpu::decode_paged`],
//! [`crate::gpu::Gpu::encode_paged`]). Cache tensors come in through
//! DLPack (torch, cupy): device memory is borrowed, never copied to the
//! host for decode. In a build without the `cuda` feature every call
//! raises `UnsupportedError`.

use std::sync::Mutex;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use super::archive::Archive;
use super::codec_and_options;
use super::dlpack::{self, Imported};
use super::errors::IntoPy;
use crate::cache::DType;
use crate::gpu::paged::{PagedCache, PagedLayout};
use crate::gpu::{Gpu, PagedJob, PagedStats};

use dlpack::DEVICE_CUDA;

/// True when `obj` says (`__dlpack_device__`) it is CUDA device memory.
fn is_cuda(obj: &Bound<'_, PyAny>) -> bool {
    obj.getattr(pyo3::intern!(obj.py(), "__dlpack_device__"))
        .and_then(|f| f.call0())
        .and_then(|d| d.extract::<(i32, i32)>())
        .is_ok_and(|(ty, _)| ty == DEVICE_CUDA)
}

/// The DLPack stream argument for a raw `CUstream` (DLPack names the
/// legacy default stream 1, where a raw handle is 0).
fn dlpack_stream(stream: u64) -> isize {
    if stream == 0 { 1 } else { stream as isize }
}

/// The cache tensors (one for the joint layouts, K and V for `hnd`),
/// borrowed through DLPack, described as a [`PagedCache`], with the CUDA
/// device ordinal.
///
/// `stream` (the raw `CUstream` the work goes to) is handed to each
/// producer's `__dlpack__`, which orders the producer's pending work on
/// the tensor before that stream (DLPack names the legacy default stream 1,
/// where a raw handle is 0).
fn import_cache(
    tensors: &[Bound<'_, PyAny>],
    layout: PagedLayout,
    writable: bool,
    stream: u64,
) -> PyResult<(Vec<Imported>, PagedCache, usize)> {
    let want = if layout.joint() { 1 } else { 2 };
    if tensors.len() != want {
        return Err(PyValueError::new_err(format!(
            "the {} layout takes {want} cache tensor(s) {}, got {}",
            layout.name(),
            layout.axes(),
            tensors.len()
        )));
    }
    let imported = tensors
        .iter()
        .map(|t| dlpack::import(t, is_cuda(t).then_some(dlpack_stream(stream))))
        .collect::<PyResult<Vec<_>>>()?;
    let first = &imported[0];
    let what = |i: usize| {
        if want == 1 {
            "kv_cache"
        } else {
            ["K cache", "V cache"][i]
        }
    };
    for (i, t) in imported.iter().enumerate() {
        if t.device.device_type != DEVICE_CUDA || t.device.device_id != first.device.device_id {
            return Err(PyValueError::new_err(format!(
                "{} is not on CUDA device {} (DLPack device type {}, id {})",
                what(i),
                first.device.device_id,
                t.device.device_type,
                t.device.device_id
            )));
        }
        if !t.is_contiguous() {
            return Err(PyValueError::new_err(format!(
                "{} is not contiguous; paged caches must be C-contiguous {}",
                what(i),
                layout.axes()
            )));
        }
        if t.shape != first.shape || t.dtype != first.dtype {
            return Err(PyValueError::new_err(
                "the K and V caches differ in shape or dtype",
            ));
        }
        if writable {
            t.check_writable(what(i))?;
        }
    }
    let dtype = match first.dtype {
        dlpack::BF16 => DType::Bf16,
        dlpack::F16 => DType::F16,
        _ => {
            return Err(PyValueError::new_err(
                "paged caches must be bfloat16 or float16",
            ));
        }
    };
    let ordinal = usize::try_from(first.device.device_id)
        .map_err(|_| PyValueError::new_err("negative CUDA device id"))?;
    let v = imported.get(1).map(|t| t.ptr as u64);
    // SAFETY: the pointers, shape and dtype come from the producers' DLPack
    // capsules, which `imported` holds (and the caller keeps, for as long as
    // the work may run): live, C-contiguous device memory of that many
    // elements (checked above) on device `ordinal`.
    let cache = unsafe { PagedCache::from_raw(layout, dtype, &first.shape, first.ptr as u64, v) }
        .py_err()?;
    Ok((imported, cache, ordinal))
}

/// The device handle submitting to `stream` (a raw `CUstream`).
fn gpu_on(ordinal: usize, stream: u64) -> PyResult<Gpu> {
    // One handle per device for the life of the process: its loaded
    // modules and pooled pinned staging buffers serve every later call
    // (a fresh handle per call reloads modules and pins new staging).
    static GPUS: std::sync::OnceLock<Mutex<std::collections::HashMap<usize, Gpu>>> =
        std::sync::OnceLock::new();
    let gpus = GPUS.get_or_init(Default::default);
    let mut held = gpus.lock().unwrap_or_else(|e| e.into_inner());
    let gpu = match held.get(&ordinal) {
        Some(g) => g.clone(),
        None => {
            let g = Gpu::new(ordinal).py_err()?;
            held.insert(ordinal, g.clone());
            g
        }
    };
    drop(held);
    // SAFETY: the Python caller passes its current stream of this device
    // (`torch.cuda.current_stream().cuda_stream` by default, see
    // kvpack/cuda.py), which outlives the call and the job holding it.
    Ok(unsafe { gpu.with_stream(stream) })
}

/// A block table: a list of ints, or a 1-d int32/int64 host array (numpy,
/// CPU torch) read through DLPack without a per-element conversion.
pub(super) fn block_table(obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    if let Ok(v) = obj.extract::<Vec<i64>>() {
        return Ok(v);
    }
    let t = dlpack::import(obj, None)?;
    let bytes = t.host_bytes("block_ids")?;
    match (t.dtype.code, t.dtype.bits, t.shape.len()) {
        (0, 64, 1) => Ok(bytes
            .chunks_exact(8)
            .map(|c| i64::from_ne_bytes(c.try_into().expect("8 bytes")))
            .collect()),
        (0, 32, 1) => Ok(bytes
            .chunks_exact(4)
            .map(|c| i64::from(i32::from_ne_bytes(c.try_into().expect("4 bytes"))))
            .collect()),
        _ => Err(pyo3::exceptions::PyValueError::new_err(
            "block_ids must be a list of ints or a 1-d int32/int64 array",
        )),
    }
}

/// Counters of a paged decode as a dict.
fn stats_dict<'py>(py: Python<'py>, s: &PagedStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("pages", s.pages)?;
    d.set_item("file_bytes", s.file_bytes)?;
    d.set_item("uploaded_bytes", s.uploaded_bytes)?;
    d.set_item("output_bytes", s.output_bytes)?;
    Ok(d)
}

/// Paged decode work enqueued on a CUDA stream (`kvpack.cuda.CudaJob`).
/// Holds the cache tensors and the pinned staging until the work is done;
/// dropping it waits for the work (an event wait, never the device).
#[pyclass(module = "kvpack._native", name = "CudaJob", frozen)]
pub struct CudaJob {
    job: Mutex<Option<PagedJob>>,
    _hold: Vec<Imported>,
}

#[pymethods]
impl CudaJob {
    /// Waits (GIL released) until the work has finished on its stream and
    /// checks what the kernels reported; returns counters `{pages,
    /// file_bytes, uploaded_bytes, output_bytes}`. A second call returns
    /// `None`.
    ///
    /// Raises `FormatError` when a page failed its codec's content checks,
    /// `KvpackIOError` for a CUDA failure.
    fn wait<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let job = self.job.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(job) = job else {
            return Ok(None);
        };
        let stats = py.detach(|| job.wait()).py_err()?;
        Ok(Some(stats_dict(py, &stats)?))
    }

    /// True when the work has finished (does not block).
    fn done(&self) -> bool {
        self.job
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_none_or(|j| j.is_complete())
    }
}

/// Decodes layer `layer` of a kvpack file into a paged cache on `stream`
/// (see `kvpack.cuda.decode_paged`). `data` is a `kvpack._native.Archive`,
/// `bytes` or a contiguous uint8 host array; `kv_cache` the cache
/// tensor(s). Returns the enqueued [`CudaJob`].
#[pyfunction]
#[pyo3(signature = (data, kv_cache, block_ids, *, layer, layout, stream, device_copy=None))]
#[allow(clippy::too_many_arguments)]
pub fn cuda_decode_paged(
    py: Python<'_>,
    data: &Bound<'_, PyAny>,
    kv_cache: Vec<Bound<'_, PyAny>>,
    block_ids: &Bound<'_, PyAny>,
    layer: u32,
    layout: &str,
    stream: u64,
    device_copy: Option<Bound<'_, PyAny>>,
) -> PyResult<CudaJob> {
    let layout = PagedLayout::parse(layout).py_err()?;
    let block_ids = block_table(block_ids)?;
    let (mut hold, cache, ordinal) = import_cache(&kv_cache, layout, true, stream)?;
    let gpu = gpu_on(ordinal, stream)?;
    let resident = match device_copy {
        Some(d) => {
            let t = dlpack::import(&d, Some(dlpack_stream(stream)))?;
            let (ptr, len) = t.cuda_bytes("device_copy", ordinal)?;
            hold.push(t);
            Some((ptr, len))
        }
        None => None,
    };
    let run = |a: &crate::decode::Archive<'_>| match resident {
        Some((ptr, len)) => {
            let need = a.reader().committed_len();
            if (len as u64) < need {
                return Err(crate::Error::param(format!(
                    "device_copy holds {len} bytes, the file {need}"
                )));
            }
            // SAFETY: `ptr` is `len` bytes of CUDA memory on this device,
            // held by `hold` for as long as the job lives; the caller
            // promised (kvpack.cuda.decode_paged's docs) that they equal the
            // file's bytes and stay unchanged until the job is done.
            unsafe { gpu.decode_paged_resident(a, ptr, layer, &cache, &block_ids) }
        }
        None => gpu.decode_paged(a, layer, &cache, &block_ids),
    };
    let job = if is_cuda(data) {
        if resident.is_some() {
            return Err(PyValueError::new_err(
                "device_copy is for a host copy of the file; the file is on the device already",
            ));
        }
        let t = dlpack::import(data, Some(dlpack_stream(stream)))?;
        let (ptr, len) = t.cuda_bytes("data", ordinal)?;
        hold.push(t);
        // SAFETY: `ptr` is `len` bytes of CUDA memory on this device, held
        // by `hold` for as long as the job lives; the caller hands the
        // tensor over unchanged until the job is done
        // (kvpack.cuda.decode_paged's docs).
        py.detach(|| unsafe { gpu.decode_paged_device(ptr, len as u64, layer, &cache, &block_ids) })
    } else if let Ok(ar) = data.cast::<Archive>() {
        let ar = ar.get();
        py.detach(|| ar.with(run))
    } else {
        let held;
        // A borrowed array may be written by other Python threads while we
        // decode: its pages are checked and decoded from private copies.
        let (bytes, shared): (&[u8], bool) = if let Ok(b) = data.cast::<PyBytes>() {
            (b.as_bytes(), false)
        } else {
            held = dlpack::import(data, None)?;
            (held.host_bytes("data")?, true)
        };
        py.detach(|| run(&crate::decode::Archive::open(bytes)?.with_private_pages(shared)))
    }
    .py_err()?;
    Ok(CudaJob {
        job: Mutex::new(Some(job)),
        _hold: hold,
    })
}

/// `(report, bytes | None, bytes written into out | None)`.
type Encoded<'py> = (
    Bound<'py, PyDict>,
    Option<super::arrays::OwnedBytes>,
    Option<usize>,
);

/// Encodes tokens `0..num_tokens` of a paged cache on `stream` into a
/// complete kvpack file (see `kvpack.cuda.encode_paged`), returned as
/// `bytes` or written into `out` (a writable contiguous uint8 host array
/// of at least `kvpack.max_size` bytes). Returns `(report, bytes | None,
/// written | None)`.
#[pyfunction]
#[pyo3(signature = (kv_cache, block_ids, num_tokens, codec, *, layout, layer, stream,
    out=None, page_tokens=None, sink=None, recent=None, zstd_level=None, align_log2=6,
    raw_fallback=false))]
#[allow(clippy::too_many_arguments)]
pub fn cuda_encode_paged<'py>(
    py: Python<'py>,
    kv_cache: Vec<Bound<'py, PyAny>>,
    block_ids: &Bound<'_, PyAny>,
    num_tokens: u32,
    codec: &str,
    layout: &str,
    layer: u32,
    stream: u64,
    out: Option<Bound<'py, PyAny>>,
    page_tokens: Option<u32>,
    sink: Option<u32>,
    recent: Option<u32>,
    zstd_level: Option<i32>,
    align_log2: u8,
    raw_fallback: bool,
) -> PyResult<Encoded<'py>> {
    let (codec, opts) = codec_and_options(
        codec,
        page_tokens,
        sink,
        recent,
        zstd_level,
        align_log2,
        raw_fallback,
    )?;
    let layout = PagedLayout::parse(layout).py_err()?;
    let block_ids = block_table(block_ids)?;
    let (_hold, cache, ordinal) = import_cache(&kv_cache, layout, false, stream)?;
    let gpu = gpu_on(ordinal, stream)?;
    let c = codec.as_ref();
    if let Some(out) = out.as_ref().filter(|o| is_cuda(o)) {
        let buf = dlpack::import(out, Some(dlpack_stream(stream)))?;
        let (ptr, cap) = buf.cuda_bytes("out", ordinal)?;
        buf.check_writable("out")?;
        // SAFETY: `ptr` is `cap` writable bytes of CUDA memory on this
        // device, held by `buf` for the whole call, which returns once the
        // file is written (a stream synchronize).
        let (n, report) = py
            .detach(|| unsafe {
                gpu.encode_paged_device(
                    &cache, &block_ids, num_tokens, c, layer, &opts, ptr, cap as u64,
                )
            })
            .py_err()?;
        return Ok((super::report_dict(py, &report)?, None, Some(n as usize)));
    }
    if let Some(out) = out {
        let buf = dlpack::import(&out, None)?;
        let bytes = buf.host_bytes_mut("out")?;
        let w = super::SliceWriter { buf: bytes, pos: 0 };
        let (w, report) = py
            .detach(|| gpu.encode_paged(&cache, &block_ids, num_tokens, c, layer, &opts, w))
            .map_err(super::full_buffer_is_param)
            .py_err()?;
        return Ok((super::report_dict(py, &report)?, None, Some(w.pos)));
    }
    // Files are at most about the bf16/fp16 source (raw, plus headers):
    // reserved up front, a growing Vec's copies are spared (capacity never
    // written is never backed by memory).
    let s = cache.shape();
    let reserve =
        2 * s.kv_heads as usize * num_tokens as usize * s.head_dim as usize * 2 + (1 << 20);
    let (file, report) = py
        .detach(|| {
            let out = Vec::with_capacity(reserve);
            gpu.encode_paged(&cache, &block_ids, num_tokens, c, layer, &opts, out)
        })
        .py_err()?;
    Ok((
        super::report_dict(py, &report)?,
        Some(super::arrays::OwnedBytes::new(file)),
        None,
    ))
}

/// Times the Rust library's own `Gpu::decode_paged` (open + stage + upload
/// + kernels + wait) of `data` into `kv_cache`, `runs` times, with no
/// Python in the loop: seconds per run. For comparing the Python call with
/// the library in the same process (`tools/bench_cuda.py`).
#[pyfunction]
#[pyo3(signature = (data, kv_cache, block_ids, *, layer, layout, stream, runs))]
#[allow(clippy::too_many_arguments)]
pub fn cuda_bench_decode_paged(
    py: Python<'_>,
    data: &Bound<'_, PyBytes>,
    kv_cache: Vec<Bound<'_, PyAny>>,
    block_ids: &Bound<'_, PyAny>,
    layer: u32,
    layout: &str,
    stream: u64,
    runs: usize,
) -> PyResult<Vec<f64>> {
    let layout = PagedLayout::parse(layout).py_err()?;
    let block_ids = block_table(block_ids)?;
    let (_hold, cache, ordinal) = import_cache(&kv_cache, layout, true, stream)?;
    let gpu = gpu_on(ordinal, stream)?;
    let bytes = data.as_bytes();
    py.detach(|| {
        (0..runs)
            .map(|_| {
                let t0 = std::time::Instant::now();
                let a = crate::decode::Archive::open(bytes)?;
                gpu.decode_paged(&a, layer, &cache, &block_ids)?.wait()?;
                Ok(t0.elapsed().as_secs_f64())
            })
            .collect::<crate::Result<Vec<f64>>>()
    })
    .py_err()
}

/// Times the Rust library's own `Gpu::encode_paged` of `kv_cache` with
/// `codec`, `runs` times (no Python in the loop): seconds per run.
#[pyfunction]
#[pyo3(signature = (kv_cache, block_ids, num_tokens, codec, *, layout, stream, runs))]
#[allow(clippy::too_many_arguments)]
pub fn cuda_bench_encode_paged(
    py: Python<'_>,
    kv_cache: Vec<Bound<'_, PyAny>>,
    block_ids: &Bound<'_, PyAny>,
    num_tokens: u32,
    codec: &str,
    layout: &str,
    stream: u64,
    runs: usize,
) -> PyResult<Vec<f64>> {
    let (codec, opts) = super::codec_and_options(codec, None, None, None, None, 6, false)?;
    let layout = PagedLayout::parse(layout).py_err()?;
    let block_ids = block_table(block_ids)?;
    let (_hold, cache, ordinal) = import_cache(&kv_cache, layout, false, stream)?;
    let gpu = gpu_on(ordinal, stream)?;
    let c = codec.as_ref();
    py.detach(|| {
        (0..runs)
            .map(|_| {
                let t0 = std::time::Instant::now();
                gpu.encode_paged(&cache, &block_ids, num_tokens, c, 0, &opts, Vec::new())?;
                Ok(t0.elapsed().as_secs_f64())
            })
            .collect::<crate::Result<Vec<f64>>>()
    })
    .py_err()
}

/// True when this build has the `cuda` feature.
#[pyfunction]
pub fn cuda_built() -> bool {
    cfg!(feature = "cuda")
}
