//! Side tables: per-tensor data a decode (or encode) kernel needs besides
//! the page body, built on the host from the codec's parameter block and
//! the tensor (layer, kind, heads, head_dim) exactly as the CPU decoder
//! derives it, then placed in device memory next to the pages.
//!
//! | family | layout (little-endian) |
//! |---|---|
//! | polar | the `2^m` directions `(cos, sin)` of the parameter block, f32 pairs |
//! | innerq K with normalization | the layer's factors, f32 `[heads][head_dim]` |
//! | octopus | float4 `n(a, b) = (x, y, r, 0)` at `a * 2^b_dir + b`, the `2^b_norm` norm centroids, then at `gpu::family::sphere_sign_offset` per kv head the `D` rotation sign bits and, with QJL, the `D` bits of `s'` (1 = negative, LSB-first); when `2 b_dir + b_norm <= 10`, then (16-aligned) the products `n(a, b)_k * C_rho[jn]` as float4 at `((a + b 2^b_dir) 2^b_norm) + jn` |
//! | turbo | the `2^b` coordinate centroids, then the signs as for octopus |
//! | hqmq decode | u64 `O^G` (0 when it is `2^64`), 8 zero bytes, then per kv head the `24 S` joint codewords (float4) |
//! | hqmq encode | per kv head the `S` secondaries then the `24 S` joint codewords (float4) |
//!
//! kivi, InnerQ without normalization and the raw / affine families
//! need none (nor does a new family unless it adds a row here). Each table
//! is built by its family's `side_table` (`gpu/family/*.rs`); this module
//! packs them per archive.

use crate::cache::TensorInfo;
use crate::codec::Codec;
use crate::error::{Error, Result};

use super::spec::KernelCodec;

/// The decode side table of tensor `t` for pages of `codec` (kernel family
/// `kc`), or `None` when the kernels need none: the family's
/// `gpu::family::GpuFamily::side_table`.
///
/// # Errors
/// [`Error::Parameter`] when the parameter block lacks what `t` needs (an
/// InnerQ normalization entry, an octopus / turbo codebook for its
/// head_dim), as the CPU decoder reports it.
pub fn table(codec: &dyn Codec, kc: KernelCodec, t: &TensorInfo) -> Result<Option<Vec<u8>>> {
    super::family::of(kc).side_table(codec, kc, t)
}

/// Side tables of an archive: all tables in one byte buffer, and the
/// offset of each `(codec slot, tensor)` pair's table in it.
pub type Tables = (Vec<u8>, std::collections::BTreeMap<(u16, u32), u64>);

/// The side tables of the `(codec slot, tensor)` pairs of an archive, packed
/// into one buffer (each table 256-aligned): `(bytes, offset of each pair's
/// table)`; pairs without a table are absent from the map.
///
/// # Errors
/// As [`table`], and [`Error::Unsupported`] for a codec without kernels.
pub fn for_archive(
    archive: &crate::decode::Archive<'_>,
    pairs: impl IntoIterator<Item = (u16, u32)>,
) -> Result<Tables> {
    let mut bytes = Vec::new();
    let mut at = std::collections::BTreeMap::new();
    let infos = archive.tensors();
    for (c, t) in pairs {
        if at.contains_key(&(c, t)) {
            continue;
        }
        let info = infos
            .get(t as usize)
            .ok_or_else(|| Error::param(format!("no tensor {t}")))?;
        let codec = archive.codec(usize::from(c));
        let kc = KernelCodec::of(codec, info)?;
        if let Some(tab) = table(codec, kc, info)? {
            bytes.resize(bytes.len().next_multiple_of(256), 0);
            at.insert((c, t), bytes.len() as u64);
            bytes.extend_from_slice(&tab);
        }
    }
    Ok((bytes, at))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{DType, Kind};
    use crate::codec::sphere::{self, PURPOSE_QJL};

    fn info(kind: Kind, d: u32) -> TensorInfo {
        TensorInfo {
            name: "t".into(),
            layer: 3,
            kind,
            dtype: DType::Bf16,
            batch: 1,
            heads: 2,
            tokens: 4,
            head_dim: d,
        }
    }

    #[test]
    fn tables_have_the_documented_layout() {
        let c = crate::codec::parse("polar:m4n4").unwrap();
        let t = info(Kind::Key, 64);
        let kc = KernelCodec::of(c.as_ref(), &t).unwrap();
        assert_eq!(table(c.as_ref(), kc, &t).unwrap().unwrap().len(), 128);
        let c = crate::codec::parse("hqmq:s24r3").unwrap();
        let kc = KernelCodec::of(c.as_ref(), &t).unwrap();
        let tab = table(c.as_ref(), kc, &t).unwrap().unwrap();
        assert_eq!(tab.len(), 16 + 2 * 24 * 24 * 16);
        assert_eq!(
            u64::from_le_bytes(tab[..8].try_into().unwrap()),
            9u64.pow(17)
        );
        let c = crate::codec::parse("turbo:b3+qjl").unwrap();
        let c = c.prepare(
            &crate::cache::KvCache {
                tensors: vec![
                    crate::cache::Tensor::new(
                        info(Kind::Key, 64),
                        crate::cache::TensorData::Bf16(vec![half::bf16::ONE; 2 * 4 * 64]),
                    )
                    .unwrap(),
                ],
                ..Default::default()
            }
            .view(),
            &crate::plan::Layout::default(),
        );
        let c = c.unwrap().unwrap();
        let kc = KernelCodec::of(c.as_ref(), &t).unwrap();
        let tab = table(c.as_ref(), kc, &t).unwrap().unwrap();
        // 8 centroids (32 bytes), then 2 heads x 2 x 64 bits.
        assert_eq!(tab.len(), 32 + 2 * 2 * 8);
        let s = sphere::signs_for(0, 3, 1, Kind::Key, PURPOSE_QJL, 64);
        assert_eq!(
            &tab[32 + 16 + 8..32 + 32],
            &super::super::family::sign_bits(&s)[..]
        );
    }
}
