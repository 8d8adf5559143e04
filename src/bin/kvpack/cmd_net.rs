//! `kvpack send`, `kvpack recv`, `kvpack append` and `kvpack match`.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Args as ClapArgs;
use kvpack::DType;
use kvpack::compress::CompressOptions;
use kvpack::format::{StreamEvent, StreamReader};
use kvpack::io::{file, safetensors};
use kvpack::net::{Accept, NetLimits};
use serde_json::json;

use crate::output;

/// Stream a safetensors KV cache to a `kvpack recv` over TCP, encoding page
/// k+1 while page k is on the wire (layer-major order, so the receiver can
/// start on layer 0 at once).
#[derive(ClapArgs, Debug)]
pub struct SendArgs {
    /// Input safetensors file, or - for stdin.
    pub input: String,
    /// Receiver address, HOST:PORT.
    #[arg(long, value_name = "HOST:PORT")]
    pub to: String,
    /// Codec name (see `kvpack codecs`).
    #[arg(long, short = 'c', default_value = "bdr128")]
    pub codec: String,
    /// Emulate a slower link: at most GBIT gigabits per second.
    #[arg(long, value_name = "GBIT")]
    pub rate_limit: Option<f64>,
    #[command(flatten)]
    pub layout: output::LayoutArgs,
    #[command(flatten)]
    pub net: NetArgs,
    /// Print a JSON report.
    #[arg(long)]
    pub json: bool,
    /// No progress or summary.
    #[arg(long, short = 'q')]
    pub quiet: bool,
}

/// Timeouts and authentication shared by send and recv.
#[derive(clap::Args, Debug)]
pub struct NetArgs {
    /// Seconds to wait for the connection (send: to connect; recv: for a
    /// sender, default forever).
    #[arg(long, value_name = "SECS")]
    pub connect_timeout: Option<f64>,
    /// Seconds without progress before giving up (a stalled or trickling
    /// peer).
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    pub idle_timeout: f64,
    /// Seconds for the whole transfer.
    #[arg(long, value_name = "SECS", default_value_t = 3600.0)]
    pub total_timeout: f64,
    /// File holding a shared secret: the stream is authenticated with
    /// HMAC-SHA256; both sides need the same secret.
    #[arg(long, value_name = "FILE")]
    pub secret_file: Option<String>,
}

impl NetArgs {
    fn limits(&self, default_connect: Option<f64>, max_bytes: u64) -> Result<NetLimits> {
        let secs = |v: f64, what: &str| {
            Duration::try_from_secs_f64(v).map_err(|_| {
                kvpack::Error::param(format!("--{what} must be a positive number of seconds"))
            })
        };
        Ok(NetLimits {
            connect: self
                .connect_timeout
                .or(default_connect)
                .map(|v| secs(v, "connect-timeout"))
                .transpose()?,
            idle: secs(self.idle_timeout, "idle-timeout")?,
            total: secs(self.total_timeout, "total-timeout")?,
            max_bytes,
        })
    }

    fn secret(&self) -> Result<Option<Vec<u8>>> {
        let Some(p) = &self.secret_file else {
            return Ok(None);
        };
        let mut s = std::fs::read(p).map_err(|e| kvpack::Error::io(format!("reading {p}"), e))?;
        while s.last().is_some_and(|b| b.is_ascii_whitespace()) {
            s.pop();
        }
        if s.len() < 16 {
            return Err(kvpack::Error::param(format!(
                "the secret in {p} is {} bytes; use at least 16",
                s.len()
            ))
            .into());
        }
        Ok(Some(s))
    }
}

/// Receive one stream from `kvpack send` and write it out only once it is
/// complete and valid. To .safetensors: pages are decoded while they arrive
/// and each completed layer is reported. To .kvpack: the stream is checked
/// and stored as is (it is a valid random-access file).
#[derive(ClapArgs, Debug)]
pub struct RecvArgs {
    /// Address to listen on, e.g. 0.0.0.0:7070 or 127.0.0.1:0.
    #[arg(long, value_name = "ADDR")]
    pub listen: String,
    /// Output file: .kvpack keeps the compressed stream, anything else is
    /// written as safetensors.
    #[arg(long, short = 'o')]
    pub output: String,
    /// Output element type for safetensors [default: the source dtype].
    #[arg(long, value_parser = ["bf16", "fp16", "fp32"])]
    pub dtype: Option<String>,
    /// Overwrite the output if it exists.
    #[arg(long, short = 'f')]
    pub force: bool,
    /// Refuse a sender whose cache is for another model (kvpack.model).
    #[arg(long)]
    pub model: Option<String>,
    /// Most bytes accepted from the sender [default: 64G].
    #[arg(long, value_name = "BYTES", value_parser = output::parse_size)]
    pub max_bytes: Option<u64>,
    #[command(flatten)]
    pub net: NetArgs,
    /// Print a JSON report.
    #[arg(long)]
    pub json: bool,
    /// No per-layer reports.
    #[arg(long, short = 'q')]
    pub quiet: bool,
}

/// Append the tokens that follow the stored ones (a longer cache of the same
/// conversation) as a new commit, without rewriting existing pages. Crash
/// safe: an interrupted append leaves the previous cache readable.
#[derive(ClapArgs, Debug)]
pub struct AppendArgs {
    /// The .kvpack prompt cache to extend.
    pub cache: String,
    /// The longer cache (safetensors) whose first tokens are the stored ones.
    pub more: String,
    /// Append even when neither side has token ids to prove the prefix.
    #[arg(long, short = 'f')]
    pub force: bool,
    /// Print a JSON report.
    #[arg(long)]
    pub json: bool,
    /// No summary.
    #[arg(long, short = 'q')]
    pub quiet: bool,
}

/// Check a prompt cache against a model and prompt: prints how many leading
/// tokens of the prompt the cache can serve (0 when none). Sliding-window
/// layers count: once a layer's window rolled, the cache serves its whole
/// prefix or nothing (--json lists the rolled layers and the reason). Exit 2 when the cache
/// belongs to another model or records no token ids.
#[derive(ClapArgs, Debug)]
pub struct MatchArgs {
    /// The .kvpack prompt cache.
    pub cache: String,
    /// Model name the prompt is for (compared with kvpack.model).
    #[arg(long)]
    pub model: String,
    /// Prompt token ids: a JSON list, or a file holding one (@FILE).
    #[arg(long, value_name = "JSON|@FILE")]
    pub tokens: String,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn send(a: SendArgs) -> Result<u8> {
    let codec = kvpack::codec::parse(&a.codec)?;
    let input = output::open_any(&a.input)?;
    let cache = safetensors::parse(&input, &a.input)?.cache;
    let opts = a
        .layout
        .options(codec.as_ref(), kvpack::format::DEFAULT_ALIGN_LOG2);
    let pb = output::progress(cache.source_bytes(), "send", a.quiet || a.json);
    let net = kvpack::transport::SendOptions {
        limits: a.net.limits(Some(10.0), u64::MAX)?,
        secret: a.net.secret()?,
    };
    let r = kvpack::transport::send_with(
        &cache,
        codec.as_ref(),
        &opts,
        a.to.as_str(),
        a.rate_limit,
        &net,
        &|n| pb.set_position(n),
    )?;
    pb.finish_and_clear();
    let wire_gbit = r.compress.output_bytes as f64 * 8.0 / r.seconds.max(1e-9) / 1e9;
    if a.json {
        output::print_json(
            &json!({"to": a.to, "codec": r.compress.codec, "source_bytes": r.compress.source_bytes, "wire_bytes": r.compress.output_bytes,
                    "bits_per_element": r.compress.bits_per_element(), "seconds": r.seconds, "wire_gbit_per_s": wire_gbit,
                    "rate_limit_gbit": a.rate_limit}),
            false,
        );
    } else if !a.quiet {
        eprintln!(
            "sent {} as {} ({}, {:.3} bits/element) in {:.3} s ({:.2} Gbit/s on the wire)",
            output::bytes(r.compress.source_bytes),
            output::bytes(r.compress.output_bytes),
            r.compress.codec,
            r.compress.bits_per_element(),
            r.seconds,
            wire_gbit
        );
    }
    Ok(crate::EXIT_OK)
}

/// Copies everything read into a writer.
struct Tee<R, W> {
    r: R,
    w: W,
}

impl<R: Read, W: Write> Read for Tee<R, W> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.r.read(buf)?;
        self.w.write_all(&buf[..n])?;
        Ok(n)
    }
}

pub fn recv(a: RecvArgs) -> Result<u8> {
    let out = PathBuf::from(&a.output);
    // Everything that can fail before a byte arrives fails before listening.
    file::check_writable(&out, a.force)?;
    let dtype = a.dtype.as_deref().map(DType::parse).transpose()?;
    let limits = a
        .net
        .limits(None, a.max_bytes.unwrap_or(NetLimits::default().max_bytes))?;
    let rules = Accept {
        model: a.model.clone(),
        secret: a.net.secret()?,
    };
    let listener = TcpListener::bind(&a.listen)
        .map_err(|e| kvpack::Error::io(format!("listening on {}", a.listen), e))?;
    let local = listener.local_addr()?;
    if !a.quiet {
        eprintln!("listening on {local}");
    }
    let (_hello, stream, peer) = kvpack::net::receive(&listener, &limits, &rules)?;
    let start = Instant::now();
    let reader = std::io::BufReader::with_capacity(1 << 20, stream);
    let quiet = a.quiet || a.json;
    let report_layer = |l: u32, t: Duration| {
        if !quiet {
            eprintln!("layer {l} complete at {:.1} ms", t.as_secs_f64() * 1e3);
        }
    };
    let summary = if a.output.ends_with(".kvpack") {
        let mut pages = 0usize;
        let mut bytes = 0u64;
        file::write_atomic(&out, a.force, |w| {
            let mut sr = StreamReader::with_limits(Tee { r: reader, w }, output::limits())?;
            let codecs = sr
                .header()
                .codecs
                .iter()
                .enumerate()
                .map(|(i, e)| kvpack::codec::from_entry(i, e))
                .collect::<kvpack::Result<Vec<_>>>()?;
            while let Some(ev) = sr.next_event()? {
                if let StreamEvent::Page(p) = ev {
                    // Validated by its codec before the output is committed.
                    kvpack::stream_decode::check_page(&codecs, sr.header(), &p, &output::limits())?;
                    pages += 1;
                    let t = &sr.header().tensors[p.header.meta.tensor as usize];
                    if p.header.meta.token_start + p.header.meta.tokens == t.tokens
                        && matches!(t.kind, kvpack::Kind::Value | kvpack::Kind::Latent)
                    {
                        report_layer(t.layer, start.elapsed());
                    }
                }
            }
            bytes = sr.bytes_read();
            Ok(())
        })?;
        json!({"from": peer.to_string(), "output": a.output, "pages": pages, "bytes": bytes, "seconds": start.elapsed().as_secs_f64()})
    } else if file::is_special(&out) {
        // A FIFO or device is written in order: the decoded cache is held
        // in memory until the commit arrives.
        let d = kvpack::stream_decode::decode_stream_with(
            reader,
            dtype,
            output::limits(),
            &report_layer,
        )?;
        file::write_atomic(&out, a.force, |w| safetensors::write(&d.cache, w))?;
        json!({"from": peer.to_string(), "output": a.output, "pages": d.pages, "bytes": d.bytes,
               "received_seconds": d.received.as_secs_f64(), "decoded_seconds": d.decoded.as_secs_f64(),
               "first_layer_seconds": d.layer_done.first().map(|x| x.1.as_secs_f64()),
               "seconds": start.elapsed().as_secs_f64()})
    } else {
        // Each page is decoded as it arrives and written at its place in
        // the temporary output: a few pages per thread in memory. The
        // header's room for token ids (which come with the commit) is
        // sized from the longest tensor.
        let mut report = None;
        file::write_atomic_file(&out, a.force, |f| {
            let layout = std::sync::OnceLock::<safetensors::Layout>::new();
            let r = kvpack::stream_decode::decode_stream_pieces(
                reader,
                dtype,
                output::limits(),
                |h, infos| {
                    let most = infos.iter().map(|t| t.tokens as usize).max().unwrap_or(0);
                    let l = safetensors::Layout::with_room(infos, &h.metadata, most)?;
                    f.set_len(l.len())
                        .map_err(|e| kvpack::Error::io(format!("sizing {}", a.output), e))?;
                    let _ = layout.set(l);
                    Ok(())
                },
                &report_layer,
                &|p| {
                    let l = layout.get().expect("set before any page");
                    l.write_piece(f, p.output, p.token, p.tokens, p.elems)
                },
            )?;
            let mut l = layout.into_inner().expect("set by on_header");
            l.finish(f, &r.token_ids)?;
            report = Some(r);
            Ok(())
        })?;
        let d = report.expect("set by write_atomic_file's closure");
        json!({"from": peer.to_string(), "output": a.output, "pages": d.pages, "bytes": d.bytes,
               "received_seconds": d.received.as_secs_f64(), "decoded_seconds": d.decoded.as_secs_f64(),
               "first_layer_seconds": d.layer_done.first().map(|x| x.1.as_secs_f64()),
               "seconds": start.elapsed().as_secs_f64()})
    };
    if a.json {
        output::print_json(&summary, false);
    } else if !a.quiet {
        eprintln!(
            "received {} bytes from {peer} into {} in {:.3} s",
            summary["bytes"],
            a.output,
            start.elapsed().as_secs_f64()
        );
    }
    Ok(crate::EXIT_OK)
}

pub fn append(a: AppendArgs) -> Result<u8> {
    let more = output::open_any(&a.more)?;
    let longer = safetensors::parse(&more, &a.more)?.cache;
    let pb = output::progress(longer.source_bytes(), "append", a.quiet || a.json);
    let r = file::append_file(
        &PathBuf::from(&a.cache),
        &longer,
        a.force,
        &CompressOptions::default(),
        &|n| pb.set_position(n),
    )?;
    pb.finish_and_clear();
    if a.json {
        output::print_json(
            &json!({"cache": a.cache, "generation": r.generation, "pages_added": r.report.pages, "bytes_added": r.report.output_bytes,
                    "elements_added": r.report.elements, "torn_tail_removed": r.torn_tail_removed, "seconds": r.report.seconds}),
            false,
        );
    } else if !a.quiet {
        if r.torn_tail_removed > 0 {
            eprintln!(
                "removed {} bytes of an interrupted earlier append",
                r.torn_tail_removed
            );
        }
        eprintln!(
            "{}: commit {} adds {} pages ({} elements, {})",
            a.cache,
            r.generation,
            r.report.pages,
            r.report.elements,
            output::bytes(r.report.output_bytes)
        );
    }
    Ok(crate::EXIT_OK)
}

pub fn matching(a: MatchArgs) -> Result<u8> {
    let text = match a.tokens.strip_prefix('@') {
        Some(p) => {
            std::fs::read_to_string(p).map_err(|e| kvpack::Error::io(format!("reading {p}"), e))?
        }
        None => a.tokens.clone(),
    };
    let prompt: Vec<u32> = serde_json::from_str(&text).map_err(|e| {
        kvpack::Error::param(format!("--tokens must be a JSON list of token ids: {e}"))
    })?;
    let input = output::open_kvpack(&a.cache)?;
    let ar = output::open_archive(&input)?;
    let m = kvpack::prompt::match_prefix(&ar, &a.model, &prompt)?;
    if a.json {
        output::print_json(
            &json!({"cache": a.cache, "model": a.model, "cached_tokens": m.cached, "prompt_tokens": prompt.len(),
                    "matching_prefix": m.matching, "usable_prefix": m.usable,
                    "rolled_layers": m.rolled.iter().map(|r| json!({"layer": r.layer, "holds": [r.first, r.end]})).collect::<Vec<_>>(),
                    "reason": m.reason}),
            false,
        );
    } else {
        if let Some(r) = &m.reason {
            eprintln!("note: {r}");
        }
        println!("{}", m.usable);
    }
    Ok(crate::EXIT_OK)
}
