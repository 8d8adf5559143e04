//! Host paged KV caches for Python (`kvpack.paged`): one layer encoded
//! straight from a paged cache in host memory (numpy arrays, CPU torch
//! tensors) and a layer of a file decoded straight into one
//! ([`crate::paged`]), the host mirror of `kvpack.cuda`'s
//! `encode_paged` / `decode_paged`. Tensors come in through DLPack,
//! borrowed; the GIL is released while coding.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::archive::Archive;
use super::arrays::{check_disjoint, dtype_of, host_elems, host_elems_mut};
use super::dlpack::{self, Imported};
use super::errors::IntoPy;
use super::{Compressed, codec_and_options, encoded};
use crate::cache::{DType, ElemsMut};
use crate::gpu::paged::{PagedLayout, PagedShape};
use crate::paged::{HostPaged, host_shape};

/// The cache tensors (one for the joint layouts, K and V for `hnd`),
/// borrowed through DLPack: host memory, C-contiguous, one shape and
/// dtype (`hint` names the type of uint16 bit patterns).
fn import_cache(
    tensors: &[Bound<'_, PyAny>],
    layout: PagedLayout,
    hint: Option<&str>,
) -> PyResult<(Vec<Imported>, PagedShape, DType)> {
    let imported = tensors
        .iter()
        .map(|t| dlpack::import(t, None))
        .collect::<PyResult<Vec<_>>>()?;
    let Some(first) = imported.first() else {
        return Err(PyValueError::new_err("no cache tensor given"));
    };
    let dtype = dtype_of(first, hint, "kv_cache")?;
    for t in &imported {
        if !t.is_contiguous() {
            return Err(PyValueError::new_err(format!(
                "the cache is not contiguous; paged caches must be C-contiguous {}",
                layout.axes()
            )));
        }
        if t.shape != first.shape || dtype_of(t, hint, "kv_cache")? != dtype {
            return Err(PyValueError::new_err(
                "the K and V caches differ in shape or dtype",
            ));
        }
    }
    let lens: Vec<usize> = imported.iter().map(|t| t.len()).collect();
    let shape = host_shape(layout, &first.shape, &lens).py_err()?;
    Ok((imported, shape, dtype))
}

/// Encodes tokens `0..num_tokens` of a host paged cache (layer `layer`,
/// blocks `block_ids`) into a kvpack file (see `kvpack.paged.encode_paged`),
/// returned as `bytes` or written into `out` (a writable contiguous uint8
/// host array). Returns `(report, bytes | None, written | None)`.
#[pyfunction]
#[pyo3(signature = (kv_cache, block_ids, num_tokens, codec, *, layout, layer, dtype=None,
    out=None, page_tokens=None, sink=None, recent=None, zstd_level=None, align_log2=6,
    raw_fallback=false))]
#[allow(clippy::too_many_arguments)]
pub fn encode_paged_host<'py>(
    py: Python<'py>,
    kv_cache: Vec<Bound<'py, PyAny>>,
    block_ids: &Bound<'_, PyAny>,
    num_tokens: u32,
    codec: &str,
    layout: &str,
    layer: u32,
    dtype: Option<&str>,
    out: Option<Bound<'py, PyAny>>,
    page_tokens: Option<u32>,
    sink: Option<u32>,
    recent: Option<u32>,
    zstd_level: Option<i32>,
    align_log2: u8,
    raw_fallback: bool,
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
    let layout = PagedLayout::parse(layout).py_err()?;
    let ids = super::cuda::block_table(block_ids)?;
    let (held, shape, dt) = import_cache(&kv_cache, layout, dtype)?;
    let cache = HostPaged {
        layout,
        shape,
        k: host_elems(&held[0], dt, "kv_cache")?,
        v: held
            .get(1)
            .map(|t| host_elems(t, dt, "V cache"))
            .transpose()?,
    };
    let c = codec.as_ref();
    encoded(py, out, |w| {
        Ok(crate::paged::encode_paged(&cache, &ids, num_tokens, c, layer, &opts, w)?.1)
    })
}

/// Decodes layer `layer` of a kvpack file (`data`: a
/// `kvpack._native.Archive`, `bytes` or a contiguous uint8 host array,
/// borrowed) into the blocks `block_ids` of a host paged
/// cache, all stored tokens or stored tokens `tokens = (start, end)` (see
/// `kvpack.paged.decode_paged`).
#[pyfunction]
#[pyo3(signature = (data, kv_cache, block_ids, *, layer, layout, dtype=None, tokens=None))]
#[allow(clippy::too_many_arguments)]
pub fn decode_paged_host(
    py: Python<'_>,
    data: &Bound<'_, PyAny>,
    kv_cache: Vec<Bound<'_, PyAny>>,
    block_ids: &Bound<'_, PyAny>,
    layer: u32,
    layout: &str,
    dtype: Option<&str>,
    tokens: Option<(u32, u32)>,
) -> PyResult<()> {
    let layout = PagedLayout::parse(layout).py_err()?;
    let ids = super::cuda::block_table(block_ids)?;
    let (held, shape, dt) = import_cache(&kv_cache, layout, dtype)?;
    check_disjoint(&held.iter().collect::<Vec<_>>())?;
    let mut cache = held
        .iter()
        .map(|t| host_elems_mut(t, dt, "kv_cache"))
        .collect::<PyResult<Vec<ElemsMut<'_>>>>()?;
    let dims = shape.dims(layout);
    let range = tokens.map(|(s, e)| s..e);
    let run = |a: &crate::decode::Archive<'_>| {
        crate::paged::decode_paged(a, layer, layout, &dims, &mut cache, &ids, range)
    };
    if let Ok(ar) = data.cast::<Archive>() {
        let ar = ar.get();
        return py.detach(|| ar.with(run)).py_err();
    }
    let keep;
    let bytes: &[u8] = if let Ok(b) = data.cast::<PyBytes>() {
        b.as_bytes()
    } else {
        keep = dlpack::import(data, None)?;
        keep.host_bytes("data")?
    };
    py.detach(|| run(&crate::decode::Archive::open(bytes)?))
        .py_err()
}
