//! Shared CLI helpers: progress bars, exit codes, output paths, formatting.

use std::path::Path;

use indicatif::{ProgressBar, ProgressStyle};
use kvpack::Error;
use kvpack::codec::Codec;
use kvpack::compress::CompressOptions;
use kvpack::decode::Archive;
use kvpack::format::Limits;
use kvpack::io::file;
use kvpack::plan::Layout;

use crate::{EXIT_BAD_INPUT, EXIT_DEVICE, EXIT_IO};

static LIMITS: std::sync::OnceLock<Limits> = std::sync::OnceLock::new();

/// Sets the reader limits of this run (`--max-memory`) and the codebook
/// budget that follows from them.
pub fn set_limits(max_memory: Option<u64>) {
    let mut l = Limits::default();
    if let Some(m) = max_memory {
        l.max_memory = m;
    }
    kvpack::codec::set_codebook_budget(l.max_codebook_bytes);
    let _ = LIMITS.set(l);
}

/// The reader limits of this run.
pub fn limits() -> Limits {
    LIMITS.get().copied().unwrap_or_default()
}

/// Opens a .kvpack input (`-` for stdin): magic checked first, at most
/// `--max-memory` bytes from a pipe.
pub fn open_kvpack(path: &str) -> Result<file::InputBytes, Error> {
    file::open_input_with(path, file::InputRules::kvpack(limits().max_memory))
}

/// Opens the archive in `input` under this run's limits: pages of a
/// mapped file are copied before they are verified (another process may
/// rewrite the file) and dropped from memory once copied.
pub fn open_archive(input: &file::InputBytes) -> Result<Archive<'_>, Error> {
    Ok(Archive::open_with(input, limits())?
        .with_private_pages(input.is_mapped())
        .with_release(Some(input)))
}

/// Opens a safetensors input (`-` for stdin), at most `--max-memory` bytes
/// from a pipe.
pub fn open_any(path: &str) -> Result<file::InputBytes, Error> {
    file::open_input_with(path, file::InputRules::any(limits().max_memory))
}

/// Parses a byte count: `4096`, `512K`, `64M`, `8G`, `1T` (powers of 1024;
/// an optional trailing `B` or `iB` is accepted).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (num, shift) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 30),
        Some('T' | 't') => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    num.trim()
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1u64 << shift))
        .ok_or_else(|| format!("{s:?} is not a size like 512M, 8G or 4096"))
}

/// Maps an error to the documented exit status: 3 for an operating-system
/// failure other than a missing file, 4 for a device failure, 2 otherwise.
pub fn exit_code(e: &anyhow::Error) -> u8 {
    match e.downcast_ref::<Error>() {
        Some(Error::Io { source, .. }) if source.kind() != std::io::ErrorKind::NotFound => EXIT_IO,
        Some(Error::Device { .. }) => EXIT_DEVICE,
        _ => EXIT_BAD_INPUT,
    }
}

/// A byte progress bar on stderr; hidden when stderr is not a terminal or
/// `quiet` is set.
pub fn progress(total: u64, what: &str, quiet: bool) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::with_draw_target(Some(total), indicatif::ProgressDrawTarget::stderr());
    pb.set_style(
        ProgressStyle::with_template(
            "{msg} [{bar:30}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    pb
}

/// The output path: `output` when given, else `input` with its extension
/// replaced by `ext` (`cache.safetensors` -> `cache.kvpack`).
///
/// # Errors
/// When reading stdin without `-o`.
pub fn output_name(input: &str, output: Option<&str>, ext: &str) -> Result<String, Error> {
    match output {
        Some(o) => Ok(o.to_string()),
        None if input == "-" => Err(Error::param(
            "reading stdin needs -o OUTPUT (or -o - for stdout)",
        )),
        None => Ok(Path::new(input).with_extension(ext).display().to_string()),
    }
}

/// Page size, windows and zstd, shared by the commands that encode.
#[derive(clap::Args, Debug)]
pub struct LayoutArgs {
    /// Leading tokens per layer kept at source precision (attention sinks)
    /// [default: the codec's own, 0 for raw/int/bdr].
    #[arg(long, value_name = "N")]
    pub sink: Option<u32>,
    /// Trailing tokens per layer kept at source precision [default: the
    /// codec's own, 0 for raw/int/bdr].
    #[arg(long, value_name = "N")]
    pub recent: Option<u32>,
    /// Tokens per page (the unit of random access and streaming).
    #[arg(long, default_value_t = 256, value_name = "N")]
    pub page_tokens: u32,
    /// Also compress each page with zstd at this level (kept only where it
    /// helps).
    #[arg(long, value_name = "LEVEL", num_args = 0..=1, default_missing_value = "3")]
    pub zstd: Option<i32>,
}

impl LayoutArgs {
    /// Compression options for `codec`, filling unset windows with the
    /// codec's defaults.
    pub fn options(&self, codec: &dyn Codec, align_log2: u8) -> CompressOptions {
        let (sink, recent) = codec.default_windows();
        CompressOptions {
            layout: Layout {
                page_tokens: self.page_tokens,
                sink: self.sink.unwrap_or(sink),
                recent: self.recent.unwrap_or(recent),
            },
            zstd_level: self.zstd,
            raw_fallback: false,
            align_log2,
        }
    }
}

/// Human byte count: `10.9 MB`.
pub fn bytes(n: u64) -> String {
    let n = n as f64;
    if n >= 1e9 {
        format!("{:.2} GB", n / 1e9)
    } else if n >= 1e6 {
        format!("{:.2} MB", n / 1e6)
    } else if n >= 1e3 {
        format!("{:.1} kB", n / 1e3)
    } else {
        format!("{n} B")
    }
}

/// Prints a JSON value on stdout, or on stderr when stdout carries data.
pub fn print_json(v: &serde_json::Value, data_on_stdout: bool) {
    let s = serde_json::to_string_pretty(v).expect("json");
    if data_on_stdout {
        eprintln!("{s}");
    } else {
        println!("{s}");
    }
}

/// Installs the CLI's signal handlers (temporary outputs removed on
/// SIGINT/SIGTERM/SIGHUP; a truncated mapped input is an I/O error).
pub fn install_signal_handlers() {
    file::install_cleanup_handlers();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_error_kind_has_its_documented_exit_status() {
        let code = |e: Error| exit_code(&anyhow::Error::from(e));
        assert_eq!(code(Error::device("CUDA launch", "out of memory")), 4);
        assert_eq!(
            code(Error::io("writing x", std::io::Error::other("disk full"))),
            3
        );
        let missing = std::io::Error::from(std::io::ErrorKind::NotFound);
        assert_eq!(code(Error::io("reading x", missing)), 2);
        assert_eq!(code(Error::param("unknown codec")), 2);
        assert_eq!(
            code(Error::format(kvpack::Location::Header, "bad magic")),
            2
        );
    }
}
