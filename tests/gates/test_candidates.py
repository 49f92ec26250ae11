"""A candidate kept as its digests (gates.candidates): the same gate results to the bit as from its record, through
the JSON entry; a damaged or stale entry is refused; the cache lock makes a second process wait.

Run: python -m pytest tests/gates/test_candidates.py -q
"""

from __future__ import annotations

import copy
import dataclasses
import json
import multiprocessing
import time

import numpy as np
import pytest

from nxgates.gates import candidates as C
from nxgates.gates import gates as G
from nxgates.gates import record as record_lib
from tests.gates.test_gates import TOLS, noisy
from tests.gates.toy_model import synthetic_record


def _cases():
    control = synthetic_record(0)
    reference = noisy(control, 1e-3, seed=1)
    inf = copy.deepcopy(control)
    g = inf.steps[1].grads["head"].copy()
    g[0, 0] = np.inf
    inf.steps[1].grads["head"] = g
    dropped = noisy(control, 1e-3, seed=3)
    dropped.steps[0].dropped_tokens = 2
    short = copy.deepcopy(control)
    short.steps = short.steps[:2]
    return control, reference, {"noisy": noisy(control, 2e-3, seed=2), "identical": copy.deepcopy(control),
                                "non-finite": inf, "dropped": dropped, "other start": synthetic_record(5),
                                "two steps": short}


CONTROL, REFERENCE, CANDIDATES = _cases()


@pytest.mark.parametrize("name", sorted(CANDIDATES))
@pytest.mark.parametrize("contract", ["exact", "rounding"])
@pytest.mark.parametrize("min_size", [1, 20])
def test_gates_from_a_stored_entry_equal_the_gates_from_the_records(tmp_path, name, contract, min_size):
    cand = CANDIDATES[name]
    tols = TOLS if min_size == 1 else dataclasses.replace(TOLS, min_size={"N5": min_size})
    want = G.evaluate(cand, CONTROL, REFERENCE, contract, tols)
    key = C.entry_key("c" * 32, "k" * 32, "r" * 32)
    C.store(tmp_path, key, C.CandidateSummary.of(cand, CONTROL, REFERENCE))
    back = C.load(tmp_path, key)
    got = G.evaluate_digests(back.vs_control, back.vs_reference, G.pair_digest(CONTROL, REFERENCE), contract, tols)
    assert [r.as_dict() for r in got[0]] == [r.as_dict() for r in want[0]]  # floats compared exactly
    assert got[1] == want[1]
    if name != "identical":  # and the case is not a vacuous one: something differs from the control
        assert want[1] or any(r.vs_control > 0 for r in want[0])


def test_a_digest_keeps_what_the_gates_read(tmp_path):
    cand = CANDIDATES["noisy"]
    d = G.pair_digest(cand, CONTROL)
    for i in range(3):
        assert d.metrics(i, min_size=20) == G.metrics(cand, CONTROL, i, min_size=20)
        assert d.steps[i].identical == {g: G.bit_identical(g, cand, CONTROL, i) for g in G.GATES}
    assert [g for g, same in d.steps[0].identical.items() if same] == ["N1"]  # noisy() leaves the loss alone
    assert all(G.pair_digest(CONTROL, copy.deepcopy(CONTROL)).steps[0].identical.values())


def test_a_damaged_or_stale_entry_is_refused(tmp_path):
    key = C.entry_key("c" * 32, "k" * 32, "r" * 32)
    path = C.store(tmp_path, key, C.CandidateSummary.of(CANDIDATES["noisy"], CONTROL, REFERENCE))
    other = key | {"control": "x" * 32}  # the entry copied to another key's path: its key says it is not that one
    C.entry_path(tmp_path, other).write_bytes(path.read_bytes())
    with pytest.raises(record_lib.CacheEntryInvalid, match="key parts differ"):
        C.load(tmp_path, other)
    assert C.load(tmp_path, key).vs_control.num_steps == 3
    doc = json.loads(path.read_text())
    doc["body"]["vs_control"]["steps"][0]["scalar"]["N2"] = 0.0  # one number edited: sha256 mismatch
    path.write_text(json.dumps(doc))
    with pytest.raises(record_lib.CacheEntryInvalid, match="sha256 mismatch"):
        C.load(tmp_path, key)
    path.write_text(path.read_text()[:100])  # truncated
    with pytest.raises(record_lib.CacheEntryInvalid, match="unreadable"):
        C.load(tmp_path, key)
    with pytest.raises(FileNotFoundError):
        C.load(tmp_path, key | {"candidate": "d" * 32})


def _take_lock(root, name, out):
    cache = record_lib.RecordCache(root)
    with cache.lock(name):
        out.put(time.monotonic())


def test_the_cache_lock_makes_another_process_wait_and_is_reentrant(tmp_path):
    cache = record_lib.RecordCache(tmp_path)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    with cache.lock("rec"):
        with cache.lock("rec"):  # the same process again: no deadlock
            pass
        proc = ctx.Process(target=_take_lock, args=(str(tmp_path), "rec", out))
        proc.start()
        time.sleep(1.0)
        released = time.monotonic()
    acquired = out.get(timeout=60)
    proc.join(timeout=60)
    assert acquired >= released  # the other process got it only once this one let go
    with cache.lock("other"):  # another name is not held by anyone
        pass
