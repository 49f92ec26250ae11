"""The per-kernel tolerance report: each Pallas kernel and its unfused XLA baseline against the float32 reference.

For every kernel, case and output (forward and each gradient) a row gives rel L2, the max abs error with the two values
at that element, percent close, SQNR (dB), the tolerance (``[kernels."<tol_key>"]`` in ``fixtures/tolerances.toml``,
with its reason and source) and the verdict (PASS when finite and ``rel_l2 <= tol``). The rows come from the case
modules of ``gates/kernel_cases`` (see its ``__init__``). Prints a table and writes ``<out>/kernels.json`` and
``<out>/kernels.md`` atomically.

Run: ``python -m nxgates.kernel_report [--case tiny|medium|cell] [--op moe|gdn|fp8 ...] [--out reports/]``
(also ``python -m nxgates kernels``). Exit 0: every row passes; 1: a row is out of tolerance (or has no tolerance
entry, or is not finite); 2: bad arguments, with a message naming the argument.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import importlib.util
import inspect
import math
import os
import pathlib
import sys
import time
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from nxgates import fixtures
from nxgates.gates import atomic
from nxgates.gates import tolerances as tolerance_table
from nxgates.gates.diff import summarize
from nxgates.gates.kernel_cases import OPS
from nxgates.gates.kernel_cases.base import KernelRow, interpret_mode

DEFAULT_TOLERANCES = fixtures.TOLERANCES
CASE_NAMES = ("tiny", "medium", "cell")


class ArgumentError(ValueError):
    """Bad command-line input (exit 2)."""


def load_tolerances(path: str | os.PathLike = DEFAULT_TOLERANCES) -> dict[str, dict]:
    """The ``[kernels."<key>"]`` entries of the tolerance table: ``{key: {"rel_l2", "reason", "source"}}``.

    Read through the project's one tolerance loader (``gates.tolerances``); a missing or malformed file is an
    ``ArgumentError`` naming ``--tolerances`` and the path."""
    try:
        entries = tolerance_table.load_kernel_tolerances(path)
    except ValueError as e:
        raise ArgumentError(f"--tolerances={str(path)!r}: {e}") from None
    return {k: {"rel_l2": t.rel_l2, "reason": t.reason, "source": t.source} for k, t in entries.items()}


@contextlib.contextmanager
def _overridden(module, overrides: Mapping[str, Callable] | None):
    """Temporarily replace entries of ``module.IMPLS`` (names must exist: a typo must not test the real one)."""
    if not overrides:
        yield
        return
    impls = getattr(module, "IMPLS", None)
    if impls is None:
        raise ValueError(f"overrides given for {module.__name__}, which has no IMPLS table")
    unknown = sorted(set(overrides) - set(impls))
    if unknown:
        raise ValueError(f"overrides={unknown} name no implementation of {module.__name__}; known: {sorted(impls)}")
    saved = {name: impls[name] for name in overrides}
    impls.update(overrides)
    try:
        yield
    finally:
        impls.update(saved)


def evaluate(row: KernelRow, tolerances: Mapping[str, dict]) -> dict:
    """The report's record of one row: the diff summary, its tolerance and the verdict."""
    summary = summarize(row.actual, row.expected)
    entry = tolerances.get(row.tol_key)
    tol = float(entry["rel_l2"]) if entry else None
    if entry is None:
        verdict = "FAIL (no tolerance)"
    elif not summary.finite:
        verdict = "FAIL (non-finite)"
    elif summary.rel_l2 <= tol:
        verdict = "PASS"
    else:
        verdict = "FAIL"
    return {
        "kernel": row.kernel,
        "case": row.case,
        "output": row.output,
        "impl": row.impl,
        "shape": list(np.shape(row.expected)),
        **summary.as_dict(),
        "tol_key": row.tol_key,
        "tol_rel_l2": tol,
        "tol_reason": entry["reason"] if entry else None,
        "tol_source": entry["source"] if entry else None,
        "verdict": verdict,
    }


def _fmt(x: float, spec: str = ".3e") -> str:
    return str(x) if (x is None or (isinstance(x, float) and not math.isfinite(x))) else format(x, spec)


def table_rows(records: list[dict]) -> list[list[str]]:
    out = []
    for r in records:
        idx = r.get("max_abs_index")
        at = f" at {list(idx)}" if idx else ""
        max_abs = f"{_fmt(r['max_abs'])}{at} ({_fmt(r['actual_at_max'], '.5g')} vs {_fmt(r['expected_at_max'], '.5g')})"
        out.append([
            r["kernel"], r["case"], r["output"], r["impl"], _fmt(r["rel_l2"]), max_abs, _fmt(r["pct_close"], ".2f"),
            _fmt(r["sqnr_db"], ".1f"), _fmt(r["tol_rel_l2"], ".1e") if r["tol_rel_l2"] is not None else "-",
            r["verdict"],
        ])
    return out


HEADERS = ["kernel", "case", "output", "impl", "rel L2", "max abs at [index] (actual vs expected)", "% close",
           "SQNR dB", "tol", "verdict"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m nxgates kernels",
        description="Per-kernel tolerance report: Pallas kernels and XLA baselines against the float32 references.",
    )
    p.add_argument(
        "--case",
        default="tiny",
        choices=CASE_NAMES,
        help="shapes: tiny (default, CPU), medium (gdn only: context 4, T=1000), cell (the trainer's shapes)",
    )
    p.add_argument("--op", action="append", choices=sorted(OPS), help="op to report (repeatable; default: all)")
    p.add_argument("--out", default="reports", help="output folder for kernels.json / kernels.md (default reports/)")
    p.add_argument("--kernel", action="append", help="only these kernels (repeatable; ops whose rows take kernels=)")
    p.add_argument("--tolerances", default=str(DEFAULT_TOLERANCES), help="tolerance table (TOML)")
    return p


def _import_rows(op: str):
    module_name, fn_name = OPS[op]
    module = importlib.import_module(module_name)
    return module, getattr(module, fn_name)


def _markdown(meta: dict, records: list[dict]) -> str:
    from tabulate import tabulate

    lines = [
        f"# Kernel tolerance report: case `{meta['case']}`",
        "",
        f"{meta['date']} | jax {meta['jax_version']} | backend {meta['backend']} | interpret {meta['interpret']} | "
        f"exit {meta['exit_code']} | command `{meta['command']}`",
        "",
        tabulate(table_rows(records), headers=HEADERS, tablefmt="github"),
        "",
        "## Tolerances",
        "",
    ]
    seen = set()
    for r in records:
        if r["tol_key"] in seen:
            continue
        seen.add(r["tol_key"])
        lines.append(f"- `{r['tol_key']}` = {r['tol_rel_l2']}: {r['tol_reason']} (source: `{r['tol_source']}`)")
    if meta["skipped"]:
        lines += ["", "## Skipped ops", ""] + [f"- {k}: {v}" for k, v in meta["skipped"].items()]
    return "\n".join(lines) + "\n"


def run(case: str, ops: list[str], tolerances: Mapping[str, dict], overrides=None, kernels=None) -> Iterator[dict]:
    """Evaluate every row of ``ops`` at ``case`` (``overrides``: {op: {impl name: fn}}; ``kernels``: only these)."""
    for op in ops:
        module, rows_fn = _import_rows(op)
        cases = getattr(module, "CASES", ())
        if case not in cases:
            raise ArgumentError(f"--case={case!r} is not a case of op {op!r} (cases: {list(cases)})")
        with _overridden(module, (overrides or {}).get(op)):
            if kernels and "kernels" in inspect.signature(rows_fn).parameters:
                known = getattr(module, "KERNELS", ())
                rows_iter = rows_fn(case, kernels=tuple(k for k in kernels if k in known))
            else:
                rows_iter = rows_fn(case)
            for row in rows_iter:
                if not kernels or row.kernel in kernels:
                    yield evaluate(row, tolerances)


def main(argv: list[str] | None = None, *, overrides: Mapping[str, Mapping[str, Callable]] | None = None) -> int:
    """CLI entry: returns 0 (all rows pass), 1 (a row fails), 2 (bad arguments)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse printed the message naming the argument
        return 0 if e.code == 0 else 2
    out_dir = pathlib.Path(args.out)
    try:
        if out_dir.exists() and not out_dir.is_dir():
            raise ArgumentError(f"--out={args.out!r} exists and is not a directory")
        tolerances = load_tolerances(args.tolerances)
        ops = args.op or sorted(OPS)
        skipped: dict[str, str] = {}
        if not args.op:  # default: every registered op whose case module exists (a missing one is reported)
            for op in list(ops):
                if importlib.util.find_spec(OPS[op][0]) is None:
                    skipped[op] = f"case module {OPS[op][0]} not found"
                    ops.remove(op)
        else:
            for op in ops:
                if importlib.util.find_spec(OPS[op][0]) is None:
                    raise ArgumentError(f"--op={op!r}: case module {OPS[op][0]} not found")
        if overrides:
            unknown = sorted(set(overrides) - set(ops))
            if unknown:
                raise ArgumentError(f"overrides for ops {unknown} that are not run (ops: {ops})")
        import jax

        t0 = time.perf_counter()
        records = list(run(args.case, ops, tolerances, overrides, args.kernel))
        if not records:
            raise ArgumentError(f"--kernel={args.kernel} selects no row of ops {ops}")
        elapsed = time.perf_counter() - t0
    except ArgumentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from tabulate import tabulate

    exit_code = 0 if records and all(r["verdict"] == "PASS" for r in records) else 1
    print(tabulate(table_rows(records), headers=HEADERS))
    for op, why in skipped.items():
        print(f"skipped op {op}: {why}")
    meta = {
        "case": args.case,
        "ops": ops,
        "skipped": skipped,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "interpret": repr(interpret_mode()),
        "elapsed_s": elapsed,
        "command": " ".join(["python -m nxgates.kernel_report", *(argv if argv is not None else sys.argv[1:])]),
        "tolerances": str(args.tolerances),
        "exit_code": exit_code,
    }
    atomic.write_json_atomic(out_dir / "kernels.json", {**meta, "rows": records})
    atomic.write_text_atomic(out_dir / "kernels.md", _markdown(meta, records))
    n_fail = sum(r["verdict"] != "PASS" for r in records)
    print(f"{len(records)} rows, {n_fail} failing, {elapsed:.1f} s; wrote {out_dir / 'kernels.json'} and "
          f"{out_dir / 'kernels.md'}")
    return exit_code

