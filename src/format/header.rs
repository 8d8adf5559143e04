//! The file header: 64-byte prefix, tensor table, codec table, metadata.

use std::collections::BTreeMap;

use crate::cache::{DType, Fp8, Kind, TensorInfo};
use crate::error::{Error, FormatCause, Location, Result};

use super::bytes::{Cursor, PutLe, crc32};
use super::{FRAME_HEADER_LEN, Limits, MAGIC, VERSION_MAJOR};

/// One entry of the codec table: a codec id and its self-describing
/// parameter block (format/codecs/*.md define each codec's bytes). Pages
/// refer to entries by position ("codec slot").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodecEntry {
    /// Registered codec id (format/SPEC.md "Codec ids").
    pub id: u16,
    /// Codec parameters, seeds and small codebooks, at most 16 MiB.
    pub params: Vec<u8>,
}

/// Everything in the file header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileHeader {
    /// Major version of the file (1 for files this crate writes).
    pub version_major: u16,
    /// Minor version of the file.
    pub version_minor: u16,
    /// Frame alignment as a power of two, 6 (64 B) to 12 (4096 B).
    pub align_log2: u8,
    /// Tensors in layer-major order (layer 0 K, layer 0 V, ...). `tokens` is
    /// the token count of the first commit (generation 0); the latest index
    /// holds the current counts.
    pub tensors: Vec<TensorInfo>,
    /// Codec table; pages refer to it by slot.
    pub codecs: Vec<CodecEntry>,
    /// Free-form UTF-8 metadata, keys unique (sorted on write).
    pub metadata: BTreeMap<String, String>,
    /// Nominal page size in tokens used by the writer (informational).
    pub page_tokens: u32,
    /// Sink window in tokens used by the writer (informational).
    pub sink_tokens: u32,
    /// Recent window in tokens used by the writer (informational).
    pub recent_tokens: u32,
}

impl FileHeader {
    /// Frame alignment in bytes.
    pub fn align(&self) -> u64 {
        1u64 << self.align_log2
    }

    /// Serializes the header including zero padding to the alignment.
    ///
    /// # Errors
    /// [`Error::Parameter`] when the tensor table is not strictly sorted by
    /// `(layer, kind)`, names repeat, a layer has both a latent and K/V, a
    /// `version_minor` is not the lowest minor the tensors need (a writer
    /// MUST emit it, format/SPEC.md section 3: fp8 and latents need 1.1,
    /// everything else 1.0; use [`FileHeader::required_minor`]), counts
    /// overflow `u32`, the alignment is outside 6..=12, or a layer index or
    /// the codec count exceeds the default [`Limits`] (readers would refuse
    /// the file).
    pub fn encode(&self) -> Result<Vec<u8>> {
        self.validate().map_err(|e| match e {
            Error::Format { msg, .. } => Error::param(msg),
            other => other,
        })?;
        let minor = Self::required_minor(&self.tensors);
        if (self.version_major, self.version_minor) != (VERSION_MAJOR, minor) {
            return Err(Error::param(format!(
                "a writer emits the lowest version that holds the file: {VERSION_MAJOR}.{minor} \
                 for these tensors, not {}.{}",
                self.version_major, self.version_minor
            )));
        }
        let limits = Limits::default();
        if let Some(t) = self.tensors.iter().find(|t| t.layer > limits.max_layer) {
            return Err(Error::param(format!(
                "{}: layer index {} is above {}, the largest a reader accepts by default",
                t.name, t.layer, limits.max_layer
            )));
        }
        if self.codecs.len() as u64 > u64::from(limits.max_codecs) {
            return Err(Error::param(format!(
                "{} codec slots, a reader accepts at most {} by default",
                self.codecs.len(),
                limits.max_codecs
            )));
        }
        let mut body = Vec::new();
        for t in &self.tensors {
            body.put_u32(t.layer);
            body.put_u8(t.kind.code());
            body.put_u8(t.dtype.code());
            body.put_u16(0);
            body.put_u32(t.batch);
            body.put_u32(t.heads);
            body.put_u32(t.tokens);
            body.put_u32(t.head_dim);
            body.put_str(&t.name);
            if let Some(scale) = t.dtype.scale() {
                body.put_u32(scale.to_bits());
            }
        }
        for c in &self.codecs {
            body.put_u16(c.id);
            body.put_u16(0);
            body.put_u32(c.params.len() as u32);
            body.extend_from_slice(&c.params);
        }
        for (k, v) in &self.metadata {
            body.put_str(k);
            body.put_str(v);
        }
        let total = (FRAME_HEADER_LEN + body.len()).next_multiple_of(self.align() as usize);
        let mut out = Vec::with_capacity(total);
        out.extend_from_slice(&MAGIC);
        out.put_u16(self.version_major);
        out.put_u16(self.version_minor);
        out.put_u32(0); // required flags
        out.put_u32(0); // optional flags
        out.put_u8(self.align_log2);
        out.extend_from_slice(&[0; 3]);
        out.put_u32(u32::try_from(total).map_err(|_| Error::Limits("header over 4 GiB".into()))?);
        out.put_u32(body.len() as u32);
        out.put_u32(self.tensors.len() as u32);
        out.put_u32(self.codecs.len() as u32);
        out.put_u32(self.metadata.len() as u32);
        out.put_u32(self.page_tokens);
        out.put_u32(self.sink_tokens);
        out.put_u32(self.recent_tokens);
        out.put_u32(0);
        let crc = crc32(&[&out, &body]);
        out.put_u32(crc);
        out.extend_from_slice(&body);
        out.resize(total, 0);
        Ok(out)
    }

    /// Reads the 64-byte prefix and returns `header_len` (so a stream reader
    /// knows how much more to read) after checking magic, version and
    /// limits.
    ///
    /// # Errors
    /// [`Error::Format`] for a bad magic, a newer major version, set
    /// required flags or an inconsistent length; [`Error::Limits`] when
    /// `header_len` exceeds `limits.max_header_bytes`.
    pub fn prefix_len(prefix: &[u8; FRAME_HEADER_LEN], limits: &Limits) -> Result<u64> {
        let mut c = Cursor::new(prefix, Location::Header);
        let magic: [u8; 8] = c.array("magic")?;
        if magic != MAGIC {
            return Err(c.err_with(
                FormatCause::NotKvpack,
                format!(
                    "not a kvpack file: magic bytes are {:02x?}, expected {:02x?}",
                    magic, MAGIC
                ),
            ));
        }
        let major = c.u16("major version")?;
        let minor = c.u16("minor version")?;
        if major != VERSION_MAJOR {
            return Err(c.err_with(FormatCause::UnsupportedVersion, format!(
                "file is format version {major}.{minor}; this kvpack reads version {VERSION_MAJOR}.x \
                 (upgrade kvpack to read it)"
            )));
        }
        let required = c.u32("required flags")?;
        if required != 0 {
            return Err(c.err_with(
                FormatCause::UnsupportedVersion,
                format!(
                    "required feature flags 0x{required:08x} are set; this reader understands none \
                 (written by a newer kvpack {major}.{minor})"
                ),
            ));
        }
        let _optional = c.u32("optional flags")?;
        let align_log2 = c.u8("alignment")?;
        if !(6..=12).contains(&align_log2) {
            return Err(c.err(format!("alignment 2^{align_log2} is outside 2^6..2^12")));
        }
        c.zeros(3, "reserved bytes after alignment")?;
        let header_len = u64::from(c.u32("header_len")?);
        let body_len = u64::from(c.u32("body_len")?);
        if header_len > limits.max_header_bytes {
            return Err(Error::Limits(format!(
                "header is {header_len} bytes, limit is {}",
                limits.max_header_bytes
            )));
        }
        if header_len % (1 << align_log2) != 0 || header_len < FRAME_HEADER_LEN as u64 + body_len {
            return Err(c.err(format!(
                "header_len {header_len} is not aligned or shorter than 64 + body_len {body_len}"
            )));
        }
        Ok(header_len)
    }

    /// Parses and validates a whole header (`buf` holds exactly
    /// `header_len` bytes, as returned by [`FileHeader::prefix_len`]).
    ///
    /// # Errors
    /// [`Error::Format`] naming the field at fault: bad CRC, truncated body,
    /// unknown dtype or kind code, an fp8 scale that is not a positive
    /// normal f32, a dtype or kind newer than the header's minor version,
    /// unsorted or duplicate tensors, a layer with both a latent and K/V,
    /// non-UTF-8 strings, non-zero padding or reserved bytes.
    pub fn parse(buf: &[u8], limits: &Limits) -> Result<FileHeader> {
        let prefix: &[u8; FRAME_HEADER_LEN] = buf
            .get(..FRAME_HEADER_LEN)
            .and_then(|p| p.try_into().ok())
            .ok_or_else(|| {
                Error::format_with(
                    FormatCause::Truncated,
                    Location::Header,
                    "file is shorter than the 64-byte prefix",
                )
            })?;
        let header_len = Self::prefix_len(prefix, limits)?;
        if buf.len() as u64 != header_len {
            return Err(Error::format_with(
                FormatCause::Truncated,
                Location::Header,
                format!("header needs {header_len} bytes, have {}", buf.len()),
            ));
        }
        let mut c = Cursor::new(prefix, Location::Header);
        c.bytes(8, "magic")?;
        let version_major = c.u16("major")?;
        let version_minor = c.u16("minor")?;
        c.bytes(8, "flags")?;
        let align_log2 = c.u8("alignment")?;
        c.bytes(3 + 4, "reserved")?;
        let body_len = c.u32("body_len")? as usize;
        let n_tensors = c.u32("n_tensors")?;
        let n_codecs = c.u32("n_codecs")?;
        let n_meta = c.u32("n_meta")?;
        let page_tokens = c.u32("page_tokens")?;
        let sink_tokens = c.u32("sink_tokens")?;
        let recent_tokens = c.u32("recent_tokens")?;
        c.zeros(4, "reserved word at offset 56")?;
        let stored_crc = c.u32("header_crc")?;
        let body = &buf[FRAME_HEADER_LEN..FRAME_HEADER_LEN + body_len];
        let crc = crc32(&[&prefix[..60], body]);
        if crc != stored_crc {
            return Err(Error::format_with(
                FormatCause::Checksum,
                Location::Header,
                format!("header CRC mismatch: stored 0x{stored_crc:08x}, computed 0x{crc:08x}"),
            ));
        }
        super::bytes::check_zero_padding(
            &buf[FRAME_HEADER_LEN + body_len..],
            (FRAME_HEADER_LEN + body_len) as u64,
            Location::Header,
        )?;
        if n_tensors > limits.max_tensors {
            return Err(Error::Limits(format!(
                "{n_tensors} tensors, limit is {}",
                limits.max_tensors
            )));
        }
        if n_codecs > limits.max_codecs {
            return Err(Error::Limits(format!(
                "file header: n_codecs is {n_codecs}, the limit is {}",
                limits.max_codecs
            )));
        }
        let mut c = Cursor::new(body, Location::Header);
        let mut tensors = Vec::with_capacity(n_tensors.min(4096) as usize);
        for i in 0..n_tensors {
            let what = format!("tensor record {i}");
            let layer = c.u32(&what)?;
            if layer > limits.max_layer {
                return Err(Error::Limits(format!(
                    "file header: {what}: layer index {layer} is above the limit {}",
                    limits.max_layer
                )));
            }
            let kind_code = c.u8(&what)?;
            let kind = Kind::from_code(kind_code)
                .ok_or_else(|| c.err(format!("{what}: unknown kind code {kind_code}")))?;
            let dtype_code = c.u8(&what)?;
            let mut dtype = DType::from_code(dtype_code)
                .ok_or_else(|| c.err(format!("{what}: unknown dtype code {dtype_code}")))?;
            c.zeros(2, &what)?;
            let batch = c.u32(&what)?;
            let heads = c.u32(&what)?;
            let tokens = c.u32(&what)?;
            let head_dim = c.u32(&what)?;
            let name = c.string(&what)?;
            if let DType::Fp8(f) = dtype {
                let scale = f32::from_bits(c.u32(&what)?);
                let f = Fp8::new(f.format(), scale)
                    .map_err(|e| c.err(format!("{what} ({name}): {e}")))?;
                dtype = DType::Fp8(f);
            }
            tensors.push(TensorInfo {
                name,
                layer,
                kind,
                dtype,
                batch,
                heads,
                tokens,
                head_dim,
            });
        }
        let mut codecs = Vec::new();
        for i in 0..n_codecs {
            let what = format!("codec record {i}");
            let id = c.u16(&what)?;
            c.zeros(2, &what)?;
            let n = c.u32(&what)? as usize;
            let params = c.bytes(n, &what)?.to_vec();
            codecs.push(CodecEntry { id, params });
        }
        let mut metadata = BTreeMap::new();
        let mut last: Option<String> = None;
        for i in 0..n_meta {
            let what = format!("metadata record {i}");
            let k = c.string(&what)?;
            let v = c.string(&what)?;
            if last.as_ref().is_some_and(|l| *l >= k) {
                return Err(c.err(format!(
                    "{what}: key {k:?} is not in strictly ascending order"
                )));
            }
            last = Some(k.clone());
            metadata.insert(k, v);
        }
        c.expect_end("header body")?;
        let h = FileHeader {
            version_major,
            version_minor,
            align_log2,
            tensors,
            codecs,
            metadata,
            page_tokens,
            sink_tokens,
            recent_tokens,
        };
        h.validate()?;
        Ok(h)
    }

    /// The lowest minor version of format 1 that can hold `tensors`: 1 when
    /// any tensor is fp8 or an MLA latent (format 1.1), else 0.
    pub fn required_minor(tensors: &[TensorInfo]) -> u16 {
        tensors.iter().map(Self::tensor_minor).max().unwrap_or(0)
    }

    /// The minor version that introduced what tensor `t` uses.
    fn tensor_minor(t: &TensorInfo) -> u16 {
        u16::from(matches!(t.dtype, DType::Fp8(_)) || t.kind == Kind::Latent)
    }

    /// Structural rules shared by writer and reader (format/SPEC.md,
    /// "Header validation").
    fn validate(&self) -> Result<()> {
        let err = |m: String| Err(Error::format(Location::Header, m));
        let newer = |t: &&TensorInfo| Self::tensor_minor(t) > self.version_minor;
        if let Some(t) = self.tensors.iter().find(newer) {
            return err(format!(
                "tensor {} ({}, {}) needs format 1.1 (fp8 element types and MLA latents), \
                 but the header says {}.{}",
                t.name,
                t.describe(),
                t.dtype.name(),
                self.version_major,
                self.version_minor
            ));
        }
        if !(6..=12).contains(&self.align_log2) {
            return err(format!(
                "alignment 2^{} is outside 2^6..2^12",
                self.align_log2
            ));
        }
        if self.codecs.is_empty() {
            return err("codec table is empty".into());
        }
        if self.codecs.len() > u16::MAX as usize {
            return err("more than 65535 codecs".into());
        }
        let mut names = std::collections::HashSet::new();
        for (i, t) in self.tensors.iter().enumerate() {
            if t.batch == 0 || t.heads == 0 || t.head_dim == 0 {
                return err(format!(
                    "tensor {i} ({}) has a zero dimension: batch {}, heads {}, head_dim {}",
                    t.name, t.batch, t.heads, t.head_dim
                ));
            }
            let elems = u64::from(t.batch)
                .checked_mul(u64::from(t.heads))
                .and_then(|x| x.checked_mul(u64::from(t.head_dim)))
                .and_then(|x| x.checked_mul(u64::from(t.tokens.max(1))));
            if elems.is_none_or(|e| e > 1 << 48) {
                return err(format!(
                    "tensor {i} ({}) has more than 2^48 elements",
                    t.name
                ));
            }
            if t.name.is_empty() || !names.insert(t.name.as_str()) {
                return err(format!(
                    "tensor {i} has an empty or repeated name {:?}",
                    t.name
                ));
            }
            if i > 0 {
                let p = &self.tensors[i - 1];
                if (p.layer, p.kind) >= (t.layer, t.kind) {
                    return err(format!(
                        "tensor table not strictly ordered by (layer, kind): {} after {}",
                        t.describe(),
                        p.describe()
                    ));
                }
                // Latent sorts after K and V, so a K or V of the same layer
                // is the record just before it.
                if t.kind == Kind::Latent && p.layer == t.layer {
                    return err(format!(
                        "layer {} has both an MLA latent and {}: a layer holds either a latent \
                         or K and V",
                        t.layer,
                        p.describe()
                    ));
                }
            }
        }
        Ok(())
    }
}
