//! Shared CLI helpers: progress bars, exit codes, output paths, formatting.

use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};
use kvpack::Error;

use crate::{EXIT_BAD_INPUT, EXIT_IO};

/// Maps an error to the documented exit status.
pub fn exit_code(e: &anyhow::Error) -> u8 {
    match e.downcast_ref::<Error>() {
        Some(Error::Io { source, .. }) if source.kind() != std::io::ErrorKind::NotFound => EXIT_IO,
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

/// `path` with its extension replaced by `ext` (`cache.safetensors` ->
/// `cache.kvpack`).
pub fn with_extension(path: &str, ext: &str) -> PathBuf {
    Path::new(path).with_extension(ext)
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
