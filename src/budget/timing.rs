//! Section timings of the planner for profiling: with the environment
//! variable `KVPACK_PLAN_TIMES` set, [`report`] prints to stderr the time
//! spent in each [`Section`] since the last report, summed over threads
//! (CPU seconds, not wall time). Unset, [`time`] only calls its closure.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// A timed part of [`super::compress_budget`].
#[derive(Debug, Clone, Copy)]
pub(crate) enum Section {
    /// Reading the sampled rows of a tensor.
    Sample,
    /// Candidate codecs encoding and decoding the samples.
    RoundTrip,
    /// Attention-output distortion of every candidate.
    Distortion,
    /// Bit allocation.
    Allocate,
    /// Writing the file with the chosen codecs (every attempt).
    Encode,
}

const NAMES: [&str; 5] = ["sample", "round trips", "distortion", "allocate", "encode"];

static NANOS: [AtomicU64; 5] = [const { AtomicU64::new(0) }; 5];

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("KVPACK_PLAN_TIMES").is_some())
}

/// Runs `f`, adding its duration to `section` when timing is enabled.
pub(crate) fn time<T>(section: Section, f: impl FnOnce() -> T) -> T {
    if !enabled() {
        return f();
    }
    let start = Instant::now();
    let out = f();
    let ns = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
    NANOS[section as usize].fetch_add(ns, Ordering::Relaxed);
    out
}

/// Prints and clears the section times when timing is enabled.
pub(crate) fn report() {
    if !enabled() {
        return;
    }
    let parts: Vec<String> = NAMES
        .iter()
        .zip(&NANOS)
        .map(|(n, a)| format!("{n} {:.1} ms", a.swap(0, Ordering::Relaxed) as f64 / 1e6))
        .collect();
    eprintln!(
        "kvpack plan times (CPU, summed over threads): {}",
        parts.join(", ")
    );
}
