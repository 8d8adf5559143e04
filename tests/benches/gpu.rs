//! GPU decode/encode throughput against the device-to-device copy ceiling
//! measured in the same run, and file-on-disk to bf16-on-GPU throughput.
//!
//! `cargo bench --features cuda --bench gpu` (needs an NVIDIA GPU, the
//! driver and libnvrtc at run time). Environment:
//! * `KVPACK_BENCH_DIR`: where the 4 GiB cache files are written
//!   (default: the current directory); they are deleted afterwards.
//! * `KVPACK_BENCH_FILE=0`: skip the file-to-GPU part.
//! * `KVPACK_FIXTURE`: path of the Gemma fixture (default
//!   `fixtures/gemma3-270m-gpl3-520.safetensors`).
//! * `KVPACK_BENCH_NCU=1`: launch each Llama-layer kernel only twice and
//!   skip the rest, for profiling under `ncu`.
//! * `KVPACK_BENCH_BASE=0`: skip raw, int and bdr (phase 1's codecs).
//! * `KVPACK_BENCH_VQ`: the VQ / group codecs to run (comma-separated name
//!   prefixes, e.g. `hqmq,polar`; `0` for none; default all).
//! * `KVPACK_BENCH_PAGED`: `only` runs just the copy ceiling and the paged
//!   I/O part (vLLM layouts through a block table, kernels and whole calls
//!   on a caller's stream); `0` skips the paged part.
//!
//! Every kernel time is the median over 31 batches of 20 launches (after 3
//! warm-up batches), CUDA events around each batch, the 20 launches
//! rotating over 6 input/output sets so that no run finds its input in L2.
//! GB/s counts bytes read (page sections, or source elements for encode)
//! plus bytes written (output elements, or scales + zero points + codes).

use std::io::Write;
use std::time::Instant;

use half::bf16;
use kvpack::cache::{DType, Kind, KvCache, Tensor, TensorData, TensorInfo};
use kvpack::compress::{CompressOptions, compress};
use kvpack::decode::{Archive, Selection};
use kvpack::gpu::paged::{PagedCache, PagedLayout, PagedShape, slot_mapping};
use kvpack::gpu::{
    DecodePlan, Dst, EncodePlan, FileDecoder, Gpu, GpuBuffer, GpuPages, OutType, Target,
};
use kvpack::plan::{Layout, plan};
use rayon::prelude::*;

const SETS: usize = 6;
const BATCH: usize = 20;
const RUNS: usize = 31;

/// One table row.
struct Row {
    shape: String,
    codec: String,
    op: String,
    kernels: String,
    us: f64,
    read: u64,
    written: u64,
}

struct Bench {
    gpu: Gpu,
    rows: Vec<Row>,
    ceiling: f64,
}

fn gbs(bytes: u64, us: f64) -> f64 {
    bytes as f64 / us / 1e3
}

/// True under `KVPACK_BENCH_NCU=1` (profiling: one launch per timing).
fn ncu() -> bool {
    std::env::var("KVPACK_BENCH_NCU").is_ok_and(|v| v == "1")
}

impl Bench {
    /// Median microseconds per launch of `launch(set)`.
    fn time(&self, mut launch: impl FnMut(usize)) -> (f64, f64, f64) {
        if ncu() {
            let ms = self.gpu.time_ms(|| {
                launch(0);
                Ok(())
            });
            let us = ms.expect("timing") * 1e3;
            return (us, us, us);
        }
        let mut samples = Vec::new();
        let mut k = 0;
        for r in 0..RUNS + 3 {
            let ms = self
                .gpu
                .time_ms(|| {
                    for _ in 0..BATCH {
                        launch(k % SETS);
                        k += 1;
                    }
                    Ok(())
                })
                .expect("timing");
            if r >= 3 {
                samples.push(ms * 1e3 / BATCH as f64);
            }
        }
        samples.sort_by(|a, b| a.total_cmp(b));
        (
            samples[0],
            samples[samples.len() / 2],
            samples[samples.len() - 1],
        )
    }

    fn record(
        &mut self,
        shape: &str,
        codec: &str,
        op: &str,
        kernels: String,
        med: f64,
        rw: (u64, u64),
    ) {
        println!(
            "  {shape:<34} {codec:<8} {op:<24} {med:>9.2} us {:>8.1} GB/s {:>6.1}%  [{kernels}]",
            gbs(rw.0 + rw.1, med),
            100.0 * gbs(rw.0 + rw.1, med) / self.ceiling.max(1e-9)
        );
        self.rows.push(Row {
            shape: shape.into(),
            codec: codec.into(),
            op: op.into(),
            kernels,
            us: med,
            read: rw.0,
            written: rw.1,
        });
    }

    fn decode(&mut self, shape: &str, codec: &str, op: &str, plans: &[DecodePlan<'_>]) {
        plans[0].launch().unwrap();
        plans[0].finish().unwrap();
        let (lo, med, hi) = self.time(|s| plans[s % plans.len()].launch().unwrap());
        println!("    spread {lo:.2}..{hi:.2} us");
        for p in plans {
            p.finish().unwrap();
        }
        self.record(
            shape,
            codec,
            op,
            plans[0].kernels().join("+"),
            med,
            plans[0].bytes(),
        );
    }
}

/// Whether a VQ / group codec is benchmarked: all unless
/// `KVPACK_BENCH_VQ` lists codec name prefixes (comma-separated), or is `0`.
fn vq_selected(codec: &str) -> bool {
    if !codec.contains(':') {
        return base_selected();
    }
    match std::env::var("KVPACK_BENCH_VQ") {
        Err(_) => true,
        Ok(v) if v == "0" => false,
        Ok(v) => v.split(',').any(|p| !p.is_empty() && codec.starts_with(p)),
    }
}

/// Whether the phase-1 codecs (raw, int, bdr) are benchmarked: unless
/// `KVPACK_BENCH_BASE=0`.
fn base_selected() -> bool {
    std::env::var("KVPACK_BENCH_BASE").map_or(true, |v| v != "0")
}

/// A bf16 cache of `layers` layers `[1, heads, tokens, head_dim]`, filled
/// on all threads with roughly Gaussian values (K gets outlier channels).
fn cache(layers: u32, heads: u32, tokens: u32, head_dim: u32, seed: u64) -> KvCache {
    let mut tensors = Vec::new();
    for l in 0..layers {
        for kind in [Kind::Key, Kind::Value] {
            let info = TensorInfo {
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
            };
            let n = info.elements() as usize;
            let mut v = vec![bf16::ZERO; n];
            let d = head_dim as usize;
            v.par_chunks_mut(1 << 16).enumerate().for_each(|(ci, c)| {
                let mut s = (seed ^ (u64::from(l) << 40) ^ ((ci as u64) << 8) ^ kind.code() as u64)
                    .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                    | 1;
                for (i, x) in c.iter_mut().enumerate() {
                    let mut u = 0.0f32;
                    for _ in 0..3 {
                        s ^= s << 13;
                        s ^= s >> 7;
                        s ^= s << 17;
                        u += (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                    }
                    let ch = ((ci << 16) + i) % d;
                    let boost = if kind == Kind::Key && ch % 17 == 3 {
                        8.0
                    } else {
                        1.0
                    };
                    *x = bf16::from_f32(u * 2.0 * boost);
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

fn compress_mem(cache: &KvCache, codec: &str, page_tokens: u32) -> Vec<u8> {
    let c = kvpack::codec::parse(codec).unwrap();
    let opts = CompressOptions {
        layout: Layout {
            page_tokens,
            sink: 0,
            recent: 0,
        },
        ..Default::default()
    };
    compress(cache, c.as_ref(), &opts, Vec::new(), &|_| {})
        .unwrap()
        .0
}

/// Decode benchmarks of tensors `tensors` of `file`: contiguous (bf16 and
/// fp16) and paged (bf16, block size 16, shuffled blocks).
fn bench_decode(
    b: &mut Bench,
    file: &[u8],
    tensors: &[usize],
    shape: &str,
    codec: &str,
    paged: bool,
    f16: bool,
) {
    let archive = Archive::open(file).unwrap();
    let infos = archive.tensors();
    let pages: Vec<usize> = tensors
        .iter()
        .flat_map(|&t| archive.reader().pages_overlapping(t, 0, u32::MAX))
        .collect();
    let gp: Vec<GpuPages> = (0..SETS)
        .map(|_| GpuPages::upload(&b.gpu, &archive, &pages).unwrap())
        .collect();
    let outs: Vec<Vec<GpuBuffer<u16>>> = (0..SETS)
        .map(|_| {
            tensors
                .iter()
                .map(|&t| b.gpu.alloc::<u16>(infos[t].elements() as usize).unwrap())
                .collect()
        })
        .collect();
    let mut outs_list = vec![(OutType::Bf16, "decode contiguous bf16")];
    if f16 {
        outs_list.push((OutType::F16, "decode contiguous fp16"));
    }
    for (out, op) in outs_list {
        let plans: Vec<DecodePlan<'_>> = (0..SETS)
            .map(|s| {
                let targets: Vec<Target<'_>> = tensors
                    .iter()
                    .zip(&outs[s])
                    .map(|(&t, buf)| Target {
                        tensor: t as u32,
                        dst: Dst::Contiguous {
                            buf,
                            first_token: 0,
                            tokens: infos[t].tokens,
                        },
                    })
                    .collect();
                b.gpu.plan_decode(&gp[s], &targets, out).unwrap()
            })
            .collect();
        b.decode(shape, codec, op, &plans);
    }
    if !paged {
        return;
    }
    // vLLM paged layout, block size 16, blocks in shuffled order.
    let bs = 16u32;
    let mut slot_bufs = Vec::new();
    for &t in tensors {
        let n = infos[t].tokens;
        let blocks = n.div_ceil(bs);
        let mut order: Vec<u32> = (0..blocks).collect();
        let mut s = 0x2545F4914F6CDD1Du64 ^ t as u64;
        for i in (1..order.len()).rev() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            order.swap(i, (s % (i as u64 + 1)) as usize);
        }
        let slots: Vec<i64> = (0..n)
            .map(|tok| i64::from(order[(tok / bs) as usize] * bs + tok % bs))
            .collect();
        slot_bufs.push((b.gpu.upload(&slots).unwrap(), blocks * bs));
    }
    let caches: Vec<Vec<GpuBuffer<u16>>> = (0..SETS)
        .map(|_| {
            tensors
                .iter()
                .zip(&slot_bufs)
                .map(|(&t, (_, nslots))| {
                    let i = &infos[t];
                    b.gpu
                        .alloc::<u16>((*nslots * i.heads * i.head_dim) as usize)
                        .unwrap()
                })
                .collect()
        })
        .collect();
    let plans: Vec<DecodePlan<'_>> = (0..SETS)
        .map(|s| {
            let targets: Vec<Target<'_>> = tensors
                .iter()
                .zip(&caches[s])
                .zip(&slot_bufs)
                .map(|((&t, cache), (slots, _))| Target {
                    tensor: t as u32,
                    dst: Dst::Paged {
                        cache,
                        slots,
                        slot_stride: infos[t].tokens,
                    },
                })
                .collect();
            b.gpu.plan_decode(&gp[s], &targets, OutType::Bf16).unwrap()
        })
        .collect();
    b.decode(shape, codec, "decode paged bf16 (bs16)", &plans);
}

/// `codec` prepared for `cache` under the default layout (InnerQ's key
/// normalization factors), as the compressor prepares it.
fn prepared(codec: &str, cache: &KvCache) -> Box<dyn kvpack::codec::Codec> {
    let c = kvpack::codec::parse(codec).unwrap();
    match c.prepare(&cache.view(), &Layout::default()).unwrap() {
        Some(p) => p,
        None => c,
    }
}

/// Encode benchmark of tensors `tensors` of `cache` (all of them per timed
/// launch), checked once against the CPU encoder.
fn bench_encode(
    b: &mut Bench,
    cache: &KvCache,
    tensors: &[usize],
    shape: &str,
    codec: &str,
    label: &str,
) {
    let c = prepared(codec, cache);
    let mut srcs: Vec<Vec<GpuBuffer<u16>>> = (0..SETS).map(|_| Vec::new()).collect();
    let mut pages = Vec::new();
    for &t in tensors {
        let tensor = &cache.tensors[t];
        let TensorData::Bf16(v) = &tensor.data else {
            panic!("bf16 cache expected")
        };
        pages.push(plan(std::slice::from_ref(&tensor.info), &[0], Layout::default()).unwrap());
        for s in &mut srcs {
            s.push(b.gpu.upload::<u16>(bytemuck::cast_slice(v)).unwrap());
        }
    }
    let plans: Vec<Vec<EncodePlan<'_>>> = srcs
        .iter()
        .map(|set| {
            tensors
                .iter()
                .zip(set)
                .zip(&pages)
                .map(|((&t, src), p)| {
                    b.gpu
                        .plan_encode(src, &cache.tensors[t].info, c.as_ref(), p)
                        .unwrap()
                })
                .collect()
        })
        .collect();
    for (i, &t) in tensors.iter().enumerate() {
        let p = &plans[0][i];
        p.launch().unwrap();
        p.finish().unwrap();
        let want =
            kvpack::gpu::host::encode_tensor(&cache.tensors[t], c.as_ref(), &pages[i]).unwrap();
        if p.sections().unwrap() != want {
            println!("  WARNING: {codec} GPU encode differs from the CPU encoder");
        }
    }
    let (lo, med, hi) = b.time(|s| {
        for p in &plans[s % plans.len()] {
            p.launch().unwrap();
        }
    });
    println!("    spread {lo:.2}..{hi:.2} us");
    let mut rw = (0, 0);
    for p in &plans[0] {
        p.finish().unwrap();
        rw.0 += p.bytes().0;
        rw.1 += p.bytes().1;
    }
    let kernel = plans[0][0].kernel().to_string();
    b.record(shape, label, "encode", kernel, med, rw);
}

/// Median wall-clock microseconds of `runs` calls of `f` (after one
/// warm-up call).
fn wall_us(runs: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut v: Vec<f64> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// `n` distinct block ids out of `num_blocks`, shuffled.
fn shuffled_ids(n: u32, num_blocks: u32, seed: u64) -> Vec<i64> {
    let mut ids: Vec<i64> = (0..i64::from(num_blocks)).collect();
    let mut s = seed | 1;
    for i in (1..ids.len()).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ids.swap(i, (s % (i as u64 + 1)) as usize);
    }
    ids.truncate(n as usize);
    ids
}

/// A device cache of `layout` (K then V for HND) and its description.
fn paged_cache(b: &Bench, layout: PagedLayout, shape: &PagedShape) -> (GpuBuffer<u16>, PagedCache) {
    let buf = b
        .gpu
        .alloc::<u16>(2 * shape.kv_elements() as usize)
        .unwrap();
    let at = buf.device_ptr();
    let v = (!layout.joint()).then_some(at + 2 * shape.kv_elements());
    // SAFETY: `buf` is a live allocation of both tensors, dropped after
    // every use of the description (the bench synchronizes before).
    let c =
        unsafe { PagedCache::from_raw(layout, DType::Bf16, &shape.dims(layout), at, v).unwrap() };
    (buf, c)
}

/// Paged I/O of one Llama-3-8B layer (8 KV heads, head_dim 128, 32768
/// tokens) in vLLM's layouts, block size 16, shuffled block ids:
/// * kernels: decode into each layout (FlashAttention, FlashInfer, HND),
///   and for encode the gather out of the FlashAttention layout plus the
///   encode kernels, timed as the other rows (GB/s, % of copy);
/// * whole calls, what the Python `kvpack.cuda` functions run:
///   `Archive::open` + `Gpu::decode_paged` + `PagedJob::wait` (CPU staging,
///   one upload, kernels, on a stream given by raw handle), and
///   `Gpu::encode_paged` to a complete file (checked byte-identical to the
///   CPU's file), wall clock, median of 9.
fn paged(b: &mut Bench, llama: &KvCache) {
    let tokens = 32768u32;
    let shape = PagedShape {
        num_blocks: tokens / 16 + 64,
        block_size: 16,
        kv_heads: 8,
        head_dim: 128,
    };
    let ids = shuffled_ids(tokens / 16, shape.num_blocks, 0x5eed);
    let slots = b
        .gpu
        .upload(&slot_mapping(&ids, &shape, tokens).unwrap())
        .unwrap();
    let label = "llama3-8b layer K+V paged bs16";
    // The stream a serving engine would pass: here kvpack's own, wrapped by
    // its raw handle like a torch stream.
    // SAFETY: kvpack's stream lives as long as the process's Gpu.
    let ext = unsafe { b.gpu.with_stream(b.gpu.raw_stream()) };
    let layouts = [
        PagedLayout::FlashAttn,
        PagedLayout::FlashInfer,
        PagedLayout::Hnd,
    ];
    let caches: Vec<Vec<(GpuBuffer<u16>, PagedCache)>> = layouts
        .iter()
        .map(|&l| (0..SETS).map(|_| paged_cache(b, l, &shape)).collect())
        .collect();
    let mut summary = Vec::new();
    for codec in [
        "raw",
        "int4",
        "bdr128",
        "hqmq:s96r4",
        "polar:m4n4",
        "kivi:2",
        "innerq:k2v2",
        "turbo:b3",
        "octopus:b3",
    ] {
        if !vq_selected(codec) {
            continue;
        }
        let file = compress_mem(llama, codec, 256);
        let archive = Archive::open(&file).unwrap();
        let pages: Vec<usize> = (0..2)
            .flat_map(|t| archive.reader().pages_overlapping(t, 0, u32::MAX))
            .collect();
        let gp: Vec<GpuPages> = (0..SETS)
            .map(|_| GpuPages::upload(&b.gpu, &archive, &pages).unwrap())
            .collect();
        let mut kernel_gbs = 0.0;
        for (li, l) in layouts.iter().enumerate() {
            let plans: Vec<DecodePlan<'_>> = (0..SETS)
                .map(|s| {
                    let c = &caches[li][s].1;
                    let targets = [Kind::Key, Kind::Value].map(|kind| Target {
                        tensor: u32::from(kind == Kind::Value),
                        dst: Dst::Blocks {
                            cache: c,
                            kind,
                            slots: &slots,
                        },
                    });
                    b.gpu.plan_decode(&gp[s], &targets, OutType::Bf16).unwrap()
                })
                .collect();
            b.decode(
                label,
                codec,
                &format!("paged decode bf16 {}", l.name()),
                &plans,
            );
            if li == 0 {
                let r = b.rows.last().unwrap();
                kernel_gbs = gbs(r.read + r.written, r.us);
            }
        }
        // The whole call, FlashAttention layout.
        let cache = &caches[0][0].1;
        let mut stats = None;
        let us = wall_us(9, || {
            let a = Archive::open(&file).unwrap();
            let job = ext.decode_paged(&a, 0, cache, &ids).unwrap();
            stats = Some(job.wait().unwrap());
        });
        let st = stats.unwrap();
        let out_gbs = gbs(st.output_bytes, us);
        println!(
            "  {label} {codec:<12} decode_paged call (open + stage + upload + kernels + wait):              {us:>9.1} us, {out_gbs:.1} GB/s of bf16 written ({:.1} MB file)",
            st.file_bytes as f64 / 1e6
        );
        b.rows.push(Row {
            shape: label.into(),
            codec: codec.into(),
            op: "decode_paged call (wall)".into(),
            kernels: "staging+H2D+kernels".into(),
            us,
            read: st.file_bytes,
            written: st.output_bytes,
        });
        summary.push(format!(
            "| {codec} | decode | {kernel_gbs:.0} | {:.0}% | {us:.0} | {out_gbs:.1} |",
            100.0 * kernel_gbs / b.ceiling
        ));
    }
    // Encode from the FlashAttention layout: the cache holds the layer's
    // rows at the block table's slots.
    let (fa_buf, fa) = paged_cache(b, PagedLayout::FlashAttn, &shape);
    {
        let mut image = vec![0u16; 2 * shape.kv_elements() as usize];
        let d = 128usize;
        for t in llama.tensors.iter().take(2) {
            let TensorData::Bf16(v) = &t.data else {
                panic!("bf16 cache expected")
            };
            let (off, _, addr) = shape.image_target(PagedLayout::FlashAttn, t.info.kind);
            for h in 0..8u32 {
                for tok in 0..tokens as usize {
                    let slot = (ids[tok / 16] * 16 + (tok % 16) as i64) as u64;
                    let at = (off + addr.offset(slot, h)) as usize;
                    let src = (h as usize * tokens as usize + tok) * d;
                    image[at..at + d].copy_from_slice(bytemuck::cast_slice(&v[src..src + d]));
                }
            }
        }
        fa_buf.write(&image).unwrap();
    }
    let n = 8 * tokens as usize * 128;
    let gathered: Vec<[GpuBuffer<u16>; 2]> = (0..SETS)
        .map(|_| {
            [
                b.gpu.alloc::<u16>(n).unwrap(),
                b.gpu.alloc::<u16>(n).unwrap(),
            ]
        })
        .collect();
    let gathers: Vec<_> = gathered
        .iter()
        .map(|g| {
            b.gpu
                .plan_gather(&fa, &slots, tokens, [&g[0], &g[1]])
                .unwrap()
        })
        .collect();
    let (_, gus, _) = b.time(|s| gathers[s].launch().unwrap());
    let gname = gathers[0].kernel().to_string();
    b.record(
        label,
        "-",
        "gather (flash_attn)",
        gname,
        gus,
        gathers[0].bytes(),
    );
    for codec in [
        "int4",
        "bdr128",
        "hqmq:s96r4",
        "hqmq:s96r4+med3",
        "hqmq:s96r4+chan",
        "kivi:2",
        "innerq:k2v2",
        "polar:m4n4",
        "turbo:b3",
        "octopus:b3",
    ] {
        if !vq_selected(codec) {
            continue;
        }
        let c = prepared(codec, llama);
        let infos: Vec<TensorInfo> = llama.tensors[..2].iter().map(|t| t.info.clone()).collect();
        let pages: Vec<_> = (0..2)
            .map(|t| plan(std::slice::from_ref(&infos[t]), &[0], Layout::default()).unwrap())
            .collect();
        let plans: Vec<Vec<EncodePlan<'_>>> = gathered
            .iter()
            .map(|g| {
                (0..2)
                    .map(|t| {
                        b.gpu
                            .plan_encode(&g[t], &infos[t], c.as_ref(), &pages[t])
                            .unwrap()
                    })
                    .collect()
            })
            .collect();
        let (_, us, _) = b.time(|s| {
            gathers[s].launch().unwrap();
            for p in &plans[s] {
                p.launch().unwrap();
            }
        });
        let mut rw = gathers[0].bytes();
        for p in &plans[0] {
            p.finish().unwrap();
            rw.0 += p.bytes().0;
            rw.1 += p.bytes().1;
        }
        let kernels = format!("{}+{}", gathers[0].kernel(), plans[0][0].kernel());
        b.record(
            label,
            codec,
            "paged encode (gather+encode)",
            kernels,
            us,
            rw,
        );
        let kernel_gbs = gbs(rw.0 + rw.1, us);
        let opts = CompressOptions::default();
        let mut bytes = Vec::new();
        let us = wall_us(9, || {
            bytes = ext
                .encode_paged(&fa, &ids, tokens, c.as_ref(), 0, &opts, Vec::new())
                .unwrap()
                .0;
        });
        let same = bytes == compress_mem(llama, codec, 256);
        let src_bytes = 2 * n as u64 * 2;
        let in_gbs = gbs(src_bytes, us);
        println!(
            "  {label} {codec:<12} encode_paged call (gather + encode + download + file):              {us:>9.1} us, {in_gbs:.1} GB/s of bf16 read, {:.1} MB file, identical to the CPU's              file: {same}",
            bytes.len() as f64 / 1e6
        );
        if !same {
            println!("  WARNING: {codec} encode_paged differs from the CPU's file");
        }
        b.rows.push(Row {
            shape: label.into(),
            codec: codec.into(),
            op: "encode_paged call (wall)".into(),
            kernels: "gather+encode+D2H+frames".into(),
            us,
            read: src_bytes,
            written: bytes.len() as u64,
        });
        // The same call writing into a reused buffer (as `out=` of the
        // Python call into a registered NIXL buffer): no fresh memory.
        let mut reused: Vec<u8> = Vec::with_capacity(bytes.len());
        let us_out = wall_us(9, || {
            reused.clear();
            ext.encode_paged(&fa, &ids, tokens, c.as_ref(), 0, &opts, &mut reused)
                .unwrap();
        });
        assert!(
            reused == bytes,
            "{codec}: encode_paged into a reused buffer differs"
        );
        println!(
            "  {label} {codec:<12} encode_paged call into a reused buffer:              {us_out:>9.1} us"
        );
        b.rows.push(Row {
            shape: label.into(),
            codec: codec.into(),
            op: "encode_paged call into a reused buffer (wall)".into(),
            kernels: "gather+encode+D2H+frames".into(),
            us: us_out,
            read: src_bytes,
            written: bytes.len() as u64,
        });
        summary.push(format!(
            "| {codec} | encode | {kernel_gbs:.0} | {:.0}% | {us:.0} ({us_out:.0} reused out) | {in_gbs:.1} |",
            100.0 * kernel_gbs / b.ceiling
        ));
    }
    b.gpu.synchronize().unwrap();
    println!(
        "\nPaged I/O, Llama-3-8B layer (8 KV heads, head_dim 128, 32768 tokens, bs 16, shuffled \
         blocks, flash_attn layout); copy ceiling {:.0} GB/s:",
        b.ceiling
    );
    println!("| codec | op | kernels GB/s | vs copy | whole call (us) | whole call GB/s (bf16) |");
    println!("|---|---|---|---|---|---|");
    for l in summary {
        println!("{l}");
    }
}

/// Copy ceiling: 16-byte copy kernel (64 MiB rotating over 6 pairs, and
/// 1 GiB), and the driver's device-to-device copy (1 GiB).
fn ceiling(b: &mut Bench) {
    let small = 128 << 20;
    let pairs: Vec<(GpuBuffer<u8>, GpuBuffer<u8>)> = (0..SETS)
        .map(|_| {
            let a = b.gpu.alloc::<u8>(small).unwrap();
            a.fill_bytes(0x5a).unwrap();
            (a, b.gpu.alloc::<u8>(small).unwrap())
        })
        .collect();
    let (_, us, _) = b.time(|s| b.gpu.copy(&pairs[s].0, &pairs[s].1, false).unwrap());
    let small_gbs = gbs(2 * small as u64, us);
    drop(pairs);
    let big = 1 << 30;
    let src = b.gpu.alloc::<u8>(big).unwrap();
    src.fill_bytes(0xa5).unwrap();
    let dst = b.gpu.alloc::<u8>(big).unwrap();
    let (_, us_k, _) = b.time(|_| b.gpu.copy(&src, &dst, false).unwrap());
    let (_, us_d, _) = b.time(|_| b.gpu.copy(&src, &dst, true).unwrap());
    let k = gbs(2 * big as u64, us_k);
    let d = gbs(2 * big as u64, us_d);
    println!(
        "copy ceiling (read + write): copy kernel 128 MiB x{SETS} rotating {small_gbs:.1} GB/s; \
         copy kernel 1 GiB {k:.1} GB/s ({us_k:.1} us); cuMemcpyDtoD 1 GiB {d:.1} GB/s"
    );
    b.ceiling = k.max(small_gbs);
    b.rows.push(Row {
        shape: "128 MiB x6 rotating".into(),
        codec: "-".into(),
        op: "copy kernel".into(),
        kernels: "copy_u128".into(),
        us,
        read: small as u64,
        written: small as u64,
    });
    b.rows.push(Row {
        shape: "1 GiB".into(),
        codec: "-".into(),
        op: "copy kernel".into(),
        kernels: "copy_u128".into(),
        us: us_k,
        read: big as u64,
        written: big as u64,
    });
    b.rows.push(Row {
        shape: "1 GiB".into(),
        codec: "-".into(),
        op: "cuMemcpyDtoD".into(),
        kernels: "driver".into(),
        us: us_d,
        read: big as u64,
        written: big as u64,
    });
}

/// File on disk to bf16 on the GPU: a Llama-3-8B-shaped cache (32 layers,
/// 8 KV heads, head_dim 128, 32768 tokens: 4 GiB of bf16).
fn file_to_gpu(b: &mut Bench) {
    let dir = std::env::var("KVPACK_BENCH_DIR").unwrap_or_else(|_| ".".into());
    let t0 = Instant::now();
    let c = cache(32, 8, 32768, 128, 42);
    println!(
        "file to GPU: generated {:.2} GiB of bf16 in {:.1} s",
        c.source_bytes() as f64 / (1u64 << 30) as f64,
        t0.elapsed().as_secs_f64()
    );
    let outs: Vec<GpuBuffer<u16>> = c
        .tensors
        .iter()
        .map(|t| b.gpu.alloc::<u16>(t.info.elements() as usize).unwrap())
        .collect();
    let mut fd = FileDecoder::new(&b.gpu, 64 << 20).unwrap();
    let mut lines = Vec::new();
    for codec in ["bdr128", "int4", "raw"] {
        let path = std::path::Path::new(&dir).join(format!("kvpack-bench-{codec}.kvpack"));
        let t0 = Instant::now();
        {
            let f = std::fs::File::create(&path).unwrap();
            let cc = kvpack::codec::parse(codec).unwrap();
            let (w, _) = compress(
                &c,
                cc.as_ref(),
                &CompressOptions::default(),
                std::io::BufWriter::with_capacity(8 << 20, f),
                &|_| {},
            )
            .unwrap();
            let f = w.into_inner().unwrap();
            f.sync_all().unwrap();
        }
        let file_len = std::fs::metadata(&path).unwrap().len();
        println!(
            "  {codec}: wrote {:.3} GiB in {:.1} s",
            file_len as f64 / (1u64 << 30) as f64,
            t0.elapsed().as_secs_f64()
        );
        let run = |fd: &mut FileDecoder| {
            let f = std::fs::File::open(&path).unwrap();
            // SAFETY: the file is not modified while mapped.
            let map = unsafe { memmap2::Mmap::map(&f) }.unwrap();
            let t0 = Instant::now();
            let archive = Archive::open(&map).unwrap();
            let targets: Vec<Target<'_>> = archive
                .tensors()
                .iter()
                .enumerate()
                .map(|(t, i)| Target {
                    tensor: t as u32,
                    dst: Dst::Contiguous {
                        buf: &outs[t],
                        first_token: 0,
                        tokens: i.tokens,
                    },
                })
                .collect();
            let stats = fd.decode(&archive, &targets, OutType::Bf16).unwrap();
            (t0.elapsed().as_secs_f64(), stats)
        };
        let (first, st) = run(&mut fd);
        let mut warm: Vec<f64> = (0..3).map(|_| run(&mut fd).0).collect();
        warm.sort_by(|a, b| a.total_cmp(b));
        let warm = warm[1];
        // Check tensor 0 against the CPU decoder.
        {
            let bytes = std::fs::read(&path).unwrap();
            let a = Archive::open(&bytes).unwrap();
            let sel = Selection {
                layers: Some(0..1),
                tokens: None,
                kind: Some(Kind::Key),
            };
            let want = a.decode(&sel, Some(DType::Bf16), None).unwrap();
            let TensorData::Bf16(w) = &want.tensors[0].data else {
                unreachable!()
            };
            let got = outs[0].to_vec().unwrap();
            let same = got
                .iter()
                .zip(w)
                .filter(|(g, w)| **g == w.to_bits())
                .count();
            println!(
                "    layer 0 K: {same} of {} elements bit-identical to the CPU",
                got.len()
            );
            if same != got.len() {
                println!("    WARNING: GPU decode differs from the CPU");
            }
            // CPU decode of the whole file on all threads, for reference.
            let t0 = Instant::now();
            let all = a
                .decode(&Selection::default(), Some(DType::Bf16), None)
                .unwrap();
            let cpu = t0.elapsed().as_secs_f64();
            drop(all);
            lines.push(format!(
                "| {codec} | {:.3} | CPU decode to host memory, {} threads | {:.1} |",
                file_len as f64 / (1u64 << 30) as f64,
                rayon::current_num_threads(),
                c.source_bytes() as f64 / cpu / 1e9
            ));
        }
        // Cold: drop the file from the page cache (fadvise DONTNEED via dd).
        let cold = std::process::Command::new("dd")
            .arg(format!("if={}", path.display()))
            .args(["iflag=nocache", "count=0", "status=none"])
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
            .then(|| run(&mut fd).0);
        let eq = c.source_bytes() as f64;
        println!(
            "    first {first:.3} s, warm (median of 3) {warm:.3} s = {:.1} GB/s bf16-equivalent \
             ({:.1} GB/s of file); cold {}; {} chunks, {} pages, {:.2} GiB uploaded",
            eq / warm / 1e9,
            file_len as f64 / warm / 1e9,
            cold.map_or("n/a".into(), |s| format!(
                "{s:.3} s = {:.1} GB/s",
                eq / s / 1e9
            )),
            st.chunks,
            st.pages,
            st.uploaded_bytes as f64 / (1u64 << 30) as f64
        );
        lines.push(format!(
            "| {codec} | {:.3} | GPU, page cache warm (median of 3) | {:.1} |",
            file_len as f64 / (1u64 << 30) as f64,
            eq / warm / 1e9
        ));
        if let Some(s) = cold {
            lines.push(format!(
                "| {codec} | {:.3} | GPU, page cache dropped (fadvise) | {:.1} |",
                file_len as f64 / (1u64 << 30) as f64,
                eq / s / 1e9
            ));
        }
        std::fs::remove_file(&path).unwrap();
    }
    println!("\nFile on disk -> bf16 on GPU, 4 GiB (bf16) Llama-3-8B-shaped cache, 64 MiB chunks:");
    println!("| codec | file GiB | path | GB/s of bf16 delivered |");
    println!("|---|---|---|---|");
    for l in lines {
        println!("{l}");
    }
}

fn main() {
    let gpu = match Gpu::new(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("gpu bench skipped: {e}");
            return;
        }
    };
    let t0 = Instant::now();
    gpu.warm_up().unwrap();
    let i = gpu.info().clone();
    println!(
        "GPU: {} (cc {}.{}, {} SMs, {:.0} GiB, L2 {} MiB); kernels compiled by NVRTC in {:.2} s",
        i.name,
        i.compute_capability.0,
        i.compute_capability.1,
        i.multiprocessors,
        i.memory_bytes as f64 / (1u64 << 30) as f64,
        i.l2_bytes >> 20,
        t0.elapsed().as_secs_f64()
    );
    let mut b = Bench {
        gpu,
        rows: Vec::new(),
        ceiling: 0.0,
    };
    ceiling(&mut b);
    let paged_mode = std::env::var("KVPACK_BENCH_PAGED").unwrap_or_default();
    if paged_mode == "only" {
        let llama = cache(1, 8, 32768, 128, 7);
        paged(&mut b, &llama);
        return;
    }

    // Llama-3-8B layer: K and V, 8 KV heads, head_dim 128, 32768 tokens,
    // both tensors in one launch.
    let llama = cache(1, 8, 32768, 128, 7);
    let shape = "llama3-8b layer K+V 2x[8,32768,128]";
    for codec in ["raw", "int4", "bdr128"] {
        if !base_selected() {
            break;
        }
        let file = compress_mem(&llama, codec, 256);
        bench_decode(
            &mut b,
            &file,
            &[0, 1],
            shape,
            codec,
            true,
            codec == "bdr128",
        );
    }
    for codec in ["int4", "bdr128"] {
        if base_selected() {
            bench_encode(&mut b, &llama, &[0, 1], shape, codec, codec);
        }
    }
    // Variants that isolate costs: 8-element units (more shuffles, more
    // index math per element, fully coalesced 16-byte stores) against the
    // default 32-element units; code width (bytes read); small blocks (all
    // butterflies in registers).
    let default_gpu = b.gpu.clone();
    b.gpu = default_gpu.with_kernel_options(kvpack::gpu::KernelOptions {
        narrow: true,
        ..Default::default()
    });
    for codec in ["int4", "bdr128"] {
        if !base_selected() {
            break;
        }
        let file = compress_mem(&llama, codec, 256);
        let label = format!("{codec} w8");
        bench_decode(&mut b, &file, &[0, 1], shape, &label, false, false);
        bench_encode(&mut b, &llama, &[0, 1], shape, codec, &label);
    }
    b.gpu = default_gpu.clone();
    for codec in ["int8", "int2", "bdr16"] {
        if !base_selected() {
            break;
        }
        let file = compress_mem(&llama, codec, 256);
        bench_decode(&mut b, &file, &[0, 1], shape, codec, false, false);
    }
    // The VQ and group codecs: K+V in one launch (one row per kernel mix),
    // then K and V alone where they use different kernels.
    let shape_k = "llama3-8b layer K [8,32768,128]";
    let shape_v = "llama3-8b layer V [8,32768,128]";
    for (codec, paged, f16, split) in [
        ("polar:m4n4", true, true, true),
        ("polar:m4n2", false, false, true),
        ("polar:m4n4:adjacent", false, false, true),
        ("polar:m4n2:adjacent", false, false, false),
        ("innerq:k2v2", true, true, true),
        ("innerq:k3v3", false, false, false),
        ("innerq:k3v2", false, false, true),
        ("innerq:k2v2:sym", false, false, false),
        ("innerq:k2v2:asym", false, false, false),
        ("kivi:2", true, false, true),
        ("kivi:4", false, false, false),
        ("turbo:b3", true, false, false),
        ("turbo:b3+qjl", false, false, true),
        ("octopus:b3", true, true, false),
        ("octopus:b3+qjl", false, false, true),
        ("octopus:b3:vg32", false, false, true),
        ("hqmq:s96r4", true, true, false),
        ("hqmq:s96r4+med3", true, false, false),
        ("hqmq:s24r3", false, false, false),
        ("hqmq:s24r3+chan", false, false, false),
        ("hqmq:s24r3+ctr", false, false, false),
    ] {
        if !vq_selected(codec) {
            continue;
        }
        let file = compress_mem(&llama, codec, 256);
        bench_decode(&mut b, &file, &[0, 1], shape, codec, paged, f16);
        if split {
            bench_decode(&mut b, &file, &[0], shape_k, codec, false, false);
            bench_decode(&mut b, &file, &[1], shape_v, codec, false, false);
        }
    }
    if vq_selected("hqmq:s96r4") {
        // The joint codebook read through L1 instead of copied to shared
        // memory once per work item.
        b.gpu = default_gpu.with_kernel_options(kvpack::gpu::KernelOptions {
            global_hqmq_codebook: true,
            ..Default::default()
        });
        let file = compress_mem(&llama, "hqmq:s96r4", 256);
        bench_decode(
            &mut b,
            &file,
            &[0, 1],
            shape,
            "hqmq:s96r4 L1 cb",
            false,
            false,
        );
        b.gpu = default_gpu.clone();
        bench_encode(&mut b, &llama, &[0, 1], shape, "hqmq:s96r4", "hqmq:s96r4");
        bench_encode(&mut b, &llama, &[0, 1], shape, "hqmq:s24r3", "hqmq:s24r3");
        bench_encode(
            &mut b,
            &llama,
            &[0, 1],
            shape,
            "hqmq:s24r3+chan",
            "hqmq:s24r3+chan",
        );
        bench_encode(
            &mut b,
            &llama,
            &[0, 1],
            shape,
            "hqmq:s24r3+ctr",
            "hqmq:s24r3+ctr",
        );
    }
    // The group codecs' and polar's encoders: K+V in one launch, then K and
    // V alone (channel-group, token-group and polar kernels differ).
    for codec in [
        "kivi:2",
        "kivi:4",
        "innerq:k2v2",
        "innerq:k3v2:sym",
        "innerq:k2v2:asym",
        "polar:m4n4",
        "polar:m4n2:adjacent",
    ] {
        if !vq_selected(codec) {
            continue;
        }
        bench_encode(&mut b, &llama, &[0, 1], shape, codec, codec);
        bench_encode(&mut b, &llama, &[0], shape_k, codec, codec);
        bench_encode(&mut b, &llama, &[1], shape_v, codec, codec);
    }
    // octopus / turbo encode: K+V in one plan set; the QJL variants also K
    // alone (only K pages carry the residual sketch).
    for (codec, split) in [
        ("turbo:b3", false),
        ("turbo:b4", false),
        ("turbo:b3+qjl", true),
        ("octopus:b3", false),
        ("octopus:b2", false),
        ("octopus:b3+qjl", true),
    ] {
        if !vq_selected(codec) {
            continue;
        }
        bench_encode(&mut b, &llama, &[0, 1], shape, codec, codec);
        if split {
            bench_encode(&mut b, &llama, &[0], shape_k, codec, codec);
        }
    }
    if vq_selected("hqmq:s96r4+med3") {
        let c = "hqmq:s96r4+med3";
        bench_encode(&mut b, &llama, &[0, 1], shape, c, c);
    }
    if paged_mode != "0" && !ncu() {
        paged(&mut b, &llama);
    }
    drop(llama);
    if ncu() {
        return;
    }

    // The fixture's shapes: Gemma-3-270M, 1 KV head, head_dim 256, 511 or
    // 520 tokens per layer, 18 layers.
    let fixture = std::env::var("KVPACK_FIXTURE")
        .unwrap_or_else(|_| "fixtures/gemma3-270m-gpl3-520.safetensors".into());
    match std::fs::read(&fixture) {
        Ok(bytes) => {
            let fc = kvpack::io::safetensors::parse(&bytes, &fixture)
                .unwrap()
                .cache;
            let t511 = fc.tensors.iter().position(|t| t.info.tokens == 511);
            let t520 = fc.tensors.iter().position(|t| t.info.tokens == 520);
            let all: Vec<usize> = (0..fc.tensors.len()).collect();
            for codec in [
                "raw",
                "int4",
                "bdr128",
                "bdr256",
                "polar:m4n4",
                "innerq:k2v2",
                "kivi:2",
                "turbo:b3",
                "octopus:b3",
                "hqmq:s96r4",
                "hqmq:s96r4+med3",
            ] {
                if !vq_selected(codec) {
                    continue;
                }
                let file = compress_mem(&fc, codec, 256);
                for (t, n) in [(t511, 511), (t520, 520)] {
                    if let Some(t) = t {
                        let s = format!("gemma3 1 tensor [1,{n},256]");
                        bench_decode(&mut b, &file, &[t], &s, codec, false, false);
                    }
                }
                let s = format!("gemma3 whole cache ({} tensors)", all.len());
                bench_decode(&mut b, &file, &all, &s, codec, true, false);
            }
            for codec in [
                "int4",
                "bdr128",
                "bdr256",
                "hqmq:s96r4",
                "hqmq:s96r4+med3",
                "kivi:2",
                "innerq:k2v2",
                "polar:m4n4",
            ] {
                if !vq_selected(codec) {
                    continue;
                }
                if let Some(t) = t520 {
                    bench_encode(
                        &mut b,
                        &fc,
                        &[t],
                        "gemma3 1 tensor [1,520,256]",
                        codec,
                        codec,
                    );
                }
            }
        }
        Err(e) => println!("fixture {fixture}: {e}; skipping the fixture shapes"),
    }

    let ceiling = b.ceiling;
    let gpu_name = b.gpu.info().name.clone();
    if std::env::var("KVPACK_BENCH_FILE").map_or(true, |v| v != "0") {
        file_to_gpu(&mut b);
    }

    println!(
        "\nGPU kernels on {gpu_name}; ceiling = copy kernel {ceiling:.1} GB/s (read + write):"
    );
    println!(
        "| shape | codec | op | time (us) | read MB | written MB | GB/s | vs copy | kernels |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for r in &b.rows {
        let g = gbs(r.read + r.written, r.us);
        println!(
            "| {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.0} | {:.0}% | {} |",
            r.shape,
            r.codec,
            r.op,
            r.us,
            r.read as f64 / 1e6,
            r.written as f64 / 1e6,
            g,
            100.0 * g / ceiling,
            r.kernels
        );
    }
    std::io::stdout().flush().unwrap();
}
