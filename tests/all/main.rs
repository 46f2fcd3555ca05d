//! The CPU integration tests, in one binary (one link instead of one per file):
//!
//! * `semantics`: the cache's rules, one test each (and on the GPU in `tests/cuda`);
//! * `planned`: planned caches (`KeyPolicy::Planned`, the default): plans, divergence, escapes,
//!   drops on other threads, the byte cap, invalidation, out-of-memory recovery, thread exit;
//! * `threads`: named caches across threads;
//! * `failures`: typed errors, out-of-memory recovery, `empty_cache`;
//! * `faults`: allocations failing on purpose (`testing::CountingBackend`);
//! * `prop_programs`: random operation programs on caches of free lists, checked against a model
//!   after every step; `prop_planned`: random programs on planned caches, checked for safety (no
//!   shared storage, patterns intact, every byte accounted and given back) and for settling on
//!   a plan; `prop_kept`: random training loops whose steps differ and keep their loss past
//!   their end, checked for safety; `programs`: what the two share;
//! * `stress`: many threads, many operations;
//! * `disable`: `GPUCACHE_DISABLE` (in child processes of this binary, their output captured);
//! * `macros`: `#[cache_scope]` and `cache_scope!` at run time, in every form;
//! * `trace`: recording, the Chrome trace-event JSON, `GPUCACHE_TRACE` (child processes), the
//!   allocation log of `gpucache_suite::replay` and the replay of its fixture;
//! * `replay_logs`: the PyTorch models' allocation logs (`tests/fixtures/*.csv.gz`) replay at or
//!   above their peak live bytes, and planned caches within 1.10x (1.5x on decoding);
//! * `plan`: the step planner (`gpucache::planner`; property tests, small plans worked out by
//!   hand, and what plans hold on the PyTorch models' logs);
//! * `tracing_events` (feature `tracing`): misses, evictions, invalidations and out-of-memory as
//!   `tracing` events.
//!
//! `macros_lint` (crate-level lint attributes) and `ui` (trybuild) stay binaries of their own.
//!
//! Tests that act on every thread's caches (`empty_cache`, out-of-memory recovery, whole-process
//! readings) hold `common::serial()` (`gpucache_suite::common`); every other test that checks
//! what a cache holds holds `common::shared()` (taken by the `common::device_tests!` wrappers),
//! so the two never overlap.

mod disable;
mod failures;
mod faults;
mod macros;
mod plan;
mod planned;
mod programs;
mod prop_kept;
mod prop_planned;
mod prop_programs;
mod replay_logs;
mod semantics;
mod stress;
mod threads;
mod trace;
mod tracing_events;
