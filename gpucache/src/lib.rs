//! # gpucache
//!
//! Scoped, named, thread-local allocation caches for device arrays, so that after the first
//! step of a training or inference loop no device allocation happens at all.
//!
//! A step is marked as a named *scope*. Inside it, every [`Array`] allocation goes through the
//! thread's cache of that name. By default ([`KeyPolicy::Planned`]) the cache records the first
//! step's allocations and their lifetimes, and serves the next steps from one block per device
//! laid out from them: each array at a fixed offset, arrays alive at the same time never
//! overlapping, so a step holds about the most bytes its arrays need at once and, after the
//! second step, allocates nothing from the device (see [Memory of a step](#memory-of-a-step)).
//! Free lists keyed by (element type, shape, device), recycled when the scope is entered again,
//! are the other policy ([`KeyPolicy::Exact`]). [`invalidate`] gives the memory back (between
//! epochs, say).
//!
//! ```
//! use gpucache::cache_scope;
//! use gpucache::prelude::*;
//!
//! #[cache_scope(train_step)]
//! fn train_step(dev: Device, x: &Array<f32>) -> gpucache::Result<f32> {
//!     let mut h = Array::<f32>::zeros(dev, [x.shape().dims()[0], 16])?; // recycled on re-entry
//!     for (hi, xi) in h.as_mut_slice()?.iter_mut().zip(x.as_slice()?.iter().cycle()) {
//!         *hi = xi.max(0.0);
//!     }
//!     Ok(h.as_slice()?.iter().sum())
//! }
//!
//! let dev = Device::Cpu;
//! let x = Array::from_slice(dev, &[1.0f32, -2.0, 3.0, -4.0], [4, 1])?;
//! for epoch in 0..2 {
//!     let before = gpucache::stats("train_step");
//!     for _batch in 0..10 {
//!         train_step(dev, &x)?;
//!     }
//!     let s = gpucache::stats("train_step").since(&before); // this epoch's figures
//!     // The first step allocates its array, the second the plan's block; then 8 hits.
//!     assert_eq!((s.misses, s.hits), (2, 8));
//!     println!("epoch {epoch}: {s}");
//!     // A block in a scope of its own; `?` in it leaves the enclosing function, as in any block.
//!     let loss = cache_scope!(eval, {
//!         let h = Array::<f32>::zeros(dev, [4, 16])?;
//!         h.as_slice()?.iter().sum::<f32>()
//!     });
//!     assert_eq!(loss, 0.0);
//!     gpucache::invalidate("train_step"); // give the memory back between epochs
//!     assert_eq!(gpucache::stats("train_step").bytes_cached, 0);
//! }
//! # Ok::<(), gpucache::Error>(())
//! ```
//!
//! ## The macros
//!
//! A scope is entered in one of three ways, all the same underneath:
//!
//! * [`#[cache_scope(name)]`](prelude::cache_scope) on a function or method runs its body in the
//!   scope. On an `async fn`, and on a function that returns `impl Future` or
//!   `Pin<Box<dyn Future>>` (as `async-trait` writes one), the scope is entered around every
//!   poll of the future, not held while it is suspended, so the future stays `Send` and may
//!   finish on another thread.
//! * [`cache_scope!(name, { ... })`](cache_scope!) runs a block (or `cache_scope!(name, expr)`
//!   an expression) in the scope and evaluates to its value; `return`, `?`, `break` and
//!   `continue` inside act as in a plain block.
//! * [`enter`]`("name")` returns a guard; the scope exits when it drops.
//!
//! **In async code, `.await` in a scope through an `async` block:**
//! `cache_scope!(name, async move { ... }).await` enters the scope around each poll of the
//! block, like the attribute on an `async fn`, and the future stays `Send`, so it works in a
//! spawned task. (A `{ ... }` block holding an `.await` keeps the scope's guard across it, and
//! a task that must be `Send` then fails to compile: "future cannot be sent between threads
//! safely", as the guard, a [`ScopeGuard`], "is not `Send`".)
//!
//! ```
//! use gpucache::cache_scope;
//!
//! async fn read_batch() -> Vec<f32> {
//!     vec![0.0; 4]
//! }
//!
//! fn spawn<F: std::future::Future + Send + 'static>(task: F) -> F {
//!     task // what a multi-threaded executor asks of a task
//! }
//!
//! let task = spawn(async {
//!     cache_scope!(load, async move {
//!         let batch = read_batch().await;
//!         (batch.len(), gpucache::current_scope())
//!     })
//!     .await
//! });
//! # let mut task = std::pin::pin!(task);
//! # let poll = task.as_mut().poll(&mut std::task::Context::from_waker(std::task::Waker::noop()));
//! # assert_eq!(poll, std::task::Poll::Ready((4, Some("load".to_owned()))));
//! ```
//!
//! A name is an identifier or a string literal: `#[cache_scope(train_step)]` and
//! `#[cache_scope("train_step")]` name the same cache. **A bare identifier is the literal name,
//! never a variable's value**: for a name computed at run time, write
//! `cache_scope!(name = <expr>, { ... })`, where the expression gives a `&str`, a `String` or
//! anything `AsRef<str>` (evaluated once, before the body):
//!
//! ```
//! use gpucache::cache_scope;
//!
//! for i in 0..2 {
//!     let layer = format!("layer{i}");
//!     let inside = cache_scope!(name = &layer, gpucache::current_scope());
//!     assert_eq!(inside, Some(layer)); // `cache_scope!(layer, ..)` would be the scope "layer"
//! }
//! ```
//!
//! The attribute lives in [`prelude`] and the block macro at the crate root, because an
//! attribute and a function-like macro cannot share one path; import both with
//!
//! ```
//! use gpucache::cache_scope; // the block macro `cache_scope!`
//! use gpucache::prelude::*; // ... and the attribute `#[cache_scope]`, with the common types
//!
//! #[cache_scope(step)]
//! fn step() -> Option<String> {
//!     cache_scope!(inner, assert_eq!(gpucache::current_scope().as_deref(), Some("inner")));
//!     gpucache::current_scope()
//! }
//! assert_eq!(step().as_deref(), Some("step"));
//! ```
//!
//! or write them out: `#[gpucache::prelude::cache_scope(step)]` and
//! `gpucache::cache_scope!(step, { ... })`. (A module that glob-imports its parent with
//! `use super::*;` gets only the block macro from a parent that imports both this way, since
//! the explicit `use gpucache::cache_scope;` shadows the prelude's attribute there: import the
//! prelude in that module too.)
//!
//! ## Semantics
//!
//! * **Outside any scope** arrays are allocated from the device and freed when they drop.
//! * **Scopes** ([`enter`], and the `cache_scope` macros) make a cache the thread's current one;
//!   the innermost wins, scopes nest, a name may be entered recursively, and the previous scope
//!   is restored on every exit, panics unwinding included.
//! * **Inside a scope** of a planned cache (the default, [`KeyPolicy::Planned`]) an allocation
//!   is served from the step's plan (a *hit*) or from a block of its own (a *miss*, a device
//!   allocation), and its bytes are free again as soon as it drops (see
//!   [Memory of a step](#memory-of-a-step)). In a cache of free lists ([`KeyPolicy::Exact`],
//!   [`KeyPolicy::SizeClass`]) it pops a free buffer of its key (a hit) or allocates one (a
//!   miss); either way the buffer is *busy*.
//! * **Reuse** (free lists). Under [`Reuse::OnExit`] (the default) the buffer of an array
//!   dropped inside the scope becomes free when the outermost active entry of that cache exits;
//!   under [`Reuse::Immediate`] as soon as the array drops.
//! * **Escaping arrays** (returned, stored, sent to another thread) keep their memory while they
//!   live, and give it back to their home cache when they drop, from any thread. Memory is never
//!   handed to a second array while the first is alive.
//! * **[`invalidate`]** frees what the cache holds that no array uses (free lists, a plan's
//!   block and spares; a planned cache starts cold, as in its first step) and starts a new
//!   generation: memory of arrays still alive is freed, not cached, when they drop.
//!   [`empty_cache`] does the same for every cache of every thread.
//! * **Out of memory**: a failed device allocation gives back what the caches hold for the device
//!   that no array owns (this thread's caches, then every thread's) and retries once, then
//!   returns [`Error::OutOfMemory`]. A planned cache that asked for more than the array (its
//!   plan's block, or room for an array that grows) asks once more for the array alone first:
//!   a step that outgrows its plan on a nearly full device goes on, served array by array.
//!
//! ## Memory of a step
//!
//! A step (the time between two exits of a cache's outermost scope) of a real model allocates
//! hundreds of arrays, most of which die within the step. Under [`KeyPolicy::Exact`] with
//! [`Reuse::OnExit`] every buffer of a step stays distinct, so the step holds the sum of what it
//! allocates; the least a step can hold is its *peak live* bytes, the most bytes of its arrays
//! alive at once. [`KeyPolicy::Planned`] holds close to that:
//!
//! * The **first step** allocates each array from the device and frees it when it drops (it
//!   holds exactly what its arrays need), and records every allocation's size and lifetime, as
//!   positions: the k-th allocation of the step on a device is position k.
//! * At its end the record becomes a **plan**: one block per device and an offset in it for each
//!   position, chosen so that arrays alive at the same time never overlap
//!   ([`planner::greedy_by_size`]). Arrays still alive at the step's end are left out.
//! * **Later steps** follow the plan: position k gets its offset, in O(1) and at the same
//!   address every step, when the array is no larger than planned there and no array the plan
//!   placed on those bytes is still alive (checked per allocation: an array kept alive past its
//!   planned end keeps its bytes). A step with smaller sizes fits the plan. A few arrays larger
//!   than planned are served apart on their own, and the step stays on its plan; one that
//!   grew a little since the last plan (attention over the tokens so far) is planned with room
//!   to grow. A step that leaves its plan is planned again at its end, with each position's
//!   largest size. Until then, if it outgrew the plan (the same allocations, larger than the
//!   plan's block holds, in all or in its largest array so far: a longer sequence, a larger
//!   batch, a batch padded to a larger image), the plan's block is given back as soon as no
//!   array uses it, and the rest of the step follows the plan scaled by the ratio in which the
//!   step grew (its largest array so far: a detector's inputs grow otherwise than its feature
//!   maps), in one new block (an array larger than its scaled place is served apart; the rest of
//!   the plan is placed again without the arrays served before, which are not in that block, when
//!   they would keep much of it unused: an input alive through the step). When arrays planned
//!   to live past the first eighth of the rest of the step keep the old block in use (a
//!   training step's attention mask, a detector's feature maps), or any arrays do and waiting
//!   for them would send half the plan's bytes apart (an encoder's hidden states), the plan
//!   scaled is placed again for the rest of the step around them, each until its planned end
//!   ([`planner::greedy_by_size_among`]), and serves it from the old block, grown in place where
//!   it can (CUDA's), when that needs no more bytes than the plan scaled whole. When waiting
//!   for the old block would cost too much (those arrays keep it in use and the rest does not
//!   fit so, half its size went apart while waiting, or the step can no
//!   longer follow the plan scaled), or if the step did not outgrow the plan (an array kept
//!   alive, another order, extra allocations), the rest is served from the block's free bytes
//!   while they hold it. A plan made again is merged with the old one position by position,
//!   unless the merged plan would hold an eighth more than both (another arrangement). It keeps
//!   the old block when it fits, even under a few small arrays still alive there (a training
//!   loop's loss, kept until the next step's replaces it): it is placed around them
//!   ([`planner::greedy_by_size_around`]), or its positions over them wait until they drop, so
//!   a step never holds two blocks for the sake of a few bytes. So under larger ones, up to half
//!   a block that can grow (CUDA's), when the step left its plan and needed at least half the
//!   block itself (a detector's masks, kept by the caller into the next step): the block grows
//!   in place around them. And under many small ones, up to 512, those not kept before holding
//!   at most half of a block that can grow: an optimizer's state made after the first step (a
//!   gradient scaler skipped the first optimizer steps), kept for good, and gradients
//!   accumulated over micro-batches (made by the first, kept to the last); whatever their share
//!   when they were made past the plan's end by a step that followed it there (an optimizer's
//!   state made at the first optimizer step after micro-batches). The steps after follow the
//!   plan placed around them rather than an earlier plan whose positions they would block. The
//!   next micro-batches make the same gradients, add them in and drop them (the last then steps
//!   the optimizer): those positions are *held over*, served in the block in every kind of step,
//!   not from a device block each. The step that drops the gradients has its plan made again,
//!   around the arrays still alive, with those positions held to the step's end: the next first
//!   micro-batch keeps its gradients where the one before did, and the plans of the cycle come
//!   again (given again by the planner, their views with them). A first micro-batch whose plan
//!   did not hold them so places the rest of its step again around them. A first micro-batch
//!   that ends before its plan (the last micro-batch's, which went on to the optimizer's step)
//!   is planned from that plan's step, around the gradients it keeps: the micro-batches after
//!   it and the optimizer's step follow one plan to its end.
//! * **A step larger than its plan, of another kind** (a training loop's evaluation step on a
//!   larger batch, in the training step's scope: it begins as the training step larger, with no
//!   backward pass after). A plan scaled for a step takes the block as it is and grows it only
//!   when a position past its end is served, the step's first position moved to the block's
//!   bottom; and in a loop whose steps began with at most two sizes, a step that outgrows a
//!   training step's plan (most of its peak held by activations kept long) is served from the
//!   block's gaps, the block grown to the plan scaled, once, only if a gap does not hold an
//!   array (a batch raised). The evaluation steps take no memory of their own: ViT-S and
//!   ResNet-50 trained with one every few steps hold 1.01x and 1.02x of their peak live bytes
//!   (1.97x and 2.01x before).
//! * **A first step's arrays that later steps do not make** (a training step's first step makes
//!   its optimizer's state in the middle of the step): a long run of positions apart is skipped
//!   for the position after it, so that the next steps' temporaries of the same sizes are
//!   planned, not served apart one by one.
//! * **Several kinds of step** in one scope (a server's prompt steps and decoding steps) keep a
//!   plan each, up to 33, sharing the block: a step's first allocation picks the plan made for
//!   steps like it. Steps whose counts of larger arrays differ (a CNN whose convolutions cuDNN runs
//!   with other algorithms at another batch size) are of different kinds, and so are steps that
//!   leave a plan by the order of their allocations, with another first allocation, once such a
//!   step comes again with the same sizes in the same order (a CNN trained on batches of several
//!   sizes: a plan per size, rather than one merged plan that the next batch leaves). A step
//!   that follows its plan and ends early (evaluation after training, both beginning with the
//!   same forward pass) is served by that plan. A step much smaller than its plan that leaves it
//!   (a smaller batch in another order) and is unlike the last few is served from the plan's
//!   block and not planned; a kind that comes again soon is.
//! * **Steps that never come again** (a detector's: its feature maps follow each image's size,
//!   its heads keep as many boxes as the image gives) each leave the plan made from the step
//!   before, and plans made again at every step drift up (Mask R-CNN: up to 2.1x of its peak
//!   live bytes). From the first step that leaves its plan, the cache simulates serving the
//!   scope's steps *online* on their records (sizes and lifetimes only: no memory); once, after
//!   four steps, its plans have held more than a sixteenth above what that would have held, and
//!   the plan's block is growable (below), the scope is served online: every allocation of a
//!   step takes the smallest free range of that one block that holds it (best fit), and the
//!   block grows in place at its top, by whole 2 MiB granules, when none does; arrays alive at
//!   a step's end stay where they are (the next step's ranges go around them); no plan is made.
//!   Small arrays (at most 512 bytes) kept from earlier steps split the block's free bytes, so
//!   once the block grows while some are in it, every small array of the scope takes a slot of
//!   a *slab* instead (one device allocation of 128 slots). A step that leaves arrays the block
//!   cannot keep (used on another stream, dropped on another thread and not yet returned, more
//!   than 256) has the plans serve the scope again; [`invalidate`], [`empty_cache`] and
//!   out-of-memory recovery forget the choice. Steps that come again in kind (a CNN whose batch
//!   varies) stay on their plans, which hold them better; the simulation stops after sixteen
//!   steps and starts again later and later, so such a scope pays for it less and less.
//! * **Arrays that outlive their step** (returned, stored, sent to another thread) are served
//!   apart, each from a block of its own rounded up to its size class (one that grew since the
//!   plan and is small beside the cache, like a cache of keys and values, with room to grow as
//!   much again, up to half its size, so that its blocks grow rarer); when one drops after its
//!   step, its block is kept as a spare for the next such array it fits (up to four times as
//!   large as the array or as what its position held when planned; a cache of keys and values
//!   that grows a token a step reuses them, so does a server's next request, shorter, and so does a
//!   model's input whose batch varies), until a device allocation would take the cache past the
//!   most it has held: then spares go back first, so keeping them never raises its peak.
//! * The first step allocates from the device, and so does a step that outgrows its plan (its
//!   scaled plan's block, and the arrays served apart); a step that follows its plan does not.
//!   A plan's block of 32 MiB or more is *growable*: on CUDA it is mapped through the driver's
//!   virtual memory management, on the CPU (Unix) it is a mapping that reserves as many
//!   addresses as a GPU's memory and no memory (the kernel backs the pages touched), in 2 MiB
//!   granules either way, so a larger plan's block is the old one *grown in place* (only the
//!   new bytes are mapped; the old block is not freed) when no array uses it: the block a plan
//!   gives up is kept for the next plan's block, and freed first if the cache would otherwise
//!   hold more than it ever has. On CUDA, freeing such a block waits for the device to finish
//!   with it. Where the host refuses the addresses (valgrind, `vm.overcommit_memory = 2`), and
//!   in a process whose addresses are limited (`ulimit -v`, which the reserve would count
//!   against), the CPU's blocks are allocated as any other; a larger plan then takes a new block while arrays
//!   still hold the old one (Keypoint R-CNN's varying inference, replayed: 2.05x of its peak
//!   live bytes so, 1.27x grown).
//!   [`Reuse`] does not apply.
//!
//! Replayed from real models' allocation logs (`examples/replay`, BENCHMARKS.md), the peak held
//! over the peak live bytes is 1.000x on GPT-2 training, 1.005x on ResNet-50 training, 1.001x on
//! ViT-S/16 and T5 training; 1.013x, 1.007x and 1.016x on BERT (two attention kernels) and GPT-2
//! whose sequence length varies every batch; 1.040x, 1.040x, 1.004x and 1.016x on EfficientNet,
//! ConvNeXt, ResNet-18 and ViT-B whose batch varies every step; 1.012x on GPT-2 decoding; and
//! 1.30x and 1.10x on Llama-style and OPT servers alternating prompts and decoding. Exact keys
//! with [`Reuse::OnExit`] hold 2.4x to 106x there, CUDA's stream-ordered pool 1.02x to 1.82x.
//! Detectors, whose steps never come again, as recorded and replayed five times longer in
//! shuffled orders, hold 1.08x to 1.44x: Faster R-CNN 1.08x, Keypoint R-CNN 1.15x-1.19x, Faster
//! R-CNN v2 1.22x, Mask R-CNN 1.11x-1.29x, FCOS and RetinaNet 1.27x-1.44x (on one such run,
//! PyTorch's caching allocator holds them at 1.67x-3.96x, 1.14x-1.44x with expandable segments).
//!
//! ## Choosing a key policy
//!
//! Measured on real models' allocation logs (PyTorch training, varying-length inference and
//! decoding, replayed by `examples/replay`; the figures are in the repository's BENCHMARKS.md):
//!
//! * **Memory near a step's peak**, whatever its shapes: [`KeyPolicy::Planned`], the default (see
//!   above). Its first two steps, and steps that leave their plan, allocate from the device.
//! * **Every buffer of a step distinct** (a buffer's address stays its array's until the scope
//!   exits): [`KeyPolicy::Exact`] with [`Reuse::OnExit`]. No device allocation after the first
//!   step on fixed shapes, but a step holds the sum of what it allocates; with
//!   [`Reuse::Immediate`] a buffer dropped inside the step serves a later array of its key.
//! * **Shapes that vary, with free lists**: [`KeyPolicy::SizeClass`] with [`Reuse::Immediate`]
//!   holds the least of the free-list policies on the real logs; exact keys there allocate in
//!   every step and keep what they allocated.
//! * A byte cap (`max_cached_bytes`) over exact keys does not fix varying shapes: the cache
//!   evicts the buffers the next steps would have hit, and allocates nearly every step.
//! * `KeyPolicy::Arena`, a bump arena that held a step's sum of bytes, is deprecated: it is now
//!   the planned policy.
//!
//! How each policy fares (device allocations, peak bytes, time per step) is measured by the
//! benches, and the figures are kept in the repository's BENCHMARKS.md.
//!
//! ## Threads
//!
//! Names are process-wide, storage is per thread.
//!
//! * **Per thread**: two threads using the name `train_step` have two caches, each with its own
//!   free lists, counters and lock; the owner holds its lock for a whole scope, so the hit path
//!   takes no lock another thread contends for.
//! * **Per name**: [`invalidate`], [`configure`] and [`reset_peak`] act on the name on every
//!   thread. Another thread's cache is changed at once when that thread is not inside a scope of
//!   it, else when that scope exits; [`configure`] also holds for caches created later.
//!   [`stats`] reads the calling thread's cache, [`snapshot`] every thread's (exited threads'
//!   included: their rows go on counting the frees of their arrays still alive elsewhere) and
//!   [`Snapshot::total`] sums them by name.
//! * **Arrays dropped on another thread** go back to their home cache's return queue. The owner
//!   takes it in when it next enters a scope of the cache (the buffers are free for that step),
//!   when it misses, and when a scope exits. [`empty_cache`], [`invalidate`] and out-of-memory
//!   recovery give queued buffers back to the device from any thread, whatever the owner is
//!   doing, so nothing is stranded behind an idle or blocked thread.
//! * **A thread that exits** closes its caches: free buffers go back to the device, and its
//!   arrays still alive elsewhere are freed when they drop.
//!
//! ## Decisions
//!
//! * Zero-size arrays own no memory and never touch a cache (no hit, no miss).
//! * `bytes_in_use` counts buffers handed out and not yet free, including those dropped inside
//!   a scope that has not exited; `peak_bytes` is the peak of `bytes_in_use + bytes_cached`.
//! * Another thread's cache that is inside a scope when [`empty_cache`] (or out-of-memory
//!   recovery) runs has its free lists released when that scope exits, not at once (buffers
//!   returned to it are released at once). Out-of-memory recovery on the thread that ran out
//!   also frees what its own active scopes hold for their exit.
//! * `bytes_in_use` of a cache includes buffers other threads returned to it and it has not
//!   taken in yet; [`Error::OutOfMemory`]'s `in_use` counts live arrays only.
//! * A cache tracks at most 16 devices per thread; inside its scope, an allocation on a 17th
//!   device is made from the device directly (as outside any scope).
//! * [`Snapshot::total`] sums `peak_bytes` over threads: an upper bound of the name's peak.
//! * Changing a cache's [`KeyPolicy`] with [`configure`] invalidates it.
//! * A planned cache's plan block and spares that no array uses count as cached, and
//!   `max_cached_bytes` bounds the spares. A position's arrays that another thread dropped
//!   during the step keep their bytes taken until the plan is made again (the owner does not see
//!   the drop at once): a later array over them is served apart.
//! * On CUDA a planned array is a view of its part of the block, which gets a cudarc slice of its
//!   own (with its own read/write events when cudarc tracks them) at its first use that needs one:
//!   none while the context has a single stream, where cudarc uses no slice's events and a kernel
//!   gets the array's device address (see the `cuda` module). The block is made ready for the
//!   thread's stream at each step's first hit, so bytes reused within a step are ordered by that
//!   stream; an array used on another stream (`Array::record_stream`, or a stream switched
//!   mid-step) keeps its bytes until the step ends, and then the block leaves the plan and is freed
//!   after the recorded events.
//! * [`Element`] is sealed: buffers are shared between element types under
//!   [`KeyPolicy::SizeClass`], which is sound only for plain types.
//! * Host memory is always initialised (new buffers are zeroed), so [`Array::empty`] is never
//!   undefined behaviour to read. Host buffers of 1 MiB and more are `mmap`ed directly, so they
//!   are zeroed lazily by the kernel. Device memory is never memset for `empty` (as
//!   `torch.empty`): a new device buffer holds what the device gives, memory the process may
//!   have used before, which is read only through copies. `zeros` and `bool` arrays (not every
//!   byte is a `bool`) zero their own bytes, also when they get part of a planned cache's block,
//!   which is never zeroed as a whole. (Replaying the BERT log on an H200, the memsets of new
//!   blocks had been more than half of the planned cache's host time per step.)
//! * [`invalidate`] empties the free lists but keeps the cache's table of keys (a few dozen
//!   bytes per distinct key), so that the buffers of arrays still alive always know their free
//!   list. A thread's cache names likewise live as long as the thread.
//! * `hits` and `misses` count allocations that succeeded; a failed allocation counts in
//!   neither.
//! * Beyond the core API: [`current_scope`] (the innermost scope's name),
//!   [`device_stats`] (what a device's backend allocated and freed, cached or not) and the
//!   [`testing`] module.
//!
//! ## CUDA (feature `cuda`)
//!
//! With the `cuda` feature, arrays live on [`Device::Cuda`] through [cudarc] (loaded at run
//! time, so the crate builds on machines without CUDA; [`Device::cuda`] reports a missing
//! driver or GPU as an [`Error`]). A CUDA array is a cudarc buffer: it passes straight to kernel
//! launches and cuBLAS, with no copy. Allocations are stream-ordered on the thread's current
//! stream, and arrays used on other streams are marked with `Array::record_stream`. A warm
//! step can be captured once as a CUDA graph and replayed (`cuda::StepGraph`): allocations
//! inside the capture must be cache hits, and a miss is a typed error, never a silently wrong
//! graph. The `cuda` module documents all of it, with examples.
//!
//! [cudarc]: https://docs.rs/cudarc
//!
//! ## Several GPUs (feature `nccl`)
//!
//! The device is part of every cache key, so one thread (or process) per GPU with its own scopes
//! is the normal set-up: buffers never cross devices, and out-of-memory recovery releases only
//! the failing device's buffers. With the `nccl` feature, `nccl::Comm` runs NCCL's
//! all-reduce, broadcast and send/receive on gpucache arrays, with no copy, on the thread's
//! current stream of their device; a data-parallel step all-reduces its cached gradients inside
//! its scope. gpucache is not a communication library: starting ranks and handing NCCL's unique
//! id over are the program's. The `nccl` module documents the set-ups.
//!
//! gpucache's own methods (`Array::record_stream`, the NCCL calls) refuse an array of another
//! device with [`Error::DeviceMismatch`]. A kernel launch cannot check devices (cudarc's launch
//! builder does not tell its arguments which stream they are for), so an array of another GPU
//! given to a kernel is what CUDA makes of it: a fault of that launch
//! (`CUDA_ERROR_ILLEGAL_ADDRESS`, after which that GPU's context is unusable) or, where peer
//! access is enabled, a read of the other GPU's memory.
//!
//! ## Memory over time
//!
//! Recording is opt-in, at run time: `GPUCACHE_TRACE=trace.json` in the environment records
//! the whole run and writes the file when the process exits, and [`trace::start`] /
//! [`trace::stop`] record part of a run from code and hand the events back. Every scope entry
//! and exit, hit, miss, drop, device free, invalidation, eviction, `empty_cache`, out-of-memory
//! (with the release and the retry's outcome) and return from another thread is an
//! [`trace::Event`] with its time, thread, cache, key, bytes, device and CUDA stream. The file
//! is Chrome trace-event JSON: open it at <https://ui.perfetto.dev> (or `chrome://tracing`) to see
//! each thread's scopes as slices and the bytes in use and cached as counter tracks per device
//! and per cache. While recording is off it costs nothing measurable (one test of a flag the
//! hot paths already test); the [`trace`] module has the details and the cost per event.
//! In a planned cache ([`KeyPolicy::Planned`]) an array served from the plan or a spare is
//! recorded as a hit and one that needed a new block as a miss, each with the array's bytes and
//! address (and no key), the plan's block when it is allocated as
//! [`EventKind::PlanBlock`](trace::EventKind::PlanBlock), a slab of small arrays as
//! [`EventKind::SlabBlock`](trace::EventKind::SlabBlock), a drop as back to the cache (or
//! returned, from another thread), and a block given back to the device as a device free, so a
//! trace of planned caches replays.
//!
//! With the `tracing` feature, misses, evictions and invalidations are also `tracing` debug
//! events and out-of-memory a warning (hits never are).
//!
//! ## Turning caching off
//!
//! `GPUCACHE_DISABLE=1` in the environment (or `true`, `yes`, `on`, in any case; read once, at
//! the first scope entered or allocation) turns caching off for the process: scopes are still
//! entered, but every array allocates from the device and frees to it directly, so tools such
//! as `compute-sanitizer` see every buffer's own allocation. [`stats`] then counts no hits or
//! misses, and [`summary`] starts with the line `caching disabled (GPUCACHE_DISABLE)`. `0`,
//! `false`, `no`, `off` and the empty string leave caching on; any other value leaves it on with
//! a one-line warning on standard error.
//!
//! ## Testing code that uses gpucache
//!
//! [`testing::CountingBackend`] counts allocations and frees and fails allocations on demand.

#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod alloc;
mod array;
mod backend;
mod cache;
mod config;
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub mod cuda;
mod device;
mod dtype;
mod error;
mod instrument;
mod metrics;
#[cfg(feature = "nccl")]
#[cfg_attr(docsrs, doc(cfg(feature = "nccl")))]
pub mod nccl;
pub mod planner;
mod registry;
mod scope;
mod shape;
mod sync;
pub mod testing;
#[cfg(test)]
mod tests;
mod thread;
pub mod trace;

pub use array::Array;
pub use config::{CacheConfig, KeyPolicy, Reuse};
pub use device::Device;
pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use half::{bf16, f16};
pub use metrics::{CacheStats, DeviceStats, DeviceUsage, Snapshot, SnapshotRow};
pub use registry::{
    configure, device_stats, empty_cache, invalidate, reset_peak, snapshot, stats, summary,
};
pub use scope::{ScopeGuard, current_scope, enter};
pub use shape::Shape;

/// The block macro `cache_scope!(name, { ... })`: runs a block inside the scope `name`. (The
/// attribute is [`#[cache_scope]`](crate::prelude::cache_scope) in the prelude.)
pub use gpucache_macros::cache_scope_block as cache_scope;

/// The names most programs need: `use gpucache::prelude::*;`.
pub mod prelude {
    pub use crate::{
        Array, CacheConfig, DType, Device, Element, Error, KeyPolicy, Result, Reuse, Shape, bf16,
        f16, invalidate, stats,
    };
    /// The attribute `#[cache_scope(name)]`: runs a function inside the scope `name`. (The block
    /// macro is [`cache_scope!`](crate::cache_scope!) at the crate root.)
    pub use gpucache_macros::cache_scope;
}

/// What the macros expand to. Not part of the public API.
#[doc(hidden)]
pub mod __private {
    pub use crate::instrument::{
        Instrumented, Literal, ScopeName, enter_named, instrument, instrument_fn,
    };
    pub use crate::scope::{ScopeGuard, enter};
}
