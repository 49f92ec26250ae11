"""gates.metrics_log: a JSON-lines metrics log (MaxText's by default) imported as a record, its precision kept."""

import json

import numpy as np
import pytest

from nxgates.gates import metrics_log as ml
from nxgates.gates import records


def _maxtext_log(path, losses, grad_norms, *, eval_after=None):
    """What MaxText's write_metrics_locally writes: json.dumps of float(float32) scalars, the step as a float."""
    with open(path, "w") as f:
        for step, (loss, gn) in enumerate(zip(losses, grad_norms, strict=True)):
            f.write(json.dumps({"learning/loss": float(np.float32(loss)), "learning/grad_norm": float(np.float32(gn)),
                                "learning/lr": 1e-5, "perf/step_time_seconds": 0.5, "step": float(step),
                                "run_name": "demo"}) + "\n")
            if step == eval_after:
                f.write(json.dumps({"eval/avg_loss": 4.0, "step": float(step), "run_name": "demo"}) + "\n")
    return path


@pytest.mark.parametrize(("text", "digits", "exact", "resolution"), [
    ("4.1587", 5, False, 5e-5),
    ("0.0012", 2, False, 5e-5),
    ("1.250e-3", 4, False, 5e-7),
    ("12", 2, False, 0.5),
    ("4.158699989318848", 16, True, 0.0),  # a float32 printed as its double: identifies the float32
    ("4.1586999893188477", 17, True, 0.0),
    ("4.15869998931884", 15, False, 5e-15),  # 15 digits of the same value: no longer exactly that float32
    ("2.5", 2, False, 0.05),  # exactly a float32 but too short to prove it was not rounded
])
def test_logged_precision(text, digits, exact, resolution):
    p = ml.logged_precision(text)
    assert p["digits"] == digits
    assert p["exact"] is exact
    assert p["resolution"] == pytest.approx(resolution, rel=1e-9)
    assert p["value"] == float(text)


def test_maxtext_log_imports_exact_float32_with_offset(tmp_path):
    losses, gns = [4.1587, 4.1517, 4.1447], [0.1248, 0.1238, 0.1228]
    log = _maxtext_log(tmp_path / "metrics.txt", losses, gns, eval_after=1)
    res = ml.import_metrics(log, tmp_path / "run")
    assert res["skipped"] == 1  # the eval line
    run = records.load_run(tmp_path / "run")
    assert run.step_numbers == [1, 2, 3]  # MaxText's step 0 is the record's step 1
    for i, s in enumerate(run.step_numbers):
        loss = run.steps[s].get("loss")
        assert loss.dtype == np.float32 and loss == np.float32(losses[i])  # the float32 bits recovered
        assert run.steps[s].get("grad_norm") == np.float32(gns[i])
        assert ml.logged_resolution(run.meta, "loss", s) == 0.0
    assert run.meta["extra"]["metrics_log"]["summary"]["loss"]["all_float32"] is True
    assert run.meta["closed"] is True and run.meta["sketch"] is None


def test_coarse_log_keeps_its_resolution(tmp_path):
    log = tmp_path / "m.jsonl"
    log.write_text("\n".join(f'{{"it": {i}, "train_loss": {2.5 - 0.1 * i:.4f}}}' for i in range(1, 4)))
    ml.import_metrics(log, tmp_path / "run", step_key="it", loss_key="train_loss", grad_norm_key="gn", step_offset=0)
    run = records.load_run(tmp_path / "run")
    assert run.step_numbers == [1, 2, 3]
    assert run.steps[1].get("loss").dtype == np.float64 and "grad_norm" not in run.steps[1].arrays
    assert ml.logged_resolution(run.meta, "loss", 2) == pytest.approx(5e-5)
    assert ml.logged_resolution(run.meta, "grad_norm", 2) is None
    assert run.meta["extra"]["metrics_log"]["summary"]["loss"]["min_digits"] == 5


def test_resolved_interval():
    # 4.1587 vs 4.1589, each +-5e-5: the true difference lies in [1e-4, 3e-4]
    lo, hi = ml.resolved(abs(4.1589 - 4.1587) / 4.1587, 4.1589, 5e-5, 4.1587, 5e-5)
    assert lo == pytest.approx(1e-4 / (4.1587 + 5e-5), rel=1e-6)
    assert hi == pytest.approx(3e-4 / (4.1587 - 5e-5), rel=1e-6)
    assert ml.resolved(0.25, 1.0, 0.0, 0.8, 0.0) == (0.25, 0.25)
    lo, hi = ml.resolved(0.0, 4.1587, 5e-5, 4.1587, 5e-5)  # same text: only "below the resolution"
    assert lo == 0.0 and hi > 2e-5


@pytest.mark.parametrize(("lines", "kwargs", "match"), [
    (['{"step": 0, "learning/loss": 1.0}', "not json"], {}, r"m\.jsonl:2: not a JSON object"),
    (['[1, 2]'], {}, r"m\.jsonl:1: a line must be one JSON object"),
    (['{"learning/loss": 1.0}'], {}, r"no step key 'step'"),
    (['{"step": 0.5, "learning/loss": 1.0}'], {}, r"is not an integer"),
    (['{"step": 0, "learning/loss": "1.0"}'], {}, r"'learning/loss'='1.0' is not a number"),
    (['{"step": 0, "loss": 1.0}'], {}, r"no line with the loss key 'learning/loss'"),
    (['{"step": 0, "learning/grad_norm": 1.0}'], {}, r"the loss key 'learning/loss' is missing at record step\(s\) "
                                                     r"\[1\]"),
    (['{"step": 0, "learning/loss": 1.0}', '{"step": 0, "learning/loss": 1.5}'], {}, r"step 1 .* appears again"),
    (['{"step": 0, "learning/loss": 1.0}', '{"step": 2, "learning/loss": 1.5}'], {}, r"have gaps at \[2\]"),
    (['{"step": 0, "learning/loss": 1.0}'], {"step_offset": 0}, r"< 1 \(records count steps from 1\)"),
    (['{"step": 0, "learning/loss": 1.0}'], {"first": 0}, r"first=0 must be an int >= 1"),
])
def test_bad_logs_are_named(tmp_path, lines, kwargs, match):
    log = tmp_path / "m.jsonl"
    log.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=match):
        ml.read_metrics(log, **kwargs)


def test_missing_file_and_repeated_identical_step(tmp_path):
    with pytest.raises(ValueError, match=r"path='.*nope\.jsonl' does not exist"):
        ml.read_metrics(tmp_path / "nope.jsonl")
    log = tmp_path / "m.jsonl"  # a restart that re-logged step 1 with the same values: kept once
    log.write_text('{"step": 0, "learning/loss": 1.0}\n{"step": 1, "learning/loss": 0.9}\n'
                   '{"step": 1, "learning/loss": 0.9}\n{"step": 2, "learning/loss": 0.8}\n')
    assert sorted(ml.read_metrics(log)["steps"]) == [1, 2, 3]
    assert sorted(ml.read_metrics(log, first=2)["steps"]) == [1, 2]


def test_out_dir_not_overwritten_without_the_flag(tmp_path):
    log = _maxtext_log(tmp_path / "m.jsonl", [1.0, 0.9], [0.5, 0.4])
    ml.import_metrics(log, tmp_path / "run")
    with pytest.raises(ValueError, match="exists and is not empty"):
        ml.import_metrics(log, tmp_path / "run")
    ml.import_metrics(log, tmp_path / "run", overwrite=True, first=1)
    assert records.load_run(tmp_path / "run").step_numbers == [1]
