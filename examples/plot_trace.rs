//! Draws memory over time from a trace file to SVG: bytes in use and cached, per device and per
//! cache.
//!
//! ```text
//! GPUCACHE_TRACE=trace.json cargo run --release --example train
//! cargo run --release --example plot_trace -- trace.json memory.svg
//! ```

use gpucache_suite::trace_plot;

use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<PathBuf> = std::env::args_os().skip(1).map(PathBuf::from).collect();
    let [trace, svg] = args.as_slice() else {
        eprintln!("usage: plot_trace TRACE.json OUT.svg");
        return ExitCode::from(2);
    };
    let title = format!("gpucache: {}", trace.display());
    match trace_plot::plot(trace, svg, &title) {
        Ok(()) => {
            println!("wrote {}", svg.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
