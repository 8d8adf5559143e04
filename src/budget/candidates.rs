//! The operating points the planner chooses from: codec names and sink
//! windows. One list for every model; only names whose codec accepts a
//! tensor's shape ([`crate::codec::Codec::check`]) are tried on it.

/// Codec names tried on every tensor, from cheap to expensive. `{h}` is
/// replaced by the Walsh-Hadamard block of `bdr`: the largest power of two
/// dividing `head_dim`, at most 128.
///
/// - TurboQuant-MSE (`turbo`, arXiv:2504.19874) at 2-4 bits: fast, good
///   on well-spread vectors;
/// - Hurwitz-quaternion VQ (`hqmq`, arXiv:2605.27646) from 2.3 to 4.3 bits
///   (codebook size `24 S` and radius bits `r` are free parameters of the
///   bitstream; `S` is kept at most 96 so encoding stays fast);
/// - block-Hadamard INT (`bdr`) and per-channel KIVI (`kivi`,
///   arXiv:2402.02750) at 3-6 bits;
/// - `int8` and `raw` for tensors worth almost every bit.
pub(crate) const CODECS: &[&str] = &[
    "turbo:b2",
    "turbo:b3",
    "turbo:b4",
    "hqmq:s12r2",
    "hqmq:s24r2",
    "hqmq:s24r3",
    "hqmq:s48r3",
    "hqmq:s48r4",
    "hqmq:s96r4",
    "hqmq:s96r5",
    "hqmq:s96r6",
    "bdr{h}:b3",
    "bdr{h}:b4",
    "bdr{h}:b5",
    "bdr{h}:b6",
    "kivi:2",
    "kivi:3",
    "kivi:4",
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
