//! Per-page validation of a received kvpack file, for transports that must
//! say exactly which token ranges arrived damaged (`kvpack.nixl`).

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::dlpack;
use super::errors::IntoPy;

/// One damaged page: `(layer, kind, token_start, token_end, message)`,
/// `kind` `"K"`, `"V"` or `"L"`, tokens a half-open range.
pub type Fault = (u32, &'static str, u32, u32, String);

/// Checks every page of the kvpack file in `data` (`bytes` or a contiguous
/// uint8 host array, borrowed) on its own: header and body CRCs, the page
/// header against the index, the section table. Returns one [`Fault`] per
/// damaged page, in index order (empty when every page is intact). Reads
/// the whole file once; decodes nothing.
///
/// # Errors
/// `FormatError` when the file header, index or trailer is itself damaged
/// (then no page can be attributed: the whole file is lost).
#[pyfunction]
pub fn page_faults(py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<Vec<Fault>> {
    let held;
    let bytes: &[u8] = if let Ok(b) = data.cast::<PyBytes>() {
        b.as_bytes()
    } else {
        held = dlpack::import(data, None)?;
        held.host_bytes("data")?
    };
    py.detach(|| {
        let r = crate::format::Reader::open(bytes)?;
        let tensors = &r.header().tensors;
        Ok(r.index()
            .entries
            .iter()
            .enumerate()
            .filter_map(|(i, e)| {
                let err = r.page(i).err()?;
                let t = &tensors[e.meta.tensor as usize];
                let end = e.meta.token_start + e.meta.tokens;
                Some((
                    t.layer,
                    t.kind.letter(),
                    e.meta.token_start,
                    end,
                    err.to_string(),
                ))
            })
            .collect())
    })
    .py_err()
}
