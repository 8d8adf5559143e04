//! Round trips through the container and every codec on synthetic data:
//! exactness for raw, error bounds for the quantizers, windows, zstd,
//! alignment, partial decodes and odd shapes.

mod common;

use common::*;
use kvpack::cache::{DType, Kind};
use kvpack::decode::{Archive, Selection};
use kvpack::plan::Layout;
use proptest::prelude::*;

fn decode_all(bytes: &[u8], dtype: Option<DType>) -> kvpack::KvCache {
    Archive::open(bytes)
        .unwrap()
        .decode(&Selection::default(), dtype, None)
        .unwrap()
}

const SHAPES: &[LayerSpec] = &[
    LayerSpec {
        batch: 1,
        heads: 2,
        tokens: 37,
        head_dim: 64,
    },
    LayerSpec {
        batch: 2,
        heads: 1,
        tokens: 300,
        head_dim: 64,
    },
    LayerSpec {
        batch: 1,
        heads: 3,
        tokens: 1,
        head_dim: 64,
    },
];

#[test]
fn raw_is_lossless_for_every_dtype() {
    for dtype in [DType::Bf16, DType::F16, DType::F32] {
        let c = synthetic(SHAPES, dtype, 11);
        for zstd in [None, Some(3)] {
            let b = compress_bytes(
                &c,
                "raw",
                Layout {
                    page_tokens: 16,
                    sink: 0,
                    recent: 0,
                },
                zstd,
            );
            let d = decode_all(&b, None);
            assert_eq!(d.tensors, c.tensors, "{dtype:?} zstd {zstd:?}");
            assert_eq!(d.token_ids, c.token_ids);
            assert_eq!(d.metadata, c.metadata);
        }
    }
}

/// Per-element bound of token-wise affine quantization: half a step, where
/// the step is (max - min) / (2^b - 1) of the (rotated) row, plus bf16
/// output rounding.
fn check_affine_bound(codec: &str, bits: u32, rotate: Option<usize>, keys_only: bool) {
    check_affine_bound_on(SHAPES, codec, bits, rotate, keys_only)
}

fn check_affine_bound_on(
    shapes: &[LayerSpec],
    codec: &str,
    bits: u32,
    rotate: Option<usize>,
    keys_only: bool,
) {
    let c = synthetic(shapes, DType::F32, 5);
    let b = compress_bytes(
        &c,
        codec,
        Layout {
            page_tokens: 32,
            sink: 0,
            recent: 0,
        },
        None,
    );
    let d = decode_all(&b, Some(DType::F32));
    for (o, r) in c.tensors.iter().zip(&d.tensors) {
        let hd = o.info.head_dim as usize;
        let x = o.data.to_f32();
        let y = r.data.to_f32();
        let h = if keys_only && o.info.kind == Kind::Value {
            None
        } else {
            rotate
        };
        for (xr, yr) in x.chunks(hd).zip(y.chunks(hd)) {
            let mut u = xr.to_vec();
            let mut v = yr.to_vec();
            if let Some(h) = h {
                kvpack::kernels::wht::fwht_blocks_scalar(&mut u, h);
                kvpack::kernels::wht::fwht_blocks_scalar(&mut v, h);
                let c = (h as f32).sqrt().recip();
                u.iter_mut().for_each(|a| *a *= c);
                v.iter_mut().for_each(|a| *a *= c);
            }
            let mn = u.iter().cloned().fold(f32::INFINITY, f32::min);
            let mx = u.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let step = (mx - mn) / ((1 << bits) - 1) as f32;
            for (a, b) in u.iter().zip(&v) {
                assert!(
                    (a - b).abs() <= 0.5 * step * 1.001 + 1e-4,
                    "{codec}: |{a} - {b}| > step/2 = {}",
                    step / 2.0
                );
            }
        }
    }
}

#[test]
fn int_error_is_at_most_half_a_step() {
    for bits in [2, 3, 4, 8] {
        check_affine_bound(&format!("int{bits}"), bits, None, false);
    }
}

/// Rows whose codes do not fill whole bytes (odd head_dims at 4 bits, any
/// head_dim at 3, 5, 7 bits) share bytes with the next row; every width
/// decodes them (int4 at an odd head_dim used to panic in its byte-row
/// fast path).
#[test]
fn int_error_is_at_most_half_a_step_at_odd_head_dims() {
    let shapes: Vec<LayerSpec> = [1, 3, 5, 7, 33]
        .iter()
        .map(|&head_dim| LayerSpec {
            batch: 1,
            heads: 2,
            tokens: 41,
            head_dim,
        })
        .collect();
    for bits in 1..=8 {
        check_affine_bound_on(&shapes, &format!("int{bits}"), bits, None, false);
    }
}

#[test]
fn bdr_error_is_at_most_half_a_step_in_the_rotated_space() {
    for h in [16usize, 32, 64] {
        check_affine_bound(&format!("bdr{h}"), 4, Some(h), false);
    }
    check_affine_bound("bdr64:k", 4, Some(64), true);
    check_affine_bound("bdr32:b3", 3, Some(32), false);
}

#[test]
fn windows_keep_source_precision() {
    let c = synthetic(SHAPES, DType::Bf16, 9);
    let l = Layout {
        page_tokens: 16,
        sink: 4,
        recent: 8,
    };
    let b = compress_bytes(&c, "int2", l, None);
    let d = decode_all(&b, None);
    for (o, r) in c.tensors.iter().zip(&d.tensors) {
        let t = o.info.tokens as usize;
        for p in 0..o.info.planes() {
            for tok in (0..t).filter(|&k| k < 4 || k + 8 >= t) {
                let a = o.plane_rows(p, tok, 1).slice(0, o.info.head_dim as usize);
                let bb = r.plane_rows(p, tok, 1);
                let mut x = vec![0f32; o.info.head_dim as usize];
                let mut y = x.clone();
                a.load(0, &mut x);
                bb.load(0, &mut y);
                assert_eq!(x, y, "window token {tok} of {}", o.info.name);
            }
        }
    }
    let ar = Archive::open(&b).unwrap();
    assert_eq!(ar.codecs().len(), 2);
    assert_eq!(ar.codec(1).name(), "raw");
}

#[test]
fn align_4096_round_trips() {
    let c = synthetic(SHAPES, DType::Bf16, 3);
    let codec = kvpack::codec::parse("bdr32").unwrap();
    let opts = kvpack::compress::CompressOptions {
        align_log2: 12,
        ..Default::default()
    };
    let (b, _) =
        kvpack::compress::compress(&c, codec.as_ref(), &opts, Vec::new(), &|_| {}).unwrap();
    let ar = Archive::open(&b).unwrap();
    for e in &ar.reader().index().entries {
        assert_eq!((ar.reader().header_len() + e.offset) % 4096, 0);
    }
    let d = ar.decode(&Selection::default(), None, None).unwrap();
    let d64 = decode_all(&compress_bytes(&c, "bdr32", Layout::default(), None), None);
    assert_eq!(d.tensors, d64.tensors);
}

#[test]
fn partial_decode_equals_slice_of_full_decode() {
    let c = synthetic(SHAPES, DType::Bf16, 21);
    let b = compress_bytes(
        &c,
        "bdr64",
        Layout {
            page_tokens: 50,
            sink: 3,
            recent: 5,
        },
        Some(1),
    );
    let ar = Archive::open(&b).unwrap();
    let full = ar.decode(&Selection::default(), None, None).unwrap();
    let sel = Selection {
        layers: Some(1..2),
        tokens: Some(40..173),
        kind: Some(Kind::Value),
    };
    let part = ar.decode(&sel, None, None).unwrap();
    assert_eq!(part.tensors.len(), 1);
    let p = &part.tensors[0];
    let f = full.get(1, Kind::Value).unwrap();
    assert_eq!(p.info.tokens, 133);
    let d = f.info.head_dim as usize;
    let mut a = vec![0f32; d];
    let mut bb = vec![0f32; d];
    for plane in 0..f.info.planes() {
        for t in 0..133 {
            f.plane_rows(plane, 40 + t, 1).load(0, &mut a);
            p.plane_rows(plane, t, 1).load(0, &mut bb);
            assert_eq!(a, bb);
        }
    }
}

#[test]
fn different_token_counts_per_layer_are_kept() {
    let c = synthetic(
        &[
            LayerSpec {
                batch: 1,
                heads: 1,
                tokens: 511,
                head_dim: 32,
            },
            LayerSpec {
                batch: 1,
                heads: 1,
                tokens: 520,
                head_dim: 32,
            },
            LayerSpec {
                batch: 1,
                heads: 1,
                tokens: 0,
                head_dim: 32,
            },
        ],
        DType::Bf16,
        4,
    );
    let b = compress_bytes(&c, "int4", Layout::default(), None);
    let d = decode_all(&b, None);
    let tokens: Vec<u32> = d.tensors.iter().map(|t| t.info.tokens).collect();
    assert_eq!(tokens, vec![511, 511, 520, 520, 0, 0]);
}

#[test]
fn head_dim_not_divisible_names_the_largest_valid_block() {
    let c = synthetic(
        &[LayerSpec {
            batch: 1,
            heads: 1,
            tokens: 4,
            head_dim: 96,
        }],
        DType::Bf16,
        1,
    );
    let codec = kvpack::codec::parse("bdr64").unwrap();
    let err =
        kvpack::compress::compress(&c, codec.as_ref(), &Default::default(), Vec::new(), &|_| {})
            .unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("bdr32") && msg.contains("96"), "{msg}");
}

#[test]
fn non_finite_values_are_refused_with_a_location() {
    let mut c = synthetic(
        &[LayerSpec {
            batch: 1,
            heads: 1,
            tokens: 4,
            head_dim: 16,
        }],
        DType::F32,
        1,
    );
    if let kvpack::TensorData::F32(v) = &mut c.tensors[1].data {
        v[2 * 16 + 5] = f32::NAN;
    }
    let codec = kvpack::codec::parse("int4").unwrap();
    let err =
        kvpack::compress::compress(&c, codec.as_ref(), &Default::default(), Vec::new(), &|_| {})
            .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("layer 0 V") && msg.contains("token 2"),
        "{msg}"
    );
    // raw keeps NaN bit-exactly.
    let b = compress_bytes(&c, "raw", Layout::default(), None);
    assert!(decode_all(&b, None).tensors[1].data.to_f32()[37].is_nan());
}

#[test]
fn simd_and_scalar_paths_give_identical_files() {
    // The encoder dispatches to AVX2 when available; the result must equal
    // the portable path bit for bit (the child process forces scalar).
    let c = synthetic(SHAPES, DType::Bf16, 8);
    let b = compress_bytes(&c, "bdr64", Layout::default(), None);
    let exe = std::env::current_exe().unwrap();
    if std::env::var_os("KVPACK_NO_SIMD").is_some() {
        let out = std::env::var("KVPACK_SCALAR_OUT").unwrap();
        std::fs::write(out, &b).unwrap();
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("scalar.kvpack");
    let st = std::process::Command::new(exe)
        .args([
            "--exact",
            "simd_and_scalar_paths_give_identical_files",
            "--nocapture",
        ])
        .env("KVPACK_NO_SIMD", "1")
        .env("KVPACK_SCALAR_OUT", &out)
        .status()
        .unwrap();
    assert!(st.success());
    assert_eq!(std::fs::read(out).unwrap(), b);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]
    #[test]
    fn random_shapes_round_trip_raw_and_bound_int8(
        layers in proptest::collection::vec((1u32..3, 1u32..4, 0u32..70, prop_oneof![Just(8u32), Just(16), Just(32), Just(12)]), 1..4),
        page in 1u32..40, sink in 0u32..10, recent in 0u32..10, seed in 1u64..1000, zstd in proptest::option::of(1i32..4),
    ) {
        let specs: Vec<LayerSpec> = layers.iter().map(|&(b, h, t, d)| LayerSpec { batch: b, heads: h, tokens: t, head_dim: d }).collect();
        let c = synthetic(&specs, DType::Bf16, seed);
        let l = Layout { page_tokens: page, sink, recent };
        let b = compress_bytes(&c, "raw", l, zstd);
        let d = decode_all(&b, None);
        prop_assert_eq!(&d.tensors, &c.tensors);
        let b8 = compress_bytes(&c, "int8", l, zstd);
        let d8 = decode_all(&b8, Some(DType::F32));
        for (o, r) in c.tensors.iter().zip(&d8.tensors) {
            let e = kvpack::metrics::tensor_error(o, r).unwrap();
            prop_assert!(e.rel_mse < 1e-3, "{} rel mse {}", o.info.name, e.rel_mse);
        }
    }
}
