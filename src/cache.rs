//! The in-memory KV cache model: tensors, their shapes and element types.
//!
//! A KV cache is a list of tensors, two per layer (K and V), each shaped
//! `[batch, kv_heads, tokens, head_dim]` in row-major order (the HF
//! `past_key_values` layout). Token counts may differ per layer (for example
//! sliding-window layers hold fewer tokens than global ones). An MLA model
//! (DeepSeek-V2/V3 multi-head latent attention) instead holds one
//! [`Kind::Latent`] tensor per layer, `[batch, 1, tokens, latent_dim]` with
//! `latent_dim = kv_lora_rank + qk_rope_head_dim` (the compressed KV
//! followed by the RoPE key part).
//!
//! Elements are bf16, fp16, fp32 or fp8 (E4M3FN / E5M2 with a per-tensor
//! scale, [`Fp8`]); codecs see every element type as f32 values (fp8
//! dequantized: `code * scale`).
//!
//! Codecs see one tensor as `batch * kv_heads` independent *planes*, each a
//! `[tokens, head_dim]` matrix whose rows are the per-token head vectors.

use std::collections::BTreeMap;

use half::{bf16, f16};

use crate::error::{Error, Result};
use crate::kernels::fp8;
pub use crate::kernels::fp8::Fp8Format;

/// An fp8 element type together with its per-tensor scale: the value of a
/// stored code `c` is `fp8(c) * scale` (f32), as in vLLM's fp8 KV caches
/// (`k_scale` / `v_scale`). The scale is a finite, positive, normal f32.
///
/// Equality compares format and scale (bit for bit): two fp8 tensors hold
/// interchangeable bytes only when both agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fp8 {
    format: Fp8Format,
    scale_bits: u32,
}

impl Fp8 {
    /// `format` with `scale`.
    ///
    /// # Errors
    /// [`Error::Parameter`] when `scale` is not finite, positive and
    /// normal (zero, subnormal, negative, inf and NaN are refused).
    pub fn new(format: Fp8Format, scale: f32) -> Result<Fp8> {
        if !(scale.is_normal() && scale > 0.0) {
            return Err(Error::param(format!(
                "fp8 scale {scale:e} must be a finite, positive, normal f32"
            )));
        }
        Ok(Fp8 {
            format,
            scale_bits: scale.to_bits(),
        })
    }

    /// `format` with the per-tensor scale that maps `amax` (the largest
    /// magnitude of the tensor) onto the format's largest finite value:
    /// `amax / max` (vLLM's dynamic per-tensor scaling). Scale 1 when
    /// `amax` is zero or not finite, or the quotient is not a normal f32.
    pub fn for_amax(format: Fp8Format, amax: f32) -> Fp8 {
        Fp8::new(format, amax / format.max()).unwrap_or(Fp8::unscaled(format))
    }

    /// `format` with scale 1 (vLLM's default when no scale was calibrated).
    pub fn unscaled(format: Fp8Format) -> Fp8 {
        Fp8 {
            format,
            scale_bits: 1f32.to_bits(),
        }
    }

    /// The element format (E4M3FN or E5M2).
    pub fn format(self) -> Fp8Format {
        self.format
    }

    /// The per-tensor scale (dequantized value = code * scale).
    pub fn scale(self) -> f32 {
        f32::from_bits(self.scale_bits)
    }
}

/// Element type of a source tensor (the precision a `raw` page keeps).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// bfloat16: 1 sign, 8 exponent, 7 mantissa bits. File code 1.
    Bf16,
    /// IEEE 754 binary16. File code 2.
    F16,
    /// IEEE 754 binary32. File code 3.
    F32,
    /// fp8 with a per-tensor scale: E4M3FN (file code 4) or E5M2 (file
    /// code 5). Format 1.1.
    Fp8(Fp8),
}

impl DType {
    /// Bytes per element (2, 2, 4, or 1 for fp8).
    pub fn size(self) -> usize {
        match self {
            DType::Bf16 | DType::F16 => 2,
            DType::F32 => 4,
            DType::Fp8(_) => 1,
        }
    }

    /// The code stored in the file (format/SPEC.md, "Element types").
    pub fn code(self) -> u8 {
        match self {
            DType::Bf16 => 1,
            DType::F16 => 2,
            DType::F32 => 3,
            DType::Fp8(f) => match f.format() {
                Fp8Format::E4M3Fn => 4,
                Fp8Format::E5M2 => 5,
            },
        }
    }

    /// Inverse of [`DType::code`]; `None` for an unknown code. fp8 codes
    /// come back with scale 1 (the tensor table stores the real scale).
    pub fn from_code(code: u8) -> Option<DType> {
        match code {
            1 => Some(DType::Bf16),
            2 => Some(DType::F16),
            3 => Some(DType::F32),
            4 => Some(DType::Fp8(Fp8::unscaled(Fp8Format::E4M3Fn))),
            5 => Some(DType::Fp8(Fp8::unscaled(Fp8Format::E5M2))),
            _ => None,
        }
    }

    /// Lower-case name as used on the command line: `bf16`, `fp16`, `fp32`,
    /// `fp8_e4m3`, `fp8_e5m2`.
    pub fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::F16 => "fp16",
            DType::F32 => "fp32",
            DType::Fp8(f) => match f.format() {
                Fp8Format::E4M3Fn => "fp8_e4m3",
                Fp8Format::E5M2 => "fp8_e5m2",
            },
        }
    }

    /// The fp8 scale, `None` for the other types.
    pub fn scale(self) -> Option<f32> {
        match self {
            DType::Fp8(f) => Some(f.scale()),
            _ => None,
        }
    }

    /// Parses `bf16`, `fp16`/`f16`, `fp32`/`f32`, `fp8_e4m3`/`fp8`/
    /// `float8_e4m3fn`, `fp8_e5m2`/`float8_e5m2`. fp8 types come with scale
    /// 1; [`DType::for_source`] picks the scale of an output.
    ///
    /// # Errors
    /// [`Error::Parameter`] for any other string.
    pub fn parse(s: &str) -> Result<DType> {
        let fp8 = |f| Ok(DType::Fp8(Fp8::unscaled(f)));
        match s.to_ascii_lowercase().as_str() {
            "bf16" => Ok(DType::Bf16),
            "fp16" | "f16" | "float16" => Ok(DType::F16),
            "fp32" | "f32" | "float32" => Ok(DType::F32),
            "fp8" | "fp8_e4m3" | "fp8_e4m3fn" | "f8_e4m3" | "float8_e4m3fn" => {
                fp8(Fp8Format::E4M3Fn)
            }
            "fp8_e5m2" | "f8_e5m2" | "float8_e5m2" => fp8(Fp8Format::E5M2),
            _ => Err(Error::param(format!(
                "unknown dtype {s:?}: expected bf16, fp16, fp32, fp8_e4m3 or fp8_e5m2"
            ))),
        }
    }

    /// The output type actually used when `self` is requested for a
    /// tensor stored as `src`: for an fp8 request, the scale comes from the
    /// source, since a caller asking for "fp8_e4m3" cannot know it. Same fp8
    /// format: the source's scale (the stored codes come back unchanged
    /// through `raw`). The other fp8 format: the source scale times
    /// `src_max / out_max`, so the source's full range maps onto the
    /// output's. A non-fp8 source: scale 1 (vLLM's default). Non-fp8
    /// requests are returned unchanged.
    pub fn for_source(self, src: DType) -> DType {
        match (self, src) {
            (DType::Fp8(out), DType::Fp8(s)) if out.format() == s.format() => src,
            (DType::Fp8(out), DType::Fp8(s)) => {
                let scale = s.scale() * s.format().max() / out.format().max();
                DType::Fp8(Fp8::new(out.format(), scale).unwrap_or(out))
            }
            _ => self,
        }
    }
}

/// Whether a tensor holds keys, values or an MLA latent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// Keys (file code 0).
    Key,
    /// Values (file code 1).
    Value,
    /// MLA latent (file code 2, format 1.1): one tensor per layer holding
    /// the compressed KV (`kv_lora_rank` elements) followed by the RoPE key
    /// part (`qk_rope_head_dim`), shape `[batch, 1, tokens, latent_dim]`
    /// (DeepSeek-AI, "DeepSeek-V2: A Strong, Economical, and Efficient
    /// Mixture-of-Experts Language Model", arXiv:2405.04434, section 2.1).
    /// A layer with a latent has no K or V tensor.
    Latent,
}

/// How a codec treats a tensor: codecs whose math differs between keys and
/// values (per-channel vs per-token groups, inner-product corrections,
/// value groups) pick their branch by role. An MLA latent takes the key
/// role: its full row enters the attention scores `q . k`, so it gets the
/// treatment designed for inner products.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Coded like keys.
    Key,
    /// Coded like values.
    Value,
}

impl Kind {
    /// File code: 0 for K, 1 for V, 2 for an MLA latent.
    pub fn code(self) -> u8 {
        match self {
            Kind::Key => 0,
            Kind::Value => 1,
            Kind::Latent => 2,
        }
    }

    /// Inverse of [`Kind::code`].
    pub fn from_code(code: u8) -> Option<Kind> {
        match code {
            0 => Some(Kind::Key),
            1 => Some(Kind::Value),
            2 => Some(Kind::Latent),
            _ => None,
        }
    }

    /// `"K"`, `"V"` or `"L"`.
    pub fn letter(self) -> &'static str {
        match self {
            Kind::Key => "K",
            Kind::Value => "V",
            Kind::Latent => "L",
        }
    }

    /// `"key"`, `"value"` or `"latent"`: the last part of the safetensors
    /// tensor name `past_key_values.{layer}.{name}`.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Key => "key",
            Kind::Value => "value",
            Kind::Latent => "latent",
        }
    }

    /// Parses `k`/`key`, `v`/`value`, `l`/`latent` (any case).
    ///
    /// # Errors
    /// [`Error::Parameter`] for any other string.
    pub fn parse(s: &str) -> Result<Kind> {
        match s.to_ascii_lowercase().as_str() {
            "k" | "key" | "keys" => Ok(Kind::Key),
            "v" | "value" | "values" => Ok(Kind::Value),
            "l" | "latent" => Ok(Kind::Latent),
            _ => Err(Error::param(format!(
                "unknown tensor kind {s:?}: expected k, v or latent"
            ))),
        }
    }

    /// The codec role: [`Role::Key`] for keys and latents.
    pub fn role(self) -> Role {
        match self {
            Kind::Key | Kind::Latent => Role::Key,
            Kind::Value => Role::Value,
        }
    }
}

/// Shape, element type and name of one K, V or latent tensor.
///
/// Shape is `[batch, heads, tokens, head_dim]` with `heads` the number of
/// KV heads (1 for an MLA latent, whose `head_dim` is the latent width).
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

    /// Short description such as `layer 3 K` or `layer 3 latent`.
    pub fn describe(&self) -> String {
        match self.kind {
            Kind::Latent => format!("layer {} latent", self.layer),
            k => format!("layer {} {}", self.layer, k.letter()),
        }
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
    /// fp8 codes with their format and per-tensor scale.
    Fp8(Fp8, Vec<u8>),
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
            DType::Fp8(f) => TensorData::Fp8(f, vec![0; len]),
        };
        let bytes = d.as_elems().bytes();
        advise_huge_pages(bytes.as_ptr() as usize, bytes.len());
        d
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        match self {
            TensorData::Bf16(_) => DType::Bf16,
            TensorData::F16(_) => DType::F16,
            TensorData::F32(_) => DType::F32,
            TensorData::Fp8(f, _) => DType::Fp8(*f),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.as_elems().len()
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
            TensorData::Fp8(f, v) => Elems::Fp8(*f, v),
        }
    }

    /// Mutable view of all elements.
    pub fn as_elems_mut(&mut self) -> ElemsMut<'_> {
        match self {
            TensorData::Bf16(v) => ElemsMut::Bf16(v),
            TensorData::F16(v) => ElemsMut::F16(v),
            TensorData::F32(v) => ElemsMut::F32(v),
            TensorData::Fp8(f, v) => ElemsMut::Fp8(*f, v),
        }
    }

    /// Little-endian bytes of the elements (a copy).
    pub fn to_le_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.len() * self.dtype().size());
        match self {
            TensorData::Bf16(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
            TensorData::F16(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
            TensorData::F32(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
            TensorData::Fp8(_, v) => out.extend_from_slice(v),
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
            DType::Fp8(f) => TensorData::Fp8(f, bytes.to_vec()),
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
    /// fp8 codes with their format and per-tensor scale.
    Fp8(Fp8, &'a [u8]),
}

impl<'a> Elems<'a> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Elems::Bf16(v) => v.len(),
            Elems::F16(v) => v.len(),
            Elems::F32(v) => v.len(),
            Elems::Fp8(_, v) => v.len(),
        }
    }

    /// The elements' bytes in native byte order (little-endian on every
    /// target kvpack's file I/O writes without swapping).
    pub fn bytes(&self) -> &'a [u8] {
        match *self {
            Elems::Bf16(v) => bytemuck::cast_slice(v),
            Elems::F16(v) => bytemuck::cast_slice(v),
            Elems::F32(v) => bytemuck::cast_slice(v),
            Elems::Fp8(_, v) => v,
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
            Elems::Fp8(f, _) => DType::Fp8(*f),
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
            Elems::Fp8(f, v) => Elems::Fp8(f, &v[start..start + len]),
        }
    }

    /// Widens elements `[start, start + out.len())` to f32 into `out` (fp8
    /// dequantized: `code * scale`).
    ///
    /// # Panics
    /// If the range is out of bounds.
    pub fn load(&self, start: usize, out: &mut [f32]) {
        let n = out.len();
        match self {
            Elems::Bf16(v) => crate::kernels::convert::bf16_to_f32(&v[start..start + n], out),
            Elems::F16(v) => crate::kernels::convert::f16_to_f32(&v[start..start + n], out),
            Elems::F32(v) => out.copy_from_slice(&v[start..start + n]),
            Elems::Fp8(f, v) => fp8::dequantize(&v[start..start + n], f.format(), f.scale(), out),
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
    /// fp8 codes with their format and per-tensor scale.
    Fp8(Fp8, &'a mut [u8]),
}

impl<'a> ElemsMut<'a> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            ElemsMut::Bf16(v) => v.len(),
            ElemsMut::F16(v) => v.len(),
            ElemsMut::F32(v) => v.len(),
            ElemsMut::Fp8(_, v) => v.len(),
        }
    }

    /// The elements' bytes in native byte order, writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            ElemsMut::Bf16(v) => bytemuck::cast_slice_mut(v),
            ElemsMut::F16(v) => bytemuck::cast_slice_mut(v),
            ElemsMut::F32(v) => bytemuck::cast_slice_mut(v),
            ElemsMut::Fp8(_, v) => v,
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
            ElemsMut::Fp8(f, _) => DType::Fp8(*f),
        }
    }

    /// Narrows `src` (f32) into elements `[start, start + src.len())`,
    /// rounding to nearest-even for bf16/fp16; fp8 stores
    /// `fp8(x / scale)`, nearest-even and saturating
    /// ([`crate::kernels::fp8`]).
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
            ElemsMut::Fp8(f, v) => {
                fp8::quantize(src, f.format(), f.scale(), &mut v[start..start + n])
            }
        }
    }

    /// Elements `[start, start + len)`, reborrowed.
    ///
    /// # Panics
    /// If out of bounds.
    pub fn slice_mut(&mut self, start: usize, len: usize) -> ElemsMut<'_> {
        match self {
            ElemsMut::Bf16(v) => ElemsMut::Bf16(&mut v[start..start + len]),
            ElemsMut::F16(v) => ElemsMut::F16(&mut v[start..start + len]),
            ElemsMut::F32(v) => ElemsMut::F32(&mut v[start..start + len]),
            ElemsMut::Fp8(f, v) => ElemsMut::Fp8(*f, &mut v[start..start + len]),
        }
    }

    /// Splits the first `planes * per_plane` elements into `planes`
    /// consecutive runs of `per_plane` elements (the planes of a page's
    /// `[planes, tokens, head_dim]` scratch).
    ///
    /// # Panics
    /// If `planes * per_plane > len`.
    pub fn split_planes(self, per_plane: usize, planes: usize) -> Vec<ElemsMut<'a>> {
        let mut rest = self;
        let mut out = Vec::with_capacity(planes);
        for _ in 0..planes {
            let (a, b) = rest.split_at(per_plane);
            out.push(a);
            rest = b;
        }
        out
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
            ElemsMut::Fp8(f, v) => {
                let (a, b) = v.split_at_mut(mid);
                (ElemsMut::Fp8(f, a), ElemsMut::Fp8(f, b))
            }
        }
    }
}

/// One K, V or latent tensor with its data.
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

    /// The same tensor with its elements converted to `dtype` (through f32;
    /// rounding as [`ElemsMut::store`]). The name and shape are kept.
    pub fn converted(&self, dtype: DType) -> Tensor {
        let mut data = TensorData::zeros(dtype, self.data.len());
        data.as_elems_mut().store(0, &self.data.to_f32());
        Tensor {
            info: TensorInfo {
                dtype,
                ..self.info.clone()
            },
            data,
        }
    }

    /// The same tensor stored as fp8 of `format` with the per-tensor scale
    /// calibrated on its largest magnitude ([`Fp8::for_amax`]), as vLLM's
    /// dynamic per-tensor fp8 scaling does.
    pub fn to_fp8(&self, format: Fp8Format) -> Tensor {
        let amax = self.data.to_f32().iter().fold(0f32, |m, x| m.max(x.abs()));
        self.converted(DType::Fp8(Fp8::for_amax(format, amax)))
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
