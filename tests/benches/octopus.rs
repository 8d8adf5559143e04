//! OCTOPUS and TurboQuant-MSE throughput on the real fixture (Gemma-3-270M,
//! head_dim 256), in GB/s of bf16 KV (input bytes for encode, output bytes
//! for decode), on one thread and on all threads, next to bdr128 and zstd
//! level 1 on the same bytes in the same run; plus the compressed-domain
//! score (`Octopus::scores`: one query against every K page, no decode) in
//! GB/s of the bf16 K bytes it stands for.
//!
//! `cargo bench --bench octopus` or `cargo bench --bench octopus -- decode`.
//! Set `KVPACK_BENCH_CODECS=octopus:b3,turbo:b3` to choose codecs.

use std::path::Path;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvpack::cache::{DType, Kind};
use kvpack::codec::octopus::Octopus;
use kvpack::compress::{CompressOptions, compress};
use kvpack::decode::{Archive, Selection};
use kvpack::format::Reader;
use rayon::prelude::*;

const FIXTURE: &str = "fixtures/gemma3-270m-gpl3-520.safetensors";
const DEFAULT: &str = "octopus:b2,octopus:b3,octopus:b4,octopus:b3+qjl,turbo:b3,bdr128";

fn pools() -> Vec<(String, rayon::ThreadPool)> {
    let all = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let pool = |n| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .unwrap()
    };
    let mut v = vec![("1 thread".to_string(), pool(1))];
    if all > 1 {
        v.push((format!("{all} threads"), pool(all)));
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
    let codecs = std::env::var("KVPACK_BENCH_CODECS").unwrap_or_else(|_| DEFAULT.into());
    let files: Vec<(String, Vec<u8>)> = codecs
        .split(',')
        .map(|name| {
            let codec = kvpack::codec::parse(name).unwrap();
            let (f, _) = compress(
                &cache,
                codec.as_ref(),
                &CompressOptions::default(),
                Vec::new(),
                &|_| {},
            )
            .unwrap();
            (name.to_string(), f)
        })
        .collect();
    let zipped: Vec<Vec<u8>> = raw
        .iter()
        .map(|t| zstd::bulk::compress(t, 1).unwrap())
        .collect();
    for (label, pool) in pools() {
        let mut g = c.benchmark_group(format!("encode/{label}"));
        g.throughput(Throughput::Bytes(source));
        for name in codecs.split(',') {
            let codec = kvpack::codec::parse(name).unwrap();
            g.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter(|| {
                    pool.install(|| {
                        compress(
                            &cache,
                            codec.as_ref(),
                            &CompressOptions::default(),
                            Vec::with_capacity(4 << 20),
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
        for (name, file) in &files {
            let ar = Archive::open(file).unwrap();
            g.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter(|| {
                    pool.install(|| {
                        ar.decode(&Selection::default(), Some(DType::Bf16), None)
                            .unwrap()
                    })
                })
            });
        }
        g.bench_function(BenchmarkId::from_parameter("zstd-1"), |b| {
            b.iter(|| {
                pool.install(|| {
                    zipped
                        .par_iter()
                        .zip(&raw)
                        .map(|(c, r)| zstd::bulk::decompress(c, r.len()).unwrap().len())
                        .sum::<usize>()
                })
            })
        });
        g.finish();
    }

    // Compressed-domain scores: one query per K page, single thread.
    let mut g = c.benchmark_group("scores/1 thread");
    let k_bytes: u64 = cache
        .tensors
        .iter()
        .filter(|t| t.info.kind == Kind::Key)
        .map(|t| t.info.elements() * 2)
        .sum();
    g.throughput(Throughput::Bytes(k_bytes));
    for (name, file) in files.iter().filter(|(n, _)| n.starts_with("octopus")) {
        let r = Reader::open(file).unwrap();
        let codec = Octopus::from_params(&r.header().codecs[0].params).unwrap();
        let pages: Vec<_> = (0..r.index().entries.len())
            .filter_map(|i| {
                let e = r.index().entries[i].meta;
                let info = r.header().tensors[e.tensor as usize].clone();
                (info.kind == Kind::Key).then(|| (r.page(i).unwrap(), info))
            })
            .collect();
        let q: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 17) as f32 - 8.0) / 8.0)
            .collect();
        g.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| {
                pages
                    .iter()
                    .map(|(p, info)| codec.scores(p, info, 0, &q).unwrap().len())
                    .sum::<usize>()
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).measurement_time(std::time::Duration::from_secs(2)).warm_up_time(std::time::Duration::from_millis(500));
    targets = bench
}
criterion_main!(benches);
