//! kvpack: a versioned container format and codecs for compressed LLM KV
//! caches (see `README.md` and `format/SPEC.md`).
//!
//! ```no_run
//! use kvpack::compress::{CompressOptions, compress};
//! use kvpack::decode::{Archive, Selection};
//!
//! let bytes = std::fs::read("cache.safetensors")?;
//! let cache = kvpack::io::safetensors::parse(&bytes, "cache.safetensors")?.cache;
//! let codec = kvpack::codec::parse("bdr128")?;
//! let (file, report) = compress(&cache, codec.as_ref(), &CompressOptions::default(), Vec::new(), &|_| {})?;
//! println!("{:.3} bits/element", report.bits_per_element());
//!
//! let archive = Archive::open(&file)?; // validates structure and checksums
//! let layer0 = archive.decode(&Selection { layers: Some(0..1), ..Default::default() }, None, None)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Modules: [`format`](mod@format) (the container, no codec math), [`codec`] (the
//! [`codec::Codec`] trait, the registry and one module per codec),
//! [`kernels`] (shared math), [`compress`] / [`decode`] (whole-cache
//! pipelines on all threads), [`stream_decode`] / [`transport`] (the
//! prefill-to-decode handoff), [`gpu`] (CUDA decode/encode kernels, feature
//! `cuda`), [`io`] (safetensors, mmap, atomic writes and
//! crash-safe appends), [`eval`] / [`metrics`] (quality measurement).

#![warn(missing_docs)]

pub mod cache;
pub mod codec;
pub mod error;
pub mod eval;
pub mod format;
pub mod kernels;

pub use cache::{DType, Kind, KvCache, Tensor, TensorData, TensorInfo};
pub use error::{Error, Location, Result};
pub mod compress;
pub mod decode;
pub mod gpu;
pub mod io;
pub mod metrics;
pub mod net;
pub mod plan;
pub mod prompt;
pub mod stream_decode;
pub mod transport;
pub mod view;

#[cfg(feature = "python")]
mod python;
