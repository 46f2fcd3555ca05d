//! Step benchmark: the CUDA example's MLP (4 layers, cuBLAS sgemm and NVRTC kernels), one
//! training step with its buffers from five sources, timed side by side.
//!
//! ```text
//! cargo run --release --features cuda --example step_bench [ROUNDS] [--no-event-tracking]
//! ```
//!
//! Variants: buffers preallocated by hand (allocated once, handed out in step order);
//! gpucache eager (a scope per step, every buffer a cache hit); gpucache graph replay (the
//! same step through `gpucache::cuda::StepGraph`: captured once warm, then one graph launch
//! per step); cudarc's default allocation (`cuMemAllocAsync` from the device's default pool,
//! release threshold 0, freed on drop); and `cuMemAllocAsync` with the pool's release
//! threshold at its maximum (the pool keeps what is freed); and, with event tracking off, the
//! preallocated step captured by hand with cudarc's graph API and replayed (the floor for
//! graph replay: no scope, no checks). Every variant trains its own copy
//! of the same model on the same batch, on one non-default stream (a graph cannot be captured
//! on the default stream), with one synchronisation per step (as reading the loss would
//! cost); a step's time is host wall-clock time to that synchronisation.
//!
//! # How the variants are interleaved
//!
//! The small step is bound by the host (kernel launches), so its time follows the host CPU's
//! clock and whatever else that machine does, which drift over seconds. So variants take
//! turns at a fine grain: a *turn* is one untimed step (it brings the variant's state back
//! into the CPU caches, and for the pool variants sets the pool's release threshold and lets
//! the pool settle) and then `STEPS` timed steps; a *pass* gives every variant one turn, in an
//! order shuffled anew for each pass (so no variant always follows the same one); a *round* is
//! `PASSES` passes. The round's step time of a variant is the mean over its timed steps in that
//! round, and its ratio is to the preallocated variant's time in the same round: both were
//! measured over the same second or so, turn by turn. Round 0 warms up (allocations, the
//! capture, the clocks) and is not counted. The table gives the median over rounds of the step
//! time, and the median and range of the ratio.
//!
//! After each table, the host work of the step's buffers alone is timed the same way, without
//! any device work: allocate the step's buffers, push each one as a kernel argument three
//! times (about as often as the step uses it) into a launch that is never made, drop them
//! (for gpucache: inside a scope, entered and exited each time). The difference between
//! gpucache and preallocation there is what gpucache itself costs the host per step.
//!
//! A context with a second stream has cudarc's event tracking on: every launch that takes a
//! buffer waits for and records its events. `--no-event-tracking` turns it off before any
//! buffer is allocated (cudarc's `disable_event_tracking`; one stream, so nothing needs it).

use gpucache_suite::mlp;

use std::sync::Arc;
use std::time::Instant;

use gpucache::cuda::StepGraph;
use gpucache::cuda::cudarc::driver::result;
use gpucache::cuda::cudarc::driver::sys::{
    CUgraphInstantiate_flags, CUmemPool_attribute, CUstreamCaptureMode,
};
use gpucache::cuda::cudarc::driver::{CudaGraph, CudaStream};
use gpucache::{Array, Device};
use mlp::{Allocator, Buffer, Cached, Cudarc, Dims, Gpu, Mlp, Preallocated, Result, median};

const LEARNING_RATE: f32 = 0.01;
/// The cache of the eager variant (and of the host-work measurement).
const EAGER_CACHE: &str = "step_bench";
/// The cache of the host-work measurement.
const HOST_CACHE: &str = "step_bench_host";

/// Where a variant's buffers come from.
enum Source {
    Preallocated(Preallocated),
    /// The preallocated step captured by hand with cudarc's graph API (event tracking off),
    /// then replayed.
    HandGraph(Preallocated, Option<CudaGraph>),
    Eager,
    Graph(StepGraph),
    /// cuMemAllocAsync with the pool's release threshold set to this.
    Pool(u64),
}

struct Variant {
    label: &'static str,
    source: Source,
    model: Mlp,
    loss: Array<f32>,
    /// Steps run (timed or not): the loss sums over all of them.
    steps: usize,
    times: Times,
}

/// A variant's timings: the timed steps of the round in progress, and the mean step time of
/// each counted round.
#[derive(Default)]
struct Times {
    steps: usize,
    total: f64,
    rounds: Vec<f64>,
}

impl Times {
    fn add(&mut self, steps: usize, total: f64) {
        self.steps += steps;
        self.total += total;
    }

    /// Ends a round; keeps its mean when `counted`.
    fn end_round(&mut self, counted: bool) {
        if counted {
            self.rounds.push(self.total / self.steps as f64);
        }
        (self.steps, self.total) = (0, 0.0);
    }
}

/// How long a benchmark runs: `rounds` counted rounds (after one warm-up round) of `passes`
/// passes, in which each variant runs one untimed step and `steps` timed ones.
#[derive(Clone, Copy)]
struct Plan {
    rounds: usize,
    passes: usize,
    steps: usize,
}

/// Sets the release threshold of `stream`'s device's default memory pool and trims the pool
/// to it.
fn set_release_threshold(stream: &CudaStream, bytes: u64) -> Result<()> {
    let ctx = stream.context();
    ctx.bind_to_thread()?;
    stream.synchronize()?;
    let mut value = bytes;
    // SAFETY: the device comes from a live context; the attribute takes a `u64` (cuuint64_t),
    // which `value` is, alive for the call.
    unsafe {
        let pool = result::device::get_default_mem_pool(ctx.cu_device())?;
        let attr = CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
        result::mem_pool::set_attribute(pool, attr, (&raw mut value).cast())?;
        result::mem_pool::trim_to(pool, usize::try_from(bytes).unwrap_or(usize::MAX))?;
    }
    Ok(())
}

impl Variant {
    fn new(label: &'static str, source: Source, dims: &Dims, dev: Device) -> Result<Variant> {
        Ok(Variant {
            label,
            source,
            model: Mlp::new(dev, dims, 42)?,
            loss: Array::zeros(dev, 1)?,
            steps: 0,
            times: Times::default(),
        })
    }

    /// One step, up to its synchronisation.
    fn step(&mut self, gpu: &Gpu, x: &Array<f32>, y: &Array<f32>) -> Result<()> {
        let (model, loss) = (&mut self.model, &mut self.loss);
        let cached = Cached(gpu.dev);
        match &mut self.source {
            Source::Preallocated(pre) => {
                pre.rewind();
                model.step(pre, gpu, x, y, loss, LEARNING_RATE)?;
            }
            Source::HandGraph(pre, graph) => {
                if graph.is_none() {
                    pre.rewind();
                    let mode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
                    gpu.stream.begin_capture(mode)?;
                    model.step(pre, gpu, x, y, loss, LEARNING_RATE)?;
                    *graph = gpu.stream.end_capture(CUgraphInstantiate_flags(0))?;
                }
                graph.as_ref().ok_or("empty graph")?.launch()?;
            }
            Source::Eager => {
                let _scope = gpucache::enter(EAGER_CACHE);
                model.step(&cached, gpu, x, y, loss, LEARNING_RATE)?;
            }
            Source::Graph(graph) => {
                graph.run(|| model.step(&cached, gpu, x, y, loss, LEARNING_RATE))?;
            }
            Source::Pool(_) => {
                let alloc = Cudarc(Arc::clone(&gpu.stream));
                model.step(&alloc, gpu, x, y, loss, LEARNING_RATE)?;
            }
        }
        gpu.stream.synchronize()?;
        self.steps += 1;
        Ok(())
    }

    /// One turn: an untimed step, then `steps` timed ones, added to the round's time.
    fn turn(&mut self, gpu: &Gpu, x: &Array<f32>, y: &Array<f32>, steps: usize) -> Result<()> {
        if let Source::Pool(threshold) = self.source {
            set_release_threshold(&gpu.stream, threshold)?;
        }
        self.step(gpu, x, y)?;
        let start = Instant::now();
        for _ in 0..steps {
            self.step(gpu, x, y)?;
        }
        self.times.add(steps, start.elapsed().as_secs_f64() * 1e6);
        Ok(())
    }
}

/// Runs `plan`: `turn` on each of `items` once per pass, in an order shuffled for each pass;
/// ends each round in every item's [`Times`] (round 0 is not counted).
fn interleave<T>(
    items: &mut [T],
    plan: Plan,
    mut turn: impl FnMut(&mut T) -> Result<()>,
    times: impl Fn(&mut T) -> &mut Times,
) -> Result<()> {
    let mut rng = fastrand::Rng::with_seed(0x5eed);
    let mut order: Vec<usize> = (0..items.len()).collect();
    for round in 0..=plan.rounds {
        for _ in 0..plan.passes {
            rng.shuffle(&mut order);
            for &i in &order {
                turn(&mut items[i])?;
            }
        }
        for item in items.iter_mut() {
            times(item).end_round(round > 0);
        }
    }
    Ok(())
}

/// `f(a, b)` of each round's `a` and `b`: the median, min and max over rounds.
fn per_round(a: &[f64], b: &[f64], f: impl Fn(f64, f64) -> f64) -> (f64, f64, f64) {
    let v: Vec<f64> = a.iter().zip(b).map(|(&a, &b)| f(a, b)).collect();
    let (lo, hi) = v
        .iter()
        .fold((f64::MAX, f64::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
    (median(v), lo, hi)
}

/// Benchmarks one model size; prints its table and the host work of its buffers.
fn bench(gpu: &Gpu, dims: Dims, plan: Plan, tracking: bool) -> Result<()> {
    let dev = gpu.dev;
    let data = dims.data(gpu, 1, 1)?;
    let (x, y) = &data[0];
    let preallocated = || -> Result<Preallocated> {
        let mut pre = Preallocated::new(Arc::clone(&gpu.stream));
        pre.allocate(&dims.step_buffers())?;
        Ok(pre)
    };
    let graph = StepGraph::new("step_bench_graph", dev);
    let pre = Source::Preallocated(preallocated()?);
    let mut variants = vec![
        Variant::new("preallocated by hand", pre, &dims, dev)?,
        Variant::new("gpucache eager", Source::Eager, &dims, dev)?,
        Variant::new("gpucache graph replay", Source::Graph(graph), &dims, dev)?,
        Variant::new("cudarc default (threshold 0)", Source::Pool(0), &dims, dev)?,
        Variant::new(
            "cuMemAllocAsync, threshold max",
            Source::Pool(u64::MAX),
            &dims,
            dev,
        )?,
    ];
    if !tracking {
        let hand = Source::HandGraph(preallocated()?, None);
        variants.push(Variant::new(
            "preallocated, captured by hand",
            hand,
            &dims,
            dev,
        )?);
    }
    interleave(
        &mut variants,
        plan,
        |v| v.turn(gpu, x, y, plan.steps),
        |v| &mut v.times,
    )?;
    set_release_threshold(&gpu.stream, 0)?;
    if let Source::Graph(graph) = &variants[2].source {
        if !graph.is_captured() || graph.captures() != 1 {
            return Err(format!("the graph was captured {} times", graph.captures()).into());
        }
        println!(
            "graph: captured once, replayed {} times, holds {:.1} MiB",
            graph.replays(),
            graph.held_bytes() as f64 / (1 << 20) as f64
        );
    }

    let Dims {
        batch,
        input,
        hidden,
        output,
        layers,
    } = dims;
    let Plan {
        rounds,
        passes,
        steps,
    } = plan;
    println!(
        "\nMLP {layers} layers {input}-{hidden}-...-{output}, batch {batch}, {} buffers per \
         step; {rounds} rounds of {passes} passes, each variant 1 untimed + {steps} timed \
         steps per pass, in shuffled order (median over rounds; ratio to preallocated in the \
         same round, median [min, max])",
        dims.step_buffers().len()
    );
    println!("| variant | step time (µs) | ratio to preallocated | mean loss |");
    println!("|---|---:|---:|---:|");
    let base = variants[0].times.rounds.clone();
    let mut losses = Vec::new();
    for v in &variants {
        let (r, lo, hi) = per_round(&v.times.rounds, &base, |t, b| t / b);
        let loss = f64::from(v.loss.to_vec()?[0]) / v.steps as f64;
        losses.push(loss);
        println!(
            "| {} | {:.1} | {r:.3}x [{lo:.3}, {hi:.3}] | {loss:.6} |",
            v.label,
            median(v.times.rounds.clone()),
        );
    }
    let (eager, replay) = (losses[1], losses[2]);
    println!(
        "mean loss, gpucache eager vs graph replay: {eager:.7} vs {replay:.7} (relative \
         difference {:.1e})",
        (eager - replay).abs() / eager.abs().max(f64::MIN_POSITIVE)
    );
    host_work(gpu, &dims, rounds, median(base))?;
    drop(variants);
    gpucache::invalidate(EAGER_CACHE);
    gpucache::invalidate("step_bench_graph");
    Ok(())
}

/// The host side of a step's buffers, no device work: allocates the step's buffers (all
/// `empty`), pushes each as a kernel argument three times into a launch that is never made,
/// and drops them.
fn buffers<A: Allocator>(alloc: &A, gpu: &Gpu, sizes: &[usize]) -> Result<()> {
    let bufs = sizes
        .iter()
        .map(|&n| alloc.empty(n))
        .collect::<Result<Vec<_>>>()?;
    let mut args = gpu.stream.launch_builder(&gpu.k.sgd);
    for buf in &bufs {
        for _ in 0..3 {
            buf.input(&mut args);
        }
    }
    drop(args);
    drop(bufs);
    Ok(())
}

/// Times [`buffers`] with preallocated buffers (`Some`) and with gpucache (`None`: a scope per
/// step), turn by turn as the steps are; prints the difference per step and its share of
/// `step_us`, the preallocated step's time.
fn host_work(gpu: &Gpu, dims: &Dims, rounds: usize, step_us: f64) -> Result<()> {
    let sizes = dims.step_buffers();
    let mut pre = Preallocated::new(Arc::clone(&gpu.stream));
    pre.allocate(&sizes)?;
    let cached = Cached(gpu.dev);
    let mut sides = [(Some(pre), Times::default()), (None, Times::default())];
    let plan = Plan {
        rounds,
        passes: 20,
        steps: 200,
    };
    let step = |pre: &mut Option<Preallocated>| match pre {
        Some(pre) => {
            pre.rewind();
            buffers(pre, gpu, &sizes)
        }
        None => {
            // A cache of its own: its steps are not the eager steps' (a plan each).
            let _scope = gpucache::enter(HOST_CACHE);
            buffers(&cached, gpu, &sizes)
        }
    };
    // Warm: the first step records, the second makes the plan's block.
    step(&mut None)?;
    step(&mut None)?;
    // As for the steps: an untimed iteration, then the timed ones.
    let turn = |(pre, times): &mut (Option<Preallocated>, Times)| -> Result<()> {
        step(pre)?;
        let start = Instant::now();
        for _ in 0..plan.steps {
            step(pre)?;
        }
        times.add(plan.steps, start.elapsed().as_secs_f64() * 1e9);
        Ok(())
    };
    let misses = gpucache::stats(HOST_CACHE).misses;
    interleave(&mut sides, plan, turn, |(_, times)| times)?;
    if gpucache::stats(HOST_CACHE).misses != misses {
        return Err("the host-work measurement missed the warm cache".into());
    }
    let [(_, pre), (_, gpucache)] = &sides;
    let (pre, gpucache) = (&pre.rounds, &gpucache.rounds);
    let (diff, lo, hi) = per_round(gpucache, pre, |g, p| g - p);
    println!(
        "host work of the step's {} buffers alone (allocate, 3 kernel-argument pushes each, \
         drop; no device work), {rounds} rounds: preallocated {:.0} ns, gpucache eager {:.0} ns \
         (scope entry and exit included); gpucache - preallocated: {diff:.0} ns per step \
         [{lo:.0}, {hi:.0}], {:.2}% of the preallocated step",
        sizes.len(),
        median(pre.clone()),
        median(gpucache.clone()),
        diff / 1e3 / step_us * 100.0,
    );
    Ok(())
}

fn main() -> Result<()> {
    let mut rounds = 21;
    let mut tracking = true;
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--no-event-tracking" => tracking = false,
            n => rounds = n.parse::<usize>()?.max(1),
        }
    }
    let dev = Device::cuda(0)?;
    let ctx = gpucache::cuda::context(dev)?;
    if !tracking {
        // SAFETY: called before any buffer of the benchmark exists; all of its work runs on one
        // stream, so no buffer needs events to order its uses.
        unsafe { ctx.disable_event_tracking() };
    }
    let stream = ctx.new_stream()?;
    let _on = gpucache::cuda::use_stream(&stream)?;
    println!(
        "{}; cudarc event tracking {}",
        ctx.name()?,
        if ctx.is_managing_stream_synchronization() {
            "on"
        } else {
            "off"
        }
    );
    let gpu = Gpu::new(dev)?;
    gpu.check_matmul()?;
    let small = Dims {
        batch: 32,
        input: 256,
        hidden: 256,
        output: 64,
        layers: 4,
    };
    let large = Dims {
        batch: 512,
        input: 4096,
        hidden: 4096,
        output: 64,
        layers: 4,
    };
    // A pass takes about 10 ms of each variant's steps on the small model and 20 ms on the
    // large one; a round, a few hundred ms of each.
    let small_plan = Plan {
        rounds,
        passes: 30,
        steps: 10,
    };
    let large_plan = Plan {
        rounds,
        passes: 5,
        steps: 4,
    };
    bench(&gpu, small, small_plan, tracking)?;
    bench(&gpu, large, large_plan, tracking)?;
    Ok(())
}
