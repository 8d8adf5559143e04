//! Prefill-to-decode handoff benchmark over loopback TCP.
//!
//! A synthetic cache shaped like Llama-3-8B (32 layers, 8 KV heads,
//! head_dim 128, 32k tokens by default: 4 GiB in bf16; generated at run
//! time) is sent with `kvpack::transport::send` through an emulated link of
//! 10, 25, 100 Gbit/s and unlimited, and received with
//! `kvpack::stream_decode::decode_stream`, which decodes while receiving.
//! For each codec and rate it prints the time until the first and the last
//! layer is decoded at the receiver, and, measured in the same run, each
//! stage alone: encode (all sender threads), decode (all receiver threads),
//! and the wire (compressed bytes / link rate).
//!
//! ```text
//! cargo bench --bench handoff -- [--tokens 32768] [--layers 32] [--heads 8]
//!     [--head-dim 128] [--codecs raw,bdr128,hqmq:s96r4] [--rates 10,25,100,0]
//!     [--send-threads N] [--recv-threads N] [--json FILE]
//! ```

use std::net::TcpListener;
use std::time::{Duration, Instant};

use half::bf16;
use kvpack::cache::{DType, Kind, KvCache, Tensor, TensorData, TensorInfo};
use kvpack::compress::{CompressOptions, compress};
use kvpack::decode::{Archive, Selection};
use rayon::prelude::*;

struct Opts {
    tokens: u32,
    layers: u32,
    heads: u32,
    head_dim: u32,
    codecs: Vec<String>,
    rates: Vec<f64>,
    send_threads: usize,
    recv_threads: usize,
    json: Option<String>,
}

fn parse_opts() -> Opts {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2);
    let mut o = Opts {
        tokens: 32768,
        layers: 32,
        heads: 8,
        head_dim: 128,
        codecs: vec!["raw".into(), "bdr128".into()],
        rates: vec![10.0, 25.0, 100.0, 0.0],
        send_threads: cores.div_ceil(2),
        recv_threads: cores.div_ceil(2),
        json: None,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let v = args.get(i + 1).cloned().unwrap_or_default();
        match args[i].as_str() {
            "--tokens" => o.tokens = v.parse().expect("--tokens N"),
            "--layers" => o.layers = v.parse().expect("--layers N"),
            "--heads" => o.heads = v.parse().expect("--heads N"),
            "--head-dim" => o.head_dim = v.parse().expect("--head-dim N"),
            "--codecs" => o.codecs = v.split(',').map(str::to_string).collect(),
            "--rates" => {
                o.rates = v
                    .split(',')
                    .map(|r| r.parse().expect("--rates GBIT,..."))
                    .collect()
            }
            "--send-threads" => o.send_threads = v.parse().expect("N"),
            "--recv-threads" => o.recv_threads = v.parse().expect("N"),
            "--json" => o.json = Some(v),
            "--bench" => {
                i += 1;
                continue;
            }
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    o
}

/// Gaussian-like bf16 values (sum of 4 uniforms) with a few large outlier
/// channels in K, generated in parallel with a per-chunk xorshift.
fn synthetic(o: &Opts) -> KvCache {
    let mut tensors = Vec::new();
    for layer in 0..o.layers {
        for kind in [Kind::Key, Kind::Value] {
            let info = TensorInfo {
                name: format!(
                    "past_key_values.{layer}.{}",
                    if kind == Kind::Key { "key" } else { "value" }
                ),
                layer,
                kind,
                dtype: DType::Bf16,
                batch: 1,
                heads: o.heads,
                tokens: o.tokens,
                head_dim: o.head_dim,
            };
            let n = info.elements() as usize;
            let d = o.head_dim as usize;
            let mut v = vec![bf16::ZERO; n];
            v.par_chunks_mut(1 << 16)
                .enumerate()
                .for_each(|(c, chunk)| {
                    let mut s = ((layer as u64 * 2 + kind.code() as u64) << 40)
                        ^ ((c as u64 + 1) * 0x9E37_79B9_7F4A_7C15);
                    for (i, x) in chunk.iter_mut().enumerate() {
                        let mut g = 0.0f32;
                        for _ in 0..4 {
                            s ^= s << 13;
                            s ^= s >> 7;
                            s ^= s << 17;
                            g += (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                        }
                        let ch = (c * (1 << 16) + i) % d;
                        let boost = if kind == Kind::Key && ch % 31 == 7 {
                            10.0
                        } else {
                            1.0
                        };
                        *x = bf16::from_f32(g * 1.7 * boost);
                    }
                });
            tensors.push(Tensor::new(info, TensorData::Bf16(v)).unwrap());
        }
    }
    KvCache {
        tensors,
        ..Default::default()
    }
}

struct Row {
    codec: String,
    wire_bytes: u64,
    first_layer: Duration,
    last_layer: Duration,
    sent: Duration,
}

fn handoff(
    cache: &KvCache,
    codec: &dyn kvpack::codec::Codec,
    rate: f64,
    send_pool: &rayon::ThreadPool,
    recv_pool: &rayon::ThreadPool,
) -> Row {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let start = Instant::now();
    let ((t0, recv), (report, sent)) = std::thread::scope(|s| {
        let rx = s.spawn(move || {
            let (_, sock, _) =
                kvpack::net::receive(&l, &Default::default(), &Default::default()).unwrap();
            let reader = std::io::BufReader::with_capacity(1 << 20, sock);
            // decode_stream times layers from its own start; t0 maps them
            // onto the sender's clock.
            let t0 = start.elapsed();
            (
                t0,
                recv_pool.install(|| {
                    kvpack::stream_decode::decode_stream(reader, None, &|_, _| {}).unwrap()
                }),
            )
        });
        let r = send_pool.install(|| {
            kvpack::transport::send(
                cache,
                codec,
                &CompressOptions::default(),
                addr,
                (rate > 0.0).then_some(rate),
                &|_| {},
            )
            .unwrap()
        });
        let sent = start.elapsed();
        (rx.join().unwrap(), (r, sent))
    });
    Row {
        codec: codec.name(),
        wire_bytes: report.compress.output_bytes,
        first_layer: t0 + recv.layer_done.first().map(|x| x.1).unwrap_or_default(),
        last_layer: t0 + recv.layer_done.last().map(|x| x.1).unwrap_or_default(),
        sent,
    }
}

fn main() {
    let o = parse_opts();
    let send_pool = rayon::ThreadPoolBuilder::new()
        .num_threads(o.send_threads)
        .build()
        .unwrap();
    // One receiver worker reads the socket; the rest decode.
    let recv_pool = rayon::ThreadPoolBuilder::new()
        .num_threads(o.recv_threads + 1)
        .build()
        .unwrap();
    let t = Instant::now();
    let cache = synthetic(&o);
    let src = cache.source_bytes();
    eprintln!(
        "cache: {} layers x K/V x [1, {}, {}, {}] bf16 = {:.2} GiB, generated in {:.1} s; {} send threads, {} decode threads, {} cores",
        o.layers,
        o.heads,
        o.tokens,
        o.head_dim,
        src as f64 / (1u64 << 30) as f64,
        t.elapsed().as_secs_f64(),
        o.send_threads,
        o.recv_threads,
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0)
    );
    let mut json = Vec::new();
    println!(
        "| codec | bits/elem | link Gbit/s | wire GB | first layer ms | last layer ms | vs raw | encode GB/s | wire-only ms | decode GB/s | bound by |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let mut raw_last = std::collections::HashMap::new();
    for name in &o.codecs {
        let codec = kvpack::codec::parse(name).unwrap();
        // Stage 1: encode alone (to a sink), all sender threads.
        let t = Instant::now();
        let (_, rep) = send_pool.install(|| {
            compress(
                &cache,
                codec.as_ref(),
                &CompressOptions::default(),
                std::io::sink(),
                &|_| {},
            )
            .unwrap()
        });
        let enc = t.elapsed().as_secs_f64();
        // Stage 3: decode alone, all receiver threads.
        let (bytes, _) = send_pool.install(|| {
            compress(
                &cache,
                codec.as_ref(),
                &CompressOptions::default(),
                Vec::with_capacity(rep.output_bytes as usize),
                &|_| {},
            )
            .unwrap()
        });
        let ar = Archive::open(&bytes).unwrap();
        let dec_pool = rayon::ThreadPoolBuilder::new()
            .num_threads(o.recv_threads)
            .build()
            .unwrap();
        let t = Instant::now();
        let out = dec_pool.install(|| {
            ar.decode(&Selection::default(), Some(DType::Bf16), None)
                .unwrap()
        });
        let dec = t.elapsed().as_secs_f64();
        drop(out);
        drop(ar);
        drop(bytes);
        let enc_gbs = src as f64 / enc / 1e9;
        let dec_gbs = src as f64 / dec / 1e9;
        for &rate in &o.rates {
            let r = handoff(&cache, codec.as_ref(), rate, &send_pool, &recv_pool);
            let wire_s = if rate > 0.0 {
                r.wire_bytes as f64 * 8.0 / (rate * 1e9)
            } else {
                0.0
            };
            let stages = [("encode", enc), ("wire", wire_s), ("decode", dec)];
            let bound = stages.iter().max_by(|a, b| a.1.total_cmp(&b.1)).unwrap().0;
            if name == "raw" {
                raw_last.insert(rate.to_bits(), r.last_layer.as_secs_f64());
            }
            let vs_raw = raw_last
                .get(&rate.to_bits())
                .map(|raw| r.last_layer.as_secs_f64() / raw);
            println!(
                "| {} | {:.3} | {} | {:.3} | {:.1} | {:.1} | {} | {:.2} | {:.1} | {:.2} | {} |",
                r.codec,
                8.0 * r.wire_bytes as f64 / cache.elements() as f64,
                if rate > 0.0 {
                    format!("{rate}")
                } else {
                    "unlimited".into()
                },
                r.wire_bytes as f64 / 1e9,
                r.first_layer.as_secs_f64() * 1e3,
                r.last_layer.as_secs_f64() * 1e3,
                vs_raw
                    .map(|v| format!("{v:.3}x"))
                    .unwrap_or_else(|| "-".into()),
                enc_gbs,
                wire_s * 1e3,
                dec_gbs,
                bound
            );
            json.push(serde_json::json!({
                "codec": r.codec, "rate_gbit": rate, "wire_bytes": r.wire_bytes, "first_layer_s": r.first_layer.as_secs_f64(),
                "last_layer_s": r.last_layer.as_secs_f64(), "sender_done_s": r.sent.as_secs_f64(), "vs_raw": vs_raw,
                "encode_gb_s": enc_gbs, "decode_gb_s": dec_gbs, "wire_only_s": wire_s, "bound_by": bound,
            }));
        }
    }
    if let Some(p) = o.json {
        std::fs::write(p, serde_json::to_string_pretty(&json).unwrap()).unwrap();
    }
}
