//! OCTOPUS's compressed-domain score (`Octopus::scores`: one query against
//! every K page, no decode) in GB/s of the bf16 K bytes it stands for, one
//! thread.
//!
//! `cargo bench --bench octopus` (set `KVPACK_BENCH_CODECS` to choose the
//! octopus configurations). Whole-codec encode/decode throughput next to
//! zstd-1 is in the `codecs` bench:
//! `KVPACK_BENCH_CODECS=octopus:b3,turbo:b3 cargo bench --bench codecs`.

use std::path::Path;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvpack::cache::Kind;
use kvpack::codec::octopus::Octopus;
use kvpack::compress::{CompressOptions, compress};
use kvpack::format::Reader;

const FIXTURE: &str = "fixtures/gemma3-270m-gpl3-520.safetensors";
const DEFAULT: &str = "octopus:b2,octopus:b3,octopus:b4,octopus:b3+qjl";

fn bench(c: &mut Criterion) {
    let bytes =
        std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join(FIXTURE)).expect("fixture");
    let cache = kvpack::io::safetensors::parse(&bytes, FIXTURE)
        .unwrap()
        .cache;
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
