//! HQMQ throughput on the real fixture, in GB/s of bf16 KV (input bytes for
//! encode, output bytes for decode), on one thread and on all threads, next
//! to zstd level 1 on the same bytes in the same run; and the direction
//! search alone, fast exact search against exhaustive search (the encoder
//! speedup), in bf16 input bytes (8 per chunk).
//!
//! `cargo bench --bench hqmq` (all groups) or e.g.
//! `cargo bench --bench hqmq -- search`. Set `KVPACK_BENCH_CODECS` to choose
//! the codecs (default `hqmq:s24r3,hqmq:s96r4,hqmq:s96r4+med3,hqmq:s192r6+med3`).

use std::path::Path;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvpack::cache::{DType, Kind};
use kvpack::codec::hqmq::{parse_name, search};
use kvpack::compress::{CompressOptions, compress};
use kvpack::decode::{Archive, Selection};
use kvpack::kernels::quaternion::Quat;
use rayon::prelude::*;

const FIXTURE: &str = "fixtures/gemma3-270m-gpl3-520.safetensors";
const DEFAULT: &str = "hqmq:s24r3,hqmq:s96r4,hqmq:s96r4+med3,hqmq:s192r6+med3";

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

fn load() -> kvpack::io::safetensors::Loaded {
    let bytes =
        std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join(FIXTURE)).expect("fixture");
    kvpack::io::safetensors::parse(&bytes, FIXTURE).unwrap()
}

fn codecs(c: &mut Criterion) {
    let cache = load().cache;
    let source = cache.source_bytes();
    let raw: Vec<Vec<u8>> = cache.tensors.iter().map(|t| t.data.to_le_bytes()).collect();
    let names = std::env::var("KVPACK_BENCH_CODECS").unwrap_or_else(|_| DEFAULT.into());
    for (label, pool) in pools() {
        let mut g = c.benchmark_group(format!("hqmq encode/{label}"));
        g.throughput(Throughput::Bytes(source));
        for name in names.split(',') {
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

        let mut g = c.benchmark_group(format!("hqmq decode/{label}"));
        g.throughput(Throughput::Bytes(source));
        for name in names.split(',') {
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

/// Direction search alone on one thread: fast exact search vs exhaustive
/// search over the 24 S joint codewords, on the first 16384 chunks of the
/// fixture's layer-0 keys.
fn search_speedup(c: &mut Criterion) {
    let cache = load().cache;
    let x = cache.tensors[0].data.to_f32();
    let chunks: Vec<Quat> = x
        .chunks_exact(4)
        .take(16384)
        .map(|c| [c[0], c[1], c[2], c[3]])
        .collect();
    let mut g = c.benchmark_group("hqmq search");
    g.throughput(Throughput::Bytes(8 * chunks.len() as u64));
    for name in ["hqmq:s24r3", "hqmq:s96r4", "hqmq:s192r6"] {
        let h = parse_name(name).unwrap();
        let cb = h.codebook(0, 0, Kind::Key);
        let mut out = vec![0u32; chunks.len()];
        let s = h.secondaries;
        g.bench_function(BenchmarkId::new("fast", s), |b| {
            b.iter(|| search::search_quats(&cb, &chunks, &mut out))
        });
        g.bench_function(BenchmarkId::new("exhaustive", s), |b| {
            b.iter(|| {
                for (o, x) in out.iter_mut().zip(&chunks) {
                    *o = search::exhaustive(&cb.joint, *x);
                }
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).measurement_time(std::time::Duration::from_secs(3)).warm_up_time(std::time::Duration::from_secs(1));
    targets = search_speedup, codecs
}
criterion_main!(benches);
