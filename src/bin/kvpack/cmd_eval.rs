//! `kvpack eval`.

use anyhow::Result;
use clap::Args as ClapArgs;
use kvpack::eval::evaluate;
use kvpack::io::{file, safetensors};

use crate::output;

/// Compare codecs on a real cache: for each codec, compress in memory,
/// decode, and report bits/element (everything included), K/V relative MSE,
/// SNR and cosine, and the attention-output error with the cache's
/// queries.{layer} tensors (when present).
#[derive(ClapArgs, Debug)]
pub struct Args {
    /// A safetensors KV cache (as for `compress`).
    pub input: String,
    /// Comma-separated codecs to compare.
    #[arg(
        long,
        short = 'c',
        default_value = "int4,bdr128",
        value_delimiter = ','
    )]
    pub codec: Vec<String>,
    #[command(flatten)]
    pub layout: output::LayoutArgs,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: Args) -> Result<u8> {
    let bytes = file::open_input(&a.input)?;
    let loaded = safetensors::parse(&bytes, &a.input)?;
    let mut rows = Vec::new();
    for name in &a.codec {
        let codec = kvpack::codec::parse(name)?;
        let opts = a
            .layout
            .options(codec.as_ref(), kvpack::format::DEFAULT_ALIGN_LOG2);
        rows.push(evaluate(&loaded, codec.as_ref(), &opts)?);
    }
    if a.json {
        output::print_json(&serde_json::to_value(&rows)?, false);
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
