"""Check anyone's kernel against the float32 references: ``check_kernel``, ``assert_kernel_close``, adapters, a CLI.

``check_kernel(fn, op)`` calls ``fn`` the way the reference of ``op`` is called (``OPS`` in
``gates/kernel_cases/reference_ops.py``: gmm, tgmm, swiglu, swiglu_bwd, dswiglu, gdn, gdn_chunk_maps, gdn_fold,
fp8_fake_quant) on the project's cases for that op, takes ``jax.vjp`` of it and of the float32 reference with the same
seeded cotangent, and reports for every case and output (the forward outputs, then one gradient per differentiated
argument): rel L2, the max abs error with both values and its index, percent close, SQNR, the tolerance with its key,
reason and source, and the verdict. Every number comes from ``gates/diff.py`` (float64), every verdict from
``gates/kernel_report.evaluate`` (PASS when finite and ``rel_l2 <= tol``).

Tolerances: by default ``[kernels."check.<op>.<dtype>"]`` of ``fixtures/tolerances.toml`` (looked up as
``check.<op>.<output>.<dtype>``, ``check.<op>.<dtype>``, ``check.<op>``, ``check.<dtype>``, most specific first);
``tolerances=`` replaces them with a number (every row), a mapping (``{"<output>": tol, "<output>/<dtype>": tol, "*":
tol}``; a value may be ``{"rel_l2", "reason"}``) or the path of another TOML table of the same form.

``adapter=`` wraps a function of another layout or argument order into the op's convention (``heads_first_gdn``,
``transposed_rhs_gmm``, ``chunks_first_fold``, ``reorder_args``) or states a narrower contract on purpose
(``rows_past_group_sum_unspecified``: a GMM whose rows past ``sum(group_sizes)`` are garbage, compared on the rows that
belong to a group only). The report names the adapter.

Bad input raises ``ValueError`` naming it (an unknown op or case, a bad tolerance) and ``KernelShapeError`` (a
``ValueError``) when the function returns the wrong number of arrays, a wrong shape or a non-float dtype. A function
that raises on a case gives that case's rows the verdict ``ERROR (...)``: it fails, with the message.

CLI: ``nxgates kernels --impl PACKAGE.MODULE:FUNCTION --op OP [--case NAME ...] [--adapter NAME] [--no-grads] [--json]``
(exit 0: every row passes; 1: a row fails; 2: bad input, named: an import path that does not resolve, an unknown op or
case, an output of the wrong shape).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from nxgates.gates import atomic, kernel_report
from nxgates.gates.kernel_cases.base import KernelRow
from nxgates.gates.kernel_cases.reference_ops import OPS, Case, OpSpec, cotangent

__all__ = [
    "ADAPTERS",
    "KernelReport",
    "KernelShapeError",
    "OPS",
    "assert_kernel_close",
    "check_kernel",
    "chunks_first_fold",
    "heads_first_gdn",
    "main",
    "reorder_args",
    "rows_past_group_sum_unspecified",
    "transposed_rhs_gmm",
]

CASE_SETS = ("default", "cell", "all")


class KernelShapeError(ValueError):
    """The function's outputs do not have the op's structure, shapes or a floating dtype."""


# --------------------------------------------------------------------------------------------------------- adapters


def _name(fn) -> str:
    if isinstance(fn, str):
        return fn
    inner = getattr(fn, "func", None)  # functools.partial
    if inner is not None:
        return f"partial({_name(inner)})"
    module, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if qual is None:
        return type(fn).__name__
    return f"{module}:{qual}" if module else qual


def _named(adapted, adapter: str, fn):
    adapted.__name__ = adapted.__qualname__ = f"{adapter}({_name(fn)})"
    adapted.adapter_name = adapter
    return adapted


def heads_first_gdn(fn: Callable) -> Callable:
    """A GDN taking heads-first ``q, k [B, H, T, K]``, ``v [B, H, T, V]``, ``g, beta [B, H, T]`` (state ``[B, H, K,
    V]``) and returning ``o [B, H, T, V]``, called in the ``[B, T, H, K]`` convention of ``gdn``."""

    def adapted(q, k, v, g, beta, initial_state):
        # [B, T, H, ...] <-> [B, H, T, ...]
        o, final_state = fn(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v, g, beta)), initial_state)
        return jnp.swapaxes(o, 1, 2), final_state

    return _named(adapted, "heads_first_gdn", fn)


def transposed_rhs_gmm(fn: Callable) -> Callable:
    """A GMM taking its weights transposed, ``rhs_t [G, n, k]``, called as ``gmm(lhs, rhs [G, k, n], group_sizes)``."""

    def adapted(lhs, rhs, group_sizes):
        return fn(lhs, jnp.swapaxes(rhs, 1, 2), group_sizes)  # [G, k, n] -> [G, n, k]

    return _named(adapted, "transposed_rhs_gmm", fn)


def chunks_first_fold(fn: Callable) -> Callable:
    """A fold taking the chunk axis first, ``m [N, B, H, K, K]``, ``b [N, B, H, K, V]`` (``kernels.gdn``'s folds)."""

    def adapted(m, b):
        return fn(jnp.moveaxis(m, 1, 0), jnp.moveaxis(b, 1, 0))  # [B, N, ...] -> [N, B, ...]

    return _named(adapted, "chunks_first_fold", fn)


def rows_past_group_sum_unspecified(fn: Callable) -> Callable:
    """A GMM whose contract leaves the rows past ``sum(group_sizes)`` unspecified (megablox leaves them unwritten).

    Zeroes those rows of ``lhs`` going in and of the output coming out (a select, so their gradient is exactly 0 and
    garbage there cannot reach the routed rows' gradients): the check then compares what the kernel promises.
    Without this adapter such a kernel fails the cases with rows past the sum, the right verdict for a caller that
    reads those rows.
    """

    def adapted(lhs, rhs, group_sizes):
        routed = (jnp.arange(lhs.shape[0]) < jnp.sum(group_sizes))[:, None]  # [m, 1]
        out = fn(jnp.where(routed, lhs, jnp.zeros_like(lhs)), rhs, group_sizes)
        return jnp.where(routed, out, jnp.zeros_like(out))

    return _named(adapted, "rows_past_group_sum_unspecified", fn)


def reorder_args(*positions: int) -> Callable[[Callable], Callable]:
    """An adapter for another argument order: ``fn`` receives the op's arguments ``args[positions[0]], ...``.

    E.g. a GMM ``fn(group_sizes, lhs, rhs)`` is checked with ``adapter=reorder_args(2, 0, 1)``.
    """
    if not positions or sorted(positions) != list(range(len(positions))):
        raise ValueError(f"reorder_args{positions}: positions must be a permutation of 0..n-1")

    def adapter(fn):
        def adapted(*args, **kwargs):
            if len(args) != len(positions):
                raise ValueError(f"reorder_args{positions}: the op passes {len(args)} arguments")
            return fn(*(args[i] for i in positions), **kwargs)

        return _named(adapted, f"reorder_args{positions}", fn)

    adapter.__name__ = f"reorder_args{positions}"
    return adapter


ADAPTERS: dict[str, Callable[[Callable], Callable]] = {
    "heads_first_gdn": heads_first_gdn,
    "transposed_rhs_gmm": transposed_rhs_gmm,
    "chunks_first_fold": chunks_first_fold,
    "rows_past_group_sum_unspecified": rows_past_group_sum_unspecified,
}


# ------------------------------------------------------------------------------------------------------------ report


@dataclasses.dataclass(frozen=True)
class KernelReport:
    """The rows of one ``check_kernel`` run (``rows``: the records of ``kernel_report.evaluate``, one per case and
    output) and what produced them."""

    op: str
    impl: str
    adapter: str | None
    grads: bool
    cases: tuple[str, ...]
    rows: tuple[dict, ...]
    elapsed_s: float

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r["verdict"] == "PASS" for r in self.rows)

    @property
    def failures(self) -> list[dict]:
        return [r for r in self.rows if r["verdict"] != "PASS"]

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def table(self, tablefmt: str = "simple") -> str:
        from tabulate import tabulate

        body = [[r[1], r[2], *r[4:]] for r in kernel_report.table_rows(list(self.rows))]  # without kernel and impl
        headers = [h for i, h in enumerate(kernel_report.HEADERS) if i not in (0, 3)]
        return tabulate(body, headers=headers, tablefmt=tablefmt, disable_numparse=True)

    def failure_lines(self) -> list[str]:
        """One line per failing row: the case, the output, the metric against its tolerance and the worst element."""
        lines = []
        for r in self.failures:
            where = f"{self.op} case {r['case']!r} output {r['output']!r}"
            if r["verdict"].startswith("ERROR"):
                lines.append(f"{r['verdict']}: {where}")
                continue
            tol = "no tolerance" if r["tol_rel_l2"] is None else f"tol {r['tol_rel_l2']:.1e} ({r['tol_key']})"
            idx = list(r["max_abs_index"])
            lines.append(
                f"{r['verdict']}: {where}: rel L2 {r['rel_l2']:.3e} vs {tol}; worst element {r['output']}{idx}: "
                f"actual {r['actual_at_max']:.6g} vs expected {r['expected_at_max']:.6g} (|diff| {r['max_abs']:.3e})"
            )
        return lines

    def tolerance_lines(self, reasons: bool = True) -> list[str]:
        """One line per tolerance used: key = value, its reason (the JSON and Markdown keep it) and its source."""
        seen, lines = set(), []
        for r in self.rows:
            if r["tol_key"] in seen or r["tol_rel_l2"] is None:
                continue
            seen.add(r["tol_key"])
            reason = f": {r['tol_reason']}" if reasons else ""
            lines.append(f"{r['tol_key']} = {r['tol_rel_l2']}{reason} (source: {r['tol_source']})")
        return lines

    def header(self) -> str:
        adapter = f" via {self.adapter}" if self.adapter else ""
        return (f"check_kernel: op {self.op}, impl {self.impl}{adapter}, {len(self.cases)} cases, "
                f"gradients {'on' if self.grads else 'off'}")

    def verdict_line(self) -> str:
        n_fail = len(self.failures)
        word = "PASS" if self.passed else "FAIL"
        return f"{word}: {len(self.rows)} rows, {n_fail} failing, {self.elapsed_s:.1f} s"

    def __str__(self) -> str:
        parts = [self.header(), "", self.table(), ""]
        parts += self.failure_lines()
        parts += ["", "tolerances:", *("  " + t for t in self.tolerance_lines(reasons=False)), self.verdict_line()]
        return "\n".join(parts)

    def to_dict(self) -> dict:
        """JSON-ready (non-finite floats as strings)."""
        return atomic._jsonable({
            "op": self.op, "impl": self.impl, "adapter": self.adapter, "grads": self.grads, "cases": list(self.cases),
            "passed": self.passed, "exit_code": self.exit_code, "elapsed_s": self.elapsed_s,
            "failures": self.failure_lines(), "tolerances": self.tolerance_lines(),
            "rows": [dict(r) for r in self.rows],
        })  # fmt: skip


# ------------------------------------------------------------------------------------------------------- tolerances

_ARGUMENT_SOURCE = "tolerances= argument of check_kernel"


def _tolerance_resolver(tolerances) -> Callable[[str, str, str], tuple[str, dict | None]]:
    """-> ``resolve(op, output, dtype_tag) -> (key, {"rel_l2", "reason", "source"} or None)``."""
    if tolerances is None or isinstance(tolerances, str | os.PathLike):
        path = kernel_report.DEFAULT_TOLERANCES if tolerances is None else tolerances
        try:
            table = kernel_report.load_tolerances(path)
        except kernel_report.ArgumentError as e:
            raise ValueError(str(e).replace("--tolerances=", "tolerances=")) from None

        def from_table(op, output, tag):
            for key in (f"check.{op}.{output}.{tag}", f"check.{op}.{tag}", f"check.{op}", f"check.{tag}"):
                if key in table:
                    return key, table[key]
            return f"check.{op}.{tag}", None

        return from_table
    if isinstance(tolerances, bool) or not isinstance(tolerances, int | float | Mapping):
        raise ValueError(f"tolerances={tolerances!r} must be None, a number, a mapping or the path of a TOML table")
    if not isinstance(tolerances, Mapping):
        tolerances = {"*": tolerances}
    entries = {}
    for key, value in tolerances.items():
        entry = dict(value) if isinstance(value, Mapping) else {"rel_l2": value}
        rel = entry.get("rel_l2")
        if isinstance(rel, bool) or not isinstance(rel, int | float) or not rel >= 0:
            raise ValueError(f"tolerances[{key!r}]={value!r}: rel_l2 must be a number >= 0")
        entry.setdefault("reason", "given by the caller")
        entry["source"] = _ARGUMENT_SOURCE
        entries[key] = entry

    def from_argument(op, output, tag):
        for key in (f"{output}/{tag}", output, f"*/{tag}", "*"):
            if key in entries:
                return f"tolerances[{key!r}]", entries[key]
        return f"tolerances[{output!r}]", None

    return from_argument


# ---------------------------------------------------------------------------------------------------------- running


def _split(args: Mapping[str, object]) -> tuple[list[str], list[str]]:
    """Argument names holding arrays (traced) and the rest (static: None, ints, tuples)."""
    arrays = [n for n, x in args.items() if isinstance(x, jax.Array | np.ndarray)]
    return arrays, [n for n in args if n not in arrays]


def _program(fn, args: Mapping[str, object], kwargs: Mapping[str, object], diff: list[str]):
    """``run(*arrays) -> (outputs, grads or None, cts)``: a jitted forward and VJP of ``fn`` with static args bound."""
    array_names, _ = _split(args)

    def bind(arrays):
        full = dict(args)
        full.update(zip(array_names, arrays, strict=True))
        return full

    def forward(*arrays):
        return fn(*bind(arrays).values(), **kwargs)

    def forward_and_vjp(cts, *arrays):
        full = bind(arrays)

        def call(*d):
            full.update(zip(diff, d, strict=True))
            return fn(*full.values(), **kwargs)

        out, vjp = jax.vjp(call, *(full[n] for n in diff))
        leaves, treedef = jax.tree.flatten(out)
        ct = jax.tree.unflatten(treedef, [c.astype(leaf.dtype) for c, leaf in zip(cts, leaves, strict=True)])
        return out, vjp(ct)

    return array_names, forward, forward_and_vjp


def _host(x) -> np.ndarray:
    return np.asarray(jax.device_get(x))


_EXPECTED_CACHE: dict[tuple, dict[str, np.ndarray]] = {}  # (op, case id, gradients) -> results; small cases only


def _expected(spec: OpSpec, case: Case, args, kwargs, diff, cts_by_name) -> dict[str, np.ndarray]:
    """The float32 reference's outputs and gradients (on the float32 upcast of the case's arrays), computed once per
    process for a case that is not a ``cell`` case (the inputs are a function of the case id)."""
    key = (spec.name, case.case_id, tuple(diff))
    if key in _EXPECTED_CACHE:
        return _EXPECTED_CACHE[key]
    result = _expected_uncached(spec, case, args, kwargs, diff, cts_by_name)
    if not case.cell:
        _EXPECTED_CACHE[key] = result
    return result


def _expected_uncached(spec: OpSpec, case: Case, args, kwargs, diff, cts_by_name) -> dict[str, np.ndarray]:
    f32 = {n: (jnp.asarray(x, jnp.float32) if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)
               else x) for n, x in args.items()}  # fmt: skip
    if spec.expected is not None:
        return spec.expected(case, f32, kwargs, cts_by_name)
    array_names, _, forward_and_vjp = _program(spec.reference, f32, kwargs, diff)
    cts = [cts_by_name[o] for o in spec.outputs]
    out, grads = jax.jit(forward_and_vjp)(cts, *(f32[n] for n in array_names))
    result = dict(zip(spec.outputs, (_host(x) for x in jax.tree.leaves(out)), strict=True))
    result.update({spec.grad_name(n): _host(g) for n, g in zip(diff, grads, strict=True)})
    return result


def _reference_shapes(spec: OpSpec, args, kwargs) -> list[jax.ShapeDtypeStruct]:
    array_names, _ = _split(args)
    f32 = {n: (jax.ShapeDtypeStruct(x.shape, jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype)
               if n in array_names else x) for n, x in args.items()}  # fmt: skip
    arrays = [f32[n] for n in array_names]

    def call(*a):
        full = dict(f32)
        full.update(zip(array_names, a, strict=True))
        return spec.reference(*full.values(), **kwargs)

    return jax.tree.leaves(jax.eval_shape(call, *arrays))


def _check_structure(spec: OpSpec, case: Case, impl: str, got, want) -> None:
    leaves = jax.tree.leaves(got)
    names = ", ".join(spec.outputs)
    if len(leaves) != len(want):
        raise KernelShapeError(
            f"{impl} returned {len(leaves)} array(s) for op {spec.name!r} (case {case.name!r}); the op returns "
            f"{len(want)}: {names}"
        )
    for name, g, w in zip(spec.outputs, leaves, want, strict=True):
        if tuple(g.shape) != tuple(w.shape):
            raise KernelShapeError(
                f"{impl} output {name!r} of op {spec.name!r} has shape {tuple(g.shape)} in case {case.name!r}; "
                f"the reference's is {tuple(w.shape)} (convention: {spec.signature})"
            )
        if not jnp.issubdtype(g.dtype, jnp.floating):
            raise KernelShapeError(
                f"{impl} output {name!r} of op {spec.name!r} has dtype {g.dtype} in case {case.name!r}; it must be a "
                "floating dtype"
            )


def _error_record(op, case, output, impl, exc: BaseException, tol, stage: str = "calling it") -> dict:
    key, entry = tol
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else "(no message)"
    nan = math.nan
    return {
        "kernel": op, "case": case, "output": output, "impl": impl, "shape": None, "rel_l2": nan, "max_abs": nan,
        "max_abs_index": (), "actual_at_max": nan, "expected_at_max": nan, "pct_close": nan, "sqnr_db": nan,
        "finite": False, "size": 0, "tol_key": key, "tol_rel_l2": entry["rel_l2"] if entry else None,
        "tol_reason": entry["reason"] if entry else None, "tol_source": entry["source"] if entry else None,
        "verdict": f"ERROR ({stage} raised {type(exc).__name__}: {msg[:300]})",
    }  # fmt: skip


def _run_case(fn, impl: str, spec: OpSpec, case: Case, grads: bool, resolve) -> list[dict]:
    args, kwargs = case.build()
    diff = [n for n in spec.grads if args.get(n) is not None] if grads else []
    ref_shapes = _reference_shapes(spec, args, kwargs)
    cts_by_name = {o: cotangent(case.case_id, o, s.shape) for o, s in zip(spec.outputs, ref_shapes, strict=True)}
    cts = [cts_by_name[o] for o in spec.outputs]
    grad_outputs = [spec.grad_name(n) for n in diff]
    tol = {o: resolve(spec.name, o, case.dtype) for o in [*spec.outputs, *grad_outputs]}

    array_names, forward, forward_and_vjp = _program(fn, args, kwargs, diff)
    arrays = [args[n] for n in array_names]
    try:
        got_shapes = jax.eval_shape(forward, *arrays)
    except Exception as e:  # the function cannot run this case: every row of it fails with the message
        return [_error_record(spec.name, case.name, o, impl, e, tol[o]) for o in tol]
    _check_structure(spec, case, impl, got_shapes, ref_shapes)

    grad_error = None
    try:
        if diff:
            out, grads_out = jax.jit(forward_and_vjp)(cts, *arrays)
        else:
            out, grads_out = jax.jit(forward)(*arrays), ()
    except Exception as e:
        if not diff:
            return [_error_record(spec.name, case.name, o, impl, e, tol[o]) for o in tol]
        grad_error = e  # the forward may still run: report it, and the gradients as errors
        try:
            out, grads_out = jax.jit(forward)(*arrays), None
        except Exception as e2:
            return [_error_record(spec.name, case.name, o, impl, e2, tol[o]) for o in tol]

    expected = _expected(spec, case, args, kwargs, diff, cts_by_name)
    actual = dict(zip(spec.outputs, (_host(x) for x in jax.tree.leaves(out)), strict=True))
    if grads_out is not None:
        actual.update({spec.grad_name(n): _host(g) for n, g in zip(diff, grads_out, strict=True)})
    records = []
    for output in tol:
        if output not in actual:
            stage = "jax.vjp of it (no VJP? check with grads=False / --no-grads)"
            records.append(_error_record(spec.name, case.name, output, impl, grad_error, tol[output], stage))
            continue
        key, entry = tol[output]
        row = KernelRow(spec.name, case.name, output, impl, actual[output], expected[output], key)
        records.append(kernel_report.evaluate(row, {key: entry} if entry else {}))
    return records


def select_cases(op: str, cases="default") -> list[Case]:
    """``cases``: ``"default"`` (every case but the cell's), ``"cell"``, ``"all"``, a case name, or a list of these."""
    spec = _spec(op)
    names = [cases] if isinstance(cases, str) else list(cases)
    if not names:
        raise ValueError(f"cases={cases!r} selects no case of op {op!r}")
    chosen: list[Case] = []
    for name in names:
        if name == "default":
            picked = [c for c in spec.cases if not c.cell]
        elif name == "cell":
            picked = [c for c in spec.cases if c.cell]
        elif name == "all":
            picked = list(spec.cases)
        else:
            picked = [c for c in spec.cases if c.name == name or c.name.split("/")[0] == name]
            if not picked:
                raise ValueError(
                    f"cases={name!r} is not a case of op {op!r}; cases: {[c.name for c in spec.cases]} "
                    f"(or one of {list(CASE_SETS)}, or a kind without its dtype)"
                )
        chosen += [c for c in picked if c not in chosen]
    return chosen


def _spec(op: str) -> OpSpec:
    if op not in OPS:
        raise ValueError(f"op={op!r} is not an op; ops: {sorted(OPS)}")
    return OPS[op]


def check_kernel(fn: Callable, op: str, *, cases: str | Iterable[str] = "default", grads: bool = True,
                 tolerances=None, adapter: Callable[[Callable], Callable] | None = None) -> KernelReport:
    """Run ``fn`` on the cases of ``op`` against the float32 reference, forward and every gradient.

    Args:
      fn: the implementation, called like the op's reference (see ``gates/kernel_cases/reference_ops.py``); it may
        return any dtype of floats (bf16 outputs are compared as they are).
      op: one of ``OPS`` (gmm, tgmm, swiglu, swiglu_bwd, dswiglu, gdn, gdn_chunk_maps, gdn_fold, fp8_fake_quant).
      cases: ``"default"``, ``"cell"`` (the trainer's shapes: slow on CPU), ``"all"``, a case name (``"awkward/bf16"``
        or ``"awkward"`` for both dtypes) or a list of these.
      grads: also compare the gradients (``jax.vjp`` of ``fn`` and of the reference with the same cotangent).
      tolerances: None (the project's table), a number, a mapping or a TOML path (see the module docstring).
      adapter: ``adapter(fn)`` is what gets called (``ADAPTERS``, ``reorder_args``, or your own).

    Returns:
      a ``KernelReport`` (``.passed``, ``.failures``, ``str(report)`` prints the table).

    Raises:
      ValueError: an unknown op or case, a bad tolerance; ``KernelShapeError`` when an output's count, shape or dtype
      does not match the op's.
    """
    spec = _spec(op)
    chosen = select_cases(op, cases)
    if not callable(fn):
        raise ValueError(f"fn={fn!r} is not callable")
    if adapter is not None and not callable(adapter):
        raise ValueError(f"adapter={adapter!r} is not callable")
    resolve = _tolerance_resolver(tolerances)
    impl = _name(fn)
    called = adapter(fn) if adapter is not None else fn
    t0 = time.perf_counter()
    rows: list[dict] = []
    for case in chosen:
        rows += _run_case(called, impl, spec, case, grads, resolve)
    return KernelReport(op=op, impl=impl, adapter=_name(adapter) if adapter is not None else None, grads=grads,
                        cases=tuple(c.name for c in chosen), rows=tuple(rows), elapsed_s=time.perf_counter() - t0)


def assert_kernel_close(fn: Callable, op: str, **kwargs) -> KernelReport:
    """``check_kernel`` for a pytest suite: returns the report if every row passes, else raises ``AssertionError``
    with the table and one line per failing row (case, output, worst element)."""
    report = check_kernel(fn, op, **kwargs)
    if not report.passed:
        raise AssertionError(f"{report.op}: {len(report.failures)} of {len(report.rows)} rows fail\n{report}")
    return report


# --------------------------------------------------------------------------------------------------------------- CLI


class _BadInput(ValueError):
    pass


def resolve_callable(path: str, *, arg: str = "--impl") -> Callable:
    """``PACKAGE.MODULE:ATTRIBUTE[.ATTRIBUTE]`` -> the callable; ``_BadInput`` naming the argument otherwise."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise _BadInput(f"{arg}={path!r} must read PACKAGE.MODULE:FUNCTION")
    if os.getcwd() not in sys.path:  # the console script does not put the working directory on the path
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise _BadInput(f"{arg}={path!r}: module {module_name!r} not found ({e})") from None
    except Exception as e:  # the module exists but importing it fails: say so, without its traceback
        raise _BadInput(f"{arg}={path!r}: importing {module_name!r} raised {type(e).__name__}: {e}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise _BadInput(f"{arg}={path!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise _BadInput(f"{arg}={path!r}: {attr!r} is a {type(obj).__name__}, not a function")
    return obj


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nxgates kernels --impl",
        description="Check a kernel against the float32 reference of an op, forward and gradients, on the project's "
                    "cases.",
    )  # fmt: skip
    p.add_argument("--impl", required=True, metavar="PACKAGE.MODULE:FUNCTION", help="the function to check")
    p.add_argument("--op", required=True, help=f"the op: {', '.join(sorted(OPS))}")
    p.add_argument("--case", action="append", metavar="NAME",
                   help="default | cell | all | a case name (repeatable; default: default)")
    p.add_argument("--adapter", help=f"{' | '.join(ADAPTERS)} | PACKAGE.MODULE:FUNCTION (adapter(fn) -> fn)")
    p.add_argument("--no-grads", action="store_true", help="forward only (a kernel without a VJP)")
    p.add_argument("--tolerances", default=None, help="tolerance table (TOML; default the project's)")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    p.add_argument("--out", default=None, help="also write <out>/check_<op>.json and .md")
    return p


def main(argv: list[str] | None = None) -> int:
    """``nxgates kernels --impl ...``: 0 every row passes, 1 a row fails, 2 bad input (named)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse printed the message naming the argument
        return 0 if e.code == 0 else 2
    try:
        if args.op not in OPS:
            raise _BadInput(f"--op={args.op!r} is not an op; ops: {', '.join(sorted(OPS))}")
        try:
            cases = select_cases(args.op, args.case or "default")
        except ValueError as e:
            raise _BadInput(str(e).replace("cases=", "--case=")) from None
        if args.out is not None and pathlib.Path(args.out).exists() and not pathlib.Path(args.out).is_dir():
            raise _BadInput(f"--out={args.out!r} exists and is not a directory")
        if args.tolerances is not None and not pathlib.Path(args.tolerances).is_file():
            raise _BadInput(f"--tolerances={args.tolerances!r}: file not found")
        adapter = None
        if args.adapter is not None:
            adapter = ADAPTERS.get(args.adapter)
            if adapter is None:
                if ":" not in args.adapter:
                    raise _BadInput(f"--adapter={args.adapter!r} is not an adapter; adapters: {', '.join(ADAPTERS)} "
                                    "or PACKAGE.MODULE:FUNCTION")
                adapter = resolve_callable(args.adapter, arg="--adapter")
        fn = resolve_callable(args.impl)
        report = check_kernel(fn, args.op, cases=[c.name for c in cases], grads=not args.no_grads,
                              tolerances=args.tolerances, adapter=adapter)
    except (_BadInput, ValueError) as e:  # KernelShapeError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, sort_keys=True))
    else:
        print(report)
    if args.out is not None:
        out = pathlib.Path(args.out)
        atomic.write_json_atomic(out / f"check_{args.op}.json", {**report.to_dict(), "command": " ".join(
            ["nxgates kernels", *argv])})
        atomic.write_text_atomic(out / f"check_{args.op}.md", _markdown(report, argv))
    return report.exit_code


def _markdown(report: KernelReport, argv: list[str]) -> str:
    lines = [f"# {report.header()}", "", f"jax {jax.__version__} | backend {jax.default_backend()} | exit "
             f"{report.exit_code} | command `nxgates kernels {' '.join(argv)}`", "", report.table("github"), ""]
    lines += [f"- {line}" for line in report.failure_lines()]
    lines += ["", "## Tolerances", ""] + [f"- {t}" for t in report.tolerance_lines()]
    return "\n".join(lines) + "\n"
