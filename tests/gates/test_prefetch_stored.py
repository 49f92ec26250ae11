"""A run whose records are stored starts no worker process for them: ``gates.prefetch`` asks the runner which records
and candidates this tree's sources already name in the cache (``Runner.stored_by_source``) and hands the workers only
the rest; with nothing left and the control stored, it starts no pool at all. Each worker process costs a process
start and a runner build (about 1.3 s on tiny), which a warm rerun of the default run paid 23 times to read what
the calling process reads anyway (docs/speed.md).

Run: python -m pytest tests/gates/test_prefetch_stored.py -q
"""

from __future__ import annotations

import json

from nxgates.gates import prefetch, suite
from tests.gates import toy_model


def _run(cache_dir, messages):
    return suite.check("toy", None, api=toy_model.api(), api_factory="tests.gates.toy_model:api", jobs=2,
                       cache_dir=str(cache_dir), progress=messages.append, explain=False)


def _numbers(report) -> str:
    """Every gate value of every check, both lenses (what a cached record must reproduce)."""
    return json.dumps([[c["name"], c["gates"], c.get("lens_gates")] for c in report.to_json()["checks"]],
                      sort_keys=True)


def test_stored_records_go_to_no_worker_and_a_missing_one_alone_does(tmp_path, monkeypatch):
    first_msgs: list = []
    first = _run(tmp_path, first_msgs)  # (the repository's table is tiny's: the toy's verdict is not the point)
    assert first.checks
    started = [m for m in first_msgs if "prefetch:" in m and "worker processes" in m]
    assert started and "(0 stored already)" in started[0], started  # cold: every record went to a worker

    pools: list = []
    real_pool = prefetch.worker_pool
    monkeypatch.setattr(prefetch, "worker_pool", lambda *a, **kw: pools.append(a) or real_pool(*a, **kw))
    msgs: list = []
    again = _run(tmp_path, msgs)
    assert pools == [], "a run whose records are all stored started worker processes"
    assert any("prefetch: 0 records in 2 worker processes" in m for m in msgs), msgs
    assert _numbers(again) == _numbers(first)

    # one candidate's digests gone: that one alone goes to a worker (and the run gives the same numbers)
    entries = sorted((tmp_path / "candidates").glob("*.json"))
    assert entries
    entries[0].unlink()
    msgs = []
    third = _run(tmp_path, msgs)
    assert len(pools) == 1
    assert any("prefetch: 1 records in 2 worker processes" in m for m in msgs), msgs
    assert _numbers(third) == _numbers(first)
