//! Streaming handoff over real TCP sockets on loopback: the receiver
//! decodes while receiving, reports layers in order, and never accepts a
//! truncated or corrupted stream.

mod common;

use std::io::Write;
use std::net::TcpListener;
use std::sync::Mutex;

use common::*;
use kvpack::compress::CompressOptions;
use kvpack::decode::{Archive, Selection};
use kvpack::plan::Layout;
use kvpack::stream_decode::decode_stream;

fn listener() -> (TcpListener, String) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = l.local_addr().unwrap().to_string();
    (l, a)
}

#[test]
fn send_and_receive_the_real_cache_over_tcp() {
    let fx = fixture();
    let (l, addr) = listener();
    let order = Mutex::new(Vec::new());
    let received = std::thread::scope(|s| {
        let rx = s.spawn(|| {
            let (hello, sock, _) =
                kvpack::net::receive(&l, &Default::default(), &Default::default()).unwrap();
            assert_eq!(hello.version.0, 1);
            decode_stream(std::io::BufReader::new(sock), None, &|layer, _| {
                order.lock().unwrap().push(layer)
            })
            .unwrap()
        });
        let codec = kvpack::codec::parse("bdr128").unwrap();
        let opts = CompressOptions {
            layout: Layout {
                page_tokens: 64,
                sink: 4,
                recent: 16,
            },
            ..Default::default()
        };
        let r = kvpack::transport::send(
            &fx.cache,
            codec.as_ref(),
            &opts,
            addr.as_str(),
            Some(2.0),
            &|_| {},
        )
        .unwrap();
        assert!(r.compress.output_bytes > 0);
        rx.join().unwrap()
    });
    // Same result as compressing to a file and decoding it.
    let bytes = compress_bytes(
        &fx.cache,
        "bdr128",
        Layout {
            page_tokens: 64,
            sink: 4,
            recent: 16,
        },
        None,
    );
    assert_eq!(
        received.bytes as usize,
        bytes.len(),
        "the stream is the file, byte for byte"
    );
    let want = Archive::open(&bytes)
        .unwrap()
        .decode(&Selection::default(), None, None)
        .unwrap();
    assert_eq!(received.cache, want);
    let order = order.into_inner().unwrap();
    assert_eq!(order.len(), 18);
    assert_eq!(received.layer_done.len(), 18);
    // Layer-major streaming: layer 0 completes before the stream ends.
    assert!(received.layer_done[0].1 <= received.received);
}

fn stream_bytes() -> Vec<u8> {
    let c = synthetic(
        &[LayerSpec {
            batch: 1,
            heads: 2,
            tokens: 90,
            head_dim: 64,
        }; 3],
        kvpack::DType::Bf16,
        5,
    );
    compress_bytes(
        &c,
        "int4",
        Layout {
            page_tokens: 32,
            sink: 0,
            recent: 0,
        },
        None,
    )
}

/// Serves `bytes` to one connection, then closes it.
fn serve(bytes: Vec<u8>) -> String {
    let (l, addr) = listener();
    std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let _ = s.write_all(&bytes);
    });
    addr
}

#[test]
fn a_truncated_stream_is_an_error_naming_the_page() {
    let bytes = stream_bytes();
    let ar = Archive::open(&bytes).unwrap();
    let e = ar.reader().index().entries[4];
    for cut in [
        100,
        (ar.reader().header_len() + e.offset + 200) as usize,
        bytes.len() - 70,
        bytes.len() - 1,
    ] {
        let addr = serve(bytes[..cut].to_vec());
        let sock = std::net::TcpStream::connect(addr).unwrap();
        let err = decode_stream(sock, None, &|_, _| {})
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("truncated") || err.contains("ended"),
            "cut at {cut}: {err}"
        );
        if cut > 1000 && cut < bytes.len() - 200 {
            assert!(
                err.contains("page #4") || err.contains("after page #"),
                "{err}"
            );
        }
    }
}

#[test]
fn a_corrupted_stream_is_an_error_naming_the_page() {
    let mut bytes = stream_bytes();
    let ar = Archive::open(&bytes).unwrap();
    let e = ar.reader().index().entries[7];
    let off = (ar.reader().header_len() + e.offset + 64 + 40) as usize;
    bytes[off] ^= 1;
    let sock = std::net::TcpStream::connect(serve(bytes)).unwrap();
    let err = decode_stream(sock, None, &|_, _| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("page #7") && err.contains("CRC"), "{err}");
}

#[test]
fn cli_send_to_cli_recv_writes_output_only_when_complete() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("got.kvpack");
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let addr = format!("127.0.0.1:{port}");
    let exe = env!("CARGO_BIN_EXE_kvpack");
    let mut recv = std::process::Command::new(exe)
        .args(["recv", "--listen", &addr, "-o", out.to_str().unwrap(), "-q"])
        .spawn()
        .unwrap();
    // Retry until the receiver listens.
    let mut ok = false;
    for _ in 0..100 {
        std::thread::sleep(std::time::Duration::from_millis(50));
        let st = std::process::Command::new(exe)
            .args([
                "send",
                repo(FIXTURE).to_str().unwrap(),
                "--to",
                &addr,
                "--codec",
                "int4",
                "-q",
            ])
            .status()
            .unwrap();
        if st.success() {
            ok = true;
            break;
        }
    }
    assert!(ok, "send never connected");
    assert!(recv.wait().unwrap().success());
    let bytes = std::fs::read(&out).unwrap();
    let fx = fixture();
    assert_eq!(
        bytes,
        compress_bytes(&fx.cache, "int4", Layout::default(), None)
    );

    // A receiver whose sender dies mid-stream writes nothing and exits 2.
    let out2 = dir.path().join("never.safetensors");
    let (l, addr2) = listener();
    drop(l);
    let recv = std::process::Command::new(exe)
        .args([
            "recv",
            "--listen",
            &addr2,
            "-o",
            out2.to_str().unwrap(),
            "-q",
        ])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut sock = None;
    for _ in 0..100 {
        std::thread::sleep(std::time::Duration::from_millis(30));
        if let Ok(s) = std::net::TcpStream::connect(&addr2) {
            sock = Some(s);
            break;
        }
    }
    let hello = kvpack::net::Hello {
        version: (1, 0),
        model: String::new(),
        codecs: vec![0, 1],
        authenticated: false,
    };
    let mut out =
        kvpack::net::client_handshake(sock.expect("receiver listening"), &hello, None).unwrap();
    out.write_all(&bytes[..bytes.len() / 2]).unwrap();
    drop(out);
    let o = recv.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("truncated"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(!out2.exists());
}
