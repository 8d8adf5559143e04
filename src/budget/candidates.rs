//! The operating points the planner chooses from: codec names and sink
//! windows. One list for every model; only names whose codec accepts a
//! tensor's shape ([`crate::codec::Codec::check`]) are tried on it.

/// Codec names tried on every tensor, from cheap to expensive. `{h}` in a
/// name (none at present) would be replaced by the Walsh-Hadamard block of
/// `bdr`: the largest power of two dividing `head_dim`, at most 128.
///
/// - Hurwitz-quaternion VQ (`hqmq`, Swain et al., arXiv:2605.27646) from
///   2.3 to 4.3 bits: codebook size `24 S` and radius bits `r` are free
///   parameters of its bitstream (`S` at most 96 keeps encoding fast), with
///   and without the fp16 outlier chunks of `+med3`, and with per-channel
///   centring (`+ctr`, format/codecs/hqmq.md section 11; trialled only
///   with a sink window, see `Candidate::windowed`);
/// - TurboQuant-MSE at 4 bits (`turbo:b4`, arXiv:2504.19874);
/// - `int8` and `raw` for tensors worth almost every bit.
///
/// Rotation-based codecs at 2-3 bits (`turbo:b2`/`b3`, `bdr:b3`, `octopus`)
/// and `kivi` are left out: the attention-output distortion of
/// [`super::distortion`] rates them better than `hqmq` at equal bits, but on
/// Gemma-3-270M's perplexity they are far worse (turbo:b3 +22% against
/// hqmq:s24r3 +2.8% at 3.1 bits), and a plan using them lost to every
/// single codec (README, "Planned bits").
pub(crate) const CODECS: &[&str] = &[
    "hqmq:s6r2",
    "hqmq:s12r2",
    "hqmq:s24r2",
    "hqmq:s24r3",
    "hqmq:s48r3",
    "hqmq:s48r4",
    "hqmq:s96r4",
    "hqmq:s96r5",
    "hqmq:s96r6",
    "hqmq:s24r3+med3",
    "hqmq:s48r4+med3",
    "hqmq:s96r4+med3",
    "hqmq:s96r5+med3",
    "hqmq:s12r2+ctr",
    "hqmq:s24r3+ctr",
    "hqmq:s48r4+ctr",
    "hqmq:s96r4+ctr",
    "hqmq:s96r5+ctr",
    "turbo:b4",
    "int8",
    "raw",
];

/// Sink windows tried on every tensor: leading cache slots kept at source
/// precision (attention sinks, Xiao et al., "Efficient Streaming Language
/// Models with Attention Sinks", arXiv:2309.17453).
pub(crate) const SINKS: &[u32] = &[0, 1, 4, 16];

/// The codec name of `pattern` for tensors of `head_dim`, or `None` when
/// the pattern does not apply (no power-of-two block of at least 2).
pub(crate) fn name_for(pattern: &str, head_dim: u32) -> Option<String> {
    if !pattern.contains("{h}") {
        return Some(pattern.to_string());
    }
    let h = 1u32 << head_dim.trailing_zeros().min(7);
    (h >= 2).then(|| pattern.replace("{h}", &h.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bdr_block_follows_head_dim() {
        assert_eq!(name_for("bdr{h}:b3", 256).as_deref(), Some("bdr128:b3"));
        assert_eq!(name_for("bdr{h}:b3", 64).as_deref(), Some("bdr64:b3"));
        assert_eq!(name_for("bdr{h}:b3", 96).as_deref(), Some("bdr32:b3"));
        assert_eq!(name_for("bdr{h}:b3", 7), None);
        assert_eq!(name_for("kivi:2", 7).as_deref(), Some("kivi:2"));
    }

    #[test]
    fn every_candidate_parses() {
        for p in CODECS {
            let n = name_for(p, 128).unwrap();
            crate::codec::parse(&n).unwrap_or_else(|e| panic!("{n}: {e}"));
        }
    }
}
