//! `kvpack compress`.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args as ClapArgs;
use kvpack::budget;
use kvpack::io::{file, safetensors};

use crate::output;

/// Compress a safetensors KV cache (HF layout: past_key_values.{layer}.key /
/// .value, [batch, kv_heads, tokens, head_dim], bf16/fp16/fp32, or fp8
/// F8_E4M3 / F8_E5M2 with {name}_scale tensors; MLA caches:
/// past_key_values.{layer}.latent, [batch, 1, tokens, latent_dim]) into a
/// .kvpack file.
#[derive(ClapArgs, Debug)]
pub struct Args {
    /// Input safetensors file, or - for stdin.
    pub input: String,
    /// Codec name: raw, int2/int3/int4/int8, bdr16..bdr256, bdr128:k, ...
    /// (see `kvpack codecs`).
    #[arg(long, short = 'c', default_value = "bdr128")]
    pub codec: String,
    /// Instead of one codec: a budget in bits per element, everything
    /// counted (codes, scales, windows, headers, index). The planner
    /// chooses per layer and K/V the codec, its parameters and a sink
    /// window, minimising the attention-output error it measures on the
    /// cache itself; `kvpack inspect` shows the plan.
    #[arg(long, value_name = "B", conflicts_with_all = ["codec", "sink", "recent", "key_codec"])]
    pub bits: Option<f64>,
    /// A different codec for the keys (and MLA latents); --codec then codes
    /// the values only. Keys need more bits than values for the same
    /// attention error, e.g. `--key-codec hqmq:s48r4+ctr --codec hqmq:s12r2
    /// --sink 1` (3.24 bits/element on Gemma-3-270M). Windows as given, or
    /// the larger of the two codecs' own.
    #[arg(long, value_name = "CODEC")]
    pub key_codec: Option<String>,
    /// Output file, or - for stdout [default: INPUT with extension .kvpack].
    #[arg(long, short = 'o')]
    pub output: Option<String>,
    #[command(flatten)]
    pub layout: output::LayoutArgs,
    /// Frame alignment in bytes: 64, or 4096 for O_DIRECT / GPUDirect
    /// Storage.
    #[arg(long, default_value_t = 64, value_parser = parse_align)]
    pub align: u32,
    /// Overwrite the output if it exists.
    #[arg(long, short = 'f')]
    pub force: bool,
    /// Print a JSON report.
    #[arg(long)]
    pub json: bool,
    /// No progress bar or summary.
    #[arg(long, short = 'q')]
    pub quiet: bool,
}

fn parse_align(s: &str) -> Result<u32, String> {
    match s {
        "64" => Ok(64),
        "4096" => Ok(4096),
        _ => Err("alignment must be 64 or 4096".into()),
    }
}

pub fn run(a: Args) -> Result<u8> {
    let codec = match a.bits {
        Some(_) => kvpack::codec::parse("raw")?,
        None => kvpack::codec::parse(&a.codec)?,
    };
    let input = output::open_any(&a.input)?;
    // Borrow the elements from the input (a memory map for a regular file):
    // memory stays at a few pages per thread whatever the cache size. An
    // input whose arrays cannot be borrowed (misaligned) is copied.
    let owned;
    let (cache, ignored) = match safetensors::parse_view(&input, &a.input) {
        Ok(v) => (v.cache, v.ignored),
        Err(kvpack::Error::Unsupported(_)) => {
            owned = safetensors::parse(&input, &a.input)?;
            (owned.cache.view(), owned.ignored.clone())
        }
        Err(e) => return Err(e.into()),
    };
    let layers = cache
        .tensors
        .iter()
        .map(|t| t.info.layer as usize + 1)
        .max()
        .unwrap_or(0);
    let out_name = output::output_name(&a.input, a.output.as_deref(), "kvpack")?;
    let mut opts = a
        .layout
        .options(codec.as_ref(), a.align.trailing_zeros() as u8);
    let pb = output::progress(cache.source_bytes(), "compress", a.quiet || a.json);
    let progress = |n: u64| pb.set_position(n);
    let key_codec = a
        .key_codec
        .as_deref()
        .map(kvpack::codec::parse)
        .transpose()?;
    if let Some(k) = &key_codec {
        // Windows left unset: both codecs' own.
        opts.layout =
            budget::split_windows(opts.layout, k.as_ref(), a.layout.sink, a.layout.recent);
    }
    let method = match (a.bits, &key_codec) {
        (Some(bits), _) => budget::Method::Bits(bits),
        (None, Some(k)) => budget::Method::Split {
            key: k.as_ref(),
            value: codec.as_ref(),
        },
        (None, None) => budget::Method::Codec(codec.as_ref()),
    };
    // A mapped input's tensor is dropped from memory once encoded.
    let done = |t: usize| input.release_slice(cache.tensors[t].elems().bytes());
    let encode = |w: &mut (dyn Write + Send)| -> kvpack::Result<kvpack::CompressReport> {
        Ok(budget::compress_with_release(&cache, method, &opts, w, &progress, &done)?.1)
    };
    let report = if out_name == "-" {
        let mut w = std::io::BufWriter::new(std::io::stdout());
        let r = encode(&mut w)?;
        w.flush().context("writing stdout")?;
        r
    } else {
        let mut rep = None;
        file::write_atomic(&PathBuf::from(&out_name), a.force, |w| {
            rep = Some(encode(w)?);
            Ok(())
        })?;
        rep.expect("set by write_atomic's closure")
    };
    pb.finish_and_clear();
    let gbps = report.source_bytes as f64 / report.seconds.max(1e-9) / 1e9;
    if a.json {
        let v = serde_json::json!({
            "input": a.input,
            "output": out_name,
            "codec": report.codec,
            "layers": layers,
            "tensors": cache.tensors.len(),
            "pages": report.pages,
            "raw_pages": report.raw_pages,
            "elements": report.elements,
            "source_bytes": report.source_bytes,
            "output_bytes": report.output_bytes,
            "bits_per_element": report.bits_per_element(),
            "compression_ratio": report.ratio(),
            "seconds": report.seconds,
            "throughput_gb_per_s": gbps,
            "ignored_tensors": ignored,
        });
        output::print_json(&v, out_name == "-");
    } else if !a.quiet {
        let tokens: Vec<u32> = cache
            .tensors
            .iter()
            .step_by(2)
            .map(|t| t.info.tokens)
            .collect();
        let (tmin, tmax) = (
            tokens.iter().min().copied().unwrap_or(0),
            tokens.iter().max().copied().unwrap_or(0),
        );
        eprintln!(
            "{} -> {}: {} layers, {} tokens/layer, codec {}, {} pages ({} raw)",
            a.input,
            out_name,
            layers,
            if tmin == tmax {
                tmin.to_string()
            } else {
                format!("{tmin}..{tmax}")
            },
            report.codec,
            report.pages,
            report.raw_pages
        );
        eprintln!(
            "{} -> {} ({:.2}x), {:.3} bits/element everything included, {:.2} s ({:.2} GB/s)",
            output::bytes(report.source_bytes),
            output::bytes(report.output_bytes),
            report.ratio(),
            report.bits_per_element(),
            report.seconds,
            gbps
        );
        if !ignored.is_empty() {
            eprintln!(
                "note: {} non-KV tensors not stored (e.g. {})",
                ignored.len(),
                ignored[0]
            );
        }
    }
    Ok(crate::EXIT_OK)
}
