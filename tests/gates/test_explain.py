"""gates.explain on synthetic taps (execution order, bounds, exact contracts), the report's explanation and pictures
(with and without matplotlib), and the CLI's refusals. The model's taps: tests/model/test_taps.py.

Run: ``python -m pytest tests/gates/test_explain.py -q`` (seconds; no model is compiled).
"""

import builtins
import copy
import json

import numpy as np
import pytest

from nxgates.gates import cli, contracts, explainer, report
from nxgates.gates.errors import BadInput
from nxgates.gates.gates import GateResult
from nxgates.gates.runner import CheckResult
from nxgates.gates.tolerances import load_tolerances
from nxgates.model.taps import TapSpec

BOUNDS = explainer.Bounds(slack=0.5, floor=1e-6, source="test")
PATTERN = ("gdn", "attention")
SPECS = {
    "embed": [TapSpec("embed", "embed", "", ("out",), ("out",))],
    "layer_0": [TapSpec("gdn", "gdn", "", ("out",), ("q",)), TapSpec("moe_mlp", "moe_mlp", "", ("out",), ("x",))],
    "layer_1": [TapSpec("attention", "attention", "", ("out",), ("q",))],
    "head": [TapSpec("logp", "logp", "", ("out",), ("out",))],
}


def _run(seed: int, scale: float = 0.0, extra: float = 0.0) -> explainer.TapRun:
    """Taps = truth + ``scale`` x noise(seed) + ``extra`` x noise(seed + 100); 8 devices, 2 layer groups."""
    truth = np.random.default_rng(0)
    noise = np.random.default_rng(seed)
    more = np.random.default_rng(seed + 100)

    def leaf(shape):
        x = truth.standard_normal(shape) + scale * noise.standard_normal(shape)
        return (x + extra * more.standard_normal(shape)).astype(np.float32)

    def tree(layer: bool, direction: str):
        out = {}
        for scope, specs in SPECS.items():
            if scope.startswith("layer_") != layer:
                continue
            shape = (8, 2, 16) if layer else (8, 16)
            out[scope] = {s.key: {p: leaf(shape) for p in getattr(s, direction)} for s in specs}
        return out

    def both(direction):
        t = tree(False, direction)
        t["layers"] = tree(True, direction)
        return t

    fwd, bwd = both("forward"), both("backward")
    fwd["head"]["loss"] = {"out": np.ones(1, np.float32)}
    return explainer.TapRun(fwd, bwd, SPECS, None, PATTERN, 2, 0.0)


def _runs():
    # reference = the truth, control 1e-2 from it, candidate = control + 3e-3: a benign rounding candidate (it shares
    # the control's roundings but one)
    return _run(2, 1e-2, 3e-3), _run(2, 1e-2), _run(3, 0.0)


def _bump(run, direction, scope, key, part, group=None, by=1.0):
    run = copy.deepcopy(run)
    tree = getattr(run, direction)
    base = tree["layers"][scope] if scope.startswith("layer_") else tree[scope]
    a = base[key][part]
    if group is None:
        a += by
    else:
        a[:, group] += by
    return run


def test_order_forward_layers_then_backward_reversed():
    cand, ctl, ref = _runs()
    rows = explainer.compare(cand, ctl, ref, "rounding", BOUNDS)
    where = [(r.direction, r.where, r.op) for r in rows]
    assert where[:4] == [("forward", "embed", "embed"), ("forward", "layer 0 (gdn)", "gdn"),
                         ("forward", "layer 0 (gdn)", "moe_mlp"), ("forward", "layer 1 (attention)", "attention")]
    assert where[4][1] == "layer 2 (gdn)" and where[7] == ("forward", "head", "logp")
    assert where[8] == ("forward", "head", "loss")
    assert where[9:12] == [("backward", "head", "logp"), ("backward", "layer 3 (attention)", "attention"),
                           ("backward", "layer 2 (gdn)", "moe_mlp")]
    assert where[-1] == ("backward", "embed", "embed")


def test_a_benign_candidate_has_no_tap_over_and_a_wrong_one_is_named():
    cand, ctl, ref = _runs()
    assert explainer.compare(cand, ctl, ref, "rounding", BOUNDS)[0].bound == pytest.approx(
        1.5 * explainer._rel(ctl.forward["embed"]["embed"]["out"], ref.forward["embed"]["embed"]["out"]))
    assert not any(r.over for r in explainer.compare(cand, ctl, ref, "rounding", BOUNDS))
    # wrong in layer 2's moe_mlp forward (group 1, pattern position 0) and in layer 1's backward: the forward one wins
    bad = _bump(_bump(cand, "forward", "layer_0", "moe_mlp", "out", group=1), "backward", "layer_1", "attention", "q",
                group=0)
    rows = explainer.compare(bad, ctl, ref, "rounding", BOUNDS)
    first = next(r for r in rows if r.over)
    assert (first.where, first.op, first.direction) == ("layer 2 (gdn)", "moe_mlp", "forward")
    assert first.line().startswith("layer 2 (gdn), moe_mlp, forward: rel ")
    # backward only: the last layer's backward comes first
    bad = _bump(_bump(cand, "backward", "layer_0", "gdn", "q", group=0), "backward", "layer_1", "attention", "q",
                group=0)
    first = next(r for r in explainer.compare(bad, ctl, ref, "rounding", BOUNDS) if r.over)
    assert (first.where, first.op, first.part) == ("layer 1 (attention)", "attention", "q")
    assert "backward d(q)" in first.line()


def test_exact_contract_needs_bit_identity():
    _, ctl, ref = _runs()
    same = copy.deepcopy(ctl)
    assert not any(r.over for r in explainer.compare(same, ctl, ref, "exact", BOUNDS))
    tiny = _bump(same, "forward", "head", "logp", "out", by=1e-7)
    first = next(r for r in explainer.compare(tiny, ctl, ref, "exact", BOUNDS) if r.over)
    assert first.op == "logp" and "not bit-identical" in first.line()


def test_taps_that_do_not_line_up_are_refused():
    cand, ctl, ref = _runs()
    cand = copy.deepcopy(cand)
    cand.specs = {**SPECS, "head": []}
    with pytest.raises(RuntimeError, match="taps differ"):
        explainer.compare(cand, ctl, ref, "rounding", BOUNDS)


def _explanation(bad: bool = True) -> explainer.Explanation:
    cand, ctl, ref = _runs()
    if bad:
        cand = _bump(cand, "forward", "layer_0", "gdn", "out", group=0)
    rows = explainer.compare(cand, ctl, ref, "rounding", BOUNDS)
    return explainer.Explanation("k=v", "toy", "rounding", {"k": "v"}, BOUNDS, rows, 1.0, {})


def _report(ex) -> report.Report:
    spec = contracts.CheckSpec(name="k=v", contract="rounding", candidate_overrides={"k": "v"}, keys=("k",))
    results = [GateResult(g, s, 0.1 if g == "N4" else 1e-4, 0.1, 1e-2, 1e-2, 1.05e-2, None, g != "N4", g != "N4",
                          None) for s in (1, 2, 3) for g in ("N1", "N2", "N3", "N4", "N5", "N6")]
    check = CheckResult(spec, {}, {"k": "v"}, results, [], {}, {"control": "computed", "reference": "computed"}, 1.0,
                        explanation=ex)
    return report.Report(config="toy", checks=[check], golden=None, env={}, tolerances=load_tolerances())


def test_report_carries_the_explanation_and_its_pictures(tmp_path):
    pytest.importorskip("matplotlib")
    rep = _report(_explanation())
    json_path, md_path = rep.write(tmp_path)
    md = md_path.read_text()
    assert "explain (step 1, first tap over its bound): layer 0 (gdn), gdn, forward: rel" in md
    assert "moe_mlp" in md  # the table of every tap
    for name in ("k_v-gates.png", "k_v-explain.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({name})" in md
    data = json.loads(json_path.read_text())
    assert data["checks"][0]["explanation"]["first"]["op"] == "gdn"
    assert "layer 0 (gdn), gdn" in rep.table()


def test_report_is_complete_without_matplotlib(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("matplotlib hidden by the test")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    rep = _report(_explanation())
    _, md_path = rep.write(tmp_path)
    md = md_path.read_text()
    assert not list(tmp_path.glob("*.png"))
    assert ".png" not in md
    assert "layer 0 (gdn), gdn, forward: rel" in md and "every tap of the explanation" in md


def test_a_passing_explanation_says_so():
    ex = _explanation(bad=False)
    assert ex.first is None and ex.line().startswith("no tap over its bound")


def test_cli_explain_without_flags_is_bad_input(capsys):
    assert cli.main(["explain", "--config", "smoke"]) == cli.EXIT_BAD_INPUT
    assert "--flags" in capsys.readouterr().err


def test_cli_explain_unknown_mutant_is_bad_input(capsys):
    assert cli.main(["explain", "--config", "smoke", "--mutant", "nope"]) == cli.EXIT_BAD_INPUT
    assert "unknown mutant" in capsys.readouterr().err


def test_run_explains_each_failing_check_and_only_those(tmp_path, capsys):
    """The hook in gates.suite: a failing check gets an explanation (the toy model has no taps, so the report says
    why there is none), a passing check none."""
    from tests.gates import toy_model
    from tests.gates.test_cli import tolerance_file

    argv = ["--config", "toy", "--flags", "moe_wi_gmm_fused_swiglu=true", "--cache-dir", str(tmp_path / "cache"),
            "--out", str(tmp_path / "r"), "--json"]
    assert cli.main([*argv, "--tolerances", tolerance_file(tmp_path, 0.0)], api=toy_model.api()) == 1
    check = json.loads(capsys.readouterr().out)["checks"][0]
    assert check["explanation"]["line"].startswith("no explanation: explain: this model's build_log_probs takes no")
    passing = [a if a != "moe_wi_gmm_fused_swiglu=true" else "fp8_fake_quant_hoist=gather8" for a in argv]
    assert cli.main(passing, api=toy_model.api()) == 0
    assert json.loads(capsys.readouterr().out)["checks"][0]["explanation"] is None
    assert cli.main([*argv, "--tolerances", tolerance_file(tmp_path, 0.0), "--no-explain"], api=toy_model.api()) == 1
    assert json.loads(capsys.readouterr().out)["checks"][0]["explanation"] is None


def test_a_check_only_the_lens_fails_is_explained_in_the_lens(monkeypatch):
    """explain_failed picks the float32 lens when the bf16 gates passed and the lens failed, the bf16 runs otherwise."""
    seen = []
    monkeypatch.setattr(explainer, "explain_spec", lambda runner, spec, precision: seen.append(precision) or precision)
    lens_only = type("C", (), {"bf16_passed": True, "lens_passed": False})()
    both = type("C", (), {"bf16_passed": False, "lens_passed": False})()
    assert explainer.explain_failed(None, None, lens_only) == "lens"
    assert explainer.explain_failed(None, None, both) == "production"
    assert explainer.explain_failed(None, None) == "production"
    with pytest.raises(BadInput, match="precision='fp16'"):
        monkeypatch.undo()
        explainer.explain_spec(None, None, precision="fp16")


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_sub_bf16_mutants_are_named_in_the_lens():
    """smoke: each mutant the bf16 gates cannot see is explained in the float32 lens, at the op it was injected into
    (about 2 minutes per mutant on 2 cores: --runslow)."""
    from nxgates.gates import mutants

    names = [m.name for m in mutants.MUTANTS if not m.must and m.lens_must]
    assert names
    for m, injected, ex in explainer.explain_mutants("smoke", only=names, progress=lambda msg: None):
        assert ex.precision == "lens" and ex.first is not None, (m.name, ex.line())
        assert ex.first.op == injected, (m.name, injected, ex.line())
