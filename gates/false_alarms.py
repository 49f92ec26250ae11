"""``python -m nxgates false-alarms``: benign variants must pass both lenses; how many were tried, how many failed.

A gate that fails correct code is as useless as one that passes wrong code. Three kinds of benign variant, each run as
a ``rounding`` check through the bf16 gates and the float32 lens:

- ``tiles``: every GMM k tile of the config halved and doubled (``gates.calibrate.default_benign``): the same
  arithmetic with the float32 accumulation re-associated. These also set the tables' slack, so passing them shows the
  rule holds as applied; the next two kinds do not enter any table.
- ``folds``: the GDN context-parallel folds (forward and backward) composed left to right in XLA instead of the pairwise
  tree: another association of the same float32 map products (injected through ``model.ops.override``).
- ``seeds``: every rounding check of the default run (each flag alone and the tuned set) on a batch of other seeds
  (tokens, completion mask, advantages; ``Runner(batch_case=...)``): new control, reference and lens records.

Exit 0 when every variant passes both lenses, 1 otherwise (the failing ones are named).

Run: python -m nxgates false-alarms [--config tiny] [--only tiles folds seeds] [--seeds N]
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time

from nxgates.gates import atomic, calibrate, contracts, mutants
from nxgates.gates.errors import BadInput

KINDS = ("tiles", "folds", "seeds")


@dataclasses.dataclass
class Variant:
    kind: str
    name: str
    bf16_passed: bool
    lens_passed: bool | None  # None: the lens did not run
    failed: list[str]  # "bf16 N4", "lens N2", ... (each failing gate once)

    @property
    def passed(self) -> bool:
        return self.bf16_passed and self.lens_passed is not False


def fold_left_to_right(m, b):
    """The maps composed one after the other, map 0 first (n - 1 sequential compositions in XLA): the same float32
    products as ``fold_tree`` in another association."""
    from nxgates.kernels.gdn import context_parallel

    m, b = m.astype("float32"), b.astype("float32")
    acc_m, acc_b = m[0], b[0]
    for i in range(1, m.shape[0]):
        acc_m, acc_b = context_parallel._compose(m[i], b[i], acc_m, acc_b)
    return acc_m, acc_b


def _variant(kind, name, check) -> Variant:
    failed = sorted({f"bf16 {g.gate}" for g in check.results if not g.passed}
                    | {f"lens {g.gate}" for g in check.lens_results or () if not g.passed})
    failed += [f"precondition: {p}" for p in [*check.problems, *check.lens_problems]]
    return Variant(kind, name, check.bf16_passed, check.lens_passed, failed)


def run_false_alarms(config: str = "tiny", *, only=KINDS, seeds: int = 1, api=None, cache_dir=None, progress=None,
                     runner_factory=None) -> list[Variant]:
    """The benign variants of ``only`` (module docstring); ``seeds`` other batches for ``seeds``.
    ``runner_factory(batch_case)``: builds the ``gates.runner.Runner`` for a batch (default: the built-in model's)."""
    from nxgates.gates import record as record_lib
    from nxgates.gates import runner as runner_lib

    progress = progress or (lambda m: print(m, file=sys.stderr, flush=True))
    bad = [k for k in only if k not in KINDS]
    if bad or not only:
        raise BadInput(f"--only {list(only)}: choose among {KINDS}")
    if not isinstance(seeds, int) or isinstance(seeds, bool) or seeds < 1:
        raise BadInput(f"--seeds {seeds!r}: must be an integer >= 1")

    def factory(batch_case: str = "batch"):
        return runner_lib.Runner(config, api=api, cache=record_lib.RecordCache(cache_dir, log=progress),
                                 progress=progress, batch_case=batch_case)

    factory = runner_factory or factory
    r = factory("batch")
    if not r.lens:
        raise BadInput(f"false alarms are counted in both lenses, and {r.tolerances.path} has no [lens.*] bounds "
                       "(python -m nxgates calibrate --lens)")
    base = r.api.as_dict(r.base_flags)
    out: list[Variant] = []

    def note(v: Variant):
        out.append(v)
        progress(f"false-alarms {v.kind} {v.name}: bf16 {'PASS' if v.bf16_passed else 'FAIL'}, float32 lens "
                 f"{ {None: 'n/a', True: 'PASS', False: 'FAIL'}[v.lens_passed] } {v.failed or ''} "
                 f"({time.perf_counter() - r.t0:.0f}s)")

    if "tiles" in only:
        for changes in calibrate.default_benign(r):
            name = ",".join(f"{k}={v}" for k, v in changes.items())
            spec = contracts.build_check(name, changes, base, r.closure)
            note(_variant("tiles", name, r.run_check(spec)))
    if "folds" in only:
        if r.api.override is None:
            raise BadInput("--only folds injects through the model API's override (model.ops.override): none here")
        for op in ("gdn_cp_fold", "gdn_cp_dh_fold"):
            spec = contracts.CheckSpec(name=f"{op} left to right", contract="rounding", candidate_overrides={},
                                       keys=())
            check = r.run_check(spec, candidate_context=functools.partial(
                mutants._overriding, r.api, [(op, fold_left_to_right)]))
            impl = check.implementations["candidate"].get(op, "")
            if not str(impl).startswith("override:"):
                raise RuntimeError(f"false-alarms: the {op} variant never reached the trace (dispatched {impl!r}); "
                                   "this config does not run the GDN context-parallel folds")
            note(_variant("folds", spec.name, check))
    if "seeds" in only:
        for i in range(1, seeds + 1):
            rs = factory(f"batch/false-alarms-{i}")
            for spec in rs.default_specs():
                if spec.contract == "rounding":
                    note(_variant("seeds", f"batch seed {i}: {spec.name}", rs.run_check(spec)))
    return out


def table(variants: list[Variant]) -> str:
    from tabulate import tabulate

    rows = [[v.kind, v.name, "PASS" if v.bf16_passed else "FAIL",
             {None: "n/a", True: "PASS", False: "FAIL"}[v.lens_passed], " ".join(v.failed) or "-"] for v in variants]
    return tabulate(rows, headers=["kind", "variant", "bf16 gates", "float32 lens", "failed"], tablefmt="github",
                    disable_numparse=True)


def summary(variants: list[Variant]) -> str:
    failed = [v for v in variants if not v.passed]
    counts = {k: sum(v.kind == k for v in variants) for k in KINDS}
    per_kind = ", ".join(f"{k} {n}" for k, n in counts.items() if n)
    return (f"{len(variants)} benign variants tried ({per_kind}), {len(failed)} failed"
            + (": " + "; ".join(f"{v.kind} {v.name} ({' '.join(v.failed)})" for v in failed) if failed else ""))


def main(args, api) -> int:
    variants = run_false_alarms(args.config, only=tuple(args.only or KINDS), seeds=args.seeds, api=api,
                                cache_dir=args.cache_dir)
    data = {"config": args.config, "summary": summary(variants), "variants": [dataclasses.asdict(v) for v in variants]}
    atomic.write_json_atomic(f"{args.out}/false-alarms.json", data)
    atomic.write_text_atomic(f"{args.out}/false-alarms.md",
                             f"# False alarms ({args.config})\n\n{summary(variants)}\n\n{table(variants)}\n")
    print(json.dumps(data, indent=2) if args.json else f"{table(variants)}\n\n{summary(variants)}")
    return 0 if all(v.passed for v in variants) else 1
