"""Every byte of a record-cache entry is covered by its check (issue 13 item 1): an entry whose metadata, sidecars or
arrays changed, lost or gained a file, or lost its checksum, is rejected naming the file and recomputed, never
trusted. The issue's case: ``num_steps`` 3 -> 2 in a candidate's metadata made the entry trusted and every gate FAIL;
set to 1 in every entry it gave a traceback. On the toy model.

Run: python -m pytest tests/gates/test_cache_integrity.py -q
"""

from __future__ import annotations

import json
import pathlib

import pytest

from nxgates.gates import cli
from nxgates.gates import record as R
from tests.gates import toy_model
from tests.gates.toy_model import toy_run

KEY = {"kind": "test-entry", "n": 1}


@pytest.fixture
def entry(tmp_path):
    cache = R.RecordCache(tmp_path / "cache")
    cache.store(KEY, toy_run("control"))
    return cache, cache.path(KEY)


def _edit_json(path: pathlib.Path, edit) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def _num_steps_2(doc):
    doc["extra"]["metadata"]["num_steps"] = 2


TAMPERING = {
    "metadata num_steps 3 -> 2": lambda d: _edit_json(d / "meta.json", _num_steps_2),
    "metadata flags": lambda d: _edit_json(d / "meta.json", lambda m: m["extra"]["metadata"]["flags"].update(
        {"moe_wi_gmm_fused_swiglu": True})),
    "step 3 deleted": lambda d: [(d / "steps" / f"000003.{e}").unlink() for e in ("npz", "json")],
    "sidecar dtype": lambda d: _edit_json(d / "steps" / "000002.json", lambda s: s["arrays"]["loss"].update(
        {"dtype": "float64"})),
    "file added": lambda d: (d / "steps" / "000004.json").write_text("{}"),
    "checksum file removed": lambda d: (d / R.ENTRY_CHECKSUM).unlink(),
    "checksum file garbled": lambda d: (d / R.ENTRY_CHECKSUM).write_bytes(b"\xff\xfe not json"),
}


@pytest.mark.parametrize("how", list(TAMPERING))
def test_a_changed_entry_is_recomputed_never_trusted(entry, how):
    cache, d = entry
    assert cache.load(KEY).num_steps == 3
    TAMPERING[how](d)
    with pytest.raises(R.CacheEntryInvalid):
        cache.load(KEY)
    calls = []
    rec, got = cache.get_or_compute(KEY, lambda: calls.append(1) or toy_run("control"), label="control")
    assert calls and got.startswith("recomputed: ") and rec.num_steps == 3, got
    assert cache.get_or_compute(KEY, lambda: pytest.fail("recomputed twice"))[1] == "cached"  # rebuilt, whole


def test_every_byte_of_the_metadata_and_sidecars_is_covered(entry):
    """Flip each byte of meta.json and of a step's sidecar, and sampled bytes of every array file: each is caught."""
    cache, d = entry
    targets = [d / "meta.json", d / "steps" / "000003.json"]
    for path in targets:
        original = path.read_bytes()
        for i in range(len(original)):
            data = bytearray(original)
            data[i] ^= 0x01
            path.write_bytes(bytes(data))
            with pytest.raises(R.CacheEntryInvalid, match=path.name):
                R.verify_entry(d)
        path.write_bytes(original)
    for path in sorted(d.glob("steps/*.npz")):
        original = path.read_bytes()
        for i in range(0, len(original), max(1, len(original) // 16)):
            data = bytearray(original)
            data[i] ^= 0x80
            path.write_bytes(bytes(data))
            with pytest.raises(R.CacheEntryInvalid, match=path.name):
                R.verify_entry(d)
        path.write_bytes(original)
    R.verify_entry(d)  # restored: trusted again
    assert cache.load(KEY).num_steps == 3


def test_the_issue_case_through_the_cli(tmp_path, capsys):
    """num_steps edited in every entry (the records' metadata, the candidate's digests) and a record's last step
    deleted: the next run recomputes them and passes (before: every gate FAILed, exit 1, on every rerun; num_steps=1
    everywhere: a traceback)."""
    argv = ["run", "--config", "toy", "--jobs", "1", "--flags", "fp8_fake_quant_hoist=gather8", "--out",
            str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache")]
    assert cli.main(argv, api=toy_model.api()) == 0
    # the record entries (not the by-source names, gates.runner, the locks, the candidates' digests, gates.candidates,
    # nor compiled programs, gates.profile)
    entries = sorted(p for p in (tmp_path / "cache").iterdir()
                     if p.is_dir() and p.name not in ("by-source", "xla", "locks", "candidates"))
    assert len(entries) == 2
    for d in entries:
        _edit_json(d / "meta.json", lambda m: m["extra"]["metadata"].update({"num_steps": 1}))
    for e in ("npz", "json"):
        (entries[0] / "steps" / f"000003.{e}").unlink()
    (candidate,) = (tmp_path / "cache" / "candidates").iterdir()
    _edit_json(candidate, lambda m: m["body"]["vs_control"].update({"num_steps": 1}))
    capsys.readouterr()
    code = cli.main(argv, api=toy_model.api())
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err, err
    records = json.loads((tmp_path / "out" / "gates.json").read_text())["checks"][0]["records"]
    assert all(how.startswith("recomputed: ") for how in records.values()), records
    assert cli.main(argv, api=toy_model.api()) == 0  # and trusted again once rebuilt
    records = json.loads((tmp_path / "out" / "gates.json").read_text())["checks"][0]["records"]
    assert set(records.values()) == {"cached"}, records
