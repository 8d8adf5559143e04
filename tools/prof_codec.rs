//! Profiling driver: repeatedly encodes and decodes the fixture with one
//! codec on one thread (`cargo run --release --example prof_codec -- bdr128 [encode|decode|both] [iters]`).

use kvpack::cache::DType;
use kvpack::compress::{CompressOptions, compress};
use kvpack::decode::{Archive, Selection};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let name = args.get(1).map(String::as_str).unwrap_or("bdr128");
    let what = args.get(2).map(String::as_str).unwrap_or("both");
    let iters: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(200);
    let bytes = std::fs::read("fixtures/gemma3-270m-gpl3-520.safetensors").unwrap();
    let cache = kvpack::io::safetensors::parse(&bytes, "fixture")
        .unwrap()
        .cache;
    let codec = kvpack::codec::parse(name).unwrap();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let (file, _) = compress(
        &cache,
        codec.as_ref(),
        &CompressOptions::default(),
        Vec::new(),
        &|_| {},
    )
    .unwrap();
    let t = std::time::Instant::now();
    pool.install(|| {
        for _ in 0..iters {
            if what != "decode" {
                compress(
                    &cache,
                    codec.as_ref(),
                    &CompressOptions::default(),
                    Vec::new(),
                    &|_| {},
                )
                .unwrap();
            }
            if what != "encode" {
                Archive::open(&file)
                    .unwrap()
                    .decode(&Selection::default(), Some(DType::Bf16), None)
                    .unwrap();
            }
        }
    });
    let s = t.elapsed().as_secs_f64() / iters as f64;
    eprintln!(
        "{name} {what}: {:.3} ms/iter, {:.2} GB/s",
        s * 1e3,
        cache.source_bytes() as f64 / s / 1e9
    );
}
