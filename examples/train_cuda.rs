//! Trains a two-layer MLP on a CUDA GPU with cuBLAS sgemm and NVRTC elementwise kernels, one
//! gpucache scope per step, and compares the step time with cudarc's default allocation.
//!
//! ```text
//! cargo run --release --features cuda --example train_cuda [EPOCHS] [STEPS_PER_EPOCH]
//! ```
//!
//! Every step allocates its activations and gradients (9 arrays, about 50 MiB). With gpucache
//! they come from the `train_step` cache (all hits after the first step; `invalidate` between
//! epochs gives the memory back); the baseline allocates the same buffers with cudarc's
//! `CudaStream::alloc` (cuMemAllocAsync from the device's default pool, whose release threshold
//! of 0 hands memory back to the driver at every synchronisation). Same model, kernels and data,
//! epochs of the two runs interleaved, one synchronisation per step (as reading the loss would
//! cost); step times are host wall-clock time from the step's start to that synchronisation.
//! Device memory in use is read with cuMemGetInfo after synchronising.

use std::error::Error;
use std::sync::Arc;
use std::time::Instant;

use gpucache::cuda::cudarc::cublas::sys::cublasOperation_t;
use gpucache::cuda::cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use gpucache::cuda::cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchArgs, LaunchConfig,
    PushKernelArg,
};
use gpucache::cuda::cudarc::nvrtc::compile_ptx;
use gpucache::{Array, Device};

type Result<T, E = Box<dyn Error>> = std::result::Result<T, E>;

const BATCH: usize = 1024;
const INPUT: usize = 1024;
const HIDDEN: usize = 4096;
const OUTPUT: usize = 64;
const LEARNING_RATE: f32 = 0.05;
/// Distinct batches of data on the GPU; an epoch cycles through them.
const DATA_BATCHES: usize = 16;

const KERNELS: &str = r#"
#define GRID_STRIDE(i, n) \
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += gridDim.x * blockDim.x)
extern "C" __global__ void bias_relu(float* h, const float* b, unsigned rows, unsigned cols) {
    GRID_STRIDE(i, rows * cols) { float v = h[i] + b[i % cols]; h[i] = v > 0.0f ? v : 0.0f; }
}
extern "C" __global__ void bias(float* y, const float* b, unsigned rows, unsigned cols) {
    GRID_STRIDE(i, rows * cols) { y[i] += b[i % cols]; }
}
// dy = 2 (yhat - y) / n, loss += sum((yhat - y)^2) / n
extern "C" __global__ void mse(float* dy, float* loss, const float* yhat, const float* y,
                               unsigned n) {
    float local = 0.0f;
    GRID_STRIDE(i, n) { float d = yhat[i] - y[i]; dy[i] = 2.0f * d / n; local += d * d; }
    atomicAdd(loss, local / n);
}
extern "C" __global__ void relu_back(float* dh, const float* h, unsigned n) {
    GRID_STRIDE(i, n) { if (h[i] <= 0.0f) dh[i] = 0.0f; }
}
extern "C" __global__ void col_sum(float* out, const float* m, unsigned rows, unsigned cols) {
    GRID_STRIDE(j, cols) { float s = 0.0f; for (unsigned r = 0; r < rows; ++r) s += m[r * cols + j]; out[j] = s; }
}
extern "C" __global__ void tanh_inplace(float* y, unsigned n) {
    GRID_STRIDE(i, n) { y[i] = tanhf(y[i]); }
}
extern "C" __global__ void sgd(float* w, const float* g, float lr, unsigned n) {
    GRID_STRIDE(i, n) { w[i] -= lr * g[i]; }
}
"#;

struct Kernels {
    bias_relu: CudaFunction,
    bias: CudaFunction,
    mse: CudaFunction,
    relu_back: CudaFunction,
    col_sum: CudaFunction,
    tanh: CudaFunction,
    sgd: CudaFunction,
}

/// What a step's buffers need: cuBLAS operands and kernel arguments. Both gpucache's
/// `Array<f32>` and cudarc's `CudaSlice<f32>` pass straight to `launch.arg(..)`.
trait Buffer: DevicePtr<f32> + DevicePtrMut<f32> {
    fn input<'a, 'b: 'a>(&'b self, launch: &mut LaunchArgs<'a>);
    fn output<'a, 'b: 'a>(&'b mut self, launch: &mut LaunchArgs<'a>);
}

impl Buffer for Array<f32> {
    fn input<'a, 'b: 'a>(&'b self, launch: &mut LaunchArgs<'a>) {
        launch.arg(self);
    }
    fn output<'a, 'b: 'a>(&'b mut self, launch: &mut LaunchArgs<'a>) {
        launch.arg(self);
    }
}

impl Buffer for CudaSlice<f32> {
    fn input<'a, 'b: 'a>(&'b self, launch: &mut LaunchArgs<'a>) {
        launch.arg(self);
    }
    fn output<'a, 'b: 'a>(&'b mut self, launch: &mut LaunchArgs<'a>) {
        launch.arg(self);
    }
}

/// Where a step's buffers come from.
trait Allocator {
    type Buf: Buffer;
    /// `n` floats whose contents the step overwrites.
    fn empty(&self, n: usize) -> Result<Self::Buf>;
    /// `n` zeros.
    fn zeros(&self, n: usize) -> Result<Self::Buf>;
}

/// gpucache: arrays from the current scope's cache.
struct Cached(Device);

impl Allocator for Cached {
    type Buf = Array<f32>;
    fn empty(&self, n: usize) -> Result<Array<f32>> {
        Ok(Array::empty(self.0, n)?)
    }
    fn zeros(&self, n: usize) -> Result<Array<f32>> {
        Ok(Array::zeros(self.0, n)?)
    }
}

/// cudarc's default allocation: cuMemAllocAsync on the stream, freed (cuMemFreeAsync) on drop.
struct Cudarc(Arc<CudaStream>);

impl Allocator for Cudarc {
    type Buf = CudaSlice<f32>;
    fn empty(&self, n: usize) -> Result<CudaSlice<f32>> {
        // SAFETY: every buffer allocated with `empty` is fully written (by cuBLAS or a
        // kernel) before it is read, as with gpucache's `Array::empty`.
        Ok(unsafe { self.0.alloc::<f32>(n) }?)
    }
    fn zeros(&self, n: usize) -> Result<CudaSlice<f32>> {
        Ok(self.0.alloc_zeros::<f32>(n)?)
    }
}

/// The model: `yhat = relu(x w1 + b1) w2 + b2`, row-major.
struct Mlp {
    w1: Array<f32>,
    b1: Array<f32>,
    w2: Array<f32>,
    b2: Array<f32>,
}

/// `n` numbers uniform in `[-a, a)` from a seeded generator (reproducible data and weights).
fn uniform(rng: &mut fastrand::Rng, n: usize, a: f32) -> Vec<f32> {
    (0..n).map(|_| (rng.f32() * 2.0 - 1.0) * a).collect()
}

impl Mlp {
    fn new(dev: Device, seed: u64) -> Result<Mlp> {
        let mut rng = fastrand::Rng::with_seed(seed);
        Ok(Mlp {
            w1: Array::from_slice(
                dev,
                &uniform(&mut rng, INPUT * HIDDEN, (6.0 / INPUT as f32).sqrt()),
                [INPUT, HIDDEN],
            )?,
            b1: Array::zeros(dev, HIDDEN)?,
            w2: Array::from_slice(
                dev,
                &uniform(&mut rng, HIDDEN * OUTPUT, (3.0 / HIDDEN as f32).sqrt()),
                [HIDDEN, OUTPUT],
            )?,
            b2: Array::zeros(dev, OUTPUT)?,
        })
    }
}

/// Row-major `c = op(a) op(b)` (`op(a)` is m x k, `op(b)` k x n) with column-major cuBLAS:
/// computes `c^T = op(b)^T op(a)^T`, so the operands swap and keep their storage.
#[allow(clippy::too_many_arguments)]
fn matmul<A, B, C>(
    blas: &CudaBlas,
    (m, n, k): (usize, usize, usize),
    a: &A,
    trans_a: bool,
    b: &B,
    trans_b: bool,
    c: &mut C,
) -> Result<()>
where
    A: DevicePtr<f32>,
    B: DevicePtr<f32>,
    C: DevicePtrMut<f32>,
{
    let op = |t: bool| {
        if t {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        }
    };
    let int = |v: usize| i32::try_from(v).expect("matrix sizes fit in i32");
    let cfg = GemmConfig {
        transa: op(trans_b),
        transb: op(trans_a),
        m: int(n),
        n: int(m),
        k: int(k),
        alpha: 1.0f32,
        lda: int(if trans_b { k } else { n }),
        ldb: int(if trans_a { m } else { k }),
        beta: 0.0f32,
        ldc: int(n),
    };
    // SAFETY: the callers pass buffers of at least m*k, k*n and m*n floats, laid out as the
    // leading dimensions above say.
    unsafe { blas.gemm(cfg, b, a, c) }?;
    Ok(())
}

/// Launches `f` over `n` elements with the arguments `push` adds.
fn launch<'a>(
    stream: &'a CudaStream,
    f: &'a CudaFunction,
    n: usize,
    push: impl FnOnce(&mut LaunchArgs<'a>),
) -> Result<()> {
    let mut args = stream.launch_builder(f);
    push(&mut args);
    let blocks = n.div_ceil(256).clamp(1, 1024) as u32;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: each call below passes the arguments its kernel's signature in KERNELS declares,
    // and buffers of the sizes the kernel indexes.
    unsafe { args.launch(cfg) }?;
    Ok(())
}

/// One SGD step on a batch; adds the batch's loss to `loss`.
#[allow(clippy::too_many_arguments)]
fn step<A: Allocator>(
    alloc: &A,
    k: &Kernels,
    blas: &CudaBlas,
    stream: &CudaStream,
    m: &mut Mlp,
    x: &Array<f32>,
    y: &Array<f32>,
    loss: &mut Array<f32>,
) -> Result<()> {
    let (rows, hid, out) = (BATCH as u32, HIDDEN as u32, OUTPUT as u32);
    // Forward.
    let mut h = alloc.empty(BATCH * HIDDEN)?;
    matmul(blas, (BATCH, HIDDEN, INPUT), x, false, &m.w1, false, &mut h)?;
    launch(stream, &k.bias_relu, BATCH * HIDDEN, |l| {
        h.output(l);
        l.arg(&m.b1).arg(&rows).arg(&hid);
    })?;
    let mut yhat = alloc.empty(BATCH * OUTPUT)?;
    matmul(
        blas,
        (BATCH, OUTPUT, HIDDEN),
        &h,
        false,
        &m.w2,
        false,
        &mut yhat,
    )?;
    launch(stream, &k.bias, BATCH * OUTPUT, |l| {
        yhat.output(l);
        l.arg(&m.b2).arg(&rows).arg(&out);
    })?;
    // Loss and its gradient.
    let mut dy = alloc.empty(BATCH * OUTPUT)?;
    let n = BATCH as u32 * out;
    launch(stream, &k.mse, BATCH * OUTPUT, |l| {
        dy.output(l);
        l.arg(&mut *loss);
        yhat.input(l);
        l.arg(y).arg(&n);
    })?;
    // Backward.
    let mut dw2 = alloc.empty(HIDDEN * OUTPUT)?;
    matmul(
        blas,
        (HIDDEN, OUTPUT, BATCH),
        &h,
        true,
        &dy,
        false,
        &mut dw2,
    )?;
    let mut db2 = alloc.zeros(OUTPUT)?;
    launch(stream, &k.col_sum, OUTPUT, |l| {
        db2.output(l);
        dy.input(l);
        l.arg(&rows).arg(&out);
    })?;
    let mut dh = alloc.empty(BATCH * HIDDEN)?;
    matmul(
        blas,
        (BATCH, HIDDEN, OUTPUT),
        &dy,
        false,
        &m.w2,
        true,
        &mut dh,
    )?;
    let nh = rows * hid;
    launch(stream, &k.relu_back, BATCH * HIDDEN, |l| {
        dh.output(l);
        h.input(l);
        l.arg(&nh);
    })?;
    let mut dw1 = alloc.empty(INPUT * HIDDEN)?;
    matmul(blas, (INPUT, HIDDEN, BATCH), x, true, &dh, false, &mut dw1)?;
    let mut db1 = alloc.zeros(HIDDEN)?;
    launch(stream, &k.col_sum, HIDDEN, |l| {
        db1.output(l);
        dh.input(l);
        l.arg(&rows).arg(&hid);
    })?;
    // Update.
    let lr = LEARNING_RATE;
    for (w, g, len) in [
        (&mut m.w1, &dw1, INPUT * HIDDEN),
        (&mut m.b1, &db1, HIDDEN),
        (&mut m.w2, &dw2, HIDDEN * OUTPUT),
        (&mut m.b2, &db2, OUTPUT),
    ] {
        let n = len as u32;
        launch(stream, &k.sgd, len, |l| {
            l.arg(w);
            g.input(l);
            l.arg(&lr).arg(&n);
        })?;
    }
    Ok(())
}

/// Checks `matmul`'s three operand layouts against the host on small matrices.
fn check_matmul(dev: Device, blas: &CudaBlas) -> Result<()> {
    let (m, n, k) = (3, 5, 4);
    let mut rng = fastrand::Rng::with_seed(7);
    let a = uniform(&mut rng, m * k, 1.0); // m x k (or k x m when transposed)
    let b = uniform(&mut rng, k * n, 1.0); // k x n (or n x k when transposed)
    for (ta, tb) in [(false, false), (true, false), (false, true)] {
        let at = |i: usize, p: usize| if ta { a[p * m + i] } else { a[i * k + p] };
        let bt = |p: usize, j: usize| if tb { b[j * k + p] } else { b[p * n + j] };
        let want: Vec<f32> = (0..m * n)
            .map(|ij| (0..k).map(|p| at(ij / n, p) * bt(p, ij % n)).sum())
            .collect();
        let (da, db) = (
            Array::from_slice(dev, &a, a.len())?,
            Array::from_slice(dev, &b, b.len())?,
        );
        let mut dc = Array::<f32>::empty(dev, m * n)?;
        matmul(blas, (m, n, k), &da, ta, &db, tb, &mut dc)?;
        let got = dc.to_vec()?;
        let err = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs())
            .fold(0.0f32, f32::max);
        if err > 1e-4 {
            return Err(
                format!("matmul self-check failed (ta={ta}, tb={tb}): max error {err}").into(),
            );
        }
    }
    println!("matmul self-check against the host: ok");
    Ok(())
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Device memory in use (all processes), in bytes, once the stream is idle (so the default
/// pool has given back what it frees at a synchronisation).
fn in_use(dev: Device, stream: &CudaStream) -> Result<usize> {
    stream.synchronize()?;
    let (free, total) = gpucache::cuda::mem_get_info(dev)?;
    Ok(total - free)
}

/// What a training run needs from `main`.
struct Ctx<'a> {
    dev: Device,
    k: &'a Kernels,
    blas: &'a CudaBlas,
    stream: &'a CudaStream,
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
        let model = Mlp::new(dev, 42)?;
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
        let mut loss = Array::<f32>::zeros(c.dev, 1)?;
        c.stream.synchronize()?;
        for i in 0..c.steps {
            let (x, y) = &c.data[i % c.data.len()];
            let start = Instant::now();
            {
                let _scope = self.cached.then(|| gpucache::enter("train_step"));
                step(
                    &self.alloc,
                    c.k,
                    c.blas,
                    c.stream,
                    &mut self.model,
                    x,
                    y,
                    &mut loss,
                )?;
            }
            c.stream.synchronize()?;
            self.times_ms.push(start.elapsed().as_secs_f64() * 1e3);
        }
        let mean = loss.to_vec()?[0] / c.steps as f32;
        self.losses.push(mean);
        let used = in_use(c.dev, c.stream)?;
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
                mib(in_use(c.dev, c.stream)?)
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
    let mut args = std::env::args().skip(1).map(|a| a.parse::<usize>());
    let epochs = args.next().transpose()?.unwrap_or(5).max(1);
    let steps = args.next().transpose()?.unwrap_or(100).max(1);

    let dev = Device::cuda(0)?;
    let ctx = gpucache::cuda::context(dev)?;
    let stream = gpucache::cuda::current_stream(dev)?;
    let caching = std::env::var_os("GPUCACHE_DISABLE").is_none_or(|v| v != "1");
    println!(
        "{} ({:.0} MiB); MLP {INPUT}-{HIDDEN}-{OUTPUT}, batch {BATCH}, {epochs} epochs of \
         {steps} steps; caching {}",
        ctx.name()?,
        mib(ctx.total_mem()?),
        if caching {
            "on"
        } else {
            "off (GPUCACHE_DISABLE=1)"
        }
    );
    let module = ctx.load_module(compile_ptx(KERNELS)?)?;
    let f = |name: &str| module.load_function(name);
    let kernels = Kernels {
        bias_relu: f("bias_relu")?,
        bias: f("bias")?,
        mse: f("mse")?,
        relu_back: f("relu_back")?,
        col_sum: f("col_sum")?,
        tanh: f("tanh_inplace")?,
        sgd: f("sgd")?,
    };
    let blas = CudaBlas::new(Arc::clone(&stream))?;
    check_matmul(dev, &blas)?;

    // Data: random inputs and a fixed random teacher, y = tanh(x t), computed on the GPU.
    let mut rng = fastrand::Rng::with_seed(1);
    let teacher = uniform(&mut rng, INPUT * OUTPUT, (9.0 / INPUT as f32).sqrt());
    let teacher = Array::from_slice(dev, &teacher, [INPUT, OUTPUT])?;
    let data = (0..DATA_BATCHES.min(steps))
        .map(|_| {
            let x = Array::from_slice(dev, &uniform(&mut rng, BATCH * INPUT, 1.0), [BATCH, INPUT])?;
            let mut y = Array::<f32>::empty(dev, [BATCH, OUTPUT])?;
            matmul(
                &blas,
                (BATCH, OUTPUT, INPUT),
                &x,
                false,
                &teacher,
                false,
                &mut y,
            )?;
            let n = (BATCH * OUTPUT) as u32;
            launch(&stream, &kernels.tanh, BATCH * OUTPUT, |l| {
                l.arg(&mut y).arg(&n);
            })?;
            Ok((x, y))
        })
        .collect::<Result<Vec<_>>>()?;
    let c = Ctx {
        dev,
        k: &kernels,
        blas: &blas,
        stream: &stream,
        data: &data,
        steps,
    };

    // The same model, kernels and data, trained twice, epochs interleaved.
    let mut cached = Run::new("gpucache", Cached(dev), true, dev)?;
    let mut base = Run::new("cudarc alloc", Cudarc(Arc::clone(&stream)), false, dev)?;
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
