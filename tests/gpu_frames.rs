//! Files kept in device memory (CUDA only; without a GPU each test says
//! why it was skipped): the CRC-32 computed on the device, page frames
//! built and checksummed on the device (`Gpu::encode_paged_device`)
//! byte-identical to the host's file, and decode from a file in device
//! memory (`Gpu::decode_paged_resident`) identical to the staged decode.
#![cfg(feature = "cuda")]

mod common;

use common::Rng;
use half::{bf16, f16};
use kvpack::cache::DType;
use kvpack::decode::Archive;
use kvpack::gpu::paged::{PagedCache, PagedLayout, PagedShape};
use kvpack::gpu::{Gpu, GpuBuffer, POISON};
use kvpack::plan::Layout;

fn gpu() -> Option<Gpu> {
    match Gpu::new(0) {
        Ok(g) => Some(g),
        Err(e) => {
            eprintln!("skipping: {e}");
            None
        }
    }
}

fn layout(page_tokens: u32, sink: u32, recent: u32) -> Layout {
    Layout {
        page_tokens,
        sink,
        recent,
    }
}

fn random_image(rng: &mut Rng, shape: &PagedShape, dtype: DType) -> Vec<u16> {
    (0..2 * shape.kv_elements())
        .map(|_| {
            let x = (rng.normal() * 0.7) as f32;
            match dtype {
                DType::Bf16 => bf16::from_f32(x).to_bits(),
                _ => f16::from_f32(x).to_bits(),
            }
        })
        .collect()
}

fn block_table(rng: &mut Rng, n: usize, num_blocks: u32) -> Vec<i64> {
    let mut ids: Vec<i64> = (0..i64::from(num_blocks)).collect();
    for i in (1..ids.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        ids.swap(i, j);
    }
    ids.truncate(n);
    ids
}

/// The cache over a device copy of `image`.
fn cache(buf: &GpuBuffer<u16>, pl: PagedLayout, shape: &PagedShape, dtype: DType) -> PagedCache {
    let at = buf.device_ptr();
    let v = (!pl.joint()).then_some(at + 2 * shape.kv_elements());
    // SAFETY: `buf` holds the image (K then V for HND) and outlives every
    // use of the cache in these tests (each call waits for its work).
    unsafe { PagedCache::from_raw(pl, dtype, &shape.dims(pl), at, v).unwrap() }
}

/// CRC-32 of spans of every length class (empty, shorter than the block's
/// threads, unaligned, several chunks per thread) equals crc32fast.
#[test]
fn device_crc32_is_crc32fast() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(5);
    let data: Vec<u8> = (0..300_000).map(|_| rng.next_u64() as u8).collect();
    let buf = g.upload(&data).unwrap();
    let spans = [
        (0, 0),
        (3, 1),
        (7, 60),
        (64, 64),
        (1, 255),
        (0, 256),
        (5, 257),
        (11, 4099),
        (0, 65_536),
        (17, 299_983),
    ];
    let got = g.crc32_spans(&buf, &spans).unwrap();
    for (&(o, n), c) in spans.iter().zip(got) {
        assert_eq!(c, crc32fast::hash(&data[o..o + n]), "span {o}+{n}");
    }
    assert!(g.crc32_spans(&buf, &[(299_999, 2)]).is_err());
}

/// Every codec with a GPU encoder, from the three paged layouts, with and
/// without windows, bf16 and fp16: the file framed on the device equals
/// `encode_paged`'s host-framed file byte for byte (hqmq `+med` and zstd
/// take the host framing and are compared too); an output that is too
/// small is refused before anything is written past it.
#[test]
fn device_framed_files_equal_host_framed_files() {
    let Some(g) = gpu() else { return };
    let codecs = [
        "raw",
        "int4",
        "bdr32",
        "hqmq:s96r4",
        "hqmq:s24r3+med3",
        "kivi:2",
        "polar:m4n4",
        "innerq:k2v2",
        "turbo:b3",
        "octopus:b3+qjl",
    ];
    let mut rng = Rng(77);
    let mut compared = 0;
    for (dtype, heads, head_dim, tokens) in [(DType::Bf16, 2, 64, 75), (DType::F16, 3, 32, 40)] {
        let shape = PagedShape {
            num_blocks: 9,
            block_size: 16,
            kv_heads: heads,
            head_dim,
        };
        let image = random_image(&mut rng, &shape, dtype);
        let ids = block_table(&mut rng, 9, 9);
        let dev_image = g.upload(&image).unwrap();
        for pl in [PagedLayout::FlashAttn, PagedLayout::Hnd] {
            let c = cache(&dev_image, pl, &shape, dtype);
            for codec in codecs {
                for (l, zstd) in [
                    (layout(32, 0, 0), None),
                    (layout(16, 8, 20), None),
                    (layout(32, 0, 0), Some(1)),
                ] {
                    let cd = kvpack::codec::parse(codec).unwrap();
                    let opts = kvpack::compress::CompressOptions {
                        layout: l,
                        zstd_level: zstd,
                        ..Default::default()
                    };
                    let (want, _) = g
                        .encode_paged(&c, &ids, tokens, cd.as_ref(), 3, &opts, Vec::new())
                        .unwrap();
                    let out = g.alloc::<u8>(want.len() + 100).unwrap();
                    out.fill_bytes(0xa5).unwrap();
                    // SAFETY: `out` holds the capacity given; the call waits.
                    let (n, report) = unsafe {
                        g.encode_paged_device(
                            &c,
                            &ids,
                            tokens,
                            cd.as_ref(),
                            3,
                            &opts,
                            out.device_ptr(),
                            out.len() as u64,
                        )
                    }
                    .unwrap_or_else(|e| panic!("{codec} {pl:?} {l:?}: {e}"));
                    let got = out.to_vec().unwrap();
                    assert_eq!(n as usize, want.len(), "{codec} {pl:?} {l:?} {zstd:?}");
                    assert_eq!(report.output_bytes, n);
                    assert!(
                        got[..want.len()] == want[..],
                        "{codec} {pl:?} {dtype:?} {l:?} {zstd:?}: device-framed file differs"
                    );
                    assert!(
                        got[want.len()..].iter().all(|&b| b == 0xa5),
                        "wrote past the file"
                    );
                    compared += 1;
                    // Too small an output: refused, nothing written past it.
                    let small = g.alloc::<u8>(want.len() - 1).unwrap();
                    // SAFETY: as above.
                    let r = unsafe {
                        g.encode_paged_device(
                            &c,
                            &ids,
                            tokens,
                            cd.as_ref(),
                            3,
                            &opts,
                            small.device_ptr(),
                            small.len() as u64,
                        )
                    };
                    assert!(
                        matches!(r, Err(kvpack::Error::Parameter(_))),
                        "{codec}: {r:?}"
                    );
                }
            }
        }
    }
    println!("device-framed files: {compared} byte-identical to the host's");
}

/// Decoding from a device copy of the file (bodies read in place) writes
/// exactly what the staged decode writes, zstd pages (inflated and
/// uploaded) included, and uploads only descriptors for the rest.
#[test]
fn resident_decode_equals_staged_decode() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(31);
    let shape = PagedShape {
        num_blocks: 12,
        block_size: 16,
        kv_heads: 2,
        head_dim: 64,
    };
    let dtype = DType::Bf16;
    let image = random_image(&mut rng, &shape, dtype);
    let src_image = g.upload(&image).unwrap();
    let ids = block_table(&mut rng, 12, 12);
    let tokens = 150;
    let mut checked = 0;
    for pl in [
        PagedLayout::FlashAttn,
        PagedLayout::FlashInfer,
        PagedLayout::Hnd,
    ] {
        let src = cache(&src_image, pl, &shape, dtype);
        for codec in [
            "raw",
            "int4",
            "bdr64",
            "hqmq:s24r3+med3",
            "kivi:2",
            "polar:m4n4",
            "turbo:b3",
        ] {
            for (l, zstd) in [(layout(32, 4, 16), None), (layout(64, 0, 0), Some(3))] {
                let cd = kvpack::codec::parse(codec).unwrap();
                let opts = kvpack::compress::CompressOptions {
                    layout: l,
                    zstd_level: zstd,
                    ..Default::default()
                };
                let (file, _) = g
                    .encode_paged(&src, &ids, tokens, cd.as_ref(), 0, &opts, Vec::new())
                    .unwrap();
                let archive = Archive::open(&file).unwrap();
                let dev_file = g.upload(&file).unwrap();
                let dst_ids = block_table(&mut rng, 12, 12);
                let run = |resident: bool| {
                    let out = g.upload(&vec![POISON; image.len()]).unwrap();
                    let c = cache(&out, pl, &shape, dtype);
                    let job = if resident {
                        // SAFETY: `dev_file` holds the archive's bytes,
                        // unchanged until the job is waited for.
                        unsafe {
                            g.decode_paged_resident(
                                &archive,
                                dev_file.device_ptr(),
                                0,
                                &c,
                                &dst_ids,
                            )
                        }
                    } else {
                        g.decode_paged(&archive, 0, &c, &dst_ids)
                    }
                    .unwrap();
                    let stats = job.wait().unwrap();
                    (out.to_vec().unwrap(), stats)
                };
                let (want, staged) = run(false);
                let (got, resident) = run(true);
                assert!(
                    got == want,
                    "{codec} {pl:?} {l:?} {zstd:?}: resident decode differs"
                );
                assert!(
                    resident.uploaded_bytes < staged.uploaded_bytes
                        || (zstd.is_some() && resident.uploaded_bytes == staged.uploaded_bytes),
                    "{codec}: resident uploaded {} of {}",
                    resident.uploaded_bytes,
                    staged.uploaded_bytes
                );
                checked += 1;
            }
        }
    }
    println!("resident decode: {checked} files identical to the staged decode");
}
