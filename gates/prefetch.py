"""Prefetch: compute a run's records in worker processes before the checks read them from the record cache.

XLA compiles mostly on one core (a tiny candidate's program: 14 s wall, 20 s CPU; docs/speed.md), so two processes on
two cores cut the wall time of ``nxgates run``. The control is computed first in the calling process (every other
record replays its routing; the workers start with it and are handed their records once its steps have run); the
reference and every candidate with the config's default control go to the workers, and, when the float32 lens runs,
the lens's control and each rounding candidate in the lens. Nothing is trusted from a failed worker: its check
computes the record itself later.

Workers never outlive the process that started them: each one, when it starts, asks the kernel to kill it when its
parent dies (Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``) and runs a watchdog thread that exits the process as soon as
its parent is gone (every platform: the parent's pid is no longer its parent's). Workers ignore Ctrl-C (the terminal
sends it to the whole process group): the parent stops them, so an interrupted run prints one line, not a traceback
per worker.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import importlib
import multiprocessing
import os
import signal
import sys
import threading
import time

import jax

from nxgates.gates import protocol
from nxgates.gates import record as record_lib
from nxgates.gates.profile import active_compilation_cache_dir, use_compilation_cache_dir
from nxgates.gates.runner import Runner, control_routing, stderr

DEFAULT_API_FACTORY = "nxgates.gates.model_api:default_model_api"
WATCHDOG_PERIOD_S = 0.5
_PR_SET_PDEATHSIG = 1
_WORKER: dict = {}  # per worker process: (config, settings, cache_dir, api_factory) -> (Runner, the control's routing)


def _exit_with_parent(parent_pid: int) -> None:
    """In a worker: die when the parent ``parent_pid`` dies (kernel signal on Linux, and a polling watchdog)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watchdog below still applies
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        os._exit(1)

    def watchdog():
        while True:
            time.sleep(WATCHDOG_PERIOD_S)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watchdog, name="nxgates-parent-watchdog", daemon=True).start()


def worker_init(parent_pid: int) -> None:
    """The initializer of every prefetch worker process: ignore Ctrl-C, die with the parent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent(parent_pid)


def worker_pool(jobs: int) -> concurrent.futures.ProcessPoolExecutor:
    """``jobs`` spawned worker processes that die with this process (``worker_init``)."""
    return concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                                                  initializer=worker_init, initargs=(os.getpid(),))


def stop_pool(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Kill the workers now and cancel what has not started (an interrupted or failed run waits for no record). The
    processes are taken before ``shutdown``, which forgets them."""
    procs = list((getattr(pool, "_processes", None) or {}).values())
    for proc in procs:
        try:
            proc.kill()
        except (OSError, ValueError):
            pass
    for proc in procs:
        proc.join(timeout=5)
    pool.shutdown(wait=False, cancel_futures=True)


def load_api_factory(spec: str):
    """``"package.module:function"`` -> the function (a ``ModelAPI`` factory)."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _worker_runner(config: str, settings: dict, cache_dir: str | None, api_factory: str,
                   xla_dir: str | None) -> Runner:
    """In a worker process: its ``Runner`` for this run (built once: jax, the model, the config and the batch)."""
    key = (config, tuple(sorted(settings.items())), cache_dir, api_factory)
    if key not in _WORKER:
        if xla_dir is not None:
            use_compilation_cache_dir(xla_dir)
        _WORKER[key] = Runner(config, api=load_api_factory(api_factory)(),
                              settings=protocol.ProtocolSettings(**settings),
                              cache=record_lib.RecordCache(cache_dir, log=lambda m: None), progress=None)
    return _WORKER[key]


def _warm_up(config: str, settings: dict, cache_dir: str | None, api_factory: str, xla_dir: str | None) -> None:
    """Worker process: build the runner (imports, config, batch) while the parent computes the control."""
    _worker_runner(config, settings, cache_dir, api_factory, xla_dir)


def _prefetch_one(config: str, settings: dict, cache_dir: str | None, overrides: dict | None, label: str,
                  replay: list | None, api_factory: str = DEFAULT_API_FACTORY, xla_dir: str | None = None,
                  precision: str = "production") -> tuple[str, dict]:
    """Worker process: one record into the cache (``overrides=None``: the float32 reference; ``{}``: the control at
    ``precision``, the float32 lens's control; else the candidate, the control with ``overrides`` at ``precision``,
    "production" or "lens", kept as its digests against its control and the reference, ``gates.candidates``),
    replaying ``replay``, the control's routing. A record another process is computing (the control, whose summaries
    the parent may still be computing; a reference) is waited for (``RecordCache.lock``). Returns how it was obtained
    and its ``gates.profile.row``. ``xla_dir``: the parent's persistent compilation cache (a spawned process starts
    without it)."""
    r = _worker_runner(config, settings, cache_dir, api_factory, xla_dir)
    r.progress = lambda m: stderr(f"  [{label}] {m.split('] ', 1)[-1]}")
    if overrides is None:
        how = r.shared_record(r.base_flags, "reference", label, replay)[1]
    elif not overrides:  # the control at another precision (the float32 lens's control)
        how = r.shared_record(r.base_flags, precision, label, replay)[1]
    else:  # a candidate: its digests against the control and the reference (read, or waited for, from the cache)
        how = r.candidate_summary(r.flags_from(overrides), precision, label, replay)[1]
    # This process keeps the control, the reference and the lens's control (every candidate reads them); a candidate
    # is kept as its digests only. Its programs are dropped: jax's in-memory caches keep every executable and trace
    # of the run otherwise (a worker grew to 3.3 GB over 12 records on tiny); the next record reads the shared
    # programs (the optimizer's, the summaries') back from the persistent compilation cache.
    jax.clear_caches()
    return how, r.profile[-1]


def prefetch(runner: Runner, specs, jobs: int, cache_dir: str | None, *, api_factory: str | None = None) -> None:
    """Compute the control here, then the reference, the lens's control and every candidate of ``specs`` (in that
    order: a candidate's digests read the first two) in ``jobs`` worker processes, into the record cache (XLA
    compiles mostly on one core). Only the candidates with a
    config's default control are prefetched; a worker's failure is reported and the check computes the record itself
    later. ``api_factory``: "module:function" the workers call to build the model API (default: the real model's).
    How each record was obtained goes to ``runner.prefetched``.

    The workers start with the control: they import jax and the model and build their runner meanwhile. Every other
    record replays the control's routing, so they are given their records as soon as the control's steps have run
    (``run_protocol``'s ``on_steps``), while this process computes the control's summaries and stores it; a candidate
    that needs the control's record waits for it (``RecordCache.lock``)."""
    api_factory = api_factory or DEFAULT_API_FACTORY
    base = runner.api.as_dict(runner.base_flags)
    jobs_list = [(None, "reference", runner.base_flags, "reference")]
    lens = runner.lens and any(spec.contract == "rounding" for spec in specs)
    if lens:  # the float32 lens's control, shared by every rounding check
        jobs_list.append(({}, "control-lens", runner.base_flags, "lens"))
    for spec in specs:
        control_flags, candidate_flags = runner.resolve(spec)
        if runner.api.as_dict(control_flags) != base:
            continue
        changed = {k: v for k, v in runner.api.as_dict(candidate_flags).items() if base.get(k) != v}
        jobs_list.append((changed, f"candidate[{spec.name}]", candidate_flags, "production"))
        if lens and spec.contract == "rounding":
            jobs_list.append((changed, f"candidate-lens[{spec.name}]", candidate_flags, "lens"))
    settings = runner.settings.as_dict()
    xla_dir = active_compilation_cache_dir()
    futures: dict = {}
    submitted: list = []  # one entry once the jobs are submitted
    pool = worker_pool(jobs)

    def submit(replay):
        if submitted:
            return
        submitted.append(replay)
        runner.progress(f"[{time.perf_counter() - runner.t0:7.1f}s] prefetch: {len(jobs_list)} records in {jobs} "
                        "worker processes")
        for ov, label, flags, precision in jobs_list:
            fut = pool.submit(_prefetch_one, runner.config_name, settings, cache_dir, ov, label, replay, api_factory,
                              xla_dir, precision)
            futures[fut] = (label, record_lib.key_digest(runner.key_parts(flags, precision, replay)))

    try:
        for _ in range(jobs):  # one each (a fast one may take two: the runner is built once per process)
            pool.submit(_warm_up, runner.config_name, settings, cache_dir, api_factory, xla_dir)
        runner.shared_record(runner.base_flags, "production", "control (before the checks)", on_steps=submit)
        # the control was read from the cache (or found by its program): no steps ran here, nothing submitted yet
        submit(control_routing(runner.base_control()[0]))
        for fut in concurrent.futures.as_completed(futures):
            label, digest = futures[fut]
            try:
                how, row = fut.result()
                runner.prefetched[digest] = how
                runner.profile.append({**row, "record": f"{label} (worker)"})
                runner.progress(f"[{time.perf_counter() - runner.t0:7.1f}s] prefetch: {label} {how.split(' (')[0]}")
            except Exception as e:  # the check recomputes it; nothing is trusted from a failed worker
                runner.progress(f"prefetch: {label} failed in its worker ({type(e).__name__}: {e}); computed later")
    except BaseException:  # Ctrl-C, or anything else: no worker keeps computing for a run that is over
        stop_pool(pool)
        raise
    pool.shutdown(wait=True)
