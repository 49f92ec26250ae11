"""A corpus of bad inputs: every one exits 2 with its key and value named, no traceback, nothing computed.

The CLI is called in-process (``gates.cli.main(argv)``, the real model's config validation) with the model runs
replaced by a failure, so an input that is not refused fails the test at once instead of computing for minutes; a
few go through a real ``python -m nxgates`` subprocess. The Python API's bad arguments raise a ``ValueError`` naming
the argument and its value.

Run: python -m pytest tests/gates/test_bad_input.py -q
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from nxgates.gates import cli, runner
from nxgates.gates import tolerances as T


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Bad files the corpus points at: configs, tolerance tables, a regular file to put paths under."""
    d = tmp_path_factory.mktemp("bad")
    smoke = (pathlib.Path(__file__).parents[2] / "fixtures" / "configs" / "smoke.toml").read_text()
    (d / "latin1.toml").write_bytes(smoke.replace("# smoke", "# sm\xf6ke").encode("latin-1"))
    (d / "broken.toml").write_text("[model\nhidden_dim = 128\n")
    (d / "flags_not_table.toml").write_text("flags = 3\n" + smoke.split("[flags]")[0])
    (d / "unknown_key.toml").write_text(smoke.replace("hidden_dim = 128", "hidden_dim = 128\nhiden_size = 3"))
    (d / "negative.toml").write_text(smoke.replace("hidden_dim = 128", "hidden_dim = -128"))
    (d / "string_dim.toml").write_text(smoke.replace("hidden_dim = 128", 'hidden_dim = "abc"'))
    (d / "section.toml").write_text(smoke + "\n[extra]\nx = 1\n")
    (d / "tuned_same.toml").write_text(smoke.replace("gdn_cp_m_scan = true", "gdn_cp_m_scan = true\n"
                                                     "wo_tile_fwd_mlp_dim = 32"))
    (d / "flag_value.toml").write_text(smoke.replace("scan_layers = true", "scan_layers = 2"))
    (d / "huge_tile.toml").write_text(smoke.replace("wi_tile_fwd_mlp_dim = 64", "wi_tile_fwd_mlp_dim = 1048576"))
    (d / "dir.toml").mkdir()
    tol = T.DEFAULT_TOLERANCES.read_text()
    (d / "tol_latin1.toml").write_bytes(("# \xe9\n" + tol).encode("latin-1"))
    (d / "tol_broken.toml").write_text(tol.replace("[gates.N3]", "[gates.N3"))
    (d / "tol_no_n3.toml").write_text(tol.replace("[gates.N3]", "[gates.N3_retired]"))
    (d / "tol_negative.toml").write_text(tol.replace("[gates.N1]\nfloor = 0.0", "[gates.N1]\nfloor = -1.0"))
    (d / "tol_bad_cross.toml").write_text(tol.replace("cross_env_rel = 5e-3\n", 'cross_env_rel = "loose"\n'))
    (d / "a_file").write_text("not a folder\n")
    return d


F = "{files}"  # replaced by the fixture's folder
T3 = "wi_tile_fwd_embed_dim"
# (id, argv after "run" (or a command), texts the message must contain)
CORPUS = [
    # --- flag values: tiles against their dims, digits, types (issue 13 items 4 and 5)
    ("tile-1048576", ["--flags", "wi_tile_fwd_mlp_dim=1048576"],
     ["wi_tile_fwd_mlp_dim=1048576 is larger than the dim it tiles", "at most 256"]),
    ("tile-26-digits", ["--flags", "wi_tile_fwd_mlp_dim=99999999999999999999999999"],
     ["wi_tile_fwd_mlp_dim=99999999999999999999999999 is larger than the dim"]),
    ("buffers-1000", ["--flags", "wi_tile_fwd_rhs_buffer_count=1000"],
     ["wi_tile_fwd_rhs_buffer_count=1000 is more than the", "wi tiles"]),
    ("buffers-1000-smoke", ["--config", "smoke", "--flags", "wi_tile_fwd_rhs_buffer_count=1000"],
     ["wi_tile_fwd_rhs_buffer_count=1000 is more than the"]),
    ("tile-huge-smoke", ["--config", "smoke", "--flags", "wi_tile_fwd_mlp_dim=1048576"],
     ["wi_tile_fwd_mlp_dim=1048576 is larger than the dim it tiles", "at most 128"]),
    ("m-tile-over-rows", ["--config", "smoke", "--flags", "wi_tile_fwd_batch_seq=4096"],
     ["wi_tile_fwd_batch_seq=4096 is larger than the dim it tiles", "rounded up to 8: 512"]),
    ("superscript", ["--flags", f"{T3}=²"], [f"{T3}=² is malformed", "ASCII decimal digits"]),
    ("full-width-digits", ["--flags", f"{T3}=１２８"], [f"{T3}=１２８ is malformed"]),
    ("arabic-indic-digits", ["--flags", f"{T3}=١٢٨"], [f"{T3}=١٢٨ is malformed"]),
    ("float", ["--flags", f"{T3}=128.0"], [f"{T3}=128.0 is malformed"]),
    ("hex", ["--flags", f"{T3}=0x80"], [f"{T3}=0x80 is malformed"]),
    ("negative", ["--flags", f"{T3}=-128"], [f"{T3}=-128 is malformed"]),
    ("zero", ["--flags", f"{T3}=0"], [f"{T3}=0 is malformed"]),
    ("underscore", ["--flags", f"{T3}=1_28"], [f"{T3}=1_28 is malformed"]),
    ("plus-sign", ["--flags", f"{T3}=+128"], [f"{T3}=+128 is malformed"]),
    ("exponent", ["--flags", f"{T3}=1e3"], [f"{T3}=1e3 is malformed"]),
    ("5000-digits", ["--flags", f"{T3}={'1' * 5000}"], [f"{T3}='1111", "(5002 characters) is malformed"]),
    ("empty-value", ["--flags", f"{T3}="], [f"--flags item '{T3}=' is malformed"]),
    ("no-key", ["--flags", "=true"], ["--flags item '=true' is malformed"]),
    ("no-equals", ["--flags", "moe_wi_gmm_fused_swiglu"], ["--flags item 'moe_wi_gmm_fused_swiglu' is malformed"]),
    ("bool-yes", ["--flags", "moe_wi_gmm_fused_swiglu=yes"], ["moe_wi_gmm_fused_swiglu=yes is malformed"]),
    ("bool-full-width", ["--flags", "moe_wi_gmm_fused_swiglu=ｔｒｕｅ"],
     ["moe_wi_gmm_fused_swiglu=ｔｒｕｅ is malformed"]),
    ("bool-2", ["--flags", "moe_wi_gmm_fused_swiglu=2"], ["moe_wi_gmm_fused_swiglu=2 is malformed"]),
    ("enum-case", ["--flags", "fp8_fake_quant_hoist=GATHER8"], ["fp8_fake_quant_hoist=GATHER8 is malformed"]),
    ("enum-unknown", ["--flags", "fp8_fake_quant_hoist=gather"], ["fp8_fake_quant_hoist=gather is malformed"]),
    ("unknown-flag", ["--flags", "no_such_flag=1"], ["unknown flag 'no_such_flag' (value '1')"]),
    ("near-miss", ["--flags", "moe_wi_gmm_fused_swigl=true"], ["did you mean 'moe_wi_gmm_fused_swiglu'?"]),
    ("nul-in-key", ["--flags", "moe\x00=true"], ["unknown flag 'moe\\x00'"]),
    ("newline-in-value", ["--flags", "moe_wi_gmm_fused_swiglu=tr\nue"],
     ["moe_wi_gmm_fused_swiglu=tr\nue is malformed"]),
    ("given-twice", ["--flags", "gdn_cp_m_scan=true", "gdn_cp_m_scan=false"], ["--flags gives gdn_cp_m_scan twice"]),
    ("nothing-changes", ["--flags", "gdn_cp_m_scan=false"], ["no tuning flag differs"]),
    ("refused-combination", ["--flags", "moe_router_grad_from_wo_input=true", "moe_wo_gmm_fused_dswiglu=false"],
     ["moe_router_grad_from_wo_input=True requires moe_wo_gmm_fused_dswiglu=True"]),
    ("tile-not-dividing", ["--flags", "wo_tile_fwd_embed_dim=96"], ["wo_tile_fwd_embed_dim=96 must divide"]),
    ("mesh-batch", ["--flags", "gdn_cp_m_scan=true", "ici_fsdp_parallelism=3"],
     ["ici_fsdp_parallelism=3", "batch_size=4"]),
    ("mesh-zero", ["--flags", "gdn_cp_m_scan=true", "ici_expert_parallelism=0"],
     ["ici_expert_parallelism=0 is malformed"]),
    ("control-setting-missing", ["--flags", "fp8_fake_quant_hoist=gather8", "fp8_moe_fake_quant=false"],
     ["fp8_fake_quant_hoist=gather8 requires fp8_moe_fake_quant=True"]),
    # --- configs (issue 13 item 5: a config file that is not UTF-8)
    ("config-unknown", ["--config", "nope"], ["unknown config 'nope'"]),
    ("config-empty", ["--config", ""], ["config=''"]),
    ("config-latin1", ["--config", F + "/latin1.toml"], ["latin1.toml is not UTF-8 text", "at byte"]),
    ("config-not-toml", ["--config", F + "/broken.toml"], ["broken.toml is not valid TOML"]),
    ("config-flags-not-table", ["--config", F + "/flags_not_table.toml"], ["flags = 3", "must be a table [flags]"]),
    ("config-unknown-key", ["--config", F + "/unknown_key.toml"], ["unknown key 'hiden_size' (value 3)"]),
    ("config-negative-dim", ["--config", F + "/negative.toml"], ["hidden_dim=-128 must be a positive int"]),
    ("config-string-dim", ["--config", F + "/string_dim.toml"], ["hidden_dim='abc' must be a positive int"]),
    ("config-unknown-section", ["--config", F + "/section.toml"], ["unknown section [extra]"]),
    ("config-tuned-equals-control", ["--config", F + "/tuned_same.toml"],
     ["wo_tile_fwd_mlp_dim=32 equals the control's value"]),
    ("config-flag-value", ["--config", F + "/flag_value.toml"], ["scan_layers=2 is malformed"]),
    ("config-huge-tile", ["--config", F + "/huge_tile.toml"], ["wi_tile_fwd_mlp_dim=1048576 is larger than the dim"]),
    ("config-directory", ["--config", F + "/dir.toml"], ["dir.toml"]),
    # --- the tolerance table (issue 13 item 5)
    ("tolerances-missing", ["--tolerances", F + "/no_such.toml"], ["--tolerances=", "no_such.toml' is not a file"]),
    ("tolerances-directory", ["--tolerances", F + "/dir.toml"], ["--tolerances=", "dir.toml' is not a file"]),
    ("tolerances-not-toml", ["--tolerances", F + "/tol_broken.toml"], ["tol_broken.toml is not valid TOML"]),
    ("tolerances-latin1", ["--tolerances", F + "/tol_latin1.toml"], ["tol_latin1.toml is not UTF-8 text"]),
    ("tolerances-no-entry", ["--tolerances", F + "/tol_no_n3.toml"], ["[gates.N3] missing"]),
    ("tolerances-negative", ["--tolerances", F + "/tol_negative.toml"],
     ["[gates.N1] floor=-1.0 must be a finite number >= 0"]),
    ("tolerances-bad-cross-env", ["--tolerances", F + "/tol_bad_cross.toml"],
     ["[gates.golden] cross_env_rel='loose' must be a finite number >= 0"]),
    # --- --jobs (issue 13 item 6)
    ("jobs-0", ["--jobs", "0"], ["--jobs='0' must be an integer from 1 to"]),
    ("jobs-negative", ["--jobs", "-1"], ["--jobs='-1' must be an integer"]),
    ("jobs-word", ["--jobs", "two"], ["--jobs='two' must be an integer"]),
    ("jobs-full-width", ["--jobs", "１"], ["--jobs='１' must be an integer"]),
    ("jobs-float", ["--jobs", "1.5"], ["--jobs='1.5' must be an integer"]),
    ("jobs-huge", ["--jobs", "100000"], ["--jobs='100000' must be an integer from 1 to"]),
    # --- output locations, checked before anything runs (issue 13 item 3)
    ("out-under-a-file", ["--out", F + "/a_file/reports"], ["--out=", "cannot be written", "not a folder"]),
    ("out-is-a-file", ["--out", F + "/a_file"], ["--out=", "a_file' cannot be written: it is a file"]),
    ("out-empty", ["--out", ""], ["--out='' must name a folder"]),
    ("cache-under-a-file", ["--cache-dir", F + "/a_file/cache"], ["--cache-dir=", "cannot be written"]),
    ("golden-dir-missing", ["--golden-dir", F + "/no_such_dir"], ["--golden-dir=", "no_such_dir' is not a folder"]),
    # --- argparse's own refusals
    ("tiles-choice", ["--tiles", "some"], ["argument --tiles: invalid choice: 'some'"]),
    ("unknown-option", ["--flag", "x=1", "--frobnicate"], ["unrecognized arguments: --frobnicate"]),
    ("flags-without-value", ["--flags"], ["argument --flags: expected at least one argument"]),
]
# Other commands: (id, argv, texts)
COMMANDS_CORPUS = [
    ("golden-dir-under-a-file", ["golden", "--config", "smoke", "--golden-dir", F + "/a_file/g"],
     ["--golden-dir=", "cannot be written"]),
    ("list-flags-unknown-config", ["list-flags", "--config", "nope"], ["unknown config 'nope'"]),
    ("calibrate-out-under-a-file", ["calibrate", "--config", "smoke", "--out", F + "/a_file/r"],
     ["--out=", "cannot be written"]),
    ("calibrate-benign-malformed", ["calibrate", "--config", "smoke", "--out", F + "/cal", "--benign", "x"],
     ["--flags item 'x' is malformed"]),
    ("mutants-cache-under-a-file", ["mutants", "--config", "smoke", "--out", F + "/mu", "--cache-dir",
                                    F + "/a_file/c"], ["--cache-dir=", "cannot be written"]),
    ("resolution-eps-too-large", ["resolution", "--eps", "1.5"], ["argument --eps: invalid eps value: '1.5'"]),
    ("resolution-eps-zero", ["resolution", "--eps", "0"], ["argument --eps: invalid eps value: '0'"]),
    ("resolution-exact-flag", ["resolution", "--config", "smoke", "--out", F + "/rs", "--cache-dir", F + "/c",
                               "--flags", "fp8_fake_quant_hoist=gather8"], ["exact check", "fp8_fake_quant_hoist"]),
    ("resolution-unknown-flag", ["resolution", "--config", "smoke", "--out", F + "/rs", "--cache-dir", F + "/c",
                                 "--flags", "gdn_cp_m_scn=true"], ["gdn_cp_m_scn", "did you mean 'gdn_cp_m_scan'"]),
    ("resolution-out-under-a-file", ["resolution", "--config", "smoke", "--out", F + "/a_file/r"],
     ["--out=", "cannot be written"]),
    ("false-alarms-kind", ["false-alarms", "--only", "tile"], ["argument --only: invalid choice: 'tile'"]),
    ("mutants-jobs-zero", ["mutants", "--config", "smoke", "--out", F + "/mu", "--jobs", "0"],
     ["--jobs='0' must be an integer from 1 to"]),
    ("false-alarms-seeds", ["false-alarms", "--config", "smoke", "--out", F + "/fa", "--cache-dir", F + "/c",
                            "--seeds", "0"], ["--seeds 0: must be an integer >= 1"]),
]


@pytest.fixture
def no_model_runs(monkeypatch):
    """A run that is not refused fails here at once (instead of computing for minutes)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a bad input was not refused: a model run started")

    monkeypatch.setattr(runner.Runner, "compute", refuse)


def _expand(argv, files):
    return [a.replace(F, str(files)) for a in argv]


def _check_refusal(code, err, texts, files):
    assert code == 2, f"exit {code}, stderr: {err}"
    assert "Traceback" not in err and "AssertionError" not in err, err
    for text in texts:
        assert text.replace(F, str(files)) in err, f"{text!r} not in {err!r}"


@pytest.mark.parametrize("argv, texts", [c[1:] for c in CORPUS], ids=[c[0] for c in CORPUS])
def test_run_refuses_bad_input(argv, texts, files, tmp_path, capsys, no_model_runs):
    code = cli.main(["run", "--config", "tiny", "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "c"),
                     *_expand(argv, files)])
    _check_refusal(code, capsys.readouterr().err, texts, files)


@pytest.mark.parametrize("argv, texts", [c[1:] for c in COMMANDS_CORPUS], ids=[c[0] for c in COMMANDS_CORPUS])
def test_commands_refuse_bad_input(argv, texts, files, capsys, no_model_runs):
    code = cli.main(_expand(argv, files))
    _check_refusal(code, capsys.readouterr().err, texts, files)


def test_the_corpus_is_large():
    """Issue 13: at least 50 bad inputs through the CLI (and every id distinct)."""
    ids = [c[0] for c in CORPUS + COMMANDS_CORPUS]
    assert len(ids) == len(set(ids)) and len(ids) >= 50


@pytest.mark.parametrize("kwargs, texts", [
    ({"flags": "moe_wi_gmm_fused_swiglu=true"}, ["flags='moe_wi_gmm_fused_swiglu=true' must be a mapping",
                                                 "the CLI's 'k=v' strings are for --flags"]),
    ({"flags": ["gdn_cp_m_scan=true"]}, ["flags=['gdn_cp_m_scan=true'] must be a mapping"]),
    ({"flags": {1: True}}, ["flags: key 1 must be a flag name"]),
    ({"config": None}, ["config=None must be a config name"]),
    ({"config": ""}, ["config='' must be a config name"]),
    ({"config": 3}, ["config=3 must be a config name"]),
    ({"jobs": 0}, ["jobs=0 must be an int >= 1"]),
    ({"jobs": True}, ["jobs=True must be an int >= 1"]),
    ({"jobs": 1.5}, ["jobs=1.5 must be an int >= 1"]),
    ({"jobs": "2"}, ["jobs='2' must be an int >= 1"]),
    ({"tiles": "some"}, ["tiles='some' must be 'each' or 'grouped'"]),
    ({"use_cache": "yes"}, ["use_cache='yes' must be True or False"]),
    ({"progress": 5}, ["progress=5 must be callable"]),
    ({"cache_dir": 5}, ["cache_dir=5 must be a path"]),
    ({"settings": None}, ["settings=None must be a gates.protocol.ProtocolSettings"]),
    ({"api": "model"}, ["api='model' must be a gates.model_api.ModelAPI"]),
    ({"api_factory": "no_colon"}, ["api_factory='no_colon' must be 'package.module:function'"]),
    ({"golden_dir": "no/such/dir"}, ["golden_dir='no/such/dir' is not a directory"]),
    ({"tolerances_path": "no/such.toml"}, ["tolerances_path='no/such.toml'", "does not exist"]),
    ({"accelerator": "no"}, ["accelerator='no' must be True or False"]),
    ({"fail_fast": "yes"}, ["fail_fast='yes' must be True or False"]),
    ({"flags": {"wi_tile_fwd_embed_dim": "１２８"}}, ["wi_tile_fwd_embed_dim=１２８ is malformed"]),
    ({"flags": {"wi_tile_fwd_mlp_dim": 1048576}}, ["wi_tile_fwd_mlp_dim=1048576 is larger than the dim"]),
], ids=lambda v: str(v)[:40] if isinstance(v, dict) else None)
def test_python_api_refuses_bad_arguments(kwargs, texts, no_model_runs):
    from nxgates import gates

    with pytest.raises(ValueError) as e:
        gates.check(**{"config": "tiny", "progress": None, **kwargs})
    for text in texts:
        assert text in str(e.value), f"{text!r} not in {str(e.value)!r}"


SUBPROCESS = [
    (["--flags", "wi_tile_fwd_embed_dim=²"], "wi_tile_fwd_embed_dim=² is malformed"),
    (["--config", F + "/latin1.toml"], "latin1.toml is not UTF-8 text"),
    (["--tolerances", F + "/tol_broken.toml"], "is not valid TOML"),
    (["--out", F + "/a_file/reports"], "cannot be written"),
]


@pytest.mark.parametrize("argv, text", SUBPROCESS, ids=["superscript", "latin1-config", "broken-tolerances",
                                                         "out-under-file"])
def test_real_cli_process_refuses_bad_input(argv, text, files, tmp_path):
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    proc = subprocess.run([sys.executable, "-m", "nxgates", "run", "--cache-dir", str(tmp_path / "c"), "--out",
                           str(tmp_path / "out"), *_expand(argv, files)], capture_output=True, text=True,
                          encoding="utf-8", env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and text in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 4, proc.stderr  # the refusal, not a log


def test_the_harness_fails_an_input_that_is_not_refused(tmp_path, no_model_runs):
    """The corpus's guard works: a valid input reaches a model run, which fails the test instead of computing."""
    with pytest.raises(AssertionError, match="a bad input was not refused"):
        cli.main(["run", "--config", "smoke", "--flags", "gdn_cp_m_scan=true", "--jobs", "1", "--out",
                  str(tmp_path / "out"), "--cache-dir", str(tmp_path / "c")])


def test_a_plain_interpreter_gets_the_host_devices_or_the_fix(tmp_path):
    """Issue 13 item 7: the README's snippet in a plain interpreter. ``check`` sets up the 8 host CPU devices when jax
    has not started (here: refused flag, after the mesh's devices exist); when jax already started with fewer, the
    error says what to set."""
    code = ("import jax\nfrom nxgates import gates\n"
            "try:\n    gates.check('smoke', {'wi_tile_fwd_mlp_dim': 1048576}, progress=None)\n"
            "except ValueError as e:\n    print('refused:', str(e).splitlines()[-1], len(jax.devices()))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 0 and "refused:" in proc.stdout and proc.stdout.strip().endswith(" 8"), proc.stderr
    late = "import jax\njax.devices()\nfrom nxgates import gates\ngates.check('smoke', progress=None)\n"
    proc = subprocess.run([sys.executable, "-c", late], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 1 and "RuntimeError: nxgates needs 8 devices" in proc.stderr
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=8" in proc.stderr
