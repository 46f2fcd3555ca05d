//! The main job: a two-layer MLP (ReLU, softmax cross-entropy) trained with SGD on synthetic
//! data on the CPU, every step inside the `train_step` cache scope; then the same training
//! without the cache, comparing wall time and system allocations.
//!
//! Run with `cargo run --release --example train`. With `GPUCACHE_TRACE=trace.json` set, the
//! run's memory timeline is written there (open it at <https://ui.perfetto.dev>); with
//! `-- --plot memory.svg`, memory over time is also drawn to that file (the trace beside it, as
//! `memory.json`, unless `GPUCACHE_TRACE` names it).
//!
//! The model's parameters and the data set are allocated once, outside any scope. Every other
//! array (activations, gradients, temporaries) is made inside the step, so under the cache the
//! step allocates from the device only in the first step of each epoch (`invalidate` gives the
//! memory back between epochs) and recycles its buffers in every other step.

use gpucache_suite::trace_plot;

use std::alloc::System;
use std::error::Error;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use gpucache::prelude::*;
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

/// Counts every allocation the process makes; gpucache's CPU backend allocates through it too.
#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// The name of the step's cache scope.
const SCOPE: &str = "train_step";
const DEV: Device = Device::Cpu;

const BATCH: usize = 256;
const INPUTS: usize = 128;
/// Hidden activations are `BATCH × HIDDEN` f32 = 1 MiB: past the system allocator's mmap
/// threshold, so every uncached allocation of them is paid for in page faults or zeroing.
const HIDDEN: usize = 1024;
const CLASSES: usize = 10;
const BATCHES: usize = 24;
const EPOCHS: usize = 6;
const LEARNING_RATE: f32 = 0.1;
const DATA_SEED: u64 = 0x9e37_79b9_7f4a_7c15;
const MODEL_SEED: u64 = 0x2545_f491_4f6c_dd1d;

type Result<T> = std::result::Result<T, Box<dyn Error>>;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let plot = match std::env::args_os().skip(1).collect::<Vec<_>>().as_slice() {
        [] => None,
        [flag, path] if flag == "--plot" => Some(PathBuf::from(path)),
        _ => return Err("usage: train [--plot OUT.svg]".into()),
    };
    // Recording from the start means `GPUCACHE_TRACE` named a file that could be created (else
    // the library said "not recording" and nothing is written at exit).
    let from_env = gpucache::trace::is_recording();
    if plot.is_some() && !from_env {
        gpucache::trace::start()?;
    }
    let data = dataset(&mut Rng::with_seed(DATA_SEED))?;
    println!(
        "MLP {INPUTS} -> {HIDDEN} (ReLU) -> {CLASSES}, softmax cross-entropy, SGD lr {LEARNING_RATE}; \
         {BATCHES} batches of {BATCH}, {EPOCHS} epochs\n"
    );
    println!("with the cache (scope \"{SCOPE}\"):");
    let cached = train(Mode::Cached, &data)?;
    println!("\nwithout the cache (no scope):");
    let uncached = train(Mode::Uncached, &data)?;

    println!();
    cached.report("cached");
    uncached.report("uncached");
    println!(
        "speed-up {:.2}x, {:.1}x fewer device allocations, {:.1}x fewer heap allocations \
         (heap counts include one packing buffer per matmul, allocated by matrixmultiply)\n",
        uncached.wall.as_secs_f64() / cached.wall.as_secs_f64(),
        uncached.device_allocs as f64 / cached.device_allocs as f64,
        uncached.heap_allocations as f64 / cached.heap_allocations as f64,
    );
    println!("{}", gpucache::summary());

    if cached.losses != uncached.losses {
        return Err("the cached and uncached runs computed different losses".into());
    }
    let (first, last) = (cached.losses[0], cached.losses[EPOCHS - 1]);
    if last >= first {
        return Err(format!("the loss did not decrease: first {first:.4}, last {last:.4}").into());
    }
    println!("loss decreased from {first:.4} to {last:.4}");
    if let Some(svg) = plot {
        draw(&svg, from_env)?;
    } else if let Some(path) = std::env::var_os("GPUCACHE_TRACE").filter(|_| from_env) {
        println!(
            "trace: {} (written at exit; open it at https://ui.perfetto.dev)",
            PathBuf::from(path).display()
        );
    }
    Ok(())
}

/// Stops recording, saves the trace (where `GPUCACHE_TRACE` says when it is recording there,
/// else beside `svg`) and draws memory over time from it to `svg`.
fn draw(svg: &std::path::Path, from_env: bool) -> Result<()> {
    let trace = gpucache::trace::stop().ok_or("the trace was not recorded")?;
    let json = match std::env::var_os("GPUCACHE_TRACE").filter(|_| from_env) {
        Some(path) => PathBuf::from(path), // written by `stop`
        None => {
            let json = svg.with_extension("json");
            trace.save(&json)?;
            json
        }
    };
    trace_plot::plot(&json, svg, "train: the train_step cache over 6 epochs")?;
    println!(
        "trace: {} ({} events, {} dropped; open it at https://ui.perfetto.dev), memory plot: {}",
        json.display(),
        trace.events().len(),
        trace.dropped(),
        svg.display()
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Training loop

/// Whether the steps run inside the cache scope.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Cached,
    Uncached,
}

impl Mode {
    fn step(self, model: &mut Mlp, batch: &Batch) -> Result<f32> {
        match self {
            Mode::Cached => cached_step(model, batch),
            Mode::Uncached => step(model, batch),
        }
    }
}

/// What one training run measured.
struct RunReport {
    /// The mean loss of each epoch.
    losses: Vec<f32>,
    wall: Duration,
    /// Array buffers gpucache allocated from the device (the CPU backend: the global allocator
    /// for small buffers, `mmap` for those of 1 MiB and more).
    device_allocs: u64,
    /// Allocations (and reallocations) through the global allocator during training: gpucache's
    /// small buffers, matrixmultiply's packing buffers, bookkeeping.
    heap_allocations: usize,
}

impl RunReport {
    fn report(&self, label: &str) {
        println!(
            "{label:>8}: wall {:>7.3} s, {:>5} device allocations, {:>5} heap allocations",
            self.wall.as_secs_f64(),
            self.device_allocs,
            self.heap_allocations,
        );
    }
}

/// Trains a freshly initialised model on `data`, printing one line per epoch.
fn train(mode: Mode, data: &[Batch]) -> Result<RunReport> {
    let mut model = Mlp::new(&mut Rng::with_seed(MODEL_SEED))?;
    let mut losses = Vec::with_capacity(EPOCHS);
    let mut before = gpucache::stats(SCOPE);
    if mode == Mode::Cached {
        println!(
            "  (per epoch: mean loss; hits and misses in the epoch; bytes at its end, before invalidate)"
        );
    }
    let device_before = gpucache::device_stats(DEV)?;
    let region = Region::new(GLOBAL);
    let start = Instant::now();
    for epoch in 1..=EPOCHS {
        let mut total = 0.0;
        for batch in data {
            total += f64::from(mode.step(&mut model, batch)?);
        }
        let loss = (total / data.len() as f64) as f32;
        losses.push(loss);
        print!("  epoch {epoch}: loss {loss:.4}");
        if mode == Mode::Cached {
            let now = gpucache::stats(SCOPE);
            print!(
                ", hits {:>3}, misses {:>2}, in use {:.2} MiB, cached {:.2} MiB",
                now.hits - before.hits,
                now.misses - before.misses,
                mib(now.bytes_in_use),
                mib(now.bytes_cached),
            );
            gpucache::invalidate(SCOPE);
            before = now;
        }
        println!();
    }
    let wall = start.elapsed();
    let heap = region.change();
    let device = gpucache::device_stats(DEV)?;
    Ok(RunReport {
        losses,
        wall,
        device_allocs: device.allocs - device_before.allocs,
        heap_allocations: heap.allocations + heap.reallocations,
    })
}

/// One SGD step inside the `train_step` cache scope (the attribute enters it on every call and
/// exits it on every return, `?` included).
#[cache_scope(train_step)]
fn cached_step(model: &mut Mlp, batch: &Batch) -> Result<f32> {
    step(model, batch)
}

/// One SGD step on `batch`; returns the batch's mean cross-entropy loss.
fn step(model: &mut Mlp, batch: &Batch) -> Result<f32> {
    let x = View::of(&batch.x)?;
    let h = affine(x, &model.w1, &model.b1, Activation::Relu)?;
    let logits = affine(View::of(&h)?, &model.w2, &model.b2, Activation::Identity)?;
    let (loss, dlogits) = softmax_cross_entropy(&logits, &batch.y)?;

    let dw2 = matmul(View::of(&h)?.t(), View::of(&dlogits)?)?;
    let db2 = column_sums(&dlogits)?;
    let mut dh = matmul(View::of(&dlogits)?, View::of(&model.w2)?.t())?;
    relu_backward(&mut dh, &h)?;
    let dw1 = matmul(x.t(), View::of(&dh)?)?;
    let db1 = column_sums(&dh)?;

    model.sgd([&dw1, &db1, &dw2, &db2], LEARNING_RATE)?;
    Ok(loss)
}

// ---------------------------------------------------------------------------------------------
// Model and data

/// The parameters, allocated once, outside any scope.
struct Mlp {
    w1: Array<f32>,
    b1: Array<f32>,
    w2: Array<f32>,
    b2: Array<f32>,
}

impl Mlp {
    /// He-initialised weights, zero biases.
    fn new(rng: &mut Rng) -> Result<Mlp> {
        Ok(Mlp {
            w1: uniform_array(rng, [INPUTS, HIDDEN], (6.0 / INPUTS as f32).sqrt())?,
            b1: Array::zeros(DEV, HIDDEN)?,
            w2: uniform_array(rng, [HIDDEN, CLASSES], (6.0 / HIDDEN as f32).sqrt())?,
            b2: Array::zeros(DEV, CLASSES)?,
        })
    }

    /// `param -= lr * grad` for every parameter, gradients in the order w1, b1, w2, b2.
    fn sgd(&mut self, grads: [&Array<f32>; 4], lr: f32) -> Result<()> {
        let params = [&mut self.w1, &mut self.b1, &mut self.w2, &mut self.b2];
        for (param, grad) in params.into_iter().zip(grads) {
            for (p, g) in param.as_mut_slice()?.iter_mut().zip(grad.as_slice()?) {
                *p -= lr * g;
            }
        }
        Ok(())
    }
}

/// A batch of inputs `[BATCH, INPUTS]` and one-hot labels `[BATCH, CLASSES]`.
struct Batch {
    x: Array<f32>,
    y: Array<f32>,
}

/// Uniform inputs labelled by a random linear teacher: `y = one_hot(argmax(x · teacher))`.
fn dataset(rng: &mut Rng) -> Result<Vec<Batch>> {
    let teacher = uniform_array(rng, [INPUTS, CLASSES], 1.0)?;
    (0..BATCHES)
        .map(|_| {
            let x = uniform_array(rng, [BATCH, INPUTS], 1.0)?;
            let scores = matmul(View::of(&x)?, View::of(&teacher)?)?;
            let mut y = Array::<f32>::zeros(DEV, [BATCH, CLASSES])?;
            for (y_row, s_row) in y
                .as_mut_slice()?
                .chunks_exact_mut(CLASSES)
                .zip(scores.as_slice()?.chunks_exact(CLASSES))
            {
                y_row[argmax(s_row)] = 1.0;
            }
            Ok(Batch { x, y })
        })
        .collect()
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |(i, _)| i)
}

/// A seeded generator, for reproducible synthetic data and weights.
type Rng = fastrand::Rng;

/// An array outside any scope, filled uniformly in `[-scale, scale)`.
fn uniform_array(rng: &mut Rng, shape: [usize; 2], scale: f32) -> Result<Array<f32>> {
    let mut a = Array::<f32>::empty(DEV, shape)?;
    a.as_mut_slice()?
        .iter_mut()
        .for_each(|v| *v = (rng.f32() * 2.0 - 1.0) * scale);
    Ok(a)
}

// ---------------------------------------------------------------------------------------------
// Kernels: each makes its result as a new array (through the current scope's cache, if any).

/// A row-major 2-D array, read as it is or transposed.
#[derive(Clone, Copy)]
struct View<'a> {
    data: &'a [f32],
    /// The stored matrix's dimensions.
    rows: usize,
    cols: usize,
    transposed: bool,
}

impl<'a> View<'a> {
    fn of(a: &'a Array<f32>) -> Result<View<'a>> {
        let &[rows, cols] = a.shape().dims() else {
            return Err(format!("expected a matrix, got shape {:?}", a.shape()).into());
        };
        Ok(View {
            data: a.as_slice()?,
            rows,
            cols,
            transposed: false,
        })
    }

    fn t(self) -> View<'a> {
        View {
            transposed: !self.transposed,
            ..self
        }
    }

    /// The logical dimensions (after transposition).
    fn dims(&self) -> (usize, usize) {
        if self.transposed {
            (self.cols, self.rows)
        } else {
            (self.rows, self.cols)
        }
    }

    /// The logical (row, column) strides in elements.
    fn strides(&self) -> (isize, isize) {
        let row = self.cols as isize;
        if self.transposed { (1, row) } else { (row, 1) }
    }
}

/// `a · b` in a new `[m, n]` array.
fn matmul(a: View<'_>, b: View<'_>) -> Result<Array<f32>> {
    let ((m, k), (kb, n)) = (a.dims(), b.dims());
    assert_eq!(k, kb, "matmul: inner dimensions differ");
    assert!(a.data.len() == m * k && b.data.len() == k * n);
    let (rsa, csa) = a.strides();
    let (rsb, csb) = b.strides();
    // Every element is written (beta = 0), so recycled contents do not matter.
    let mut c = Array::<f32>::empty(DEV, [m, n])?;
    let out = c.as_mut_slice()?;
    // SAFETY: `a` addresses rows × cols elements of its slice with strides (cols, 1), or (1, cols)
    // when transposed, all inside the slice (checked above); likewise `b`. `out` is an exclusive
    // borrow of a new array of exactly m × n elements, written with strides (n, 1), so it does
    // not alias `a` or `b`, which borrow other arrays.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.data.as_ptr(),
            rsa,
            csa,
            b.data.as_ptr(),
            rsb,
            csb,
            0.0,
            out.as_mut_ptr(),
            n as isize,
            1,
        );
    }
    Ok(c)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Activation {
    Identity,
    Relu,
}

/// `act(x · w + b)` in a new array.
fn affine(x: View<'_>, w: &Array<f32>, b: &Array<f32>, act: Activation) -> Result<Array<f32>> {
    let mut z = matmul(x, View::of(w)?)?;
    let b = b.as_slice()?;
    for row in z.as_mut_slice()?.chunks_exact_mut(b.len()) {
        for (v, bias) in row.iter_mut().zip(b) {
            *v += bias;
            if act == Activation::Relu {
                *v = v.max(0.0);
            }
        }
    }
    Ok(z)
}

/// The mean cross-entropy of `softmax(logits)` against one-hot `labels`, and its gradient with
/// respect to the logits, `(softmax(logits) - labels) / batch`, in a new array.
fn softmax_cross_entropy(logits: &Array<f32>, labels: &Array<f32>) -> Result<(f32, Array<f32>)> {
    let (batch, classes) = View::of(logits)?.dims();
    let mut grad = Array::<f32>::empty(DEV, [batch, classes])?;
    let mut loss = 0.0f64;
    let rows = logits
        .as_slice()?
        .chunks_exact(classes)
        .zip(labels.as_slice()?.chunks_exact(classes))
        .zip(grad.as_mut_slice()?.chunks_exact_mut(classes));
    for ((z, y), g) in rows {
        let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f32 = z.iter().map(|v| (v - max).exp()).sum();
        let log_sum = sum.ln();
        for ((gi, zi), yi) in g.iter_mut().zip(z).zip(y) {
            let log_p = zi - max - log_sum;
            loss -= f64::from(yi * log_p);
            *gi = (log_p.exp() - yi) / batch as f32;
        }
    }
    Ok(((loss / batch as f64) as f32, grad))
}

/// The sum of each column of a matrix, in a new array.
fn column_sums(a: &Array<f32>) -> Result<Array<f32>> {
    let (_, cols) = View::of(a)?.dims();
    let mut sums = Array::<f32>::zeros(DEV, cols)?;
    let out = sums.as_mut_slice()?;
    for row in a.as_slice()?.chunks_exact(cols) {
        for (s, v) in out.iter_mut().zip(row) {
            *s += v;
        }
    }
    Ok(sums)
}

/// Zeroes the gradient where the ReLU's output `h` was zero.
fn relu_backward(grad: &mut Array<f32>, h: &Array<f32>) -> Result<()> {
    for (g, hv) in grad.as_mut_slice()?.iter_mut().zip(h.as_slice()?) {
        if *hv <= 0.0 {
            *g = 0.0;
        }
    }
    Ok(())
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}
