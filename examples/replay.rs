//! Replays an allocation log (examples/replay: a CSV made from a recorded trace) through gpucache,
//! in the recorded scopes, and through the bare backend, and compares time, peak bytes and
//! device allocations, as RMM's replay benchmark does for its logs.
//!
//! ```text
//! cargo run --release --example replay -- tests/fixtures/train_cuda.csv cpu 7
//! cargo run --release --features cuda --example replay -- tests/fixtures/train_cuda.csv cuda 7
//! ```
//!
//! The two replays alternate (which goes first alternates too) for the given number of rounds;
//! each round replays the whole log and ends with `empty_cache`, so every round starts cold. The
//! ratio is taken per round; the median and the range are printed.

#[path = "replay/mod.rs"]
mod replay;

use std::path::PathBuf;

use gpucache::Device;
use replay::{Mode, Replay, Result};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (log, device, rounds) = match args.as_slice() {
        [log] => (log, "cpu", 7),
        [log, device] => (log, device.as_str(), 7),
        [log, device, rounds] => (log, device.as_str(), rounds.parse()?),
        _ => return Err("usage: replay LOG.csv [cpu|cuda] [ROUNDS]".into()),
    };
    let dev = match device {
        "cpu" => Device::Cpu,
        "cuda" => Device::cuda(0)?,
        other => return Err(format!("unknown device {other:?} (cpu or cuda)").into()),
    };
    let ops = replay::read(&PathBuf::from(log))?;
    let allocs = ops
        .iter()
        .filter(|o| matches!(o, replay::Op::Alloc { .. }))
        .count();
    println!(
        "{log}: {} operations, {allocs} allocations; on {dev}, {rounds} rounds",
        ops.len()
    );
    let mut ratios = Vec::new();
    let (mut cached, mut bare) = (Vec::new(), Vec::new());
    for round in 0..rounds.max(1) {
        let order = if round % 2 == 0 {
            [Mode::Gpucache, Mode::Bare]
        } else {
            [Mode::Bare, Mode::Gpucache]
        };
        let mut got = [Replay::default(); 2];
        for mode in order {
            let r = replay::replay(&ops, dev, mode)?;
            gpucache::empty_cache();
            got[usize::from(mode == Mode::Bare)] = r;
        }
        let [c, b] = got;
        println!(
            "round {round}: gpucache {:.3} ms (peak {:.1} MiB, {} device allocations), \
             bare {:.3} ms (peak {:.1} MiB, {} device allocations)",
            c.seconds * 1e3,
            mib(c.peak_bytes),
            c.device_allocs,
            b.seconds * 1e3,
            mib(b.peak_bytes),
            b.device_allocs
        );
        ratios.push(b.seconds / c.seconds);
        cached.push(c);
        bare.push(b);
    }
    ratios.sort_by(f64::total_cmp);
    let median = |v: &[Replay]| {
        let mut t: Vec<f64> = v.iter().map(|r| r.seconds).collect();
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    };
    println!(
        "median: gpucache {:.3} ms, bare {:.3} ms; bare / gpucache {:.2}x (rounds {:.2}x to {:.2}x); \
         peak bytes gpucache {:.1} MiB, bare {:.1} MiB",
        median(&cached) * 1e3,
        median(&bare) * 1e3,
        ratios[ratios.len() / 2],
        ratios[0],
        ratios[ratios.len() - 1],
        mib(cached.iter().map(|r| r.peak_bytes).max().unwrap_or(0)),
        mib(bare.iter().map(|r| r.peak_bytes).max().unwrap_or(0)),
    );
    Ok(())
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}
