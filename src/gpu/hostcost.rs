//! Host-side cost of a paged encode (`Gpu::encode_paged`) and decode
//! (`Gpu::decode_paged`) without a GPU: the device-independent steps of
//! one Llama-3-8B layer (K and V, 8 kv heads, 32768 tokens, head_dim 128,
//! bf16, 256-token pages) timed on a backend that only keeps what it is
//! given in host memory. Run with `cargo test --release --lib
//! gpu::hostcost -- --ignored --nocapture --test-threads 1`
//! (`KVPACK_HOSTCOST_CODECS=int4,bdr128` picks the encode codecs,
//! `KVPACK_HOSTCOST_RUNS=3` repeats each, `KVPACK_HOSTCOST_DECODE` the
//! decode codecs). Prints wall and process CPU milliseconds (all threads)
//! per step. Encode: the codec's preparation, planning and placing (what
//! the CUDA backend uploads or clears), the bodies once downloaded into
//! reused staging (section tables written, or the cut) and the file
//! (frames, CRCs, writing into a buffer already in memory; into a new
//! `Vec` apart). Decode: staging (CRC and page checks), the descriptor
//! tables and the fill of the staging image.

use std::time::Instant;

use super::backend::{Backend, Launch, place_encode};
use super::encplan::{EncodedBodies, Place};
use super::paged::{self, PagedShape};
use super::spec::KernelOptions;
use crate::cache::DType;
use crate::compress::CompressOptions;
use crate::error::Result;

/// Device memory as host vectors; counts what a CUDA backend would do.
#[derive(Default)]
struct Fake {
    bufs: Vec<Vec<u8>>,
    placed: usize,
    bytes: usize,
}

impl Fake {
    fn push(&mut self, b: Vec<u8>) -> u64 {
        self.bufs.push(b);
        ((self.bufs.len() as u64) << 40) | 0x100
    }
}

impl Place for Fake {
    fn place(&mut self, bytes: &[u8]) -> Result<u64> {
        self.placed += 1;
        self.bytes += bytes.len();
        Ok(self.push(bytes.to_vec()))
    }

    fn zeroed(&mut self, len: usize) -> Result<u64> {
        self.placed += 1;
        Ok(self.push(vec![0; len]))
    }

    fn place_padded(&mut self, bytes: &[u8], len: usize) -> Result<u64> {
        // As the CUDA backend: a clear on the device, `bytes` copied.
        self.placed += 1;
        self.bytes += bytes.len();
        let mut b = bytes.to_vec();
        b.resize(len.max(bytes.len()), 0);
        Ok(self.push(b))
    }

    fn zeroed_with(&mut self, len: usize, value: u32, at: &[usize]) -> Result<u64> {
        // As the CUDA backend: a clear and memsets on the device.
        let a = self.zeroed(len)?;
        let b = self.bufs.last_mut().expect("just placed");
        for &o in at {
            b[o..o + 4].copy_from_slice(&value.to_le_bytes());
        }
        Ok(a)
    }
}

impl Backend for Fake {
    fn launch(&mut self, _launches: &[Launch]) -> Result<()> {
        Ok(())
    }

    fn read(&mut self, addr: u64, len: usize) -> Result<Vec<u8>> {
        let (i, o) = (
            (addr >> 40) as usize - 1,
            (addr & 0xff_ffff_ffff) as usize - 0x100,
        );
        Ok(self.bufs[i][o..o + len].to_vec())
    }
}

/// Staging buffers reused across calls, as the CUDA backend's pinned
/// pool: a download writes into memory already mapped.
type Pool = std::sync::Arc<std::sync::Mutex<Vec<Vec<u8>>>>;

/// A buffer of the pool, returned to it when dropped.
struct Staged {
    pool: Pool,
    buf: Vec<u8>,
    len: usize,
}

impl Staged {
    /// A buffer of at least `len` bytes (the one copy a download makes
    /// into it is not timed: the device writes it).
    fn take(pool: &Pool, len: usize) -> Staged {
        let mut p = pool.lock().unwrap();
        let buf = match p.iter().position(|b| b.len() >= len) {
            Some(i) => p.swap_remove(i),
            None => vec![0; len],
        };
        Staged {
            pool: pool.clone(),
            buf,
            len,
        }
    }
}

impl super::encplan::HostBytes for Staged {
    fn bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf[..self.len]
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        let b = std::mem::take(&mut self.buf);
        self.pool.lock().unwrap().push(b);
    }
}

/// Wall and process CPU time since its start, milliseconds.
struct Clock(Instant, f64);

fn cpu_ms() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid clock id and a valid out pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 * 1e3 + t.tv_nsec as f64 / 1e6
}

impl Clock {
    fn start() -> Clock {
        Clock(Instant::now(), cpu_ms())
    }

    /// `[wall, cpu]` ms.
    fn ms(&self) -> [f64; 2] {
        [self.0.elapsed().as_secs_f64() * 1e3, cpu_ms() - self.1]
    }
}

fn add(a: &mut [f64; 2], b: [f64; 2]) {
    a[0] += b[0];
    a[1] += b[1];
}

/// A Llama-3-8B layer's paged cache: 2048 blocks of 16 tokens, 8 kv heads,
/// head_dim 128.
const LLAMA: PagedShape = PagedShape {
    num_blocks: 2048,
    block_size: 16,
    kv_heads: 8,
    head_dim: 128,
};
/// Tokens of the Llama layer (every block full).
const LLAMA_TOKENS: u32 = 32768;

#[test]
#[ignore = "timing harness: run with --ignored --nocapture"]
fn paged_encode_host_cost() {
    let (shape, tokens) = (LLAMA, LLAMA_TOKENS);
    let opts = CompressOptions::default();
    let list = std::env::var("KVPACK_HOSTCOST_CODECS").unwrap_or_else(|_| {
        "int4,bdr128,hqmq:s96r4,hqmq:s96r4+med3,kivi:2,innerq:k2v2,polar:m4n4,turbo:b3,octopus:b3"
            .into()
    });
    let runs: usize = std::env::var("KVPACK_HOSTCOST_RUNS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(3);
    println!(
        "wall / CPU ms (all threads) | codec | plan+place | uploads | uploaded MB | bodies | file | total (with prepare) | file into a new Vec | file MB |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let pool = Pool::default();
    let mut sink = vec![1u8; 200 << 20];
    sink.clear();
    for name in list.split(',').flat_map(|n| std::iter::repeat_n(n, runs)) {
        let codec = crate::codec::parse(name).unwrap();
        let all = Clock::start();
        let infos = paged::layer_infos(&shape, DType::Bf16, 0, tokens);
        let pages = crate::plan::plan(&infos, &[0, 0], opts.layout).unwrap();
        let prepared = match super::family::sphere::prepare_shapes(codec.as_ref(), &infos).unwrap()
        {
            Some(c) => Some(c),
            None => paged::prepare_on_gpu(codec.as_ref(), &infos, &pages, &opts, |body| {
                super::backend::key_amax(&mut Fake::default(), 0x1000, &infos[0], body).map(Some)
            })
            .unwrap(),
        };
        let codec = prepared.as_deref().unwrap_or(codec.as_ref());
        assert!(
            paged::encodes_on_gpu(&infos, &pages, codec, &opts),
            "{name}"
        );
        let prep = all.ms();
        let (mut plan, mut cut) = ([0.0; 2], [0.0; 2]);
        let mut fake = Fake::default();
        let bodies = paged::bodies_by_tensor(&pages, 2, codec, |t, mine, c| {
            let t0 = Clock::start();
            let placed = place_encode(
                &mut fake,
                0x1000,
                &infos[t],
                c,
                mine,
                KernelOptions::default(),
            )?;
            add(&mut plan, t0.ms());
            // The bodies downloaded into a staging buffer (untimed: the
            // device's copy), then their tables written (or the cut).
            let mut bodies = Staged::take(&pool, placed.bodies_len);
            let device = fake.read(placed.bodies, placed.bodies_len)?;
            bodies.buf[..placed.bodies_len].copy_from_slice(&device);
            drop(device);
            let t0 = Clock::start();
            let s = EncodedBodies::new(placed.layouts, placed.cut, Box::new(bodies));
            add(&mut cut, t0.ms());
            s
        })
        .unwrap();
        // Into a buffer of the right size already in memory (as `out=` of
        // the Python call), then into a new `Vec` (the `bytes` it returns).
        let t0 = Clock::start();
        let (mut file, _) =
            paged::file_from_bodies(infos.clone(), codec, &opts, &pages, &bodies, sink).unwrap();
        let file_ms = t0.ms();
        let t0 = Clock::start();
        drop(paged::file_from_bodies(infos, codec, &opts, &pages, &bodies, Vec::new()).unwrap());
        let vec_ms = t0.ms();
        let len = file.len();
        file.clear();
        sink = file;
        let mut total = prep;
        for x in [plan, cut, file_ms] {
            add(&mut total, x);
        }
        let f = |x: [f64; 2]| format!("{:.1} / {:.1}", x[0], x[1]);
        println!(
            "| {name} | {} | {} | {:.1} | {} | {} | {} | {} | {:.1} |",
            f(plan),
            fake.placed,
            fake.bytes as f64 / 1e6,
            f(cut),
            f(file_ms),
            f(total),
            f(vec_ms),
            len as f64 / 1e6
        );
    }
}

#[test]
#[ignore = "timing harness: run with --ignored --nocapture"]
fn hqmq_tables_cost() {
    let infos = paged::layer_infos(&LLAMA, DType::Bf16, 0, LLAMA_TOKENS);
    let c = crate::codec::parse("hqmq:s96r4").unwrap();
    let t0 = Clock::start();
    let t = super::family::hqmq::encode_table(c.as_ref(), &infos[0], 96).unwrap();
    println!("encode_table {:?} {}", t0.ms(), t.len());
    let t0 = Clock::start();
    let g = super::hqmq_cells::grid(96).unwrap();
    let r = super::hqmq_cells::region(g, 8);
    println!("region {:?} {}", t0.ms(), r.len());
}

/// The host side of `Gpu::decode_paged` for one Llama-3-8B layer (as in
/// [`paged_encode_host_cost`]) compressed on the CPU: staging (CRC and
/// page checks), the descriptor tables (twice: sizing, then placed) and
/// the fill of the staging image. `KVPACK_HOSTCOST_DECODE=int4,kivi:2`
/// picks codecs.
#[test]
#[ignore = "timing harness: run with --ignored --nocapture"]
fn paged_decode_host_cost() {
    use crate::cache::Kind;
    use crate::gpu::decplan::PagedImage;
    use crate::gpu::spec::OutType;
    let (shape, tokens) = (LLAMA, LLAMA_TOKENS);
    let infos = paged::layer_infos(&shape, DType::Bf16, 0, tokens);
    let cache = uniform_cache(&infos);
    let ids: Vec<i64> = (0..i64::from(shape.num_blocks)).rev().collect();
    let list = std::env::var("KVPACK_HOSTCOST_DECODE")
        .unwrap_or_else(|_| "int4,bdr128,kivi:2,polar:m4n4,turbo:b3,hqmq:s96r4".into());
    println!("wall / CPU ms | codec | stage (CRC, checks) | tables x2 | fill | total | file MB |");
    println!("|---|---|---|---|---|---|---|");
    let mut image = vec![1u8; 200 << 20];
    for name in list.split(',') {
        let file = compressed(&cache, name);
        for _ in 0..2 {
            let archive = crate::decode::Archive::open(&file).unwrap();
            let all = Clock::start();
            let img = PagedImage::new(&archive, 0, &shape, &ids).unwrap();
            let stage = all.ms();
            let t0 = Clock::start();
            let target = |k: Kind| {
                let (off, len, addr) = shape.image_target(paged::PagedLayout::FlashAttn, k);
                (0x10_0000_0000 + 2 * off, len, addr)
            };
            let opts = KernelOptions::default();
            let tlen = img.tables(0, target, OutType::Bf16, opts).unwrap().0.len();
            let (tables, _, _) = img
                .tables(0x20_0000_0000, target, OutType::Bf16, opts)
                .unwrap();
            let tab = t0.ms();
            let t0 = Clock::start();
            img.fill(&mut image[..img.fixed]);
            image[img.fixed..img.fixed + tlen].copy_from_slice(&tables);
            let fill = t0.ms();
            let f = |x: [f64; 2]| format!("{:.1} / {:.1}", x[0], x[1]);
            println!(
                "| {name} | {} | {} | {} | {} | {:.1} |",
                f(stage),
                f(tab),
                f(fill),
                f(all.ms()),
                file.len() as f64 / 1e6
            );
        }
    }
}

/// The host side of `Gpu::decode_paged_device` for one Llama-3-8B layer
/// (as in [`paged_decode_host_cost`]) whose file is "on the device": the
/// host image holding only what is read back (head, tail, page headers and
/// section tables, the sections the codec checks), the archive opened on
/// it, the pages staged with `BodyCheck::Device`, the device checks and
/// the descriptor tables. `KVPACK_HOSTCOST_DECODE` picks codecs.
#[test]
#[ignore = "timing harness: run with --ignored --nocapture"]
fn paged_device_decode_host_cost() {
    use crate::cache::Kind;
    use crate::decode::Archive;
    use crate::gpu::decplan::{
        BodyCheck, PagedImage, any_host_checked, host_checked_spans, layer_pages,
    };
    use crate::gpu::spec::OutType;
    let (shape, tokens) = (LLAMA, LLAMA_TOKENS);
    let infos = paged::layer_infos(&shape, DType::Bf16, 0, tokens);
    let cache = uniform_cache(&infos);
    let ids: Vec<i64> = (0..i64::from(shape.num_blocks)).rev().collect();
    let list =
        std::env::var("KVPACK_HOSTCOST_DECODE").unwrap_or_else(|_| "int4,bdr128,kivi:2".into());
    println!(
        "| codec | shadow + open + heads | content spans | staged | checks | tables x2 | total (wall ms) |"
    );
    println!("|---|---|---|---|---|---|---|");
    for name in list.split(',') {
        let file = compressed(&cache, name);
        for _ in 0..3 {
            let all = Clock::start();
            let n = file.len();
            let w = n.min(1 << 16);
            let mut shadow = vec![0u8; n];
            shadow[..w].copy_from_slice(&file[..w]);
            shadow[n - w..].copy_from_slice(&file[n - w..]);
            let (heads, content) = {
                let a = Archive::open(&shadow).unwrap();
                let (_, _, pages) = layer_pages(&a, 0, &shape).unwrap();
                let r = a.reader();
                let e = &r.index().entries;
                let heads: Vec<(u64, u64)> = pages
                    .iter()
                    .map(|&p| (r.header_len() + e[p].offset, e[p].frame_len.min(384)))
                    .collect();
                (heads, any_host_checked(&a, &pages).unwrap())
            };
            for &(o, l) in &heads {
                let (o, l) = (o as usize, l as usize);
                shadow[o..o + l].copy_from_slice(&file[o..o + l]);
            }
            let t_heads = all.ms();
            let t0 = Clock::start();
            if content {
                let spans = {
                    let a = Archive::open(&shadow).unwrap();
                    let (_, _, pages) = layer_pages(&a, 0, &shape).unwrap();
                    host_checked_spans(&a, &pages).unwrap()
                };
                for &(o, l) in &spans {
                    let (o, l) = (o as usize, l as usize);
                    shadow[o..o + l].copy_from_slice(&file[o..o + l]);
                }
            }
            let t_content = t0.ms();
            let t0 = Clock::start();
            let archive = Archive::open(&shadow).unwrap();
            let img =
                PagedImage::resident(&archive, 0, &shape, &ids, Some(1 << 40), BodyCheck::Device)
                    .unwrap();
            let t_stage = t0.ms();
            let t0 = Clock::start();
            let checks = img.device_checks();
            assert_eq!(checks.crc.len(), img.bodies.len());
            let t_checks = t0.ms();
            let t0 = Clock::start();
            let target = |k: Kind| {
                let (off, len, addr) = shape.image_target(paged::PagedLayout::FlashAttn, k);
                (0x10_0000_0000 + 2 * off, len, addr)
            };
            let opts = KernelOptions::default();
            let _ = img.tables(0, target, OutType::Bf16, opts).unwrap();
            let _ = img
                .tables(0x20_0000_0000, target, OutType::Bf16, opts)
                .unwrap();
            let t_tab = t0.ms();
            println!(
                "| {name} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
                t_heads[0],
                t_content[0],
                t_stage[0],
                t_checks[0],
                t_tab[0],
                all.ms()[0]
            );
        }
    }
}

/// A cache of `infos` (bf16) filled with xorshift values uniform in
/// [-0.5, 0.5), a different stream per tensor.
fn uniform_cache(infos: &[crate::cache::TensorInfo]) -> crate::cache::KvCache {
    use crate::cache::{KvCache, Tensor, TensorData};
    let tensors = infos
        .iter()
        .enumerate()
        .map(|(k, i)| {
            let mut s = 0x9E37_79B9_7F4A_7C15u64 ^ k as u64;
            let v = (0..i.elements())
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    half::bf16::from_f32((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
                })
                .collect();
            Tensor::new(i.clone(), TensorData::Bf16(v)).unwrap()
        })
        .collect();
    KvCache {
        tensors,
        ..Default::default()
    }
}

/// `cache` compressed by codec `name` with the default options.
fn compressed(cache: &crate::cache::KvCache, name: &str) -> Vec<u8> {
    let codec = crate::codec::parse(name).unwrap();
    crate::compress::compress(
        cache,
        codec.as_ref(),
        &CompressOptions::default(),
        Vec::new(),
        &|_| {},
    )
    .unwrap()
    .0
}
