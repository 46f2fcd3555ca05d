//! Trains the MLP of `train_cuda` (`gpucache_suite::mlp`) data-parallel over several GPUs with
//! NCCL, each step in a `#[cache_scope]` on its GPU, gradients all-reduced on cached arrays.
//!
//! ```text
//! cargo run --release --features nccl --example train_ddp [threads|processes] [ROUNDS] [STEPS] [GPUS]
//! ```
//!
//! * `threads` (the default): one process, one thread per GPU; the threads share an NCCL
//!   unique id made by the main thread.
//! * `processes`: one process per GPU, as `torchrun` starts them, the set-up that spans hosts.
//!   The example re-executes itself once per rank with `RANK`, `LOCAL_RANK` (the GPU),
//!   `WORLD_SIZE` and the NCCL unique id (`GPUCACHE_NCCL_ID`, 256 hexadecimal digits) in the
//!   environment, and waits for the ranks. A process started with those variables set is a rank:
//!   a launcher on each host can start the ranks of that host the same way. The children keep
//!   `NCCL_NVLS_ENABLE` (set to 0 when the launcher's environment does not set it: no NVLink
//!   multicast objects).
//!
//! The global batch (2048 rows, MLP 1024-4096-64) is split evenly over the GPUs. Each rank
//! computes the gradients of its shard, the gradients are averaged over the ranks with NCCL
//! (`all_reduce(.., Avg)` inside one NCCL group) and every rank applies the same update, so the
//! model stays identical on every GPU and follows the single-GPU run on the whole batch. Rank 0
//! also trains that single-GPU run, on GPU 0, for reference.
//!
//! Each round (at least 7, interleaved) trains one epoch of `STEPS` steps of three runs: the
//! single-GPU run (gpucache), the data-parallel run with gpucache (steps in the `ddp_step`
//! scope) and the same data-parallel run without it (the same code outside any scope: every
//! array is allocated with cuMemAllocAsync and freed on drop, cudarc's default). It prints the
//! loss trajectories (the data-parallel ones must match the single-GPU one within a relative
//! `TOLERANCE`, or the example fails), device memory in use on each GPU after every step of the
//! cached run, the median step times with their per-round ratios, and the throughput of all
//! GPUs against one.

use gpucache_suite::mlp;

use std::process::Command;
use std::time::Instant;

use gpucache::cache_scope; // the block macro; the prelude brings the attribute
use gpucache::nccl::{Comm, ReduceOp, UniqueId};
use gpucache::prelude::*;
use mlp::{Cached, Dims, Gpu, Grad, Mlp, Result, median, mib};

/// The model and the global batch, split over the GPUs.
const GLOBAL: Dims = Dims {
    batch: 2048,
    input: 1024,
    hidden: 4096,
    output: 64,
    layers: 2,
};
const LEARNING_RATE: f32 = 0.05;
/// Distinct global batches of data; an epoch cycles through them.
const DATA_BATCHES: usize = 8;
/// The largest relative difference allowed between a data-parallel epoch loss and the
/// single-GPU one. The two compute the same gradients in exact arithmetic, but not with the same
/// float roundings (cuBLAS multiplies a 1024-row shard with other kernels than a 2048-row batch,
/// and NCCL sums the ranks' halves). Measured on two H200s: within 5.2e-3 on 2 GPUs, within
/// 1e-5 with one GPU in the data-parallel run (`GPUS` = 1: the shard is the whole batch and the
/// all-reduce is the identity).
const TOLERANCE: f32 = 1e-2;

/// The environment of a rank started by the `processes` launcher.
const ID_VAR: &str = "GPUCACHE_NCCL_ID";

/// One rank: its GPU (stream, cuBLAS, kernels) and its communicator.
struct Rank {
    rank: usize,
    world: usize,
    gpu: Gpu,
    comm: Comm,
}

impl Rank {
    /// Waits for every rank (a one-byte all-reduce, then a synchronisation).
    fn barrier(&self) -> Result<()> {
        let mut token = Array::<u8>::zeros(self.gpu.dev, 1)?;
        self.comm.all_reduce(&mut token, ReduceOp::Sum)?;
        self.gpu.stream.synchronize()?;
        Ok(())
    }

    /// Rows `rank * n / world ..` of the row-major matrix `a` (`n` rows), copied on the GPU.
    fn shard(&self, a: &Array<f32>) -> Result<Array<f32>> {
        let (rows, cols) = (a.shape().dims()[0] / self.world, a.shape().dims()[1]);
        let mut out = Array::<f32>::empty(self.gpu.dev, [rows, cols])?;
        let view = a.cuda_view()?;
        let start = self.rank * rows * cols;
        let part = view.slice(start..start + rows * cols);
        self.gpu.stream.memcpy_dtod(&part, &mut out)?;
        Ok(out)
    }
}

/// A batch: inputs and targets.
type Batch = (Array<f32>, Array<f32>);

/// One data-parallel step: this rank's gradients, averaged over the ranks, applied.
fn ddp_step(r: &Rank, model: &mut Mlp, (x, y): &Batch, loss: &mut Array<f32>) -> Result<()> {
    let mut grads = model.gradients(&Cached(r.gpu.dev), &r.gpu, x, y, loss)?;
    average(r, &mut grads)?;
    model.update(&r.gpu, &grads, LEARNING_RATE)
}

/// Averages each layer's gradients over the ranks, in place: one NCCL group, so that the
/// all-reduces are launched together.
fn average(r: &Rank, grads: &mut [Grad<Array<f32>>]) -> Result<()> {
    gpucache::nccl::group(|| {
        for g in grads.iter_mut() {
            r.comm.all_reduce(&mut g.w, ReduceOp::Avg)?;
            r.comm.all_reduce(&mut g.b, ReduceOp::Avg)?;
        }
        Ok(())
    })?;
    Ok(())
}

/// [`ddp_step`] in the `ddp_step` scope: its activations and gradients are recycled.
#[cache_scope(ddp_step)]
fn cached_ddp_step(r: &Rank, model: &mut Mlp, batch: &Batch, loss: &mut Array<f32>) -> Result<()> {
    ddp_step(r, model, batch, loss)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Single,
    DdpCached,
    DdpUncached,
}

/// One training run: its model, epoch losses, step times and (for the cached data-parallel
/// run) device memory in use after each step.
struct Run {
    kind: Kind,
    model: Mlp,
    losses: Vec<f32>,
    /// Step times per round, ms.
    times_ms: Vec<Vec<f64>>,
    mem: Vec<usize>,
    /// The `ddp_step` cache's misses after the run's first step.
    first_misses: Option<u64>,
}

impl Run {
    fn new(kind: Kind, dev: Device) -> Result<Run> {
        Ok(Run {
            kind,
            model: Mlp::new(dev, &GLOBAL, 42)?,
            losses: Vec::new(),
            times_ms: Vec::new(),
            mem: Vec::new(),
            first_misses: None,
        })
    }

    /// One epoch of `steps` steps over `data`; the loss is averaged over the ranks.
    fn epoch(&mut self, r: &Rank, data: &[Batch], steps: usize) -> Result<()> {
        let gpu = &r.gpu;
        let mut loss = Array::<f32>::zeros(gpu.dev, 1)?;
        let mut times = Vec::with_capacity(steps);
        gpu.stream.synchronize()?;
        for i in 0..steps {
            let batch = &data[i % data.len()];
            let (x, y) = batch;
            let start = Instant::now();
            match self.kind {
                // The single-GPU reference step on the whole global batch, in its own scope.
                Kind::Single => cache_scope!(single_step, {
                    let alloc = Cached(gpu.dev);
                    self.model
                        .step(&alloc, gpu, x, y, &mut loss, LEARNING_RATE)?
                }),
                Kind::DdpCached => cached_ddp_step(r, &mut self.model, batch, &mut loss)?,
                Kind::DdpUncached => ddp_step(r, &mut self.model, batch, &mut loss)?,
            }
            gpu.stream.synchronize()?;
            times.push(start.elapsed().as_secs_f64() * 1e3);
            if self.kind == Kind::DdpCached {
                self.mem.push(gpu.in_use()?);
                self.first_misses
                    .get_or_insert(gpucache::stats("ddp_step").misses);
            }
        }
        if self.kind != Kind::Single {
            r.comm.all_reduce(&mut loss, ReduceOp::Avg)?;
        }
        self.losses.push(loss.to_vec()?[0] / steps as f32);
        self.times_ms.push(times);
        Ok(())
    }

    /// The median step time of each round.
    fn round_medians(&self) -> Vec<f64> {
        self.times_ms.iter().map(|t| median(t.clone())).collect()
    }
}

/// Median and range of `a[i] / b[i]`.
fn ratio(a: &[f64], b: &[f64]) -> (f64, f64, f64) {
    let r: Vec<f64> = a.iter().zip(b).map(|(a, b)| a / b).collect();
    let (lo, hi) = r
        .iter()
        .fold((f64::MAX, f64::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
    (median(r), lo, hi)
}

/// What one rank does, in either set-up: joins the communicator, trains, and (rank 0) reports.
fn run_rank(
    rank: usize,
    world: usize,
    gpu_ordinal: usize,
    id: &UniqueId,
    rounds: usize,
    steps: usize,
) -> Result<()> {
    let dev = Device::cuda(gpu_ordinal)?;
    let gpu = Gpu::new(dev)?;
    if rank == 0 {
        gpu.check_matmul()?;
    }
    let comm = Comm::new(dev, rank, world, id)?;
    let r = Rank {
        rank,
        world,
        gpu,
        comm,
    };
    // Every rank makes the same global batches (same seed) and keeps its shard.
    let global = GLOBAL.data(&r.gpu, DATA_BATCHES, 1)?;
    let shards = global
        .iter()
        .map(|(x, y)| Ok((r.shard(x)?, r.shard(y)?)))
        .collect::<Result<Vec<_>>>()?;
    // Rank 0 keeps the whole batches, and trains the single-GPU reference on them.
    let (global, mut single) = if rank == 0 {
        (global, Some(Run::new(Kind::Single, dev)?))
    } else {
        (Vec::new(), None)
    };
    let mut cached = Run::new(Kind::DdpCached, dev)?;
    let mut uncached = Run::new(Kind::DdpUncached, dev)?;
    // Every rank starts from rank 0's weights (the seeds agree already; frameworks broadcast).
    for model in [&mut cached.model, &mut uncached.model] {
        for layer in &mut model.layers {
            r.comm.broadcast(&mut layer.w, 0)?;
            r.comm.broadcast(&mut layer.b, 0)?;
        }
    }
    first_step_gradients(
        &r,
        &cached.model,
        &shards[0],
        single.as_ref().zip(global.first()),
    )?;
    for _round in 0..rounds {
        if let Some(single) = &mut single {
            single.epoch(&r, &global, steps)?;
        }
        r.barrier()?; // the other ranks wait while rank 0 runs the single-GPU epoch
        cached.epoch(&r, &shards, steps)?;
        uncached.epoch(&r, &shards, steps)?;
    }

    // Memory: device memory in use on this GPU after every step of the cached run.
    let s = gpucache::stats("ddp_step");
    let first = cached.mem[0];
    let rest = &cached.mem[1..];
    let (lo, hi) = (
        rest.iter().copied().min().unwrap_or(first),
        rest.iter().copied().max().unwrap_or(first),
    );
    println!(
        "[rank {rank}] {dev}: device memory in use after step 1: {:.1} MiB; over steps 2..{}: \
         {:.1} to {:.1} MiB ({}); ddp_step cache: {} misses after step 1, {} at the end, {} hits, \
         {:.1} MiB cached",
        mib(first),
        cached.mem.len(),
        mib(lo),
        mib(hi),
        if lo == hi { "flat" } else { "NOT flat" },
        cached.first_misses.unwrap_or(0),
        s.misses,
        s.hits,
        mib(s.bytes_cached)
    );
    r.barrier()?;
    let outcome = match single {
        Some(single) => report(&r, &single, &cached, &uncached, steps),
        None => Ok(()),
    };
    r.barrier()?; // every rank waits for the report, whatever it found
    outcome
}

/// The first step's gradients, all-reduced over the ranks, against the single-GPU gradients on
/// the whole batch (rank 0, which holds `reference`: the single-GPU run and the global batch).
/// Printed, not checked: float sums in another order differ in the last bits.
fn first_step_gradients(
    r: &Rank,
    model: &Mlp,
    (x, y): &Batch,
    reference: Option<(&Run, &Batch)>,
) -> Result<()> {
    let alloc = Cached(r.gpu.dev);
    let mut loss = Array::<f32>::zeros(r.gpu.dev, 1)?;
    let mut grads = model.gradients(&alloc, &r.gpu, x, y, &mut loss)?;
    average(r, &mut grads)?;
    let Some((single, (gx, gy))) = reference else {
        return Ok(());
    };
    let expected = single.model.gradients(&alloc, &r.gpu, gx, gy, &mut loss)?;
    let mut worst = 0.0f32;
    for (g, e) in grads.iter().zip(&expected) {
        for (got, want) in [(&g.w, &e.w), (&g.b, &e.b)] {
            let (got, want) = (got.to_vec()?, want.to_vec()?);
            let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let diff = got
                .iter()
                .zip(&want)
                .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
            worst = worst.max(diff / scale.max(f32::MIN_POSITIVE));
        }
    }
    println!(
        "first step: gradients all-reduced over {} GPUs against one GPU on the whole batch: largest \
         difference {worst:.2e} of each tensor's largest gradient",
        r.world
    );
    Ok(())
}

/// Rank 0's report: loss trajectories, step times, throughput.
fn report(r: &Rank, single: &Run, cached: &Run, uncached: &Run, steps: usize) -> Result<()> {
    let world = r.world;
    println!(
        "loss per round ({steps} steps each), 1 GPU on the global batch of {} against {world} \
         GPUs on {} rows each:",
        GLOBAL.batch,
        GLOBAL.batch / world
    );
    let mut worst = 0.0f32;
    for (i, ((s, c), u)) in single
        .losses
        .iter()
        .zip(&cached.losses)
        .zip(&uncached.losses)
        .enumerate()
    {
        let rel = ((c - s) / s).abs().max(((u - s) / s).abs());
        worst = if rel.is_nan() {
            f32::INFINITY
        } else {
            worst.max(rel)
        };
        println!(
            "  round {i}: 1 GPU {s:.6}  {world} GPUs gpucache {c:.6}  {world} GPUs no cache \
             {u:.6}  max relative difference {rel:.2e}"
        );
    }
    println!(
        "loss trajectories agree within {worst:.2e} (tolerance {TOLERANCE:.0e}); gpucache and no \
         cache bitwise {}",
        if cached.losses == uncached.losses {
            "equal"
        } else {
            "different"
        }
    );
    let rounds = single.times_ms.len();
    let (s, c, u) = (
        single.round_medians(),
        cached.round_medians(),
        uncached.round_medians(),
    );
    let (uc, uc_lo, uc_hi) = ratio(&u, &c);
    println!(
        "median step time over {rounds} interleaved rounds of {steps} steps: {world} GPUs with \
         gpucache {:.3} ms, without (cuMemAllocAsync, release threshold 0) {:.3} ms: {uc:.2}x \
         (per-round ratios {uc_lo:.2}x to {uc_hi:.2}x)",
        median(c.clone()),
        median(u.clone())
    );
    let (sc, sc_lo, sc_hi) = ratio(&s, &c);
    let per_s = |ms: f64| GLOBAL.batch as f64 / ms * 1e3;
    println!(
        "throughput: 1 GPU {:.0} samples/s, {world} GPUs {:.0} samples/s: {sc:.2}x (per-round \
         ratios {sc_lo:.2}x to {sc_hi:.2}x)",
        per_s(median(s.clone())),
        per_s(median(c.clone()))
    );
    if worst > TOLERANCE {
        return Err(format!(
            "the data-parallel loss left the single-GPU one: {worst:.2e} > {TOLERANCE:.0e}"
        )
        .into());
    }
    Ok(())
}

/// `processes` mode: starts one rank per GPU (this program again, with the rank's environment)
/// and waits for them.
fn launch_processes(world: usize) -> Result<()> {
    let id = UniqueId::new()?; // its bootstrap listener lives in this process while ranks join
    let exe = std::env::current_exe()?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let nvls = std::env::var("NCCL_NVLS_ENABLE").unwrap_or_else(|_| "0".to_owned());
    let children = (0..world)
        .map(|rank| {
            Command::new(&exe)
                .args(&args)
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env(ID_VAR, id.to_string())
                .env("NCCL_NVLS_ENABLE", &nvls)
                .spawn()
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    // Wait for every rank; when one fails, the others would wait for it in their next
    // collective forever: stop them.
    let mut running: Vec<(usize, std::process::Child)> = children.into_iter().enumerate().collect();
    let mut failed = Vec::new();
    while !running.is_empty() {
        let mut still = Vec::new();
        for (rank, mut child) in running {
            match child.try_wait()? {
                Some(status) if !status.success() => failed.push(format!("rank {rank}: {status}")),
                Some(_) => {}
                None => still.push((rank, child)),
            }
        }
        if !failed.is_empty() {
            for (_, child) in &mut still {
                child.kill()?;
                child.wait()?;
            }
            return Err(format!("ranks failed: {}", failed.join(", ")).into());
        }
        running = still;
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    Ok(())
}

/// A number from the environment.
fn env_number(var: &str) -> Result<usize> {
    let v = std::env::var(var).map_err(|_| format!("{var} is not set"))?;
    Ok(v.parse()
        .map_err(|_| format!("{var}={v:?} is not a number"))?)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mode, numbers) = match args.first().map(String::as_str) {
        Some(m @ ("threads" | "processes")) => (m, &args[1..]),
        _ => ("threads", &args[..]),
    };
    let mut numbers = numbers.iter().map(|a| a.parse::<usize>());
    let rounds = numbers.next().transpose()?.unwrap_or(8).max(1);
    let steps = numbers.next().transpose()?.unwrap_or(50).max(2);
    let world = numbers.next().transpose()?.unwrap_or(2).max(1);
    if !GLOBAL.batch.is_multiple_of(world) {
        return Err(format!("{world} GPUs do not split a batch of {}", GLOBAL.batch).into());
    }

    // A rank started by a launcher (this one's `processes` mode, or one per host).
    if let Ok(id) = std::env::var(ID_VAR) {
        let id: UniqueId = id.parse()?;
        let (rank, world) = (env_number("RANK")?, env_number("WORLD_SIZE")?);
        let local = env_number("LOCAL_RANK").unwrap_or(rank);
        return run_rank(rank, world, local, &id, rounds, steps);
    }

    let (major, minor, patch) = gpucache::nccl::version()?;
    println!(
        "train_ddp: {mode}, {world} GPUs, NCCL {major}.{minor}.{patch}, NCCL_NVLS_ENABLE={}; MLP \
         {}-{}-{}, global batch {}, {rounds} rounds of {steps} steps",
        std::env::var("NCCL_NVLS_ENABLE").unwrap_or_else(|_| "(unset)".to_owned()),
        GLOBAL.input,
        GLOBAL.hidden,
        GLOBAL.output,
        GLOBAL.batch
    );
    if mode == "processes" {
        return launch_processes(world);
    }
    let id = UniqueId::new()?;
    std::thread::scope(|s| {
        let ranks: Vec<_> = (0..world)
            .map(|rank| {
                s.spawn(move || {
                    run_rank(rank, world, rank, &id, rounds, steps).map_err(|e| e.to_string())
                })
            })
            .collect();
        let results: Vec<_> = ranks
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| "a rank panicked".to_owned())
                    .and_then(|r| r)
            })
            .collect();
        results.into_iter().collect::<Result<Vec<()>, String>>()
    })?;
    Ok(())
}
