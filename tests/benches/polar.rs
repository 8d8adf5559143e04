//! PolarQuant score kernels (single thread): q.k for every cached token by
//! the section 3.3 table lookup (`PolarKeys::scores`, AVX2 gather, and its
//! scalar reference) against a plain dequantize-then-dot on the same
//! compressed page (`PolarKeys::scores_dequant`), with an f32 dot product
//! over uncompressed keys for scale. Throughput is in tokens scored
//! (criterion "elements").
//!
//! Data: the real fixture's keys (all 18 layers of Gemma-3-270M stacked:
//! 9,225 tokens x head_dim 256) with a real query, and synthetic Gaussian
//! keys with 32,768 tokens x head_dim 128 (the paper's Table 4 shape).
//!
//! `cargo bench --bench polar` (or `-- m4n4` to filter).

use std::path::Path;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use half::bf16;
use kvpack::cache::{DType, Kind, KvCache, Tensor, TensorData, TensorInfo};
use kvpack::codec::polar::{Polar, score::PolarKeys};
use kvpack::compress::{CompressOptions, compress};
use kvpack::decode::Archive;
use kvpack::plan::Layout;

const FIXTURE: &str = "fixtures/gemma3-270m-gpl3-520.safetensors";

/// One K tensor of `tokens x d` (plus a V tensor so the cache is complete).
fn cache_of(keys: Vec<bf16>, tokens: u32, d: u32) -> KvCache {
    let info = |kind| TensorInfo {
        name: format!("k{kind:?}"),
        layer: 0,
        kind,
        dtype: DType::Bf16,
        batch: 1,
        heads: 1,
        tokens,
        head_dim: d,
    };
    let v = vec![bf16::ZERO; keys.len()];
    KvCache {
        tensors: vec![
            Tensor::new(info(Kind::Key), TensorData::Bf16(keys)).unwrap(),
            Tensor::new(info(Kind::Value), TensorData::Bf16(v)).unwrap(),
        ],
        ..Default::default()
    }
}

fn xorshift(seed: &mut u64) -> f32 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    // Sum of 4 uniforms: roughly Gaussian, deterministic.
    let mut s = 0.0;
    for k in 0..4 {
        s += ((*seed >> (16 * k)) & 0xffff) as f32 / 65536.0;
    }
    (s - 2.0) * 1.7
}

fn datasets() -> Vec<(String, KvCache, Vec<f32>)> {
    let bytes =
        std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join(FIXTURE)).expect("fixture");
    let fx = kvpack::io::safetensors::parse(&bytes, FIXTURE).unwrap();
    let mut keys = Vec::new();
    let mut tokens = 0;
    for t in fx.cache.tensors.iter().filter(|t| t.info.kind == Kind::Key) {
        if let TensorData::Bf16(v) = &t.data {
            keys.extend_from_slice(v);
        }
        tokens += t.info.tokens;
    }
    let q_real = fx.queries[0].data[..256].to_vec();
    let real = cache_of(keys, tokens, 256);

    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let (t, d) = (32_768u32, 128u32);
    let keys = (0..t * d)
        .map(|_| bf16::from_f32(xorshift(&mut seed)))
        .collect();
    let q_synth = (0..d).map(|_| xorshift(&mut seed)).collect();
    vec![
        (format!("gemma-{tokens}x256"), real, q_real),
        (format!("gauss-{t}x{d}"), cache_of(keys, t, d), q_synth),
    ]
}

fn bench(c: &mut Criterion) {
    for (label, cache, q) in datasets() {
        let tokens = cache.tensors[0].info.tokens;
        let keys_f32 = cache.tensors[0].data.to_f32();
        let d = q.len();
        let mut g = c.benchmark_group(format!("polar-score/{label}"));
        g.throughput(Throughput::Elements(u64::from(tokens)));
        let mut out = vec![0f32; tokens as usize];
        g.bench_function(BenchmarkId::from_parameter("f32 dot (uncompressed)"), |b| {
            b.iter(|| {
                for (o, k) in out.iter_mut().zip(keys_f32.chunks_exact(d)) {
                    let mut acc = [0f32; 8];
                    for (x, y) in q.chunks_exact(8).zip(k.chunks_exact(8)) {
                        for l in 0..8 {
                            acc[l] += x[l] * y[l];
                        }
                    }
                    *o = acc.iter().sum();
                }
                std::hint::black_box(&out);
            })
        });
        for name in ["polar:m4n4", "polar:m4n2"] {
            let codec = kvpack::codec::parse(name).unwrap();
            let opts = CompressOptions {
                layout: Layout {
                    page_tokens: tokens,
                    sink: 0,
                    recent: 0,
                },
                ..Default::default()
            };
            let (file, _) = compress(&cache, codec.as_ref(), &opts, Vec::new(), &|_| {}).unwrap();
            let ar = Archive::open(&file).unwrap();
            let polar = Polar::from_params(&ar.reader().header().codecs[0].params).unwrap();
            let page = ar.reader().page(0).unwrap();
            let info = &ar.tensors()[0];
            let keys = PolarKeys::new(&polar, &page, info).unwrap();
            g.bench_function(BenchmarkId::new(name, "lookup"), |b| {
                b.iter(|| keys.scores(0, &q, &mut out))
            });
            g.bench_function(BenchmarkId::new(name, "lookup scalar"), |b| {
                b.iter(|| keys.scores_reference(0, &q, &mut out))
            });
            g.bench_function(BenchmarkId::new(name, "dequant+dot"), |b| {
                b.iter(|| keys.scores_dequant(0, &q, &mut out))
            });
        }
        g.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(2)).warm_up_time(std::time::Duration::from_millis(500));
    targets = bench
}
criterion_main!(benches);
