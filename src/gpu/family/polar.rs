//! `polar` key pages: per-pair radius and angle codes (`kernels/polar.cu`);
//! polar's V pages are raw or `int{b}` and decode through those families.

use crate::cache::{Role, TensorInfo};
use crate::codec::Codec;
use crate::codec::polar::{self, Pairing, Polar, Values};
use crate::error::Result;
use crate::format::PageView;

use super::{GpuFamily, OUTS, POLAR_UNITS, a64, at, choice, chunked, packed, units};
use crate::gpu::spec::{KernelChoice, KernelCodec, KernelOptions, OutType, UNITS_PER_THREAD};

/// The polar family ([`KernelCodec::Polar`]).
pub(crate) struct Family;

fn fields(kc: KernelCodec) -> (u8, u8, bool) {
    let KernelCodec::Polar { m, n, adjacent } = kc else {
        unreachable!("polar family")
    };
    (m, n, adjacent)
}

impl GpuFamily for Family {
    fn codec_ids(&self) -> &'static [u16] {
        &[polar::ID]
    }

    fn kernel_codec(&self, codec: &dyn Codec, t: &TensorInfo) -> Result<KernelCodec> {
        let c = Polar::from_params(&codec.params())?;
        Ok(match (t.kind.role() == Role::Key, c.values) {
            (true, _) => KernelCodec::Polar {
                m: c.angle_bits,
                n: c.radius_bits,
                adjacent: c.pairing == Pairing::Adjacent,
            },
            (false, Values::Raw) => KernelCodec::Raw { src: t.dtype },
            (false, Values::Int(bits)) => KernelCodec::Affine { bits, block: None },
        })
    }

    fn page_sections(
        &self,
        kc: KernelCodec,
        page: &PageView<'_>,
        t: &TensorInfo,
    ) -> Result<([u32; 5], u32)> {
        let (m, n, _) = fields(kc);
        let tokens = page.header.meta.tokens as usize;
        let (s, i) = polar::key_sections(m + n, page, t.planes(), tokens, t.head_dim as usize)?;
        Ok(([at(page, s), at(page, i), 0, 0, 0], 0))
    }

    fn decode_kernel(
        &self,
        kc: KernelCodec,
        head_dim: u32,
        out: OutType,
        _opts: KernelOptions,
    ) -> Result<KernelChoice> {
        let (m, n, adjacent) = fields(kc);
        let o = out.suffix();
        let c = u32::from(m) + u32::from(n);
        Ok(if head_dim.is_multiple_of(16) && c <= 8 {
            let pairing = if adjacent { "adj" } else { "half" };
            let cc = if matches!(c, 4 | 6 | 8) { c } else { 0 };
            if adjacent {
                // The per-unit kernel: measured faster than a quad
                // kernel for adjacent pairs (tests/benches/gpu.md).
                choice(
                    "polar",
                    format!("decode_polar_adj_c{cc}_{o}"),
                    units(16, POLAR_UNITS),
                )
            } else {
                chunked(
                    "polar",
                    &format!("decode_polar_{pairing}"),
                    &format!("_c{cc}_{o}"),
                    head_dim,
                    16,
                    POLAR_UNITS,
                )
            }
        } else {
            choice(
                "polar",
                format!("decode_polar_any_{o}"),
                units(2, UNITS_PER_THREAD),
            )
        })
    }

    fn desc_params(&self, kc: KernelCodec, _head_dim: u32, _extra: u32) -> [u32; 4] {
        let (m, n, adjacent) = fields(kc);
        [
            u32::from(m),
            u32::from(m) + u32::from(n),
            u32::from(adjacent),
            0,
        ]
    }

    fn canonical_body_len(&self, kc: KernelCodec, rows: u64, tokens: u64, d: u64) -> u64 {
        let (m, n, _) = fields(kc);
        let planes = rows.checked_div(tokens).unwrap_or(0);
        64 + a64(4 * planes * d / 2) + a64(packed(rows * d / 2, u64::from(m + n)))
    }

    /// The `2^m` directions `(cos, sin)` of the parameter block, f32 pairs.
    fn side_table(
        &self,
        codec: &dyn Codec,
        _kc: KernelCodec,
        _t: &TensorInfo,
    ) -> Result<Option<Vec<u8>>> {
        let mut out = Vec::new();
        for d in Polar::from_params(&codec.params())?.directions() {
            out.extend_from_slice(&super::f32_bytes(d));
        }
        Ok(Some(out))
    }

    fn kernel_names(&self) -> Vec<(&'static str, String)> {
        let mut v = Vec::new();
        for out in OUTS {
            let o = out.suffix();
            for pairing in ["half", "adj", "halfq"] {
                for c in [0, 4, 6, 8] {
                    v.push(("polar", format!("decode_polar_{pairing}_c{c}_{o}")));
                }
            }
            v.push(("polar", format!("decode_polar_any_{o}")));
        }
        v
    }
}
