//! `kvpack decompress`.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args as ClapArgs;
use kvpack::decode::{Archive, DecodeStats, Selection, parse_range};
use kvpack::io::{file, safetensors};
use kvpack::{DType, Kind};

use crate::output;

/// Decompress a .kvpack file to safetensors: by default the same tensor
/// names, shapes and dtypes as the source. --layers, --tokens and --kind
/// decode only part of the cache, reading only the pages that hold it.
#[derive(ClapArgs, Debug)]
pub struct Args {
    /// Input .kvpack file, or - for stdin.
    pub input: String,
    /// Output safetensors file, or - for stdout [default: INPUT with
    /// extension .safetensors].
    #[arg(long, short = 'o')]
    pub output: Option<String>,
    /// Output element type [default: the source dtype].
    #[arg(long, value_parser = ["bf16", "fp16", "fp32"])]
    pub dtype: Option<String>,
    /// Only layers A..B (half-open, e.g. 0..4; ..4 and 4.. work too).
    #[arg(long, value_name = "A..B")]
    pub layers: Option<String>,
    /// Only cache slots A..B of each layer (e.g. 128..512).
    #[arg(long, value_name = "A..B")]
    pub tokens: Option<String>,
    /// Only keys (k) or only values (v).
    #[arg(long, value_parser = ["k", "v"])]
    pub kind: Option<String>,
    /// Overwrite the output if it exists.
    #[arg(long, short = 'f')]
    pub force: bool,
    /// Print a JSON report.
    #[arg(long)]
    pub json: bool,
    /// No summary.
    #[arg(long, short = 'q')]
    pub quiet: bool,
}

pub fn run(a: Args) -> Result<u8> {
    let sel = Selection {
        layers: a.layers.as_deref().map(parse_range).transpose()?,
        tokens: a.tokens.as_deref().map(parse_range).transpose()?,
        kind: a
            .kind
            .as_deref()
            .map(|k| if k == "k" { Kind::Key } else { Kind::Value }),
    };
    let dtype = a.dtype.as_deref().map(DType::parse).transpose()?;
    let input = output::open_kvpack(&a.input)?;
    let start = Instant::now();
    let archive = Archive::open_with(&input, output::limits())
        .map(|a| a.with_private_pages(input.is_mapped()))?;
    let stats = DecodeStats::default();
    let cache = archive.decode(&sel, dtype, Some(&stats))?;
    let decode_s = start.elapsed().as_secs_f64();
    if cache.tensors.is_empty() {
        anyhow::bail!(kvpack::Error::param("the selection matches no tensor"));
    }
    let out_name = output::output_name(&a.input, a.output.as_deref(), "safetensors")?;
    if out_name == "-" {
        let mut w = std::io::BufWriter::new(std::io::stdout().lock());
        safetensors::write(&cache, &mut w)?;
        w.flush().context("writing stdout")?;
    } else {
        file::write_atomic(&PathBuf::from(&out_name), a.force, |w| {
            safetensors::write(&cache, w)
        })?;
    }
    let out_bytes = cache.source_bytes();
    let pages = stats.pages.load(std::sync::atomic::Ordering::Relaxed);
    let total_pages = archive.reader().index().entries.len();
    if a.json {
        output::print_json(
            &serde_json::json!({
                "input": a.input,
                "output": out_name,
                "tensors": cache.tensors.len(),
                "elements": cache.elements(),
                "output_bytes": out_bytes,
                "pages_decoded": pages,
                "pages_total": total_pages,
                "bytes_read": stats.bytes_read.load(std::sync::atomic::Ordering::Relaxed),
                "decode_seconds": decode_s,
                "decode_gb_per_s": out_bytes as f64 / decode_s.max(1e-9) / 1e9,
            }),
            out_name == "-",
        );
    } else if !a.quiet {
        eprintln!(
            "{} -> {}: {} tensors, {} pages of {} decoded, {} in {:.3} s ({:.2} GB/s decode)",
            a.input,
            out_name,
            cache.tensors.len(),
            pages,
            total_pages,
            output::bytes(out_bytes),
            decode_s,
            out_bytes as f64 / decode_s.max(1e-9) / 1e9
        );
        if archive.reader().torn_tail() > 0 {
            eprintln!(
                "warning: {} bytes after the last complete commit were ignored (an interrupted append)",
                archive.reader().torn_tail()
            );
        }
    }
    Ok(crate::EXIT_OK)
}
