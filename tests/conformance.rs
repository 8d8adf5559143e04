//! The conformance suite: every example parameter set of every registered
//! codec family (`registry::FAMILIES`, each family's `examples`) through
//!
//! * round trip: `raw` bit exact, every other example at or above its
//!   registered SNR floor on the real fixture and on a synthetic cache;
//! * golden re-encode: encoding twice gives the same bytes, and where
//!   `format/vectors/vectors.json` has a vector for the name, encoding its
//!   input reproduces the committed file byte for byte;
//! * tampered sections with resealed checksums: the writer itself seals a
//!   page whose sections were dropped, resized, retyped, renumbered, added
//!   to or overwritten, so every CRC passes and only the codec's decoder can
//!   notice; structural changes must be a format error of cause
//!   `FormatCause::Codec`, content changes that or a successful decode,
//!   never a panic;
//! * random shapes (proptest, small);
//! * with `--features cuda`: the GPU kernels (through the SIMT emulator
//!   under `KVPACK_GPU_EMU=1`, and CUDA device 0 when present) against the
//!   CPU decoder.
//!
//! A new codec gets all of it by listing examples in its registry entry.
//! `cargo test --release --test conformance -- --nocapture` prints what
//! was covered.

mod common;

use std::panic::{AssertUnwindSafe, catch_unwind};

use common::*;
use kvpack::FormatCause;
use kvpack::cache::{DType, KvCache, TensorInfo};
use kvpack::codec::registry::{Example, FAMILIES, Family};
use kvpack::codec::{Codec, PageIn, PageOut};
use kvpack::compress::{CompressOptions, compress};
use kvpack::decode::{Archive, Selection};
use kvpack::format::{ElemType, PageView, Section, SectionKind};
use kvpack::plan::Layout;
use kvpack::view::CacheView;

/// Every `(family, example)` of the registry.
fn examples() -> Vec<(&'static Family, &'static Example)> {
    FAMILIES
        .iter()
        .flat_map(|f| f.examples.iter().map(move |e| (f, e)))
        .collect()
}

/// Every token coded (no raw windows), two pages per tensor or more.
const CODED: Layout = Layout {
    page_tokens: 256,
    sink: 0,
    recent: 0,
};

fn try_compress(
    cache: &KvCache,
    codec: &dyn Codec,
    layout: Layout,
    zstd: Option<i32>,
) -> kvpack::Result<Vec<u8>> {
    let opts = CompressOptions {
        layout,
        zstd_level: zstd,
        ..Default::default()
    };
    Ok(compress(cache, codec, &opts, Vec::new(), &|_| {})?.0)
}

fn decode_all(file: &[u8]) -> kvpack::Result<KvCache> {
    Archive::open(file)?.decode(&Selection::default(), None, None)
}

/// The smallest per-tensor SNR of `name` on `cache` (infinite when every
/// tensor decodes bit exactly).
fn min_snr(cache: &KvCache, name: &str) -> f64 {
    let codec = kvpack::codec::parse(name).unwrap();
    let file = try_compress(cache, codec.as_ref(), CODED, None)
        .unwrap_or_else(|e| panic!("{name}: compress: {e}"));
    let dec = decode_all(&file).unwrap_or_else(|e| panic!("{name}: decode: {e}"));
    let mut snr = f64::INFINITY;
    for (a, b) in cache.tensors.iter().zip(&dec.tensors) {
        assert_eq!(a.info.shape(), b.info.shape(), "{name}: {}", a.info.name);
        if a.data.to_f32() == b.data.to_f32() {
            continue;
        }
        let e = kvpack::metrics::tensor_error(a, b).unwrap();
        snr = snr.min(e.snr_db);
    }
    snr
}

/// A synthetic cache whose head_dim every example accepts.
fn synthetic_cache() -> KvCache {
    let l = LayerSpec {
        batch: 1,
        heads: 2,
        tokens: 300,
        head_dim: 128,
    };
    synthetic(&[l, l], DType::Bf16, 11)
}

#[test]
fn every_registered_family_has_examples_that_parse_canonically() {
    let mut listing = Vec::new();
    for f in FAMILIES {
        assert!(
            !f.examples.is_empty(),
            "codec family {} lists no examples in its registry entry",
            f.name
        );
        for e in f.examples {
            let c = kvpack::codec::parse(e.name)
                .unwrap_or_else(|err| panic!("{}: example {}: {err}", f.name, e.name));
            assert_eq!(c.id(), f.id, "{}: parsed by another family", e.name);
            assert_eq!(
                c.name(),
                e.name,
                "{}: example name is not canonical",
                e.name
            );
            let back = kvpack::codec::from_entry(
                0,
                &kvpack::format::CodecEntry {
                    id: c.id(),
                    params: c.params(),
                },
            )
            .unwrap();
            assert_eq!(back.name(), e.name, "{}: params do not round trip", e.name);
            assert!(!e.min_snr_db.is_nan(), "{}", e.name);
        }
        let names: Vec<&str> = f.examples.iter().map(|e| e.name).collect();
        listing.push(format!("{:<8} {}", f.name, names.join(", ")));
    }
    eprintln!(
        "conformance covers {} families, {} parameter sets:\n  {}",
        FAMILIES.len(),
        examples().len(),
        listing.join("\n  ")
    );
    // Every golden vector's codec is one of the examples.
    for v in golden_vectors() {
        assert!(
            examples().iter().any(|(_, e)| e.name == v.codec),
            "golden vector {} uses {}, which no registry entry lists as an example",
            v.file,
            v.codec
        );
    }
}

#[test]
fn round_trip_meets_each_examples_quality_floor() {
    let real = fixture().cache;
    let syn = synthetic_cache();
    let (mut rows, mut failures) = (Vec::new(), Vec::new());
    for (f, e) in examples() {
        let r = min_snr(&real, e.name);
        let s = min_snr(&syn, e.name);
        rows.push(format!(
            "{:<26} fixture {r:>6.2} dB  synthetic {s:>6.2} dB  floor {:.1} dB",
            e.name, e.min_snr_db
        ));
        if e.min_snr_db.is_infinite() && !(r.is_infinite() && s.is_infinite()) {
            failures.push(format!(
                "{} ({}) is registered lossless but does not decode bit exactly",
                e.name, f.name
            ));
        }
        if r < e.min_snr_db || s < e.min_snr_db {
            failures.push(format!(
                "{}: SNR fixture {r:.2} dB / synthetic {s:.2} dB below its floor {} dB",
                e.name, e.min_snr_db
            ));
        }
    }
    eprintln!("round trip (min per-tensor SNR):\n  {}", rows.join("\n  "));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The GPU side states each kernel family's page layout once, as the list
/// of its canonical body's sections (`gpu::family::body_sections`, which
/// sizes staging and the encode templates); every page the CPU writes for
/// every example has exactly those sections, in that order, or (for
/// codecs whose page size depends on the data) sections no larger.
#[test]
fn gpu_body_sections_match_the_pages_the_cpu_writes() {
    use kvpack::gpu::family::{body_sections, canonical_body_len};
    use kvpack::gpu::spec::KernelCodec;
    let cache = synthetic_cache();
    let mut rows = Vec::new();
    for (_, e) in examples() {
        let codec = kvpack::codec::parse(e.name).unwrap();
        let file = try_compress(&cache, codec.as_ref(), CODED, None).unwrap();
        let ar = Archive::open(&file).unwrap();
        let infos = ar.tensors();
        let exact = codec.size_depends_only_on_shape();
        let n = ar.reader().index().entries.len();
        for i in 0..n {
            let page = ar.reader().page(i).unwrap();
            let m = page.header.meta;
            let info = &infos[m.tensor as usize];
            let kc = KernelCodec::of(ar.codec(m.codec as usize), info).unwrap();
            let (tokens, d) = (u64::from(m.tokens), u64::from(info.head_dim));
            let r = info.planes() as u64 * tokens;
            let want = body_sections(kc, r, tokens, d).unwrap();
            let got: Vec<_> = page
                .sections()
                .iter()
                .map(|s| (s.kind, s.stream, s.elem, s.count, s.len))
                .collect();
            let want: Vec<_> = want
                .iter()
                .map(|s| (s.kind, s.stream, s.elem, s.count, s.len))
                .collect();
            let bound = canonical_body_len(kc, r, tokens, d);
            let body = page.body().len() as u64;
            if exact {
                assert_eq!(got, want, "{} page {i}", e.name);
                assert_eq!(body, bound, "{} page {i}", e.name);
            } else {
                assert!(
                    body <= bound,
                    "{} page {i}: body {body} > bound {bound}",
                    e.name
                );
                for (g, w) in got.iter().zip(&want) {
                    assert!(
                        g.0 == w.0 && g.1 == w.1 && g.2 == w.2 && g.3 <= w.3,
                        "{} page {i}: {g:?} not within {w:?}",
                        e.name
                    );
                }
            }
        }
        rows.push(format!(
            "{:<26} {n} pages {}",
            e.name,
            if exact { "exact" } else { "within the bound" }
        ));
    }
    eprintln!("GPU body sections:\n  {}", rows.join("\n  "));
}

struct Golden {
    file: String,
    /// The input it encodes (format 1.1 vectors have fp8 and latent inputs).
    input: String,
    codec: String,
    layout: Layout,
    zstd: Option<i32>,
}

fn golden_vectors() -> Vec<Golden> {
    let list: serde_json::Value =
        serde_json::from_slice(&std::fs::read(repo("format/vectors/vectors.json")).unwrap())
            .unwrap();
    list["vectors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| Golden {
            file: v["file"].as_str().unwrap().into(),
            input: v["input"].as_str().unwrap().into(),
            codec: v["codec"].as_str().unwrap().into(),
            layout: Layout {
                page_tokens: v["page_tokens"].as_u64().unwrap() as u32,
                sink: v["sink"].as_u64().unwrap() as u32,
                recent: v["recent"].as_u64().unwrap() as u32,
            },
            zstd: v["zstd"].as_i64().map(|z| z as i32),
        })
        .collect()
}

#[test]
fn encoding_is_deterministic_and_reproduces_golden_vectors() {
    let syn = synthetic_cache();
    let golden = golden_vectors();
    let inputs: std::collections::BTreeMap<&str, kvpack::KvCache> = golden
        .iter()
        .map(|g| {
            let bytes = std::fs::read(repo(&format!("format/vectors/{}", g.input))).unwrap();
            let cache = kvpack::io::safetensors::parse(&bytes, &g.input)
                .unwrap()
                .cache;
            (g.input.as_str(), cache)
        })
        .collect();
    let mut rows = Vec::new();
    for (_, e) in examples() {
        let codec = kvpack::codec::parse(e.name).unwrap();
        let a = try_compress(&syn, codec.as_ref(), CODED, Some(3)).unwrap();
        let b = try_compress(&syn, codec.as_ref(), CODED, Some(3)).unwrap();
        assert!(a == b, "{}: two encodings of the same cache differ", e.name);
        let mut vectors = Vec::new();
        for g in golden.iter().filter(|g| g.codec == e.name) {
            let want = std::fs::read(repo(&format!("format/vectors/{}", g.file))).unwrap();
            let got =
                try_compress(&inputs[g.input.as_str()], codec.as_ref(), g.layout, g.zstd).unwrap();
            assert!(
                got == want,
                "{}: re-encoding {} no longer reproduces {}",
                e.name,
                g.input,
                g.file
            );
            vectors.push(g.file.as_str());
        }
        rows.push(format!(
            "{:<26} deterministic; golden: {}",
            e.name,
            if vectors.is_empty() {
                "none".to_string()
            } else {
                vectors.join(", ")
            }
        ));
    }
    eprintln!("re-encode:\n  {}", rows.join("\n  "));
}

/// One way of changing the sections an encoder returns.
#[derive(Debug, Clone, Copy)]
enum Mutation {
    /// The section is left out.
    Drop,
    /// One element fewer (bytes cut to match).
    Shorter,
    /// One element more (zero bytes added to match).
    Longer,
    /// Another element type or width, same count.
    Retype,
    /// Another stream number.
    Renumber,
    /// An unknown AUX section is added next to it.
    Extra,
    /// Every byte set to the value.
    Fill(u8),
    /// Every byte XORed with the value.
    Xor(u8),
}

impl Mutation {
    const ALL: [Mutation; 9] = [
        Mutation::Drop,
        Mutation::Shorter,
        Mutation::Longer,
        Mutation::Retype,
        Mutation::Renumber,
        Mutation::Extra,
        Mutation::Fill(0x00),
        Mutation::Fill(0xFF),
        Mutation::Xor(0x5A),
    ];

    /// Structural changes contradict the codec's section spec and must be
    /// rejected; content changes must only never panic.
    fn structural(self) -> bool {
        !matches!(self, Mutation::Fill(_) | Mutation::Xor(_))
    }

    fn apply(self, secs: &mut Vec<Section>, target: (SectionKind, u8)) {
        let Some(i) = secs.iter().position(|s| (s.kind, s.stream) == target) else {
            return;
        };
        let resize = |s: &mut Section, count: u32| {
            s.count = count;
            let len = s.elem.byte_len(u64::from(count)).unwrap() as usize;
            s.data.resize(len, 0);
        };
        match self {
            Mutation::Drop => {
                secs.remove(i);
            }
            Mutation::Shorter => {
                let c = secs[i].count;
                if c == 0 {
                    secs.remove(i);
                } else {
                    resize(&mut secs[i], c - 1);
                }
            }
            Mutation::Longer => {
                let c = secs[i].count + 1;
                resize(&mut secs[i], c);
            }
            Mutation::Retype => {
                let s = &mut secs[i];
                s.elem = match s.elem {
                    ElemType::Packed(b) => ElemType::Packed(b % 32 + 1),
                    ElemType::Bf16 => ElemType::F16,
                    ElemType::F16 => ElemType::F32,
                    ElemType::F32 => ElemType::Bf16,
                    ElemType::U16 => ElemType::U32,
                    ElemType::U32 => ElemType::U16,
                    ElemType::Bytes => ElemType::U16,
                    ElemType::F8E4M3 => ElemType::F8E5M2,
                    ElemType::F8E5M2 => ElemType::F8E4M3,
                };
                let c = s.count;
                resize(s, c);
            }
            Mutation::Renumber => {
                let kind = secs[i].kind;
                let used: Vec<u8> = secs
                    .iter()
                    .filter(|s| s.kind == kind)
                    .map(|s| s.stream)
                    .collect();
                let free = (0..=255u8).rev().find(|n| !used.contains(n)).unwrap();
                secs[i].stream = free;
            }
            Mutation::Extra => {
                let used: Vec<u8> = secs
                    .iter()
                    .filter(|s| s.kind == SectionKind::Aux)
                    .map(|s| s.stream)
                    .collect();
                let free = (0..=255u8).rev().find(|n| !used.contains(n)).unwrap();
                secs.push(Section {
                    kind: SectionKind::Aux,
                    stream: free,
                    elem: ElemType::Bytes,
                    count: 4,
                    data: vec![1, 2, 3, 4],
                });
            }
            Mutation::Fill(v) => secs[i].data.fill(v),
            Mutation::Xor(v) => secs[i].data.iter_mut().for_each(|b| *b ^= v),
        }
    }
}

/// A codec that is `inner` except that its encoder's sections are
/// mutated: the file records `inner`'s id and parameters, so the real
/// decoder reads pages the writer sealed with valid checksums.
#[derive(Debug)]
struct Tamper {
    inner: Box<dyn Codec>,
    target: (SectionKind, u8),
    mutation: Mutation,
}

impl Codec for Tamper {
    fn name(&self) -> String {
        self.inner.name()
    }
    fn id(&self) -> u16 {
        self.inner.id()
    }
    fn params(&self) -> Vec<u8> {
        self.inner.params()
    }
    fn check(&self, t: &TensorInfo) -> kvpack::Result<()> {
        self.inner.check(t)
    }
    fn prepare(
        &self,
        cache: &CacheView<'_>,
        layout: &Layout,
    ) -> kvpack::Result<Option<Box<dyn Codec>>> {
        Ok(self.inner.prepare(cache, layout)?.map(|inner| {
            Box::new(Tamper {
                inner,
                target: self.target,
                mutation: self.mutation,
            }) as Box<dyn Codec>
        }))
    }
    fn encode(&self, page: &PageIn<'_>) -> kvpack::Result<Vec<Section>> {
        let mut s = self.inner.encode(page)?;
        self.mutation.apply(&mut s, self.target);
        Ok(s)
    }
    fn decode(&self, page: &PageView<'_>, out: &mut PageOut<'_>) -> kvpack::Result<()> {
        self.inner.decode(page, out)
    }
    fn bits_per_element(&self, t: &TensorInfo) -> f64 {
        self.inner.bits_per_element(t)
    }
}

/// Tiny cache for the tampering runs: one layer, two pages per tensor.
fn tiny() -> KvCache {
    synthetic(
        &[LayerSpec {
            batch: 1,
            heads: 2,
            tokens: 24,
            head_dim: 128,
        }],
        DType::Bf16,
        5,
    )
}

const TINY_PAGES: Layout = Layout {
    page_tokens: 16,
    sink: 0,
    recent: 0,
};

/// Every tampering of example `name` on `cache`: the `(kind, stream)` of
/// the sections its pages hold, and per section and [`Mutation`] a label,
/// the mutation and what the writer made of it (resealed file or error).
#[allow(clippy::type_complexity)]
fn tamperings(
    cache: &KvCache,
    name: &str,
) -> (
    Vec<(SectionKind, u8)>,
    Vec<(String, Mutation, kvpack::Result<Vec<u8>>)>,
) {
    let clean = kvpack::codec::parse(name).unwrap();
    let file = try_compress(cache, clean.as_ref(), TINY_PAGES, None).unwrap();
    let ar = Archive::open(&file).unwrap();
    let mut targets = Vec::new();
    for p in 0..ar.reader().index().entries.len() {
        for d in ar.reader().page(p).unwrap().sections() {
            if !targets.contains(&(d.kind, d.stream)) {
                targets.push((d.kind, d.stream));
            }
        }
    }
    let mut out = Vec::new();
    for &target in &targets {
        for mutation in Mutation::ALL {
            let codec = Tamper {
                inner: kvpack::codec::parse(name).unwrap(),
                target,
                mutation,
            };
            let what = format!(
                "{name} section {} stream {} {mutation:?}",
                target.0.name(),
                target.1
            );
            out.push((
                what,
                mutation,
                try_compress(cache, &codec, TINY_PAGES, Some(3)),
            ));
        }
    }
    (targets, out)
}

#[test]
fn tampered_sections_are_rejected_by_the_decoder_never_a_panic() {
    let cache = tiny();
    let mut failures = Vec::new();
    let mut rows = Vec::new();
    for (_, e) in examples() {
        let (targets, tampered) = tamperings(&cache, e.name);
        let (mut rejected, mut accepted) = (0, 0);
        for (what, mutation, file) in tampered {
            let file = match file {
                Ok(f) => f,
                Err(err) => {
                    failures.push(format!("{what}: the writer refused: {err}"));
                    continue;
                }
            };
            match catch_unwind(AssertUnwindSafe(|| decode_all(&file))) {
                Err(_) => failures.push(format!("{what}: the decoder panicked")),
                Ok(Err(err)) if err.format_cause() == Some(FormatCause::Codec) => rejected += 1,
                Ok(Err(err)) => failures.push(format!(
                    "{what}: not a codec format error ({:?}): {err}",
                    err.format_cause()
                )),
                Ok(Ok(_)) if mutation.structural() => {
                    failures.push(format!("{what}: accepted"));
                }
                Ok(Ok(_)) => accepted += 1,
            }
        }
        let names: Vec<String> = targets
            .iter()
            .map(|(k, s)| format!("{}/{s}", k.name()))
            .collect();
        rows.push(format!(
            "{:<26} sections {}: {rejected} rejected, {accepted} content changes decoded",
            e.name,
            names.join(" ")
        ));
    }
    eprintln!("tampered sections:\n  {}", rows.join("\n  "));
    assert!(
        failures.is_empty(),
        "{} tampered pages not rejected cleanly:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

mod random_shapes {
    use super::*;
    use proptest::prelude::*;

    // Odd, small and non-power-of-two head_dims too: rows whose codes share
    // bytes, no Walsh-Hadamard block, one chunk (int4 at an odd head_dim
    // once decoded through a byte-row fast path and panicked).
    const HEAD_DIMS: [u32; 14] = [1, 3, 5, 6, 12, 16, 24, 40, 64, 80, 96, 128, 192, 256];

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Every example on small random shapes, dtypes and layouts: the
        /// encoder accepts what `check` accepts, decoding gives the shape
        /// back, `raw` bit exact, others finite.
        #[test]
        fn every_example_round_trips_random_shapes(
            batch in 1u32..=2,
            heads in 1u32..=3,
            tokens in 0u32..=40,
            hd in 0usize..HEAD_DIMS.len(),
            dtype in prop::sample::select(vec![DType::Bf16, DType::F16, DType::F32]),
            page_tokens in 1u32..=24,
            sink in 0u32..=4,
            recent in 0u32..=6,
            seed in any::<u64>(),
        ) {
            let layout = Layout { page_tokens, sink, recent };
            for (_, e) in examples() {
                let codec = kvpack::codec::parse(e.name).unwrap();
                // The first head_dim from `hd` on (cyclically) the codec takes.
                let Some(head_dim) = (0..HEAD_DIMS.len())
                    .map(|i| HEAD_DIMS[(hd + i) % HEAD_DIMS.len()])
                    .find(|&d| {
                        let s = LayerSpec { batch, heads, tokens, head_dim: d };
                        let c = synthetic(&[s], dtype, 1);
                        c.tensors.iter().all(|t| codec.check(&t.info).is_ok())
                    })
                else {
                    continue;
                };
                let spec = LayerSpec { batch, heads, tokens, head_dim };
                let cache = synthetic(&[spec], dtype, seed);
                let what = format!("{} {spec_dbg} {dtype:?} {layout:?}", e.name,
                    spec_dbg = format_args!("b{batch} h{heads} t{tokens} d{head_dim}"));
                let file = try_compress(&cache, codec.as_ref(), layout, None)
                    .map_err(|err| TestCaseError::fail(format!("{what}: {err}")))?;
                let dec = decode_all(&file)
                    .map_err(|err| TestCaseError::fail(format!("{what}: {err}")))?;
                for (a, b) in cache.tensors.iter().zip(&dec.tensors) {
                    prop_assert_eq!(a.info.shape(), b.info.shape(), "{}", what);
                    let (x, y) = (a.data.to_f32(), b.data.to_f32());
                    if e.min_snr_db.is_infinite() {
                        prop_assert!(x == y, "{}: lossless codec changed values", what);
                    } else {
                        prop_assert!(y.iter().all(|v| v.is_finite()), "{}: non-finite output", what);
                    }
                }
            }
        }
    }
}

/// The GPU kernels against the CPU decoder, every example: through the SIMT
/// emulator under `KVPACK_GPU_EMU=1` (CI) and on CUDA device 0 when one is
/// present (by hand: `cargo test --release --features cuda --test
/// conformance`). Every element within 1 bf16/fp16 ulp. The emulator needs
/// no `cuda` feature.
#[test]
fn gpu_decode_matches_cpu_for_every_example() {
    use kvpack::gpu::{Device, HostLayout, OutType};
    let mut devices = Vec::new();
    match Device::cuda(0) {
        Ok(d) => devices.push(d),
        Err(e) => eprintln!("skipping CUDA: {e}"),
    }
    if std::env::var("KVPACK_GPU_EMU").is_ok_and(|x| x == "1") {
        devices.push(Device::emulated().expect("the SIMT emulator (needs g++)"));
    } else {
        eprintln!("skipping the emulator: set KVPACK_GPU_EMU=1");
    }
    let ordered = |x: u16| -> i32 {
        if x & 0x8000 != 0 {
            -i32::from(x & 0x7fff)
        } else {
            i32::from(x)
        }
    };
    let cache = tiny();
    for dev in &devices {
        let mut rows = Vec::new();
        for (_, e) in examples() {
            let codec = kvpack::codec::parse(e.name).unwrap();
            let file = try_compress(&cache, codec.as_ref(), TINY_PAGES, None).unwrap();
            let ar = Archive::open(&file).unwrap();
            let mut inexact = 0;
            for (t, info) in ar.tensors().iter().enumerate() {
                let layout = HostLayout::Contiguous {
                    first_token: 0,
                    tokens: info.tokens,
                };
                for out in [OutType::Bf16, OutType::F16] {
                    let want = Device::Cpu.decode_tensor(&ar, t, out, &layout).unwrap();
                    let got = dev
                        .decode_tensor(&ar, t, out, &layout)
                        .unwrap_or_else(|err| panic!("{} on {}: {err}", e.name, dev.name()));
                    assert_eq!(got.len(), want.len(), "{}", e.name);
                    for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                        if g != w {
                            inexact += 1;
                            assert!(
                                (ordered(g) - ordered(w)).abs() <= 1,
                                "{} on {}: tensor {t} {out:?} element {i}: 0x{g:04x} vs CPU 0x{w:04x}",
                                e.name,
                                dev.name()
                            );
                        }
                    }
                }
            }
            rows.push(format!("{:<26} {inexact} elements 1 ulp off", e.name));
        }
        eprintln!("{} vs cpu:\n  {}", dev.name(), rows.join("\n  "));
    }
}

/// The GPU staging reads pages through the codecs' own page layouts, so
/// every device rejects what the CPU decoder rejects: each structural
/// mutation of each section of every example (an extra section among them)
/// is refused with a `FormatCause::Codec` error by the CPU device, by the
/// SIMT emulator (under `KVPACK_GPU_EMU=1` with `--features cuda`) and by
/// CUDA device 0 when present, before any kernel runs.
#[test]
fn every_device_rejects_structurally_tampered_pages() {
    use kvpack::gpu::{Device, HostLayout, OutType};
    let mut devices = vec![Device::Cpu];
    match Device::cuda(0) {
        Ok(d) => devices.push(d),
        Err(e) => eprintln!("skipping CUDA: {e}"),
    }
    if std::env::var("KVPACK_GPU_EMU").is_ok_and(|x| x == "1") {
        devices.push(Device::emulated().expect("the SIMT emulator (needs g++)"));
    } else {
        eprintln!("skipping the emulator: set KVPACK_GPU_EMU=1");
    }
    let cache = tiny();
    let mut failures = Vec::new();
    let mut counts = vec![0usize; devices.len()];
    for (_, e) in examples() {
        for (what, mutation, file) in tamperings(&cache, e.name).1 {
            if mutation.structural() {
                let Ok(file) = file else {
                    continue; // the tampering run reports writer refusals
                };
                let ar = Archive::open(&file).unwrap();
                for (t, info) in ar.tensors().iter().enumerate() {
                    let layout = HostLayout::Contiguous {
                        first_token: 0,
                        tokens: info.tokens,
                    };
                    // Only the tensors the CPU decoder refuses: the others
                    // hold no tampered page.
                    let cpu = Device::Cpu.decode_tensor(&ar, t, OutType::Bf16, &layout);
                    if cpu.is_ok() {
                        continue;
                    }
                    for (k, dev) in devices.iter().enumerate() {
                        match dev.decode_tensor(&ar, t, OutType::Bf16, &layout) {
                            Err(err) if err.format_cause() == Some(FormatCause::Codec) => {
                                counts[k] += 1;
                            }
                            Err(err) => failures.push(format!(
                                "{what}, tensor {t} on {}: not a codec format error: {err}",
                                dev.name()
                            )),
                            Ok(_) => failures
                                .push(format!("{what}, tensor {t} on {}: accepted", dev.name())),
                        }
                    }
                }
            }
        }
    }
    for (dev, n) in devices.iter().zip(&counts) {
        eprintln!("{}: {n} tampered tensors rejected", dev.name());
    }
    assert!(counts[0] > 0, "no tampered tensor was tried");
    assert!(
        failures.is_empty(),
        "{} tampered tensors not rejected like the CPU:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
