//! Codec evaluation on a real cache: compress in memory, decode, and
//! measure size, reconstruction error and attention-output error with the
//! cache's own queries. Used by `kvpack eval` and the fixture tests so that
//! every codec is measured the same way. [`synthetic`] reproduces the
//! OCTOPUS paper's synthetic tables (`kvpack eval --synthetic`).

pub mod synthetic;

use std::time::Instant;

use crate::cache::{DType, Kind};
use crate::codec::Codec;
use crate::compress::{CompressOptions, compress};
use crate::decode::{Archive, Selection};
use crate::error::Result;
use crate::io::safetensors::{ATTN_SCALE_KEY, Loaded};
use crate::metrics::{TensorError, attention_error, tensor_error};

/// Mean errors over the K (or V) tensors of all layers, each layer weighted
/// equally.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct KindSummary {
    /// Mean relative MSE.
    pub rel_mse: f64,
    /// Mean SNR in dB.
    pub snr_db: f64,
    /// Mean per-vector cosine.
    pub cosine: f64,
    /// Largest absolute error over all tensors.
    pub max_abs_err: f64,
}

/// The result of [`evaluate`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Evaluation {
    /// Canonical codec name.
    pub codec: String,
    /// File bits per element, everything included (headers, scales,
    /// windows, index, padding).
    pub bits_per_element: f64,
    /// File bytes.
    pub bytes: u64,
    /// Key errors.
    pub k: KindSummary,
    /// Value errors.
    pub v: KindSummary,
    /// MLA latent errors; `None` when the cache has no latent tensors.
    pub latent: Option<KindSummary>,
    /// Mean over layers with queries of the attention-output relative error
    /// `||O - O^|| / ||O||`; `None` when the cache has no queries.
    pub attention: Option<f64>,
    /// Per layer `(layer, attention error)`.
    pub attention_per_layer: Vec<(u32, f64)>,
    /// Wall time to compress, seconds (all threads).
    pub encode_seconds: f64,
    /// Wall time to decode to bf16, seconds (all threads).
    pub decode_seconds: f64,
}

fn summarize(errs: &[&TensorError]) -> KindSummary {
    let n = errs.len().max(1) as f64;
    KindSummary {
        rel_mse: errs.iter().map(|e| e.rel_mse).sum::<f64>() / n,
        snr_db: errs.iter().map(|e| e.snr_db).sum::<f64>() / n,
        cosine: errs.iter().map(|e| e.cosine).sum::<f64>() / n,
        max_abs_err: errs.iter().map(|e| e.max_abs_err).fold(0.0, f64::max),
    }
}

/// Compresses `loaded.cache` with `codec`, decodes it, and measures it
/// against the original. The attention scale is the metadata value
/// `kvpack.attn_scale` when present, else `1/sqrt(head_dim)`.
///
/// # Errors
/// Any compression or decoding error.
pub fn evaluate(loaded: &Loaded, codec: &dyn Codec, opts: &CompressOptions) -> Result<Evaluation> {
    let cache = &loaded.cache;
    let t = Instant::now();
    let (bytes, _) = compress(cache, codec, opts, Vec::new(), &|_| {})?;
    let encode_seconds = t.elapsed().as_secs_f64();
    let ar = Archive::open(&bytes)?;
    let t = Instant::now();
    ar.decode(&Selection::default(), Some(DType::Bf16), None)?;
    let decode_seconds = t.elapsed().as_secs_f64();
    let dec = ar.decode(&Selection::default(), Some(DType::F32), None)?;
    let mut errs = Vec::new();
    for (o, d) in cache.tensors.iter().zip(&dec.tensors) {
        // A tensor without elements (a layer with no tokens) has no error
        // to average in.
        if o.info.elements() > 0 {
            errs.push((o.info.kind, tensor_error(o, d)?));
        }
    }
    let pick = |k: Kind| {
        errs.iter()
            .filter(|e| e.0 == k)
            .map(|e| &e.1)
            .collect::<Vec<_>>()
    };
    let scale_meta = cache
        .metadata
        .get(ATTN_SCALE_KEY)
        .and_then(|s| s.parse::<f64>().ok())
        // A scale that is not a positive number: the default.
        .filter(|s| s.is_finite() && *s > 0.0);
    let mut per_layer = Vec::new();
    for q in &loaded.queries {
        let (Some(k), Some(v), Some(k2), Some(v2)) = (
            cache.get(q.layer, Kind::Key),
            cache.get(q.layer, Kind::Value),
            dec.get(q.layer, Kind::Key),
            dec.get(q.layer, Kind::Value),
        ) else {
            continue;
        };
        let scale = scale_meta.unwrap_or(1.0 / f64::from(k.info.head_dim).sqrt());
        per_layer.push((q.layer, attention_error(q, k, v, k2, v2, scale)?));
    }
    let attention = (!per_layer.is_empty())
        .then(|| per_layer.iter().map(|x| x.1).sum::<f64>() / per_layer.len() as f64);
    Ok(Evaluation {
        codec: ar.codec(0).name(),
        bits_per_element: 8.0 * bytes.len() as f64 / cache.elements().max(1) as f64,
        bytes: bytes.len() as u64,
        k: summarize(&pick(Kind::Key)),
        v: summarize(&pick(Kind::Value)),
        latent: Some(pick(Kind::Latent))
            .filter(|l| !l.is_empty())
            .map(|l| summarize(&l)),
        attention,
        attention_per_layer: per_layer,
        encode_seconds,
        decode_seconds,
    })
}
