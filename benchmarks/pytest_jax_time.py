"""Where the test suite's time goes inside jax: a pytest plugin that adds up jax's own duration events per test, and a
summary per test file.

    NXGATES_JAX_TIME=DIR PYTHONPATH=benchmarks python -m pytest -n 2 --dist loadfile -p pytest_jax_time
    python benchmarks/pytest_jax_time.py DIR [--top 25]

The plugin registers a ``jax.monitoring`` duration listener in each test process (xdist's workers too) and charges
every event to the test that was running (before the first test: "(outside any test)"; after a test, until the next
starts: that test): XLA's backend compile (a miss of the persistent compilation cache), tracing
to a jaxpr, lowering to StableHLO, and the cache's hits. Each process writes ``DIR/<worker>.json`` when it ends. The
summary prints, per event, the count and seconds over the whole run, then per file the backend compiles: their number
and seconds, and how many of them took under 0.5 s and their seconds (the small programs: a jitted helper, an eager
``jnp`` op, a kernel test's case) against the large ones (a model's program). The events of a subprocess a test starts
(the CLI tests) are not counted: jax in that process has no listener.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import sys

ENV = "NXGATES_JAX_TIME"
SMALL_S = 0.5  # a backend compile under this many seconds counts as a small program
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"

_current = ["(outside any test)"]
# nodeid -> event -> [count, seconds, count under SMALL_S, seconds of those]
_events: dict = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0, 0, 0.0]))


def _listener(event: str, duration: float, **_) -> None:
    row = _events[_current[0]][event]
    row[0] += 1
    row[1] += duration
    if duration < SMALL_S:
        row[2] += 1
        row[3] += duration


# ------------------------------------------------------------------------------------------------------ pytest hooks
def pytest_configure(config) -> None:
    if not os.environ.get(ENV):
        import pytest

        raise pytest.UsageError(f"pytest_jax_time: {ENV} is not set: set it to the folder for the per-process files")
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_listener)


def pytest_runtest_protocol(item, nextitem):  # noqa: ARG001 (pytest's hook signature)
    _current[0] = item.nodeid


def pytest_unconfigure(config) -> None:  # noqa: ARG001
    if not os.environ.get(ENV):  # refused in pytest_configure
        return
    from nxgates.gates.atomic import write_json_atomic

    out = pathlib.Path(os.environ[ENV])
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.json",
                      {test: dict(ev) for test, ev in _events.items()})


# ------------------------------------------------------------------------------------------------------------ summary
def summarize(folder: pathlib.Path, top: int) -> str:
    from tabulate import tabulate

    files = sorted(folder.glob("*.json"))
    if not files:
        raise SystemExit(f"pytest_jax_time: no <worker>.json in {str(folder)!r} (run pytest with the plugin first)")
    totals: dict = collections.defaultdict(lambda: [0, 0.0])
    per_file: dict = collections.defaultdict(lambda: [0, 0.0, 0, 0.0])
    # summed over the processes' files: "(outside any test)" is in each of them
    for test, events in ((t, ev) for f in files for t, ev in json.loads(f.read_text()).items()):
        for event, (n, s, n_small, s_small) in events.items():
            totals[event][0] += n
            totals[event][1] += s
            if event == BACKEND_COMPILE:
                row = per_file[test.split("::")[0]]
                for i, v in enumerate((n, s, n_small, s_small)):
                    row[i] += v
    lines = [tabulate([(e, n, f"{s:.1f}") for e, (n, s) in sorted(totals.items(), key=lambda x: -x[1][1])],
                      headers=["event", "count", "seconds"], tablefmt="github"), ""]
    rows = sorted(per_file.items(), key=lambda x: -x[1][1])
    body = [(f, n, f"{s:.1f}", ns, f"{ss:.1f}", n - ns, f"{s - ss:.1f}") for f, (n, s, ns, ss) in rows[:top]]
    n, s, ns, ss = (sum(r[i] for _, r in rows) for i in range(4))
    body.append(("all files", n, f"{s:.1f}", ns, f"{ss:.1f}", n - ns, f"{s - ss:.1f}"))
    lines.append(tabulate(body, headers=["file", "compiles", "s", f"under {SMALL_S} s", "s", "larger", "s"],
                          tablefmt="github"))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", help=f"the folder {ENV} named in the pytest run")
    ap.add_argument("--top", type=int, default=25, help="files shown (the rest are in the total)")
    args = ap.parse_args(argv)
    if args.top < 1:
        print(f"error: --top={args.top} must be >= 1", file=sys.stderr)
        return 2
    print(summarize(pathlib.Path(args.folder), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
