//! safetensors import and export of KV caches in the HF layout:
//! `past_key_values.{layer}.key` / `past_key_values.{layer}.value`, shape
//! `[batch, kv_heads, tokens, head_dim]`, bf16/fp16/fp32 (`BF16`, `F16`,
//! `F32`) or fp8 (`F8_E4M3` = E4M3FN, `F8_E5M2`). Optional
//! `queries.{layer}` tensors `[batch, q_heads, tokens, head_dim]` (post-RoPE
//! query vectors for attention checks) are returned separately.
//!
//! MLA (DeepSeek-style) caches hold one `past_key_values.{layer}.latent`
//! tensor per layer instead of K and V: `[batch, 1, tokens, latent_dim]`
//! (or 3-axis `[batch, tokens, latent_dim]`, read as one head), the
//! compressed KV followed by the RoPE key part.
//!
//! fp8 tensors carry their per-tensor scale (dequantized value = code *
//! scale) in a scalar tensor named after them with `_scale` appended, e.g.
//! `past_key_values.3.key_scale` (shape `[]` or `[1]`, F32/BF16/F16; vLLM
//! calls these `k_scale` / `v_scale`). A missing scale means 1 (vLLM's
//! default); a scale for a tensor that is not fp8 is refused.
//!
//! Metadata keys are carried through compress/decompress unchanged, except
//! `kvpack.token_ids` (a JSON list of integers), which becomes the cache's
//! token ids (prompt-cache identity).

use std::collections::BTreeMap;
use std::io::Write;

use safetensors::{Dtype, SafeTensors};

use crate::cache::{DType, Elems, Fp8, Fp8Format, Kind, KvCache, Tensor, TensorData, TensorInfo};
use crate::error::{Error, Location, Result};
use crate::view::{CacheView, Strides, TensorView};

/// Metadata key holding the token ids of the cached prefix.
pub const TOKEN_IDS_KEY: &str = "kvpack.token_ids";
/// Metadata key holding the model's attention scale (softmax temperature).
pub const ATTN_SCALE_KEY: &str = "kvpack.attn_scale";

/// Query vectors of one layer: `[batch, q_heads, tokens, head_dim]`, f32.
#[derive(Debug, Clone, PartialEq)]
pub struct Queries {
    /// Layer index.
    pub layer: u32,
    /// `[batch, q_heads, tokens, head_dim]`.
    pub shape: [usize; 4],
    /// Row-major values.
    pub data: Vec<f32>,
}

/// A parsed safetensors KV cache file.
#[derive(Debug, Clone, PartialEq)]
pub struct Loaded {
    /// The K/V tensors (layer-major), metadata and token ids.
    pub cache: KvCache,
    /// `queries.{layer}` tensors, when present.
    pub queries: Vec<Queries>,
    /// Names of tensors that were neither K/V nor queries (ignored).
    pub ignored: Vec<String>,
}

/// Suffix of the scalar tensor holding an fp8 tensor's scale.
pub const SCALE_SUFFIX: &str = "_scale";

fn dtype_of(d: Dtype, name: &str) -> Result<DType> {
    match d {
        Dtype::BF16 => Ok(DType::Bf16),
        Dtype::F16 => Ok(DType::F16),
        Dtype::F32 => Ok(DType::F32),
        Dtype::F8_E4M3 => Ok(DType::Fp8(Fp8::unscaled(Fp8Format::E4M3Fn))),
        Dtype::F8_E5M2 => Ok(DType::Fp8(Fp8::unscaled(Fp8Format::E5M2))),
        other => Err(Error::param(format!(
            "tensor {name} has dtype {other:?}; kvpack supports BF16, F16, F32, F8_E4M3 (E4M3FN) \
             and F8_E5M2 KV caches"
        ))),
    }
}

fn shape4(shape: &[usize], name: &str, kind: Option<Kind>) -> Result<[usize; 4]> {
    match (shape, kind) {
        (&[b, t, d], Some(Kind::Latent)) => Ok([b, 1, t, d]),
        _ => <[usize; 4]>::try_from(shape).map_err(|_| {
            Error::param(format!(
                "tensor {name} has shape {shape:?}; expected 4 axes [batch, kv_heads, tokens, head_dim]{}",
                if kind == Some(Kind::Latent) {
                    " or 3 axes [batch, tokens, latent_dim]"
                } else {
                    ""
                }
            ))
        }),
    }
}

/// Splits `past_key_values.{layer}.{key|value|latent}[_scale]` or
/// `queries.{layer}`.
enum Name {
    Kv(u32, Kind),
    Scale(u32, Kind),
    Query(u32),
    Other,
}

fn classify(name: &str) -> Result<Name> {
    if let Some(rest) = name.strip_prefix("past_key_values.") {
        let (l, what) = rest.split_once('.').unwrap_or((rest, ""));
        let (what, scale) = match what.strip_suffix(SCALE_SUFFIX) {
            Some(w) => (w, true),
            None => (what, false),
        };
        let kind = match what {
            "key" => Kind::Key,
            "value" => Kind::Value,
            "latent" => Kind::Latent,
            _ => {
                return Err(Error::param(format!(
                    "tensor {name}: expected past_key_values.{{layer}}.key, .value or .latent \
                     (or one of them with {SCALE_SUFFIX} appended)"
                )));
            }
        };
        let layer = l
            .parse()
            .map_err(|_| Error::param(format!("tensor {name}: layer {l:?} is not a number")))?;
        return Ok(if scale {
            Name::Scale(layer, kind)
        } else {
            Name::Kv(layer, kind)
        });
    }
    if let Some(l) = name.strip_prefix("queries.")
        && let Ok(layer) = l.parse()
    {
        return Ok(Name::Query(layer));
    }
    Ok(Name::Other)
}

/// A parsed safetensors KV cache whose elements stay in the input bytes
/// (e.g. a memory map): nothing is copied.
#[derive(Debug, Clone)]
pub struct LoadedView<'a> {
    /// Views of the K/V tensors (layer-major), metadata and token ids.
    pub cache: CacheView<'a>,
    /// `queries.{layer}` tensors, when present (copied, f32).
    pub queries: Vec<Queries>,
    /// Names of tensors that were neither K/V nor queries (ignored).
    pub ignored: Vec<String>,
}

/// The validated content of a safetensors file, borrowing element bytes.
struct Parsed<'a> {
    kv: Vec<(TensorInfo, &'a [u8])>,
    queries: Vec<Queries>,
    ignored: Vec<String>,
    metadata: BTreeMap<String, String>,
    token_ids: Vec<u32>,
}

/// Parses a safetensors file's bytes.
///
/// # Errors
/// [`Error::Format`] (location: the input) for a malformed safetensors
/// file; [`Error::Parameter`] for unsupported dtypes, wrong ranks, missing
/// K or V of a layer, K/V shape mismatches, a layer with both a latent and
/// K/V, a scale that is not a positive finite scalar or belongs to no fp8
/// tensor, bad `kvpack.token_ids`, or no K/V/latent tensors at all.
pub fn parse(bytes: &[u8], source: &str) -> Result<Loaded> {
    let p = parse_parts(bytes, source)?;
    let tensors =
        p.kv.into_iter()
            .map(|(info, b)| {
                let data = TensorData::from_le_bytes(info.dtype, b)?;
                Tensor::new(info, data)
            })
            .collect::<Result<Vec<_>>>()?;
    Ok(Loaded {
        cache: KvCache {
            tensors,
            metadata: p.metadata,
            token_ids: p.token_ids,
        },
        queries: p.queries,
        ignored: p.ignored,
    })
}

/// Like [`parse`], borrowing the K/V elements from `bytes` instead of
/// copying them (compressing a memory-mapped file then needs memory for a
/// few pages, not for the cache).
///
/// # Errors
/// As [`parse`]; [`Error::Unsupported`] when an element array is not
/// aligned for its type in `bytes` or the machine is big-endian (use
/// [`parse`] then).
pub fn parse_view<'a>(bytes: &'a [u8], source: &str) -> Result<LoadedView<'a>> {
    let p = parse_parts(bytes, source)?;
    let tensors =
        p.kv.into_iter()
            .map(|(info, b)| {
                let cast = |e: bytemuck::PodCastError| {
                    Error::Unsupported(format!(
                        "{}: elements cannot be borrowed ({e:?})",
                        info.name
                    ))
                };
                if cfg!(target_endian = "big") {
                    return Err(Error::Unsupported("big-endian host".into()));
                }
                let data = match info.dtype {
                    DType::Bf16 => Elems::Bf16(bytemuck::try_cast_slice(b).map_err(cast)?),
                    DType::F16 => Elems::F16(bytemuck::try_cast_slice(b).map_err(cast)?),
                    DType::F32 => Elems::F32(bytemuck::try_cast_slice(b).map_err(cast)?),
                    DType::Fp8(f) => Elems::Fp8(f, b),
                };
                let strides = Strides::head_major(&info);
                TensorView::new(info, data, strides)
            })
            .collect::<Result<Vec<_>>>()?;
    Ok(LoadedView {
        cache: CacheView {
            tensors,
            metadata: p.metadata,
            token_ids: p.token_ids,
        },
        queries: p.queries,
        ignored: p.ignored,
    })
}

fn parse_parts<'a>(bytes: &'a [u8], source: &str) -> Result<Parsed<'a>> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| {
        Error::format(
            Location::Input(source.to_string()),
            format!("not a valid safetensors file: {e}"),
        )
    })?;
    let (_, meta) = SafeTensors::read_metadata(bytes)
        .map_err(|e| Error::format(Location::Input(source.to_string()), e.to_string()))?;
    let mut kv: BTreeMap<(u32, Kind), (TensorInfo, &'a [u8])> = BTreeMap::new();
    let mut scales: BTreeMap<(u32, Kind), (String, f32)> = BTreeMap::new();
    let mut queries = Vec::new();
    let mut ignored = Vec::new();
    let mut names: Vec<_> = st.names().into_iter().map(str::to_string).collect();
    names.sort();
    for name in &names {
        let view = st
            .tensor(name)
            .map_err(|e| Error::format(Location::Input(name.clone()), e.to_string()))?;
        match classify(name)? {
            Name::Kv(layer, kind) => {
                let dtype = dtype_of(view.dtype(), name)?;
                let [b, h, t, d] = shape4(view.shape(), name, Some(kind))?;
                let fits = |x: usize| {
                    u32::try_from(x).map_err(|_| {
                        Error::param(format!("tensor {name}: dimension {x} too large"))
                    })
                };
                let info = TensorInfo {
                    name: name.clone(),
                    layer,
                    kind,
                    dtype,
                    batch: fits(b)?,
                    heads: fits(h)?,
                    tokens: fits(t)?,
                    head_dim: fits(d)?,
                };
                if b == 0 || h == 0 || d == 0 {
                    return Err(Error::param(format!(
                        "tensor {name} has an empty axis: shape {:?}",
                        view.shape()
                    )));
                }
                let data: &'a [u8] = view.data();
                if data.len() as u64 != info.elements() * dtype.size() as u64 {
                    return Err(Error::param(format!(
                        "tensor {name}: {} bytes for shape {:?}",
                        data.len(),
                        view.shape()
                    )));
                }
                kv.insert((layer, kind), (info, data));
            }
            Name::Scale(layer, kind) => {
                let dtype = dtype_of(view.dtype(), name)?;
                let vals = TensorData::from_le_bytes(dtype, view.data())?.to_f32();
                let (&[s], true) = (vals.as_slice(), view.shape().len() <= 1) else {
                    return Err(Error::param(format!(
                        "tensor {name} has shape {:?}; an fp8 scale is one number (shape [] or [1])",
                        view.shape()
                    )));
                };
                scales.insert((layer, kind), (name.clone(), s));
            }
            Name::Query(layer) => {
                let dtype = dtype_of(view.dtype(), name)?;
                let shape = shape4(view.shape(), name, None)?;
                let data = TensorData::from_le_bytes(dtype, view.data())?.to_f32();
                queries.push(Queries { layer, shape, data });
            }
            Name::Other => ignored.push(name.clone()),
        }
    }
    for ((layer, kind), (name, s)) in scales {
        let t = kv.get_mut(&(layer, kind)).ok_or_else(|| {
            Error::param(format!(
                "{name} is the scale of past_key_values.{layer}.{}, which is missing",
                kind.name()
            ))
        })?;
        let DType::Fp8(f) = t.0.dtype else {
            return Err(Error::param(format!(
                "{name}: {} is {}, not fp8; only fp8 tensors carry a scale",
                t.0.name,
                t.0.dtype.name()
            )));
        };
        let f = Fp8::new(f.format(), s).map_err(|e| Error::param(format!("{name}: {e}")))?;
        t.0.dtype = DType::Fp8(f);
    }
    if kv.is_empty() {
        let some: Vec<_> = names.iter().take(5).cloned().collect();
        return Err(Error::param(format!(
            "{source} has no tensors named past_key_values.{{layer}}.key / .value / .latent (found {} tensors{}{})",
            names.len(),
            if some.is_empty() { "" } else { ": " },
            some.join(", ")
        )));
    }
    for ((layer, kind), (a, _)) in &kv {
        let other = match kind {
            Kind::Key => Kind::Value,
            Kind::Value => Kind::Key,
            Kind::Latent => {
                if let Some((o, _)) = [Kind::Key, Kind::Value]
                    .iter()
                    .find_map(|k| kv.get(&(*layer, *k)))
                {
                    return Err(Error::param(format!(
                        "layer {layer} has both an MLA latent ({}) and {}; a layer holds either \
                         a latent or K and V",
                        a.name, o.name
                    )));
                }
                continue;
            }
        };
        match kv.get(&(*layer, other)) {
            None => {
                return Err(Error::param(format!(
                    "{} is present but past_key_values.{layer}.{} is missing",
                    a.name,
                    other.name()
                )));
            }
            Some((b, _)) => {
                if (a.batch, a.heads, a.tokens) != (b.batch, b.heads, b.tokens) {
                    return Err(Error::param(format!(
                        "layer {layer}: K and V shapes disagree on batch/kv_heads/tokens: {:?} vs {:?}",
                        a.shape(),
                        b.shape()
                    )));
                }
            }
        }
    }
    let mut metadata: BTreeMap<String, String> = meta
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    let token_ids = match metadata.remove(TOKEN_IDS_KEY) {
        Some(s) => serde_json::from_str::<Vec<u32>>(&s).map_err(|e| {
            Error::param(format!(
                "{source}: metadata {TOKEN_IDS_KEY} is not a JSON list of token ids: {e}"
            ))
        })?,
        None => Vec::new(),
    };
    queries.sort_by_key(|q| q.layer);
    Ok(Parsed {
        kv: kv.into_values().collect(),
        queries,
        ignored,
        metadata,
        token_ids,
    })
}

fn st_dtype(d: DType) -> &'static str {
    match d {
        DType::Bf16 => "BF16",
        DType::F16 => "F16",
        DType::F32 => "F32",
        DType::Fp8(f) => match f.format() {
            Fp8Format::E4M3Fn => "F8_E4M3",
            Fp8Format::E5M2 => "F8_E5M2",
        },
    }
}

/// Writes `cache` as a safetensors file (tensor names, shapes and dtypes
/// from the cache; metadata plus `kvpack.token_ids` when token ids exist;
/// for every fp8 tensor a scalar F32 tensor `{name}_scale` with its scale).
///
/// # Errors
/// [`Error::Io`] when writing fails.
pub fn write(cache: &KvCache, w: &mut dyn Write) -> Result<()> {
    let infos: Vec<TensorInfo> = cache.tensors.iter().map(|t| t.info.clone()).collect();
    write_header(&infos, &cache.metadata, &cache.token_ids, w)?;
    for t in &cache.tensors {
        write_tensor(t, w)?;
    }
    write_scales(&infos, w)
}

/// Writes the safetensors header for tensors `infos` (their dtype is the
/// output dtype) in this order, then the scalar `{name}_scale` of every fp8
/// tensor; the tensors' bytes follow with [`write_tensor`], so a writer
/// needs only one tensor in memory at a time, and then the scales with
/// [`write_scales`].
///
/// # Errors
/// [`Error::Io`] when writing fails; [`Error::Parameter`] when a scale's
/// name is taken by a tensor.
pub fn write_header(
    infos: &[TensorInfo],
    metadata: &BTreeMap<String, String>,
    token_ids: &[u32],
    w: &mut dyn Write,
) -> Result<()> {
    let mut hb = header_json(infos, metadata, token_ids)?;
    hb.resize(hb.len().next_multiple_of(8), b' ');
    let io = |e| Error::io("writing safetensors", e);
    w.write_all(&(hb.len() as u64).to_le_bytes()).map_err(io)?;
    w.write_all(&hb).map_err(io)
}

/// The JSON header (unpadded) for `infos`, metadata and token ids.
fn header_json(
    infos: &[TensorInfo],
    metadata: &BTreeMap<String, String>,
    token_ids: &[u32],
) -> Result<Vec<u8>> {
    let mut header = serde_json::Map::new();
    let mut meta: serde_json::Map<String, serde_json::Value> = metadata
        .iter()
        .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
        .collect();
    if !token_ids.is_empty() {
        meta.insert(
            TOKEN_IDS_KEY.into(),
            serde_json::Value::String(serde_json::to_string(token_ids).expect("ints")),
        );
    }
    if !meta.is_empty() {
        header.insert("__metadata__".into(), serde_json::Value::Object(meta));
    }
    let mut off = 0u64;
    for t in infos {
        let n = t.elements() * t.dtype.size() as u64;
        header.insert(
            t.name.clone(),
            serde_json::json!({"dtype": st_dtype(t.dtype), "shape": t.shape(), "data_offsets": [off, off + n]}),
        );
        off += n;
    }
    for t in infos.iter().filter(|t| t.dtype.scale().is_some()) {
        let name = format!("{}{SCALE_SUFFIX}", t.name);
        if header.contains_key(&name) {
            return Err(Error::param(format!(
                "cannot write the scale of {} as {name}: a tensor of that name exists",
                t.name
            )));
        }
        header.insert(
            name,
            serde_json::json!({"dtype": "F32", "shape": [], "data_offsets": [off, off + 4]}),
        );
        off += 4;
    }
    Ok(serde_json::to_vec(&header).expect("json"))
}

/// Where each tensor of a safetensors output lies in the file, known from
/// the tensor shapes before any element is decoded: decoded pieces are
/// written at their offsets in any order, from any thread
/// ([`Layout::write_piece`]), into a file of [`Layout::len`] bytes, and the
/// header and fp8 scales last ([`Layout::finish`]). The file is the same,
/// byte for byte, as [`write()`] makes, except that the header may carry
/// trailing spaces (room reserved for token ids that arrive last, as the
/// safetensors format allows).
#[derive(Debug, Clone, PartialEq)]
pub struct Layout {
    infos: Vec<TensorInfo>,
    metadata: BTreeMap<String, String>,
    /// Bytes of the header (8-byte length and JSON, padded).
    header_len: u64,
    /// File offset of each tensor's first element, in `infos` order.
    offsets: Vec<u64>,
    /// File offset of the first fp8 scale (the end of the tensor data).
    scales_at: u64,
}

impl Layout {
    /// The layout of `infos` (output dtypes) with `metadata` and
    /// `token_ids`: the file [`write()`] makes.
    ///
    /// # Errors
    /// As [`write_header`].
    pub fn exact(
        infos: &[TensorInfo],
        metadata: &BTreeMap<String, String>,
        token_ids: &[u32],
    ) -> Result<Layout> {
        let json = header_json(infos, metadata, token_ids)?.len() as u64;
        Ok(Self::build(infos, metadata, json))
    }

    /// The layout of `infos` (output dtypes) with `metadata`, with room in
    /// the header for up to `max_token_ids` token ids, whose values are
    /// given to [`Layout::finish`] (a stream's token ids come last).
    ///
    /// # Errors
    /// As [`write_header`].
    pub fn with_room(
        infos: &[TensorInfo],
        metadata: &BTreeMap<String, String>,
        max_token_ids: usize,
    ) -> Result<Layout> {
        // One id of 10 digits, plus 10 digits and a comma for every other.
        let json = if max_token_ids == 0 {
            header_json(infos, metadata, &[])?.len() as u64
        } else {
            header_json(infos, metadata, &[u32::MAX])?.len() as u64 + 11 * max_token_ids as u64
        };
        Ok(Self::build(infos, metadata, json))
    }

    fn build(infos: &[TensorInfo], metadata: &BTreeMap<String, String>, json: u64) -> Layout {
        let header_len = 8 + json.next_multiple_of(8);
        let mut offsets = Vec::with_capacity(infos.len());
        let mut at = header_len;
        for t in infos {
            offsets.push(at);
            at += t.elements() * t.dtype.size() as u64;
        }
        Layout {
            infos: infos.to_vec(),
            metadata: metadata.clone(),
            header_len,
            offsets,
            scales_at: at,
        }
    }

    /// The file's length in bytes.
    pub fn len(&self) -> u64 {
        self.scales_at
            + 4 * self
                .infos
                .iter()
                .filter(|t| t.dtype.scale().is_some())
                .count() as u64
    }

    /// True when the layout holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.infos.is_empty()
    }

    /// Writes a decoded piece of output tensor `output` (position in the
    /// layout's `infos`): tokens `[token, token + tokens)` of every plane,
    /// elements `[planes, tokens, head_dim]` in the tensor's dtype.
    ///
    /// # Errors
    /// [`Error::Parameter`] when the piece does not fit the tensor;
    /// [`Error::Io`] when writing fails.
    pub fn write_piece(
        &self,
        f: &std::fs::File,
        output: usize,
        token: u32,
        tokens: u32,
        elems: Elems<'_>,
    ) -> Result<()> {
        let bad = || {
            Error::param(format!(
                "piece {output} tokens {token}+{tokens} does not fit"
            ))
        };
        let t = self.infos.get(output).ok_or_else(bad)?;
        let (d, planes) = (t.head_dim as usize, t.planes());
        let row = tokens as usize * d;
        if u64::from(token) + u64::from(tokens) > u64::from(t.tokens)
            || elems.len() != planes * row
            || elems.dtype() != t.dtype
        {
            return Err(bad());
        }
        let size = t.dtype.size() as u64;
        for p in 0..planes {
            let part = elems.slice(p * row, row);
            let at = self.offsets[output]
                + ((p as u64 * u64::from(t.tokens) + u64::from(token)) * d as u64) * size;
            let io = |e| Error::io("writing safetensors", e);
            if cfg!(target_endian = "little") {
                super::file::write_all_at(f, part.bytes(), at).map_err(io)?;
            } else {
                let mut v = TensorData::zeros(t.dtype, row);
                let mut f32s = vec![0f32; row];
                part.load(0, &mut f32s);
                v.as_elems_mut().store(0, &f32s);
                super::file::write_all_at(f, &v.to_le_bytes(), at).map_err(io)?;
            }
        }
        Ok(())
    }

    /// Sets the file's length, then writes the header (with `token_ids`)
    /// and the fp8 scales: call it once every piece is written. When the
    /// token ids need more header room than was reserved, the tensor data
    /// is moved up in place (a bounded buffer) to make room.
    ///
    /// # Errors
    /// [`Error::Io`] when writing fails.
    pub fn finish(&mut self, f: &std::fs::File, token_ids: &[u32]) -> Result<()> {
        let io = |e| Error::io("writing safetensors", e);
        let json = header_json(&self.infos, &self.metadata, token_ids)?;
        let need = 8 + (json.len() as u64).next_multiple_of(8);
        if need > self.header_len {
            let shift = need - self.header_len;
            move_up(f, self.header_len, self.scales_at, shift).map_err(io)?;
            for o in &mut self.offsets {
                *o += shift;
            }
            self.scales_at += shift;
            self.header_len = need;
        }
        let mut hb = json;
        hb.resize(self.header_len as usize - 8, b' ');
        let mut head = (hb.len() as u64).to_le_bytes().to_vec();
        head.extend_from_slice(&hb);
        super::file::write_all_at(f, &head, 0).map_err(io)?;
        let mut scales = Vec::new();
        for s in self.infos.iter().filter_map(|t| t.dtype.scale()) {
            scales.extend_from_slice(&s.to_le_bytes());
        }
        super::file::write_all_at(f, &scales, self.scales_at).map_err(io)?;
        f.set_len(self.len()).map_err(io)
    }
}

/// Moves bytes `[from, to)` of `f` up by `shift` bytes, last chunk first.
fn move_up(f: &std::fs::File, from: u64, to: u64, shift: u64) -> std::io::Result<()> {
    const CHUNK: u64 = 1 << 20;
    let mut buf = vec![0u8; CHUNK as usize];
    let mut end = to;
    while end > from {
        let start = end.saturating_sub(CHUNK).max(from);
        let b = &mut buf[..(end - start) as usize];
        read_exact_at(f, b, start)?;
        super::file::write_all_at(f, b, start + shift)?;
        end = start;
    }
    Ok(())
}

fn read_exact_at(f: &std::fs::File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        std::os::unix::fs::FileExt::read_exact_at(f, buf, offset)
    }
    #[cfg(windows)]
    {
        let (mut buf, mut offset) = (buf, offset);
        while !buf.is_empty() {
            match std::os::windows::fs::FileExt::seek_read(f, buf, offset) {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => {
                    buf = &mut buf[n..];
                    offset += n as u64;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// Writes one tensor's elements, little-endian (after [`write_header`]).
///
/// # Errors
/// [`Error::Io`] when writing fails.
pub fn write_tensor(t: &Tensor, w: &mut dyn Write) -> Result<()> {
    let io = |e| Error::io("writing safetensors", e);
    if cfg!(target_endian = "little") {
        w.write_all(t.data.as_elems().bytes()).map_err(io)
    } else {
        w.write_all(&t.data.to_le_bytes()).map_err(io)
    }
}

/// Writes the scales of the fp8 tensors among `infos` (after the last
/// [`write_tensor`]), in the order [`write_header`] declared them.
///
/// # Errors
/// [`Error::Io`] when writing fails.
pub fn write_scales(infos: &[TensorInfo], w: &mut dyn Write) -> Result<()> {
    let io = |e| Error::io("writing safetensors", e);
    for s in infos.iter().filter_map(|t| t.dtype.scale()) {
        w.write_all(&s.to_le_bytes()).map_err(io)?;
    }
    Ok(())
}
