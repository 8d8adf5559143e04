//! GPU decode and encode against the CPU codecs. Every test body runs on
//! the CPU backend and, when kvpack is built with `--features cuda` and a
//! GPU is present, on CUDA too (otherwise it says why CUDA was skipped);
//! with `KVPACK_GPU_EMU=1` also through the SIMT emulator (the same kernels
//! compiled for the CPU, `kvpack::gpu::emu`; needs g++).
//!
//! Decode: every element within 1 bf16/fp16 ulp of the CPU decoder (the
//! kernels aim for, and the tests report, bit-exact results), unwritten
//! elements left untouched, in the contiguous and the vLLM paged layouts.
//! Encode: the scales, zero points and codes of every page identical to the
//! CPU encoder's, byte for byte.

mod common;

use common::{LayerSpec, Rng, block_table, compress_bytes, random_image, synthetic};
use half::{bf16, f16};
use kvpack::cache::{DType, Kind, KvCache, TensorData};
use kvpack::decode::{Archive, Selection};
use kvpack::gpu::paged::{PagedLayout, PagedShape};
use kvpack::gpu::{Device, Gpu, HostLayout, OutType, POISON};
use kvpack::plan::{Layout, plan};

/// The CPU backend, plus CUDA device 0 when available, plus the emulated
/// kernels under `KVPACK_GPU_EMU=1`.
fn devices() -> Vec<Device> {
    let mut v = vec![Device::Cpu];
    match Device::cuda(0) {
        Ok(d) => v.push(d),
        Err(e) => eprintln!("skipping CUDA: {e}"),
    }
    if std::env::var("KVPACK_GPU_EMU").is_ok_and(|x| x == "1") {
        match Device::emulated() {
            Ok(d) => v.push(d),
            Err(e) => eprintln!("skipping the emulator: {e}"),
        }
    }
    v
}

/// The CPU decoder's output for `tensor`, arranged as `layout`: the oracle.
fn oracle(archive: &Archive<'_>, tensor: usize, out: OutType, layout: &HostLayout) -> Vec<u16> {
    let info = archive.tensors()[tensor].clone();
    let sel = Selection {
        layers: Some(info.layer..info.layer + 1),
        tokens: None,
        kind: Some(info.kind),
    };
    let c = archive.decode(&sel, Some(out.dtype()), None).unwrap();
    let bits: Vec<u16> = match &c.tensors[0].data {
        TensorData::Bf16(v) => v.iter().map(|x| x.to_bits()).collect(),
        TensorData::F16(v) => v.iter().map(|x| x.to_bits()).collect(),
        TensorData::F32(_) | TensorData::Fp8(..) => unreachable!(),
    };
    let d = info.head_dim as usize;
    let t_all = info.tokens as usize;
    match layout {
        HostLayout::Contiguous {
            first_token,
            tokens,
        } => {
            let (f, n) = (*first_token as usize, *tokens as usize);
            let mut o = vec![POISON; info.planes() * n * d];
            for p in 0..info.planes() {
                for t in f..(f + n).min(t_all) {
                    let src = (p * t_all + t) * d;
                    let dst = (p * n + t - f) * d;
                    o[dst..dst + d].copy_from_slice(&bits[src..src + d]);
                }
            }
            o
        }
        HostLayout::Paged { num_slots, slots } => {
            let heads = info.heads as usize;
            let mut o = vec![POISON; *num_slots as usize * heads * d];
            for p in 0..info.planes() {
                let (b, h) = (p / heads, p % heads);
                for t in 0..t_all {
                    let s = slots[b * t_all + t];
                    if s < 0 {
                        continue;
                    }
                    let dst = (s as usize * heads + h) * d;
                    let src = (p * t_all + t) * d;
                    o[dst..dst + d].copy_from_slice(&bits[src..src + d]);
                }
            }
            o
        }
        HostLayout::Blocks {
            layout,
            shape,
            block_ids,
        } => {
            // The C-contiguous index of each layout, written out (not the
            // library's addressing): K is index 0 of the K/V axis, V 1;
            // HND holds K then V.
            let (nb, bs, h) = (
                shape.num_blocks as usize,
                shape.block_size as usize,
                shape.kv_heads as usize,
            );
            let kv = usize::from(info.kind == Kind::Value);
            let mut o = vec![POISON; 2 * nb * bs * h * d];
            for head in 0..h {
                for t in 0..t_all {
                    let (blk, r) = (block_ids[t / bs] as usize, t % bs);
                    let dst = match layout {
                        PagedLayout::FlashAttn => (((kv * nb + blk) * bs + r) * h + head) * d,
                        PagedLayout::FlashInfer => (((blk * 2 + kv) * bs + r) * h + head) * d,
                        PagedLayout::Hnd => kv * nb * h * bs * d + ((blk * h + head) * bs + r) * d,
                    };
                    let src = (head * t_all + t) * d;
                    o[dst..dst + d].copy_from_slice(&bits[src..src + d]);
                }
            }
            o
        }
    }
}

/// Order-preserving integer image of a bf16/fp16 bit pattern (for ulp
/// distances).
fn ordered(x: u16) -> i32 {
    if x & 0x8000 != 0 {
        -((x & 0x7fff) as i32)
    } else {
        x as i32
    }
}

/// Asserts every element within 1 ulp; returns the count not bit-identical.
fn assert_close(got: &[u16], want: &[u16], what: &str) -> usize {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut inexact = 0;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if g == w {
            continue;
        }
        inexact += 1;
        let ulps = (ordered(g) - ordered(w)).abs();
        assert!(
            ulps <= 1 && g != POISON && w != POISON,
            "{what}: element {i}: got 0x{g:04x}, CPU 0x{w:04x} ({ulps} ulp)"
        );
    }
    inexact
}

/// A random slot mapping for `n` tokens into `num_slots` slots (a
/// permutation, every 13th token unmapped with -1).
fn slot_mapping(rng: &mut Rng, n: usize, num_slots: u32) -> Vec<i64> {
    let mut perm: Vec<i64> = (0..i64::from(num_slots)).collect();
    for i in (1..perm.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        perm.swap(i, j);
    }
    perm.truncate(n);
    for (i, s) in perm.iter_mut().enumerate() {
        if i % 13 == 5 {
            *s = -1;
        }
    }
    perm
}

/// Decodes every tensor of a compressed cache on `dev` in the contiguous
/// layout (whole and a clipped token range) and the paged layout, bf16 and
/// fp16, against the CPU oracle. Returns (elements compared, inexact).
fn check_decode(dev: &Device, file: &[u8], seed: u64, what: &str) -> (usize, usize) {
    let archive = Archive::open(file).unwrap();
    let mut rng = Rng(seed | 1);
    let (mut n, mut inexact) = (0, 0);
    for (t, info) in archive.tensors().iter().enumerate() {
        let tokens = info.tokens;
        let lo = (rng.next_u64() % u64::from(tokens)) as u32;
        let len = 1 + (rng.next_u64() % u64::from(tokens - lo)) as u32;
        let slots = 16 * u64::from(tokens * info.batch).div_ceil(16) as u32 + 16;
        let layouts = [
            HostLayout::Contiguous {
                first_token: 0,
                tokens,
            },
            HostLayout::Contiguous {
                first_token: lo,
                tokens: len,
            },
            HostLayout::Paged {
                num_slots: slots,
                slots: slot_mapping(&mut rng, (tokens * info.batch) as usize, slots),
            },
        ];
        for out in [OutType::Bf16, OutType::F16] {
            for layout in &layouts {
                let want = oracle(&archive, t, out, layout);
                let got = dev
                    .decode_tensor(&archive, t, out, layout)
                    .unwrap_or_else(|e| panic!("{what} {} {layout:?}: {e}", dev.name()));
                let label = format!(
                    "{what} on {}: tensor {t} ({}) {out:?} {layout:?}",
                    dev.name(),
                    info.describe()
                );
                inexact += assert_close(&got, &want, &label);
                n += got.len();
            }
        }
    }
    (n, inexact)
}

struct Case {
    codec: &'static str,
    spec: LayerSpec,
    dtype: DType,
    layout: Layout,
    zstd: bool,
}

fn spec(batch: u32, heads: u32, tokens: u32, head_dim: u32) -> LayerSpec {
    LayerSpec {
        batch,
        heads,
        tokens,
        head_dim,
    }
}

fn layout(page_tokens: u32, sink: u32, recent: u32) -> Layout {
    Layout {
        page_tokens,
        sink,
        recent,
    }
}

/// Shapes that cover every kernel: head_dim a multiple of 8 (unit kernels)
/// or not (fallbacks), rotation blocks in registers/shuffles (<= 256) or
/// shared memory (512), token counts that are no multiple of any page,
/// batch > 1, sink/recent raw pages, zstd pages, bf16/fp16/f32 sources.
fn cases() -> Vec<Case> {
    let c = |codec, spec, dtype, layout, zstd| Case {
        codec,
        spec,
        dtype,
        layout,
        zstd,
    };
    vec![
        c(
            "raw",
            spec(1, 3, 257, 64),
            DType::Bf16,
            layout(64, 0, 0),
            false,
        ),
        c(
            "raw",
            spec(2, 2, 100, 24),
            DType::F16,
            layout(32, 0, 0),
            true,
        ),
        c(
            "raw",
            spec(1, 2, 33, 6),
            DType::F32,
            layout(16, 0, 0),
            false,
        ),
        c(
            "int4",
            spec(1, 4, 300, 128),
            DType::Bf16,
            layout(128, 4, 5),
            false,
        ),
        c(
            "int4",
            spec(2, 1, 77, 6),
            DType::Bf16,
            layout(32, 0, 0),
            false,
        ),
        c(
            "int3",
            spec(1, 2, 129, 96),
            DType::F16,
            layout(64, 0, 3),
            true,
        ),
        c(
            "int8",
            spec(1, 2, 65, 256),
            DType::F32,
            layout(64, 0, 0),
            false,
        ),
        c(
            "int1",
            spec(1, 1, 40, 40),
            DType::Bf16,
            layout(16, 0, 0),
            false,
        ),
        c(
            "int2",
            spec(3, 2, 19, 80),
            DType::Bf16,
            layout(8, 2, 0),
            false,
        ),
        c(
            "bdr128",
            spec(1, 8, 1000, 128),
            DType::Bf16,
            layout(256, 0, 0),
            false,
        ),
        c(
            "bdr128",
            spec(2, 2, 257, 256),
            DType::F16,
            layout(64, 4, 7),
            true,
        ),
        c(
            "bdr64:k",
            spec(1, 2, 130, 64),
            DType::Bf16,
            layout(64, 0, 0),
            false,
        ),
        c(
            "bdr16",
            spec(1, 2, 50, 48),
            DType::Bf16,
            layout(16, 0, 0),
            false,
        ),
        c(
            "bdr32:b3",
            spec(1, 3, 70, 96),
            DType::Bf16,
            layout(32, 0, 0),
            false,
        ),
        c(
            "bdr256",
            spec(1, 1, 300, 256),
            DType::Bf16,
            layout(256, 0, 0),
            false,
        ),
        c(
            "bdr512",
            spec(1, 1, 20, 512),
            DType::Bf16,
            layout(8, 0, 0),
            false,
        ),
        c("bdr2", spec(1, 1, 9, 6), DType::F32, layout(4, 0, 0), false),
        c(
            "bdr8:b8",
            spec(1, 2, 31, 8),
            DType::Bf16,
            layout(16, 0, 0),
            false,
        ),
        c(
            "bdr1024:b2",
            spec(1, 1, 5, 1024),
            DType::Bf16,
            layout(8, 0, 0),
            false,
        ),
        c(
            "bdr4",
            spec(1, 2, 37, 64),
            DType::Bf16,
            layout(16, 0, 0),
            false,
        ),
        c(
            "bdr16:b5",
            spec(1, 2, 45, 128),
            DType::F16,
            layout(32, 0, 0),
            false,
        ),
        c(
            "bdr32",
            spec(2, 1, 23, 32),
            DType::Bf16,
            layout(8, 0, 0),
            false,
        ),
        c(
            "int6",
            spec(1, 3, 50, 512),
            DType::Bf16,
            layout(16, 0, 0),
            false,
        ),
    ]
}

/// The VQ and group codecs (hqmq, octopus, turbo, polar, innerq, kivi):
/// shapes that reach every kernel variant (fast and fallback, shared or
/// L1 codebooks, outlier list and bitmap, QJL, value groups, both polar
/// pairings, every InnerQ mode), token counts that are no multiple of any
/// page or group, batch > 1, raw windows, zstd, bf16/fp16/f32 sources.
fn vq_cases() -> Vec<Case> {
    let c = |codec, spec, dtype, layout, zstd| Case {
        codec,
        spec,
        dtype,
        layout,
        zstd,
    };
    vec![
        c(
            "kivi:2",
            spec(1, 4, 300, 128),
            DType::Bf16,
            layout(128, 4, 5),
            false,
        ),
        c(
            "kivi:4",
            spec(2, 2, 77, 64),
            DType::F16,
            layout(32, 0, 0),
            true,
        ),
        c(
            "kivi:3:g5",
            spec(1, 2, 45, 40),
            DType::Bf16,
            layout(16, 0, 0),
            false,
        ),
        c(
            "kivi:8:g16",
            spec(1, 1, 33, 48),
            DType::F32,
            layout(16, 0, 0),
            false,
        ),
        c(
            "kivi:1:g3",
            spec(1, 2, 19, 6),
            DType::Bf16,
            layout(8, 0, 0),
            false,
        ),
        c(
            "innerq:k2v2",
            spec(1, 4, 300, 128),
            DType::Bf16,
            layout(128, 32, 96),
            false,
        ),
        c(
            "innerq:k3v2:sym",
            spec(2, 2, 100, 64),
            DType::F16,
            layout(64, 4, 8),
            true,
        ),
        c(
            "innerq:k2v4:asym:g64",
            spec(1, 2, 130, 64),
            DType::Bf16,
            layout(64, 0, 0),
            false,
        ),
        c(
            "innerq:k4v1:nonorm",
            spec(1, 3, 70, 96),
            DType::F32,
            layout(32, 0, 3),
            false,
        ),
        c(
            "innerq:k2v3:g96",
            spec(1, 1, 200, 96),
            DType::Bf16,
            layout(256, 0, 0),
            false,
        ),
        // Quad kernels: pages whose token count is no multiple of 4 (quads
        // across planes, across token groups and slot words), G = 64.
        c(
            "innerq:k3v3",
            spec(2, 3, 75, 64),
            DType::Bf16,
            layout(32, 3, 2),
            false,
        ),
        c(
            "innerq:k3v2:asym",
            spec(1, 2, 150, 64),
            DType::F16,
            layout(70, 0, 0),
            false,
        ),
        c(
            "innerq:k2v2:sym:g64",
            spec(1, 2, 140, 128),
            DType::Bf16,
            layout(70, 0, 0),
            false,
        ),
        c(
            "innerq:k4v3:nonorm",
            spec(1, 2, 70, 32),
            DType::Bf16,
            layout(30, 0, 0),
            false,
        ),
        c(
            "kivi:3:g2",
            spec(2, 3, 75, 64),
            DType::Bf16,
            layout(32, 3, 2),
            false,
        ),
        c(
            "kivi:5:g16",
            spec(1, 2, 150, 256),
            DType::Bf16,
            layout(70, 0, 0),
            false,
        ),
        c(
            "polar:m4n2",
            spec(2, 3, 75, 64),
            DType::Bf16,
            layout(30, 0, 0),
            false,
        ),
        c(
            "polar:m4n4",
            spec(1, 4, 300, 128),
            DType::Bf16,
            layout(128, 0, 16),
            false,
        ),
        c(
            "polar:m4n2:adjacent",
            spec(2, 2, 77, 64),
            DType::F16,
            layout(32, 0, 0),
            true,
        ),
        c(
            "polar:m3n2:v3",
            spec(1, 2, 50, 32),
            DType::Bf16,
            layout(16, 0, 0),
            false,
        ),
        c(
            "polar:m2n2:vraw",
            spec(1, 1, 40, 16),
            DType::F32,
            layout(16, 0, 0),
            false,
        ),
        c(
            "polar:m5n5:adjacent",
            spec(1, 2, 33, 24),
            DType::Bf16,
            layout(16, 0, 0),
            false,
        ),
        c(
            "turbo:b3",
            spec(1, 4, 300, 128),
            DType::Bf16,
            layout(128, 4, 5),
            false,
        ),
        c(
            "turbo:b2+qjl",
            spec(2, 2, 77, 64),
            DType::F16,
            layout(32, 0, 0),
            true,
        ),
        c(
            "turbo:b4:vg32",
            spec(1, 2, 100, 256),
            DType::Bf16,
            layout(64, 0, 0),
            false,
        ),
        c(
            "turbo:b1+qjl",
            spec(1, 1, 20, 16),
            DType::Bf16,
            layout(8, 0, 0),
            false,
        ),
        c(
            "turbo:b3:seed5",
            spec(1, 1, 5, 2048),
            DType::Bf16,
            layout(4, 0, 0),
            false,
        ),
        c(
            "octopus:b3",
            spec(1, 4, 300, 128),
            DType::Bf16,
            layout(128, 0, 0),
            false,
        ),
        c(
            "octopus:b3+qjl",
            spec(1, 2, 130, 64),
            DType::F32,
            layout(64, 0, 7),
            false,
        ),
        c(
            "octopus:b4:vg16b3",
            spec(1, 2, 45, 32),
            DType::Bf16,
            layout(16, 0, 0),
            false,
        ),
        c(
            "octopus:b2+qjl",
            spec(1, 1, 9, 8),
            DType::Bf16,
            layout(4, 0, 0),
            false,
        ),
        c(
            "octopus:b5",
            spec(1, 1, 20, 1024),
            DType::Bf16,
            layout(16, 0, 0),
            false,
        ),
        c(
            "hqmq:s96r4",
            spec(1, 4, 300, 128),
            DType::Bf16,
            layout(128, 4, 5),
            false,
        ),
        c(
            "hqmq:s24r3+med3",
            spec(2, 2, 77, 64),
            DType::F16,
            layout(32, 0, 0),
            true,
        ),
        c(
            "hqmq:s24r3+med1",
            spec(1, 2, 100, 64),
            DType::Bf16,
            layout(64, 0, 0),
            false,
        ),
        c(
            "hqmq:s32r2",
            spec(1, 2, 45, 12),
            DType::F32,
            layout(16, 0, 0),
            false,
        ),
        c(
            "hqmq:s5r2:seed9",
            spec(1, 3, 70, 32),
            DType::Bf16,
            layout(32, 0, 0),
            false,
        ),
        c(
            "hqmq:s192r4",
            spec(1, 2, 300, 128),
            DType::Bf16,
            layout(256, 0, 0),
            false,
        ),
        c(
            "hqmq:s300r2",
            spec(1, 1, 50, 64),
            DType::Bf16,
            layout(16, 0, 0),
            false,
        ),
        c(
            "hqmq:s96r4:g5",
            spec(1, 2, 37, 256),
            DType::Bf16,
            layout(16, 0, 0),
            false,
        ),
    ]
}

/// Every codec the GPU decodes, into vLLM's paged layouts (FlashAttention,
/// FlashInfer, HND) through a shuffled block table, bf16 and fp16, K and V
/// of one layer into one cache image: bit-exact with the CPU decoder, and
/// every element outside the tensor's rows untouched.
#[test]
fn decode_paged_layouts_match_cpu() {
    let cases = [
        ("raw", spec(1, 2, 70, 64), DType::Bf16),
        ("raw", spec(1, 2, 37, 6), DType::F16),
        ("int4", spec(1, 2, 70, 64), DType::Bf16),
        ("int3", spec(1, 3, 21, 6), DType::F16),
        ("bdr64", spec(1, 2, 70, 64), DType::Bf16),
        ("bdr16", spec(1, 2, 33, 48), DType::F16),
        ("hqmq:s96r4", spec(1, 2, 70, 128), DType::Bf16),
        ("hqmq:s24r3+med3", spec(1, 2, 40, 64), DType::F16),
        ("polar:m4n4", spec(1, 2, 70, 64), DType::Bf16),
        ("kivi:2", spec(1, 2, 70, 64), DType::Bf16),
        ("innerq:k2v2", spec(1, 2, 70, 64), DType::F16),
        ("turbo:b3", spec(1, 2, 40, 64), DType::Bf16),
        ("octopus:b3", spec(1, 2, 40, 64), DType::Bf16),
    ];
    let files: Vec<Vec<u8>> = cases
        .iter()
        .enumerate()
        .map(|(i, (codec, s, dtype))| {
            let cache = synthetic(&[*s], *dtype, 401 + i as u64);
            compress_bytes(&cache, codec, layout(32, 0, 0), None)
        })
        .collect();
    for dev in devices() {
        let (mut n, mut inexact) = (0, 0);
        for (i, ((codec, s, _), file)) in cases.iter().zip(&files).enumerate() {
            let archive = Archive::open(file).unwrap();
            let mut rng = Rng(77 + i as u64);
            let shape = PagedShape {
                num_blocks: s.tokens.div_ceil(16) + 3,
                block_size: 16,
                kv_heads: s.heads,
                head_dim: s.head_dim,
            };
            let ids = block_table(&mut rng, s.tokens.div_ceil(16) as usize, shape.num_blocks);
            for pl in [
                PagedLayout::FlashAttn,
                PagedLayout::FlashInfer,
                PagedLayout::Hnd,
            ] {
                let l = HostLayout::Blocks {
                    layout: pl,
                    shape,
                    block_ids: ids.clone(),
                };
                for out in [OutType::Bf16, OutType::F16] {
                    // The whole-layer call (Gpu::decode_paged on CUDA): K
                    // and V into one image.
                    let mut want = oracle(&archive, 0, out, &l);
                    for (w, v) in want.iter_mut().zip(oracle(&archive, 1, out, &l)) {
                        if v != POISON {
                            *w = v;
                        }
                    }
                    let got = dev
                        .decode_paged(&archive, 0, pl, &shape, &ids, out)
                        .unwrap_or_else(|e| panic!("{codec} {pl:?} on {}: {e}", dev.name()));
                    let label = format!("{codec} on {}: layer {out:?} {pl:?}", dev.name());
                    inexact += assert_close(&got, &want, &label);
                    n += got.len();
                    for t in 0..archive.tensors().len() {
                        let want = oracle(&archive, t, out, &l);
                        let got = dev
                            .decode_tensor(&archive, t, out, &l)
                            .unwrap_or_else(|e| panic!("{codec} {pl:?} on {}: {e}", dev.name()));
                        let label = format!("{codec} on {}: tensor {t} {out:?} {pl:?}", dev.name());
                        inexact += assert_close(&got, &want, &label);
                        n += got.len();
                    }
                }
            }
        }
        println!(
            "paged layouts on {}: {n} elements within 1 ulp of the CPU, {inexact} not bit-identical",
            dev.name()
        );
        assert_eq!(
            inexact,
            0,
            "paged decode on {} is not bit-exact",
            dev.name()
        );
    }
}

/// Encode from the three paged layouts through a shuffled block table,
/// without and with sink/recent windows: the GPU encoders (raw, int, bdr,
/// hqmq, kivi, innerq with its key statistics computed on the device,
/// polar, octopus, turbo) write files byte-identical to the CPU's, which the CPU reader
/// opens and decodes to the gathered rows (raw: exactly).
#[test]
fn encode_paged_layouts_match_cpu_bytes() {
    // hqmq+med: the outlier threshold, table and cut sections on the GPU.
    let all = [
        "raw",
        "int4",
        "bdr32",
        "hqmq:s96r4",
        "kivi:2",
        "kivi:4",
        "polar:m4n4",
        "polar:m4n2:adjacent:vraw",
        "innerq:k2v2",
        "innerq:k3v2:sym",
        "innerq:k4v3:asym:nonorm",
        "polar:m4n4",
        "turbo:b3",
        "turbo:b2+qjl",
        "octopus:b3+qjl",
        "octopus:b2",
        "turbo:b2+qjl:vg32",
        "polar:m4n4",
        "hqmq:s24r3+med3",
    ];
    let devs = devices();
    let mut rng = Rng(909);
    for (dtype, heads, head_dim, tokens, codecs) in [
        (DType::Bf16, 2, 64, 75, &all[..]),
        (DType::F16, 3, 32, 40, &all[..]),
        // head_dim not a multiple of 8: the element-wise gather.
        (DType::F16, 2, 6, 20, &all[..2]),
    ] {
        let shape = PagedShape {
            num_blocks: 9,
            block_size: 16,
            kv_heads: heads,
            head_dim,
        };
        let image = random_image(&mut rng, &shape, dtype);
        let ids = block_table(&mut rng, 9, 9);
        for pl in [
            PagedLayout::FlashAttn,
            PagedLayout::FlashInfer,
            PagedLayout::Hnd,
        ] {
            for (&codec, l) in codecs
                .iter()
                .flat_map(|c| [(c, layout(32, 0, 0)), (c, layout(16, 8, 20))])
            {
                let c = kvpack::codec::parse(codec).unwrap();
                let opts = kvpack::compress::CompressOptions {
                    layout: l,
                    ..Default::default()
                };
                // Every codec here takes the GPU path (the bytes alone
                // would not tell it from the host fallback).
                let infos = kvpack::gpu::paged::layer_infos(&shape, dtype, 3, tokens);
                let pages = plan(&infos, &[0, 0], l).unwrap();
                let ready =
                    kvpack::gpu::paged::prepare_on_gpu(c.as_ref(), &infos, &pages, &opts, |_| {
                        Ok(None)
                    })
                    .unwrap();
                assert!(
                    kvpack::gpu::paged::encodes_on_gpu(
                        &infos,
                        &pages,
                        ready.as_deref().unwrap_or(c.as_ref()),
                        &opts
                    ),
                    "{codec} {l:?} does not encode on the GPU"
                );
                let want = Device::Cpu
                    .encode_paged(
                        &image,
                        pl,
                        &shape,
                        dtype,
                        &ids,
                        tokens,
                        c.as_ref(),
                        3,
                        &opts,
                    )
                    .unwrap();
                let archive = Archive::open(&want).unwrap();
                assert_eq!(archive.tensors().len(), 2);
                assert_eq!(archive.tensors()[1].name, "past_key_values.3.value");
                if codec == "raw" {
                    // The stored rows are the cache's rows of the block table.
                    let gathered =
                        kvpack::gpu::paged::gather_host(&image, pl, &shape, &ids, tokens).unwrap();
                    for (t, g) in gathered.iter().enumerate() {
                        let l = HostLayout::Contiguous {
                            first_token: 0,
                            tokens,
                        };
                        let out = OutType::from_dtype(dtype).unwrap();
                        assert_eq!(&oracle(&archive, t, out, &l), g, "{pl:?} tensor {t}");
                    }
                }
                for dev in &devs[1..] {
                    let got = dev
                        .encode_paged(
                            &image,
                            pl,
                            &shape,
                            dtype,
                            &ids,
                            tokens,
                            c.as_ref(),
                            3,
                            &opts,
                        )
                        .unwrap_or_else(|e| panic!("{codec} {pl:?} on {}: {e}", dev.name()));
                    assert!(
                        got == want,
                        "{codec} {pl:?} {dtype:?} {l:?} on {}: file differs from the CPU's",
                        dev.name()
                    );
                }
            }
        }
    }
    for dev in &devs {
        println!(
            "paged encode on {}: files byte-identical to the CPU's",
            dev.name()
        );
    }
}

/// Bad block tables and shapes are refused with a parameter error, on
/// every device, before anything runs.
#[test]
fn paged_inputs_are_validated() {
    let cache = synthetic(&[spec(1, 2, 40, 64)], DType::Bf16, 3);
    let file = compress_bytes(&cache, "int4", layout(16, 0, 0), None);
    let archive = Archive::open(&file).unwrap();
    let shape = PagedShape {
        num_blocks: 4,
        block_size: 16,
        kv_heads: 2,
        head_dim: 64,
    };
    let wrong_heads = PagedShape {
        kv_heads: 4,
        ..shape
    };
    for dev in devices() {
        for (ids, sh, layer) in [
            (vec![0, 1], shape, 0),     // 40 tokens need 3 blocks
            (vec![0, 1, 4], shape, 0),  // id past the cache
            (vec![0, 1, 1], shape, 0),  // repeated block
            (vec![0, -1, 2], shape, 0), // negative id
            (vec![0, 1, 2], wrong_heads, 0),
            (vec![0, 1, 2], shape, 1), // no layer 1
        ] {
            let e = dev
                .decode_paged(
                    &archive,
                    layer,
                    PagedLayout::FlashAttn,
                    &sh,
                    &ids,
                    OutType::Bf16,
                )
                .unwrap_err();
            assert!(
                matches!(e, kvpack::Error::Parameter(_)),
                "{} {ids:?}: {e}",
                dev.name()
            );
        }
        let image = vec![0u16; 2 * shape.kv_elements() as usize];
        let c = kvpack::codec::parse("int4").unwrap();
        let e = dev
            .encode_paged(
                &image,
                PagedLayout::Hnd,
                &shape,
                DType::Bf16,
                &[0, 1],
                40,
                c.as_ref(),
                0,
                &Default::default(),
            )
            .unwrap_err();
        assert!(
            matches!(e, kvpack::Error::Parameter(_)),
            "{}: {e}",
            dev.name()
        );
    }
}

#[test]
fn decode_vq_and_group_codecs_match_cpu() {
    let cases = vq_cases();
    let files: Vec<Vec<u8>> = cases
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let cache = synthetic(&[c.spec, c.spec], c.dtype, 51 + i as u64);
            compress_bytes(&cache, c.codec, c.layout, c.zstd.then_some(1))
        })
        .collect();
    for dev in devices() {
        let (mut n, mut inexact) = (0, 0);
        for (i, (c, file)) in cases.iter().zip(&files).enumerate() {
            let (a, b) = check_decode(&dev, file, 300 + i as u64, c.codec);
            n += a;
            inexact += b;
        }
        println!(
            "VQ/group decode on {}: {n} elements within 1 ulp of the CPU, {inexact} not bit-identical",
            dev.name()
        );
    }
}

/// The hqmq kernels that read the joint codebook through L1 (a benchmark
/// knob; the default copies it to shared memory per work item).
#[test]
fn decode_hqmq_l1_codebook_matches_cpu() {
    let cases = [
        ("hqmq:s96r4+med3", spec(1, 2, 300, 128), layout(128, 0, 0)),
        ("hqmq:s192r4", spec(1, 2, 100, 64), layout(64, 0, 0)),
    ];
    let files: Vec<Vec<u8>> = cases
        .iter()
        .enumerate()
        .map(|(i, (codec, s, l))| {
            let cache = synthetic(&[*s], DType::Bf16, 91 + i as u64);
            compress_bytes(&cache, codec, *l, None)
        })
        .collect();
    let l1 = kvpack::gpu::KernelOptions {
        global_hqmq_codebook: true,
        ..Default::default()
    };
    for dev in devices().iter().map(|d| d.with_kernel_options(l1)) {
        for ((codec, _, _), file) in cases.iter().zip(&files) {
            let (n, inexact) = check_decode(&dev, file, 7, codec);
            println!(
                "{codec} (L1 codebook) on {}: {n} elements, {inexact} not bit-identical",
                dev.name()
            );
        }
    }
}

#[test]
fn decode_random_shapes_matches_cpu() {
    for dev in devices() {
        let (mut n, mut inexact) = (0, 0);
        for (i, c) in cases().iter().enumerate() {
            let cache = synthetic(&[c.spec, c.spec], c.dtype, 7 + i as u64);
            let file = compress_bytes(&cache, c.codec, c.layout, c.zstd.then_some(1));
            let (a, b) = check_decode(&dev, &file, 100 + i as u64, c.codec);
            n += a;
            inexact += b;
        }
        println!(
            "decode on {}: {n} elements within 1 ulp of the CPU, {inexact} not bit-identical",
            dev.name()
        );
    }
}

#[test]
fn decode_fixture_vq_matches_cpu() {
    let cache = common::fixture().cache;
    let codecs = [
        "hqmq:s96r4+med3",
        "octopus:b3+qjl",
        "turbo:b3:vg32",
        "polar:m4n4",
        "innerq:k2v2",
        "kivi:2",
    ];
    let files: Vec<Vec<u8>> = codecs
        .iter()
        .map(|c| compress_bytes(&cache, c, layout(256, 4, 16), None))
        .collect();
    for dev in devices() {
        for (codec, file) in codecs.iter().zip(&files) {
            let (n, inexact) = check_decode(&dev, file, 19, codec);
            println!(
                "fixture {codec} decode on {}: {n} elements, {inexact} not bit-identical",
                dev.name()
            );
        }
    }
}

#[test]
fn decode_fixture_matches_cpu() {
    let cache = common::fixture().cache;
    for dev in devices() {
        for codec in ["bdr128", "bdr256", "int4", "raw"] {
            let l = layout(256, 4, 16);
            let file = compress_bytes(&cache, codec, l, None);
            let (n, inexact) = check_decode(&dev, &file, 9, codec);
            println!(
                "fixture {codec} decode on {}: {n} elements, {inexact} not bit-identical",
                dev.name()
            );
        }
    }
}

/// Encodes every tensor of `cache` page by page on `dev` and on the CPU and
/// compares the sections byte for byte.
fn check_encode(dev: &Device, cache: &KvCache, codec: &str, l: Layout) -> usize {
    let c = kvpack::codec::parse(codec).unwrap();
    // Codecs with per-head_dim codebooks (octopus, turbo) or whole-cache
    // statistics (innerq) are prepared for the cache first, as compression
    // does.
    let c = c.prepare(&cache.view(), &l).unwrap().unwrap_or(c);
    check_encode_with(dev, cache, c.as_ref(), l)
}

/// [`check_encode`] with a codec object (e.g. prepared for `cache`).
fn check_encode_with(
    dev: &Device,
    cache: &KvCache,
    c: &dyn kvpack::codec::Codec,
    l: Layout,
) -> usize {
    let codec = c.name();
    let infos: Vec<_> = cache.tensors.iter().map(|t| t.info.clone()).collect();
    let pages = plan(&infos, &vec![0; infos.len()], l).unwrap();
    let mut compared = 0;
    for (ti, t) in cache.tensors.iter().enumerate() {
        if !matches!(dev, Device::Cpu) && !kvpack::gpu::family::gpu_encodes(c, &t.info) {
            // The value-group V pages of octopus / turbo are kivi value
            // pages: compared only where the kivi family encodes on the GPU.
            assert!(
                codec.contains(":vg"),
                "{codec}: no GPU encoder for {}",
                t.info.name
            );
            continue;
        }
        let mine: Vec<_> = pages
            .iter()
            .filter(|p| p.tensor == ti as u32 && !p.raw)
            .copied()
            .collect();
        let want = kvpack::gpu::host::encode_tensor(t, c, &mine).unwrap();
        let got = dev
            .encode_tensor(t, c, &mine)
            .unwrap_or_else(|e| panic!("{codec} on {}: {e}", dev.name()));
        assert_eq!(got.len(), want.len());
        for (pi, (g, w)) in got.iter().zip(&want).enumerate() {
            for (gs, ws) in g.iter().zip(w) {
                if gs != ws {
                    let diff = gs.data.iter().zip(&ws.data).filter(|(a, b)| a != b).count();
                    panic!(
                        "{codec} on {}: tensor {ti} page {pi} section {:?}: {diff} of {} bytes differ",
                        dev.name(),
                        ws.kind,
                        ws.data.len()
                    );
                }
                compared += gs.data.len();
            }
            assert_eq!(g.len(), w.len());
        }
    }
    compared
}

#[test]
fn encode_random_shapes_matches_cpu_bitwise() {
    for dev in devices() {
        let mut bytes = 0;
        for (i, c) in cases().iter().enumerate() {
            if c.codec == "raw" {
                continue;
            }
            let cache = synthetic(&[c.spec], c.dtype, 31 + i as u64);
            bytes += check_encode(&dev, &cache, c.codec, c.layout);
        }
        println!(
            "encode on {}: {bytes} section bytes identical to the CPU",
            dev.name()
        );
    }
}

#[test]
fn encode_hqmq_matches_cpu_bitwise() {
    let cases = [
        (
            "hqmq:s96r4",
            spec(1, 4, 300, 128),
            DType::Bf16,
            layout(128, 0, 0),
        ),
        (
            "hqmq:s24r3",
            spec(2, 2, 77, 64),
            DType::F16,
            layout(32, 0, 0),
        ),
        (
            "hqmq:s5r2:seed3",
            spec(1, 3, 70, 12),
            DType::F32,
            layout(32, 0, 0),
        ),
        (
            "hqmq:s32r2:g7",
            spec(1, 1, 9, 2048),
            DType::Bf16,
            layout(4, 0, 0),
        ),
        (
            "hqmq:s192r6",
            spec(1, 2, 40, 64),
            DType::Bf16,
            layout(16, 0, 0),
        ),
        // Outlier extraction: position lists (+med3) and bitmaps (+med1,
        // about half the chunks), one-token pages, a 4-wide head.
        (
            "hqmq:s96r4+med3",
            spec(1, 4, 300, 128),
            DType::Bf16,
            layout(128, 0, 0),
        ),
        (
            "hqmq:s24r3+med1",
            spec(2, 2, 77, 64),
            DType::F16,
            layout(32, 0, 0),
        ),
        (
            "hqmq:s5r2+med2:seed9",
            spec(1, 3, 70, 12),
            DType::F32,
            layout(1, 0, 0),
        ),
        (
            "hqmq:s32r2+med1.5:g7",
            spec(1, 1, 9, 4),
            DType::Bf16,
            layout(4, 0, 0),
        ),
        // Per-channel gains, with and without outliers, one-token pages,
        // a 2048-wide head.
        (
            "hqmq:s24r3+chan",
            spec(2, 2, 77, 64),
            DType::F16,
            layout(32, 0, 0),
        ),
        (
            "hqmq:s5r2+med2+chan:seed9",
            spec(1, 3, 70, 12),
            DType::F32,
            layout(1, 0, 0),
        ),
        (
            "hqmq:s96r4+med3+chan",
            spec(1, 4, 300, 128),
            DType::Bf16,
            layout(128, 0, 0),
        ),
        (
            "hqmq:s32r2+chan:g7",
            spec(1, 1, 9, 2048),
            DType::Bf16,
            layout(4, 0, 0),
        ),
        // Per-channel centring: the same shapes.
        (
            "hqmq:s24r3+ctr",
            spec(2, 2, 77, 64),
            DType::F16,
            layout(32, 0, 0),
        ),
        (
            "hqmq:s5r2+med2+ctr:seed9",
            spec(1, 3, 70, 12),
            DType::F32,
            layout(1, 0, 0),
        ),
        (
            "hqmq:s96r4+med3+ctr",
            spec(1, 4, 300, 128),
            DType::Bf16,
            layout(128, 0, 0),
        ),
        (
            "hqmq:s32r2+ctr:g7",
            spec(1, 1, 9, 2048),
            DType::Bf16,
            layout(4, 0, 0),
        ),
    ];
    for dev in devices() {
        let mut bytes = 0;
        for (i, (codec, s, dtype, l)) in cases.iter().enumerate() {
            let cache = synthetic(&[*s], *dtype, 71 + i as u64);
            bytes += check_encode(&dev, &cache, codec, *l);
        }
        let fixture = common::fixture().cache;
        bytes += check_encode(&dev, &fixture, "hqmq:s96r4", layout(256, 0, 0));
        // Every registered hqmq example on the real fixture.
        for ex in kvpack::codec::hqmq::FAMILY.examples {
            bytes += check_encode(&dev, &fixture, ex.name, layout(256, 0, 0));
        }
        println!(
            "hqmq encode on {}: {bytes} section bytes identical to the CPU",
            dev.name()
        );
    }
}

/// `codec` prepared for `cache` under layout `l` (InnerQ's key
/// normalization factors), as the compressor prepares it.
fn prepared(codec: &str, cache: &KvCache, l: Layout) -> Box<dyn kvpack::codec::Codec> {
    let c = kvpack::codec::parse(codec).unwrap();
    match c.prepare(&cache.view(), &l).unwrap() {
        Some(p) => p,
        None => c,
    }
}

/// Zeros of both signs, constant runs and a column of huge values in the
/// keys: minima that are a signed zero (the CPU's tie rule decides the
/// stored zero point's sign), groups with a zero scale.
fn with_zeros(mut cache: KvCache) -> KvCache {
    for t in &mut cache.tensors {
        let d = t.info.head_dim as usize;
        let put = |i: usize, x: f32| -> (usize, f32) { (i, x) };
        let edits: Vec<(usize, f32)> = (0..t.info.elements() as usize)
            .filter_map(|i| match (i / d) % 7 {
                0 if i % 3 == 0 => Some(put(i, 0.0)),
                0 if i % 3 == 1 => Some(put(i, -0.0)),
                0 => Some(put(i, (i % 5) as f32 * 0.25)),
                3 => Some(put(i, 0.5)),
                _ => None,
            })
            .collect();
        match &mut t.data {
            TensorData::Bf16(v) => edits.iter().for_each(|&(i, x)| v[i] = bf16::from_f32(x)),
            TensorData::F16(v) => edits.iter().for_each(|&(i, x)| v[i] = f16::from_f32(x)),
            TensorData::F32(v) => edits.iter().for_each(|&(i, x)| v[i] = x),
            TensorData::Fp8(..) => unreachable!("no fp8 here"),
        }
    }
    cache
}

/// kivi, innerq and polar (every registry example and further variants)
/// encoded on the GPU: the sections equal the CPU encoder's, on edge shapes
/// (partial token groups at page ends, batch > 1, head_dim 1024, groups of
/// 1 and 64, signed-zero minima, constant groups, f32 sources) and on the
/// real fixture.
#[test]
fn encode_group_and_polar_codecs_match_cpu_bitwise() {
    let codecs = [
        "kivi:2",
        "kivi:4",
        "kivi:3:g64",
        "kivi:8:g1",
        "innerq:k2v2",
        "innerq:k3v2:sym",
        "innerq:k4v3:asym:nonorm",
        "innerq:k4v2:sym",
        "innerq:k2v4:asym",
        "innerq:k1v8:g64",
        "innerq:k8v1:hybrid:g64:nonorm",
        "polar:m4n4",
        "polar:m4n2",
        "polar:m4n2:adjacent:vraw",
        "polar:m2n8:v2",
        "polar:m8n3:adjacent",
    ];
    let shapes = [
        (spec(1, 4, 300, 128), DType::Bf16, layout(128, 0, 0)),
        (spec(2, 2, 77, 64), DType::F16, layout(32, 0, 0)),
        (spec(1, 3, 45, 64), DType::F32, layout(16, 0, 0)),
        (spec(1, 1, 40, 1024), DType::Bf16, layout(40, 0, 0)),
        // Pages over 512 tokens: polar's separate scale kernel.
        (spec(1, 2, 600, 64), DType::Bf16, layout(600, 0, 0)),
    ];
    for dev in devices() {
        let mut bytes = 0;
        for (i, (s, dtype, l)) in shapes.iter().enumerate() {
            let cache = with_zeros(synthetic(&[*s], *dtype, 51 + i as u64));
            for codec in codecs {
                bytes += check_encode_with(&dev, &cache, prepared(codec, &cache, *l).as_ref(), *l);
            }
        }
        let fixture = common::fixture().cache;
        for codec in [
            "kivi:2",
            "kivi:4",
            "innerq:k2v2",
            "innerq:k3v2:sym",
            "polar:m4n4",
        ] {
            let l = layout(256, 0, 0);
            bytes += check_encode_with(&dev, &fixture, prepared(codec, &fixture, l).as_ref(), l);
        }
        println!(
            "kivi/innerq/polar encode on {}: {bytes} section bytes identical to the CPU",
            dev.name()
        );
    }
}

/// hqmq edge values, f32 source: zero rows and a plane of zeros with a
/// few non-zero chunks (median 0: every non-zero chunk an outlier), tiny
/// and subnormal chunks (the search's underflow fallback), chunks on the
/// Hurwitz units and their halves (exact ties between codewords), values
/// at the fp16 limit; S with its secondaries in global memory (300) and
/// above the cell index's range (3000: every chunk through the coset
/// search); with per-channel gains and centring (zero, subnormal and
/// fp16-limit gains, offsets at the fp16 limit).
#[test]
fn encode_hqmq_edge_values_match_cpu_bitwise() {
    let mut cache = synthetic(&[spec(1, 3, 48, 32)], DType::F32, 8);
    let set = [-1.0f32, -0.5, 0.0, 0.5, 1.0];
    for t in &mut cache.tensors {
        let TensorData::F32(v) = &mut t.data else {
            unreachable!("f32 cache")
        };
        let plane = 48 * 32;
        for (i, x) in v.iter_mut().enumerate() {
            let (p, row) = (i / plane, i % plane / 32);
            *x = match (p, row % 8) {
                (0, _) if row > 2 => 0.0,
                (0, _) => *x,
                (_, 0) => 0.0,
                (_, 1) => *x * 1e-33,
                (_, 2) => *x * 1e-41,
                (_, 3 | 4) => set[(i * 7 + i / 5) % 5],
                (_, 5) if i % 4 == 0 => 65504.0 * set[i / 4 % 5],
                (_, 5) => 0.0,
                _ => *x,
            };
        }
    }
    for dev in devices() {
        let mut bytes = 0;
        for codec in [
            "hqmq:s96r4",
            "hqmq:s24r3+med3",
            "hqmq:s5r2+med1",
            "hqmq:s300r2",
            "hqmq:s3000r2+med2",
            // Gains: zero channels (gain 0), subnormal and fp16-limit gains.
            "hqmq:s24r3+chan",
            "hqmq:s5r2+med1+chan",
            "hqmq:s24r3+ctr",
            "hqmq:s5r2+med1+ctr",
        ] {
            bytes += check_encode(&dev, &cache, codec, layout(16, 0, 0));
        }
        println!(
            "hqmq edge encode on {}: {bytes} section bytes identical to the CPU",
            dev.name()
        );
    }
}

#[test]
fn encode_fixture_matches_cpu_bitwise() {
    let cache = common::fixture().cache;
    for dev in devices() {
        for codec in ["bdr128", "bdr256", "int4", "int2", "bdr64:k"] {
            let n = check_encode(&dev, &cache, codec, layout(256, 0, 0));
            println!(
                "fixture {codec} encode on {}: {n} bytes identical",
                dev.name()
            );
        }
    }
}

/// Every octopus / turbo variant of the registry examples, plus the other
/// bit widths, splits and encoder searches: the unit-coded pages encoded
/// on the GPU equal the CPU's byte for byte, on the fixture (head_dim 256,
/// bf16) and on edge shapes (head_dim 8 to 2048, fp16 / fp32 sources,
/// batch 2, pages of 1 and of odd token counts, zero rows).
#[test]
fn encode_sphere_matches_cpu_bitwise() {
    let examples: Vec<&str> = kvpack::codec::registry::FAMILIES
        .iter()
        .filter(|f| f.name == "turbo" || f.name == "octopus")
        .flat_map(|f| f.examples.iter().map(|e| e.name))
        .collect();
    assert!(examples.len() >= 7, "{examples:?}");
    let mut codecs = examples.clone();
    codecs.extend([
        "turbo:b1",
        "turbo:b2",
        "turbo:b3+qjl",
        "turbo:b4",
        "turbo:b4+qjl",
        "turbo:b5:seed9",
        "turbo:b6+qjl",
        "octopus:b5+qjl",
        "octopus:d6n6",
        "octopus:d1n1+qjl",
        "octopus:b3:full",
        "octopus:b3+qjl:scalar",
    ]);
    let shapes = [
        (spec(1, 2, 37, 64), DType::Bf16, layout(16, 0, 0)),
        (spec(2, 1, 9, 32), DType::F16, layout(4, 0, 0)),
        (spec(1, 3, 5, 128), DType::F32, layout(2, 0, 0)),
        (spec(1, 1, 3, 8), DType::Bf16, layout(1, 0, 0)),
        (spec(1, 2, 6, 16), DType::F16, layout(4, 0, 0)),
        (spec(1, 1, 4, 1024), DType::Bf16, layout(4, 0, 0)),
        (spec(1, 1, 3, 2048), DType::F16, layout(2, 0, 0)),
    ];
    // The fixture's first three layers (K and V): the emulator runs every
    // shuffle as a context switch, and these rows already cover both
    // kernels' paths at head_dim 256.
    let mut fixture = common::fixture().cache;
    fixture.tensors.truncate(6);
    for dev in devices() {
        let mut bytes = 0;
        for codec in &examples {
            bytes += check_encode(&dev, &fixture, codec, layout(256, 0, 0));
        }
        for codec in &codecs {
            for (i, (s, dtype, l)) in shapes.iter().enumerate() {
                if codec.ends_with(":full") && s.head_dim > 64 {
                    continue; // every code pair per triplet: slow under the emulator
                }
                let mut cache = synthetic(&[*s], *dtype, 101 + i as u64);
                // A zero row (plane 0, token 1): gamma 0, u = 0.
                let d = s.head_dim as usize;
                match &mut cache.tensors[0].data {
                    TensorData::Bf16(v) => v[d..2 * d].fill(bf16::ZERO),
                    TensorData::F16(v) => v[d..2 * d].fill(f16::ZERO),
                    TensorData::F32(v) => v[d..2 * d].fill(0.0),
                    TensorData::Fp8(..) => unreachable!(),
                }
                bytes += check_encode(&dev, &cache, codec, *l);
            }
        }
        println!(
            "octopus / turbo encode on {}: {bytes} section bytes identical to the CPU",
            dev.name()
        );
    }
}

#[test]
fn encode_rejects_non_finite_rows() {
    let mut cache = synthetic(&[spec(1, 2, 40, 64)], DType::Bf16, 5);
    if let TensorData::Bf16(v) = &mut cache.tensors[1].data {
        v[(40 + 17) * 64 + 3] = bf16::NAN; // plane 1, token 17
    }
    let t = &cache.tensors[1];
    let pages = plan(std::slice::from_ref(&t.info), &[0], layout(16, 0, 0)).unwrap();
    for dev in devices() {
        for codec in ["int4", "bdr64", "hqmq:s24r3", "turbo:b3+qjl", "octopus:b3"] {
            let c = kvpack::codec::parse(codec).unwrap();
            let c = c
                .prepare(&cache.view(), &layout(16, 0, 0))
                .unwrap()
                .unwrap_or(c);
            let e = dev.encode_tensor(t, c.as_ref(), &pages).unwrap_err();
            let m = e.to_string();
            assert!(
                m.contains("plane 1 token 17"),
                "{} {codec}: {m}",
                dev.name()
            );
        }
    }
}

/// polar key pages at the edges of the GPU encoder's fast paths, equal to
/// the CPU's: a plane of zeros (scale 0), radius levels exactly on a
/// rounding boundary (2.5 of a scale of 1), pairs exactly half-way between
/// two directions (ties), axis and diagonal pairs, magnitudes outside the
/// fast window (subnormal, 1e-30, 1.5e38: scales whose reciprocal leaves
/// [1e-30, 1e30]), on head_dim 32 and 16 (the vectorized paths), 36 (the
/// generic path), f32 / bf16 / f16 sources, pages of 20 tokens (a partial
/// last page), and tables of 8 to 256 directions.
#[test]
fn encode_polar_edge_values_match_cpu_bitwise() {
    let fine = kvpack::kernels::polar::uniform_directions(5);
    for (dtype, d) in [
        (DType::F32, 32),
        (DType::Bf16, 32),
        (DType::F16, 32),
        (DType::Bf16, 16),
        (DType::F32, 36),
    ] {
        let (huge, tiny) = if dtype == DType::F16 {
            (6.0e4f32, 6.0e-8f32)
        } else {
            (1.5e38f32, 1.0e-30f32)
        };
        let mut cache = synthetic(&[spec(1, 4, 48, d)], dtype, 17);
        let h = d as usize / 2;
        let plane = 48 * d as usize;
        for t in &mut cache.tensors {
            let n = t.info.elements() as usize;
            let base: Vec<f32> = match &t.data {
                TensorData::F32(v) => v.clone(),
                TensorData::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
                TensorData::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
                TensorData::Fp8(..) => unreachable!("no fp8 here"),
            };
            let vals: Vec<f32> = (0..n)
                .map(|i| {
                    let (p, row, c) = (i / plane, i % plane / d as usize, i % d as usize);
                    // Pair j's x (first) or y (second) channel, half pairing.
                    let (j, second) = (c % h, c >= h);
                    let xy = |x: f32, y: f32| if second { y } else { x };
                    match (p, row % 8) {
                        (0, _) => 0.0,
                        (1, 0) => xy(15.0, 0.0),
                        (1, 1) => {
                            [xy(2.5, 0.0), xy(0.0, -10.5), xy(-7.5, 0.0), xy(0.5, 0.0)][j % 4]
                        }
                        (1, 2) => xy(3.0, -4.0),
                        (1, 3) => {
                            [xy(1.25, 1.25), xy(-1.25, 1.25), xy(2.0, -2.0), xy(0.0, 7.0)][j % 4]
                        }
                        (1, 4) => {
                            let u = fine[(2 * j + 1) % fine.len()];
                            xy(u[0] * 8.0, u[1] * 8.0)
                        }
                        (1, 5) => [xy(1.0e-40, 1.0e-41), xy(tiny, -tiny), xy(0.0, -tiny)][j % 3],
                        (1, _) => base[i] * 3.0,
                        (2, r) if r < 4 => (base[i] * huge).clamp(-huge, huge),
                        (3, r) if r < 4 => base[i] * tiny,
                        (3, 4) => base[i] * 1.0e-18,
                        _ => base[i],
                    }
                })
                .collect();
            match &mut t.data {
                TensorData::F32(v) => v.copy_from_slice(&vals),
                TensorData::Bf16(v) => v
                    .iter_mut()
                    .zip(&vals)
                    .for_each(|(o, &x)| *o = bf16::from_f32(x)),
                TensorData::F16(v) => v
                    .iter_mut()
                    .zip(&vals)
                    .for_each(|(o, &x)| *o = f16::from_f32(x)),
                TensorData::Fp8(..) => unreachable!("no fp8 here"),
            }
        }
        for dev in devices() {
            let mut bytes = 0;
            for codec in [
                "polar:m4n4",
                "polar:m4n2",
                "polar:m4n4:adjacent",
                "polar:m3n5",
                "polar:m6n2:adjacent",
                "polar:m8n8",
            ] {
                bytes += check_encode(&dev, &cache, codec, layout(20, 0, 0));
            }
            println!(
                "polar edge encode ({dtype:?}, head_dim {d}) on {}: {bytes} section bytes identical to the CPU",
                dev.name()
            );
        }
    }
}

/// kivi, innerq and polar refuse what their CPU encoders refuse: a NaN
/// (in K and V, plane 1 token 17) and values beyond the fp16 range of
/// their scales and zero points, with a parameter error naming the page's
/// plane and token (the row, or the first row of its token group).
#[test]
fn group_and_polar_encoders_reject_what_the_cpu_rejects() {
    let mut nan = synthetic(&[spec(1, 2, 40, 64)], DType::Bf16, 5);
    let mut huge = synthetic(&[spec(1, 2, 40, 64)], DType::F32, 6);
    for t in 0..2 {
        if let TensorData::Bf16(v) = &mut nan.tensors[t].data {
            v[(40 + 17) * 64 + 3] = bf16::NAN;
        }
        if let TensorData::F32(v) = &mut huge.tensors[t].data {
            v[(40 + 17) * 64 + 3] = -1.0e6;
        }
    }
    for dev in devices() {
        for cache in [&nan, &huge] {
            for codec in [
                "kivi:2",
                "innerq:k2v2:nonorm",
                "innerq:k3v2:sym:nonorm",
                "polar:m4n4",
            ] {
                let c = kvpack::codec::parse(codec).unwrap();
                for t in &cache.tensors {
                    let pages =
                        plan(std::slice::from_ref(&t.info), &[0], layout(16, 0, 0)).unwrap();
                    let cpu = kvpack::gpu::host::encode_tensor(t, c.as_ref(), &pages);
                    let got = dev.encode_tensor(t, c.as_ref(), &pages);
                    assert_eq!(
                        cpu.is_err(),
                        got.is_err(),
                        "{} {codec} {}",
                        dev.name(),
                        t.info.name
                    );
                    if let Err(e) = got {
                        let m = e.to_string();
                        assert!(
                            matches!(e, kvpack::error::Error::Parameter(_))
                                && m.contains("plane 1 token 1"),
                            "{} {codec}: {m}",
                            dev.name()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn fp16_source_with_subnormals_and_extremes() {
    // Values near fp16 limits and subnormals exercise the conversions.
    let mut cache = synthetic(&[spec(1, 1, 64, 64)], DType::F16, 3);
    for t in &mut cache.tensors {
        if let TensorData::F16(v) = &mut t.data {
            for (i, x) in v.iter_mut().enumerate() {
                *x = match i % 7 {
                    0 => f16::from_f32(6.0e-8),
                    1 => f16::from_f32(-65504.0),
                    2 => f16::from_f32(1.0e-5),
                    _ => *x,
                };
            }
        }
    }
    for dev in devices() {
        for codec in ["raw", "int4", "bdr64"] {
            let file = compress_bytes(&cache, codec, layout(32, 0, 0), None);
            check_decode(&dev, &file, 1, codec);
            if codec != "raw" {
                check_encode(&dev, &cache, codec, layout(32, 0, 0));
            }
        }
    }
}

#[test]
fn no_gpu_is_an_error_not_a_crash() {
    match Gpu::new(0) {
        Ok(g) => {
            assert!(Gpu::device_count() > 0);
            println!("CUDA device: {:?}", g.info());
        }
        Err(kvpack::Error::Unsupported(m)) => {
            println!("no CUDA: {m}");
            if !cfg!(feature = "cuda") {
                assert_eq!(m, kvpack::gpu::NO_CUDA);
            }
        }
        Err(e) => panic!("unexpected error kind: {e}"),
    }
}

#[test]
fn every_launched_kernel_is_defined_in_the_sources() {
    let defined: Vec<(String, String)> = kvpack::gpu::sources::ALL
        .iter()
        .flat_map(|s| {
            s.kernel_names()
                .into_iter()
                .map(|n| (s.name.to_string(), n))
        })
        .collect();
    for (src, name) in kvpack::gpu::all_kernel_names() {
        assert!(
            defined.iter().any(|(s, n)| s == src && *n == name),
            "kernel {name} is not defined in {src}.cu"
        );
    }
}

/// Compiles every source with NVRTC (needs only libnvrtc, no GPU). With
/// `KVPACK_PTX_DIR=dir` the PTX is written there (for `ptxas -v`).
#[cfg(feature = "cuda")]
#[test]
fn kernel_sources_compile_with_nvrtc() {
    match kvpack::gpu::compile_all((9, 0)) {
        Ok(ptx) => {
            for (name, text) in ptx {
                assert!(text.contains(".entry"), "{name}");
                println!("{name}.cu: {} bytes of PTX", text.len());
                if let Some(dir) = std::env::var_os("KVPACK_PTX_DIR") {
                    let p = std::path::Path::new(&dir).join(format!("{name}.ptx"));
                    std::fs::write(p, text).unwrap();
                }
            }
        }
        Err(kvpack::Error::Unsupported(m)) => println!("skipping NVRTC compile: {m}"),
        Err(e) => panic!("{e}"),
    }
}

/// The file-to-GPU path: a zstd + raw-window bdr128 file decoded through
/// small staging chunks (many chunks, both buffers reused) equals the CPU.
/// One contiguous target per tensor: tensor `t` whole into `bufs[t]`.
fn whole_tensors<'a>(
    infos: &[kvpack::cache::TensorInfo],
    bufs: &'a [kvpack::gpu::GpuBuffer<u16>],
) -> Vec<kvpack::gpu::Target<'a>> {
    infos
        .iter()
        .zip(bufs)
        .enumerate()
        .map(|(t, (i, buf))| kvpack::gpu::Target {
            tensor: t as u32,
            dst: kvpack::gpu::Dst::Contiguous {
                buf,
                first_token: 0,
                tokens: i.tokens,
            },
        })
        .collect()
}

#[test]
fn file_decoder_matches_cpu() {
    // bdr128 (phase 1) and VQ / group codecs whose kernels need side tables
    // (codebooks, signs, factors) uploaded once per file.
    let cache = common::fixture().cache;
    let l = layout(64, 4, 16);
    for codec in [
        "bdr128",
        "hqmq:s96r4+med3",
        "octopus:b3+qjl",
        "innerq:k2v2",
        "polar:m4n4",
    ] {
        let file = compress_bytes(&cache, codec, l, Some(1));
        let archive = Archive::open(&file).unwrap();
        for dev in devices() {
            let Device::Cuda(gpu) = &dev else {
                println!("file decoder: CPU path is Archive::decode (the oracle itself)");
                continue;
            };
            let mut fd = kvpack::gpu::FileDecoder::new(gpu, 1 << 20).unwrap();
            let infos = archive.tensors();
            let bufs: Vec<_> = infos
                .iter()
                .map(|i| gpu.upload(&vec![POISON; i.elements() as usize]).unwrap())
                .collect();
            let targets = whole_tensors(&infos, &bufs);
            for round in 0..2 {
                let stats = fd.decode(&archive, &targets, OutType::Bf16).unwrap();
                assert!(stats.chunks >= 2, "{stats:?}");
                for (t, i) in infos.iter().enumerate() {
                    let want = oracle(
                        &archive,
                        t,
                        OutType::Bf16,
                        &HostLayout::Contiguous {
                            first_token: 0,
                            tokens: i.tokens,
                        },
                    );
                    let got = bufs[t].to_vec().unwrap();
                    assert_close(
                        &got,
                        &want,
                        &format!("{codec} file decoder round {round} tensor {t}"),
                    );
                }
                println!("{codec} file decoder round {round}: {stats:?}");
            }
        }
    }
}

#[test]
fn keys_only_bdr_leaves_values_unrotated() {
    // bdr64:k: K pages rotated, V pages plain int4; both decode right.
    let cache = synthetic(&[spec(1, 2, 64, 64)], DType::Bf16, 11);
    let file = compress_bytes(&cache, "bdr64:k", layout(32, 0, 0), None);
    let archive = Archive::open(&file).unwrap();
    assert_eq!(archive.tensors()[1].kind, Kind::Value);
    for dev in devices() {
        check_decode(&dev, &file, 3, "bdr64:k");
    }
}

/// Which kind of error: hostile input must be refused by every device
/// path with the same kind as the CPU reader.
fn error_class(e: &kvpack::Error) -> std::mem::Discriminant<kvpack::Error> {
    std::mem::discriminant(e)
}

/// Every committed invalid vector (format/vectors/invalid/) is refused by
/// every device's decode path (CPU host path, the SIMT emulator under
/// `KVPACK_GPU_EMU=1`, CUDA when present: `decode_tensor` and the
/// `FileDecoder`) with the same kind of error as the CPU reader
/// (`Archive::decode`): the device paths go through the same reader checks
/// (limits, codec vs tensor, CRCs, private page copies), and declared
/// sizes are bounded before any host or device buffer is allocated.
#[test]
fn invalid_vectors_are_refused_by_every_device_like_the_cpu_reader() {
    let dir = common::repo("format/vectors/invalid");
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "kvpack"))
        .collect();
    names.sort();
    assert!(names.len() >= 10, "{names:?}");
    let devs = devices();
    let mut decoded = 0;
    for path in names {
        let f = path.file_name().unwrap().to_string_lossy().to_string();
        let bytes = std::fs::read(&path).unwrap();
        let archive = match Archive::open(&bytes) {
            // Refused when opened: the same `Archive::open` for every
            // device, nothing device-specific runs.
            Err(_) => continue,
            Ok(a) => a.with_private_pages(true),
        };
        let cpu = archive
            .decode(&Default::default(), None, None)
            .expect_err(&format!("{f} accepted by the CPU reader"));
        decoded += 1;
        for dev in &devs {
            let got = (0..archive.tensors().len())
                .map(|t| {
                    let info = &archive.tensors()[t];
                    dev.decode_tensor(
                        &archive,
                        t,
                        OutType::Bf16,
                        &HostLayout::Contiguous {
                            first_token: 0,
                            tokens: info.tokens,
                        },
                    )
                })
                .find_map(|r| r.err())
                .unwrap_or_else(|| panic!("{f} accepted by {}", dev.name()));
            assert_eq!(
                error_class(&got),
                error_class(&cpu),
                "{f} on {}: {got} (CPU: {cpu})",
                dev.name()
            );
            println!("{f} on {}: {got}", dev.name());
            if let Device::Cuda(gpu) = dev
                && archive.tensors().iter().all(|i| i.elements() < 1 << 24)
            {
                let bufs: Vec<_> = archive
                    .tensors()
                    .iter()
                    .map(|i| gpu.alloc::<u16>(i.elements() as usize).unwrap())
                    .collect();
                let targets = whole_tensors(&archive.tensors(), &bufs);
                let mut fd = kvpack::gpu::FileDecoder::new(gpu, 1 << 20).unwrap();
                let e = fd
                    .decode(&archive, &targets, OutType::Bf16)
                    .expect_err(&format!("{f} accepted by the file decoder"));
                assert_eq!(error_class(&e), error_class(&cpu), "{f}: {e} (CPU: {cpu})");
            }
        }
    }
    // Some vectors open and fail only when pages are decoded.
    assert!(decoded >= 3, "{decoded}");
}
