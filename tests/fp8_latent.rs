//! Format 1.1: fp8 KV caches (E4M3FN / E5M2 with a per-tensor scale) and
//! MLA latent caches, through every codec, the container, safetensors and
//! the CLI; rejection of unknown codes; 1.0 files stay 1.0.

mod common;

use std::process::Command;

use common::*;
use kvpack::cache::{DType, Fp8, Fp8Format, Kind, KvCache, TensorData};
use kvpack::compress::CompressOptions;
use kvpack::decode::{Archive, Selection};
use kvpack::eval::evaluate;
use kvpack::io::safetensors::Loaded;
use kvpack::metrics::tensor_error;
use kvpack::plan::Layout;

/// The first `layers` layers of the real fixture (with their queries).
fn fixture_layers(layers: u32) -> Loaded {
    let mut fx = fixture();
    fx.cache.tensors.retain(|t| t.info.layer < layers);
    fx.queries.retain(|q| q.layer < layers);
    fx
}

fn fp8_fixture(layers: u32, f: Fp8Format) -> Loaded {
    let fx = fixture_layers(layers);
    Loaded {
        cache: to_fp8(&fx.cache, f),
        ..fx
    }
}

fn decode_all(bytes: &[u8], dtype: Option<DType>) -> KvCache {
    Archive::open(bytes)
        .unwrap()
        .decode(&Selection::default(), dtype, None)
        .unwrap()
}

fn minor(bytes: &[u8]) -> u16 {
    u16::from_le_bytes([bytes[10], bytes[11]])
}

/// Mean cosine over all tensors of `dec` against `orig` (fp8 originals
/// compared through their dequantized values).
fn mean_cosine(orig: &KvCache, dec: &KvCache) -> f64 {
    let c: Vec<f64> = orig
        .tensors
        .iter()
        .zip(&dec.tensors)
        .map(|(o, d)| tensor_error(o, d).unwrap().cosine)
        .collect();
    c.iter().sum::<f64>() / c.len() as f64
}

#[test]
fn fp8_raw_keeps_the_codes_bit_exactly_at_8_bits() {
    for f in [Fp8Format::E4M3Fn, Fp8Format::E5M2] {
        let cache = fp8_fixture(4, f).cache;
        let bytes = compress_bytes(&cache, "raw", Layout::default(), None);
        assert_eq!(minor(&bytes), 1, "an fp8 file is format 1.1");
        let bpe = 8.0 * bytes.len() as f64 / cache.elements() as f64;
        assert!(bpe > 8.0 && bpe < 8.1, "{f:?}: raw fp8 {bpe} bits/element");
        let dec = decode_all(&bytes, None);
        for (o, d) in cache.tensors.iter().zip(&dec.tensors) {
            assert_eq!(o.info, d.info, "{f:?}: info incl. scale");
            assert_eq!(o.data, d.data, "{f:?}: {} codes", o.info.name);
        }
        // The same with an explicit fp8 output of the same format, and a
        // token range that cuts pages (partial-page path).
        let dec = decode_all(
            &bytes,
            Some(DType::parse(cache.tensors[0].info.dtype.name()).unwrap()),
        );
        assert_eq!(dec.tensors, cache.tensors);
        let sel = Selection {
            tokens: Some(5..300),
            ..Default::default()
        };
        let part = Archive::open(&bytes)
            .unwrap()
            .decode(&sel, None, None)
            .unwrap();
        for (o, d) in cache.tensors.iter().zip(&part.tensors) {
            let (t, dd) = (o.info.tokens as usize, o.info.head_dim as usize);
            let TensorData::Fp8(_, src) = &o.data else {
                unreachable!()
            };
            let TensorData::Fp8(_, got) = &d.data else {
                panic!("{}: decoded as {:?}", o.info.name, d.info.dtype)
            };
            assert_eq!(&got[..], &src[5 * dd..t.min(300) * dd], "{}", o.info.name);
        }
    }
}

#[test]
fn fp8_caches_through_every_codec() {
    // One codec per family; the fp8 cache must code about as well as the
    // bf16 cache it came from, measured against its own dequantized values.
    let bf = fixture_layers(4);
    for f in [Fp8Format::E4M3Fn, Fp8Format::E5M2] {
        let fx = fp8_fixture(4, f);
        for codec in [
            "int8",
            "int4",
            "bdr128",
            "bdr128:k",
            "hqmq:s96r4",
            "octopus:b3",
            "turbo:b3",
            "polar:m4n4",
            "innerq:k2v2",
            "kivi:2",
        ] {
            let c = kvpack::codec::parse(codec).unwrap();
            let e8 = evaluate(&fx, c.as_ref(), &CompressOptions::default()).unwrap();
            let e16 = evaluate(&bf, c.as_ref(), &CompressOptions::default()).unwrap();
            let (c8, c16) = (
                (e8.k.cosine + e8.v.cosine) / 2.0,
                (e16.k.cosine + e16.v.cosine) / 2.0,
            );
            assert!(
                c8 > c16 - 0.01 && c8 > 0.9,
                "{f:?} {codec}: cosine {c8:.5} (bf16 source {c16:.5})"
            );
            let (a8, a16) = (e8.attention.unwrap(), e16.attention.unwrap());
            assert!(
                a8 < 1.25 * a16 + 0.01,
                "{f:?} {codec}: attention error {a8:.5} (bf16 source {a16:.5})"
            );
            // A quantizing codec costs about what it costs on bf16; the
            // raw windows cost 8 bits instead of 16.
            assert!(
                e8.bits_per_element <= e16.bits_per_element + 0.01,
                "{f:?} {codec}: {} vs {} bits/element",
                e8.bits_per_element,
                e16.bits_per_element
            );
        }
    }
}

#[test]
fn decoding_to_fp8_requantizes_with_the_tensor_scale() {
    let fx = fp8_fixture(2, Fp8Format::E4M3Fn);
    let bytes = compress_bytes(&fx.cache, "int8", Layout::default(), None);
    let f32s = decode_all(&bytes, Some(DType::F32));
    let fp8 = decode_all(&bytes, Some(DType::parse("fp8_e4m3").unwrap()));
    for ((o, a), b) in fx.cache.tensors.iter().zip(&f32s.tensors).zip(&fp8.tensors) {
        // Same format and scale as the source.
        assert_eq!(b.info.dtype, o.info.dtype, "{}", o.info.name);
        let mut want = TensorData::zeros(o.info.dtype, a.data.len());
        want.as_elems_mut().store(0, &a.data.to_f32());
        assert_eq!(
            b.data, want,
            "{}: fp8 output = fp8(f32 output / scale)",
            o.info.name
        );
    }
    // The other fp8 format: the source range maps onto the output range.
    let e5 = decode_all(&bytes, Some(DType::parse("fp8_e5m2").unwrap()));
    let s4 = fx.cache.tensors[0].info.dtype.scale().unwrap();
    let s5 = e5.tensors[0].info.dtype.scale().unwrap();
    assert_eq!(s5, s4 * 448.0 / 57344.0);
    assert!(mean_cosine(&fx.cache, &e5) > 0.99);
    // A bf16 source decoded to fp8 gets scale 1.
    let bf = fixture_layers(1).cache;
    let bytes = compress_bytes(&bf, "raw", Layout::default(), None);
    let d = decode_all(&bytes, Some(DType::parse("fp8_e5m2").unwrap()));
    assert_eq!(d.tensors[0].info.dtype.scale(), Some(1.0));
    assert!(mean_cosine(&bf, &d) > 0.99);
}

/// DeepSeek-V2-Lite shapes: latent 576 = kv_lora_rank 512 + rope 64.
fn latent_cache(dtype: DType) -> KvCache {
    latent(3, 150, dtype, 11)
}

#[test]
fn latent_caches_through_the_codecs() {
    let cache = latent_cache(DType::Bf16);
    let bytes = compress_bytes(&cache, "raw", Layout::default(), None);
    assert_eq!(minor(&bytes), 1, "a latent file is format 1.1");
    assert_eq!(
        decode_all(&bytes, None).tensors,
        cache.tensors,
        "raw is exact"
    );
    // Codecs whose constraints hold for a 576-wide row, with the cosine
    // floor each reaches on Gaussian rows.
    for (codec, floor) in [
        ("int8", 0.9999),
        ("int4", 0.97),
        ("bdr64", 0.97),
        ("bdr64:k", 0.97),
        ("hqmq:s96r4", 0.985),
        ("hqmq:s96r4+med3", 0.995),
        ("polar:m4n4", 0.99),
        ("innerq:k2v2", 0.97),
        ("innerq:k2v2:g64", 0.97),
        ("kivi:2", 0.92),
    ] {
        let bytes = compress_bytes(&cache, codec, Layout::default(), None);
        let cos = mean_cosine(&cache, &decode_all(&bytes, None));
        eprintln!("latent {codec}: cosine {cos:.5}");
        assert!(cos > floor, "{codec} on the latent: cosine {cos:.5}");
    }
    // Codecs whose math needs what a 576-wide row lacks refuse it, naming
    // the constraint.
    for (codec, needle) in [
        ("bdr128", "divisible by 128"),
        ("octopus:b3", "power-of-two"),
        ("turbo:b3", "power-of-two"),
        ("innerq:k2v2:g128", "over 128 channels"),
    ] {
        let c = kvpack::codec::parse(codec).unwrap();
        let err = kvpack::compress::compress(
            &cache,
            c.as_ref(),
            &CompressOptions::default(),
            Vec::new(),
            &|_| {},
        )
        .unwrap_err();
        assert!(
            matches!(err, kvpack::Error::Parameter(_)) && err.to_string().contains(needle),
            "{codec}: {err}"
        );
        assert!(
            err.to_string().contains("latent"),
            "{codec} names the tensor: {err}"
        );
    }
}

#[test]
fn latent_windows_selection_and_fp8() {
    let cache = latent_cache(DType::Bf16);
    let layout = Layout {
        page_tokens: 32,
        sink: 4,
        recent: 16,
    };
    let bytes = compress_bytes(&cache, "bdr64", layout, None);
    let ar = Archive::open(&bytes).unwrap();
    // Sink and recent windows are raw pages: exact.
    let dec = ar.decode(&Selection::default(), None, None).unwrap();
    for (o, d) in cache.tensors.iter().zip(&dec.tensors) {
        let (TensorData::Bf16(a), TensorData::Bf16(b)) = (&o.data, &d.data) else {
            unreachable!()
        };
        let n = a.len();
        assert_eq!(a[..4 * 576], b[..4 * 576], "sink window");
        assert_eq!(a[n - 16 * 576..], b[n - 16 * 576..], "recent window");
        assert_ne!(a, b, "the body is quantized");
    }
    // Selection by kind.
    let sel = |k| Selection {
        kind: Some(k),
        ..Default::default()
    };
    let l = ar.decode(&sel(Kind::Latent), None, None).unwrap();
    assert_eq!(l.tensors.len(), 3);
    assert!(l.tensors.iter().all(|t| t.info.kind == Kind::Latent));
    assert!(
        ar.decode(&sel(Kind::Key), None, None)
            .unwrap()
            .tensors
            .is_empty()
    );
    // fp8 latents (vLLM MLA with an fp8 cache): raw bit-exact, bdr64 close.
    let f8 = to_fp8(&cache, Fp8Format::E4M3Fn);
    let bytes = compress_bytes(&f8, "raw", layout, None);
    assert_eq!(decode_all(&bytes, None).tensors, f8.tensors);
    let bytes = compress_bytes(&f8, "bdr64", layout, None);
    // 20 of 150 tokens in raw windows, the rest at 4 bits (Gaussian rows:
    // cosine 0.976 per coded row).
    assert!(mean_cosine(&f8, &decode_all(&bytes, None)) > 0.97);
}

#[test]
fn one_zero_files_stay_one_zero() {
    let fx = fixture_layers(2);
    for codec in ["raw", "bdr128", "hqmq:s96r4"] {
        let bytes = compress_bytes(&fx.cache, codec, Layout::default(), None);
        assert_eq!(minor(&bytes), 0, "{codec}: bf16 K/V is format 1.0");
    }
}

/// Rewrites the header CRC after a patch (format/SPEC.md 4.1: CRC32 of
/// prefix bytes 0..60 then the body).
fn fix_header_crc(b: &mut [u8]) {
    let body_len = u32::from_le_bytes(b[28..32].try_into().unwrap()) as usize;
    let mut h = crc32fast::Hasher::new();
    h.update(&b[..60]);
    h.update(&b[64..64 + body_len]);
    let crc = h.finalize();
    b[60..64].copy_from_slice(&crc.to_le_bytes());
}

#[test]
fn unknown_codes_and_minor_mismatches_are_rejected() {
    let cache = to_fp8(&latent(1, 20, DType::Bf16, 3), Fp8Format::E5M2);
    let good = compress_bytes(&cache, "raw", Layout::default(), None);
    // Tensor record 0 starts the body at 64: layer u32, kind u8, dtype u8.
    let (kind_at, dtype_at) = (68, 69);
    assert_eq!((good[kind_at], good[dtype_at]), (2, 5));
    let open_err = |b: &[u8]| Archive::open(b).unwrap_err();
    let mut b = good.clone();
    b[dtype_at] = 6;
    fix_header_crc(&mut b);
    let e = open_err(&b);
    assert!(
        e.is_format() && e.to_string().contains("unknown dtype code 6"),
        "{e}"
    );
    let mut b = good.clone();
    b[kind_at] = 3;
    fix_header_crc(&mut b);
    let e = open_err(&b);
    assert!(
        e.is_format() && e.to_string().contains("unknown kind code 3"),
        "{e}"
    );
    // A header that says 1.0 but uses 1.1 codes.
    let mut b = good.clone();
    b[10] = 0;
    fix_header_crc(&mut b);
    let e = open_err(&b);
    assert!(
        e.is_format() && e.to_string().contains("needs format 1.1"),
        "{e}"
    );
    // A zero scale (the f32 after the name).
    let name_len = u32::from_le_bytes(good[88..92].try_into().unwrap()) as usize;
    let scale_at = 92 + name_len;
    assert_eq!(
        f32::from_le_bytes(good[scale_at..scale_at + 4].try_into().unwrap()),
        cache.tensors[0].info.dtype.scale().unwrap()
    );
    let mut b = good.clone();
    b[scale_at..scale_at + 4].copy_from_slice(&0f32.to_le_bytes());
    fix_header_crc(&mut b);
    let e = open_err(&b);
    assert!(e.is_format() && e.to_string().contains("scale"), "{e}");
    // A later minor (say 1.7) is read: additions are new codes only.
    let mut b = good.clone();
    b[10] = 7;
    fix_header_crc(&mut b);
    assert_eq!(decode_all(&b, None).tensors, cache.tensors);
}

#[test]
fn safetensors_carry_fp8_scales_and_latents() {
    let cache = to_fp8(&latent(2, 10, DType::Bf16, 5), Fp8Format::E4M3Fn);
    let mut buf = Vec::new();
    kvpack::io::safetensors::write(&cache, &mut buf).unwrap();
    let back = kvpack::io::safetensors::parse(&buf, "mem").unwrap();
    assert_eq!(back.cache.tensors, cache.tensors);
    assert!(back.ignored.is_empty());
    let st = safetensors::SafeTensors::deserialize(&buf).unwrap();
    let s = st.tensor("past_key_values.1.latent_scale").unwrap();
    assert_eq!(s.dtype(), safetensors::Dtype::F32);
    assert_eq!(
        f32::from_le_bytes(s.data().try_into().unwrap()),
        cache.tensors[1].info.dtype.scale().unwrap()
    );
    assert_eq!(
        st.tensor("past_key_values.0.latent").unwrap().dtype(),
        safetensors::Dtype::F8_E4M3
    );

    // Built by hand as a vLLM export would be: 3-axis latent, E5M2 codes,
    // a [1]-shaped bf16 scale.
    let codes: Vec<u8> = (0..2 * 3 * 8).map(|i| (i * 5 % 120) as u8).collect();
    let scale = half::bf16::from_f32(0.25).to_le_bytes();
    let views = vec![
        (
            "past_key_values.0.latent".to_string(),
            safetensors::tensor::TensorView::new(
                safetensors::Dtype::F8_E5M2,
                vec![2, 3, 8],
                &codes,
            )
            .unwrap(),
        ),
        (
            "past_key_values.0.latent_scale".to_string(),
            safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![1], &scale)
                .unwrap(),
        ),
    ];
    let raw = safetensors::serialize(views.clone(), None).unwrap();
    let l = kvpack::io::safetensors::parse(&raw, "vllm").unwrap();
    let t = &l.cache.tensors[0];
    assert_eq!(t.info.shape(), [2, 1, 3, 8]);
    assert_eq!(t.info.kind, Kind::Latent);
    assert_eq!(
        t.info.dtype,
        DType::Fp8(Fp8::new(Fp8Format::E5M2, 0.25).unwrap())
    );
    assert_eq!(
        t.data.to_f32()[1],
        0.25 * kvpack::kernels::fp8::to_f32(5, Fp8Format::E5M2)
    );

    // Refusals: a scale of a bf16 tensor, a scale without its tensor, a
    // latent next to K/V in one layer.
    let bf = latent(1, 4, DType::Bf16, 1);
    let one = 1f32.to_le_bytes();
    let bytes = bf.tensors[0].data.to_le_bytes();
    fn view(
        d: safetensors::Dtype,
        shape: Vec<usize>,
        b: &[u8],
    ) -> safetensors::tensor::TensorView<'_> {
        safetensors::tensor::TensorView::new(d, shape, b).unwrap()
    }
    let cases = [
        (
            vec![
                (
                    "past_key_values.0.latent",
                    view(safetensors::Dtype::BF16, vec![1, 1, 4, 576], &bytes),
                ),
                (
                    "past_key_values.0.latent_scale",
                    view(safetensors::Dtype::F32, vec![], &one),
                ),
            ],
            "not fp8",
        ),
        (
            vec![
                (
                    "past_key_values.0.latent",
                    view(safetensors::Dtype::BF16, vec![1, 1, 4, 576], &bytes),
                ),
                (
                    "past_key_values.1.key_scale",
                    view(safetensors::Dtype::F32, vec![], &one),
                ),
            ],
            "missing",
        ),
        (
            vec![
                (
                    "past_key_values.0.latent",
                    view(safetensors::Dtype::BF16, vec![1, 1, 4, 576], &bytes),
                ),
                (
                    "past_key_values.0.key",
                    view(safetensors::Dtype::BF16, vec![1, 1, 4, 576], &bytes),
                ),
                (
                    "past_key_values.0.value",
                    view(safetensors::Dtype::BF16, vec![1, 1, 4, 576], &bytes),
                ),
            ],
            "either",
        ),
    ];
    for (views, needle) in cases {
        let raw = safetensors::serialize(views, None).unwrap();
        let e = kvpack::io::safetensors::parse(&raw, "bad").unwrap_err();
        assert!(
            matches!(e, kvpack::Error::Parameter(_)) && e.to_string().contains(needle),
            "{e}"
        );
    }
}

#[test]
fn gpu_entry_points_refuse_fp8_and_latents() {
    use kvpack::gpu::spec::{KernelCodec, supported};
    let fp8 = to_fp8(&fixture_layers(1).cache, Fp8Format::E4M3Fn);
    let lat = latent(1, 4, DType::Bf16, 1);
    let bdr = kvpack::codec::parse("bdr64").unwrap();
    for t in [&fp8.tensors[0].info, &lat.tensors[0].info] {
        let e = supported(t).unwrap_err();
        assert!(
            matches!(e, kvpack::Error::Unsupported(_)) && e.to_string().contains("CPU"),
            "{e}"
        );
        let e = KernelCodec::of(bdr.as_ref(), t).unwrap_err();
        assert!(matches!(e, kvpack::Error::Unsupported(_)), "{e}");
    }
    // The paged (vLLM) path: a latent layer or an fp8 K/V is refused before
    // any device work.
    let shape = kvpack::gpu::paged::PagedShape {
        num_blocks: 4,
        block_size: 16,
        kv_heads: 1,
        head_dim: 576,
    };
    let lat_file = compress_bytes(&lat, "raw", Layout::default(), None);
    let e = kvpack::gpu::paged::layer_tensors(&Archive::open(&lat_file).unwrap(), 0, &shape)
        .unwrap_err();
    assert!(matches!(e, kvpack::Error::Unsupported(_)), "{e}");
    let fp8_file = compress_bytes(&fp8, "raw", Layout::default(), None);
    let shape = kvpack::gpu::paged::PagedShape {
        head_dim: 256,
        ..shape
    };
    let e = kvpack::gpu::paged::layer_tensors(&Archive::open(&fp8_file).unwrap(), 0, &shape)
        .unwrap_err();
    assert!(matches!(e, kvpack::Error::Unsupported(_)), "{e}");
    let e = kvpack::gpu::OutType::from_dtype(fp8.tensors[0].info.dtype).unwrap_err();
    assert!(
        matches!(e, kvpack::Error::Parameter(_)) && e.to_string().contains("fp8_e4m3"),
        "{e}"
    );
    // The CPU device decodes them.
    let bytes = compress_bytes(&lat, "bdr64", Layout::default(), None);
    let ar = Archive::open(&bytes).unwrap();
    let layout = kvpack::gpu::HostLayout::Contiguous {
        first_token: 0,
        tokens: 4,
    };
    let out = kvpack::gpu::Device::Cpu
        .decode_tensor(&ar, 0, kvpack::gpu::OutType::Bf16, &layout)
        .unwrap();
    assert_eq!(out.len(), 4 * 576);
}

fn kvpack_cli(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvpack"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn cli_compress_inspect_decompress_verify_fp8_and_latent() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    let fp8 = to_fp8(&fixture_layers(2).cache, Fp8Format::E4M3Fn);
    let lat = latent(2, 40, DType::Bf16, 2);
    for (name, cache, codec, kind) in [("fp8", &fp8, "bdr128", "K"), ("lat", &lat, "bdr64", "L")] {
        let src = p(&format!("{name}.safetensors"));
        kvpack::io::safetensors::write(cache, &mut std::fs::File::create(&src).unwrap()).unwrap();
        let out = p(&format!("{name}.kvpack"));
        let o = kvpack_cli(&["compress", &src, "-o", &out, "--codec", codec, "-q"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let o = kvpack_cli(&["inspect", &out, "--json"]);
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(j["format_version"], "1.1");
        let t0 = &j["tensors"][0];
        assert_eq!(t0["kind"], kind);
        assert_eq!(t0["dtype"], cache.tensors[0].info.dtype.name());
        assert_eq!(
            t0["scale"].as_f64().map(|s| s as f32),
            cache.tensors[0].info.dtype.scale()
        );
        let o = kvpack_cli(&["inspect", &out]);
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(text.contains(cache.tensors[0].info.dtype.name()), "{text}");
        let o = kvpack_cli(&[
            "verify",
            &out,
            "--against",
            &src,
            "--min-cosine",
            "0.95",
            "--json",
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let key = if kind == "L" {
            "latent_cosine"
        } else {
            "k_cosine"
        };
        assert!(j["summary"][key].as_f64().unwrap() > 0.95, "{j}");
    }
    // fp8 output of the fp8 cache: F8_E4M3 with the source's scales.
    let back = p("fp8-back.safetensors");
    let o = kvpack_cli(&[
        "decompress",
        &p("fp8.kvpack"),
        "-o",
        &back,
        "--dtype",
        "fp8_e4m3",
        "-q",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let l = kvpack::io::safetensors::parse(&std::fs::read(&back).unwrap(), "back").unwrap();
    for (a, b) in l.cache.tensors.iter().zip(&fp8.tensors) {
        assert_eq!(a.info.dtype, b.info.dtype);
    }
    // Latent-only selection.
    let o = kvpack_cli(&[
        "decompress",
        &p("lat.kvpack"),
        "-o",
        &p("l.safetensors"),
        "--kind",
        "latent",
        "--layers",
        "1..2",
        "-q",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let l =
        kvpack::io::safetensors::parse(&std::fs::read(p("l.safetensors")).unwrap(), "l").unwrap();
    assert_eq!(l.cache.tensors.len(), 1);
    assert_eq!(l.cache.tensors[0].info.name, "past_key_values.1.latent");
}

/// A latent is coded like keys: the same rows as a K tensor decode to the
/// same values, bit for bit, in every codec whose bitstream does not derive
/// seeds from the kind.
#[test]
fn latents_are_coded_like_keys() {
    let lat = latent(1, 70, DType::Bf16, 13);
    let mut key = lat.clone();
    key.tensors[0].info.kind = Kind::Key;
    key.tensors[0].info.name = "past_key_values.0.key".into();
    let mut value = key.clone();
    value.tensors[0].info.kind = Kind::Value;
    value.tensors[0].info.name = "past_key_values.0.value".into();
    for codec in ["int4", "bdr64:k", "kivi:2", "innerq:k2v2", "polar:m4n4"] {
        let dec = |c: &KvCache| {
            decode_all(&compress_bytes(c, codec, Layout::default(), None), None).tensors[0]
                .data
                .clone()
        };
        let l = dec(&lat);
        assert_eq!(l, dec(&key), "{codec}: latent = key");
        if codec != "int4" {
            assert_ne!(
                l,
                dec(&value),
                "{codec}: K and V differ, so the test can fail"
            );
        }
    }
}

#[test]
fn writers_emit_the_lowest_minor_version() {
    use kvpack::format::{CodecEntry, FileHeader};
    let header = |cache: &KvCache, minor| FileHeader {
        version_major: 1,
        version_minor: minor,
        align_log2: 6,
        tensors: cache.tensors.iter().map(|t| t.info.clone()).collect(),
        codecs: vec![CodecEntry {
            id: 0,
            params: Vec::new(),
        }],
        metadata: Default::default(),
        page_tokens: 256,
        sink_tokens: 0,
        recent_tokens: 0,
    };
    let bf = latent(1, 4, DType::Bf16, 1);
    let mut kv = bf.clone();
    kv.tensors[0].info.kind = Kind::Key;
    let f8 = to_fp8(&kv, Fp8Format::E5M2);
    for (cache, good) in [(&kv, 0), (&bf, 1), (&f8, 1)] {
        assert_eq!(FileHeader::required_minor(&header(cache, 0).tensors), good);
        header(cache, good).encode().unwrap();
        let e = header(cache, 1 - good).encode().unwrap_err();
        assert!(matches!(e, kvpack::Error::Parameter(_)), "{e}");
    }
}

/// Regression (found by tests/roundtrip.rs's random shapes): a tensor with
/// 0 tokens and several heads has zero strides in the head-major layout and
/// must still decode (no elements can overlap).
#[test]
fn zero_token_tensors_with_several_heads_decode() {
    let spec = |tokens| LayerSpec {
        batch: 2,
        heads: 3,
        tokens,
        head_dim: 8,
    };
    let cache = synthetic(&[spec(0), spec(5)], DType::Bf16, 3);
    let bytes = compress_bytes(&cache, "raw", Layout::default(), None);
    assert_eq!(decode_all(&bytes, None).tensors, cache.tensors);
}
