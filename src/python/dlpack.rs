//! DLPack, the C ABI through which numpy, torch, CuPy and JAX share tensors
//! without copying (<https://dmlc.github.io/dlpack/latest/>): importing any
//! object with `__dlpack__` as a borrowed [`Imported`] tensor, and exporting
//! Rust-owned elements as a capsule that `numpy.from_dlpack` /
//! `torch.from_dlpack` wrap without a copy.
//!
//! Only the DLPack structs and the capsule protocol live here; what the
//! tensors mean is decided by the callers.

use std::ffi::{CStr, c_void};
use std::os::raw::c_char;

use pyo3::exceptions::{PyBufferError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

/// `DLDevice`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DLDevice {
    /// `kDLCPU` = 1, `kDLCUDA` = 2, `kDLCUDAHost` = 3, ...
    pub device_type: i32,
    /// Device ordinal.
    pub device_id: i32,
}

/// `DLDataType`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DLDataType {
    /// Type code (`kDLInt` 0, `kDLUInt` 1, `kDLFloat` 2, `kDLBfloat` 4,
    /// `kDLFloat8_e4m3fn` 10, `kDLFloat8_e5m2` 12).
    pub code: u8,
    /// Bits per lane.
    pub bits: u8,
    /// Lanes (1 for scalars).
    pub lanes: u16,
}

/// `DLTensor`.
#[repr(C)]
#[derive(Debug)]
pub struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

/// `DLManagedTensor` (the legacy, unversioned capsule `"dltensor"`).
#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// `DLPackVersion`.
#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

/// `DLManagedTensorVersioned` (capsule `"dltensor_versioned"`, DLPack 1.x).
#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

const FLAG_READ_ONLY: u64 = 1;
const LEGACY: &CStr = c"dltensor";
const VERSIONED: &CStr = c"dltensor_versioned";

/// `kDLCPU`.
pub const DEVICE_CPU: i32 = 1;
/// `kDLCUDAHost` (pinned host memory, readable by the CPU).
pub const DEVICE_CUDA_HOST: i32 = 3;
/// `kDLCUDA`: CUDA device memory.
pub const DEVICE_CUDA: i32 = 2;

/// Element types kvpack exchanges.
pub const BF16: DLDataType = DLDataType {
    code: 4,
    bits: 16,
    lanes: 1,
};
/// IEEE binary16.
pub const F16: DLDataType = DLDataType {
    code: 2,
    bits: 16,
    lanes: 1,
};
/// IEEE binary32.
pub const F32: DLDataType = DLDataType {
    code: 2,
    bits: 32,
    lanes: 1,
};
/// Bytes (also fp8 codes, whose scale is the tensor's, kept apart).
pub const U8: DLDataType = DLDataType {
    code: 1,
    bits: 8,
    lanes: 1,
};
/// 16-bit unsigned (bf16 bit patterns for numpy, which has no bf16).
pub const U16: DLDataType = DLDataType {
    code: 1,
    bits: 16,
    lanes: 1,
};

/// A tensor borrowed from a Python object through `__dlpack__`. The
/// producer's capsule is held until this is dropped, which keeps the memory
/// alive; the producer's capsule destructor releases it.
#[derive(Debug)]
pub struct Imported {
    _capsule: Py<PyAny>,
    /// Address of element 0 (data + byte_offset).
    pub ptr: usize,
    /// Device type and ordinal.
    pub device: DLDevice,
    /// Element type.
    pub dtype: DLDataType,
    /// Shape.
    pub shape: Vec<usize>,
    /// Strides in elements (row-major when the producer gave none).
    pub strides: Vec<usize>,
    /// True when the producer marked the memory read-only.
    pub read_only: bool,
}

// SAFETY: `Imported` holds a strong reference to the capsule (a Python
// object, released through pyo3's reference pool when dropped without the
// GIL) and plain numbers; the memory it points to is shared with the
// producer, and the callers that write through `ptr` do so only while they
// own the call (the Python caller handed the tensor over for that call).
unsafe impl Send for Imported {}
// SAFETY: as above; `Imported` itself has no interior mutability.
unsafe impl Sync for Imported {}

impl Imported {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes per element.
    pub fn elem_bytes(&self) -> usize {
        (self.dtype.bits as usize).div_ceil(8)
    }

    /// Elements from `ptr` to one past the last element addressed (0 for
    /// an empty tensor), or an error when the strides are negative or
    /// overflow. kvpack only accepts non-negative strides.
    pub fn extent(&self) -> usize {
        if self.shape.contains(&0) {
            return 0;
        }
        1 + self
            .shape
            .iter()
            .zip(&self.strides)
            .map(|(&n, &s)| (n - 1) * s)
            .sum::<usize>()
    }

    /// True when the CPU can read and write the memory directly.
    pub fn on_host(&self) -> bool {
        matches!(self.device.device_type, DEVICE_CPU | DEVICE_CUDA_HOST)
    }

    /// True when the elements are densely packed in row-major order.
    pub fn is_contiguous(&self) -> bool {
        let mut want = 1usize;
        for (&n, &s) in self.shape.iter().zip(&self.strides).rev() {
            if n != 1 && s != want {
                return false;
            }
            want *= n;
        }
        true
    }

    /// The memory as bytes.
    ///
    /// # Errors
    /// `ValueError` when the tensor is not on the host or not contiguous.
    pub fn host_bytes(&self, what: &str) -> PyResult<&[u8]> {
        self.check_host_contiguous(what)?;
        // SAFETY: the producer guarantees `len * elem_bytes` bytes at `ptr`
        // for a contiguous host tensor, alive while the capsule is held
        // (`self` holds it).
        Ok(unsafe {
            std::slice::from_raw_parts(self.ptr as *const u8, self.len() * self.elem_bytes())
        })
    }

    /// The memory as writable bytes.
    ///
    /// # Errors
    /// `ValueError` when the tensor is not on the host, not contiguous or
    /// read-only.
    #[allow(clippy::mut_from_ref)]
    pub fn host_bytes_mut(&self, what: &str) -> PyResult<&mut [u8]> {
        self.check_host_contiguous(what)?;
        self.check_writable(what)?;
        // SAFETY: as in `host_bytes`; the memory is writable (not flagged
        // read-only) and the Python caller handed it to this call for
        // writing, so no other Rust reference to it exists.
        Ok(unsafe {
            std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.len() * self.elem_bytes())
        })
    }

    /// The device address and byte length of a contiguous tensor on CUDA
    /// device `ordinal`.
    ///
    /// # Errors
    /// `ValueError` when the tensor is not CUDA memory of that device or
    /// not contiguous.
    pub fn cuda_bytes(&self, what: &str, ordinal: usize) -> PyResult<(u64, usize)> {
        if self.device.device_type != DEVICE_CUDA
            || usize::try_from(self.device.device_id).ok() != Some(ordinal)
        {
            return Err(PyValueError::new_err(format!(
                "{what} is not on CUDA device {ordinal} (DLPack device type {}, id {})",
                self.device.device_type, self.device.device_id
            )));
        }
        if !self.is_contiguous() {
            return Err(PyValueError::new_err(format!("{what} is not contiguous")));
        }
        Ok((self.ptr as u64, self.len() * self.elem_bytes()))
    }

    /// `ValueError` when read-only.
    pub fn check_writable(&self, what: &str) -> PyResult<()> {
        if self.read_only {
            return Err(PyValueError::new_err(format!(
                "{what} is read-only; pass a writable array"
            )));
        }
        Ok(())
    }

    fn check_host_contiguous(&self, what: &str) -> PyResult<()> {
        if !self.on_host() {
            return Err(PyValueError::new_err(format!(
                "{what} is on device type {} (not host memory)",
                self.device.device_type
            )));
        }
        if !self.is_contiguous() {
            return Err(PyValueError::new_err(format!("{what} is not contiguous")));
        }
        Ok(())
    }
}

/// Calls `obj.__dlpack__(...)` and borrows the tensor it describes.
/// `stream` is passed to the producer (for CUDA tensors: the consumer's
/// stream, so the producer orders its pending work before ours).
///
/// # Errors
/// `TypeError` when `obj` has no `__dlpack__`; `BufferError` for a capsule
/// kvpack cannot read (negative strides, more than 8 dimensions).
pub fn import(obj: &Bound<'_, PyAny>, stream: Option<isize>) -> PyResult<Imported> {
    let py = obj.py();
    // SAFETY: PyCapsule_IsValid accepts any object and checks type and
    // name; the GIL is held.
    let is_capsule = unsafe {
        ffi::PyCapsule_IsValid(obj.as_ptr(), LEGACY.as_ptr()) == 1
            || ffi::PyCapsule_IsValid(obj.as_ptr(), VERSIONED.as_ptr()) == 1
    };
    if is_capsule {
        // An unused capsule made by the caller (e.g.
        // `torch.utils.dlpack.to_dlpack`): read it in place.
        return from_capsule(obj.clone());
    }
    let method = pyo3::intern!(py, "__dlpack__");
    let kwargs = PyDict::new(py);
    if let Some(s) = stream {
        // The consumer's CUDA stream: the producer orders its pending work
        // on the tensor before work on this stream.
        kwargs.set_item(pyo3::intern!(py, "stream"), s)?;
    }
    kwargs.set_item(pyo3::intern!(py, "max_version"), PyTuple::new(py, [1, 0])?)?;
    let capsule = match obj.call_method(method, (), Some(&kwargs)) {
        Ok(c) => c,
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyAttributeError>(py) => {
            return Err(PyTypeError::new_err(format!(
                "expected an array or tensor supporting DLPack (numpy >= 1.22, torch, cupy), got {}",
                obj.get_type().name()?
            )));
        }
        Err(e) if e.is_instance_of::<PyTypeError>(py) => {
            // A producer that predates DLPack 1.0 keyword arguments.
            kwargs.del_item(pyo3::intern!(py, "max_version"))?;
            obj.call_method(method, (), Some(&kwargs))?
        }
        Err(e) => return Err(e),
    };
    from_capsule(capsule)
}

/// Borrows the tensor of an unused DLPack capsule.
fn from_capsule(capsule: Bound<'_, PyAny>) -> PyResult<Imported> {
    let cap = capsule.as_ptr();
    // SAFETY: PyCapsule_IsValid/GetPointer accept any object pointer and
    // check the type and name; the GIL is held.
    unsafe {
        if ffi::PyCapsule_IsValid(cap, VERSIONED.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(cap, VERSIONED.as_ptr())
                as *const DLManagedTensorVersioned;
            let read_only = (*m).flags & FLAG_READ_ONLY != 0;
            from_dl(&(*m).dl_tensor, capsule.unbind(), read_only)
        } else if ffi::PyCapsule_IsValid(cap, LEGACY.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(cap, LEGACY.as_ptr()) as *const DLManagedTensor;
            from_dl(&(*m).dl_tensor, capsule.unbind(), false)
        } else {
            Err(PyBufferError::new_err(
                "__dlpack__ returned something that is not an unused DLPack capsule",
            ))
        }
    }
}

/// Reads a `DLTensor`.
///
/// # Safety
/// `t` points to a valid DLTensor owned by `capsule`.
unsafe fn from_dl(t: &DLTensor, capsule: Py<PyAny>, read_only: bool) -> PyResult<Imported> {
    let ndim = usize::try_from(t.ndim)
        .ok()
        .filter(|&n| n <= 8)
        .ok_or_else(|| {
            PyBufferError::new_err(format!("DLPack tensor with {} dimensions", t.ndim))
        })?;
    // SAFETY: DLPack guarantees `ndim` shape entries (and strides when not
    // null).
    let shape_i: &[i64] = if ndim == 0 {
        &[]
    } else {
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }
    };
    let shape = shape_i
        .iter()
        .map(|&n| usize::try_from(n))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| PyBufferError::new_err("negative DLPack shape"))?;
    let strides = if t.strides.is_null() || ndim == 0 {
        let mut s = vec![1usize; ndim];
        for i in (0..ndim.saturating_sub(1)).rev() {
            s[i] = s[i + 1] * shape[i + 1];
        }
        s
    } else {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts(t.strides, ndim) }
            .iter()
            .map(|&s| usize::try_from(s))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| PyBufferError::new_err("negative DLPack strides are not supported"))?
    };
    if t.dtype.lanes != 1 {
        return Err(PyBufferError::new_err(
            "vector (multi-lane) DLPack dtypes are not supported",
        ));
    }
    Ok(Imported {
        _capsule: capsule,
        ptr: t.data as usize + t.byte_offset as usize,
        device: t.device,
        dtype: t.dtype,
        shape,
        strides,
        read_only,
    })
}

/// What an exported capsule keeps alive: the Python object that owns the
/// elements, and the shape/stride arrays the DLTensor points to.
struct ExportCtx {
    _owner: Py<PyAny>,
    shape: Vec<i64>,
    strides: Vec<i64>,
}

unsafe extern "C" fn delete_managed(m: *mut DLManagedTensor) {
    if m.is_null() {
        return;
    }
    // SAFETY: `m` and its context were created by `export` with Box; the
    // deleter is called exactly once by the consumer (or by the capsule
    // destructor when nobody consumed it).
    let m = unsafe { Box::from_raw(m) };
    let ctx = unsafe { Box::from_raw(m.manager_ctx as *mut ExportCtx) };
    let owner = ctx._owner.into_ptr();
    // Consumers may call this from any thread, with or without the GIL,
    // and (torch) while the interpreter is shutting down. Never panic here
    // (this is an `extern "C"` callback): take the GIL through the C API
    // while the interpreter runs; once it is finalizing, leave the
    // reference (the process is exiting and frees everything).
    // SAFETY: `owner` is a strong reference owned by `ctx`;
    // Py_IsInitialized may be called at any time; the GIL is taken before
    // the reference count changes.
    unsafe {
        if ffi::Py_IsInitialized() != 0 {
            let g = ffi::PyGILState_Ensure();
            ffi::Py_DecRef(owner);
            ffi::PyGILState_Release(g);
        }
    }
}

unsafe extern "C" fn capsule_destructor(cap: *mut ffi::PyObject) {
    // SAFETY: called by Python with the GIL held on our own capsule; only an
    // unconsumed capsule (still named "dltensor") owns its tensor.
    unsafe {
        if ffi::PyCapsule_IsValid(cap, LEGACY.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(cap, LEGACY.as_ptr()) as *mut DLManagedTensor;
            if let Some(d) = (*m).deleter {
                d(m);
            }
        }
    }
}

/// Exports `ptr` (host memory owned by `owner`) as a legacy `"dltensor"`
/// capsule of `dtype` with a row-major `shape`.
///
/// # Safety
/// `ptr` must address `shape.product()` elements of `dtype` that stay valid
/// and unmoved for as long as `owner` is alive.
pub unsafe fn export(
    py: Python<'_>,
    owner: Py<PyAny>,
    ptr: *mut c_void,
    dtype: DLDataType,
    shape: &[usize],
) -> PyResult<Py<PyAny>> {
    let shape: Vec<i64> = shape.iter().map(|&n| n as i64).collect();
    let mut strides = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    let mut ctx = Box::new(ExportCtx {
        _owner: owner,
        shape,
        strides,
    });
    let managed = Box::new(DLManagedTensor {
        dl_tensor: DLTensor {
            data: ptr,
            device: DLDevice {
                device_type: DEVICE_CPU,
                device_id: 0,
            },
            ndim: ctx.shape.len() as i32,
            dtype,
            shape: ctx.shape.as_mut_ptr(),
            strides: ctx.strides.as_mut_ptr(),
            byte_offset: 0,
        },
        manager_ctx: std::ptr::null_mut(),
        deleter: Some(delete_managed),
    });
    let managed = Box::into_raw(managed);
    // SAFETY: `managed` is a fresh, exclusively owned allocation.
    unsafe { (*managed).manager_ctx = Box::into_raw(ctx) as *mut c_void };
    // SAFETY: the GIL is held; on failure the tensor is freed here.
    let cap = unsafe {
        ffi::PyCapsule_New(
            managed as *mut c_void,
            LEGACY.as_ptr() as *const c_char,
            Some(capsule_destructor),
        )
    };
    if cap.is_null() {
        // SAFETY: nobody else saw `managed`.
        unsafe { delete_managed(managed) };
        return Err(PyErr::fetch(py));
    }
    // SAFETY: `cap` is a new strong reference.
    Ok(unsafe { Bound::from_owned_ptr(py, cap) }.unbind())
}
