//! Memory over time, drawn from a trace file (the Chrome trace-event JSON that
//! `GPUCACHE_TRACE=path` or `gpucache::trace` writes) to SVG with plotters: one panel per device;
//! for each cache (and the device's total, when it has several), the bytes it holds (in use +
//! cached, a line) and the bytes in use (an area), each at its peak over short intervals.

use std::collections::BTreeMap;
use std::error::Error;
use std::path::Path;

use plotters::prelude::*;
use serde_json::Value;

type Result<T> = std::result::Result<T, Box<dyn Error>>;

/// One counter track: (time in ms, in use MiB, cached MiB) samples.
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
    Ok(tracks)
}

/// The highest value in each of `buckets` equal time intervals (as steps), so that a long trace
/// still makes a small picture and short peaks stay visible.
fn peaks(track: &[(f64, f64)], t_end: f64, buckets: usize) -> Vec<(f64, f64)> {
    let width = t_end.max(1e-9) / buckets as f64;
    let mut high: Vec<Option<f64>> = vec![None; buckets + 1];
    for &(t, v) in track {
        let b = ((t / width) as usize).min(buckets);
        high[b] = Some(high[b].map_or(v, |h: f64| h.max(v)));
    }
    // A bucket without samples keeps the last value.
    let mut last = 0.0;
    let mut out = Vec::new();
    for (b, h) in high.into_iter().enumerate() {
        let v = match h {
            Some(v) => v,
            None => last,
        };
        out.push((b as f64 * width, v));
        out.push(((b + 1) as f64 * width, v));
        if let Some(&(_, v)) = track.iter().rev().find(|s| s.0 < (b + 1) as f64 * width) {
            last = v;
        }
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
        .fold(0.0, f64::max);
    let root = SVGBackend::new(out, (900, 320 * devices.len() as u32)).into_drawing_area();
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
            .then(|| tracks.get_key_value(&format!("device {device}")))
            .flatten()
            .map(|(k, v)| (k.as_str(), v));
        let mine: Vec<(&str, &Track)> = total.into_iter().chain(caches).collect();
        let y_max = mine
            .iter()
            .flat_map(|(_, t)| t.iter())
            .map(|s| s.1.max(s.2))
            .fold(0.0, f64::max)
            .max(1e-3)
            * 1.1;
        let mut chart = ChartBuilder::on(area)
            .margin(10)
            .caption(format!("memory on {device}"), ("sans-serif", 15))
            .x_label_area_size(35)
            .y_label_area_size(55)
            .build_cartesian_2d(0.0..t_end.max(1e-3), 0.0..y_max)?;
        chart
            .configure_mesh()
            .x_desc("time (ms)")
            .y_desc("MiB")
            .light_line_style(WHITE)
            .draw()?;
        for (i, (name, track)) in mine.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let label = name
                .trim_end_matches(&format!(" on {device}"))
                .trim_start_matches("cache ");
            let series = |f: fn(&(f64, f64, f64)) -> f64| {
                let points: Vec<(f64, f64)> = track.iter().map(|s| (s.0, f(s))).collect();
                peaks(&points, t_end, 300)
            };
            let light = color.mix(0.3);
            chart
                .draw_series(AreaSeries::new(series(|s| s.1), 0.0, light.filled()))?
                .label(format!("{label}: in use (peak)"))
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 18, y + 5)], light.filled())
                });
            chart
                .draw_series(LineSeries::new(
                    series(|s| s.1 + s.2),
                    color.stroke_width(2),
                ))?
                .label(format!("{label}: in use + cached"))
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 18, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK.mix(0.3))
            .draw()?;
    }
    root.present()?;
    Ok(())
}
