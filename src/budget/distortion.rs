//! The distortion the planner minimises: the error of one layer's attention
//! output, measured on a token sample with the cache's own keys as proxy
//! queries (no queries, calibration data or model needed).
//!
//! For one kv head with sampled keys `K`, values `V` (`[n, d]`), sample
//! weights `w` (slots each row stands for) and proxy queries `Q` (every
//! `n / PROXIES`-th sampled key), the reference attention is
//! `P = softmax(scale * Q K^T + ln w)` (row-wise; `ln w` makes the sampled
//! softmax estimate the one over all slots; a proxy's own slot is left
//! out, since a key matches itself as no query does) and `O = P V`. A key
//! reconstruction `K^` changes it to `P^ = softmax(scale * Q K^^T + ln w)`
//! and the output error is `(P^ - P) V`, computed exactly through the Gram
//! matrix `V V^T`, so the softmax's sensitivity (a sink key that draws all
//! the attention, a flat row that hides errors) is part of the measure. A
//! value reconstruction `V^` gives the error `P (V^ - V)`: value errors
//! count where attention looks. Both are divided by `||O||^2` summed over
//! the layer's heads and proxies, so K and V of a layer, and layers of any
//! scale, are measured in the same unit. Slots in a sink window are exact
//! (their error rows are zero). Tensors without a K/V partner in their
//! layer (MLA latents) use the weighted relative squared error instead.

/// Proxy queries per kv head.
pub(crate) const PROXIES: usize = 16;

/// The sampled rows of one kv head of one layer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Head<'a> {
    /// Keys `[n, d]`.
    pub k: &'a [f32],
    /// Values `[n, d]`.
    pub v: &'a [f32],
}

/// Reference attention of one kv head on the sample: scores, weights and
/// the values' Gram matrix.
#[derive(Debug, Clone)]
pub(crate) struct HeadContext {
    n: usize,
    d: usize,
    /// Proxy query rows (indices into the sample).
    proxies: Vec<usize>,
    /// `scale * q.k + ln w`, `[proxies, n]`.
    scores: Vec<f32>,
    /// `softmax(scores)`, `[proxies, n]`.
    probs: Vec<f32>,
    /// `V V^T`, `[n, n]`.
    gram: Vec<f32>,
    /// `sum_q ||O_q||^2`.
    energy: f64,
}

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent accumulators: vectorizes without fast-math.
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

#[inline(always)]
fn softmax(row: &mut [f32]) {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut s = 0.0f32;
    for x in row.iter_mut() {
        *x = (*x - m).exp();
        s += *x;
    }
    for x in row.iter_mut() {
        *x /= s;
    }
}

impl HeadContext {
    /// The reference of `head` (`n` rows of `d`) with sample `weights` and
    /// softmax `scale`.
    pub fn new(head: Head<'_>, n: usize, d: usize, weights: &[f32], scale: f32) -> HeadContext {
        crate::kernels::with_avx2(
            #[inline(always)]
            || {
                let nq = PROXIES.min(n);
                let proxies: Vec<usize> = (0..nq).map(|i| i * n / nq.max(1)).collect();
                let row = |m: &[f32], i: usize| -> Vec<f32> { m[i * d..(i + 1) * d].to_vec() };
                let mut scores = vec![0.0f32; nq * n];
                for (qi, &q) in proxies.iter().enumerate() {
                    let qv = row(head.k, q);
                    for j in 0..n {
                        // A key is no query of itself: its own slot, which would
                        // draw the attention to one exactly matching row, is left
                        // out.
                        scores[qi * n + j] = if j == q && n > 1 {
                            f32::NEG_INFINITY
                        } else {
                            scale * dot(&qv, &head.k[j * d..(j + 1) * d]) + weights[j].ln()
                        };
                    }
                }
                let mut probs = scores.clone();
                for r in probs.chunks_exact_mut(n.max(1)) {
                    softmax(r);
                }
                let mut gram = vec![0.0f32; n * n];
                for i in 0..n {
                    for j in i..n {
                        let g = dot(&head.v[i * d..(i + 1) * d], &head.v[j * d..(j + 1) * d]);
                        gram[i * n + j] = g;
                        gram[j * n + i] = g;
                    }
                }
                let energy = (0..nq)
                    .map(|q| quad(&gram, &probs[q * n..(q + 1) * n], n))
                    .sum();
                HeadContext {
                    n,
                    d,
                    proxies,
                    scores,
                    probs,
                    gram,
                    energy,
                }
            },
        )
    }

    /// `sum_q ||O_q||^2`, the denominator of the layer's distortion.
    pub fn energy(&self) -> f64 {
        self.energy
    }

    /// Key score errors `scale * q.(k^ - k)`, `[proxies, n]`, of a key
    /// reconstruction `k_hat` against `head`.
    pub fn key_deltas(&self, head: Head<'_>, k_hat: &[f32], scale: f32) -> Vec<f32> {
        crate::kernels::with_avx2(
            #[inline(always)]
            || {
                let (n, d) = (self.n, self.d);
                let diff: Vec<f32> = k_hat.iter().zip(head.k).map(|(a, b)| a - b).collect();
                let mut out = vec![0.0f32; self.proxies.len() * n];
                for (qi, &q) in self.proxies.iter().enumerate() {
                    let qv = &head.k[q * d..(q + 1) * d];
                    let o = &mut out[qi * n..(qi + 1) * n];
                    row_dots(&diff[..n * d], qv, o);
                    for v in o.iter_mut() {
                        *v *= scale;
                    }
                }
                out
            },
        )
    }

    /// `sum_q ||(P^_q - P_q) V||^2` for the score errors `deltas` of
    /// [`HeadContext::key_deltas`], slots `0..exact` kept exact.
    #[cfg(test)]
    pub fn key_error(&self, deltas: &[f32], exact: usize) -> f64 {
        self.key_errors(deltas, &[exact])[0]
    }

    /// [`HeadContext::key_error`] for each window of `exacts` (slots
    /// `0..exacts[k]` kept exact), with the same operations: per proxy the
    /// windows' score rows differ in a few slots, and an exponential whose
    /// argument has the same bits as for the previous window is taken from
    /// it instead of computed again.
    pub fn key_errors(&self, deltas: &[f32], exacts: &[usize]) -> Vec<f64> {
        crate::kernels::with_avx2(
            #[inline(always)]
            || {
                let n = self.n;
                let mut totals = vec![0.0f64; exacts.len()];
                let mut row = vec![0.0f32; n];
                // The previous window's row and exponentials.
                let mut prev = vec![0.0f32; n];
                let mut ex = vec![0.0f32; n];
                for q in 0..self.proxies.len() {
                    let (s, p) = (
                        &self.scores[q * n..(q + 1) * n],
                        &self.probs[q * n..(q + 1) * n],
                    );
                    // The previous window's maximum.
                    let mut prev_m: Option<f32> = None;
                    for (total, &exact) in totals.iter_mut().zip(exacts) {
                        for j in 0..n {
                            row[j] = s[j] + if j < exact { 0.0 } else { deltas[q * n + j] };
                        }
                        // softmax(row), as `softmax` computes it.
                        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        let same_m = prev_m.is_some_and(|pm| pm.to_bits() == m.to_bits());
                        let mut sum = 0.0f32;
                        for j in 0..n {
                            if !(same_m && row[j].to_bits() == prev[j].to_bits()) {
                                ex[j] = (row[j] - m).exp();
                            }
                            sum += ex[j];
                        }
                        prev.copy_from_slice(&row);
                        prev_m = Some(m);
                        for j in 0..n {
                            row[j] = ex[j] / sum;
                            row[j] -= p[j];
                        }
                        *total += quad(&self.gram, &row, n);
                    }
                }
                totals
            },
        )
    }

    /// `P (V^ - V)` for the value errors `v_hat - head.v`, `[proxies, d]`,
    /// every slot coded.
    pub fn value_deltas(&self, head: Head<'_>, v_hat: &[f32]) -> Vec<f32> {
        crate::kernels::with_avx2(
            #[inline(always)]
            || {
                let (n, d) = (self.n, self.d);
                let diff: Vec<f32> = v_hat.iter().zip(head.v).map(|(a, b)| a - b).collect();
                let mut out = vec![0.0f32; self.proxies.len() * d];
                for q in 0..self.proxies.len() {
                    let o = &mut out[q * d..(q + 1) * d];
                    for j in 0..n {
                        let p = self.probs[q * n + j];
                        for (o, e) in o.iter_mut().zip(&diff[j * d..(j + 1) * d]) {
                            *o += p * e;
                        }
                    }
                }
                out
            },
        )
    }

    /// `sum_q ||P_q (V^ - V)||^2` with slots `0..exact` kept exact, from
    /// [`HeadContext::value_deltas`].
    pub fn value_error(&self, head: Head<'_>, v_hat: &[f32], deltas: &[f32], exact: usize) -> f64 {
        crate::kernels::with_avx2(
            #[inline(always)]
            || {
                let (n, d) = (self.n, self.d);
                let mut o = vec![0.0f32; d];
                let mut total = 0.0f64;
                for q in 0..self.proxies.len() {
                    o.copy_from_slice(&deltas[q * d..(q + 1) * d]);
                    for j in 0..exact.min(n) {
                        let p = self.probs[q * n + j];
                        let (a, b) = (&v_hat[j * d..(j + 1) * d], &head.v[j * d..(j + 1) * d]);
                        for k in 0..d {
                            o[k] -= p * (a[k] - b[k]);
                        }
                    }
                    total += o.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>();
                }
                total
            },
        )
    }
}

/// `x^T G x` for a symmetric `n x n` `G`: `sum_i x_i (G_i . x)` in f64 in
/// index order (rows with `x_i = 0` skipped), each `G_i . x` by [`dot`].
#[inline(always)]
fn quad(g: &[f32], x: &[f32], n: usize) -> f64 {
    let mut dots = [0.0f32; 64];
    let mut t = 0.0f64;
    // Row products 64 rows at a time (their use is unchanged).
    for i0 in (0..n).step_by(64) {
        let m = (n - i0).min(64);
        row_dots(&g[i0 * n..(i0 + m) * n], &x[..n], &mut dots[..m]);
        for (r, &dv) in dots[..m].iter().enumerate() {
            if x[i0 + r] != 0.0 {
                t += f64::from(x[i0 + r]) * f64::from(dv);
            }
        }
    }
    t
}

/// [`dot`] of each row of `rows` (`[out.len(), x.len()]`) with `x`, into
/// `out`, bit for bit: 8 rows at a time on AVX2 when `x.len()` is a
/// multiple of 8 (the product `row * x` is `x * row`).
#[inline(always)]
fn row_dots(rows: &[f32], x: &[f32], out: &mut [f32]) {
    let d = x.len();
    let mut r = 0;
    #[cfg(target_arch = "x86_64")]
    if d.is_multiple_of(8) && crate::kernels::simd_available() {
        let zero = sum_neutral();
        while r + 8 <= out.len() {
            // SAFETY: simd_available() checked AVX2; rows `r..r + 8` hold
            // `d` values each, `d` a multiple of 8.
            let v = unsafe { avx2::dot8(&rows[r * d..(r + 8) * d], x, zero) };
            out[r..r + 8].copy_from_slice(&v);
            r += 8;
        }
    }
    for (o, row) in out[r..]
        .iter_mut()
        .zip(rows[r * d..].chunks_exact(d.max(1)))
    {
        *o = dot(row, x);
    }
}

/// The value `iter().sum::<f32>()` starts its fold from (that of an empty
/// sum), which [`dot`] adds its lanes to.
#[inline(always)]
fn sum_neutral() -> f32 {
    std::iter::empty::<f32>().sum()
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// [`super::dot`] of each of 8 rows (`rows`, `[8, n]`, `n =
    /// x.len()` a multiple of 8) with `x`, bit for bit: per row the same 8
    /// lane accumulators (`acc += row * x`, 8 values a step), their sum in
    /// lane order from `zero` (the neutral of `f32`'s `Sum`), plus the
    /// empty tail's sum (`zero`). The lane sums of the 8 rows run side by
    /// side after a transpose instead of one row at a time.
    ///
    /// # Safety
    /// AVX2 must be available; `rows.len() >= 8 * x.len()`,
    /// `x.len() % 8 == 0`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn dot8(rows: &[f32], x: &[f32], zero: f32) -> [f32; 8] {
        let n = x.len();
        assert!(rows.len() >= 8 * n && n.is_multiple_of(8));
        // SAFETY: loads read 8 values at offsets `r * n + m` and `m` with
        // `m + 8 <= n`, inside `rows` and `x` (asserted above).
        unsafe {
            let mut acc = [_mm256_setzero_ps(); 8];
            let mut m = 0;
            while m < n {
                let xv = _mm256_loadu_ps(x.as_ptr().add(m));
                for (r, a) in acc.iter_mut().enumerate() {
                    let gv = _mm256_loadu_ps(rows.as_ptr().add(r * n + m));
                    *a = _mm256_add_ps(*a, _mm256_mul_ps(gv, xv));
                }
                m += 8;
            }
            // Transpose: lane r of t[l] is lane l of acc[r].
            let [a0, a1, a2, a3, a4, a5, a6, a7] = acc;
            let u0 = _mm256_unpacklo_ps(a0, a1);
            let u1 = _mm256_unpackhi_ps(a0, a1);
            let u2 = _mm256_unpacklo_ps(a2, a3);
            let u3 = _mm256_unpackhi_ps(a2, a3);
            let u4 = _mm256_unpacklo_ps(a4, a5);
            let u5 = _mm256_unpackhi_ps(a4, a5);
            let u6 = _mm256_unpacklo_ps(a6, a7);
            let u7 = _mm256_unpackhi_ps(a6, a7);
            let v0 = _mm256_shuffle_ps::<0x44>(u0, u2);
            let v1 = _mm256_shuffle_ps::<0xEE>(u0, u2);
            let v2 = _mm256_shuffle_ps::<0x44>(u1, u3);
            let v3 = _mm256_shuffle_ps::<0xEE>(u1, u3);
            let v4 = _mm256_shuffle_ps::<0x44>(u4, u6);
            let v5 = _mm256_shuffle_ps::<0xEE>(u4, u6);
            let v6 = _mm256_shuffle_ps::<0x44>(u5, u7);
            let v7 = _mm256_shuffle_ps::<0xEE>(u5, u7);
            let t = [
                _mm256_permute2f128_ps::<0x20>(v0, v4),
                _mm256_permute2f128_ps::<0x20>(v1, v5),
                _mm256_permute2f128_ps::<0x20>(v2, v6),
                _mm256_permute2f128_ps::<0x20>(v3, v7),
                _mm256_permute2f128_ps::<0x31>(v0, v4),
                _mm256_permute2f128_ps::<0x31>(v1, v5),
                _mm256_permute2f128_ps::<0x31>(v2, v6),
                _mm256_permute2f128_ps::<0x31>(v3, v7),
            ];
            let z = _mm256_set1_ps(zero);
            let mut s = z;
            for tl in t {
                s = _mm256_add_ps(s, tl);
            }
            s = _mm256_add_ps(s, z);
            let mut out = [0f32; 8];
            _mm256_storeu_ps(out.as_mut_ptr(), s);
            out
        }
    }
}

/// Weighted relative squared error `sum_j w_j ||x^_j - x_j||^2` over rows
/// `exact..n` (`[n, d]` rows) and the weighted energy `sum_j w_j ||x_j||^2`.
pub(crate) fn weighted_mse(
    x: &[f32],
    x_hat: &[f32],
    w: &[f32],
    d: usize,
    exact: usize,
) -> (f64, f64) {
    let (mut err, mut energy) = (0.0f64, 0.0f64);
    for (j, (a, b)) in x.chunks_exact(d).zip(x_hat.chunks_exact(d)).enumerate() {
        let wj = f64::from(w[j]);
        energy += wj * a.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>();
        if j >= exact {
            err += wj
                * a.iter()
                    .zip(b)
                    .map(|(&u, &v)| f64::from(u - v).powi(2))
                    .sum::<f64>();
        }
    }
    (err, energy)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(n: usize, d: usize, seed: u32) -> (Vec<f32>, Vec<f32>) {
        let mut s = seed;
        let mut r = || {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        };
        let k: Vec<f32> = (0..n * d).map(|_| r()).collect();
        let v: Vec<f32> = (0..n * d).map(|_| r()).collect();
        (k, v)
    }

    #[test]
    fn exact_reconstruction_has_no_error_and_windows_remove_it() {
        let (n, d) = (24, 16);
        let (k, v) = head(n, d, 7);
        let w = vec![1.0; n];
        let h = Head { k: &k, v: &v };
        let ctx = HeadContext::new(h, n, d, &w, 0.5);
        assert!(ctx.energy() > 0.0);
        let dk = ctx.key_deltas(h, &k, 0.5);
        assert_eq!(ctx.key_error(&dk, 0), 0.0);
        let noisy: Vec<f32> = k.iter().map(|x| x * 1.3).collect();
        let dk = ctx.key_deltas(h, &noisy, 0.5);
        assert!(ctx.key_error(&dk, 0) > 0.0);
        assert!(ctx.key_error(&dk, n).abs() < 1e-9);
        let vn: Vec<f32> = v.iter().map(|x| x + 0.1).collect();
        let dv = ctx.value_deltas(h, &vn);
        let full = ctx.value_error(h, &vn, &dv, 0);
        // A constant shift of every value moves every output by exactly it.
        let want = PROXIES.min(n) as f64 * d as f64 * 0.01;
        assert!((full - want).abs() < 1e-3 * want, "{full} vs {want}");
        assert!(ctx.value_error(h, &vn, &dv, n) < 1e-9);
        assert!(ctx.value_error(h, &vn, &dv, n / 2) < full);
    }

    /// The windows computed together (exponentials reused) give the bits
    /// of each window computed alone, also when a window changes a row's
    /// maximum (a large score error on slot 0) and for windows in any
    /// order.
    #[test]
    fn key_errors_of_several_windows_equal_each_alone() {
        let (n, d) = (40, 16);
        let (k, v) = head(n, d, 11);
        let w: Vec<f32> = (0..n).map(|i| 1.0 + (i % 3) as f32).collect();
        let h = Head { k: &k, v: &v };
        let ctx = HeadContext::new(h, n, d, &w, 0.7);
        let noisy: Vec<f32> = k
            .iter()
            .enumerate()
            .map(|(i, x)| x + 0.05 * ((i % 7) as f32 - 3.0))
            .collect();
        let mut dk = ctx.key_deltas(h, &noisy, 0.7);
        for q in 0..ctx.proxies.len() {
            if q % 2 == 0 {
                dk[q * n] = 30.0;
            }
        }
        let exacts = [0, 1, 4, 16, 3, 0, n];
        let together = ctx.key_errors(&dk, &exacts);
        for (e, t) in exacts.iter().zip(&together) {
            assert_eq!(t.to_bits(), ctx.key_error(&dk, *e).to_bits(), "window {e}");
        }
        assert!(together[0] > together[3]);
    }

    /// The 8-row AVX2 quadratic form gives the bits of one [`dot`] per
    /// row, with zeros and values across decades in `x`.
    #[test]
    fn quad_equals_row_by_row_dots() {
        for n in [8, 16, 64, 72, 13] {
            let (g, x) = head(n, n, n as u32 + 1);
            let mut x: Vec<f32> = x[..n]
                .iter()
                .enumerate()
                .map(|(i, v)| v * [1.0, 1e-4, 30.0][i % 3])
                .collect();
            x[n / 2] = 0.0;
            let mut want = 0.0f64;
            for i in 0..n {
                if x[i] != 0.0 {
                    want += f64::from(x[i]) * f64::from(dot(&g[i * n..(i + 1) * n], &x));
                }
            }
            let got = crate::kernels::with_avx2(|| quad(&g, &x, n));
            assert_eq!(got.to_bits(), want.to_bits(), "n {n}");
        }
    }

    /// `key_deltas` (8 rows at a time) gives the bits of one [`dot`] per
    /// proxy and row, for head dims with and without the 8-row path.
    #[test]
    fn key_deltas_equal_dots() {
        for (n, d) in [(24, 16), (30, 40), (17, 12), (70, 64)] {
            let (k, v) = head(n, d, 9);
            let w = vec![1.5; n];
            let h = Head { k: &k, v: &v };
            let ctx = HeadContext::new(h, n, d, &w, 0.4);
            let kn: Vec<f32> = k
                .iter()
                .enumerate()
                .map(|(i, x)| x + 0.01 * (i % 7) as f32)
                .collect();
            let got = ctx.key_deltas(h, &kn, 0.4);
            let diff: Vec<f32> = kn.iter().zip(&k).map(|(a, b)| a - b).collect();
            for (qi, &q) in ctx.proxies.iter().enumerate() {
                for j in 0..n {
                    let want = 0.4 * dot(&k[q * d..(q + 1) * d], &diff[j * d..(j + 1) * d]);
                    assert_eq!(got[qi * n + j].to_bits(), want.to_bits(), "n {n} d {d}");
                }
            }
        }
    }

    #[test]
    fn weighted_mse_counts_weights() {
        let x = [1.0, 0.0, 0.0, 1.0];
        let y = [0.0, 0.0, 0.0, 1.0];
        assert_eq!(weighted_mse(&x, &y, &[3.0, 1.0], 2, 0), (3.0, 4.0));
        assert_eq!(weighted_mse(&x, &y, &[3.0, 1.0], 2, 1), (0.0, 4.0));
    }
}
