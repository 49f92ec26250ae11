"""The end of the terminal report names every failing check: its first failing gate and step per lens, the side and
the value against the bound, so a log cut to its last lines (a CI job's) still says what failed.

Run: python -m pytest tests/gates/test_report_verdict.py -q
"""

from __future__ import annotations

from nxgates.gates import contracts
from nxgates.gates import gates as G
from nxgates.gates import report as report_lib
from nxgates.gates import runner as runner_lib
from nxgates.gates import tolerances as T

TOL = T.Tolerances(tol={g: 0.0 for g in G.GATES}, slack={g: 0.1 for g in G.GATES}, golden_rel=0.0, reasons={},
                   sources={}, path="test")


def _row(gate, step, vs_control=0.01, vs_reference=0.02, c=0.02, *, slack=0.1, exact=False):
    bound_c, bound_r = (0.0 if exact else c), (1 + slack) * c
    return G.GateResult(gate=gate, step=step, vs_control=vs_control, vs_reference=vs_reference,
                        control_vs_reference=c, bound_control=bound_c, bound_reference=bound_r,
                        bit_identical=(vs_control == 0.0) if exact else None,
                        passed_control=(vs_control == 0.0) if exact else vs_control <= bound_c,
                        passed_reference=vs_reference <= bound_r, worst_tensor=None)


def _check(name, contract, rows, lens_rows=None, problems=()):
    spec = contracts.CheckSpec(name=name, contract=contract, candidate_overrides={name: True}, keys=(name,))
    return runner_lib.CheckResult(spec=spec, control_flags={}, candidate_flags={name: True}, results=rows,
                                  problems=list(problems), implementations={}, records={"control": "computed",
                                                                                        "reference": "computed"},
                                  wall_s=1.0, lens_results=lens_rows)


def _steps(**bad):
    """Every gate at steps 1-3 passing, except ``bad``: {"N5_2": (vs_control, vs_reference)}."""
    out = []
    for step in (1, 2, 3):
        for g in G.GATES:
            vc, vr = bad.get(f"{g}_{step}", (0.01, 0.02))
            out.append(_row(g, step, vc, vr))
    return out


def test_the_last_lines_name_each_failing_check_gate_step_side_and_value():
    good = _check("good_flag", "rounding", _steps(), lens_rows=_steps())
    # bf16: N5 fails against the reference at steps 2 and 3 (5.3e-2 > 1.1 x 2e-2 = 2.2e-2); lens passes
    n5 = _check("n5_flag", "rounding", _steps(N5_2=(0.01, 0.053), N5_3=(0.01, 0.06)), lens_rows=_steps())
    # lens only: N4 against the control at step 1 (0.03 > 0.02), bf16 passes
    lens = _check("lens_flag", "rounding", _steps(), lens_rows=_steps(N4_1=(0.03, 0.02)))
    rep = report_lib.Report(config="toy", checks=[good, n5, lens], golden=None, env={}, tolerances=TOL, wall_s=12.0)
    tail = rep.table().splitlines()[-3:]
    assert tail[0] == "FAIL: 1/3 checks pass (12.0s)"
    assert tail[1] == ("  failed: n5_flag (rounding): bf16 N5 step 2 vs reference: 5.300e-02 > bound 2.200e-02 "
                       "(and 1 more gate-step(s))")
    assert tail[2] == "  failed: lens_flag (rounding): float32 lens N4 step 1 vs control: 3.000e-02 > bound 2.000e-02"
    assert "good_flag" not in "\n".join(tail)


def test_an_exact_check_says_its_bits_differ_and_a_precondition_is_named():
    rows = [_row(g, s, exact=True, vs_control=(1e-7 if (g, s) == ("N4", 2) else 0.0)) for s in (1, 2, 3)
            for g in G.GATES]
    exact = _check("hoist", "exact", rows)
    nan = _check("nan_flag", "rounding", _steps(), lens_rows=_steps(), problems=["candidate: non-finite gradient"])
    text = report_lib.Report(config="toy", checks=[exact, nan], golden=None, env={}, tolerances=TOL).table()
    assert "  failed: hoist (exact): bf16 N4 step 2 vs control: bits differ from the control (metric 1.000e-07)" in text
    assert "  failed: nan_flag (rounding): bf16 precondition: candidate: non-finite gradient" in text


def test_a_passing_report_ends_with_its_verdict_alone():
    rep = report_lib.Report(config="toy", checks=[_check("good_flag", "rounding", _steps(), lens_rows=_steps())],
                            golden=None, env={}, tolerances=TOL, wall_s=3.0)
    assert rep.table().splitlines()[-1] == "PASS: 1/1 checks pass (3.0s)"
