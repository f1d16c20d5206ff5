//! `flashattn plot IN.json OUT.svg`: GFLOP/s against sequence length, one line per
//! (implementation, head_dim), one panel per (dtype, mask, pass).
//!
//! IN is what `bench/compare_torch.py` writes — an object whose `"results"` array holds one entry
//! per measurement — or a plain JSON array of such entries, or the JSON lines of
//! `flashattn bench --json`. An entry needs `impl` (e.g. "flashattn", "torch_sdpa", "naive"),
//! `seqlen_q` (or `seqlen`) and `gflops`; `dtype`, `head_dim`, `causal`, `pass`, `batch`, `heads`
//! and `threads` group and label it when present; entries with `"skipped": true`, without a
//! positive finite `gflops`, or of another `kind` (the "machine" line) are left out. The optional
//! top-level `"machine"` object (`threads`, `isa`, `peak_f32_gflops`, `peak_bf16_gflops`) goes into
//! the title.
//!
//! Only the SVG backend is used: text is written as SVG `<text>` for the viewer to render, so no
//! font files are needed.

use crate::error::{CliError, Result};
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(clap::Args, Debug)]
pub struct PlotArgs {
    /// JSON results (bench/compare_torch.py's output, or `flashattn bench --json` lines).
    pub input: PathBuf,
    /// The SVG file to write.
    pub output: PathBuf,
    /// Title (default: one made from the machine and shape fields).
    #[arg(long)]
    pub title: Option<String>,
}

/// One measurement.
#[derive(Clone, Debug)]
struct Point {
    implementation: String,
    dtype: String,
    head_dim: Option<u64>,
    causal: Option<bool>,
    pass: String,
    seqlen: u64,
    gflops: f64,
}

/// A panel: (dtype, causal, pass).
type PanelKey = (String, Option<bool>, String);
/// A line within a panel: (implementation, head_dim).
type SeriesKey = (String, Option<u64>);
/// A panel's lines: (log2 seqlen, GFLOP/s) points of each.
type Series = BTreeMap<SeriesKey, Vec<(f64, f64)>>;

/// What the title says about the machine and shapes.
#[derive(Default, Debug)]
struct Context {
    threads: Option<u64>,
    batch: Option<u64>,
    heads: Option<u64>,
    isa: Option<String>,
    peak_f32: Option<f64>,
    peak_bf16: Option<f64>,
}

pub fn plot(args: &PlotArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.input)
        .map_err(|e| CliError(format!("cannot read {}: {e}", args.input.display())))?;
    let (points, ctx) =
        parse(&text).map_err(|e| CliError(format!("{}: {e}", args.input.display())))?;
    let title = args.title.clone().unwrap_or_else(|| title(&ctx));
    draw(&points, &title, &args.output)
        .map_err(|e| CliError(format!("cannot draw {}: {e}", args.output.display())))?;
    Ok(())
}

/// The entries and context of a results file, in any of the accepted forms.
fn parse(text: &str) -> std::result::Result<(Vec<Point>, Context), String> {
    let mut ctx = Context::default();
    let entries: Vec<Value> = match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(mut top)) => {
            if let Some(Value::Object(m)) = top.get("machine") {
                read_machine(m, &mut ctx);
            }
            match top.remove("results") {
                Some(Value::Array(a)) => a,
                Some(_) => return Err("\"results\" is not an array".into()),
                // A single bench line.
                None => vec![Value::Object(top)],
            }
        }
        Ok(Value::Array(a)) => a,
        Ok(_) => return Err("expected a JSON object with \"results\", or an array".into()),
        // JSON lines (`flashattn bench --json`): every non-empty line must parse.
        Err(first) => {
            let mut v = Vec::new();
            for (n, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                match serde_json::from_str::<Value>(line) {
                    Ok(x) => v.push(x),
                    Err(_) if n == 0 => return Err(format!("not JSON: {first}")),
                    Err(e) => return Err(format!("line {}: not JSON: {e}", n + 1)),
                }
            }
            v
        }
    };
    let mut points = Vec::new();
    for e in &entries {
        let Value::Object(m) = e else {
            return Err(format!("a result is not an object: {e}"));
        };
        match m.get("kind").and_then(Value::as_str) {
            Some("machine") | Some("peak") => {
                read_machine(m, &mut ctx);
                continue;
            }
            None | Some("measurement") => {}
            Some(_) => continue,
        }
        if m.get("skipped").and_then(Value::as_bool) == Some(true) {
            continue;
        }
        let implementation = m
            .get("impl")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("a result has no \"impl\" string: {e}"))?;
        let seqlen = m
            .get("seqlen_q")
            .or_else(|| m.get("seqlen"))
            .and_then(Value::as_u64)
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("a result has no positive integer \"seqlen_q\": {e}"))?;
        let Some(gflops) = m.get("gflops").and_then(Value::as_f64) else {
            return Err(format!("a result has no numeric \"gflops\": {e}"));
        };
        if !(gflops.is_finite() && gflops > 0.0) {
            continue;
        }
        let num = |k: &str| m.get(k).and_then(Value::as_u64);
        for (slot, k) in [
            (&mut ctx.threads, "threads"),
            (&mut ctx.batch, "batch"),
            (&mut ctx.heads, "heads"),
        ] {
            // Shown in the title only while every entry agrees.
            if let Some(x) = num(k) {
                *slot = match *slot {
                    Some(y) if y != x => Some(u64::MAX),
                    _ => Some(x),
                };
            }
        }
        points.push(Point {
            implementation: implementation.to_string(),
            dtype: m
                .get("dtype")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string(),
            head_dim: num("head_dim"),
            causal: m.get("causal").and_then(Value::as_bool),
            pass: m
                .get("pass")
                .and_then(Value::as_str)
                .unwrap_or("fwd")
                .to_string(),
            seqlen,
            gflops,
        });
    }
    if points.is_empty() {
        return Err("no measurements to plot (entries need impl, seqlen_q and gflops)".into());
    }
    Ok((points, ctx))
}

fn read_machine(m: &serde_json::Map<String, Value>, ctx: &mut Context) {
    let f = |k: &str| m.get(k).and_then(Value::as_f64);
    ctx.threads = m.get("threads").and_then(Value::as_u64).or(ctx.threads);
    ctx.isa = m
        .get("isa")
        .and_then(Value::as_str)
        .map(String::from)
        .or(ctx.isa.take());
    ctx.peak_f32 = f("peak_f32_gflops").or(ctx.peak_f32);
    ctx.peak_bf16 = f("peak_bf16_gflops").or(ctx.peak_bf16);
}

fn title(ctx: &Context) -> String {
    let mut parts = vec!["Attention GFLOP/s vs sequence length".to_string()];
    let known = |x: Option<u64>| x.filter(|&v| v != u64::MAX);
    let mut shape = Vec::new();
    if let Some(b) = known(ctx.batch) {
        shape.push(format!("batch {b}"));
    }
    if let Some(h) = known(ctx.heads) {
        shape.push(format!("{h} heads"));
    }
    if let Some(t) = known(ctx.threads) {
        shape.push(format!("{t} threads"));
    }
    if !shape.is_empty() {
        parts.push(shape.join(", "));
    }
    let mut machine = Vec::new();
    if let Some(isa) = &ctx.isa {
        machine.push(format!("ISA {isa}"));
    }
    if let Some(p) = ctx.peak_f32 {
        machine.push(format!("peak f32 {p:.0}"));
    }
    if let Some(p) = ctx.peak_bf16 {
        machine.push(format!("bf16 dot {p:.0} GFLOP/s"));
    }
    if !machine.is_empty() {
        parts.push(machine.join(", "));
    }
    parts.join(" — ")
}

fn panel_caption(key: &PanelKey) -> String {
    let (dtype, causal, pass) = key;
    let mask = match causal {
        Some(true) => "causal",
        Some(false) => "non-causal",
        None => "",
    };
    [dtype.as_str(), mask, pass.as_str()]
        .iter()
        .filter(|s| !s.is_empty())
        .copied()
        .collect::<Vec<_>>()
        .join(", ")
}

/// Colour of an implementation: a darker shade for the larger head_dim.
fn colour(implementation: &str, shade: usize) -> RGBColor {
    let pair = match implementation {
        "flashattn" => [RGBColor(86, 150, 230), RGBColor(20, 60, 160)],
        "torch_sdpa" | "torch" => [RGBColor(250, 160, 60), RGBColor(200, 80, 0)],
        "naive" => [RGBColor(150, 150, 150), RGBColor(60, 60, 60)],
        _ => [RGBColor(120, 200, 120), RGBColor(20, 120, 40)],
    };
    pair[shade.min(1)]
}

fn draw(points: &[Point], title: &str, out: &Path) -> std::result::Result<(), String> {
    // Panels in the order they first appear in the file.
    let mut panels: Vec<(PanelKey, Series)> = Vec::new();
    for p in points {
        let key = (p.dtype.clone(), p.causal, p.pass.clone());
        let at = match panels.iter().position(|(k, _)| *k == key) {
            Some(i) => i,
            None => {
                panels.push((key, BTreeMap::new()));
                panels.len() - 1
            }
        };
        panels[at]
            .1
            .entry((p.implementation.clone(), p.head_dim))
            .or_default()
            .push(((p.seqlen as f64).log2(), p.gflops));
    }
    let dims: Vec<Option<u64>> = {
        let mut d: Vec<_> = points.iter().map(|p| p.head_dim).collect();
        d.sort_unstable();
        d.dedup();
        d
    };
    let cols = if panels.len() > 1 { 2 } else { 1 };
    let rows = panels.len().div_ceil(cols);
    let (w, h) = (640 * cols as u32, 60 + 420 * rows as u32);
    let root = SVGBackend::new(out, (w, h)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let (top, body) = root.split_vertically(60);
    // The title's first part on one line, the details under it, centred.
    let (head, rest) = title.split_once(" — ").unwrap_or((title, ""));
    let centre = |size: i32| {
        TextStyle::from(("sans-serif", size).into_font()).pos(Pos::new(HPos::Center, VPos::Top))
    };
    top.draw_text(head, &centre(20), (w as i32 / 2, 8))
        .map_err(|e| e.to_string())?;
    top.draw_text(rest, &centre(14), (w as i32 / 2, 34))
        .map_err(|e| e.to_string())?;
    let areas = body.split_evenly((rows, cols));
    for (area, (key, series)) in areas.iter().zip(panels.iter()) {
        draw_panel(area, key, series, &dims)?;
    }
    root.present().map_err(|e| e.to_string())?;
    Ok(())
}

/// A linear f64 axis (here log2 of the sequence length) with tick marks and grid lines at given
/// values only: the measured lengths, not plotters' round numbers of the log.
struct TickedAxis {
    x0: f64,
    x1: f64,
    ticks: Vec<f64>,
}

impl Ranged for TickedAxis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        let f = (v - self.x0) / (self.x1 - self.x0);
        limit.0 + (f * (limit.1 - limit.0) as f64).round() as i32
    }

    /// The same points for bold and light grid lines (and so the labels), whatever the hint.
    fn key_points<H: KeyPointHint>(&self, _hint: H) -> Vec<f64> {
        self.ticks.clone()
    }

    fn range(&self) -> std::ops::Range<f64> {
        self.x0..self.x1
    }
}

fn draw_panel(
    area: &DrawingArea<SVGBackend, Shift>,
    key: &PanelKey,
    series: &Series,
    dims: &[Option<u64>],
) -> std::result::Result<(), String> {
    let all = series.values().flatten();
    let (mut x0, mut x1, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, 0.0f64);
    for &(x, y) in all {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y1 = y1.max(y);
    }
    // Ticks at the measured lengths only.
    let mut ticks: Vec<f64> = series.values().flatten().map(|p| p.0).collect();
    ticks.sort_by(f64::total_cmp);
    ticks.dedup();
    // A third of an octave of margin; a single length still gets a visible range. The headroom
    // above the highest point keeps the legend (upper left) off the lines.
    let (x0, x1) = (x0 - 0.3, x1 + 0.3);
    let y1 = y1 * (1.25 + 0.07 * series.len() as f64);
    let mut chart = ChartBuilder::on(area)
        .caption(panel_caption(key), ("sans-serif", 17))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(TickedAxis { x0, x1, ticks }, 0.0..y1)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("sequence length (log scale)")
        .y_desc("GFLOP/s")
        .x_label_formatter(&|x| format!("{}", 2f64.powf(*x).round()))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()
        .map_err(|e| e.to_string())?;
    for ((implementation, head_dim), pts) in series {
        let mut pts = pts.clone();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let shade = dims.iter().position(|d| d == head_dim).unwrap_or(0);
        let c = colour(implementation, shade);
        let style = ShapeStyle::from(&c).stroke_width(if shade == 0 { 2 } else { 3 });
        let label = match head_dim {
            Some(d) => format!("{implementation} d={d}"),
            None => implementation.clone(),
        };
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), style))
            .map_err(|e| e.to_string())?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style));
        if shade == 0 {
            chart
                .draw_series(pts.iter().map(|&p| Circle::new(p, 4, c.filled())))
                .map_err(|e| e.to_string())?;
        } else {
            chart
                .draw_series(pts.iter().map(|&p| TriangleMarker::new(p, 5, c.filled())))
                .map_err(|e| e.to_string())?;
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(|e| e.to_string())?;
    Ok(())
}
