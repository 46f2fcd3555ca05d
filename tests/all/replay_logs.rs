//! The PyTorch allocation logs (`tests/fixtures/*.csv.gz`, written on a GPU by
//! `examples/replay/record_torch.py`): each parses, has live bytes, and replays on the CPU under
//! every configuration of `replay::CONFIGS` and bare, each peaking at or above the log's
//! peak live bytes (the lower bound of any allocator), with the same figures every time; planned
//! caches hold at most 1.10x the peak live bytes on the training and varying-shape logs (1.12x
//! on MobileNetV3 trained with a varying batch, replayed in other orders, above the target: see
//! BENCHMARKS.md) and
//! 1.5x on decoding and serving, with no device allocation after the second step on the
//! fixed-shape training logs, and after it fewer than one in twenty of the allocations on the
//! others (a step larger than every one before it, served from its plan scaled; the keys and
//! values crossing size classes, and those of new requests); the varying-shape logs' steps
//! replayed longer in other orders stay within the same bound and, but one, make no device
//! allocation in the second half of their steps; and a zero-byte allocation replays in every
//! mode.

use gpucache::{CacheConfig, Device, KeyPolicy};

use gpucache_suite::common::serial;
use gpucache_suite::replay::{self, CONFIGS, Mode, Op, arena};

/// Each log, and the most its planned replay may hold over its peak live bytes.
const LOGS: &[(&str, f64)] = &[
    ("gpt2_train", 1.10),
    ("resnet50_train", 1.10),
    ("vit_train", 1.10),
    ("t5_train", 1.10),
    ("llama_ckpt_train", 1.10),
    ("resnet_epochs_train", 1.10),
    ("gpt2_vary_train", 1.10),
    ("mobilenet_vary_train", 1.10),
    ("bert_infer", 1.10),
    ("effnet_infer", 1.10),
    ("convnext_infer", 1.10),
    ("bert_eager_infer", 1.10),
    ("gpt2_infer", 1.10),
    ("resnet18_infer", 1.10),
    ("vit_infer", 1.10),
    ("deeplab_infer", 1.10),
    ("densenet_infer", 1.10),
    ("gpt2_decode", 1.5),
    ("llama_serve", 1.5),
    ("opt_serve", 1.5),
    ("mistral_decode", 1.5),
];

/// Whether `log` trains on inputs of one shape (or one more for an epoch's last batch): no
/// device allocation after its second step.
fn fixed_shapes(log: &str) -> bool {
    log.ends_with("_train") && !varying(log)
}

/// Whether `log`'s inputs change shape every step.
fn varying(log: &str) -> bool {
    log.ends_with("_infer") || log.ends_with("_vary_train")
}

/// Sets the fixtures' caches back to the default when dropped (even on a failure), for the tests
/// that use the same names.
struct Defaults(Vec<String>);

impl Drop for Defaults {
    fn drop(&mut self) {
        for name in &self.0 {
            gpucache::configure(name, CacheConfig::default());
        }
    }
}

#[test]
fn the_torch_fixtures_replay_at_or_above_their_peak_live_bytes() {
    let _serial = serial();
    let mut defaults = Defaults(Vec::new());
    for &(log, bound) in LOGS {
        let path = format!("{}/tests/fixtures/{log}.csv.gz", env!("CARGO_MANIFEST_DIR"));
        let ops = replay::read(path.as_ref()).unwrap();
        assert!(
            replay::steps(&ops) >= 6,
            "{log}: {} steps",
            replay::steps(&ops)
        );
        defaults.0.extend(ops.iter().filter_map(|op| match op {
            Op::Enter(name) => Some(name.clone()),
            _ => None,
        }));
        defaults.0.dedup();
        let live = replay::peak_live(&ops);
        assert!(live > 0, "{log}");
        let modes = CONFIGS.iter().map(|(_, c)| Mode::Configured(*c));
        for mode in modes.chain([Mode::Bare]) {
            let m = replay::memory(&ops, Device::Cpu, mode).unwrap();
            assert_eq!(m.peak_live, live);
            assert!(m.peak_device >= live, "{log}, {mode:?}: {m:?}");
            let again = replay::memory(&ops, Device::Cpu, mode).unwrap();
            assert_eq!(again, m, "{log}, {mode:?}: the figures are deterministic");
            if matches!(mode, Mode::Configured(c) if c.key == KeyPolicy::Planned) {
                let ratio = m.peak_device as f64 / live as f64;
                assert!(
                    ratio <= bound,
                    "{log}, planned: {ratio:.3}x > {bound}x ({m:?})"
                );
                if fixed_shapes(log) {
                    assert_eq!(m.allocs_after_step2, 0, "{log}, planned: {m:?}");
                }
                let allocs = ops
                    .iter()
                    .filter(|op| matches!(op, Op::Alloc { .. }))
                    .count();
                assert!(
                    m.allocs_after_step2 * 20 < allocs as u64,
                    "{log}, planned: {} of {allocs} allocations after step 2",
                    m.allocs_after_step2
                );
            }
        }
    }
    // Zero-byte allocations (torch logs may hold odd sizes) replay in every mode.
    let alloc = |buffer, bytes| Op::Alloc {
        cache: "replay_logs_zero".into(),
        buffer,
        bytes,
        elem: 1,
        dims: vec![bytes],
    };
    let ops = [
        Op::Enter("replay_logs_zero".into()),
        alloc(1, 0),
        alloc(2, 512),
        Op::Free { buffer: 1 },
        Op::Free { buffer: 2 },
        Op::Exit("replay_logs_zero".into()),
    ];
    let modes = CONFIGS.iter().map(|(_, c)| Mode::Configured(*c));
    for mode in modes.chain([Mode::Bare]) {
        let m = replay::memory(&ops, Device::Cpu, mode).unwrap();
        assert!(m.peak_device >= 512, "{mode:?}: {m:?}");
    }
}

/// The logs whose long runs still allocate in their second half: ConvNeXt-T's input batch (1 to
/// 48 images), alive into the next step and so served apart, takes any larger spare block at
/// the cache's high-water mark, but inputs of 13, 4 and 23 MiB in a row need a third block (the
/// 4 MiB one took the larger of two, the other is too small: once, in one of the two orders;
/// BENCHMARKS.md, "The second half of a long run").
const STEADY_STATE_NOT_YET: &[&str] = &["convnext_infer"];

/// The varying-shape logs replayed longer, their steps after the first in shuffled
/// orders (`replay::reordered`: five more passes, two seeds), as a long run of such a model
/// brings them: the planned cache still holds at most its bound over the run's peak live bytes,
/// and makes no device allocation in the second half of the run's steps, where every kind of
/// step (every batch size or length of the recording) has come at least twice before (but
/// [`STEADY_STATE_NOT_YET`]).
/// EfficientNet's batches of 1 to 64 make more kinds of step than a cache keeps plans for; before
/// the plan of the largest footprint was always kept, both orders held 1.55x (a large batch
/// matched with a small batch's plan, its block's gaps fragmented, the rest allocated apart).
#[test]
fn varying_logs_replayed_longer_in_other_orders_stay_within_their_bound() {
    let _serial = serial();
    let mut defaults = Defaults(Vec::new());
    for &(log, bound) in LOGS.iter().filter(|(log, _)| varying(log)) {
        let path = format!("{}/tests/fixtures/{log}.csv.gz", env!("CARGO_MANIFEST_DIR"));
        let ops = replay::read(path.as_ref()).unwrap();
        defaults.0.extend(ops.iter().filter_map(|op| match op {
            Op::Enter(name) => Some(name.clone()),
            _ => None,
        }));
        defaults.0.dedup();
        for seed in [1, 7] {
            let long = replay::reordered(&ops, 5, seed);
            assert_eq!(replay::steps(&long), 6 * replay::steps(&ops) - 5, "{log}");
            let count = |free: bool| {
                long.iter()
                    .filter(|op| matches!(op, Op::Free { .. }) == free)
                    .filter(|op| matches!(op, Op::Alloc { .. } | Op::Free { .. }))
                    .count()
            };
            assert_eq!(
                count(true),
                count(false),
                "{log}: every array is freed once"
            );
            let m = replay::memory(&long, Device::Cpu, Mode::Configured(CONFIGS[0].1)).unwrap();
            let ratio = m.peak_device as f64 / m.peak_live as f64;
            assert!(
                ratio <= bound,
                "{log}, seed {seed}: {ratio:.3}x > {bound}x ({m:?})"
            );
            if !STEADY_STATE_NOT_YET.contains(&log) {
                assert_eq!(
                    m.allocs_in_second_half, 0,
                    "{log}, seed {seed}: device allocations in the second half ({m:?})"
                );
            }
        }
    }
}

/// The planned replay of `ops` on this thread through a fresh counting backend (growable as
/// asked, mapped in granules of `granularity` bytes if not 0): the most bytes it held over the
/// log's peak live bytes, the device allocations after the second step, and the growths.
fn planned_on(ops: &[Op], growable: bool, granularity: usize) -> (f64, u64, u64) {
    let backend = gpucache::testing::CountingBackend::new();
    backend.set_growable(growable);
    backend.set_granularity(granularity);
    let installed = gpucache::testing::use_backend(&backend);
    gpucache::empty_cache();
    let r = replay::replay(ops, Device::Cpu, Mode::Gpucache).unwrap();
    gpucache::empty_cache();
    drop(installed);
    assert_eq!(backend.outstanding_bytes(), 0, "every byte went back");
    let ratio = backend.peak_bytes() as f64 / replay::peak_live(ops) as f64;
    (ratio, r.allocs_after_step2(), backend.grows())
}

/// Blocks grown in place hold each fixture within its bound, within a hundredth of its peak with
/// new blocks instead (a grown block is kept where a new one would be made at a step's
/// footprint, and the steps after may fit it otherwise: DenseNet 1.021x grown, 1.016x not);
/// mapped in the H100's granules, as the CUDA backend maps them, within the bound (BERT 1.022x
/// so, as on the GPU, 1.013x as asked), with no more allocations than new blocks. (Grown by
/// the bytes asked, the Llama-style server and Mistral's decoding make more, 13 and 9 after the
/// second step against 7 and 4 with new blocks, whose arrays apart the rooms of retired blocks
/// serve: each growth counts as an allocation, and the server's prompt longer than any before
/// grows its block ten times in its step. In the granules, 7 and 4.)
#[test]
fn plan_blocks_grown_in_place_keep_the_fixtures_peaks_and_allocate_no_more() {
    let _serial = serial();
    let mut grows = 0;
    for &(log, bound) in LOGS {
        let path = format!("{}/tests/fixtures/{log}.csv.gz", env!("CARGO_MANIFEST_DIR"));
        let ops = replay::read(path.as_ref()).unwrap();
        let (peak, allocs, _) = planned_on(&ops, false, 0);
        let (grown_peak, _, grown) = planned_on(&ops, true, 0);
        let (mapped_peak, mapped_allocs, _) = planned_on(&ops, true, arena::GPU_GRANULE);
        assert!(
            mapped_peak <= bound,
            "{log}: {mapped_peak:.3}x in the H100's granules"
        );
        assert!(
            grown_peak <= peak + 0.01 && grown_peak <= bound,
            "{log}: {grown_peak:.3}x grown, {peak:.3}x not"
        );
        assert!(mapped_allocs <= allocs, "{log}: {mapped_allocs} > {allocs}");
        grows += grown;
    }
    assert!(grows > 0, "no plan block grew");
}

/// `empty_cache` is a cold start: nothing a cache learned from one replay changes the next. The
/// planner's choice of its first way of placing a step's arrays (the way that last came within
/// a 32nd of the peak, or won several plans running) outlived it, and a replay's plans depended
/// on the replays before it (BERT inference on growable blocks held 1.01268x of its peak live
/// bytes after a replay on blocks that do not grow, 1.01265x replayed first).
#[test]
fn a_replay_after_empty_cache_holds_what_a_first_replay_holds() {
    let _serial = serial();
    let path = format!(
        "{}/tests/fixtures/bert_infer.csv.gz",
        env!("CARGO_MANIFEST_DIR")
    );
    let ops = replay::read(path.as_ref()).unwrap();
    let first = planned_on(&ops, true, 0);
    planned_on(&ops, false, 0);
    assert_eq!(planned_on(&ops, true, 0), first);
}

/// The default CPU backend holds what the GPU holds: where the host grants the addresses, it
/// maps a planned cache's blocks in the H100's granules and grows them in place, as the CUDA
/// backend does, so a replay through it peaks at the counting backend's bytes so mapped, not at
/// those of blocks that cannot grow (which differ on these logs: BERT inference 1.022x against
/// 1.013x); elsewhere (valgrind, `vm.overcommit_memory = 2`) at the latter.
///
/// The replay through the CPU backend reads the backend's bytes, which every thread of the
/// process moves, and other tests of this binary allocate through it meanwhile (one such run
/// read 256 bytes less than the counting backend: a test's array held when the replay started
/// and freed during it): it runs alone, in a child process.
#[test]
fn the_cpu_backend_holds_what_the_gpu_holds() {
    let stderr = gpucache_suite::common::run_child(
        "replay_logs::the_cpu_backend_holds_what_the_gpu_holds_alone",
        &[],
        "the replay through the CPU backend, in a child process",
    );
    stderr
        .lines()
        .filter(|l| l.starts_with("notice:"))
        .for_each(|l| eprintln!("{l}"));
}

/// What [`the_cpu_backend_holds_what_the_gpu_holds`] runs in a child process (listed as ignored
/// in a normal run).
#[test]
#[ignore = "run by the_cpu_backend_holds_what_the_gpu_holds in a child process"]
fn the_cpu_backend_holds_what_the_gpu_holds_alone() {
    let _serial = serial();
    let grows = gpucache::testing::host_grows_blocks();
    if !grows {
        eprintln!(
            "notice: this host refuses growable mappings; the CPU backend's blocks do not grow"
        );
    }
    for log in ["bert_infer", "convnext_infer", "effnet_infer"] {
        let path = format!("{}/tests/fixtures/{log}.csv.gz", env!("CARGO_MANIFEST_DIR"));
        let ops = replay::read(path.as_ref()).unwrap();
        let m = replay::memory(&ops, Device::Cpu, Mode::Gpucache).unwrap();
        let real = m.peak_device as f64 / m.peak_live as f64;
        let (mapped, ..) = planned_on(&ops, true, arena::GPU_GRANULE);
        let (fixed, ..) = planned_on(&ops, false, 0);
        assert_ne!(mapped, fixed, "{log}: the two backends differ");
        let expected = if grows { mapped } else { fixed };
        assert_eq!(
            real, expected,
            "{log}: {real:.4}x, granules {mapped:.4}x, fixed {fixed:.4}x"
        );
    }
}
