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
//! A view may also address a serving engine's paged cache ([`Paged`]):
//! token `t` is row `slots[t] % block_size` of block `slots[t] /
//! block_size` ([`PagedAddr`], the addressing the GPU
//! kernels use, and `kvpack::gpu::paged::slot_mapping` from a block
//! table), so a layer is encoded from, or decoded into, its blocks in
//! place.
//!
//! [`TensorViewMut`] is the mirror for decoding into caller-owned memory
//! ([`crate::decode::Archive::decode_into`]).

use std::collections::BTreeMap;

use crate::cache::{Elems, ElemsMut, KvCache, TensorData, TensorInfo};
use crate::error::{Error, Result};
use crate::gpu::addr::PagedAddr;

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
        // An empty tensor (a layer with 0 tokens) has no elements to
        // overlap, whatever its (then zero) strides.
        info.elements() == 0
            || disjoint(
                info.head_dim as usize,
                [
                    (self.token, info.tokens as usize),
                    (self.head, info.heads as usize),
                    (self.batch, info.batch as usize),
                ],
            )
    }

    fn offset(&self, plane: usize, heads: usize, token: usize) -> usize {
        (plane / heads) * self.batch + (plane % heads) * self.head + token * self.token
    }
}

/// True when rows of `d` contiguous elements addressed by the `(stride,
/// count)` axes never share an element: sorted by stride, each axis must
/// step over everything the smaller axes span.
fn disjoint<const N: usize>(d: usize, mut axes: [(usize, usize); N]) -> bool {
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

/// The rows of a one-sequence (batch 1) view in a paged cache: token `t`
/// of the view lives in cache slot `slots[t]` ([`PagedAddr::offset`]; the
/// slots come from a block table through
/// `kvpack::gpu::paged::slot_mapping`), element offsets counted from the
/// view's first element.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Paged<'a> {
    /// Block size, strides and block count of K or V in the cache.
    pub addr: PagedAddr,
    /// The cache slot of every token of the view.
    pub slots: &'a [i64],
}

/// How a view's rows are addressed: by strides, or through a paged
/// cache's slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rows<'a> {
    /// Element `(b, h, t, i)` at `b * batch + h * head + t * token + i`.
    Strided(Strides),
    /// Element `(0, h, t, i)` at `addr.offset(slots[t], h) + i`.
    Paged(Paged<'a>),
}

impl Rows<'_> {
    /// Element offset of row `(plane, token)`, planes `b * heads + h`.
    fn offset(&self, plane: usize, heads: usize, token: usize) -> usize {
        match self {
            Rows::Strided(s) => s.offset(plane, heads, token),
            Rows::Paged(p) => p.addr.offset(p.slots[token] as u64, plane as u32) as usize,
        }
    }
}

impl<'a> Paged<'a> {
    /// Checks that `info` (batch 1, `slots.len()` tokens) fits a buffer of
    /// `len` elements through this addressing, with every slot in the
    /// cache; with `exclusive`, also that no two rows share an element
    /// (distinct slots, disjoint strides), as a destination needs.
    fn check(&self, info: &TensorInfo, len: usize, exclusive: bool) -> Result<()> {
        let what = || format!("{} ({})", info.name, info.describe());
        if info.batch != 1 || self.slots.len() != info.tokens as usize {
            return Err(Error::param(format!(
                "{}: a paged view holds one sequence of {} tokens, {} slots given for batch {}",
                what(),
                info.tokens,
                self.slots.len(),
                info.batch
            )));
        }
        self.addr
            .check(len as u64, info.heads, info.head_dim)
            .map_err(|e| Error::param(format!("{}: {e}", what())))?;
        let n = self.addr.slots();
        if let Some(s) = self.slots.iter().find(|&&s| s < 0 || s as u64 >= n) {
            return Err(Error::param(format!(
                "{}: slot {s} outside the cache's {n} slots",
                what()
            )));
        }
        if exclusive {
            let mut seen = vec![false; n as usize];
            if let Some(s) = self
                .slots
                .iter()
                .find(|&&s| std::mem::replace(&mut seen[s as usize], true))
            {
                return Err(Error::param(format!("{}: slot {s} is used twice", what())));
            }
            let st = self.addr.strides;
            let axes = [
                (st.token as usize, self.addr.block_size as usize),
                (st.head as usize, info.heads as usize),
                (st.block as usize, self.addr.num_blocks as usize),
            ];
            if !disjoint(info.head_dim as usize, axes) {
                return Err(Error::param(format!(
                    "{}: paged strides {st:?} make elements overlap",
                    what()
                )));
            }
        }
        Ok(())
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
    rows: Rows<'a>,
}

impl<'a> TensorView<'a> {
    /// A view of `data` laid out with `strides`.
    ///
    /// # Errors
    /// [`Error::Parameter`] when `data`'s dtype differs from `info.dtype`
    /// or `data` is too short for the shape and strides.
    pub fn new(info: TensorInfo, data: Elems<'a>, strides: Strides) -> Result<TensorView<'a>> {
        check_dtype(&info, data.dtype(), "data is")?;
        check_extent(&info, &strides, data.len())?;
        Ok(TensorView {
            info,
            data,
            rows: Rows::Strided(strides),
        })
    }

    /// A view of one sequence (batch 1) in a paged cache: token `t` is
    /// the row of slot `paged.slots[t]` in `data` (K or V of a paged cache
    /// from its (block 0, row 0, head 0) element on).
    ///
    /// # Errors
    /// [`Error::Parameter`] when `data`'s dtype differs from `info.dtype`,
    /// batch is not 1, `paged.slots` does not hold one slot per token, a
    /// slot lies outside the cache, or `data` is too short for the cache
    /// ([`PagedAddr::check`]).
    pub fn paged(info: TensorInfo, data: Elems<'a>, paged: Paged<'a>) -> Result<TensorView<'a>> {
        check_dtype(&info, data.dtype(), "data is")?;
        paged.check(&info, data.len(), false)?;
        Ok(TensorView {
            info,
            data,
            rows: Rows::Paged(paged),
        })
    }

    /// All the elements the view borrows (in its addressing's order).
    pub fn elems(&self) -> Elems<'a> {
        self.data
    }

    /// The view's row addressing.
    pub fn rows(&self) -> Rows<'a> {
        self.rows
    }

    /// Row `(plane p, token t)`: its `head_dim` elements.
    ///
    /// # Panics
    /// If out of bounds.
    pub fn row(&self, p: usize, t: usize) -> Elems<'a> {
        let d = self.info.head_dim as usize;
        self.data
            .slice(self.rows.offset(p, self.info.heads as usize, t), d)
    }

    /// Tokens `[t0, t0 + n)` of plane `p` (`p = b * kv_heads + h`) as one
    /// `[n, head_dim]` slice when the rows are contiguous in memory, else
    /// `None`.
    ///
    /// # Panics
    /// If the range is out of bounds (callers derive it from the shape).
    pub fn plane_rows(&self, p: usize, t0: usize, n: usize) -> Option<Elems<'a>> {
        let Rows::Strided(s) = self.rows else {
            return None;
        };
        if !s.rows_contiguous(&self.info) {
            return None;
        }
        let d = self.info.head_dim as usize;
        let start = s.offset(p, self.info.heads as usize, t0);
        Some(self.data.slice(start, n * d))
    }

    /// Widens row `(plane p, token t)` (`head_dim` elements) to f32.
    ///
    /// # Panics
    /// If out of bounds or `out.len() != head_dim`.
    pub fn load_row(&self, p: usize, t: usize, out: &mut [f32]) {
        let start = self.rows.offset(p, self.info.heads as usize, t);
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
        // Token by token: a gathered view's memory is token-major or paged.
        for t in 0..n {
            for p in 0..self.info.planes() {
                let src = self.rows.offset(p, heads, t0 + t);
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
                    rows: Rows::Strided(Strides::head_major(&t.info)),
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
    rows: Rows<'a>,
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
        check_dtype(&info, data.dtype(), "output buffer is")?;
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
            rows: Rows::Strided(strides),
        })
    }

    /// A destination in a paged cache (see [`TensorView::paged`]).
    ///
    /// # Errors
    /// As [`TensorView::paged`], and when two tokens share a slot or the
    /// strides make rows overlap.
    pub fn paged(
        info: TensorInfo,
        data: ElemsMut<'a>,
        paged: Paged<'a>,
    ) -> Result<TensorViewMut<'a>> {
        check_dtype(&info, data.dtype(), "output buffer is")?;
        paged.check(&info, data.len(), true)?;
        Ok(TensorViewMut {
            info,
            data,
            rows: Rows::Paged(paged),
        })
    }

    /// The view's row addressing.
    pub fn rows(&self) -> Rows<'a> {
        self.rows
    }

    /// True when plane rows are contiguous and planes are densely packed
    /// one after another (kvpack's own order), so the buffer splits into
    /// per-page plane slices.
    pub(crate) fn is_head_major(&self) -> bool {
        self.rows == Rows::Strided(Strides::head_major(&self.info))
    }

    /// The underlying elements.
    pub(crate) fn into_elems(self) -> ElemsMut<'a> {
        self.data
    }

    /// Raw parts for scattered writes from many threads.
    pub(crate) fn raw_parts(&mut self) -> (RawDst, Rows<'a>) {
        (RawDst::of(&mut self.data), self.rows)
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

/// The rows of one page of a destination view, written in place by a
/// row-wise decoder ([`crate::codec::PageOut::scatter`]). Created only by
/// the decoder for a page's own rows, so no two live values address the
/// same row.
#[derive(Debug)]
pub struct RowsOut<'a> {
    dst: RawDst,
    rows: Rows<'a>,
    heads: usize,
    head_dim: usize,
    first: usize,
}

impl<'a> RowsOut<'a> {
    /// Rows of tokens `first..` of the view whose raw parts are `dst` and
    /// `rows`.
    ///
    /// # Safety
    /// As [`RawDst::row`]: the buffer stays mutably borrowed by the caller
    /// while this value lives, and no other thread or value touches the
    /// rows this one writes (the page's tokens of every plane).
    pub(crate) unsafe fn new(
        dst: RawDst,
        rows: Rows<'a>,
        info: &TensorInfo,
        first: usize,
    ) -> RowsOut<'a> {
        RowsOut {
            dst,
            rows,
            heads: info.heads as usize,
            head_dim: info.head_dim as usize,
            first,
        }
    }

    /// Row `(plane, first + token)`, writable.
    ///
    /// # Panics
    /// If out of the view's bounds.
    pub fn row(&mut self, plane: usize, token: usize) -> ElemsMut<'_> {
        let at = self.rows.offset(plane, self.heads, self.first + token);
        // SAFETY: the view's extent was checked against the buffer when it
        // was made (the offset is in bounds, and `row` asserts it), and
        // `new`'s contract makes this value the only writer of its rows;
        // the returned slice borrows `self` mutably, so it is unique.
        unsafe { self.dst.row(at, self.head_dim) }
    }
}

pub(crate) fn plane_offset(rows: &Rows<'_>, heads: usize, plane: usize, token: usize) -> usize {
    rows.offset(plane, heads, token)
}

/// Checks that elements of dtype `got` can hold `info`.
fn check_dtype(info: &TensorInfo, got: crate::cache::DType, what: &str) -> Result<()> {
    if got == info.dtype {
        return Ok(());
    }
    Err(Error::param(format!(
        "{} ({}): {what} {}, the tensor is declared {}",
        info.name,
        info.describe(),
        got.name(),
        info.dtype.name()
    )))
}
