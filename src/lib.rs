//! The code that gpucache's integration tests (`tests/`) and examples (`examples/`) share, as
//! the library of the root package `gpucache-suite` (not published): they
//! `use gpucache_suite::...` it.
//!
//! * [`common`]: the tests' helpers (device tests, locks between tests, patterns, child
//!   processes, the GPU harnesses' trials);
//! * [`replay`]: allocation logs and their replay (`examples/replay`, `examples/train_cuda`,
//!   `tests/all`);
//! * [`trace_plot`]: memory over time drawn from a trace (`examples/train`,
//!   `examples/plot_trace`);
//! * `mlp` (feature `cuda`): the MLP the CUDA examples train and the GPU tests capture.
//!
//! Its doc tests include the README's Rust code blocks (`ReadmeDoctests`).

pub mod common;
#[cfg(feature = "cuda")]
pub mod mlp;
pub mod replay;
pub mod trace_plot;

/// The Rust code blocks of the repository's README.md, compiled and run as this crate's doc
/// tests by `cargo test` (a block that cannot run says why, and is marked `no_run` or `ignore`).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
