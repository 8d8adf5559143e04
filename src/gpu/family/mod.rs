//! One home per codec family on the GPU. Each kernel family
//! ([`KernelCodec`] variant) has one file here implementing `GpuFamily`:
//! the kernel family of a (codec, tensor) pair read from the codec's id and
//! parameter block, the checked section offsets of a page, the kernel that
//! decodes it and its grid, the codec parameters its descriptor carries,
//! the sections of its canonical body (the one statement of its page
//! layout here: the body length and the encode body layouts follow from it),
//! the side table, the kernel names it may ask for and, for the families
//! with a GPU encoder, the encode plan.
//!
//! | family | file | codecs (ids) |
//! |---|---|---|
//! | `Raw` | `raw.rs` | `raw` |
//! | `Affine` | `affine.rs` | `int{b}`, `bdr{h}` |
//! | `Kivi` | `kivi.rs` | `kivi` (and octopus / turbo value-group V pages) |
//! | `InnerQ` | `innerq.rs` | `innerq` |
//! | `Polar` | `polar.rs` | `polar` (its V pages are `Raw` / `Affine`) |
//! | `Sphere` | `sphere.rs` | `turbo`, `octopus` |
//! | `Hqmq` | `hqmq.rs` | `hqmq` |
//!
//! Dispatch happens in two places, both here: [`KernelCodec::of`] (codec
//! id to the family that reads its parameter block, `FAMILIES`) and
//! `of` (kernel family to its implementation).
//!
//! Nothing here reads a codec's bytes: parameters come from each codec's
//! own parser (`Kivi::from_params`, `InnerQ::from_params`, ...) and every
//! page is checked by the codec's own page layout, the function its CPU
//! decoder uses (section kinds, streams, element types, counts, no extra
//! section, and content the kernels do not check themselves: finite scales
//! and zero points, InnerQ slots, the outlier table). The GPU therefore
//! accepts exactly the pages the CPU accepts.

pub(crate) mod affine;
pub(crate) mod group_enc;
pub(crate) mod hqmq;
pub(crate) mod innerq;
pub(crate) mod kivi;
pub(crate) mod polar;
pub(crate) mod raw;
pub(crate) mod sphere;

use crate::cache::TensorInfo;
use crate::codec::Codec;
use crate::error::{Error, Result};
use crate::format::{ElemType, PageView, SectionKind};

use super::body::{CanonicalBody, SectionSpec};
use super::encplan::{EncodeJob, EncodeLayout, Place};
use super::spec::{Grid, KernelChoice, KernelCodec, KernelOptions, OutType};
use crate::plan::PlannedPage;

pub use hqmq::{HQ_NPOS, HQ_SMEM_MAX};
pub use sphere::{octopus_product_table, sphere_sign_offset};

/// Units (8 channels) per thread of the fast kivi / innerq kernels
/// (`KIVI_U`, `INNERQ_U`).
pub const GROUP_UNITS: u32 = 4;
/// Units (8 pairs) per thread of the fast polar kernels (`POLAR_U`).
pub const POLAR_UNITS: u32 = 4;
/// Units (8 elements, or 8 polar pairs) per thread of the quad kernels:
/// `QUADS` quads of 4 rows (`kernels/common.cuh`).
pub const QUAD_UNITS: u32 = 4;

/// The GPU side of one kernel family (module docs). Every method but
/// `GpuFamily::kernel_codec` receives a `kc` of this family's variant.
pub(crate) trait GpuFamily: Sync {
    /// Ids of the codecs whose parameter blocks this family reads
    /// ([`KernelCodec::of`] dispatches on them).
    fn codec_ids(&self) -> &'static [u16];

    /// The kernel family of pages of `t` encoded by `codec` (one of
    /// `GpuFamily::codec_ids`), from the codec's own parameter parser;
    /// may be another family's variant (polar V pages are raw / affine).
    ///
    /// # Errors
    /// [`Error::Parameter`] for a block that does not parse or does not
    /// fit `t`.
    fn kernel_codec(&self, codec: &dyn Codec, t: &TensorInfo) -> Result<KernelCodec>;

    /// Checked section offsets `[s0..s4]` of a page (meaning: the
    /// kernel's, see its `.cu` file) and its page-specific parameter (hqmq:
    /// inlier chunks; else 0), from the codec's own page layout function.
    ///
    /// # Errors
    /// [`Error::Format`] naming the page, as the CPU decoder reports it.
    fn page_sections(
        &self,
        kc: KernelCodec,
        page: &PageView<'_>,
        t: &TensorInfo,
    ) -> Result<([u32; 5], u32)>;

    /// The kinds of the sections whose content [`GpuFamily::page_sections`]
    /// reads (beyond the section table): what a host must hold of a page
    /// whose body is in device memory to check it (`gpu::decplan`,
    /// `BodyCheck::Device`). Defaults to every kind; families whose checks
    /// are the section table alone return none.
    fn host_checked(&self) -> &'static [SectionKind] {
        &ALL_KINDS
    }

    /// The decode kernel (source, name, grid, shared memory) for pages of
    /// head_dim `head_dim` written as `out`.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for shapes no kernel handles.
    fn decode_kernel(
        &self,
        kc: KernelCodec,
        head_dim: u32,
        out: OutType,
        opts: KernelOptions,
    ) -> Result<KernelChoice>;

    /// The codec parameters `p0..p3` of a page descriptor (`extra`: the
    /// page-specific parameter of `GpuFamily::page_sections`).
    fn desc_params(&self, _kc: KernelCodec, _head_dim: u32, _extra: u32) -> [u32; 4] {
        [0; 4]
    }

    /// The sections of the canonical body (format/SPEC.md 6.2) of a page
    /// of `rows` rows (`tokens` per plane) of `d` channels, in the order
    /// the CPU encoder writes them: the kinds, streams, element types and
    /// counts the codec's page layout function expects (an upper bound
    /// where the body depends on the data: the hqmq `+med` outlier table
    /// and inlier streams). The one statement of a family's page layout
    /// on the GPU side: `canonical_body_len` (staging of zstd pages) and
    /// the encode body layouts derive from it, and `tests/conformance.rs`
    /// checks it against the pages the CPU writes for every registry
    /// example.
    ///
    /// # Errors
    /// [`Error::Parameter`] for a section over 2^32 elements or 4 GiB.
    fn body_sections(
        &self,
        kc: KernelCodec,
        rows: u64,
        tokens: u64,
        d: u64,
    ) -> Result<Vec<SectionSpec>>;

    /// The decode side table of `t` ([`super::side`] lists the layouts),
    /// or `None` when the kernels need none.
    ///
    /// # Errors
    /// [`Error::Parameter`] when the parameter block lacks what `t` needs.
    fn side_table(
        &self,
        _codec: &dyn Codec,
        _kc: KernelCodec,
        _t: &TensorInfo,
    ) -> Result<Option<Vec<u8>>> {
        Ok(None)
    }

    /// Every `(source, kernel name)` the family's decode and encode may
    /// launch (the source check test compiles them all).
    fn kernel_names(&self) -> Vec<(&'static str, String)>;

    /// True when the GPU encodes pages of `kc` (`GpuFamily::plan_encode`
    /// plans them).
    fn encodes(&self, _kc: KernelCodec) -> bool {
        false
    }

    /// True when the encoder of `kc` (`GpuFamily::encodes`) also takes
    /// tensors shaped like `t` (kernel limits on head_dim); default: all.
    fn encodes_shape(&self, _kc: KernelCodec, _t: &TensorInfo) -> bool {
        true
    }

    /// Plans a GPU encode (page body layouts, descriptors, launches);
    /// scratch buffers and side tables are placed through `place`, which
    /// returns their device address.
    ///
    /// # Errors
    /// [`Error::Unsupported`] without a GPU encoder (the default);
    /// [`Error::Parameter`] for pages the codec cannot encode; the errors
    /// of `place`.
    fn plan_encode(&self, job: &EncodeJob<'_>, _place: &mut dyn Place) -> Result<EncodeLayout> {
        Err(Error::Unsupported(format!(
            "no GPU encoder for {} yet; encode it on the CPU",
            job.codec.name()
        )))
    }
}

/// Every family, in [`KernelCodec`] order.
pub(crate) const FAMILIES: [&dyn GpuFamily; 7] = [
    &raw::Family,
    &affine::Family,
    &kivi::Family,
    &innerq::Family,
    &polar::Family,
    &sphere::Family,
    &hqmq::Family,
];

/// The family of a kernel codec: the one dispatch from [`KernelCodec`] to
/// its implementation.
pub(crate) fn of(kc: KernelCodec) -> &'static dyn GpuFamily {
    match kc {
        KernelCodec::Raw { .. } => &raw::Family,
        KernelCodec::Affine { .. } => &affine::Family,
        KernelCodec::Kivi { .. } => &kivi::Family,
        KernelCodec::InnerQ { .. } => &innerq::Family,
        KernelCodec::Polar { .. } => &polar::Family,
        KernelCodec::Sphere { .. } => &sphere::Family,
        KernelCodec::Hqmq { .. } => &hqmq::Family,
    }
}

impl KernelCodec {
    /// The kernel family of pages of `t` encoded by `codec`, from the
    /// codec's own parameter parser (through the family listing the codec's
    /// id, `GpuFamily::codec_ids`).
    ///
    /// # Errors
    /// [`Error::Unsupported`] for a codec without GPU kernels or a tensor
    /// the kernels do not take; [`Error::Parameter`] for a parameter block
    /// that does not parse or a bdr block that does not divide head_dim.
    pub fn of(codec: &dyn Codec, t: &TensorInfo) -> Result<KernelCodec> {
        super::spec::supported(t)?;
        let id = codec.id();
        match FAMILIES.iter().find(|f| f.codec_ids().contains(&id)) {
            Some(f) => f.kernel_codec(codec, t),
            None => Err(Error::Unsupported(format!(
                "no GPU kernels for codec {} (id {id}) yet; decode it on the CPU",
                codec.name(),
            ))),
        }
    }
}

/// `GpuFamily::page_sections` of `kc`'s family.
///
/// # Errors
/// [`Error::Format`] naming the page when a section is missing, extra, has
/// the wrong type or count, or content the CPU decoder rejects.
pub fn page_sections(
    kc: KernelCodec,
    page: &PageView<'_>,
    t: &TensorInfo,
) -> Result<([u32; 5], u32)> {
    of(kc).page_sections(kc, page, t)
}

/// Every section kind.
const ALL_KINDS: [SectionKind; 6] = [
    SectionKind::Scale,
    SectionKind::Zero,
    SectionKind::Index,
    SectionKind::Outliers,
    SectionKind::Raw,
    SectionKind::Aux,
];

/// `GpuFamily::host_checked` of `kc`'s family.
pub fn host_checked(kc: KernelCodec) -> &'static [SectionKind] {
    of(kc).host_checked()
}

/// `GpuFamily::decode_kernel` of `kc`'s family.
///
/// # Errors
/// [`Error::Unsupported`] for shapes no kernel handles (`int`/`bdr`
/// head_dim above [`super::spec::SEG_MAX`], hqmq head_dim above 8192,
/// octopus / turbo head_dim above 4096 or not a power of two).
pub fn decode_kernel(
    kc: KernelCodec,
    head_dim: u32,
    out: OutType,
    opts: KernelOptions,
) -> Result<KernelChoice> {
    of(kc).decode_kernel(kc, head_dim, out, opts)
}

/// `GpuFamily::desc_params` of `kc`'s family.
pub fn desc_params(kc: KernelCodec, head_dim: u32, extra: u32) -> [u32; 4] {
    of(kc).desc_params(kc, head_dim, extra)
}

/// `GpuFamily::body_sections` of `kc`'s family: the canonical sections of
/// a page of `rows` rows (`tokens` per plane) of `d` channels.
///
/// # Errors
/// [`Error::Parameter`] for a section over 2^32 elements or 4 GiB.
pub fn body_sections(kc: KernelCodec, rows: u64, tokens: u64, d: u64) -> Result<Vec<SectionSpec>> {
    of(kc).body_sections(kc, rows, tokens, d)
}

/// Length in bytes of the canonical body (format/SPEC.md 6.2) of a page of
/// `rows` rows (`tokens` per plane) of `d` channels: the layout of
/// [`body_sections`], what the CPU encoder writes (an upper bound where
/// the body depends on the data). Sizes staging for zstd pages before they
/// are decompressed. `u64::MAX` for a body over 4 GiB, which no page holds.
pub fn canonical_body_len(kc: KernelCodec, rows: u64, tokens: u64, d: u64) -> u64 {
    body_sections(kc, rows, tokens, d)
        .and_then(CanonicalBody::new)
        .map_or(u64::MAX, |b| u64::from(b.body_len))
}

/// Plans the encode of `pages` of tensor `info` (source elements at device
/// address `src`, `[planes, tokens, head_dim]`) with `codec`, through the
/// codec's family (`GpuFamily::plan_encode`). `place`
/// stores a byte buffer on the device and returns its address.
///
/// # Errors
/// [`Error::Parameter`] for a page outside the tensor or a codec that
/// cannot encode it; [`Error::Unsupported`] for codecs without a GPU
/// encoder (`gpu_encodes` is false); the errors of `place`.
pub(crate) fn plan_encode(
    src: u64,
    info: &TensorInfo,
    codec: &dyn Codec,
    pages: &[PlannedPage],
    opts: KernelOptions,
    place: &mut dyn Place,
) -> Result<EncodeLayout> {
    codec.check(info)?;
    let kc = KernelCodec::of(codec, info)?;
    let family = of(kc);
    if !family.encodes(kc) || !family.encodes_shape(kc, info) {
        return Err(Error::Unsupported(format!(
            "no GPU encoder for {}; encode it on the CPU",
            codec.name()
        )));
    }
    let job = EncodeJob {
        src,
        info,
        codec,
        kc,
        pages,
        opts,
    };
    family.plan_encode(&job, place)
}

/// True when the GPU encodes `codec` for tensor `info` (`plan_encode` accepts
/// it): the codec takes the tensor and its kernel family has an encoder
/// for its shape (`GpuFamily::encodes`, `GpuFamily::encodes_shape`; today
/// every family: `raw`, `int{b}`, `bdr{h}`, `hqmq` with or without `+med` (not `+chan`),
/// `kivi` (and the value-group V pages of `octopus` / `turbo`), `innerq`,
/// `polar` and the unit-coded pages of `octopus` / `turbo`).
pub fn gpu_encodes(codec: &dyn Codec, info: &TensorInfo) -> bool {
    codec.check(info).is_ok()
        && KernelCodec::of(codec, info)
            .is_ok_and(|kc| of(kc).encodes(kc) && of(kc).encodes_shape(kc, info))
}

/// Every `(source, kernel name)` of every family.
pub(crate) fn kernel_names() -> Vec<(&'static str, String)> {
    FAMILIES.iter().flat_map(|f| f.kernel_names()).collect()
}

// Shared helpers of the family files.

/// The parameter block of `codec` does not match its spec.
pub(crate) fn bad_params(codec: &dyn Codec) -> Error {
    Error::param(format!(
        "{}: parameter block of {} bytes does not match the codec spec",
        codec.name(),
        codec.params().len()
    ))
}

/// Whether the quad kernels handle rows of `upr` chunks (a power of two
/// <= 256, so a block's rows start at a multiple of 4).
fn quad_chunks(upr: u32) -> bool {
    upr.is_power_of_two() && upr <= 256
}

/// Section `(kind, stream)` of `count` elements of `elem`; its byte length
/// follows from the element type.
///
/// # Errors
/// [`Error::Parameter`] for a section over 2^32 elements or 4 GiB.
pub(crate) fn section(
    kind: SectionKind,
    stream: u8,
    elem: ElemType,
    count: u64,
) -> Result<SectionSpec> {
    let len = elem.byte_len(count).and_then(|l| u32::try_from(l).ok());
    match (u32::try_from(count), len) {
        (Ok(count), Some(len)) => Ok(SectionSpec {
            kind,
            stream,
            elem,
            count,
            len,
        }),
        _ => Err(Error::param(format!(
            "section {} stream {stream} of {count} {} elements: over 2^32 elements or 4 GiB",
            kind.name(),
            elem.name()
        ))),
    }
}

/// Groups of a kivi / innerq page: `ceil(T / G) * D` per plane along
/// tokens, `D / G` per row along channels.
pub(crate) fn group_count(tokens_axis: bool, group: u32, planes: u64, tokens: u64, d: u64) -> u64 {
    if tokens_axis {
        planes * tokens.div_ceil(u64::from(group)) * d
    } else {
        planes * tokens * (d / u64::from(group))
    }
}

/// Offset in the page body of `bytes`, a section slice of `page`.
pub(crate) fn at(page: &PageView<'_>, bytes: &[u8]) -> u32 {
    let o = bytes.as_ptr() as usize - page.body().as_ptr() as usize;
    debug_assert!(o + bytes.len() <= page.body().len());
    o as u32
}

/// Offset of section `(kind, stream)` (present: checked before).
pub(crate) fn offset(page: &PageView<'_>, kind: SectionKind, stream: u8) -> u32 {
    page.sections()
        .iter()
        .find(|s| s.kind == kind && s.stream == stream)
        .map(|s| s.offset)
        .expect("section checked by the codec's page layout")
}

/// A kernel choice without shared memory.
pub(crate) fn choice(source: &'static str, name: String, grid: Grid) -> KernelChoice {
    KernelChoice {
        source,
        name,
        grid,
        shared: 0,
    }
}

/// Units of `w` elements, `per_thread` per thread.
pub(crate) fn units(w: u32, per_thread: u32) -> Grid {
    Grid::Units { w, per_thread }
}

/// A decode kernel over units of `w` elements (8-element chunks; 16 for
/// polar's 8 pairs): the quad kernel `{prefix}q{suffix}` when a row's
/// chunks (`head_dim / w`) are a power of two <= 256, else the per-unit
/// kernel `{prefix}{suffix}` with `per_thread` units per thread.
pub(crate) fn chunked(
    codec: &'static str,
    prefix: &str,
    suffix: &str,
    head_dim: u32,
    w: u32,
    per_thread: u32,
) -> KernelChoice {
    if quad_chunks(head_dim / w) {
        choice(codec, format!("{prefix}q{suffix}"), units(w, QUAD_UNITS))
    } else {
        choice(codec, format!("{prefix}{suffix}"), units(w, per_thread))
    }
}

/// `v` as little-endian f32 bytes.
pub(crate) fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Sign bits (1 = negative, LSB-first) of a ±1 vector.
pub(crate) fn sign_bits(s: &[f32]) -> Vec<u8> {
    let mut b = vec![0u8; s.len().div_ceil(8)];
    for (i, &v) in s.iter().enumerate() {
        if v < 0.0 {
            b[i / 8] |= 1 << (i % 8);
        }
    }
    b
}

/// Both output types.
pub(crate) const OUTS: [OutType; 2] = [OutType::Bf16, OutType::F16];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::Kind;
    use crate::codec;
    use crate::gpu::spec::DEC_UNITS_W32;

    #[test]
    fn families_from_parameter_blocks() {
        let t = |kind| TensorInfo {
            name: "t".into(),
            layer: 0,
            kind,
            dtype: crate::cache::DType::Bf16,
            batch: 1,
            heads: 2,
            tokens: 10,
            head_dim: 128,
        };
        let kc = |name: &str, kind| {
            KernelCodec::of(codec::parse(name).unwrap().as_ref(), &t(kind)).unwrap()
        };
        assert_eq!(
            kc("hqmq:s96r4", Kind::Key),
            KernelCodec::Hqmq {
                s: 96,
                b: 4,
                e: 12,
                g: 17,
                w: 54,
                o: 9,
                med: false,
                chan: crate::codec::hqmq::Channels::Off
            }
        );
        assert_eq!(
            kc("kivi:2", Kind::Key),
            KernelCodec::Kivi {
                bits: 2,
                group: 32,
                tokens: true,
            }
        );
        assert_eq!(
            kc("polar:m4n4:vraw", Kind::Value),
            KernelCodec::Raw {
                src: crate::cache::DType::Bf16
            }
        );
        assert_eq!(
            kc("polar:m4n2:adjacent", Kind::Key),
            KernelCodec::Polar {
                m: 4,
                n: 2,
                adjacent: true
            }
        );
        assert_eq!(
            kc("innerq:k2v3", Kind::Value),
            KernelCodec::InnerQ {
                bits: 3,
                mode: 2,
                group: 32,
                tokens: true,
                norm: false
            }
        );
        assert_eq!(
            kc("turbo:b3+qjl", Kind::Key),
            KernelCodec::Sphere {
                octopus: false,
                a: 3,
                b: 0,
                qjl: true
            }
        );
        assert_eq!(
            kc("octopus:b3+qjl:vg32", Kind::Value),
            KernelCodec::Kivi {
                bits: 3,
                group: 32,
                tokens: false,
            }
        );
        assert!(matches!(
            kc("octopus:b3+qjl", Kind::Value),
            KernelCodec::Sphere {
                octopus: true,
                a: 4,
                b: 2,
                qjl: false
            }
        ));
    }

    #[test]
    fn kernel_names_exist_for_every_family() {
        let names = kernel_names();
        let hqmq = |med, chan| KernelCodec::Hqmq {
            s: 5,
            b: 2,
            e: 5,
            g: 3,
            w: 20,
            o: 15,
            med,
            chan,
        };
        use crate::codec::hqmq::Channels;
        for (kc, d) in [
            (hqmq(true, Channels::Gains), 12),
            (hqmq(false, Channels::Centred), 12),
            (
                KernelCodec::Polar {
                    m: 3,
                    n: 2,
                    adjacent: false,
                },
                64,
            ),
            (
                KernelCodec::Sphere {
                    octopus: true,
                    a: 4,
                    b: 2,
                    qjl: false,
                },
                2048,
            ),
        ] {
            let k = decode_kernel(kc, d, OutType::Bf16, KernelOptions::default()).unwrap();
            assert!(
                names.iter().any(|(s, n)| *s == k.source && *n == k.name),
                "{k:?}"
            );
        }
    }

    #[test]
    fn kernel_choice() {
        let bdr = |h| KernelCodec::Affine {
            bits: 4,
            block: Some(h),
        };
        assert_eq!(
            decode_kernel(bdr(128), 128, OutType::Bf16, KernelOptions::default())
                .unwrap()
                .name,
            "decode_affine_rowrot_b4_bf16"
        );
        assert_eq!(
            decode_kernel(bdr(64), 128, OutType::Bf16, KernelOptions::default())
                .unwrap()
                .name,
            "decode_affine_b4_bf16"
        );
        assert_eq!(
            decode_kernel(bdr(512), 512, OutType::F16, KernelOptions::default())
                .unwrap()
                .grid,
            Grid::Units {
                w: 32,
                per_thread: DEC_UNITS_W32
            }
        );
        assert_eq!(
            decode_kernel(bdr(512), 1024 + 512, OutType::F16, KernelOptions::default()).ok(),
            None
        );
        assert_eq!(
            decode_kernel(bdr(16), 48, OutType::F16, KernelOptions::default())
                .unwrap()
                .name,
            "decode_affine_w8_b4_f16"
        );
        assert_eq!(
            decode_kernel(bdr(32), 96, OutType::F16, KernelOptions::default())
                .unwrap()
                .name,
            "decode_affine_w8_b4_f16"
        );
        assert_eq!(
            decode_kernel(bdr(2), 6, OutType::F16, KernelOptions::default())
                .unwrap()
                .grid,
            Grid::Segments { seg: 2 }
        );
        assert_eq!(
            super::super::spec::encode_kernel(
                bdr(16),
                96,
                crate::cache::DType::Bf16,
                KernelOptions::default()
            )
            .unwrap()
            .name,
            "encode_affine_any_bf16"
        );
        assert!(decode_kernel(bdr(2048), 2048, OutType::Bf16, KernelOptions::default()).is_err());
    }
}
