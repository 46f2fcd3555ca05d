//! What plans of a step's memory (`gpucache::planner`, the layout of a planned cache) would hold
//! on a whole log.
//!
//! [`simulate`] measures what such plans would hold on a whole log: every step planned from its
//! own lifetimes, the plan remade with each position's largest size as the log goes on (so one
//! block serves a step whose sizes vary), and the arrays that outlive their step served apart
//! at their own size. It is the bound the runtime's planned tier aims at, computed here from
//! the log alone (no allocator runs): the replay report prints it beside the measured policies.

use std::collections::HashMap;

pub use gpucache::planner::{Lifetime, greedy_by_size};

use super::Op;

/// What [`simulate`] found on a log.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Simulated {
    /// The most bytes held at once: the plan's block (the largest it had to be so far) plus the
    /// arrays served apart that are alive.
    pub peak: usize,
    /// The largest footprint of any step's own plan (aligned sizes).
    pub largest_step_plan: usize,
    /// Steps whose plan had to be remade (a position grew, or the step allocated a different
    /// number of arrays); the first step is not counted.
    pub replans: usize,
}

/// One step as [`simulate`] sees it: the arrays dropped inside it (planned), in allocation
/// order, and the bytes of those that outlived it.
struct Step {
    planned: Vec<Lifetime>,
    /// (buffer, aligned bytes) of the arrays alive at the step's exit.
    escaped: Vec<(u64, usize)>,
}

/// Frees of arrays made in earlier steps: those before a step's entry, and those during it.
#[derive(Default)]
struct Freed {
    before: Vec<u64>,
    during: Vec<u64>,
}

/// Splits `ops` into steps (outermost scopes) with their lifetimes.
fn steps(ops: &[Op]) -> Vec<(Step, Freed)> {
    let mut out = Vec::new();
    let mut depth = 0usize;
    let mut tick = 0u32;
    let mut open: HashMap<u64, usize> = HashMap::new();
    let mut lives: Vec<(u64, Lifetime, bool)> = Vec::new();
    let mut freed = Freed::default();
    for op in ops {
        match op {
            Op::Enter(_) => {
                if depth == 0 {
                    tick = 0;
                    open.clear();
                    lives.clear();
                }
                depth += 1;
            }
            Op::Exit(_) => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    let planned = lives
                        .iter()
                        .filter(|(_, _, done)| *done)
                        .map(|&(_, l, _)| l)
                        .collect();
                    let escaped = lives
                        .iter()
                        .filter(|(_, _, done)| !*done)
                        .map(|&(b, l, _)| (b, l.bytes))
                        .collect();
                    out.push((Step { planned, escaped }, std::mem::take(&mut freed)));
                }
            }
            Op::Alloc { buffer, bytes, .. } if depth > 0 => {
                open.insert(*buffer, lives.len());
                lives.push((
                    *buffer,
                    Lifetime {
                        bytes: gpucache::planner::aligned(*bytes).unwrap_or(*bytes),
                        start: tick,
                        end: u32::MAX,
                    },
                    false,
                ));
                tick += 1;
            }
            Op::Free { buffer } if depth > 0 => match open.remove(buffer) {
                Some(i) => {
                    lives[i].1.end = tick;
                    lives[i].2 = true;
                }
                None => freed.during.push(*buffer),
            },
            Op::Free { buffer } => freed.before.push(*buffer),
            _ => {}
        }
    }
    out
}

/// What plans would hold on `ops` (see the module docs). Positions are numbered among the arrays
/// that die within their step (known here from the whole log; a runtime numbers every
/// allocation). Arrays that outlive their step are
/// counted at their aligned size from their step's exit until the step that frees them (also
/// during the step that allocates them, through the plan: a conservative overlap).
pub fn simulate(ops: &[Op]) -> Simulated {
    let mut sim = Simulated::default();
    // The plan's sizes per position (each position's largest so far), and its block.
    let mut sizes: Vec<usize> = Vec::new();
    let mut block = 0usize;
    // Arrays served apart, alive: buffer -> bytes.
    let mut apart: HashMap<u64, usize> = HashMap::new();
    for (n, (step, freed)) in steps(ops).into_iter().enumerate() {
        for b in &freed.before {
            apart.remove(b);
        }
        let own = greedy_by_size(&step.planned).footprint;
        sim.largest_step_plan = sim.largest_step_plan.max(own);
        let fits = step.planned.len() == sizes.len()
            && step.planned.iter().zip(&sizes).all(|(l, &s)| l.bytes <= s);
        if !fits {
            if n > 0 {
                sim.replans += 1;
            }
            if step.planned.len() == sizes.len() {
                for (s, l) in sizes.iter_mut().zip(&step.planned) {
                    *s = (*s).max(l.bytes);
                }
            } else {
                sizes = step.planned.iter().map(|l| l.bytes).collect();
            }
            let merged: Vec<Lifetime> = step
                .planned
                .iter()
                .zip(&sizes)
                .map(|(l, &bytes)| Lifetime { bytes, ..*l })
                .collect();
            block = block.max(greedy_by_size(&merged).footprint);
        }
        // During the step: the block, the arrays apart from earlier steps (those it frees are
        // still counted: conservative), and the ones it allocates to outlive it.
        let apart_now: usize = apart.values().sum();
        let escaping: usize = step.escaped.iter().map(|&(_, b)| b).sum();
        sim.peak = sim.peak.max(block + apart_now + escaping);
        for b in &freed.during {
            apart.remove(b);
        }
        apart.extend(step.escaped);
    }
    sim
}
