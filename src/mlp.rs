//! The MLP that the CUDA examples train: cuBLAS sgemm and NVRTC elementwise kernels, with the
//! step's buffers taken from an [`Allocator`] (gpucache's cache, cudarc's allocation, or
//! buffers allocated once by hand), so that one model serves the training example, the step
//! benchmark and the data-parallel example.

use std::cell::{Cell, RefCell, RefMut};
use std::error::Error;
use std::sync::Arc;

use gpucache::cuda::cudarc::cublas::sys::cublasOperation_t;
use gpucache::cuda::cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use gpucache::cuda::cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchArgs, LaunchConfig,
    PushKernelArg,
};
use gpucache::cuda::cudarc::nvrtc::compile_ptx;
use gpucache::{Array, Device};

/// What the model's steps return.
pub type Result<T, E = Box<dyn Error>> = std::result::Result<T, E>;

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

/// The elementwise kernels (CUDA C in this module's source), compiled with NVRTC.
pub struct Kernels {
    bias_relu: CudaFunction,
    bias: CudaFunction,
    mse: CudaFunction,
    relu_back: CudaFunction,
    col_sum: CudaFunction,
    tanh: CudaFunction,
    /// `sgd(w, g, lr, n)`: `w -= lr * g` over `n` floats.
    pub sgd: CudaFunction,
}

/// What a step runs on: the device, the thread's current stream (where gpucache allocates),
/// a cuBLAS handle on that stream, and the kernels.
pub struct Gpu {
    /// The device.
    pub dev: Device,
    /// The thread's current stream of `dev`.
    pub stream: Arc<CudaStream>,
    /// cuBLAS, on `stream`.
    pub blas: CudaBlas,
    /// The elementwise kernels.
    pub k: Kernels,
}

impl Gpu {
    /// Compiles the kernels and creates a cuBLAS handle on the calling thread's current stream
    /// of `dev`.
    pub fn new(dev: Device) -> Result<Gpu> {
        let stream = gpucache::cuda::current_stream(dev)?;
        let module = stream.context().load_module(compile_ptx(KERNELS)?)?;
        let f = |name: &str| module.load_function(name);
        let k = Kernels {
            bias_relu: f("bias_relu")?,
            bias: f("bias")?,
            mse: f("mse")?,
            relu_back: f("relu_back")?,
            col_sum: f("col_sum")?,
            tanh: f("tanh_inplace")?,
            sgd: f("sgd")?,
        };
        let blas = CudaBlas::new(Arc::clone(&stream))?;
        Ok(Gpu {
            dev,
            stream,
            blas,
            k,
        })
    }

    /// Launches `f` over `n` elements with the arguments `push` adds.
    fn launch<'a>(
        &'a self,
        f: &'a CudaFunction,
        n: usize,
        push: impl FnOnce(&mut LaunchArgs<'a>),
    ) -> Result<()> {
        let mut args = self.stream.launch_builder(f);
        push(&mut args);
        let blocks = n.div_ceil(256).clamp(1, 1024) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: each caller passes the arguments its kernel's signature in KERNELS declares,
        // and buffers of the sizes the kernel indexes.
        unsafe { args.launch(cfg) }?;
        Ok(())
    }

    /// Row-major `c = op(a) op(b)` (`op(a)` is m x k, `op(b)` k x n) with column-major
    /// cuBLAS: computes `c^T = op(b)^T op(a)^T`, so the operands swap and keep their storage.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul<A: Buffer, B: Buffer, C: Buffer>(
        &self,
        (m, n, k): (usize, usize, usize),
        a: &A,
        trans_a: bool,
        b: &B,
        trans_b: bool,
        c: &mut C,
    ) -> Result<()> {
        let op = |t: bool| {
            if t {
                cublasOperation_t::CUBLAS_OP_T
            } else {
                cublasOperation_t::CUBLAS_OP_N
            }
        };
        let int = |v: usize| i32::try_from(v).map_err(|_| format!("{v} does not fit in i32"));
        let cfg = GemmConfig {
            transa: op(trans_b),
            transb: op(trans_a),
            m: int(n)?,
            n: int(m)?,
            k: int(k)?,
            alpha: 1.0f32,
            lda: int(if trans_b { k } else { n })?,
            ldb: int(if trans_a { m } else { k })?,
            beta: 0.0f32,
            ldc: int(n)?,
        };
        // SAFETY: the callers pass buffers of at least m*k, k*n and m*n floats, laid out as
        // the leading dimensions above say.
        unsafe { self.blas.gemm(cfg, b.slice(), a.slice(), c.slice_mut()) }?;
        Ok(())
    }

    /// Checks [`Gpu::matmul`]'s three operand layouts against the host on small matrices.
    pub fn check_matmul(&self) -> Result<()> {
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
                Array::from_slice(self.dev, &a, a.len())?,
                Array::from_slice(self.dev, &b, b.len())?,
            );
            let mut dc = Array::<f32>::empty(self.dev, m * n)?;
            self.matmul((m, n, k), &da, ta, &db, tb, &mut dc)?;
            let got = dc.to_vec()?;
            let err = got
                .iter()
                .zip(&want)
                .map(|(g, w)| (g - w).abs())
                .fold(0.0f32, f32::max);
            if err > 1e-4 {
                return Err(format!(
                    "matmul self-check failed (ta={ta}, tb={tb}): max error {err}"
                )
                .into());
            }
        }
        println!("matmul self-check against the host: ok");
        Ok(())
    }

    /// Device memory in use (all processes), in bytes, once the stream is idle (so the
    /// default pool has given back what it frees at a synchronisation).
    pub fn in_use(&self) -> Result<usize> {
        self.stream.synchronize()?;
        let (free, total) = gpucache::cuda::mem_get_info(self.dev)?;
        Ok(total - free)
    }
}

/// A step's buffer: a cuBLAS operand and a kernel argument. gpucache's `Array<f32>`, cudarc's
/// `CudaSlice<f32>` and a borrowed preallocated slice all are.
pub trait Buffer {
    /// What cuBLAS gets.
    type Slice: DevicePtr<f32> + DevicePtrMut<f32>;
    /// The buffer, to read.
    fn slice(&self) -> &Self::Slice;
    /// The buffer, to write.
    fn slice_mut(&mut self) -> &mut Self::Slice;
    /// Pushes the buffer as a kernel argument the kernel reads.
    fn input<'a, 'b: 'a>(&'b self, launch: &mut LaunchArgs<'a>);
    /// Pushes the buffer as a kernel argument the kernel writes.
    fn output<'a, 'b: 'a>(&'b mut self, launch: &mut LaunchArgs<'a>);
}

/// An owned buffer is its own cuBLAS operand and kernel argument.
macro_rules! owned_buffer {
    ($($t:ty),*) => {$(
        impl Buffer for $t {
            type Slice = $t;
            fn slice(&self) -> &$t {
                self
            }
            fn slice_mut(&mut self) -> &mut $t {
                self
            }
            fn input<'a, 'b: 'a>(&'b self, launch: &mut LaunchArgs<'a>) {
                launch.arg(self);
            }
            fn output<'a, 'b: 'a>(&'b mut self, launch: &mut LaunchArgs<'a>) {
                launch.arg(self);
            }
        }
    )*};
}

owned_buffer!(Array<f32>, CudaSlice<f32>);

impl Buffer for RefMut<'_, CudaSlice<f32>> {
    type Slice = CudaSlice<f32>;
    fn slice(&self) -> &CudaSlice<f32> {
        self
    }
    fn slice_mut(&mut self) -> &mut CudaSlice<f32> {
        self
    }
    fn input<'a, 'b: 'a>(&'b self, launch: &mut LaunchArgs<'a>) {
        launch.arg(&**self);
    }
    fn output<'a, 'b: 'a>(&'b mut self, launch: &mut LaunchArgs<'a>) {
        launch.arg(&mut **self);
    }
}

/// Where a step's buffers come from.
pub trait Allocator {
    /// The buffers it hands out.
    type Buf<'a>: Buffer
    where
        Self: 'a;
    /// `n` floats whose contents the step overwrites.
    fn empty(&self, n: usize) -> Result<Self::Buf<'_>>;
    /// `n` zeros.
    fn zeros(&self, n: usize) -> Result<Self::Buf<'_>>;
}

/// gpucache: arrays from the current scope's cache (or the device, outside a scope).
pub struct Cached(pub Device);

impl Allocator for Cached {
    type Buf<'a> = Array<f32>;
    fn empty(&self, n: usize) -> Result<Array<f32>> {
        Ok(Array::empty(self.0, n)?)
    }
    fn zeros(&self, n: usize) -> Result<Array<f32>> {
        Ok(Array::zeros(self.0, n)?)
    }
}

/// cudarc's default allocation: cuMemAllocAsync on the stream from the device's current
/// memory pool, freed (cuMemFreeAsync) on drop.
pub struct Cudarc(pub Arc<CudaStream>);

impl Allocator for Cudarc {
    type Buf<'a> = CudaSlice<f32>;
    fn empty(&self, n: usize) -> Result<CudaSlice<f32>> {
        // SAFETY: every buffer allocated with `empty` is fully written (by cuBLAS or a
        // kernel) before it is read, as with gpucache's `Array::empty`.
        Ok(unsafe { self.0.alloc::<f32>(n) }?)
    }
    fn zeros(&self, n: usize) -> Result<CudaSlice<f32>> {
        Ok(self.0.alloc_zeros::<f32>(n)?)
    }
}

/// Buffers allocated once by hand (the first step allocates them, with cudarc), handed out in
/// the order the step asks for them; [`Preallocated::rewind`] starts the next step.
pub struct Preallocated {
    stream: Arc<CudaStream>,
    bufs: Vec<RefCell<CudaSlice<f32>>>,
    next: Cell<usize>,
}

impl Preallocated {
    /// No buffers yet: the first step allocates them on `stream`.
    pub fn new(stream: Arc<CudaStream>) -> Preallocated {
        Preallocated {
            stream,
            bufs: Vec::new(),
            next: Cell::new(0),
        }
    }

    /// Hands out the buffers from the first again (needs every buffer of the last step dropped).
    pub fn rewind(&mut self) {
        self.next.set(0);
    }

    /// The next buffer, `n` floats (a step asks for the same sizes in the same order).
    fn next(&self, n: usize) -> Result<RefMut<'_, CudaSlice<f32>>> {
        let i = self.next.get();
        self.next.set(i + 1);
        let buf = self
            .bufs
            .get(i)
            .ok_or("Preallocated: more buffers asked for than the first step allocated")?;
        let buf = buf.try_borrow_mut()?;
        if buf.len() != n {
            return Err(format!(
                "Preallocated: buffer {i} holds {} floats, not {n}",
                buf.len()
            )
            .into());
        }
        Ok(buf)
    }

    /// Allocates the buffers of one step (with the sizes `sizes` in step order); call once.
    pub fn allocate(&mut self, sizes: &[usize]) -> Result<()> {
        for &n in sizes {
            self.bufs
                .push(RefCell::new(self.stream.alloc_zeros::<f32>(n)?));
        }
        Ok(())
    }
}

impl Allocator for Preallocated {
    type Buf<'a> = RefMut<'a, CudaSlice<f32>>;
    fn empty(&self, n: usize) -> Result<Self::Buf<'_>> {
        self.next(n)
    }
    fn zeros(&self, n: usize) -> Result<Self::Buf<'_>> {
        let mut buf = self.next(n)?;
        self.stream.memset_zeros(&mut *buf)?;
        Ok(buf)
    }
}

/// The sizes of a model and its batches: `layers` dense layers, input -> hidden -> ... ->
/// hidden -> output, ReLU after every layer but the last.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    /// Rows of a batch.
    pub batch: usize,
    /// Width of the input.
    pub input: usize,
    /// Width of every hidden layer.
    pub hidden: usize,
    /// Width of the output.
    pub output: usize,
    /// Dense layers.
    pub layers: usize,
}

impl Dims {
    /// The widths of the layers' inputs and of the last layer's output.
    pub fn widths(&self) -> Vec<usize> {
        let mut w = vec![self.input];
        w.extend(std::iter::repeat_n(
            self.hidden,
            self.layers.saturating_sub(1),
        ));
        w.push(self.output);
        w
    }

    /// The sizes (floats) of the buffers a step allocates, in the order it allocates them.
    pub fn step_buffers(&self) -> Vec<usize> {
        let (w, b) = (self.widths(), self.batch);
        let mut sizes: Vec<usize> = w[1..].iter().map(|&o| b * o).collect(); // activations
        sizes.push(b * self.output); // dy
        for l in (0..self.layers).rev() {
            sizes.extend([w[l] * w[l + 1], w[l + 1]]); // dW, db
            if l > 0 {
                sizes.push(b * w[l]); // dh
            }
        }
        sizes
    }

    /// `n` batches `(x, y)` of random inputs and a fixed random teacher, `y = tanh(x t)`,
    /// computed on the GPU.
    pub fn data(&self, gpu: &Gpu, n: usize, seed: u64) -> Result<Vec<(Array<f32>, Array<f32>)>> {
        let (batch, input, output) = (self.batch, self.input, self.output);
        let mut rng = fastrand::Rng::with_seed(seed);
        let teacher = uniform(&mut rng, input * output, (9.0 / input as f32).sqrt());
        let teacher = Array::from_slice(gpu.dev, &teacher, [input, output])?;
        (0..n)
            .map(|_| {
                let x = uniform(&mut rng, batch * input, 1.0);
                let x = Array::from_slice(gpu.dev, &x, [batch, input])?;
                let mut y = Array::<f32>::empty(gpu.dev, [batch, output])?;
                gpu.matmul((batch, output, input), &x, false, &teacher, false, &mut y)?;
                let n = (batch * output) as u32;
                gpu.launch(&gpu.k.tanh, batch * output, |l| {
                    l.arg(&mut y).arg(&n);
                })?;
                Ok((x, y))
            })
            .collect()
    }
}

/// One dense layer: `w` is fan-in x fan-out, row-major.
pub struct Layer {
    /// The weights, fan-in x fan-out.
    pub w: Array<f32>,
    /// The bias, fan-out.
    pub b: Array<f32>,
}

/// The model: `yhat = relu(... relu(x w1 + b1) ...) wL + bL`, row-major.
pub struct Mlp {
    /// The layers, input first.
    pub layers: Vec<Layer>,
}

/// A layer's gradients.
pub struct Grad<B> {
    /// The weights' gradient.
    pub w: B,
    /// The bias's gradient.
    pub b: B,
}

/// `n` numbers uniform in `[-a, a)` from a seeded generator (reproducible data and weights).
pub fn uniform(rng: &mut fastrand::Rng, n: usize, a: f32) -> Vec<f32> {
    (0..n).map(|_| (rng.f32() * 2.0 - 1.0) * a).collect()
}

impl Mlp {
    /// A model of `dims`' widths, weights uniform (He for ReLU layers, half that variance for
    /// the last), biases zero.
    pub fn new(dev: Device, dims: &Dims, seed: u64) -> Result<Mlp> {
        let mut rng = fastrand::Rng::with_seed(seed);
        let w = dims.widths();
        let layers = w
            .windows(2)
            .enumerate()
            .map(|(l, io)| {
                let (fan_in, fan_out) = (io[0], io[1]);
                let gain = if l + 1 == dims.layers { 3.0 } else { 6.0 };
                let a = (gain / fan_in as f32).sqrt();
                let w = uniform(&mut rng, fan_in * fan_out, a);
                Ok(Layer {
                    w: Array::from_slice(dev, &w, [fan_in, fan_out])?,
                    b: Array::zeros(dev, fan_out)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Mlp { layers })
    }

    /// Forward and backward on a batch (`x` is batch x input, `y` batch x output): adds the
    /// batch's mean squared error to `loss` and returns each layer's gradients, in layer order.
    pub fn gradients<'a, A: Allocator>(
        &self,
        alloc: &'a A,
        gpu: &Gpu,
        x: &Array<f32>,
        y: &Array<f32>,
        loss: &mut Array<f32>,
    ) -> Result<Vec<Grad<A::Buf<'a>>>> {
        let n_layers = self.layers.len();
        let batch = x.shape().dims()[0];
        let rows = batch as u32;
        // Forward: acts[l] is layer l's output.
        let mut acts: Vec<A::Buf<'a>> = Vec::with_capacity(n_layers);
        for (l, layer) in self.layers.iter().enumerate() {
            let (fan_in, fan_out) = (layer.w.shape().dims()[0], layer.w.shape().dims()[1]);
            let mut h = alloc.empty(batch * fan_out)?;
            match acts.last() {
                None => gpu.matmul((batch, fan_out, fan_in), x, false, &layer.w, false, &mut h)?,
                Some(prev) => gpu.matmul(
                    (batch, fan_out, fan_in),
                    prev,
                    false,
                    &layer.w,
                    false,
                    &mut h,
                )?,
            }
            let f = if l + 1 == n_layers {
                &gpu.k.bias
            } else {
                &gpu.k.bias_relu
            };
            let cols = fan_out as u32;
            gpu.launch(f, batch * fan_out, |a| {
                h.output(a);
                a.arg(&layer.b).arg(&rows).arg(&cols);
            })?;
            acts.push(h);
        }
        // Loss and its gradient.
        let yhat = acts.last().ok_or("a model has at least one layer")?;
        let out = y.len();
        let mut d = alloc.empty(out)?;
        let n = out as u32;
        gpu.launch(&gpu.k.mse, out, |a| {
            d.output(a);
            a.arg(&mut *loss);
            yhat.input(a);
            a.arg(y).arg(&n);
        })?;
        // Backward, from the last layer.
        let mut grads = Vec::with_capacity(n_layers);
        for l in (0..n_layers).rev() {
            let layer = &self.layers[l];
            let (fan_in, fan_out) = (layer.w.shape().dims()[0], layer.w.shape().dims()[1]);
            let mut dw = alloc.empty(fan_in * fan_out)?;
            match l {
                0 => gpu.matmul((fan_in, fan_out, batch), x, true, &d, false, &mut dw)?,
                _ => gpu.matmul(
                    (fan_in, fan_out, batch),
                    &acts[l - 1],
                    true,
                    &d,
                    false,
                    &mut dw,
                )?,
            }
            let mut db = alloc.zeros(fan_out)?;
            let cols = fan_out as u32;
            gpu.launch(&gpu.k.col_sum, fan_out, |a| {
                db.output(a);
                d.input(a);
                a.arg(&rows).arg(&cols);
            })?;
            grads.push(Grad { w: dw, b: db });
            if l > 0 {
                let mut dh = alloc.empty(batch * fan_in)?;
                gpu.matmul((batch, fan_in, fan_out), &d, false, &layer.w, true, &mut dh)?;
                let nh = (batch * fan_in) as u32;
                gpu.launch(&gpu.k.relu_back, batch * fan_in, |a| {
                    dh.output(a);
                    acts[l - 1].input(a);
                    a.arg(&nh);
                })?;
                d = dh;
            }
        }
        grads.reverse();
        Ok(grads)
    }

    /// `w -= lr * g` for every weight and bias.
    pub fn update<B: Buffer>(&mut self, gpu: &Gpu, grads: &[Grad<B>], lr: f32) -> Result<()> {
        for (layer, g) in self.layers.iter_mut().zip(grads) {
            for (w, g) in [(&mut layer.w, &g.w), (&mut layer.b, &g.b)] {
                let len = w.len();
                let n = len as u32;
                gpu.launch(&gpu.k.sgd, len, |a| {
                    a.arg(w);
                    g.input(a);
                    a.arg(&lr).arg(&n);
                })?;
            }
        }
        Ok(())
    }

    /// One SGD step on a batch; adds the batch's loss to `loss`.
    pub fn step<A: Allocator>(
        &mut self,
        alloc: &A,
        gpu: &Gpu,
        x: &Array<f32>,
        y: &Array<f32>,
        loss: &mut Array<f32>,
        lr: f32,
    ) -> Result<()> {
        let grads = self.gradients(alloc, gpu, x, y, loss)?;
        self.update(gpu, &grads, lr)
    }
}

/// `bytes` in MiB.
pub fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// The median of `v` (the upper one for an even length).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
