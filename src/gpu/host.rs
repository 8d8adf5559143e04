//! The CPU side of [`super::Device`]: the reference codecs writing the same
//! layouts as the GPU kernels, so one test body checks both backends.

use crate::cache::{Elems, Tensor, TensorData, TensorInfo};
use crate::codec::{Codec, PageIn, PageOut};
use crate::decode::Archive;
use crate::error::{Error, Result};
use crate::format::Section;
use crate::plan::PlannedPage;

use super::{HostLayout, OutType, POISON};

/// The tensor table entry `tensor` of `archive`.
///
/// # Errors
/// [`Error::Parameter`] when the file has no tensor `tensor`.
pub fn tensor_info(archive: &Archive<'_>, tensor: usize) -> Result<TensorInfo> {
    archive
        .tensors()
        .get(tensor)
        .cloned()
        .ok_or_else(|| Error::param(format!("no tensor {tensor}")))
}

/// Checks a host output of `len` 16-bit elements for `info` against the
/// archive's [`crate::format::Limits::max_memory`] before it is allocated,
/// as the CPU reader checks its outputs ([`Archive::check_output`]).
///
/// # Errors
/// [`Error::Limits`] naming the tensor and its declared shape.
pub fn check_output_len(archive: &Archive<'_>, info: &TensorInfo, len: u64) -> Result<()> {
    archive.reader().limits().check_memory(
        len.saturating_mul(2),
        &format!(
            "decoding {} ({}, shape [batch, kv_heads, tokens, head_dim] = {:?}) on the device",
            info.name,
            info.describe(),
            info.shape()
        ),
    )
}

/// Elements of a [`HostLayout`] output for `info`.
///
/// # Errors
/// [`Error::Parameter`] when a paged slot mapping does not have `batch *
/// tokens` entries.
pub fn layout_len(info: &TensorInfo, layout: &HostLayout) -> Result<usize> {
    let row = info.head_dim as usize;
    match layout {
        HostLayout::Contiguous { tokens, .. } => (info.planes() as u64)
            .checked_mul(u64::from(*tokens) * row as u64)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| {
                Error::Limits(format!(
                    "{} ({}): output too large",
                    info.name,
                    info.describe()
                ))
            }),
        HostLayout::Paged { num_slots, slots } => {
            let want = info.batch as usize * info.tokens as usize;
            if slots.len() != want {
                return Err(Error::param(format!(
                    "slot mapping has {} entries, {} (batch x tokens) expected",
                    slots.len(),
                    want
                )));
            }
            (u64::from(*num_slots) * u64::from(info.heads))
                .checked_mul(row as u64)
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| {
                    Error::Limits(format!(
                        "{} ({}): output too large",
                        info.name,
                        info.describe()
                    ))
                })
        }
        HostLayout::Blocks { shape, .. } => {
            if info.batch != 1 || info.heads != shape.kv_heads || info.head_dim != shape.head_dim {
                return Err(Error::param(format!(
                    "{} ({}) does not fit a paged cache of {} kv heads x head_dim {}                      (batch 1 needed)",
                    info.name,
                    info.describe(),
                    shape.kv_heads,
                    shape.head_dim
                )));
            }
            usize::try_from(2 * shape.kv_elements())
                .map_err(|_| Error::param("paged cache too large for this host"))
        }
    }
}

/// Tensor tokens `[lo, hi)` a layout needs.
pub fn token_range(info: &TensorInfo, layout: &HostLayout) -> (u32, u32) {
    match layout {
        HostLayout::Contiguous {
            first_token,
            tokens,
        } => (
            (*first_token).min(info.tokens),
            first_token.saturating_add(*tokens).min(info.tokens),
        ),
        HostLayout::Paged { .. } | HostLayout::Blocks { .. } => (0, info.tokens),
    }
}

/// Decodes tensor `t` page by page with the CPU codecs and scatters the
/// rows into `layout` (see [`super::Device::decode_tensor`]).
///
/// # Errors
/// As [`super::Device::decode_tensor`].
pub fn decode_tensor(
    archive: &Archive<'_>,
    t: usize,
    out: OutType,
    layout: &HostLayout,
) -> Result<Vec<u16>> {
    let info = tensor_info(archive, t)?;
    let mut dst = vec![POISON; layout_len(&info, layout)?];
    decode_tensor_into(archive, t, out, layout, &mut dst)?;
    Ok(dst)
}

/// [`decode_tensor`] into `dst` (of [`layout_len`] elements): elements no
/// page of tensor `t` writes keep their value.
///
/// # Errors
/// As [`super::Device::decode_tensor`], and [`Error::Parameter`] when `dst`
/// has the wrong length.
pub fn decode_tensor_into(
    archive: &Archive<'_>,
    t: usize,
    out: OutType,
    layout: &HostLayout,
    dst: &mut [u16],
) -> Result<()> {
    let info = &tensor_info(archive, t)?;
    if dst.len() != layout_len(info, layout)? {
        return Err(Error::param(format!(
            "output of {} elements for a layout of {}",
            dst.len(),
            layout_len(info, layout)?
        )));
    }
    let d = info.head_dim as usize;
    let (lo, hi) = token_range(info, layout);
    let blocks = match layout {
        HostLayout::Blocks {
            layout,
            shape,
            block_ids,
        } => Some((
            shape.image_target(*layout, info.kind),
            super::paged::slot_mapping(block_ids, shape, info.tokens)?,
        )),
        _ => None,
    };
    for pi in archive.reader().pages_overlapping(t, lo, hi) {
        let view = archive.reader().page(pi)?;
        let m = view.header.meta;
        let n = m.tokens as usize;
        let mut scratch = TensorData::zeros(out.dtype(), info.planes() * n * d);
        {
            let planes = scratch.as_elems_mut().split_planes(n * d, info.planes());
            let mut po = PageOut {
                scatter: None,
                tensor: info,
                tokens: m.tokens,
                planes,
            };
            archive.codec(m.codec as usize).decode(&view, &mut po)?;
        }
        let bits: &[u16] = match &scratch {
            TensorData::Bf16(v) => bytemuck::cast_slice(v),
            TensorData::F16(v) => bytemuck::cast_slice(v),
            TensorData::F32(_) | TensorData::Fp8(..) => unreachable!("OutType is 16-bit"),
        };
        for p in 0..info.planes() {
            let (b, h) = (p / info.heads as usize, p % info.heads as usize);
            for r in 0..n {
                let tok = m.token_start as usize + r;
                let at = match layout {
                    HostLayout::Contiguous {
                        first_token,
                        tokens,
                    } => {
                        let f = *first_token as usize;
                        if tok < f || tok >= f + *tokens as usize {
                            continue;
                        }
                        (p * *tokens as usize + tok - f) * d
                    }
                    HostLayout::Paged { num_slots, slots } => {
                        let s = slots[b * info.tokens as usize + tok];
                        if s < 0 {
                            continue;
                        }
                        if s >= i64::from(*num_slots) {
                            return Err(Error::param(format!(
                                "slot {s} of token {tok} is past the {num_slots} slots of the cache"
                            )));
                        }
                        (s as usize * info.heads as usize + h) * d
                    }
                    HostLayout::Blocks { .. } => {
                        let ((off, _, addr), slots) = blocks.as_ref().expect("set above");
                        (off + addr.offset(slots[tok] as u64, h as u32)) as usize
                    }
                };
                let src = (p * n + r) * d;
                dst[at..at + d].copy_from_slice(&bits[src..src + d]);
            }
        }
    }
    Ok(())
}

/// Encodes planned pages of `tensor` with the CPU codec.
///
/// # Errors
/// The codec's encode error.
pub fn encode_tensor(
    tensor: &Tensor,
    codec: &dyn Codec,
    pages: &[PlannedPage],
) -> Result<Vec<Vec<Section>>> {
    pages
        .iter()
        .map(|p| {
            let planes: Vec<Elems<'_>> = (0..tensor.info.planes())
                .map(|pl| tensor.plane_rows(pl, p.token_start as usize, p.tokens as usize))
                .collect();
            codec.encode(&PageIn {
                source: None,
                tensor: &tensor.info,
                token_start: p.token_start,
                tokens: p.tokens,
                planes,
            })
        })
        .collect()
}
