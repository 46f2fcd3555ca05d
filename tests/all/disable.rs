//! `GPUCACHE_DISABLE` turns caching off for the process. The variable is read once, so each test
//! re-runs [`child_process`] in a child process of this binary with it set, and shows the
//! child's output only when it fails.

use gpucache::{Array, Device, enter, stats};
use gpucache_suite::common;

const CHILD: &str = "disable::child_process";

/// Runs [`child_process`] with `GPUCACHE_DISABLE=value`, expecting caching `disabled` or not;
/// returns the child's standard error.
fn child(value: &str, disabled: bool) -> String {
    let expect = if disabled { "off" } else { "on" };
    gpucache_suite::common::run_child(
        CHILD,
        &[
            ("GPUCACHE_DISABLE", value),
            ("GPUCACHE_DISABLE_EXPECT", expect),
        ],
        &format!("the run with GPUCACHE_DISABLE={value:?}"),
    )
}

/// The warning an unrecognised value gives, as lines of `stderr`.
fn warnings(stderr: &str) -> usize {
    stderr
        .lines()
        .filter(|l| l.starts_with("gpucache: GPUCACHE_DISABLE="))
        .count()
}

#[test]
fn disabled_caching_allocates_and_frees_directly() {
    for value in ["1", "true", "YES", "On"] {
        assert_eq!(warnings(&child(value, true)), 0, "{value:?}");
    }
}

#[test]
fn off_values_leave_caching_on() {
    for value in ["", "0", "false", "No", "OFF"] {
        assert_eq!(warnings(&child(value, false)), 0, "{value:?}");
    }
}

#[test]
fn another_value_leaves_caching_on_with_one_warning() {
    assert_eq!(warnings(&child("2", false)), 1);
}

/// What the child processes run (listed as ignored in a normal run).
#[test]
#[ignore = "run by the other tests of this module in a child process"]
fn child_process() {
    common::free_lists("disabled");
    let disabled = match std::env::var("GPUCACHE_DISABLE_EXPECT").as_deref() {
        Ok("off") => true,
        Ok("on") => false,
        _ => panic!("run by the tests of this module, with GPUCACHE_DISABLE_EXPECT set"),
    };
    let (backend, _installed) = common::counting();
    for _ in 0..3 {
        let _scope = enter("disabled");
        assert_eq!(gpucache::current_scope().as_deref(), Some("disabled"));
        let a = Array::<f32>::zeros(Device::Cpu, [64, 64]).unwrap();
        assert_eq!(backend.outstanding_bytes(), 64 * 64 * 4);
        drop(a); // disabled: freed at once, not kept for the scope's exit
        let left = if disabled { 0 } else { 64 * 64 * 4 };
        assert_eq!(backend.outstanding_bytes(), left);
    }
    let s = stats("disabled");
    let note = gpucache::summary().contains("caching disabled (GPUCACHE_DISABLE)");
    if disabled {
        assert_eq!((backend.allocs(), backend.frees()), (3, 3));
        assert_eq!((s.hits, s.misses, s.bytes_cached), (0, 0, 0));
        assert!(note, "summary() says that caching is disabled");
    } else {
        assert_eq!((backend.allocs(), s.hits, s.misses), (1, 2, 1));
        assert!(!note);
        gpucache::invalidate("disabled");
    }
    // A planned cache (the default) likewise: its plan's hit path serves nothing.
    let before = (backend.allocs(), backend.frees());
    for _ in 0..3 {
        let _scope = enter("disabled-planned");
        let a = Array::<f32>::zeros(Device::Cpu, [64, 64]).unwrap();
        drop(a);
    }
    let s = stats("disabled-planned");
    if disabled {
        assert_eq!(
            (backend.allocs(), backend.frees()),
            (before.0 + 3, before.1 + 3)
        );
        assert_eq!((s.hits, s.misses), (0, 0));
    } else {
        // The first step allocates the array, the second the plan's block; the third is a hit.
        assert_eq!((s.misses, s.hits), (2, 1));
        gpucache::invalidate("disabled-planned");
    }
}
