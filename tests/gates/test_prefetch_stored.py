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


def _run(cache_dir, messages, profile=None):
    return suite.check("toy", None, api=toy_model.api(), api_factory="tests.gates.toy_model:api", jobs=2,
                       cache_dir=str(cache_dir), progress=messages.append, explain=False, profile=profile)


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


def test_a_worker_that_finds_its_candidate_reads_neither_full_record(tmp_path):
    """A prefetch worker's ``candidate_summary``: where the candidate's digests are in the cache (named for this tree,
    or found by the lowered program after an edit that changes no program), it reads neither the control's nor the
    reference's full record (their program keys find the entry); where they are not, it reads both to form them. The
    same numbers every way."""
    from nxgates.gates import contracts, runner
    from nxgates.gates import record as record_lib

    def fresh():  # a runner as a worker process builds it
        return runner.Runner("toy", api=toy_model.api(), cache=record_lib.RecordCache(str(tmp_path)), progress=None,
                             lens=False)

    r0 = fresh()
    spec = contracts.build_check("f", {"moe_wi_gmm_fused_swiglu": True}, r0.api.as_dict(r0.base_flags), r0.closure)
    r0.run_check(spec)
    control_flags, candidate_flags = r0.resolve(spec)
    replay = runner.control_routing(r0.shared_record(control_flags, "production", "control")[0])

    def worker():
        r = fresh()
        summary, how = r.candidate_summary(candidate_flags, "production", "candidate[f]", replay)
        numbers = {k: v for k, v in summary.to_json().items() if k != "metadata"}  # metadata: the run's timings too
        return r, json.dumps(numbers, sort_keys=True), how

    r, named, how = worker()
    assert how == "cached" and r._records == {}, (how, list(r._records))
    r._alias_path(record_lib.key_digest(r.key_parts(candidate_flags, "production", replay))).unlink()
    r, by_program, how = worker()  # the candidate's name gone, as after an edit: its lowered program finds it
    assert how == "cached (the same program and inputs)" and r._records == {}, (how, list(r._records))
    for entry in (tmp_path / "candidates").glob("*.json"):
        entry.unlink()
    r, computed, how = worker()
    assert how == "computed" and len(r._records) == 2, (how, list(r._records))
    assert named == by_program == computed


def test_workers_that_compile_nothing_take_the_next_record_in_the_same_process(tmp_path):
    """After an edit that changes no program (here: the tree's names removed from the cache), every worker finds its
    record by its lowered program and compiles nothing, so its process takes the lane's next record
    (``prefetch.compiled_nothing``) instead of a fresh process per record; the same numbers. A cold run's workers,
    which compile, still use a process per record."""
    profile: list = []
    first = _run(tmp_path, [], profile)
    cold = [row for row in profile if row["record"].endswith("(worker)")]
    assert len(cold) >= 4 and len({row["process"] for row in cold}) == len(cold), [r["process"] for r in cold]
    for name in (tmp_path / "by-source").glob("*.json"):
        name.unlink()
    profile = []
    again = _run(tmp_path, [], profile)
    rows = [row for row in profile if row["record"].endswith("(worker)")]
    assert len(rows) == len(cold) and all(row["how"].startswith("cached") for row in rows), [r["how"] for r in rows]
    assert len({row["process"] for row in rows}) <= 2, [row["process"] for row in rows]  # jobs=2: one per lane
    assert _numbers(again) == _numbers(first)


def test_each_check_is_given_as_soon_as_its_records_are_in(tmp_path, monkeypatch):
    """With workers, a check runs as soon as its own records are in (``prefetch(on_ready=...)``), not after the last
    record: its verdict line comes after the lines of its own records and, when a later candidate is slow, before
    that candidate's. The same numbers as a run that reads every record after the workers."""
    import re

    from tests.gates import slow_toy

    monkeypatch.setenv("NXGATES_TEST_SLOW_S", "4")
    monkeypatch.setenv("NXGATES_TEST_SLOW_IF", "wi_tile_fwd_batch_seq")  # the last flag's candidate and the tuned set
    msgs: list = []
    streamed = suite.check("toy", None, api=slow_toy.api(), api_factory="tests.gates.slow_toy:api", jobs=2,
                           cache_dir=str(tmp_path), progress=msgs.append, explain=False)
    arrived = {m.group(1): i for i, msg in enumerate(msgs)
               if (m := re.search(r"prefetch: (\S+) (?:computed|cached)", msg))}
    verdicts = {m.group(1): i for i, msg in enumerate(msgs)  # "PASS" or "FAIL: <first failing gate>"
                if (m := re.search(r"check \d+/\d+: (?:FAIL: )?(\S+) \(\w+\)", msg))}
    names = [c.spec.name for c in streamed.checks]
    assert list(verdicts) == names, (list(verdicts), names)  # one verdict line per check, in order
    for name, at in verdicts.items():
        own = [label for label in arrived if label.endswith(f"[{name}]")]
        assert own and all(arrived[label] < at for label in own), (name, own, msgs)
        assert arrived["reference"] < at
    slow = min(at for label, at in arrived.items() if "wi_tile_fwd_batch_seq" in label or "[tuned]" in label)
    assert names[3].startswith("wi_tile_fwd_batch_seq")
    assert all(verdicts[name] < slow for name in names[:3]), msgs  # none of them waited for the slow candidates

    monkeypatch.delenv("NXGATES_TEST_SLOW_S")
    again = _run(tmp_path, [])  # every record stored: the checks run after prefetch, which starts no worker
    assert _numbers(again) == _numbers(streamed)
