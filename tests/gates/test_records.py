"""The record format (gates/records.py): round trip, a run killed mid-step, and every unreadable record refused by
name (missing, corrupt, unknown version)."""

import json

import numpy as np
import pytest

from nxgates.gates import records as R
from nxgates.gates.sketch import SketchSpec


def _run(tmp_path, steps=(1, 2)):
    d = tmp_path / "run"
    meta = R.new_meta(trainer="test", config={"a": 1}, sketch=SketchSpec(width=8, seed=1))
    R.write_meta(d, meta)
    for s in steps:
        R.write_step(d, s, {"loss": np.float32(0.5 + s), "grad_sketch/w": np.arange(8, dtype=np.float32) * s,
                            "grad_fp/w": np.array([s, 7], np.uint32)})
    return d


def test_round_trip_keeps_dtypes_and_values(tmp_path):
    d = _run(tmp_path)
    run = R.load_run(d)
    assert run.step_numbers == [1, 2] and run.spec == SketchSpec(width=8, seed=1)
    assert run.steps[2].get("loss").dtype == np.float32 and float(run.steps[2].get("loss")) == 2.5
    np.testing.assert_array_equal(run.steps[2].group("grad_sketch")["w"], np.arange(8, dtype=np.float32) * 2)
    assert run.steps[1].has_group("grad_fp") and not run.steps[1].has_group("param_fp")
    side = json.loads((d / "steps" / "000001.json").read_text())
    assert side["fields"] == ["grad_fp/w", "grad_sketch/w", "loss"] and side["arrays"]["loss"]["dtype"] == "float32"


def test_killed_mid_step_leaves_earlier_steps_readable_and_the_torn_step_named(tmp_path):
    d = _run(tmp_path, steps=(1, 2))
    (d / "steps" / "000003.npz").write_bytes(b"PK\x03\x04 half a zip")  # npz written, sidecar never was
    with pytest.raises(R.RecordError, match=r"000003\.npz.*step 3 has no sidecar"):
        R.load_run(d)
    (d / "steps" / "000003.npz").unlink()
    assert R.load_run(d).step_numbers == [1, 2]


@pytest.mark.parametrize("damage, message", [
    ("missing_dir", "missing record"),
    ("missing_meta", "missing meta.json"),
    ("bad_json", "corrupt meta.json"),
    ("version", "format_version=99 is not one"),
    ("not_record", "not an nxgates record"),
    ("checksum", "checksum mismatch"),
    ("missing_npz", "missing arrays of step 2"),
    ("no_steps", "missing steps"),
    ("bad_field", "is not one of"),
])
def test_bad_records_are_refused_by_name(tmp_path, damage, message):
    d = _run(tmp_path)
    meta_path = d / "meta.json"
    if damage == "missing_dir":
        d = tmp_path / "nowhere"
    elif damage == "missing_meta":
        meta_path.unlink()
    elif damage == "bad_json":
        meta_path.write_text("{not json")
    elif damage in ("version", "not_record"):
        m = json.loads(meta_path.read_text())
        m["format_version" if damage == "version" else "format"] = 99 if damage == "version" else "other"
        meta_path.write_text(json.dumps(m))
    elif damage == "checksum":
        p = d / "steps" / "000002.npz"
        b = bytearray(p.read_bytes())
        b[len(b) // 2] ^= 0xFF
        p.write_bytes(bytes(b))
    elif damage == "missing_npz":
        (d / "steps" / "000002.npz").unlink()
    elif damage == "no_steps":
        for p in (d / "steps").iterdir():
            p.unlink()
    elif damage == "bad_field":
        with pytest.raises(ValueError, match=message):
            R.write_step(d, 3, {"gradients/w": np.zeros(2)})
        return
    with pytest.raises(R.RecordError, match=message):
        R.load_run(d)
