//! `kvpack decompress`.

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args as ClapArgs;
use kvpack::cache::TensorInfo;
use kvpack::decode::{DecodeStats, Selection, parse_range};
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
    /// Output element type [default: the source dtype]. fp8 outputs take
    /// the scale of an fp8 source (scale 1 for other sources) and are
    /// written with a `{name}_scale` tensor.
    #[arg(long, value_parser = ["bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2"])]
    pub dtype: Option<String>,
    /// Only layers A..B (half-open, e.g. 0..4; ..4 and 4.. work too).
    #[arg(long, value_name = "A..B")]
    pub layers: Option<String>,
    /// Only cache slots A..B of each layer (e.g. 128..512).
    #[arg(long, value_name = "A..B")]
    pub tokens: Option<String>,
    /// Only keys (k), only values (v) or only MLA latents (latent).
    #[arg(long, value_parser = ["k", "v", "latent"])]
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
        kind: a.kind.as_deref().map(Kind::parse).transpose()?,
    };
    let dtype = a.dtype.as_deref().map(DType::parse).transpose()?;
    let input = output::open_kvpack(&a.input)?;
    let start = Instant::now();
    let archive = output::open_archive(&input)?;
    let stats = DecodeStats::default();
    // The output tensors and their declared size, checked before anything
    // is allocated or written.
    let selected = archive.select(&sel, dtype);
    if selected.is_empty() {
        anyhow::bail!(kvpack::Error::param("the selection matches no tensor"));
    }
    archive.check_output(&selected)?;
    let infos: Vec<TensorInfo> = selected.iter().map(|s| s.info.clone()).collect();
    let out_name = output::output_name(&a.input, a.output.as_deref(), "safetensors")?;
    let meta = archive.reader().header().metadata.clone();
    let ids = archive.token_ids().to_vec();
    let mut decode_s = 0.0;
    if out_name == "-" || file::is_special(Path::new(&out_name)) {
        // In order, for a pipe: a group of layers (about GROUP_BYTES) is
        // decoded into memory, written, and dropped.
        const GROUP_BYTES: u64 = 64 << 20;
        let emit = |w: &mut dyn Write, decode_s: &mut f64| -> kvpack::Result<()> {
            safetensors::write_header(&infos, &meta, &ids, w)?;
            let mut i = 0;
            while i < infos.len() {
                let first = infos[i].layer;
                let mut j = i;
                let mut bytes = 0u64;
                while j < infos.len()
                    && (j == i || infos[j].layer == infos[j - 1].layer || bytes < GROUP_BYTES)
                {
                    bytes += infos[j].elements() * infos[j].dtype.size() as u64;
                    j += 1;
                }
                let last = infos[j - 1].layer;
                let t0 = Instant::now();
                let part = archive.decode(
                    &Selection {
                        layers: Some(first..last + 1),
                        ..sel.clone()
                    },
                    dtype,
                    Some(&stats),
                )?;
                *decode_s += t0.elapsed().as_secs_f64();
                for t in &part.tensors {
                    safetensors::write_tensor(t, w)?;
                }
                i = j;
            }
            safetensors::write_scales(&infos, w)
        };
        if out_name == "-" {
            let mut w = std::io::BufWriter::new(std::io::stdout().lock());
            emit(&mut w, &mut decode_s)?;
            w.flush().context("writing stdout")?;
        } else {
            file::write_atomic(Path::new(&out_name), a.force, |w| emit(w, &mut decode_s))?;
        }
    } else {
        // To a regular file: every page is decoded on a worker thread and
        // written at its place in the file, a page per thread in memory.
        file::write_atomic_file(Path::new(&out_name), a.force, |f| {
            let mut layout = safetensors::Layout::exact(&infos, &meta, &ids)?;
            f.set_len(layout.len())
                .map_err(|e| kvpack::Error::io(format!("sizing {out_name}"), e))?;
            let t0 = Instant::now();
            archive.decode_pieces(&selected, Some(&stats), &|p| {
                layout.write_piece(f, p.output, p.token, p.tokens, p.elems)
            })?;
            decode_s = t0.elapsed().as_secs_f64();
            layout.finish(f, &ids)
        })?;
    }
    let _ = start;
    let out_bytes: u64 = infos
        .iter()
        .map(|t| t.elements() * t.dtype.size() as u64)
        .sum();
    let pages = stats.pages.load(std::sync::atomic::Ordering::Relaxed);
    let total_pages = archive.reader().index().entries.len();
    if a.json {
        output::print_json(
            &serde_json::json!({
                "input": a.input,
                "output": out_name,
                "tensors": infos.len(),
                "elements": infos.iter().map(|t| t.elements()).sum::<u64>(),
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
            infos.len(),
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
