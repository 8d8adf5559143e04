//! The `kvpack` command-line tool: compress, decompress, inspect and verify
//! compressed KV caches. Argument parsing, progress and output only; all
//! format and codec work is in the library.

mod cmd_compress;
mod cmd_decompress;
mod cmd_eval;
mod cmd_inspect;
mod cmd_net;
mod cmd_verify;
mod output;
mod plot;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Exit status: success.
pub const EXIT_OK: u8 = 0;
/// Exit status: `verify` found a problem.
pub const EXIT_VERIFY_FAILED: u8 = 1;
/// Exit status: bad usage or bad input (unknown codec, corrupt or missing
/// file, output exists without --force).
pub const EXIT_BAD_INPUT: u8 = 2;
/// Exit status: the system failed (disk full, permission denied, broken
/// pipe).
pub const EXIT_IO: u8 = 3;
/// Exit status: the GPU failed (CUDA driver, NVRTC, a kernel, out of
/// device memory).
pub const EXIT_DEVICE: u8 = 4;

const AFTER_HELP: &str = "\
Exit status: 0 success, 1 verification failed (verify), 2 bad usage or bad
input (unknown codec, corrupt or missing file, existing output without
--force), 3 I/O failure (disk full, permission denied), 4 device failure
(CUDA driver, kernel, out of GPU memory).

Examples:
  kvpack compress cache.safetensors --codec bdr128
  kvpack inspect cache.kvpack
  kvpack verify cache.kvpack --against cache.safetensors
  kvpack decompress cache.kvpack -o restored.safetensors --dtype fp32";

/// Compressed, checksummed storage and transport for LLM KV caches.
#[derive(Parser, Debug)]
#[command(name = "kvpack", version, about, after_help = AFTER_HELP)]
struct Cli {
    /// Worker threads (default: all cores).
    #[arg(long, global = true, value_name = "N")]
    threads: Option<usize>,
    /// Largest decoded output an input may declare (decompress, verify,
    /// recv and inspect refuse more, before anything is allocated or
    /// written; they stream, holding a few pages per thread), and most
    /// bytes read from a pipe: e.g. 512M, 8G, 64G [default: 8G].
    #[arg(long, global = true, value_name = "BYTES", value_parser = output::parse_size)]
    max_memory: Option<u64>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Compress a safetensors KV cache into a .kvpack file.
    Compress(cmd_compress::Args),
    /// Decompress a .kvpack file (or part of it) to safetensors.
    Decompress(cmd_decompress::Args),
    /// Show a .kvpack file's header, codecs, pages and bits per element.
    Inspect(cmd_inspect::Args),
    /// Check every checksum and structural rule; compare with the original.
    Verify(cmd_verify::Args),
    /// List the available codecs and their bits per element.
    Codecs(cmd_inspect::CodecsArgs),
    /// Compare codecs on a cache: size, reconstruction and attention error.
    Eval(cmd_eval::Args),
    /// Add the tokens that follow a stored prompt cache (crash-safe append).
    Append(cmd_net::AppendArgs),
    /// Stream a cache to `kvpack recv` over TCP (prefill -> decode handoff).
    Send(cmd_net::SendArgs),
    /// Receive a stream from `kvpack send`, decoding while it arrives.
    Recv(cmd_net::RecvArgs),
    /// How many leading tokens of a prompt a prompt cache holds.
    Match(cmd_net::MatchArgs),
}

fn main() -> ExitCode {
    // Behave like other Unix tools when stdout is a closed pipe
    // (`kvpack inspect f | head`): end quietly instead of panicking in
    // println!.
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of SIGPIPE before any other
    // thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // glibc gives freed memory at the top of an arena back to the kernel
    // once 128 KiB sit there, so encoders that allocate and free a page's
    // buffers in turn fault and zero them again on every page (about 9%
    // of the CPU time of `compress --bits` on the fixture). 16 MiB of
    // padding per arena keeps them mapped.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets a tuning parameter; no other thread exists
    // yet.
    unsafe {
        libc::mallopt(libc::M_TOP_PAD, 16 << 20);
    }
    let cli = Cli::parse();
    if let Some(n) = cli.threads
        && let Err(e) = rayon::ThreadPoolBuilder::new()
            .num_threads(n.max(1))
            .build_global()
    {
        eprintln!("kvpack: cannot start {n} threads: {e}");
        return ExitCode::from(EXIT_IO);
    }
    output::set_limits(cli.max_memory);
    output::install_signal_handlers();
    let r = match cli.command {
        Command::Compress(a) => cmd_compress::run(a),
        Command::Decompress(a) => cmd_decompress::run(a),
        Command::Inspect(a) => cmd_inspect::run(a),
        Command::Verify(a) => cmd_verify::run(a),
        Command::Codecs(a) => cmd_inspect::codecs(a),
        Command::Eval(a) => cmd_eval::run(a),
        Command::Append(a) => cmd_net::append(a),
        Command::Send(a) => cmd_net::send(a),
        Command::Recv(a) => cmd_net::recv(a),
        Command::Match(a) => cmd_net::matching(a),
    };
    match r {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("kvpack: {}", message(&e));
            ExitCode::from(output::exit_code(&e))
        }
    }
}

/// The error and its causes, `": "`-separated, each cause left out when
/// the text before already holds it (kvpack's I/O errors print their OS
/// error themselves).
fn message(e: &anyhow::Error) -> String {
    let mut msg = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !msg.contains(&c) {
            msg.push_str(": ");
            msg.push_str(&c);
        }
    }
    msg
}
