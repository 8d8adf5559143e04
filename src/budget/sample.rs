//! The token sample a plan is measured on, and one codec round trip of it.

use std::borrow::Cow;

use crate::cache::{DType, ElemsMut, TensorInfo};
use crate::codec::{Codec, PageIn, PageOut};
use crate::error::{Error, Location, Result};
use crate::format::{Limits, PageFrame, PageHeader, PageMeta, PageView, Section};
use crate::view::TensorView;

/// Leading cache slots always in the sample (each stands for itself), so
/// that every sink window the planner tries is measured exactly.
pub(crate) const HEAD: u32 = 16;
/// Further slots spread evenly over the rest of the cache.
pub(crate) const SPREAD: u32 = 48;

/// Cache slots of one tensor that stand for all of them: `tokens[i]` stands
/// for `weights[i]` slots (the weights sum to the tensor's token count).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Sample {
    /// Sampled slots, ascending.
    pub tokens: Vec<u32>,
    /// Slots each sampled slot stands for.
    pub weights: Vec<f32>,
}

impl Sample {
    /// The sample of a tensor of `tokens` slots: every slot when there are
    /// at most `HEAD + SPREAD`, else slots `0..HEAD` and `SPREAD` slots at
    /// the middles of equal strides of the rest.
    pub fn of(tokens: u32) -> Sample {
        if tokens <= HEAD + SPREAD {
            return Sample {
                tokens: (0..tokens).collect(),
                weights: vec![1.0; tokens as usize],
            };
        }
        let rest = f64::from(tokens - HEAD);
        let step = rest / f64::from(SPREAD);
        let mut t: Vec<u32> = (0..HEAD).collect();
        t.extend((0..SPREAD).map(|i| HEAD + ((f64::from(i) + 0.5) * step) as u32));
        let mut w = vec![1.0f32; HEAD as usize];
        w.extend(std::iter::repeat_n(step as f32, SPREAD as usize));
        Sample {
            tokens: t,
            weights: w,
        }
    }

    /// Number of sampled slots.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }
}

/// Rows of `t` at the sampled slots as f32, plane-major
/// `[planes, sample, head_dim]`.
pub(crate) fn load_rows(t: &TensorView<'_>, s: &Sample) -> Vec<f32> {
    let d = t.info.head_dim as usize;
    let n = s.len();
    let mut out = vec![0.0f32; t.info.planes() * n * d];
    for p in 0..t.info.planes() {
        for (i, &tok) in s.tokens.iter().enumerate() {
            let at = (p * n + i) * d;
            t.load_row(p, tok as usize, &mut out[at..at + d]);
        }
    }
    out
}

/// One codec round trip of sampled rows: the reconstruction and what the
/// rows cost.
#[derive(Debug, Clone)]
pub(crate) struct RoundTrip {
    /// Decoded rows, same layout as the input.
    pub rows: Vec<f32>,
    /// Section payload bytes of the sample page.
    pub payload: u64,
    /// The part of `payload` that does not grow with the page's tokens
    /// (known for hqmq trials; 0 otherwise).
    pub per_page: u64,
    /// Sampled slots per plane the page held.
    pub tokens: usize,
    /// Sections of the page.
    pub sections: usize,
}

/// What the encoder of a round trip returns.
pub(crate) enum Encoded {
    /// The page's sections: the round trip decodes them.
    Sections(Vec<Section>),
    /// The decoded page was written to the encoder's buffer (bit for bit
    /// what the codec's decode returns); the sections' payload bytes and
    /// number, and the payload bytes that do not grow with the tokens.
    Decoded {
        payload: u64,
        sections: usize,
        per_page: u64,
    },
}

/// The encoder of a round trip: encodes a page, given a buffer for the
/// decoded page (`[planes, n, head_dim]` f32).
pub(crate) type Encoder<'a> = dyn FnMut(&PageIn<'_>, &mut [f32]) -> Result<Encoded> + 'a;

/// Encodes `rows` (`[planes, n, head_dim]`, f32) as one page of a tensor
/// shaped like `info` with `n` tokens by `encode` (the encoder of `codec`),
/// and decodes it again with `codec` unless the encoder did.
///
/// # Errors
/// The codec's encode or decode error.
pub(crate) fn round_trip(
    codec: &dyn Codec,
    encode: &mut Encoder<'_>,
    info: &TensorInfo,
    rows: &[f32],
    n: usize,
) -> Result<RoundTrip> {
    let d = info.head_dim as usize;
    let planes = info.planes();
    let mut info = info.clone();
    info.dtype = DType::F32;
    info.tokens = u32::try_from(n).map_err(|_| Error::param("sample too large"))?;
    let page = PageIn {
        source: None,
        tensor: &info,
        token_start: 0,
        tokens: info.tokens,
        planes: rows
            .chunks_exact(n * d)
            .map(crate::cache::Elems::F32)
            .collect(),
    };
    let mut out = vec![0.0f32; planes * n * d];
    let sections = match encode(&page, &mut out)? {
        Encoded::Decoded {
            payload,
            sections,
            per_page,
        } => {
            return Ok(RoundTrip {
                rows: out,
                payload,
                per_page,
                tokens: n,
                sections,
            });
        }
        Encoded::Sections(s) => s,
    };
    let payload = sections.iter().map(|s| s.data.len() as u64).sum();
    let meta = PageMeta {
        tensor: 0,
        token_start: 0,
        tokens: info.tokens,
        codec: 0,
    };
    let frame = PageFrame::encode(meta, &sections, None, 64)?;
    let at = Location::Header;
    let header = PageHeader::parse(
        frame.bytes[..64].try_into().expect("64-byte frame header"),
        &at,
        &Limits::default(),
    )?;
    let stored = &frame.bytes[64..64 + header.stored_len as usize];
    let view = PageView::from_stored(header, Cow::Borrowed(stored), 0, "sample".into(), &at)?;
    let mut dst = PageOut {
        scatter: None,
        tensor: &info,
        tokens: info.tokens,
        planes: out.chunks_exact_mut(n * d).map(ElemsMut::F32).collect(),
    };
    codec.decode(&view, &mut dst)?;
    Ok(RoundTrip {
        rows: out,
        payload,
        per_page: 0,
        tokens: n,
        sections: sections.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_weights_cover_every_slot() {
        for t in [0u32, 1, 63, 64, 65, 511, 520, 1024, 100_000] {
            let s = Sample::of(t);
            let sum: f64 = s.weights.iter().map(|&w| f64::from(w)).sum();
            assert!(
                (sum - f64::from(t)).abs() < 1e-3 * f64::from(t.max(1)),
                "{t}: {sum}"
            );
            assert!(s.tokens.windows(2).all(|w| w[0] < w[1]), "{t}");
            assert!(s.tokens.iter().all(|&x| x < t.max(1)));
        }
        assert_eq!(Sample::of(520).tokens[..4], [0, 1, 2, 3]);
    }
}
