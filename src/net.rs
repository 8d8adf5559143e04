//! The network side of a handoff: connection setup with timeouts, a byte
//! cap, a handshake that checks format version, model identity and codecs
//! before any KV byte moves, and optional authentication of the whole
//! stream with a shared secret (HMAC-SHA256, RFC 2104).
//!
//! Wire protocol (all integers little-endian):
//!
//! ```text
//! sender -> receiver  hello := "KVPH" u32:len body(len <= 64 KiB)
//!     body := u16 version_major, u16 version_minor, u32 flags (bit 0: HMAC),
//!             16 bytes sender nonce, string model ("" = unknown),
//!             u16 n, n x u16 codec ids          (string = u32 len + UTF-8)
//! receiver -> sender  reply := "KVPA" u8 status (0 accept, 1 refuse),
//!             16 bytes receiver nonce, string reason
//! sender -> receiver  the kvpack stream (format/SPEC.md section 11); with
//!     bit 0 set, cut into chunks: u32 len (<= 1 MiB), len bytes, 32-byte
//!     tag = HMAC-SHA256(secret, "kvpack-chunk" sender_nonce receiver_nonce
//!     u64 seq u32 len bytes); a chunk of len 0 ends the stream.
//! ```
//!
//! The receiver releases no byte of a chunk before its tag has verified, so
//! a stranger without the secret cannot inject or alter KV data, replay a
//! chunk (sequence numbers), or cut the stream short unnoticed (the empty
//! final chunk is authenticated too). Fresh nonces on both sides make a
//! recorded session useless against a new one.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use hmac::{KeyInit, Mac};

use crate::error::{Error, Result};

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// Largest chunk of an authenticated stream, bytes.
pub const MAX_CHUNK: usize = 1 << 20;
const HELLO_MAGIC: [u8; 4] = *b"KVPH";
const REPLY_MAGIC: [u8; 4] = *b"KVPA";
const MAX_HELLO: u32 = 64 << 10;
const TAG_LEN: usize = 32;

/// Timeouts and the byte cap of one transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetLimits {
    /// Longest wait for a TCP connection (sender) or for a sender to
    /// connect (receiver; `None` waits forever). Default 10 s / forever.
    pub connect: Option<Duration>,
    /// Longest time without any progress (a byte read or written).
    /// Default 30 s.
    pub idle: Duration,
    /// Longest whole transfer after the connection. Default 1 hour.
    pub total: Duration,
    /// Most bytes accepted from a peer. Default 64 GiB.
    pub max_bytes: u64,
}

impl Default for NetLimits {
    fn default() -> Self {
        NetLimits {
            connect: Some(Duration::from_secs(10)),
            idle: Duration::from_secs(30),
            total: Duration::from_secs(3600),
            max_bytes: 64 << 30,
        }
    }
}

fn timed_out(what: String) -> std::io::Error {
    std::io::Error::new(ErrorKind::TimedOut, what)
}

/// A socket side with a total deadline and a byte cap; the idle timeout is
/// the socket's own read/write timeout (set by [`connect`] and [`accept`]).
#[derive(Debug)]
pub struct Guarded<S> {
    inner: S,
    deadline: Instant,
    limits: NetLimits,
    moved: u64,
}

impl<S> Guarded<S> {
    /// Guards `inner` from now on.
    pub fn new(inner: S, limits: NetLimits) -> Self {
        Guarded {
            inner,
            deadline: Instant::now() + limits.total,
            limits,
            moved: 0,
        }
    }

    /// Bytes read or written so far.
    pub fn bytes(&self) -> u64 {
        self.moved
    }

    /// The guarded value.
    pub fn into_inner(self) -> S {
        self.inner
    }

    fn check(&self) -> std::io::Result<()> {
        if Instant::now() > self.deadline {
            return Err(timed_out(format!(
                "the transfer exceeded its total timeout of {} s",
                self.limits.total.as_secs()
            )));
        }
        Ok(())
    }

    fn idle(&self, e: std::io::Error) -> std::io::Error {
        if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
            timed_out(format!(
                "the peer made no progress for {} s (idle timeout)",
                self.limits.idle.as_secs()
            ))
        } else {
            e
        }
    }
}

impl<S: Read> Read for Guarded<S> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.check()?;
        let n = self.inner.read(buf).map_err(|e| self.idle(e))?;
        self.moved += n as u64;
        if self.moved > self.limits.max_bytes {
            return Err(std::io::Error::new(
                ErrorKind::InvalidData,
                format!(
                    "the peer sent more than the cap of {} bytes",
                    self.limits.max_bytes
                ),
            ));
        }
        Ok(n)
    }
}

impl<S: Write> Write for Guarded<S> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.check()?;
        let n = self.inner.write(buf).map_err(|e| self.idle(e))?;
        self.moved += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush().map_err(|e| self.idle(e))
    }
}

fn set_timeouts(s: &TcpStream, limits: &NetLimits) -> Result<()> {
    let idle = Some(limits.idle.max(Duration::from_millis(1)));
    s.set_read_timeout(idle)
        .and_then(|_| s.set_write_timeout(idle))
        .and_then(|_| s.set_nodelay(true))
        .map_err(|e| Error::io("setting socket timeouts", e))
}

/// Connects to `addr` within `limits.connect` (each resolved address in
/// turn) and sets the idle timeout on the socket.
///
/// # Errors
/// [`Error::Io`] naming the address (refused, unreachable, timed out).
pub fn connect(
    addr: impl ToSocketAddrs + std::fmt::Debug,
    limits: &NetLimits,
) -> Result<TcpStream> {
    let what = format!("{addr:?}");
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| Error::io(format!("resolving {what}"), e))?
        .collect();
    let mut last = None;
    for a in addrs {
        let r = match limits.connect {
            Some(t) => TcpStream::connect_timeout(&a, t),
            None => TcpStream::connect(a),
        };
        match r {
            Ok(s) => {
                set_timeouts(&s, limits)?;
                return Ok(s);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(Error::io(
        format!("connecting to {what}"),
        last.unwrap_or_else(|| std::io::Error::new(ErrorKind::NotFound, "no address")),
    ))
}

/// Waits for one connection on `l` for at most `limits.connect` (`None`:
/// forever) and sets the idle timeout on it.
///
/// # Errors
/// [`Error::Io`] when accepting fails or nobody connects in time.
pub fn accept(l: &TcpListener, limits: &NetLimits) -> Result<(TcpStream, SocketAddr)> {
    let r = match limits.connect {
        None => l.accept(),
        Some(t) => {
            l.set_nonblocking(true)
                .map_err(|e| Error::io("configuring the listener", e))?;
            let end = Instant::now() + t;
            loop {
                match l.accept() {
                    Err(e) if e.kind() == ErrorKind::WouldBlock && Instant::now() < end => {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        break Err(timed_out(format!(
                            "no sender connected within {} s",
                            t.as_secs()
                        )));
                    }
                    other => break other,
                }
            }
        }
    };
    let (s, peer) = r.map_err(|e| Error::io("accepting a connection", e))?;
    s.set_nonblocking(false)
        .map_err(|e| Error::io("configuring the connection", e))?;
    set_timeouts(&s, limits)?;
    Ok((s, peer))
}

/// What a sender announces before the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// Format version of the stream (major, minor).
    pub version: (u16, u16),
    /// Model identity (`kvpack.model`), empty when unknown.
    pub model: String,
    /// Codec ids the stream uses.
    pub codecs: Vec<u16>,
    /// Whether the stream is authenticated with a shared secret.
    pub authenticated: bool,
}

fn nonce() -> Result<[u8; 16]> {
    let mut n = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut n))
        .map_err(|e| Error::io("reading /dev/urandom for a nonce", e))?;
    Ok(n)
}

fn put_str(v: &mut Vec<u8>, s: &str) {
    v.extend_from_slice(&(s.len() as u32).to_le_bytes());
    v.extend_from_slice(s.as_bytes());
}

fn proto(msg: impl Into<String>) -> Error {
    Error::format(crate::error::Location::Input("handshake".into()), msg)
}

/// A bounds-checked cursor over a handshake message.
struct Msg<'a>(&'a [u8]);

impl<'a> Msg<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.0.len() < n {
            return Err(proto("handshake message is truncated"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2")))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn string(&mut self) -> Result<String> {
        let n = self.u32()? as usize;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| proto("string is not UTF-8"))
    }
}

impl Hello {
    /// Serializes the hello with `nonce`.
    fn encode(&self, nonce: &[u8; 16]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&self.version.0.to_le_bytes());
        b.extend_from_slice(&self.version.1.to_le_bytes());
        b.extend_from_slice(&u32::from(self.authenticated).to_le_bytes());
        b.extend_from_slice(nonce);
        put_str(&mut b, &self.model);
        b.extend_from_slice(&(self.codecs.len() as u16).to_le_bytes());
        for c in &self.codecs {
            b.extend_from_slice(&c.to_le_bytes());
        }
        let mut out = HELLO_MAGIC.to_vec();
        out.extend_from_slice(&(b.len() as u32).to_le_bytes());
        out.extend_from_slice(&b);
        out
    }

    /// Parses a hello message body (after magic and length).
    ///
    /// # Errors
    /// [`Error::Format`] for a malformed message.
    pub fn parse(body: &[u8]) -> Result<(Hello, [u8; 16])> {
        let mut m = Msg(body);
        let major = m.u16()?;
        let minor = m.u16()?;
        let flags = m.u32()?;
        if flags & !1 != 0 {
            return Err(proto(format!("unknown hello flags 0x{flags:x}")));
        }
        let nonce: [u8; 16] = m.take(16)?.try_into().expect("16");
        let model = m.string()?;
        let n = m.u16()? as usize;
        let codecs = (0..n).map(|_| m.u16()).collect::<Result<Vec<_>>>()?;
        if !m.0.is_empty() {
            return Err(proto("bytes left over after the hello"));
        }
        Ok((
            Hello {
                version: (major, minor),
                model,
                codecs,
                authenticated: flags & 1 != 0,
            },
            nonce,
        ))
    }
}

/// What a receiver accepts.
#[derive(Debug, Clone, Default)]
pub struct Accept {
    /// Required model identity; `None` accepts any.
    pub model: Option<String>,
    /// Shared secret; `Some` requires an authenticated stream.
    pub secret: Option<Vec<u8>>,
}

/// The sender side of an authenticated session.
#[derive(Debug, Clone)]
struct Session {
    key: Vec<u8>,
    nonces: [u8; 32],
    seq: u64,
}

impl Session {
    fn tag(&self, data: &[u8]) -> [u8; TAG_LEN] {
        let mut m = HmacSha256::new_from_slice(&self.key).expect("HMAC takes any key length");
        m.update(b"kvpack-chunk");
        m.update(&self.nonces);
        m.update(&self.seq.to_le_bytes());
        m.update(&(data.len() as u32).to_le_bytes());
        m.update(data);
        m.finalize().into_bytes().into()
    }
}

/// Runs the sender's side of the handshake on `sock` and returns the
/// writer for the kvpack stream (chunked and tagged when `secret` is
/// given). Call [`StreamOut::finish`] after the stream.
///
/// # Errors
/// [`Error::Parameter`] with the receiver's reason when it refuses;
/// [`Error::Io`] on socket errors and timeouts; [`Error::Format`] for a
/// malformed reply.
pub fn client_handshake<S: Read + Write>(
    mut sock: S,
    hello: &Hello,
    secret: Option<&[u8]>,
) -> Result<StreamOut<S>> {
    let hello = Hello {
        authenticated: secret.is_some(),
        ..hello.clone()
    };
    let mine = nonce()?;
    sock.write_all(&hello.encode(&mine))
        .and_then(|_| sock.flush())
        .map_err(|e| Error::io("sending the handshake", e))?;
    let mut head = [0u8; 5 + 16];
    sock.read_exact(&mut head)
        .map_err(|e| Error::io("reading the receiver's handshake reply", e))?;
    if head[..4] != REPLY_MAGIC {
        return Err(proto(format!(
            "the receiver answered {:02x?}, not a kvpack handshake reply",
            &head[..4]
        )));
    }
    let mut len = [0u8; 4];
    sock.read_exact(&mut len)
        .map_err(|e| Error::io("reading the handshake reply", e))?;
    let n = u32::from_le_bytes(len);
    if n > MAX_HELLO {
        return Err(proto("handshake reply too long"));
    }
    let mut reason = vec![0u8; n as usize];
    sock.read_exact(&mut reason)
        .map_err(|e| Error::io("reading the handshake reply", e))?;
    let reason = String::from_utf8_lossy(&reason).into_owned();
    if head[4] != 0 {
        return Err(Error::param(format!(
            "the receiver refused the stream: {reason}"
        )));
    }
    let session = secret.map(|k| {
        let mut nonces = [0u8; 32];
        nonces[..16].copy_from_slice(&mine);
        nonces[16..].copy_from_slice(&head[5..21]);
        Session {
            key: k.to_vec(),
            nonces,
            seq: 0,
        }
    });
    Ok(StreamOut {
        sock,
        session,
        buf: Vec::new(),
    })
}

/// Runs the receiver's side: reads the hello, checks it against `accept`
/// (format major version, model identity, known codecs, authentication),
/// answers, and returns the hello and the reader of the kvpack stream
/// (tags verified before any byte is released when a secret is set).
///
/// # Errors
/// [`Error::Parameter`] naming the mismatch when the stream is refused
/// (the sender is told why); [`Error::Format`] for a malformed hello;
/// [`Error::Io`] on socket errors and timeouts.
pub fn server_handshake<S: Read + Write>(
    mut sock: S,
    accept: &Accept,
) -> Result<(Hello, StreamIn<S>)> {
    let mut head = [0u8; 8];
    sock.read_exact(&mut head)
        .map_err(|e| Error::io("reading the sender's handshake", e))?;
    if head[..4] != HELLO_MAGIC {
        return Err(proto(format!(
            "the peer sent {:02x?}, not a kvpack handshake (is it an older kvpack send?)",
            &head[..4]
        )));
    }
    let n = u32::from_le_bytes(head[4..].try_into().expect("4"));
    if n > MAX_HELLO {
        return Err(proto(format!(
            "handshake of {n} bytes, the limit is {MAX_HELLO}"
        )));
    }
    let mut body = vec![0u8; n as usize];
    sock.read_exact(&mut body)
        .map_err(|e| Error::io("reading the sender's handshake", e))?;
    let (hello, theirs) = Hello::parse(&body)?;
    let mine = nonce()?;
    let refusal = refusal(&hello, accept);
    let reason = refusal.clone().unwrap_or_default();
    let mut reply = REPLY_MAGIC.to_vec();
    reply.push(u8::from(refusal.is_some()));
    reply.extend_from_slice(&mine);
    put_str(&mut reply, &reason);
    sock.write_all(&reply)
        .and_then(|_| sock.flush())
        .map_err(|e| Error::io("answering the handshake", e))?;
    if let Some(r) = refusal {
        return Err(Error::param(format!("refused the sender's stream: {r}")));
    }
    let session = accept.secret.as_ref().map(|k| {
        let mut nonces = [0u8; 32];
        nonces[..16].copy_from_slice(&theirs);
        nonces[16..].copy_from_slice(&mine);
        Session {
            key: k.clone(),
            nonces,
            seq: 0,
        }
    });
    Ok((
        hello,
        StreamIn {
            sock,
            session,
            buf: Vec::new(),
            pos: 0,
            ended: false,
        },
    ))
}

fn refusal(h: &Hello, a: &Accept) -> Option<String> {
    if h.version.0 != crate::format::VERSION_MAJOR {
        return Some(format!(
            "format version {}.{} is not readable here (major {})",
            h.version.0,
            h.version.1,
            crate::format::VERSION_MAJOR
        ));
    }
    if let Some(m) = &a.model
        && *m != h.model
    {
        return Some(format!(
            "the cache is for model {:?}, this receiver wants {m:?}",
            h.model
        ));
    }
    if let Some(c) = h
        .codecs
        .iter()
        .find(|c| !crate::codec::registry::FAMILIES.iter().any(|f| f.id == **c))
    {
        return Some(format!("codec id {c} is unknown to this receiver"));
    }
    match (a.secret.is_some(), h.authenticated) {
        (true, false) => Some("this receiver requires an authenticated stream (--secret)".into()),
        (false, true) => {
            Some("this receiver has no shared secret; the stream is authenticated".into())
        }
        _ => None,
    }
}

/// The writer of the kvpack stream after the handshake.
#[derive(Debug)]
pub struct StreamOut<S: Write> {
    sock: S,
    session: Option<Session>,
    buf: Vec<u8>,
}

impl<S: Write> StreamOut<S> {
    fn emit(&mut self) -> std::io::Result<()> {
        let Some(s) = &mut self.session else {
            return Ok(());
        };
        let tag = s.tag(&self.buf);
        s.seq += 1;
        self.sock
            .write_all(&(self.buf.len() as u32).to_le_bytes())?;
        self.sock.write_all(&self.buf)?;
        self.sock.write_all(&tag)?;
        self.buf.clear();
        Ok(())
    }

    /// Ends the stream (the authenticated end marker when a secret is
    /// used) and returns the socket.
    ///
    /// # Errors
    /// [`Error::Io`] on socket errors.
    pub fn finish(mut self) -> Result<S> {
        if self.session.is_some() {
            if !self.buf.is_empty() {
                self.emit().map_err(|e| Error::io("sending", e))?;
            }
            self.emit()
                .map_err(|e| Error::io("sending the end marker", e))?;
        }
        self.sock.flush().map_err(|e| Error::io("flushing", e))?;
        Ok(self.sock)
    }
}

impl<S: Write> Write for StreamOut<S> {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.session.is_none() {
            return self.sock.write(data);
        }
        let n = data.len().min(MAX_CHUNK - self.buf.len());
        self.buf.extend_from_slice(&data[..n]);
        if self.buf.len() == MAX_CHUNK {
            self.emit()?;
        }
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        if self.session.is_some() && !self.buf.is_empty() {
            self.emit()?;
        }
        self.sock.flush()
    }
}

/// The reader of the kvpack stream after the handshake.
#[derive(Debug)]
pub struct StreamIn<S: Read> {
    sock: S,
    session: Option<Session>,
    buf: Vec<u8>,
    pos: usize,
    ended: bool,
}

impl<S: Read> StreamIn<S> {
    fn next_chunk(&mut self) -> std::io::Result<()> {
        let bad = |m: String| std::io::Error::new(ErrorKind::InvalidData, m);
        let s = self.session.as_mut().expect("authenticated");
        let mut len = [0u8; 4];
        self.sock.read_exact(&mut len).map_err(|e| {
            if e.kind() == ErrorKind::UnexpectedEof {
                bad("the authenticated stream ended without its end marker".into())
            } else {
                e
            }
        })?;
        let n = u32::from_le_bytes(len) as usize;
        if n > MAX_CHUNK {
            return Err(bad(format!("chunk of {n} bytes, the limit is {MAX_CHUNK}")));
        }
        self.buf.resize(n, 0);
        self.sock.read_exact(&mut self.buf)?;
        let mut tag = [0u8; TAG_LEN];
        self.sock.read_exact(&mut tag)?;
        let mut m = HmacSha256::new_from_slice(&s.key).expect("any key length");
        m.update(b"kvpack-chunk");
        m.update(&s.nonces);
        m.update(&s.seq.to_le_bytes());
        m.update(&len);
        m.update(&self.buf);
        m.verify_slice(&tag).map_err(|_| {
            bad(format!(
                "chunk {} failed authentication (wrong secret, or the stream was altered)",
                s.seq
            ))
        })?;
        s.seq += 1;
        self.pos = 0;
        if n == 0 {
            self.ended = true;
        }
        Ok(())
    }
}

impl<S: Read> Read for StreamIn<S> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        if self.session.is_none() {
            return self.sock.read(out);
        }
        while self.pos == self.buf.len() {
            if self.ended {
                return Ok(0);
            }
            self.next_chunk()?;
        }
        let n = out.len().min(self.buf.len() - self.pos);
        out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// Waits for one sender on `l` ([`accept`]), runs the receiver's handshake
/// ([`server_handshake`]) and returns the sender's hello, the guarded
/// reader of its kvpack stream (idle and total timeouts, byte cap) and the
/// peer's address.
///
/// # Errors
/// As [`accept`] and [`server_handshake`].
pub fn receive(
    l: &TcpListener,
    limits: &NetLimits,
    accept_rules: &Accept,
) -> Result<(Hello, StreamIn<Guarded<TcpStream>>, SocketAddr)> {
    let (s, peer) = accept(l, limits)?;
    let (hello, r) = server_handshake(Guarded::new(s, *limits), accept_rules)?;
    Ok((hello, r, peer))
}
