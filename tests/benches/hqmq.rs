//! HQMQ's direction search alone: the fast exact search against exhaustive
//! search over the 24 S joint codewords (the encoder speedup), in bf16 input
//! bytes (8 per chunk), one thread.
//!
//! `cargo bench --bench hqmq`. Whole-codec encode/decode throughput next to
//! zstd-1 is in the `codecs` bench:
//! `KVPACK_BENCH_CODECS=hqmq:s24r3,hqmq:s96r4,hqmq:s96r4+med3 cargo bench --bench codecs`.

use std::path::Path;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvpack::cache::Kind;
use kvpack::codec::hqmq::{parse_name, search};
use kvpack::kernels::quaternion::Quat;

const FIXTURE: &str = "fixtures/gemma3-270m-gpl3-520.safetensors";

fn load() -> kvpack::io::safetensors::Loaded {
    let bytes =
        std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join(FIXTURE)).expect("fixture");
    kvpack::io::safetensors::parse(&bytes, FIXTURE).unwrap()
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
    targets = search_speedup
}
criterion_main!(benches);
