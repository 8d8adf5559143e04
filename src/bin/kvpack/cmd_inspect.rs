//! `kvpack inspect` and `kvpack codecs`.

use anyhow::Result;
use clap::Args as ClapArgs;
use kvpack::cache::{DType, Kind, TensorInfo};
use kvpack::codec::registry::FAMILIES;
use kvpack::decode::Selection;
use kvpack::format::FLAG_ZSTD;
use serde_json::json;

use crate::output;

/// Show a .kvpack file: format version, commits, codec table, per-layer
/// pages and bits per element (everything counted: headers, scales, index,
/// padding), compression ratio, metadata and prompt identity.
#[derive(ClapArgs, Debug)]
pub struct Args {
    /// The .kvpack file, or - for stdin.
    pub file: String,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// List every page with its sections.
    #[arg(long)]
    pub pages: bool,
    /// Read every page and break the bits per element down by section kind
    /// (scales, indices, outlier tables, raw windows, framing), with the
    /// outlier tables' entry count (format/SPEC.md section 6.5).
    #[arg(long)]
    pub sections: bool,
}

/// Bytes per section kind over all pages, outlier-table totals, and the
/// bytes outside sections (headers, section tables, padding, index).
fn section_breakdown(
    r: &kvpack::format::Reader<'_>,
    elements: u64,
    file_bytes: u64,
) -> Result<serde_json::Value> {
    use kvpack::format::SectionKind;
    let kinds = [
        SectionKind::Scale,
        SectionKind::Zero,
        SectionKind::Index,
        SectionKind::Outliers,
        SectionKind::Raw,
        SectionKind::Aux,
    ];
    let mut bytes = [0u64; 6];
    let (mut entries, mut universe) = (0u64, 0u64);
    for i in 0..r.index().entries.len() {
        let page = r.page(i)?;
        for d in page.sections() {
            let k = kinds.iter().position(|k| *k == d.kind).unwrap_or(0);
            bytes[k] += u64::from(d.len);
            if d.kind == SectionKind::Outliers {
                let (_, b) = page.section(d.kind, d.stream)?;
                if b.len() >= 12 {
                    entries += u64::from(u32::from_le_bytes(b[0..4].try_into()?));
                    universe += u64::from(u32::from_le_bytes(b[8..12].try_into()?));
                }
            }
        }
    }
    let bpe = |b: u64| 8.0 * b as f64 / elements.max(1) as f64;
    let mut v = serde_json::Map::new();
    for (k, &b) in kinds.iter().zip(&bytes) {
        if b > 0 {
            v.insert(
                k.name().to_string(),
                json!({"bytes": b, "bits_per_element": bpe(b)}),
            );
        }
    }
    let in_sections: u64 = bytes.iter().sum();
    v.insert(
        "framing".into(),
        json!({"bytes": file_bytes - in_sections, "bits_per_element": bpe(file_bytes - in_sections)}),
    );
    v.insert(
        "outlier_entries".into(),
        json!({"entries": entries, "positions": universe,
               "fraction": if universe == 0 { 0.0 } else { entries as f64 / universe as f64 }}),
    );
    Ok(serde_json::Value::Object(v))
}

/// List the codecs this build knows, with bits per element.
#[derive(ClapArgs, Debug)]
pub struct CodecsArgs {
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn run(a: Args) -> Result<u8> {
    let input = output::open_kvpack(&a.file)?;
    let ar = output::open_archive(&input)?;
    // A file whose declared tensors exceed the limits is refused here as by
    // every command that decodes it (--max-memory raises the limit).
    ar.check_output(&ar.select(&Selection::default(), None))?;
    let r = ar.reader();
    let h = r.header();
    let idx = r.index();
    let tensors = ar.tensors();
    let mut per = vec![(0usize, 0u64); tensors.len()];
    for e in &idx.entries {
        let p = &mut per[e.meta.tensor as usize];
        p.0 += 1;
        p.1 += e.frame_len;
    }
    let elements: u64 = tensors.iter().map(TensorInfo::elements).sum();
    let source: u64 = tensors
        .iter()
        .map(|t| t.elements() * t.dtype.size() as u64)
        .sum();
    let file_bytes = r.committed_len();
    let bpe = if elements == 0 {
        0.0
    } else {
        8.0 * file_bytes as f64 / elements as f64
    };
    let codecs: Vec<_> = ar
        .codecs()
        .iter()
        .enumerate()
        .map(|(slot, c)| {
            let nominal = tensors.first().map(|t| c.bits_per_element(t)).unwrap_or(0.0);
            json!({"slot": slot, "id": c.id(), "name": c.name(), "params_hex": hex(&h.codecs[slot].params), "nominal_bits_per_element": nominal})
        })
        .collect();
    let ids: Vec<u16> = h.codecs.iter().map(|c| c.id).collect();
    let coding = kvpack::budget::coding(&idx.entries, &ids, tensors.len());
    let coding_text = |c: &kvpack::budget::TensorCoding| {
        let names: Vec<String> = c
            .slots
            .iter()
            .map(|&s| ar.codec(s as usize).name())
            .collect();
        let mut t = names.join("+");
        if c.sink > 0 {
            t += &format!(" sink {}", c.sink);
        }
        if c.recent > 0 {
            t += &format!(" recent {}", c.recent);
        }
        t
    };
    let tjson: Vec<_> = tensors
        .iter()
        .zip(&per)
        .zip(&coding)
        .map(|((t, (n, b)), c)| {
            json!({"name": t.name, "layer": t.layer, "kind": t.kind.letter(), "dtype": t.dtype.name(), "scale": t.dtype.scale(),
                   "batch": t.batch, "kv_heads": t.heads, "tokens": t.tokens, "head_dim": t.head_dim,
                   "pages": n, "bytes": b, "codec_slots": c.slots, "sink": c.sink, "recent": c.recent,
                   "bits_per_element": if t.elements() == 0 { 0.0 } else { 8.0 * *b as f64 / t.elements() as f64 }})
        })
        .collect();
    let pages_json: Vec<_> = if a.pages {
        (0..idx.entries.len())
            .map(|i| {
                let e = idx.entries[i];
                let secs = match r.page(i) {
                    Ok(p) => p
                        .sections()
                        .iter()
                        .map(|s| json!({"kind": s.kind.name(), "stream": s.stream, "elem": s.elem.name(), "count": s.count, "bytes": s.len}))
                        .collect(),
                    Err(err) => vec![json!({"error": err.to_string()})],
                };
                json!({"page": i, "offset": r.header_len() + e.offset, "frame_bytes": e.frame_len,
                       "tensor": tensors[e.meta.tensor as usize].name, "token_start": e.meta.token_start,
                       "tokens": e.meta.tokens, "codec_slot": e.meta.codec, "zstd": e.flags & FLAG_ZSTD != 0,
                       "sections": secs})
            })
            .collect()
    } else {
        Vec::new()
    };
    if a.json {
        let mut v = json!({
            "file": a.file,
            "bytes": file_bytes,
            "format_version": format!("{}.{}", h.version_major, h.version_minor),
            "alignment": h.align(),
            "generation": idx.generation,
            "torn_tail_bytes": r.torn_tail(),
            "page_tokens": h.page_tokens,
            "sink_tokens": h.sink_tokens,
            "recent_tokens": h.recent_tokens,
            "codecs": codecs,
            "layers": tensors.iter().map(|t| t.layer + 1).max().unwrap_or(0),
            "tensors": tjson,
            "pages": idx.entries.len(),
            "elements": elements,
            "source_bytes": source,
            "bits_per_element": bpe,
            "compression_ratio": source as f64 / file_bytes.max(1) as f64,
            "metadata": h.metadata,
            "model": h.metadata.get("kvpack.model"),
            "token_ids": idx.token_ids.len(),
            "token_ids_head": idx.token_ids.iter().take(16).collect::<Vec<_>>(),
        });
        if a.pages {
            v["page_list"] = json!(pages_json);
        }
        if a.sections {
            v["sections"] = section_breakdown(r, elements, file_bytes)?;
        }
        output::print_json(&v, false);
        return Ok(crate::EXIT_OK);
    }
    println!(
        "{}: kvpack format {}.{}, {}",
        a.file,
        h.version_major,
        h.version_minor,
        output::bytes(file_bytes)
    );
    println!(
        "  commits: {} (latest generation {}), alignment {} B, page {} tokens, sink {}, recent {}",
        idx.generation + 1,
        idx.generation,
        h.align(),
        h.page_tokens,
        h.sink_tokens,
        h.recent_tokens
    );
    if r.torn_tail() > 0 {
        println!(
            "  warning: {} bytes after the last commit are an interrupted append (ignored)",
            r.torn_tail()
        );
    }
    if let Some(m) = h.metadata.get("kvpack.model") {
        println!("  model: {m}");
    }
    if !idx.token_ids.is_empty() {
        let head: Vec<String> = idx
            .token_ids
            .iter()
            .take(8)
            .map(|t| t.to_string())
            .collect();
        println!(
            "  prompt: {} token ids [{}{}]",
            idx.token_ids.len(),
            head.join(", "),
            if idx.token_ids.len() > 8 { ", ..." } else { "" }
        );
    }
    println!("  codecs:");
    for c in &codecs {
        println!(
            "    slot {}: {} (id {}, params {}), {:.3} bits/element nominal",
            c["slot"],
            c["name"].as_str().unwrap_or(""),
            c["id"],
            c["params_hex"].as_str().unwrap_or(""),
            c["nominal_bits_per_element"].as_f64().unwrap_or(0.0)
        );
    }
    // fp8 tensors show their per-tensor scale; MLA latents are kind L
    // (heads 1, head_dim = latent width).
    let fp8 = tensors.iter().any(|t| t.dtype.scale().is_some());
    println!(
        "  {:>5} {:>2} {:>8} {:>5} {:>8} {:>6} {:>5} {:>10} {:>9}  coding{}",
        "layer",
        "",
        "dtype",
        "heads",
        "head_dim",
        "tokens",
        "pages",
        "bytes",
        "bits/elem",
        if fp8 { "  scale" } else { "" }
    );
    if tensors.iter().any(|t| t.kind == Kind::Latent) {
        println!(
            "  (L = MLA latent: compressed KV + RoPE key, one per layer; head_dim = latent width)"
        );
    }
    for ((t, j), c) in tensors.iter().zip(&tjson).zip(&coding) {
        println!(
            "  {:>5} {:>2} {:>8} {:>5} {:>8} {:>6} {:>5} {:>10} {:>9.3}  {}{}",
            t.layer,
            t.kind.letter(),
            t.dtype.name(),
            t.heads * t.batch,
            t.head_dim,
            t.tokens,
            j["pages"],
            j["bytes"],
            j["bits_per_element"].as_f64().unwrap_or(0.0),
            coding_text(c),
            t.dtype
                .scale()
                .map(|s| format!("  {s:e}"))
                .unwrap_or_default()
        );
    }
    println!(
        "  total: {} elements, {} pages, {} source -> {}: {:.3} bits/element everything included, ratio {:.2}x",
        elements,
        idx.entries.len(),
        output::bytes(source),
        output::bytes(file_bytes),
        bpe,
        source as f64 / file_bytes.max(1) as f64
    );
    if a.sections {
        let b = section_breakdown(r, elements, file_bytes)?;
        let parts: Vec<String> = b
            .as_object()
            .into_iter()
            .flatten()
            .filter_map(|(k, v)| {
                v["bits_per_element"]
                    .as_f64()
                    .map(|x| format!("{k} {x:.4}"))
            })
            .collect();
        println!("  bits/element by section: {}", parts.join(", "));
        let o = &b["outlier_entries"];
        if o["entries"].as_u64().unwrap_or(0) > 0 {
            println!(
                "  outlier tables: {} entries of {} positions ({:.2}%)",
                o["entries"],
                o["positions"],
                100.0 * o["fraction"].as_f64().unwrap_or(0.0)
            );
        }
    }
    if !h.metadata.is_empty() {
        println!("  metadata:");
        for (k, v) in &h.metadata {
            let v = if v.len() > 80 {
                format!("{}...", &v[..v.floor_char_boundary(77)])
            } else {
                v.clone()
            };
            println!("    {k} = {v}");
        }
    }
    for p in &pages_json {
        println!(
            "  page {:>4} @{:>10} {:>8} B {} tokens {}+{} slot {}{}",
            p["page"],
            p["offset"],
            p["frame_bytes"],
            p["tensor"].as_str().unwrap_or(""),
            p["token_start"],
            p["tokens"],
            p["codec_slot"],
            if p["zstd"].as_bool() == Some(true) {
                " zstd"
            } else {
                ""
            }
        );
        for s in p["sections"].as_array().into_iter().flatten() {
            println!("        {}", s);
        }
    }
    Ok(crate::EXIT_OK)
}

pub fn codecs(a: CodecsArgs) -> Result<u8> {
    let examples = [
        "raw",
        "int2",
        "int3",
        "int4",
        "int8",
        "bdr16",
        "bdr32",
        "bdr64",
        "bdr128",
        "bdr256",
        "bdr128:k",
        "hqmq:s24r3",
        "hqmq:s48r4",
        "hqmq:s96r4",
        "hqmq:s192r4",
        "hqmq:s192r6",
        "hqmq:s96r4+med3",
        "polar:m4n4",
        "polar:m4n2",
        "innerq:k3v3",
        "innerq:k3v2",
        "innerq:k2v2",
        "kivi:2",
        "kivi:4",
        "octopus:b2",
        "octopus:b3",
        "octopus:b4",
        "octopus:b3+qjl",
        "octopus:b3:vg32",
        "turbo:b2",
        "turbo:b3",
        "turbo:b4",
    ];
    // Mean of the K and V figures (codecs such as innerq:k3v2 differ).
    let shape = |d: u32, kind: Kind| TensorInfo {
        name: String::new(),
        layer: 0,
        kind,
        dtype: DType::Bf16,
        batch: 1,
        heads: 1,
        tokens: 1,
        head_dim: d,
    };
    let rows: Vec<_> = examples
        .iter()
        .filter_map(|n| kvpack::codec::parse(n).ok())
        .map(|c| {
            let bpe = |d| {
                (c.bits_per_element(&shape(d, Kind::Key)) + c.bits_per_element(&shape(d, Kind::Value))) / 2.0
            };
            json!({"name": c.name(), "id": c.id(), "bits_per_element_d128": bpe(128), "bits_per_element_d256": bpe(256)})
        })
        .collect();
    if a.json {
        let fams: Vec<_> = FAMILIES
            .iter()
            .map(|f| json!({"id": f.id, "name": f.name, "syntax": f.syntax, "summary": f.summary}))
            .collect();
        output::print_json(&json!({"families": fams, "examples": rows}), false);
        return Ok(crate::EXIT_OK);
    }
    println!("codec families (id: name syntax, then what it is):");
    let mut fams: Vec<_> = FAMILIES.iter().collect();
    fams.sort_by_key(|f| f.id);
    for f in fams {
        println!("  {:>2}: {}\n      {}", f.id, f.syntax, f.summary);
    }
    println!(
        "\nbits/element (codec payload, mean of K and V; sink/recent windows, per-page scales and the container add more):"
    );
    println!("  {:<16} {:>10} {:>10}", "codec", "d=128", "d=256");
    for r in rows {
        println!(
            "  {:<16} {:>10.3} {:>10.3}",
            r["name"].as_str().unwrap_or(""),
            r["bits_per_element_d128"].as_f64().unwrap_or(0.0),
            r["bits_per_element_d256"].as_f64().unwrap_or(0.0)
        );
    }
    Ok(crate::EXIT_OK)
}
