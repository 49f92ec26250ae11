"""Prefetch workers die with their parent: SIGKILL the process running ``gates.check(jobs=2)`` while its workers are
computing and no worker survives (issue 13 item 2); without the workers' guard (``gates.prefetch.worker_init``) the
same test finds the orphans, so it can fail.

The run is the toy model with builds that sleep in the workers (``tests/gates/slow_toy.py``), so the kill lands while
both workers are busy. Linux only (the process tree is read from /proc).

Run: python -m pytest tests/gates/test_prefetch_kill.py -q
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process tree from /proc")

ROOT = pathlib.Path(__file__).resolve().parents[2]

DRIVER = """
import sys
from nxgates.devices import use_host_devices
use_host_devices()
from nxgates.gates import prefetch, suite
from tests.gates import slow_toy
if sys.argv[2] == "unguarded":  # the deliberately wrong pool: workers without worker_init
    import concurrent.futures, multiprocessing
    prefetch.worker_pool = lambda jobs, **kw: concurrent.futures.ProcessPoolExecutor(
        max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))
suite.check("toy", None, api=slow_toy.api(), api_factory="tests.gates.slow_toy:api", jobs=2, cache_dir=sys.argv[1],
            progress=lambda m: print(m, file=sys.stderr, flush=True))
"""


# How long the workers get to die after their parent: the kernel's PDEATHSIG kills them at once and the watchdog
# within prefetch.WATCHDOG_PERIOD_S (0.5 s); a worker alive after this is an orphan (the unguarded pool's workers wait
# on their 600 s builds).
SURVIVOR_WINDOW_S = 5.0


def children(pid: int) -> set[int]:
    """The live processes whose parent is ``pid``."""
    out = set()
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            out.add(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    try:
        text = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text.rsplit(")", 1)[1].split()[0] != "Z"


def kill_parent_during_prefetch(tmp_path, mode: str) -> tuple[set[int], set[int]]:
    """Start the driver, wait until both workers are building, SIGKILL the driver; (workers, survivors after
    ``SURVIVOR_WINDOW_S``)."""
    env = {**os.environ, "NXGATES_TEST_SLOW_S": "600", "NXGATES_TEST_SLOW_WHERE": "workers"}
    log = (tmp_path / f"{mode}.log").open("w")
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path / f"cache-{mode}"), mode], cwd=ROOT, env=env,
                            stderr=log, stdout=log)
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            if (tmp_path / f"{mode}.log").read_text().count("building slowly") >= 2:
                break
            text = (tmp_path / f"{mode}.log").read_text()
            assert proc.poll() is None and "failed in its worker" not in text, text
            time.sleep(0.5)
        else:
            pytest.fail("the workers did not start building in 240 s:\n" + (tmp_path / f"{mode}.log").read_text())
        workers = children(proc.pid)  # the workers (and any helper process the pool started)
        lines = (tmp_path / f"{mode}.log").read_text().splitlines()
        building = {int(line.split("pid ")[1].split()[0]) for line in lines if "building slowly" in line}
        assert building <= workers, (building, workers)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.time() + SURVIVOR_WINDOW_S
        while time.time() < deadline and any(alive(p) for p in workers):
            time.sleep(0.2)
        return workers, {p for p in workers if alive(p)}
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


def test_no_worker_survives_its_parent(tmp_path):
    workers, survivors = kill_parent_during_prefetch(tmp_path, "guarded")
    assert len(workers) >= 2 and not survivors, (workers, survivors)


def test_unguarded_workers_would_survive(tmp_path):
    """The deliberately wrong pool (no ``worker_init``): the same kill leaves orphans, which the test then ends."""
    workers, survivors = kill_parent_during_prefetch(tmp_path, "unguarded")
    try:
        assert survivors, "the kill test cannot tell: unguarded workers died too"
    finally:
        for pid in survivors:
            os.kill(pid, signal.SIGKILL)
