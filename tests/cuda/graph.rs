//! GPU checks of `gpucache::cuda::StepGraph`: replayed steps compute what eager steps compute
//! (the CUDA example's MLP, cuBLAS and NVRTC kernels), a shape change during the capture is a
//! typed error that leaves nothing run or corrupted, a graph holds its buffers until dropped,
//! invalidation / configuration / a dropped input make it capture again, and work the graph
//! cannot hold (another stream, host copies, cudarc buffers waiting on outside events) is a
//! typed error.
//!
//! The harness in `main.rs` runs them one at a time (a capture fails when another thread
//! synchronises the whole context meanwhile, as the failing captures here do), and lists them
//! as ignored without a GPU.

use std::error::Error as StdError;
use std::sync::Arc;

use gpucache::cuda::cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use gpucache::cuda::cudarc::nvrtc::compile_ptx;
use gpucache::cuda::{Ran, StepGraph, StreamGuard};
use gpucache::{Array, CacheConfig, Device, Error, Reuse, stats};

use crate::gpu::GpuTest;
use gpucache_suite::common::{self, TestResult};
use gpucache_suite::mlp::{Cached, Dims, Gpu, Mlp};

/// The tests that need a GPU.
pub const TESTS: &[(&str, GpuTest)] = common::test_table![
    replayed_mlp_steps_compute_what_eager_steps_compute,
    a_planned_step_is_captured_and_computes_what_eager_steps_compute,
    a_shape_change_during_capture_is_a_typed_error_and_runs_nothing,
    a_graph_holds_its_buffers_until_dropped,
    invalidate_configure_and_a_dropped_input_make_it_capture_again,
    immediate_reuse_inside_a_step_is_captured,
    other_streams_and_host_copies_are_typed_errors,
];

/// A new stream of `dev`'s context made the thread's current stream (a graph cannot be
/// captured on the default stream).
fn on_new_stream(dev: Device) -> Result<(Arc<CudaStream>, StreamGuard), Box<dyn StdError>> {
    let stream = gpucache::cuda::context(dev)?.new_stream()?;
    let on = gpucache::cuda::use_stream(&stream)?;
    Ok((stream, on))
}

/// `fill(a, v, n)`: a[i] = v; `add(out, a, n)`: out[i] += a[i].
struct Kernels {
    fill: CudaFunction,
    add: CudaFunction,
}

fn kernels(stream: &CudaStream) -> Result<Kernels, Box<dyn StdError>> {
    let ptx = compile_ptx(
        r#"
extern "C" __global__ void fill(float* a, float v, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) a[i] = v;
}
extern "C" __global__ void add(float* out, const float* a, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) out[i] += a[i];
}"#,
    )?;
    let module = stream.context().load_module(ptx)?;
    Ok(Kernels {
        fill: module.load_function("fill")?,
        add: module.load_function("add")?,
    })
}

/// One step of the small tests: a scratch array of `scratch` floats (from the cache), filled
/// with 1, added to the first `out.len()` elements of `out`.
fn add_one(
    dev: Device,
    stream: &CudaStream,
    k: &Kernels,
    out: &mut Array<f32>,
    scratch: usize,
) -> Result<(), Box<dyn StdError>> {
    let mut tmp = Array::<f32>::empty(dev, scratch)?;
    let n = out.len() as u32;
    let cfg = LaunchConfig::for_num_elems(n);
    let mut fill = stream.launch_builder(&k.fill);
    fill.arg(&mut tmp).arg(&1.0f32).arg(&n);
    // SAFETY: `fill` takes (float*, float, unsigned) and writes n <= tmp.len() elements.
    unsafe { fill.launch(cfg) }?;
    let mut add = stream.launch_builder(&k.add);
    add.arg(&mut *out).arg(&tmp).arg(&n);
    // SAFETY: `add` takes (float*, const float*, unsigned) and touches n elements of each.
    unsafe { add.launch(cfg) }?;
    Ok(())
}

fn assert_all(a: &Array<f32>, want: f32) -> TestResult {
    let got = a.to_vec()?;
    assert!(
        got.iter().all(|&v| v == want),
        "expected every element {want}, got {:?}...",
        &got[..4]
    );
    Ok(())
}

fn replayed_mlp_steps_compute_what_eager_steps_compute(dev: Device) -> TestResult {
    mlp_steps(dev, "graph-mlp", false)
}

fn a_planned_step_is_captured_and_computes_what_eager_steps_compute(dev: Device) -> TestResult {
    mlp_steps(dev, "graph-mlp-planned", true)
}

/// MLP training steps through a `StepGraph` of cache `name` (planned, or free lists with exact
/// keys) against the same steps run eagerly.
fn mlp_steps(dev: Device, name: &str, planned: bool) -> TestResult {
    if !planned {
        common::free_lists(name);
    }
    let (_stream, _on) = on_new_stream(dev)?;
    let dims = Dims {
        batch: 32,
        input: 64,
        hidden: 128,
        output: 16,
        layers: 4,
    };
    let gpu = Gpu::new(dev)?;
    let data = dims.data(&gpu, 1, 3)?;
    let (x, y) = &data[0];
    let (steps, lr) = (8, 0.05);
    let initial = Mlp::new(dev, &dims, 9)?;

    let mut eager = Mlp::new(dev, &dims, 9)?;
    let mut eager_loss = Array::<f32>::zeros(dev, 1)?;
    for _ in 0..steps {
        let _scope = gpucache::enter("graph-mlp-eager");
        eager.step(&Cached(dev), &gpu, x, y, &mut eager_loss, lr)?;
    }

    let mut replayed = Mlp::new(dev, &dims, 9)?;
    let mut replayed_loss = Array::<f32>::zeros(dev, 1)?;
    let mut graph = StepGraph::new(name, dev);
    let mut ran = Vec::new();
    for _ in 0..steps {
        ran.push(graph.run(|| replayed.step(&Cached(dev), &gpu, x, y, &mut replayed_loss, lr))?);
    }
    // Warm once a step misses nothing: free lists from the second step, a plan from the third
    // (the first step records, the second makes the plan's block).
    let warmup = if planned { 3 } else { 2 };
    let mut want = vec![Ran::Eagerly; warmup];
    want.push(Ran::Captured);
    want.resize(steps, Ran::Replayed);
    assert_eq!(ran, want);
    assert_eq!(
        (graph.captures(), graph.replays()),
        (1, (steps - warmup - 1) as u64)
    );
    let step_bytes = dims.step_buffers().iter().sum::<usize>() * 4;
    if planned {
        // Views of the plan's block: what the step's arrays need, at most.
        assert!(
            (1..=step_bytes).contains(&graph.held_bytes()),
            "{}",
            graph.held_bytes()
        );
    } else {
        assert_eq!(
            graph.held_bytes(),
            step_bytes,
            "the graph holds every buffer the step allocated"
        );
    }

    let close = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .all(|(a, b)| (a - b).abs() <= 1e-5 * a.abs().max(1.0))
    };
    for ((e, r), i) in eager
        .layers
        .iter()
        .zip(&replayed.layers)
        .zip(&initial.layers)
    {
        let (e, r, i) = (e.w.to_vec()?, r.w.to_vec()?, i.w.to_vec()?);
        assert!(!close(&e, &i), "the steps changed the weights");
        assert!(close(&e, &r), "replayed weights differ from eager ones");
    }
    let (e, r) = (eager_loss.to_vec()?[0], replayed_loss.to_vec()?[0]);
    assert!(close(&[e], &[r]), "losses: eager {e}, replayed {r}");
    Ok(())
}

fn a_shape_change_during_capture_is_a_typed_error_and_runs_nothing(dev: Device) -> TestResult {
    let (stream, _on) = on_new_stream(dev)?;
    let k = kernels(&stream)?;
    let mut out = Array::<f32>::zeros(dev, 256)?;
    common::free_lists("graph-shape");
    let mut graph = StepGraph::new("graph-shape", dev);
    for _ in 0..2 {
        let ran = graph.run(|| add_one(dev, &stream, &k, &mut out, 256))?;
        assert_eq!(ran, Ran::Eagerly);
    }
    let misses = stats("graph-shape").misses;
    // The capture run asks for another shape: not in the cache.
    let err = graph
        .run(|| add_one(dev, &stream, &k, &mut out, 512))
        .expect_err("a miss during capture");
    match err.downcast_ref::<Error>() {
        Some(Error::CaptureMiss { cache, dims, .. }) => {
            assert_eq!(
                (cache.as_str(), dims.as_slice()),
                ("graph-shape", &[512][..])
            );
        }
        other => panic!("expected Error::CaptureMiss, got {other:?} ({err})"),
    }
    assert!(!graph.is_captured());
    assert_eq!(stats("graph-shape").misses, misses, "nothing was allocated");
    assert_all(&out, 2.0)?; // the failed run did not run on the device

    // The new shape warms up eagerly, is captured, and replays.
    let mut ran = Vec::new();
    for _ in 0..4 {
        ran.push(graph.run(|| add_one(dev, &stream, &k, &mut out, 512))?);
    }
    use Ran::*;
    assert_eq!(ran, [Eagerly, Eagerly, Captured, Replayed]);
    assert_all(&out, 6.0)
}

fn a_graph_holds_its_buffers_until_dropped(dev: Device) -> TestResult {
    let (stream, _on) = on_new_stream(dev)?;
    let k = kernels(&stream)?;
    let mut out = Array::<f32>::zeros(dev, 1024)?;
    common::free_lists("graph-held");
    let mut graph = StepGraph::new("graph-held", dev);
    for _ in 0..3 {
        graph.run(|| add_one(dev, &stream, &k, &mut out, 1024))?;
    }
    assert!(graph.is_captured());
    let s = stats("graph-held");
    assert_eq!((s.bytes_in_use, s.bytes_cached), (4096, 0), "{s}");
    assert_eq!(graph.held_bytes(), 4096);
    // Another user of the cache cannot get the graph's buffer while it lives.
    {
        let _scope = gpucache::enter("graph-held");
        let _other = Array::<f32>::zeros(dev, 1024)?;
    }
    assert_eq!(stats("graph-held").misses, 2);
    graph.run(|| add_one(dev, &stream, &k, &mut out, 1024))?;
    assert_all(&out, 4.0)?;

    drop(graph);
    let s = stats("graph-held");
    assert_eq!((s.bytes_in_use, s.bytes_cached), (0, 8192), "{s}");
    gpucache::invalidate("graph-held");
    let s = stats("graph-held");
    assert_eq!((s.bytes_cached, s.device_frees), (0, 2), "{s}");
    Ok(())
}

fn invalidate_configure_and_a_dropped_input_make_it_capture_again(dev: Device) -> TestResult {
    let (stream, _on) = on_new_stream(dev)?;
    let k = kernels(&stream)?;
    let mut out = Array::<f32>::zeros(dev, 256)?;
    common::free_lists("graph-again");
    let mut graph = StepGraph::new("graph-again", dev);
    let mut run = |out: &mut Array<f32>| graph.run(|| add_one(dev, &stream, &k, out, 256));
    use Ran::*;
    let mut ran = Vec::new();
    for _ in 0..4 {
        ran.push(run(&mut out)?);
    }
    gpucache::invalidate("graph-again");
    for _ in 0..4 {
        ran.push(run(&mut out)?);
    }
    let immediate = CacheConfig {
        reuse: Reuse::Immediate,
        key: gpucache::KeyPolicy::Exact,
        ..CacheConfig::default()
    };
    gpucache::configure("graph-again", immediate);
    for _ in 0..4 {
        ran.push(run(&mut out)?);
    }
    let mut want = [Eagerly, Eagerly, Captured, Replayed].repeat(2);
    // The graph's buffer goes back to the cache, free at once under `Reuse::Immediate`: the
    // first eager run is warm already.
    want.extend([Eagerly, Captured, Replayed, Replayed]);
    assert_eq!(ran, want);
    assert_all(&out, 12.0)?;

    // A new output array: the graph wrote to the old one's address.
    drop(out);
    let mut out = Array::<f32>::zeros(dev, 256)?;
    let ran = run(&mut out)?;
    assert_eq!(ran, Eagerly);
    assert_all(&out, 1.0)?;
    assert_eq!(graph.captures(), 3);
    Ok(())
}

fn immediate_reuse_inside_a_step_is_captured(dev: Device) -> TestResult {
    let (stream, _on) = on_new_stream(dev)?;
    let k = kernels(&stream)?;
    let immediate = CacheConfig {
        reuse: Reuse::Immediate,
        key: gpucache::KeyPolicy::Exact,
        ..CacheConfig::default()
    };
    gpucache::configure("graph-immediate", immediate);
    let mut out = Array::<f32>::zeros(dev, 256)?;
    common::free_lists("graph-immediate");
    let mut graph = StepGraph::new("graph-immediate", dev);
    for _ in 0..4 {
        // Two scratch arrays of one key, one after the other: eagerly the second could reuse
        // the first's buffer; the graph keeps both.
        graph.run(|| -> TestResult {
            add_one(dev, &stream, &k, &mut out, 256)?;
            add_one(dev, &stream, &k, &mut out, 256)
        })?;
    }
    assert_eq!((graph.captures(), graph.replays()), (1, 1));
    assert_eq!(graph.held_bytes(), 2 * 1024);
    assert_all(&out, 8.0)
}

fn other_streams_and_host_copies_are_typed_errors(dev: Device) -> TestResult {
    let (stream, on) = on_new_stream(dev)?;
    let k = kernels(&stream)?;
    let other = gpucache::cuda::context(dev)?.new_stream()?;
    let mut out = Array::<f32>::zeros(dev, 256)?;
    // Arrays of the failing work, allocated outside the step (one inside would miss first).
    let (copy, mut dst) = (
        Array::<f32>::zeros(dev, 256)?,
        Array::<f32>::zeros(dev, 256)?,
    );
    common::free_lists("graph-errors");
    let mut graph = StepGraph::new("graph-errors", dev);
    {
        let _warm = gpucache::enter("graph-errors");
        add_one(dev, &stream, &k, &mut out, 256)?;
    }
    // One eager run (a warm one) and a capture that fails.
    let mut capture = |extra: &mut dyn FnMut() -> TestResult| {
        graph.reset();
        assert_eq!(
            graph.run(|| add_one(dev, &stream, &k, &mut out, 256))?,
            Ran::Eagerly
        );
        let err = graph
            .run(|| {
                add_one(dev, &stream, &k, &mut out, 256)?;
                extra()
            })
            .expect_err("the capture fails");
        assert!(!graph.is_captured());
        Ok::<_, Box<dyn StdError>>(err)
    };

    // An array copied on another stream.
    let e = capture(&mut || Ok(other.memcpy_dtod(&copy, &mut dst)?))?;
    assert!(kind(&*e).contains("CaptureForeignStream"), "{e:?}");
    // Work forked to another stream and not joined back.
    let e = capture(&mut || {
        other.join(&stream)?;
        let mut f = other.launch_builder(&k.fill);
        let n = 256u32;
        f.arg(&mut dst).arg(&2.0f32).arg(&n);
        // SAFETY: as in `add_one`.
        unsafe { f.launch(LaunchConfig::for_num_elems(n)) }?;
        Ok(())
    })?;
    assert!(kind(&*e).contains("CaptureFailed"), "{e:?}");
    // A host copy.
    let e = capture(&mut || {
        copy.to_vec()?;
        Ok(())
    })?;
    assert!(kind(&*e).contains("CaptureUnsupported"), "{e:?}");
    // A cudarc buffer whose events were recorded outside the capture (event tracking is on:
    // the context has several streams).
    let mut plain = stream.alloc_zeros::<f32>(256)?;
    let e = capture(&mut || {
        let mut f = stream.launch_builder(&k.fill);
        let n = 256u32;
        f.arg(&mut plain).arg(&2.0f32).arg(&n);
        // SAFETY: as in `add_one`.
        unsafe { f.launch(LaunchConfig::for_num_elems(n)) }?;
        Ok(())
    })?;
    assert!(kind(&*e).contains("CaptureFailed"), "{e:?}");
    // None of the failed captures ran: 1 run to warm the cache, 1 eager run before each of 4.
    assert_all(&out, 5.0)?;
    let again = graph.run(|| add_one(dev, &stream, &k, &mut out, 256))?;
    assert_eq!(again, Ran::Eagerly);

    // The default stream cannot be captured.
    drop(on);
    common::free_lists("graph-errors");
    let mut graph = StepGraph::new("graph-errors", dev);
    let err = graph
        .run(|| add_one(dev, &stream, &k, &mut out, 256))
        .expect_err("no capture on the default stream");
    assert!(kind(&*err).contains("CaptureDefaultStream"), "{err:?}");
    stream.synchronize()?;
    assert_all(&out, 6.0)
}

/// The gpucache error variant in `e`, as text (`None` for other errors).
fn kind(e: &(dyn StdError + 'static)) -> String {
    format!("{:?}", e.downcast_ref::<Error>())
}
