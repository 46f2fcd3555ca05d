//! Trains a two-layer MLP (`gpucache_suite::mlp`) on a CUDA GPU with cuBLAS sgemm and NVRTC
//! kernels, one gpucache scope per step, and compares the step time with cudarc's default allocation.
//!
//! ```text
//! cargo run --release --features cuda --example train_cuda [EPOCHS] [STEPS_PER_EPOCH] [--log LOG.csv]
//! ```
//!
//! With `--log`, the gpucache run's allocations are recorded (`gpucache::trace`) and written as
//! an allocation log that `examples/replay` replays (tests/fixtures/train_cuda.csv is one).
//!
//! Every step allocates its activations and gradients (8 arrays, about 50 MiB). With gpucache
//! they come from the `train_step` cache (all hits after the first step; `invalidate` between
//! epochs gives the memory back); the baseline allocates the same buffers with cudarc's
//! `CudaStream::alloc` (cuMemAllocAsync from the device's default pool, whose release threshold
//! of 0 hands memory back to the driver at every synchronisation). Same model, kernels and data,
//! epochs of the two runs interleaved, one synchronisation per step (as reading the loss would
//! cost); step times are host wall-clock time from the step's start to that synchronisation.
//! Device memory in use is read with cuMemGetInfo after synchronising.

use gpucache_suite::mlp;
use gpucache_suite::replay;

use std::sync::Arc;
use std::time::Instant;

use gpucache::{Array, Device};
use mlp::{Allocator, Cached, Cudarc, Dims, Gpu, Mlp, Result, median, mib};

const DIMS: Dims = Dims {
    batch: 1024,
    input: 1024,
    hidden: 4096,
    output: 64,
    layers: 2,
};
const LEARNING_RATE: f32 = 0.05;
/// Distinct batches of data on the GPU; an epoch cycles through them.
const DATA_BATCHES: usize = 16;

/// What a training run needs from `main`.
struct Ctx<'a> {
    gpu: &'a Gpu,
    data: &'a [(Array<f32>, Array<f32>)],
    steps: usize,
}

/// One training run: a model of its own, its buffers from `alloc`.
struct Run<A> {
    label: &'static str,
    alloc: A,
    /// Whether steps run inside the `train_step` scope.
    cached: bool,
    model: Mlp,
    losses: Vec<f32>,
    times_ms: Vec<f64>,
}

impl<A: Allocator> Run<A> {
    fn new(label: &'static str, alloc: A, cached: bool, dev: Device) -> Result<Run<A>> {
        let model = Mlp::new(dev, &DIMS, 42)?;
        let (losses, times_ms) = (Vec::new(), Vec::new());
        Ok(Run {
            label,
            alloc,
            cached,
            model,
            losses,
            times_ms,
        })
    }

    fn epoch(&mut self, epoch: usize, c: &Ctx<'_>) -> Result<()> {
        let gpu = c.gpu;
        let mut loss = Array::<f32>::zeros(gpu.dev, 1)?;
        gpu.stream.synchronize()?;
        for i in 0..c.steps {
            let (x, y) = &c.data[i % c.data.len()];
            let start = Instant::now();
            {
                let _scope = self.cached.then(|| gpucache::enter("train_step"));
                self.model
                    .step(&self.alloc, gpu, x, y, &mut loss, LEARNING_RATE)?;
            }
            gpu.stream.synchronize()?;
            self.times_ms.push(start.elapsed().as_secs_f64() * 1e3);
        }
        let mean = loss.to_vec()?[0] / c.steps as f32;
        self.losses.push(mean);
        let used = gpu.in_use()?;
        if self.cached {
            let s = gpucache::stats("train_step");
            gpucache::invalidate("train_step");
            println!(
                "[{}] epoch {epoch}: loss {mean:.5}  hits {} misses {}  cached {:.1} MiB  \
                 device memory in use {:.1} MiB, {:.1} MiB after invalidate",
                self.label,
                s.hits,
                s.misses,
                mib(s.bytes_cached),
                mib(used),
                mib(gpu.in_use()?)
            );
        } else {
            println!(
                "[{}] epoch {epoch}: loss {mean:.5}  device memory in use {:.1} MiB",
                self.label,
                mib(used)
            );
        }
        Ok(())
    }
}

fn main() -> Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let log = match args.iter().position(|a| a == "--log") {
        Some(i) if i + 1 < args.len() => Some(args.drain(i..=i + 1).nth(1).unwrap_or_default()),
        Some(_) => return Err("--log needs a file name".into()),
        None => None,
    };
    let mut args = args.into_iter().map(|a| a.parse::<usize>());
    let epochs = args.next().transpose()?.unwrap_or(5).max(1);
    let steps = args.next().transpose()?.unwrap_or(100).max(1);

    let dev = Device::cuda(0)?;
    let ctx = gpucache::cuda::context(dev)?;
    let caching = std::env::var_os("GPUCACHE_DISABLE").is_none_or(|v| v != "1");
    let Dims {
        batch,
        input,
        hidden,
        output,
        ..
    } = DIMS;
    println!(
        "{} ({:.0} MiB); MLP {input}-{hidden}-{output}, batch {batch}, {epochs} epochs of \
         {steps} steps; caching {}",
        ctx.name()?,
        mib(ctx.total_mem()?),
        if caching {
            "on"
        } else {
            "off (GPUCACHE_DISABLE=1)"
        }
    );
    let gpu = Gpu::new(dev)?;
    gpu.check_matmul()?;
    let data = DIMS.data(&gpu, DATA_BATCHES.min(steps), 1)?;
    let c = Ctx {
        gpu: &gpu,
        data: &data,
        steps,
    };

    if log.is_some() {
        gpucache::trace::start()?;
    }
    // The same model, kernels and data, trained twice, epochs interleaved.
    let mut cached = Run::new("gpucache", Cached(dev), true, dev)?;
    let mut base = Run::new("cudarc alloc", Cudarc(Arc::clone(&gpu.stream)), false, dev)?;
    for epoch in 0..epochs {
        cached.epoch(epoch, &c)?;
        base.epoch(epoch, &c)?;
    }

    let (cm, bm) = (
        median(cached.times_ms.clone()),
        median(base.times_ms.clone()),
    );
    println!(
        "median step time over {} steps: gpucache {cm:.3} ms, cudarc default allocation \
         (cuMemAllocAsync, release threshold 0) {bm:.3} ms: {:.2}x",
        epochs * steps,
        bm / cm
    );
    if let Some(path) = log {
        let trace = gpucache::trace::stop().ok_or("the trace was not recorded")?;
        let ops = replay::from_trace(&trace, None);
        std::fs::write(&path, replay::to_csv(&ops))?;
        println!(
            "allocation log: {path} ({} operations from {} events, {} dropped)",
            ops.len(),
            trace.events().len(),
            trace.dropped()
        );
    }
    let (first, last) = (cached.losses[0], cached.losses[epochs - 1]);
    println!(
        "loss: gpucache {first:.5} -> {last:.5}, cudarc alloc {:.5} -> {:.5}",
        base.losses[0],
        base.losses[epochs - 1]
    );
    if epochs > 1 && last >= first {
        return Err(format!("the loss did not decrease ({first} -> {last})").into());
    }
    Ok(())
}
