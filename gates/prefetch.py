"""Prefetch: compute a run's records in worker processes; each check reads its records from the record cache as soon
as they are in (``prefetch(on_ready=...)``), while the workers compute the rest.

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
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable

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


TASKS_PER_PROCESS = 1


def _kill_and_join(procs) -> None:
    """SIGKILL each worker process (``multiprocessing.Process``), then wait up to 5 s for each to be gone."""
    for proc in procs:
        try:
            proc.kill()
        except (OSError, ValueError):
            pass
    for proc in procs:
        proc.join(timeout=5)


class FreshProcessPool:
    """``jobs`` lanes of work, each served by one spawned worker process at a time that is replaced by a new one after
    ``tasks_per_process`` tasks: a task starts from the memory of a fresh process, so the largest process of a run
    does not grow with the number of records it computes.

    Why: a worker's resident set creeps up by 0.1 to 0.3 GB per record even with jax's caches cleared (the allocator's
    heap after a compile; docs/speed.md), so a long-lived worker was the largest process of every run, and more flags
    meant a larger peak. A replacement costs a process start, jax's import and the runner's build (about 1.3 s on
    tiny, measured), and, for a candidate, reading the control and the reference back from the record cache.

    Each lane is a thread in this process that owns a one-process ``ProcessPoolExecutor`` and hands it the lane's
    tasks one by one (``submit`` returns a ``concurrent.futures.Future``, so ``as_completed`` works as before). A
    worker that dies (a crash, the OOM killer) fails its task with ``BrokenProcessPool`` and the lane starts a new
    process for the next one. (``ProcessPoolExecutor(max_tasks_per_child=...)`` would do the same in one executor, but
    CPython 3.12.1 stops scheduling once a worker has exited at its limit: issue 115634, reproduced there.)

    ``warm_up``: ``(fn, args)`` each new process runs before its first task (imports, the runner). The first
    processes start with the pool, so they warm up while the caller computes the control; a replacement starts when
    its lane's next task is there (none is started for nothing at the end of a run).

    ``light``: a predicate on a task's result; a task whose result it holds true does not count against
    ``tasks_per_process`` (its process serves the lane's next task too). The prefetch marks a record it found without
    compiling anything (read by name, or found by its program after one trace and lowering): such a task leaves a few
    megabytes behind, not a compile's heap (docs/speed.md), so a fresh process for the next one would cost its start
    and the runner's build for nothing.
    """

    def __init__(self, jobs: int, *, tasks_per_process: int = TASKS_PER_PROCESS, warm_up: tuple | None = None,
                 light: Callable[[object], bool] | None = None):
        if jobs < 1 or tasks_per_process < 1:
            raise ValueError(f"jobs={jobs!r}, tasks_per_process={tasks_per_process!r}: both must be >= 1")
        self._tasks_per_process = tasks_per_process
        self._warm_up = warm_up
        self._light = light
        self._parent = os.getpid()
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._executors: set[concurrent.futures.ProcessPoolExecutor] = set()
        self._stopped = False
        self._lanes = [threading.Thread(target=self._lane, args=(self._start(),), name=f"nxgates-lane-{i}",
                                        daemon=True) for i in range(jobs)]
        for lane in self._lanes:
            lane.start()

    def _start(self) -> concurrent.futures.ProcessPoolExecutor | None:
        """A new one-process executor, already starting its process and warm-up (None once the pool is stopped)."""
        with self._lock:
            if self._stopped:
                return None
            ex = concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                                        initializer=worker_init, initargs=(self._parent,))
            self._executors.add(ex)
            if self._warm_up is not None:
                fn, args = self._warm_up
                ex.submit(fn, *args)  # its failure shows again in the task that needs what it builds
            return ex

    def _retire(self, ex: concurrent.futures.ProcessPoolExecutor) -> None:
        with self._lock:
            self._executors.discard(ex)
        ex.shutdown(wait=True)

    def _lane(self, ex: concurrent.futures.ProcessPoolExecutor | None) -> None:
        done = 0
        while True:
            item = self._tasks.get()
            if item is None:
                break
            outer, fn, args = item
            if ex is None:
                try:
                    ex = self._start()
                except BaseException as e:  # noqa: BLE001 - no process for this task: its future says why
                    if outer.set_running_or_notify_cancel():
                        outer.set_exception(e)
                    continue
            if ex is None:  # the pool was stopped
                outer.cancel()
                continue
            if not outer.set_running_or_notify_cancel():  # the caller cancelled it
                continue
            light = False
            try:
                result = ex.submit(fn, *args).result()
                light = self._light is not None and bool(self._light(result))
                outer.set_result(result)
            except BaseException as e:  # noqa: BLE001 - the task's error (a dead worker's too) goes to its future
                outer.set_exception(e)
            done += 0 if light else 1
            if done >= self._tasks_per_process or isinstance(outer.exception(), concurrent.futures.BrokenExecutor):
                self._retire(ex)  # the next task of this lane starts a new process
                ex, done = None, 0
        if ex is not None:
            self._retire(ex)

    def submit(self, fn, *args) -> concurrent.futures.Future:
        """Queue ``fn(*args)`` for the next free lane; its future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._tasks.put((fut, fn, args))
        return fut

    def processes(self) -> list:
        """The worker processes alive now (``multiprocessing.Process``)."""
        with self._lock:
            return [p for ex in self._executors for p in (getattr(ex, "_processes", None) or {}).values()]

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more tasks: each lane finishes what is queued (unless ``cancel_futures``), then its process exits."""
        if cancel_futures:
            with self._lock:
                self._stopped = True
        for _ in self._lanes:
            self._tasks.put(None)
        if wait:
            for lane in self._lanes:
                lane.join()

    def kill(self) -> None:
        """Kill the workers now; queued tasks are cancelled, and a lane starts no new process."""
        with self._lock:
            self._stopped = True
            executors = list(self._executors)
        _kill_and_join([p for ex in executors for p in (getattr(ex, "_processes", None) or {}).values()])
        for ex in executors:
            ex.shutdown(wait=False, cancel_futures=True)
        self.shutdown(wait=False, cancel_futures=True)


def worker_pool(jobs: int, *, warm_up: tuple | None = None,
                light: Callable[[object], bool] | None = None) -> FreshProcessPool:
    """``jobs`` lanes of spawned worker processes that die with this process (``worker_init``), a fresh process per
    task, or after a ``light`` one, the same (``FreshProcessPool``)."""
    return FreshProcessPool(jobs, warm_up=warm_up, light=light)


def compiled_nothing(result: tuple[str, dict]) -> bool:
    """Of a ``_prefetch_one`` result: the worker obtained its record without compiling a program (its ``how`` starts
    with "cached": read by name, or found by its lowered program), so its process may take the next record."""
    return result[0].startswith("cached")


def stop_pool(pool) -> None:
    """Kill the workers now and cancel what has not started (an interrupted or failed run waits for no record). A
    plain ``ProcessPoolExecutor``: its processes are taken before ``shutdown``, which forgets them."""
    if isinstance(pool, FreshProcessPool):
        pool.kill()
        return
    _kill_and_join(list((getattr(pool, "_processes", None) or {}).values()))
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
    # A process that serves another task (after a light one, or with ``tasks_per_process`` above 1) starts it holding
    # neither the full records it read (the control, the reference, the lens's control: about 136 MB each on tiny; a
    # candidate reads them again, as a fresh process would, after its compile and run) nor its programs (jax's
    # in-memory caches keep every executable and trace otherwise); the next record reads the shared programs (the
    # optimizer's, the summaries') back from the persistent compilation cache.
    r.drop_records()
    jax.clear_caches()
    return how, {**r.profile[-1], "process": os.getpid()}


def prefetch(runner: Runner, specs, jobs: int, cache_dir: str | None, *, api_factory: str | None = None,
             on_ready: Callable[[int], None] | None = None) -> None:
    """Compute the control here, then the reference, the lens's control and every candidate of ``specs`` (in that
    order: a candidate's digests read the first two) in ``jobs`` worker processes, into the record cache (XLA
    compiles mostly on one core). Only the candidates with a
    config's default control are prefetched; a worker's failure is reported and the check computes the record itself
    later. ``api_factory``: "module:function" the workers call to build the model API (default: the real model's).
    How each record was obtained goes to ``runner.prefetched``.

    The workers start with the control: they import jax and the model and build their runner meanwhile. Every other
    record replays the control's routing, so they are given their records as soon as the control's steps have run
    (``run_protocol``'s ``on_steps``), while this process computes the control's summaries and stores it; a candidate
    that needs the control's record waits for it (``RecordCache.lock``). A record or candidate that this tree's
    sources already name in the cache (``Runner.stored_by_source``) goes to no worker: its check reads it; with the
    control stored too, a run whose records are all stored starts no worker process.

    ``on_ready(n)``: called here once the workers are given their records (where the records of leading checks were
    all stored already) and each time a worker's record is in, with the number of leading ``specs`` whose records
    are all in the cache (the control, the reference, the candidate, and in the lens the lens's control and candidate),
    so that the caller can run those checks while the workers compute the rest (``gates.suite.check`` gives each
    verdict as soon as its records are in). A spec whose control is not the config's is never counted: its check
    computes its own records after the workers. A record whose worker failed is not counted either: its check computes
    it later."""
    api_factory = api_factory or DEFAULT_API_FACTORY
    base = runner.api.as_dict(runner.base_flags)
    jobs_list = [(None, "reference", runner.base_flags, "reference")]
    lens = runner.lens and any(spec.contract == "rounding" for spec in specs)
    if lens:  # the float32 lens's control, shared by every rounding check
        jobs_list.append(({}, "control-lens", runner.base_flags, "lens"))
    needs: list[frozenset[str] | None] = []  # per spec: the labels of the records its check reads (None: not here)
    for spec in specs:
        control_flags, candidate_flags = runner.resolve(spec)
        if runner.api.as_dict(control_flags) != base:
            needs.append(None)
            continue
        changed = {k: v for k, v in runner.api.as_dict(candidate_flags).items() if base.get(k) != v}
        jobs_list.append((changed, f"candidate[{spec.name}]", candidate_flags, "production"))
        labels = {"reference", f"candidate[{spec.name}]"}
        if lens and spec.contract == "rounding":
            jobs_list.append((changed, f"candidate-lens[{spec.name}]", candidate_flags, "lens"))
            labels |= {"control-lens", f"candidate-lens[{spec.name}]"}
        needs.append(frozenset(labels))
    done: set[str] = set()  # labels whose records are in the cache (stored before this run, or a worker's)

    def ready() -> int:
        n = 0
        for need in needs:
            if need is None or not need <= done:
                break
            n += 1
        return n
    settings = runner.settings.as_dict()
    xla_dir = active_compilation_cache_dir()
    futures: dict = {}
    submitted: list = []  # one entry once the jobs are submitted
    pool = None

    def start_pool():
        # each worker process builds its runner (imports, config, batch) before its record: the first two while the
        # control is computed here
        return worker_pool(jobs, warm_up=(_warm_up, (runner.config_name, settings, cache_dir, api_factory, xla_dir)),
                           light=compiled_nothing)

    if not runner.stored_by_source(runner.base_flags, "production"):
        pool = start_pool()  # the control is computed here: the workers start with it

    def submit(replay):
        nonlocal pool
        if submitted:
            return
        submitted.append(replay)
        # a record or candidate this tree's sources already name in the cache is read by its check; a worker process
        # for it would cost a process start and a runner build (about 1.3 s on tiny) to read it (docs/speed.md)
        todo = [(ov, label, flags, precision) for ov, label, flags, precision in jobs_list
                if not runner.stored_by_source(flags, precision, replay, candidate=bool(ov))]
        done.update({label for _, label, _, _ in jobs_list} - {label for _, label, _, _ in todo})
        runner.progress(f"[{time.perf_counter() - runner.t0:7.1f}s] prefetch: {len(todo)} records in {jobs} "
                        f"worker processes ({len(jobs_list) - len(todo)} stored already)")
        if todo and pool is None:
            pool = start_pool()
        for ov, label, flags, precision in todo:
            fut = pool.submit(_prefetch_one, runner.config_name, settings, cache_dir, ov, label, replay,
                                  api_factory, xla_dir, precision)
            futures[fut] = (label, record_lib.key_digest(runner.key_parts(flags, precision, replay)))

    try:
        runner.shared_record(runner.base_flags, "production", "control (before the checks)", on_steps=submit)
        # the control was read from the cache (or found by its program): no steps ran here, nothing submitted yet
        submit(control_routing(runner.base_control()[0]))
        n = ready()
        if on_ready is not None and n:  # the checks whose records were all stored: now, not after a worker's record
            on_ready(n)
        for fut in concurrent.futures.as_completed(futures):
            label, digest = futures[fut]
            try:
                how, row = fut.result()
                runner.prefetched[digest] = how
                runner.profile.append({**row, "record": f"{label} (worker)"})
                runner.progress(f"[{time.perf_counter() - runner.t0:7.1f}s] prefetch: {label} {how.split(' (')[0]}")
            except Exception as e:  # the check recomputes it; nothing is trusted from a failed worker
                runner.progress(f"prefetch: {label} failed in its worker ({type(e).__name__}: {e}); computed later")
                continue
            done.add(label)
            if on_ready is not None:
                on_ready(ready())
    except BaseException:  # Ctrl-C, or anything else: no worker keeps computing for a run that is over
        if pool is not None:
            stop_pool(pool)
        raise
    if pool is not None:
        pool.shutdown(wait=True)
