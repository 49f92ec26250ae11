"""Prefetch: compute a run's records in worker processes before the checks read them from the record cache.

Compilation is single-threaded, so two processes on two cores roughly halve the wall time of ``nxgates run``. The
control is computed first in the calling process (every other record replays its routing); the reference and every
candidate with the config's default control go to the workers. Nothing is trusted from a failed worker: its check
computes the record itself later.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import time

from nxgates.gates import protocol
from nxgates.gates import record as record_lib
from nxgates.gates.runner import Runner, control_routing, stderr

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
    r.progress = lambda m: stderr(f"  [{label}] {m.split('] ', 1)[-1]}")
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
