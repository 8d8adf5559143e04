//! kvpack: a versioned container format and codecs for compressed LLM KV
//! caches (see `README.md` and `format/SPEC.md`).
//!
//! ```no_run
//! use kvpack::{Archive, CompressOptions, Selection, compress};
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
//! The types most programs need are re-exported here: the cache
//! ([`KvCache`], [`Tensor`], [`TensorInfo`]) and borrowed views of it
//! ([`CacheView`]), compression ([`compress()`], [`compress_view()`],
//! [`CompressOptions`], [`Layout`], a [`Codec`] from [`codec::parse`]),
//! decoding ([`Archive`], [`Selection`]), the prefill-to-decode handoff
//! ([`send()`], [`decode_stream()`]) and errors ([`Error`], [`FormatCause`],
//! [`Location`]).
//!
//! Modules: [`format`](mod@format) (the container, no codec math), [`codec`] (the
//! [`codec::Codec`] trait, the registry and one module per codec),
//! [`compress`](mod@compress) / [`decode`] (whole-cache pipelines on all
//! threads), [`paged`] (one layer from and into a paged cache in host
//! memory), [`stream_decode`] / [`transport`] (the prefill-to-decode
//! handoff), [`gpu`] (CUDA decode/encode kernels, feature `cuda`), [`io`]
//! (safetensors, mmap, atomic writes and crash-safe appends), [`eval`] /
//! [`metrics`] (quality measurement). `ARCHITECTURE.md` shows how they fit.

#![warn(missing_docs)]

pub mod budget;
pub mod cache;
pub mod codec;
pub mod compress;
pub mod decode;
pub mod error;
pub mod eval;
pub mod format;
pub mod gpu;
pub mod io;
/// Shared numeric kernels (bit packing, Walsh-Hadamard, quantizers, PRNG):
/// internal to the codecs, public only for the crate's tests and benchmarks.
#[doc(hidden)]
pub mod kernels;
pub mod metrics;
pub mod net;
pub mod paged;
pub mod plan;
pub mod prompt;
pub mod stream_decode;
pub mod transport;
pub mod view;

pub use cache::{DType, Fp8, Fp8Format, Kind, KvCache, Tensor, TensorData, TensorInfo};
pub use codec::Codec;
pub use compress::{CompressOptions, CompressReport, compress, compress_view};
pub use decode::{Archive, Selection};
pub use error::{Error, FormatCause, Location, Result};
pub use plan::Layout;
pub use stream_decode::{StreamDecoded, decode_stream};
pub use transport::{SendReport, send};
pub use view::{CacheView, TensorView};

#[cfg(feature = "python")]
mod python;
