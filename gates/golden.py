"""Golden control records: ``fixtures/golden/<config>.json``.

A golden holds the control run's per-step loss at full precision (the float32 value, its exact hex bits and its decimal
repr) and the per-step gradient global norms, with metadata (date, jax/jaxlib versions, platform, device kind and
count, flags, seeds, the implementation of every op, the source hash). Rebuild with

    python -m nxgates golden --config tiny

which runs the control fresh (no cache) and writes the golden atomically, and only when the run is clean (finite, no
dropped token): a failed run never overwrites a good golden.

A gate run compares its control with the golden. The golden's environment key (``EXACT_KEYS``: jax, jaxlib, platform,
device kind and count, and on CPU the target XLA compiles for, ``gates.provenance.cpu_target``: the CPU name and the
hash of its LLVM feature string) says where the control is reproducible to the bit: there, the loss must be
bit-identical and the gradient norms within ``[gates.golden] rel``. Outside that key (another CPU, other versions) the
control legitimately rounds differently, so loss and gradient norms are compared per step at ``[gates.golden]
cross_env_rel`` (its reason in fixtures/tolerances.toml), and the message names the keys that differ. Only a control
that is another program is not compared: another platform or device count (another backend or mesh), or other flags.
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
# Where the control is reproducible to the bit: a different compiler, device or CPU target legitimately rounds
# differently (then the comparison is at [gates.golden] cross_env_rel).
EXACT_KEYS = ("jax", "jaxlib", "platform", "device_kind", "device_count", "cpu_target")
# A control on another platform or device count is another program (backend, mesh): not compared with this golden.
PROGRAM_KEYS = ("platform", "device_count")


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
    status: str  # "match" | "mismatch" | "skipped" (another program: platform, device count, flags) | "missing"
    message: str
    path: str
    exact: bool = True  # compared to the bit (the environment key matches), else at the cross-environment tolerance

    @property
    def failed(self) -> bool:
        return self.status == "mismatch"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _show(v) -> str:
    if isinstance(v, dict):  # the CPU target: its name and feature hash
        return f"{v.get('cpu')} (features {v.get('features_sha256')}, from {v.get('source')})"
    return repr(v)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b != 0 else (0.0 if a == 0 else math.inf)


def compare(golden: dict, rec: RunRecord, tol_rel: float, path: str = "", *,
            cross_env_rel: float | None = None) -> GoldenComparison:
    """The control ``rec`` against ``golden``: exact (loss bits, grad norms within ``tol_rel``) where the environment
    key matches, else loss and grad norms within ``cross_env_rel`` per step (None: not compared, said so)."""
    env = rec.metadata.get("env", {})
    meta = golden.get("metadata", {})
    genv = meta.get("env", {})
    other = [f"{k} {genv.get(k)!r} (golden) vs {env.get(k)!r} (now)" for k in PROGRAM_KEYS if genv.get(k) != env.get(k)]
    if other:
        return GoldenComparison("skipped", "golden NOT compared: another program (platform / device count differ: "
                                + "; ".join(other) + ")", path)
    if meta.get("flags") != rec.metadata.get("flags"):
        return GoldenComparison("skipped", "golden NOT compared: the golden's control flags differ from this control's",
                                path)
    n = len(golden.get("loss", []))
    if n != rec.num_steps:
        return GoldenComparison("mismatch", f"golden has {n} steps, the control {rec.num_steps}", path)
    differ = [f"{k} {_show(genv.get(k))} (golden) vs {_show(env.get(k))} (now)"
              for k in EXACT_KEYS if genv.get(k) != env.get(k)]
    exact = not differ
    if not exact and cross_env_rel is None:
        return GoldenComparison("skipped", "golden NOT compared: the environment differs from the golden's ("
                                + "; ".join(differ) + ") and the tolerance table has no [gates.golden] cross_env_rel",
                                path, False)
    rel_bound = tol_rel if exact else cross_env_rel
    problems, worst = [], {"loss": 0.0, "grad norm": 0.0}
    for i, s in enumerate(rec.steps):
        loss, gloss = float(np.asarray(s.loss, np.float64)), float(golden["loss"][i])
        if exact:
            if _f32_hex(s.loss) != golden["loss_f32_hex"][i]:
                problems.append(f"step {i + 1} loss {float(s.loss)!r} != golden {golden['loss'][i]!r}")
        else:
            r = _rel(loss, gloss)
            worst["loss"] = max(worst["loss"], r)
            if not r <= rel_bound:
                problems.append(f"step {i + 1} loss {loss!r} vs golden {gloss!r}: rel {r:.3e} > {rel_bound:g}")
        g, gg = float(np.asarray(s.grad_norm, np.float64)), float(golden["grad_norm"][i])
        r = _rel(g, gg)
        worst["grad norm"] = max(worst["grad norm"], r)
        if not r <= rel_bound:
            problems.append(f"step {i + 1} grad norm {g!r} vs golden {gg!r}: rel {r:.3e} > {rel_bound:g}")
    src_note = ""
    if meta.get("source_sha256") != rec.metadata.get("source_sha256"):
        src_note = " (the model/kernel sources changed since the golden was built)"
    env_note = "" if exact else (" [the environment differs from the golden's: " + "; ".join(differ)
                                 + f"; compared at [gates.golden] cross_env_rel {rel_bound:g}, not to the bit]")
    if problems:
        rebuild = meta.get("rebuild", "python -m nxgates golden")
        return GoldenComparison("mismatch", "control drifted from the golden" + src_note + ": " + "; ".join(problems)
                                + f". If intended, rebuild with `{rebuild}`" + env_note, path, exact)
    if exact:
        return GoldenComparison("match", f"control matches the golden ({n} steps: loss bit-identical, grad norms "
                                f"within rel {tol_rel:g}){src_note}", path)
    return GoldenComparison("match", f"control matches the golden within rel {rel_bound:g} ({n} steps; largest rel: "
                            f"loss {worst['loss']:.3e}, grad norm {worst['grad norm']:.3e}){src_note}{env_note}",
                            path, exact)


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
    return compare(golden, rec, tols.golden_rel, str(path), cross_env_rel=tols.golden_cross_env_rel)


def write_golden(config: str, rec: RunRecord, golden_dir: str | pathlib.Path | None = None) -> pathlib.Path:
    """Write the golden for ``config`` from a clean control run; refuses (ValueError) a run that is not clean."""
    problems = gates_lib.preconditions({"control": rec})
    if problems:
        raise ValueError(f"golden for config={config!r} not written (the existing one is kept): " + "; ".join(problems))
    return atomic.write_json_atomic(golden_path(config, golden_dir), golden_from_record(config, rec))
