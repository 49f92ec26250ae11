"""``gates.prefetch.FreshProcessPool``: every task in a process of its own (after that process's warm-up), a dead
worker fails its task only, and ``stop_pool`` leaves no worker behind.

Run: python -m pytest tests/gates/test_prefetch_pool.py -q
"""

from __future__ import annotations

import concurrent.futures
import os
import time

import pytest

from nxgates.gates import prefetch

_WARM: dict = {}


def warm_up(tag: str) -> None:
    """In a worker: what its tasks must find there."""
    _WARM["tag"] = tag
    _WARM["pid"] = os.getpid()


def task(i: int) -> tuple[int, int, str | None]:
    """In a worker: (i, this process, the tag its warm-up left)."""
    return i, os.getpid(), _WARM.get("tag") if _WARM.get("pid") == os.getpid() else None


def crash(i: int) -> None:
    os._exit(3)


def fail(i: int) -> None:
    raise ValueError(f"task {i} failed on purpose")


def sleep(i: int) -> int:
    time.sleep(600)
    return i


def _run(pool, fn, items):
    futures = [pool.submit(fn, i) for i in items]
    return [f.result(timeout=120) for f in futures]


def test_every_task_runs_in_a_fresh_process_after_its_warm_up():
    pool = prefetch.FreshProcessPool(2, warm_up=(warm_up, ("warm",)))
    try:
        out = _run(pool, task, range(3))
    finally:
        pool.shutdown(wait=True)
    assert [i for i, _, _ in out] == list(range(3))
    pids = [pid for _, pid, _ in out]
    assert len(set(pids)) == 3 and os.getpid() not in pids, pids
    assert [tag for _, _, tag in out] == ["warm"] * 3
    assert pool.processes() == []  # every process retired


def test_tasks_per_process_bounds_the_reuse_and_can_fail():
    """Two tasks per process: a pid serves at most two tasks, and fewer processes than tasks are used (the check of
    the test above would fail on this pool)."""
    pool = prefetch.FreshProcessPool(1, tasks_per_process=2)
    try:
        pids = [pid for _, pid, _ in _run(pool, task, range(4))]
    finally:
        pool.shutdown(wait=True)
    assert len(set(pids)) == 2 and all(pids.count(p) == 2 for p in pids), pids


def test_a_light_task_keeps_its_process_for_the_next():
    """``light``: a task whose result it holds true does not count against ``tasks_per_process``; the next task of
    its lane runs in the same process, and a task after a heavy one in a new process."""
    pool = prefetch.FreshProcessPool(1, light=lambda out: out[0] in (0, 1))
    try:
        pids = [pid for _, pid, _ in _run(pool, task, range(5))]
    finally:
        pool.shutdown(wait=True)
    assert pids[0] == pids[1] == pids[2] and len({pids[2], pids[3], pids[4]}) == 3, pids


def test_a_dead_worker_fails_its_task_only():
    pool = prefetch.FreshProcessPool(1)
    try:
        first, dead, error, last = (pool.submit(fn, i) for fn, i in ((task, 0), (crash, 1), (fail, 2), (task, 3)))
        assert first.result(timeout=120)[0] == 0
        with pytest.raises(concurrent.futures.process.BrokenProcessPool):
            dead.result(timeout=120)
        with pytest.raises(ValueError, match="task 2 failed on purpose"):
            error.result(timeout=120)
        assert last.result(timeout=120)[0] == 3
    finally:
        pool.shutdown(wait=True)


def test_stop_pool_kills_the_workers_and_cancels_what_waits():
    pool = prefetch.FreshProcessPool(2)
    running = [pool.submit(sleep, i) for i in range(2)]
    waiting = pool.submit(task, 2)
    deadline = time.time() + 60
    while len(pool.processes()) < 2 or not all(f.running() for f in running):
        assert time.time() < deadline, "the two workers did not start"
        time.sleep(0.1)
    procs = pool.processes()
    prefetch.stop_pool(pool)
    for f in running:
        with pytest.raises(concurrent.futures.process.BrokenProcessPool):
            f.result(timeout=30)
    with pytest.raises(concurrent.futures.CancelledError):
        waiting.result(timeout=30)
    for p in procs:
        p.join(timeout=10)
        assert not p.is_alive(), p.pid
    pool.shutdown(wait=True)  # the lanes have retired every executor
    assert pool.processes() == []


@pytest.mark.parametrize("jobs, per", [(0, 1), (2, 0)])
def test_bad_sizes_are_refused(jobs, per):
    with pytest.raises(ValueError, match=f"jobs={jobs}, tasks_per_process={per}"):
        prefetch.FreshProcessPool(jobs, tasks_per_process=per)
