"""``python -m nxgates resolution``: the smallest error each lens catches, per rounding flag and gate.

A gate that passes says "no error larger than what this gate resolves". This measures that size. For each rounding
check of the config (or of ``--flags``), the candidate runs with its flag on and an error of known relative size
``eps`` injected into the op the flag changes (``SITES``): every injected array ``a`` becomes ``a * (1 + eps * s)``
with ``s`` a fixed pattern of random signs (``jax.random.rademacher``, seeded from the flag's name), so its relative L2
change is exactly ``eps`` before it is rounded to the array's dtype. A forward site changes the op's output value only
(its gradient is the op's own); a backward site changes the cotangents the op returns. ``eps`` sweeps a log grid
(``EPS_GRID``, one point per decade); the float32 lens stops one decade past the first ``eps`` at which it fails a
gate, the sweep one decade past the first failure of the bf16 gates (the bf16 candidate runs at every point). The
answer per flag and gate is the smallest ``eps`` that fails it, in each lens.

Why it matters: a bf16 gate resolves only errors comparable to bf16's own (the candidate may lie ``1 + slack`` times the
control's distance from the reference), so a logic error up to ~0.3 of bf16's error passes it; the float32 lens removes
bf16's noise and resolves errors down to float32 reassociation. ``eps = 0`` is the flag's own check (it must pass).

Run: python -m nxgates resolution [--config tiny] [--flags k=v ...] [--eps 1e-5 1e-3 ...]
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp

from nxgates.gates import atomic, mutants
from nxgates.gates import gates as gates_lib
from nxgates.gates.errors import BadInput

EPS_GRID = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
PAST_FIRST_FAILURE = 1  # grid points run past the first eps at which a lens fails (the other gates' thresholds)


@dataclasses.dataclass(frozen=True)
class Site:
    """Where a flag's error goes: ``op`` (a ``model.ops`` name) and ``parts``: the op's outputs, named in order
    (``("y",)`` for one output; a GDN fold's ``("M", "B")``), perturbed as values (their gradient stays the op's own);
    or, for ``moe_mlp``'s backward, a subset of the cotangents it returns, ``dx dwi dwo d_route``. ``side``: which
    pass the flag changes (the forward output, or the backward: cotangents, or the dh fold that only the backward
    runs)."""

    op: str
    parts: tuple[str, ...]
    side: str = "forward"

    def describe(self) -> str:
        return f"{self.op} {self.side} ({', '.join(self.parts)})"


_GRADS = ("dx", "dwi", "dwo", "d_route")
# The flags whose site is not a GMM tile: what each one changes (model/flags.py's doc of the flag).
SITES: dict[str, Site] = {
    "moe_wi_gmm_fused_swiglu": Site("moe_mlp", ("y",)),  # silu(gate) * up from the f32 accumulator: the forward
    "moe_wo_gmm_fused_dswiglu": Site("moe_mlp", ("dx", "dwi"), "backward"),  # d[gate | up]: what feeds dx, dwi
    "moe_router_grad_from_wo_input": Site("moe_mlp", ("d_route",), "backward"),  # the routing weight's gradient
    "gdn_cp_m_scan": Site("gdn_cp_fold", ("M", "B")),
    "gdn_cp_dh_scan": Site("gdn_cp_dh_fold", ("M", "B"), "backward"),
}
# A GMM k tile re-associates that GMM's sum: the forward GMMs' output, the backward GMMs' cotangents.
_TILE_SITES = {"wi fwd": ("y",), "wo fwd": ("y",), "wi dlhs": ("dx",), "wo dlhs": ("dx", "dwi"),
               "wi drhs": ("dwi",), "wo drhs": ("dwo",)}


def site_of(key: str) -> Site:
    """The site of tuning flag ``key`` (BadInput when it has none: an exact flag, or a rounding flag without one)."""
    from nxgates.gates import contracts

    if key in SITES:
        return SITES[key]
    if contracts.is_tile_key(key):
        from nxgates.model.flags import Flags

        parts = _TILE_SITES[Flags.__dataclass_fields__[key].metadata["gmm_dim"][0]]
        return Site("moe_mlp", parts, "forward" if parts == ("y",) else "backward")
    raise BadInput(f"flag {key!r} has no injection site in gates.resolution.SITES (add one: the op and the arrays "
                   "its change reaches)")


def perturb(a, eps: float, seed: int):
    """``a * (1 + eps * s)``, ``s`` random signs from ``seed`` (relative L2 change exactly ``eps`` before ``a``'s
    dtype rounds it), in float32, cast back to ``a``'s dtype."""
    s = jax.random.rademacher(jax.random.PRNGKey(seed), a.shape, dtype=jnp.float32)
    af = a.astype(jnp.float32)
    return (af + (eps * s) * af).astype(a.dtype)


def seed_of(key: str, part: str) -> int:
    """The sign pattern's seed, from the flag and the part (the same command gives the same numbers)."""
    return zlib.crc32(f"resolution/{key}/{part}".encode()) & 0x7FFFFFFF


def _value_only(a, eps: float, seed: int):
    return a + jax.lax.stop_gradient(perturb(a, eps, seed) - a)


def wrapper(key: str, site: Site, eps: float) -> Callable[[Callable], Callable]:
    """The wrapper ``model.ops.wrap`` traces: the op's function with ``eps`` injected at ``site``."""
    name = f"eps_{eps:.0e}_{key}".replace("-", "m").replace("+", "")
    if site.side == "backward" and set(site.parts) <= set(_GRADS):
        if site.op != "moe_mlp":
            raise BadInput(f"site {site.describe()} of {key!r}: cotangents are injected into moe_mlp only")

        def edit(primals, dy, grads):
            return tuple(perturb(g, eps, seed_of(key, p)) if p in site.parts else g
                         for p, g in zip(_GRADS, grads, strict=True))

        def wrap_backward(fn):
            return mutants.with_backward_edit(fn, edit, "moe_mlp_grads_with_error")
        wrap_backward.__name__ = name
        return wrap_backward

    def wrap_outputs(fn):
        def with_error(*args, **kwargs):
            out = fn(*args, **kwargs)
            if isinstance(out, (tuple, list)):
                if len(out) != len(site.parts):
                    raise ValueError(f"site {site.describe()}: the op returned {len(out)} outputs")
                return type(out)(_value_only(o, eps, seed_of(key, p)) for o, p in zip(out, site.parts, strict=True))
            return _value_only(out, eps, seed_of(key, site.parts[0]))
        return with_error
    wrap_outputs.__name__ = name
    return wrap_outputs


@dataclasses.dataclass
class Point:
    """One ``eps`` of one flag: the gates each lens failed (None: that lens did not run at this eps)."""

    eps: float
    bf16_failed: list[str] | None
    lens_failed: list[str] | None
    bf16_clearance: dict[str, float]  # gate -> metric / bound (largest over steps and sides), every gate
    lens_clearance: dict[str, float]


@dataclasses.dataclass
class FlagResolution:
    key: str
    check: str
    site: str
    points: list[Point]
    own_check_passed: bool | None  # eps = 0: the flag's own check (both lenses)

    def smallest(self, lens: bool, gate: str | None = None) -> float | None:
        """The smallest eps at which ``gate`` (None: any gate) failed in that lens; None when none did."""
        for p in sorted(self.points, key=lambda p: p.eps):
            failed = p.lens_failed if lens else p.bf16_failed
            if failed and (gate is None or gate in failed):
                return p.eps
        return None

    def largest_run(self, lens: bool) -> float | None:
        ran = [p.eps for p in self.points if (p.lens_failed if lens else p.bf16_failed) is not None]
        return max(ran, default=None)


def _clearances(results) -> dict[str, float]:
    return {g: mutants.clearance(results, g) for g in gates_lib.GATES} if results else {}


def run_resolution(config: str = "tiny", *, flags: dict | None = None, eps_grid=EPS_GRID, api=None, cache_dir=None,
                   progress=None, runner=None, sites: dict[str, Site] | None = None) -> list[FlagResolution]:
    """The sweep (module docstring) for every rounding check of ``config`` (not the tuned combination), or for the one
    check of ``flags``. Needs a model API with ``wrap`` (the built-in model's ``model.ops.wrap``) and the float32
    lens's ``[lens.*]`` bounds. ``sites``: flag -> ``Site`` (default ``site_of``); ``runner``: a ``gates.runner.Runner``
    to use (its config, API, tolerances)."""
    from nxgates.gates import record as record_lib
    from nxgates.gates import runner as runner_lib

    progress = progress or (lambda m: print(m, file=sys.stderr, flush=True))
    grid = sorted(float(e) for e in eps_grid)
    if not grid or any(not (math.isfinite(e) and 0 < e < 1) for e in grid):
        raise BadInput(f"--eps {list(eps_grid)}: every eps must be a number in (0, 1)")
    r = runner or runner_lib.Runner(config, api=api, cache=record_lib.RecordCache(cache_dir, log=progress),
                                    progress=progress)
    if r.api.wrap is None:
        raise BadInput("resolution injects through the model API's wrap (model.ops.wrap): this API has none")
    if flags:
        specs = [r.user_spec(flags)]
        if specs[0].contract != "rounding":
            raise BadInput(f"--flags {flags}: an exact check (bit-identity) has no resolution to measure")
    else:
        specs = [s for s in r.default_specs() if s.contract == "rounding" and len(s.keys) == 1]
    if not r.lens:
        raise BadInput(f"resolution compares the bf16 gates with the float32 lens, and {r.tolerances.path} has no "
                       "[lens.*] bounds (python -m nxgates calibrate --lens)")
    where = [(s, s.keys[0], (sites or {}).get(s.keys[0]) or site_of(s.keys[0])) for s in specs]  # before any run
    out = []
    for spec, key, site in where:
        own = r.run_check(spec)
        progress(f"resolution {spec.name}: own check {'PASS' if own.passed else 'FAIL'}; injecting at "
                 f"{site.describe()}")
        res = FlagResolution(key, spec.name, site.describe(), [], own.passed)
        stop = {False: None, True: None}  # lens -> the last eps to run (set at its first failure)
        for i, eps in enumerate(grid):
            run_lens = stop[True] is None or eps <= stop[True]
            if stop[False] is not None and eps > stop[False] and not run_lens:
                break
            # the bf16 candidate runs at every point the sweep makes (the lens fails first in practice); the float32
            # lens only until one decade past its first failure
            wrap = wrapper(key, site, eps)
            check = r.run_check(spec, candidate_context=lambda w=wrap, op=site.op: r.api.wrap(op, w), lens=run_lens)
            _injected(check.implementations["candidate"], site, spec)
            p = Point(eps, sorted({g.gate for g in check.results if not g.passed}),
                      None if check.lens_results is None else sorted({g.gate for g in check.lens_results
                                                                        if not g.passed}),
                      _clearances(check.results), _clearances(check.lens_results))
            res.points.append(p)
            for lens, failed in ((False, p.bf16_failed), (True, p.lens_failed)):
                if failed and stop[lens] is None:
                    stop[lens] = grid[min(i + PAST_FIRST_FAILURE, len(grid) - 1)]
            progress(f"resolution {spec.name} eps {eps:.0e}: bf16 failed {p.bf16_failed}, float32 lens failed "
                     f"{p.lens_failed} ({time.perf_counter() - r.t0:.0f}s)")
        out.append(res)
    return out


def _injected(implementations: dict, site: Site, spec) -> None:
    """An injection that never reached the trace proves nothing: refuse the point."""
    if not str(implementations.get(site.op, "")).startswith("wrap:"):
        raise RuntimeError(f"resolution {spec.name}: the error at {site.describe()} never reached the candidate's "
                           f"trace (it dispatched {implementations.get(site.op)!r})")


def _fmt(e: float | None, ran: float | None) -> str:
    if e is not None:
        return f"{e:.0e}"
    return "-" if ran is None else f"> {ran:.0e}"


def table(results: list[FlagResolution]) -> str:
    """Per flag: the smallest eps failing any gate in each lens and their ratio, then per gate."""
    from tabulate import tabulate

    rows = []
    for res in results:
        b, lz = res.smallest(False), res.smallest(True)
        ratio = f"{b / lz:.0e}" if b and lz else "-"
        per_gate = " ".join(f"{g}:{_fmt(res.smallest(False, g), res.largest_run(False))}/"
                            f"{_fmt(res.smallest(True, g), res.largest_run(True))}" for g in gates_lib.GATES)
        rows.append([res.check, res.site, "pass" if res.own_check_passed else "FAIL",
                     _fmt(b, res.largest_run(False)), _fmt(lz, res.largest_run(True)), ratio, per_gate])
    return tabulate(rows, headers=["flag", "error injected at", "eps=0", "bf16 gates", "float32 lens",
                                   "bf16 / lens", "per gate (bf16/lens)"], tablefmt="github", disable_numparse=True)


def to_json(results: list[FlagResolution], config: str, grid) -> dict:
    return {"config": config, "eps_grid": list(grid), "past_first_failure": PAST_FIRST_FAILURE,
            "flags": [{"flag": r.key, "check": r.check, "site": r.site, "own_check_passed": r.own_check_passed,
                       "smallest_eps_failing": {"bf16": r.smallest(False), "lens": r.smallest(True)},
                       "per_gate": {g: {"bf16": r.smallest(False, g), "lens": r.smallest(True, g)}
                                    for g in gates_lib.GATES},
                       "points": [dataclasses.asdict(p) for p in r.points]} for r in results]}


def main(args, api, flags: dict | None) -> int:
    """Exit 0 when the table was measured and every flag's own check passed; 1 when an own check failed (its
    resolution is then meaningless)."""
    grid = args.eps or EPS_GRID
    results = run_resolution(args.config, flags=flags, eps_grid=grid, api=api, cache_dir=args.cache_dir)
    data = to_json(results, args.config, grid)
    atomic.write_json_atomic(f"{args.out}/resolution.json", data)
    text = table(results)
    atomic.write_text_atomic(f"{args.out}/resolution.md", f"# Detection floor ({args.config})\n\n{text}\n")
    print(json.dumps(data, indent=2) if args.json else text)
    return 0 if all(r.own_check_passed for r in results) else 1
