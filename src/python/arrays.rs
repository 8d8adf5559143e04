//! Arrays between Python and the library: borrowed views of DLPack
//! tensors (no copy) and [`OwnedArray`], Rust-owned decode output that
//! numpy and torch wrap without a copy.

use std::sync::Arc;

use half::{bf16, f16};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::dlpack::{self, DLDataType, Imported};
use crate::cache::{DType, Elems, ElemsMut, Kind, TensorData, TensorInfo};
use crate::view::Strides;

/// Parses `"K"`/`"V"`/`"L"` (also `"key"`/`"value"`/`"latent"`).
pub fn parse_kind(s: &str) -> PyResult<Kind> {
    Kind::parse(s).map_err(|_| {
        PyValueError::new_err(format!(
            "kind {s:?}: expected \"K\", \"V\" or \"L\" (MLA latent)"
        ))
    })
}

/// The kvpack dtype of a DLPack tensor; `hint` names the element type of
/// 16-bit unsigned bit patterns (numpy has no bfloat16).
pub fn dtype_of(t: &Imported, hint: Option<&str>, what: &str) -> PyResult<DType> {
    let hinted = hint
        .map(DType::parse)
        .transpose()
        .map_err(super::errors::to_py)?;
    let d = match (t.dtype, hinted) {
        (dlpack::BF16, None | Some(DType::Bf16)) => DType::Bf16,
        (dlpack::F16, None | Some(DType::F16)) => DType::F16,
        (dlpack::F32, None | Some(DType::F32)) => DType::F32,
        (dlpack::U16, Some(h @ (DType::Bf16 | DType::F16))) => h,
        // torch.float8_e4m3fn / float8_e5m2 (DLPack codes 10 and 12), or
        // uint8 codes with an fp8 dtype hint; the scale comes separately.
        (
            DLDataType {
                code: 10,
                bits: 8,
                lanes: 1,
            },
            None,
        ) => DType::Fp8(crate::cache::Fp8::unscaled(crate::cache::Fp8Format::E4M3Fn)),
        (
            DLDataType {
                code: 12,
                bits: 8,
                lanes: 1,
            },
            None,
        ) => DType::Fp8(crate::cache::Fp8::unscaled(crate::cache::Fp8Format::E5M2)),
        (
            DLDataType {
                code: 10 | 12 | 1,
                bits: 8,
                lanes: 1,
            },
            Some(h @ DType::Fp8(_)),
        ) => h,
        (dt, h) => {
            return Err(PyValueError::new_err(format!(
                "{what}: element type {} cannot be read as {}; kvpack takes bfloat16, float16, \
                 float32 and float8 e4m3fn/e5m2 (uint16 bit patterns with dtype=\"bf16\" or \
                 \"fp16\", uint8 codes with dtype=\"fp8_e4m3\" or \"fp8_e5m2\")",
                dl_name(dt),
                h.map_or("any kvpack dtype", |d| d.name())
            )));
        }
    };
    Ok(d)
}

fn dl_name(d: DLDataType) -> String {
    let kind = match d.code {
        0 => "int",
        1 => "uint",
        2 => "float",
        4 => "bfloat",
        6 => "bool",
        _ => "code",
    };
    format!("{kind}{}", d.bits)
}

/// Logical `[batch, kv_heads, tokens, head_dim]` shape and element strides
/// of a 4-d tensor (or 3-d `[kv_heads, tokens, head_dim]`, batch 1), with
/// the `head_dim` axis contiguous.
pub fn kv_layout(t: &Imported, what: &str) -> PyResult<([u32; 4], Strides)> {
    let (shape, strides): ([usize; 4], [usize; 4]) = match t.shape.len() {
        4 => (
            [t.shape[0], t.shape[1], t.shape[2], t.shape[3]],
            [t.strides[0], t.strides[1], t.strides[2], t.strides[3]],
        ),
        3 => (
            [1, t.shape[0], t.shape[1], t.shape[2]],
            [0, t.strides[0], t.strides[1], t.strides[2]],
        ),
        n => {
            return Err(PyValueError::new_err(format!(
                "{what}: expected [batch, kv_heads, tokens, head_dim] (or 3-d without batch), \
                 got {n} dimensions {:?}",
                t.shape
            )));
        }
    };
    if shape[3] > 1 && strides[3] != 1 {
        return Err(PyValueError::new_err(format!(
            "{what}: the head_dim axis must be contiguous (stride 1, got {})",
            strides[3]
        )));
    }
    let dims = shape
        .iter()
        .map(|&n| u32::try_from(n))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| PyValueError::new_err(format!("{what}: dimension over 2^32 in {shape:?}")))?;
    Ok((
        [dims[0], dims[1], dims[2], dims[3]],
        Strides {
            batch: strides[0],
            head: strides[1],
            token: strides[2],
        },
    ))
}

/// A tensor info for layer `layer`, kind `kind` with shape `[b, h, t, d]`,
/// named as HF names `past_key_values` entries.
pub fn kv_info(layer: u32, kind: Kind, dtype: DType, shape: [u32; 4]) -> TensorInfo {
    TensorInfo {
        name: format!("past_key_values.{layer}.{}", kind.name()),
        layer,
        kind,
        dtype,
        batch: shape[0],
        heads: shape[1],
        tokens: shape[2],
        head_dim: shape[3],
    }
}

/// The host elements of `t` (from its first element to one past its last
/// addressed one) as `dtype`.
///
/// # Errors
/// `ValueError` when `t` is not in host memory.
pub fn host_elems<'a>(t: &'a Imported, dtype: DType, what: &str) -> PyResult<Elems<'a>> {
    host_check(t, what)?;
    let n = t.extent();
    // SAFETY: the producer guarantees that every element addressed by the
    // shape and strides is valid host memory of `t.dtype` (1, 2 or 4 bytes
    // wide, matching `dtype` as checked by `dtype_of`), alive while `t`
    // holds the capsule; DLPack data is aligned to its element type.
    Ok(unsafe {
        match dtype {
            DType::Bf16 => Elems::Bf16(std::slice::from_raw_parts(t.ptr as *const bf16, n)),
            DType::F16 => Elems::F16(std::slice::from_raw_parts(t.ptr as *const f16, n)),
            DType::F32 => Elems::F32(std::slice::from_raw_parts(t.ptr as *const f32, n)),
            DType::Fp8(f) => Elems::Fp8(f, std::slice::from_raw_parts(t.ptr as *const u8, n)),
        }
    })
}

/// Like [`host_elems`], writable.
///
/// # Errors
/// `ValueError` when `t` is not in host memory or is read-only.
pub fn host_elems_mut<'a>(t: &'a Imported, dtype: DType, what: &str) -> PyResult<ElemsMut<'a>> {
    host_check(t, what)?;
    t.check_writable(what)?;
    let n = t.extent();
    // SAFETY: as in `host_elems`; the memory is writable and the Python
    // caller handed it to this call as an output, so nothing else in Rust
    // references it. Overlap between elements is rejected by
    // `TensorViewMut::new`, between different outputs by the callers.
    Ok(unsafe {
        match dtype {
            DType::Bf16 => ElemsMut::Bf16(std::slice::from_raw_parts_mut(t.ptr as *mut bf16, n)),
            DType::F16 => ElemsMut::F16(std::slice::from_raw_parts_mut(t.ptr as *mut f16, n)),
            DType::F32 => ElemsMut::F32(std::slice::from_raw_parts_mut(t.ptr as *mut f32, n)),
            DType::Fp8(f) => ElemsMut::Fp8(f, std::slice::from_raw_parts_mut(t.ptr as *mut u8, n)),
        }
    })
}

fn host_check(t: &Imported, what: &str) -> PyResult<()> {
    if !t.on_host() {
        return Err(PyValueError::new_err(format!(
            "{what} is in GPU memory (DLPack device {}); use kvpack.cuda for GPU tensors",
            t.device.device_type
        )));
    }
    if !t.ptr.is_multiple_of(t.elem_bytes().max(1)) {
        return Err(PyValueError::new_err(format!(
            "{what}: data pointer is not aligned to its element size"
        )));
    }
    Ok(())
}

/// Rejects outputs whose memory ranges intersect (two destinations of one
/// decode must be disjoint).
pub fn check_disjoint(outs: &[&Imported]) -> PyResult<()> {
    let mut spans: Vec<(usize, usize, usize)> = outs
        .iter()
        .enumerate()
        .map(|(i, t)| (t.ptr, t.ptr + t.extent() * t.elem_bytes(), i))
        .filter(|&(a, b, _)| b > a)
        .collect();
    spans.sort_unstable();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(PyValueError::new_err(format!(
                "outputs {} and {} share memory",
                w[0].2, w[1].2
            )));
        }
    }
    Ok(())
}

/// Decoded elements owned by Rust, shared with numpy/torch through
/// DLPack without a copy: `numpy.from_dlpack(a)`, `torch.from_dlpack(a)`.
/// Row-major, on the CPU.
#[pyclass(frozen, module = "kvpack._native")]
pub struct OwnedArray {
    data: Arc<TensorData>,
    shape: Vec<usize>,
    /// Export 16-bit floats as uint16 bit patterns.
    bits: bool,
}

impl OwnedArray {
    /// Wraps `data` with `shape` (the product of `shape` is `data.len()`).
    pub fn new(data: TensorData, shape: Vec<usize>) -> OwnedArray {
        OwnedArray {
            data: Arc::new(data),
            shape,
            bits: false,
        }
    }

    fn ptr(&self) -> *mut std::ffi::c_void {
        self.data.as_elems().bytes().as_ptr() as *mut _
    }
}

#[pymethods]
impl OwnedArray {
    /// DLPack export (the array API standard's `__dlpack__`): a capsule
    /// viewing this array's memory; the array stays alive as long as any
    /// consumer holds it. Host memory only, so `stream` must be `None`.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        slf: &Bound<'_, Self>,
        stream: Option<Py<PyAny>>,
        max_version: Option<Py<PyAny>>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let _ = (stream, max_version);
        if dl_device.is_some_and(|(t, _)| t != dlpack::DEVICE_CPU) {
            return Err(PyValueError::new_err("kvpack arrays live in host memory"));
        }
        if copy == Some(true) {
            return Err(PyValueError::new_err(
                "copy=True: kvpack exports without copying; copy on the consumer side",
            ));
        }
        let me = slf.get();
        let dtype = match (me.data.dtype(), me.bits) {
            (DType::Bf16 | DType::F16, true) => dlpack::U16,
            (DType::Bf16, false) => dlpack::BF16,
            (DType::F16, false) => dlpack::F16,
            (DType::F32, _) => dlpack::F32,
            // fp8 codes as uint8; the scale is the tensor's (`dtype` name
            // and scale in the tensor table).
            (DType::Fp8(_), _) => dlpack::U8,
        };
        // SAFETY: the elements live in `me.data` (an Arc never mutated after
        // construction) and `owner` keeps `me` alive for the capsule's life.
        unsafe {
            dlpack::export(
                slf.py(),
                slf.clone().into_any().unbind(),
                me.ptr(),
                dtype,
                &me.shape,
            )
        }
    }

    /// `(kDLCPU, 0)`.
    fn __dlpack_device__(&self) -> (i32, i32) {
        (dlpack::DEVICE_CPU, 0)
    }

    /// The same memory with bf16/fp16 elements exported as uint16 bit
    /// patterns (for numpy, which has no bfloat16).
    fn as_bits(&self) -> OwnedArray {
        OwnedArray {
            data: self.data.clone(),
            shape: self.shape.clone(),
            bits: true,
        }
    }

    /// Shape (row-major).
    #[getter]
    fn shape(&self) -> Vec<usize> {
        self.shape.clone()
    }

    /// Element type: `"bf16"`, `"fp16"` or `"fp32"`.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.data.dtype().name()
    }
}

/// Bytes owned by Rust (an encoded kvpack file), shared with numpy/torch
/// as a 1-d uint8 array through DLPack without a copy:
/// `numpy.from_dlpack(b)`.
#[pyclass(frozen, module = "kvpack._native")]
pub struct OwnedBytes {
    data: Vec<u8>,
}

impl OwnedBytes {
    /// Wraps `data`.
    pub fn new(data: Vec<u8>) -> OwnedBytes {
        OwnedBytes { data }
    }
}

#[pymethods]
impl OwnedBytes {
    /// DLPack export of the bytes (uint8, 1-d, host memory).
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        slf: &Bound<'_, Self>,
        stream: Option<Py<PyAny>>,
        max_version: Option<Py<PyAny>>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let _ = (stream, max_version);
        if dl_device.is_some_and(|(t, _)| t != dlpack::DEVICE_CPU) || copy == Some(true) {
            return Err(PyValueError::new_err(
                "kvpack bytes live in host memory and are exported without copying",
            ));
        }
        let me = slf.get();
        // SAFETY: the bytes live in `me.data`, never mutated after
        // construction; `owner` keeps `me` alive for the capsule's life.
        unsafe {
            dlpack::export(
                slf.py(),
                slf.clone().into_any().unbind(),
                me.data.as_ptr() as *mut std::ffi::c_void,
                dlpack::U8,
                &[me.data.len()],
            )
        }
    }

    /// `(kDLCPU, 0)`.
    fn __dlpack_device__(&self) -> (i32, i32) {
        (dlpack::DEVICE_CPU, 0)
    }

    fn __len__(&self) -> usize {
        self.data.len()
    }
}
