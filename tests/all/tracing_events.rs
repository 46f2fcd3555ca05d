//! Feature `tracing`: misses, evictions and invalidations are `tracing` debug events, an
//! out-of-memory a warning, and hits none (checked with a subscriber that collects them).
#![cfg(feature = "tracing")]

use std::fmt::Debug;
use std::sync::{Arc, Mutex};

use gpucache::testing::{CountingBackend, use_backend};
use gpucache::{Array, Device, Reuse, enter};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

use gpucache_suite::common::{configure, serial};

/// (level, message, `cache` field) of every event.
type Seen = Arc<Mutex<Vec<(Level, String, String)>>>;

/// Collects every event into `seen`; with `reader`, its handler first reads the caches (the
/// stats of cache `reader`, and the summary), as a subscriber may.
struct Collect {
    seen: Seen,
    reader: Option<&'static str>,
}

#[derive(Default)]
struct Fields {
    message: String,
    cache: String,
}

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        match field.name() {
            "message" => self.message = format!("{value:?}"),
            "cache" => self.cache = format!("{value:?}"),
            _ => {}
        }
    }
}

impl Subscriber for Collect {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        if let Some(name) = self.reader {
            // Both read the cache whose event this is.
            let _ = gpucache::stats(name);
            let _ = gpucache::summary();
        }
        let level = *event.metadata().level();
        self.seen
            .lock()
            .unwrap()
            .push((level, fields.message, fields.cache));
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

/// The events `f` emits on this thread, collected by a subscriber that reads cache `reader`
/// from its handler, if given.
fn collect(reader: Option<&'static str>, f: impl FnOnce()) -> Vec<(Level, String, String)> {
    let seen = Seen::default();
    let subscriber = Collect {
        seen: Arc::clone(&seen),
        reader,
    };
    tracing::subscriber::with_default(subscriber, f);
    seen.lock().unwrap().clone()
}

#[test]
fn misses_evictions_invalidations_and_out_of_memory_are_tracing_events_hits_are_not() {
    let _serial = serial();
    let backend = CountingBackend::new();
    let _installed = use_backend(&backend);
    let name = "tracing-events";
    configure(name, |c| {
        c.reuse = Reuse::Immediate;
        c.max_cached_bytes = Some(1000);
    });
    let seen = collect(None, || {
        let _scope = enter(name);
        for _ in 0..5 {
            drop(Array::<u8>::zeros(Device::Cpu, 600).unwrap()); // 1 miss, 4 hits
        }
        drop(Array::<u8>::zeros(Device::Cpu, 700).unwrap()); // a miss that evicts the 600
        gpucache::invalidate(name);
        backend.fail_nth(1);
        backend.fail_nth(2);
        assert!(Array::<u8>::zeros(Device::Cpu, 8).is_err());
    });
    let of = |level: Level, text: &str| {
        seen.iter()
            .filter(|(l, m, _)| *l == level && m.contains(text))
            .count()
    };
    assert_eq!(of(Level::DEBUG, "cache miss"), 2, "{seen:?}");
    assert_eq!(of(Level::DEBUG, "evicted"), 1, "{seen:?}");
    assert_eq!(of(Level::DEBUG, "invalidated"), 1, "{seen:?}");
    assert_eq!(of(Level::WARN, "out of memory"), 1, "{seen:?}");
    assert_eq!(seen.len(), 5, "nothing else, hits included: {seen:?}");
    assert!(
        seen.iter().take(4).all(|(_, _, cache)| cache == name),
        "{seen:?}"
    );
}

#[test]
fn a_subscriber_may_read_the_caches_from_its_event_handler() {
    let _serial = serial();
    let name = "tracing-reentrant";
    configure(name, |c| c.reuse = Reuse::Immediate);
    let (done, finished) = std::sync::mpsc::channel();
    let worker = std::thread::spawn(move || {
        let seen = collect(Some(name), || {
            {
                // Inside a scope: a miss, an eviction (a drop past the cap), an invalidation.
                let _scope = enter(name);
                configure(name, |c| {
                    c.reuse = Reuse::Immediate;
                    c.max_cached_bytes = Some(1000);
                });
                drop(Array::<u8>::zeros(Device::Cpu, 600).unwrap());
                drop(Array::<u8>::zeros(Device::Cpu, 700).unwrap());
                gpucache::invalidate(name);
            }
            // Outside one: an eviction (a lower cap) and an invalidation.
            {
                let _scope = enter(name);
                drop(Array::<u8>::zeros(Device::Cpu, 600).unwrap());
            }
            configure(name, |c| {
                c.reuse = Reuse::Immediate;
                c.max_cached_bytes = Some(100);
            });
            {
                let _scope = enter(name);
                drop(Array::<u8>::zeros(Device::Cpu, 60).unwrap());
            }
            gpucache::invalidate(name);
        });
        let _ = done.send(());
        seen
    });
    finished
        .recv_timeout(std::time::Duration::from_secs(20))
        .expect("a subscriber reading the caches deadlocked");
    let seen = worker.join().unwrap();
    let of = |text: &str| seen.iter().filter(|(_, m, _)| m.contains(text)).count();
    assert_eq!(of("cache miss"), 4, "{seen:?}");
    assert_eq!(of("evicted"), 2, "{seen:?}");
    assert_eq!(of("invalidated"), 2, "{seen:?}");
}
