//! Hostile inputs (issue "hostile input, faults and the network"): small
//! files that declare huge sizes, codec tables that cost gigabytes, zstd
//! bombs, layer indices near u32::MAX, codec parameters that do not fit the
//! tensor, a flipped bit in the final trailer. Each is built here with the
//! public format API and fed to the release CLI, which must reject it with
//! exit 2 or 3, a message naming the field, quickly and in little memory.
//!
//! `KVPACK_HOSTILE_OUT=dir cargo test --release --test hostile -- --ignored
//! write_hostile_files` writes the files to `dir` for measurements with
//! `/usr/bin/time -v`.

mod common;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvpack::cache::{DType, Kind, TensorInfo};
use kvpack::format::{
    CodecEntry, ElemType, FileHeader, Index, IndexEntry, PageFrame, PageMeta, Section, SectionKind,
    Trailer,
};

fn tensor(layer: u32, kind: Kind, heads: u32, tokens: u32, head_dim: u32) -> TensorInfo {
    TensorInfo {
        name: format!(
            "past_key_values.{layer}.{}",
            if kind == Kind::Key { "key" } else { "value" }
        ),
        layer,
        kind,
        dtype: DType::Bf16,
        batch: 1,
        heads,
        tokens,
        head_dim,
    }
}

fn header(tensors: Vec<TensorInfo>, codecs: Vec<CodecEntry>) -> FileHeader {
    FileHeader {
        version_major: 1,
        version_minor: 0,
        align_log2: 6,
        tensors,
        codecs,
        metadata: Default::default(),
        page_tokens: 256,
        sink_tokens: 0,
        recent_tokens: 0,
    }
}

fn raw_entry() -> CodecEntry {
    let c = kvpack::codec::parse("raw").unwrap();
    CodecEntry {
        id: c.id(),
        params: c.params(),
    }
}

/// A page holding one tiny RAW section, whatever the tokens it claims.
fn tiny_page(tensor: u32, tokens: u32) -> PageFrame {
    let s = Section {
        kind: SectionKind::Raw,
        stream: 0,
        elem: ElemType::Bf16,
        count: 1,
        data: vec![0, 0],
    };
    let meta = PageMeta {
        tensor,
        token_start: 0,
        tokens,
        codec: 0,
    };
    PageFrame::encode(meta, &[s], None, 64).unwrap()
}

/// Header, page frames (already encoded for alignment 64), index and
/// trailer of a single commit with the given generation.
fn assemble(
    h: &FileHeader,
    pages: &[Vec<u8>],
    metas: &[(PageMeta, u16, u32)],
    generation: u32,
) -> Vec<u8> {
    let hb = h.encode().unwrap();
    let mut data = Vec::new();
    let mut entries = Vec::new();
    for (p, &(meta, flags, body_crc)) in pages.iter().zip(metas) {
        entries.push(IndexEntry {
            offset: data.len() as u64,
            frame_len: p.len() as u64,
            meta,
            flags,
            body_crc,
        });
        data.extend_from_slice(p);
    }
    let mut counts = vec![0u32; h.tensors.len()];
    for e in &entries {
        let t = e.meta.tensor as usize;
        counts[t] = counts[t].max(e.meta.token_start + e.meta.tokens);
    }
    let idx = Index {
        generation,
        prev_index: None,
        token_counts: counts,
        entries,
        token_ids: vec![],
    };
    let frame = idx.encode(64);
    let index_offset = data.len() as u64;
    data.extend_from_slice(&frame);
    let tr = Trailer {
        generation,
        index_offset,
        index_frame_len: frame.len() as u64,
        commit_end: data.len() as u64 + 64,
        header_len: hb.len() as u64,
    };
    data.extend_from_slice(&tr.encode());
    [hb, data].concat()
}

fn one_page_file(h: FileHeader, frames: Vec<PageFrame>, generation: u32) -> Vec<u8> {
    let metas: Vec<_> = frames
        .iter()
        .map(|f| (f.header.meta, f.header.flags, f.header.body_crc))
        .collect();
    let bytes: Vec<_> = frames.into_iter().map(|f| f.bytes).collect();
    assemble(&h, &bytes, &metas, generation)
}

/// A few hundred bytes whose single tensor has 2^48 elements
/// (tokens 2^32 - 1, head_dim 2^16).
pub fn elements_2p48() -> Vec<u8> {
    let h = header(
        vec![tensor(0, Kind::Key, 1, u32::MAX, 1 << 16)],
        vec![raw_entry()],
    );
    one_page_file(h, vec![tiny_page(0, u32::MAX)], 0)
}

/// A valid-looking commit whose index and trailer say generation
/// 0xFFFFFFFF.
pub fn generation_max() -> Vec<u8> {
    let h = header(vec![tensor(0, Kind::Key, 1, 1, 1)], vec![raw_entry()]);
    one_page_file(h, vec![tiny_page(0, 1)], u32::MAX)
}

/// kv_heads = 2^30 with one token.
pub fn heads_2p30() -> Vec<u8> {
    let h = header(
        vec![tensor(0, Kind::Key, 1 << 30, 1, 64)],
        vec![raw_entry()],
    );
    one_page_file(h, vec![tiny_page(0, 1)], 0)
}

/// One small tensor in layer 4294967295 (what `compress` used to write
/// from a safetensors name `past_key_values.4294967295.key`; the writer now
/// refuses it, so the field is patched in and the header CRC redone).
pub fn layer_max() -> Vec<u8> {
    let h = header(vec![tensor(7, Kind::Key, 1, 1, 1)], vec![raw_entry()]);
    let mut b = one_page_file(h, vec![tiny_page(0, 1)], 0);
    b[64..68].copy_from_slice(&u32::MAX.to_le_bytes());
    let body_len = u32::from_le_bytes(b[28..32].try_into().unwrap()) as usize;
    let crc = crc32fast::hash(&[&b[..60], &b[64..64 + body_len]].concat());
    b[60..64].copy_from_slice(&crc.to_le_bytes());
    b
}

/// 48 codec slots of hqmq with a 65536-entry codebook (and raw in slot 0).
pub fn hqmq_48_slots() -> Vec<u8> {
    let c = kvpack::codec::parse("hqmq:s65536r4").unwrap();
    let mut codecs = vec![raw_entry()];
    codecs.extend((0..48).map(|_| CodecEntry {
        id: c.id(),
        params: c.params(),
    }));
    let h = header(vec![tensor(0, Kind::Key, 1, 1, 4)], codecs);
    one_page_file(h, vec![tiny_page(0, 1)], 0)
}

/// 24 codec slots of hqmq with S = 65536, each used by one page of a
/// 64-head tensor: decoding builds a 28 MB codebook per (layer, head),
/// 1536 in all (43 GB if every codebook stayed cached, as the per-codec
/// cache of 1024 entries allowed); the process-wide codebook budget keeps
/// it at 512 MiB.
pub fn hqmq_codebooks() -> Vec<u8> {
    let c = kvpack::codec::parse("hqmq:s65536r4").unwrap();
    let heads = 64;
    let info = TensorInfo {
        dtype: DType::F32,
        ..tensor(0, Kind::Key, heads, 1, 4)
    };
    let data: Vec<f32> = (0..heads * 4)
        .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.3)
        .collect();
    let td = kvpack::cache::TensorData::F32(data);
    let planes: Vec<_> = (0..heads as usize)
        .map(|p| td.as_elems().slice(p * 4, 4))
        .collect();
    let page = kvpack::codec::PageIn {
        source: None,
        tensor: &info,
        token_start: 0,
        tokens: 1,
        planes,
    };
    let sections = c.encode(&page).unwrap();
    let layers = 24u32;
    let tensors = (0..layers)
        .map(|l| TensorInfo {
            dtype: DType::F32,
            ..tensor(l, Kind::Key, heads, 1, 4)
        })
        .collect();
    let codecs = (0..layers)
        .map(|_| CodecEntry {
            id: c.id(),
            params: c.params(),
        })
        .collect();
    let frames = (0..layers)
        .map(|l| {
            let meta = PageMeta {
                tensor: l,
                token_start: 0,
                tokens: 1,
                codec: l as u16,
            };
            PageFrame::encode(meta, &sections, None, 64).unwrap()
        })
        .collect();
    one_page_file(header(tensors, codecs), frames, 0)
}

/// Three zstd pages of ~33 kB, each declaring a 1 GiB body: one RAW
/// section of 2^29 - 32 bf16 zeros, for a tensor of 8 elements per page.
pub fn zstd_bomb() -> Vec<u8> {
    let body_len: u64 = 1 << 30;
    let count = ((body_len - 64) / 2) as u32;
    let mut table = Vec::new();
    table.extend_from_slice(&[5, 0, 1, 16]); // RAW, stream 0, bf16, 16 bits
    table.extend_from_slice(&count.to_le_bytes());
    table.extend_from_slice(&64u32.to_le_bytes());
    table.extend_from_slice(&(2 * count).to_le_bytes());
    table.resize(64, 0);
    let mut enc = zstd::stream::Encoder::new(Vec::new(), 19).unwrap();
    enc.set_pledged_src_size(Some(body_len)).unwrap();
    enc.include_contentsize(true).unwrap();
    enc.write_all(&table).unwrap();
    let zeros = vec![0u8; 1 << 20];
    let mut left = body_len - 64;
    while left > 0 {
        let n = left.min(zeros.len() as u64) as usize;
        enc.write_all(&zeros[..n]).unwrap();
        left -= n as u64;
    }
    let stored = enc.finish().unwrap();
    let pages = 3u32;
    let mut frames = Vec::new();
    let mut metas = Vec::new();
    for p in 0..pages {
        let meta = PageMeta {
            tensor: 0,
            token_start: p,
            tokens: 1,
            codec: 0,
        };
        let crc = crc32fast::hash(&stored);
        let mut f = Vec::new();
        f.extend_from_slice(b"KVPG");
        f.extend_from_slice(&0u32.to_le_bytes());
        f.extend_from_slice(&p.to_le_bytes());
        f.extend_from_slice(&1u32.to_le_bytes());
        f.extend_from_slice(&0u16.to_le_bytes());
        f.extend_from_slice(&1u16.to_le_bytes()); // zstd
        f.extend_from_slice(&1u16.to_le_bytes()); // one section
        f.extend_from_slice(&0u16.to_le_bytes());
        f.extend_from_slice(&(stored.len() as u64).to_le_bytes());
        f.extend_from_slice(&body_len.to_le_bytes());
        f.extend_from_slice(&crc.to_le_bytes());
        f.extend_from_slice(&[0; 16]);
        let hcrc = crc32fast::hash(&f);
        f.extend_from_slice(&hcrc.to_le_bytes());
        f.extend_from_slice(&stored);
        f.resize(f.len().next_multiple_of(64), 0);
        frames.push(f);
        metas.push((meta, 1u16, crc));
    }
    let h = header(vec![tensor(0, Kind::Key, 1, pages, 8)], vec![raw_entry()]);
    assemble(&h, &frames, &metas, 0)
}

/// An int4-coded page under a codec table that says bdr16, for a tensor
/// of head_dim 8: the rotation block is larger than the head vector.
pub fn bdr_block_over_head_dim() -> Vec<u8> {
    let info = tensor(0, Kind::Key, 1, 4, 8);
    let data = kvpack::cache::TensorData::F32((0..32).map(|i| i as f32 * 0.1).collect());
    let int4 = kvpack::codec::parse("int4").unwrap();
    let planes = vec![data.as_elems()];
    let page = kvpack::codec::PageIn {
        source: None,
        tensor: &TensorInfo {
            dtype: DType::F32,
            ..info.clone()
        },
        token_start: 0,
        tokens: 4,
        planes,
    };
    let sections = int4.encode(&page).unwrap();
    let meta = PageMeta {
        tensor: 0,
        token_start: 0,
        tokens: 4,
        codec: 0,
    };
    let frame = PageFrame::encode(meta, &sections, None, 64).unwrap();
    let bdr = kvpack::codec::parse("bdr16").unwrap();
    let h = header(
        vec![TensorInfo {
            dtype: DType::F32,
            ..info
        }],
        vec![CodecEntry {
            id: bdr.id(),
            params: bdr.params(),
        }],
    );
    one_page_file(h, vec![frame], 0)
}

/// A valid bdr16 file with one bit flipped in the final trailer's
/// generation field.
pub fn trailer_bit_flip() -> Vec<u8> {
    let mut b = small_valid();
    let n = b.len();
    b[n - 64 + 4] ^= 1;
    b
}

fn small_valid() -> Vec<u8> {
    let c = common::synthetic(
        &[common::LayerSpec {
            batch: 1,
            heads: 2,
            tokens: 20,
            head_dim: 16,
        }],
        DType::Bf16,
        5,
    );
    common::compress_bytes(&c, "bdr16", kvpack::plan::Layout::default(), None)
}

/// Recomputes the header CRC after a patch of the prefix or body.
fn fix_header_crc(b: &mut [u8]) {
    let body_len = u32::from_le_bytes(b[28..32].try_into().unwrap()) as usize;
    let crc = crc32fast::hash(&[&b[..60], &b[64..64 + body_len]].concat());
    b[60..64].copy_from_slice(&crc.to_le_bytes());
}

/// Invalid files every reader must reject, each with the rule (format/SPEC.md
/// section) it breaks; written to `format/vectors/invalid/` by
/// `write_invalid_vectors`.
pub fn invalid_vectors() -> Vec<(&'static str, &'static str, Vec<u8>)> {
    let good = small_valid();
    let mut v: Vec<(&'static str, &'static str, Vec<u8>)> = vec![
        (
            "elements-2p48",
            "8: decoded output above the memory limit (2^48 elements)",
            elements_2p48(),
        ),
        (
            "generation-max",
            "8: generation larger than the data can hold",
            generation_max(),
        ),
        (
            "heads-2p30",
            "8: decoded output above the memory limit (kv_heads 2^30)",
            heads_2p30(),
        ),
        ("layer-max", "8: layer index above the limit", layer_max()),
        (
            "zstd-bomb",
            "8: page body_len above 16 bytes per element + 1 MiB",
            zstd_bomb(),
        ),
        (
            "bdr-block-over-head-dim",
            "9.9: codec parameters do not fit the tensor",
            bdr_block_over_head_dim(),
        ),
        ("trailer-bit-flip", "5.3: trailer CRC", trailer_bit_flip()),
    ];
    let mut b = good.clone();
    b[1] = b'X';
    v.push(("bad-magic", "3: magic", b));
    let mut b = good.clone();
    b[8] = 2;
    fix_header_crc(&mut b);
    v.push(("major-2", "3: version_major must be 1", b));
    let mut b = good.clone();
    b[12] = 1;
    fix_header_crc(&mut b);
    v.push(("required-flag", "3: unknown required flag", b));
    let mut b = good.clone();
    b[70] ^= 1;
    v.push(("header-crc", "4.1: header_crc", b));
    let hl = u32::from_le_bytes(good[24..28].try_into().unwrap()) as usize;
    let mut b = good.clone();
    b[hl + 64 + 3] ^= 0x80;
    v.push(("page-body-crc", "6.1: body_crc over the stored body", b));
    let mut b = good.clone();
    b.truncate(b.len() - 1);
    v.push((
        "truncated",
        "10.2: no valid trailer (single commit cut short)",
        b,
    ));
    v
}

/// Every hostile file with its name.
pub fn all() -> Vec<(&'static str, Vec<u8>)> {
    vec![
        ("elements_2p48", elements_2p48()),
        ("generation_max", generation_max()),
        ("heads_2p30", heads_2p30()),
        ("layer_max", layer_max()),
        ("hqmq_48_slots", hqmq_48_slots()),
        ("zstd_bomb", zstd_bomb()),
        ("bdr_block_over_head_dim", bdr_block_over_head_dim()),
        ("trailer_bit_flip", trailer_bit_flip()),
    ]
}

/// Writes `format/vectors/invalid/*.kvpack` and `INVALID.json` (file ->
/// rule broken).
#[test]
#[ignore = "regenerates committed vectors"]
fn write_invalid_vectors() {
    let dir = common::repo("format/vectors/invalid");
    std::fs::create_dir_all(&dir).unwrap();
    let mut rules = serde_json::Map::new();
    for (name, rule, b) in invalid_vectors() {
        let f = format!("{name}.kvpack");
        std::fs::write(dir.join(&f), b).unwrap();
        rules.insert(f, rule.into());
    }
    std::fs::write(
        dir.join("INVALID.json"),
        serde_json::to_string_pretty(&rules).unwrap() + "\n",
    )
    .unwrap();
}

/// Every committed invalid vector is rejected by the random-access reader
/// (open or decode) and by the stream decoder, and is still what its
/// builder makes (so the rule list stays true).
#[test]
fn invalid_vectors_are_rejected_by_every_reader() {
    let dir = common::repo("format/vectors/invalid");
    let rules: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&std::fs::read(dir.join("INVALID.json")).unwrap()).unwrap();
    let built = invalid_vectors();
    assert_eq!(rules.len(), built.len());
    for (name, rule, bytes) in built {
        let f = format!("{name}.kvpack");
        assert_eq!(rules[&f], rule, "{f}");
        let committed = std::fs::read(dir.join(&f)).unwrap();
        let ar = kvpack::decode::Archive::open(&committed);
        let rejected = match ar {
            Err(_) => true,
            Ok(a) => a.decode(&Default::default(), None, None).is_err(),
        };
        assert!(rejected, "{f} ({rule}) accepted by the file reader");
        assert!(
            kvpack::stream_decode::decode_stream(&committed[..], None, &|_, _| {}).is_err(),
            "{f} ({rule}) accepted by the stream decoder"
        );
        // The zstd bomb is built at level 19 and may differ across zstd
        // versions byte for byte; all others are deterministic.
        if name != "zstd-bomb" {
            assert_eq!(committed, bytes, "{f} differs from its builder");
        }
    }
}

/// Writes every hostile file to `$KVPACK_HOSTILE_OUT` (for measuring the
/// CLI with `/usr/bin/time -v`).
#[test]
#[ignore = "writes files for manual measurement"]
fn write_hostile_files() {
    let dir = std::env::var("KVPACK_HOSTILE_OUT").expect("set KVPACK_HOSTILE_OUT");
    for (name, b) in all() {
        std::fs::write(Path::new(&dir).join(format!("{name}.kvpack")), b).unwrap();
    }
    // Valid, but costly to decode without a codebook budget.
    std::fs::write(
        Path::new(&dir).join("hqmq_codebooks.kvpack"),
        hqmq_codebooks(),
    )
    .unwrap();
}

/// Runs the release CLI on `bytes` saved as a file; returns (exit code,
/// stderr, seconds, peak RSS in KiB of the child).
fn run_cli(args: &[&str], bytes: &[u8]) -> (i32, String, f64, i64) {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("in.kvpack");
    std::fs::write(&f, bytes).unwrap();
    let out = dir.path().join("out.safetensors");
    let mut full: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    full.push(f.display().to_string());
    if args[0] == "decompress" {
        full.push("-o".into());
        full.push(out.display().to_string());
    }
    let start = Instant::now();
    // Reaped below with wait4, which also returns the child's peak RSS.
    #[allow(clippy::zombie_processes)]
    let child = Command::new(env!("CARGO_BIN_EXE_kvpack"))
        .args(&full)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.unwrap(), &mut err).unwrap();
    let mut status = 0;
    // SAFETY: plain wait4 on our own child; rusage is a C struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
    assert_eq!(r, pid);
    let secs = start.elapsed().as_secs_f64();
    let code = if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        128 + libc::WTERMSIG(status)
    };
    (code, err, secs, ru.ru_maxrss)
}

/// Each hostile file is refused by `decompress` with exit 2, a message
/// naming the field, in under 2 s and 64 MiB.
#[test]
fn hostile_files_are_refused_fast_and_small_by_decompress() {
    let expect = [
        ("elements_2p48", "needs 562949953290240 bytes"),
        ("generation_max", "trailer generation 4294967295"),
        ("heads_2p30", "needs 137438953472 bytes"),
        ("layer_max", "layer index 4294967295"),
        ("zstd_bomb", "body_len 1073741824"),
        (
            "bdr_block_over_head_dim",
            "bdr16 needs head_dim divisible by 16",
        ),
    ];
    let files = all();
    for (name, want) in expect {
        let bytes = &files.iter().find(|f| f.0 == name).unwrap().1;
        let (code, err, secs, rss_kb) = run_cli(&["decompress", "-q"], bytes);
        assert_eq!(code, 2, "{name}: exit {code}, stderr {err}");
        assert!(err.contains(want), "{name}: {err}");
        assert!(secs < 2.0, "{name}: {secs} s");
        // A spawned child's peak RSS starts at the test process's own (the
        // kernel keeps the pre-exec high-water mark): compare above it.
        // SAFETY: getrusage fills a plain C struct.
        let mut me: libc::rusage = unsafe { std::mem::zeroed() };
        unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut me) };
        assert!(
            rss_kb < me.ru_maxrss + (64 << 10),
            "{name}: {rss_kb} KiB (test process {} KiB)",
            me.ru_maxrss
        );
    }
}

/// A stream decoder (`recv`'s library side) refuses the same files without
/// allocating their declared sizes.
#[test]
fn hostile_streams_are_refused_by_the_stream_decoder() {
    for (name, bytes) in all() {
        let r = kvpack::stream_decode::decode_stream(&bytes[..], None, &|_, _| {});
        assert!(r.is_err(), "{name} was accepted");
    }
}

/// A bdr block larger than head_dim is a format error at open, not a
/// panic in the WHT kernel (issue section 2).
#[test]
fn bdr_block_over_head_dim_is_an_error_not_a_panic() {
    let b = bdr_block_over_head_dim();
    let e = kvpack::decode::Archive::open(&b).unwrap_err();
    assert!(e.to_string().contains("cannot decode"), "{e}");
}

/// A zstd page must be exactly one frame: a skippable frame before it or a
/// second frame after it is rejected (SPEC 6.4).
#[test]
fn zstd_page_with_two_frames_or_a_skippable_frame_is_rejected() {
    use kvpack::error::Location;
    use kvpack::format::{PageHeader, PageView};
    let body = vec![0u8; 64];
    let z = zstd::bulk::compress(&body, 3).unwrap();
    let skippable = [&[0x50, 0x2A, 0x4D, 0x18, 0, 0, 0, 0][..], &z].concat();
    let twice = [&z[..], &z[..]].concat();
    for (what, stored) in [("skippable", skippable), ("two frames", twice)] {
        let h = PageHeader {
            meta: PageMeta {
                tensor: 0,
                token_start: 0,
                tokens: 1,
                codec: 0,
            },
            flags: 1,
            n_sections: 0,
            stored_len: stored.len() as u64,
            body_len: 64,
            body_crc: crc32fast::hash(&stored),
        };
        let at = Location::Header;
        let e = PageView::from_stored(h, stored.into(), 0, String::new(), &at).unwrap_err();
        assert!(e.to_string().contains("frame"), "{what}: {e}");
    }
    // The same body as one frame passes the frame checks (and then fails
    // only the canonical layout of an empty section table: 64 != 0).
    let h = PageHeader {
        meta: PageMeta {
            tensor: 0,
            token_start: 0,
            tokens: 1,
            codec: 0,
        },
        flags: 1,
        n_sections: 0,
        stored_len: z.len() as u64,
        body_len: 64,
        body_crc: crc32fast::hash(&z),
    };
    let e = PageView::from_stored(h, z.into(), 0, String::new(), &Location::Header).unwrap_err();
    assert!(e.to_string().contains("section table implies"), "{e}");
}

/// `inspect` refuses what the decoding commands refuse: declared sizes
/// above the limits are exit 2 with a message naming the tensor and its
/// shape, unless --max-memory raises the limit.
#[test]
fn inspect_refuses_declared_sizes_above_the_limits() {
    let files = all();
    for (name, want) in [
        ("elements_2p48", "needs 562949953290240 bytes"),
        ("heads_2p30", "needs 137438953472 bytes"),
    ] {
        let bytes = &files.iter().find(|f| f.0 == name).unwrap().1;
        let (code, err, _, _) = run_cli(&["inspect"], bytes);
        assert_eq!(code, 2, "{name}: {err}");
        assert!(err.contains(want), "{name}: {err}");
        assert!(
            err.contains("shape [batch, kv_heads, tokens, head_dim]"),
            "{name}: {err}"
        );
        let (code, err, _, _) = run_cli(&["--max-memory", "1024T", "inspect"], bytes);
        assert_eq!(code, 0, "{name} with a raised limit: {err}");
    }
}

/// `inspect` of a device or of stdin checks the magic before reading on.
#[test]
fn inspect_dev_zero_is_refused_at_once() {
    let start = Instant::now();
    let o = Command::new(env!("CARGO_BIN_EXE_kvpack"))
        .args(["inspect", "/dev/zero"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not a kvpack file"));
    assert!(start.elapsed() < Duration::from_secs(2));
}

/// Found by the file_reader fuzz target: decoding part of a page (a token
/// selection) allocated a scratch page of the page's declared size (2^48
/// elements here) before any check; it is now bounded by the memory limit.
#[test]
fn partial_page_scratch_is_bounded() {
    let b = elements_2p48();
    let limits = kvpack::format::Limits {
        max_memory: 64 << 20,
        ..Default::default()
    };
    let ar = kvpack::decode::Archive::open_with(&b, limits).unwrap();
    let e = ar
        .decode(
            &kvpack::decode::Selection {
                tokens: Some(1..7),
                ..Default::default()
            },
            Some(DType::F32),
            None,
        )
        .unwrap_err();
    assert!(matches!(e, kvpack::Error::Limits(_)), "{e}");
}

/// Found by the file_reader fuzz campaign: a selection that holds no token
/// of a tensor declaring 2^30 kv heads walked every declared plane (10 s
/// under the sanitizer) although there was nothing to decode. Work must
/// follow the data that exists, not the declared shape.
#[test]
fn empty_selection_does_not_walk_declared_planes() {
    let b = std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("format/vectors/invalid/heads-2p30.kvpack"),
    )
    .unwrap();
    let ar = kvpack::decode::Archive::open_with(&b, Default::default()).unwrap();
    let start = Instant::now();
    let r = ar.decode(
        &kvpack::decode::Selection {
            tokens: Some(1..7),
            ..Default::default()
        },
        Some(DType::F32),
        None,
    );
    let took = start.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "{took:?} for {:?}",
        r.map(|c| c.tensors.len())
    );
}
