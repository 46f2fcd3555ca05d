//! `serve` on a multi-thread tokio runtime: a task per connection reads requests (an `.await`
//! each), runs an inference step of varying batch in the `infer` cache scope for each, and sends
//! the result to a consumer thread, which drops it (its buffer goes back to the cache of the
//! thread that allocated it). At the end, `gpucache::summary()` shows each thread's cache, and
//! after the runtime has shut down, `snapshot().total("infer")` shows that everything was given
//! back.
//!
//! ```text
//! cargo run --release --example serve_async
//! ```
//!
//! **Scopes and `.await`.** Caches are per thread, and a scope is entered on the thread that
//! runs it. A task on a multi-thread runtime may move to another worker thread at any `.await`,
//! so a scope must never be held across one. The patterns that are right:
//!
//! * **The step runs synchronously inside the task**: a `#[cache_scope]` function (or a
//!   `cache_scope!(name, { ... })` block) with no `.await` inside, called from the task. The
//!   whole step runs on one worker thread, in that thread's cache. What it returns may be sent,
//!   awaited on and dropped anywhere. This is `infer` here.
//! * **A long step goes to `tokio::task::spawn_blocking`**, so that it does not hold up a worker
//!   the other tasks need: the closure runs the scoped step on a thread of the blocking pool,
//!   in that thread's cache. This is `infer_large` here.
//! * **`.await` inside the scope**: `cache_scope!(name, async move { ... }).await`, or
//!   `#[cache_scope]` on an `async fn`. The scope is entered around every poll of the future and
//!   left before it is suspended, so each stretch of code between two `.await`s allocates from
//!   the cache of the thread that polls it (the future stays `Send`).
//!
//! A plain block that holds an `.await` (`cache_scope!(name, { x.await })`, or a guard of
//! `gpucache::enter` kept across an `.await`) would hold the scope while the task is suspended:
//! the guard is not `Send`, so `tokio::spawn` refuses such a task at compile time.
//!
//! What the summary shows: a row per thread that ran a step (the runtime's workers and its
//! blocking threads, all named `tokio`, told apart by their numbers). A cache keeps its buffers
//! for as long as its thread lives (`cached`), and `in use` counts the results the consumer has
//! dropped that the worker has not taken back yet (it takes them in when it next enters the
//! scope). When the runtime shuts down its threads exit, and their caches give everything back.
//! The batch size varies and the results outlive their step, so the cache uses size classes
//! (as `serve` does; the crate docs' "Choosing a key policy" says why).

use std::thread;

use gpucache::prelude::*;
use tokio::sync::mpsc;

const REQUESTS: usize = 400;
const CONNECTIONS: usize = 16;
const WORKERS: usize = 4;
const BLOCKING: usize = 2;
const WIDTH: usize = 256;
/// Requests of this many rows or more run on the blocking pool.
const LARGE: usize = 24;

/// One inference step: a batch of `batch` rows through a toy layer. It runs synchronously, so
/// its whole scope is on the calling thread; the result escapes the step.
#[cache_scope(infer)]
fn infer(dev: Device, batch: usize, seed: f32) -> Result<Array<f32>> {
    let x = Array::<f32>::from_slice(dev, &vec![seed; batch * WIDTH], [batch, WIDTH])?;
    let mut y = Array::<f32>::empty(dev, [batch, WIDTH])?;
    for (yi, xi) in y.as_mut_slice()?.iter_mut().zip(x.as_slice()?) {
        *yi = xi.max(0.0) * 0.5;
    }
    Ok(y)
}

/// A large request: the same step, on a thread of the blocking pool.
async fn infer_large(dev: Device, batch: usize, seed: f32) -> Result<Array<f32>> {
    tokio::task::spawn_blocking(move || infer(dev, batch, seed))
        .await
        .expect("the step panicked")
}

/// Reads request `r`: its batch size, after some waiting (a stand-in for the network).
async fn read_request(r: usize) -> usize {
    tokio::task::yield_now().await;
    1 + (r * 7) % 32 // 1..=32 rows
}

fn main() -> Result<()> {
    gpucache::configure(
        "infer",
        CacheConfig {
            key: KeyPolicy::SizeClass,
            ..CacheConfig::default()
        },
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKERS)
        // Each thread that runs a step has a cache of its own: bound the blocking pool (512
        // threads by default), or a burst of large requests makes a cache on each new thread.
        .max_blocking_threads(BLOCKING)
        .thread_name("tokio")
        .build()
        .expect("a tokio runtime");

    let (tx, mut rx) = mpsc::channel::<Array<f32>>(CONNECTIONS);
    let consumer = thread::Builder::new()
        .name("consumer".into())
        .spawn(move || {
            let (mut results, mut rows) = (0usize, 0usize);
            while let Some(y) = rx.blocking_recv() {
                results += 1;
                rows += y.shape().dims()[0];
                drop(y); // back to the cache of the thread that allocated it
            }
            (results, rows)
        })
        .expect("spawn the consumer");

    runtime.block_on(async {
        // A task per connection, each serving its requests one after another.
        let connections: Vec<_> = (0..CONNECTIONS)
            .map(|c| {
                let tx = tx.clone();
                tokio::spawn(async move {
                    for r in (c..REQUESTS).step_by(CONNECTIONS) {
                        let batch = read_request(r).await;
                        let y = if batch >= LARGE {
                            infer_large(Device::Cpu, batch, r as f32).await?
                        } else {
                            infer(Device::Cpu, batch, r as f32)? // no `.await` in the scope
                        };
                        tx.send(y).await.expect("the consumer is running");
                    }
                    Ok::<_, gpucache::Error>(())
                })
            })
            .collect();
        drop(tx);
        for connection in connections {
            connection.await.expect("a task panicked")?;
        }
        Ok::<_, gpucache::Error>(())
    })?;
    let (results, rows) = consumer.join().expect("the consumer panicked");
    println!(
        "{results} results, {rows} rows, on {WORKERS} workers and {BLOCKING} blocking threads\n"
    );
    println!("{}", gpucache::summary());

    drop(runtime); // its threads exit: their caches give what they hold back to the device
    let total = gpucache::snapshot().total("infer");
    println!(
        "after the runtime's shutdown, \"infer\" on every thread: {} allocations, {} frees, \
         {} bytes in use, {} bytes cached",
        total.device_allocs, total.device_frees, total.bytes_in_use, total.bytes_cached
    );
    Ok(())
}
