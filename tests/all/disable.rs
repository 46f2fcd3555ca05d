//! `GPUCACHE_DISABLE=1` turns caching off for the process. The variable is read once, so the
//! test re-runs itself in a child process with it set.

use std::process::Command;

use crate::common;
use gpucache::{Array, Device, enter, stats};

const CHILD: &str = "disable::disabled_caching_allocates_and_frees_directly";

#[test]
fn disabled_caching_allocates_and_frees_directly() {
    if std::env::var_os("GPUCACHE_DISABLE").is_none_or(|v| v != "1") {
        let status = Command::new(std::env::current_exe().expect("test binary"))
            .args(["--exact", CHILD, "--test-threads=1"])
            .env("GPUCACHE_DISABLE", "1")
            .status()
            .expect("the test binary runs");
        assert!(status.success(), "the run with GPUCACHE_DISABLE=1 failed");
        return;
    }
    let (backend, _installed) = common::counting();
    for _ in 0..3 {
        let _scope = enter("disabled");
        assert_eq!(gpucache::current_scope().as_deref(), Some("disabled"));
        let a = Array::<f32>::zeros(Device::Cpu, [64, 64]).unwrap();
        assert_eq!(backend.outstanding_bytes(), 64 * 64 * 4);
        drop(a); // freed at once, not kept for the scope's exit
        assert_eq!(backend.outstanding_bytes(), 0);
    }
    assert_eq!((backend.allocs(), backend.frees()), (3, 3));
    let s = stats("disabled");
    assert_eq!((s.hits, s.misses, s.bytes_cached), (0, 0, 0));
}
