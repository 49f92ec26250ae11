"""The gate report: a terminal table per check, ``reports/gates.json`` and ``reports/gates.md`` (written atomically).

Per check: gate, step, the metric against the control, against the float32 reference, the bound each is held to
(``0 (exact)`` or the tolerance against the control; ``max(tol, (1 + slack) * m(control, reference))`` against the
reference), the verdict; then the first failing step and the worst tensor (largest gradient rel L2 against the control).
A failing check's explanation (``gates.explain``: the first op and layer over its bound at step 1) follows its table:
the line in the terminal, the line and every tap in ``gates.md`` and ``gates.json``. ``write`` also draws, where
matplotlib is installed (the ``plots`` extra), each check's gate curves and each explanation's heatmap as PNG files
beside the reports, linked from ``gates.md`` (``gates.plots``); the text stays complete without them.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import time

from tabulate import tabulate

from nxgates.gates import atomic
from nxgates.gates import gates as gates_lib
from nxgates.gates.tolerances import Tolerances

STATUSES = ("complete", "incomplete", "interrupted", "stopped")
HEADERS = ("gate", "step", "vs control", "bound", "vs reference", "bound (ref)", "verdict")


def _fmt(x: float) -> str:
    if x is None:
        return "-"
    if math.isinf(x) or math.isnan(x):
        return str(x)
    return "0" if x == 0 else f"{x:.3e}"


@dataclasses.dataclass
class Report:
    config: str
    checks: list  # list[gates.runner.CheckResult]
    golden: object | None  # gates.golden.GoldenComparison
    env: dict
    tolerances: Tolerances
    wall_s: float = 0.0
    pending: list = dataclasses.field(default_factory=list)  # checks not run yet (a partial report)
    plots: dict = dataclasses.field(default_factory=dict)  # check name -> [(title, file name)] (set by write)
    # "complete"; "incomplete" (written while the run goes on: if its process is gone, it was killed);
    # "interrupted" (Ctrl-C / SIGTERM: the checks done before it); "stopped" (fail_fast: the checks up to the first
    # failing one, which is the last; a FAIL verdict, with the checks not run in ``pending``)
    status: str = "complete"
    run: dict = dataclasses.field(default_factory=dict)  # started, command, git_commit, source_sha256, pid, host

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"Report: status={self.status!r} must be one of {STATUSES}")

    @property
    def passed(self) -> bool:
        """Every gate of every check passes. The golden comparison is reported next to it, not part of it: a drifted
        control is a finding about the baseline (rebuild or investigate), not a flag's gate failure."""
        return (self.status == "complete" and bool(self.checks) and not self.pending
                and all(c.passed for c in self.checks))

    def status_line(self) -> str:
        """The first line of every render: the status, when, the command, the commit and source hash."""
        r = self.run
        done = f"{len(self.checks)}/{len(self.checks) + len(self.pending)} checks"
        what = {"complete": f"COMPLETE ({done})",
                "incomplete": f"INCOMPLETE ({done} so far; written while the run went on: if process {r.get('pid')} "
                              f"on {r.get('host')} is gone, the run was killed before it finished)",
                "interrupted": f"INTERRUPTED ({done} done before the interrupt; not a verdict)",
                "stopped": f"STOPPED AT THE FIRST FAILING CHECK ({done}; --fail-fast: the rest not run)"}[self.status]
        commit = r.get("git_commit") or "no git checkout"
        return (f"status: {what}; started {r.get('started', '?')}, written {self.written}; command: "
                f"{r.get('command', '?')}; commit {commit}; source sha256 {str(r.get('source_sha256', '?'))[:16]}")

    # ------------------------------------------------------------------------------------------------------ rows
    @staticmethod
    def rows(check, lens: bool = False) -> list[list[str]]:
        """The bf16 gates' rows, or (``lens``) the float32 lens's (empty when the lens did not run)."""
        out = []
        for r in (check.lens_results or []) if lens else check.results:
            bound_c = "0 (exact)" if check.spec.contract == "exact" else _fmt(r.bound_control)
            verdict = "pass" if r.passed else "FAIL"
            if not r.passed:
                why = []
                if not r.passed_control:
                    why.append("control")
                if not r.passed_reference:
                    why.append("reference")
                verdict += f" ({', '.join(why)}{'; ' + r.note if r.note else ''})"
            name = f"{r.gate} {gates_lib.GATE_NAMES[r.gate]}"
            out.append([name, str(r.step), _fmt(r.vs_control), bound_c, _fmt(r.vs_reference), _fmt(r.bound_reference),
                        verdict])
        return out

    @staticmethod
    def summary(check) -> list[str]:
        lines = [f"check {check.spec.name!r}: contract {check.spec.contract}; "
                 f"{'PASS' if check.passed else 'FAIL'} ({check.wall_s:.1f}s; control {check.records['control']}, "
                 f"reference {check.records['reference']})"]
        if check.control_flags:
            lines.append("  control prerequisites: " + ", ".join(f"{k}={v}" for k, v in check.control_flags.items()))
        lines.append("  candidate flags: " + ", ".join(f"{k}={v}" for k, v in check.candidate_flags.items()))
        for p in check.problems:
            lines.append(f"  precondition failed: {p}")
        lens_ok = getattr(check, "lens_passed", None)
        lines.append("  float32 lens: " + ("not run (exact contract, or no [lens.*] bounds)" if lens_ok is None else
                                           ("PASS" if lens_ok else "FAIL") + "; bf16 gates: "
                                           + ("PASS" if getattr(check, "bf16_passed", check.passed) else "FAIL")))
        for p in getattr(check, "lens_problems", ()):
            lines.append(f"  float32 lens precondition failed: {p}")
        for e in getattr(check, "environment", ()):
            lines.append(f"  environment change (reported, not a failure): {e}")
        step = check.first_failing_step
        name, value = check.worst_tensor
        worst = f"{name} (gradient rel L2 {_fmt(value)})" if value > 0 else "none (every gradient tensor equal)"
        lines.append(f"  first failing step: {step if step is not None else 'none'}; worst tensor vs control: {worst}")
        ex = getattr(check, "explanation", None)
        if ex is not None:
            lines.append(f"  explain (step 1, first tap over its bound): {ex if isinstance(ex, str) else ex.line()}")
        rm = check.routing_mismatch
        if rm:
            lines.append("  routing replayed from the control; own top-k would differ on (layer, token) pairs "
                         "per step: "
                         f"candidate {'/'.join(map(str, rm['candidate']))}, "
                         f"float32 reference {'/'.join(map(str, rm['reference']))}")
        return lines

    def verdict(self) -> str:
        """PASS; FAIL (a complete run, or one stopped at its first failing check); else the status (no verdict)."""
        if self.passed:
            return "PASS"
        return "FAIL" if self.status in ("complete", "stopped") else self.status.upper()

    # -------------------------------------------------------------------------------------------------- renders
    @property
    def written(self) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    def table(self) -> str:
        parts = [self.status_line(),
                 f"nxgates: config {self.config!r} on {self.env.get('device_count')} x {self.env.get('device_kind')} "
                 f"(jax {self.env.get('jax')}), slack {gates_lib.slack_text(self.tolerances)}"]
        for c in self.checks:
            parts.append("")
            parts += self.summary(c)
            parts.append(tabulate(self.rows(c), headers=HEADERS, tablefmt="simple", disable_numparse=True))
            if self.rows(c, lens=True):
                parts.append("float32 lens (the candidate's and the control's code paths in float32, same reference):")
                parts.append(tabulate(self.rows(c, lens=True), headers=HEADERS, tablefmt="simple",
                                      disable_numparse=True))
        if self.golden is not None:
            tag = "WARNING " if self.golden.failed else ""
            parts += ["", f"{tag}golden: {self.golden.status}: {self.golden.message}"]
        if self.pending:
            parts += ["", ("NOT RUN (stopped at the first failing check): " if self.status == "stopped"
                           else "PARTIAL REPORT: still to run: ") + ", ".join(self.pending)]
        n_fail = sum(not c.passed for c in self.checks)
        verdict = self.verdict()
        parts += ["", f"{verdict}: {len(self.checks) - n_fail}/{len(self.checks)} checks "
                  f"pass ({self.wall_s:.1f}s)"]
        parts += [f"  failed: {self.failure_line(c)}" for c in self.checks if not c.passed]
        return "\n".join(parts)

    @staticmethod
    def failure_line(check) -> str:
        """One line naming what failed first in a failing check, for the end of the terminal report: where a log
        keeps only its last lines (a CI job's), the verdict still says which check failed, on which gate and step,
        against which side and by how much. Per lens, the first failing row (by step, then gate): the metric and the
        bound it crossed; a precondition failure is named instead."""
        parts = []
        for lens, results, problems in (("bf16", check.results, check.problems),
                                        ("float32 lens", check.lens_results or [],
                                         getattr(check, "lens_problems", ()))):
            if problems:
                parts.append(f"{lens} precondition: {problems[0]}")
                continue
            bad = [r for r in results if not r.passed]
            if not bad:
                continue
            r = min(bad, key=lambda r: (r.step, gates_lib.GATES.index(r.gate)))
            side, value, bound = (("control", r.vs_control, r.bound_control) if not r.passed_control else
                                  ("reference", r.vs_reference, r.bound_reference))
            what = (f"bits differ from the control (metric {_fmt(value)})"
                    if check.spec.contract == "exact" and side == "control" and lens == "bf16"
                    else f"{_fmt(value)} > bound {_fmt(bound)}")
            more = len(bad) - 1
            parts.append(f"{lens} {r.gate} step {r.step} vs {side}: {what}"
                         + (f" (and {more} more gate-step(s))" if more else ""))
        return f"{check.spec.name} ({check.spec.contract}): " + "; ".join(parts)

    def to_markdown(self) -> str:
        parts = [f"**{self.status_line()}**", "", f"# nxgates report: config `{self.config}`", "",
                 f"{self.env.get('device_count')} x {self.env.get('device_kind')}, jax {self.env.get('jax')}, "
                 f"jaxlib {self.env.get('jaxlib')}; tolerances `{self.tolerances.path}`, "
                 f"slack {gates_lib.slack_text(self.tolerances)}.",
                 "", f"**{self.verdict()}**"
                 + (f" ({'not run' if self.status == 'stopped' else 'partial: still to run'} "
                    f"{', '.join(self.pending)})" if self.pending else ""), ""]
        for c in self.checks:
            parts.append(f"## {c.spec.name} ({c.spec.contract}): {'PASS' if c.passed else 'FAIL'}")
            parts.append("")
            parts += [f"- {line.strip()}" for line in self.summary(c)[1:]]
            parts.append("")
            parts.append(tabulate(self.rows(c), headers=HEADERS, tablefmt="github", disable_numparse=True))
            parts.append("")
            for title, name in self.plots.get(c.spec.name, []):
                parts += [f"![{title}]({name})", ""]
            ex = getattr(c, "explanation", None)
            if ex is not None and not isinstance(ex, str):
                parts += ["<details><summary>every tap of the explanation (step 1)</summary>", "", "```",
                          ex.text(), "```", "", "</details>", ""]
            if self.rows(c, lens=True):
                parts += ["float32 lens:", "",
                          tabulate(self.rows(c, lens=True), headers=HEADERS, tablefmt="github", disable_numparse=True),
                          ""]
        if self.golden is not None:
            parts += [f"Golden: **{self.golden.status}**: {self.golden.message}", ""]
        return "\n".join(parts)

    def to_json(self) -> dict:
        return {
            "status": self.status,
            "status_line": self.status_line(),
            "run": {**self.run, "written": self.written},
            "config": self.config,
            "passed": self.passed,
            "env": self.env,
            "wall_s": self.wall_s,
            "tolerances": {"path": self.tolerances.path, "tol": dict(self.tolerances.tol),
                           "slack": dict(self.tolerances.slack), "golden_rel": self.tolerances.golden_rel,
                           "golden_cross_env_rel": self.tolerances.golden_cross_env_rel},
            "golden": self.golden.as_dict() if self.golden is not None else None,
            "pending": list(self.pending),
            "checks": [
                {
                    "name": c.spec.name,
                    "contract": c.spec.contract,
                    "keys": list(c.spec.keys),
                    "control_overrides": c.control_flags,
                    "candidate_overrides": c.candidate_flags,
                    "passed": c.passed,
                    "first_failing_step": c.first_failing_step,
                    "worst_tensor": {"name": c.worst_tensor[0], "rel_l2": c.worst_tensor[1]},
                    "problems": c.problems,
                    "records": c.records,
                    "routing_mismatch": c.routing_mismatch,
                    "implementations": c.implementations,
                    "wall_s": c.wall_s,
                    "gates": [r.as_dict() for r in c.results],
                    "explanation": _explanation_json(getattr(c, "explanation", None)),
                    "lens_passed": getattr(c, "lens_passed", None),
                    "lens_gates": [r.as_dict() for r in getattr(c, "lens_results", None) or ()],
                    "lens_problems": list(getattr(c, "lens_problems", ())),
                    "environment": list(getattr(c, "environment", ())),
                }
                for c in self.checks
            ],
        }

    def write(self, out_dir: str | pathlib.Path = "reports") -> tuple[pathlib.Path, pathlib.Path]:
        out = pathlib.Path(out_dir)
        if self.status == "stopped" or (self.status == "complete" and not self.pending):  # final: with pictures
            from nxgates.gates import plots

            self.plots = plots.report_plots(self, out)
        return (atomic.write_json_atomic(out / "gates.json", self.to_json(), sort_keys=False),  # status first
                atomic.write_text_atomic(out / "gates.md", self.to_markdown()))


def _explanation_json(ex):
    if ex is None:
        return None
    return {"line": ex} if isinstance(ex, str) else ex.to_json()
