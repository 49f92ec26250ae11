"""The six gates on records from any trainer: ``nxgates compare CONTROL CANDIDATE [--reference REF]`` (docs/records.md).

Each gate's metric is the one of ``gates.gates`` (the same formulas: ``rel_scalar``, ``rel_from_squares``,
``worst_tensor``), read from the best data both records hold:

| gate | exact arrays | otherwise |
| N1 | ``loss`` | (none: n/a) |
| N2 | ``log_probs`` over ``mask`` | (none: n/a) |
| N3 | ``grad/*`` (float64 norm) | ``grad_sq/*`` (per-tensor float32 squares, summed in float64), else ``grad_norm`` |
| N4 | ``grad/*`` | ``grad_sketch/*``: ``sum_t ||S(a_t) - S(b_t)||^2`` over ``sum_t grad_sq`` (or ``||S(b_t)||^2``) |
| N5 | ``grad/*`` | the same per tensor; tensors below the sketch width are stored exactly, so exact |
| N6 | ``param/*`` with step 0 | ``update_sketch/*`` summed over steps 1..t, else ``param_sketch`` at t minus step 0 |

N5 reads the tensors of at least the table's ``[gates.N5] min_size`` elements (sizes from the record's tensor list).

Verdicts per gate and step, with ``tol``/``slack`` from the tolerance table:
- with ``--reference``: against the control ``m(cand, ctrl) <= max(tol, m(ctrl, ref))`` and against the reference
  ``m(cand, ref) <= max(tol, (1 + slack) m(ctrl, ref))``: the live control-to-reference distance of these records sets
  the bound (``tol`` is the table's rel when ``--tolerances`` is given or the records come from this repository's
  config of that name, else 0; the slack is always the table's);
- without it: ``m(cand, ctrl) <= tol`` when a table gives ``tol``, else the gate is n/a ("no bound");
- ``exact`` contract: against the control the arrays the gate reads must be bit-identical, decided by the per-tensor
  fingerprints (or the arrays themselves); a sketch cannot prove it.
A gate whose data a record lacks is ``n/a`` with the reason, never a pass; so is N1 / N3 on values imported from a
metrics log (``nxgates import-metrics``) whose logged digits cannot decide the bound (``metrics_log.precision_verdict``;
the digits are named in every such row). Exit codes: 0 every judged gate passes and N1
and N3 were judged at every step, 1 a judged gate fails, 2 bad input (``CompareInputError``/``RecordError``, named).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from nxgates.gates import atomic, metrics_log
from nxgates.gates import gates as gates_lib
from nxgates.gates import records as records_lib
from nxgates.gates import tolerances as tolerance_table
from nxgates.gates.diff import as_f64
from nxgates.gates.gates import GATE_NAMES, GATES, Metric
from nxgates.gates.records import RecordError, Run
from nxgates.gates.sketch import estimate_sq

REQUIRED = ("N1", "N3")  # a comparison that cannot judge these is refused
PASS, FAIL, NA = "pass", "fail", "n/a"


class CompareInputError(RecordError):
    """Records that cannot be compared (exit 2): the message names the records and what differs."""


class NotAvailable(Exception):
    """A gate the records cannot support; the message is the reason shown as n/a."""


# ------------------------------------------------------------------------------------------------------- alignment
def _label(run: Run, role: str) -> str:
    return f"{role} ({run.path})"


def check_comparable(runs: Mapping[str, Run]) -> None:
    """Refuse (``CompareInputError``) records that do not line up with the control: the step list, sketch kind /
    width / seed, config, batch, mask, the parameter tensors (names, shapes, dtypes) or the initial parameters."""
    control = runs["control"]
    for role, run in runs.items():
        if role == "control":
            continue
        a, b = _label(run, role), _label(control, "control")
        if run.step_numbers != control.step_numbers:
            raise CompareInputError(f"different step list: {a} has steps {run.step_numbers}, {b} has "
                                    f"{control.step_numbers}")
        if run.spec is not None and control.spec is not None and run.spec != control.spec:
            diff = [f"{k} {getattr(run.spec, k)!r} vs {getattr(control.spec, k)!r}" for k in ("kind", "width", "seed")
                    if getattr(run.spec, k) != getattr(control.spec, k)]
            raise CompareInputError(f"different sketch {', '.join(diff)}: {a} vs {b} (sketches are comparable only "
                                    "with the same kind, width and seed)")
        if run.meta.get("config") != control.meta.get("config"):
            keys = _diff_keys(run.meta.get("config"), control.meta.get("config"))
            raise CompareInputError(f"different config ({keys}): {a} vs {b}")
        if run.meta.get("batch") is not None and control.meta.get("batch") is not None and \
                run.meta.get("batch") != control.meta.get("batch"):
            raise CompareInputError(f"different batch ({_diff_keys(run.meta['batch'], control.meta['batch'])}): {a} vs"
                                    f" {b}")
        for n in control.step_numbers:
            ma, mb = run.steps[n].get("mask"), control.steps[n].get("mask")
            if ma is not None and mb is not None and (ma.shape != mb.shape or not np.array_equal(ma, mb)):
                raise CompareInputError(f"different mask at step {n}: {a} vs {b} (the gates compare log-probs of the "
                                        "same tokens)")
        ta, tb = run.tensors, control.tensors
        if ta and tb:
            if sorted(ta) != sorted(tb):
                only = sorted(set(ta) ^ set(tb))
                raise CompareInputError(f"different parameter tensors ({len(only)} not in both, e.g. {only[:3]}): {a} "
                                        f"vs {b}")
            for p in tb:
                for k in ("shape", "dtype"):
                    if ta[p].get(k) is not None and tb[p].get(k) is not None and ta[p][k] != tb[p][k]:
                        raise CompareInputError(f"different {k} of tensor {p!r}: {ta[p][k]} vs {tb[p][k]}: {a} vs {b}")
        if 0 in run.steps and 0 in control.steps:
            fa, fb = run.steps[0].group("param_fp"), control.steps[0].group("param_fp")
            if fa and fb and (sorted(fa) != sorted(fb) or any(not np.array_equal(fa[p], fb[p]) for p in fb)):
                raise CompareInputError(f"different initial parameters (step 0 fingerprints): {a} vs {b}")


def _diff_keys(x: Any, y: Any) -> str:
    if isinstance(x, dict) and isinstance(y, dict):
        keys = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
        shown = ", ".join(f"{k}={x.get(k)!r} vs {y.get(k)!r}" for k in keys[:3])
        return shown + (f", +{len(keys) - 3} more" if len(keys) > 3 else "")
    return f"{x!r} vs {y!r}"


# ---------------------------------------------------------------------------------------------------------- metrics
def _f64(x) -> float:
    return float(as_f64(x))


def _need(step: records_lib.Step, field: str, who: str) -> np.ndarray:
    v = step.get(field)
    if v is None:
        raise NotAvailable(f"no {field} in {who}")
    return v


def _common_group(sa, sb, group: str, who: tuple[str, str]) -> tuple[dict, dict]:
    ga, gb = sa.group(group), sb.group(group)
    if not ga or not gb:
        missing = who[0] if not ga else who[1]
        raise NotAvailable(f"no {group} in {missing}")
    if sorted(ga) != sorted(gb):
        raise NotAvailable(f"{group} tensors differ between {who[0]} and {who[1]}")
    return ga, gb


def _grad_norm2(step: records_lib.Step) -> tuple[float, str] | None:
    full = step.group("grad")
    if full:
        return sum(float(np.sum(as_f64(g) ** 2)) for g in full.values()), "exact"
    sq = step.group("grad_sq")
    if sq:
        return sum(_f64(v) for v in sq.values()), "per-tensor norms"
    if step.get("grad_norm") is not None:
        return _f64(step.get("grad_norm")) ** 2, "grad_norm"
    return None


def tensor_sizes(run: Run, step) -> dict[str, int]:
    """{tensor: elements}: from the record's tensor list (meta.json ``tensors``, each with its global shape), else
    from the full gradient arrays of ``step``; a tensor known neither way is left out (N5 then keeps it)."""
    sizes = {n: int(np.prod(t["shape"])) for n, t in run.tensors.items()
             if isinstance(t, Mapping) and isinstance(t.get("shape"), list)}
    for n, g in step.group("grad").items():
        sizes.setdefault(n, int(np.size(g)))
    return sizes


def metric(gate: str, a: Run, b: Run, step: int, who: tuple[str, str] = ("a", "b"), *,
           min_size: int = 1) -> tuple[Metric, str]:
    """(m_gate(a, b) at ``step`` (1-based), the data it came from: "exact", "sketch", ...); ``NotAvailable`` with the
    reason when the records lack what the gate reads. ``min_size``: N5's smallest tensor (``Tolerances.min_size``)."""
    sa, sb = a.steps[step], b.steps[step]
    if gate == "N1":
        return Metric(gates_lib.rel_scalar(_f64(_need(sa, "loss", who[0])), _f64(_need(sb, "loss", who[1])))), "exact"
    if gate == "N2":
        x, y = _need(sa, "log_probs", who[0]), _need(sb, "log_probs", who[1])
        m = np.asarray(_need(sb, "mask", who[1])) > 0
        x, y = as_f64(x)[m], as_f64(y)[m]
        return Metric(gates_lib.rel_from_squares(float(np.sum((x - y) ** 2)), float(np.sum(y**2)))), "exact"
    if gate == "N3":
        na, nb = _grad_norm2(sa), _grad_norm2(sb)
        if na is None or nb is None:
            raise NotAvailable(f"no gradient norm (grad_norm, grad_sq or grad) in {who[0] if na is None else who[1]}")
        src = na[1] if na[1] == nb[1] else f"{na[1]} / {nb[1]}"
        return Metric(gates_lib.rel_scalar(math.sqrt(na[0]), math.sqrt(nb[0]))), src
    if gate in ("N4", "N5"):
        per, src = _grad_pairs(sa, sb, who)
        if gate == "N5":
            return gates_lib.worst_tensor(per, tensor_sizes(b, sb), min_size), src
        return Metric(gates_lib.rel_from_squares(sum(v[0] for v in per.values()),
                                                 sum(v[1] for v in per.values()))), src
    if gate == "N6":
        num2, den2, src = _update_pairs(a, b, step, who)
        return Metric(gates_lib.rel_from_squares(num2, den2)), src
    raise ValueError(f"metric: gate={gate!r} is not one of {GATES}")


def _grad_pairs(sa, sb, who) -> tuple[dict[str, tuple[float, float]], str]:
    """{tensor: (||a - b||^2, ||b||^2)} from full gradients, else from sketches (with exact norms when recorded)."""
    fa, fb = sa.group("grad"), sb.group("grad")
    if fa and fb and sorted(fa) == sorted(fb):
        return {n: (float(np.sum((as_f64(fa[n]) - as_f64(fb[n])) ** 2)), float(np.sum(as_f64(fb[n]) ** 2)))
                for n in fb}, "exact"
    ka, kb = _common_group(sa, sb, "grad_sketch", who)
    sq = sb.group("grad_sq")
    per = {}
    for n in kb:
        if ka[n].shape != kb[n].shape:
            raise NotAvailable(f"grad_sketch/{n} has length {ka[n].shape} in {who[0]}, {kb[n].shape} in {who[1]}")
        den = _f64(sq[n]) if n in sq else float(np.sum(as_f64(kb[n]) ** 2))
        per[n] = (estimate_sq(ka[n], kb[n]), den)
    return per, "sketch"


def _update_pairs(a: Run, b: Run, step: int, who) -> tuple[float, float, str]:
    """(||u_a - u_b||^2, ||u_b||^2) of the parameter change since step 0, over every tensor."""
    sa, sb = a.steps[step], b.steps[step]
    fa, fb = sa.group("param"), sb.group("param")
    a0, b0 = a.steps.get(0), b.steps.get(0)
    if fa and fb and a0 is not None and b0 is not None and a0.group("param") and b0.group("param"):
        pa0, pb0 = a0.group("param"), b0.group("param")
        num = den = 0.0
        for n in fb:
            da, db = as_f64(fa[n]) - as_f64(pa0[n]), as_f64(fb[n]) - as_f64(pb0[n])
            num += float(np.sum((da - db) ** 2))
            den += float(np.sum(db**2))
        return num, den, "exact"
    steps = [s for s in a.step_numbers if s <= step]
    if all(a.steps[s].has_group("update_sketch") and b.steps[s].has_group("update_sketch") for s in steps):
        ua = _sum_groups([a.steps[s].group("update_sketch") for s in steps])
        ub = _sum_groups([b.steps[s].group("update_sketch") for s in steps])
        src = "sketch (updates)"
    elif a0 is not None and b0 is not None and sa.has_group("param_sketch") and sb.has_group("param_sketch") and \
            a0.has_group("param_sketch") and b0.has_group("param_sketch"):
        ua = _sum_groups([sa.group("param_sketch"), a0.group("param_sketch")], sign=(1.0, -1.0))
        ub = _sum_groups([sb.group("param_sketch"), b0.group("param_sketch")], sign=(1.0, -1.0))
        src = "sketch (parameters)"
    else:
        missing = [w for w, r in zip(who, (a, b), strict=True) if not all(r.steps[s].has_group("update_sketch")
                                                                           for s in steps)]
        raise NotAvailable(f"no update_sketch at every step up to {step}, nor param_sketch at steps 0 and {step}, "
                           f"in {' and '.join(missing) or who[0]}")
    if sorted(ua) != sorted(ub):
        raise NotAvailable(f"the update sketches of {who[0]} and {who[1]} cover different tensors")
    num = sum(estimate_sq(ua[n], ub[n]) for n in ub)
    den = sum(float(np.dot(ub[n], ub[n])) for n in ub)
    return num, den, src


def _sum_groups(groups: list[dict[str, np.ndarray]], sign=None) -> dict[str, np.ndarray]:
    sign = sign or (1.0,) * len(groups)
    out = {}
    for g, s in zip(groups, sign, strict=True):
        for n, v in g.items():
            out[n] = out.get(n, 0.0) + s * as_f64(v)
    return out


def bit_identical(gate: str, a: Run, b: Run, step: int, who=("a", "b")) -> bool:
    """Whether the arrays gate ``gate`` reads are bit-identical: the fingerprints (or arrays) of both records;
    ``NotAvailable`` when they hold neither (a sketch cannot prove bit identity)."""
    sa, sb = a.steps[step], b.steps[step]

    def same_arrays(x, y):
        return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()

    def same_group(full: str, fp: str) -> bool:
        ga, gb = sa.group(full), sb.group(full)
        if ga and gb:
            return sorted(ga) == sorted(gb) and all(same_arrays(ga[n], gb[n]) for n in gb)
        ka, kb = sa.group(fp), sb.group(fp)
        if not ka or not kb:
            raise NotAvailable(f"no {fp} (bit fingerprints) in {who[0] if not ka else who[1]}: the exact contract "
                               "cannot be decided from sketches")
        return sorted(ka) == sorted(kb) and all(np.array_equal(ka[n], kb[n]) for n in kb)

    if gate == "N1":
        return same_arrays(_need(sa, "loss", who[0]), _need(sb, "loss", who[1]))
    if gate == "N2":
        if sa.get("log_probs") is not None and sb.get("log_probs") is not None:
            return same_arrays(sa.get("log_probs"), sb.get("log_probs"))
        return np.array_equal(_need(sa, "log_probs_fp", who[0]), _need(sb, "log_probs_fp", who[1]))
    if gate == "N3":
        gn = [s.get("grad_norm") for s in (sa, sb)]
        same_norm = gn[0] is None or gn[1] is None or same_arrays(gn[0], gn[1])
        return same_norm and same_group("grad", "grad_fp")
    if gate in ("N4", "N5"):
        return same_group("grad", "grad_fp")
    if gate == "N6":
        return same_group("param", "param_fp")
    raise ValueError(f"bit_identical: gate={gate!r} is not one of {GATES}")


# ---------------------------------------------------------------------------------------------------- preconditions
def preconditions(runs: Mapping[str, Run]) -> list[str]:
    """Violations that fail every gate: a non-finite recorded value, a dropped token."""
    problems = []
    for role, run in runs.items():
        for n in run.step_numbers:
            st = run.steps[n]
            bad = [k for k, v in st.arrays.items()
                   if np.issubdtype(v.dtype, np.floating) and not np.all(np.isfinite(as_f64(v)))]
            if bad:
                more = f" (+{len(bad) - 3} more)" if len(bad) > 3 else ""
                problems.append(f"{role} step {n}: non-finite {', '.join(sorted(bad)[:3])}{more}")
            dropped = st.get("dropped_tokens")
            if dropped is not None and int(dropped) != 0:
                problems.append(f"{role} step {n}: {int(dropped)} dropped tokens")
    return problems


# ------------------------------------------------------------------------------------------------------------ gates
@dataclasses.dataclass(frozen=True)
class GateVerdict:
    """One gate at one step: the metrics (None where not computed), bounds, the verdict and why."""

    gate: str
    step: int
    verdict: str  # pass / fail / n/a
    reason: str
    vs_control: float | None
    vs_reference: float | None
    control_vs_reference: float | None
    bound_control: float | None
    bound_reference: float | None
    bit_identical: bool | None
    worst_tensor: str | None
    source: str | None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class CompareReport:
    paths: dict[str, str]
    contract: str
    tolerances: str | None
    bounds: str
    results: list[GateVerdict]
    problems: list[str]

    @property
    def judged(self) -> list[str]:
        """Gates judged at every step."""
        return [g for g in GATES if all(r.verdict != NA for r in self.results if r.gate == g)]

    @property
    def not_judged(self) -> dict[str, str]:
        out = {}
        for r in self.results:
            if r.verdict == NA and r.gate not in out:
                out[r.gate] = f"step {r.step}: {r.reason}"
        return out

    @property
    def failed(self) -> list[GateVerdict]:
        return [r for r in self.results if r.verdict == FAIL]

    @property
    def exit_code(self) -> int:
        if any(g not in self.judged for g in REQUIRED):
            return 2  # insufficient records: no verdict, whatever else failed
        return 1 if self.failed or self.problems else 0

    def summary(self) -> list[str]:
        lines = [f"judged: {', '.join(self.judged) or 'none'}"]
        for g, why in self.not_judged.items():
            lines.append(f"n/a {g} ({GATE_NAMES[g]}): {why}")
        missing = [g for g in REQUIRED if g not in self.judged]
        if missing:
            lines.append(f"refused: {', '.join(missing)} must be judged at every step (the records lack their data)")
        for p in self.problems:
            lines.append(f"precondition failed: {p}")
        if self.failed:
            first = self.failed[0]
            lines.append(f"FAIL: {len(self.failed)} gate-step(s), first {first.gate} step {first.step}: {first.reason}")
        elif not missing and not self.problems:
            lines.append("PASS: every judged gate passes at every step")
        return lines

    def table(self) -> str:
        from tabulate import tabulate

        def f(x):
            return "-" if x is None else f"{x:.3e}"

        rows = [[r.gate, GATE_NAMES[r.gate], r.step, r.verdict, f(r.vs_control), f(r.bound_control),
                 f(r.vs_reference), f(r.bound_reference), f(r.control_vs_reference), r.source or "-",
                 r.worst_tensor or "", r.reason] for r in self.results]
        head = [f"contract {self.contract}; bounds: {self.bounds}",
                *(f"{k}: {v}" for k, v in self.paths.items())]
        body = tabulate(rows, headers=["gate", "what", "step", "verdict", "vs ctrl", "bound", "vs ref", "bound",
                                       "ctrl vs ref", "from", "worst tensor", "why"], tablefmt="simple",
                        disable_numparse=True)
        return "\n".join([*head, "", body, "", *self.summary()])

    def to_json(self) -> dict:
        return {"paths": self.paths, "contract": self.contract, "tolerances": self.tolerances, "bounds": self.bounds,
                "exit_code": self.exit_code, "judged": self.judged, "not_judged": self.not_judged,
                "problems": self.problems, "summary": self.summary(),
                "results": [r.as_dict() for r in self.results]}

    def write(self, out_dir: str | pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
        out = pathlib.Path(out_dir)
        j = atomic.write_json_atomic(out / "compare.json", self.to_json())
        m = atomic.write_text_atomic(out / "compare.md", "```\n" + self.table() + "\n```\n")
        return j, m


def _tolerance(tolerances, gate: str, step: int) -> float | None:
    return None if tolerances is None else tolerances.tol_at(gate, step)


def compare(control: Run, candidate: Run, reference: Run | None = None, *, contract: str = "rounding",
            tolerances: tolerance_table.Tolerances | None = None,
            slack: Mapping[str, float] | None = None) -> CompareReport:
    """The six gates at every step of the records. ``tolerances``: the table whose rel values bound the candidate
    (None: only live bounds from ``reference``, or n/a); ``slack`` per gate (default: ``tolerances``'s, else the
    repository table's). Raises ``CompareInputError`` for records that do not line up."""
    if contract not in gates_lib.CONTRACTS:
        raise CompareInputError(f"contract={contract!r} must be one of {gates_lib.CONTRACTS}")
    runs = {"control": control, "candidate": candidate}
    if reference is not None:
        runs["reference"] = reference
    check_comparable(runs)
    table = tolerances or tolerance_table.load_tolerances()
    if slack is None:
        slack = dict(table.slack)
    min_size = dict(table.min_size)
    problems = preconditions(runs)
    results = []
    for n in control.step_numbers:
        for gate in GATES:
            results.append(_judge(gate, n, control, candidate, reference, contract, tolerances, slack, problems,
                                  min_size.get(gate, 1)))
    if reference is not None:
        bounds = ("live: against the control max(rel, m(control, reference)), against the reference max(rel, (1 + "
                  "slack) m(control, reference)); rel " + ("from " + tolerances.path if tolerances else "0"))
    else:
        bounds = ("against the control only, rel from " + tolerances.path) if tolerances else \
            "none (no --reference, no --tolerances): only the exact contract can be judged"
    return CompareReport(paths={k: v.path for k, v in runs.items()}, contract=contract,
                         tolerances=tolerances.path if tolerances else None, bounds=bounds, results=results,
                         problems=problems)


def _judge(gate, n, control, candidate, reference, contract, tolerances, slack, problems, min_size=1) -> GateVerdict:
    def na(reason, **kw):
        base = dict(vs_control=None, vs_reference=None, control_vs_reference=None, bound_control=None,
                    bound_reference=None, bit_identical=None, worst_tensor=None, source=None)
        base.update(kw)
        return GateVerdict(gate, n, NA, reason, **base)

    try:
        vc, src = metric(gate, candidate, control, n, ("candidate", "control"), min_size=min_size)
    except NotAvailable as e:
        return na(str(e))
    tol = _tolerance(tolerances, gate, n)
    ident = None
    vr = cr = bound_r = None
    if reference is not None:
        try:
            vr = metric(gate, candidate, reference, n, ("candidate", "reference"), min_size=min_size)[0].value
            cr = metric(gate, control, reference, n, ("control", "reference"), min_size=min_size)[0].value
        except NotAvailable as e:
            return na(f"against the reference: {e}", vs_control=vc.value, source=src)
        floor = tol if tol is not None else 0.0
        bound_r = gates_lib.reference_bound(floor, slack[gate], cr)
    if contract == "exact":
        try:
            ident = bit_identical(gate, candidate, control, n, ("candidate", "control"))
        except NotAvailable as e:
            return na(str(e), vs_control=vc.value, source=src)
        bound_c = 0.0
        ok_c = bool(ident) and vc.value == 0.0
    elif reference is not None:
        bound_c = max(tol if tol is not None else 0.0, cr)
        ok_c = vc.value <= bound_c
    elif tol is not None:
        bound_c = tol
        ok_c = vc.value <= bound_c
    else:
        return na("no bound: neither --reference (live bound) nor --tolerances (rel) given", vs_control=vc.value,
                  source=src, worst_tensor=vc.worst_tensor)
    ok_r = True if reference is None else vr <= bound_r
    floor = tol if tol is not None else 0.0
    decidable, note = metrics_log.precision_verdict(
        gate, n, candidate, control, reference, source=src, contract=contract, vs_control=vc.value, vs_reference=vr,
        control_vs_reference=cr, bounds_at=lambda c: (bound_c, None) if reference is None else
        (max(floor, c), gates_lib.reference_bound(floor, slack[gate], c)))
    if not decidable:  # values imported from a metrics log, too coarse to decide this gate (gates/metrics_log.py)
        return na(note, vs_control=vc.value, vs_reference=vr, control_vs_reference=cr, bound_control=bound_c,
                  bound_reference=bound_r, source=src)
    if problems:
        verdict, reason = FAIL, "precondition failed"
    elif ok_c and ok_r:
        verdict, reason = PASS, ""
    else:
        why = []
        if contract == "exact" and not ident:
            why.append("not bit-identical to the control")
        elif not ok_c:
            why.append(f"vs control {vc.value:.3e} > {bound_c:.3e}")
        if not ok_r:
            why.append(f"vs reference {vr:.3e} > {bound_r:.3e}")
        verdict, reason = FAIL, "; ".join(why)
    reason = "; ".join(x for x in (reason, note, vc.note) if x)
    return GateVerdict(gate, n, verdict, reason, vc.value, vr, cr, bound_c, bound_r, ident, vc.worst_tensor, src)


# ---------------------------------------------------------------------------------------------------------------- CLI
def default_tolerances_for(control: Run):
    """The repository's table when the records come from this repository's protocol on a config it ships (the table
    was calibrated there), else None."""
    from nxgates import fixtures

    if control.meta.get("trainer") != "nxgates":
        return None
    name = (control.meta.get("extra") or {}).get("config_name")
    if not name or not (pathlib.Path(fixtures.CONFIGS) / f"{name}.toml").is_file():
        return None
    return tolerance_table.load_tolerances()


def main(args) -> int:
    """``nxgates compare`` (args from gates.cli): prints the table (or JSON), writes --out; returns the exit code."""
    import sys

    try:
        control = records_lib.load_run(args.control)
        candidate = records_lib.load_run(args.candidate)
        reference = records_lib.load_run(args.reference) if args.reference else None
        if args.tolerances:
            try:
                tolerances = tolerance_table.load_tolerances(args.tolerances)
            except ValueError as e:
                raise CompareInputError(f"--tolerances: {e}") from e
        else:
            tolerances = default_tolerances_for(control)
        report = compare(control, candidate, reference, contract=args.contract, tolerances=tolerances)
    except RecordError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.out:
        report.write(args.out)
    if args.json:
        print(json.dumps(report.to_json(), indent=2, default=str))
    else:
        print(report.table())
    return report.exit_code
