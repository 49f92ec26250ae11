"""``python -m nxgates calibrate [--config tiny]``: the measurements behind ``fixtures/tolerances.toml`` ``[gates.*]``.

Four runs of the protocol on one config: the control (production bf16, the config's flags), the float32 reference, the
control again (fresh, no cache: is the control reproducible to the bit? ``exact`` contracts rely on it) and a benign
reassociation for every GMM k tile of the config, halved and doubled (the same arithmetic, the f32 accumulation
re-associated; ``rounding`` changes that must pass; per gate and step the one farthest from the reference is kept).
Per gate and step it prints m(control, reference), m(benign, control), m(benign, reference) and
m(control again, control), and proposes:
- ``rel[gate]``, one number per step: m(control, reference) at that step, rounded up to 3 significant digits. A flag
  that "changes the numbers by bf16 rounding" must move the result less than the whole bf16 path's own error does
  (the control's distance to the float32 truth at that step; measured: every rounding flag of tiny stays within
  0.82 x of it on N2, N4, N5, N6, python -m nxgates run, 2026-12-02). Per step, because the distances differ by step
  (step 1 compares the same parameters; steps 2 and 3 also carry the first updates). N3 stays at docs/design.md's 2e-3
  and N1 at 0 (the loss must not move; its measured distances are printed).
- ``slack[gate]``, per gate, from the benign reassociation on THAT gate. The reference bound is
  ``max(rel, (1 + slack) * m(control, reference))``; with ``rel`` at m(control, reference) itself the slack term
  decides at every step (except where a fixed ``rel`` is larger: N3). With
  ``ratio = max over the steps where m(benign, reference) > rel of m(benign, reference) / m(control, reference)``,
  ``slack = max(SLACK_FLOOR, 2 * (ratio - 1))`` rounded up to a multiple of 0.05: a rounding change as benign as a
  re-associated accumulation went ``ratio - 1`` farther from the float32 truth than the control; twice that, because
  one reassociation is one draw of the rounding noise. No such step: the floor SLACK_FLOOR = 0.05 (with routing
  replay the whole-model metrics N2, N4, N6 of a re-associated candidate sit within 1-2% of the control's distance
  to the reference, so 5% is the resolution the table allows). The ratio over every step is printed too. Nothing
  about the mutants or the flags under test enters the rule.
The numbers are printed (and written to reports/calibration.json); updating the table is a deliberate edit.
"""

from __future__ import annotations

import json
import math
import sys

from tabulate import tabulate

from nxgates.gates import atomic, contracts
from nxgates.gates import gates as gates_lib
from nxgates.gates import runner as runner_lib
from nxgates.gates.errors import BadInput

SLACK_FLOOR = 0.05
SLACK_FACTOR = 2.0
SLACK_STEP = 0.05


def slack_from_ratio(ratio: float | None) -> float:
    """The per-gate slack rule: ``max(SLACK_FLOOR, SLACK_FACTOR * (ratio - 1))`` rounded up to ``SLACK_STEP``;
    ``ratio`` None (no step with m(control, reference) > 0) gives the floor."""
    if ratio is None:
        return SLACK_FLOOR
    if not math.isfinite(ratio):
        raise ValueError(f"slack_from_ratio: ratio={ratio!r} must be finite")
    raw = math.ceil(max(SLACK_FACTOR * (ratio - 1.0), 0.0) / SLACK_STEP - 1e-9) * SLACK_STEP
    return round(max(SLACK_FLOOR, raw), 10)


FIXED_REL = {"N3": 2e-3}  # docs/design.md fixes N3's tolerance
REL_DIGITS = 3


def proposed_rel(gate: str, control_vs_reference: list[float]) -> float | list[float]:
    """The rel rule: docs/design.md's fixed value (N3), 0 when the control matches the reference at every step (N1),
    else per step m(control, reference) rounded up to ``REL_DIGITS`` significant digits."""
    if gate in FIXED_REL:
        return FIXED_REL[gate]
    if max(control_vs_reference) == 0.0:
        return 0.0
    return [_round_up(x, REL_DIGITS) for x in control_vs_reference]


def _rel_at(rel, step: int) -> float:
    return float(rel) if isinstance(rel, (int, float)) else float(rel[step - 1])


def benign_ratios(rows: list[dict], rel: dict | None = None) -> dict[str, dict]:
    """Per gate: the largest m(benign, reference) / m(control, reference) over the steps where m(control, reference)
    > 0 and (with ``rel``) m(benign, reference) > rel[gate] at that step:
    {"ratio": float | None, "step": int | None}. A row without a benign draw (benign_vs_reference None) is no
    candidate."""
    out = {}
    for g in gates_lib.GATES:
        cands = [(row["benign_vs_reference"] / row["control_vs_reference"], row["step"]) for row in rows
                 if row["gate"] == g and row["control_vs_reference"] > 0 and row["benign_vs_reference"] is not None
                 and (rel is None or row["benign_vs_reference"] > _rel_at(rel[g], row["step"]))]
        ratio, step = max(cands) if cands else (None, None)
        out[g] = {"ratio": ratio, "step": step}
    return out


def derive_tolerances(rows: list[dict]) -> dict[str, dict]:
    """THE rule from measured rows to the [gates.*] table (used by ``calibrate`` and ``calibrate_records``).

    ``rows``: per gate and step (1-based, steps 1..n in order) {"gate", "step", "control_vs_reference",
    "benign_vs_reference" (the worst benign draw's; None without one)}; a gate without rows is left out. Per gate:
    {"rel": ``proposed_rel``, "slack": ``slack_from_ratio`` of the largest benign ratio over the steps where the draw
    exceeds rel, "benign_ratio", "benign_ratio_step", "benign_ratio_every_step", "control_vs_reference_max"}."""
    gates = [g for g in gates_lib.GATES if any(row["gate"] == g for row in rows)]
    rel = {g: proposed_rel(g, [row["control_vs_reference"] for row in rows if row["gate"] == g]) for g in gates}
    every_step, uncovered = benign_ratios(rows), benign_ratios(rows, rel)
    return {g: {"rel": rel[g], "slack": slack_from_ratio(uncovered[g]["ratio"]),
                "benign_ratio": uncovered[g]["ratio"], "benign_ratio_step": uncovered[g]["step"],
                "benign_ratio_every_step": every_step[g]["ratio"],
                "control_vs_reference_max": max(row["control_vs_reference"] for row in rows if row["gate"] == g)}
            for g in gates}


def _round_up(x: float, digits: int = 2) -> float:
    if x <= 0 or not math.isfinite(x):
        return x
    e = math.floor(math.log10(x)) - (digits - 1)
    return math.ceil(x / 10**e - 1e-9) * 10**e


def default_benign(r: runner_lib.Runner) -> list[dict]:
    """The benign reassociations: every ``rounding`` tile key (a GMM k tile, forward or backward), halved and doubled
    where the result is a valid tile: [{key: value}, ...]. Each is one draw of the rounding noise (the same arithmetic,
    the f32 accumulation re-associated); the slack rule takes the worst draw: N5's worst tensor (the 4-element GDN decay
    parameters' gradients on tiny) varies a lot from draw to draw, so one draw would underestimate it."""
    base = r.api.as_dict(r.base_flags)
    found = []
    for key, value in base.items():
        if not (contracts.is_tile_key(key) and contracts.contract_of(key) == "rounding"):
            continue
        for new in (value // 2, value * 2):
            if new < 8:
                continue
            try:
                r.api.validate(r.cfg, r.flags_from({key: new}))
            except r.api.config_error:
                continue
            found.append({key: new})
    if not found:
        raise BadInput(f"config {r.config_name!r}: no k tile halves or doubles to a valid tile; "
                                  "pass --benign k=v")
    return found


LENS_FLOOR_FACTOR = 2.0
LENS_DIGITS = 2


def derive_lens_tolerances(rows: list[dict]) -> dict[str, dict]:
    """THE rule for the float32 lens's ``[lens.*]`` table from rows measured at ``precision="lens"`` (the control
    and the benign reassociations on their own code paths in float32; the same row keys as ``derive_tolerances``).

    Without bf16 rounding a correct flag differs from the float32 reference only by float32 reassociation. Per gate:
    ``floor`` = ``LENS_FLOOR_FACTOR`` x the largest float32 distance to the reference of the control or any benign draw
    at any step, rounded up to ``LENS_DIGITS`` significant digits (the reassociation noise, twice: one draw is one draw
    of the noise); ``slack`` by ``slack_from_ratio`` over the steps where a benign draw exceeds the floor (none: the
    floor 0.05); ``live_range`` = [0, floor] (a float32 control farther from the reference than the floor means the
    float32 path itself moved: reported as an environment change)."""
    out = {}
    for g in gates_lib.GATES:
        rs = [row for row in rows if row["gate"] == g]
        if not rs:
            continue
        noise = max(max(row["control_vs_reference"], row["benign_vs_reference"] or 0.0) for row in rs)
        floor = _round_up(LENS_FLOOR_FACTOR * noise, LENS_DIGITS) if noise > 0 else 0.0
        uncovered = benign_ratios(rs, {g: floor})[g]
        out[g] = {"floor": floor, "slack": slack_from_ratio(uncovered["ratio"]), "live_range": [0.0, floor],
                  "noise_max": noise, "benign_ratio": uncovered["ratio"], "benign_ratio_step": uncovered["step"],
                  "control_vs_reference_max": max(row["control_vs_reference"] for row in rs)}
    return out


def calibrate(config: str, api=None, benign: dict | list[dict] | None = None, *, cache_dir=None, progress=None,
              repeat: bool = True, lens: bool = False, draws: int | None = None) -> dict:
    """The calibration runs (module docstring). ``lens``: the control and the benign draws at ``precision="lens"``
    (the float32 lens; rows for ``derive_lens_tolerances``), no repeat. ``draws``: keep the first ``draws`` benign
    draws (stated in the result)."""
    from nxgates.gates import record as record_lib

    progress = progress or (lambda m: print(m, file=sys.stderr, flush=True))
    r = runner_lib.Runner(config, api=api, cache=record_lib.RecordCache(cache_dir, log=progress), progress=progress)
    benigns = default_benign(r) if benign is None else ([benign] if isinstance(benign, dict) else list(benign))
    if draws is not None:
        if draws < 1:
            raise BadInput(f"--draws {draws}: must be >= 1")
        benigns = benigns[:draws]
    benign_flags = []
    for b in benigns:
        flags = r.flags_from(b)
        r.api.validate(r.cfg, flags)
        benign_flags.append(flags)
    control, _ = r.shared_record(r.base_flags, "production", "control")
    replay = runner_lib.control_routing(control)  # the reference and the benign candidates replay the control's routing
    reference, _ = r.shared_record(r.base_flags, "reference", "reference", replay)
    precision = "lens" if lens else "production"
    if lens:  # the float32 control on its own code path: the lens's noise floor
        control, _ = r.shared_record(r.base_flags, "lens", "control-lens", replay)
        repeat = False
    again = r.compute(r.base_flags, "production", "control again (fresh)") if repeat else None
    # Through the record cache, keyed like any candidate: a benign tile that is also a tuned value is shared with
    # the gates' own check of it.
    cands = [r.shared_record(f, precision, f"benign {b}", replay)[0] for b, f in zip(benigns, benign_flags,
                                                                                      strict=True)]
    rows = []
    # N5 reads the tensors the table being calibrated lets it read ([gates.N5] / [lens.N5] min_size)
    min_size = (r.lens_tolerances if lens else r.tolerances).min_size
    for i in range(control.num_steps):
        # every gate of each pair at this step, N3-N5 from one pass over the two gradients (gates.metrics)
        def of(a, b, i=i):
            return gates_lib.metrics(a, b, i, min_size=min_size.get("N5", 1))

        vs_control, vs_reference = [of(c, control) for c in cands], [of(c, reference) for c in cands]
        control_vs_reference, again_vs_control = of(control, reference), (of(again, control) if again else None)
        for g in gates_lib.GATES:
            per = [(a[g].value, b[g].value) for a, b in zip(vs_control, vs_reference, strict=True)]
            worst = max(range(len(per)), key=lambda j: per[j][1])  # the draw farthest from the reference
            rows.append({
                "gate": g, "step": i + 1,
                "control_vs_reference": control_vs_reference[g].value,
                "benign_vs_control": max(p[0] for p in per),  # the largest over the draws (not the worst draw's)
                "benign_vs_reference": per[worst][1],
                "benign_worst": ",".join(f"{k}={v}" for k, v in benigns[worst].items()),
                "control_again_vs_control": again_vs_control[g].value if again else None,
                "control_reproducible_bits": gates_lib.bit_identical(g, again, control, i) if again else None,
            })
    proposed = derive_lens_tolerances(rows) if lens else derive_tolerances(rows)
    return {"config": config, "lens": lens, "benign": benigns, "env": r.env, "rows": rows, "proposed": proposed,
            "min_size": dict(min_size),
            "slack_rule": f"slack = max({SLACK_FLOOR}, {SLACK_FACTOR} * (max over the steps where m(benign, ref) > rel "
                          f"of m(benign, ref) / m(control, ref) - 1)) rounded up to {SLACK_STEP}",
            "preconditions": gates_lib.preconditions(
                {"control": control, "reference": reference}
                | {f"benign {i}": c for i, c in enumerate(cands)} | ({"control_again": again} if again else {})),
            "wall_s": round(__import__("time").perf_counter() - r.t0, 1)}


def main(args, api, benign: dict | None = None) -> int:
    """``nxgates calibrate``: ``benign`` is the parsed ``--benign k=v ...`` (None: ``default_benign``)."""
    lens = bool(getattr(args, "lens", False))
    res = calibrate(args.config, api, benign, cache_dir=args.cache_dir, repeat=not args.no_repeat, lens=lens,
                    draws=getattr(args, "draws", None))
    atomic.write_json_atomic(f"{args.out}/calibration{'-lens' if lens else ''}.json", res)
    if args.json:
        print(json.dumps(res, indent=2, default=str))
        return 0
    fmt = [{k: (f"{v:.3e}" if isinstance(v, float) else ("-" if v is None else v)) for k, v in row.items()}
           for row in res["rows"]]
    print(f"calibration on config {res['config']!r}, benign reassociation {res['benign']} "
          f"({res['env']['device_count']} x {res['env']['device_kind']}, jax {res['env']['jax']}, {res['wall_s']}s)")
    print(tabulate(fmt, headers="keys", tablefmt="simple", disable_numparse=True))
    for p in res["preconditions"]:
        print(f"precondition failed: {p}")
    if lens:
        print("proposed [lens.*] values (gates/calibrate.py derive_lens_tolerances; source: `python -m nxgates "
              f"calibrate --lens --config {res['config']}`):")
        print(tabulate([[g, f"{v['noise_max']:.3e}", f"{v['floor']:.2g}", f"{v['slack']:.2f}"]
                        for g, v in res["proposed"].items()],
                       headers=["gate", "max float32 distance to ref", "floor", "slack"], tablefmt="simple",
                       disable_numparse=True))
        return 0
    print(f"slack rule: {res['slack_rule']}")
    print("proposed [gates.*] values (source: `python -m nxgates calibrate --config " + res["config"] + "`):")
    prop = [[g, f"{v['control_vs_reference_max']:.3e}",
             f"{v['rel']:.3g}" if isinstance(v["rel"], float) else "[" + ", ".join(f"{x:.3e}" for x in v["rel"]) + "]",
             "-" if v["benign_ratio_every_step"] is None else f"{v['benign_ratio_every_step']:.4f}",
             "-" if v["benign_ratio"] is None else f"{v['benign_ratio']:.4f} (step {v['benign_ratio_step']})",
             f"{v['slack']:.2f}"] for g, v in res["proposed"].items()]
    print(tabulate(prop, headers=["gate", "max m(control, ref)", "rel", "max ratio, every step",
                                  "max ratio where m(benign, ref) > rel", "slack"],
                   tablefmt="simple", disable_numparse=True))
    return 0
