"""One run of the gates on a config: the checks, the records they need, the golden comparison and the report.

``check(config, flags=None)`` is ``gates.check`` and ``python -m nxgates run``: with ``flags=None`` every tuning flag
alone (``gates.contracts.default_checks``) and the tuned combination, else one check of ``flags``; every combination is
refused or accepted before anything is computed; with ``jobs > 1`` the records are computed first by worker processes
(``gates.prefetch``); the config's control is compared with its golden record (``gates.golden``).
"""

from __future__ import annotations

import os
import pathlib
import platform
import time
from collections.abc import Callable, Mapping
from typing import Any

from nxgates.gates import golden as golden_lib
from nxgates.gates import protocol
from nxgates.gates import record as record_lib
from nxgates.gates import report as report_lib
from nxgates.gates.errors import BadInput
from nxgates.gates.model_api import ModelAPI
from nxgates.gates.prefetch import prefetch
from nxgates.gates.provenance import git_commit
from nxgates.gates.runner import Runner, stderr
from nxgates.gates.tolerances import load_tolerances


def announce_prerequisites(specs, progress: Callable[[str], None]) -> None:
    """Say which prerequisite tuning flags a ``--flags`` check added to the user's keys."""
    for spec in specs:
        if spec.added_prerequisites:
            added = ", ".join(f"{k}={v}" for k, v in spec.added_prerequisites.items())
            progress(f"check {spec.name!r}: added the prerequisite tuning flags {added} (the model's rules; the "
                     f"config's tuned values), as the default run does")


class _StopAtFailure(Exception):
    """``fail_fast``: a check failed; raised out of ``prefetch``'s ``on_ready`` (which stops its workers) or out of
    the checks' loop, and caught in ``check``."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM through the CLI) during ``check``: ``report`` holds the checks done so far, status
    "interrupted". A ``KeyboardInterrupt``, so code that does not know it still stops as on any Ctrl-C."""

    def __init__(self, report):
        super().__init__("interrupted")
        self.report = report


def _validate_args(config, flags, api, settings, tiles, cache_dir, use_cache, tolerances_path, golden_dir, progress,
                   on_check, jobs, api_factory, command) -> None:
    """``BadInput`` (a ``ValueError``) naming the argument and its value, before anything is loaded or computed."""
    path_like = (str, os.PathLike)
    if not isinstance(config, path_like) or not str(config).strip():
        raise BadInput(f"config={config!r} must be a config name (e.g. 'tiny') or the path of a .toml file")
    if flags is not None:
        if not isinstance(flags, Mapping):
            hint = " (e.g. {'moe_wi_gmm_fused_swiglu': True}; the CLI's 'k=v' strings are for --flags)" \
                if isinstance(flags, (str, list, tuple)) else ""
            raise BadInput(f"flags={flags!r} must be a mapping {{key: value}} or None (every tuning flag){hint}")
        for key in flags:
            if not isinstance(key, str):
                raise BadInput(f"flags: key {key!r} must be a flag name (str)")
    if api is not None and not isinstance(api, ModelAPI):
        raise BadInput(f"api={api!r} must be a gates.model_api.ModelAPI or None (the real model)")
    if not isinstance(settings, protocol.ProtocolSettings):
        raise BadInput(f"settings={settings!r} must be a gates.protocol.ProtocolSettings")
    if tiles not in ("each", "grouped"):
        raise BadInput(f"tiles={tiles!r} must be 'each' or 'grouped'")
    for name, value in (("cache_dir", cache_dir), ("tolerances_path", tolerances_path), ("golden_dir", golden_dir)):
        if value is not None and (not isinstance(value, path_like) or not str(value).strip()):
            raise BadInput(f"{name}={value!r} must be a path (str or os.PathLike) or None")
    if not isinstance(use_cache, bool):
        raise BadInput(f"use_cache={use_cache!r} must be True or False")
    for name, value in (("progress", progress), ("on_check", on_check)):
        if value is not None and not callable(value):
            raise BadInput(f"{name}={value!r} must be callable or None")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise BadInput(f"jobs={jobs!r} must be an int >= 1 (1: everything in this process)")
    if api_factory is not None and (not isinstance(api_factory, str) or ":" not in api_factory):
        raise BadInput(f"api_factory={api_factory!r} must be 'package.module:function' (a ModelAPI factory that "
                       "worker processes can import) or None")
    if command is not None and not isinstance(command, str):
        raise BadInput(f"command={command!r} must be a str (how the run was started, for the report) or None")
    if golden_dir is not None and not pathlib.Path(golden_dir).is_dir():
        raise BadInput(f"golden_dir={str(golden_dir)!r} is not a directory (the golden records are read from it)")


def run_info(command: str, runner: Runner) -> dict:
    """Where a report comes from: when the run started, the command, the commit and the source hash."""
    return {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": command,
        "git_commit": git_commit(),
        "source_sha256": runner.source_sha256,
        "pid": os.getpid(),
        "host": platform.node(),
    }


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
    api_factory: str | None = None,
    command: str | None = None,
    accelerator: bool = False,
    profile: list | None = None,
    explain: bool = True,
    fail_fast: bool = False,
):
    """Run the gates: ``flags=None`` checks every tuning flag alone and the tuned combination; otherwise one check
    of ``flags`` ({key: value or string}) plus the prerequisite tuning flags the model's rules name (printed).
    Returns a ``gates.report.Report`` (status "complete"). Bad input (any argument, an unknown config or flag, a
    malformed value, a refused combination, an unreadable tolerance table) raises ``ConfigError`` (``model.flags``) or
    ``BadInput``, both ``ValueError``, naming the argument and its value, before anything is computed.
    ``on_check(partial_report)`` is called once before the first record is computed and after each check but the
    last (status "incomplete"; the CLI writes them, so a stale report never looks current). ``jobs > 1`` (with the
    cache, and the real model or an importable ``api_factory`` "module:function"): the records are computed by that
    many worker processes (``gates.prefetch``), and each check reads its records as soon as they are in, while the
    workers compute the rest. Each check's verdict goes to ``progress`` as soon as it is known ("check 3/14: <name>
    (<contract>): PASS", or "FAIL: " and the first failing gate). Ctrl-C raises ``Interrupted`` (a
    ``KeyboardInterrupt``) carrying the report so far, status "interrupted". ``command``: how the run was started,
    written into the report (default: this call). The real model runs on 8 host CPU devices
    (``nxgates.devices.use_host_devices``, set up here when jax has not started yet; if it has, with fewer devices,
    a ``RuntimeError`` says what to set); ``accelerator=True``: on jax's default devices instead. ``profile``: a list
    that gets one ``gates.profile.row`` per record (where the time went; ``nxgates run --profile``). ``explain``:
    every failing check gets its explanation (``gates.explainer``: the first op and layer over its bound at step 1).
    ``fail_fast``: stop at the first failing check: the prefetch workers are stopped, the failing check is explained
    (after they are, so that it has the machine), its control is compared with the golden where it is the config's,
    and the report's status is "stopped" (its ``pending`` names the checks not run; not a pass)."""
    _validate_args(config, flags, api, settings, tiles, cache_dir, use_cache, tolerances_path, golden_dir, progress,
                   on_check, jobs, api_factory, command)
    if profile is not None and not isinstance(profile, list):
        raise BadInput(f"profile={profile!r} must be a list or None")
    if not isinstance(accelerator, bool):
        raise BadInput(f"accelerator={accelerator!r} must be True or False")
    if not isinstance(explain, bool):
        raise BadInput(f"explain={explain!r} must be True or False")
    if not isinstance(fail_fast, bool):
        raise BadInput(f"fail_fast={fail_fast!r} must be True or False")
    if api is None and not accelerator:
        from nxgates.devices import use_host_devices

        use_host_devices()
    try:
        tols = load_tolerances(tolerances_path) if tolerances_path is not None else load_tolerances()
    except ValueError as e:  # missing, unreadable, not TOML, a missing entry: named by the reader
        raise BadInput(f"tolerances_path={str(tolerances_path)!r}: {e}" if tolerances_path is not None else str(e)) \
            from None
    runner = Runner(str(config), api=api, settings=settings,
                    cache=record_lib.RecordCache(cache_dir, log=progress or (lambda m: None)), use_cache=use_cache,
                    tolerances=tols, progress=progress)
    specs = runner.default_specs(tiles) if flags is None else [runner.user_spec(flags)]
    for spec in specs:  # refuse a bad combination before any compile
        runner.resolve(spec)
    if flags is not None and progress:
        announce_prerequisites(specs, progress)
    if progress:
        progress(f"config {config!r}: {len(specs)} check(s): " + ", ".join(f"{s.name} ({s.contract})" for s in specs))
    info = run_info(command or f"gates.check({str(config)!r}, flags={flags!r})", runner)
    checks: list = []

    def report(status: str, golden=None):
        return report_lib.Report(config=str(config), checks=list(checks), golden=golden, env=runner.env,
                                 tolerances=tols, wall_s=round(time.perf_counter() - runner.t0, 2),
                                 pending=[s.name for s in specs[len(checks):]], status=status, run=dict(info))

    def explain_last() -> None:
        from nxgates.gates.explainer import explain_failed

        checks[-1].explanation = explain_failed(runner, checks[-1].spec, checks[-1])

    def run_checks(upto: int) -> None:
        """The checks of ``specs[len(checks):upto]``, in order; each verdict is printed as soon as it is known."""
        while len(checks) < upto:
            spec = specs[len(checks)]
            checks.append(runner.run_check(spec))
            c = checks[-1]
            if progress:
                progress(f"[{time.perf_counter() - runner.t0:7.1f}s] check {len(checks)}/{len(specs)}: "
                         + (f"{spec.name} ({spec.contract}): PASS" if c.passed
                            else f"FAIL: {report_lib.Report.failure_line(c)}"))
            if not c.passed and fail_fast and len(checks) < len(specs):
                raise _StopAtFailure
            if explain and not c.passed:
                explain_last()
            if on_check is not None and len(checks) < len(specs):
                on_check(report("incomplete"))

    stopped = False
    try:
        if on_check is not None:
            on_check(report("incomplete"))
        try:
            if jobs > 1 and use_cache and (api is None or api_factory is not None):
                # each check runs as soon as its records are in, while the workers compute the others
                prefetch(runner, specs, jobs, cache_dir, api_factory=api_factory, on_ready=run_checks)
            run_checks(len(specs))
        except _StopAtFailure:  # prefetch stopped its workers on the way out; the failing check is the last one
            stopped = True
            if progress:
                progress(f"[{time.perf_counter() - runner.t0:7.1f}s] stopped at the first failing check "
                         f"({len(checks)}/{len(specs)}; fail_fast): {len(specs) - len(checks)} not run")
            if explain:
                explain_last()
        if profile is not None:
            profile.extend(runner.profile)
        base = runner.base_control()
        gold = None if base is None else golden_lib.compare_with_golden(config, base[0], tols, golden_dir=golden_dir)
    except KeyboardInterrupt:
        raise Interrupted(report("interrupted")) from None
    return report("stopped" if stopped else "complete", gold)
