"""``gates/testing.py``: anyone's kernel against the float32 references (``check_kernel``, the CLI ``--impl``).

Proof with implementations this project did not write: ``jax.lax.ragged_dot`` and JAX's megablox GMM (Pallas,
interpret mode) pass as GMMs; a GMM with its group boundaries one row late and a GDN that decays after the delta
correction fail, naming the case and the worst element. Every op's pipeline passes its own reference and fails a
1 % scaled one. The kernels live in ``tests/gates/peer_kernels.py``.
Run: ``python -m pytest tests/gates/test_testing.py -q`` (the cell shapes: ``--runslow``).
"""

from __future__ import annotations

import ast
import json
import pathlib

import jax
import jax.numpy as jnp
import pytest

from nxgates import reference as R
from nxgates.gates import testing
from nxgates.gates.kernel_cases.reference_ops import OPS
from tests.gates import peer_kernels as peers

REPO = pathlib.Path(__file__).resolve().parents[2]


def _rows(report, **match):
    return [r for r in report.rows if all(r[k] == v for k, v in match.items())]


# ----------------------------------------------------------------------------------------------- the two peers pass


def test_ragged_dot_passes_as_gmm():
    report = testing.assert_kernel_close(peers.ragged_dot_gmm, "gmm")
    assert report.passed and len(report.cases) == 6  # awkward, empty groups, rows past the sum; f32 and bf16
    assert {r["output"] for r in report.rows} == {"out", "dlhs", "drhs"}
    assert {r["tol_key"] for r in report.rows} == {"check.f32", "check.bf16"}
    assert all(r["tol_source"] and r["tol_reason"] for r in report.rows)


def test_megablox_passes_as_gmm_with_its_rows_past_the_sum_unspecified():
    # Each geometry once (the full default set: `nxgates kernels --impl tests.gates.peer_kernels:megablox_gmm --op gmm
    # --adapter rows_past_group_sum_unspecified`, 18 rows, PASS); every case compiles three Pallas calls.
    cases = ["awkward/bf16", "empty_groups/f32", "rows_past_sum/bf16"]
    report = testing.assert_kernel_close(peers.megablox_gmm, "gmm", cases=cases,
                                         adapter=testing.rows_past_group_sum_unspecified)
    assert report.adapter.endswith("rows_past_group_sum_unspecified")


def test_megablox_without_the_adapter_fails_on_rows_past_the_sum_with_nan():
    """Why megablox needs the adapter: it never writes the rows past sum(group_sizes) (the Pallas interpreter fills
    unwritten output with NaN), and its dlhs (a gmm against the transposed weights) leaves them unwritten too."""
    report = testing.check_kernel(peers.megablox_gmm, "gmm", cases="rows_past_sum/bf16")
    failing = {(r["case"], r["output"]) for r in report.failures}
    assert failing == {("rows_past_sum/bf16", "out"), ("rows_past_sum/bf16", "dlhs")}
    for r in report.failures:
        assert r["verdict"] == "FAIL (non-finite)"
        assert r["max_abs_index"][0] == 30  # the first row past sum(10, 7, 13) = 30
        assert r["expected_at_max"] == 0.0


# -------------------------------------------------------------------------------------- the two wrong kernels fail


def test_gmm_with_boundaries_one_row_late_fails_naming_case_and_worst_element():
    with pytest.raises(AssertionError) as info:
        testing.assert_kernel_close(peers.gmm_boundaries_one_row_late, "gmm", cases=["awkward/f32", "rows_past_sum"])
    message = str(info.value)
    assert "gmm case 'awkward/f32' output 'out'" in message and "worst element out[" in message
    report = testing.check_kernel(peers.gmm_boundaries_one_row_late, "gmm", cases="awkward/f32")
    out = _rows(report, output="out")[0]
    assert out["verdict"] == "FAIL" and out["rel_l2"] > 0.1
    boundaries = {9, 23, 34}  # the first rows of groups 1, 2, 3 (sizes 9, 14, 11, 11)
    assert out["max_abs_index"][0] in boundaries
    past = testing.check_kernel(peers.gmm_boundaries_one_row_late, "gmm", cases="rows_past_sum/f32")
    assert all(r["verdict"] == "FAIL" for r in past.rows)


def test_gdn_decaying_after_the_delta_correction_fails_naming_case_and_worst_element():
    cases = ["strong_decay/f32", "weak_decay/bf16"]  # one decay of each strength, both dtypes
    report = testing.check_kernel(peers.gdn_decay_after_delta, "gdn", cases=cases)
    assert not report.passed
    for case in cases:
        for output in ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta"):
            assert _rows(report, case=case, output=output)[0]["verdict"] == "FAIL", (case, output)
        # The state's gradient does not see the order: exp(g) is a scalar, it commutes with (I - beta k k^T).
        assert _rows(report, case=case, output="dstate0")[0]["verdict"] == "PASS"
    lines = report.failure_lines()
    assert any(line.startswith("FAIL: gdn case 'strong_decay/f32' output 'o'") and "worst element o[" in line
               for line in lines)
    # The right recurrence in another form passes the same case (so the case is not merely strict).
    testing.assert_kernel_close(
        lambda q, k, v, g, beta, s: R.gdn_chunked(q, k, v, g, beta, chunk_size=16, initial_state=s), "gdn",
        cases="weak_decay/bf16",
    )


# ------------------------------------------------------------------------------------------------------- adapters


def test_heads_first_gdn_adapter():
    testing.assert_kernel_close(peers.gdn_heads_first, "gdn", cases="weak_decay/bf16", adapter=testing.heads_first_gdn)
    # Without it the shapes happen to fit (T and H swapped twice) but the recurrence runs over heads: it fails.
    assert not testing.check_kernel(peers.gdn_heads_first, "gdn", cases="weak_decay/bf16", grads=False).passed


def test_transposed_rhs_adapter_and_argument_order():
    testing.assert_kernel_close(peers.gmm_rhs_transposed, "gmm", cases="awkward", adapter=testing.transposed_rhs_gmm)

    def gmm_sizes_first(group_sizes, lhs, rhs):
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)

    testing.assert_kernel_close(gmm_sizes_first, "gmm", cases="empty_groups/f32", adapter=testing.reorder_args(2, 0, 1))
    with pytest.raises(ValueError, match="permutation"):
        testing.reorder_args(0, 0, 1)


def test_project_fold_scan_forward_passes_and_its_missing_vjp_is_an_error_row():
    kw = dict(cases="weak_decay", adapter=testing.chunks_first_fold)
    testing.assert_kernel_close(peers.project_fold_scan, "gdn_fold", grads=False, **kw)
    report = testing.check_kernel(peers.project_fold_scan, "gdn_fold", **kw)
    assert [r["verdict"] for r in _rows(report, output="M")] == ["PASS"]
    grad_rows = _rows(report, output="dm") + _rows(report, output="db")
    assert grad_rows and all(r["verdict"].startswith("ERROR (jax.vjp of it (no VJP?") for r in grad_rows)


# --------------------------------------------------------------------- every op: its reference passes, 1 % off fails


def _scaled(fn, factor):
    def scaled(*args, **kwargs):
        return jax.tree.map(lambda y: y * jnp.asarray(factor, y.dtype), fn(*args, **kwargs))

    return scaled


@pytest.mark.parametrize("op", sorted(OPS))
def test_every_op_passes_its_reference_and_fails_it_scaled_by_one_percent(op):
    """One case per op (bf16; the fold is float32 only): the pipeline of every op compares and can fail."""
    spec = OPS[op]
    cases = [next(c.name for c in spec.cases if not c.cell and c.dtype == ("f32" if op == "gdn_fold" else "bf16"))]
    good = testing.check_kernel(spec.reference, op, cases=cases)
    assert good.passed, str(good)
    assert {r["output"] for r in good.rows} == {*spec.outputs, *(spec.grad_name(a) for a in spec.grads)} - (
        set() if all(c.build()[0].get("initial_state") is not None for c in map(spec.case, cases)) else {"dstate0"})
    bad = testing.check_kernel(_scaled(spec.reference, 1.01), op, cases=cases)
    assert {r["verdict"] for r in bad.rows} == {"FAIL"}, str(bad)


# ----------------------------------------------------------------------------------------------- bad input, tolerances


def test_shape_and_structure_errors_are_named():
    with pytest.raises(testing.KernelShapeError, match=r"output 'out' of op 'gmm' has shape \(45, 39\) .* \(45, 40\)"):
        testing.check_kernel(peers.gmm_drops_last_column, "gmm", cases="awkward/f32")
    with pytest.raises(testing.KernelShapeError, match="returned 1 array.* returns 2: dgate, dup"):
        testing.check_kernel(lambda gate, up, dh: gate * up * dh, "swiglu_bwd", cases="awkward/f32")
    with pytest.raises(testing.KernelShapeError, match="dtype int32"):
        testing.check_kernel(lambda gate, up: (gate * up).astype(jnp.int32), "swiglu", cases="awkward/f32", grads=False)


@pytest.mark.parametrize(
    "kwargs,needle",
    [({"op": "gemm"}, "op='gemm'"), ({"cases": "huge"}, "cases='huge'"), ({"cases": []}, "selects no case"),
     ({"tolerances": -1.0}, "rel_l2 must be a number >= 0"), ({"tolerances": "missing.toml"}, "tolerances="),
     ({"adapter": 3}, "adapter=3")],
    ids=["op", "case", "no-case", "tolerance", "tolerance-file", "adapter"],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, needle):
    kwargs = {"op": "gmm", "cases": "awkward/f32", **kwargs}
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        testing.check_kernel(peers.ragged_dot_gmm, **kwargs)


def test_tolerance_argument_decides_and_is_reported():
    # The bf16 rows sit at ~1.7e-3: a caller's 1e-3 for "out" fails exactly those rows and says where it came from.
    report = testing.check_kernel(peers.ragged_dot_gmm, "gmm", cases="awkward", grads=False,
                                  tolerances={"out/bf16": 1e-3, "*": 1e-5})
    assert [(r["case"], r["verdict"]) for r in report.rows] == [("awkward/f32", "PASS"), ("awkward/bf16", "FAIL")]
    assert report.rows[1]["tol_key"] == "tolerances['out/bf16']"
    assert report.rows[1]["tol_source"] == "tolerances= argument of check_kernel"


def test_a_function_that_raises_fails_its_case_with_the_message():
    def broken(lhs, rhs, group_sizes):
        raise NotImplementedError("no ragged rows yet")

    report = testing.check_kernel(broken, "gmm", cases="awkward/f32")
    assert not report.passed
    assert all("NotImplementedError: no ragged rows yet" in r["verdict"] for r in report.rows)


# ---------------------------------------------------------------------------------------------------------------- CLI


def _cli(capsys, *argv):
    from nxgates.gates import cli

    code = cli.main(["kernels", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_pass_fail_and_json(capsys, tmp_path):
    code, out, _ = _cli(capsys, "--impl", "tests.gates.peer_kernels:ragged_dot_gmm", "--op", "gmm", "--case",
                        "awkward", "--out", str(tmp_path))
    assert code == 0 and "PASS: 6 rows, 0 failing" in out
    assert json.loads((tmp_path / "check_gmm.json").read_text())["passed"] is True
    code, out, _ = _cli(capsys, "--impl", "tests.gates.peer_kernels:gmm_boundaries_one_row_late", "--op", "gmm",
                        "--case", "awkward/f32", "--json")
    doc = json.loads(out)
    assert code == 1 and doc["passed"] is False and doc["exit_code"] == 1
    assert doc["failures"][0].startswith("FAIL: gmm case 'awkward/f32' output 'out'")


@pytest.mark.parametrize(
    "argv,needle",
    [(["--impl", "no_such_pkg.mod:fn", "--op", "gmm"], "module 'no_such_pkg.mod' not found"),
     (["--impl", "tests.gates.peer_kernels:nothing", "--op", "gmm"], "has no attribute 'nothing'"),
     (["--impl", "tests.gates.peer_kernels", "--op", "gmm"], "must read PACKAGE.MODULE:FUNCTION"),
     (["--impl", "tests.gates.peer_kernels:REPO_NOTE", "--op", "gmm"], "not a function"),
     (["--impl", "tests.gates.peer_kernels:ragged_dot_gmm", "--op", "gemm"], "--op='gemm' is not an op"),
     (["--impl", "tests.gates.peer_kernels:ragged_dot_gmm", "--op", "gmm", "--case", "huge"], "--case='huge'"),
     (["--impl", "tests.gates.peer_kernels:ragged_dot_gmm", "--op", "gmm", "--adapter", "nope"], "--adapter='nope'"),
     (["--impl", "tests.gates.peer_kernels:gmm_drops_last_column", "--op", "gmm", "--case", "awkward/f32"],
      "output 'out' of op 'gmm' has shape (45, 39)"),
     (["--op", "gmm", "--impl"], "--impl")],
    ids=["module", "attribute", "format", "not-callable", "op", "case", "adapter", "shape", "missing-value"],
)
def test_cli_bad_input_exits_2_naming_it_without_traceback(capsys, argv, needle):
    code, _, err = _cli(capsys, *argv)
    assert code == 2 and needle in err and "Traceback" not in err


def test_cli_without_impl_still_runs_the_projects_report(capsys, tmp_path):
    code, out, _ = _cli(capsys, "--op", "fp8", "--out", str(tmp_path))
    assert code == 0 and "fp8_absmax_quantize" in out


# ------------------------------------------------------------------------------------------------------ import cycle


def test_case_modules_do_not_import_the_report():
    """kernel_report imports the case modules; they import only kernel_cases.base (no cycle through importlib)."""
    for path in sorted((REPO / "gates" / "kernel_cases").glob("*.py")):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                imported |= {a.name for a in node.names}
        assert not any(name.endswith("kernel_report") for name in imported), path.name


# --------------------------------------------------------------------------------------------------- the cell shapes


@pytest.mark.slow
def test_ragged_dot_passes_the_cell_gmm():
    testing.assert_kernel_close(peers.ragged_dot_gmm, "gmm", cases="cell")
