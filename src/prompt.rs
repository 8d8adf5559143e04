//! Prompt-cache reuse with sliding-window layers: how much of a prompt a
//! stored cache can actually serve.
//!
//! A cache of a prefix of `P` tokens holds, per layer, the token count `T`
//! of its latest commit. A global-attention layer holds positions `0..P`
//! (`T == P`). A sliding-window layer whose window rolled holds only the
//! last `T < P` positions, `P - T .. P` (Gemma 3's sliding layers hold
//! positions 9..519 of a 520-token prefill). Reusing the cache for a prompt
//! whose first `m` tokens match the stored ones means continuing from
//! position `m`; a rolled layer then lacks positions `0 .. P - T`, which the
//! window of a position `m < P` may still need, and keeps positions past
//! `m` that belong to another continuation. So a cache with a rolled layer
//! serves exactly its whole prefix (`m == P`) or nothing.

use crate::decode::Archive;
use crate::error::Result;

/// One layer whose window rolled: it holds positions `first..end` only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RolledLayer {
    /// Layer index.
    pub layer: u32,
    /// First position held (`P - T`).
    pub first: u32,
    /// One past the last position held (`P`).
    pub end: u32,
}

/// What a cache can serve for a prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Tokens of the cached prefix (`P`, the recorded token ids).
    pub cached: usize,
    /// Leading prompt tokens equal to the cached ones.
    pub matching: usize,
    /// Leading prompt tokens the cache can serve: `matching` when no layer
    /// rolled or the whole prefix matches, else 0.
    pub usable: usize,
    /// Layers whose sliding window rolled (positions they no longer hold).
    pub rolled: Vec<RolledLayer>,
    /// Why `usable < matching`, when it is.
    pub reason: Option<String>,
}

/// Matches `prompt` against the cache in `archive`, accounting for every
/// layer's window (module docs).
///
/// # Errors
/// As [`Archive::matching_prefix`]: another model, or no token ids.
pub fn match_prefix(archive: &Archive<'_>, model: &str, prompt: &[u32]) -> Result<PrefixMatch> {
    let matching = archive.matching_prefix(model, prompt)?;
    let cached = archive.token_ids().len();
    let mut rolled: Vec<RolledLayer> = Vec::new();
    for t in archive.tensors() {
        let p = cached as u32;
        if t.tokens < p && rolled.last().is_none_or(|r| r.layer != t.layer) {
            rolled.push(RolledLayer {
                layer: t.layer,
                first: p - t.tokens,
                end: p,
            });
        }
    }
    let (usable, reason) = if rolled.is_empty() || matching == cached {
        (matching, None)
    } else {
        let r = &rolled[0];
        (
            0,
            Some(format!(
                "{} sliding-window layers rolled (layer {} holds positions {}..{} only): the cache \
                 serves its whole {cached}-token prefix or nothing, and the prompt matches {matching}",
                rolled.len(),
                r.layer,
                r.first,
                r.end
            )),
        )
    };
    Ok(PrefixMatch {
        cached,
        matching,
        usable,
        rolled,
        reason,
    })
}
