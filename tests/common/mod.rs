//! Shared helpers for integration tests: deterministic synthetic caches
//! (for edge cases and oracles; real-data tests use the committed fixture).
#![allow(dead_code)]

use std::path::PathBuf;

use kvpack::cache::{DType, Kind, KvCache, Tensor, TensorData, TensorInfo};
use kvpack::compress::{CompressOptions, compress};
use kvpack::plan::Layout;

/// xorshift64* PRNG: fixed, platform-independent.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545F4914F6CDD1D)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u = self.uniform().max(1e-300);
        let v = self.uniform();
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
}

/// Shape of one synthetic layer.
#[derive(Clone, Copy)]
pub struct LayerSpec {
    pub batch: u32,
    pub heads: u32,
    pub tokens: u32,
    pub head_dim: u32,
}

/// A synthetic cache: Gaussian values with a few large outlier channels in
/// K (like real keys), `dtype` storage.
pub fn synthetic(layers: &[LayerSpec], dtype: DType, seed: u64) -> KvCache {
    let mut rng = Rng(seed.max(1));
    let mut tensors = Vec::new();
    for (l, s) in layers.iter().enumerate() {
        for kind in [Kind::Key, Kind::Value] {
            let info = TensorInfo {
                name: format!(
                    "past_key_values.{l}.{}",
                    if kind == Kind::Key { "key" } else { "value" }
                ),
                layer: l as u32,
                kind,
                dtype,
                batch: s.batch,
                heads: s.heads,
                tokens: s.tokens,
                head_dim: s.head_dim,
            };
            let n = info.elements() as usize;
            let d = s.head_dim as usize;
            let vals: Vec<f32> = (0..n)
                .map(|i| {
                    let ch = i % d;
                    let boost = if kind == Kind::Key && ch % 17 == 3 {
                        8.0
                    } else {
                        1.0
                    };
                    (rng.normal() * boost) as f32
                })
                .collect();
            let mut data = TensorData::zeros(dtype, n);
            data.as_elems_mut().store(0, &vals);
            tensors.push(Tensor::new(info, data).unwrap());
        }
    }
    let mut c = KvCache {
        tensors,
        ..Default::default()
    };
    c.metadata.insert("kvpack.model".into(), "synthetic".into());
    c.token_ids = (0..layers.iter().map(|l| l.tokens).max().unwrap_or(0))
        .map(|i| i * 7 + 1)
        .collect();
    c
}

/// `cache` with every tensor stored as fp8 of `format`, each with its own
/// per-tensor scale calibrated on its largest magnitude.
pub fn to_fp8(cache: &KvCache, format: kvpack::Fp8Format) -> KvCache {
    let tensors = cache.tensors.iter().map(|t| t.to_fp8(format)).collect();
    KvCache {
        tensors,
        ..cache.clone()
    }
}

/// An MLA latent cache shaped like DeepSeek-V2-Lite's (kv_lora_rank 512 +
/// qk_rope_head_dim 64 = 576 per token, one latent per layer), Gaussian
/// values with the RoPE part 4x larger, `dtype` storage.
pub fn latent(layers: u32, tokens: u32, dtype: DType, seed: u64) -> KvCache {
    let mut rng = Rng(seed.max(1));
    let tensors = (0..layers)
        .map(|l| {
            let info = TensorInfo {
                name: format!("past_key_values.{l}.latent"),
                layer: l,
                kind: Kind::Latent,
                dtype,
                batch: 1,
                heads: 1,
                tokens,
                head_dim: 576,
            };
            let vals: Vec<f32> = (0..info.elements() as usize)
                .map(|i| (rng.normal() * if i % 576 >= 512 { 4.0 } else { 1.0 }) as f32)
                .collect();
            let mut data = TensorData::zeros(dtype, vals.len());
            data.as_elems_mut().store(0, &vals);
            Tensor::new(info, data).unwrap()
        })
        .collect();
    KvCache {
        tensors,
        ..Default::default()
    }
}

/// Compresses into memory.
pub fn compress_bytes(cache: &KvCache, codec: &str, layout: Layout, zstd: Option<i32>) -> Vec<u8> {
    let codec = kvpack::codec::parse(codec).unwrap();
    let opts = CompressOptions {
        layout,
        zstd_level: zstd,
        ..Default::default()
    };
    compress(cache, codec.as_ref(), &opts, Vec::new(), &|_| {})
        .unwrap()
        .0
}

/// Path of a file under the repository root.
pub fn repo(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// The committed real fixture (Gemma-3-270M, bf16).
pub const FIXTURE: &str = "fixtures/gemma3-270m-gpl3-520.safetensors";

/// Loads the real fixture.
pub fn fixture() -> kvpack::io::safetensors::Loaded {
    let bytes = std::fs::read(repo(FIXTURE)).expect("fixture present (see tools/README.md)");
    kvpack::io::safetensors::parse(&bytes, FIXTURE).unwrap()
}

/// SHA-256 hex of `b`.
pub fn sha256(b: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

/// The golden-vector digest input: every tensor as little-endian f32.
pub fn decoded_f32_bytes(c: &KvCache) -> Vec<u8> {
    let mut out = Vec::new();
    for t in &c.tensors {
        for v in t.data.to_f32() {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    out
}

/// Runs `cmd` to completion; returns its exit code (128 + signal when
/// killed) and its peak resident memory in KiB (`wait4`). The child's peak
/// starts at this process's own before `exec`: compare with
/// [`own_peak_kib`].
#[cfg(unix)]
pub fn run_peak_rss(cmd: &mut std::process::Command) -> (i32, i64) {
    // Reaped below with wait4, which also returns the child's peak RSS.
    #[allow(clippy::zombie_processes)]
    let child = cmd.spawn().expect("spawn");
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: plain wait4 on our own child; rusage is a C struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
    assert_eq!(r, pid);
    let code = if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        128 + libc::WTERMSIG(status)
    };
    (code, ru.ru_maxrss)
}

/// This process's peak resident memory so far, KiB.
#[cfg(unix)]
pub fn own_peak_kib() -> i64 {
    // SAFETY: getrusage fills a plain C struct.
    let mut me: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut me) };
    me.ru_maxrss
}

/// A paged cache image (K then V for HND) of random bf16/fp16 values.
pub fn random_image(
    rng: &mut Rng,
    shape: &kvpack::gpu::paged::PagedShape,
    dtype: DType,
) -> Vec<u16> {
    (0..2 * shape.kv_elements())
        .map(|_| {
            let x = (rng.normal() * 0.7) as f32;
            match dtype {
                DType::Bf16 => half::bf16::from_f32(x).to_bits(),
                _ => half::f16::from_f32(x).to_bits(),
            }
        })
        .collect()
}

/// A shuffled block table of `n` distinct ids below `num_blocks`.
pub fn block_table(rng: &mut Rng, n: usize, num_blocks: u32) -> Vec<i64> {
    let mut ids: Vec<i64> = (0..i64::from(num_blocks)).collect();
    for i in (1..ids.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        ids.swap(i, j);
    }
    ids.truncate(n);
    ids
}
