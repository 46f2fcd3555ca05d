//! Scopes: the thread's stack of entered caches, [`enter`] and [`ScopeGuard`].

use std::cell::{Cell, RefCell};
use std::fmt;
use std::marker::PhantomData;
use std::ptr;
use std::sync::Arc;

use crate::cache::CacheCell;
// Whether `GPUCACHE_DISABLE` turned caching off: scopes are still entered, but every array
// allocates from and frees to the device directly (so compute-sanitizer sees every buffer).
use crate::config::caching_disabled as disabled;
use crate::registry;

thread_local! {
    /// The innermost entered cache, or null. Read on every allocation, so it is a plain `Cell`
    /// with a const initialiser and no destructor.
    static CURRENT: Cell<*const CacheCell> = const { Cell::new(ptr::null()) };
    /// Every entered cache with its guard's entry number, innermost last. Each entry is kept
    /// alive by its `ScopeGuard`.
    static STACK: RefCell<Vec<(*const CacheCell, u64)>> = const { RefCell::new(Vec::new()) };
    /// The entry number of the next `enter` (tells apart entries of one recursive cache).
    static ENTRIES: Cell<u64> = const { Cell::new(0) };
}

/// Enters the calling thread's cache `name` until the returned guard drops.
///
/// Array allocations on this thread then go through that cache (the innermost entered scope
/// wins). Scopes nest, and one name may be entered recursively: the cache's outermost entry
/// decides when buffers dropped inside become free again (see [`Reuse`](crate::Reuse)).
/// Dropping the guard exits the scope, on a normal exit, an early return, `?` and a panic
/// unwinding alike.
///
/// The name is looked up once here, not on every allocation. Any string is a name, the empty
/// one included: `enter("")` enters the cache `""` like any other (returning a guard, `enter`
/// has no error to give). `cache_scope!(name = <expr>, ..)` does the same with a name computed
/// at run time; only the macros' literal forms refuse an empty name, at compile time, as a slip.
///
/// ```
/// use gpucache::{Array, Device};
/// for _ in 0..3 {
///     let _scope = gpucache::enter("step");
///     let x = Array::<f32>::zeros(Device::Cpu, [64, 64])?;
///     assert_eq!(x.len(), 4096);
/// } // the array's bytes are free again here, and served again on the next entry
/// let s = gpucache::stats("step");
/// // The first step allocates the array, the second the plan's block; the third is a hit.
/// assert_eq!((s.misses, s.hits), (2, 1));
/// # Ok::<(), gpucache::Error>(())
/// ```
pub fn enter(name: &str) -> ScopeGuard {
    let cell = match registry::own_cell(name) {
        Some(Some(cell)) => Some(cell),
        Some(None) => new_cell(name),
        None => None,
    };
    let Some(cell) = cell else {
        // The thread is being torn down: allocate without a cache.
        return ScopeGuard {
            cell: None,
            entry: 0,
            _not_send: PhantomData,
        };
    };
    if cell.traced() {
        cell.enter_traced();
    } else {
        cell.enter();
    }
    let top = Arc::as_ptr(&cell);
    let entry = ENTRIES.replace(ENTRIES.get() + 1);
    // While the stack is gone (thread teardown), the scope still holds `CURRENT`.
    let _ = STACK.try_with(|s| s.borrow_mut().push((top, entry)));
    CURRENT.set(top);
    ScopeGuard {
        cell: Some(cell),
        entry,
        _not_send: PhantomData,
    }
}

/// This thread's first cache `name`. The first cache of the process starts the recording that
/// `GPUCACHE_TRACE` asks for, if any, before it is made.
#[cold]
#[inline(never)]
fn new_cell(name: &str) -> Option<Arc<CacheCell>> {
    crate::trace::init_from_env();
    registry::create_cell(name)
}

/// An entered scope; dropping it exits the scope. Made by [`enter`] (and the `cache_scope`
/// macros). It stays on the thread that made it.
#[must_use = "the scope exits when the guard is dropped; bind it with `let _scope = ...`"]
pub struct ScopeGuard {
    cell: Option<Arc<CacheCell>>,
    /// This guard's entry in `STACK`.
    entry: u64,
    _not_send: PhantomData<*const ()>,
}

impl ScopeGuard {
    /// The name of the entered cache (`None` if the guard was made during thread teardown and
    /// holds no scope).
    pub fn name(&self) -> Option<&str> {
        self.cell.as_deref().map(CacheCell::name)
    }
}

impl ScopeGuard {
    /// The entered cache (`None` if the guard was made during thread teardown).
    #[cfg(feature = "cuda")]
    pub(crate) fn cell(&self) -> Option<&CacheCell> {
        self.cell.as_deref()
    }
}

impl fmt::Debug for ScopeGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ScopeGuard")
            .field("name", &self.name())
            .finish()
    }
}

impl Drop for ScopeGuard {
    fn drop(&mut self) {
        let Some(cell) = self.cell.take() else {
            return;
        };
        // Guards normally drop innermost first; one dropped out of order removes its own entry
        // (not another entry of the same cache, when it was entered recursively).
        let top = STACK
            .try_with(|s| {
                let mut s = s.borrow_mut();
                if let Some(i) = s.iter().rposition(|&(_, e)| e == self.entry) {
                    s.remove(i);
                }
                s.last().map_or(ptr::null(), |&(p, _)| p)
            })
            .unwrap_or(ptr::null());
        CURRENT.set(top);
        // One test sends traced and arena caches (and closed ones) to the slow exit.
        if cell.is_plain() {
            cell.exit();
        } else {
            cell.exit_slow();
        }
    }
}

/// The name of the innermost scope entered on this thread, if any.
///
/// ```
/// assert_eq!(gpucache::current_scope(), None);
/// let _outer = gpucache::enter("outer");
/// {
///     let _inner = gpucache::enter("inner");
///     assert_eq!(gpucache::current_scope().as_deref(), Some("inner"));
/// }
/// assert_eq!(gpucache::current_scope().as_deref(), Some("outer"));
/// ```
pub fn current_scope() -> Option<String> {
    with_innermost(|cell| cell.map(|c| c.name().to_owned()))
}

/// Runs `f` with the cache that allocations on this thread go through: the innermost entered
/// one (`None` outside any scope, once the cache is closed by thread teardown, and always when
/// `GPUCACHE_DISABLE` turns caching off).
#[inline]
pub(crate) fn with_current<R>(f: impl FnOnce(Option<&CacheCell>) -> R) -> R {
    if disabled() {
        return f(None);
    }
    with_innermost(f)
}

/// [`with_current`], for the hit paths, which test the cache's flags themselves: a closed one
/// included, and one made while `GPUCACHE_DISABLE` turns caching off, which its flags say (so
/// the switch is not read here).
#[inline]
pub(crate) fn with_current_for_hit<R>(f: impl FnOnce(Option<&CacheCell>) -> R) -> R {
    let ptr = CURRENT.get();
    // SAFETY: as in `with_innermost`.
    f(unsafe { ptr.as_ref() })
}

/// The innermost entered cache of this thread, or null (for comparison only).
#[inline]
pub(crate) fn current_ptr() -> *const CacheCell {
    CURRENT.get()
}

/// Runs `f` with the innermost entered cache of this thread (`None` outside any scope, or once
/// the cache is closed by thread teardown).
#[inline]
fn with_innermost<R>(f: impl FnOnce(Option<&CacheCell>) -> R) -> R {
    let ptr = CURRENT.get();
    // SAFETY: a non-null `CURRENT` is the innermost entry of `STACK` (or the last entered cache
    // during teardown), whose `ScopeGuard` holds an `Arc` to it and is still alive: guards are
    // `!Send`, and a guard dropping resets `CURRENT` before it releases its `Arc`. `f` is crate
    // code that enters and exits no scope.
    let cell = unsafe { ptr.as_ref() };
    f(cell.filter(|c| !c.is_closed()))
}
