//! `raw`: lossless passthrough at source precision (format/codecs/raw.md).
//! Sink and recent windows are stored as `raw` pages.

use crate::cache::TensorInfo;
use crate::error::{Error, Result};
use crate::format::{ElemType, PageView, Section, SectionKind};

use super::{Codec, PageIn, PageOut, expect_section, expect_section_count, row_order};

/// Codec id of `raw`.
pub const ID: u16 = 0;

/// The `raw` codec: one RAW section with every element of the page in the
/// tensor's source dtype, plane-major `[planes, tokens, head_dim]`. fp8
/// tensors keep their 8-bit codes (bit-exact; the scale is the tensor
/// table's), MLA latents are rows like any other.
#[derive(Debug, Clone, Copy, Default)]
pub struct Raw;

/// Registry entry of `raw`.
pub const FAMILY: super::Family = super::Family {
    id: ID,
    name: "raw",
    syntax: "raw",
    summary: "lossless passthrough at source precision (bf16/fp16/fp32/fp8)",
    parse: |s| (s == "raw").then(|| Ok(Box::new(Raw) as Box<dyn Codec>)),
    from_params: |p| {
        if !p.is_empty() {
            return Err(Error::param(format!(
                "raw takes no parameters, found {} bytes",
                p.len()
            )));
        }
        Ok(Box::new(Raw))
    },
    examples: &[super::Example {
        name: "raw",
        min_snr_db: f64::INFINITY,
    }],
};

impl Codec for Raw {
    fn size_depends_only_on_shape(&self) -> bool {
        true
    }

    fn name(&self) -> String {
        "raw".into()
    }

    fn id(&self) -> u16 {
        ID
    }

    fn params(&self) -> Vec<u8> {
        Vec::new()
    }

    fn check(&self, _tensor: &TensorInfo) -> Result<()> {
        Ok(())
    }

    fn row_wise(&self) -> bool {
        true
    }

    fn encode(&self, page: &PageIn<'_>) -> Result<Vec<Section>> {
        let dtype = page.tensor.dtype;
        let w = dtype.size();
        let n = match page.source {
            Some(_) => page.rows() * page.head_dim(),
            None => page.planes.iter().map(|p| p.len()).sum(),
        };
        let mut data = crate::format::pool::take(n * w);
        if page.source.is_some() {
            // Rows in the caller's memory: visited in its order, each
            // copied to its plane-major place.
            let row_bytes = page.head_dim() * w;
            data.resize(n * w, 0);
            for r in row_order(page.rows(), page.tokens as usize, true) {
                let to = &mut data[r * row_bytes..(r + 1) * row_bytes];
                to.copy_from_slice(page.row(r).bytes());
                if cfg!(target_endian = "big") {
                    to.chunks_exact_mut(w).for_each(|c| c.reverse());
                }
            }
        }
        for p in &page.planes {
            let bytes = p.bytes();
            if cfg!(target_endian = "little") {
                data.extend_from_slice(bytes);
            } else {
                // Byte-swap each element to little-endian.
                for c in bytes.chunks_exact(w) {
                    data.extend(c.iter().rev());
                }
            }
        }
        Ok(vec![Section {
            kind: SectionKind::Raw,
            stream: 0,
            elem: ElemType::from_dtype(dtype),
            count: u32::try_from(n).map_err(|_| Error::param("page over 2^32 elements"))?,
            data,
        }])
    }

    fn decode(&self, page: &PageView<'_>, out: &mut PageOut<'_>) -> Result<()> {
        let d = out.tensor.head_dim as usize;
        let rows = out.rows();
        let src_t = out.tensor.dtype;
        let bytes = page_layout(page, src_t, rows * d)?;
        let plane_bytes = out.tokens as usize * d * src_t.size();
        let mut row = vec![0f32; d];
        if out.scatter.is_some() {
            // Rows of the caller's memory, visited in its order.
            let row_bytes = d * src_t.size();
            let same =
                rows > 0 && out.row_mut(0).dtype() == src_t && cfg!(target_endian = "little");
            let wide = if same {
                None
            } else {
                Some(crate::cache::TensorData::from_le_bytes(src_t, bytes)?)
            };
            for r in row_order(rows, out.tokens as usize, true) {
                let mut dst = out.row_mut(r);
                match &wide {
                    // Same type: the stored bytes are the output.
                    None => dst
                        .bytes_mut()
                        .copy_from_slice(&bytes[r * row_bytes..(r + 1) * row_bytes]),
                    Some(w) => {
                        w.as_elems().load(r * d, &mut row);
                        dst.store(0, &row);
                    }
                }
            }
            return Ok(());
        }
        for (p, plane) in out.planes.iter_mut().enumerate() {
            let src = &bytes[p * plane_bytes..(p + 1) * plane_bytes];
            if plane.dtype() == src_t && cfg!(target_endian = "little") {
                // Same type (for fp8: same format and scale): the stored
                // bytes are the output, bit for bit.
                plane.bytes_mut().copy_from_slice(src);
                continue;
            }
            let data = crate::cache::TensorData::from_le_bytes(src_t, src)?;
            let elems = data.as_elems();
            for t in 0..out.tokens as usize {
                elems.load(t * d, &mut row);
                plane.store(t * d, &row);
            }
        }
        Ok(())
    }

    fn bits_per_element(&self, tensor: &TensorInfo) -> f64 {
        8.0 * tensor.dtype.size() as f64
    }
}

/// The checked layout of a raw page of `n` elements of `dtype`: exactly
/// one RAW stream 0 section of that element type and count, returned. The
/// CPU decoder and the GPU staging both read pages through it.
///
/// # Errors
/// [`crate::Error::Format`] naming the page for a missing, mistyped or
/// extra section.
pub(crate) fn page_layout<'p>(
    page: &'p PageView<'_>,
    dtype: crate::cache::DType,
    n: usize,
) -> Result<&'p [u8]> {
    let bytes = expect_section(page, SectionKind::Raw, 0, ElemType::from_dtype(dtype), n)?;
    expect_section_count(page, 1)?;
    Ok(bytes)
}
