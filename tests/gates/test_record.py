"""Run records on disk: exact round trip, and a cache that never trusts a corrupted, truncated or stale entry.

Run: python -m pytest tests/gates/test_record.py -q
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from nxgates.gates import record as R
from tests.gates.toy_model import synthetic_record

KEY = {"config": "toy", "flags": {"a": True}, "precision": "production", "env": {"jax": "0.12.0.1"}}


def assert_same(a: R.RunRecord, b: R.RunRecord):
    assert a.num_steps == b.num_steps
    for n in a.params0:
        assert a.params0[n].tobytes() == b.params0[n].tobytes()
    for sa, sb in zip(a.steps, b.steps, strict=True):
        assert sa.loss.tobytes() == sb.loss.tobytes() and sa.loss.dtype == sb.loss.dtype == np.float32
        assert sa.logp.tobytes() == sb.logp.tobytes()
        assert sa.grad_norm.tobytes() == sb.grad_norm.tobytes()
        assert sa.dropped_tokens == sb.dropped_tokens and sa.routing_mismatch == sb.routing_mismatch
        assert (sa.routing is None) == (sb.routing is None)
        if sa.routing is not None:
            assert sa.routing.dtype == sb.routing.dtype and sa.routing.tobytes() == sb.routing.tobytes()
        assert set(sa.grads) == set(sb.grads) and all(sa.grads[n].tobytes() == sb.grads[n].tobytes() for n in sa.grads)
        assert all(sa.params[n].tobytes() == sb.params[n].tobytes() for n in sa.params)
    assert a.mask.tobytes() == b.mask.tobytes()


class Counter:
    def __init__(self, rec):
        self.rec, self.calls = rec, 0

    def __call__(self):
        self.calls += 1
        return self.rec


def test_store_load_round_trip_is_bit_exact(tmp_path):
    rec = synthetic_record(3, metadata={"implementations": {"moe_mlp": "pallas"}})
    cache = R.RecordCache(tmp_path)
    cache.store(KEY, rec)
    back = cache.load(KEY)
    assert_same(rec, back)
    assert back.metadata["implementations"] == {"moe_mlp": "pallas"} and back.metadata["num_steps"] == 3


def test_routing_round_trips(tmp_path):
    rec = synthetic_record(3)
    for i, s in enumerate(rec.steps):
        s.routing = np.arange(24, dtype=np.int32).reshape(1, 2, 2, 3, 2) + i
        s.routing_mismatch = 5 * i
    cache = R.RecordCache(tmp_path)
    cache.store(KEY, rec)
    back = cache.load(KEY)
    assert_same(rec, back)
    assert [s.routing_mismatch for s in back.steps] == [0, 5, 10] and back.steps[2].routing[0, 0, 0, 0, 0] == 2


def test_computed_once_then_cached(tmp_path):
    compute = Counter(synthetic_record(1))
    cache = R.RecordCache(tmp_path)
    _, how1 = cache.get_or_compute(KEY, compute)
    rec2, how2 = cache.get_or_compute(KEY, compute)
    assert (how1, how2, compute.calls) == ("computed", "cached", 1)
    assert_same(rec2, compute.rec)
    # Different key parts (e.g. another flag value or jax version) -> another entry, computed again.
    _, how3 = cache.get_or_compute({**KEY, "env": {"jax": "0.13"}}, compute)
    assert how3 == "computed" and compute.calls == 2


def _corrupt_npz(npz):
    data = bytearray(npz.read_bytes())
    data[len(data) // 2] ^= 0xFF
    npz.write_bytes(bytes(data))


def _truncate_json(js):
    js.write_text(js.read_text()[:40])


def _edit_meta(js, fn):
    meta = json.loads(js.read_text())
    fn(meta)
    js.write_text(json.dumps(meta))


def _stale_key(js):
    _edit_meta(js, lambda m: m["extra"]["key"].update(flags={"a": False}))


def _old_format(js):
    _edit_meta(js, lambda m: m.update(format_version=2))


def _unclosed(js):
    _edit_meta(js, lambda m: m.update(closed=False))


@pytest.mark.parametrize(
    "damage, reason",
    [
        # the entry's checksum (gates.record.verify_entry) names the file before the record format is parsed
        (lambda npz, js: _corrupt_npz(npz), "000002.npz: changed since the entry was written"),
        (lambda npz, js: npz.write_bytes(npz.read_bytes()[:100]), "000002.npz: changed since the entry was written"),
        (lambda npz, js: npz.unlink(), "000002.npz: missing"),
        (lambda npz, js: _truncate_json(js), "meta.json: changed since the entry was written"),
        (lambda npz, js: _stale_key(js), "meta.json: changed since the entry was written"),
        (lambda npz, js: _old_format(js), "meta.json: changed since the entry was written"),
        (lambda npz, js: _unclosed(js), "meta.json: changed since the entry was written"),
        (lambda npz, js: npz.with_suffix(".json").unlink(), "000002.json: missing"),
    ],
    ids=["flipped-byte", "truncated-npz", "missing-npz", "truncated-json", "stale-key", "old-format", "unclosed",
         "torn-step"],
)
def test_damaged_entry_is_recomputed_not_trusted(tmp_path, damage, reason):
    good = synthetic_record(2)
    cache = R.RecordCache(tmp_path)
    cache.store(KEY, synthetic_record(9))  # what a damaged entry would have given
    d = cache.path(KEY)
    damage(d / "steps" / "000002.npz", d / "meta.json")
    with pytest.raises(R.CacheEntryInvalid, match=reason):
        cache.load(KEY)
    compute = Counter(good)
    rec, how = cache.get_or_compute(KEY, compute)
    assert compute.calls == 1 and how.startswith("recomputed: ") and reason in how
    assert_same(rec, good)
    assert_same(cache.load(KEY), good)  # the entry was rewritten and is valid again


def test_checksum_covers_content_not_just_length(tmp_path):
    cache = R.RecordCache(tmp_path)
    cache.store(KEY, synthetic_record(4))
    other = R.RecordCache(tmp_path / "other")
    other.store(KEY, synthetic_record(5))
    npz, npz_other = (c.path(KEY) / "steps" / "000002.npz" for c in (cache, other))
    assert npz_other.stat().st_size == npz.stat().st_size  # same layout, same size, other numbers
    npz.write_bytes(npz_other.read_bytes())
    with pytest.raises(R.CacheEntryInvalid, match="000002.npz: changed since the entry was written"):
        cache.load(KEY)


def test_no_temporary_files_left_behind(tmp_path):
    cache = R.RecordCache(tmp_path)
    cache.store(KEY, synthetic_record(6))
    d = cache.path(KEY)
    assert [p.name for p in tmp_path.iterdir()] == [d.name]
    assert sorted(p.name for p in d.iterdir()) == [R.ENTRY_CHECKSUM, "meta.json", "steps"]
    names = sorted(p.name for p in (d / "steps").iterdir())
    assert names == [f"00000{i}.{e}" for i in range(4) for e in ("json", "npz")]


def test_a_cached_record_is_a_run_in_the_record_format(tmp_path):
    """One format: the cache's entry is what records.load_run reads and compare judges; the summaries are there."""
    from nxgates.gates import compare, records

    cache = R.RecordCache(tmp_path)
    cache.store(KEY, synthetic_record(7, metadata={"config": "toy", "config_values": {"d": 4}, "batch_seed": 3}))
    run = records.load_run(cache.path(KEY))
    assert run.meta["trainer"] == "nxgates" and run.meta["config"] == {"d": 4} and run.step_numbers == [1, 2, 3]
    assert run.steps[1].has_group("grad_sketch") and run.steps[1].has_group("update_sketch")
    assert run.steps[1].has_group("grad_fp") and run.steps[0].has_group("param_fp")
    rep = compare.compare(run, run, run, contract="exact")
    assert rep.exit_code == 0 and rep.judged == ["N1", "N2", "N3", "N4", "N5", "N6"]
