"""One run of the gates on a config: the checks, the records they need, the golden comparison and the report.

``check(config, flags=None)`` is ``gates.check`` and ``python -m nxgates run``: with ``flags=None`` every tuning flag
alone (``gates.contracts.default_checks``) and the tuned combination, else one check of ``flags``; every combination is
refused or accepted before anything is computed; with ``jobs > 1`` the records are computed first by worker processes
(``gates.prefetch``); the config's control is compared with its golden record (``gates.golden``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from nxgates.gates import golden as golden_lib
from nxgates.gates import protocol
from nxgates.gates import record as record_lib
from nxgates.gates import report as report_lib
from nxgates.gates.model_api import ModelAPI
from nxgates.gates.prefetch import prefetch
from nxgates.gates.runner import Runner, stderr
from nxgates.gates.tolerances import load_tolerances


def announce_prerequisites(specs, progress: Callable[[str], None]) -> None:
    """Say which prerequisite tuning flags a ``--flags`` check added to the user's keys."""
    for spec in specs:
        if spec.added_prerequisites:
            added = ", ".join(f"{k}={v}" for k, v in spec.added_prerequisites.items())
            progress(f"check {spec.name!r}: added the prerequisite tuning flags {added} (the model's rules; the "
                     f"config's tuned values), as the default run does")


def check(
    config: str = "tiny",
    flags: Mapping[str, Any] | None = None,
    *,
    api: ModelAPI | None = None,
    settings: protocol.ProtocolSettings = protocol.DEFAULT_SETTINGS,
    tiles: str = "each",
    cache_dir: str | None = None,
    use_cache: bool = True,
    tolerances_path: str | None = None,
    golden_dir: str | None = None,
    progress: Callable[[str], None] | None = stderr,
    on_check: Callable[[Any], None] | None = None,
    jobs: int = 1,
    explain: bool = True,
):
    """Run the gates: ``flags=None`` checks every tuning flag alone and the tuned combination; otherwise one check
    of ``flags`` ({key: value or string}) plus the prerequisite tuning flags the model's rules name (printed).
    Returns a ``gates.report.Report``. Bad input raises ``ConfigError`` (``model.flags``) or ``BadInput``, both
    ``ValueError``, before anything is computed. ``on_check(partial_report)`` is
    called after each check (the CLI writes the reports so far). ``jobs > 1`` (with the cache and the real model):
    the records are computed first by that many worker processes (``gates.prefetch``), then the checks read them.
    ``explain``: every failing check gets its explanation (``gates.explain``: the first op and layer over its bound)."""
    tols = load_tolerances(tolerances_path) if tolerances_path else load_tolerances()
    runner = Runner(config, api=api, settings=settings,
                    cache=record_lib.RecordCache(cache_dir, log=progress or (lambda m: None)), use_cache=use_cache,
                    tolerances=tols, progress=progress)
    specs = runner.default_specs(tiles) if flags is None else [runner.user_spec(flags)]
    for spec in specs:  # refuse a bad combination before any compile
        runner.resolve(spec)
    if flags is not None and progress:
        announce_prerequisites(specs, progress)
    if progress:
        progress(f"config {config!r}: {len(specs)} check(s): " + ", ".join(f"{s.name} ({s.contract})" for s in specs))
    if jobs > 1 and use_cache and api is None:
        prefetch(runner, specs, jobs, cache_dir)
    checks = []
    for spec in specs:
        checks.append(runner.run_check(spec))
        if explain and not checks[-1].passed:
            from nxgates.gates.explainer import explain_failed

            checks[-1].explanation = explain_failed(runner, spec)
        if on_check is not None and len(checks) < len(specs):
            on_check(report_lib.Report(config=config, checks=list(checks), golden=None, env=runner.env,
                                       tolerances=tols, wall_s=round(time.perf_counter() - runner.t0, 2),
                                       pending=[s.name for s in specs[len(checks):]]))
    base = runner.base_control()
    gold = None
    if base is not None:
        gold = golden_lib.compare_with_golden(config, base[0], tols, golden_dir=golden_dir)
    return report_lib.Report(config=config, checks=checks, golden=gold, env=runner.env, tolerances=tols,
                             wall_s=round(time.perf_counter() - runner.t0, 2))
