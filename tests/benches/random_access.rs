//! Partial decode vs full decode through the random-access reader, on a
//! cache with many pages: 32 layers x K/V x [1, 8, 2048, 128] bf16
//! (268 MB), bdr128, 256-token pages (512 pages), memory-mapped from a file.
//!
//! `cargo bench --bench random_access`

#[path = "../common/mod.rs"]
mod common;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvpack::cache::{DType, Kind};
use kvpack::compress::{CompressOptions, compress};
use kvpack::decode::{Archive, Selection};

fn bench(c: &mut Criterion) {
    let cache = common::synthetic(
        &[common::LayerSpec {
            batch: 1,
            heads: 8,
            tokens: 2048,
            head_dim: 128,
        }; 32],
        DType::Bf16,
        7,
    );
    let codec = kvpack::codec::parse("bdr128").unwrap();
    let (bytes, _) = compress(
        &cache,
        codec.as_ref(),
        &CompressOptions::default(),
        Vec::new(),
        &|_| {},
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.kvpack");
    std::fs::write(&path, &bytes).unwrap();
    drop(bytes);
    let map = kvpack::io::file::open_input(path.to_str().unwrap()).unwrap();
    let ar = Archive::open(&map).unwrap();
    eprintln!(
        "{} pages, {} bytes",
        ar.reader().index().entries.len(),
        map.len()
    );
    let cases = [
        ("full cache", Selection::default()),
        (
            "4 layers",
            Selection {
                layers: Some(0..4),
                ..Default::default()
            },
        ),
        (
            "1 layer K",
            Selection {
                layers: Some(7..8),
                kind: Some(Kind::Key),
                ..Default::default()
            },
        ),
        (
            "tokens 128..512 of all layers",
            Selection {
                tokens: Some(128..512),
                ..Default::default()
            },
        ),
        (
            "layers 0..4 tokens 128..512",
            Selection {
                layers: Some(0..4),
                tokens: Some(128..512),
                ..Default::default()
            },
        ),
    ];
    let mut g = c.benchmark_group("decode selection");
    for (name, sel) in cases {
        let out = ar.decode(&sel, Some(DType::Bf16), None).unwrap();
        g.throughput(Throughput::Bytes(out.source_bytes()));
        g.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| ar.decode(&sel, Some(DType::Bf16), None).unwrap())
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).measurement_time(std::time::Duration::from_secs(3)).warm_up_time(std::time::Duration::from_secs(1));
    targets = bench
}
criterion_main!(benches);
