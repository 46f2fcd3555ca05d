//! The text table of [`Snapshot`](super::Snapshot) rows that [`summary`](crate::summary)
//! prints, and byte counts in binary units.

use std::fmt;

#[cfg(test)]
use super::CacheStats;
use super::SnapshotRow;

/// A byte count printed in binary units (`1.5 MiB`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Bytes(pub usize);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
        let mut v = self.0 as f64;
        let mut unit = 0;
        while v >= 1024.0 && unit + 1 < UNITS.len() {
            v /= 1024.0;
            unit += 1;
        }
        let s = if unit == 0 {
            format!("{} B", self.0)
        } else {
            format!("{v:.1} {}", UNITS[unit])
        };
        f.pad(&s)
    }
}

/// The widest a thread or cache name is printed in the table; longer ones are shortened.
const NAME_WIDTH: usize = 40;

/// `name`, shortened to at most `NAME_WIDTH` characters (with a `…` in the middle).
fn shorten(name: &str) -> String {
    let n = name.chars().count();
    if n <= NAME_WIDTH {
        return name.to_owned();
    }
    let head = (NAME_WIDTH - 1) / 2;
    let tail = NAME_WIDTH - 1 - head;
    let mut out: String = name.chars().take(head).collect();
    out.push('…');
    out.extend(name.chars().skip(n - tail));
    out
}

/// Formats rows as an aligned text table.
pub(crate) fn table(rows: &[SnapshotRow]) -> String {
    use std::fmt::Write;
    let threads: Vec<String> = rows
        .iter()
        .map(|r| {
            let exited = if r.exited { " (exited)" } else { "" };
            format!("{}#{}{exited}", shorten(&r.thread), r.thread_number)
        })
        .collect();
    let caches: Vec<String> = rows.iter().map(|r| shorten(&r.cache)).collect();
    let width = |names: &[String], min: usize| {
        names
            .iter()
            .map(|n| n.chars().count())
            .max()
            .unwrap_or(0)
            .max(min)
    };
    let (tw, cw) = (width(&threads, 6), width(&caches, 5));
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<tw$}  {:<cw$}  {:>10}  {:>8}  {:>6}  {:>8}  {:>8}  {:>10}  {:>10}  {:>10}  {:>5}  {:>6}",
        "thread",
        "cache",
        "hits",
        "misses",
        "hit%",
        "allocs",
        "frees",
        "in use",
        "cached",
        "peak",
        "inval",
        "evict",
    );
    for ((r, thread), cache) in rows.iter().zip(&threads).zip(&caches) {
        let s = &r.stats;
        let _ = writeln!(
            out,
            "{thread:<tw$}  {cache:<cw$}  {:>10}  {:>8}  {:>6.1}  {:>8}  {:>8}  {:>10}  {:>10}  {:>10}  {:>5}  {:>6}",
            s.hits,
            s.misses,
            s.hit_rate() * 100.0,
            s.device_allocs,
            s.device_frees,
            Bytes(s.bytes_in_use),
            Bytes(s.bytes_cached),
            Bytes(s.peak_bytes),
            s.invalidations,
            s.evictions,
        );
    }
    if rows.is_empty() {
        out.push_str("(no caches)\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_print_in_binary_units() {
        assert_eq!(Bytes(0).to_string(), "0 B");
        assert_eq!(Bytes(1023).to_string(), "1023 B");
        assert_eq!(Bytes(1536).to_string(), "1.5 KiB");
        assert_eq!(Bytes(64 << 20).to_string(), "64.0 MiB");
        assert_eq!(format!("{:>9}", Bytes(2048)), "  2.0 KiB");
    }

    #[test]
    fn long_names_are_shortened_in_the_table() {
        let long = "x".repeat(70_000);
        let t = table(&[SnapshotRow {
            thread: long.clone(),
            thread_number: 7,
            exited: true,
            cache: format!("{long}end"),
            stats: CacheStats::default(),
        }]);
        let row = t.lines().nth(1).unwrap();
        assert!(row.len() < 200, "{row}");
        assert!(
            row.contains("…") && row.contains("#7 (exited)") && row.contains("xend"),
            "{row}"
        );
        assert_eq!(shorten("short"), "short");
        assert_eq!(shorten(&"é".repeat(41)).chars().count(), NAME_WIDTH);
    }

    #[test]
    fn display_names_every_counter() {
        let s = CacheStats {
            hits: 3,
            misses: 1,
            device_allocs: 1,
            device_frees: 0,
            bytes_in_use: 4096,
            bytes_cached: 0,
            peak_bytes: 4096,
            invalidations: 2,
            evictions: 5,
        };
        let text = s.to_string();
        for needle in [
            "hits 3",
            "misses 1",
            "75.0% hit",
            "in use 4.0 KiB",
            "invalidations 2",
            "evictions 5",
        ] {
            assert!(text.contains(needle), "{text:?} lacks {needle:?}");
        }
        let t = table(&[SnapshotRow {
            thread: "main".into(),
            thread_number: 1,
            exited: false,
            cache: "step".into(),
            stats: s,
        }]);
        assert!(t.lines().nth(1).unwrap().starts_with("main#1 "), "{t}");
    }
}
