//! Hooks for planner studies (`tools/plan_study.py`), off unless their
//! environment variable is set:
//!
//! - `KVPACK_PLAN_CODECS=a,b,...` replaces the candidate codec names of
//!   [`super::candidates::CODECS`] (same `{h}` patterns), so that a study
//!   can measure codecs the planner does not try;
//! - `KVPACK_PLAN_POINTS=FILE` writes every tensor's measured operating
//!   points to `FILE` as JSON: a list, per tensor in the cache's order, of
//!   `{"name", "kind", "points": [{"codec", "sink", "bytes", "distortion"}]}`
//!   (`kind`: `key`, `value` or `latent`; `bytes`: estimated bytes of the
//!   tensor's pages; `distortion`: the measure of [`super::distortion`]);
//!   the file is replaced atomically if it exists;
//! - `KVPACK_PLAN_VALUE_WEIGHT=W` multiplies every value tensor's
//!   distortion by `W` (a positive number) before the allocation.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::error::{Error, Result};
use crate::view::CacheView;

/// The candidate patterns of `KVPACK_PLAN_CODECS`, or `None` when unset.
pub(crate) fn codecs_override() -> Option<Vec<String>> {
    let s = std::env::var("KVPACK_PLAN_CODECS").ok()?;
    Some(
        s.split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(String::from)
            .collect(),
    )
}

/// The factor of `KVPACK_PLAN_VALUE_WEIGHT` on values' distortion, 1 when
/// unset or not a positive number.
pub(crate) fn value_weight() -> f64 {
    std::env::var("KVPACK_PLAN_VALUE_WEIGHT")
        .ok()
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|w| w.is_finite() && *w > 0.0)
        .unwrap_or(1.0)
}

/// One operating point as written to `KVPACK_PLAN_POINTS`.
#[derive(Debug, Serialize)]
pub(crate) struct PointOut {
    pub codec: String,
    pub sink: u32,
    pub bytes: f64,
    pub distortion: f64,
}

/// One tensor's points as written to `KVPACK_PLAN_POINTS`.
#[derive(Debug, Serialize)]
pub(crate) struct TensorOut {
    pub name: String,
    pub kind: String,
    pub points: Vec<PointOut>,
}

/// The file named by `KVPACK_PLAN_POINTS`, or `None` when unset.
pub(crate) fn points_path() -> Option<PathBuf> {
    std::env::var_os("KVPACK_PLAN_POINTS").map(PathBuf::from)
}

/// Writes `tensors` (one list of points per tensor of `cache`, in order)
/// to `path` as described in the module docs.
///
/// # Errors
/// [`Error::Io`] when the file cannot be written.
pub(crate) fn write_points(
    path: &Path,
    cache: &CacheView<'_>,
    tensors: Vec<Vec<PointOut>>,
) -> Result<()> {
    let out: Vec<TensorOut> = cache
        .tensors
        .iter()
        .zip(tensors)
        .map(|(t, points)| TensorOut {
            name: t.info.name.clone(),
            kind: t.info.kind.name().to_string(),
            points,
        })
        .collect();
    let json = serde_json::to_vec(&out).map_err(|e| Error::param(format!("plan points: {e}")))?;
    crate::io::file::write_atomic(path, true, |w| {
        w.write_all(&json)
            .map_err(|e| Error::io(format!("writing {}", path.display()), e))
    })
}
