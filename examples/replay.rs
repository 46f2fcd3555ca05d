//! Replays allocation logs (`gpucache_suite::replay`: a CSV, maybe gzip-compressed, made from a
//! recorded trace or by `examples/replay/record_torch.py` from a PyTorch model) through every
//! gpucache configuration of `replay::CONFIGS`, in the recorded scopes, and, on CUDA, through the
//! device's stream-ordered memory pool (cuMemAllocAsync / cuMemFreeAsync) with its release
//! threshold at 0 (cudarc's default) and at `u64::MAX`; on the CPU through the bare host
//! allocator instead. gpucache's own device allocations go to that pool at threshold 0 (what a
//! program gets unless it sets the threshold); on CUDA the planned cache is also replayed over
//! the pool at threshold max, its memory then the device's memory in use above the start
//! (`cuMemGetInfo`: the pool's reserve, which keeps what gpucache frees, and the plan blocks
//! gpucache maps outside the pool).
//!
//! ```text
//! cargo run --release --example replay -- tests/fixtures/gpt2_train.csv.gz cpu 7
//! cargo run --release --features cuda --example replay -- tests/fixtures/*.csv.gz cuda 7
//! cargo run --release --example replay -- --longer 10 tests/fixtures/vit_infer.csv.gz cpu 3
//! ```
//!
//! `--no-event-tracking` turns cudarc's event tracking off for the device's context before the
//! replay: cudarc then makes no read and write events for a new slice (each device allocation
//! gets a slice, and with tracking two events: the pool's, and gpucache's own blocks; arrays
//! served from part of a block make none while the context has one stream, as in this replay),
//! so the difference it makes is what those events cost. A measurement, not a setting to copy: a
//! program that uses a buffer on several streams needs the events, or its own synchronisation.
//!
//! `--longer PASSES` replays each log's steps after the first that many more times, in
//! shuffled orders ([`replay::reordered`]): a recording of ten steps shows a few batches or
//! lengths in one order, a long run of the model brings every order. The figures are then the
//! longer run's (its peak live bytes included). `--only NAMES` replays only the variants whose
//! label contains one of the comma-separated names, and the baseline (`--only "planned
//! (default)"`: gpucache's default against the pool).
//!
//! For each log it prints first what two allocators simulated from the log alone would hold
//! (`replay::plan::simulate`: every step planned from its own lifetimes, one block with each
//! position's largest size; `replay::arena::simulate`: one block for every step, sub-allocated
//! online best fit and grown at its top in 2 MiB granules, as PyTorch's expandable segments
//! are), then, per variant:
//!
//! * peak device bytes over the log's **peak live** bytes (the most bytes of its buffers alive
//!   at once, the lower bound); gpucache: what the backend holds for it (over the pool at
//!   threshold max: the device's memory in use); pool: the pool's reserved high-water mark;
//!   bare: the live buffers' bytes;
//! * device allocations in the steps after the second, and in parentheses those in the second
//!   half of the steps, where a long run's every kind of step has come before (bare and pool:
//!   every allocation);
//! * host time per step: the mean of the steps after the second (all steps when there are
//!   fewer than three), per round; the median over the rounds and their [min, max], and the
//!   median over the baseline's median (the pool at threshold max; on the CPU, bare) with the
//!   per-round ratios' range.
//!
//! Every round replays the whole log once per variant, the variants round-robin (the first one
//! rotates from round to round), each from cold: on a new thread (fresh caches), `empty_cache`
//! before, and the pool trimmed. An untimed round comes first, which follows gpucache's peak
//! (reading the backend's bytes after every allocation) and checks every array's memory
//! (`Peak::Checked`: its own tags written at both ends when it is made, through a cudarc view on
//! CUDA, and read back when it drops: an array handed bytes another live array holds, or a view
//! that does not reach its end, stops the variant with an error); the timed rounds do neither,
//! so that the host times compare the allocators alone. The memory figures are that round's
//! (the same every round but the pool's), the pool's peak the highest of the rounds. The clock
//! runs over the log's operations made ready beforehand (each array's shape built, each buffer
//! a slot of a vector), so that it times the allocators, not the parsing of the log or a map of
//! buffers.

use gpucache_suite::replay;

use replay::{arena, plan};

use std::path::PathBuf;

use gpucache::Device;
use replay::{CONFIGS, Mode, Peak, Replay, Result};

/// One line of the report.
struct Variant {
    label: String,
    mode: Mode,
    replays: Vec<Replay>,
    /// The error of a replay that failed (out of memory, say): the variant is not replayed
    /// again and has no figures.
    failed: Option<String>,
}

fn main() -> Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    // `--longer PASSES`: each log's steps replayed that many more times in shuffled orders.
    let mut longer = None;
    if let Some(i) = args.iter().position(|a| a == "--longer") {
        let passes = args.get(i + 1).and_then(|p| p.parse::<usize>().ok());
        longer = Some(passes.ok_or("--longer takes a number of passes")?);
        args.drain(i..i + 2);
    }
    // `--only NAMES`: only the variants whose label contains one of the comma-separated names
    // (and the baseline).
    let mut only = None;
    if let Some(i) = args.iter().position(|a| a == "--only") {
        let names = args
            .get(i + 1)
            .ok_or("--only takes comma-separated names")?;
        only = Some(names.split(',').map(str::to_owned).collect::<Vec<_>>());
        args.drain(i..i + 2);
    }
    // `--no-event-tracking`: cudarc's read and write events off for the device's context (see
    // the module docs).
    let no_events = args.iter().any(|a| a == "--no-event-tracking");
    args.retain(|a| a != "--no-event-tracking");
    let mut rounds = 7usize;
    if let Some(n) = args.last().and_then(|a| a.parse().ok()) {
        rounds = n;
        args.pop();
    }
    let dev = match args.last().map(String::as_str) {
        Some("cpu") => Some(Device::Cpu),
        Some("cuda") => Some(Device::cuda(0)?),
        _ => None,
    };
    let dev = match dev {
        Some(d) => {
            args.pop();
            d
        }
        None => Device::Cpu,
    };
    if args.is_empty() {
        return Err(
            "usage: replay [--longer PASSES] [--only NAMES] [--no-event-tracking] LOG.csv[.gz]... \
             [cpu|cuda] [ROUNDS]"
                .into(),
        );
    }
    if no_events && !dev.is_cuda() {
        return Err("--no-event-tracking is for a CUDA device".into());
    }
    #[cfg(feature = "cuda")]
    if no_events {
        // SAFETY: cudarc then records no event on a slice's use and waits for none; the replay
        // uses each array on the stream of the thread that made it (no kernel, its tags copied
        // on that stream and synchronised), and gpucache orders a buffer's reuse on another
        // stream itself.
        unsafe {
            gpucache::cuda::context(dev)?.disable_event_tracking();
        }
    }
    let rounds = rounds.max(1);
    let mut summary = Vec::new();
    for log in &args {
        summary.push((
            log.clone(),
            report(log, dev, rounds, longer, only.as_deref())?,
        ));
    }
    if args.len() > 1 {
        print_summary(&summary);
    }
    Ok(())
}

/// The seed of the orders `--longer` replays a log's steps in.
const LONGER_SEED: u64 = 7;

/// The variants replayed on `dev`; the last is the baseline of the time ratios. With `only`,
/// those whose label contains one of its names, and the baseline.
fn variants(dev: Device, only: Option<&[String]>) -> Vec<Variant> {
    let mut v: Vec<(String, Mode)> = CONFIGS
        .iter()
        .map(|(name, cfg)| (format!("gpucache {name}"), Mode::Configured(*cfg)))
        .collect();
    if dev.is_cuda() {
        v.push((
            "gpucache planned, pool threshold max".into(),
            Mode::ConfiguredOverPool {
                config: CONFIGS[0].1,
                threshold: u64::MAX,
            },
        ));
        v.push(("pool threshold 0".into(), Mode::Pool { threshold: 0 }));
        v.push((
            "pool threshold max".into(),
            Mode::Pool {
                threshold: u64::MAX,
            },
        ));
    } else {
        v.push(("bare (host allocator)".into(), Mode::Bare));
    }
    if let Some(only) = only {
        let last = v.len() - 1;
        let mut i = 0;
        v.retain(|(label, _)| {
            i += 1;
            i - 1 == last || only.iter().any(|name| label.contains(name.as_str()))
        });
    }
    v.into_iter()
        .map(|(label, mode)| Variant {
            label,
            mode,
            replays: Vec::new(),
            failed: None,
        })
        .collect()
}

/// The figures of one variant on one log.
struct Row {
    label: String,
    peak: usize,
    allocs_after_step2: u64,
    allocs_in_second_half: u64,
    later_steps: usize,
    median: f64,
    range: (f64, f64),
    ratio: f64,
    ratio_range: (f64, f64),
}

/// What one log's report found.
struct Report {
    /// The log's peak live bytes.
    live: usize,
    /// What plans would hold ([`plan::simulate`]).
    planned: plan::Simulated,
    /// What one block sub-allocated online would hold ([`arena::simulate`]).
    arena: usize,
    /// The variants' rows.
    rows: Vec<Row>,
}

fn report(
    log: &str,
    dev: Device,
    rounds: usize,
    longer: Option<usize>,
    only: Option<&[String]>,
) -> Result<Report> {
    let mut ops = replay::read(&PathBuf::from(log))?;
    if let Some(passes) = longer {
        println!(
            "{log}: replayed longer: its steps after the first {passes} more times, in shuffled \
             orders (replay::reordered, seed {LONGER_SEED})"
        );
        ops = replay::reordered(&ops, passes, LONGER_SEED);
    }
    let allocs = ops
        .iter()
        .filter(|o| matches!(o, replay::Op::Alloc { .. }))
        .count();
    let steps = replay::steps(&ops);
    let live = replay::peak_live(&ops);
    println!(
        "{log}: {} operations, {allocs} allocations, {steps} steps, peak live {:.1} MiB; on {dev}, \
         {rounds} rounds",
        ops.len(),
        mib(live)
    );
    let planned = plan::simulate(&ops);
    println!(
        "planned steps, simulated from the log (one block, each position's largest size; arrays \
         that outlive their step apart): peak {:.3}x peak live, largest step's own plan {:.3}x, \
         {} re-plans",
        planned.peak as f64 / live.max(1) as f64,
        planned.largest_step_plan as f64 / live.max(1) as f64,
        planned.replans
    );
    let arena = arena::simulate(&ops, arena::GPU_GRANULE);
    println!(
        "one block for every step, sub-allocated online, simulated from the log (best fit, grown \
         at its top in 2 MiB granules, as PyTorch's expandable segments): peak {:.3}x peak live",
        arena as f64 / live.max(1) as f64
    );
    if !dev.is_cuda() {
        println!(
            "(on the CPU there is no memory pool: the pool rows are absent, bare is the baseline)"
        );
    }
    let mut variants = variants(dev, only);
    let n = variants.len();
    // Round 0 follows gpucache's peak and checks its arrays' memory; the timed rounds after it
    // do neither.
    for round in 0..=rounds {
        let peak = if round == 0 {
            Peak::Checked
        } else {
            Peak::Untracked
        };
        for i in 0..n {
            let v = &mut variants[(round + i) % n];
            if v.failed.is_some() {
                continue;
            }
            gpucache::empty_cache();
            let r = replay::replay_cold(&ops, dev, v.mode, peak);
            gpucache::empty_cache();
            match r {
                Ok(r) => v.replays.push(r),
                Err(e) => {
                    println!("{}: failed in round {round}: {e}", v.label);
                    v.failed = Some(e.to_string());
                }
            }
        }
    }
    // Host time per step of a replay: the mean of the steps after the second.
    let per_step = |r: &Replay| {
        let t = if r.step_seconds.len() > 2 {
            &r.step_seconds[2..]
        } else {
            &r.step_seconds[..]
        };
        t.iter().sum::<f64>() / t.len().max(1) as f64
    };
    if variants[n - 1].failed.is_some() {
        return Err(format!("{log}: the baseline failed").into());
    }
    let base: Vec<f64> = variants[n - 1].replays[1..].iter().map(per_step).collect();
    let base_median = median(&base);
    let later_steps = steps.saturating_sub(2);
    let mut rows = Vec::new();
    println!(
        "| variant | peak / peak live | peak MiB | device allocations in steps 3.. ({later_steps} steps) \
         (in the second half) | host time per step, median [min, max] | / {} |",
        variants[n - 1].label
    );
    println!("|---|---|---|---|---|---|");
    for v in &variants {
        if v.failed.is_some() {
            println!("| {} | failed | | | | |", v.label);
            rows.push(Row {
                label: v.label.clone(),
                peak: 0,
                allocs_after_step2: 0,
                allocs_in_second_half: 0,
                later_steps,
                median: f64::NAN,
                range: (f64::NAN, f64::NAN),
                ratio: f64::NAN,
                ratio_range: (f64::NAN, f64::NAN),
            });
            continue;
        }
        let first = &v.replays[0];
        let peak = if matches!(v.mode, Mode::Pool { .. }) {
            v.replays.iter().map(|r| r.peak_bytes).max().unwrap_or(0)
        } else {
            first.peak_bytes
        };
        let times: Vec<f64> = v.replays[1..].iter().map(per_step).collect();
        let ratios: Vec<f64> = times.iter().zip(&base).map(|(t, b)| t / b).collect();
        let row = Row {
            label: v.label.clone(),
            peak,
            allocs_after_step2: first.allocs_after_step2(),
            allocs_in_second_half: first.allocs_in_second_half(),
            later_steps,
            median: median(&times),
            range: min_max(&times),
            ratio: median(&times) / base_median,
            ratio_range: min_max(&ratios),
        };
        println!(
            "| {} | {:.3} | {:.1} | {} ({}) | {} µs [{}, {}] | {:.2}x [{:.2}, {:.2}] |",
            row.label,
            row.peak as f64 / live.max(1) as f64,
            mib(row.peak),
            row.allocs_after_step2,
            row.allocs_in_second_half,
            us(row.median),
            us(row.range.0),
            us(row.range.1),
            row.ratio,
            row.ratio_range.0,
            row.ratio_range.1,
        );
        rows.push(row);
    }
    println!();
    Ok(Report {
        live,
        planned,
        arena,
        rows,
    })
}

/// The three tables of several logs: rows the logs, columns the variants.
fn print_summary(logs: &[(String, Report)]) {
    let Some((_, Report { rows: first, .. })) = logs.first() else {
        return;
    };
    let head = |what: &str| {
        let labels: Vec<&str> = first.iter().map(|r| r.label.as_str()).collect();
        println!("\n{what}\n\n| log | {} |", labels.join(" | "));
        println!("|---|{}", "---|".repeat(labels.len()));
    };
    let name = |log: &str| {
        let file = log.rsplit('/').next().unwrap_or(log);
        file.trim_end_matches(".gz")
            .trim_end_matches(".csv")
            .to_owned()
    };
    println!(
        "\nPeak device bytes / peak live bytes (last columns: planned steps, and one block \
         sub-allocated online, simulated from the log)\n"
    );
    let labels: Vec<&str> = first.iter().map(|r| r.label.as_str()).collect();
    println!(
        "| log | {} | planned (simulated) | online block (simulated) |",
        labels.join(" | ")
    );
    println!("|---|{}---|---|", "---|".repeat(labels.len()));
    for (
        log,
        Report {
            live,
            planned,
            arena,
            rows,
        },
    ) in logs
    {
        let cells: Vec<String> = rows
            .iter()
            .map(|r| format!("{:.3}", r.peak as f64 / (*live).max(1) as f64))
            .collect();
        println!(
            "| {} ({:.1} MiB) | {} | {:.3} | {:.3} |",
            name(log),
            mib(*live),
            cells.join(" | "),
            planned.peak as f64 / (*live).max(1) as f64,
            *arena as f64 / (*live).max(1) as f64
        );
    }
    head("Device allocations in the steps after the second (in the second half of the steps)");
    for (log, Report { rows, .. }) in logs {
        let cells: Vec<String> = rows
            .iter()
            .map(|r| format!("{} ({})", r.allocs_after_step2, r.allocs_in_second_half))
            .collect();
        let steps = rows.first().map_or(0, |r| r.later_steps);
        println!("| {} ({steps} steps) | {} |", name(log), cells.join(" | "));
    }
    head(
        "Host time per step (steps after the second), median over the rounds / the baseline's [range]",
    );
    for (log, Report { rows, .. }) in logs {
        let cells: Vec<String> = rows
            .iter()
            .map(|r| {
                format!(
                    "{} µs, {:.2}x [{:.2}, {:.2}]",
                    us(r.median),
                    r.ratio,
                    r.ratio_range.0,
                    r.ratio_range.1
                )
            })
            .collect();
        println!("| {} | {} |", name(log), cells.join(" | "));
    }
}

fn median(v: &[f64]) -> f64 {
    let mut t = v.to_vec();
    t.sort_by(f64::total_cmp);
    t.get(t.len() / 2).copied().unwrap_or(f64::NAN)
}

fn min_max(v: &[f64]) -> (f64, f64) {
    v.iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
            (lo.min(x), hi.max(x))
        })
}

fn us(seconds: f64) -> String {
    let us = seconds * 1e6;
    if us >= 100.0 {
        format!("{us:.0}")
    } else {
        format!("{us:.1}")
    }
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}
