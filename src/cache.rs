//! The in-memory KV cache model: tensors, their shapes and element types.
//!
//! A KV cache is a list of tensors, two per layer (K and V), each shaped
//! `[batch, kv_heads, tokens, head_dim]` in row-major order (the HF
//! `past_key_values` layout). Token counts may differ per layer (for example
//! sliding-window layers hold fewer tokens than global ones).
//!
//! Codecs see one tensor as `batch * kv_heads` independent *planes*, each a
//! `[tokens, head_dim]` matrix whose rows are the per-token head vectors.

use std::collections::BTreeMap;

use half::{bf16, f16};

use crate::error::{Error, Result};

/// Element type of a source tensor (the precision a `raw` page keeps).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// bfloat16: 1 sign, 8 exponent, 7 mantissa bits. File code 1.
    Bf16,
    /// IEEE 754 binary16. File code 2.
    F16,
    /// IEEE 754 binary32. File code 3.
    F32,
}

impl DType {
    /// Bytes per element (2, 2 or 4).
    pub fn size(self) -> usize {
        match self {
            DType::Bf16 | DType::F16 => 2,
            DType::F32 => 4,
        }
    }

    /// The code stored in the file (format/SPEC.md, "Element types").
    pub fn code(self) -> u8 {
        match self {
            DType::Bf16 => 1,
            DType::F16 => 2,
            DType::F32 => 3,
        }
    }

    /// Inverse of [`DType::code`]; `None` for an unknown code.
    pub fn from_code(code: u8) -> Option<DType> {
        match code {
            1 => Some(DType::Bf16),
            2 => Some(DType::F16),
            3 => Some(DType::F32),
            _ => None,
        }
    }

    /// Lower-case name as used on the command line: `bf16`, `fp16`, `fp32`.
    pub fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::F16 => "fp16",
            DType::F32 => "fp32",
        }
    }

    /// Parses `bf16`, `fp16`/`f16`, `fp32`/`f32`.
    ///
    /// # Errors
    /// [`Error::Parameter`] for any other string.
    pub fn parse(s: &str) -> Result<DType> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" => Ok(DType::Bf16),
            "fp16" | "f16" | "float16" => Ok(DType::F16),
            "fp32" | "f32" | "float32" => Ok(DType::F32),
            _ => Err(Error::param(format!(
                "unknown dtype {s:?}: expected bf16, fp16 or fp32"
            ))),
        }
    }
}

/// Whether a tensor holds keys or values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// Keys (file code 0).
    Key,
    /// Values (file code 1).
    Value,
}

impl Kind {
    /// File code: 0 for K, 1 for V.
    pub fn code(self) -> u8 {
        match self {
            Kind::Key => 0,
            Kind::Value => 1,
        }
    }

    /// Inverse of [`Kind::code`].
    pub fn from_code(code: u8) -> Option<Kind> {
        match code {
            0 => Some(Kind::Key),
            1 => Some(Kind::Value),
            _ => None,
        }
    }

    /// `"K"` or `"V"`.
    pub fn letter(self) -> &'static str {
        match self {
            Kind::Key => "K",
            Kind::Value => "V",
        }
    }
}

/// Shape, element type and name of one K or V tensor.
///
/// Shape is `[batch, heads, tokens, head_dim]` with `heads` the number of
/// KV heads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Tensor name restored on decompress (e.g. `past_key_values.3.key`).
    pub name: String,
    /// Layer index.
    pub layer: u32,
    /// K or V.
    pub kind: Kind,
    /// Source element type.
    pub dtype: DType,
    /// Batch size (1 for a prompt cache).
    pub batch: u32,
    /// Number of KV heads.
    pub heads: u32,
    /// Number of cached tokens.
    pub tokens: u32,
    /// Elements per head vector.
    pub head_dim: u32,
}

impl TensorInfo {
    /// Number of `[tokens, head_dim]` planes: `batch * heads`.
    pub fn planes(&self) -> usize {
        self.batch as usize * self.heads as usize
    }

    /// Total element count `batch * heads * tokens * head_dim`.
    pub fn elements(&self) -> u64 {
        self.planes() as u64 * self.tokens as u64 * self.head_dim as u64
    }

    /// Short description such as `layer 3 K`.
    pub fn describe(&self) -> String {
        format!("layer {} {}", self.layer, self.kind.letter())
    }

    /// Shape as `[batch, heads, tokens, head_dim]`.
    pub fn shape(&self) -> [usize; 4] {
        [
            self.batch as usize,
            self.heads as usize,
            self.tokens as usize,
            self.head_dim as usize,
        ]
    }
}

/// Owned tensor elements in row-major `[batch, heads, tokens, head_dim]`.
#[derive(Debug, Clone, PartialEq)]
pub enum TensorData {
    /// bfloat16 elements.
    Bf16(Vec<bf16>),
    /// binary16 elements.
    F16(Vec<f16>),
    /// binary32 elements.
    F32(Vec<f32>),
}

impl TensorData {
    /// Zero-filled storage of `len` elements of `dtype`.
    ///
    /// Allocated zeroed by the allocator (calloc: fresh pages from the OS
    /// are already zero), not filled element by element, so a multi-GB
    /// output costs nothing until decoding threads touch it in parallel.
    pub fn zeros(dtype: DType, len: usize) -> TensorData {
        let d = match dtype {
            DType::Bf16 => TensorData::Bf16(bytemuck::cast_vec(vec![0u16; len])),
            DType::F16 => TensorData::F16(bytemuck::cast_vec(vec![0u16; len])),
            DType::F32 => TensorData::F32(vec![0.0; len]),
        };
        let (ptr, bytes) = match &d {
            TensorData::Bf16(v) => (v.as_ptr() as usize, v.len() * 2),
            TensorData::F16(v) => (v.as_ptr() as usize, v.len() * 2),
            TensorData::F32(v) => (v.as_ptr() as usize, v.len() * 4),
        };
        advise_huge_pages(ptr, bytes);
        d
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        match self {
            TensorData::Bf16(_) => DType::Bf16,
            TensorData::F16(_) => DType::F16,
            TensorData::F32(_) => DType::F32,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            TensorData::Bf16(v) => v.len(),
            TensorData::F16(v) => v.len(),
            TensorData::F32(v) => v.len(),
        }
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Borrowed view of all elements.
    pub fn as_elems(&self) -> Elems<'_> {
        match self {
            TensorData::Bf16(v) => Elems::Bf16(v),
            TensorData::F16(v) => Elems::F16(v),
            TensorData::F32(v) => Elems::F32(v),
        }
    }

    /// Mutable view of all elements.
    pub fn as_elems_mut(&mut self) -> ElemsMut<'_> {
        match self {
            TensorData::Bf16(v) => ElemsMut::Bf16(v),
            TensorData::F16(v) => ElemsMut::F16(v),
            TensorData::F32(v) => ElemsMut::F32(v),
        }
    }

    /// Little-endian bytes of the elements (a copy).
    pub fn to_le_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.len() * self.dtype().size());
        match self {
            TensorData::Bf16(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
            TensorData::F16(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
            TensorData::F32(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        }
        out
    }

    /// Parses little-endian bytes as `dtype` elements.
    ///
    /// # Errors
    /// [`Error::Parameter`] when `bytes.len()` is not a multiple of the
    /// element size.
    pub fn from_le_bytes(dtype: DType, bytes: &[u8]) -> Result<TensorData> {
        if !bytes.len().is_multiple_of(dtype.size()) {
            return Err(Error::param(format!(
                "{} bytes is not a whole number of {} elements",
                bytes.len(),
                dtype.name()
            )));
        }
        Ok(match dtype {
            DType::Bf16 => TensorData::Bf16(
                bytes
                    .chunks_exact(2)
                    .map(|c| bf16::from_le_bytes([c[0], c[1]]))
                    .collect(),
            ),
            DType::F16 => TensorData::F16(
                bytes
                    .chunks_exact(2)
                    .map(|c| f16::from_le_bytes([c[0], c[1]]))
                    .collect(),
            ),
            DType::F32 => TensorData::F32(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
        })
    }

    /// All elements widened to f32 (a copy).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len()];
        self.as_elems().load(0, &mut out);
        out
    }
}

/// Asks the kernel to back a large, not yet touched allocation with
/// transparent huge pages (Linux, `MADV_HUGEPAGE`): decoding into a
/// multi-GB output then takes one page fault per 2 MiB instead of per
/// 4 KiB. Advisory only; does nothing for small buffers or elsewhere.
fn advise_huge_pages(ptr: usize, bytes: usize) {
    const HUGE: usize = 2 << 20;
    if bytes < 8 * HUGE {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        let start = ptr.next_multiple_of(HUGE);
        let end = (ptr + bytes) & !(HUGE - 1);
        if end > start {
            // SAFETY: the range lies inside one live allocation owned by the
            // caller; MADV_HUGEPAGE only changes how untouched pages are
            // backed, never their contents or validity. Failure is harmless.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = ptr;
}

/// Borrowed elements of one element type.
#[derive(Debug, Clone, Copy)]
pub enum Elems<'a> {
    /// bfloat16 elements.
    Bf16(&'a [bf16]),
    /// binary16 elements.
    F16(&'a [f16]),
    /// binary32 elements.
    F32(&'a [f32]),
}

impl<'a> Elems<'a> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Elems::Bf16(v) => v.len(),
            Elems::F16(v) => v.len(),
            Elems::F32(v) => v.len(),
        }
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        match self {
            Elems::Bf16(_) => DType::Bf16,
            Elems::F16(_) => DType::F16,
            Elems::F32(_) => DType::F32,
        }
    }

    /// Sub-range `[start, start + len)`.
    ///
    /// # Panics
    /// If the range is out of bounds (callers derive ranges from validated
    /// shapes).
    pub fn slice(&self, start: usize, len: usize) -> Elems<'a> {
        match *self {
            Elems::Bf16(v) => Elems::Bf16(&v[start..start + len]),
            Elems::F16(v) => Elems::F16(&v[start..start + len]),
            Elems::F32(v) => Elems::F32(&v[start..start + len]),
        }
    }

    /// Widens elements `[start, start + out.len())` to f32 into `out`.
    ///
    /// # Panics
    /// If the range is out of bounds.
    pub fn load(&self, start: usize, out: &mut [f32]) {
        let n = out.len();
        match self {
            Elems::Bf16(v) => crate::kernels::convert::bf16_to_f32(&v[start..start + n], out),
            Elems::F16(v) => crate::kernels::convert::f16_to_f32(&v[start..start + n], out),
            Elems::F32(v) => out.copy_from_slice(&v[start..start + n]),
        }
    }
}

/// Mutable elements of one element type.
#[derive(Debug)]
pub enum ElemsMut<'a> {
    /// bfloat16 elements.
    Bf16(&'a mut [bf16]),
    /// binary16 elements.
    F16(&'a mut [f16]),
    /// binary32 elements.
    F32(&'a mut [f32]),
}

impl<'a> ElemsMut<'a> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            ElemsMut::Bf16(v) => v.len(),
            ElemsMut::F16(v) => v.len(),
            ElemsMut::F32(v) => v.len(),
        }
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        match self {
            ElemsMut::Bf16(_) => DType::Bf16,
            ElemsMut::F16(_) => DType::F16,
            ElemsMut::F32(_) => DType::F32,
        }
    }

    /// Narrows `src` (f32) into elements `[start, start + src.len())`,
    /// rounding to nearest-even for bf16/fp16.
    ///
    /// # Panics
    /// If the range is out of bounds.
    pub fn store(&mut self, start: usize, src: &[f32]) {
        let n = src.len();
        match self {
            ElemsMut::Bf16(v) => {
                crate::kernels::convert::f32_to_bf16(src, &mut v[start..start + n])
            }
            ElemsMut::F16(v) => crate::kernels::convert::f32_to_f16(src, &mut v[start..start + n]),
            ElemsMut::F32(v) => v[start..start + n].copy_from_slice(src),
        }
    }

    /// Splits into `[0, mid)` and `[mid, len)`.
    ///
    /// # Panics
    /// If `mid > len`.
    pub fn split_at(self, mid: usize) -> (ElemsMut<'a>, ElemsMut<'a>) {
        match self {
            ElemsMut::Bf16(v) => {
                let (a, b) = v.split_at_mut(mid);
                (ElemsMut::Bf16(a), ElemsMut::Bf16(b))
            }
            ElemsMut::F16(v) => {
                let (a, b) = v.split_at_mut(mid);
                (ElemsMut::F16(a), ElemsMut::F16(b))
            }
            ElemsMut::F32(v) => {
                let (a, b) = v.split_at_mut(mid);
                (ElemsMut::F32(a), ElemsMut::F32(b))
            }
        }
    }
}

/// One K or V tensor with its data.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    /// Shape, name and element type.
    pub info: TensorInfo,
    /// Row-major `[batch, heads, tokens, head_dim]` elements.
    pub data: TensorData,
}

impl Tensor {
    /// Builds a tensor, checking that `data` matches `info`.
    ///
    /// # Errors
    /// [`Error::Parameter`] when the element count or dtype disagree.
    pub fn new(info: TensorInfo, data: TensorData) -> Result<Tensor> {
        if data.dtype() != info.dtype || data.len() as u64 != info.elements() {
            return Err(Error::param(format!(
                "tensor {}: data holds {} {} elements, shape {:?} {} needs {}",
                info.name,
                data.len(),
                data.dtype().name(),
                info.shape(),
                info.dtype.name(),
                info.elements()
            )));
        }
        Ok(Tensor { info, data })
    }

    /// The `[tokens, head_dim]` slice of plane `p` restricted to tokens
    /// `[t0, t0 + n)`.
    ///
    /// # Panics
    /// If out of bounds.
    pub fn plane_rows(&self, p: usize, t0: usize, n: usize) -> Elems<'_> {
        let d = self.info.head_dim as usize;
        let t = self.info.tokens as usize;
        self.data.as_elems().slice((p * t + t0) * d, n * d)
    }
}

/// A whole KV cache: tensors in layer-major order (layer 0 K, layer 0 V,
/// layer 1 K, ...), free-form metadata and the token ids of the cached
/// prefix (empty when unknown).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KvCache {
    /// Tensors sorted by `(layer, kind)`.
    pub tensors: Vec<Tensor>,
    /// String metadata carried through compress/decompress.
    pub metadata: BTreeMap<String, String>,
    /// Token ids of the cached prefix (prompt-cache identity), may be empty.
    pub token_ids: Vec<u32>,
}

impl KvCache {
    /// Number of layers (one more than the largest layer index).
    pub fn layers(&self) -> usize {
        self.tensors
            .iter()
            .map(|t| t.info.layer as usize + 1)
            .max()
            .unwrap_or(0)
    }

    /// Total elements over all tensors.
    pub fn elements(&self) -> u64 {
        self.tensors.iter().map(|t| t.info.elements()).sum()
    }

    /// Total bytes of the tensors at their source precision.
    pub fn source_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .map(|t| t.info.elements() * t.info.dtype.size() as u64)
            .sum()
    }

    /// Finds the tensor of `(layer, kind)`.
    pub fn get(&self, layer: u32, kind: Kind) -> Option<&Tensor> {
        self.tensors
            .iter()
            .find(|t| t.info.layer == layer && t.info.kind == kind)
    }
}
