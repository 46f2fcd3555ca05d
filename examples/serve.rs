//! An inference server's shape on the CPU: worker threads each run a `#[cache_scope]` step on
//! batches of varying size, send the results over a channel, and a consumer thread drops them
//! (so their buffers go back to the workers' caches from another thread). At the end,
//! `gpucache::summary()` shows every thread's caches. The workers have exited by then: their
//! rows count the results the consumer dropped after they exited as freed (what their caches
//! still held went back to the device at the exit), so nothing is in use.
//!
//! ```text
//! cargo run --release --example serve
//! ```

use std::sync::mpsc;
use std::thread;

use gpucache::prelude::*;

const WORKERS: usize = 3;
const REQUESTS: usize = 200;
const WIDTH: usize = 256;

/// One inference step: a batch of `batch` rows through a toy layer; the result escapes the step.
#[cache_scope(infer)]
fn infer(dev: Device, batch: usize, seed: f32) -> Result<Array<f32>> {
    let x = Array::<f32>::from_slice(dev, &vec![seed; batch * WIDTH], [batch, WIDTH])?;
    let mut y = Array::<f32>::empty(dev, [batch, WIDTH])?;
    for (yi, xi) in y.as_mut_slice()?.iter_mut().zip(x.as_slice()?) {
        *yi = xi.max(0.0) * 0.5;
    }
    Ok(y) // escapes the scope: its buffer goes back to this cache when the consumer drops it
}

fn main() -> Result<()> {
    // Batch sizes vary and results outlive their step (crate docs, "Choosing a key policy").
    gpucache::configure(
        "infer",
        CacheConfig {
            key: KeyPolicy::SizeClass,
            ..CacheConfig::default()
        },
    );
    let (tx, rx) = mpsc::channel::<(usize, Array<f32>)>();
    let consumer = thread::Builder::new()
        .name("consumer".into())
        .spawn(move || {
            let (mut results, mut rows) = (0usize, 0usize);
            for (_worker, y) in rx {
                results += 1;
                rows += y.shape().dims()[0];
                drop(y); // back to the worker's cache, from this thread
            }
            (results, rows)
        })
        .expect("spawn the consumer");
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| {
            let tx = tx.clone();
            thread::Builder::new()
                .name(format!("worker-{w}"))
                .spawn(move || -> Result<()> {
                    for r in 0..REQUESTS {
                        let batch = 1 + (r * 7 + w * 13) % 32; // 1..=32 rows
                        let y = infer(Device::Cpu, batch, r as f32)?;
                        if tx.send((w, y)).is_err() {
                            break;
                        }
                    }
                    Ok(())
                })
                .expect("spawn a worker")
        })
        .collect();
    drop(tx);
    for worker in workers {
        worker.join().expect("a worker panicked")?;
    }
    let (results, rows) = consumer.join().expect("the consumer panicked");
    println!("{results} results, {rows} rows, from {WORKERS} workers\n");
    println!("{}", gpucache::summary());
    Ok(())
}
