"""examples/plain_jax_trainer.py: a trainer that is not the gates' own, judged through its records.

The benign variant (split-k: the float32 accumulation re-associated) must pass ``nxgates compare`` against the control
with the float32 reference's live bounds (exit 0); the bug variant (a custom_vjp that forgets a scale in one weight
gradient) must fail it (exit 1), on the gradient gates. Small shapes on one device (XLA compiles each variant's train
step: about 4 s of CPU each); the same verdicts with the batch and weights sharded over the 8 host devices are the
``slow`` test.
"""

import ast
import importlib.util
import json
import pathlib

import pytest

from nxgates.gates import cli

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "plain_jax_trainer.py"


def _load():
    spec = importlib.util.spec_from_file_location("plain_jax_trainer", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _train_all(root, devices: int):
    trainer = _load()
    for variant in trainer.VARIANTS:
        assert trainer.main(["--out", str(root / variant), "--variant", variant, "--steps", "3",
                             "--devices", str(devices)]) == 0
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _train_all(tmp_path_factory.mktemp("plain_jax_runs"), devices=1)


def test_example_uses_only_the_recorder_api():
    tree = ast.parse(EXAMPLE.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            imported.add(f"{node.module}:{','.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert {m for m in imported if "nxgates" in m} == {"nxgates.gates:recorder"}


def _compare(runs, candidate, tmp_path):
    out = tmp_path / candidate
    code = cli.main(["compare", str(runs / "control"), str(runs / candidate), "--reference", str(runs / "reference"),
                     "--out", str(out)])
    return code, json.loads((out / "compare.json").read_text())


def test_benign_reassociation_passes(runs, tmp_path):
    code, report = _compare(runs, "benign", tmp_path)
    assert code == 0
    assert report["judged"] == ["N1", "N2", "N3", "N4", "N5", "N6"]
    assert {r["verdict"] for r in report["results"]} == {"pass"}
    # the gradient gates read sketches (the tensors are wider than the sketch), not exact arrays
    assert {r["source"] for r in report["results"] if r["gate"] == "N4"} == {"sketch"}


def test_bug_fails_the_gradient_gates(runs, tmp_path):
    code, report = _compare(runs, "bug", tmp_path)
    assert code == 1
    failed = {r["gate"] for r in report["results"] if r["verdict"] == "fail"}
    assert failed == {"N3", "N4", "N5"}  # the forward is untouched; AdamW's per-element step hides the scale
    n5 = [r for r in report["results"] if r["gate"] == "N5"]
    assert {r["worst_tensor"] for r in n5} == {"mlp/w_out_proj"}  # the tensor whose backward is wrong is named


def test_bad_variant_is_refused(capsys):
    trainer = _load()
    with pytest.raises(SystemExit) as e:
        trainer.main(["--out", "unused", "--variant", "fused"])
    assert e.value.code == 2
    assert "invalid choice: 'fused'" in capsys.readouterr().err


@pytest.mark.slow
def test_same_verdicts_sharded_over_8_devices(tmp_path):
    root = _train_all(tmp_path / "runs", devices=8)
    assert _compare(root, "benign", tmp_path)[0] == 0
    code, report = _compare(root, "bug", tmp_path)
    assert code == 1 and {r["gate"] for r in report["results"] if r["verdict"] == "fail"} == {"N3", "N4", "N5"}
