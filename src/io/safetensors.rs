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
/// [`Error::Io`] when writing fails.
pub fn write_header(
    infos: &[TensorInfo],
    metadata: &BTreeMap<String, String>,
    token_ids: &[u32],
    w: &mut dyn Write,
) -> Result<()> {
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
    let mut off = 0usize;
    for t in infos {
        let n = t.elements() as usize * t.dtype.size();
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
    let mut hb = serde_json::to_vec(&header).expect("json");
    hb.resize(hb.len().next_multiple_of(8), b' ');
    let io = |e| Error::io("writing safetensors", e);
    w.write_all(&(hb.len() as u64).to_le_bytes()).map_err(io)?;
    w.write_all(&hb).map_err(io)
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
