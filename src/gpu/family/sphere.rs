//! `turbo` and `octopus` coded pages: norm, rotated unit-vector codes
//! (TurboQuant per coordinate, OCTOPUS per triplet), optional QJL residual
//! (`kernels/sphere.cu`). Their value-group V pages are the kivi family.

use crate::cache::{Role, TensorInfo};
use crate::codec::Codec;
use crate::codec::octopus::{self, Octopus};
use crate::codec::sphere::{self, PURPOSE_QJL, PURPOSE_ROTATION, Values};
use crate::codec::turbo::{self, Turbo};
use crate::error::{Error, Result};
use crate::format::PageView;

use super::{GpuFamily, OUTS, a64, at, choice, packed, units};
use super::{f32_bytes, sign_bits};
use crate::gpu::spec::{Grid, KernelChoice, KernelCodec, KernelOptions, OutType};

/// The sphere family ([`KernelCodec::Sphere`]).
pub(crate) struct Family;

fn fields(kc: KernelCodec) -> (bool, u8, u8, bool) {
    let KernelCodec::Sphere { octopus, a, b, qjl } = kc else {
        unreachable!("sphere family")
    };
    (octopus, a, b, qjl)
}

/// True when an octopus split's products `n(a, b) * C_rho[jn]` fit the
/// 1024-entry shared table of the `octt` kernels (`2 b_dir + b_norm <= 10`).
pub fn octopus_product_table(b_dir: u8, b_norm: u8) -> bool {
    2 * u32::from(b_dir) + u32::from(b_norm) <= 10
}

/// Byte offset of the sign vectors in a sphere side table: after the
/// direction (octopus, float4 per code pair) and norm / coordinate
/// codebooks, 16-aligned.
pub fn sphere_sign_offset(octopus: bool, a: u8, b: u8) -> u32 {
    let tables = if octopus {
        16 * (1u32 << (2 * a)) + 4 * (1u32 << b)
    } else {
        4 * (1u32 << a)
    };
    tables.next_multiple_of(16)
}

impl GpuFamily for Family {
    fn codec_ids(&self) -> &'static [u16] {
        &[octopus::ID, turbo::ID]
    }

    fn kernel_codec(&self, codec: &dyn Codec, t: &TensorInfo) -> Result<KernelCodec> {
        let (a, b, _, opts, _) = sphere::read_header(&codec.params())?;
        if let (false, Values::Groups { bits, group }) =
            (sphere::unit_coded(&opts, t.kind), opts.values)
        {
            return Ok(KernelCodec::Kivi {
                bits,
                group,
                tokens: false,
            });
        }
        let octopus = codec.id() == octopus::ID;
        Ok(KernelCodec::Sphere {
            octopus,
            a,
            b: if octopus { b } else { 0 },
            qjl: opts.qjl && t.kind.role() == Role::Key,
        })
    }

    fn page_sections(
        &self,
        kc: KernelCodec,
        page: &PageView<'_>,
        t: &TensorInfo,
    ) -> Result<([u32; 5], u32)> {
        let (octopus, a, b, qjl) = fields(kc);
        let rows = t.planes() * page.header.meta.tokens as usize;
        let d = t.head_dim as usize;
        let triplets = d.div_ceil(3);
        let streams: &[(u8, usize)] = if octopus {
            &[(a, 2 * triplets), (b, triplets)]
        } else {
            &[(a, d)]
        };
        let u = sphere::unit_sections(page, streams, qjl, rows, d)?;
        let (g, bits) = u.qjl.map_or((0, 0), |(g, b)| (at(page, g), at(page, b)));
        Ok((
            [
                at(page, u.gammas),
                at(page, u.codes[0]),
                u.codes.get(1).map_or(0, |c| at(page, c)),
                g,
                bits,
            ],
            0,
        ))
    }

    fn decode_kernel(
        &self,
        kc: KernelCodec,
        head_dim: u32,
        out: OutType,
        _opts: KernelOptions,
    ) -> Result<KernelChoice> {
        let (octopus, a, b, qjl) = fields(kc);
        let o = out.suffix();
        if !head_dim.is_power_of_two() || head_dim > 4096 {
            return Err(Error::Unsupported(format!(
                "GPU octopus/turbo kernels handle power-of-two head_dim up to 4096, not {head_dim}"
            )));
        }
        Ok(if (32..=1024).contains(&head_dim) {
            let kind = match octopus {
                false => "turbo",
                true if octopus_product_table(a, b) => "octt",
                true => "oct",
            };
            let q = if qjl { "_qjl" } else { "" };
            choice(
                "sphere",
                format!("decode_sphere_{kind}{q}_{o}"),
                units(32, 1),
            )
        } else {
            choice("sphere", format!("decode_sphere_any_{o}"), Grid::Rows)
        })
    }

    fn desc_params(&self, kc: KernelCodec, head_dim: u32, _extra: u32) -> [u32; 4] {
        let (octopus, a, b, qjl) = fields(kc);
        [
            u32::from(a),
            u32::from(b) | u32::from(octopus) << 8 | u32::from(qjl) << 9,
            sphere_sign_offset(octopus, a, b),
            crate::kernels::wht::inv_sqrt(head_dim as usize).to_bits(),
        ]
    }

    fn canonical_body_len(&self, kc: KernelCodec, rows: u64, _tokens: u64, d: u64) -> u64 {
        let (octopus, ba, b, _) = fields(kc);
        let t = d.div_ceil(3);
        let codes = if octopus {
            a64(packed(2 * rows * t, u64::from(ba))) + a64(packed(rows * t, u64::from(b)))
        } else {
            a64(packed(rows * d, u64::from(ba)))
        };
        128 + a64(4 * rows) + codes + a64(2 * rows) + a64(rows * d / 8)
    }

    /// Octopus: float4 directions, the norm centroids, then per kv head the
    /// rotation (and QJL) sign bits, then the product table when it fits;
    /// turbo: the coordinate centroids, then the signs ([`super::super::side`]).
    fn side_table(
        &self,
        codec: &dyn Codec,
        kc: KernelCodec,
        t: &TensorInfo,
    ) -> Result<Option<Vec<u8>>> {
        let (octopus, a, b, qjl) = fields(kc);
        let p = codec.params();
        let missing = || sphere::no_codebook(&codec.name(), "codebook", t);
        let (oct, tur);
        let (opts, dirs_table, book) = if octopus {
            oct = Octopus::from_params(&p)?;
            let book = oct.norm_codebook(t.head_dim).ok_or_else(missing)?;
            (oct.options, Some(oct.dir_tables()), book)
        } else {
            tur = Turbo::from_params(&p)?;
            let book = tur.coord_codebook(t.head_dim).ok_or_else(missing)?;
            (tur.options, None, book)
        };
        let mut out = Vec::new();
        if let Some(tables) = dirs_table {
            for x in 0..1usize << a {
                for y in 0..1usize << a {
                    let n = tables.dir(x, y);
                    out.extend_from_slice(&f32_bytes(&[n[0], n[1], n[2], 0.0]));
                }
            }
        }
        out.extend_from_slice(&f32_bytes(book));
        out.resize(sphere_sign_offset(octopus, a, b) as usize, 0);
        let d = t.head_dim as usize;
        for head in 0..t.heads {
            let s = sphere::signs_for(opts.seed, t.layer, head, t.kind, PURPOSE_ROTATION, d);
            out.extend_from_slice(&sign_bits(&s));
            if qjl {
                let s2 = sphere::signs_for(opts.seed, t.layer, head, t.kind, PURPOSE_QJL, d);
                out.extend_from_slice(&sign_bits(&s2));
            }
        }
        if let Some(dirs) = dirs_table.filter(|_| octopus_product_table(a, b)) {
            // Products n(x, y)_k * C_rho[jn] (the decoder's f32 products), at
            // ((x | y << b_dir) << b_norm) | jn.
            out.resize(out.len().next_multiple_of(16), 0);
            for pair in 0..1usize << (2 * a) {
                let (x, y) = (pair & ((1 << a) - 1), pair >> a);
                let n = dirs.dir(x, y);
                for &rho in book {
                    out.extend_from_slice(&f32_bytes(&[n[0] * rho, n[1] * rho, n[2] * rho, 0.0]));
                }
            }
        }
        Ok(Some(out))
    }

    fn kernel_names(&self) -> Vec<(&'static str, String)> {
        let mut v = Vec::new();
        for out in OUTS {
            let o = out.suffix();
            for kind in ["turbo", "oct", "octt"] {
                for q in ["", "_qjl"] {
                    v.push(("sphere", format!("decode_sphere_{kind}{q}_{o}")));
                }
            }
            v.push(("sphere", format!("decode_sphere_any_{o}")));
        }
        v
    }
}
