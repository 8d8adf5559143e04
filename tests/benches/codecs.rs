//! Encode/decode throughput on the real fixture, in GB/s of bf16 KV (input
//! bytes for encode, output bytes for decode), on one thread and on all
//! threads, next to zstd level 1 on the same bytes in the same run.
//!
//! `cargo bench --bench codecs` (bdr128 and int4) or `cargo bench --bench codecs
//! -- bdr128` (one). Set `KVPACK_BENCH_CODECS=int4,bdr128` to choose codecs.

use std::path::Path;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvpack::cache::DType;
use kvpack::compress::{CompressOptions, compress};
use kvpack::decode::{Archive, Selection};
use rayon::prelude::*;

const FIXTURE: &str = "fixtures/gemma3-270m-gpl3-520.safetensors";

fn pools() -> Vec<(String, rayon::ThreadPool)> {
    let all = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let mut v = vec![(
        "1 thread".to_string(),
        rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap(),
    )];
    if all > 1 {
        v.push((
            format!("{all} threads"),
            rayon::ThreadPoolBuilder::new()
                .num_threads(all)
                .build()
                .unwrap(),
        ));
    }
    v
}

fn bench(c: &mut Criterion) {
    let bytes =
        std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join(FIXTURE)).expect("fixture");
    let cache = kvpack::io::safetensors::parse(&bytes, FIXTURE)
        .unwrap()
        .cache;
    let source = cache.source_bytes();
    let raw: Vec<Vec<u8>> = cache.tensors.iter().map(|t| t.data.to_le_bytes()).collect();
    let codecs = std::env::var("KVPACK_BENCH_CODECS").unwrap_or_else(|_| "bdr128,int4".into());
    for (label, pool) in pools() {
        let mut g = c.benchmark_group(format!("encode/{label}"));
        g.throughput(Throughput::Bytes(source));
        for name in codecs.split(',') {
            let codec = kvpack::codec::parse(name).unwrap();
            let opts = CompressOptions::default();
            g.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter(|| {
                    pool.install(|| {
                        compress(
                            &cache,
                            codec.as_ref(),
                            &opts,
                            Vec::with_capacity(3 << 20),
                            &|_| {},
                        )
                        .unwrap()
                    })
                })
            });
        }
        g.bench_function(BenchmarkId::from_parameter("zstd-1"), |b| {
            b.iter(|| {
                pool.install(|| {
                    raw.par_iter()
                        .map(|t| zstd::bulk::compress(t, 1).unwrap().len())
                        .sum::<usize>()
                })
            })
        });
        g.finish();

        let mut g = c.benchmark_group(format!("decode/{label}"));
        g.throughput(Throughput::Bytes(source));
        for name in codecs.split(',') {
            let codec = kvpack::codec::parse(name).unwrap();
            let (file, _) = compress(
                &cache,
                codec.as_ref(),
                &CompressOptions::default(),
                Vec::new(),
                &|_| {},
            )
            .unwrap();
            let ar = Archive::open(&file).unwrap();
            g.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter(|| {
                    pool.install(|| {
                        ar.decode(&Selection::default(), Some(DType::Bf16), None)
                            .unwrap()
                    })
                })
            });
        }
        let z: Vec<Vec<u8>> = raw
            .iter()
            .map(|t| zstd::bulk::compress(t, 1).unwrap())
            .collect();
        let zlen: usize = z.iter().map(Vec::len).sum();
        eprintln!(
            "zstd-1 ratio on the fixture: {:.3}x",
            source as f64 / zlen as f64
        );
        g.bench_function(BenchmarkId::from_parameter("zstd-1"), |b| {
            b.iter(|| {
                pool.install(|| {
                    z.par_iter()
                        .zip(&raw)
                        .map(|(c, r)| zstd::bulk::decompress(c, r.len()).unwrap().len())
                        .sum::<usize>()
                })
            })
        });
        g.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(3)).warm_up_time(std::time::Duration::from_secs(1));
    targets = bench
}
criterion_main!(benches);
