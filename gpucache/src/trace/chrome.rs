//! The Chrome trace-event JSON of a [`Trace`] (the "JSON Array/Object Format" that Perfetto's UI
//! and `chrome://tracing` open), written directly: the format is small and fixed, and the only
//! text in it (cache and thread names, keys) goes through [`string`].
//!
//! * one track per thread (`tid`: the thread number), named `name#number`;
//! * scopes as `B`/`E` slices on their thread's track, named after the cache (an exit whose entry
//!   was before recording started is left out; a scope still open at the end is closed at the
//!   last event's time, so slices always balance);
//! * instant events (`i`) for misses, device frees, invalidations, evictions, `empty_cache`
//!   (global), out-of-memory and returns from other threads, with the event's fields as `args`;
//! * counter tracks (`C`) with `in use` and `cached` bytes: `device <device>` (every cache of
//!   every thread) and `cache <name> on <device>` (that name on every thread).

use std::collections::BTreeMap;
use std::io::{self, BufWriter, Write};

use super::{Event, EventKind, Trace};
use crate::Device;

pub(super) fn write(trace: &Trace, out: impl Write) -> io::Result<()> {
    let mut out = BufWriter::new(out);
    let w = &mut out;
    let pid = std::process::id();
    writeln!(
        w,
        "{{\"displayTimeUnit\":\"ns\",\"otherData\":{{\"producer\":\"gpucache\",\
         \"dropped_events\":{}}},\"traceEvents\":[",
        trace.dropped
    )?;
    write!(
        w,
        "{{\"ph\":\"M\",\"pid\":{pid},\"tid\":0,\"name\":\"process_name\",\
         \"args\":{{\"name\":\"gpucache\"}}}}"
    )?;
    for (number, name) in &trace.threads {
        write!(
            w,
            ",\n{{\"ph\":\"M\",\"pid\":{pid},\"tid\":{number},\"name\":\"thread_name\",\
             \"args\":{{\"name\":{}}}}}",
            string(&format!("{name}#{number}"))
        )?;
    }
    // Open scopes per thread (their names), and the last bytes of every (cache, owner, device).
    let mut open: BTreeMap<u64, Vec<String>> = BTreeMap::new();
    let mut bytes: BTreeMap<(String, u64, Device), (usize, usize)> = BTreeMap::new();
    let mut last = 0;
    for e in &trace.events {
        last = e.time_ns;
        let ts = Micros(e.time_ns);
        let tid = e.thread;
        let cache = e.cache.as_deref().unwrap_or("");
        match e.kind {
            EventKind::ScopeEnter => {
                open.entry(tid).or_default().push(cache.to_owned());
                write!(
                    w,
                    ",\n{{\"ph\":\"B\",\"pid\":{pid},\"tid\":{tid},\"ts\":{ts},\
                     \"cat\":\"scope\",\"name\":{}}}",
                    string(cache)
                )?;
            }
            EventKind::ScopeExit => {
                if open.get_mut(&tid).and_then(Vec::pop).is_some() {
                    write!(
                        w,
                        ",\n{{\"ph\":\"E\",\"pid\":{pid},\"tid\":{tid},\"ts\":{ts}}}"
                    )?;
                }
            }
            EventKind::Hit | EventKind::FreeToCache | EventKind::Settled => {}
            kind => {
                let (name, scope) = match kind {
                    EventKind::Miss => ("miss", 't'),
                    EventKind::PlanBlock => ("plan block", 't'),
                    EventKind::SlabBlock => ("slab block", 't'),
                    EventKind::DeviceFree => ("device free", 't'),
                    EventKind::Invalidate => ("invalidate", 't'),
                    EventKind::Evict => ("evict", 't'),
                    EventKind::EmptyCache => ("empty_cache", 'g'),
                    EventKind::OutOfMemory { .. } => ("out of memory", 't'),
                    _ => ("returned from another thread", 't'),
                };
                write!(
                    w,
                    ",\n{{\"ph\":\"i\",\"s\":\"{scope}\",\"pid\":{pid},\"tid\":{tid},\"ts\":{ts},\
                     \"cat\":\"memory\",\"name\":\"{name}\",\"args\":{{"
                )?;
                args(w, e)?;
                w.write_all(b"}}")?;
            }
        }
        if let (Some(name), Some(device), Some(after)) = (&e.cache, e.device, e.bytes_after) {
            bytes.insert((name.to_string(), e.cache_thread, device), after);
            let sum = |of: &dyn Fn(&(String, u64, Device)) -> bool| {
                bytes
                    .iter()
                    .filter(|(k, _)| of(k))
                    .fold((0, 0), |(u, c), (_, &(bu, bc))| (u + bu, c + bc))
            };
            let per_device = sum(&|k| k.2 == device);
            let per_cache = sum(&|k| k.2 == device && *k.0 == **name);
            counter(w, pid, ts, &format!("device {device}"), per_device)?;
            counter(w, pid, ts, &format!("cache {name} on {device}"), per_cache)?;
        }
    }
    for (tid, scopes) in open {
        for _ in scopes {
            write!(
                w,
                ",\n{{\"ph\":\"E\",\"pid\":{pid},\"tid\":{tid},\"ts\":{}}}",
                Micros(last)
            )?;
        }
    }
    w.write_all(b"\n]}\n")?;
    out.flush()
}

/// A counter event with the `in use` and `cached` series.
fn counter(
    w: &mut impl Write,
    pid: u32,
    ts: Micros,
    name: &str,
    (in_use, cached): (usize, usize),
) -> io::Result<()> {
    write!(
        w,
        ",\n{{\"ph\":\"C\",\"pid\":{pid},\"tid\":0,\"ts\":{ts},\"cat\":\"memory\",\"name\":{},\
         \"args\":{{\"in use\":{in_use},\"cached\":{cached}}}}}",
        string(name)
    )
}

/// The fields of an instant event's `args` object (without the braces).
fn args(w: &mut impl Write, e: &Event) -> io::Result<()> {
    write!(w, "\"bytes\":{}", e.bytes)?;
    if let Some(cache) = &e.cache {
        write!(
            w,
            ",\"cache\":{},\"cache thread\":{}",
            string(cache),
            e.cache_thread
        )?;
    }
    if let Some(key) = &e.key {
        write!(w, ",\"key\":{}", string(&key.to_string()))?;
    }
    if let Some(device) = e.device {
        write!(w, ",\"device\":\"{device}\"")?;
    }
    if let Some(stream) = e.stream {
        write!(w, ",\"stream\":\"{stream:#x}\"")?;
    }
    if let EventKind::OutOfMemory {
        released,
        recovered,
    } = e.kind
    {
        write!(w, ",\"released\":{released},\"recovered\":{recovered}")?;
    }
    Ok(())
}

/// Nanoseconds written as microseconds with three decimals (the format's `ts` unit).
#[derive(Clone, Copy)]
struct Micros(u64);

impl std::fmt::Display for Micros {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{:03}", self.0 / 1000, self.0 % 1000)
    }
}

/// `s` as a JSON string literal: quotes, backslashes and control characters escaped.
fn string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_are_escaped() {
        assert_eq!(string("a\"b\\c\nd\u{1}é"), "\"a\\\"b\\\\c\\nd\\u0001é\"");
        assert_eq!(Micros(1_234_567).to_string(), "1234.567");
        assert_eq!(Micros(5).to_string(), "0.005");
    }
}
