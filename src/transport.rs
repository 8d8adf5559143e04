//! Moving a KV cache over a byte stream: a rate limiter that emulates a
//! slower link, and the sender side of the prefill-to-decode handoff (the
//! receiver side is [`crate::stream_decode::decode_stream`]). The wire format
//! is the kvpack stream (format/SPEC.md section 11), nothing else.

use std::io::Write;
use std::net::ToSocketAddrs;
use std::time::{Duration, Instant};

use crate::cache::KvCache;
use crate::codec::Codec;
use crate::compress::{CompressOptions, CompressReport, compress};
use crate::error::{Error, Result};
use crate::net::{Guarded, Hello, NetLimits};

/// A writer that never exceeds `bytes_per_second` on average since its
/// creation (a token bucket with no burst beyond one 64 KiB chunk),
/// emulating a slower network link.
#[derive(Debug)]
pub struct RateLimited<W> {
    inner: W,
    bytes_per_second: f64,
    start: Option<Instant>,
    sent: u64,
}

impl<W: Write> RateLimited<W> {
    /// Limits `inner` to `gbit` gigabits per second (`10` = 1.25 GB/s);
    /// `None` or a non-positive value means unlimited.
    pub fn new(inner: W, gbit: Option<f64>) -> Self {
        let bytes_per_second = gbit
            .filter(|g| *g > 0.0)
            .map(|g| g * 1e9 / 8.0)
            .unwrap_or(f64::INFINITY);
        RateLimited {
            inner,
            bytes_per_second,
            start: None,
            sent: 0,
        }
    }

    /// The wrapped writer.
    pub fn into_inner(self) -> W {
        self.inner
    }
}

impl<W: Write> Write for RateLimited<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes_per_second.is_infinite() {
            return self.inner.write(buf);
        }
        let start = *self.start.get_or_insert_with(Instant::now);
        let n = buf.len().min(64 << 10);
        let due = Duration::from_secs_f64((self.sent + n as u64) as f64 / self.bytes_per_second);
        let now = start.elapsed();
        if due > now {
            std::thread::sleep(due - now);
        }
        let w = self.inner.write(&buf[..n])?;
        self.sent += w as u64;
        Ok(w)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// What [`send`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct SendReport {
    /// The compression report (output_bytes = bytes put on the wire).
    pub compress: CompressReport,
    /// Time from connecting until the last byte was handed to the socket.
    pub seconds: f64,
}

/// How [`send_with`] connects and what it announces.
#[derive(Debug, Clone, Default)]
pub struct SendOptions {
    /// Connect/idle/total timeouts (the byte cap is the receiver's).
    pub limits: NetLimits,
    /// Shared secret: the stream is authenticated with HMAC-SHA256
    /// ([`crate::net`]).
    pub secret: Option<Vec<u8>>,
}

/// [`send_with`] with default timeouts and no secret.
///
/// # Errors
/// As [`send_with`].
pub fn send(
    cache: &KvCache,
    codec: &dyn Codec,
    opts: &CompressOptions,
    addr: impl ToSocketAddrs + std::fmt::Debug,
    gbit: Option<f64>,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<SendReport> {
    send_with(
        cache,
        codec,
        opts,
        addr,
        gbit,
        &SendOptions::default(),
        progress,
    )
}

/// Connects to `addr` (within the connect timeout), runs the handshake
/// (format version, model identity from `kvpack.model`, codec ids; the
/// receiver may refuse) and streams `cache` encoded with `codec`: pages
/// are encoded on the rayon pool while earlier pages are on the wire, in
/// layer-major order, optionally through a [`RateLimited`] link of
/// `gbit`. A receiver that stops reading for the idle timeout ends the
/// send with an error.
///
/// # Errors
/// [`Error::Io`] when connecting or sending fails or times out (e.g. the
/// receiver closed the connection); [`Error::Parameter`] when the receiver
/// refuses the handshake, with its reason; the errors of [`compress`].
pub fn send_with(
    cache: &KvCache,
    codec: &dyn Codec,
    opts: &CompressOptions,
    addr: impl ToSocketAddrs + std::fmt::Debug,
    gbit: Option<f64>,
    net: &SendOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<SendReport> {
    let stream = crate::net::connect(addr, &net.limits)?;
    let start = Instant::now();
    let hello = Hello {
        version: (crate::format::VERSION_MAJOR, crate::format::VERSION_MINOR),
        model: cache
            .metadata
            .get(crate::decode::MODEL_KEY)
            .cloned()
            .unwrap_or_default(),
        codecs: vec![crate::codec::raw::ID, codec.id()],
        authenticated: net.secret.is_some(),
    };
    let out = crate::net::client_handshake(
        Guarded::new(stream, net.limits),
        &hello,
        net.secret.as_deref(),
    )?;
    let w = std::io::BufWriter::with_capacity(1 << 20, RateLimited::new(out, gbit));
    let (w, report) = compress(cache, codec, opts, w, progress)?;
    let out = w
        .into_inner()
        .map_err(|e| Error::io("flushing the socket", e.into_error()))?
        .into_inner();
    let stream = out.finish()?.into_inner();
    stream
        .shutdown(std::net::Shutdown::Write)
        .map_err(|e| Error::io("closing the stream", e))?;
    Ok(SendReport {
        compress: report,
        seconds: start.elapsed().as_secs_f64(),
    })
}
