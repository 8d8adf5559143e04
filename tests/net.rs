//! The network against hostile or broken peers on 127.0.0.1 (issue 12
//! section 4): a stalled, a trickling, an oversized and an unauthenticated
//! sender, a receiver that stops reading, refusals in the handshake, and
//! `recv` checking its output before it listens. Every wait is bounded.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use common::*;
use kvpack::cache::DType;
use kvpack::compress::CompressOptions;
use kvpack::net::{Accept, Hello, NetLimits};
use kvpack::stream_decode::decode_stream;

fn short() -> NetLimits {
    NetLimits {
        connect: Some(Duration::from_secs(3)),
        idle: Duration::from_millis(300),
        total: Duration::from_secs(2),
        max_bytes: 64 << 20,
    }
}

fn hello() -> Hello {
    Hello {
        version: (1, 0),
        model: "m".into(),
        codecs: vec![0, 1],
        authenticated: false,
    }
}

fn bind() -> (TcpListener, String) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = l.local_addr().unwrap().to_string();
    (l, a)
}

fn small_cache() -> kvpack::KvCache {
    synthetic(
        &[LayerSpec {
            batch: 1,
            heads: 2,
            tokens: 64,
            head_dim: 64,
        }],
        DType::Bf16,
        3,
    )
}

/// Receives one stream with `limits` and `accept`, decoding it; the error
/// text and the time it took.
fn receive_err(l: &TcpListener, limits: NetLimits, accept: Accept) -> (String, Duration) {
    let start = Instant::now();
    let r = kvpack::net::receive(l, &limits, &accept).and_then(|(_, rd, _)| {
        decode_stream(std::io::BufReader::new(rd), None, &|_, _| {}).map(|_| ())
    });
    (r.unwrap_err().to_string(), start.elapsed())
}

#[test]
fn a_stalled_sender_times_out_on_idle() {
    let (l, addr) = bind();
    let t = std::thread::spawn(move || {
        let s = TcpStream::connect(addr).unwrap();
        std::thread::sleep(Duration::from_secs(2));
        drop(s);
    });
    let (e, took) = receive_err(&l, short(), Accept::default());
    assert!(e.contains("idle timeout"), "{e}");
    assert!(took < Duration::from_millis(1500), "{took:?}");
    t.join().unwrap();
}

#[test]
fn a_trickling_sender_hits_the_total_timeout() {
    let (l, addr) = bind();
    let t = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        // One byte every 100 ms never trips the idle timeout.
        for b in b"KVPH\xff\x00\x00\x00".iter().cycle().take(60) {
            if s.write_all(&[*b]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let limits = NetLimits {
        total: Duration::from_secs(1),
        ..short()
    };
    let (e, took) = receive_err(&l, limits, Accept::default());
    assert!(e.contains("total timeout"), "{e}");
    assert!(took < Duration::from_secs(3), "{took:?}");
    t.join().unwrap();
}

#[test]
fn an_oversized_sender_hits_the_byte_cap() {
    let (l, addr) = bind();
    let cache = small_cache();
    let t = std::thread::spawn(move || {
        let codec = kvpack::codec::parse("raw").unwrap();
        let _ = kvpack::transport::send(
            &cache,
            codec.as_ref(),
            &CompressOptions::default(),
            addr.as_str(),
            None,
            &|_| {},
        );
    });
    let limits = NetLimits {
        max_bytes: 10_000,
        ..short()
    };
    let (e, _) = receive_err(&l, limits, Accept::default());
    assert!(e.contains("cap of 10000 bytes"), "{e}");
    t.join().unwrap();
}

#[test]
fn an_unauthenticated_or_wrong_secret_sender_is_refused() {
    let secret = b"0123456789abcdef-shared".to_vec();
    // No secret at all: refused in the handshake, both sides told why.
    let (l, addr) = bind();
    let t = std::thread::spawn(move || {
        let s = TcpStream::connect(addr).unwrap();
        kvpack::net::client_handshake(s, &hello(), None)
            .unwrap_err()
            .to_string()
    });
    let accept = Accept {
        model: None,
        secret: Some(secret.clone()),
    };
    let (e, _) = receive_err(&l, short(), accept.clone());
    assert!(e.contains("requires an authenticated stream"), "{e}");
    assert!(t.join().unwrap().contains("refused"));

    // The wrong secret: the first chunk fails authentication, nothing is
    // decoded.
    let (l, addr) = bind();
    let cache = small_cache();
    let t = std::thread::spawn(move || {
        let codec = kvpack::codec::parse("int4").unwrap();
        let net = kvpack::transport::SendOptions {
            limits: short(),
            secret: Some(b"another secret of 16+ bytes".to_vec()),
        };
        let _ = kvpack::transport::send_with(
            &cache,
            codec.as_ref(),
            &CompressOptions::default(),
            addr.as_str(),
            None,
            &net,
            &|_| {},
        );
    });
    let (e, _) = receive_err(&l, short(), accept.clone());
    assert!(e.contains("failed authentication"), "{e}");
    t.join().unwrap();

    // The right secret decodes exactly what was sent.
    let (l, addr) = bind();
    let cache = small_cache();
    let sent = cache.clone();
    let s2 = secret.clone();
    let t = std::thread::spawn(move || {
        let codec = kvpack::codec::parse("raw").unwrap();
        let net = kvpack::transport::SendOptions {
            limits: short(),
            secret: Some(s2),
        };
        kvpack::transport::send_with(
            &cache,
            codec.as_ref(),
            &CompressOptions::default(),
            addr.as_str(),
            None,
            &net,
            &|_| {},
        )
        .unwrap();
    });
    let (_, rd, _) = kvpack::net::receive(&l, &short(), &accept).unwrap();
    let got = decode_stream(std::io::BufReader::new(rd), None, &|_, _| {}).unwrap();
    t.join().unwrap();
    assert_eq!(got.cache.tensors, sent.tensors);
}

#[test]
fn a_tampered_authenticated_chunk_is_rejected() {
    let secret = b"0123456789abcdef-shared".to_vec();
    let (l, addr) = bind();
    let s2 = secret.clone();
    let t = std::thread::spawn(move || {
        // A man in the middle flips one byte of the first chunk's data.
        let s = TcpStream::connect(addr).unwrap();
        let mut out = kvpack::net::client_handshake(
            Tamper {
                inner: s,
                at: 8 + 20, // after the hello: len prefix, then data
                seen: 0,
                hello_done: false,
            },
            &hello(),
            Some(&s2),
        )
        .unwrap();
        let _ = out.write_all(&compress_bytes(
            &small_cache(),
            "raw",
            Default::default(),
            None,
        ));
        let _ = out.finish();
    });
    let accept = Accept {
        model: None,
        secret: Some(secret),
    };
    let (e, _) = receive_err(&l, short(), accept);
    assert!(e.contains("failed authentication"), "{e}");
    t.join().unwrap();
}

/// Flips one byte of what is written after the handshake.
struct Tamper {
    inner: TcpStream,
    at: usize,
    seen: usize,
    hello_done: bool,
}

impl Read for Tamper {
    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        self.hello_done = true;
        self.inner.read(b)
    }
}

impl Write for Tamper {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        let mut v = b.to_vec();
        if self.hello_done {
            if (self.seen..self.seen + v.len()).contains(&self.at) {
                v[self.at - self.seen] ^= 0x40;
            }
            self.seen += v.len();
        }
        self.inner.write_all(&v)?;
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

#[test]
fn a_model_mismatch_is_refused_in_the_handshake() {
    let (l, addr) = bind();
    let t = std::thread::spawn(move || {
        let s = TcpStream::connect(addr).unwrap();
        kvpack::net::client_handshake(s, &hello(), None)
            .unwrap_err()
            .to_string()
    });
    let accept = Accept {
        model: Some("gemma-3-270m".into()),
        secret: None,
    };
    let (e, _) = receive_err(&l, short(), accept);
    assert!(e.contains("model"), "{e}");
    let sender = t.join().unwrap();
    assert!(sender.contains("wants \"gemma-3-270m\""), "{sender}");
}

#[test]
fn send_to_a_receiver_that_stops_reading_times_out() {
    let (l, addr) = bind();
    let rx = std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        let (_, _rd) = kvpack::net::server_handshake(s, &Accept::default()).unwrap();
        std::thread::sleep(Duration::from_secs(4)); // never reads
    });
    let cache = synthetic(
        &[LayerSpec {
            batch: 1,
            heads: 8,
            tokens: 2048,
            head_dim: 128,
        }],
        DType::Bf16,
        9,
    );
    let codec = kvpack::codec::parse("raw").unwrap();
    let net = kvpack::transport::SendOptions {
        limits: short(),
        secret: None,
    };
    let start = Instant::now();
    let e = kvpack::transport::send_with(
        &cache,
        codec.as_ref(),
        &CompressOptions::default(),
        addr.as_str(),
        None,
        &net,
        &|_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("idle timeout") || e.contains("total timeout"),
        "{e}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "{:?}",
        start.elapsed()
    );
    rx.join().unwrap();
}

#[test]
fn no_sender_within_the_connect_timeout() {
    let (l, _) = bind();
    let limits = NetLimits {
        connect: Some(Duration::from_millis(200)),
        ..short()
    };
    let start = Instant::now();
    let e = kvpack::net::receive(&l, &limits, &Accept::default()).unwrap_err();
    assert!(e.to_string().contains("no sender connected"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(2));
}

#[test]
fn recv_checks_its_output_before_listening() {
    let dir = tempfile::tempdir().unwrap();
    let exists = dir.path().join("x.kvpack");
    std::fs::write(&exists, b"keep").unwrap();
    for (out, want) in [
        (exists.clone(), "exists"),
        (
            dir.path().join("no/such/dir/x.kvpack"),
            "creating a file in",
        ),
    ] {
        let start = Instant::now();
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_kvpack"))
            .args([
                "recv",
                "--listen",
                "127.0.0.1:0",
                "-o",
                out.to_str().unwrap(),
            ])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(matches!(o.status.code(), Some(2 | 3)), "{err}");
        assert!(err.contains(want), "{err}");
        assert!(!err.contains("listening"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(2));
    }
    assert_eq!(std::fs::read(&exists).unwrap(), b"keep");
}

/// A stream whose page passes every checksum but breaks its codec's rules
/// (a RAW section of 1 element for a page of 4): `recv -o x.kvpack` used to
/// store it; now it validates each page with its codec first and writes
/// nothing.
#[test]
fn recv_to_kvpack_validates_pages_with_the_codec() {
    use kvpack::cache::{Kind, TensorInfo};
    use kvpack::format::{
        CodecEntry, ElemType, FileHeader, PageFrame, PageMeta, Section, SectionKind, Writer,
    };
    let raw = kvpack::codec::parse("raw").unwrap();
    let h = FileHeader {
        version_major: 1,
        version_minor: 0,
        align_log2: 6,
        tensors: vec![TensorInfo {
            name: "past_key_values.0.key".into(),
            layer: 0,
            kind: Kind::Key,
            dtype: DType::Bf16,
            batch: 1,
            heads: 1,
            tokens: 1,
            head_dim: 4,
        }],
        codecs: vec![CodecEntry {
            id: raw.id(),
            params: raw.params(),
        }],
        metadata: Default::default(),
        page_tokens: 256,
        sink_tokens: 0,
        recent_tokens: 0,
    };
    let page = PageFrame::encode(
        PageMeta {
            tensor: 0,
            token_start: 0,
            tokens: 1,
            codec: 0,
        },
        &[Section {
            kind: SectionKind::Raw,
            stream: 0,
            elem: ElemType::Bf16,
            count: 1,
            data: vec![0, 0],
        }],
        None,
        64,
    )
    .unwrap();
    let mut w = Writer::new(Vec::new(), &h).unwrap();
    w.write_page(&page).unwrap();
    let (bytes, _) = w.commit(&[]).unwrap();

    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("got.kvpack");
    let (l, addr) = bind();
    drop(l);
    let recv = std::process::Command::new(env!("CARGO_BIN_EXE_kvpack"))
        .args(["recv", "--listen", &addr, "-o", out.to_str().unwrap(), "-q"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut sock = None;
    for _ in 0..100 {
        std::thread::sleep(Duration::from_millis(30));
        if let Ok(s) = TcpStream::connect(&addr) {
            sock = Some(s);
            break;
        }
    }
    let mut w = kvpack::net::client_handshake(sock.unwrap(), &hello(), None).unwrap();
    w.write_all(&bytes).unwrap();
    drop(w.finish().unwrap());
    let o = recv.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("holds 1 bf16 elements, expected 4"), "{err}");
    assert!(!out.exists());
}
