#!/usr/bin/env python3
"""Replays gpucache replay logs through PyTorch's own caching allocator, on a GPU.

What PyTorch would hold for the same allocations: each ``alloc`` of a log is a
``torch.empty(bytes, dtype=torch.uint8, device="cuda")`` and its ``free`` drops the tensor, in
the log's order; ``invalidate`` is ``torch.cuda.empty_cache()``. Each configuration of the
caching allocator runs in a process of its own (``PYTORCH_CUDA_ALLOC_CONF`` is read once): the
default (blocks split inside segments of 2 MiB and 20 MiB or more, no segment grown) and
``expandable_segments:True`` (segments mapped through the driver's virtual memory management,
grown in place). For each log and configuration it prints the peak reserved bytes
(``torch.cuda.max_memory_reserved()``) over the log's peak live bytes (the most bytes of its
arrays alive at once, as ``examples/replay`` counts them) and the device allocations (the
allocator's ``num_device_alloc``: segments allocated, or mapped, from the driver) in the steps
after the second and in the second half of the steps, the figures ``examples/replay`` prints for
gpucache and CUDA's pool. Host time is not measured: a Python call per allocation costs more
than the allocator does.

    python3 examples/replay/replay_torch.py tests/fixtures/*.csv.gz

The log format is documented at the top of ``src/replay/mod.rs``; ``record_torch.py`` records
one. Needs a CUDA device and torch; no network.
"""

import argparse
import gzip
import json
import os
import subprocess
import sys

CONFS = {
    "torch caching allocator": "",
    "torch, expandable segments": "expandable_segments:True",
}


def read(path):
    """The log's operations: ("enter",), ("exit",), ("alloc", buffer, bytes), ("free", buffer),
    ("invalidate",)."""
    opener = gzip.open if path.endswith(".gz") else open
    ops = []
    with opener(path, "rt") as f:
        header = f.readline().strip()
        if header != "op,cache,buffer,bytes,elem,dims":
            raise SystemExit(f"{path}: not a replay log (header {header!r})")
        for n, line in enumerate(f, start=2):
            fields = line.rstrip("\n").split(",")
            if len(fields) != 6:
                raise SystemExit(f"{path}:{n}: not a log line: {line!r}")
            op = fields[0]
            if op in ("enter", "exit", "invalidate"):
                ops.append((op,))
            elif op == "alloc":
                ops.append(("alloc", int(fields[2]), int(fields[3])))
            elif op == "free":
                ops.append(("free", int(fields[2])))
            else:
                raise SystemExit(f"{path}:{n}: unknown operation {op!r}")
    return ops


def peak_live(ops):
    """The most bytes of the log's arrays alive at once."""
    sizes, live, peak = {}, 0, 0
    for op in ops:
        if op[0] == "alloc":
            live += op[2] - sizes.get(op[1], 0)
            sizes[op[1]] = op[2]
            peak = max(peak, live)
        elif op[0] == "free":
            live -= sizes.pop(op[1], 0)
    return peak


def replay(ops):
    """Replays `ops` through the caching allocator: its peak reserved bytes and the device
    allocations made in each step."""
    import torch

    def device_allocs():
        stats = torch.cuda.memory_stats()
        return stats.get("num_device_alloc", stats.get("segment.all.allocated", 0))

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    live, depth, step_allocs = {}, 0, []
    before = device_allocs()
    for op in ops:
        kind = op[0]
        if kind == "alloc":
            live[op[1]] = torch.empty(op[2], dtype=torch.uint8, device="cuda")
        elif kind == "free":
            live.pop(op[1], None)
        elif kind == "enter":
            depth += 1
        elif kind == "exit":
            depth -= 1
            if depth == 0:
                now = device_allocs()
                step_allocs.append(now - before)
                before = now
        else:
            torch.cuda.empty_cache()
    live.clear()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_reserved()
    torch.cuda.empty_cache()
    return peak, step_allocs


def child(paths):
    """One configuration (the environment's): a JSON line per log."""
    for path in paths:
        ops = read(path)
        peak, step_allocs = replay(ops)
        print(json.dumps({"log": path, "peak": peak, "live": peak_live(ops), "steps": step_allocs}))
        sys.stdout.flush()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("logs", nargs="+", help="replay logs (.csv or .csv.gz)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.logs)
        return
    results = {}
    for name, conf in CONFS.items():
        env = dict(os.environ)
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        out = subprocess.run(
            [sys.executable, __file__, "--child", *args.logs],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        for line in out.splitlines():
            r = json.loads(line)
            results.setdefault(r["log"], {})[name] = r
    print("| log | peak live MiB | " + " | ".join(
        f"{name}: peak / peak live, device allocations after step 2 (second half)" for name in CONFS
    ) + " |")
    print("|---|---|" + "---|" * len(CONFS))
    for log, by_conf in results.items():
        cells = []
        live = 0
        for name in CONFS:
            r = by_conf[name]
            live = r["live"]
            steps = r["steps"]
            half = sum(steps[len(steps) // 2:])
            ratio = r["peak"] / r["live"] if r["live"] else float("nan")
            cells.append(f"{ratio:.3f}x, {sum(steps[2:])} ({half})")
        name = os.path.basename(log).removesuffix(".gz").removesuffix(".csv")
        print(f"| {name} | {live / 2**20:.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
