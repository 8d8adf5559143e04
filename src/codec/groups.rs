//! Quantization groups of a page, shared by the group-wise codecs (KIVI,
//! InnerQ): which elements of a page `[planes, tokens, head_dim]` form each
//! group, and in which order the groups' side data is stored.
//!
//! * [`Axis::Channels`]: a group is `G` consecutive channels of one token
//!   (one row): group `(r, i)` holds channels `[i*G, (i+1)*G)` of row `r`;
//!   groups are ordered by row, then `i`. `head_dim` must be a multiple of
//!   `G`.
//! * [`Axis::Tokens`]: a group is up to `G` consecutive tokens of one
//!   channel: group `(p, j, c)` holds tokens `[j*G, min((j+1)*G, tokens))`
//!   of channel `c` of plane `p`, counted from the page's first token;
//!   groups are ordered by plane, then token group `j`, then channel `c`.
//!   The last token group of a page is partial when the page's token count
//!   is not a multiple of `G`.
//!
//! Elements inside a group are ordered by channel (Channels) or by token
//! (Tokens). Element positions index the page buffer in plane-major row
//! order, `(p * tokens + t) * head_dim + c` (format/SPEC.md section 6.3).

/// The axis a quantization group runs along.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Axis {
    /// `G` channels of one token (per-token groups).
    Channels,
    /// Up to `G` tokens of one channel (per-channel groups).
    Tokens,
}

/// The groups of one page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Groups {
    /// Grouping axis.
    pub axis: Axis,
    /// Group size `G` (elements per full group).
    pub size: usize,
    /// `batch * kv_heads`.
    pub planes: usize,
    /// Tokens in the page.
    pub tokens: usize,
    /// Elements per head vector.
    pub head_dim: usize,
}

/// Where a group's elements lie in the page buffer: `len` positions
/// `start, start + stride, ...`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// Position of the first element.
    pub start: usize,
    /// Distance between consecutive elements.
    pub stride: usize,
    /// Number of elements (`<= G`).
    pub len: usize,
}

impl Span {
    /// The element positions in group order.
    pub fn positions(self) -> impl Iterator<Item = usize> {
        (0..self.len).map(move |i| self.start + i * self.stride)
    }
}

impl Groups {
    /// Token groups per plane for [`Axis::Tokens`]: `ceil(tokens / G)`.
    fn token_groups(&self) -> usize {
        self.tokens.div_ceil(self.size)
    }

    /// Number of groups in the page.
    ///
    /// For Channels: `planes * tokens * head_dim / G`; for Tokens:
    /// `planes * ceil(tokens / G) * head_dim`.
    pub fn count(&self) -> usize {
        match self.axis {
            Axis::Channels => self.planes * self.tokens * (self.head_dim / self.size),
            Axis::Tokens => self.planes * self.token_groups() * self.head_dim,
        }
    }

    /// Span of group `g` (`g < count()`).
    pub fn span(&self, g: usize) -> Span {
        let d = self.head_dim;
        match self.axis {
            Axis::Channels => {
                let per_row = d / self.size;
                let (r, i) = (g / per_row, g % per_row);
                Span {
                    start: r * d + i * self.size,
                    stride: 1,
                    len: self.size,
                }
            }
            Axis::Tokens => {
                let per_plane = self.token_groups() * d;
                let (p, rest) = (g / per_plane, g % per_plane);
                let (j, c) = (rest / d, rest % d);
                let t0 = j * self.size;
                Span {
                    start: (p * self.tokens + t0) * d + c,
                    stride: d,
                    len: self.size.min(self.tokens - t0),
                }
            }
        }
    }

    /// Channel of element `i` of group `g`: the oracle the tests check
    /// [`Groups::span`] positions against.
    #[cfg(test)]
    pub fn channel(&self, g: usize, i: usize) -> usize {
        match self.axis {
            Axis::Channels => (g % (self.head_dim / self.size)) * self.size + i,
            Axis::Tokens => g % self.head_dim,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_element_is_in_exactly_one_group() {
        for axis in [Axis::Channels, Axis::Tokens] {
            for tokens in [1usize, 7, 32, 45, 64] {
                let g = Groups {
                    axis,
                    size: 8,
                    planes: 3,
                    tokens,
                    head_dim: 16,
                };
                let mut seen = vec![0u8; 3 * tokens * 16];
                for i in 0..g.count() {
                    let s = g.span(i);
                    assert!(s.len >= 1 && s.len <= 8);
                    for (k, p) in s.positions().enumerate() {
                        seen[p] += 1;
                        assert_eq!(g.channel(i, k), p % 16);
                    }
                }
                assert!(seen.iter().all(|&c| c == 1), "{axis:?} {tokens}");
            }
        }
    }

    #[test]
    fn token_groups_order_and_partial_tail() {
        let g = Groups {
            axis: Axis::Tokens,
            size: 4,
            planes: 2,
            tokens: 6,
            head_dim: 3,
        };
        assert_eq!(g.count(), 2 * 2 * 3);
        // plane 0, token group 0, channel 1
        assert_eq!(
            g.span(1),
            Span {
                start: 1,
                stride: 3,
                len: 4
            }
        );
        // plane 0, token group 1 (tokens 4..6), channel 0
        assert_eq!(
            g.span(3),
            Span {
                start: 12,
                stride: 3,
                len: 2
            }
        );
        // plane 1, token group 0, channel 2
        assert_eq!(g.span(8).start, 6 * 3 + 2);
    }
}
