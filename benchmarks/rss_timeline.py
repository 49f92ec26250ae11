"""Where a process's memory peaks: the resident set over time while one process computes the control, the float32
lens's control and one lens candidate (with the reference it needs), as a prefetch worker would, in a fresh cache.

    python benchmarks/rss_timeline.py [--config tiny] [--flag moe_wi_gmm_fused_swiglu=true] [--cache-dir DIR]

A thread samples ``VmRSS`` (``/proc/self/status``, Linux only) every 50 ms. The run's own progress lines (tracing and
compiling, each step) are printed with the resident set at that moment, and after the run the largest and the
smallest sample between each line and the next: a step line is printed when the step has run, so the window that
starts at "tracing + compiling" holds the compile and the first step. Between records the in-memory jax caches are
dropped (``jax.clear_caches``), as a worker does.
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import sys
import tempfile
import threading
import time

from nxgates.devices import use_host_devices

use_host_devices()

import jax  # noqa: E402

from nxgates.gates import record as record_lib  # noqa: E402
from nxgates.gates.cli import parse_flag_items  # noqa: E402
from nxgates.gates.runner import Runner, control_routing  # noqa: E402


def rss_mb() -> float:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1e3
    raise RuntimeError("no VmRSS in /proc/self/status")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--flag", default="moe_wi_gmm_fused_swiglu=true")
    ap.add_argument("--cache-dir", default=None, help="an empty folder (default: a new temporary one)")
    args = ap.parse_args(argv)
    if not sys.platform.startswith("linux"):
        ap.error("reads /proc/self/status: Linux only")
    flag = parse_flag_items([args.flag])
    t0 = time.perf_counter()
    samples: list[tuple[float, float]] = []
    events: list[tuple[float, str]] = []

    def sample():
        while True:
            samples.append((time.perf_counter() - t0, rss_mb()))
            time.sleep(0.05)

    def log(msg: str):
        events.append((time.perf_counter() - t0, msg))
        print(f"{events[-1][0]:7.1f} s  RSS {rss_mb():6.0f} MB | {msg}", flush=True)

    threading.Thread(target=sample, daemon=True).start()
    root = args.cache_dir or tempfile.mkdtemp(prefix="rss_timeline_")
    r = Runner(args.config, cache=record_lib.RecordCache(root, log=lambda m: None), progress=log)
    replay = control_routing(r.shared_record(r.base_flags, "production", "control")[0])
    jax.clear_caches()
    log("control done, jax caches cleared")
    r.shared_record(r.base_flags, "lens", "lens control", replay)
    jax.clear_caches()
    log("lens control done, jax caches cleared")
    r.candidate_summary(r.flags_from(flag), "lens", f"lens candidate {args.flag}", replay)
    jax.clear_caches()
    log("lens candidate done, jax caches cleared")
    time.sleep(0.1)
    print("\nlargest / smallest resident set between each line and the next:")
    bounds = events + [(float("inf"), "end")]
    for (start, msg), (stop, _) in itertools.pairwise(bounds):
        window = [mb for t, mb in samples if start <= t < stop]
        if window:
            print(f"{start:7.1f} s  max {max(window):6.0f} MB  min {min(window):6.0f} MB | {msg[:90]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
