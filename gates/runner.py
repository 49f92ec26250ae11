"""The check runner behind ``gates.check`` and ``python -m nxgates run``.

For each check (a ``gates.contracts.CheckSpec``): the control (config flags + the check's control prerequisites,
production precision) and the float32 reference (same flags, ``precision="reference"``) come from the record cache,
computed once per (config, control flags) and reused by every candidate; the candidate (control + the check's flags) is
cached the same way unless a mutant's override or loss is in effect (then always computed fresh); then the six
gates. Every flag combination is parsed and validated before anything runs, so a
refused combination costs no compile.

The model is reached through ``ModelAPI``; ``default_model_api()`` wires the real ``model`` package.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import pathlib
import platform
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from nxgates.gates import contracts as contracts_lib
from nxgates.gates import gates as gates_lib
from nxgates.gates import protocol
from nxgates.gates import record as record_lib

PACKAGE_ROOT = pathlib.Path(__file__).resolve().parent.parent  # nxgates.<layer> folders: reference/, kernels/, ...
# Source folders whose code determines a run record (a change invalidates the cache).
SOURCE_DIRS = ("reference", "kernels", "model")
SOURCE_FILES = ("gates/protocol.py", "gates/sketch.py", "gates/recorder.py")


def control_routing(control: record_lib.RunRecord) -> list | None:
    """The control's per-step routing for the other runs to replay (None for a model without routing)."""
    routes = [s.routing for s in control.steps]
    return None if any(r is None for r in routes) else routes


def routing_digest(replay) -> str:
    h = hashlib.sha256()
    for ids in replay:
        a = np.ascontiguousarray(np.asarray(ids, np.int32))
        h.update(repr(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


class BadInput(ValueError):
    """Input the runner refuses (exit 2): the message names the key and its value."""


@dataclasses.dataclass(frozen=True)
class ModelAPI:
    """The model functions the runner needs (see /work/notes/interfaces.md, model/)."""

    load_config: Callable[[str], Any]
    parse_flags: Callable[..., Any]  # (overrides: dict, base: Flags | None) -> Flags
    validate: Callable[[Any, Any], None]
    init_params: Callable[[Any, int], Any]
    build_log_probs: Callable[..., Callable]
    make_mesh: Callable[[Any], Any]
    implementations: Callable[[], dict]
    base_flags: Callable[[Any], Any]  # cfg -> the config's control Flags ([flags])
    tuned: Callable[[Any], Mapping[str, Any]]  # cfg -> the config's [tuned] values
    dims: Callable[[Any], tuple[int, int, int]]  # cfg -> (batch, seq_len, vocab)
    as_dict: Callable[[Any], dict]  # a config or Flags -> JSON-able dict
    config_error: type[Exception]
    config_files: Callable[[str], list[pathlib.Path]]  # the files defining a config (hashed into cache keys)
    with_prerequisites: Callable[[Any, Mapping[str, Any]], dict] | None = None  # (cfg, overrides) -> + prerequisites
    place_params: Callable[[Any, Any], Any] | None = None  # (params, mesh) -> params placed on the mesh
    override: Callable[[str, Callable], Any] | None = None  # model.ops.override (the mutants inject through it)
    source_dirs: tuple[str, ...] = SOURCE_DIRS
    list_configs: Callable[[], list[str]] = lambda: []


def default_model_api() -> ModelAPI:
    """The real model package (imports jax)."""
    from nxgates.model import config as mconfig
    from nxgates.model import ops as mops
    from nxgates.model import sharding as msharding
    from nxgates.model import transformer as mtransformer

    def as_dict(obj):
        if dataclasses.is_dataclass(obj):
            return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return dict(obj)

    return ModelAPI(
        load_config=mconfig.load_config,
        parse_flags=mconfig.parse_flags,
        validate=mconfig.validate,
        init_params=mtransformer.init_params,
        build_log_probs=mtransformer.build_log_probs,
        make_mesh=msharding.make_mesh,
        implementations=mops.implementations,
        base_flags=lambda cfg: cfg.control,
        tuned=mconfig.tuning_flags,
        dims=lambda cfg: (int(cfg.batch_size), int(cfg.seq_len), int(cfg.vocab_size)),
        as_dict=as_dict,
        config_error=mconfig.ConfigError,
        config_files=lambda name: [pathlib.Path(name) if name.endswith(".toml")
                                   else mconfig.config_dir() / f"{name}.toml"],
        with_prerequisites=mconfig.with_prerequisites,
        place_params=msharding.shard_params,
        override=mops.override,
        list_configs=lambda: list(mconfig.available_configs()),
    )


def _jsonable(v):
    if dataclasses.is_dataclass(v):
        return {f.name: _jsonable(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    return str(v)


def source_hash(dirs: tuple[str, ...] = SOURCE_DIRS, files: tuple[str, ...] = SOURCE_FILES,
                extra: list[pathlib.Path] = ()) -> str:
    """sha256 over the .py files of ``dirs`` (sorted), ``files`` and ``extra``, names included."""
    h = hashlib.sha256()
    paths = []
    roots = {d: pathlib.Path(importlib.import_module(f"nxgates.{d}").__file__).resolve().parent for d in dirs}
    for d in dirs:
        paths += [(f"{d}/{p.relative_to(roots[d])}", p) for p in sorted(roots[d].rglob("*.py"))]
    gates_root = pathlib.Path(__file__).resolve().parent
    paths += [(f, gates_root / f.removeprefix("gates/")) for f in files]
    paths += [(str(p), p) for p in extra]
    for name, p in paths:
        if p.is_file():
            h.update(name.encode())
            h.update(b"\0")
            h.update(p.read_bytes())
            h.update(b"\0")
    return h.hexdigest()


def environment() -> dict:
    """Versions and the device the runs execute on."""
    import jax
    import jaxlib
    import numpy
    import optax

    devs = jax.devices()
    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "numpy": numpy.__version__,
        "optax": optax.__version__,
        "platform": devs[0].platform,
        "device_kind": devs[0].device_kind,
        "device_count": len(devs),
    }


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclasses.dataclass
class CheckResult:
    spec: contracts_lib.CheckSpec
    control_flags: dict
    candidate_flags: dict
    results: list[gates_lib.GateResult]
    problems: list[str]
    implementations: dict
    records: dict  # label -> how it was obtained ("cached" / "computed" / "recomputed: ...")
    wall_s: float
    # Routing replay: per step, the (layer, token) pairs whose own top-k differed from the control's replayed choice,
    # {"candidate": [...], "reference": [...]}; empty for a model without routing.
    routing_mismatch: dict = dataclasses.field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.problems and all(r.passed for r in self.results)

    @property
    def first_failing_step(self) -> int | None:
        failing = [r.step for r in self.results if not r.passed]
        return min(failing) if failing else None

    @property
    def worst_tensor(self) -> tuple[str | None, float]:
        """The tensor with the largest gradient rel L2 against the control (N5) over the steps."""
        n5 = [r for r in self.results if r.gate == "N5"]
        if not n5:
            return None, 0.0
        worst = max(n5, key=lambda r: r.vs_control)
        return worst.worst_tensor, worst.vs_control


class Runner:
    """Runs checks on one config, sharing controls and references between them."""

    def __init__(
        self,
        config: str,
        *,
        api: ModelAPI | None = None,
        settings: protocol.ProtocolSettings = protocol.DEFAULT_SETTINGS,
        cache: record_lib.RecordCache | None = None,
        use_cache: bool = True,
        tolerances: gates_lib.Tolerances | None = None,
        progress: Callable[[str], None] | None = _stderr,
    ):
        self.api = api or default_model_api()
        self.config_name = config
        self.cfg = self.api.load_config(config)  # unknown name -> ConfigError naming it
        self.settings = settings
        self.progress = progress or (lambda msg: None)
        self.cache = cache or record_lib.RecordCache(log=self.progress)
        self.use_cache = use_cache
        self.tolerances = tolerances or gates_lib.load_tolerances()
        self.base_flags = self.api.base_flags(self.cfg)
        self.env = environment()
        self.seeds = {"params": protocol.seed_for(f"{config}/params"), "batch": protocol.seed_for(f"{config}/batch")}
        batch_size, seq_len, vocab = self.api.dims(self.cfg)
        self.batch = protocol.make_batch(batch_size, seq_len, vocab, self.seeds["batch"])
        self._params0 = None
        self._records: dict[str, tuple[record_lib.RunRecord, str]] = {}
        self._src_hash = source_hash(self.api.source_dirs, extra=self.api.config_files(config))
        self.t0 = time.perf_counter()

    # ---------------------------------------------------------------------------------------------------- flags
    def flags_from(self, overrides: Mapping[str, Any], base=None):
        return self.api.parse_flags(dict(overrides), base if base is not None else self.base_flags)

    def resolve(self, spec: contracts_lib.CheckSpec):
        """(control_flags, candidate_flags), both validated; ConfigError on a refused combination."""
        control = self.flags_from(spec.control_overrides)
        candidate = self.flags_from(spec.candidate_overrides, control)
        self.api.validate(self.cfg, control)
        self.api.validate(self.cfg, candidate)
        return control, candidate

    def closure(self, overrides: Mapping[str, Any]) -> dict:
        """``overrides`` + the prerequisite tuning flags the model's rules need (identity without a model closure)."""
        if self.api.with_prerequisites is None:
            return dict(overrides)
        return self.api.with_prerequisites(self.cfg, overrides)

    def default_specs(self, tiles: str = "each") -> list[contracts_lib.CheckSpec]:
        return contracts_lib.default_checks(self.api.as_dict(self.base_flags), self.api.tuned(self.cfg),
                                            self.closure, tiles=tiles)

    def user_spec(self, flags: Mapping[str, Any]) -> contracts_lib.CheckSpec:
        """A check from user flags: tuning keys go to the candidate, configuration keys to both sides."""
        if not flags:
            raise BadInput("flags={} names no flag; omit --flags to check every registered flag")
        parsed = self.api.as_dict(self.flags_from(flags))  # unknown key / malformed value -> ConfigError
        base = self.api.as_dict(self.base_flags)
        tuning = {k: parsed[k] for k in flags if contracts_lib.is_tuning_key(k)}
        config_keys = {k: parsed[k] for k in flags if not contracts_lib.is_tuning_key(k)}
        changed = {k: v for k, v in tuning.items() if base.get(k) != v}
        if not changed:
            shown = ", ".join(f"{k}={v!r}" for k, v in flags.items())
            raise BadInput(f"flags {shown}: no tuning flag differs from config {self.config_name!r}'s control, "
                           "nothing to check")
        name = ",".join(f"{k}={v}" for k, v in changed.items())
        # The user's explicit choice is the check: no prerequisite is added behind their back (a missing one is refused
        # by validate with the rule's message).
        spec = contracts_lib.build_check(name, changed, base)
        return dataclasses.replace(spec, control_overrides=config_keys)

    # -------------------------------------------------------------------------------------------------- records
    def params0(self):
        if self._params0 is None:
            self._params0 = self.api.init_params(self.cfg, self.seeds["params"])
        return self._params0

    def key_parts(self, flags, precision: str, replay=None) -> dict:
        parts = {
            "kind": "run-record",
            "config": self.config_name,
            "config_values": self.api.as_dict(self.cfg),
            "flags": self.api.as_dict(flags),
            "precision": precision,
            "settings": self.settings.as_dict(),
            "sketch": protocol.DEFAULT_SKETCH.to_json(),
            "seeds": self.seeds,
            "env": self.env,
            "source_sha256": self._src_hash,
        }
        if replay is not None:  # a replaying run depends on the routing it replays
            parts["routing_replay_sha256"] = routing_digest(replay)
        return parts

    def compute(self, flags, precision: str, label: str, *, loss_fn=protocol.grpo_loss,
                replay=None) -> record_lib.RunRecord:
        self.progress(f"[{time.perf_counter() - self.t0:7.1f}s] {label}: tracing + compiling ({precision})")
        mesh = self.api.make_mesh(flags)
        fn = self.api.build_log_probs(self.cfg, flags, precision=precision, mesh=mesh)
        params = self.params0()
        if self.api.place_params is not None:
            params = self.api.place_params(params, mesh)
        meta = {"config": self.config_name, "config_values": self.api.as_dict(self.cfg),
                "flags": self.api.as_dict(flags), "precision": precision, "seeds": self.seeds, "env": self.env,
                "source_sha256": self._src_hash, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        t = time.perf_counter()

        def progress(msg):
            self.progress(f"[{time.perf_counter() - self.t0:7.1f}s] {msg}")

        if replay is not None:
            meta["routing_replay_sha256"] = routing_digest(replay)
        rec = protocol.run_protocol(fn, params, self.batch, self.settings, metadata=meta, loss_fn=loss_fn,
                                    progress=progress, label=label, replay=replay)
        rec.metadata["implementations"] = dict(self.api.implementations())
        rec.metadata["run_s"] = round(time.perf_counter() - t, 3)
        return rec

    def shared_record(self, flags, precision: str, label: str, replay=None) -> tuple[record_lib.RunRecord, str]:
        """Control or reference: once per (flags, precision, replayed routing) in this process, and through the disk
        cache."""
        parts = self.key_parts(flags, precision, replay)
        k = record_lib.key_digest(parts)
        if k in self._records:
            return self._records[k][0], "shared (computed for an earlier check)"
        compute = functools.partial(self.compute, flags, precision, label, replay=replay)
        if self.use_cache:
            self._records[k] = self.cache.get_or_compute(parts, compute, label=label)
        else:
            self._records[k] = (compute(), "computed")
        return self._records[k]

    # ---------------------------------------------------------------------------------------------------- checks
    def run_check(self, spec: contracts_lib.CheckSpec, *, candidate_loss_fn=protocol.grpo_loss,
                  candidate_context=None) -> CheckResult:
        """Control, reference, candidate, gates. ``candidate_context``: a context manager active while the candidate
        is traced (the mutants inject through ``model.ops.override`` this way)."""
        t = time.perf_counter()
        control_flags, candidate_flags = self.resolve(spec)
        control, how_c = self.shared_record(control_flags, "production", f"control[{spec.name}]")
        # Routing replay: the reference and the candidate take the control's expert choices at every step.
        replay = control_routing(control)
        reference, how_r = self.shared_record(control_flags, "reference", f"reference[{spec.name}]", replay)
        label = f"candidate[{spec.name}]"
        if candidate_context is None and candidate_loss_fn is protocol.grpo_loss:
            # A plain candidate is determined by its key like the control: cached too (re-running a check after a
            # tolerance edit costs no model run). A mutated one (override, loss) never goes near the cache.
            candidate, how_cand = self.shared_record(candidate_flags, "production", label, replay)
        elif candidate_context is None:
            candidate = self.compute(candidate_flags, "production", label, loss_fn=candidate_loss_fn, replay=replay)
            how_cand = "computed"
        else:
            with candidate_context:
                candidate = self.compute(candidate_flags, "production", label, loss_fn=candidate_loss_fn,
                                         replay=replay)
            how_cand = "computed"
        results, problems = gates_lib.evaluate(candidate, control, reference, spec.contract, self.tolerances)
        return CheckResult(
            spec=spec,
            control_flags=spec.control_overrides,
            candidate_flags=spec.candidate_overrides,
            results=results,
            problems=problems,
            implementations={"candidate": candidate.metadata.get("implementations", {}),
                             "control": control.metadata.get("implementations", {}),
                             "reference": reference.metadata.get("implementations", {})},
            records={"control": how_c, "reference": how_r, "candidate": how_cand},
            wall_s=round(time.perf_counter() - t, 2),
            routing_mismatch={} if replay is None else {
                "candidate": [s.routing_mismatch for s in candidate.steps],
                "reference": [s.routing_mismatch for s in reference.steps]},
        )

    def base_control(self) -> tuple[record_lib.RunRecord, str] | None:
        """The config's own control if this runner has it (for the golden comparison)."""
        k = record_lib.key_digest(self.key_parts(self.base_flags, "production"))
        return self._records.get(k)


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
    progress: Callable[[str], None] | None = _stderr,
    on_check: Callable[[Any], None] | None = None,
    jobs: int = 1,
):
    """Run the gates: ``flags=None`` checks every registered flag alone and the tuned combination; otherwise one check
    of ``flags`` ({key: value or string}). Returns a ``gates.report.Report``. Bad input raises ``ConfigError`` (from
    model.config) or ``BadInput``, both ``ValueError``, before anything is computed. ``on_check(partial_report)`` is
    called after each check (the CLI writes the reports so far). ``jobs > 1`` (with the cache and the real model):
    the records are computed first by that many worker processes (``prefetch``), then the checks read them."""
    from nxgates.gates import golden as golden_lib
    from nxgates.gates import report as report_lib

    tols = gates_lib.load_tolerances(tolerances_path) if tolerances_path else gates_lib.load_tolerances()
    runner = Runner(config, api=api, settings=settings,
                    cache=record_lib.RecordCache(cache_dir, log=progress or (lambda m: None)), use_cache=use_cache,
                    tolerances=tols, progress=progress)
    specs = runner.default_specs(tiles) if flags is None else [runner.user_spec(flags)]
    for spec in specs:  # refuse a bad combination before any compile
        runner.resolve(spec)
    if progress:
        progress(f"config {config!r}: {len(specs)} check(s): " + ", ".join(f"{s.name} ({s.contract})" for s in specs))
    if jobs > 1 and use_cache and api is None:
        prefetch(runner, specs, jobs, cache_dir)
    checks = []
    for spec in specs:
        checks.append(runner.run_check(spec))
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


# ------------------------------------------------------------------------------------------------------------ prefetch
_WORKER: dict = {}  # per worker process: (config, settings, cache_dir) -> (Runner, the control's routing)


def _prefetch_one(config: str, settings: dict, cache_dir: str | None, overrides: dict | None, label: str) -> str:
    """Worker process: one record into the cache (``overrides=None``: the float32 reference), replaying the
    control's routing read from the cache (once per worker process). Returns how the record was obtained."""
    key = (config, tuple(sorted(settings.items())), cache_dir)
    if key not in _WORKER:
        r = Runner(config, settings=protocol.ProtocolSettings(**settings),
                   cache=record_lib.RecordCache(cache_dir, log=lambda m: None), progress=None)
        control, _ = r.shared_record(r.base_flags, "production", "control")
        _WORKER[key] = (r, control_routing(control))
    r, replay = _WORKER[key]
    r.progress = lambda m: _stderr(f"  [{label}] {m.split('] ', 1)[-1]}")
    flags, precision = (r.base_flags, "reference") if overrides is None else (r.flags_from(overrides), "production")
    how = r.shared_record(flags, precision, label, replay)[1]
    # The record is on disk now; keep only the control in this process's memory (a record is ~140 MB on tiny).
    r._records.pop(record_lib.key_digest(r.key_parts(flags, precision, replay)), None)
    return how


def prefetch(runner: Runner, specs, jobs: int, cache_dir: str | None) -> None:
    """Compute the control here, then the reference and every candidate of ``specs`` in ``jobs`` worker processes,
    into the record cache (compilation is single-threaded, so two processes on two cores roughly halve the wall time).
    Only the candidates with a config's default control are prefetched; a worker's failure is reported and the check
    computes the record itself later."""
    import concurrent.futures
    import multiprocessing

    runner.shared_record(runner.base_flags, "production", "control")
    base = runner.api.as_dict(runner.base_flags)
    jobs_list = [(None, "reference")]
    for spec in specs:
        control_flags, candidate_flags = runner.resolve(spec)
        if runner.api.as_dict(control_flags) != base:
            continue
        jobs_list.append((runner.api.as_dict(candidate_flags), f"candidate[{spec.name}]"))
    t = time.perf_counter()
    runner.progress(f"[{t - runner.t0:7.1f}s] prefetch: {len(jobs_list)} records in {jobs} worker processes")
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        settings = runner.settings.as_dict()
        futures = {pool.submit(_prefetch_one, runner.config_name, settings, cache_dir, ov, label): label
                   for ov, label in jobs_list}
        for fut in concurrent.futures.as_completed(futures):
            label = futures[fut]
            try:
                how = fut.result()
                runner.progress(f"[{time.perf_counter() - runner.t0:7.1f}s] prefetch: {label} {how.split(' (')[0]}")
            except Exception as e:  # the check recomputes it; nothing is trusted from a failed worker
                runner.progress(f"prefetch: {label} failed in its worker ({type(e).__name__}: {e}); computed later")
