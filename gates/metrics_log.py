"""Import the scalars of a JSON-lines metrics log into a run record, so N1 (loss) and N3 (gradient norm) run on logs a
pod already wrote: ``nxgates import-metrics METRICS.jsonl OUT_RUN_DIR [--step-key K] [--loss-key K]
[--grad-norm-key K] [--step-offset N] [--first N]``.

The log holds one JSON object per line and per step. The defaults are MaxText's local metrics file
(``metrics_file=...``: ``MetricLogger.write_metrics_locally`` writes ``json.dumps`` of every scalar metric as a Python
float, plus ``"step": float(step)`` and ``"run_name"``): step key ``step``, loss ``learning/loss``, gradient norm
``learning/grad_norm``. MaxText counts steps from 0 (step 0 is the first update); records count from 1 (step 0 holds
the initial parameters), so ``--step-offset`` defaults to 1. Lines without the loss and the gradient-norm keys (eval
lines: ``eval/avg_loss``) are skipped and counted; a step logged twice must carry the same values (a restart that
re-logged it), else it is refused.

**Precision: a log proves only the digits it holds.** Each number keeps the text it was logged as; the import
records, per value, its significant digits and whether the text identifies the trainer's value exactly:
- exact: 17 or more significant digits (identifies a float64), or 9 or more digits of a value that is exactly a
  float32 (MaxText: ``json.dumps(float(x))`` of a float32 prints the shortest text of that double, which identifies
  the float32; the record then stores the float32 itself, bits kept);
- otherwise the value is known to half a unit in its last digit (``resolution``: ``0.5 * 10**e`` with ``e`` the
  decimal exponent of the last digit; a loss logged as ``2.3457`` is somewhere in ``[2.34565, 2.34575]``), stored as
  the float64 of the text.
``compare`` reads this (``logged_resolution``): a difference within the two values' resolutions is not resolved by the
logs, and the report says so; the bit-identity (``exact``) contract cannot be proven from a value that is not exact.
"""

from __future__ import annotations

import hashlib
import json
import math
import pathlib
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

DEFAULT_STEP_KEY = "step"
DEFAULT_LOSS_KEY = "learning/loss"
DEFAULT_GRAD_NORM_KEY = "learning/grad_norm"
DEFAULT_STEP_OFFSET = 1  # MaxText's step 0 is the record's step 1
FIELDS = ("loss", "grad_norm")
META_KEY = "metrics_log"  # meta["extra"][META_KEY]: where the values came from and their logged precision
_FLOAT64_DIGITS, _FLOAT32_DIGITS = 17, 9  # significant digits that identify a float64 / a float32


class _Logged(str):
    """A JSON number kept as its text (json's parse_float / parse_int / parse_constant hooks)."""


def logged_precision(text: str) -> dict:
    """The precision a logged number's text proves: {"value": float64, "digits": significant digits,
    "exact": bool, "float32": the text identifies a float32, "resolution": half a unit in the last digit (0 when
    exact)}. ``text`` is a JSON number (``-1.250e-3``, ``12``) or ``NaN`` / ``Infinity`` / ``-Infinity``."""
    value = float(text)
    if not math.isfinite(value):
        return {"value": value, "digits": 0, "exact": True, "float32": False, "resolution": 0.0}
    mant, _, exp = text.lower().lstrip("+-").partition("e")
    whole, _, frac = mant.partition(".")
    digits_all = (whole + frac).lstrip("0")
    digits = len(digits_all) if digits_all else 1
    last_exp = (int(exp) if exp else 0) - len(frac)  # decimal exponent of the last written digit
    f32 = bool(np.float64(np.float32(value)) == value) if abs(value) < 3.4e38 else False
    exact = digits >= _FLOAT64_DIGITS or (f32 and digits >= _FLOAT32_DIGITS)
    return {"value": value, "digits": digits, "exact": exact, "float32": bool(exact and f32),
            "resolution": 0.0 if exact else 0.5 * 10.0**last_exp}


def _number(obj: Mapping, key: str, where: str) -> _Logged | None:
    if key not in obj:
        return None
    v = obj[key]
    if not isinstance(v, _Logged):
        raise ValueError(f"{where}: {key!r}={v!r} is not a number")
    return v


def read_metrics(path: str | pathlib.Path, *, step_key: str = DEFAULT_STEP_KEY, loss_key: str = DEFAULT_LOSS_KEY,
                 grad_norm_key: str = DEFAULT_GRAD_NORM_KEY, step_offset: int = DEFAULT_STEP_OFFSET,
                 first: int | None = None) -> dict:
    """Parse the log: {"steps": {record step: {"loss": precision dict | None, "grad_norm": ...}}, "skipped": lines
    without either key, "lines": lines read, "sha256": of the file}. Bad input raises ``ValueError`` naming the file,
    line and key."""
    path = pathlib.Path(path)
    if not isinstance(step_offset, int) or isinstance(step_offset, bool):
        raise ValueError(f"metrics log: step_offset={step_offset!r} must be an int")
    if first is not None and (not isinstance(first, int) or first < 1):
        raise ValueError(f"metrics log: first={first!r} must be an int >= 1")
    try:
        raw = path.read_bytes()
    except FileNotFoundError as e:
        raise ValueError(f"metrics log: path={str(path)!r} does not exist") from e
    except IsADirectoryError as e:
        raise ValueError(f"metrics log: path={str(path)!r} is a directory, not a JSON-lines file") from e
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"metrics log: {path} is not UTF-8 text ({e})") from e
    keys = {"loss": loss_key, "grad_norm": grad_norm_key}
    steps: dict[int, dict] = {}
    lines_of: dict[int, int] = {}
    skipped = n_lines = 0
    seen_keys: set[str] = set()
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        n_lines += 1
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line, parse_float=_Logged, parse_int=_Logged, parse_constant=_Logged)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not a JSON object ({e.msg} at column {e.colno})") from e
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: a line must be one JSON object per step, got {type(obj).__name__}")
        seen_keys.update(obj)
        vals = {f: _number(obj, k, where) for f, k in keys.items()}
        if all(v is None for v in vals.values()):
            skipped += 1
            continue
        s = _number(obj, step_key, where)
        if s is None:
            raise ValueError(f"{where}: no step key {step_key!r} (keys: {sorted(obj)[:8]}); pass --step-key")
        sf = float(s)
        if not math.isfinite(sf) or sf != int(sf):
            raise ValueError(f"{where}: step {step_key!r}={s} is not an integer")
        step = int(sf) + step_offset
        if step < 1:
            raise ValueError(f"{where}: step {step_key!r}={s} + step_offset {step_offset} = {step} < 1 (records count "
                             "steps from 1); pass --step-offset")
        entry = {f: None if v is None else {"text": str(v), **logged_precision(v)} for f, v in vals.items()}
        if step in steps:
            if not _same_values(steps[step], entry):
                raise ValueError(f"{where}: step {step} (logged {s}) appears again with other values (first at line "
                                 f"{lines_of[step]}): {_show(steps[step])} vs {_show(entry)}")
            continue
        steps[step], lines_of[step] = entry, lineno
    if not steps:
        raise ValueError(f"metrics log: {path} has no line with the loss key {loss_key!r} or the gradient-norm key "
                         f"{grad_norm_key!r} (keys seen: {sorted(seen_keys)[:12]}); pass --loss-key / --grad-norm-key")
    missing = sorted(s for s, e in steps.items() if e["loss"] is None)
    if missing:
        raise ValueError(f"metrics log: {path}: the loss key {loss_key!r} is missing at record step(s) {missing[:8]} "
                         f"(lines {[lines_of[s] for s in missing[:8]]})")
    kept = sorted(steps)[:first] if first else sorted(steps)
    if kept != list(range(kept[0], kept[0] + len(kept))):
        gaps = sorted(set(range(kept[0], kept[-1] + 1)) - set(kept))
        raise ValueError(f"metrics log: {path}: record steps {kept[0]}..{kept[-1]} have gaps at {gaps[:8]} (log every "
                         "step, or pass --first N to keep the first N steps)")
    return {"steps": {s: steps[s] for s in kept}, "skipped": skipped, "lines": n_lines,
            "sha256": hashlib.sha256(raw).hexdigest(), "keys": {"step": step_key, **keys},
            "step_offset": step_offset}


def _same_values(a: dict, b: dict) -> bool:
    return all((a[f] is None) == (b[f] is None) and (a[f] is None or a[f]["value"] == b[f]["value"]
                                                     or (math.isnan(a[f]["value"]) and math.isnan(b[f]["value"])))
               for f in FIELDS)


def _show(e: dict) -> str:
    return ", ".join(f"{f}={e[f]['text'] if e[f] else None}" for f in FIELDS)


def _array(p: dict) -> np.ndarray:
    """The stored value: the float32 itself when the text identifies one (bits kept), else the float64 of the text."""
    return np.asarray(p["value"], np.float32 if p["float32"] else np.float64)


def import_metrics(path: str | pathlib.Path, out_dir: str | pathlib.Path, *, trainer: str = "metrics-log",
                   overwrite: bool = False, **read_kwargs) -> dict:
    """Write the log's loss and gradient norm as a run record (``gates.records``: one step file pair per step, no
    sketches) and return the parsed log (``read_metrics``). The precision of every value goes into
    ``meta["extra"]["metrics_log"]``."""
    from nxgates.gates import records as records_lib

    parsed = read_metrics(path, **read_kwargs)
    out = pathlib.Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"import-metrics: out_dir={str(out)!r} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ValueError(f"import-metrics: out_dir={str(out)!r} exists and is not empty (pass --overwrite)")
        for p in (out / records_lib.STEPS_DIR).glob("*"):
            p.unlink()
        (out / records_lib.META_FILE).unlink(missing_ok=True)
    precision = {f: {str(s): e[f] for s, e in parsed["steps"].items() if e[f] is not None} for f in FIELDS}
    summary = {f: _summary(list(precision[f].values())) for f in FIELDS}
    extra = {META_KEY: {"source": pathlib.Path(path).name, "sha256": parsed["sha256"], "keys": parsed["keys"],
                        "step_offset": parsed["step_offset"], "lines": parsed["lines"],
                        "skipped_lines": parsed["skipped"], "precision": precision, "summary": summary}}
    meta = records_lib.new_meta(trainer=trainer, sketch=None, extra=extra)
    records_lib.write_meta(out, meta)
    for s, e in parsed["steps"].items():
        records_lib.write_step(out, s, {f: _array(e[f]) for f in FIELDS if e[f] is not None})
        meta["steps"].append(int(s))
    meta["closed"] = True
    records_lib.write_meta(out, meta)
    return parsed | {"summary": summary}


def _summary(ps: list[dict]) -> dict | None:
    """Over one field's values: the fewest significant digits, all exact?, the largest relative resolution."""
    if not ps:
        return None
    rel = [p["resolution"] / abs(p["value"]) for p in ps if p["value"] and math.isfinite(p["value"])]
    return {"min_digits": min(p["digits"] for p in ps), "all_exact": all(p["exact"] for p in ps),
            "all_float32": all(p["float32"] for p in ps), "max_rel_resolution": max(rel) if rel else 0.0}


def logged_resolution(meta: Mapping[str, Any], field: str, step: int) -> float | None:
    """The absolute resolution of ``field`` ("loss" | "grad_norm") at ``step`` of a run imported from a metrics log
    (0.0 when the logged text identifies the value exactly); None for a run that was not imported from a log."""
    info = ((meta.get("extra") or {}).get(META_KEY) or {}).get("precision", {}).get(field)
    if not info:
        return None
    p = info.get(str(step))
    return None if p is None else float(p["resolution"])


def resolved(metric: float, a: float, ra: float, b: float, rb: float) -> tuple[float, float]:
    """The interval a relative-difference metric ``|a - b| / |b|`` lies in when ``a`` and ``b`` are known to ``ra``
    and ``rb`` (absolute): (low, high). With both exact it is (metric, metric)."""
    if ra == 0.0 and rb == 0.0:
        return metric, metric
    if not (math.isfinite(a) and math.isfinite(b)):
        return metric, metric
    d, u = abs(a - b), ra + rb
    den_lo, den_hi = max(abs(b) - rb, 0.0), abs(b) + rb
    low = max(d - u, 0.0) / den_hi if den_hi > 0 else 0.0
    high = (d + u) / den_lo if den_lo > 0 else math.inf
    return low, high


# ------------------------------------------------------------------------------------------------------------ CLI
def add_arguments(sp) -> None:
    sp.add_argument("metrics", help="JSON-lines metrics file (one object per step)")
    sp.add_argument("out", help="run directory to write (the record)")
    sp.add_argument("--step-key", default=DEFAULT_STEP_KEY, help=f"default {DEFAULT_STEP_KEY!r} (MaxText)")
    sp.add_argument("--loss-key", default=DEFAULT_LOSS_KEY, help=f"default {DEFAULT_LOSS_KEY!r} (MaxText)")
    sp.add_argument("--grad-norm-key", default=DEFAULT_GRAD_NORM_KEY,
                    help=f"default {DEFAULT_GRAD_NORM_KEY!r} (MaxText)")
    sp.add_argument("--step-offset", default=str(DEFAULT_STEP_OFFSET),
                    help="added to the logged step (default 1: MaxText's step 0 is the record's step 1)")
    sp.add_argument("--first", default=None, metavar="N", help="keep only the first N steps")
    sp.add_argument("--trainer", default="maxtext", help="the trainer name stored in meta.json (default maxtext)")
    sp.add_argument("--overwrite", action="store_true", help="replace the record in OUT")
    sp.add_argument("--json", action="store_true", help="print the parsed log as JSON")


def _int_arg(name: str, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} must be an integer") from None


def main(args) -> int:
    """``nxgates import-metrics``: exit 0 written, 2 bad input (raised as ValueError, printed by the CLI)."""
    res = import_metrics(args.metrics, args.out, trainer=args.trainer, overwrite=args.overwrite,
                         step_key=args.step_key, loss_key=args.loss_key, grad_norm_key=args.grad_norm_key,
                         step_offset=_int_arg("--step-offset", args.step_offset), first=_int_arg("--first", args.first))
    if args.json:
        print(json.dumps({k: v for k, v in res.items()}, indent=2, default=str))
        return 0
    from tabulate import tabulate

    rows = []
    for s, e in res["steps"].items():
        row = [s]
        for f in FIELDS:
            p = e[f]
            row += ["-", "-"] if p is None else [p["text"], "exact" + (" (float32)" if p["float32"] else "")
                                                 if p["exact"] else f"{p['digits']} digits, +-{p['resolution']:.1e}"]
        rows.append(row)
    print(f"imported {len(rows)} steps from {args.metrics} into {args.out} ({res['lines']} lines, "
          f"{res['skipped']} without the loss or gradient-norm key skipped; logged step + {res['step_offset']} = "
          "record step)")
    print(tabulate(rows, headers=["step", "loss", "loss precision", "grad_norm", "grad_norm precision"],
                   tablefmt="simple", disable_numparse=True))
    for f in FIELDS:
        sm = res["summary"][f]
        if sm is None:
            print(f"{f}: not in the log (key {res['keys'][f]!r}); compare reports its gate n/a", file=sys.stderr)
        elif sm["all_exact"]:
            print(f"{f}: every value logged exactly ({'float32 bits recovered' if sm['all_float32'] else 'float64'})")
        else:
            print(f"{f}: logged to {sm['min_digits']} significant digits at least: differences below "
                  f"{sm['max_rel_resolution']:.1e} (relative) are not resolved by this log, and bit-identity cannot "
                  "be proven from it")
    return 0


def precision_verdict(gate: str, step: int, candidate, control, reference, *, source: str | None, contract: str,
                      vs_control: float, vs_reference: float | None, control_vs_reference: float | None,
                      bounds_at) -> tuple[bool, str]:
    """What the logged precision allows ``compare`` to say about N1 (loss) or N3 (from ``grad_norm``) at ``step``:
    (decidable, note). Not from a log (or every value exact): (True, ""). Otherwise each metric lies in an interval
    (``resolved``) and so does each bound (``bounds_at(m(control, reference))`` -> (bound vs control, bound vs
    reference | None), evaluated at both ends of m(control, reference)'s interval): decidable when some metric lies
    wholly above its bound (a proven failure) or every metric wholly below its bound (a proven pass); the note says
    what the log resolves. Not decidable (compare reports n/a with the note) when an interval overlaps its bound, and
    for the ``exact`` contract on a value that is not exact (a rounded log cannot prove bit-identity)."""
    field = {"N1": "loss", "N3": "grad_norm"}.get(gate)
    if field is None or (gate == "N3" and source != "grad_norm"):
        return True, ""
    runs = {"candidate": candidate, "control": control} | ({"reference": reference} if reference is not None else {})
    res = {k: logged_resolution(r.meta, field, step) or 0.0 for k, r in runs.items()}
    if not any(res.values()):
        return True, ""
    val = {k: float(np.asarray(r.steps[step].get(field), np.float64)) for k, r in runs.items()}
    digits = sorted({p["digits"] for r in runs.values()
                     for p in [((r.meta.get("extra") or {}).get(META_KEY) or {}).get("precision", {})
                               .get(field, {}).get(str(step))] if p})
    logged = f"{field} logged to {'/'.join(map(str, digits))} significant digits"
    if contract == "exact":
        return False, f"{logged}: bit-identity cannot be proven from a rounded log"
    pairs = [("control", vs_control, 0)]
    cr_lo = cr_hi = control_vs_reference
    if reference is not None and vs_reference is not None:
        pairs.append(("reference", vs_reference, 1))
        cr_lo, cr_hi = resolved(control_vs_reference, val["control"], res["control"], val["reference"],
                                res["reference"])
    b_lo, b_hi = bounds_at(cr_lo), bounds_at(cr_hi)
    parts, fails, passes = [], 0, 0
    for other, m, i in pairs:
        lo, hi = resolved(m, val["candidate"], res["candidate"], val[other], res[other])
        blo, bhi = min(b_lo[i], b_hi[i]), max(b_lo[i], b_hi[i])
        parts.append(f"vs {other} in [{lo:.2e}, {hi:.2e}], bound in [{blo:.2e}, {bhi:.2e}]")
        fails += lo > bhi
        passes += hi <= blo
    if not fails and passes < len(pairs):
        return False, f"{logged}: not resolved ({'; '.join(parts)}: they overlap); log more digits"
    return True, f"{logged}: {'; '.join(parts)}"
