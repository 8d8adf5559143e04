//! Page planning: how a tensor's tokens are cut into pages.
//!
//! Token positions are cache slots of one layer, `0..tokens`. With a sink
//! window `S` and a recent window `R`, slots `[0, S)` and `[T-R, T)` are
//! stored as `raw` pages at source precision; the body `[S, T-R)` is cut
//! into pages of `page_tokens` at absolute boundaries `S + k*page_tokens`,
//! so appending at a page boundary gives the same pages as writing the
//! whole cache at once.

use crate::cache::TensorInfo;
use crate::error::{Error, Result};

/// Page size and high-precision windows, in tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Tokens per codec page (at least 1). Default 256.
    pub page_tokens: u32,
    /// Leading tokens kept at source precision (attention sinks). Default 0.
    pub sink: u32,
    /// Trailing tokens kept at source precision. Default 0.
    pub recent: u32,
}

impl Default for Layout {
    fn default() -> Self {
        Layout {
            page_tokens: 256,
            sink: 0,
            recent: 0,
        }
    }
}

/// One planned page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedPage {
    /// Index into the tensor list.
    pub tensor: u32,
    /// First token.
    pub token_start: u32,
    /// Token count (at least 1).
    pub tokens: u32,
    /// True for sink/recent window pages (stored with `raw`).
    pub raw: bool,
}

/// Plans the pages covering tokens `[from[t], tensors[t].tokens)` of every
/// tensor, in layer-major order (tensor order, then token order). `from`
/// is all zeros for a new file and the stored token counts for an append.
///
/// # Errors
/// [`Error::Parameter`] when `page_tokens` is 0 or `from` has the wrong
/// length or exceeds a token count.
pub fn plan(tensors: &[TensorInfo], from: &[u32], layout: Layout) -> Result<Vec<PlannedPage>> {
    plan_each(tensors, from, &vec![layout; tensors.len()])
}

/// Like [`plan`] with one layout per tensor (`layouts[t]` for tensor `t`),
/// as a budget plan ([`crate::budget`]) gives each tensor its own windows.
///
/// # Errors
/// As [`plan`]; also when `layouts` has the wrong length.
pub fn plan_each(
    tensors: &[TensorInfo],
    from: &[u32],
    layouts: &[Layout],
) -> Result<Vec<PlannedPage>> {
    if layouts.iter().any(|l| l.page_tokens == 0) {
        return Err(Error::param("--page-tokens must be at least 1"));
    }
    if from.len() != tensors.len() || layouts.len() != tensors.len() {
        return Err(Error::param(
            "internal: start tokens or layouts do not match tensors",
        ));
    }
    let mut pages = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        let layout = layouts[i];
        let total = t.tokens;
        let start = from[i];
        if start > total {
            return Err(Error::param(format!(
                "{}: has {total} tokens, fewer than the {start} already stored",
                t.describe()
            )));
        }
        let sink_end = layout.sink.min(total);
        let recent_start = total.saturating_sub(layout.recent).max(sink_end);
        let mut push = |lo: u32, hi: u32, raw: bool| {
            let lo = lo.max(start);
            if hi > lo {
                pages.push(PlannedPage {
                    tensor: i as u32,
                    token_start: lo,
                    tokens: hi - lo,
                    raw,
                });
            }
        };
        push(0, sink_end, true);
        let mut lo = sink_end;
        while lo < recent_start {
            let hi = (lo + layout.page_tokens).min(recent_start);
            push(lo, hi, false);
            lo = hi;
        }
        push(recent_start, total, true);
    }
    Ok(pages)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{DType, Kind};

    fn info(tokens: u32) -> TensorInfo {
        TensorInfo {
            name: "k".into(),
            layer: 0,
            kind: Kind::Key,
            dtype: DType::Bf16,
            batch: 1,
            heads: 1,
            tokens,
            head_dim: 8,
        }
    }

    fn ranges(p: &[PlannedPage]) -> Vec<(u32, u32, bool)> {
        p.iter().map(|p| (p.token_start, p.tokens, p.raw)).collect()
    }

    #[test]
    fn windows_and_pages() {
        let l = Layout {
            page_tokens: 100,
            sink: 32,
            recent: 96,
        };
        let p = plan(&[info(520)], &[0], l).unwrap();
        assert_eq!(
            ranges(&p),
            vec![
                (0, 32, true),
                (32, 100, false),
                (132, 100, false),
                (232, 100, false),
                (332, 92, false),
                (424, 96, true)
            ]
        );
        // Fewer tokens than the windows: all raw, no overlap.
        let p = plan(&[info(50)], &[0], l).unwrap();
        assert_eq!(ranges(&p), vec![(0, 32, true), (32, 18, true)]);
        let p = plan(&[info(0)], &[0], l).unwrap();
        assert!(p.is_empty());
    }

    #[test]
    fn append_keeps_absolute_boundaries() {
        let l = Layout {
            page_tokens: 100,
            sink: 0,
            recent: 0,
        };
        let whole = plan(&[info(350)], &[0], l).unwrap();
        let first = plan(&[info(200)], &[0], l).unwrap();
        let rest = plan(&[info(350)], &[200], l).unwrap();
        let joined: Vec<_> = first.iter().chain(&rest).copied().collect();
        assert_eq!(joined, whole);
    }
}
