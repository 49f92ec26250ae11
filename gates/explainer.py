"""Explain a check: the first op and layer where the candidate leaves the control (``python -m nxgates explain``).

``explain(config, flags, candidate_context=None)`` runs step 1 of the protocol (the same parameters, batch and loss)
three times with the model's taps on (``model/taps.py``): the control, the float32 reference and the candidate, the
reference and the candidate replaying the control's routing (as ``gates.protocol`` does). A tap is one op's output in
the forward, or one of its input cotangents in the backward, on every device and every layer. Per tap (float64):

- ``vs control`` = rel_l2(candidate, control), ``vs reference`` = rel_l2(candidate, reference);
- the bound, derived like the gates' reference bound with the control's own distance to the reference at that tap:
  ``max(floor, (1 + slack) * rel_l2(control, reference))`` (``[explain]`` in fixtures/tolerances.toml);
- over: an ``exact`` check's tap is over when it is not bit-identical to the control's; a ``rounding`` check's when
  either distance exceeds the bound.

Execution order: the forward taps (embedding, then every layer in order, then the head and the loss), then the backward
taps in reverse (the head, the layers from last to first, the embedding). The first tap over its bound is the answer,
one line (``layer 2 (gdn), gdn_cp_fold, forward M: rel 3.1e-1, bound 4.2e-3``), then the table of every tap.
``candidate_context`` is entered around the candidate's trace (the mutants' ``model.ops.override``);
``candidate_loss_fn`` replaces its loss (the loss mutant).

Run: ``python -m nxgates explain --flags k=v ... [--config tiny]``, ``--mutant NAME`` (a mutant of gates.mutants),
``--mutants`` (every mutant: the op it injected into beside the op named). ``gates.explain`` is this module's
``explain``. Tests: tests/gates/test_explain.py (synthetic taps), tests/model/test_taps.py (the model's taps).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable

import numpy as np

from nxgates.gates import protocol
from nxgates.gates.errors import BadInput
from nxgates.gates.tolerances import DEFAULT_TOLERANCES, read_table

DIRECTIONS = ("forward", "backward")


@dataclasses.dataclass(frozen=True)
class Bounds:
    slack: float
    floor: float
    source: str

    @classmethod
    def for_run(cls, path) -> Bounds:
        """The ``[explain]`` entry of the run's tolerance table, or of the repository's when that table has none."""
        if path and "explain" in read_table(path):
            return cls.load(path)
        return cls.load()

    @classmethod
    def load(cls, path=DEFAULT_TOLERANCES) -> Bounds:
        table = read_table(path)
        entry = table.get("explain")
        if not isinstance(entry, dict) or "slack" not in entry or "floor" not in entry:
            raise ValueError(f"tolerances: [explain] needs slack and floor in {path}")
        slack, floor = float(entry["slack"]), float(entry["floor"])
        if not (math.isfinite(slack) and slack >= 0 and math.isfinite(floor) and floor > 0):
            raise ValueError(f"tolerances: [explain] slack={slack!r} must be >= 0 and floor={floor!r} > 0")
        return cls(slack, floor, str(path))


@dataclasses.dataclass(frozen=True)
class TapRow:
    """One tap part: where it is, the three distances, its bound and verdict."""

    order: int
    direction: str
    layer: int | None  # None: the embedding or the head
    where: str  # "layer 2 (gdn)", "embed", "head"
    op: str
    label: str
    part: str
    vs_control: float
    vs_reference: float
    control_vs_reference: float
    bound_control: float  # exact: 0 (bit-identity); rounding: max(floor, control vs reference)
    bound: float  # against the reference: max(floor, (1 + slack) x control vs reference)
    identical: bool
    over: bool

    @property
    def ratio(self) -> float:
        """The larger of each distance over its bound (for the heatmap; an exact check's differing tap: inf)."""
        if self.bound_control == 0.0:
            against_control = 0.0 if self.identical else math.inf
        else:
            against_control = self.vs_control / self.bound_control
        return max(against_control, self.vs_reference / self.bound)

    @property
    def name(self) -> str:
        op = f"{self.op}[{self.label}]" if self.label else self.op
        part = "" if self.part == "out" else (f" d({self.part})" if self.direction == "backward" else f" {self.part}")
        return f"{op}, {self.direction}{part}"

    def line(self) -> str:
        if self.bound_control == 0.0 and not self.identical:
            return (f"{self.where}, {self.name}: rel {self.vs_control:.1e} vs control, bound 0 (exact: not "
                    "bit-identical)")
        if self.vs_control > self.bound_control:
            return f"{self.where}, {self.name}: rel {self.vs_control:.1e} vs control, bound {self.bound_control:.1e}"
        return f"{self.where}, {self.name}: rel {self.vs_reference:.1e} vs reference, bound {self.bound:.1e}"


@dataclasses.dataclass
class Explanation:
    check: str
    config: str
    contract: str
    candidate_flags: dict
    bounds: Bounds
    rows: list[TapRow]
    wall_s: float
    run_s: dict  # label -> seconds (trace + compile + step 1)
    precision: str = "production"  # "lens": the float32 lens's control and candidate against the reference

    @property
    def first(self) -> TapRow | None:
        return next((r for r in self.rows if r.over), None)

    def line(self) -> str:
        first = self.first
        if first is None:
            return f"no tap over its bound ({len(self.rows)} taps, step 1)"
        return first.line()

    def table(self) -> str:
        from tabulate import tabulate

        rows = [[r.order, r.where, r.op + (f"[{r.label}]" if r.label else ""), r.direction, r.part,
                 _fmt(r.vs_control), _fmt(r.bound_control), _fmt(r.vs_reference), _fmt(r.bound),
                 _fmt(r.control_vs_reference), "=" if r.identical else "", "OVER" if r.over else ""]
                for r in self.rows]
        return tabulate(rows, headers=["#", "where", "op", "dir", "part", "vs control", "bound", "vs reference",
                                       "bound (ref)", "control vs ref", "bits", ""], tablefmt="simple",
                        disable_numparse=True)

    def text(self) -> str:
        lens = ", in the float32 lens" if self.precision == "lens" else ""
        return "\n".join([f"explain {self.check!r} (config {self.config!r}, contract {self.contract}, step 1{lens}; "
                          f"bounds: vs control max({self.bounds.floor:g}, d), vs reference max({self.bounds.floor:g}, "
                          f"(1 + {self.bounds.slack:g}) d), d = control vs reference at the tap):",
                          self.line(), "", self.table()])

    def to_json(self) -> dict:
        return {"check": self.check, "config": self.config, "contract": self.contract, "precision": self.precision,
                "candidate_flags": self.candidate_flags, "slack": self.bounds.slack, "floor": self.bounds.floor,
                "first": None if self.first is None else dataclasses.asdict(self.first), "line": self.line(),
                "wall_s": self.wall_s, "run_s": self.run_s, "taps": [dataclasses.asdict(r) for r in self.rows]}


def _fmt(x: float) -> str:
    if math.isinf(x) or math.isnan(x):
        return str(x)
    return "0" if x == 0 else f"{x:.2e}"


# ------------------------------------------------------------------------------------------------------------- runs
@dataclasses.dataclass
class TapRun:
    forward: dict  # {scope: {key: {part: np.ndarray}}}; layers: {"layers": {"layer_i": ...}}
    backward: dict
    specs: dict  # scope -> [TapSpec]
    routing: np.ndarray | None
    pattern: tuple
    groups: int
    seconds: float


def run_taps(runner, flags, precision: str, *, replay=None, loss_fn=protocol.grpo_loss) -> TapRun:
    """Step 1 of the protocol with the taps on (``runner``: a ``gates.runner.Runner``)."""
    import jax
    import jax.numpy as jnp

    t = time.perf_counter()
    api = runner.api
    mesh = api.make_mesh(flags)
    try:
        fn = api.build_log_probs(runner.cfg, flags, precision=precision, mesh=mesh, explain=True)
    except TypeError as e:
        raise BadInput(f"explain: this model's build_log_probs takes no explain=True ({e})") from e
    params = runner.params0()
    if api.place_params is not None:
        params = api.place_params(params, mesh)
    batch = runner.batch
    tokens, mask, adv = (jnp.asarray(x) for x in (batch.tokens, batch.completion_mask, batch.advantages))
    shape = fn.routing_shape
    routing = ((jnp.zeros(shape, jnp.int32), jnp.bool_(False)) if replay is None
               else (jnp.asarray(replay, jnp.int32), jnp.bool_(True)))
    structure = fn.probe_shapes(params, tokens, routing)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(tuple(mesh.axis_names)))
    probes = jax.tree.map(lambda sd: jax.device_put(jnp.zeros(sd.shape, sd.dtype), sharding), structure)
    ratio_clip = runner.settings.ratio_clip

    def objective(p, pr):
        logp, aux = fn(p, tokens, routing, pr)
        loss = loss_fn(logp, jax.lax.stop_gradient(logp), adv, mask, ratio_clip=ratio_clip)
        return loss, (aux["taps"], aux["routing"])

    step = jax.jit(jax.value_and_grad(objective, argnums=1, has_aux=True))
    (loss, (fwd, used)), bwd = step(params, probes)
    fwd = jax.tree.map(np.asarray, fwd)
    fwd.setdefault("head", {})["loss"] = {"out": np.asarray(loss)[None]}
    specs = fn.tap_specs()
    return TapRun(forward=fwd, backward=jax.tree.map(np.asarray, bwd), specs=specs, routing=np.asarray(used),
                  pattern=tuple(fn.pattern), groups=int(fn.groups), seconds=round(time.perf_counter() - t, 2))


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    num, den = float(np.sum((a64 - b64) ** 2)), float(np.sum(b64**2))
    if not (math.isfinite(num) and math.isfinite(den)):
        return math.inf
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return math.sqrt(num / den)


def _entries(run: TapRun):
    """(order of scopes) -> [(scope, group, layer, where, spec)] in forward execution order."""
    out = [("embed", None, None, "embed", s) for s in run.specs.get("embed", [])]
    for g in range(run.groups):
        for i, kind in enumerate(run.pattern):
            layer = g * len(run.pattern) + i
            out += [(f"layer_{i}", g, layer, f"layer {layer} ({kind})", s) for s in run.specs.get(f"layer_{i}", [])]
    out += [("head", None, None, "head", s) for s in run.specs.get("head", [])]
    return out


def _pick(tree: dict, scope: str, group: int | None, key: str, part: str):
    base = tree["layers"][scope] if scope.startswith("layer_") else tree[scope]
    a = base[key][part]
    return a if group is None else a[:, group]


def compare(cand: TapRun, ctl: TapRun, ref: TapRun, contract: str, bounds: Bounds) -> list[TapRow]:
    entries = _entries(ctl)
    for label, run in (("candidate", cand), ("reference", ref)):
        mine = [(e[0], e[4].key) for e in _entries(run)]
        theirs = [(e[0], e[4].key) for e in entries]
        if set(mine) != set(theirs):
            diff = sorted(set(mine) ^ set(theirs))[:6]
            raise RuntimeError(f"explain: the {label}'s taps differ from the control's: {diff}")
    loss_spec = type(entries[0][4])("loss", "loss", "", ("out",), ()) if entries else None
    fwd_list = [(e, p) for e in entries for p in e[4].forward]
    if loss_spec is not None:
        fwd_list.append((("head", None, None, "head", loss_spec), "out"))
    bwd_list = [(e, p) for e in reversed(entries) for p in e[4].backward]
    rows = []

    def row(direction, e, part):
        scope, group, layer, where, spec = e
        tree = "forward" if direction == "forward" else "backward"
        a, c, r = (_pick(getattr(x, tree), scope, group, spec.key, part) for x in (cand, ctl, ref))
        vc, vr, cr = _rel(a, c), _rel(a, r), _rel(c, r)
        bound_c, bound = max(bounds.floor, cr), max(bounds.floor, (1.0 + bounds.slack) * cr)
        identical = a.shape == c.shape and a.dtype == c.dtype and a.tobytes() == c.tobytes()
        over = (not identical) if contract == "exact" else (vc > bound_c or vr > bound)
        rows.append(TapRow(len(rows) + 1, direction, layer, where, spec.op, spec.label, part, vc, vr, cr,
                           0.0 if contract == "exact" else bound_c, bound, identical, bool(over)))

    for e, part in fwd_list:
        row("forward", e, part)
    for e, part in bwd_list:
        row("backward", e, part)
    return rows


# ------------------------------------------------------------------------------------------------------ the entry
_SHARED: dict = {}  # (config, control flags, precision) -> TapRun, for the control and reference of one process


def explain_spec(runner, spec, *, candidate_context=None, candidate_loss_fn=protocol.grpo_loss,
                 bounds: Bounds | None = None, precision: str = "production") -> Explanation:
    """Explain ``spec`` (a ``gates.contracts.CheckSpec``) on ``runner``'s config. ``precision="lens"``: the control and
    the candidate in the float32 lens (their own code paths in float32; the bf16 control's routing replayed), against
    the same float32 reference: for a check that only the lens fails, an error below bf16's noise."""
    if precision not in ("production", "lens"):
        raise BadInput(f"explain: precision={precision!r} must be 'production' or 'lens'")
    t = time.perf_counter()
    bounds = bounds or Bounds.for_run(getattr(runner.tolerances, "path", None))
    control_flags, candidate_flags = runner.resolve(spec)
    key = (runner.config_name, repr(runner.api.as_dict(control_flags)))
    progress = runner.progress
    if (key, "production") not in _SHARED:
        progress(f"explain[{spec.name}]: control, step 1 with taps")
        _SHARED[key, "production"] = run_taps(runner, control_flags, "production")
    routing = _SHARED[key, "production"].routing  # every other run replays the bf16 control's expert choices
    if (key, "reference") not in _SHARED:
        progress(f"explain[{spec.name}]: float32 reference, step 1 with taps (control's routing)")
        _SHARED[key, "reference"] = run_taps(runner, control_flags, "reference", replay=routing)
    ref = _SHARED[key, "reference"]
    if (key, precision) not in _SHARED:
        progress(f"explain[{spec.name}]: control in the float32 lens, step 1 with taps (control's routing)")
        _SHARED[key, precision] = run_taps(runner, control_flags, precision, replay=routing)
    ctl = _SHARED[key, precision]
    progress(f"explain[{spec.name}]: candidate{' in the float32 lens' if precision == 'lens' else ''}, step 1 with "
             "taps (control's routing)")
    with candidate_context if candidate_context is not None else contextlib.nullcontext():
        cand = run_taps(runner, candidate_flags, precision, replay=routing, loss_fn=candidate_loss_fn)
    rows = compare(cand, ctl, ref, spec.contract, bounds)
    return Explanation(check=spec.name, config=runner.config_name, contract=spec.contract,
                       candidate_flags=dict(spec.candidate_overrides), bounds=bounds, rows=rows,
                       wall_s=round(time.perf_counter() - t, 2),
                       run_s={"control": ctl.seconds, "reference": ref.seconds, "candidate": cand.seconds},
                       precision=precision)


def explain(config: str = "tiny", flags=None, candidate_context=None, *, candidate_loss_fn: Callable | None = None,
            api=None, progress=None, precision: str = "production") -> Explanation:
    """Explain the check of ``flags`` on ``config`` (see the module docstring); ``gates.explain``."""
    from nxgates.gates.runner import Runner, stderr

    runner = Runner(config, api=api, progress=progress or stderr)
    if flags:
        spec = runner.user_spec(flags)
    elif candidate_context is not None or candidate_loss_fn is not None:
        from nxgates.gates import contracts

        spec = contracts.CheckSpec(name="candidate", contract="rounding", candidate_overrides={}, keys=())
    else:
        raise BadInput("explain: flags={} names no flag and no candidate_context is given: nothing to explain")
    return explain_spec(runner, spec, candidate_context=candidate_context,
                        candidate_loss_fn=candidate_loss_fn or protocol.grpo_loss, precision=precision)


# --------------------------------------------------------------------------------------------------------- mutants
def explain_mutants(config: str = "tiny", only=None, *, api=None, progress=None):
    """Each mutant's explanation: [(mutant, injected op(s), explanation)]."""
    from nxgates.gates import contracts, mutants
    from nxgates.gates.runner import Runner, stderr

    runner = Runner(config, api=api, progress=progress or stderr)
    names = [m.name for m in mutants.MUTANTS]
    for n in only or ():
        if n not in names:
            raise BadInput(f"--mutant {n}: unknown mutant; mutants are {names}")
    base = runner.api.as_dict(runner.base_flags)
    out = []
    for m in mutants.MUTANTS:
        if only and m.name not in only:
            continue
        if m.flags:
            spec = contracts.build_check(m.name, m.flags, base, runner.closure)
        else:
            spec = contracts.CheckSpec(name=m.name, contract="rounding", candidate_overrides={}, keys=())
        _, candidate_flags = runner.resolve(spec)
        pairs = m.overrides(runner.cfg, candidate_flags)
        injected = ", ".join(op for op, _ in pairs) or ("loss" if m.loss_fn is not None else "-")
        # a mutant the bf16 gates cannot see (no bf16 must-gate) is explained in the float32 lens
        ex = explain_spec(runner, spec, candidate_context=mutants._overriding(runner.api, pairs),
                          candidate_loss_fn=m.loss_fn or protocol.grpo_loss,
                          precision="lens" if not m.must and m.lens_must else "production")
        out.append((m, injected, ex))
    return out


def mutants_table(results) -> str:
    from tabulate import tabulate

    rows = []
    for m, injected, ex in results:
        f = ex.first
        rows.append([m.name, injected, "float32 lens" if ex.precision == "lens" else "bf16",
                     "-" if f is None else f.where, "-" if f is None else f.op,
                     "-" if f is None else f.direction + ("" if f.part == "out" else f" {f.part}"),
                     "yes" if f is not None and f.op == injected else "no", f"{ex.wall_s:.0f}s"])
    return tabulate(rows, headers=["mutant", "injected into", "runs", "named layer", "named op", "tap", "same op",
                                   "wall"],
                    tablefmt="github", disable_numparse=True)


def main(args, api, flags: dict | None) -> int:
    """``python -m nxgates explain`` (``gates.cli``; ``flags`` parsed from ``--flags``)."""
    out = args.out
    if args.mutants or args.mutant:
        results = explain_mutants(args.config, only=args.mutant, api=api)
        for m, injected, ex in results:
            print(f"\nmutant {m.name} (injected into {injected}): {ex.line()}")
            _write(ex, out, f"explain-{m.name}")
        print()
        print(mutants_table(results))
        return 0
    if not flags:
        raise BadInput("explain: give --flags k=v ... (or --mutant NAME / --mutants)")
    ex = explain(args.config, flags, api=api, precision="lens" if getattr(args, "lens", False) else "production")
    print(ex.text())
    paths = _write(ex, out, "explain")
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0 if ex.first is None else 1


def _write(ex: Explanation, out, stem: str) -> list:
    from nxgates.gates import atomic, plots

    paths = [atomic.write_json_atomic(f"{out}/{stem}.json", ex.to_json()),
             atomic.write_text_atomic(f"{out}/{stem}.txt", ex.text() + "\n")]
    png = plots.explain_heatmap(ex, f"{out}/{stem}.png")
    if png is not None:
        paths.append(png)
    return paths


def explain_failed(runner, spec, check=None) -> Explanation | str:
    """The explanation of a failing check for the report (``gates.suite.check``); a str saying why there is none when
    the model cannot be explained or the explain run fails (the gates' verdict stands either way). A check that only
    the float32 lens fails (``check``: its ``gates.runner.CheckResult``) is explained in the lens."""
    lens_only = check is not None and check.bf16_passed and check.lens_passed is False
    try:
        return explain_spec(runner, spec, precision="lens" if lens_only else "production")
    except BadInput as e:
        return f"no explanation: {e}"
    except Exception as e:  # noqa: BLE001 (an explanation is an aid: its failure must not lose the gates' report)
        return f"no explanation: the explain run failed: {type(e).__name__}: {e}"
