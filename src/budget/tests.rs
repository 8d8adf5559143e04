//! Planner tests on the committed real fixture (Gemma-3-270M, bf16, 520
//! tokens).

use super::*;
use crate::cache::{DType, KvCache, TensorData};
use crate::decode::{Archive, Selection};

fn fixture() -> KvCache {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fixtures/gemma3-270m-gpl3-520.safetensors"
    );
    let bytes = std::fs::read(path).expect("fixture");
    crate::io::safetensors::parse(&bytes, path)
        .expect("parse fixture")
        .cache
}

/// `cache` planned for `bits` with the default options: the file, report
/// and plan.
fn plan_file(cache: &KvCache, bits: f64) -> Result<(Vec<u8>, CompressReport, Plan)> {
    compress_budget(
        &cache.view(),
        bits,
        &CompressOptions::default(),
        Vec::new(),
        &|_| {},
    )
}

#[test]
fn budget_is_respected_everything_counted_and_the_file_round_trips() {
    let cache = fixture();
    let view = cache.view();
    let opts = CompressOptions::default();
    let mut last_d = f64::INFINITY;
    for bits in [2.5, 3.25, 4.25] {
        let (file, report, plan) =
            compress_budget(&view, bits, &opts, Vec::new(), &|_| {}).unwrap();
        let real = 8.0 * file.len() as f64 / cache.elements() as f64;
        assert!(real <= bits, "{bits}: file is {real} bits/element");
        assert!(real > bits - 0.25, "{bits}: only {real} bits/element used");
        assert_eq!(report.output_bytes, file.len() as u64);
        assert!(
            plan.distortion < last_d,
            "{bits}: distortion {} not below {last_d}",
            plan.distortion
        );
        last_d = plan.distortion;
        // Every page of a tensor is its planned codec, or raw in the window.
        let ar = Archive::open(&file).unwrap();
        for e in &ar.reader().index().entries {
            let t = &plan.tensors[e.meta.tensor as usize];
            let name = ar.codec(e.meta.codec as usize).name();
            if e.meta.token_start < t.sink {
                assert_eq!(name, "raw");
            } else {
                assert_eq!(name, t.codec);
            }
        }
        let dec = ar
            .decode(&Selection::default(), Some(DType::F32), None)
            .unwrap();
        for (o, d) in cache.tensors.iter().zip(&dec.tensors) {
            let e = crate::metrics::tensor_error(o, d).unwrap();
            let t = plan.tensors.iter().find(|t| t.name == o.info.name).unwrap();
            assert!(
                e.snr_db > 3.0,
                "{bits}: {} ({}) SNR {}",
                o.info.name,
                t.codec,
                e.snr_db
            );
            // Sink slots are exact.
            let dim = o.info.head_dim as usize;
            let n = t.sink as usize * dim;
            assert_eq!(
                o.data.to_f32()[..n],
                d.data.to_f32()[..n],
                "{}",
                o.info.name
            );
        }
    }
}

#[test]
fn the_plan_is_deterministic() {
    let cache = fixture();
    let view = cache.view();
    let opts = CompressOptions::default();
    let a = compress_budget(&view, 3.0, &opts, Vec::new(), &|_| {}).unwrap();
    let b = compress_budget(&view, 3.0, &opts, Vec::new(), &|_| {}).unwrap();
    assert_eq!(a.0, b.0);
    assert_eq!(a.2.tensors, b.2.tensors);
    // Pools of other sizes plan the same (layers are measured in parallel,
    // hqmq candidates share direction searches within a layer).
    for threads in [1, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let c = pool.install(|| compress_budget(&view, 3.0, &opts, Vec::new(), &|_| {}).unwrap());
        assert_eq!(a.0, c.0, "{threads} threads");
    }
}

#[test]
fn impossible_budgets_are_refused() {
    let cache = fixture();
    let view = cache.view();
    let opts = CompressOptions::default();
    let e = plan(&view, 1.0, &opts).unwrap_err().to_string();
    assert!(e.contains("smallest plan"), "{e}");
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        assert!(plan(&view, bad, &opts).is_err());
    }
}

#[test]
#[ignore = "prints the planner's measurements; run with --nocapture"]
fn print_uniform_points() {
    let cache = fixture();
    for p in uniform_points(&cache.view(), &CompressOptions::default()).unwrap() {
        println!(
            "{:<14} {:.3} D {:.4} K {:.4} V {:.4}",
            p.codec, p.bits, p.distortion, p.distortion_k, p.distortion_v
        );
    }
}

#[test]
fn study_points_file_lists_every_measured_point() {
    let cache = fixture();
    let view = cache.view();
    let opts = CompressOptions::default();
    let m = measure(&view, &opts).unwrap();
    let points = m.study_points();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("points.json");
    study::write_points(&path, &view, points).unwrap();
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let list = json.as_array().unwrap();
    assert_eq!(list.len(), cache.tensors.len());
    for ((j, t), tp) in list.iter().zip(&cache.tensors).zip(&m.tensors) {
        assert_eq!(j["name"], t.info.name.as_str());
        assert_eq!(j["kind"], t.info.kind.name());
        let pts = j["points"].as_array().unwrap();
        assert_eq!(pts.len(), tp.points.len());
        // raw is exact; every other point was measured with some error.
        for (p, q) in pts.iter().zip(&tp.points) {
            // serde_json's default float parsing may differ in the last bit.
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs();
            assert!(close(p["bytes"].as_f64().unwrap(), q.bytes), "{p}");
            assert!(
                close(p["distortion"].as_f64().unwrap(), q.distortion),
                "{p}"
            );
            assert_eq!(p["codec"] == "raw", q.distortion == 0.0, "{p}");
        }
    }
}

/// A windowed candidate (`hqmq` with `+chan`, whose page coding depends on
/// the rows in the page) is measured once per sink window of at least one
/// token (never with the attention sink inside its pages) with the
/// window's rows left out of the sample page: its points equal a round
/// trip of exactly those rows, and its estimated bytes count the gains once
/// per page, not once per sampled row.
#[test]
fn windowed_candidates_are_measured_per_sink_window() {
    let cache = fixture();
    let view = cache.view();
    let opts = CompressOptions::default();
    let names: Vec<String> = ["hqmq:s24r3", "hqmq:s24r3+chan"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let m = measure_names(&view, &opts, &names, false).unwrap();
    let t = 10; // layer 5's key: 520 tokens
    let tp = &m.tensors[t];
    let info = &cache.tensors[t].info;
    let sample = Sample::of(info.tokens);
    let rows = load_rows(&view.tensors[t], &sample);
    let n = sample.len();
    let d = info.head_dim as usize;
    let chan = Hqmq::new(24, 3, None, 0)
        .unwrap()
        .with_channels(hqmq::Channels::Gains);
    assert!(
        !tp.choice.contains(&(1, 0)),
        "a windowed candidate without a sink window"
    );
    for &sink in candidates::SINKS.iter().filter(|&&s| s > 0) {
        let e = exact_rows(&sample, sink);
        let after = rows_after(&rows, n, d, e);
        let mut shared = hqmq::Shared::default();
        let mut enc = |page: &crate::codec::PageIn<'_>, recon: &mut [f32]| {
            chan.trial(page, &mut shared, recon)
                .map(|t| Encoded::Decoded {
                    payload: t.payload,
                    sections: t.sections,
                    per_page: t.per_page,
                })
        };
        let rt = round_trip(&chan, &mut enc, info, &after, n - e).unwrap();
        assert_eq!(rt.per_page, 2 * info.planes() as u64 * d as u64);
        let i = tp.choice.iter().position(|&c| c == (1, sink)).unwrap();
        let want = tensor_bytes(info, Some(&rt), sink, &opts);
        assert_eq!(tp.points[i].bytes, want, "sink {sink}");
        // The gains cost about 2 bytes per channel and page, so +chan costs
        // far less than the gains of every sampled row would.
        let j = tp.choice.iter().position(|&c| c == (0, sink)).unwrap();
        let extra = tp.points[i].bytes - tp.points[j].bytes;
        let pages = f64::from((info.tokens - sink).div_ceil(opts.layout.page_tokens));
        assert!(
            extra < 1.5 * pages * 2.0 * d as f64,
            "sink {sink}: {extra} bytes"
        );
        assert!(tp.points[i].distortion > 0.0);
    }
}

/// The fixture with every tensor's head vectors cut to their first `d`
/// channels (real K/V rows at head_dims the fixture's model does not have).
fn fixture_cut(d: u32) -> KvCache {
    let mut cache = fixture();
    for t in &mut cache.tensors {
        let full = t.info.head_dim as usize;
        let TensorData::Bf16(v) = &t.data else {
            panic!("bf16 fixture")
        };
        let cut: Vec<_> = v
            .chunks_exact(full)
            .flat_map(|row| row[..d as usize].iter().copied())
            .collect();
        let mut info = t.info.clone();
        info.head_dim = d;
        *t = crate::cache::Tensor::new(info, TensorData::Bf16(cut)).unwrap();
    }
    cache
}

#[test]
fn head_dims_that_some_candidates_refuse_are_planned_with_the_others() {
    // 96, 80 (not powers of two: no TurboQuant codebook) and 6 (not a
    // multiple of 4: no hqmq chunks either) plan with the candidates that
    // accept them, within the budget.
    for (d, bits) in [(96, 3.25), (80, 4.25), (6, 20.0)] {
        let cache = fixture_cut(d);
        let (file, _, plan) =
            plan_file(&cache, bits).unwrap_or_else(|e| panic!("head_dim {d}: {e}"));
        let real = 8.0 * file.len() as f64 / cache.elements() as f64;
        assert!(real <= bits, "head_dim {d}: {real} bits/element");
        for t in &plan.tensors {
            assert!(!t.codec.starts_with("turbo"), "head_dim {d}: {}", t.codec);
            if d % 4 != 0 {
                assert!(!t.codec.starts_with("hqmq"), "head_dim {d}: {}", t.codec);
            }
        }
        Archive::open(&file)
            .unwrap()
            .decode(&Selection::default(), Some(DType::F32), None)
            .unwrap();
    }
}

/// Sets row `token` of plane 0 of tensor `t` to `x` in every channel.
fn set_row(cache: &mut KvCache, t: usize, token: usize, x: f32) {
    let d = cache.tensors[t].info.head_dim as usize;
    let TensorData::Bf16(v) = &mut cache.tensors[t].data else {
        panic!("bf16 fixture")
    };
    v[token * d..(token + 1) * d].fill(half::bf16::from_f32(x));
}

#[test]
fn values_a_candidate_cannot_hold_leave_it_out_for_that_tensor() {
    // 1e5 in every channel: hqmq's chunk radius is beyond its fp16 scale.
    // Token 3 is in every sample (the first 16 slots are); token 17 in
    // none (the spread slots of 520 tokens start at 21), so only the
    // file's encode finds it and the tensor is re-planned.
    for token in [3, 17] {
        let mut cache = fixture();
        set_row(&mut cache, 6, token, 1e5);
        let (file, _, plan) =
            plan_file(&cache, 4.25).unwrap_or_else(|e| panic!("token {token}: {e}"));
        assert!(8.0 * file.len() as f64 / cache.elements() as f64 <= 4.25);
        let t = &plan.tensors[6];
        assert!(
            !t.codec.starts_with("hqmq") || t.sink > token as u32,
            "token {token}: {} sink {}",
            t.codec,
            t.sink
        );
        // Other tensors keep their hqmq choices.
        assert!(plan.tensors.iter().any(|t| t.codec.starts_with("hqmq")));
        let dec = Archive::open(&file)
            .unwrap()
            .decode(&Selection::default(), Some(DType::F32), None)
            .unwrap();
        let TensorData::F32(v) = &dec.tensors[6].data else {
            panic!("f32")
        };
        let d = cache.tensors[6].info.head_dim as usize;
        let row = &v[token * d..(token + 1) * d];
        let err = row
            .iter()
            .map(|&x| (f64::from(x) - 1e5).powi(2))
            .sum::<f64>();
        let rel = (err / (d as f64 * 1e10)).sqrt();
        assert!(
            rel < 0.25,
            "token {token}: {} relative error {rel}",
            t.codec
        );
    }
}

#[test]
fn a_value_no_candidate_can_code_is_named() {
    let mut cache = fixture();
    set_row(&mut cache, 4, 2, f32::NAN);
    let e = plan_file(&cache, 4.25).unwrap_err().to_string();
    assert!(
        e.contains("past_key_values.2.key") && e.contains("token 2"),
        "{e}"
    );
}

#[test]
fn non_finite_values_of_every_source_dtype_are_named() {
    for (dtype, bad) in [(DType::F16, f32::INFINITY), (DType::F32, f32::NAN)] {
        let mut cache = fixture_cut(64);
        for t in &mut cache.tensors {
            let TensorData::Bf16(v) = &t.data else {
                panic!("bf16 fixture")
            };
            let f: Vec<f32> = v.iter().map(|x| x.to_f32()).collect();
            t.info.dtype = dtype;
            t.data = match dtype {
                DType::F16 => TensorData::F16(f.iter().map(|&x| half::f16::from_f32(x)).collect()),
                _ => TensorData::F32(f),
            };
        }
        let d = 64;
        match &mut cache.tensors[7].data {
            TensorData::F16(v) => v[5 * d + 3] = half::f16::from_f32(bad),
            TensorData::F32(v) => v[5 * d + 3] = bad,
            _ => unreachable!(),
        }
        let e = plan_file(&cache, 4.25).unwrap_err().to_string();
        assert!(
            e.contains("past_key_values.3.value")
                && e.contains("token 5")
                && e.contains("non-finite"),
            "{dtype:?}: {e}"
        );
    }
}

#[test]
fn a_layer_without_tokens_is_planned_raw_at_no_cost() {
    let mut cache = fixture();
    for t in &mut cache.tensors[2..4] {
        let mut info = t.info.clone();
        info.tokens = 0;
        *t = crate::cache::Tensor::new(info, TensorData::Bf16(Vec::new())).unwrap();
    }
    let (file, _, plan) = plan_file(&cache, 4.25).unwrap();
    assert!(8.0 * file.len() as f64 / cache.elements() as f64 <= 4.25);
    assert_eq!(plan.tensors[2].codec, "raw");
    assert_eq!(plan.tensors[2].bits, 0.0);
    let dec = Archive::open(&file)
        .unwrap()
        .decode(&Selection::default(), None, None)
        .unwrap();
    assert_eq!(dec.tensors[2].info.tokens, 0);
}
