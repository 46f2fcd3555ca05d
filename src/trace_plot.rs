//! Memory over time, drawn from a trace file (the Chrome trace-event JSON that
//! `GPUCACHE_TRACE=path` or `gpucache::trace` writes) to SVG with plotters: one panel per device,
//! and for each cache on it:
//!
//! * a line: the bytes it holds (in use + cached). A trace has far more samples than the picture
//!   has pixel columns, so each column draws the range its samples span (lowest to highest) at
//!   its middle: a drop to zero that lasts microseconds (an `invalidate`) still shows.
//! * an area: the bytes in use at each step's peak. Under `Reuse::OnExit` the bytes in use grow
//!   through a step and fall when it exits, so the value at any one moment is mostly below the
//!   step's peak; the area shows, at every time, the highest value in use reaches before it next
//!   falls to zero (the peak of the step under way).
//!
//! Where a device has more than one cache, the device's total (every cache and the arrays
//! allocated outside scopes) is drawn last, as a thin black line over the caches' lines.

use std::collections::BTreeMap;
use std::error::Error;
use std::path::Path;

use plotters::prelude::*;
use serde_json::Value;

type Result<T> = std::result::Result<T, Box<dyn Error>>;

/// One counter track: (time in ms, in use MiB, cached MiB) samples, in time order.
type Track = Vec<(f64, f64, f64)>;

/// The counter tracks of a trace file, by name (`device cpu`, `cache train_step on cpu`, ...).
pub fn counters(trace: &Path) -> Result<BTreeMap<String, Track>> {
    let doc: Value = serde_json::from_slice(&std::fs::read(trace)?)?;
    let events = doc["traceEvents"]
        .as_array()
        .ok_or("not a Chrome trace: no traceEvents")?;
    let mut tracks: BTreeMap<String, Track> = BTreeMap::new();
    const MIB: f64 = 1024.0 * 1024.0;
    for e in events.iter().filter(|e| e["ph"] == "C") {
        let (Some(name), Some(ts)) = (e["name"].as_str(), e["ts"].as_f64()) else {
            continue;
        };
        let field = |f: &str| e["args"][f].as_f64().unwrap_or(0.0) / MIB;
        tracks.entry(name.to_owned()).or_default().push((
            ts / 1000.0,
            field("in use"),
            field("cached"),
        ));
    }
    for track in tracks.values_mut() {
        track.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    Ok(tracks)
}

/// A line through `track` (time, value; a step function: each value holds until the next
/// sample) over `columns` equal intervals of `0..t_end`: in each column, a vertical stroke at
/// its middle from the value the column starts with through its lowest and highest (in the
/// order they happen) to the value it ends with, and a level stroke to the next column.
fn min_max_line(track: &[(f64, f64)], t_end: f64, columns: usize) -> Vec<(f64, f64)> {
    let width = t_end.max(1e-9) / columns as f64;
    let mut out = Vec::with_capacity(4 * columns);
    let mut samples = track.iter().peekable();
    let mut value = 0.0f64; // before the first sample nothing is held
    for c in 0..columns {
        let (x0, x1) = (c as f64 * width, (c + 1) as f64 * width);
        let start = value;
        let (mut lo, mut hi) = ((start, 0usize), (start, 0usize));
        let mut i = 0;
        while let Some(&(_, v)) = samples.next_if(|s| s.0 < x1 || c + 1 == columns) {
            i += 1;
            if v < lo.0 {
                lo = (v, i);
            }
            if v > hi.0 {
                hi = (v, i);
            }
            value = v;
        }
        let mid = (x0 + x1) / 2.0;
        let (first, second) = if lo.1 <= hi.1 {
            (lo.0, hi.0)
        } else {
            (hi.0, lo.0)
        };
        out.extend([(x0, start), (mid, start), (mid, first), (mid, second)]);
        out.extend([(mid, value), (x1, value)]);
    }
    out
}

/// The peak of the step under way at each sample: the highest value from that sample until the
/// value next falls to zero (as a step function: each value holds until the next sample).
fn step_peaks(track: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let mut out = Vec::with_capacity(track.len());
    let mut peak = 0.0f64;
    for &(t, v) in track.iter().rev() {
        peak = if v <= 0.0 { 0.0 } else { peak.max(v) };
        out.push((t, peak));
    }
    out.reverse();
    out
}

/// The highest value of `track` (a step function) in each of `columns` equal intervals of
/// `0..t_end`, as a step function for an area.
fn column_highs(track: &[(f64, f64)], t_end: f64, columns: usize) -> Vec<(f64, f64)> {
    let width = t_end.max(1e-9) / columns as f64;
    let mut out = Vec::with_capacity(2 * columns);
    let mut samples = track.iter().peekable();
    let mut value = 0.0f64;
    for c in 0..columns {
        let (x0, x1) = (c as f64 * width, (c + 1) as f64 * width);
        let mut high = value;
        while let Some(&(_, v)) = samples.next_if(|s| s.0 < x1 || c + 1 == columns) {
            high = high.max(v);
            value = v;
        }
        out.extend([(x0, high), (x1, high)]);
    }
    out
}

/// Draws the counters of `trace` to the SVG file `out`, with `title` on top.
pub fn plot(trace: &Path, out: &Path, title: &str) -> Result<()> {
    let tracks = counters(trace)?;
    let devices: Vec<&str> = tracks
        .keys()
        .filter_map(|k| k.strip_prefix("device "))
        .collect();
    if devices.is_empty() {
        return Err(format!("{}: no memory counters in the trace", trace.display()).into());
    }
    let t_end = tracks
        .values()
        .flat_map(|t| t.last())
        .map(|s| s.0)
        .fold(0.0, f64::max)
        .max(1e-3);
    let root = SVGBackend::new(out, (900, 340 * devices.len() as u32)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 18))?;
    for (area, device) in root.split_evenly((devices.len(), 1)).iter().zip(&devices) {
        let caches: Vec<(&str, &Track)> = tracks
            .iter()
            .filter(|(k, _)| k.starts_with("cache ") && k.ends_with(&format!(" on {device}")))
            .map(|(k, v)| (k.as_str(), v))
            .collect();
        // The device's total, where it is more than one cache's.
        let total = (caches.len() > 1)
            .then(|| tracks.get(&format!("device {device}")))
            .flatten();
        let y_max = caches
            .iter()
            .map(|(_, t)| *t)
            .chain(total)
            .flat_map(|t| t.iter())
            .map(|s| s.1 + s.2)
            .fold(0.0, f64::max)
            .max(1e-3)
            * 1.15;
        let mut chart = ChartBuilder::on(area)
            .margin(10)
            .caption(format!("memory on {device}"), ("sans-serif", 15))
            .x_label_area_size(35)
            .y_label_area_size(55)
            .build_cartesian_2d(0.0..t_end, 0.0..y_max)?;
        chart
            .configure_mesh()
            .x_desc("time (ms)")
            .y_desc("MiB")
            .light_line_style(WHITE)
            .draw()?;
        // One column per pixel of the plotting area.
        let columns = (chart.plotting_area().dim_in_pixel().0 as usize).max(1);
        let held = |t: &Track| -> Vec<(f64, f64)> { t.iter().map(|s| (s.0, s.1 + s.2)).collect() };
        // Areas first, so that no area hides a line.
        for (i, (name, track)) in caches.iter().enumerate() {
            let light = Palette99::pick(i).to_rgba().mix(0.35);
            let label = short(name, device);
            let in_use: Vec<(f64, f64)> = track.iter().map(|s| (s.0, s.1)).collect();
            let area = column_highs(&step_peaks(&in_use), t_end, columns);
            chart
                .draw_series(AreaSeries::new(area, 0.0, light.filled()))?
                .label(format!("{label}: in use, each step's peak (area)"))
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 18, y + 5)], light.filled())
                });
        }
        for (i, (name, track)) in caches.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let label = short(name, device);
            let line = min_max_line(&held(track), t_end, columns);
            chart
                .draw_series(LineSeries::new(line, color.stroke_width(2)))?
                .label(format!("{label}: held, in use + cached (line)"))
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 18, y)], color.stroke_width(2))
                });
        }
        if let Some(track) = total {
            let line = min_max_line(&held(track), t_end, columns);
            chart
                .draw_series(LineSeries::new(line, BLACK.stroke_width(1)))?
                .label(format!(
                    "all of {device}: held, in use + cached (thin line)"
                ))
                .legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], BLACK.stroke_width(1)));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .draw()?;
    }
    root.present()?;
    Ok(())
}

/// A cache's counter track name without `cache ` and ` on DEVICE`.
fn short<'a>(name: &'a str, device: &str) -> &'a str {
    name.strip_suffix(&format!(" on {device}"))
        .unwrap_or(name)
        .trim_start_matches("cache ")
}
