//! Writes `format/vectors/input-small.safetensors`, the deterministic
//! synthetic cache the golden vectors encode (run once; the file is
//! committed and never regenerated).

use half::bf16;
use kvpack::cache::{DType, Kind, KvCache, Tensor, TensorData, TensorInfo};

fn main() {
    // xorshift64* with a fixed seed; values ~ N(0,1) with outlier channels.
    let mut s: u64 = 0x9E3779B97F4A7C15;
    let mut next = || {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        (s.wrapping_mul(0x2545F4914F6CDD1D) >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut tensors = Vec::new();
    for (layer, tokens) in [(0u32, 37u32), (1, 21)] {
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
                heads: 2,
                tokens,
                head_dim: 64,
            };
            let n = info.elements() as usize;
            let vals = (0..n)
                .map(|i| {
                    let (u, v) = (next().max(1e-300), next());
                    let g = (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos();
                    let boost = if kind == Kind::Key && i % 64 == 5 {
                        12.0
                    } else {
                        1.0
                    };
                    bf16::from_f64(g * boost)
                })
                .collect();
            tensors.push(Tensor::new(info, TensorData::Bf16(vals)).unwrap());
        }
    }
    let mut cache = KvCache {
        tensors,
        ..Default::default()
    };
    cache
        .metadata
        .insert("kvpack.model".into(), "golden-synthetic".into());
    cache.token_ids = (0..37).map(|i| 1000 + i).collect();
    let mut f = std::fs::File::create("format/vectors/input-small.safetensors").unwrap();
    kvpack::io::safetensors::write(&cache, &mut f).unwrap();
}
