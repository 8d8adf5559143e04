//! Borrowed views of KV caches in caller-owned memory, in any axis order.
//!
//! [`KvCache`] owns its elements in kvpack's own axis order
//! `[batch, kv_heads, tokens, head_dim]`. Engines hold KV elsewhere: a torch
//! tensor of an HF cache, a memory-mapped safetensors file, an LMCache chunk
//! `[2, layers, tokens, kv_heads * head_dim]` (token-major). A
//! [`TensorView`] borrows such memory without copying it: element
//! `(b, h, t, i)` of the logical `[batch, kv_heads, tokens, head_dim]`
//! tensor lives at `b * strides.batch + h * strides.head + t *
//! strides.token + i` (strides in elements; the `head_dim` axis is always
//! contiguous). [`crate::compress::compress_view`] encodes straight from
//! views: when a plane's rows are contiguous (kvpack's axis order) pages
//! borrow them, otherwise each page is gathered into a page-sized scratch
//! buffer, so no whole-cache copy is ever made.
//!
//! [`TensorViewMut`] is the mirror for decoding into caller-owned memory
//! ([`crate::decode::Archive::decode_into`]).

use std::collections::BTreeMap;

use crate::cache::{Elems, ElemsMut, KvCache, TensorData, TensorInfo};
use crate::error::{Error, Result};

/// Element strides of the `batch`, `kv_heads` and `tokens` axes of a view
/// (the `head_dim` axis has stride 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Strides {
    /// Elements between consecutive batch entries.
    pub batch: usize,
    /// Elements between consecutive kv heads.
    pub head: usize,
    /// Elements between consecutive tokens.
    pub token: usize,
}

impl Strides {
    /// kvpack's (and HF's) axis order `[batch, kv_heads, tokens, head_dim]`,
    /// densely packed.
    pub fn head_major(info: &TensorInfo) -> Strides {
        let (h, t, d) = (
            info.heads as usize,
            info.tokens as usize,
            info.head_dim as usize,
        );
        Strides {
            batch: h * t * d,
            head: t * d,
            token: d,
        }
    }

    /// Token-major `[batch, tokens, kv_heads, head_dim]`, densely packed
    /// (vLLM's and LMCache's per-layer order).
    pub fn token_major(info: &TensorInfo) -> Strides {
        let (h, t, d) = (
            info.heads as usize,
            info.tokens as usize,
            info.head_dim as usize,
        );
        Strides {
            batch: t * h * d,
            head: d,
            token: h * d,
        }
    }

    /// Elements a buffer must hold for `info` with these strides: one past
    /// the last element addressed, or `None` on overflow.
    pub fn extent(&self, info: &TensorInfo) -> Option<usize> {
        if info.elements() == 0 {
            return Some(0);
        }
        let last = |n: u32, s: usize| (n as usize - 1).checked_mul(s);
        last(info.batch, self.batch)?
            .checked_add(last(info.heads, self.head)?)?
            .checked_add(last(info.tokens, self.token)?)?
            .checked_add(info.head_dim as usize)
    }

    /// True when every plane's `[tokens, head_dim]` rows are contiguous, so
    /// a page of a plane is one slice.
    fn rows_contiguous(&self, info: &TensorInfo) -> bool {
        self.token == info.head_dim as usize || info.tokens <= 1
    }

    /// True when no two distinct elements share an address (required of
    /// a destination: decoding writes every element once).
    fn non_overlapping(&self, info: &TensorInfo) -> bool {
        // Sort the axes by stride; each must step over everything the
        // smaller axes span. An empty tensor (a layer with 0 tokens) has no
        // elements to overlap, whatever its (then zero) strides.
        if info.elements() == 0 {
            return true;
        }
        let d = info.head_dim as usize;
        let mut axes = [
            (self.token, info.tokens as usize),
            (self.head, info.heads as usize),
            (self.batch, info.batch as usize),
        ];
        axes.sort_unstable();
        let mut span = d;
        for (stride, n) in axes {
            if n <= 1 {
                continue;
            }
            if stride < span {
                return false;
            }
            span = stride.saturating_mul(n);
        }
        true
    }

    fn offset(&self, plane: usize, heads: usize, token: usize) -> usize {
        (plane / heads) * self.batch + (plane % heads) * self.head + token * self.token
    }
}

/// Checks that a buffer of `len` elements holds `info` with `strides`.
fn check_extent(info: &TensorInfo, strides: &Strides, len: usize) -> Result<()> {
    match strides.extent(info) {
        Some(n) if n <= len => Ok(()),
        n => Err(Error::param(format!(
            "{} ({}): shape {:?} with strides {:?} needs {} elements, the buffer holds {len}",
            info.name,
            info.describe(),
            info.shape(),
            strides,
            n.map_or("more than usize::MAX".to_string(), |n| n.to_string()),
        ))),
    }
}

/// One K or V tensor borrowed from caller memory.
#[derive(Debug, Clone)]
pub struct TensorView<'a> {
    /// Logical shape `[batch, kv_heads, tokens, head_dim]`, name, dtype.
    pub info: TensorInfo,
    data: Elems<'a>,
    strides: Strides,
}

impl<'a> TensorView<'a> {
    /// A view of `data` laid out with `strides`.
    ///
    /// # Errors
    /// [`Error::Parameter`] when `data`'s dtype differs from `info.dtype`
    /// or `data` is too short for the shape and strides.
    pub fn new(info: TensorInfo, data: Elems<'a>, strides: Strides) -> Result<TensorView<'a>> {
        if data.dtype() != info.dtype {
            return Err(Error::param(format!(
                "{} ({}): data is {}, the tensor is declared {}",
                info.name,
                info.describe(),
                data.dtype().name(),
                info.dtype.name()
            )));
        }
        check_extent(&info, &strides, data.len())?;
        Ok(TensorView {
            info,
            data,
            strides,
        })
    }

    /// All the elements the view borrows (in its strides' order).
    pub fn elems(&self) -> Elems<'a> {
        self.data
    }

    /// The view's strides.
    pub fn strides(&self) -> Strides {
        self.strides
    }

    /// Tokens `[t0, t0 + n)` of plane `p` (`p = b * kv_heads + h`) as one
    /// `[n, head_dim]` slice when the rows are contiguous in memory, else
    /// `None`.
    ///
    /// # Panics
    /// If the range is out of bounds (callers derive it from the shape).
    pub fn plane_rows(&self, p: usize, t0: usize, n: usize) -> Option<Elems<'a>> {
        if !self.strides.rows_contiguous(&self.info) {
            return None;
        }
        let d = self.info.head_dim as usize;
        let start = self.strides.offset(p, self.info.heads as usize, t0);
        Some(self.data.slice(start, n * d))
    }

    /// Widens row `(plane p, token t)` (`head_dim` elements) to f32.
    ///
    /// # Panics
    /// If out of bounds or `out.len() != head_dim`.
    pub fn load_row(&self, p: usize, t: usize, out: &mut [f32]) {
        let start = self.strides.offset(p, self.info.heads as usize, t);
        self.data.load(start, out);
    }

    /// Copies tokens `[t0, t0 + n)` of every plane into `dst` in kvpack's
    /// page order (plane-major `[planes, n, head_dim]`), at source
    /// precision (a bit-exact copy).
    ///
    /// # Panics
    /// If out of bounds or `dst` is not `planes * n * head_dim` elements of
    /// the view's dtype.
    pub fn gather(&self, t0: usize, n: usize, dst: &mut TensorData) {
        let d = self.info.head_dim as usize;
        let heads = self.info.heads as usize;
        for p in 0..self.info.planes() {
            for t in 0..n {
                let src = self.strides.offset(p, heads, t0 + t);
                let at = (p * n + t) * d;
                copy_row(&self.data, src, dst, at, d);
            }
        }
    }
}

/// Copies `d` elements of `src` at `from` into `dst` at `to`, same dtype.
fn copy_row(src: &Elems<'_>, from: usize, dst: &mut TensorData, to: usize, d: usize) {
    assert_eq!(
        src.dtype(),
        dst.dtype(),
        "gather into a buffer of another dtype"
    );
    let w = src.dtype().size();
    dst.as_elems_mut().bytes_mut()[to * w..(to + d) * w]
        .copy_from_slice(&src.bytes()[from * w..(from + d) * w]);
}

/// A whole KV cache borrowed from caller memory: tensors in layer-major
/// order (layer 0 K, layer 0 V, layer 1 K, ...), metadata and the token ids
/// of the cached prefix (may be empty).
#[derive(Debug, Clone, Default)]
pub struct CacheView<'a> {
    /// Tensors sorted by `(layer, kind)`.
    pub tensors: Vec<TensorView<'a>>,
    /// String metadata stored in the file header.
    pub metadata: BTreeMap<String, String>,
    /// Token ids of the cached prefix.
    pub token_ids: Vec<u32>,
}

impl CacheView<'_> {
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

    /// Tensor infos in order.
    pub fn infos(&self) -> Vec<TensorInfo> {
        self.tensors.iter().map(|t| t.info.clone()).collect()
    }
}

impl KvCache {
    /// A borrowed view of the whole cache (no copy).
    pub fn view(&self) -> CacheView<'_> {
        CacheView {
            tensors: self
                .tensors
                .iter()
                .map(|t| TensorView {
                    info: t.info.clone(),
                    data: t.data.as_elems(),
                    strides: Strides::head_major(&t.info),
                })
                .collect(),
            metadata: self.metadata.clone(),
            token_ids: self.token_ids.clone(),
        }
    }
}

/// One output tensor in caller-owned memory: the logical
/// `[batch, kv_heads, tokens, head_dim]` tensor at `strides` inside `data`.
#[derive(Debug)]
pub struct TensorViewMut<'a> {
    /// The tensor of the file to decode (its `tokens` is the number of
    /// tokens the destination holds; `dtype` is the output element type).
    pub info: TensorInfo,
    data: ElemsMut<'a>,
    strides: Strides,
}

impl<'a> TensorViewMut<'a> {
    /// A destination view of `data` laid out with `strides`.
    ///
    /// # Errors
    /// [`Error::Parameter`] when `data` is too short, its dtype differs
    /// from `info.dtype`, or two elements of the shape share an address.
    pub fn new(
        info: TensorInfo,
        data: ElemsMut<'a>,
        strides: Strides,
    ) -> Result<TensorViewMut<'a>> {
        if data.dtype() != info.dtype {
            return Err(Error::param(format!(
                "{} ({}): output buffer is {}, {} requested",
                info.name,
                info.describe(),
                data.dtype().name(),
                info.dtype.name()
            )));
        }
        check_extent(&info, &strides, data.len())?;
        if !strides.non_overlapping(&info) {
            return Err(Error::param(format!(
                "{} ({}): output strides {:?} make elements overlap",
                info.name,
                info.describe(),
                strides
            )));
        }
        Ok(TensorViewMut {
            info,
            data,
            strides,
        })
    }

    /// The view's strides.
    pub fn strides(&self) -> Strides {
        self.strides
    }

    /// True when plane rows are contiguous and planes are densely packed
    /// one after another (kvpack's own order), so the buffer splits into
    /// per-page plane slices.
    pub(crate) fn is_head_major(&self) -> bool {
        self.strides == Strides::head_major(&self.info)
    }

    /// The underlying elements.
    pub(crate) fn into_elems(self) -> ElemsMut<'a> {
        self.data
    }

    /// Raw parts for scattered writes from many threads.
    pub(crate) fn raw_parts(&mut self) -> (RawDst, Strides) {
        (RawDst::of(&mut self.data), self.strides)
    }
}

/// A destination buffer shared by threads that write disjoint rows.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawDst {
    ptr: usize,
    len: usize,
    dtype: crate::cache::DType,
}

// SAFETY: RawDst is only a pointer and a length; the writers that use it
// (`Archive::decode_into`) write disjoint rows of a buffer that is mutably
// borrowed for the whole decode.
unsafe impl Send for RawDst {}
// SAFETY: as above.
unsafe impl Sync for RawDst {}

impl RawDst {
    fn of(data: &mut ElemsMut<'_>) -> RawDst {
        let len = data.len();
        let ptr = data.bytes_mut().as_mut_ptr() as usize;
        RawDst {
            ptr,
            len,
            dtype: data.dtype(),
        }
    }

    /// The `n` elements at `start` as a mutable slice.
    ///
    /// # Safety
    /// `start + n <= len`, the buffer is alive and mutably borrowed by the
    /// caller for the whole time, and no other thread touches these
    /// elements while the slice lives.
    pub(crate) unsafe fn row<'b>(&self, start: usize, n: usize) -> ElemsMut<'b> {
        assert!(start + n <= self.len, "row out of bounds");
        // SAFETY: in bounds (checked above); exclusivity is the caller's
        // contract.
        unsafe {
            match self.dtype {
                crate::cache::DType::Bf16 => ElemsMut::Bf16(std::slice::from_raw_parts_mut(
                    (self.ptr as *mut half::bf16).add(start),
                    n,
                )),
                crate::cache::DType::F16 => ElemsMut::F16(std::slice::from_raw_parts_mut(
                    (self.ptr as *mut half::f16).add(start),
                    n,
                )),
                crate::cache::DType::F32 => ElemsMut::F32(std::slice::from_raw_parts_mut(
                    (self.ptr as *mut f32).add(start),
                    n,
                )),
                crate::cache::DType::Fp8(f) => ElemsMut::Fp8(
                    f,
                    std::slice::from_raw_parts_mut((self.ptr as *mut u8).add(start), n),
                ),
            }
        }
    }
}

pub(crate) fn plane_offset(strides: &Strides, heads: usize, plane: usize, token: usize) -> usize {
    strides.offset(plane, heads, token)
}
