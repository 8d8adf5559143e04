//! Writes the deterministic synthetic caches the golden vectors encode
//! (format/vectors/). Each input is written once, committed, and never
//! regenerated: the tool skips inputs that already exist.
//!
//! * `input-small.safetensors` (format 1.0): 2 layers (37 and 21 tokens),
//!   K and V `[1, 2, tokens, 64]` bf16, values ~ N(0,1) with an outlier key
//!   channel.
//! * `input-fp8-e4m3.safetensors`, `input-fp8-e5m2.safetensors` (1.1): the
//!   same values stored as fp8 (E4M3FN / E5M2), each tensor with its own
//!   per-tensor scale `amax / max` in a `{name}_scale` tensor.
//! * `input-latent.safetensors` (1.1): an MLA latent cache with
//!   DeepSeek-V2-Lite's row width (kv_lora_rank 512 + qk_rope_head_dim 64 =
//!   576), 2 layers (37 and 21 tokens), `[1, 1, tokens, 576]` bf16.
//!
//! Run: `cargo run --release --example make_vector_input`.

use std::path::Path;

use half::bf16;
use kvpack::cache::{DType, Fp8Format, Kind, KvCache, Tensor, TensorData, TensorInfo};

const DIR: &str = "format/vectors";

/// xorshift64* with a fixed seed, as uniform f64 in [0, 1).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545F4914F6CDD1D) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller, one draw per pair).
    fn normal(&mut self) -> f64 {
        let (u, v) = (self.next().max(1e-300), self.next());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
}

fn small() -> KvCache {
    // xorshift64* with a fixed seed; values ~ N(0,1) with outlier channels.
    let mut rng = Rng(0x9E3779B97F4A7C15);
    let mut tensors = Vec::new();
    for (layer, tokens) in [(0u32, 37u32), (1, 21)] {
        for kind in [Kind::Key, Kind::Value] {
            let info = TensorInfo {
                name: format!("past_key_values.{layer}.{}", kind.name()),
                layer,
                kind,
                dtype: DType::Bf16,
                batch: 1,
                heads: 2,
                tokens,
                head_dim: 64,
            };
            let n = info.elements() as usize;
            let vals = (0..n)
                .map(|i| {
                    let boost = if kind == Kind::Key && i % 64 == 5 {
                        12.0
                    } else {
                        1.0
                    };
                    bf16::from_f64(rng.normal() * boost)
                })
                .collect();
            tensors.push(Tensor::new(info, TensorData::Bf16(vals)).unwrap());
        }
    }
    cache(tensors, "golden-synthetic", 1000)
}

/// A cache of `tensors` for `model`, with 37 token ids from `first_id`.
fn cache(tensors: Vec<Tensor>, model: &str, first_id: u32) -> KvCache {
    let mut cache = KvCache {
        tensors,
        ..Default::default()
    };
    cache.metadata.insert("kvpack.model".into(), model.into());
    cache.token_ids = (0..37).map(|i| first_id + i).collect();
    cache
}

fn fp8(format: Fp8Format) -> KvCache {
    let mut c = small();
    for t in &mut c.tensors {
        *t = t.to_fp8(format);
    }
    c
}

fn latent() -> KvCache {
    // The compressed KV part ~ N(0,1) with a few wide channels; the RoPE
    // part (last 64) ~ N(0, 3^2).
    let mut rng = Rng(0xD1B54A32D192ED03);
    let mut tensors = Vec::new();
    for (layer, tokens) in [(0u32, 37u32), (1, 21)] {
        let info = TensorInfo {
            name: format!("past_key_values.{layer}.latent"),
            layer,
            kind: Kind::Latent,
            dtype: DType::Bf16,
            batch: 1,
            heads: 1,
            tokens,
            head_dim: 576,
        };
        let vals = (0..info.elements() as usize)
            .map(|i| {
                let ch = i % 576;
                let s = if ch >= 512 {
                    3.0
                } else if ch % 97 == 11 {
                    6.0
                } else {
                    1.0
                };
                bf16::from_f64(rng.normal() * s)
            })
            .collect();
        tensors.push(Tensor::new(info, TensorData::Bf16(vals)).unwrap());
    }
    cache(tensors, "golden-synthetic-mla-576", 2000)
}

/// A named input and the function that builds it.
type Input = (&'static str, fn() -> KvCache);

fn main() {
    let inputs: [Input; 4] = [
        ("input-small.safetensors", small),
        ("input-fp8-e4m3.safetensors", || fp8(Fp8Format::E4M3Fn)),
        ("input-fp8-e5m2.safetensors", || fp8(Fp8Format::E5M2)),
        ("input-latent.safetensors", latent),
    ];
    for (name, make) in inputs {
        let path = Path::new(DIR).join(name);
        if path.exists() {
            eprintln!("{}: exists, kept", path.display());
            continue;
        }
        let mut f = std::fs::File::create(&path).unwrap();
        kvpack::io::safetensors::write(&make(), &mut f).unwrap();
        eprintln!("{}: written", path.display());
    }
}
