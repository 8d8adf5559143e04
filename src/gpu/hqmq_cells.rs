//! The cell index of the GPU hqmq encoder's direction search: per kv head
//! a list of candidate joint codewords for each cell of a grid over one
//! fundamental domain of the Hurwitz units, so that a chunk is scored
//! against a few codewords instead of all `24 S` (format/codecs/hqmq.md
//! section 7 allows any search that returns the rule-6 index).
//!
//! # Geometry
//! Left multiplication by a Hurwitz unit `P_p` permutes the joint codebook
//! (`P_p P_{p'} Q_s = P_m Q_s` with `P_m = P_p P_{p'}` a unit again) and is
//! an isometry, so for any unit `P`, `<x, P_m Q_s> = <y, P_{p'} Q_s>` with
//! `y = conj(P) x`. The kernel takes for `P` the unit nearest to `x` (the
//! largest of `|x_i|` and `sum_i |x_i| / 2`, as in the CPU search), which
//! puts `y` in the unit's Voronoi cell: `y_0 > 0` and the gnomonic point
//! `t = (y_1, y_2, y_3) / y_0` in the octahedron `|t_1| + |t_2| + |t_3| <=
//! 1`. The cube `[-1, 1]^3` is cut into `g^3` boxes; the boxes that meet the
//! octahedron (dilated by [`OCTA_SLACK`]) are the cells, numbered in
//! `(k_1, k_2, k_3)` order.
//!
//! # Candidate lists (built on the device, `encode_hqmq_cells`)
//! For a cell, dilated by [`BOX_SLACK`] in `t` (more than the kernel's
//! rounding of `t`): `c` = the unit direction of its centre, `r` = the
//! largest angle between `c` and a box corner (the largest over the box:
//! the angle to `c` is quasi-convex in the gnomonic plane), `theta_0` =
//! the smallest angle between `c` and a normalized codeword. Every
//! direction of the box scores at least `cos(theta_0 + r)` against that
//! codeword; a codeword at an angle above `acos(cos(theta_0 + r) - eps) +
//! r` from `c` (`eps` = [`SCORE_SLACK`]) scores below that minus `eps`
//! everywhere in the box. `eps` exceeds twice the binary32 error of a
//! normative score (rule 6: about `4 * 2^-24 |x|`, plus the codeword's
//! rounding), so such a codeword is never the rule-6 maximum nor tied
//! with it: the list (every other codeword, as `p' << 11 | s`) holds every
//! maximum, and the smallest `j = m S + s` with the largest normative
//! score over the list is the rule-6 index. Lists longer than
//! [`CELL_CAP`]` - 1` are marked, and their chunks (like tiny or zero
//! chunks, `max |x_i| < 2^-100`, where underflow breaks the error bound)
//! take the fast exact search of every secondary.

use crate::kernels::quaternion::{self, HURWITZ};

/// u16 slots per cell: the count (or [`OVERFLOW`]), then the candidates.
pub const CELL_CAP: usize = 32;
/// Count of a cell whose list did not fit: search every secondary.
#[allow(dead_code)] // The kernel's HQC_OVERFLOW (a test checks they agree).
pub const OVERFLOW: u16 = 0xffff;
/// Dilation of each box in gnomonic units (the kernel's `t` is within
/// about `1e-6` of the exact value).
pub const BOX_SLACK: f64 = 2e-4;
/// Dilation of the octahedron when choosing the cells.
pub const OCTA_SLACK: f64 = 1e-3;
/// Score slack `eps` (cosine units) of the candidate test.
#[allow(dead_code)] // The kernel's HQC_SCORE_SLACK (a test checks they agree).
pub const SCORE_SLACK: f64 = 1e-5;
/// Largest `S` with a cell index (`s` has 11 bits in a list entry).
pub const MAX_S: u32 = 2047;

/// Grid cells per axis for `S` secondaries (finer for denser codebooks,
/// about 0.4 of the typical codeword spacing), or `None` when the cell
/// index is not used (`S` above [`MAX_S`]).
pub fn grid(s: u32) -> Option<u32> {
    if s > MAX_S {
        return None;
    }
    let g = (32.0 * (f64::from(s) / 96.0).cbrt()).round() as u32;
    Some(g.clamp(8, 63))
}

/// Smallest `|t|` over box `k` of `g` (dilated by [`BOX_SLACK`]).
fn min_abs(k: u32, g: u32) -> f64 {
    let lo = -1.0 + 2.0 * f64::from(k) / f64::from(g) - BOX_SLACK;
    let hi = -1.0 + 2.0 * f64::from(k + 1) / f64::from(g) + BOX_SLACK;
    if lo <= 0.0 && hi >= 0.0 {
        0.0
    } else {
        lo.abs().min(hi.abs())
    }
}

/// The column table of grid `g` and the number of cells: entry `k_1 g +
/// k_2` is `base | lo << 20 | hi << 26`, the cells `(k_1, k_2, k_3)` for
/// `k_3` in `lo..=hi` numbered from `base` (`lo > hi`: none).
pub fn columns(g: u32) -> (Vec<u32>, u32) {
    let mut out = Vec::with_capacity((g * g) as usize);
    let mut base = 0u32;
    for k1 in 0..g {
        for k2 in 0..g {
            let m = min_abs(k1, g) + min_abs(k2, g);
            let ks: Vec<u32> = (0..g)
                .filter(|&k3| m + min_abs(k3, g) <= 1.0 + OCTA_SLACK)
                .collect();
            let (lo, hi) = match (ks.first(), ks.last()) {
                (Some(&lo), Some(&hi)) => (lo, hi),
                _ => (63, 0),
            };
            out.push(base | lo << 20 | hi << 26);
            base += ks.len() as u32;
        }
    }
    (out, base)
}

/// `m` with `HURWITZ[m] = HURWITZ[p] * HURWITZ[q]` at `24 p + q` (exact:
/// the units are closed under the product).
pub fn unit_products() -> [u8; 576] {
    let mut t = [0u8; 576];
    for (p, a) in HURWITZ.iter().enumerate() {
        for (q, b) in HURWITZ.iter().enumerate() {
            let r = quaternion::mul(*a, *b).map(|v| v + 0.0);
            t[24 * p + q] = HURWITZ
                .iter()
                .position(|u| *u == r)
                .expect("the units are a group") as u8;
        }
    }
    t
}

/// The cell region appended to the encode side table of a tensor with
/// `heads` kv heads and grid `g`: u32 `g`, u32 cells, 8 zero bytes, the
/// 576-byte [`unit_products`], the [`columns`] (padded to 16 bytes), then
/// per kv head the zeroed lists ([`CELL_CAP`] u16 per cell) that
/// `encode_hqmq_cells` fills (the encoder places [`region_head`] and
/// clears the lists on the device).
#[cfg(test)]
pub fn region(g: u32, heads: u32) -> Vec<u8> {
    let (mut out, lists) = region_head(g, heads);
    out.resize(out.len() + lists, 0);
    out
}

/// [`region`] without its zeroed lists: the bytes before them and the
/// lists' length in bytes (for placing the zeros on the device).
pub fn region_head(g: u32, heads: u32) -> (Vec<u8>, usize) {
    let (cols, cells) = columns(g);
    let mut out = Vec::new();
    for v in [g, cells, 0, 0] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.extend_from_slice(&unit_products());
    for c in &cols {
        out.extend_from_slice(&c.to_le_bytes());
    }
    out.resize(out.len().next_multiple_of(16), 0);
    (out, heads as usize * cells as usize * CELL_CAP * 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_cover_the_octahedron_and_count_cells() {
        for g in [8, 12, 32, 63] {
            let (cols, cells) = columns(g);
            let mut n = 0;
            for (i, &c) in cols.iter().enumerate() {
                let (lo, hi) = ((c >> 20) & 63, c >> 26);
                assert_eq!(c & 0xf_ffff, n, "g {g} column {i}");
                if lo <= hi {
                    n += hi - lo + 1;
                }
            }
            assert_eq!(n, cells);
            // The column through the centre is whole, the cube's corner
            // column is empty.
            let mid = cols[((g / 2) * g + g / 2) as usize];
            assert_eq!(((mid >> 20) & 63, mid >> 26), (0, g - 1));
            assert!((cols[0] >> 20) & 63 > cols[0] >> 26);
            // Towards a sixth of the cube (the octahedron's volume share)
            // as the boxes shrink.
            let share = f64::from(cells) / f64::from(g * g * g);
            assert!(
                share > 1.0 / 6.0 && share < 1.0 / 6.0 + 3.0 / f64::from(g),
                "g {g}: {share}"
            );
        }
        assert_eq!(grid(96), Some(32));
        assert_eq!(grid(2048), None);
    }

    /// The value of `#define name value` in the encode kernels.
    fn kernel_define(name: &str) -> f64 {
        let src = include_str!("kernels/hqmq_enc.cu");
        let line = src
            .lines()
            .find_map(|l| l.strip_prefix(&format!("#define {name} ")))
            .unwrap_or_else(|| panic!("{name} not defined"));
        let v = line.trim().trim_end_matches('u');
        match v.strip_prefix("0x") {
            Some(h) => u64::from_str_radix(h, 16).unwrap() as f64,
            None => v.parse().unwrap(),
        }
    }

    #[test]
    fn kernel_constants_match() {
        assert_eq!(kernel_define("HQC_CAP"), CELL_CAP as f64);
        assert_eq!(kernel_define("HQC_OVERFLOW"), f64::from(OVERFLOW));
        assert_eq!(kernel_define("HQC_BOX_SLACK"), BOX_SLACK);
        assert_eq!(kernel_define("HQC_SCORE_SLACK"), SCORE_SLACK);
        assert_eq!(kernel_define("HQC_MUL"), 16.0);
        assert_eq!(kernel_define("HQC_COLS"), 16.0 + 576.0);
    }

    #[test]
    fn unit_products_are_the_group_table() {
        let t = unit_products();
        for p in 0..24 {
            assert_eq!(t[24 * p], p as u8, "right identity");
            assert_eq!(t[p], p as u8, "left identity");
            let mut row: Vec<u8> = t[24 * p..24 * p + 24].to_vec();
            row.sort_unstable();
            assert_eq!(row, (0..24).collect::<Vec<u8>>(), "a permutation");
        }
    }
}
