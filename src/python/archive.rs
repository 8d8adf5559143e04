//! `kvpack._native.Archive`: an opened kvpack file (memory-mapped, or
//! bytes) and its decoders, with the GIL released while decoding.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::arrays::{OwnedArray, check_disjoint, dtype_of, host_elems_mut, kv_layout, parse_kind};
use super::dlpack::{self, Imported};
use super::errors::IntoPy;
use crate::cache::{DType, Kind, TensorInfo};
use crate::decode::{Archive as Inner, Destination, Selection};
use crate::io::file::InputBytes;
use crate::view::TensorViewMut;

type Parsed<'a> = Inner<'a>;

self_cell::self_cell!(
    struct Cell {
        owner: InputBytes,
        #[not_covariant]
        dependent: Parsed,
    }
);

/// An opened kvpack file. Construct with a path (memory-mapped; `"-"`
/// reads stdin) or with `bytes`. Structure and checksums of the header and
/// index are validated when opening; pages when decoded.
#[pyclass(frozen, module = "kvpack._native")]
pub struct Archive {
    cell: Cell,
}

/// One tensor table entry: `(name, layer, kind, dtype, batch, kv_heads,
/// tokens, head_dim, fp8 scale or None)`.
pub type InfoTuple = (
    String,
    u32,
    &'static str,
    &'static str,
    u32,
    u32,
    u32,
    u32,
    Option<f32>,
);

/// The tuple form of a tensor table entry.
pub fn info_tuple(i: &TensorInfo) -> InfoTuple {
    (
        i.name.clone(),
        i.layer,
        i.kind.letter(),
        i.dtype.name(),
        i.batch,
        i.heads,
        i.tokens,
        i.head_dim,
        i.dtype.scale(),
    )
}

impl Archive {
    /// Runs `f` on the parsed file.
    pub(super) fn with<R>(&self, f: impl for<'a> FnOnce(&Inner<'a>) -> R) -> R {
        self.cell.with_dependent(|_, a| f(a))
    }
}

#[pymethods]
impl Archive {
    /// Opens `source`: a filesystem path (`str` or `os.PathLike`), a
    /// `bytes` object or a contiguous uint8 host array holding a whole
    /// kvpack file (bytes and arrays are copied once).
    ///
    /// Raises `FormatError` for invalid data, `KvpackIOError` when the file
    /// cannot be read.
    #[new]
    fn new(py: Python<'_>, source: &Bound<'_, PyAny>) -> PyResult<Archive> {
        let bytes = if let Ok(b) = source.cast::<PyBytes>() {
            InputBytes::Owned(b.as_bytes().to_vec())
        } else if let Ok(path) = source.extract::<std::path::PathBuf>() {
            let p = path.to_string_lossy().into_owned();
            py.detach(|| crate::io::file::open_input(&p)).py_err()?
        } else {
            // A uint8 host array (e.g. what kvpack.cuda.encode_paged
            // returns): held as a private copy.
            let t = dlpack::import(source, None)?;
            InputBytes::Owned(t.host_bytes("source")?.to_vec())
        };
        let cell = py
            .detach(|| {
                // A mapped file may be changed by another process while we
                // read it: pages are checked and decoded from private
                // copies (the CLI's concurrency contract, SPEC section 10).
                let mapped = bytes.is_mapped();
                Cell::try_new(bytes, |b| {
                    Inner::open(b).map(|a| a.with_private_pages(mapped))
                })
            })
            .py_err()?;
        Ok(Archive { cell })
    }

    /// The tensor table with the latest commit's token counts, as tuples
    /// `(name, layer, kind, dtype, batch, kv_heads, tokens, head_dim)`.
    fn tensors(&self) -> Vec<InfoTuple> {
        self.with(|a| a.tensors().iter().map(info_tuple).collect())
    }

    /// Header metadata (string keys and values).
    fn metadata(&self) -> std::collections::BTreeMap<String, String> {
        self.with(|a| a.reader().header().metadata.clone())
    }

    /// Token ids of the cached prefix (empty when not recorded).
    fn token_ids(&self) -> Vec<u32> {
        self.with(|a| a.token_ids().to_vec())
    }

    /// Canonical names of the codec table's codecs.
    fn codecs(&self) -> Vec<String> {
        self.with(|a| a.codecs().iter().map(|c| c.name()).collect())
    }

    /// Format version `(major, minor)` and the file's size in bytes.
    fn version(&self) -> (u16, u16) {
        self.with(|a| {
            let h = a.reader().header();
            (h.version_major, h.version_minor)
        })
    }

    /// Decodes the selection into new arrays owned by Rust: a list of
    /// `(layer, kind, OwnedArray)`, each `[batch, kv_heads, tokens,
    /// head_dim]` in `dtype` (default: the source dtype). `layers` and
    /// `tokens` are half-open `(start, stop)` ranges; `kind` is `"K"`,
    /// `"V"` or `None`. Pages are decoded on all threads, without the GIL.
    ///
    /// Raises `FormatError` naming the page for corrupted data.
    #[pyo3(signature = (layers=None, kind=None, tokens=None, dtype=None))]
    fn decode(
        &self,
        py: Python<'_>,
        layers: Option<(u32, u32)>,
        kind: Option<&str>,
        tokens: Option<(u32, u32)>,
        dtype: Option<&str>,
    ) -> PyResult<Vec<(u32, &'static str, OwnedArray)>> {
        let sel = Selection {
            layers: layers.map(|(a, b)| a..b),
            tokens: tokens.map(|(a, b)| a..b),
            kind: kind.map(parse_kind).transpose()?,
        };
        let dtype = dtype.map(DType::parse).transpose().py_err()?;
        let cache = py
            .detach(|| self.with(|a| a.decode(&sel, dtype, None)))
            .py_err()?;
        Ok(cache
            .tensors
            .into_iter()
            .map(|t| {
                let shape = t.info.shape().to_vec();
                (
                    t.info.layer,
                    t.info.kind.letter(),
                    OwnedArray::new(t.data, shape),
                )
            })
            .collect())
    }

    /// Decodes into caller-owned arrays without copying: `outputs` is a
    /// list of `(layer, kind, first_token, array[, dtype_hint])`, and
    /// `array` is a writable host tensor
    /// `[batch, kv_heads, tokens, head_dim]` (or 3-d without batch) of
    /// bf16/fp16/fp32 in any strides with a contiguous head_dim axis; it
    /// receives tokens `[first_token, first_token + tokens)`.
    ///
    /// Raises `ParameterError` for a shape that does not match the file,
    /// `ValueError` for unusable arrays, `FormatError` for corrupted data.
    fn decode_into(&self, py: Python<'_>, outputs: Vec<Bound<'_, PyAny>>) -> PyResult<()> {
        let imported = import_outputs(&outputs)?;
        let specs = output_specs(&imported)?;
        py.detach(|| self.with(|a| run_decode_into(a, specs)))
            .py_err()
    }
}

/// One prepared output of a `decode_into` call: `(layer, kind)`, first
/// token, element type, `[batch, kv_heads, tokens, head_dim]`, strides and
/// the borrowed memory.
pub type Spec<'a> = (
    (u32, Kind),
    u32,
    DType,
    [u32; 4],
    crate::view::Strides,
    crate::cache::ElemsMut<'a>,
);

/// An imported output: `(layer, kind)`, first token, the array and its
/// dtype hint.
pub type Output = ((u32, Kind), u32, Imported, Option<String>);

/// Imports the outputs of a `decode_into` call: a list of `(layer, kind,
/// first_token, array[, dtype_hint])`.
pub fn import_outputs(outputs: &[Bound<'_, PyAny>]) -> PyResult<Vec<Output>> {
    let mut imported = Vec::new();
    for (i, o) in outputs.iter().enumerate() {
        let (layer, kind, first, arr, hint): (u32, String, u32, Bound<'_, PyAny>, Option<String>) =
            match o.extract::<(u32, String, u32, Bound<'_, PyAny>)>() {
                Ok((l, k, f, a)) => (l, k, f, a, None),
                Err(_) => o.extract().map_err(|_| {
                    PyValueError::new_err(format!(
                        "output {i}: expected (layer, kind, first_token, array[, dtype])"
                    ))
                })?,
            };
        let key = (layer, parse_kind(&kind)?);
        imported.push((key, first, dlpack::import(&arr, None)?, hint));
    }
    check_disjoint(&imported.iter().map(|x| &x.2).collect::<Vec<_>>())?;
    Ok(imported)
}

/// Checks imported outputs and borrows their memory.
pub fn output_specs(imported: &[Output]) -> PyResult<Vec<Spec<'_>>> {
    imported
        .iter()
        .map(|(tensor, first, t, hint)| {
            let what = format!("output for layer {} {}", tensor.0, tensor.1.letter());
            let dtype = dtype_of(t, hint.as_deref(), &what)?;
            let (shape, strides) = kv_layout(t, &what)?;
            Ok((
                *tensor,
                *first,
                dtype,
                shape,
                strides,
                host_elems_mut(t, dtype, &what)?,
            ))
        })
        .collect()
}

/// Decodes `a` into the prepared outputs.
///
/// # Errors
/// As [`Inner::decode_into`].
pub fn run_decode_into(a: &Inner<'_>, specs: Vec<Spec<'_>>) -> crate::Result<()> {
    let infos = a.tensors();
    let mut outs = Vec::new();
    for ((layer, kind), first, dtype, shape, strides, elems) in specs {
        let Some(tensor) = infos
            .iter()
            .position(|i| (i.layer, i.kind) == (layer, kind))
        else {
            return Err(crate::Error::param(format!(
                "the file has no tensor for layer {layer} {}",
                kind.letter()
            )));
        };
        let src = &infos[tensor];
        let info = TensorInfo {
            dtype,
            batch: shape[0],
            heads: shape[1],
            tokens: shape[2],
            head_dim: shape[3],
            ..src.clone()
        };
        outs.push(Destination {
            tensor,
            first_token: first,
            view: TensorViewMut::new(info, elems, strides)?,
        });
    }
    a.decode_into(outs, None)
}
