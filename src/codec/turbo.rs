//! `turbo:b{b}`: TurboQuant-MSE, the OCTOPUS paper's main baseline
//! (format/codecs/turbo.md; OCTOPUS paper, arXiv:2605.21226, section
//! 3.1-3.2 and appendix C.3; TurboQuant, Zandieh et al., arXiv:2504.19874,
//! Thm. 1).
//!
//! Per head vector: the norm `γ` (f32) and the rotated unit vector `u`
//! ([`super::sphere`], the same rotation as `octopus`), then every
//! coordinate of `u` is rounded to the nearest centroid of a `b`-bit
//! Lloyd-Max codebook matched to the coordinate marginal `(1 - u^2)^((d-3)/2)`
//! (Eq. 3) for this head_dim. `+qjl` adds the 1-bit QJL residual on K (with
//! `b - 1` MSE bits this is the paper's TurboQuant-QJL); `:vg{g}` codes V
//! with int-b groups.
//!
//! Bits per element: `b + 32/d`, plus `1 + 16/d` on K with `+qjl`.
//!
//! Names: `turbo:b{1..6}[+qjl][:vg{g}[b{bits}]][:seed{n}]`.

use std::sync::Arc;

use crate::cache::{Role, TensorInfo};
use crate::error::{Error, Result};
use crate::format::{PageView, Section};
use crate::kernels::lloyd_max::{self, Density};
use crate::plan::Layout;

use super::sphere::{self, Options, UnitQuantizer, Values};
use super::{Codec, Example, Family, PageIn, PageOut};

/// Codec id of `turbo`.
pub const ID: u16 = 5;
/// Largest bits per coordinate.
pub const MAX_BITS: u8 = 6;

/// Registry entry of `turbo`.
pub const FAMILY: Family = Family {
    id: ID,
    name: "turbo",
    syntax: "turbo:b{b}[+qjl][:vg{g}][:seed{n}]  b = 1..6, e.g. turbo:b3",
    summary: "TurboQuant-MSE: WHT rotation + per-coordinate Lloyd-Max on the Beta marginal (OCTOPUS baseline)",
    parse,
    from_params: |p| Ok(Box::new(Turbo::from_params(p)?)),
    examples: &[
        Example {
            name: "turbo:b3",
            min_snr_db: 13.0,
        },
        Example {
            name: "turbo:b2+qjl:vg32",
            min_snr_db: 4.0,
        },
    ],
};

/// The coordinate codebook of one head_dim.
#[derive(Debug, Clone, PartialEq)]
pub struct CoordTables {
    /// head_dim `d` the codebook is matched to.
    pub dim: u32,
    /// `2^b` ascending centroids in `[-1, 1]`.
    pub centroids: Vec<f32>,
    /// Midpoints of adjacent centroids, padded with `+inf`.
    pub bounds: Vec<f32>,
    /// The centroids padded to 256 entries.
    pub lut: Box<[f32; 256]>,
}

impl CoordTables {
    /// Tables for stored centroids.
    pub fn new(dim: u32, centroids: Vec<f32>) -> CoordTables {
        CoordTables {
            dim,
            bounds: lloyd_max::boundaries(&centroids),
            lut: super::octopus::lut(&centroids),
            centroids,
        }
    }

    /// Lloyd-Max on the coordinate marginal of `d` (Eq. 3).
    pub fn trained(dim: u32, bits: u8) -> CoordTables {
        let cb = lloyd_max::train(Density::Coordinate { d: dim }, 1 << bits);
        CoordTables::new(dim, cb.centroids_f32())
    }
}

/// The per-coordinate unit quantizer for one head_dim.
#[derive(Debug, Clone)]
pub struct ScalarQuantizer {
    bits: u8,
    tables: Arc<CoordTables>,
}

impl UnitQuantizer for ScalarQuantizer {
    fn dim(&self) -> usize {
        self.tables.dim as usize
    }

    fn streams(&self) -> Vec<(u8, usize)> {
        vec![(self.bits, self.dim())]
    }

    fn quantize(&self, u: &[f32], codes: &mut [&mut [u8]]) {
        lloyd_max::search_many(&self.tables.bounds, u, codes[0]);
    }

    fn reconstruct(&self, codes: &[&[u8]], u_hat: &mut [f32]) {
        for (o, &c) in u_hat.iter_mut().zip(codes[0]) {
            *o = self.tables.lut[c as usize];
        }
    }
}

/// The `turbo` codec.
#[derive(Debug, Clone)]
pub struct Turbo {
    /// Bits per coordinate.
    pub bits: u8,
    /// QJL, value coding and seed.
    pub options: Options,
    tables: Vec<Arc<CoordTables>>,
}

impl Turbo {
    /// A codec without codebooks yet (see [`Turbo::with_head_dims`]).
    ///
    /// # Panics
    /// If `bits` is outside 1..=[`MAX_BITS`].
    pub fn new(bits: u8, options: Options) -> Turbo {
        assert!((1..=MAX_BITS).contains(&bits));
        Turbo {
            bits,
            options,
            tables: Vec::new(),
        }
    }

    /// This codec with trained codebooks for every head_dim in `dims`.
    ///
    /// # Errors
    /// [`Error::Parameter`] for an unsupported head_dim.
    pub fn with_head_dims(&self, dims: &[u32]) -> Result<Turbo> {
        let mut c = self.clone();
        for &d in dims {
            sphere::check_dim_key(d, None)?;
            if c.tables.iter().all(|t| t.dim != d) {
                c.tables.push(Arc::new(CoordTables::trained(d, self.bits)));
            }
        }
        c.tables.sort_by_key(|t| t.dim);
        Ok(c)
    }

    /// The unit quantizer for head_dim `d`, when its codebook is present.
    pub fn quantizer(&self, d: u32) -> Option<ScalarQuantizer> {
        self.tables
            .iter()
            .find(|t| t.dim == d)
            .map(|t| ScalarQuantizer {
                bits: self.bits,
                tables: t.clone(),
            })
    }

    fn quantizer_for(&self, t: &TensorInfo) -> Result<ScalarQuantizer> {
        self.quantizer(t.head_dim)
            .ok_or_else(|| sphere::no_codebook(&self.name(), "codebook", t))
    }

    /// Compressed-domain scores `q . k_t` for every token of `plane` of a
    /// K page (see [`sphere::unit_scores`]).
    ///
    /// # Errors
    /// As [`sphere::unit_scores`]; [`Error::Parameter`] without a codebook
    /// for the head_dim.
    pub fn scores(
        &self,
        page: &PageView<'_>,
        t: &TensorInfo,
        plane: usize,
        q: &[f32],
    ) -> Result<Vec<f32>> {
        let uq = self.quantizer_for(t)?;
        sphere::unit_scores(&uq, &self.options, page, t, plane, q)
    }
}

fn parse(s: &str) -> Option<Result<Box<dyn Codec>>> {
    let p = match sphere::parse_name("turbo", s)? {
        Ok(p) => p,
        Err(e) => return Some(Err(e)),
    };
    let bits = match p.bits.strip_prefix('b').and_then(|b| b.parse::<u8>().ok()) {
        Some(b) if (1..=MAX_BITS).contains(&b) => b,
        _ => {
            return Some(Err(Error::param(format!(
                "{s:?}: TurboQuant takes b1..b{MAX_BITS}, e.g. turbo:b3"
            ))));
        }
    };
    if let Some(opt) = p.rest.first() {
        return Some(Err(Error::param(format!(
            "{s:?}: unknown turbo option {opt:?} (+qjl, :vg{{g}}, :seed{{n}})"
        ))));
    }
    Some(Ok(Box::new(Turbo::new(
        bits,
        sphere::options_from(&p, bits),
    ))))
}

impl Turbo {
    /// Rebuilds the codec from its parameter block (layout in
    /// format/codecs/turbo.md), e.g. to call [`Turbo::scores`] on a file's pages.
    ///
    /// # Errors
    /// [`Error::Parameter`] for an invalid block.
    pub fn from_params(p: &[u8]) -> Result<Turbo> {
        let (bits, b2, enc, options, tail) = sphere::read_header(p)?;
        if !(1..=MAX_BITS).contains(&bits) || b2 != 0 || enc != 0 {
            return Err(Error::param(format!(
                "turbo header: bits {bits} (1..={MAX_BITS}), bytes 1 and 3 must be 0 (found {b2}, {enc})"
            )));
        }
        let mut at = 0;
        let n = sphere::read_u32(tail, &mut at)? as usize;
        let mut tables = Vec::new();
        let mut prev = None;
        for _ in 0..n {
            let d = sphere::read_u32(tail, &mut at)?;
            sphere::check_dim_key(d, prev)?;
            prev = Some(d);
            let c = sphere::read_f32s(tail, &mut at, 1 << bits)?;
            sphere::check_codebook("coordinate", &c, -1.0, 1.0)?;
            tables.push(Arc::new(CoordTables::new(d, c)));
        }
        if at != tail.len() {
            return Err(Error::param(format!(
                "{} bytes after the turbo codebooks",
                tail.len() - at
            )));
        }
        Ok(Turbo {
            bits,
            options,
            tables,
        })
    }
}

impl Turbo {
    /// The coordinate centroids for head_dim `d`, if the codec has them.
    pub fn coord_codebook(&self, d: u32) -> Option<&[f32]> {
        self.tables
            .iter()
            .find(|t| t.dim == d)
            .map(|t| t.centroids.as_slice())
    }
}

impl Codec for Turbo {
    fn size_depends_only_on_shape(&self) -> bool {
        true
    }

    fn name(&self) -> String {
        let mut n = format!("turbo:b{}", self.bits);
        if self.options.qjl {
            n.push_str("+qjl");
        }
        n.push_str(&sphere::options_suffix(&self.options, self.bits));
        n
    }

    fn id(&self) -> u16 {
        ID
    }

    fn params(&self) -> Vec<u8> {
        let mut p = sphere::write_header(self.bits, 0, 0, &self.options);
        sphere::write_dim_tables(
            &mut p,
            self.tables.iter().map(|t| (t.dim, &t.centroids[..])),
        );
        p
    }

    fn check(&self, t: &TensorInfo) -> Result<()> {
        sphere::check_tensor("turbo", &self.options, t)
    }

    fn prepare(
        &self,
        cache: &crate::view::CacheView<'_>,
        _layout: &Layout,
    ) -> Result<Option<Box<dyn Codec>>> {
        let dims = sphere::coded_head_dims(&self.options, cache);
        Ok(Some(Box::new(self.with_head_dims(&dims)?)))
    }

    fn encode(&self, page: &PageIn<'_>) -> Result<Vec<Section>> {
        match self.options.values {
            Values::Groups { bits, group } if page.tensor.kind.role() == Role::Value => {
                sphere::encode_group_page(bits, group, page)
            }
            _ => {
                let uq = self.quantizer_for(page.tensor)?;
                sphere::encode_unit_page(&uq, &self.options, page)
            }
        }
    }

    fn decode(&self, page: &PageView<'_>, out: &mut PageOut<'_>) -> Result<()> {
        match self.options.values {
            Values::Groups { bits, group } if out.tensor.kind.role() == Role::Value => {
                sphere::decode_group_page(bits, group, page, out)
            }
            _ => {
                let uq = self.quantizer(out.tensor.head_dim).ok_or_else(|| {
                    page.error(format!(
                        "the turbo parameter block has no codebook for head_dim {}",
                        out.tensor.head_dim
                    ))
                })?;
                sphere::decode_unit_page(&uq, &self.options, page, out)
            }
        }
    }

    fn bits_per_element(&self, t: &TensorInfo) -> f64 {
        sphere::bits_per_element(&self.options, t, self.bits as usize * t.head_dim as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::Kind;
    use crate::codec::registry;
    use crate::format::CodecEntry;

    #[test]
    fn names_round_trip_through_params() {
        for n in [
            "turbo:b1",
            "turbo:b3",
            "turbo:b6",
            "turbo:b2+qjl",
            "turbo:b3:vg32",
            "turbo:b4+qjl:vg16b2:seed3",
        ] {
            let c = registry::parse(n).unwrap();
            let t = Turbo::new(c.params()[0], sphere::read_header(&c.params()).unwrap().3)
                .with_head_dims(&[64, 256])
                .unwrap();
            assert_eq!(t.name(), n);
            let back = registry::from_entry(
                0,
                &CodecEntry {
                    id: ID,
                    params: t.params(),
                },
            )
            .unwrap();
            assert_eq!(back.name(), n);
            assert_eq!(back.params(), t.params());
        }
        for n in [
            "turbo:b0",
            "turbo:b7",
            "turbo:3",
            "turbo:b3:full",
            "turbo:b3:vg0",
        ] {
            assert!(registry::parse(n).is_err(), "{n}");
        }
    }

    #[test]
    fn corrupt_parameter_blocks_are_rejected() {
        let good = Turbo::new(3, Options::default())
            .with_head_dims(&[128])
            .unwrap()
            .params();
        assert!(Turbo::from_params(&good).is_ok());
        for (at, v) in [(0usize, 0u8), (1, 1), (3, 1), (2, 4)] {
            let mut p = good.clone();
            p[at] = v;
            assert!(Turbo::from_params(&p).is_err(), "byte {at}");
        }
        let mut p = good.clone();
        p[24..28].copy_from_slice(&1.5f32.to_le_bytes());
        assert!(Turbo::from_params(&p).is_err());
        assert!(Turbo::from_params(&good[..good.len() - 2]).is_err());
    }

    #[test]
    fn codes_are_the_nearest_centroid() {
        let q = Turbo::new(3, Options::default())
            .with_head_dims(&[64])
            .unwrap()
            .quantizer(64)
            .unwrap();
        let u: Vec<f32> = (0..64).map(|i| (i as f32 - 31.5) / 100.0).collect();
        let mut codes = vec![0u8; 64];
        q.quantize(&u, &mut [&mut codes]);
        let mut back = vec![0f32; 64];
        q.reconstruct(&[&codes], &mut back);
        for (x, y) in u.iter().zip(&back) {
            let best = q
                .tables
                .centroids
                .iter()
                .map(|c| (c - x).abs())
                .fold(f32::INFINITY, f32::min);
            assert_eq!((y - x).abs(), best);
        }
        // bits/element: b + 32/d.
        let t = TensorInfo {
            name: String::new(),
            layer: 0,
            kind: Kind::Key,
            dtype: crate::cache::DType::Bf16,
            batch: 1,
            heads: 1,
            tokens: 1,
            head_dim: 128,
        };
        assert_eq!(Turbo::new(3, Options::default()).bits_per_element(&t), 3.25);
    }
}
