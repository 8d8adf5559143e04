//! Side tables: per-tensor data a decode (or encode) kernel needs besides
//! the page body, built on the host from the codec's parameter block and
//! the tensor (layer, kind, heads, head_dim) exactly as the CPU decoder
//! derives it, then placed in device memory next to the pages.
//!
//! | family | layout (little-endian) |
//! |---|---|
//! | polar | the `2^m` directions `(cos, sin)` of the parameter block, f32 pairs |
//! | innerq K with normalization | the layer's factors, f32 `[heads][head_dim]` |
//! | octopus | float4 `n(a, b) = (x, y, r, 0)` at `a * 2^b_dir + b`, the `2^b_norm` norm centroids, then at [`super::codecs::sphere_sign_offset`] per kv head the `D` rotation sign bits and, with QJL, the `D` bits of `s'` (1 = negative, LSB-first); when `2 b_dir + b_norm <= 10`, then (16-aligned) the products `n(a, b)_k * C_rho[jn]` as float4 at `((a + b 2^b_dir) 2^b_norm) + jn` |
//! | turbo | the `2^b` coordinate centroids, then the signs as for octopus |
//! | hqmq decode | u64 `O^G` (0 when it is `2^64`), 8 zero bytes, then per kv head the `24 S` joint codewords (float4) |
//! | hqmq encode | per kv head the `S` secondaries then the `24 S` joint codewords (float4) |
//!
//! kivi, InnerQ without normalization and the raw / affine families
//! need none (nor does a new family unless it adds a row here).

use crate::cache::TensorInfo;
use crate::codec::Codec;
use crate::codec::hqmq::Hqmq;
use crate::codec::hqmq::codebook::{Codebook, secondaries};
use crate::codec::innerq::InnerQ;
use crate::codec::octopus::Octopus;
use crate::codec::polar::Polar;
use crate::codec::sphere::{self, PURPOSE_QJL, PURPOSE_ROTATION};
use crate::codec::turbo::Turbo;
use crate::error::{Error, Result};
use crate::kernels::radix::Groups;

use super::codecs::{octopus_product_table, sphere_sign_offset};
use super::spec::KernelCodec;

fn put_f32s(out: &mut Vec<u8>, v: &[f32]) {
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
}

/// Sign bits (1 = negative, LSB-first) of a ±1 vector.
fn sign_bits(s: &[f32]) -> Vec<u8> {
    let mut b = vec![0u8; s.len().div_ceil(8)];
    for (i, &v) in s.iter().enumerate() {
        if v < 0.0 {
            b[i / 8] |= 1 << (i % 8);
        }
    }
    b
}

/// The decode side table of tensor `t` for pages of `codec` (kernel family
/// `kc`), or `None` when the kernels need none.
///
/// # Errors
/// [`Error::Parameter`] when the parameter block lacks what `t` needs (an
/// InnerQ normalization entry, an octopus / turbo codebook for its
/// head_dim), as the CPU decoder reports it.
pub fn table(codec: &dyn Codec, kc: KernelCodec, t: &TensorInfo) -> Result<Option<Vec<u8>>> {
    let p = codec.params();
    match kc {
        KernelCodec::Polar { .. } => {
            let mut out = Vec::new();
            for d in Polar::from_params(&p)?.directions() {
                put_f32s(&mut out, d);
            }
            Ok(Some(out))
        }
        KernelCodec::InnerQ { norm: true, .. } => {
            let c = InnerQ::from_params(&p)?;
            match c.factors_for(t).map_err(Error::param)? {
                Some(e) => {
                    let mut out = Vec::new();
                    put_f32s(&mut out, &e.factors);
                    Ok(Some(out))
                }
                None => Ok(None),
            }
        }
        KernelCodec::Sphere { octopus, a, b, qjl } => {
            sphere_table(codec, &p, t, octopus, a, b, qjl).map(Some)
        }
        KernelCodec::Hqmq { s, o, g, .. } => {
            let limit = Groups::new(u64::from(o), u32::from(g))
                .map(|gr| gr.limit())
                .ok_or_else(|| Error::param("hqmq parameters: invalid digit grouping"))?;
            let seed = Hqmq::from_params(&p)?.seed;
            let mut out = Vec::new();
            out.extend_from_slice(&u64::try_from(limit).unwrap_or(0).to_le_bytes());
            out.extend_from_slice(&[0u8; 8]);
            for head in 0..t.heads {
                let cb = hqmq_codebook(seed, t, head, s);
                for q in &cb.joint {
                    put_f32s(&mut out, q);
                }
            }
            Ok(Some(out))
        }
        // The families whose kernels read everything from the page (raw,
        // affine, kivi, innerq without normalization): no side table.
        _ => Ok(None),
    }
}

/// The codebook of kv head `head` of `t` for an hqmq codec of `seed`.
fn hqmq_codebook(seed: u64, t: &TensorInfo, head: u32, s: u32) -> Codebook {
    Codebook::new(secondaries(seed, t.layer, head, t.kind, s as usize))
}

/// The hqmq encode side table of `t`: per kv head the `S` secondaries,
/// then the `24 S` joint codewords, float4 each.
///
/// # Errors
/// [`Error::Parameter`] when the codec's parameter block does not parse.
pub fn hqmq_encode_table(codec: &dyn Codec, t: &TensorInfo, s: u32) -> Result<Vec<u8>> {
    let seed = Hqmq::from_params(&codec.params())?.seed;
    let mut out = Vec::new();
    for head in 0..t.heads {
        let cb = hqmq_codebook(seed, t, head, s);
        for q in cb.secondary.iter().chain(&cb.joint) {
            put_f32s(&mut out, q);
        }
    }
    Ok(out)
}

fn sphere_table(
    codec: &dyn Codec,
    p: &[u8],
    t: &TensorInfo,
    octopus: bool,
    a: u8,
    b: u8,
    qjl: bool,
) -> Result<Vec<u8>> {
    let missing = || sphere::no_codebook(&codec.name(), "codebook", t);
    let (oct, tur);
    let (opts, dirs_table, book) = if octopus {
        oct = Octopus::from_params(p)?;
        let book = oct.norm_codebook(t.head_dim).ok_or_else(missing)?;
        (oct.options, Some(oct.dir_tables()), book)
    } else {
        tur = Turbo::from_params(p)?;
        let book = tur.coord_codebook(t.head_dim).ok_or_else(missing)?;
        (tur.options, None, book)
    };
    let mut out = Vec::new();
    if let Some(tables) = dirs_table {
        for x in 0..1usize << a {
            for y in 0..1usize << a {
                let n = tables.dir(x, y);
                put_f32s(&mut out, &[n[0], n[1], n[2], 0.0]);
            }
        }
    }
    put_f32s(&mut out, book);
    out.resize(sphere_sign_offset(octopus, a, b) as usize, 0);
    let d = t.head_dim as usize;
    for head in 0..t.heads {
        let s = sphere::signs_for(opts.seed, t.layer, head, t.kind, PURPOSE_ROTATION, d);
        out.extend_from_slice(&sign_bits(&s));
        if qjl {
            let s2 = sphere::signs_for(opts.seed, t.layer, head, t.kind, PURPOSE_QJL, d);
            out.extend_from_slice(&sign_bits(&s2));
        }
    }
    if let Some(dirs) = dirs_table.filter(|_| octopus_product_table(a, b)) {
        // Products n(x, y)_k * C_rho[jn] (the decoder's f32 products), at
        // ((x | y << b_dir) << b_norm) | jn.
        out.resize(out.len().next_multiple_of(16), 0);
        for pair in 0..1usize << (2 * a) {
            let (x, y) = (pair & ((1 << a) - 1), pair >> a);
            let n = dirs.dir(x, y);
            for &rho in book {
                put_f32s(&mut out, &[n[0] * rho, n[1] * rho, n[2] * rho, 0.0]);
            }
        }
    }
    Ok(out)
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
        assert_eq!(&tab[32 + 16 + 8..32 + 32], &sign_bits(&s)[..]);
    }
}
