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


# ------------------------------------------------------------------------------------ compare on imported logs
def _coarse(path, losses, gns):
    """A log that rounds: 5 significant digits of the loss, 4 of the gradient norm."""
    path.write_text("".join(f'{{"step": {i}, "learning/loss": {lo:.4f}, "learning/grad_norm": {g:.4f}}}\n'
                            for i, (lo, g) in enumerate(zip(losses, gns, strict=True))))
    return path


def _import(tmp_path, name, losses, gns, coarse=True):
    log = (_coarse(tmp_path / f"{name}.jsonl", losses, gns) if coarse
           else _maxtext_log(tmp_path / f"{name}.jsonl", losses, gns))
    ml.import_metrics(log, tmp_path / name)
    return str(tmp_path / name)


def _compare_json(capsys, *args):
    from nxgates.gates import cli

    code = cli.main(["compare", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def _rows(report, gate):
    return [r for r in report["results"] if r["gate"] == gate]


def test_full_precision_logs_judge_n1_n3(tmp_path, capsys):
    ctrl = _import(tmp_path, "ctrl", [2.4871, 2.4093], [1.0123, 0.9012], coarse=False)
    ref = _import(tmp_path, "ref", [2.4871, 2.4093], [1.0131, 0.9019], coarse=False)
    good = _import(tmp_path, "good", [2.4871, 2.4093], [1.0127, 0.9015], coarse=False)
    bad = _import(tmp_path, "bad", [2.4871, 2.4093], [1.0223, 0.9112], coarse=False)
    code, rep = _compare_json(capsys, ctrl, good, "--reference", ref)
    assert code == 0 and rep["judged"] == ["N1", "N3"]
    assert {r["gate"] for r in rep["results"] if r["verdict"] == "n/a"} == {"N2", "N4", "N5", "N6"}
    code, rep = _compare_json(capsys, ctrl, bad, "--reference", ref)
    assert code == 1 and {r["verdict"] for r in _rows(rep, "N3")} == {"fail"}


def test_coarse_logs_say_what_they_resolve(tmp_path, capsys):
    ctrl = _import(tmp_path, "ctrl", [2.5, 2.4], [0.1248, 0.1238])
    ref = _import(tmp_path, "ref", [2.51, 2.42], [0.1498, 0.1488])  # m(ctrl, ref): N1 ~ 4e-3, N3 ~ 0.167
    same = _import(tmp_path, "same", [2.5, 2.4], [0.1248, 0.1238])
    close = _import(tmp_path, "close", [2.5, 2.4], [0.1456, 0.1446])  # vs control 0.167 +- 8e-4: the bound itself
    far = _import(tmp_path, "far", [2.5, 2.4], [0.2000, 0.1990])
    # identical logged text: N3 passes, and the row says only what 4 digits resolve
    code, rep = _compare_json(capsys, ctrl, same, "--reference", ref)
    n3 = _rows(rep, "N3")
    assert code == 0 and {r["verdict"] for r in n3} == {"pass"}
    assert all("grad_norm logged to 4 significant digits: vs control in [0.00e+00, 8." in r["reason"] for r in n3)
    # a clear failure stays a failure, with the interval named
    code, rep = _compare_json(capsys, ctrl, far, "--reference", ref)
    assert code == 1 and all(r["verdict"] == "fail" and "logged to 4" in r["reason"] for r in _rows(rep, "N3"))
    # a difference the log cannot place on either side of the bound: n/a (N3 is required: exit 2), never a pass
    code, rep = _compare_json(capsys, ctrl, close, "--reference", ref)
    assert code == 2
    assert {r["verdict"] for r in _rows(rep, "N3")} == {"n/a"}
    assert all("not resolved" in r["reason"] and "log more digits" in r["reason"] for r in _rows(rep, "N3"))
    # bit-identity cannot be proven from a rounded log
    code, rep = _compare_json(capsys, ctrl, same, "--contract", "exact")
    assert code == 2
    assert all("bit-identity cannot be proven" in r["reason"] for r in _rows(rep, "N1"))


def test_import_metrics_cli_exit_codes(tmp_path, capsys):
    from nxgates.gates import cli

    log = _maxtext_log(tmp_path / "m.jsonl", [1.0, 0.9], [0.5, 0.4])
    assert cli.main(["import-metrics", str(log), str(tmp_path / "run")]) == 0
    assert "exact (float32)" in capsys.readouterr().out
    assert cli.main(["import-metrics", str(log), str(tmp_path / "run2"), "--loss-key", "loss"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "'loss'" in err and "Traceback" not in err
    assert cli.main(["import-metrics", str(log), str(tmp_path / "run3"), "--step-offset", "x"]) == 2
    assert "--step-offset='x' must be an integer" in capsys.readouterr().err
