"""``nxgates calibrate-records``: rel and slack from a trainer's own records by calibrate's rule (one function), written
as a tolerance file that ``compare --tolerances`` reads and judges with."""

import math
import tomllib

import pytest

from nxgates.gates import calibrate, calibrate_records, cli, compare, gates, tolerances
from tests.gates.test_compare import write_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("calrec")
    write_run(d / "ref", noise=0.0)
    write_run(d / "ctrl", noise=1e-2)
    write_run(d / "benign", noise=1e-2, seed=1, extra=3e-3)  # the control's rounding plus a re-association of its own
    write_run(d / "benign2", noise=1e-2, seed=1, extra=1e-3)
    write_run(d / "far", noise=1e-2, seed=1, extra=3e-2)  # a "candidate" three times the control's distance
    write_run(d / "nologp", noise=1e-2, drop=("log_probs",))
    write_run(d / "nologp_ref", noise=0.0, drop=("log_probs",))
    write_run(d / "cfg2", noise=0.0, config={"d": 2})
    return d


def test_rule_is_calibrates_and_file_is_read_by_compare(runs, tmp_path):
    out = tmp_path / "tol.toml"
    res = calibrate_records.calibrate_records(runs / "ctrl", runs / "ref", [runs / "benign", runs / "benign2"])
    assert res["proposed"] == calibrate.derive_tolerances(res["rows"])  # the one rule
    out.write_text(res["toml"])
    tol = tolerances.load_tolerances(out)  # the schema of fixtures/tolerances.toml
    for g in ("N1", "N2", "N4", "N5"):  # (N6: the toy's sign-of-gradient updates agree: m = 0, rel 0)
        cr = [r["control_vs_reference"] for r in res["rows"] if r["gate"] == g]
        assert len(tol.tol[g]) == 3
        for step, x in enumerate(cr, start=1):  # rel = m(control, reference) rounded up to 3 significant digits
            assert x <= tol.tol_at(g, step) <= x * 1.01 + 1e-300
    assert tol.tol["N3"] == 2e-3  # fixed by DESIGN.md
    assert tol.tol["N6"] == 0.0 and res["proposed"]["N6"]["control_vs_reference_max"] == 0.0
    assert tol.slack["N1"] == calibrate.SLACK_FLOOR == calibrate_records.SLACK_FLOOR
    doc = tomllib.loads(out.read_text())
    assert all(doc["gates"][g]["reason"] and "calibrate-records" in doc["gates"][g]["source"] for g in gates.GATES)
    # the worst benign draw sets the slack where it exceeds rel: 2 x (ratio - 1), rounded up to 0.05
    p4 = res["proposed"]["N4"]
    assert p4["benign_ratio"] is not None and p4["benign_ratio"] > 1.0
    want = max(0.05, math.ceil(2 * (p4["benign_ratio"] - 1) / 0.05 - 1e-9) * 0.05)
    assert tol.slack["N4"] == pytest.approx(want)
    # compare reads the file: the benign run passes, a run three times the control's distance fails
    assert cli.main(["compare", str(runs / "ctrl"), str(runs / "benign"), "--reference", str(runs / "ref"),
                     "--tolerances", str(out)]) == 0
    assert cli.main(["compare", str(runs / "ctrl"), str(runs / "far"), "--reference", str(runs / "ref"),
                     "--tolerances", str(out)]) == 1
    assert cli.main(["compare", str(runs / "ctrl"), str(runs / "far"), "--tolerances", str(out)]) == 1


def test_n5_min_size_is_measured_with_and_written_to_the_file(runs, tmp_path):
    """N5 is calibrated on the tensors it will judge: by default the repository table's ``min_size`` (which leaves out
    the 8-element ``b``), ``--n5-min-size 1`` every tensor; the file carries the value, and compare reads it back."""
    default = calibrate_records.calibrate_records(runs / "ctrl", runs / "ref", [runs / "benign"])
    every = calibrate_records.calibrate_records(runs / "ctrl", runs / "ref", [runs / "benign"], n5_min_size=1)
    assert default["n5_min_size"] == tolerances.load_tolerances().min_size["N5"] > 8
    n5 = lambda res: [r["control_vs_reference"] for r in res["rows"] if r["gate"] == "N5"]  # noqa: E731
    assert n5(default) != n5(every)  # b's own distance is the largest with every tensor read
    out = tmp_path / "t.toml"
    out.write_text(default["toml"])
    assert tolerances.load_tolerances(out).min_size == {"N5": default["n5_min_size"]}
    out.write_text(every["toml"])
    assert tolerances.load_tolerances(out).min_size == {}
    assert cli.main(["calibrate-records", str(runs / "ctrl"), str(runs / "ref"), "--out", str(out),
                     "--n5-min-size", "4"]) == 0
    assert tolerances.load_tolerances(out).min_size == {"N5": 4}


def test_without_benign_runs_the_slack_is_the_floor(runs):
    res = calibrate_records.calibrate_records(runs / "ctrl", runs / "ref")
    assert {p["slack"] for p in res["proposed"].values()} == {calibrate.SLACK_FLOOR}
    assert "no benign run given" in tomllib.loads(res["toml"])["gates"]["N4"]["reason"]


def test_a_gate_without_data_gets_the_strictest_bound(runs, tmp_path):
    out = tmp_path / "t.toml"
    assert cli.main(["calibrate-records", str(runs / "nologp"), str(runs / "nologp_ref"), "--out", str(out)]) == 0
    doc = tomllib.loads(out.read_text())["gates"]
    assert doc["N2"]["rel"] == 0.0 and "not measured (no log_probs" in doc["N2"]["reason"]
    assert isinstance(doc["N4"]["rel"], list)


@pytest.mark.parametrize(("args", "match"), [
    (["ctrl", "missing"], "missing record"),
    (["ctrl", "ref", "cfg2"], "different config"),
    (["ctrl", "ref", "--out", "."], "is a directory"),
    (["ctrl", "ref", "--n5-min-size", "0"], "--n5-min-size 0: must be an integer >= 1"),
])
def test_bad_input_exits_2_named(runs, capsys, args, match, monkeypatch):
    monkeypatch.chdir(runs)
    code = cli.main(["calibrate-records", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and match in err and "Traceback" not in err


def test_steps_must_count_from_one(tmp_path):
    ref = write_run(tmp_path / "r", noise=0.0, steps=2)
    ctrl = write_run(tmp_path / "c", noise=1e-2, steps=2)
    del ref.steps[1], ctrl.steps[1]  # a record whose steps are [2]: no per-step rel list can index it
    with pytest.raises(compare.CompareInputError, match=r"steps \[2\]: calibrate-records needs steps 1..n"):
        calibrate_records.measure(ctrl, ref, [])
