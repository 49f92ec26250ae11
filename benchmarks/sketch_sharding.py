"""Sharding invariance on real tensors: a protocol record's summaries (computed in-step on the 2x2x2 mesh) against
the same summaries recomputed on one device from the record's full tensors.

    python benchmarks/sketch_sharding.py RUN_DIR      # a cache entry of python -m nxgates run (full tensors)
"""

from __future__ import annotations

import sys

from nxgates.devices import use_host_devices

use_host_devices()

import numpy as np  # noqa: E402

from nxgates.gates import record as record_lib  # noqa: E402
from nxgates.gates import recorder, records  # noqa: E402


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    run = records.load_run(argv[0])
    rec = record_lib.from_run(run)
    summarize = recorder.jitted_summaries(run.spec.width, run.spec.seed)
    worst: dict[str, tuple[float, str]] = {}
    fp_equal, prev = True, rec.params0
    for step in rec.steps:
        one = {k: np.asarray(v) for k, v in summarize(step.grads, step.params, prev_params=prev).items()}  # 1 device
        prev = step.params
        for k, v in one.items():
            mesh = step.summaries[k]
            group = k.split("/")[0]
            if group.endswith("_fp"):
                fp_equal &= bool(np.array_equal(v, mesh))
                continue
            ref = np.asarray(mesh, np.float64)
            den = float(np.linalg.norm(ref))
            r = float(np.linalg.norm(np.asarray(v, np.float64) - ref)) / den if den else 0.0
            if r >= worst.get(group, (-1.0, ""))[0]:
                worst[group] = (r, k)
    for group, (r, k) in sorted(worst.items()):
        print(f"{group:14s} worst ||S_1device - S_mesh|| / ||S_mesh|| = {r:.2e} ({k})")
    print(f"fingerprints identical on 1 device and on the mesh: {fp_equal}")
    return 0 if fp_equal else 1


if __name__ == "__main__":
    sys.exit(main())
