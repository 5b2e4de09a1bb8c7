//! `hemi plot METRICS.jsonl... --out DIR`: PNG charts of runs from their `--metrics` files.
//!
//! - `curves.png`: train and test loss, and test accuracy, per epoch; several runs overlaid
//!   (fp32 against amp-fp16 against amp-bf16).
//! - `scale.png`: the loss scale and the skipped steps over the optimizer steps.
//! - `grad_hist.png` (runs with `--grad-stats`): the histogram of `log2 |g|` of the unscaled
//!   gradients against the range F16 holds without loss scaling and with the run's scale,
//!   BF16's limits, and the same per parameter: the picture that shows why loss scaling exists
//!   (Micikevicius et al. 2018, figure 3).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use clap::Args;
use plotters::coord::Shift;
use plotters::prelude::*;
use serde_json::Value;

use hemi::train::Log2Histogram;
use hemi::{Error, Result};

#[derive(Args)]
pub struct PlotArgs {
    /// Metrics files written by `hemi train --metrics FILE` (JSON lines), one per run.
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Directory for the PNG files (created if needed).
    #[arg(long, default_value = "plots")]
    out: PathBuf,
    /// Names of the runs in the legends, comma-separated (default: each file's name and
    /// precision).
    #[arg(long, value_delimiter = ',')]
    labels: Vec<String>,
    /// The run whose gradient histogram is drawn (0-based position among the files; default:
    /// the first with --grad-stats records).
    #[arg(long)]
    grad_run: Option<usize>,
    /// The epoch whose gradient histogram is drawn (default: the last recorded).
    #[arg(long)]
    grad_epoch: Option<usize>,
}

/// One epoch's line of a metrics file.
#[derive(Clone, Debug, Default)]
struct EpochPoint {
    train_loss: Option<f64>,
    test_loss: Option<f64>,
    test_accuracy: Option<f64>,
}

/// One step line.
#[derive(Clone, Copy, Debug)]
struct StepPoint {
    scale: f64,
    skipped: f64,
}

/// One parameter's gradient histogram of an epoch.
#[derive(Clone, Debug)]
struct LayerHist {
    name: String,
    hist: Log2Histogram,
}

#[derive(Clone, Debug)]
struct GradRecord {
    epoch: usize,
    scale: f64,
    layers: Vec<LayerHist>,
}

/// A run read from its metrics file. A resumed run appends to the file, so a point written
/// twice (an epoch redone after a crash) keeps its last value.
#[derive(Debug, Default)]
struct Run {
    label: String,
    epochs: BTreeMap<usize, EpochPoint>,
    steps: BTreeMap<u64, StepPoint>,
    grads: BTreeMap<usize, GradRecord>,
}

fn num(v: &Value, key: &str) -> Option<f64> {
    v.get(key).and_then(Value::as_f64)
}

fn bad_line(path: &Path, line: usize, why: &str) -> Error {
    Error::Msg(format!("{}, line {line}: {why}", path.display()))
}

fn read_run(path: &Path) -> Result<Run> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.display().to_string(),
        source,
    })?;
    let mut run = Run::default();
    let mut precision = None;
    // Steps per epoch, for step lines written before `global_step` existed.
    let mut per_epoch = 0u64;
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(line)
            .map_err(|e| bad_line(path, n, &format!("not JSON ({e})")))?;
        let epoch = || {
            v.get("epoch")
                .and_then(Value::as_u64)
                .map(|e| e as usize)
                .ok_or_else(|| bad_line(path, n, "no \"epoch\""))
        };
        match v.get("kind").and_then(Value::as_str) {
            Some("epoch") => {
                if let Some(p) = v.get("precision").and_then(Value::as_str) {
                    precision = Some(p.to_string());
                }
                run.epochs.insert(
                    epoch()?,
                    EpochPoint {
                        train_loss: num(&v, "train_loss"),
                        test_loss: num(&v, "test_loss"),
                        test_accuracy: num(&v, "test_accuracy"),
                    },
                );
            }
            Some("step") => {
                let step = v.get("step").and_then(Value::as_u64).unwrap_or(0);
                per_epoch = per_epoch.max(step);
                let global = match v.get("global_step").and_then(Value::as_u64) {
                    Some(g) => g,
                    None => (epoch()? as u64 - 1) * per_epoch + step,
                };
                if let (Some(scale), Some(skipped)) = (num(&v, "scale"), num(&v, "skipped")) {
                    run.steps.insert(global, StepPoint { scale, skipped });
                }
            }
            Some("grad_stats") => {
                let layers = v
                    .get("layers")
                    .and_then(Value::as_array)
                    .ok_or_else(|| bad_line(path, n, "grad_stats without \"layers\""))?
                    .iter()
                    .map(|l| {
                        let mut hist = Log2Histogram::default();
                        let e_lo = l.get("e_lo").and_then(Value::as_i64).unwrap_or(0);
                        let counts = l.get("counts").and_then(Value::as_array);
                        for (k, c) in counts.into_iter().flatten().enumerate() {
                            let bin =
                                usize::try_from(e_lo + k as i64 - i64::from(Log2Histogram::E_MIN))
                                    .ok()
                                    .filter(|&b| b < Log2Histogram::BINS)
                                    .ok_or_else(|| {
                                        bad_line(path, n, "a binade outside F32's range")
                                    })?;
                            hist.counts[bin] = c.as_u64().unwrap_or(0);
                        }
                        hist.zeros = l.get("zeros").and_then(Value::as_u64).unwrap_or(0);
                        hist.nonfinite = l.get("nonfinite").and_then(Value::as_u64).unwrap_or(0);
                        Ok(LayerHist {
                            name: l.get("name").and_then(Value::as_str).unwrap_or("?").into(),
                            hist,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                let e = epoch()?;
                run.grads.insert(
                    e,
                    GradRecord {
                        epoch: e,
                        scale: num(&v, "scale").unwrap_or(1.0),
                        layers,
                    },
                );
            }
            // Lines of other kinds (or from later versions) are not drawn.
            _ => {}
        }
    }
    if run.epochs.is_empty() && run.steps.is_empty() && run.grads.is_empty() {
        return Err(Error::Msg(format!(
            "{}: no metrics lines (write them with `hemi train --metrics FILE`)",
            path.display()
        )));
    }
    let stem = path
        .file_stem()
        .map_or("run".into(), |s| s.to_string_lossy().to_string());
    run.label = match precision {
        Some(p) if !stem.contains(&p) => format!("{stem} ({p})"),
        _ => stem,
    };
    Ok(run)
}

fn draw_err<E: std::fmt::Debug>(what: &Path) -> impl Fn(E) -> Error + '_ {
    move |e| Error::Msg(format!("drawing {}: {e:?}", what.display()))
}

/// The font every chart uses, embedded (DejaVu Sans), so no system font is needed.
fn register_font() -> Result<()> {
    plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| Error::Msg("the embedded DejaVu Sans font did not load".into()))
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

fn color(i: usize) -> RGBColor {
    COLORS[i % COLORS.len()]
}

/// `lo..hi` padded by 5 % (and made non-empty).
fn padded(lo: f64, hi: f64) -> std::ops::Range<f64> {
    let (lo, hi) = if lo.is_finite() && hi.is_finite() {
        (lo, hi)
    } else {
        (0.0, 1.0)
    };
    let pad = ((hi - lo) * 0.05).max(1e-9);
    (lo - pad)..(hi + pad)
}

fn minmax(values: impl Iterator<Item = f64>) -> (f64, f64) {
    values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
            (a.min(v), b.max(v))
        })
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;

/// Writes an RGB buffer drawn by plotters as a PNG file (the `png` crate hemi already uses
/// for data sets, rather than plotters' own encoder and the `image` crate behind it).
fn save_png(path: &Path, pixels: Vec<u8>, (w, h): (u32, u32)) -> Result<()> {
    if pixels.len() as u64 != u64::from(w) * u64::from(h) * 3 {
        return Err(Error::Msg(format!(
            "{}: chart buffer of the wrong size",
            path.display()
        )));
    }
    let write = || -> std::result::Result<(), png::EncodingError> {
        let file = std::io::BufWriter::new(std::fs::File::create(path)?);
        let mut encoder = png::Encoder::new(file, w, h);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder.write_header()?;
        writer.write_image_data(&pixels)?;
        writer.finish()
    };
    write().map_err(|e| Error::Msg(format!("{}: cannot write the PNG: {e}", path.display())))
}

/// One panel of `scale.png`: area, caption, y label, y range, the value of a step.
type Panel<'a, 'b> = (
    &'b Area<'a>,
    &'static str,
    &'static str,
    std::ops::Range<f64>,
    fn(&StepPoint) -> f64,
);

/// Axis labels only at whole numbers (epochs, steps, binades): a short axis would otherwise
/// print the same rounded number at several ticks.
fn whole(x: f64, f: impl Fn(i64) -> String) -> String {
    if (x - x.round()).abs() < 1e-9 {
        f(x.round() as i64)
    } else {
        String::new()
    }
}

/// Points of a run's solid and dashed lines.
type Series<'a> = &'a dyn Fn(&Run) -> (Vec<(f64, f64)>, Vec<(f64, f64)>);

/// What a per-epoch chart shows.
struct EpochChart<'a> {
    caption: &'a str,
    y_desc: &'a str,
    series: Series<'a>,
    /// Appended to a run's label for its dashed line.
    dashed_name: &'a str,
    legend_at: SeriesLabelPosition,
}

/// A line chart of per-epoch series, every run in its colour.
fn epoch_chart(area: &Area, path: &Path, runs: &[Run], c: EpochChart) -> Result<()> {
    let EpochChart {
        caption,
        y_desc,
        series,
        dashed_name,
        legend_at,
    } = c;
    let err = draw_err(path);
    let all: Vec<(f64, f64)> = runs
        .iter()
        .flat_map(|r| {
            let (a, b) = series(r);
            a.into_iter().chain(b)
        })
        .collect();
    let (x0, x1) = minmax(all.iter().map(|p| p.0));
    let (y0, y1) = minmax(all.iter().map(|p| p.1));
    let (x0, x1) = if x0 <= x1 { (x0, x1) } else { (1.0, 1.0) };
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((x0 - 0.3)..(x1 + 0.3), padded(y0, y1))
        .map_err(&err)?;
    chart
        .configure_mesh()
        .x_desc("epoch")
        .y_desc(y_desc)
        .x_label_formatter(&|&x| whole(x, |e| e.to_string()))
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(&err)?;
    for (i, run) in runs.iter().enumerate() {
        let c = color(i);
        let (solid, dashed) = series(run);
        chart
            .draw_series(LineSeries::new(solid.clone(), c.stroke_width(2)))
            .map_err(&err)?
            .label(run.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        chart
            .draw_series(solid.iter().map(|&p| Circle::new(p, 3, c.filled())))
            .map_err(&err)?;
        if !dashed.is_empty() {
            chart
                .draw_series(DashedLineSeries::new(dashed, 6, 4, c.stroke_width(2)))
                .map_err(&err)?
                .label(format!("{} {dashed_name}", run.label))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 8, y)], c.stroke_width(2))
                });
        }
    }
    chart
        .configure_series_labels()
        .position(legend_at)
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .draw()
        .map_err(&err)?;
    Ok(())
}

fn plot_curves(runs: &[Run], path: &Path) -> Result<()> {
    let err = draw_err(path);
    let size = (1400, 560);
    let mut pixels = vec![0u8; size.0 as usize * size.1 as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut pixels, size).into_drawing_area();
        root.fill(&WHITE).map_err(&err)?;
        let (left, right) = root.split_horizontally(700);
        let pts = |r: &Run, f: fn(&EpochPoint) -> Option<f64>| -> Vec<(f64, f64)> {
            r.epochs
                .iter()
                .filter_map(|(&e, p)| Some((e as f64, f(p).filter(|v| v.is_finite())?)))
                .collect()
        };
        epoch_chart(
            &left,
            path,
            runs,
            EpochChart {
                caption: "Loss per epoch (solid: train, dashed: test)",
                y_desc: "loss",
                series: &|r| (pts(r, |p| p.train_loss), pts(r, |p| p.test_loss)),
                dashed_name: "test",
                legend_at: SeriesLabelPosition::UpperRight,
            },
        )?;
        epoch_chart(
            &right,
            path,
            runs,
            EpochChart {
                caption: "Test accuracy per epoch",
                y_desc: "test accuracy (%)",
                series: &|r| {
                    let a = pts(r, |p| p.test_accuracy.map(|a| 100.0 * a));
                    (a, Vec::new())
                },
                dashed_name: "",
                legend_at: SeriesLabelPosition::LowerRight,
            },
        )?;
        root.present().map_err(&err)?;
    }
    save_png(path, pixels, size)?;
    Ok(())
}

fn plot_scale(runs: &[Run], path: &Path) -> Result<()> {
    let err = draw_err(path);
    let size = (1400, 560);
    let mut pixels = vec![0u8; size.0 as usize * size.1 as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut pixels, size).into_drawing_area();
        root.fill(&WHITE).map_err(&err)?;
        let (left, right) = root.split_horizontally(700);
        let (x0, x1) = minmax(runs.iter().flat_map(|r| r.steps.keys().map(|&s| s as f64)));
        let (s0, s1) = minmax(runs.iter().flat_map(|r| {
            r.steps
                .values()
                .map(|p| p.scale.max(f64::MIN_POSITIVE).log2())
        }));
        let (k0, k1) = minmax(
            runs.iter()
                .flat_map(|r| r.steps.values().map(|p| p.skipped)),
        );
        let xr = padded(x0, x1);
        let panels: [Panel; 2] = [
            (
                &left,
                "Loss scale over steps",
                "loss scale",
                (s0.floor() - 1.0)..(s1.ceil() + 1.0),
                |p| p.scale.max(f64::MIN_POSITIVE).log2(),
            ),
            (
                &right,
                "Skipped steps (inf/NaN gradients), cumulative",
                "skipped steps",
                padded(k0.min(0.0), k1.max(1.0)),
                |p| p.skipped,
            ),
        ];
        for (pi, (area, caption, desc, yr, f)) in panels.into_iter().enumerate() {
            let mut chart = ChartBuilder::on(area)
                .caption(caption, ("sans-serif", 22))
                .margin(12)
                .x_label_area_size(40)
                .y_label_area_size(70)
                .build_cartesian_2d(xr.clone(), yr)
                .map_err(&err)?;
            let log_scale = pi == 0;
            chart
                .configure_mesh()
                .x_desc("optimizer step")
                .y_desc(desc)
                .x_label_formatter(&|&x| whole(x, |s| s.to_string()))
                .y_label_formatter(&|&y| {
                    whole(y, |k| {
                        if log_scale {
                            format!("2^{k}")
                        } else {
                            k.to_string()
                        }
                    })
                })
                .label_style(("sans-serif", 14))
                .draw()
                .map_err(&err)?;
            for (i, run) in runs.iter().enumerate() {
                let c = color(i);
                let pts: Vec<(f64, f64)> =
                    run.steps.iter().map(|(&s, p)| (s as f64, f(p))).collect();
                chart
                    .draw_series(LineSeries::new(pts, c.stroke_width(2)))
                    .map_err(&err)?
                    .label(run.label.clone())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                    });
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::MiddleRight)
                .label_font(("sans-serif", 14))
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK.mix(0.4))
                .draw()
                .map_err(&err)?;
        }
        root.present().map_err(&err)?;
    }
    save_png(path, pixels, size)?;
    Ok(())
}

/// F16's limits as binades of `floor(log2 |x|)`: values from 2^-24 (smallest subnormal) are
/// kept, normals start at 2^-14, and from 2^16 (above 65504) they overflow.
const F16_SUB: i32 = Log2Histogram::F16_SUBNORMAL;
const F16_NORMAL: i32 = -14;
const F16_OVER: i32 = Log2Histogram::F16_OVERFLOW;
/// BF16's: subnormals from 2^-133, normals from 2^-126, overflow from 2^128.
const BF16_SUB: i32 = -133;
const BF16_NORMAL: i32 = -126;
const BF16_OVER: i32 = 128;

fn plot_grad_hist(rec: &GradRecord, label: &str, path: &Path) -> Result<()> {
    let err = draw_err(path);
    let mut all = Log2Histogram::default();
    for l in &rec.layers {
        all.merge(&l.hist);
    }
    let total = all.total().max(1) as f64;
    let shift = rec.scale.max(f64::MIN_POSITIVE).log2().round() as i32;
    let (d0, d1) = (
        all.nonzero_bins().next().map_or(F16_SUB, |b| b.0),
        all.nonzero_bins().last().map_or(0, |b| b.0),
    );
    // Show the data and both F16 windows (unscaled and scaled), a binade of margin.
    let lo = d0.min(F16_SUB - shift).min(F16_SUB) - 2;
    let hi = (d1 + 1).max(F16_OVER - shift).max(F16_OVER) + 2;
    let layers = rec.layers.len();
    let row = 16u32;
    let top_h = 520u32;
    let height = top_h + 110 + row * layers as u32;
    let size = (1400, height);
    let mut pixels = vec![0u8; size.0 as usize * size.1 as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut pixels, size).into_drawing_area();
        root.fill(&WHITE).map_err(&err)?;
        let (top, bottom) = root.split_vertically(top_h);

        // Shares in %, on a log axis: the values F16 loses are a small share, invisible on a
        // linear one.
        let share: Vec<(i32, f64)> = all
            .nonzero_bins()
            .map(|(e, c)| (e, 100.0 * c as f64 / total))
            .collect();
        let smax = share.iter().map(|p| p.1).fold(0.0, f64::max).max(1e-9);
        let smin = share.iter().map(|p| p.1).fold(smax, f64::min);
        let (y0, y1) = (smin / 3.0, smax * 3.0);
        let caption = format!(
            "{label}, epoch {}: log2|g| of the unscaled gradients; F16 loses {:.3} % without \
             scaling, {:.3} % at scale 2^{shift}",
            rec.epoch,
            100.0 * all.f16_lost_share(0),
            100.0 * all.f16_lost_share(shift)
        );
        let mut chart = ChartBuilder::on(&top)
            .caption(caption, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(80)
            .build_cartesian_2d(f64::from(lo)..f64::from(hi), (y0..y1).log_scale())
            .map_err(&err)?;
        chart
            .configure_mesh()
            .x_desc("floor(log2 |g|): the value lies in [2^e, 2^(e+1))")
            .y_desc("share of values (%, log scale)")
            .x_label_formatter(&|&x| whole(x, |e| e.to_string()))
            .y_label_formatter(&|&y| format!("{y:.0e}"))
            .label_style(("sans-serif", 14))
            .draw()
            .map_err(&err)?;
        // The binades F16 keeps once the gradients are multiplied by the scale (2^shift).
        let window = RGBColor(44, 160, 44);
        chart
            .draw_series(std::iter::once(Rectangle::new(
                [
                    (f64::from(F16_SUB - shift), y0),
                    (f64::from(F16_OVER - shift), y1),
                ],
                window.mix(0.12).filled(),
            )))
            .map_err(&err)?
            .label(format!(
                "F16 range at loss scale 2^{shift}: 2^{} .. 2^{}",
                F16_SUB - shift,
                F16_OVER - shift
            ))
            .legend(move |(x, y)| {
                Rectangle::new([(x, y - 6), (x + 20, y + 6)], window.mix(0.3).filled())
            });
        let (blue, red) = (RGBColor(31, 119, 180), RGBColor(214, 39, 40));
        let bar = |e: i32, s: f64, c: RGBColor| {
            Rectangle::new(
                [(f64::from(e) + 0.08, y0), (f64::from(e) + 0.92, s)],
                c.filled(),
            )
        };
        let lost = |e: &i32| *e < F16_SUB || *e >= F16_OVER;
        chart
            .draw_series(
                share
                    .iter()
                    .filter(|p| !lost(&p.0))
                    .map(|&(e, s)| bar(e, s, blue)),
            )
            .map_err(&err)?
            .label("values F16 holds without scaling")
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 20, y + 6)], blue.filled()));
        chart
            .draw_series(
                share
                    .iter()
                    .filter(|p| lost(&p.0))
                    .map(|&(e, s)| bar(e, s, red)),
            )
            .map_err(&err)?
            .label("values F16 loses without scaling")
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 20, y + 6)], red.filled()));
        let mut mark = |e: i32, c: RGBColor, name: &str| -> Result<()> {
            let s = chart.draw_series(DashedLineSeries::new(
                [(f64::from(e), y0), (f64::from(e), y1)],
                5,
                4,
                c.stroke_width(2),
            ));
            s.map_err(&err)?.label(name).legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
            });
            Ok(())
        };
        let (normal, over) = (RGBColor(255, 127, 14), RGBColor(0, 0, 0));
        mark(F16_SUB, red, "F16 smallest subnormal 2^-24")?;
        mark(
            F16_NORMAL,
            normal,
            "F16 smallest normal 2^-14 (below: fewer bits)",
        )?;
        mark(F16_OVER, over, "F16 overflow: 2^16 (above 65504)")?;
        let purple = RGBColor(148, 103, 189);
        for (e, name) in [
            (BF16_SUB, "BF16 smallest subnormal 2^-133"),
            (BF16_NORMAL, "BF16 smallest normal 2^-126"),
            (BF16_OVER, "BF16 overflow 2^128"),
        ] {
            if (lo..=hi).contains(&e) {
                mark(e, purple, name)?;
            }
        }
        if lo > BF16_NORMAL && hi < BF16_OVER {
            chart
                .draw_series(std::iter::once(PathElement::new(vec![], purple)))
                .map_err(&err)?
                .label("BF16 holds 2^-133 .. 2^128, off this axis: it loses none of these")
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], purple.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .label_font(("sans-serif", 14))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.4))
            .draw()
            .map_err(&err)?;

        // Per parameter: the same histogram as a row of cells, shaded by log(1 + count) so that
        // a handful of lost values still shows.
        let mut grid = ChartBuilder::on(&bottom)
            .caption(
                "Per parameter (share lost in F16: unscaled / at the loss scale); darker = more values",
                ("sans-serif", 18),
            )
            .margin(12)
            .x_label_area_size(30)
            .y_label_area_size(340)
            .build_cartesian_2d(f64::from(lo)..f64::from(hi), 0.0..layers.max(1) as f64)
            .map_err(&err)?;
        grid.configure_mesh()
            .disable_mesh()
            .y_labels(0)
            .x_label_formatter(&|&x| whole(x, |e| e.to_string()))
            .label_style(("sans-serif", 12))
            .draw()
            .map_err(&err)?;
        for (i, l) in rec.layers.iter().enumerate() {
            // The first parameter on top.
            let y = (layers - 1 - i) as f64;
            let peak = (l.hist.counts.iter().copied().max().unwrap_or(1) as f64).ln_1p();
            grid.draw_series(l.hist.nonzero_bins().map(|(e, c)| {
                let s = (c as f64).ln_1p() / peak;
                let lerp = |a: u8, b: u8| (f64::from(a) + (f64::from(b) - f64::from(a)) * s) as u8;
                let col = if lost(&e) {
                    RGBColor(lerp(255, 165), lerp(255, 15), lerp(255, 21))
                } else {
                    RGBColor(lerp(255, 8), lerp(255, 48), lerp(255, 107))
                };
                Rectangle::new(
                    [(f64::from(e), y + 0.1), (f64::from(e) + 1.0, y + 0.9)],
                    col.filled(),
                )
            }))
            .map_err(&err)?;
            let name = format!(
                "{}  {:.2}% / {:.2}%",
                l.name,
                100.0 * l.hist.f16_lost_share(0),
                100.0 * l.hist.f16_lost_share(shift)
            );
            let (_, py) = grid.backend_coord(&(f64::from(lo), y + 0.5));
            root.draw(&Text::new(
                name,
                (14, py - 6),
                ("sans-serif", 12).into_font().color(&BLACK),
            ))
            .map_err(&err)?;
        }
        for (e, c) in [(F16_SUB, red), (F16_OVER, over)] {
            grid.draw_series(std::iter::once(PathElement::new(
                vec![(f64::from(e), 0.0), (f64::from(e), layers as f64)],
                c.stroke_width(1),
            )))
            .map_err(&err)?;
        }
        grid.draw_series(std::iter::once(Rectangle::new(
            [
                (f64::from(F16_SUB - shift), 0.0),
                (f64::from(F16_OVER - shift), layers as f64),
            ],
            window.stroke_width(2),
        )))
        .map_err(&err)?;
        root.present().map_err(&err)?;
    }
    save_png(path, pixels, size)?;
    Ok(())
}

pub fn run(args: PlotArgs) -> Result<()> {
    let mut runs = args
        .files
        .iter()
        .map(|p| read_run(p))
        .collect::<Result<Vec<_>>>()?;
    if !args.labels.is_empty() {
        if args.labels.len() != runs.len() {
            return Err(Error::arg(
                "plot",
                format!(
                    "--labels names {} runs, but {} files were given",
                    args.labels.len(),
                    runs.len()
                ),
            ));
        }
        for (r, l) in runs.iter_mut().zip(&args.labels) {
            r.label = l.clone();
        }
    }
    std::fs::create_dir_all(&args.out).map_err(|source| Error::Io {
        path: args.out.display().to_string(),
        source,
    })?;
    register_font()?;
    let mut written = Vec::new();
    if runs.iter().any(|r| !r.epochs.is_empty()) {
        let p = args.out.join("curves.png");
        plot_curves(&runs, &p)?;
        written.push(p);
    }
    if runs.iter().any(|r| !r.steps.is_empty()) {
        let p = args.out.join("scale.png");
        plot_scale(&runs, &p)?;
        written.push(p);
    }
    let grad_run = match args.grad_run {
        Some(i) => Some(runs.get(i).ok_or_else(|| {
            Error::arg(
                "plot",
                format!("--grad-run {i}: there are {} runs", runs.len()),
            )
        })?),
        None => runs.iter().find(|r| !r.grads.is_empty()),
    };
    match (grad_run, args.grad_epoch) {
        (Some(run), epoch) if !run.grads.is_empty() => {
            let rec = match epoch {
                Some(e) => run.grads.get(&e).ok_or_else(|| {
                    Error::arg(
                        "plot",
                        format!(
                            "--grad-epoch {e}: {} has gradient statistics for epochs {:?}",
                            run.label,
                            run.grads.keys().collect::<Vec<_>>()
                        ),
                    )
                })?,
                None => run.grads.values().last().expect("not empty"),
            };
            let p = args.out.join("grad_hist.png");
            plot_grad_hist(rec, &run.label, &p)?;
            written.push(p);
        }
        (Some(run), _) if args.grad_run.is_some() => {
            return Err(Error::arg(
                "plot",
                format!(
                    "{} has no gradient statistics (train with --grad-stats --metrics FILE)",
                    run.label
                ),
            ));
        }
        _ => {}
    }
    for p in &written {
        println!("wrote {}", p.display());
    }
    Ok(())
}

/// `hemi doctor --plot FILE.png`: per module (forward order), the activation and gradient
/// relative errors of the preset against the reference, on a log axis.
pub fn doctor_chart(d: &hemi::train::doctor::Diagnosis, path: &Path) -> Result<()> {
    if path.extension().and_then(|e| e.to_str()) != Some("png") {
        return Err(Error::arg(
            "doctor",
            format!(
                "--plot {}: charts are PNG files (name it .png)",
                path.display()
            ),
        ));
    }
    register_font()?;
    let err = draw_err(path);
    let n = d.modules.len();
    let series: [(&str, Vec<(f64, f64)>); 2] = [
        (
            "activation relative error",
            d.modules
                .iter()
                .enumerate()
                .map(|(i, m)| (i as f64, m.act_rel_err))
                .collect(),
        ),
        (
            "gradient relative error",
            d.modules
                .iter()
                .enumerate()
                .map(|(i, m)| (i as f64, m.grad_rel_err))
                .collect(),
        ),
    ];
    let (lo, hi) = minmax(
        series
            .iter()
            .flat_map(|s| s.1.iter().map(|p| p.1))
            .filter(|v| *v > 0.0),
    );
    let (lo, hi) = if lo.is_finite() {
        (lo / 3.0, hi * 3.0)
    } else {
        (1e-8, 1.0)
    };
    let size = (1400u32, 700u32);
    let mut pixels = vec![0u8; size.0 as usize * size.1 as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut pixels, size).into_drawing_area();
        root.fill(&WHITE).map_err(&err)?;
        let caption = format!(
            "{} against {} over {} steps: per-module error (x: module in forward order)",
            d.precision,
            if d.reference == hemi::DType::F64 {
                "f64"
            } else {
                "fp32"
            },
            d.steps
        );
        let mut chart = ChartBuilder::on(&root)
            .caption(caption, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(80)
            .build_cartesian_2d(-0.5..(n.max(1) as f64 - 0.5), (lo..hi).log_scale())
            .map_err(&err)?;
        let names: Vec<String> = d.modules.iter().map(|m| m.module.clone()).collect();
        chart
            .configure_mesh()
            .x_desc("module")
            .y_desc("relative error (log scale)")
            .x_labels(n.clamp(1, 24))
            .x_label_formatter(&|&x| {
                let i = x.round();
                if (x - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < names.len() {
                    let s = &names[i as usize];
                    s.rsplit('.')
                        .take(2)
                        .collect::<Vec<_>>()
                        .into_iter()
                        .rev()
                        .collect::<Vec<_>>()
                        .join(".")
                } else {
                    String::new()
                }
            })
            .label_style(("sans-serif", 12))
            .draw()
            .map_err(&err)?;
        for (k, (label, pts)) in series.iter().enumerate() {
            let c = color(k);
            let pts: Vec<(f64, f64)> = pts
                .iter()
                .copied()
                .filter(|p| p.1 > 0.0 && p.1.is_finite())
                .collect();
            chart
                .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
                .map_err(&err)?
                .label(*label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                });
            chart
                .draw_series(pts.iter().map(|&p| Circle::new(p, 4, c.filled())))
                .map_err(&err)?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .label_font(("sans-serif", 14))
            .draw()
            .map_err(&err)?;
        root.present().map_err(&err)?;
    }
    save_png(path, pixels, size)
}
