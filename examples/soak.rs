//! Soak: 100,000 steps of a small CPU training step (softmax regression trained with SGD), every
//! step inside the `soak_step` cache scope, with one array escaping each step (the loss, kept
//! until the next step replaces it). Prints the cache's bytes in use and cached at steps 2,
//! 1,000 and 100,000 and fails unless they are equal: steady-state memory is flat.
//!
//! Run with `cargo run --release --example soak` (`GPUCACHE_SOAK_STEPS` changes the step count).

use std::process::ExitCode;

use gpucache::prelude::*;
use gpucache::{CacheStats, f16};

const SCOPE: &str = "soak_step";
const DEV: Device = Device::Cpu;
const DEFAULT_STEPS: usize = 100_000;
const BATCH: usize = 64;
const FEATURES: usize = 32;
const CLASSES: usize = 10;
const LEARNING_RATE: f32 = 0.5;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let steps = match std::env::var("GPUCACHE_SOAK_STEPS") {
        Ok(v) => v.parse()?,
        Err(_) => DEFAULT_STEPS,
    };
    let checkpoints = [2, 1_000, steps];
    let data = Data::new()?;
    let mut w = Array::<f32>::zeros(DEV, [FEATURES, CLASSES])?;
    let mut last_loss: Option<Array<f32>> = None;
    let mut seen: Vec<(usize, CacheStats)> = Vec::new();
    println!(
        "soak: {steps} steps of softmax regression ({BATCH}x{FEATURES} -> {CLASSES}) in scope \"{SCOPE}\""
    );
    for step in 1..=steps {
        // The previous step's loss drops here, on its way home to the cache.
        let loss = train_step(&data, &mut w)?;
        let value = loss.as_slice()?[0];
        last_loss = Some(loss);
        if checkpoints.contains(&step) {
            let s = gpucache::stats(SCOPE);
            println!(
                "step {step:>7}: loss {value:.4}, bytes_in_use {}, bytes_cached {}, device allocs {}, hits {}, misses {}",
                s.bytes_in_use, s.bytes_cached, s.device_allocs, s.hits, s.misses
            );
            seen.push((step, s));
        }
    }
    drop(last_loss);
    let (first_step, first) = seen[0];
    for &(step, s) in &seen[1..] {
        if (s.bytes_in_use, s.bytes_cached, s.device_allocs)
            != (first.bytes_in_use, first.bytes_cached, first.device_allocs)
        {
            return Err(format!("memory grew between step {first_step} and step {step}").into());
        }
    }
    gpucache::invalidate(SCOPE);
    let s = gpucache::stats(SCOPE);
    println!(
        "flat: bytes in use, cached and device allocations equal at steps {:?}; after invalidate: \
         bytes_in_use {}, bytes_cached {}",
        checkpoints, s.bytes_in_use, s.bytes_cached
    );
    Ok(())
}

/// A fixed batch (outside any scope): inputs, integer labels, and a mask of the rows to use.
struct Data {
    x: Array<f32>,
    labels: Array<i64>,
    mask: Array<u8>,
}

impl Data {
    fn new() -> gpucache::Result<Data> {
        let mut x = Array::<f32>::zeros(DEV, [BATCH, FEATURES])?;
        let mut labels = Array::<i64>::zeros(DEV, BATCH)?;
        for (r, (row, label)) in x
            .as_mut_slice()?
            .chunks_exact_mut(FEATURES)
            .zip(labels.as_mut_slice()?)
            .enumerate()
        {
            *label = (r % CLASSES) as i64;
            for (c, v) in row.iter_mut().enumerate() {
                // Class r % CLASSES lights up its own features.
                let own = c % CLASSES == r % CLASSES;
                *v = if own {
                    1.0
                } else {
                    ((r * 7 + c * 3) % 5) as f32 * 0.05
                };
            }
        }
        let mask = Array::from_slice(DEV, &[1u8; BATCH], BATCH)?;
        Ok(Data { x, labels, mask })
    }
}

/// One SGD step: logits, softmax, cross-entropy, gradient, update; a half-precision copy of the
/// probabilities as a model might keep for logging. Returns the mean loss as a scalar array,
/// which escapes the scope.
fn train_step(data: &Data, w: &mut Array<f32>) -> gpucache::Result<Array<f32>> {
    let _scope = gpucache::enter(SCOPE);
    let x = data.x.as_slice()?;
    let mut logits = Array::<f32>::empty(DEV, [BATCH, CLASSES])?;
    matmul(x, w.as_slice()?, logits.as_mut_slice()?, FEATURES, CLASSES);

    let mut probs = Array::<f32>::empty(DEV, [BATCH, CLASSES])?;
    let mut dlogits = Array::<f32>::empty(DEV, [BATCH, CLASSES])?;
    let mut row_loss = Array::<f32>::zeros(DEV, BATCH)?;
    let labels = data.labels.as_slice()?;
    let mask = data.mask.as_slice()?;
    for r in 0..BATCH {
        let z = &logits.as_slice()?[r * CLASSES..(r + 1) * CLASSES];
        let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f32 = z.iter().map(|v| (v - max).exp()).sum();
        let p = &mut probs.as_mut_slice()?[r * CLASSES..(r + 1) * CLASSES];
        for (pi, zi) in p.iter_mut().zip(z) {
            *pi = (zi - max).exp() / sum;
        }
        let label = labels[r] as usize;
        let keep = f32::from(mask[r]);
        row_loss.as_mut_slice()?[r] = -p[label].ln() * keep;
        let d = &mut dlogits.as_mut_slice()?[r * CLASSES..(r + 1) * CLASSES];
        for (c, (di, pi)) in d.iter_mut().zip(p.iter()).enumerate() {
            let y = if c == label { 1.0 } else { 0.0 };
            *di = (pi - y) * keep / BATCH as f32;
        }
    }
    let mut half = Array::<f16>::empty(DEV, [BATCH, CLASSES])?;
    for (h, p) in half.as_mut_slice()?.iter_mut().zip(probs.as_slice()?) {
        *h = f16::from_f32(*p);
    }

    // dw = x^T · dlogits
    let mut dw = Array::<f32>::zeros(DEV, [FEATURES, CLASSES])?;
    let (dws, dl) = (dw.as_mut_slice()?, dlogits.as_slice()?);
    for r in 0..BATCH {
        for f in 0..FEATURES {
            let xv = x[r * FEATURES + f];
            for c in 0..CLASSES {
                dws[f * CLASSES + c] += xv * dl[r * CLASSES + c];
            }
        }
    }
    for (wi, gi) in w.as_mut_slice()?.iter_mut().zip(dw.as_slice()?) {
        *wi -= LEARNING_RATE * gi;
    }

    let mean = row_loss.as_slice()?.iter().sum::<f32>() / BATCH as f32;
    Array::from_slice(DEV, &[mean], Shape::scalar())
}

/// `c[m, n] = a[m, k] · b[k, n]` for row-major slices.
fn matmul(a: &[f32], b: &[f32], c: &mut [f32], k: usize, n: usize) {
    for (a_row, c_row) in a.chunks_exact(k).zip(c.chunks_exact_mut(n)) {
        c_row.fill(0.0);
        for (av, b_row) in a_row.iter().zip(b.chunks_exact(n)) {
            for (cv, bv) in c_row.iter_mut().zip(b_row) {
                *cv += av * bv;
            }
        }
    }
}
