"""The prefetch and its worker processes on the toy model (``gates.prefetch``), after one cold run shared by the
module:

- A run whose records are stored starts no worker process for them: ``prefetch`` asks the runner which records and
  candidates this tree's sources already name in the cache (``Runner.stored_by_source``) and hands the workers only
  the rest; with nothing left and the control stored, it starts no pool at all. Each worker process costs a process
  start and a runner build (about 1.3 s on tiny), which a warm rerun of the default run paid 23 times to read what the
  calling process reads anyway (docs/speed.md).
- A worker that finds its candidate reads neither full record; a worker that compiled nothing takes the next record.
- Each check runs, and its verdict is printed, as soon as its own records are in.

Run: python -m pytest tests/gates/test_prefetch_stored.py -q
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import shutil

import pytest

from nxgates.gates import prefetch, suite
from tests.gates import slow_toy, toy_model

SLOW_FLAG = "wi_tile_fwd_batch_seq"  # the toy's fourth check: its candidate and the tuned set's are slowed


def _run(cache_dir, messages, profile=None):
    return suite.check("toy", None, api=toy_model.api(), api_factory="tests.gates.toy_model:api", jobs=2,
                       cache_dir=str(cache_dir), progress=messages.append, explain=False, profile=profile)


def _numbers(report) -> str:
    """Every gate value of every check, both lenses (what a cached record must reproduce)."""
    return json.dumps([[c["name"], c["gates"], c.get("lens_gates")] for c in report.to_json()["checks"]],
                      sort_keys=True)


@dataclasses.dataclass(frozen=True)
class Cold:
    cache: pathlib.Path
    messages: list
    profile: list
    report: object

    def copy(self, to: pathlib.Path) -> pathlib.Path:
        """This run's cache, copied for a test to continue on."""
        return pathlib.Path(shutil.copytree(self.cache, to / "cache"))


@pytest.fixture(scope="module")
def cold(tmp_path_factory) -> Cold:
    """One cold toy run with two workers, whose builds of ``SLOW_FLAG``'s candidates sleep 2 s in the workers
    (``tests/gates/slow_toy.py``; they build the same programs as the toy, so the records are the toy's). (The
    repository's table is tiny's: the toy's verdict is not the point.)"""
    cache = tmp_path_factory.mktemp("cold")
    messages: list = []
    profile: list = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NXGATES_TEST_SLOW_S", "2")
        mp.setenv("NXGATES_TEST_SLOW_IF", SLOW_FLAG)
        report = suite.check("toy", None, api=slow_toy.api(), api_factory="tests.gates.slow_toy:api", jobs=2,
                             cache_dir=str(cache), progress=messages.append, explain=False, profile=profile)
    return Cold(cache, messages, profile, report)


def test_stored_records_go_to_no_worker_and_a_missing_one_alone_does(cold, tmp_path, monkeypatch):
    first = cold.report
    assert first.checks
    started = [m for m in cold.messages if "prefetch:" in m and "worker processes" in m]
    assert started and "(0 stored already)" in started[0], started  # cold: every record went to a worker

    cache = cold.copy(tmp_path)
    pools: list = []
    real_pool = prefetch.worker_pool
    monkeypatch.setattr(prefetch, "worker_pool", lambda *a, **kw: pools.append(a) or real_pool(*a, **kw))
    msgs: list = []
    again = _run(cache, msgs)
    assert pools == [], "a run whose records are all stored started worker processes"
    assert any("prefetch: 0 records in 2 worker processes" in m for m in msgs), msgs
    assert _numbers(again) == _numbers(first)

    # one candidate's digests gone: that one alone goes to a worker (and the run gives the same numbers)
    entries = sorted((cache / "candidates").glob("*.json"))
    assert entries
    entries[0].unlink()
    msgs = []
    third = _run(cache, msgs)
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


def test_workers_that_compile_nothing_take_the_next_record_in_the_same_process(cold, tmp_path):
    """After an edit that changes no program (here: the tree's names removed from the cache), every worker finds its
    record by its lowered program and compiles nothing, so its process takes the lane's next record
    (``prefetch.compiled_nothing``) instead of a fresh process per record; the same numbers. A cold run's workers,
    which compile, still use a process per record."""
    rows = [row for row in cold.profile if row["record"].endswith("(worker)")]
    assert len(rows) >= 4 and len({row["process"] for row in rows}) == len(rows), [r["process"] for r in rows]
    cache = cold.copy(tmp_path)
    for name in (cache / "by-source").glob("*.json"):
        name.unlink()
    profile: list = []
    again = _run(cache, [], profile)
    found = [row for row in profile if row["record"].endswith("(worker)")]
    assert len(found) == len(rows) and all(row["how"].startswith("cached") for row in found), \
        [r["how"] for r in found]
    assert len({row["process"] for row in found}) <= 2, [row["process"] for row in found]  # jobs=2: one per lane
    assert _numbers(again) == _numbers(cold.report)


def test_each_check_is_given_as_soon_as_its_records_are_in(cold, tmp_path):
    """With workers, a check runs as soon as its own records are in (``prefetch(on_ready=...)``), not after the last
    record: its verdict line comes after the lines of its own records and, when a later candidate is slow, before
    that candidate's. The same numbers as a run that reads every record after the workers."""
    msgs = cold.messages
    arrived = {m.group(1): i for i, msg in enumerate(msgs)
               if (m := re.search(r"prefetch: (\S+) (?:computed|cached)", msg))}
    verdicts = {m.group(1): i for i, msg in enumerate(msgs)  # "PASS" or "FAIL: <first failing gate>"
                if (m := re.search(r"check \d+/\d+: (?:FAIL: )?(\S+) \(\w+\)", msg))}
    names = [c.spec.name for c in cold.report.checks]
    assert list(verdicts) == names, (list(verdicts), names)  # one verdict line per check, in order
    for name, at in verdicts.items():
        own = [label for label in arrived if label.endswith(f"[{name}]")]
        assert own and all(arrived[label] < at for label in own), (name, own, msgs)
        assert arrived["reference"] < at
    slow = min(at for label, at in arrived.items() if SLOW_FLAG in label or "[tuned]" in label)
    assert names[3].startswith(SLOW_FLAG)
    assert all(verdicts[name] < slow for name in names[:3]), msgs  # none of them waited for the slow candidates

    again = _run(cold.copy(tmp_path), [])  # every record stored: the checks run after prefetch, with no worker
    assert _numbers(again) == _numbers(cold.report)


def test_checks_whose_records_are_stored_run_before_any_worker_record_is_in(cold, tmp_path, monkeypatch):
    """A rerun where only the slow flag's candidates are missing (their digests deleted): the checks before it read
    stored records only, so their verdicts come as soon as the workers are given the missing ones, not after the
    first of those is in (``prefetch`` calls ``on_ready`` once after submitting). The same numbers."""
    cache = cold.copy(tmp_path)
    control = toy_model.load_config("toy").control
    gone = []
    for entry in (cache / "candidates").glob("*.json"):
        flags = json.loads(entry.read_text())["body"]["metadata"]["flags"]
        if flags[SLOW_FLAG] != getattr(control, SLOW_FLAG):
            entry.unlink()
            gone.append(entry.name)
    assert gone
    monkeypatch.setenv("NXGATES_TEST_SLOW_S", "2")
    monkeypatch.setenv("NXGATES_TEST_SLOW_IF", SLOW_FLAG)
    msgs: list = []
    again = suite.check("toy", None, api=slow_toy.api(), api_factory="tests.gates.slow_toy:api", jobs=2,
                        cache_dir=str(cache), progress=msgs.append, explain=False)
    first_in = min(i for i, m in enumerate(msgs) if re.search(r"prefetch: candidate\S* computed", m))
    verdicts = [i for i, m in enumerate(msgs) if re.search(r"check \d+/\d+: ", m)]
    assert len(verdicts) == 5 and all(i < first_in for i in verdicts[:3]), msgs
    assert _numbers(again) == _numbers(cold.report)
