//! kvpack: a versioned container format and codecs for compressed LLM KV
//! caches (see `README.md` and `format/SPEC.md`).

#![warn(missing_docs)]

pub mod cache;
pub mod error;
pub mod format;
pub mod codec;
pub mod kernels;

pub use cache::{DType, KvCache, Kind, Tensor, TensorData, TensorInfo};
pub use error::{Error, Location, Result};
pub mod compress;
pub mod decode;
pub mod plan;
pub mod io;
pub mod metrics;
