//! kvpack: a versioned container format and codecs for compressed LLM KV
//! caches (see `README.md` and `format/SPEC.md`).

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
pub mod io;
pub mod metrics;
pub mod plan;
pub mod stream_decode;
pub mod transport;
