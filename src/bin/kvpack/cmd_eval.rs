//! `kvpack eval`.

use anyhow::Result;
use clap::Args as ClapArgs;
use kvpack::eval::evaluate;
use kvpack::eval::synthetic::{self, Config};
use kvpack::io::safetensors;

use crate::output;

/// Compare codecs on a real cache: for each codec, compress in memory,
/// decode, and report bits/element (everything included), K/V relative MSE,
/// SNR and cosine, and the attention-output error with the cache's
/// queries.{layer} tensors (when present).
///
/// With --synthetic, reproduce the OCTOPUS paper's synthetic tables instead
/// (Table 1: Gaussian keys and queries, d=128; Table 5: scalar vs 3x3
/// rounding and the 3x3 = full-search check; Table 4: bit-split sweep).
#[derive(ClapArgs, Debug)]
pub struct Args {
    /// A safetensors KV cache (as for `compress`).
    #[arg(required_unless_present = "synthetic")]
    pub input: Option<String>,
    /// Run the OCTOPUS paper's synthetic oracles instead of a real cache.
    #[arg(long, conflicts_with = "input")]
    pub synthetic: bool,
    /// --synthetic: seeds for Table 1.
    #[arg(long, default_value_t = 64, value_name = "N", requires = "synthetic",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub seeds: u64,
    /// --synthetic: keys per seed for Table 1.
    #[arg(long, default_value_t = 1024, value_name = "N", requires = "synthetic",
          value_parser = parse_keys)]
    pub keys: usize,
    /// --synthetic: Table 1 only (skip the slower Tables 4 and 5).
    #[arg(long, requires = "synthetic")]
    pub table1_only: bool,
    /// Comma-separated codecs to compare [default: int4 and bdr with the
    /// largest Walsh-Hadamard block, at most 128, that divides every
    /// head_dim of the cache: bdr128 for head_dims 128 and 256, bdr32 for
    /// 96].
    #[arg(long, short = 'c', value_delimiter = ',')]
    pub codec: Option<Vec<String>>,
    #[command(flatten)]
    pub layout: output::LayoutArgs,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also draw the rate-distortion report into this .png or .svg: bits
    /// per element against the planner's attention-output distortion for
    /// every candidate codec of the planner (no windows) and for the
    /// planner (`compress --bits`) at 2.5, 3, 3.25, 3.5, 4, 4.25 and 5
    /// bits; with --json the points are printed too.
    #[arg(long, value_name = "FILE", conflicts_with = "synthetic")]
    pub plot: Option<std::path::PathBuf>,
    /// Overwrite the --plot file if it exists.
    #[arg(long, short = 'f')]
    pub force: bool,
}

/// `int4` and the `bdr{h}` whose block `h` (a power of two, at most 128)
/// divides every head_dim of `cache` (none for an odd head_dim).
fn default_codecs(cache: &kvpack::KvCache) -> Vec<String> {
    let tz = cache
        .tensors
        .iter()
        .map(|t| t.info.head_dim.trailing_zeros())
        .min()
        .unwrap_or(7)
        .min(7);
    let mut names = vec!["int4".to_string()];
    if tz >= 1 {
        names.push(format!("bdr{}", 1u32 << tz));
    }
    names
}

/// `--keys`: at least 1.
fn parse_keys(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("{s} is not a key count of at least 1")),
    }
}

pub fn run(a: Args) -> Result<u8> {
    if a.synthetic {
        return run_synthetic(&a);
    }
    let input = a.input.as_deref().unwrap_or_default();
    let bytes = crate::output::open_any(input)?;
    let loaded = safetensors::parse(&bytes, input)?;
    let names = a
        .codec
        .clone()
        .unwrap_or_else(|| default_codecs(&loaded.cache));
    let mut rows = Vec::new();
    for name in &names {
        let codec = kvpack::codec::parse(name)?;
        let opts = a
            .layout
            .options(codec.as_ref(), kvpack::format::DEFAULT_ALIGN_LOG2);
        rows.push(evaluate(&loaded, codec.as_ref(), &opts)?);
    }
    if let Some(path) = &a.plot {
        if path.exists() && !a.force {
            anyhow::bail!("{} exists (pass --force to replace it)", path.display());
        }
        let opts = a.layout.options(
            kvpack::codec::parse("raw")?.as_ref(),
            kvpack::format::DEFAULT_ALIGN_LOG2,
        );
        let view = loaded.cache.view();
        let uniform = kvpack::budget::uniform_points(&view, &opts)?;
        let plans = kvpack::budget::plan_points(&view, kvpack::budget::REPORT_BUDGETS, &opts)?;
        let model = loaded
            .cache
            .metadata
            .get("kvpack.model")
            .cloned()
            .unwrap_or_else(|| input.to_string());
        crate::plot::rate_distortion(
            path,
            &format!("rate-distortion: {model}"),
            &uniform,
            &plans,
            a.force,
        )?;
        if a.json {
            let v = serde_json::json!({"codecs": rows, "uniform": uniform, "planner": plans});
            output::print_json(&v, false);
            return Ok(crate::EXIT_OK);
        }
        eprintln!("wrote {}", path.display());
    }
    if a.json {
        output::print_json(&serde_json::to_value(&rows)?, false);
        return Ok(crate::EXIT_OK);
    }
    if rows.iter().any(|r| r.latent.is_some()) {
        // An MLA cache: one latent per layer, no K/V, no attention check.
        println!(
            "{:<18} {:>9} {:>10} {:>7} {:>9}",
            "codec", "bits/elem", "L relMSE", "L SNR", "L cos"
        );
        for r in &rows {
            let l = r.latent.unwrap_or_default();
            println!(
                "{:<18} {:>9.3} {:>10.3e} {:>7.2} {:>9.5}",
                r.codec, r.bits_per_element, l.rel_mse, l.snr_db, l.cosine
            );
        }
        return Ok(crate::EXIT_OK);
    }
    println!(
        "{:<18} {:>9} {:>10} {:>10} {:>7} {:>7} {:>9} {:>9} {:>9}",
        "codec",
        "bits/elem",
        "K relMSE",
        "V relMSE",
        "K SNR",
        "V SNR",
        "K cos",
        "V cos",
        "attn err"
    );
    for r in &rows {
        println!(
            "{:<18} {:>9.3} {:>10.3e} {:>10.3e} {:>7.2} {:>7.2} {:>9.5} {:>9.5} {:>9}",
            r.codec,
            r.bits_per_element,
            r.k.rel_mse,
            r.v.rel_mse,
            r.k.snr_db,
            r.v.snr_db,
            r.k.cosine,
            r.v.cosine,
            r.attention
                .map(|a| format!("{a:.4}"))
                .unwrap_or_else(|| "-".into())
        );
    }
    Ok(crate::EXIT_OK)
}

fn pct(x: f64, reference: f64) -> String {
    format!("{:+.1}%", 100.0 * (x / reference - 1.0))
}

fn print_rows(rows: &[synthetic::Row]) {
    println!(
        "{:>2} {:<16} {:<22} {:>6} {:>7} {:>7} {:>7} {:>8} | {:>6} {:>7} {:>6} {:>7} {:>7}",
        "b",
        "codec",
        "kvpack name",
        "bits",
        "cos",
        "MSE",
        "IP err",
        "dec MSE",
        "paper",
        "cos",
        "MSE",
        "dcos",
        "dMSE"
    );
    for r in rows {
        let m = &r.measured;
        let paper = match r.paper {
            Some(((c, e, i), src)) => format!(
                "{:>6} {:>7.4} {:>6.4} {:>7} {:>7}  (IP {i:.3}, {})",
                "",
                c,
                e,
                pct(m.cosine, c),
                pct(m.mse, e),
                src
            ),
            None => String::new(),
        };
        println!(
            "{:>2} {:<16} {:<22} {:>6.3} {:>7.4} {:>7.4} {:>7.3} {:>8.4} |{paper}",
            r.bits,
            r.label,
            r.codec,
            r.bits_per_element,
            m.cosine,
            m.mse,
            m.ip_abs_err,
            m.decoded_mse
        );
    }
}

fn run_synthetic(a: &Args) -> Result<u8> {
    let cfg1 = Config {
        seeds: a.seeds,
        keys: a.keys,
        ..Config::TABLE1
    };
    let bits = [2u8, 3, 4];
    let t1 = synthetic::table1(cfg1, &bits)?;
    let (t5, same, t4) = if a.table1_only {
        (Vec::new(), Vec::new(), Vec::new())
    } else {
        (
            synthetic::table5(Config::TABLE5, &bits)?,
            synthetic::local_equals_full(128, 10_000, &[2, 3, 4, 5])?,
            synthetic::table4(Config::TABLE4, &bits)?,
        )
    };
    if a.json {
        let same: Vec<_> = same
            .iter()
            .map(|&(b, s, n)| serde_json::json!({"b_dir": b, "identical": s, "triplets": n}))
            .collect();
        output::print_json(
            &serde_json::json!({"table1": t1, "table5": t5, "local_equals_full": same, "table4": t4}),
            false,
        );
        return Ok(crate::EXIT_OK);
    }
    println!(
        "Table 1: isotropic Gaussian keys/queries, d={}, {} keys x {} queries, {} seeds; \
         MSE per coordinate (= unit-vector MSE summed over coordinates), IP err = mean |q.k - score|",
        cfg1.dim, cfg1.keys, cfg1.queries, cfg1.seeds
    );
    println!(
        "QJL rows: cos/MSE of the MSE stage (paper convention); dec MSE = kvpack's decoded keys (residual estimate added)\n"
    );
    print_rows(&t1);
    if a.table1_only {
        return Ok(crate::EXIT_OK);
    }
    let c5 = Config::TABLE5;
    println!(
        "\nTable 5: rounding ablation, d={}, {} keys x {} queries, {} seeds\n",
        c5.dim, c5.keys, c5.queries, c5.seeds
    );
    print_rows(&t5);
    println!(
        "\nTable 5: local 3x3 vs full direction search, 10^4 rotated Gaussian triplets, d=128"
    );
    for (b, s, n) in &same {
        println!("  b_dir {b}: {s} / {n} triplets byte-identical");
    }
    let c4 = Config::TABLE4;
    println!(
        "\nTable 4: diagonal bit-split sweep (b+delta, b-delta), local 3x3, d={}, {} keys, {} seeds\n",
        c4.dim, c4.keys, c4.seeds
    );
    println!(
        "{:>2} {:>5} {:>5} {:>6} {:>8} {:>8} {:>9} | {:>8} {:>8} {:>9}",
        "b", "delta", "b_dir", "b_norm", "MSE", "1-cos", "dMSE(b,b)", "paper", "1-cos", "dMSE(b,b)"
    );
    for r in &t4 {
        let uniform = t4
            .iter()
            .find(|x| x.bits == r.bits && x.delta == 0)
            .and_then(|x| x.paper);
        let paper = match (r.paper, uniform) {
            (Some((m, c)), Some((u, _))) => {
                format!("{m:>8.4} {c:>8.4} {:>9}", pct(m, u))
            }
            _ => String::new(),
        };
        println!(
            "{:>2} {:>+5} {:>5} {:>6} {:>8.4} {:>8.4} {:>+8.1}% | {paper}",
            r.bits, r.delta, r.dir, r.norm, r.mse, r.one_minus_cos, r.delta_mse_pct
        );
    }
    Ok(crate::EXIT_OK)
}
