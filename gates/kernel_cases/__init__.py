"""Case modules of the per-kernel tolerance report (``gates/kernel_report.py``).

Each op of ``--op`` names a module here and the function in it that yields the rows:

- a module ``gates/kernel_cases/<module>.py`` exposes ``CASES: tuple[str, ...]`` (including ``"tiny"`` and
  ``"cell"``) and a rows function ``rows(case) -> Iterator[KernelRow]``;
- a module may expose ``IMPLS: dict[str, Callable]``: the implementations its rows call, looked up at call time, so
  the report (and its tests) can substitute one (``kernel_report.main(argv, overrides={op: {name: fn}})``), e.g. a
  deliberately wrong epilogue that the report must fail.

``OPS`` maps each op name to ``(module, rows function name)``; the fp8 rows live in ``moe.py`` beside the MoE kernels
they feed (``fp8_rows``).
"""

from __future__ import annotations

OPS: dict[str, tuple[str, str]] = {
    "moe": ("nxgates.gates.kernel_cases.moe", "rows"),
    "gdn": ("nxgates.gates.kernel_cases.gdn", "rows"),
    "fp8": ("nxgates.gates.kernel_cases.moe", "fp8_rows"),
}
