"""The CLI and the Python API end to end on the toy model: exit codes 0 / 1 / 2, the messages, the reports, goldens.
One test runs the real model's config validation (exit 2 needs no model run).

Run: python -m pytest tests/gates/test_cli.py -q
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from nxgates.gates import cli, golden
from nxgates.gates import tolerances as T
from tests.gates import toy_model
from tests.gates.toy_model import toy_run


def tolerance_file(tmp_path: pathlib.Path, rel: float) -> str:
    """A copy of the repository's table with every gate's rel replaced (N1 stays 0)."""
    text = T.DEFAULT_TOLERANCES.read_text()
    for gate in ("N2", "N3", "N4", "N5", "N6"):
        text = re.sub(rf"(\[gates\.{gate}\]\nrel = )[^\n]+", rf"\g<1>{rel}", text)
    p = tmp_path / f"tol-{rel}.toml"
    p.write_text(text)
    return str(p)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("cli")


def run_cli(argv, workdir, capsys):
    code = cli.main([*argv, "--cache-dir", str(workdir / "cache")], api=toy_model.api())
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--config", "toy", "--flags", "no_such_flag=1"], "unknown flag 'no_such_flag' (value '1')"),
        (["--config", "toy", "--flags", "moe_wi_gmm_fused_swiglu=maybe"],
         "moe_wi_gmm_fused_swiglu=maybe is malformed"),
        (["--config", "toy", "--flags", "fp8_moe_fake_quant=false", "fp8_fake_quant_hoist=gather8"],
         "fp8_fake_quant_hoist=gather8 requires fp8_moe_fake_quant=True; got fp8_moe_fake_quant=False"),
        (["--config", "nope"], "unknown config 'nope'"),
        (["--config", "toy", "--flags", "moe_wi_gmm_fused_swiglu"],
         "--flags item 'moe_wi_gmm_fused_swiglu' is malformed"),
        (["--config", "toy", "--flags", "moe_wi_gmm_fused_swiglu=false"], "no tuning flag differs"),
        (["--config", "toy", "--jobs", "0"], "--jobs='0' must be an integer from 1 to"),
        (["--config", "toy", "--jobs", "two"], "--jobs='two' must be an integer from 1 to"),
    ],
    ids=["unknown-flag", "malformed-value", "refused-combination", "unknown-config", "malformed-item", "no-change",
         "jobs-zero", "jobs-word"],
)
def test_bad_input_exits_2_with_the_key_and_value(argv, message, workdir, capsys):
    code, out, err = run_cli(argv, workdir, capsys)
    assert code == 2 and message in err and "Traceback" not in err
    assert "step 1/3" not in err  # refused before anything ran


def test_real_model_refusals_exit_2(capsys):
    """The real config's messages (model.flags, model.rules): unknown flag, malformed value, refused combinations.
    Where no tuned value satisfies a rule, the refusal names the setting that would."""
    cases = [
        (["--flags", "moe_wi_gmm_fused_swiglu_typo=true"], ["unknown flag 'moe_wi_gmm_fused_swiglu_typo'"]),
        (["--flags", "wi_tile_fwd_batch_seq=big"], ["wi_tile_fwd_batch_seq=big is malformed"]),
        (["--flags", "moe_router_grad_from_wo_input=true", "moe_wo_gmm_fused_dswiglu=false"],
         ["moe_router_grad_from_wo_input=True requires moe_wo_gmm_fused_dswiglu=True",
          "would be satisfied by moe_wo_gmm_fused_dswiglu=True (instead of the chosen value)"]),
        (["--flags", "moe_wo_gmm_fused_dswiglu=true", "wo_tile_dlhs_mlp_dim=64"],
         ["moe_wo_gmm_fused_dswiglu=True requires wo_tile_dlhs_mlp_dim == moe_mlp_dim (one n tile)",
          "would be satisfied by wo_tile_dlhs_mlp_dim=128 (instead of the chosen value)"]),
        (["--flags", "fp8_fake_quant_hoist=gather8", "fp8_moe_fake_quant=false"],
         ["fp8_fake_quant_hoist=gather8 requires fp8_moe_fake_quant=True",
          "would be satisfied by fp8_moe_fake_quant=True (a control setting: set it in the config's [flags])"]),
        (["--config", "huge"], ["unknown config 'huge'"]),
    ]
    for argv, messages in cases:
        code = cli.main(argv)
        err = capsys.readouterr().err
        assert code == 2 and all(m in err for m in messages), (argv, err)
        assert "step 1/3" not in err  # refused before anything ran


@pytest.mark.parametrize("flags, added", [
    ({"moe_wo_gmm_fused_dswiglu": "true"}, {"wo_tile_dlhs_mlp_dim": 128}),
    ({"moe_router_grad_from_wo_input": "true"}, {"moe_wo_gmm_fused_dswiglu": True, "wo_tile_dlhs_mlp_dim": 128}),
    ({"gdn_cp_m_scan": "true"}, {}),
])
def test_flags_add_the_prerequisites_the_default_run_adds(flags, added):
    """``--flags`` builds the same candidate as the default run's check of that flag alone (no model is run)."""
    from nxgates.gates.runner import Runner

    r = Runner("tiny", progress=None)
    spec = r.user_spec(flags)
    assert spec.added_prerequisites == added
    key = next(iter(flags))
    default = next(c for c in r.default_specs() if c.name == key)
    assert spec.candidate_overrides == default.candidate_overrides and spec.contract == default.contract
    assert spec.keys == (key,)


def test_flags_prints_the_prerequisites_it_added():
    """What ``nxgates run --flags`` prints (progress, stderr) before anything runs: the prerequisites it added."""
    from nxgates.gates import suite
    from nxgates.gates.runner import Runner

    spec = Runner("tiny", progress=None).user_spec({"moe_wo_gmm_fused_dswiglu": "true"})
    messages = []
    suite.announce_prerequisites([spec], messages.append)
    assert messages == ["check 'moe_wo_gmm_fused_dswiglu=True': added the prerequisite tuning flags "
                          "wo_tile_dlhs_mlp_dim=128 (the model's rules; the config's tuned values), as the default run "
                          "does"]


def test_pass_exit_0_writes_reports(workdir, capsys, tmp_path):
    out_dir = tmp_path / "reports"
    code, out, err = run_cli(["--config", "toy", "--flags", "fp8_fake_quant_hoist=gather8", "--out", str(out_dir),
                              "--golden-dir", str(tmp_path)], workdir, capsys)
    assert code == 0, out + err
    assert "check 'fp8_fake_quant_hoist=gather8': contract exact; PASS" in out
    assert re.search(r"N4 gradient\s+3\s+0\s+0 \(exact\)", out)
    assert "candidate[fp8_fake_quant_hoist=gather8]: step 3/3" in err and "elapsed" in err  # progress lines
    data = json.loads((out_dir / "gates.json").read_text())
    assert data["passed"] is True and data["checks"][0]["contract"] == "exact"
    assert len(data["checks"][0]["gates"]) == 18
    assert data["checks"][0]["implementations"]["candidate"] == {"activation": "silu", "mlp": "unfused"}
    md = (out_dir / "gates.md").read_text()
    assert "| N6 update" in md and "**PASS**" in md
    assert "golden: missing" in out  # no golden in tmp_path yet


def test_gate_failure_exits_1_and_names_the_first_failing_step(workdir, capsys, tmp_path):
    strict = tolerance_file(tmp_path, 0.0)
    code, out, err = run_cli(["--config", "toy", "--flags", "moe_wi_gmm_fused_swiglu=true", "--tolerances", strict,
                              "--out", str(tmp_path / "r"), "--json"], workdir, capsys)
    assert code == 1
    data = json.loads(out)
    check = data["checks"][0]
    assert data["passed"] is False and check["first_failing_step"] == 1 and check["contract"] == "rounding"
    assert check["worst_tensor"]["name"] in {"embed", "mlp/w_in", "mlp/w_out", "head"}
    n1 = [g for g in check["gates"] if g["gate"] == "N1"]
    assert all(g["passed"] for g in n1)  # the loss does not move; the gradient does
    assert check["records"]["control"] == "cached"  # shared with the previous test through the cache
    # and the same candidate passes the repository's table
    code, out, _ = run_cli(["--config", "toy", "--flags", "moe_wi_gmm_fused_swiglu=true", "--tolerances",
                            tolerance_file(tmp_path, 0.1), "--out", str(tmp_path / "r")], workdir, capsys)
    assert code == 0, out


def test_list_flags(capsys):
    code = cli.main(["list-flags", "--config", "toy", "--json"], api=toy_model.api())
    out = capsys.readouterr().out
    rows = {r["flag"]: r for r in json.loads(out)}
    assert code == 0
    assert rows["fp8_fake_quant_hoist"]["contract"] == "exact" and rows["fp8_fake_quant_hoist"]["tuned"] == "gather8"
    assert rows["wi_tile_fwd_embed_dim"]["contract"] == "rounding"
    assert "drop_tokens" not in rows and "fp8_moe_fake_quant" not in rows


def test_golden_written_compared_and_never_overwritten_by_a_failed_run(tmp_path):
    tols = T.load_tolerances()
    control = toy_run("control")
    path = golden.write_golden("toy", control, tmp_path)
    saved = path.read_text()
    doc = json.loads(saved)
    assert doc["metadata"]["rebuild"] == "python -m nxgates golden --config toy" and len(doc["loss_f32_hex"]) == 3
    assert golden.compare_with_golden("toy", toy_run("control again"), tols, tmp_path).status == "match"
    # a drifted control (another rounding) is a mismatch naming the step
    fused = toy_run("fused", {"moe_wi_gmm_fused_swiglu": True})
    fused.metadata["flags"] = control.metadata["flags"]
    res = golden.compare_with_golden("toy", fused, tols, tmp_path)
    assert res.status == "mismatch" and "step 1 grad norm" in res.message and res.failed
    # another CPU target or versions: compared at the stated cross-environment tolerance, the differences named
    other = json.loads(saved)
    other["metadata"]["env"]["jaxlib"] = "0.0.1"
    other["metadata"]["env"]["cpu_target"] = {"source": "XLA CPU executable", "cpu": "haswell",
                                              "features_sha256": "0123456789abcdef"}
    (tmp_path / "toy.json").write_text(json.dumps(other))
    res = golden.compare_with_golden("toy", control, tols, tmp_path)
    assert res.status == "match" and not res.exact and not res.failed, res
    assert "jaxlib '0.0.1'" in res.message and "haswell" in res.message
    assert f"cross_env_rel {tols.golden_cross_env_rel:g}" in res.message
    # ... and a control beyond it is a mismatch naming the step (the loss is compared too, not only its bits)
    other["grad_norm"][1] *= 1 + 3 * tols.golden_cross_env_rel
    other["loss"][2] *= 1 + 3 * tols.golden_cross_env_rel
    (tmp_path / "toy.json").write_text(json.dumps(other))
    res = golden.compare_with_golden("toy", control, tols, tmp_path)
    assert res.status == "mismatch" and "step 2 grad norm" in res.message and "step 3 loss" in res.message
    assert "step 1" not in res.message and "not to the bit" in res.message
    # another platform or device count: another program, not compared, and said plainly
    other = json.loads(saved)
    other["metadata"]["env"]["platform"] = "tpu"
    (tmp_path / "toy.json").write_text(json.dumps(other))
    res = golden.compare_with_golden("toy", control, tols, tmp_path)
    assert res.status == "skipped" and "NOT compared" in res.message and "platform 'tpu'" in res.message
    # a run with a dropped token is refused and the existing golden stays
    path.write_text(saved)
    bad = toy_run("dropped", {"drop_tokens": 2})
    with pytest.raises(ValueError, match="not written.*2 dropped tokens"):
        golden.write_golden("toy", bad, tmp_path)
    assert path.read_text() == saved


def test_golden_cli_rebuilds(tmp_path, capsys):
    code = cli.main(["golden", "--config", "toy", "--golden-dir", str(tmp_path)], api=toy_model.api())
    assert code == 0 and (tmp_path / "toy.json").exists()
    assert "wrote" in capsys.readouterr().out


def test_calibrate_measures_and_proposes(tmp_path):
    from nxgates.gates import calibrate

    res = calibrate.calibrate("toy", toy_model.api(), cache_dir=str(tmp_path), progress=lambda m: None)
    assert res["benign"] == [{"wi_tile_fwd_embed_dim": 8}]  # every k tile of the toy (one), halved
    rows = res["rows"]
    assert len(rows) == 18 and not res["preconditions"]
    assert all(r["control_reproducible_bits"] and r["control_again_vs_control"] == 0.0 for r in rows)
    assert all(r["control_vs_reference"] == 0.0 for r in rows if r["gate"] == "N1")
    prop = res["proposed"]
    for g in ("N2", "N4", "N5", "N6"):  # rel per step = the control's distance to the reference there, rounded up
        cr = [r["control_vs_reference"] for r in rows if r["gate"] == g]
        assert len(prop[g]["rel"]) == 3
        assert all(c <= x <= 1.01 * c for c, x in zip(cr, prop[g]["rel"], strict=True))
    assert prop["N3"]["rel"] == 2e-3 and prop["N1"]["rel"] == 0.0
    # slack per gate: max(0.05, 2 x (the benign candidate's largest ratio of distances to the reference over the steps
    # where it exceeds rel - 1)), rounded up to 0.05; no such step: 0.05
    for g in ("N2", "N3", "N4", "N5", "N6"):
        mine = [r for r in rows if r["gate"] == g and r["control_vs_reference"] > 0]
        assert prop[g]["benign_ratio_every_step"] == max(r["benign_vs_reference"] / r["control_vs_reference"]
                                                         for r in mine)
        rel = prop[g]["rel"]
        over = [r["benign_vs_reference"] / r["control_vs_reference"] for r in mine
                if r["benign_vs_reference"] > (rel if isinstance(rel, float) else rel[r["step"] - 1])]
        assert prop[g]["benign_ratio"] == (max(over) if over else None)
        expect = max(0.05, 2 * (max(over) - 1)) if over else 0.05
        assert expect - 1e-12 <= prop[g]["slack"] < expect + 0.05
    assert prop["N1"]["benign_ratio"] is None and prop["N1"]["slack"] == 0.05  # m(control, reference) = 0 throughout


def test_slack_rule():
    from nxgates.gates import calibrate

    assert calibrate.slack_from_ratio(None) == 0.05
    assert calibrate.slack_from_ratio(0.8) == 0.05  # the benign candidate was closer than the control: the floor
    assert calibrate.slack_from_ratio(1.02) == 0.05  # 2 x 0.02 = 0.04 -> floor
    assert calibrate.slack_from_ratio(1.04) == 0.1  # 2 x 0.04 = 0.08 -> 0.1
    assert calibrate.slack_from_ratio(1.29) == 0.6  # 2 x 0.29 = 0.58 -> 0.6
    assert calibrate.slack_from_ratio(1.1) == 0.2
    assert calibrate.proposed_rel("N3", [1.0, 2.0, 3.0]) == 2e-3 and calibrate.proposed_rel("N1", [0.0] * 3) == 0.0
    assert calibrate.proposed_rel("N4", [3.671e-2, 0.0, 1.0]) == [3.68e-2, 0.0, 1.0]
    rows = [{"gate": g, "step": s, "control_vs_reference": c, "benign_vs_reference": b}
            for g in calibrate.gates_lib.GATES for s, c, b in ((1, 2.0, 2.2), (2, 1.0, 1.3), (3, 0.0, 0.0))]
    assert calibrate.benign_ratios(rows)["N4"] == {"ratio": 1.3, "step": 2}
    rel = {g: 2.1 for g in calibrate.gates_lib.GATES}  # only step 1's 2.2 exceeds the floor
    assert calibrate.benign_ratios(rows, rel)["N4"] == {"ratio": 1.1, "step": 1}
    assert calibrate.benign_ratios(rows, {g: 5.0 for g in rel})["N4"] == {"ratio": None, "step": None}
