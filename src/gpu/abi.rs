//! The kernel ABI: the page descriptors the host writes and the kernels
//! read, `#[repr(C)]` mirrors of `struct PageDesc` and `struct EncDesc` in
//! `kernels/common.cuh`. Both sides assert the same sizes at compile time
//! (`static_assert` in `common.cuh`, `const` assertions here, with every
//! field offset); a change to one side that the other lacks fails the
//! build of the kernels (NVRTC and the emulator's g++) or of the crate.

use std::mem::{offset_of, size_of};

use bytemuck::{Pod, Zeroable};

/// One page to decode, as the kernels read it (`struct PageDesc` in
/// `kernels/common.cuh`, 160 bytes). Device addresses are absolute.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
pub struct PageDesc {
    /// Device address of the page body (uncompressed).
    pub body: u64,
    /// Output base: contiguous = address of element (plane 0, output token
    /// 0); paged = address of the cache.
    pub dst: u64,
    /// Paged: address of `slot_mapping[batch 0, tensor token 0]` (i64
    /// entries); 0 for the contiguous layout.
    pub slots: u64,
    /// Contiguous: elements between planes; paged: slot-mapping entries
    /// between batch items.
    pub stride: u64,
    /// Paged: slots in the cache (`num_blocks * block_size`).
    pub limit: u64,
    /// Rows (`planes * tokens`).
    pub rows: u32,
    /// Tokens in the page.
    pub tokens: u32,
    /// KV heads per batch item.
    pub heads: u32,
    /// Elements per row.
    pub head_dim: u32,
    /// Body offset of the SCALE (affine) or RAW (raw) section.
    pub sec0: u32,
    /// Body offset of the ZERO section.
    pub sec1: u32,
    /// Body offset of the INDEX section.
    pub sec2: u32,
    /// Contiguous: page `token_start` minus the output's first token; paged:
    /// page `token_start`.
    pub tok_off: i32,
    /// First page-relative token to write.
    pub t_lo: u32,
    /// One past the last page-relative token to write.
    pub t_hi: u32,
    /// [`super::spec::magic`] of `tokens`.
    pub m_tokens: u32,
    /// [`super::spec::magic`] of `heads`.
    pub m_heads: u32,
    /// Units per row of the launched unit kernel (`head_dim / w`; 0 for
    /// other kernels).
    pub upr: u32,
    /// [`super::spec::magic`] of `upr`.
    pub m_upr: u32,
    /// Device address of the tensor's side table (codebooks, sign vectors,
    /// normalization factors; [`super::side`]), 0 when the codec has none.
    pub side: u64,
    /// Body offsets of a fourth and fifth section (codec-specific).
    pub sec3: u32,
    /// See `sec3`.
    pub sec4: u32,
    /// Codec parameters (`gpu::family::desc_params`).
    pub p0: u32,
    /// See `p0`.
    pub p1: u32,
    /// See `p0`.
    pub p2: u32,
    /// See `p0`.
    pub p3: u32,
    /// Paged: elements between blocks ([`super::addr::PagedStrides`]).
    pub blk_stride: u64,
    /// Paged: elements between the rows (tokens) of a block.
    pub tok_stride: u64,
    /// Paged: elements between the heads of a row.
    pub head_stride: u64,
    /// Paged: slots per block (1 for a flat slot mapping).
    pub block_size: u32,
    /// [`super::spec::magic`] of `block_size`.
    pub m_block: u32,
}

/// One page to encode (`struct EncDesc` in `kernels/common.cuh`, 104 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
pub struct EncDesc {
    /// Device address of source element (plane 0, page token 0).
    pub src: u64,
    /// Device address of the output page body.
    pub body: u64,
    /// Source elements between planes.
    pub stride: u64,
    /// Rows (`planes * tokens`).
    pub rows: u32,
    /// Tokens in the page.
    pub tokens: u32,
    /// Elements per row.
    pub head_dim: u32,
    /// Body offset of the SCALE section.
    pub sec_scale: u32,
    /// Body offset of the ZERO section.
    pub sec_zero: u32,
    /// Body offset of the INDEX section.
    pub sec_index: u32,
    /// Page number (reported with a non-finite row).
    pub page: u32,
    /// [`super::spec::magic`] of `tokens`.
    pub m_tokens: u32,
    /// Units per row of the launched unit kernel (`head_dim / w`).
    pub upr: u32,
    /// [`super::spec::magic`] of `upr`.
    pub m_upr: u32,
    /// Device address of the tensor's side table (codebooks), 0 if none.
    pub side: u64,
    /// Device address of the page's scratch, 0 if none.
    pub aux: u64,
    /// Body offset of a further section (codec-specific).
    pub sec3: u32,
    /// KV heads per batch item.
    pub heads: u32,
    /// Codec parameters (see each encode kernel).
    pub p0: u32,
    /// See `p0`.
    pub p1: u32,
    /// See `p0`.
    pub p2: u32,
    /// See `p0`.
    pub p3: u32,
}

// Sizes and field offsets of `kernels/common.cuh`.
const _: () = assert!(size_of::<PageDesc>() == 160);
const _: () = assert!(offset_of!(PageDesc, body) == 0);
const _: () = assert!(offset_of!(PageDesc, dst) == 8);
const _: () = assert!(offset_of!(PageDesc, slots) == 16);
const _: () = assert!(offset_of!(PageDesc, stride) == 24);
const _: () = assert!(offset_of!(PageDesc, limit) == 32);
const _: () = assert!(offset_of!(PageDesc, rows) == 40);
const _: () = assert!(offset_of!(PageDesc, tokens) == 44);
const _: () = assert!(offset_of!(PageDesc, heads) == 48);
const _: () = assert!(offset_of!(PageDesc, head_dim) == 52);
const _: () = assert!(offset_of!(PageDesc, sec0) == 56);
const _: () = assert!(offset_of!(PageDesc, sec1) == 60);
const _: () = assert!(offset_of!(PageDesc, sec2) == 64);
const _: () = assert!(offset_of!(PageDesc, tok_off) == 68);
const _: () = assert!(offset_of!(PageDesc, t_lo) == 72);
const _: () = assert!(offset_of!(PageDesc, t_hi) == 76);
const _: () = assert!(offset_of!(PageDesc, m_tokens) == 80);
const _: () = assert!(offset_of!(PageDesc, m_heads) == 84);
const _: () = assert!(offset_of!(PageDesc, upr) == 88);
const _: () = assert!(offset_of!(PageDesc, m_upr) == 92);
const _: () = assert!(offset_of!(PageDesc, side) == 96);
const _: () = assert!(offset_of!(PageDesc, sec3) == 104);
const _: () = assert!(offset_of!(PageDesc, sec4) == 108);
const _: () = assert!(offset_of!(PageDesc, p0) == 112);
const _: () = assert!(offset_of!(PageDesc, p1) == 116);
const _: () = assert!(offset_of!(PageDesc, p2) == 120);
const _: () = assert!(offset_of!(PageDesc, p3) == 124);
const _: () = assert!(offset_of!(PageDesc, blk_stride) == 128);
const _: () = assert!(offset_of!(PageDesc, tok_stride) == 136);
const _: () = assert!(offset_of!(PageDesc, head_stride) == 144);
const _: () = assert!(offset_of!(PageDesc, block_size) == 152);
const _: () = assert!(offset_of!(PageDesc, m_block) == 156);
const _: () = assert!(size_of::<EncDesc>() == 104);
const _: () = assert!(offset_of!(EncDesc, src) == 0);
const _: () = assert!(offset_of!(EncDesc, body) == 8);
const _: () = assert!(offset_of!(EncDesc, stride) == 16);
const _: () = assert!(offset_of!(EncDesc, rows) == 24);
const _: () = assert!(offset_of!(EncDesc, tokens) == 28);
const _: () = assert!(offset_of!(EncDesc, head_dim) == 32);
const _: () = assert!(offset_of!(EncDesc, sec_scale) == 36);
const _: () = assert!(offset_of!(EncDesc, sec_zero) == 40);
const _: () = assert!(offset_of!(EncDesc, sec_index) == 44);
const _: () = assert!(offset_of!(EncDesc, page) == 48);
const _: () = assert!(offset_of!(EncDesc, m_tokens) == 52);
const _: () = assert!(offset_of!(EncDesc, upr) == 56);
const _: () = assert!(offset_of!(EncDesc, m_upr) == 60);
const _: () = assert!(offset_of!(EncDesc, side) == 64);
const _: () = assert!(offset_of!(EncDesc, aux) == 72);
const _: () = assert!(offset_of!(EncDesc, sec3) == 80);
const _: () = assert!(offset_of!(EncDesc, heads) == 84);
const _: () = assert!(offset_of!(EncDesc, p0) == 88);
const _: () = assert!(offset_of!(EncDesc, p1) == 92);
const _: () = assert!(offset_of!(EncDesc, p2) == 96);
const _: () = assert!(offset_of!(EncDesc, p3) == 100);
