//! Helpers shared by codecs that work on a whole page at once: the page as
//! one f32 buffer `[planes, tokens, head_dim]` (plane-major rows), typed
//! section builders and readers for f16 and u32 elements, and error
//! messages that name the page.

use half::f16;

use crate::error::{Error, Result};
use crate::format::{ElemType, Section, SectionKind};

use super::{PageIn, PageOut};

/// Widens every row of `page` to f32: `rows * head_dim` values, row `r` at
/// `[r * head_dim, (r + 1) * head_dim)`.
pub fn load(page: &PageIn<'_>) -> Vec<f32> {
    let d = page.head_dim();
    let mut buf = vec![0f32; page.rows() * d];
    for (r, row) in buf.chunks_exact_mut(d.max(1)).enumerate() {
        page.load_row(r, row);
    }
    buf
}

/// Narrows a buffer laid out as by [`load`] into `out`.
///
/// # Panics
/// If `buf.len() != out.rows() * head_dim`.
pub fn store(out: &mut PageOut<'_>, buf: &[f32]) {
    let d = out.tensor.head_dim as usize;
    assert_eq!(buf.len(), out.rows() * d);
    for (r, row) in buf.chunks_exact(d.max(1)).enumerate() {
        out.store_row(r, row);
    }
}

/// `"past_key_values.3.key (layer 3 K) tokens 0..256"`: the page in
/// encoder error messages.
pub fn label(page: &PageIn<'_>) -> String {
    format!(
        "{} ({}) tokens {}..{}",
        page.tensor.name,
        page.tensor.describe(),
        page.token_start,
        page.token_start as u64 + u64::from(page.tokens)
    )
}

/// Prefixes an encoder error with the page and the plane/token of buffer
/// position `pos`.
pub fn at(page: &PageIn<'_>, pos: usize, e: Error) -> Error {
    let d = page.head_dim().max(1);
    let t = (page.tokens as usize).max(1);
    let (row, ch) = (pos / d, pos % d);
    Error::param(format!(
        "{} plane {} token {} channel {ch}: {e}",
        label(page),
        row / t,
        page.token_start as usize + row % t
    ))
}

/// Section count as u32.
///
/// # Errors
/// [`Error::Parameter`] above 2^32 - 1 elements.
pub fn count(n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| Error::param("page over 2^32 elements"))
}

/// A section of little-endian binary16 values.
pub fn f16s(kind: SectionKind, stream: u8, values: &[f16]) -> Section {
    Section {
        kind,
        stream,
        elem: ElemType::F16,
        count: values.len() as u32,
        data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// A section of little-endian u32 values.
pub fn u32s(kind: SectionKind, stream: u8, values: &[u32]) -> Section {
    Section {
        kind,
        stream,
        elem: ElemType::U32,
        count: values.len() as u32,
        data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// Reads little-endian f16 number `i` of `bytes`, widened to f32.
///
/// # Panics
/// If out of bounds (callers check section sizes with
/// [`super::expect_section`]).
#[inline]
pub fn f16_at(bytes: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32()
}

/// The index of the first of the little-endian binary16 values in `bytes`
/// that is infinite or NaN (exponent bits all ones), checked on the bits.
pub fn first_non_finite_f16(bytes: &[u8]) -> Option<usize> {
    bytes
        .chunks_exact(2)
        .position(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7c00 == 0x7c00)
}

/// Reads little-endian u32 number `i` of `bytes`.
///
/// # Panics
/// If out of bounds.
#[inline]
pub fn u32_at(bytes: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().expect("4 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_finite_f16_found_on_the_bits() {
        let bytes = |v: &[f32]| -> Vec<u8> {
            v.iter()
                .flat_map(|&x| f16::from_f32(x).to_le_bytes())
                .collect()
        };
        let finite = [65504.0, -0.0, 6e-8, -1.5, 0.0];
        assert_eq!(first_non_finite_f16(&bytes(&finite)), None);
        for (bad, at) in [(f32::INFINITY, 3), (f32::NEG_INFINITY, 0), (f32::NAN, 4)] {
            let mut v = finite;
            v[at] = bad;
            assert_eq!(first_non_finite_f16(&bytes(&v)), Some(at), "{bad}");
            assert!(!f16_at(&bytes(&v), at).is_finite());
        }
    }
}
