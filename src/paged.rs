//! Paged KV caches in host memory, as a serving engine's CPU-side cache
//! (or a NIXL host buffer) holds them: one layer encoded straight from its
//! blocks into a kvpack file, and a layer of a file decoded straight into
//! its blocks, the host mirror of the GPU's `encode_paged` /
//! `decode_paged` ([`crate::gpu`]).
//!
//! The layouts, their geometry and the block-table addressing are the
//! GPU's ([`PagedLayout`], [`PagedShape`], [`slot_mapping`]): token `t`
//! of the sequence lives in row `t % block_size` of block
//! `block_ids[t / block_size]`. The cache is read and written in place
//! through paged views ([`crate::view::Paged`]): pages of row-wise codecs
//! (`int`, `bdr`) are coded row by row from and into the blocks; other
//! codecs gather or scatter one page at a time. No whole-layer copy is
//! made.
//!
//! Files are byte-identical to [`crate::compress::compress_view`] of the
//! gathered `[1, kv_heads, tokens, head_dim]` K and V, named
//! `past_key_values.{layer}.key/.value` (what `kvpack.compress` of those
//! tensors writes).

use std::ops::Range;

use crate::cache::{Elems, ElemsMut, Kind};
use crate::codec::Codec;
use crate::compress::{CompressOptions, CompressReport, compress_view};
use crate::decode::{Archive, Destination};
use crate::error::{Error, Result};
use crate::gpu::paged::{PagedLayout, PagedShape, layer_infos, layer_kv, slot_mapping};
use crate::view::{CacheView, Paged, TensorView, TensorViewMut};

/// One layer's paged cache in host memory: the tensor of a joint layout
/// (`[2, num_blocks, block_size, kv_heads, head_dim]` for flash_attn,
/// `[num_blocks, 2, block_size, kv_heads, head_dim]` for flashinfer), or
/// the K and V tensors of `hnd` (`[num_blocks, kv_heads, block_size,
/// head_dim]` each), C-contiguous, elements of any dtype kvpack reads
/// (bf16, fp16, fp32, fp8).
#[derive(Debug, Clone, Copy)]
pub struct HostPaged<'a> {
    /// The layout.
    pub layout: PagedLayout,
    /// Its geometry.
    pub shape: PagedShape,
    /// The tensor (joint layouts) or the K tensor (hnd).
    pub k: Elems<'a>,
    /// The V tensor of hnd; `None` for the joint layouts.
    pub v: Option<Elems<'a>>,
}

/// Checks the tensor count and sizes of a host paged cache of `layout`
/// and `dims` (one tensor's shape) with tensors of `lens` elements, and
/// returns its geometry.
///
/// # Errors
/// [`Error::Parameter`] for a bad shape ([`PagedShape::from_dims`]), a
/// missing or extra V tensor, or a tensor of another size.
pub fn host_shape(layout: PagedLayout, dims: &[usize], lens: &[usize]) -> Result<PagedShape> {
    let shape = PagedShape::from_dims(layout, dims)?;
    let want = if layout.joint() { 1 } else { 2 };
    if lens.len() != want {
        return Err(Error::param(format!(
            "the {} layout takes {want} cache tensor(s) {}, got {}",
            layout.name(),
            layout.axes(),
            lens.len()
        )));
    }
    let n = shape.tensor_elements(layout);
    if let Some(l) = lens.iter().find(|&&l| l as u64 != n) {
        return Err(Error::param(format!(
            "paged cache tensor of {l} elements, {n} expected for {} of shape {dims:?}",
            layout.axes()
        )));
    }
    Ok(shape)
}

/// Where K or V lives: the tensor holding it and the element offset of
/// its (block 0, row 0, head 0) element.
fn target(layout: PagedLayout, shape: &PagedShape, kind: Kind) -> (usize, usize) {
    let (off, _) = shape.addr(layout, kind);
    let tensor = usize::from(!layout.joint() && kind == Kind::Value);
    (tensor, off as usize)
}

/// Encodes tokens `0..tokens` of layer `layer` of a host paged cache
/// (sequence blocks `block_ids`) into a complete kvpack file written to
/// `out`, with `codec` and `opts` as [`compress_view`]; no metadata or
/// token ids.
///
/// # Errors
/// [`Error::Parameter`] for a bad block table ([`slot_mapping`]), a
/// cache that does not match its shape, or as [`compress_view`] (a shape
/// the codec cannot take, NaN/inf rows named).
pub fn encode_paged<W: std::io::Write + Send>(
    cache: &HostPaged<'_>,
    block_ids: &[i64],
    tokens: u32,
    codec: &dyn Codec,
    layer: u32,
    opts: &CompressOptions,
    out: W,
) -> Result<(W, CompressReport)> {
    if tokens == 0 {
        return Err(Error::param("encode_paged needs at least one token"));
    }
    let s = cache.shape;
    let lens: Vec<usize> = [Some(cache.k), cache.v]
        .iter()
        .flatten()
        .map(|e| e.len())
        .collect();
    host_shape(cache.layout, &s.dims(cache.layout), &lens)?;
    let slots = slot_mapping(block_ids, &s, tokens)?;
    let dtype = cache.k.dtype();
    if cache.v.is_some_and(|v| v.dtype() != dtype) {
        return Err(Error::param("the K and V caches differ in dtype"));
    }
    let tensors = layer_infos(&s, dtype, layer, tokens)
        .into_iter()
        .map(|info| {
            let (t, off) = target(cache.layout, &s, info.kind);
            let data = if t == 0 {
                cache.k
            } else {
                cache.v.expect("checked: hnd has V")
            };
            let addr = s.addr(cache.layout, info.kind).1;
            let data = data.slice(off, data.len() - off);
            TensorView::paged(
                info,
                data,
                Paged {
                    addr,
                    slots: &slots,
                },
            )
        })
        .collect::<Result<Vec<_>>>()?;
    let view = CacheView {
        tensors,
        ..Default::default()
    };
    compress_view(&view, codec, opts, out, &|_| {})
}

/// Decodes stored tokens `tokens` (default: all) of layer `layer`'s K and
/// V in `archive` into the blocks `block_ids` of a host paged cache (the
/// tensors in `cache`, C-contiguous, of `layout` and shape `dims`, each
/// element type bf16, fp16, fp32 or fp8 as the tensors are; `dtype` says
/// which): token `t` goes to row `t % block_size` of block `block_ids[t /
/// block_size]`. Rows outside the range and blocks not named are not
/// touched. Pages are checked (CRCs, sections) before they are decoded.
///
/// # Errors
/// [`Error::Parameter`] when the file lacks the layer's K or V, they do not
/// fit the cache (batch 1, kv_heads, head_dim), the range exceeds the
/// stored tokens, or the block table is short, out of range or repeats;
/// [`Error::Format`] naming the page for corrupted data (pages decoded
/// before it stay written).
pub fn decode_paged(
    archive: &Archive<'_>,
    layer: u32,
    layout: PagedLayout,
    dims: &[usize],
    cache: &mut [ElemsMut<'_>],
    block_ids: &[i64],
    tokens: Option<Range<u32>>,
) -> Result<()> {
    let lens: Vec<usize> = cache.iter().map(|e| e.len()).collect();
    let shape = host_shape(layout, dims, &lens)?;
    let infos = archive.tensors();
    let found = layer_kv(&infos, layer, &shape)?;
    let stored = infos[found[0].0 as usize].tokens;
    if infos[found[1].0 as usize].tokens != stored {
        return Err(Error::param(format!(
            "layer {layer}'s K holds {stored} tokens, its V {}",
            infos[found[1].0 as usize].tokens
        )));
    }
    let range = tokens.unwrap_or(0..stored);
    if range.start > range.end || range.end > stored {
        return Err(Error::param(format!(
            "tokens {}..{} of layer {layer}: {stored} stored",
            range.start, range.end
        )));
    }
    let slots = slot_mapping(block_ids, &shape, stored)?;
    let slots = &slots[range.start as usize..range.end as usize];
    // K, then V: in the joint layouts both live in one buffer, which each
    // destination borrows whole in turn.
    for (tensor, kind) in found {
        let (t, off) = target(layout, &shape, kind);
        let data = &mut cache[t];
        let len = data.len();
        let info = crate::cache::TensorInfo {
            dtype: data.dtype(),
            tokens: range.end - range.start,
            ..infos[tensor as usize].clone()
        };
        let addr = shape.addr(layout, kind).1;
        let view =
            TensorViewMut::paged(info, data.slice_mut(off, len - off), Paged { addr, slots })?;
        archive.decode_into(
            vec![Destination {
                tensor: tensor as usize,
                first_token: range.start,
                view,
            }],
            None,
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{DType, TensorData};
    use crate::compress::compress_view as compress;
    use crate::view::Strides;

    const SHAPE: PagedShape = PagedShape {
        num_blocks: 9,
        block_size: 4,
        kv_heads: 2,
        head_dim: 64,
    };

    /// Deterministic bf16 values for every element of a layer's tensors.
    fn image(layout: PagedLayout, seed: u64) -> Vec<TensorData> {
        let n = SHAPE.tensor_elements(layout) as usize;
        let mut s = seed | 1;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            half::bf16::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0)
        };
        let count = if layout.joint() { 1 } else { 2 };
        (0..count)
            .map(|_| TensorData::Bf16((0..n).map(|_| next()).collect()))
            .collect()
    }

    /// The gathered `[1, kv_heads, tokens, head_dim]` K and V.
    fn gathered(
        layout: PagedLayout,
        img: &[TensorData],
        ids: &[i64],
        tokens: u32,
    ) -> [Vec<u16>; 2] {
        let mut flat: Vec<u16> = Vec::new();
        for t in img {
            let TensorData::Bf16(v) = t else {
                unreachable!()
            };
            flat.extend(v.iter().map(|x| x.to_bits()));
        }
        crate::gpu::paged::gather_host(&flat, layout, &SHAPE, ids, tokens).unwrap()
    }

    const LAYOUTS: [PagedLayout; 3] = [
        PagedLayout::FlashAttn,
        PagedLayout::FlashInfer,
        PagedLayout::Hnd,
    ];

    #[test]
    fn files_equal_compress_of_the_gathered_layer_and_decode_round_trips() {
        let ids = [7i64, 2, 5, 0, 8, 3];
        let opts = CompressOptions {
            layout: crate::plan::Layout {
                page_tokens: 8,
                sink: 2,
                recent: 3,
            },
            ..Default::default()
        };
        for layout in LAYOUTS {
            let img = image(layout, 11);
            let cache = HostPaged {
                layout,
                shape: SHAPE,
                k: img[0].as_elems(),
                v: img.get(1).map(|t| t.as_elems()),
            };
            for tokens in [21u32, 24, 1] {
                let [k, v] = gathered(layout, &img, &ids, tokens);
                let infos = layer_infos(&SHAPE, DType::Bf16, 3, tokens);
                let data = [
                    TensorData::Bf16(bytemuck::cast_vec(k)),
                    TensorData::Bf16(bytemuck::cast_vec(v)),
                ];
                let view = CacheView {
                    tensors: infos
                        .iter()
                        .zip(&data)
                        .map(|(i, d)| {
                            TensorView::new(i.clone(), d.as_elems(), Strides::head_major(i))
                                .unwrap()
                        })
                        .collect(),
                    ..Default::default()
                };
                for name in ["bdr64", "int4", "int3", "raw", "turbo:b4", "hqmq:s24r3"] {
                    let c = crate::codec::parse(name).unwrap();
                    let (want, _) =
                        compress(&view, c.as_ref(), &opts, Vec::new(), &|_| {}).unwrap();
                    let (got, _) =
                        encode_paged(&cache, &ids, tokens, c.as_ref(), 3, &opts, Vec::new())
                            .unwrap();
                    assert!(
                        got == want,
                        "{} {name} {tokens} tokens: files differ",
                        layout.name()
                    );
                    // Decode into a fresh cache at another block table; the
                    // gathered rows equal the file's own decode, and blocks
                    // not named stay untouched.
                    let ar = Archive::open(&got).unwrap();
                    let mut dst =
                        vec![
                            TensorData::zeros(DType::Bf16, SHAPE.tensor_elements(layout) as usize);
                            img.len()
                        ];
                    let other = [1i64, 6, 4, 8, 0, 2];
                    let mut outs: Vec<ElemsMut<'_>> =
                        dst.iter_mut().map(|t| t.as_elems_mut()).collect();
                    decode_paged(&ar, 3, layout, &SHAPE.dims(layout), &mut outs, &other, None)
                        .unwrap();
                    drop(outs);
                    let owned = ar
                        .decode(&Default::default(), Some(DType::Bf16), None)
                        .unwrap();
                    let [gk, gv] = gathered(layout, &dst, &other, tokens);
                    for (t, g) in owned.tensors.iter().zip([gk, gv]) {
                        let TensorData::Bf16(w) = &t.data else {
                            unreachable!()
                        };
                        let w: Vec<u16> = w.iter().map(|x| x.to_bits()).collect();
                        assert_eq!(g, w, "{} {name}: decoded rows", layout.name());
                    }
                    let used = SHAPE.blocks_for(tokens);
                    let untouched: Vec<i64> = (0..SHAPE.num_blocks as i64)
                        .filter(|b| !other[..used].contains(b))
                        .collect();
                    let [uk, uv] = gathered(
                        layout,
                        &dst,
                        &untouched,
                        SHAPE.block_size * untouched.len() as u32,
                    );
                    assert!(
                        uk.iter().chain(&uv).all(|&x| x == 0),
                        "{}: other blocks written",
                        layout.name()
                    );
                }
            }
        }
    }

    #[test]
    fn token_ranges_and_bad_tables_are_handled() {
        let layout = PagedLayout::FlashAttn;
        let img = image(layout, 5);
        let cache = HostPaged {
            layout,
            shape: SHAPE,
            k: img[0].as_elems(),
            v: None,
        };
        let ids = [3i64, 1, 4, 0, 2];
        let c = crate::codec::parse("bdr64").unwrap();
        let opts = CompressOptions::default();
        let (file, _) = encode_paged(&cache, &ids, 18, c.as_ref(), 0, &opts, Vec::new()).unwrap();
        let ar = Archive::open(&file).unwrap();
        let n = SHAPE.tensor_elements(layout) as usize;
        // Tokens 5..13 only: the others stay zero.
        let mut part = vec![TensorData::zeros(DType::Bf16, n)];
        let mut outs: Vec<ElemsMut<'_>> = part.iter_mut().map(|t| t.as_elems_mut()).collect();
        decode_paged(
            &ar,
            0,
            layout,
            &SHAPE.dims(layout),
            &mut outs,
            &ids,
            Some(5..13),
        )
        .unwrap();
        drop(outs);
        let mut full = vec![TensorData::zeros(DType::Bf16, n)];
        let mut outs: Vec<ElemsMut<'_>> = full.iter_mut().map(|t| t.as_elems_mut()).collect();
        decode_paged(&ar, 0, layout, &SHAPE.dims(layout), &mut outs, &ids, None).unwrap();
        drop(outs);
        let [pk, _] = gathered(layout, &part, &ids, 18);
        let [fk, _] = gathered(layout, &full, &ids, 18);
        let d = SHAPE.head_dim as usize;
        for h in 0..2 {
            for t in 0..18 {
                let row = (h * 18 + t) * d..(h * 18 + t + 1) * d;
                if (5..13).contains(&t) {
                    assert_eq!(pk[row.clone()], fk[row]);
                } else {
                    assert!(pk[row].iter().all(|&x| x == 0), "token {t} written");
                }
            }
        }
        let dims = SHAPE.dims(layout);
        let mut outs: Vec<ElemsMut<'_>> = full.iter_mut().map(|t| t.as_elems_mut()).collect();
        for (bad, why) in [
            (&[3i64, 1, 4][..], "block ids"),
            (&[3, 1, 4, 1, 2][..], "used twice"),
            (&[3, 1, 4, 9, 2][..], "outside"),
        ] {
            let e = decode_paged(&ar, 0, layout, &dims, &mut outs, bad, None).unwrap_err();
            assert!(e.to_string().contains(why), "{e}");
            let e = encode_paged(&cache, bad, 18, c.as_ref(), 0, &opts, Vec::new()).unwrap_err();
            assert!(e.to_string().contains(why), "{e}");
        }
        let e = decode_paged(&ar, 0, layout, &dims, &mut outs, &ids, Some(10..19)).unwrap_err();
        assert!(e.to_string().contains("18 stored"), "{e}");
        let e = decode_paged(&ar, 1, layout, &dims, &mut outs, &ids, None).unwrap_err();
        assert!(e.to_string().contains("no K tensor for layer 1"), "{e}");
        let e = decode_paged(
            &ar,
            0,
            PagedLayout::Hnd,
            &[9, 2, 4, 64],
            &mut outs,
            &ids,
            None,
        )
        .unwrap_err();
        assert!(e.to_string().contains("2 cache tensor"), "{e}");
    }
}
