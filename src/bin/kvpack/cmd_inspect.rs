//! `kvpack inspect` and `kvpack codecs`.

use anyhow::Result;
use clap::Args as ClapArgs;
use kvpack::cache::{DType, Kind, TensorInfo};
use kvpack::codec::registry::FAMILIES;
use kvpack::decode::Archive;
use kvpack::format::FLAG_ZSTD;
use kvpack::io::file;
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
    let input = file::open_input(&a.file)?;
    let ar = Archive::open(&input)?;
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
    let tjson: Vec<_> = tensors
        .iter()
        .zip(&per)
        .map(|(t, (n, b))| {
            json!({"name": t.name, "layer": t.layer, "kind": t.kind.letter(), "dtype": t.dtype.name(),
                   "batch": t.batch, "kv_heads": t.heads, "tokens": t.tokens, "head_dim": t.head_dim,
                   "pages": n, "bytes": b,
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
    println!(
        "  {:>5} {:>2} {:>6} {:>5} {:>8} {:>6} {:>5} {:>10} {:>9}",
        "layer", "", "dtype", "heads", "head_dim", "tokens", "pages", "bytes", "bits/elem"
    );
    for (t, j) in tensors.iter().zip(&tjson) {
        println!(
            "  {:>5} {:>2} {:>6} {:>5} {:>8} {:>6} {:>5} {:>10} {:>9.3}",
            t.layer,
            t.kind.letter(),
            t.dtype.name(),
            t.heads * t.batch,
            t.head_dim,
            t.tokens,
            j["pages"],
            j["bytes"],
            j["bits_per_element"].as_f64().unwrap_or(0.0)
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
        "octopus:b2",
        "octopus:b3",
        "octopus:b4",
        "octopus:b3+qjl",
        "octopus:b3:vg32",
        "turbo:b2",
        "turbo:b3",
        "turbo:b4",
    ];
    let shape = |d: u32| TensorInfo {
        name: String::new(),
        layer: 0,
        kind: Kind::Key,
        dtype: DType::Bf16,
        batch: 1,
        heads: 1,
        tokens: 1,
        head_dim: d,
    };
    let rows: Vec<_> = examples
        .iter()
        .filter_map(|n| kvpack::codec::parse(n).ok())
        .map(|c| json!({"name": c.name(), "id": c.id(), "bits_per_element_d128": c.bits_per_element(&shape(128)), "bits_per_element_d256": c.bits_per_element(&shape(256))}))
        .collect();
    if a.json {
        let fams: Vec<_> = FAMILIES
            .iter()
            .map(|f| json!({"id": f.id, "name": f.name, "syntax": f.syntax, "summary": f.summary}))
            .collect();
        output::print_json(&json!({"families": fams, "examples": rows}), false);
        return Ok(crate::EXIT_OK);
    }
    println!("codec families:");
    for f in FAMILIES {
        println!("  [{}] {:<44} {}", f.id, f.syntax, f.summary);
    }
    println!("\nbits/element (codec payload; sink/recent windows and container add a little):");
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
