"""How long a report's gate-curve PNGs take, with the log axes' tick labels in plain text (``gates/plots.py``) and
with matplotlib's default mathtext labels, side by side in one process.

    python benchmarks/report_plots.py REPORT_DIR/gates.json [--rounds 3] [--out DIR]

It rebuilds every check's gate results from the report's JSON (``python -m nxgates run`` writes it), draws the 14 (on
tiny) ``gate_curves`` pictures once per variant per round, alternating the variants, and prints min / median / each
round's seconds per variant.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import tempfile
import time
import types


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", help="a run's gates.json")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="where the PNGs go (default: a temporary folder)")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import ticker

    from nxgates.gates import gates as gates_lib
    from nxgates.gates import plots

    try:
        doc = json.loads(open(args.report, encoding="utf-8").read())
        fields = [f.name for f in dataclasses.fields(gates_lib.GateResult)]
        checks = [types.SimpleNamespace(results=[gates_lib.GateResult(**{k: r[k] for k in fields})
                                                 for r in c.get("results") or c.get("gates")],
                                        spec=types.SimpleNamespace(name=c["name"]), passed=c.get("passed", True))
                  for c in doc["checks"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"error: {args.report}: not a gates.json report ({e})", file=sys.stderr)
        return 2
    plain = ticker.LogFormatter

    class Mathtext(ticker.LogFormatterSciNotation):  # what a log axis labels with when nothing is set
        def __init__(self, labelOnlyBase=False, minor_thresholds=None):  # noqa: N803 (matplotlib's name)
            super().__init__(labelOnlyBase=labelOnlyBase)

    out = args.out or tempfile.mkdtemp(prefix="nxgates-plots-")
    seconds: dict[str, list[float]] = {"mathtext (default)": [], "plain text (gates/plots.py)": []}
    try:
        for _ in range(args.rounds):
            for name, fmt in zip(seconds, (Mathtext, plain), strict=True):
                ticker.LogFormatter = fmt
                t = time.perf_counter()
                for i, c in enumerate(checks):
                    path = pathlib.Path(f"{out}/{i:02d}-{'plain' if fmt is plain else 'mathtext'}.png")
                    path.unlink(missing_ok=True)  # drawn every round (a picture of the same numbers would be kept)
                    plots.gate_curves(c, path)
                seconds[name].append(time.perf_counter() - t)
    finally:
        ticker.LogFormatter = plain
    for name, v in seconds.items():
        print(f"{name}: {len(checks)} plots, min {min(v):.1f} s, median {statistics.median(v):.1f} s "
              f"(rounds: {', '.join(f'{x:.1f}' for x in v)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
