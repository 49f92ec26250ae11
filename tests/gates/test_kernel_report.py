"""``gates/kernel_report.py``: exit codes, the injection point (``overrides``), atomic outputs.

A deliberately wrong fused-backward epilogue (``dgate`` without the ``(1 + gate * (1 - s))`` factor) and a ``d_route``
from the weighted ``g`` must each fail their row (exit 1) while the untouched rows pass.
Run: ``python -m pytest tests/gates/test_kernel_report.py -q``.
"""

from __future__ import annotations

import json
import os
import pathlib

import jax
import jax.numpy as jnp
import pytest

from nxgates.gates import kernel_report
from nxgates.kernels.gmm import dswiglu_gmm


def _epilogue_without_silu_derivative_factor(g, gate, up, r):
    s = jax.nn.sigmoid(gate)
    dh = g * r
    return dh * up * s, dh * gate * s, jnp.sum(g * gate * s * up, axis=1, keepdims=True)  # dgate lacks (1 + gate(1-s))


def _epilogue_d_route_from_weighted_g(g, gate, up, r):
    s = jax.nn.sigmoid(gate)
    dh = g * r
    d_route = jnp.sum(dh * gate * s * up, axis=1, keepdims=True)  # rowsum(r * g * h) instead of rowsum(g * h)
    return dh * up * s * (1.0 + gate * (1.0 - s)), dh * gate * s, d_route


def _wrong(epilogue):
    def impl(dy, wo, gate_up, gs, r, tiles):
        return dswiglu_gmm(dy, wo, gate_up, gs, r, tiles=tiles[:2], emit_d_route=True, epilogue=epilogue,
                           interpret=True)

    return impl


def _rows(out: pathlib.Path) -> list[dict]:
    return json.loads((out / "kernels.json").read_text())["rows"]


def test_fp8_rows_pass_and_outputs_are_written(tmp_path, capsys):
    assert kernel_report.main(["--op", "fp8", "--out", str(tmp_path)]) == 0
    rows = _rows(tmp_path)
    assert [(r["output"], r["verdict"]) for r in rows] == [("codes", "PASS"), ("scale", "PASS")]
    assert rows[0]["tol_rel_l2"] == 0.0 and rows[0]["tol_reason"] and rows[0]["tol_source"]
    md = (tmp_path / "kernels.md").read_text()
    assert "fp8_absmax_quantize" in md and "## Tolerances" in md
    assert "SQNR dB" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kernels.json", "kernels.md"]  # no temp files left


def test_wrong_fused_backward_epilogues_fail_with_exit_1(tmp_path):
    overrides = {"moe": {
        "dswiglu_bwd.pallas_fused": _wrong(_epilogue_without_silu_derivative_factor),
        "dswiglu_bwd.pallas_fused_no_router": _wrong(_epilogue_d_route_from_weighted_g),
    }}
    code = kernel_report.main(["--op", "moe", "--kernel", "dswiglu_bwd", "--out", str(tmp_path)], overrides=overrides)
    assert code == 1
    verdicts = {(r["impl"], r["output"]): r["verdict"] for r in _rows(tmp_path)}
    assert verdicts[("pallas_fused", "d_gate_up")] == "FAIL"
    assert verdicts[("pallas_fused_no_router", "d_route")] == "FAIL"
    assert verdicts[("unfused", "d_gate_up")] == "PASS" and verdicts[("unfused", "d_route")] == "PASS"
    # The substitution is undone: the real implementation is back in the table.
    from nxgates.gates.kernel_cases import moe

    assert moe.IMPLS["dswiglu_bwd.pallas_fused"].__name__ == "_dswiglu_fused"


def test_missing_tolerance_entry_fails(tmp_path):
    table = tmp_path / "tol.toml"
    table.write_text('[kernels."fp8.codes"]\nrel_l2 = 0.0\nreason = "exact"\nsource = "test"\n')
    assert kernel_report.main(["--op", "fp8", "--out", str(tmp_path / "r"), "--tolerances", str(table)]) == 1
    assert [r["verdict"] for r in _rows(tmp_path / "r")] == ["PASS", "FAIL (no tolerance)"]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--case", "huge"], "--case"),
        (["--op", "nope"], "--op"),
        (["--tolerances", "/nonexistent/tol.toml", "--op", "fp8"], "--tolerances"),
        (["--kernel", "nope", "--op", "fp8"], "--kernel"),
    ],
    ids=["case", "op", "tolerances", "kernel"],
)
def test_bad_arguments_exit_2_naming_the_argument(argv, needle, tmp_path, capsys):
    assert kernel_report.main([*argv, "--out", str(tmp_path / "r")]) == 2
    assert needle in capsys.readouterr().err


def test_out_is_a_file_exit_2(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert kernel_report.main(["--op", "fp8", "--out", str(f)]) == 2
    assert "--out" in capsys.readouterr().err


def test_write_is_atomic(tmp_path, monkeypatch):
    assert kernel_report.main(["--op", "fp8", "--out", str(tmp_path)]) == 0
    before = (tmp_path / "kernels.json").read_bytes()

    def failing_replace(src, dst):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="simulated"):
        kernel_report.main(["--op", "fp8", "--out", str(tmp_path)])
    assert (tmp_path / "kernels.json").read_bytes() == before  # the old report, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kernels.json", "kernels.md"]
