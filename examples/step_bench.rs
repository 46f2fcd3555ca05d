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
//! A round runs each variant for a fixed number of steps, variants interleaved (the order
//! rotates from round to round); the first round is a warm-up and is not counted. The table
//! gives the median over rounds of the mean step time, and the median and range of the ratio
//! to the preallocated variant's time in the same round.
//!
//! A context with a second stream has cudarc's event tracking on: every launch that takes a
//! buffer waits for and records its events. `--no-event-tracking` turns it off before any
//! buffer is allocated (cudarc's `disable_event_tracking`; one stream, so nothing needs it).

#[path = "mlp/mod.rs"]
mod mlp;

use std::sync::Arc;
use std::time::Instant;

use gpucache::cuda::StepGraph;
use gpucache::cuda::cudarc::driver::result;
use gpucache::cuda::cudarc::driver::sys::{
    CUgraphInstantiate_flags, CUmemPool_attribute, CUstreamCaptureMode,
};
use gpucache::cuda::cudarc::driver::{CudaGraph, CudaStream};
use gpucache::{Array, Device};
use mlp::{Cached, Cudarc, Dims, Gpu, Mlp, Preallocated, Result, median};

const LEARNING_RATE: f32 = 0.01;

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
    steps: usize,
    /// Mean step time of each counted round, µs.
    times: Vec<f64>,
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
            times: Vec::new(),
        })
    }

    /// Runs `steps` steps; returns the mean step time in µs.
    fn round(&mut self, gpu: &Gpu, x: &Array<f32>, y: &Array<f32>, steps: usize) -> Result<f64> {
        if let Source::Pool(threshold) = self.source {
            set_release_threshold(&gpu.stream, threshold)?;
        }
        let (model, loss) = (&mut self.model, &mut self.loss);
        let cached = Cached(gpu.dev);
        gpu.stream.synchronize()?;
        let start = Instant::now();
        for _ in 0..steps {
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
                    let _scope = gpucache::enter("step_bench");
                    model.step(&cached, gpu, x, y, loss, LEARNING_RATE)?;
                }
                Source::Graph(graph) => {
                    graph.run(|| model.step(&cached, gpu, x, y, loss, LEARNING_RATE))?;
                }
                Source::Pool(_) => {
                    model.step(
                        &Cudarc(Arc::clone(&gpu.stream)),
                        gpu,
                        x,
                        y,
                        loss,
                        LEARNING_RATE,
                    )?;
                }
            }
            gpu.stream.synchronize()?;
        }
        self.steps += steps;
        Ok(start.elapsed().as_secs_f64() * 1e6 / steps as f64)
    }
}

/// Benchmarks one model size; prints its table.
fn bench(gpu: &Gpu, dims: Dims, rounds: usize, steps: usize, tracking: bool) -> Result<()> {
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
    let n = variants.len();
    for round in 0..=rounds {
        for i in 0..n {
            let v = &mut variants[(i + round) % n];
            let t = v.round(gpu, x, y, steps)?;
            if round > 0 {
                v.times.push(t);
            }
        }
    }
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
    println!(
        "\nMLP {layers} layers {input}-{hidden}-...-{output}, batch {batch}, {} buffers per \
         step; {rounds} rounds of {steps} steps (median over rounds; ratio to preallocated in \
         the same round, median [min, max])",
        dims.step_buffers().len()
    );
    println!("| variant | step time (µs) | ratio to preallocated | mean loss |");
    println!("|---|---:|---:|---:|");
    let base = variants[0].times.clone();
    let mut losses = Vec::new();
    for v in &variants {
        let ratios: Vec<f64> = v.times.iter().zip(&base).map(|(t, b)| t / b).collect();
        let (lo, hi) = ratios
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), &r| (lo.min(r), hi.max(r)));
        let loss = f64::from(v.loss.to_vec()?[0]) / v.steps as f64;
        losses.push(loss);
        println!(
            "| {} | {:.1} | {:.3}x [{lo:.3}, {hi:.3}] | {loss:.6} |",
            v.label,
            median(v.times.clone()),
            median(ratios),
        );
    }
    let (eager, replay) = (losses[1], losses[2]);
    println!(
        "mean loss, gpucache eager vs graph replay: {eager:.7} vs {replay:.7} (relative \
         difference {:.1e})",
        (eager - replay).abs() / eager.abs().max(f64::MIN_POSITIVE)
    );
    drop(variants);
    gpucache::invalidate("step_bench");
    gpucache::invalidate("step_bench_graph");
    Ok(())
}

fn main() -> Result<()> {
    let mut rounds = 9;
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
    bench(&gpu, small, rounds, 300, tracking)?;
    bench(&gpu, large, rounds, 20, tracking)?;
    Ok(())
}
