//! [`CacheConfig`], [`Reuse`] and [`KeyPolicy`]: the options of one named cache.

/// The options of one named cache, set with [`configure`](crate::configure).
///
/// ```
/// use gpucache::{CacheConfig, KeyPolicy, Reuse};
/// gpucache::configure("infer", CacheConfig {
///     reuse: Reuse::Immediate,
///     key: KeyPolicy::SizeClass,
///     max_cached_bytes: Some(256 << 20),
/// });
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CacheConfig {
    /// When a dropped array's buffer may be handed out again.
    pub reuse: Reuse,
    /// Which arrays may share a buffer.
    pub key: KeyPolicy,
    /// The most bytes this cache keeps in its free lists; beyond it the least recently freed
    /// buffers go back to the device. `None` (the default) keeps everything until
    /// [`invalidate`](crate::invalidate).
    pub max_cached_bytes: Option<usize>,
}

/// When the buffer of an array dropped inside a scope becomes free for reuse.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Reuse {
    /// When the outermost active entry of the cache exits, so it is recycled on re-entry (the
    /// default; every buffer of one step stays distinct within the step).
    #[default]
    OnExit,
    /// As soon as its array drops: a later allocation in the same scope can get it (lower peak
    /// memory).
    Immediate,
}

/// Which arrays may share a buffer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KeyPolicy {
    /// A step's arrays share memory, laid out from the step's own lifetimes (the default; see
    /// [Memory of a step](crate#memory-of-a-step)).
    ///
    /// * **The first step** allocates every array from the device and frees it when it drops:
    ///   it holds exactly what its arrays need at once, and its order, sizes and lifetimes are
    ///   recorded.
    /// * **A plan** is made from that record when the scope's outermost entry exits: one block
    ///   per device, and an offset in it for the k-th allocation of the step, chosen so that
    ///   arrays alive at the same time never overlap ([`planner::greedy_by_size`]). The block is
    ///   about the step's peak live bytes.
    /// * **Later steps** follow the plan: the k-th allocation gets its offset, in O(1) and at the
    ///   same address every step, when it is no larger than the plan's size there and every array
    ///   the plan placed over those bytes has dropped. Anything else (a larger size, more
    ///   allocations, an array kept alive past its planned end) leaves the plan: the rest of the
    ///   step is served from the block's free bytes when it did not grow, else apart, and the
    ///   plan is remade from that step, with each position's largest size.
    /// * **Steps that never come again** (a detector's, whose sizes follow each image) leave
    ///   every plan: once the cache has measured, on their records, that serving them online
    ///   would hold less than its plans, it does: each allocation takes the smallest free range
    ///   of one block that holds it, the block grown in place when none does (see [Memory of a
    ///   step](crate#memory-of-a-step)).
    /// * **Arrays that outlive their step** (returned, stored, sent to another thread) are
    ///   served apart, in blocks of their own, which are kept for the next such array after they
    ///   are freed, while the cache holds no more than it has held before.
    /// * [`Reuse`] does not apply: the plan reuses memory as the step's arrays drop.
    ///
    /// [`planner::greedy_by_size`]: crate::planner::greedy_by_size
    #[default]
    Planned,
    /// Arrays of the same element type, shape and device, in free lists. With
    /// [`Reuse::OnExit`], every buffer of a step stays distinct within the step: a step holds
    /// the sum of what it allocates, not its peak.
    Exact,
    /// Arrays whose byte sizes round up to the same size class, on the same device, whatever
    /// their shape and element type; the logical shape stays on the array. Classes are 512 bytes
    /// and below, then four per power of two (`2^k`, `1.25·2^k`, `1.5·2^k`, `1.75·2^k`), so at
    /// most a quarter of a buffer is slack.
    SizeClass,
    /// Formerly a bump arena per scope; it held a step's sum of bytes and let arrays that
    /// outlived their step pin whole blocks. It is now the same as [`KeyPolicy::Planned`].
    #[deprecated(note = "use KeyPolicy::Planned, which lays a step out from its lifetimes")]
    Arena,
}

impl KeyPolicy {
    /// Whether this policy plans steps ([`KeyPolicy::Planned`], or its old name).
    #[allow(deprecated)]
    pub(crate) fn is_planned(self) -> bool {
        matches!(self, KeyPolicy::Planned | KeyPolicy::Arena)
    }

    /// The capacity of the buffer this policy gives an array of `bytes > 0` bytes.
    pub(crate) fn capacity(self, bytes: usize) -> usize {
        match self {
            KeyPolicy::SizeClass => size_class_within(bytes),
            _ => bytes,
        }
    }
}

/// `bytes`' size class, or `bytes` when the class is above the largest allocation (it would fail
/// where the array itself fits).
pub(crate) fn size_class_within(bytes: usize) -> usize {
    Some(size_class(bytes))
        .filter(|&c| c <= crate::shape::MAX_BYTES)
        .unwrap_or(bytes)
}

/// Rounds `bytes > 0` up to its size class (see [`KeyPolicy::SizeClass`]).
pub(crate) fn size_class(bytes: usize) -> usize {
    const MIN: usize = 512;
    if bytes <= MIN {
        return MIN;
    }
    // The highest set bit of bytes - 1 gives the power of two just below; a quarter of it is the
    // step between classes.
    let top = usize::BITS - 1 - (bytes - 1).leading_zeros();
    let step = 1usize << (top - 2);
    bytes.div_ceil(step).checked_mul(step).unwrap_or(bytes)
}

/// Whether caching is turned off for the process by `GPUCACHE_DISABLE`, read once (at the first
/// cache made, allocation, or [`summary`](crate::summary)). `1`, `true`, `yes` and `on` (any case)
/// turn it off; unset, empty, `0`, `false`, `no` and `off` leave it on; any other value leaves it
/// on with a one-line warning on standard error.
#[inline]
pub(crate) fn caching_disabled() -> bool {
    static DISABLED: std::sync::LazyLock<bool> = std::sync::LazyLock::new(|| {
        let Some(value) = std::env::var_os("GPUCACHE_DISABLE") else {
            return false;
        };
        let switch = value.to_str().and_then(parse_switch);
        if switch.is_none() {
            eprintln!(
                "gpucache: GPUCACHE_DISABLE={value:?} is neither on (1, true, yes, on) nor off \
                 (0, false, no, off, empty); caching stays on"
            );
        }
        switch.unwrap_or(false)
    });
    *DISABLED
}

/// An on/off environment value: `Some(true)` for `1`, `true`, `yes`, `on`, `Some(false)` for
/// `0`, `false`, `no`, `off` and the empty string (any case, surrounding spaces ignored), `None`
/// for anything else.
fn parse_switch(value: &str) -> Option<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "" | "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn switch_values() {
        for on in ["1", "true", "TRUE", "Yes", "on", " On "] {
            assert_eq!(super::parse_switch(on), Some(true), "{on:?}");
        }
        for off in ["", "0", "false", "No", "OFF"] {
            assert_eq!(super::parse_switch(off), Some(false), "{off:?}");
        }
        for other in ["2", "disable", "y"] {
            assert_eq!(super::parse_switch(other), None, "{other:?}");
        }
    }

    use super::size_class;

    #[test]
    fn size_classes_are_quarter_steps() {
        assert_eq!(size_class(1), 512);
        assert_eq!(size_class(512), 512);
        assert_eq!(size_class(513), 640);
        assert_eq!(size_class(640), 640);
        assert_eq!(size_class(641), 768);
        assert_eq!(size_class(1000), 1024);
        assert_eq!(size_class(1024), 1024);
        assert_eq!(size_class(1025), 1280);
        assert_eq!(size_class(3 << 20), 3 << 20);
        for b in [513usize, 4097, 1 << 20, (1 << 20) + 1, 123_456_789] {
            let c = size_class(b);
            assert!(c >= b && (c - b) * 4 <= c, "{b} -> {c}");
        }
    }
}
