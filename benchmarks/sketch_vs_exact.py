"""For every registered flag: the gates from sketches beside the gates from exact arrays, on the same records.

    python benchmarks/sketch_vs_exact.py [--config tiny] [--cache-dir DIR] [--json F]

Reads the records a finished ``python -m nxgates run --config tiny`` left in the record cache (computes any that are
missing), then for each check: (1) the runner's own verdicts (``gates.gates.evaluate`` on the full arrays), (2)
``gates.compare`` on the same records as run directories with their full tensors (the "exact" source), (3)
``gates.compare`` on the same records with the full tensors removed (N3 from per-tensor norms, N4/N5/N6 from the
sketches recorded in-step). Prints per check and gate: pass/fail of each, and the largest relative difference between
the sketch metric and the exact one.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from nxgates.devices import use_host_devices

use_host_devices()

from nxgates.gates import compare  # noqa: E402
from nxgates.gates import gates as gates_lib  # noqa: E402
from nxgates.gates import record as record_lib  # noqa: E402
from nxgates.gates import runner as runner_lib  # noqa: E402


def _strip(run):
    for st in run.steps.values():
        st.arrays = {k: v for k, v in st.arrays.items() if not k.startswith(("grad/", "param/"))}
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    r = runner_lib.Runner(args.config, cache=record_lib.RecordCache(args.cache_dir, log=lambda m: None))
    tols = r.tolerances
    rows, all_same = [], True
    for spec in r.default_specs():
        control_flags, candidate_flags = r.resolve(spec)
        control, _ = r.shared_record(control_flags, "production", "control")
        replay = runner_lib.control_routing(control)
        reference, _ = r.shared_record(control_flags, "reference", "reference", replay)
        candidate, _ = r.shared_record(candidate_flags, "production", f"candidate[{spec.name}]", replay)
        own, problems = gates_lib.evaluate(candidate, control, reference, spec.contract, tols)
        runs = [record_lib.to_run(x, label) for x, label in ((control, "control"), (candidate, "candidate"),
                                                             (reference, "reference"))]
        exact = compare.compare(*runs, contract=spec.contract, tolerances=tols)
        sketched = compare.compare(*[_strip(record_lib.to_run(x, label)) for x, label in
                                     ((control, "control"), (candidate, "candidate"), (reference, "reference"))],
                                   contract=spec.contract, tolerances=tols)
        for g in gates_lib.GATES:
            o = [x for x in own if x.gate == g]
            e = [x for x in exact.results if x.gate == g]
            s = [x for x in sketched.results if x.gate == g]
            rel = max((abs(b.vs_control / a.vs_control - 1) for a, b in zip(e, s, strict=True)
                       if a.vs_control and b.vs_control is not None), default=0.0)
            row = {"check": spec.name, "contract": spec.contract, "gate": g,
                   "runner": "pass" if all(x.passed for x in o) else "fail",
                   "compare_exact": "/".join(x.verdict for x in e), "compare_sketch": "/".join(x.verdict for x in s),
                   "sketch_source": s[0].source, "max_rel_diff_vs_control": rel,
                   "vs_control_exact": [x.vs_control for x in e], "vs_control_sketch": [x.vs_control for x in s]}
            same = row["compare_exact"] == row["compare_sketch"]
            all_same &= same
            rows.append(row)
            print(f"{spec.name:52s} {spec.contract:8s} {g}  runner {row['runner']:4s}  exact {row['compare_exact']:14s}"
                  f"  sketch {row['compare_sketch']:14s}  {'same' if same else 'DIFFERENT'}  "
                  f"max |sketch/exact - 1| {rel:.4f}  ({row['sketch_source']})", flush=True)
        del control, candidate, reference
        r._records.clear()
    print(f"verdicts from sketches {'equal' if all_same else 'DIFFER from'} the verdicts from exact arrays "
          f"({len(rows)} gate rows)")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all_same else 1


if __name__ == "__main__":
    sys.exit(main())
