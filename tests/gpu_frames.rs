//! Files kept in device memory (CUDA only; without a GPU each test says
//! why it was skipped): the CRC-32 computed on the device, page frames
//! built and checksummed on the device (`Gpu::encode_paged_device`)
//! byte-identical to the host's file, and decode from a file in device
//! memory (`Gpu::decode_paged_resident`) identical to the staged decode.
#![cfg(feature = "cuda")]

mod common;

use common::{Rng, block_table, random_image};
use kvpack::cache::DType;
use kvpack::decode::Archive;
use kvpack::gpu::paged::{PagedCache, PagedLayout, PagedShape};
use kvpack::gpu::{Gpu, GpuBuffer, POISON};
use kvpack::plan::Layout;

/// The process's device 0 and the lock that runs these tests one at a
/// time: `Gpu::new` hands every thread the same device, whose one-slot
/// plan cache (the last device-checked decode's plan) the tests asserting
/// plan reuse would otherwise see replaced by a concurrent test's decode.
fn gpu() -> Option<(std::sync::MutexGuard<'static, ()>, Gpu)> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    match Gpu::new(0) {
        Ok(g) => Some((serial, g)),
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

/// A random bf16 layer (2 kv heads, head_dim 64, blocks of 16) of
/// `num_blocks` blocks on the device, with a shuffled table of every
/// block: the rng (for more), shape, dtype, host image, device image and
/// block table.
fn layer(
    g: &Gpu,
    seed: u64,
    num_blocks: u32,
) -> (Rng, PagedShape, DType, Vec<u16>, GpuBuffer<u16>, Vec<i64>) {
    let mut rng = Rng(seed);
    let shape = PagedShape {
        num_blocks,
        block_size: 16,
        kv_heads: 2,
        head_dim: 64,
    };
    let image = random_image(&mut rng, &shape, DType::Bf16);
    let src_image = g.upload(&image).unwrap();
    let ids = block_table(&mut rng, num_blocks as usize, num_blocks);
    (rng, shape, DType::Bf16, image, src_image, ids)
}

/// The codec `codec` and compress options with layout `l` and zstd level
/// `zstd`.
fn codec_opts(
    codec: &str,
    l: Layout,
    zstd: Option<i32>,
) -> (
    Box<dyn kvpack::codec::Codec>,
    kvpack::compress::CompressOptions,
) {
    let opts = kvpack::compress::CompressOptions {
        layout: l,
        zstd_level: zstd,
        ..Default::default()
    };
    (kvpack::codec::parse(codec).unwrap(), opts)
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
    let Some((_serial, g)) = gpu() else { return };
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
    let Some((_serial, g)) = gpu() else { return };
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
                    let (cd, opts) = codec_opts(codec, l, zstd);
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

/// The two decodes of a file in device memory against the staged decode
/// (the file's pages checked on the host and uploaded), for every codec,
/// the three paged layouts, with and without windows and zstd:
/// `decode_paged_resident` (a host copy checked, bodies read in place) and
/// `decode_paged_device` (only headers, section tables and the sections a
/// codec checks read back; CRCs and padding checked on the GPU; hqmq, whose
/// checks read its code streams, and zstd pages read back whole) write
/// exactly what the staged decode writes, and upload only descriptors where
/// the bodies are read in place.
#[test]
fn device_memory_decodes_equal_staged_decode() {
    let Some((_serial, g)) = gpu() else { return };
    let (mut rng, shape, dtype, image, src_image, ids) = layer(&g, 41, 12);
    let tokens = 150;
    let (mut resident_n, mut quick) = (0, 0);
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
            "polar:m4n4",
            "kivi:2",
            "innerq:k2v2",
            "turbo:b3+qjl",
            "hqmq:s24r3+med3",
        ] {
            for (l, zstd) in [(layout(32, 4, 16), None), (layout(64, 0, 0), Some(3))] {
                let (cd, opts) = codec_opts(codec, l, zstd);
                let (file, _) = g
                    .encode_paged(&src, &ids, tokens, cd.as_ref(), 0, &opts, Vec::new())
                    .unwrap();
                let archive = Archive::open(&file).unwrap();
                let dev_file = g.upload(&file).unwrap();
                let dst_ids = block_table(&mut rng, 12, 12);
                let run = |how: u8| {
                    let out = g.upload(&vec![POISON; image.len()]).unwrap();
                    let c = cache(&out, pl, &shape, dtype);
                    let (at, n) = (dev_file.device_ptr(), file.len() as u64);
                    // SAFETY: `dev_file` holds the archive's bytes,
                    // unchanged until the job is waited for.
                    let job = match how {
                        0 => g.decode_paged(&archive, 0, &c, &dst_ids),
                        1 => unsafe { g.decode_paged_resident(&archive, at, 0, &c, &dst_ids) },
                        _ => unsafe { g.decode_paged_device(at, n, 0, &c, &dst_ids) },
                    };
                    let stats = job.unwrap().wait().unwrap();
                    (out.to_vec().unwrap(), stats)
                };
                let what = format!("{codec} {pl:?} {l:?} {zstd:?}");
                let (want, staged) = run(0);
                let (got, resident) = run(1);
                assert!(got == want, "{what}: resident decode differs");
                assert!(
                    resident.uploaded_bytes < staged.uploaded_bytes
                        || (zstd.is_some() && resident.uploaded_bytes == staged.uploaded_bytes),
                    "{what}: resident uploaded {} of {}",
                    resident.uploaded_bytes,
                    staged.uploaded_bytes
                );
                resident_n += 1;
                let (got, device) = run(2);
                assert!(got == want, "{what}: device decode differs");
                if zstd.is_none() && !codec.starts_with("hqmq") {
                    assert!(
                        device.uploaded_bytes < 65536,
                        "{what}: uploaded {}",
                        device.uploaded_bytes
                    );
                    quick += 1;
                }
            }
        }
    }
    assert_eq!(quick, 21);
    println!(
        "decode from device memory: {resident_n} files, resident and device decodes identical to \
         the staged decode, {quick} on the device-checked path"
    );
}

/// A flipped byte anywhere in the layer's frames (page header, section
/// table, body, frame padding, index) is refused with a format error by
/// the decode from device memory, and the cache is left untouched.
#[test]
fn device_decode_refuses_every_flipped_byte_class() {
    let Some((_serial, g)) = gpu() else { return };
    let (_, shape, dtype, _, src_image, ids) = layer(&g, 43, 8);
    let pl = PagedLayout::FlashAttn;
    let src = cache(&src_image, pl, &shape, dtype);
    let opts = kvpack::compress::CompressOptions {
        layout: layout(32, 0, 0),
        // 4 KiB frames: every page frame ends in padding.
        align_log2: 12,
        ..Default::default()
    };
    let cd = kvpack::codec::parse("bdr64").unwrap();
    let (file, _) = g
        .encode_paged(&src, &ids, 100, cd.as_ref(), 0, &opts, Vec::new())
        .unwrap();
    let archive = Archive::open(&file).unwrap();
    let r = archive.reader();
    let e = r.index().entries[1];
    let frame = (r.header_len() + e.offset) as usize;
    let h = kvpack::format::PageHeader::parse(
        file[frame..frame + 64].try_into().unwrap(),
        &kvpack::error::Location::Header,
        &Default::default(),
    )
    .unwrap();
    let body = frame + 64;
    let index = (r.header_len() + r.trailer().index_offset) as usize;
    let flips = [
        ("page header", frame + 10),
        ("section table", body + 5),
        ("body", body + 200),
        ("last body byte", body + h.stored_len as usize - 1),
        ("frame padding", body + h.stored_len as usize + 7),
        ("index", index + 70),
    ];
    for (what, at) in flips {
        let mut bad = file.clone();
        bad[at] ^= 0x10;
        refused_on_device(&g, &bad, pl, &shape, &ids, what);
    }
    println!(
        "device decode: {} flipped-byte classes refused, cache untouched",
        flips.len()
    );
}

/// The next layer of a handoff: files of identical structure whose pages
/// differ only in content and CRCs, decoded from device memory one after
/// the other, reuse the first one's plan. Each decode must still equal
/// the staged decode of its own file, and a damaged file that follows an
/// intact one (a flipped body byte, body CRC field, header CRC field,
/// index entry CRC, section table byte, padding byte) must still be
/// refused with the cache untouched.
#[test]
fn device_decode_reuses_plans_and_still_refuses_damage() {
    let Some((_serial, g)) = gpu() else { return };
    let pl = PagedLayout::FlashAttn;
    let opts = kvpack::compress::CompressOptions {
        layout: layout(32, 4, 16),
        align_log2: 12,
        ..Default::default()
    };
    for codec in ["bdr64", "int4", "polar:m4n4"] {
        let cd = kvpack::codec::parse(codec).unwrap();
        // Three "layers": different values, one block table, one structure.
        let mut files = Vec::new();
        let mut shape_ids = None;
        for seed in [61, 62, 63] {
            let (_, shape, dtype, _, src_image, ids) = layer(&g, seed, 8);
            let ids = shape_ids.get_or_insert((shape, ids)).1.clone();
            let src = cache(&src_image, pl, &shape, dtype);
            let (file, _) = g
                .encode_paged(&src, &ids, 120, cd.as_ref(), 0, &opts, Vec::new())
                .unwrap();
            files.push(file);
        }
        let (shape, ids) = shape_ids.unwrap();
        assert_eq!(files[0].len(), files[1].len(), "{codec}: one structure");
        assert_ne!(files[0], files[1], "{codec}: different content");
        let decode = |file: &[u8], device: bool| {
            let out = g
                .upload(&vec![POISON; 2 * shape.kv_elements() as usize])
                .unwrap();
            let c = cache(&out, pl, &shape, DType::Bf16);
            let dev_file = g.upload(file).unwrap();
            let r = if device {
                // SAFETY: `dev_file` holds `file`, unchanged until the job
                // is waited for.
                unsafe {
                    g.decode_paged_device(dev_file.device_ptr(), file.len() as u64, 0, &c, &ids)
                }
            } else {
                let a = Archive::open(file).unwrap();
                g.decode_paged(&a, 0, &c, &ids)
            };
            r.and_then(|j| j.wait())
                .map(|stats| (out.to_vec().unwrap(), stats.plan_reused))
        };
        for (i, f) in files.iter().enumerate() {
            let (want, _) = decode(f, false).unwrap();
            let (got, reused) = decode(f, true).unwrap();
            assert!(got == want, "{codec}: device decode of file {i} differs");
            assert_eq!(reused, i > 0, "{codec}: plan reuse for file {i}");
        }
        let (h, index, entry) = places(&files[1], 2);
        let stored = u64::from_le_bytes(files[1][h + 24..h + 32].try_into().unwrap()) as usize;
        let flips = [
            ("body", h + 64 + 300),
            ("header body CRC field", h + 41),
            ("header CRC field", h + 62),
            ("index entry body CRC", entry + 33),
            ("index header", index + 5),
            ("section table", h + 64 + 9),
            ("frame padding", h + 64 + stored + 3),
        ];
        for (what, at) in flips {
            // An intact layer first: its plan is the one the damaged file
            // would reuse.
            assert!(decode(&files[0], true).is_ok(), "{codec}: intact layer");
            assert!(
                decode(&files[2], true).unwrap().1,
                "{codec}: intact layer, plan reused"
            );
            let mut bad = files[1].clone();
            bad[at] ^= 0x04;
            refused_on_device(&g, &bad, pl, &shape, &ids, &format!("{codec} {what}"));
        }
        let (want, _) = decode(&files[2], false).unwrap();
        assert!(
            decode(&files[2], true).unwrap().0 == want,
            "{codec}: after the refusals"
        );
    }
    println!(
        "device decode: plans reused across 3 codecs, 7 damage classes refused after an intact layer"
    );
}

/// Decodes layer 0 of `bad` from device memory into a poisoned bf16 cache:
/// asserts a format error and that no element of the cache was written.
fn refused_on_device(
    g: &Gpu,
    bad: &[u8],
    pl: PagedLayout,
    shape: &PagedShape,
    ids: &[i64],
    what: &str,
) {
    let dev_file = g.upload(bad).unwrap();
    let out = g
        .upload(&vec![POISON; 2 * shape.kv_elements() as usize])
        .unwrap();
    let c = cache(&out, pl, shape, DType::Bf16);
    // SAFETY: `dev_file` holds `bad`, unchanged until the call returns.
    let r = unsafe { g.decode_paged_device(dev_file.device_ptr(), bad.len() as u64, 0, &c, ids) }
        .and_then(|j| j.wait());
    assert!(
        matches!(r, Err(kvpack::Error::Format { .. })),
        "{what}: {r:?}"
    );
    assert!(
        out.to_vec().unwrap().iter().all(|&x| x == POISON),
        "{what}: cache written"
    );
}

/// File offsets of page `page`'s frame, of the index frame and of the
/// page's index entry in `file`.
fn places(file: &[u8], page: usize) -> (usize, usize, usize) {
    let a = Archive::open(file).unwrap();
    let r = a.reader();
    let frame = (r.header_len() + r.index().entries[page].offset) as usize;
    let index = (r.header_len() + r.trailer().index_offset) as usize;
    let entry = index + 64 + 4 * r.header().tensors.len() + 40 * page;
    (frame, index, entry)
}

/// Recomputes every CRC that covers the body of the page framed at `h`
/// (its header's body CRC and header CRC, its index entry at `entry`, the
/// index body and header at `index`), as a writer sealing a tampered body
/// would.
fn reseal(file: &mut [u8], (h, index, entry): (usize, usize, usize)) {
    let stored = u64::from_le_bytes(file[h + 24..h + 32].try_into().unwrap()) as usize;
    let crc = crc32fast::hash(&file[h + 64..h + 64 + stored]).to_le_bytes();
    file[h + 40..h + 44].copy_from_slice(&crc);
    let hc = crc32fast::hash(&file[h..h + 60]).to_le_bytes();
    file[h + 60..h + 64].copy_from_slice(&hc);
    file[entry + 32..entry + 36].copy_from_slice(&crc);
    let body_len = u64::from_le_bytes(file[index + 32..index + 40].try_into().unwrap()) as usize;
    let bc = crc32fast::hash(&file[index + 64..index + 64 + body_len]).to_le_bytes();
    file[index + 40..index + 44].copy_from_slice(&bc);
    let ic = crc32fast::hash(&file[index..index + 60]).to_le_bytes();
    file[index + 60..index + 64].copy_from_slice(&ic);
}

/// Content the codec forbids, sealed with valid CRCs (a NaN scale of
/// kivi, innerq and turbo; a non-zero byte in the padding after a section
/// of int4): the host decoder rejects it, and so does the decode from
/// device memory (the scales read back and checked by the codec's own
/// page check; the padding checked on the device), leaving the cache
/// untouched.
#[test]
fn device_decode_runs_the_codecs_content_checks() {
    use kvpack::format::SectionKind;
    let Some((_serial, g)) = gpu() else { return };
    let (_, shape, dtype, image, src_image, ids) = layer(&g, 47, 8);
    let pl = PagedLayout::FlashAttn;
    let src = cache(&src_image, pl, &shape, dtype);
    let opts = kvpack::compress::CompressOptions {
        layout: layout(32, 0, 0),
        ..Default::default()
    };
    // (codec, section, f16 NaN / f32 NaN / pad byte)
    let cases = [
        ("kivi:2", SectionKind::Scale, "f16"),
        ("innerq:k2v2", SectionKind::Scale, "f16"),
        ("turbo:b3", SectionKind::Scale, "f32"),
        ("int4", SectionKind::Scale, "pad"),
    ];
    for (codec, kind, how) in cases {
        let cd = kvpack::codec::parse(codec).unwrap();
        let (file, _) = g
            .encode_paged(&src, &ids, 100, cd.as_ref(), 0, &opts, Vec::new())
            .unwrap();
        // Page 3 holds K tokens 96..100: short sections, padded.
        let page = if how == "pad" { 3 } else { 1 };
        let at = places(&file, page);
        let d = {
            let a = Archive::open(&file).unwrap();
            let v = a.reader().page(page).unwrap();
            *v.sections().iter().find(|d| d.kind == kind).unwrap()
        };
        let mut bad = file.clone();
        let sec = at.0 + 64 + d.offset as usize;
        match how {
            "f16" => bad[sec..sec + 2].copy_from_slice(&0x7e00u16.to_le_bytes()),
            "f32" => bad[sec..sec + 4].copy_from_slice(&f32::NAN.to_le_bytes()),
            _ => {
                let pad = sec + d.len as usize;
                assert!(
                    !(pad - at.0).is_multiple_of(64),
                    "the section ends on a 64-byte boundary"
                );
                bad[pad] = 1;
            }
        }
        reseal(&mut bad, at);
        let host = Archive::open(&bad).and_then(|a| {
            let out = g.upload(&vec![POISON; image.len()])?;
            let c = cache(&out, pl, &shape, dtype);
            g.decode_paged(&a, 0, &c, &ids)?.wait()
        });
        assert!(
            matches!(host, Err(kvpack::Error::Format { .. })),
            "{codec} host: {host:?}"
        );
        refused_on_device(&g, &bad, pl, &shape, &ids, &format!("{codec} {how}"));
    }
    println!(
        "device decode: {} sealed content faults refused like the host",
        cases.len()
    );
}
