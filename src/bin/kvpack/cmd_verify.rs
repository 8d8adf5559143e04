//! `kvpack verify`.

use std::sync::Mutex;

use anyhow::Result;
use clap::Args as ClapArgs;
use kvpack::cache::{Tensor, TensorData};
use kvpack::decode::{Piece, Selection};
use kvpack::io::safetensors;
use kvpack::metrics::{self, ErrorSums};
use kvpack::view::{CacheView, TensorView};
use kvpack::{DType, Kind};
use serde_json::json;

use crate::output;

/// Check every checksum and structural rule of a .kvpack file and decode
/// every page. With --against, compare with the original safetensors per
/// layer and K/V (relative MSE, SNR, cosine, max abs error) and, when the
/// original carries queries.{layer} tensors, the relative error of the
/// attention outputs softmax(q K^T * scale) V (scale from the metadata key
/// kvpack.attn_scale, else 1/sqrt(head_dim)). Exit 0 when everything holds,
/// 1 when verification fails, 2 for bad usage or unreadable input.
#[derive(ClapArgs, Debug)]
pub struct Args {
    /// The .kvpack file, or - for stdin.
    pub file: String,
    /// The original safetensors cache to compare against.
    #[arg(long, value_name = "ORIG.safetensors")]
    pub against: Option<String>,
    /// Fail when any tensor's mean cosine with the original is below this
    /// (or not a number). The default 0.5 passes every shipped codec on
    /// real caches (plain int2 is the lowest, about 0.6 on the committed
    /// Gemma fixture) and fails garbage (cosine near 0); 0 disables it.
    #[arg(long, value_name = "C", default_value_t = 0.5)]
    pub min_cosine: f64,
    /// Fail when any layer's attention-output relative error exceeds this.
    #[arg(long, value_name = "E")]
    pub max_attn_err: Option<f64>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// The original cache of `--against`: its K/V tensors borrowed from the
/// mapped file when possible, and its queries.
struct Original<'a> {
    cache: CacheView<'a>,
    queries: Vec<safetensors::Queries>,
}

/// An owned copy of a borrowed tensor (for the attention check, one layer
/// at a time).
fn owned(v: &TensorView<'_>) -> Tensor {
    let mut data = TensorData::zeros(v.info.dtype, v.info.elements() as usize);
    v.gather(0, v.info.tokens as usize, &mut data);
    Tensor {
        info: v.info.clone(),
        data,
    }
}

pub fn run(a: Args) -> Result<u8> {
    let input = output::open_kvpack(&a.file)?;
    let orig_bytes = a.against.as_deref().map(output::open_any).transpose()?;
    let orig_owned;
    let original = match (&a.against, &orig_bytes) {
        (Some(p), Some(b)) => Some(match safetensors::parse_view(b, p) {
            Ok(v) => Original {
                cache: v.cache,
                queries: v.queries,
            },
            // Elements that cannot be borrowed (misaligned) are copied.
            Err(kvpack::Error::Unsupported(_)) => {
                orig_owned = safetensors::parse(b, p)?;
                Original {
                    cache: orig_owned.cache.view(),
                    queries: orig_owned.queries.clone(),
                }
            }
            Err(e) => return Err(e.into()),
        }),
        _ => None,
    };
    let mut problems: Vec<String> = Vec::new();
    let mut report = json!({"file": a.file});
    let archive = match output::open_archive(&input) {
        Ok(ar) => Some(ar),
        Err(e) if matches!(e, kvpack::Error::Io { .. }) => return Err(e.into()),
        Err(e) => {
            problems.push(e.to_string());
            None
        }
    };
    let mut rows = Vec::new();
    let mut attn = Vec::new();
    if let Some(ar) = &archive {
        let r = ar.reader();
        report["pages"] = json!(r.index().entries.len());
        report["generation"] = json!(r.index().generation);
        report["torn_tail_bytes"] = json!(r.torn_tail());
        let elements: u64 = ar.tensors().iter().map(|t| t.elements()).sum();
        report["bits_per_element"] = json!(8.0 * r.committed_len() as f64 / elements.max(1) as f64);
        // Every page is decoded (f32) and, with --against, compared with
        // the original as it comes: a page per thread in memory.
        let selected = ar.select(&Selection::default(), Some(DType::F32));
        ar.check_output(&selected)?;
        let pairs: Vec<Option<usize>> = selected
            .iter()
            .map(|s| {
                let o = original.as_ref()?;
                let i = o
                    .cache
                    .tensors
                    .iter()
                    .position(|t| t.info.name == s.info.name);
                if let Some(i) = i
                    && o.cache.tensors[i].info.shape() != s.info.shape()
                {
                    return None; // reported below
                }
                i
            })
            .collect();
        let sums: Vec<Mutex<ErrorSums>> = selected.iter().map(|_| Mutex::default()).collect();
        let compare = |at: usize, p: &Piece<'_>| {
            let (Some(o), Some(i)) = (&original, pairs[at]) else {
                return;
            };
            let view = &o.cache.tensors[i];
            let d = view.info.head_dim as usize;
            let n = p.tokens as usize;
            let (mut x, mut y) = (vec![0f32; n * d], vec![0f32; n * d]);
            let mut local = ErrorSums::default();
            for plane in 0..view.info.planes() {
                let t0 = p.token as usize;
                match view.plane_rows(plane, t0, n) {
                    Some(rows) => {
                        rows.load(0, &mut x);
                        if let Some(b) = &orig_bytes {
                            b.release_slice(rows.bytes());
                        }
                    }
                    None => {
                        for (t, row) in x.chunks_exact_mut(d).enumerate() {
                            view.load_row(plane, t0 + t, row);
                        }
                    }
                }
                p.elems.load(plane * n * d, &mut y);
                local.add(&x, &y, d);
            }
            sums[at].lock().expect("lock").merge(&local);
        };
        // The attention check needs a layer's whole K and V: where the
        // original has queries, pages are decoded a layer at a time and
        // that layer is kept (one layer in memory); otherwise in one pass.
        let queries: Vec<&safetensors::Queries> =
            original.iter().flat_map(|o| &o.queries).collect();
        let mut groups: Vec<std::ops::Range<usize>> = Vec::new();
        for (k, s) in selected.iter().enumerate() {
            match groups.last_mut() {
                Some(g) if queries.is_empty() || selected[g.start].info.layer == s.info.layer => {
                    g.end = k + 1;
                }
                _ => groups.push(k..k + 1),
            }
        }
        let mut decoded_all = true;
        for g in groups {
            let group = &selected[g.clone()];
            let layer = group[0].info.layer;
            let layer_queries: Vec<_> = queries.iter().filter(|q| q.layer == layer).collect();
            let kept: Vec<Mutex<Option<TensorData>>> = group
                .iter()
                .map(|s| {
                    Mutex::new(
                        (!layer_queries.is_empty())
                            .then(|| TensorData::zeros(DType::F32, s.info.elements() as usize)),
                    )
                })
                .collect();
            let sink = |p: Piece<'_>| -> kvpack::Result<()> {
                compare(g.start + p.output, &p);
                if let Some(t) = kept[p.output].lock().expect("lock").as_mut() {
                    let info = &group[p.output].info;
                    let (d, n) = (info.head_dim as usize, p.tokens as usize);
                    let mut row = vec![0f32; n * d];
                    for plane in 0..info.planes() {
                        p.elems.load(plane * n * d, &mut row);
                        let at = (plane * info.tokens as usize + p.token as usize) * d;
                        t.as_elems_mut().store(at, &row);
                    }
                }
                Ok(())
            };
            if let Err(e) = ar.decode_pieces(group, None, &sink) {
                problems.push(e.to_string());
                decoded_all = false;
                break;
            }
            let (Some(orig), false) = (&original, layer_queries.is_empty()) else {
                continue;
            };
            let dec = |kind: Kind| {
                let k = group.iter().position(|s| s.info.kind == kind)?;
                let data = kept[k].lock().expect("lock").take()?;
                Some(Tensor {
                    info: group[k].info.clone(),
                    data,
                })
            };
            let find = |kind: Kind| {
                orig.cache
                    .tensors
                    .iter()
                    .find(|t| t.info.layer == layer && t.info.kind == kind)
            };
            let (Some(k), Some(v), Some(k2), Some(v2)) = (
                find(Kind::Key),
                find(Kind::Value),
                dec(Kind::Key),
                dec(Kind::Value),
            ) else {
                continue;
            };
            let (k, v) = (owned(k), owned(v));
            let meta_scale = orig
                .cache
                .metadata
                .get(safetensors::ATTN_SCALE_KEY)
                .and_then(|s| s.parse::<f64>().ok())
                // A scale that is not a positive number: the default.
                .filter(|s| s.is_finite() && *s > 0.0);
            let scale = meta_scale.unwrap_or(1.0 / f64::from(k.info.head_dim).sqrt());
            for q in layer_queries {
                match metrics::attention_error(q, &k, &v, &k2, &v2, scale) {
                    Ok(e) => {
                        if let Some(m) = a.max_attn_err
                            && e > m
                        {
                            problems.push(format!(
                                "layer {}: attention error {e:.6} above {m}",
                                q.layer
                            ));
                        }
                        attn.push((q.layer, e));
                    }
                    Err(e) => problems.push(e.to_string()),
                }
            }
        }
        if decoded_all && let Some(orig) = &original {
            for (k, s) in selected.iter().enumerate() {
                let Some(i) = pairs[k] else {
                    if let Some(t) = orig
                        .cache
                        .tensors
                        .iter()
                        .find(|t| t.info.name == s.info.name)
                    {
                        problems.push(format!(
                            "{}: original shape {:?} vs decoded {:?}",
                            s.info.name,
                            t.info.shape(),
                            s.info.shape()
                        ));
                    }
                    continue;
                };
                let m = sums[k].lock().expect("lock").finish();
                let c = a.min_cosine;
                // A bit-identical tensor passes (a raw file of a cache
                // holding NaN or inf has a NaN cosine).
                if c > 0.0 && !m.identical && (m.cosine.is_nan() || m.cosine < c) {
                    problems.push(format!(
                        "{}: cosine {:.6} below {c}",
                        orig.cache.tensors[i].info.name, m.cosine
                    ));
                }
                rows.push((s.info.layer, s.info.kind, m));
            }
            for o in &orig.cache.tensors {
                if !selected.iter().any(|s| s.info.name == o.info.name) {
                    problems.push(format!(
                        "{} is in the original but not in {}",
                        o.info.name, a.file
                    ));
                }
            }
            if selected.len() != orig.cache.tensors.len() {
                problems.push(format!(
                    "{} has {} tensors, the original {}",
                    a.file,
                    selected.len(),
                    orig.cache.tensors.len()
                ));
            }
        }
    }
    // Asked for, but nothing to measure it on (and nothing else wrong).
    if let Some(m) = a.max_attn_err
        && original.is_some()
        && attn.is_empty()
        && problems.is_empty()
    {
        problems.push(format!(
            "--max-attn-err {m}: no attention error was measured (the original has no \
             queries.{{layer}} tensors for the decoded layers)"
        ));
    }
    let ok = problems.is_empty();
    let mean = |kind: kvpack::Kind, f: fn(&metrics::TensorError) -> f64| {
        let v: Vec<f64> = rows
            .iter()
            .filter(|r| r.1 == kind)
            .map(|r| f(&r.2))
            .collect();
        if v.is_empty() {
            f64::NAN
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    };
    let attn_mean = if attn.is_empty() {
        f64::NAN
    } else {
        attn.iter().map(|a| a.1).sum::<f64>() / attn.len() as f64
    };
    if a.json {
        report["ok"] = json!(ok);
        report["problems"] = json!(problems);
        if original.is_some() {
            report["tensors"] = json!(rows
                .iter()
                .map(|(l, k, m)| json!({"layer": l, "kind": k.letter(), "rel_mse": m.rel_mse, "snr_db": m.snr_db, "cosine": m.cosine, "min_cosine": m.min_cosine, "max_abs_err": m.max_abs_err}))
                .collect::<Vec<_>>());
            report["attention"] = json!(
                attn.iter()
                    .map(|(l, e)| json!({"layer": l, "rel_err": e}))
                    .collect::<Vec<_>>()
            );
            report["summary"] = json!({
                "k_rel_mse": mean(Kind::Key, |m| m.rel_mse), "v_rel_mse": mean(Kind::Value, |m| m.rel_mse),
                "k_snr_db": mean(Kind::Key, |m| m.snr_db), "v_snr_db": mean(Kind::Value, |m| m.snr_db),
                "k_cosine": mean(Kind::Key, |m| m.cosine), "v_cosine": mean(Kind::Value, |m| m.cosine),
                "latent_rel_mse": mean(Kind::Latent, |m| m.rel_mse), "latent_snr_db": mean(Kind::Latent, |m| m.snr_db),
                "latent_cosine": mean(Kind::Latent, |m| m.cosine),
                "attention_rel_err": attn_mean,
            });
        }
        output::print_json(&report, false);
    } else {
        if let Some(ar) = &archive {
            let r = ar.reader();
            println!(
                "{}: {} pages, {} commit(s), {:.3} bits/element",
                a.file,
                r.index().entries.len(),
                r.index().generation + 1,
                report["bits_per_element"].as_f64().unwrap_or(0.0)
            );
            if r.torn_tail() > 0 {
                println!(
                    "  note: {} bytes after the last commit belong to an interrupted append and are ignored",
                    r.torn_tail()
                );
            }
        }
        if original.is_some() && !rows.is_empty() {
            println!(
                "  {:>5} {:>2} {:>11} {:>8} {:>9} {:>10} {:>10}",
                "layer", "", "rel MSE", "SNR dB", "cosine", "max |err|", "attn err"
            );
            for (l, k, m) in &rows {
                let att = if *k == Kind::Value {
                    attn.iter()
                        .find(|x| x.0 == *l)
                        .map(|x| format!("{:.5}", x.1))
                        .unwrap_or_default()
                } else {
                    String::new()
                };
                println!(
                    "  {:>5} {:>2} {:>11.4e} {:>8.2} {:>9.6} {:>10.4} {:>10}",
                    l,
                    k.letter(),
                    m.rel_mse,
                    m.snr_db,
                    m.cosine,
                    m.max_abs_err,
                    att
                );
            }
            if rows.iter().any(|r| r.1 == Kind::Latent) {
                println!(
                    "  mean: latent cos {:.6} SNR {:.2} dB",
                    mean(Kind::Latent, |m| m.cosine),
                    mean(Kind::Latent, |m| m.snr_db),
                );
            }
            if rows.iter().any(|r| r.1 != Kind::Latent) {
                println!(
                    "  mean: K cos {:.6} SNR {:.2} dB | V cos {:.6} SNR {:.2} dB | attention rel err {}",
                    mean(Kind::Key, |m| m.cosine),
                    mean(Kind::Key, |m| m.snr_db),
                    mean(Kind::Value, |m| m.cosine),
                    mean(Kind::Value, |m| m.snr_db),
                    if attn.is_empty() {
                        "- (no queries)".to_string()
                    } else {
                        format!("{attn_mean:.5}")
                    }
                );
            }
        }
        for p in &problems {
            println!("  FAILED: {p}");
        }
        println!("{}", if ok { "verify: OK" } else { "verify: FAILED" });
    }
    Ok(if ok {
        crate::EXIT_OK
    } else {
        crate::EXIT_VERIFY_FAILED
    })
}
