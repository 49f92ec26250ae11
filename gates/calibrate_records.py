"""``nxgates calibrate-records CONTROL REFERENCE [BENIGN ...] [--out FILE]``: a tolerance file for someone else's
trainer, derived from that trainer's own records by the rule of ``nxgates calibrate`` (``calibrate.derive_tolerances``,
the one function both use).

The table in ``fixtures/tolerances.toml`` was calibrated on this repository's tiny model; another trainer's bf16 path
sits at its own distance from its float32 reference. From the user's control (production precision), reference
(float32) and benign runs (changes that must pass: the same arithmetic re-associated, e.g. another k tile), per gate
and step it measures m(control, reference) and, per benign run, m(benign, control) and m(benign, reference) (the
gates' metrics on records, ``gates.compare.metric``: exact arrays where recorded, else sketches), and proposes:
- ``rel``: per step, m(control, reference) rounded up to 3 significant digits; 0 where the control matches the
  reference at every step; N3 fixed at 2e-3 (DESIGN.md);
- ``slack``: 2 x the worst benign run's excess ratio m(benign, reference) / m(control, reference) - 1 over the steps
  where it exceeds rel, floor 0.05, rounded up to 0.05 (no benign run: the floor).
It writes a TOML file with the schema of ``fixtures/tolerances.toml`` ``[gates.*]`` (every entry with its reason and
the command that measured it), which ``nxgates compare --tolerances FILE`` reads. A gate the records cannot measure
(the data is missing: n/a in compare) gets rel 0 and the floor slack, its reason saying so: the strictest bound, never
a loose one. ``[gates.golden]`` (the control's reproducibility) is not measured from records: rel 0.
The records must line up (``compare.check_comparable``: steps, sketch spec, config, mask, tensors) and count their
steps 1..n (the file's per-step lists are indexed by step). Exit 0 written; 2 bad input, named.
"""

from __future__ import annotations

import json
import math
import pathlib
import shlex
import time
import tomllib

from nxgates.gates import atomic
from nxgates.gates import tolerances as tolerance_table
from nxgates.gates.gates import GATE_NAMES, GATES

# calibrate (the rule) and compare (the metrics on records) import jax: loaded on first use, so that building the
# CLI's parser stays light.
SLACK_FLOOR = 0.05  # calibrate.SLACK_FLOOR (checked in the tests)


def _lib():
    from nxgates.gates import calibrate, compare, records

    return calibrate, compare, records


def measure(control, reference, benign: list, *, n5_min_size: int = 1) -> dict:
    """Per gate and step the distances the rule reads: {"rows": [...], "not_measured": {gate: reason}}. Raises
    ``CompareInputError`` for records that do not line up or hold non-finite values. Arguments: ``records.Run``;
    ``n5_min_size``: N5 reads the tensors of at least that many elements (written to the table as ``min_size``)."""
    _, compare_lib, _ = _lib()
    CompareInputError, NotAvailable = compare_lib.CompareInputError, compare_lib.NotAvailable
    runs = {"control": control, "reference": reference} | {f"benign {i + 1}": b for i, b in enumerate(benign)}
    compare_lib.check_comparable(runs)
    steps = control.step_numbers
    if steps != list(range(1, len(steps) + 1)):
        raise CompareInputError(f"control ({control.path}) has steps {steps}: calibrate-records needs steps 1..n (the "
                                "tolerance file holds one rel per step, indexed from step 1)")
    problems = compare_lib.preconditions(runs)
    if problems:
        raise CompareInputError("cannot calibrate on records with failed preconditions: " + "; ".join(problems[:4]))
    rows, not_measured = [], {}
    for gate in GATES:
        gate_rows = []
        try:
            for n in steps:
                ms = n5_min_size  # read by N5 only
                cr, src = compare_lib.metric(gate, control, reference, n, ("control", "reference"), min_size=ms)
                per = [(compare_lib.metric(gate, b, control, n, (f"benign {i + 1}", "control"), min_size=ms)[0].value,
                        compare_lib.metric(gate, b, reference, n, (f"benign {i + 1}", "reference"),
                                           min_size=ms)[0].value)
                       for i, b in enumerate(benign)]
                worst = max(range(len(per)), key=lambda j: per[j][1]) if per else None  # farthest from the reference
                gate_rows.append({
                    "gate": gate, "step": n, "control_vs_reference": cr.value, "source": src,
                    "benign_vs_control": max(p[0] for p in per) if per else None,
                    "benign_vs_reference": per[worst][1] if per else None,
                    "benign_worst": benign[worst].path if per else None,
                })
        except NotAvailable as e:
            not_measured[gate] = str(e)
            continue
        rows += gate_rows
    bad = [f"{r['gate']} step {r['step']}" for r in rows
           if not all(math.isfinite(r[k]) for k in ("control_vs_reference", "benign_vs_control", "benign_vs_reference")
                      if r[k] is not None)]
    if bad:
        raise CompareInputError(f"non-finite distances at {', '.join(bad[:6])}: a zero norm in the reference?")
    return {"rows": rows, "not_measured": not_measured}


def calibrate_records(control_path, reference_path, benign_paths=(), *, command: str | None = None,
                      n5_min_size: int | None = None) -> dict:
    """Load the records, measure, derive: {"proposed": {gate: ...}, "rows", "not_measured", "toml", ...}.
    ``n5_min_size``: N5's smallest tensor (None: the repository table's ``[gates.N5] min_size``)."""
    calibrate_lib, _, records_lib = _lib()
    control = records_lib.load_run(control_path)
    reference = records_lib.load_run(reference_path)
    benign = [records_lib.load_run(p) for p in benign_paths]
    if n5_min_size is None:
        n5_min_size = tolerance_table.load_tolerances().min_size.get("N5", 1)
    if not isinstance(n5_min_size, int) or isinstance(n5_min_size, bool) or n5_min_size < 1:
        raise ValueError(f"--n5-min-size {n5_min_size!r}: must be an integer >= 1 (elements)")
    m = measure(control, reference, benign, n5_min_size=n5_min_size)
    proposed = calibrate_lib.derive_tolerances(m["rows"])
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    command = command or "nxgates calibrate-records " + " ".join(
        shlex.quote(str(p)) for p in (control_path, reference_path, *benign_paths))
    source = f"{command} ({when}; trainer {control.meta.get('trainer')!r}, steps {control.step_numbers}, " \
             f"{len(benign)} benign run(s))"
    res = {"control": control.path, "reference": reference.path, "benign": [b.path for b in benign],
           "rows": m["rows"], "not_measured": m["not_measured"], "proposed": proposed, "source": source,
           "n5_min_size": n5_min_size,
           "slack_rule": f"slack = max({calibrate_lib.SLACK_FLOOR}, {calibrate_lib.SLACK_FACTOR} * (max over the steps "
                         f"where m(benign, ref) > rel of m(benign, ref) / m(control, ref) - 1)) rounded up to "
                         f"{calibrate_lib.SLACK_STEP}"}
    res["toml"] = to_toml(res)
    return res


# ----------------------------------------------------------------------------------------------------------- TOML
def _toml_float(x: float) -> str:
    s = f"{x:.3g}" if x > 0 else "0.0"  # rel has calibrate.REL_DIGITS = 3 significant digits
    if float(s) < x * (1 - 1e-12):  # the 3-digit text must not round the rounded-up bound down
        s = repr(x)
    return s if any(c in s for c in ".en") else s + ".0"


def _toml_rel(rel) -> str:
    if isinstance(rel, (int, float)):
        return _toml_float(float(rel))
    return "[" + ", ".join(_toml_float(float(x)) for x in rel) + "]"


def _reason(gate: str, p: dict, rows: list[dict], n_benign: int) -> str:
    calibrate_lib = _lib()[0]
    cr = [r["control_vs_reference"] for r in rows if r["gate"] == gate]
    src = sorted({r["source"] for r in rows if r["gate"] == gate})
    per_step = "/".join(f"{x:.4g}" for x in cr)
    if gate in calibrate_lib.FIXED_REL:
        rel_why = f"DESIGN.md fixes {gate} at {calibrate_lib.FIXED_REL[gate]:g} (m(control, reference) per step " \
                  f"{per_step})"
    elif p["rel"] == 0.0:
        rel_why = "the control matches the reference at every step: it must not move"
    else:
        rel_why = f"the control's distance to the float32 reference per step ({per_step}), rounded up to " \
                  f"{calibrate_lib.REL_DIGITS} significant digits"
    if n_benign == 0:
        slack_why = f"no benign run given: the floor {calibrate_lib.SLACK_FLOOR}"
    elif p["benign_ratio"] is None:
        slack_why = f"no benign run exceeds rel at any step: the floor {calibrate_lib.SLACK_FLOOR}"
    else:
        slack_why = f"the worst benign run went {p['benign_ratio']:.4f} x the control's distance at step " \
                    f"{p['benign_ratio_step']}: 2 x {p['benign_ratio'] - 1:.4f}, rounded up to 0.05 (floor " \
                    f"{calibrate_lib.SLACK_FLOOR})"
    return f"{GATE_NAMES[gate]} ({', '.join(src)}): {rel_why}. slack: {slack_why}"


def to_toml(res: dict) -> str:
    """The [gates.*] tables (schema of fixtures/tolerances.toml), checked by reading them back."""
    lines = ["# nxgates tolerance file derived from a trainer's own records (nxgates calibrate-records; the rule of",
             "# nxgates calibrate, gates/calibrate.py derive_tolerances). Read by: nxgates compare --tolerances FILE.",
             f"# {res['slack_rule']}", ""]
    src = json.dumps(res["source"])
    for gate in GATES:
        if gate in res["proposed"]:
            p = res["proposed"][gate]
            rel, slack = _toml_rel(p["rel"]), repr(float(p["slack"]))
            reason = _reason(gate, p, res["rows"], len(res["benign"]))
        else:
            rel, slack = "0.0", repr(SLACK_FLOOR)
            reason = (f"{GATE_NAMES[gate]}: not measured ({res['not_measured'][gate]}); rel 0, the strictest bound "
                      "(compare reports the gate n/a on records without this data)")
        extra = [f"min_size = {res['n5_min_size']}"] if gate == "N5" and res.get("n5_min_size", 1) > 1 else []
        if extra:
            reason += (f"; N5 reads the tensors of at least {res['n5_min_size']} elements; smaller ones stay in N3, N4 "
                       "and N6")
        lines += [f"[gates.{gate}]", f"rel = {rel}", f"slack = {slack}", *extra, f"reason = {json.dumps(reason)}",
                  f"source = {src}", ""]
    lines += ["[gates.golden]", "rel = 0.0",
              'reason = "not measured from records (a second control run would show whether the control is '
              'reproducible to the bit); 0: bit-identity"', f"source = {src}", ""]
    text = "\n".join(lines)
    tomllib.loads(text)  # a file compare cannot read is never written
    return text


# ------------------------------------------------------------------------------------------------------------ CLI
def add_arguments(sp) -> None:
    sp.add_argument("control", help="the control's run directory (production precision)")
    sp.add_argument("reference", help="the float32 reference's run directory")
    sp.add_argument("benign", nargs="*", help="benign runs (changes that must pass, e.g. another k tile)")
    sp.add_argument("--out", default="tolerances.toml", help="tolerance file to write (default tolerances.toml)")
    sp.add_argument("--json", action="store_true", help="print the measurements and the proposal as JSON")
    sp.add_argument("--n5-min-size", type=int, default=None, metavar="N",
                    help="N5 reads the tensors of at least N elements (default: [gates.N5] min_size of the "
                         "repository's table); written to the file")


def main(args) -> int:
    """Exit 0 written; bad input raises ``ValueError`` (``RecordError`` / ``CompareInputError``), exit 2 in the CLI."""
    out = pathlib.Path(args.out)
    if out.is_dir():
        raise ValueError(f"--out={args.out!r} is a directory; give the tolerance file's path")
    res = calibrate_records(args.control, args.reference, args.benign,
                            n5_min_size=getattr(args, "n5_min_size", None))
    atomic.write_text_atomic(out, res["toml"])
    tolerance_table.load_tolerances(out)  # what compare --tolerances will read
    if args.json:
        print(json.dumps({k: v for k, v in res.items() if k != "toml"}, indent=2, default=str))
        return 0

    def f(x):
        return "-" if x is None else f"{x:.3e}"

    print(f"calibrate-records: control {res['control']}, reference {res['reference']}, "
          f"{len(res['benign'])} benign run(s)")
    from tabulate import tabulate

    print(tabulate([[r["gate"], r["step"], f(r["control_vs_reference"]), f(r["benign_vs_control"]),
                     f(r["benign_vs_reference"]), r["source"]] for r in res["rows"]],
                   headers=["gate", "step", "m(control, ref)", "max m(benign, ctrl)", "worst m(benign, ref)", "from"],
                   tablefmt="simple", disable_numparse=True))
    for g, why in res["not_measured"].items():
        print(f"{g}: not measured ({why}): rel 0, slack {SLACK_FLOOR}")
    print(res["slack_rule"])
    print(tabulate([[g, "[" + ", ".join(f"{x:.3g}" for x in p["rel"]) + "]" if isinstance(p["rel"], list)
                     else f"{p['rel']:g}", "-" if p["benign_ratio"] is None else f"{p['benign_ratio']:.4f}",
                     f"{p['slack']:.2f}"] for g, p in res["proposed"].items()],
                   headers=["gate", "rel", "worst benign ratio above rel", "slack"], tablefmt="simple",
                   disable_numparse=True))
    print(f"wrote {out} (read it with: nxgates compare CONTROL CANDIDATE --reference REF --tolerances {out})")
    return 0
