"""Golden control records: ``fixtures/golden/<config>.json``.

A golden holds the control run's per-step loss at full precision (the float32 value, its exact hex bits and its decimal
repr) and the per-step gradient global norms, with metadata (date, jax/jaxlib versions, platform, device kind and
count, flags, seeds, the implementation of every op, the source hash). Rebuild with

    python -m nxgates golden --config tiny

which runs the control fresh (no cache) and writes the golden atomically, and only when the run is clean (finite, no
dropped token): a failed run never overwrites a good golden. A gate run compares its control with the golden when the
platform and versions match (loss bit-identical, gradient norms within ``[gates.golden] rel``) and says plainly when
they do not match, in which case nothing is compared.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import time

import numpy as np

from nxgates import fixtures
from nxgates.gates import atomic
from nxgates.gates import gates as gates_lib
from nxgates.gates.record import RunRecord
from nxgates.gates.tolerances import Tolerances

GOLDEN_DIR = fixtures.GOLDEN
# What must match for a comparison to mean anything: a different compiler or device legitimately rounds differently.
PLATFORM_KEYS = ("jax", "jaxlib", "platform", "device_kind", "device_count")


def golden_path(config: str, golden_dir: str | pathlib.Path | None = None) -> pathlib.Path:
    return pathlib.Path(golden_dir or GOLDEN_DIR) / f"{config}.json"


def _f32_hex(x) -> str:
    return np.asarray(x, np.float32).reshape(()).view(np.uint32).item().to_bytes(4, "big").hex()


def golden_from_record(config: str, rec: RunRecord) -> dict:
    env = rec.metadata.get("env", {})
    return {
        "config": config,
        "loss": [float(np.asarray(s.loss, np.float64)) for s in rec.steps],
        "loss_f32_hex": [_f32_hex(s.loss) for s in rec.steps],
        "grad_norm": [float(np.asarray(s.grad_norm, np.float64)) for s in rec.steps],
        "grad_norm_f32_hex": [_f32_hex(s.grad_norm) for s in rec.steps],
        "metadata": {
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "env": env,
            "flags": rec.metadata.get("flags"),
            "seeds": rec.metadata.get("seeds"),
            "settings": rec.metadata.get("settings"),
            "implementations": rec.metadata.get("implementations"),
            "source_sha256": rec.metadata.get("source_sha256"),
            "rebuild": f"python -m nxgates golden --config {config}",
        },
    }


@dataclasses.dataclass(frozen=True)
class GoldenComparison:
    status: str  # "match" | "mismatch" | "skipped" (platform/versions differ) | "missing"
    message: str
    path: str

    @property
    def failed(self) -> bool:
        return self.status == "mismatch"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def compare(golden: dict, rec: RunRecord, tol_rel: float, path: str = "") -> GoldenComparison:
    env = rec.metadata.get("env", {})
    genv = golden.get("metadata", {}).get("env", {})
    differ = [f"{k} {genv.get(k)!r} (golden) vs {env.get(k)!r} (now)"
              for k in PLATFORM_KEYS if genv.get(k) != env.get(k)]
    if differ:
        return GoldenComparison("skipped", "golden NOT compared: platform/versions differ: " + "; ".join(differ), path)
    if golden.get("metadata", {}).get("flags") != rec.metadata.get("flags"):
        return GoldenComparison("skipped", "golden NOT compared: the golden's control flags differ from this control's",
                                path)
    n = len(golden.get("loss", []))
    if n != rec.num_steps:
        return GoldenComparison("mismatch", f"golden has {n} steps, the control {rec.num_steps}", path)
    problems = []
    for i, s in enumerate(rec.steps):
        if _f32_hex(s.loss) != golden["loss_f32_hex"][i]:
            problems.append(f"step {i + 1} loss {float(s.loss)!r} != golden {golden['loss'][i]!r}")
        g, gg = float(np.asarray(s.grad_norm, np.float64)), float(golden["grad_norm"][i])
        rel = abs(g - gg) / abs(gg) if gg != 0 else (0.0 if g == 0 else math.inf)
        if not rel <= tol_rel:
            problems.append(f"step {i + 1} grad norm {g!r} vs golden {gg!r}: rel {rel:.3e} > {tol_rel:g}")
    src_note = ""
    if golden.get("metadata", {}).get("source_sha256") != rec.metadata.get("source_sha256"):
        src_note = " (the model/kernel sources changed since the golden was built)"
    if problems:
        rebuild = golden.get("metadata", {}).get("rebuild", "python -m nxgates golden")
        return GoldenComparison("mismatch", "control drifted from the golden" + src_note + ": " + "; ".join(problems)
                                + f". If intended, rebuild with `{rebuild}`", path)
    return GoldenComparison("match", f"control matches the golden ({n} steps: loss bit-identical, grad norms within "
                            f"rel {tol_rel:g}){src_note}", path)


def compare_with_golden(config: str, rec: RunRecord, tols: Tolerances,
                        golden_dir: str | pathlib.Path | None = None) -> GoldenComparison:
    path = golden_path(config, golden_dir)
    if not path.exists():
        return GoldenComparison("missing", f"no golden at {path}; build it with `python -m nxgates golden --config "
                                f"{config}`", str(path))
    try:
        golden = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return GoldenComparison("mismatch", f"golden {path} is unreadable ({e}); rebuild it", str(path))
    return compare(golden, rec, tols.golden_rel, str(path))


def write_golden(config: str, rec: RunRecord, golden_dir: str | pathlib.Path | None = None) -> pathlib.Path:
    """Write the golden for ``config`` from a clean control run; refuses (ValueError) a run that is not clean."""
    problems = gates_lib.preconditions({"control": rec})
    if problems:
        raise ValueError(f"golden for config={config!r} not written (the existing one is kept): " + "; ".join(problems))
    return atomic.write_json_atomic(golden_path(config, golden_dir), golden_from_record(config, rec))
