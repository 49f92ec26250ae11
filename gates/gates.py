"""The six gates N1..N6 (docs/design.md, "The six gates").

Every gate compares two run records at each step with a float64 metric (``gates.diff.rel_l2`` and friends):

| gate | metric per step |
| N1 | ``|L_a - L_b| / |L_b|`` (loss) |
| N2 | ``rel_l2`` of the per-token log-probs over the completion mask |
| N3 | ``|norm(g_a) - norm(g_b)| / norm(g_b)`` (gradient global norm, float64 from the recorded gradient) |
| N4 | ``rel_l2`` of the whole flattened gradient |
| N5 | max over parameter tensors of at least ``min_size`` elements of the tensor's gradient ``rel_l2`` (named) |
| N6 | ``rel_l2`` of the parameter change since step 0 |

Bounds that travel: both bounds of a ``rounding`` gate come from this run's own live control-to-reference distance
``c = m(control, reference)`` at that step, not from a constant measured on another machine. A gate passes at a step
when
- against the control: ``m(candidate, control) <= max(floor, c)`` (a flag that changes the numbers "by bf16
  rounding" must move them less than the whole bf16 path's own error does); ``exact`` contract: the arrays it reads
  are bit-identical instead;
- against the reference pair: ``m(candidate, reference) <= max(floor, (1 + slack) * c)``,
with ``floor`` and ``slack`` the gate's own (``[gates.N4] floor``, ``[gates.N4] slack``).
N5 reads only the tensors of at least ``[gates.N5] min_size`` elements (default 1, every tensor): the relative
distance of a small tensor (a per-head decay vector, a norm's scale) is one draw of a ratio whose spread across
batches grows as 1 / sqrt(elements), wider than any slack a large tensor needs (docs/lens.md, "False alarms"); such
tensors stay in N3, N4 and N6. ``[gates.N4] live_range`` is the calibrated range of ``c``: a live ``c`` outside
it is reported (``GateResult.environment``, with the numbers) as an environment change (another CPU, another
XLA), not a failure by itself.
Preconditions (every value finite in all three records, no dropped token) fail every gate when violated.
Tolerances come from ``fixtures/tolerances.toml`` ``[gates.*]`` (each gate: floor, slack, live_range, reason, source;
calibrated by ``python -m nxgates calibrate``), read by ``gates.tolerances.load_tolerances``; the float32 lens reads
``[lens.*]`` the same way; nothing relaxes them at run time.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from nxgates.gates.diff import as_f64
from nxgates.gates.record import RunRecord
from nxgates.gates.tolerances import GATES, Tolerances

GATE_NAMES = {
    "N1": "loss",
    "N2": "log-probs",
    "N3": "gradient norm",
    "N4": "gradient",
    "N5": "worst tensor",
    "N6": "update",
}
CONTRACTS = ("exact", "rounding")


def slack_text(tolerances: Tolerances) -> str:
    """``N1 0.1, N2 0.1, ...``: the per-gate slack, for report headers."""
    return ", ".join(f"{g} {tolerances.slack[g]:g}" for g in GATES)


# ------------------------------------------------------------------------------------------------------- metrics
def _norm2(arrays) -> float:
    return float(sum(float(np.sum(as_f64(a) ** 2)) for a in arrays))


def _rel(num2: float, den2: float) -> float:
    if den2 == 0.0:
        return 0.0 if num2 == 0.0 else math.inf
    return math.sqrt(num2) / math.sqrt(den2)


def _finite_or_inf(x: float) -> float:
    return x if math.isfinite(x) else math.inf


# The gate formulas, shared by the gates on run records (``metric``) and on sketched records (``gates.compare``).
def rel_scalar(a: float, b: float) -> float:
    """N1, N3: ``|a - b| / |b|`` (0 when both are 0, inf when only ``b`` is, or for a non-finite value)."""
    if b == 0.0:
        return 0.0 if a == 0.0 else math.inf
    return _finite_or_inf(abs(a - b) / abs(b))


def rel_from_squares(num2: float, den2: float) -> float:
    """N2, N4, N6: ``sqrt(num2) / sqrt(den2)`` from a squared distance and a squared norm (inf when not finite)."""
    return _finite_or_inf(_rel(num2, den2))


def worst_tensor(per_tensor: Mapping[str, tuple[float, float]], sizes: Mapping[str, int] | None = None,
                 min_size: int = 1) -> Metric:
    """N5: the largest per-tensor ``rel_from_squares(num2, den2)`` and the tensor's name (names in sorted order),
    over the tensors of at least ``min_size`` elements (``sizes[name]``; a tensor of unknown size is kept). A model
    with no tensor that large is judged on every tensor, and the metric's ``note`` says so (never a vacuous pass)."""
    if min_size > 1 and sizes is None:
        raise ValueError(f"worst_tensor: min_size={min_size} needs the tensors' sizes")
    names, note = sorted(per_tensor), ""
    if min_size > 1:
        large = [n for n in names if sizes.get(n, min_size) >= min_size]
        if large or not names:
            names = large
        else:
            note = (f"no tensor has >= {min_size} elements (min_size; the largest has "
                    f"{max(sizes.get(n, 0) for n in names)}): N5 read every tensor")
    worst, worst_name = -1.0, None
    for n in names:
        r = rel_from_squares(*per_tensor[n])
        if r > worst:
            worst, worst_name = r, n
    return Metric(max(worst, 0.0), worst_name, note)


def reference_bound(tol: float, slack: float, control_vs_reference: float) -> float:
    """The bound on ``m(candidate, reference)``: ``max(tol, (1 + slack) * m(control, reference))``."""
    return max(tol, (1.0 + slack) * control_vs_reference)


def control_bound(floor: float, control_vs_reference: float) -> float:
    """The bound of a rounding gate on ``m(candidate, control)``: ``max(floor, m(control, reference))``."""
    return max(floor, control_vs_reference)


def environment_note(gate: str, step: int, control_vs_reference: float, live_range) -> str:
    """"" when the live ``m(control, reference)`` lies in the calibrated ``live_range`` (or there is none), else the
    environment change with the numbers."""
    if live_range is None:
        return ""
    lo, hi = live_range
    if lo <= control_vs_reference <= hi:
        return ""
    return (f"{gate} step {step}: live m(control, reference) = {control_vs_reference:.4e} outside the calibrated range "
            f"[{lo:.4e}, {hi:.4e}] (environment change; the bounds follow the live value)")


@dataclasses.dataclass(frozen=True)
class Metric:
    value: float
    worst_tensor: str | None = None  # N5: the tensor with the largest rel L2
    note: str = ""  # N5: how min_size was applied, when not as the table says


def metric(gate: str, a: RunRecord, b: RunRecord, step: int, *, min_size: int = 1) -> Metric:
    """m_gate(a, b) at ``step`` (0-based), float64; non-finite inputs give inf. ``min_size``: N5's smallest tensor
    (``Tolerances.min_size``; the other gates ignore it)."""
    sa, sb = a.steps[step], b.steps[step]
    if gate == "N1":
        return Metric(rel_scalar(float(as_f64(sa.loss)), float(as_f64(sb.loss))))
    if gate == "N2":
        m = np.asarray(a.mask) > 0
        x, y = as_f64(sa.logp)[m], as_f64(sb.logp)[m]
        return Metric(rel_from_squares(float(np.sum((x - y) ** 2)), float(np.sum(y**2))))
    if gate in ("N3", "N4", "N5"):
        return _from_grad_sums(gate, _grad_sums(sa, sb), min_size)
    if gate == "N6":
        names = sorted(sb.grads)
        da = [as_f64(sa.params[n]) - as_f64(a.params0[n]) for n in names]
        db = [as_f64(sb.params[n]) - as_f64(b.params0[n]) for n in names]
        return Metric(rel_from_squares(_norm2(x - y for x, y in zip(da, db, strict=True)), _norm2(db)))
    raise ValueError(f"metric: gate={gate!r} is not one of {GATES}")


def metrics(a: RunRecord, b: RunRecord, step: int, *, min_size: int = 1) -> dict[str, Metric]:
    """Every gate's ``metric(gate, a, b, step)``, the same numbers to the bit, with N3, N4 and N5 read from one pass
    over the two gradients (``metric`` per gate would convert each tensor to float64 once per gate)."""
    sums = _grad_sums(a.steps[step], b.steps[step])
    return {g: (_from_grad_sums(g, sums, min_size) if g in ("N3", "N4", "N5")
                else metric(g, a, b, step, min_size=min_size)) for g in GATES}


def _grad_sums(sa, sb) -> dict[str, tuple[float, float, float, int]]:
    """Per tensor of ``sb`` in sorted order: (||a - b||^2, ||a||^2, ||b||^2, elements), float64."""
    out = {}
    for n in sorted(sb.grads):
        ga, gb = as_f64(sa.grads[n]), as_f64(sb.grads[n])
        out[n] = (float(np.sum((ga - gb) ** 2)), float(np.sum(ga**2)), float(np.sum(gb**2)), int(gb.size))
    return out


def _from_grad_sums(gate: str, sums: Mapping[str, tuple[float, float, float, int]], min_size: int) -> Metric:
    """N3 (the global norms), N4 (the whole gradient) or N5 (the worst tensor) from ``_grad_sums``; sums in tensor
    order, as the gates have always added them."""
    if gate == "N3":
        return Metric(rel_scalar(math.sqrt(sum(v[1] for v in sums.values())),
                                 math.sqrt(sum(v[2] for v in sums.values()))))
    if gate == "N4":
        return Metric(rel_from_squares(sum(v[0] for v in sums.values()), sum(v[2] for v in sums.values())))
    return worst_tensor({n: (v[0], v[2]) for n, v in sums.items()}, {n: v[3] for n, v in sums.items()}, min_size)


def _bits_equal(x, y) -> bool:
    x, y = np.asarray(x), np.asarray(y)
    return x.shape == y.shape and x.dtype == y.dtype and x.tobytes() == y.tobytes()


def bit_identical(gate: str, a: RunRecord, b: RunRecord, step: int) -> bool:
    """Whether every array gate ``gate`` reads at ``step`` is bit-identical between ``a`` and ``b``."""
    sa, sb = a.steps[step], b.steps[step]
    if gate == "N1":
        return _bits_equal(sa.loss, sb.loss)
    if gate == "N2":
        return _bits_equal(sa.logp, sb.logp)
    if gate == "N3":
        return _bits_equal(sa.grad_norm, sb.grad_norm) and all(_bits_equal(sa.grads[n], sb.grads[n]) for n in sb.grads)
    if gate in ("N4", "N5"):
        return set(sa.grads) == set(sb.grads) and all(_bits_equal(sa.grads[n], sb.grads[n]) for n in sb.grads)
    if gate == "N6":
        return set(sa.params) == set(sb.params) and all(_bits_equal(sa.params[n], sb.params[n]) for n in sb.params)
    raise ValueError(f"bit_identical: gate={gate!r} is not one of {GATES}")


# -------------------------------------------------------------------------------------------------------- preconditions
def _all_finite(x) -> bool:
    """Every value finite: float32 / float64 arrays tested as they are, any other dtype (bf16, fp8) in float64."""
    x = np.asarray(x)
    return bool(np.all(np.isfinite(x if x.dtype in (np.float32, np.float64) else as_f64(x))))


def _own_problems(rec: RunRecord) -> list[str]:
    """One record's own violations (a non-finite value, a dropped token), each naming the record as ``{label}``."""
    problems = []
    for i, s in enumerate(rec.steps):
        bad = []
        if not _all_finite(s.loss):
            bad.append("loss")
        if not _all_finite(s.grad_norm):
            bad.append("grad_norm")
        if not _all_finite(s.logp):
            bad.append("logp")
        bad += [f"grads/{n}" for n, g in s.grads.items() if not _all_finite(g)]
        bad += [f"params/{n}" for n, p in s.params.items() if not _all_finite(p)]
        if bad:
            more = f" (+{len(bad) - 3} more)" if len(bad) > 3 else ""
            problems.append(f"{{label}} step {i + 1}: non-finite {', '.join(bad[:3])}{more}")
        if s.dropped_tokens != 0:
            problems.append(f"{{label}} step {i + 1}: {s.dropped_tokens} dropped tokens")
    return problems


def _alignment(a: RunRecord, b: RunRecord) -> tuple[list[str], bool]:
    """(how ``b`` fails to line up with ``a``, naming them ``{a}`` and ``{b}``; whether the gates can read the pair:
    the same steps, tensors and mask)."""
    problems, aligned = [], True
    if b.num_steps != a.num_steps:
        problems.append(f"{{b}} has {b.num_steps} steps, {{a}} has {a.num_steps}")
        aligned = False
    if set(b.params0) != set(a.params0):
        problems.append("{b} and {a} have different parameter tensors")
        aligned = False
    elif not all(_bits_equal(b.params0[n], a.params0[n]) for n in a.params0):
        problems.append("{b} and {a} start from different initial parameters")
    if not _bits_equal(b.mask, a.mask):
        problems.append("{b} and {a} use different completion masks")
        aligned = False
    return problems, aligned


def _named(templates, **labels) -> list[str]:
    out = []
    for t in templates:
        for k, v in labels.items():
            t = t.replace("{" + k + "}", v)
        out.append(t)
    return out


def preconditions(records: Mapping[str, RunRecord]) -> list[str]:
    """Violations (empty when fine): a non-finite value anywhere, a dropped token, records that do not line up (each
    against the first)."""
    problems = [p for label, rec in records.items() for p in _named(_own_problems(rec), label=label)]
    (l0, r0), *rest = list(records.items())
    for label, rec in rest:
        problems += _named(_alignment(r0, rec)[0], a=l0, b=label)
    return problems


# ----------------------------------------------------------------------------------------------------- pair digests
@dataclasses.dataclass(frozen=True)
class StepDigest:
    """What the gates read of two records at one step: N1, N2 and N6 (``scalar``), the per-tensor gradient sums that
    N3, N4 and N5 are formed from (``_grad_sums``: ||a - b||^2, ||a||^2, ||b||^2, elements), and per gate whether
    the arrays it reads are bit-identical."""

    scalar: dict[str, float]
    grad_sums: dict[str, tuple[float, float, float, int]]
    identical: dict[str, bool]


@dataclasses.dataclass(frozen=True)
class PairDigest:
    """Everything ``evaluate`` reads of a pair of records (a, b), a few kilobytes instead of two records: a cached
    candidate is kept as its digests against the control and the reference (``gates.candidates``). The gates formed
    from it are the same numbers, to the bit, as from the records: the same sums, in the same order.

    ``own``: each record's own violations (``{label}`` for its name); ``alignment``: how b fails to line up with a
    (``{a}``, ``{b}``); ``steps``: one ``StepDigest`` per step, empty when the records do not line up (``aligned``
    False); ``num_steps``: a's."""

    num_steps: int
    own: tuple[tuple[str, ...], tuple[str, ...]]
    alignment: tuple[str, ...]
    aligned: bool
    steps: tuple[StepDigest, ...]

    def metrics(self, step: int, *, min_size: int = 1) -> dict[str, Metric]:
        """``metrics(a, b, step, min_size=...)`` of the records this digest was taken from."""
        d = self.steps[step]
        return {g: (_from_grad_sums(g, d.grad_sums, min_size) if g in ("N3", "N4", "N5") else Metric(d.scalar[g]))
                for g in GATES}

    def to_json(self) -> dict:
        return {"num_steps": self.num_steps, "own": [list(x) for x in self.own], "alignment": list(self.alignment),
                "aligned": self.aligned,
                "steps": [{"scalar": d.scalar, "grad_sums": {n: list(v) for n, v in d.grad_sums.items()},
                           "identical": d.identical} for d in self.steps]}

    @classmethod
    def from_json(cls, obj: Mapping) -> PairDigest:
        """The digest ``to_json`` wrote (floats round-trip exactly through JSON); ValueError on anything else."""
        try:
            steps = tuple(StepDigest(scalar={g: float(obj_s["scalar"][g]) for g in ("N1", "N2", "N6")},
                                     grad_sums={str(n): (float(v[0]), float(v[1]), float(v[2]), int(v[3]))
                                                for n, v in obj_s["grad_sums"].items()},
                                     identical={g: bool(obj_s["identical"][g]) for g in GATES})
                          for obj_s in obj["steps"])
            own = obj["own"]
            return cls(num_steps=int(obj["num_steps"]), own=(tuple(map(str, own[0])), tuple(map(str, own[1]))),
                       alignment=tuple(map(str, obj["alignment"])), aligned=bool(obj["aligned"]), steps=steps)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise ValueError(f"pair digest: malformed ({type(e).__name__}: {e})") from None


def pair_digest(a: RunRecord, b: RunRecord) -> PairDigest:
    """The ``PairDigest`` of records ``a`` and ``b`` (N5 at every ``min_size``: the per-tensor sums are kept)."""
    alignment, aligned = _alignment(a, b)
    steps = []
    if aligned:
        for i in range(a.num_steps):
            steps.append(StepDigest(scalar={g: metric(g, a, b, i).value for g in ("N1", "N2", "N6")},
                                    grad_sums=_grad_sums(a.steps[i], b.steps[i]),
                                    identical={g: bit_identical(g, a, b, i) for g in GATES}))
    return PairDigest(num_steps=a.num_steps, own=(tuple(_own_problems(a)), tuple(_own_problems(b))),
                      alignment=tuple(alignment), aligned=aligned, steps=tuple(steps))


# ---------------------------------------------------------------------------------------------------------------- gates
@dataclasses.dataclass(frozen=True)
class GateResult:
    """One gate at one step (1-based ``step``)."""

    gate: str
    step: int
    vs_control: float
    vs_reference: float
    control_vs_reference: float
    bound_control: float
    bound_reference: float
    bit_identical: bool | None  # exact contract only
    passed_control: bool
    passed_reference: bool
    worst_tensor: str | None
    note: str = ""
    environment: str = ""  # the live m(control, reference) outside the calibrated live_range (not a failure)

    @property
    def passed(self) -> bool:
        return self.passed_control and self.passed_reference

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["passed"] = self.passed
        return d


def evaluate(
    candidate: RunRecord, control: RunRecord, reference: RunRecord, contract: str, tolerances: Tolerances
) -> tuple[list[GateResult], list[str]]:
    """Every gate at every step; returns (results, precondition violations). A violation fails every result."""
    if contract not in CONTRACTS:
        raise ValueError(f"evaluate: contract={contract!r} must be one of {CONTRACTS}")
    return evaluate_digests(pair_digest(candidate, control), pair_digest(candidate, reference),
                            pair_digest(control, reference), contract, tolerances)


def evaluate_digests(
    candidate_control: PairDigest, candidate_reference: PairDigest, control_reference: PairDigest, contract: str,
    tolerances: Tolerances,
) -> tuple[list[GateResult], list[str]]:
    """``evaluate`` from the three pairs' digests (``pair_digest(candidate, control)``, ``(candidate, reference)``,
    ``(control, reference)``): the same results and violations, in the same order."""
    if contract not in CONTRACTS:
        raise ValueError(f"evaluate: contract={contract!r} must be one of {CONTRACTS}")
    cc, cr, kr = candidate_control, candidate_reference, control_reference
    problems = (_named(cc.own[0], label="candidate") + _named(cc.own[1], label="control")
                + _named(cr.own[1], label="reference") + _named(cc.alignment, a="candidate", b="control")
                + _named(cr.alignment, a="candidate", b="reference"))
    shape_ok = cc.aligned and cr.aligned and kr.aligned
    results = []
    min_size = tolerances.min_size.get("N5", 1)
    for i in range(kr.num_steps):
        if shape_ok:  # each pair's six metrics at this step
            m_cc = cc.metrics(i, min_size=min_size)
            m_cr = cr.metrics(i, min_size=min_size)
            m_kr = kr.metrics(i, min_size=min_size)
        for gate in GATES:
            tol = tolerances.tol_at(gate, i + 1)  # the floor
            if not shape_ok:
                results.append(GateResult(gate, i + 1, math.inf, math.inf, math.inf, tol, tol, None, False, False, None,
                                          "records do not line up"))
                continue
            vc = m_cc[gate]
            vr = m_cr[gate].value
            cr_value = m_kr[gate].value
            bound_ref = reference_bound(tol, tolerances.slack[gate], cr_value)
            ident = None
            if contract == "exact":
                ident = cc.steps[i].identical[gate]
                ok_c = ident and vc.value == 0.0
                bound_c = 0.0
            else:
                bound_c = control_bound(tol, cr_value)
                ok_c = vc.value <= bound_c
            ok_r = vr <= bound_ref
            note = ""
            if problems:
                ok_c = ok_r = False
                note = "precondition failed"
            elif contract == "exact" and not ident:
                note = "not bit-identical"
            note = "; ".join(x for x in (note, vc.note) if x)
            env = environment_note(gate, i + 1, cr_value, tolerances.live_range_at(gate, i + 1))
            results.append(GateResult(gate, i + 1, vc.value, vr, cr_value, bound_c, bound_ref, ident, bool(ok_c),
                                      bool(ok_r), vc.worst_tensor, note, env))
    return results, problems
