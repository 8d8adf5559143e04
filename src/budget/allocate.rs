//! Bit allocation: one operating point per tensor minimising the summed
//! distortion under a byte budget (the Lagrangian / convex-hull greedy of
//! Shoham and Gersho, "Efficient bit allocation for an arbitrary set of
//! quantizers", IEEE Trans. ASSP 36(9), 1988).

/// One way to store a tensor: its estimated bytes and distortion.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Point {
    /// Estimated bytes, everything of the tensor's pages counted.
    pub bytes: f64,
    /// Distortion (see [`super::distortion`]).
    pub distortion: f64,
}

/// The lower convex hull of `points` (indices, ascending bytes, strictly
/// descending distortion, decreasing marginal gain per byte). Ties keep
/// the earlier point, so the result is deterministic.
fn hull(points: &[Point]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..points.len()).collect();
    order.sort_by(|&a, &b| {
        points[a]
            .bytes
            .total_cmp(&points[b].bytes)
            .then(points[a].distortion.total_cmp(&points[b].distortion))
            .then(a.cmp(&b))
    });
    let mut h: Vec<usize> = Vec::new();
    for i in order {
        let p = points[i];
        if let Some(&last) = h.last()
            && p.distortion >= points[last].distortion
        {
            continue; // dominated: costs at least as much, no better
        }
        while h.len() >= 2 {
            let (a, b) = (points[h[h.len() - 2]], points[h[h.len() - 1]]);
            // b lies on or above the segment a-p: drop it.
            let lhs = (b.distortion - a.distortion) * (p.bytes - a.bytes);
            let rhs = (p.distortion - a.distortion) * (b.bytes - a.bytes);
            if lhs >= rhs {
                h.pop();
            } else {
                break;
            }
        }
        h.push(i);
    }
    h
}

/// Chooses one point per tensor (`options[t]`, each non-empty) with total
/// bytes at most `budget`, minimising the summed distortion: every tensor
/// starts at its cheapest hull point, then the upgrade with the largest
/// distortion drop per byte that still fits is taken until none fits.
/// Returns the chosen index per tensor, or `None` when even the cheapest
/// points exceed the budget (with the smallest total then).
pub(crate) fn allocate(options: &[Vec<Point>], budget: f64) -> Result<Vec<usize>, f64> {
    let hulls: Vec<Vec<usize>> = options.iter().map(|o| hull(o)).collect();
    let mut at = vec![0usize; hulls.len()];
    let mut total: f64 = hulls.iter().zip(options).map(|(h, o)| o[h[0]].bytes).sum();
    if total > budget {
        return Err(total);
    }
    let mut stuck = vec![false; hulls.len()];
    loop {
        let mut best: Option<(f64, usize)> = None;
        for (t, h) in hulls.iter().enumerate() {
            if stuck[t] || at[t] + 1 >= h.len() {
                continue;
            }
            let (a, b) = (options[t][h[at[t]]], options[t][h[at[t] + 1]]);
            let gain = (a.distortion - b.distortion) / (b.bytes - a.bytes).max(1e-9);
            if best.is_none_or(|(g, _)| gain > g) {
                best = Some((gain, t));
            }
        }
        let Some((_, t)) = best else { break };
        let (a, b) = (options[t][hulls[t][at[t]]], options[t][hulls[t][at[t] + 1]]);
        if total - a.bytes + b.bytes <= budget {
            total += b.bytes - a.bytes;
            at[t] += 1;
        } else {
            stuck[t] = true;
        }
    }
    Ok(at.iter().zip(&hulls).map(|(&i, h)| h[i]).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(bytes: f64, distortion: f64) -> Point {
        Point { bytes, distortion }
    }

    #[test]
    fn hull_drops_dominated_and_concave_points() {
        let pts = [
            p(1.0, 10.0),
            p(2.0, 9.5),
            p(3.0, 4.0),
            p(4.0, 5.0),
            p(5.0, 3.5),
        ];
        // (2, 9.5) lies above the segment (1,10)-(3,4); (4,5) is dominated.
        assert_eq!(hull(&pts), vec![0, 2, 4]);
    }

    #[test]
    fn spends_where_it_pays_and_respects_the_budget() {
        let a = vec![p(1.0, 100.0), p(2.0, 10.0), p(3.0, 9.0)];
        let b = vec![p(1.0, 5.0), p(2.0, 3.0), p(3.0, 2.9)];
        assert_eq!(allocate(&[a.clone(), b.clone()], 3.0), Ok(vec![1, 0]));
        assert_eq!(allocate(&[a.clone(), b.clone()], 4.0), Ok(vec![1, 1]));
        assert_eq!(allocate(&[a.clone(), b.clone()], 6.0), Ok(vec![2, 2]));
        assert_eq!(allocate(&[a, b], 1.5), Err(2.0));
        // The best upgrade does not fit, a smaller one still does.
        let c = vec![p(1.0, 50.0), p(10.0, 0.0)];
        let d = vec![p(1.0, 5.0), p(2.0, 4.0)];
        assert_eq!(allocate(&[c, d], 4.0), Ok(vec![0, 1]));
    }
}
