//! The CLI streams (issue 12): `compress`, `decompress`, `verify` and
//! `recv` hold a few pages per thread, not the cache, and their outputs
//! are the same as the in-memory paths'.

mod common;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use kvpack::cache::{DType, Kind, Tensor, TensorData, TensorInfo};
use kvpack::io::safetensors::{self, Layout};

fn kvpack() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvpack"))
}

fn ok(cmd: &mut Command) -> Vec<u8> {
    let out = cmd.stderr(Stdio::piped()).output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// A layout's file is `write`'s, byte for byte; with room reserved for
/// token ids, or too little room (the data is moved up), it parses back to
/// the same cache.
#[test]
fn positional_safetensors_output_matches_the_sequential_writer() {
    let cache = common::fixture().cache;
    assert!(!cache.token_ids.is_empty(), "the fixture records token ids");
    let mut want = Vec::new();
    safetensors::write(&cache, &mut want).unwrap();
    let infos: Vec<TensorInfo> = cache.tensors.iter().map(|t| t.info.clone()).collect();
    let dir = tempfile::tempdir().unwrap();
    let write_with = |mut l: Layout, name: &str| -> Vec<u8> {
        let p = dir.path().join(name);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&p)
            .unwrap();
        f.set_len(l.len()).unwrap();
        // Pieces of 100 tokens, last tensor first.
        for (o, t) in cache.tensors.iter().enumerate().rev() {
            let d = t.info.head_dim as usize;
            for t0 in (0..t.info.tokens).step_by(100) {
                let n = 100.min(t.info.tokens - t0);
                let mut piece = TensorData::zeros(t.info.dtype, t.info.planes() * n as usize * d);
                kvpack::view::TensorView::new(
                    t.info.clone(),
                    t.data.as_elems(),
                    kvpack::view::Strides::head_major(&t.info),
                )
                .unwrap()
                .gather(t0 as usize, n as usize, &mut piece);
                l.write_piece(&f, o, t0, n, piece.as_elems()).unwrap();
            }
        }
        l.finish(&f, &cache.token_ids).unwrap();
        drop(f);
        std::fs::read(p).unwrap()
    };
    let exact = Layout::exact(&infos, &cache.metadata, &cache.token_ids).unwrap();
    assert_eq!(write_with(exact, "exact.safetensors"), want);
    for room in [520, 3] {
        let l = Layout::with_room(&infos, &cache.metadata, room).unwrap();
        let got = write_with(l, &format!("room{room}.safetensors"));
        let back = safetensors::parse(&got, "room").unwrap().cache;
        assert_eq!(back, cache, "room for {room} token ids");
    }
}

/// A piece that does not fit its tensor is an error, not a write elsewhere.
#[test]
fn a_piece_outside_its_tensor_is_refused() {
    let info = TensorInfo {
        name: "past_key_values.0.key".into(),
        layer: 0,
        kind: Kind::Key,
        dtype: DType::Bf16,
        batch: 1,
        heads: 2,
        tokens: 10,
        head_dim: 4,
    };
    let l = Layout::exact(std::slice::from_ref(&info), &BTreeMap::new(), &[]).unwrap();
    let f = tempfile::tempfile().unwrap();
    let piece = TensorData::zeros(DType::Bf16, 2 * 3 * 4);
    assert!(l.write_piece(&f, 0, 8, 3, piece.as_elems()).is_err());
    assert!(l.write_piece(&f, 1, 0, 3, piece.as_elems()).is_err());
    let f32s = TensorData::zeros(DType::F32, 2 * 3 * 4);
    assert!(l.write_piece(&f, 0, 0, 3, f32s.as_elems()).is_err());
    l.write_piece(&f, 0, 7, 3, piece.as_elems()).unwrap();
}

/// `decompress` to a file (pages written at their offsets from worker
/// threads) writes exactly what it writes to stdout (in order), for the
/// whole cache and for a selection with another dtype.
#[test]
fn decompress_to_a_file_equals_decompress_to_stdout() {
    let dir = tempfile::tempdir().unwrap();
    let packed = dir.path().join("f.kvpack");
    ok(kvpack()
        .args([
            "compress",
            common::FIXTURE,
            "-c",
            "int4",
            "--zstd",
            "-q",
            "-o",
        ])
        .arg(&packed)
        .current_dir(common::repo(".")));
    for extra in [
        &[][..],
        &[
            "--layers", "2..5", "--tokens", "100..300", "--kind", "v", "--dtype", "fp32",
        ][..],
    ] {
        let out = dir.path().join("out.safetensors");
        ok(kvpack()
            .arg("decompress")
            .arg(&packed)
            .args(extra)
            .args(["-q", "-f", "-o"])
            .arg(&out));
        let piped = ok(kvpack()
            .arg("decompress")
            .arg(&packed)
            .args(extra)
            .args(["-q", "-o", "-"]));
        assert_eq!(std::fs::read(&out).unwrap(), piped, "{extra:?}");
    }
}

/// `recv -o x.safetensors` (pages decoded and written as they arrive)
/// writes the cache `decompress` writes, token ids included.
#[test]
fn recv_to_safetensors_equals_decompress() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = common::repo(common::FIXTURE);
    let packed = dir.path().join("f.kvpack");
    ok(kvpack()
        .args(["compress", "-c", "bdr128", "-q", "-o"])
        .arg(&packed)
        .arg(&fixture));
    let dec = dir.path().join("dec.safetensors");
    ok(kvpack()
        .arg("decompress")
        .arg(&packed)
        .args(["-q", "-o"])
        .arg(&dec));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let got = dir.path().join("got.safetensors");
    let mut recv = kvpack()
        .args(["recv", "-q", "--listen", &format!("127.0.0.1:{port}"), "-o"])
        .arg(&got)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    ok(kvpack()
        .args([
            "send",
            "-c",
            "bdr128",
            "-q",
            "--to",
            &format!("127.0.0.1:{port}"),
        ])
        .arg(&fixture));
    assert!(recv.wait().unwrap().success());
    let a = safetensors::parse(&std::fs::read(&dec).unwrap(), "dec").unwrap();
    let b = safetensors::parse(&std::fs::read(&got).unwrap(), "got").unwrap();
    assert_eq!(a.cache, b.cache);
    assert_eq!(b.cache.token_ids.len(), 520);
}

/// Writes a synthetic bf16 cache of `layers` x K,V `[1, 8, tokens, 128]`
/// one tensor at a time (the test process stays small).
fn write_big_cache(path: &Path, layers: u32, tokens: u32) -> u64 {
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
                heads: 8,
                tokens,
                head_dim: 128,
            })
        })
        .collect();
    let mut w = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    safetensors::write_header(&infos, &BTreeMap::new(), &[], &mut w).unwrap();
    let mut rng = common::Rng(7);
    for info in &infos {
        let v = (0..info.elements())
            .map(|_| half::bf16::from_f64(rng.normal()))
            .collect();
        let t = Tensor::new(info.clone(), TensorData::Bf16(v)).unwrap();
        safetensors::write_tensor(&t, &mut w).unwrap();
    }
    w.flush().unwrap();
    infos.iter().map(|t| t.elements() * 2).sum()
}

/// On a 256 MB cache, each streaming command's peak resident memory stays
/// under 48 MiB (above the test process's own, which the child starts
/// from): the input, the output and the decoded cache are never all in
/// memory. Before streaming, decompress, verify and recv held the decoded
/// cache (256 MB, or 512 MB as f32) and compress the mapped input.
#[cfg(target_os = "linux")]
#[test]
fn streaming_commands_stay_small_on_a_large_cache() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("big.safetensors");
    let bytes = write_big_cache(&src, 32, 4096);
    assert!(bytes >= 256 << 20);
    let packed = dir.path().join("big.kvpack");
    let budget = 48 << 10;
    let check = |what: &str, cmd: &mut Command| {
        let (code, kib) = common::run_peak_rss(cmd.stdout(Stdio::null()));
        assert_eq!(code, 0, "{what}");
        let own = common::own_peak_kib();
        assert!(
            kib < own + budget,
            "{what}: peak {kib} KiB (test process {own} KiB)"
        );
    };
    check(
        "compress",
        kvpack()
            .args(["compress", "-c", "bdr128", "-q", "-o"])
            .arg(&packed)
            .arg(&src),
    );
    check(
        "decompress",
        kvpack()
            .arg("decompress")
            .arg(&packed)
            .args(["-q", "-o"])
            .arg(dir.path().join("out.safetensors")),
    );
    check("verify", kvpack().arg("verify").arg(&packed));
    check(
        "verify --against",
        kvpack()
            .arg("verify")
            .arg(&packed)
            .arg("--against")
            .arg(&src),
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let sender = {
        let src = src.clone();
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(500));
            kvpack()
                .args([
                    "send",
                    "-c",
                    "bdr128",
                    "-q",
                    "--to",
                    &format!("127.0.0.1:{port}"),
                ])
                .arg(&src)
                .status()
                .unwrap()
        })
    };
    check(
        "recv",
        kvpack()
            .args(["recv", "-q", "--listen", &format!("127.0.0.1:{port}"), "-o"])
            .arg(dir.path().join("recv.safetensors")),
    );
    assert!(sender.join().unwrap().success());
}
