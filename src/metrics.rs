//! Fidelity metrics: reconstruction error of K/V tensors and of attention
//! outputs, computed in f64.

use crate::cache::Tensor;
use crate::error::{Error, Result};
use crate::io::safetensors::Queries;

/// Reconstruction error of one tensor.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct TensorError {
    /// Relative MSE: `sum (x - y)^2 / sum x^2`.
    pub rel_mse: f64,
    /// Signal-to-noise ratio in dB: `-10 log10(rel_mse)`.
    pub snr_db: f64,
    /// Mean over head vectors (one token of one head) of `cos(x, y)`.
    pub cosine: f64,
    /// Smallest per-vector cosine.
    pub min_cosine: f64,
    /// Largest `|x - y|`.
    pub max_abs_err: f64,
    /// Every element of the reconstruction has the original's bit pattern
    /// (as f32; a lossless file, also where the original holds NaN or
    /// infinity, whose cosine and error are then NaN).
    pub identical: bool,
}

/// Compares an original tensor with its reconstruction.
///
/// # Errors
/// [`Error::Parameter`] when the shapes differ.
pub fn tensor_error(orig: &Tensor, dec: &Tensor) -> Result<TensorError> {
    if orig.info.shape() != dec.info.shape() {
        return Err(Error::param(format!(
            "{}: original shape {:?} vs decoded {:?}",
            orig.info.name,
            orig.info.shape(),
            dec.info.shape()
        )));
    }
    let x = orig.data.to_f32();
    let y = dec.data.to_f32();
    let mut acc = ErrorSums::default();
    acc.add(&x, &y, orig.info.head_dim as usize);
    Ok(acc.finish())
}

/// Running sums of [`TensorError`] over head vectors, for comparing a
/// tensor piece by piece (pages decoded in any order): [`ErrorSums::add`]
/// the pieces, [`ErrorSums::merge`] sums kept by different threads, then
/// [`ErrorSums::finish`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ErrorSums {
    /// `sum (x - y)^2`.
    num: f64,
    /// `sum x^2`.
    den: f64,
    /// `max |x - y|`.
    max_err: f64,
    /// Sum of per-vector cosines.
    cos_sum: f64,
    /// Smallest per-vector cosine.
    cos_min: f64,
    /// Vectors added.
    rows: u64,
    /// Elements whose f32 bit patterns differ.
    differing: u64,
}

impl Default for ErrorSums {
    fn default() -> Self {
        ErrorSums {
            num: 0.0,
            den: 0.0,
            max_err: 0.0,
            cos_sum: 0.0,
            cos_min: f64::INFINITY,
            rows: 0,
            differing: 0,
        }
    }
}

impl ErrorSums {
    /// Adds the head vectors of `x` (original) and `y` (reconstruction),
    /// `head_dim` elements each, in the same order. Extra elements of the
    /// longer slice (and a partial last vector) are ignored.
    pub fn add(&mut self, x: &[f32], y: &[f32], head_dim: usize) {
        for (a, b) in x.chunks_exact(head_dim).zip(y.chunks_exact(head_dim)) {
            let (mut xy, mut xx, mut yy) = (0f64, 0f64, 0f64);
            for (&p, &q) in a.iter().zip(b) {
                self.differing += u64::from(p.to_bits() != q.to_bits());
                let (p, q) = (f64::from(p), f64::from(q));
                self.num += (p - q) * (p - q);
                self.den += p * p;
                self.max_err = self.max_err.max((p - q).abs());
                xy += p * q;
                xx += p * p;
                yy += q * q;
            }
            let c = if xx == 0.0 && yy == 0.0 {
                1.0
            } else {
                xy / (xx.sqrt() * yy.sqrt()).max(f64::MIN_POSITIVE)
            };
            self.cos_sum += c;
            self.cos_min = self.cos_min.min(c);
            self.rows += 1;
        }
    }

    /// Adds the sums of another part of the same tensor.
    pub fn merge(&mut self, o: &ErrorSums) {
        self.num += o.num;
        self.den += o.den;
        self.max_err = self.max_err.max(o.max_err);
        self.cos_sum += o.cos_sum;
        self.cos_min = self.cos_min.min(o.cos_min);
        self.rows += o.rows;
        self.differing += o.differing;
    }

    /// The error of everything added (a tensor with no vectors has cosine
    /// 1 and error 0).
    pub fn finish(&self) -> TensorError {
        let rel = if self.den == 0.0 {
            if self.num == 0.0 { 0.0 } else { f64::INFINITY }
        } else {
            self.num / self.den
        };
        TensorError {
            rel_mse: rel,
            snr_db: if rel == 0.0 {
                f64::INFINITY
            } else {
                -10.0 * rel.log10()
            },
            cosine: if self.rows == 0 {
                1.0
            } else {
                self.cos_sum / self.rows as f64
            },
            min_cosine: if self.rows == 0 { 1.0 } else { self.cos_min },
            max_abs_err: self.max_err,
            identical: self.differing == 0,
        }
    }
}

/// Attention outputs `softmax(q K^T * scale) V` for every query head and
/// query token, over all cached tokens, as `[q_heads, q_tokens, head_dim_v]`
/// (batch 1). Query head `h` uses kv head `h / (q_heads / kv_heads)`.
///
/// # Errors
/// [`Error::Parameter`] when shapes are inconsistent (batch != 1, head_dim
/// mismatch, q_heads not a multiple of kv_heads).
pub fn attention(q: &Queries, k: &Tensor, v: &Tensor, scale: f64) -> Result<Vec<f64>> {
    let [qb, qh, qt, qd] = q.shape;
    let (ki, vi) = (&k.info, &v.info);
    if qb != 1
        || ki.batch != 1
        || qd != ki.head_dim as usize
        || ki.heads == 0
        || qh % ki.heads as usize != 0
        || ki.tokens != vi.tokens
    {
        return Err(Error::param(format!(
            "layer {}: queries {:?} do not fit K {:?} / V {:?}",
            q.layer,
            q.shape,
            ki.shape(),
            vi.shape()
        )));
    }
    let kx = k.data.to_f32();
    let vx = v.data.to_f32();
    let (t, dv) = (ki.tokens as usize, vi.head_dim as usize);
    let group = qh / ki.heads as usize;
    let mut out = vec![0f64; qh * qt * dv];
    let mut s = vec![0f64; t];
    for h in 0..qh {
        let g = h / group;
        let kh = &kx[g * t * qd..(g + 1) * t * qd];
        let vh = &vx[g * t * dv..(g + 1) * t * dv];
        for i in 0..qt {
            let qv = &q.data[(h * qt + i) * qd..(h * qt + i + 1) * qd];
            let mut m = f64::NEG_INFINITY;
            for j in 0..t {
                let dot: f64 = qv
                    .iter()
                    .zip(&kh[j * qd..(j + 1) * qd])
                    .map(|(&a, &b)| f64::from(a) * f64::from(b))
                    .sum();
                s[j] = dot * scale;
                m = m.max(s[j]);
            }
            let mut z = 0.0;
            for x in s.iter_mut() {
                *x = (*x - m).exp();
                z += *x;
            }
            let o = &mut out[(h * qt + i) * dv..(h * qt + i + 1) * dv];
            for j in 0..t {
                let p = s[j] / z;
                for (oo, &vv) in o.iter_mut().zip(&vh[j * dv..(j + 1) * dv]) {
                    *oo += p * f64::from(vv);
                }
            }
        }
    }
    Ok(out)
}

/// Relative error `||O - O^|| / ||O||` of attention outputs computed with
/// the original and the decoded K, V.
///
/// # Errors
/// As [`attention`].
pub fn attention_error(
    q: &Queries,
    k: &Tensor,
    v: &Tensor,
    k2: &Tensor,
    v2: &Tensor,
    scale: f64,
) -> Result<f64> {
    let a = attention(q, k, v, scale)?;
    let b = attention(q, k2, v2, scale)?;
    let num: f64 = a.iter().zip(&b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f64 = a.iter().map(|x| x * x).sum();
    Ok(if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{DType, Kind, TensorData, TensorInfo};

    fn t(vals: Vec<f32>, tokens: u32, d: u32) -> Tensor {
        let info = TensorInfo {
            name: "x".into(),
            layer: 0,
            kind: Kind::Key,
            dtype: DType::F32,
            batch: 1,
            heads: 1,
            tokens,
            head_dim: d,
        };
        Tensor::new(info, TensorData::F32(vals)).unwrap()
    }

    #[test]
    fn identical_tensors_have_no_error() {
        let a = t(vec![1.0, 2.0, 3.0, 4.0], 2, 2);
        let e = tensor_error(&a, &a).unwrap();
        assert_eq!(e.rel_mse, 0.0);
        assert!((1.0 - e.cosine).abs() < 1e-12);
        assert!(e.snr_db.is_infinite());
    }

    #[test]
    fn known_error_values() {
        let a = t(vec![3.0, 4.0], 1, 2);
        let b = t(vec![3.0, 3.0], 1, 2);
        let e = tensor_error(&a, &b).unwrap();
        assert!((e.rel_mse - 1.0 / 25.0).abs() < 1e-12);
        assert!((e.snr_db - 13.979400086720377).abs() < 1e-9);
        assert!((e.cosine - 21.0 / (5.0 * 18f64.sqrt())).abs() < 1e-12);
        assert_eq!(e.max_abs_err, 1.0);
    }

    #[test]
    fn attention_picks_the_matching_key() {
        // One query aligned with key 0: with a large scale the output is V[0].
        let k = t(vec![1.0, 0.0, 0.0, 1.0], 2, 2);
        let v = t(vec![5.0, 6.0, 7.0, 8.0], 2, 2);
        let q = Queries {
            layer: 0,
            shape: [1, 1, 1, 2],
            data: vec![1.0, 0.0],
        };
        let o = attention(&q, &k, &v, 100.0).unwrap();
        assert!((o[0] - 5.0).abs() < 1e-9 && (o[1] - 6.0).abs() < 1e-9);
    }
}
