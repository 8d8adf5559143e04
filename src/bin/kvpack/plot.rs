//! The rate-distortion plot of `kvpack eval --plot` (plotters): bits per
//! element against the planner's distortion, one marker series per codec
//! family, the planner as a line. Both `.svg` and `.png` lay their text out
//! with a TrueType font found on the system (or `$KVPACK_FONT`); without one
//! the command fails with exit 2 and says so, before writing anything.

use std::path::Path;

use anyhow::{Context, Result, bail};
use kvpack::budget::{PlanPoint, UniformPoint};
use plotters::prelude::*;

/// Fonts tried for the plot's text, after `$KVPACK_FONT`.
const FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/Library/Fonts/Arial.ttf",
    "C:\\Windows\\Fonts\\arial.ttf",
];

fn register_font() -> Result<()> {
    let env = std::env::var("KVPACK_FONT").ok();
    let candidates = env.iter().map(String::as_str).chain(FONTS.iter().copied());
    for path in candidates {
        if let Ok(bytes) = std::fs::read(path) {
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                return Ok(());
            }
        }
    }
    bail!(
        "no TrueType font found for the plot's text (tried $KVPACK_FONT and {}; set KVPACK_FONT=/path/to/font.ttf)",
        FONTS.join(", ")
    )
}

/// Family of a codec name: `hqmq:s24r3` -> `hqmq`, `bdr128:b3` -> `bdr`.
fn family(name: &str) -> String {
    let head = name.split(':').next().unwrap_or(name);
    head.trim_end_matches(|c: char| c.is_ascii_digit())
        .to_string()
}

/// Draws the plot into `path` (`.png` or `.svg`), `title` on top. The plot
/// is rendered into a scratch directory next to `path` and then written
/// atomically; an existing `path` is replaced only with `force`.
pub fn rate_distortion(
    path: &Path,
    title: &str,
    uniform: &[UniformPoint],
    plans: &[PlanPoint],
    force: bool,
) -> Result<()> {
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
        .to_ascii_lowercase();
    if ext != "svg" && ext != "png" {
        bail!(
            "--plot {}: the file must end in .png or .svg",
            path.display()
        );
    }
    register_font()?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let scratch = tempfile::Builder::new()
        .prefix(".kvpack-plot-")
        .tempdir_in(dir)
        .with_context(|| format!("creating a scratch directory in {}", dir.display()))?;
    let drawn = scratch.path().join(format!("plot.{ext}"));
    if ext == "svg" {
        draw(
            SVGBackend::new(&drawn, (960, 640)).into_drawing_area(),
            title,
            uniform,
            plans,
        )
    } else {
        draw(
            BitMapBackend::new(&drawn, (960, 640)).into_drawing_area(),
            title,
            uniform,
            plans,
        )
    }
    .with_context(|| format!("drawing {}", path.display()))?;
    let bytes = std::fs::read(&drawn).with_context(|| format!("reading {}", drawn.display()))?;
    kvpack::io::file::write_atomic(path, force, |w| {
        w.write_all(&bytes)
            .map_err(|e| kvpack::Error::io(format!("writing {}", path.display()), e))
    })?;
    Ok(())
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    uniform: &[UniformPoint],
    plans: &[PlanPoint],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow::anyhow!("{e:?}");
    root.fill(&WHITE).map_err(err)?;
    let pos: Vec<f64> = uniform
        .iter()
        .map(|p| p.distortion)
        .chain(plans.iter().map(|p| p.distortion))
        .filter(|d| *d > 0.0)
        .collect();
    let (dmin, dmax) = pos
        .iter()
        .fold((f64::INFINITY, 0.0f64), |(a, b), &d| (a.min(d), b.max(d)));
    if pos.is_empty() {
        bail!("nothing to plot");
    }
    let xmax = uniform
        .iter()
        .map(|p| p.bits)
        .chain(plans.iter().map(|p| p.bits))
        .filter(|b| *b < 9.0)
        .fold(2.0f64, f64::max)
        + 0.5;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(1.5f64..xmax, (dmin * 0.7..dmax * 1.5).log_scale())
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("bits per element, everything counted")
        .y_desc("attention-output distortion (planner's measure)")
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(err)?;
    let mut families: Vec<String> = uniform.iter().map(|p| family(&p.codec)).collect();
    families.dedup();
    families.sort();
    families.dedup();
    for (i, f) in families.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let pts: Vec<(f64, f64)> = uniform
            .iter()
            .filter(|p| &family(&p.codec) == f && p.distortion > 0.0 && p.bits < xmax)
            .map(|p| (p.bits, p.distortion))
            .collect();
        chart
            .draw_series(
                pts.iter()
                    .map(|&(x, y)| Circle::new((x, y), 5, color.filled())),
            )
            .map_err(err)?
            .label(f.as_str())
            .legend(move |(x, y)| Circle::new((x, y), 5, color.filled()));
        chart
            .draw_series(
                uniform
                    .iter()
                    .filter(|p| &family(&p.codec) == f && p.distortion > 0.0 && p.bits < xmax)
                    .map(|p| {
                        Text::new(
                            p.codec.clone(),
                            (p.bits, p.distortion),
                            ("sans-serif", 11).into_font().color(&BLACK.mix(0.6)),
                        )
                    }),
            )
            .map_err(err)?;
    }
    let line: Vec<(f64, f64)> = plans.iter().map(|p| (p.bits, p.distortion)).collect();
    chart
        .draw_series(LineSeries::new(line.clone(), BLACK.stroke_width(2)))
        .map_err(err)?
        .label("planner (--bits)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], BLACK.stroke_width(2)));
    chart
        .draw_series(
            line.iter()
                .map(|&(x, y)| TriangleMarker::new((x, y), 7, BLACK.filled())),
        )
        .map_err(err)?;
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::family;

    #[test]
    fn families() {
        assert_eq!(family("hqmq:s24r3"), "hqmq");
        assert_eq!(family("bdr128:b3"), "bdr");
        assert_eq!(family("int8"), "int");
        assert_eq!(family("raw"), "raw");
    }
}
