//! Writes a large synthetic KV cache in the HF safetensors layout, one
//! tensor in memory at a time, for memory and speed measurements of the CLI
//! on caches larger than the committed fixture.
//!
//! Shape: Llama-3-8B's cache geometry by default (32 layers, K and V
//! `[1, 8, TOKENS, 128]` bf16, so 131,072 bytes per token). Values: N(0, 1)
//! per element with a few outlier key channels (x 8), from a fixed-seed
//! xorshift64* generator, so the output is the same on every run.
//!
//! Run: `cargo run --release --example make_synthetic_cache -- OUT.safetensors [TOKENS] [LAYERS]`
//! (TOKENS defaults to 8192, about 1.07 GB; LAYERS to 32).

use std::collections::BTreeMap;
use std::io::{BufWriter, Write};

use half::bf16;
use kvpack::cache::{DType, Kind, Tensor, TensorData, TensorInfo};
use kvpack::io::safetensors;

/// xorshift64* with a fixed seed, as uniform f64 in (0, 1).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// A standard normal sample (Box-Muller).
    fn normal(&mut self) -> f64 {
        let (u, v) = (self.next(), self.next());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

fn main() -> kvpack::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let Some(out) = args.get(1) else {
        eprintln!("usage: make_synthetic_cache OUT.safetensors [TOKENS] [LAYERS]");
        std::process::exit(2);
    };
    let num = |i: usize, d: u32| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (tokens, layers) = (num(2, 8192), num(3, 32));
    let (heads, head_dim) = (8u32, 128u32);
    let infos: Vec<TensorInfo> = (0..layers)
        .flat_map(|l| {
            [Kind::Key, Kind::Value].map(|kind| TensorInfo {
                name: format!(
                    "past_key_values.{l}.{}",
                    if kind == Kind::Key { "key" } else { "value" }
                ),
                layer: l,
                kind,
                dtype: DType::Bf16,
                batch: 1,
                heads,
                tokens,
                head_dim,
            })
        })
        .collect();
    let f =
        std::fs::File::create(out).map_err(|e| kvpack::Error::io(format!("creating {out}"), e))?;
    let mut w = BufWriter::with_capacity(1 << 20, f);
    safetensors::write_header(&infos, &BTreeMap::new(), &[], &mut w)?;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for info in &infos {
        let d = head_dim as usize;
        let v: Vec<bf16> = (0..info.elements() as usize)
            .map(|i| {
                let outlier = info.kind == Kind::Key && (i % d) % 37 == 5;
                bf16::from_f64(rng.normal() * if outlier { 8.0 } else { 1.0 })
            })
            .collect();
        let t = Tensor::new(info.clone(), TensorData::Bf16(v))?;
        safetensors::write_tensor(&t, &mut w)?;
    }
    w.flush()
        .map_err(|e| kvpack::Error::io(format!("writing {out}"), e))?;
    eprintln!("{out}: {layers} layers x K,V [1, {heads}, {tokens}, {head_dim}] bf16");
    Ok(())
}
