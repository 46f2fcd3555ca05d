//! Procedural macros of [`gpucache`](https://docs.rs/gpucache): `#[cache_scope(name)]` and
//! `cache_scope!(name, { ... })`.
//!
//! Use them through `gpucache` (`use gpucache::prelude::*; use gpucache::cache_scope;`), not from
//! this crate directly: the expansion names `::gpucache::__private`.
