//! The model of `prop_programs`: what each free-list cache should hold and have counted
//! ([`CacheModel`]), beside the real state a program acts on ([`World`]), which applies each
//! operation to both and checks that they agree.

use super::strategy::Op;
use crate::programs::{
    Helper, NAMES, Name, Outside, ProgramWorld, check_arrays, check_backend, program_world,
};

use std::collections::VecDeque;
use std::sync::Arc;
use std::thread;

use gpucache::testing::CountingBackend;
use gpucache::{CacheConfig, CacheStats, Device, KeyPolicy, Reuse, ScopeGuard};
use gpucache_suite::common::pattern::{AnyArray, Dt, Init};
use gpucache_suite::common::size_class;

/// A free list key, as `KeyPolicy` defines it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Key {
    Exact(Dt, &'static [usize]),
    Class(usize),
}

/// Where a live array's buffer belongs.
#[derive(Clone, Copy, Debug)]
struct Home {
    cache: usize,
    generation: u64,
    key: Key,
    capacity: usize,
}

struct LiveArray {
    id: u64,
    array: AnyArray,
    /// `None` for arrays allocated outside any scope (and zero-size arrays).
    home: Option<Home>,
    /// The bytes of the buffer: its capacity, or the array's bytes outside any scope.
    capacity: usize,
}

/// What one cache should hold and have counted.
#[derive(Default)]
struct CacheModel {
    config: CacheConfig,
    /// Active entries (the cache's guards on the scope stack).
    depth: usize,
    generation: u64,
    /// Free buffers, least recently freed first.
    free: VecDeque<(Key, usize)>,
    /// Buffers dropped inside an active `OnExit` scope, in drop order.
    pending: Vec<(Key, usize)>,
    /// Buffers of arrays dropped on the helper thread, not yet taken in, in drop order.
    returned: Vec<Home>,
    /// The event counters (hits, misses, device allocs/frees, invalidations, evictions, peak).
    counted: CacheStats,
}

impl CacheModel {
    fn cached(&self) -> usize {
        self.free.iter().map(|f| f.1).sum()
    }

    fn key(&self, dt: Dt, shape: &'static [usize], bytes: usize) -> (Key, usize) {
        match self.config.key {
            KeyPolicy::Exact => (Key::Exact(dt, shape), bytes),
            KeyPolicy::SizeClass => (Key::Class(size_class(bytes)), size_class(bytes)),
            _ => unreachable!("planned caches are not modelled (see prop_planned)"),
        }
    }

    /// A buffer becomes free; the least recently freed go over the cap.
    fn push_free(&mut self, buffer: (Key, usize)) {
        self.free.push_back(buffer);
        self.evict();
    }

    fn evict(&mut self) {
        let Some(cap) = self.config.max_cached_bytes else {
            return;
        };
        while self.free.iter().map(|f| f.1).sum::<usize>() > cap {
            self.free.pop_front();
            self.counted.evictions += 1;
            self.counted.device_frees += 1;
        }
    }

    /// The buffer of a dropped array with this home comes back, while a scope of the cache is
    /// active or not.
    fn release(&mut self, home: Home, active: bool) {
        if home.generation != self.generation {
            self.counted.device_frees += 1;
        } else if active && self.config.reuse == Reuse::OnExit {
            self.pending.push((home.key, home.capacity));
        } else {
            self.push_free((home.key, home.capacity));
        }
    }

    /// The cache takes in the buffers the helper thread returned.
    fn take_in(&mut self, active: bool) {
        for home in std::mem::take(&mut self.returned) {
            self.release(home, active);
        }
    }

    fn flush(&mut self) {
        self.counted.device_frees += self.free.len() as u64;
        self.free.clear();
    }

    /// Another thread gives the returned buffers back to the device.
    fn free_returned(&mut self) {
        self.counted.device_frees += self.returned.len() as u64;
        self.returned.clear();
    }

    /// Out-of-memory recovery on the owner thread: every buffer that no array owns goes back.
    fn give_back_for_oom(&mut self) {
        self.free_returned();
        self.flush();
        self.counted.device_frees += self.pending.len() as u64;
        self.pending.clear();
    }

    fn enter(&mut self) {
        if self.depth == 0 {
            self.take_in(false);
        }
        self.depth += 1;
    }

    fn invalidate(&mut self) {
        self.flush();
        self.counted.device_frees += self.pending.len() as u64;
        self.pending.clear();
        self.generation += 1;
    }

    fn exit(&mut self) {
        self.depth -= 1;
        if self.depth == 0 {
            self.take_in(false);
            for buffer in std::mem::take(&mut self.pending) {
                self.push_free(buffer);
            }
        }
    }
}

/// The real state (guards, arrays, the helper thread) beside the model of what it should be.
pub(super) struct World {
    backend: Arc<CountingBackend>,
    /// The cache names (each program runs on a fresh thread, whose caches start empty).
    names: [String; 3],
    /// Caches that exist (entered at least once).
    caches: [Option<CacheModel>; 3],
    /// The options `configure` set for each name (for caches created later).
    configs: [CacheConfig; 3],
    stack: Vec<(usize, ScopeGuard)>,
    /// Live arrays, oldest first.
    live: Vec<LiveArray>,
    /// The first array id of each step under way, innermost last.
    steps: Vec<u64>,
    next_id: u64,
    /// Live arrays allocated outside any scope.
    outside: Outside,
    helper: Helper,
}

impl World {
    pub(super) fn new(backend: Arc<CountingBackend>, helper: Helper) -> World {
        let names = NAMES.map(|n| format!("prop/{n:?}"));
        // Options are kept by name for the whole process: start each program from exact free
        // lists (the default policy is `Planned`, which this model does not cover).
        let exact = CacheConfig {
            key: KeyPolicy::Exact,
            ..CacheConfig::default()
        };
        for name in &names {
            gpucache::configure(name, exact);
        }
        World {
            backend,
            names,
            caches: Default::default(),
            configs: [exact; 3],
            stack: Vec::new(),
            live: Vec::new(),
            steps: Vec::new(),
            next_id: 1,
            outside: Outside::default(),
            helper,
        }
    }

    /// The model of cache `name`, created (with the name's options) if new.
    fn cache(&mut self, name: Name) -> &mut CacheModel {
        let config = self.configs[name as usize];
        self.caches[name as usize].get_or_insert_with(|| CacheModel {
            config,
            ..CacheModel::default()
        })
    }

    pub(super) fn apply(&mut self, op: &Op) {
        match *op {
            Op::Enter(name) => {
                let guard = gpucache::enter(&self.names[name as usize]);
                self.cache(name).enter();
                self.stack.push((name as usize, guard));
            }
            Op::Exit => {
                self.exit_innermost();
            }
            Op::ExitAt(i) => self.exit_any(i),
            Op::Alloc(dt, shape, init) => self.alloc(dt, shape, init, false),
            Op::AllocAfterOom(dt, shape, init) => self.alloc(dt, shape, init, true),
            Op::Drop(i) | Op::SendAway(i) => {
                if !self.live.is_empty() {
                    let live = self.live.remove(i % self.live.len());
                    self.drop_array(live, matches!(op, Op::SendAway(_)));
                }
            }
            Op::Invalidate(name) => {
                gpucache::invalidate(&self.names[name as usize]);
                if let Some(cache) = &mut self.caches[name as usize] {
                    cache.take_in(false);
                    cache.invalidate();
                    // Calls count; a change of key policy (below) does not.
                    cache.counted.invalidations += 1;
                }
            }
            Op::Configure(name, reuse, key, max_cached_bytes) => {
                let config = CacheConfig {
                    reuse,
                    key,
                    max_cached_bytes,
                };
                gpucache::configure(&self.names[name as usize], config);
                self.configs[name as usize] = config;
                if let Some(cache) = &mut self.caches[name as usize] {
                    if cache.config.key != key {
                        cache.invalidate();
                    }
                    cache.config = config;
                    cache.evict();
                }
            }
            Op::EmptyCache => {
                gpucache::empty_cache();
                for cache in self.caches.iter_mut().flatten() {
                    cache.free_returned();
                    cache.flush();
                }
            }
            Op::Loop { .. } => unreachable!("loops are unrolled"),
            Op::StepStart => self.steps.push(self.next_id),
            Op::StepEnd(returns) => {
                let first = self.steps.pop().expect("a step started");
                let mut made: Vec<usize> = (0..self.live.len())
                    .filter(|&i| self.live[i].id >= first)
                    .collect();
                if returns {
                    made.pop();
                }
                for i in made.into_iter().rev() {
                    let live = self.live.remove(i);
                    self.drop_array(live, false);
                }
            }
            Op::Stats(name) => {
                let full = &self.names[name as usize];
                let exists = self.caches[name as usize].is_some();
                let table = gpucache::summary();
                assert!(!exists || table.contains(full.as_str()), "{full}:\n{table}");
                let program = thread::current();
                let row = gpucache::snapshot().rows().iter().any(|r| {
                    !r.exited && Some(r.thread.as_str()) == program.name() && &r.cache == full
                });
                assert_eq!(row, exists, "a row for {full} in\n{table}");
                // `stats` takes in what the helper returned; `check` compares the counters.
                let actual = gpucache::stats(full);
                if let Some(cache) = &mut self.caches[name as usize] {
                    let active = cache.depth > 0;
                    cache.take_in(active);
                }
                assert_eq!(actual, self.expected_stats(name as usize), "stats({full})");
            }
        }
        self.note_peaks();
    }

    fn exit_at(&mut self, depth: usize) {
        let (cache, guard) = self.stack.remove(depth);
        drop(guard);
        self.caches[cache].as_mut().expect("entered").exit();
    }

    /// Allocates an array; with `oom`, a device allocation it makes fails once first.
    fn alloc(&mut self, dt: Dt, shape: &'static [usize], init: Init, oom: bool) {
        let id = self.next_id;
        self.next_id += 1;
        let bytes = shape.iter().product::<usize>() * dt.size();
        // Whether a device allocation happens (the model decides before the real call, so that
        // the failure is armed only then), and the free list entry a hit takes.
        let (device_alloc, hit) = match self.stack.last() {
            _ if bytes == 0 => (false, None),
            None => (true, None),
            Some(&(index, _)) => {
                let cache = self.caches[index].as_mut().expect("entered");
                let (key, _) = cache.key(dt, shape, bytes);
                let find = |c: &CacheModel| c.free.iter().rposition(|f| f.0 == key);
                // The hit path looks at the free list alone; a miss takes in what the helper
                // returned and looks again.
                let at = find(cache).or_else(|| {
                    cache.take_in(true);
                    find(cache)
                });
                (at.is_none(), at)
            }
        };
        if oom && device_alloc {
            self.backend.fail_nth(1);
            for cache in self.caches.iter_mut().flatten() {
                cache.give_back_for_oom();
            }
        }
        let array = AnyArray::new(Device::Cpu, dt, shape, init, id)
            .unwrap_or_else(|e| panic!("allocation {id} failed: {e}"));
        let (home, capacity) = match self.stack.last() {
            _ if bytes == 0 => (None, 0),
            None => {
                self.outside.alloc(bytes);
                (None, bytes)
            }
            Some(&(index, _)) => {
                let cache = self.caches[index].as_mut().expect("entered");
                let (key, capacity) = cache.key(dt, shape, bytes);
                if let Some(at) = hit {
                    cache.free.remove(at);
                    cache.counted.hits += 1;
                } else {
                    cache.counted.misses += 1;
                    cache.counted.device_allocs += 1;
                }
                let home = Home {
                    cache: index,
                    generation: cache.generation,
                    key,
                    capacity,
                };
                (Some(home), capacity)
            }
        };
        self.live.push(LiveArray {
            id,
            array,
            home,
            capacity,
        });
    }

    fn drop_array(&mut self, live: LiveArray, on_helper: bool) {
        if on_helper {
            self.helper.drop_array(live.array, live.id);
        } else {
            drop(live.array);
        }
        match live.home {
            Some(home) => {
                let cache = self.caches[home.cache].as_mut().expect("allocated in it");
                if on_helper {
                    // The helper is not the owner: the buffer waits in the return queue.
                    cache.returned.push(home);
                } else {
                    let active = cache.depth > 0;
                    cache.release(home, active);
                }
            }
            None if live.capacity > 0 => {
                self.outside.free(live.capacity);
            }
            None => {}
        }
    }

    /// Raises each cache's expected peak to the bytes it holds now.
    fn note_peaks(&mut self) {
        for i in 0..self.caches.len() {
            let held = self.in_use(i) + self.caches[i].as_ref().map_or(0, CacheModel::cached);
            if let Some(cache) = &mut self.caches[i] {
                cache.counted.peak_bytes = cache.counted.peak_bytes.max(held);
            }
        }
    }

    /// The bytes cache `i` should count as in use: its live arrays' buffers, of any generation,
    /// the buffers waiting for its scope to exit and those returned but not taken in.
    fn in_use(&self, i: usize) -> usize {
        let live: usize = self
            .live
            .iter()
            .filter(|l| l.home.is_some_and(|h| h.cache == i))
            .map(|l| l.capacity)
            .sum();
        let waiting = self.caches[i].as_ref().map_or(0, |c| {
            let pending: usize = c.pending.iter().map(|p| p.1).sum();
            pending + c.returned.iter().map(|h| h.capacity).sum::<usize>()
        });
        live + waiting
    }

    fn expected_stats(&self, i: usize) -> CacheStats {
        match &self.caches[i] {
            None => CacheStats::default(),
            Some(cache) => CacheStats {
                bytes_in_use: self.in_use(i),
                bytes_cached: cache.cached(),
                ..cache.counted
            },
        }
    }

    pub(super) fn check(&self, when: &str) {
        let innermost = self.stack.last().map(|&(i, _)| self.names[i].clone());
        assert_eq!(gpucache::current_scope(), innermost, "{when}");

        let mut held = 0;
        let (mut allocs, mut frees) = (self.outside.allocs, self.outside.frees);
        // Read without taking anything in, so that returned buffers stay where they are.
        let snapshot = gpucache::snapshot();
        let program = thread::current();
        let mine = |name: &str| {
            snapshot
                .rows()
                .iter()
                .find(|r| !r.exited && Some(r.thread.as_str()) == program.name() && r.cache == name)
                .map(|r| r.stats)
                .unwrap_or_default()
        };
        for i in 0..self.names.len() {
            let expected = self.expected_stats(i);
            let actual = mine(&self.names[i]);
            assert_eq!(actual, expected, "stats of {} {when}", self.names[i]);
            held += expected.bytes_in_use + expected.bytes_cached;
            allocs += expected.device_allocs;
            frees += expected.device_frees;
        }
        let held = held + self.outside.bytes;
        check_backend(&self.backend, held, allocs, frees, when);
        let live = self.live.iter();
        check_arrays(live.map(|l| (&l.array, l.id, l.capacity)), when);
    }
}

program_world!(World, Op);
