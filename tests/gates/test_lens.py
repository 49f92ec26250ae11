"""The float32 lens on the toy model: a rounding check also runs the control and the candidate on their own code paths
in float32 against the float32 reference; a bug far below bf16's own error passes the bf16 gates and fails the lens.

Run: python -m pytest tests/gates/test_lens.py -q
"""

from __future__ import annotations

import functools

import jax

from nxgates.gates import contracts
from nxgates.gates import gates as G
from nxgates.gates import record as record_lib
from nxgates.gates import report as report_lib
from nxgates.gates import runner as runner_lib
from nxgates.gates import tolerances as T
from tests.gates import toy_model

# Lens bounds for the toy (a float32 floor well above float32 reassociation, ~1e-7 here, far below bf16's ~1e-2).
LENS = T.Tolerances(tol={g: 1e-5 for g in G.GATES}, slack={g: 0.05 for g in G.GATES}, golden_rel=0.0, reasons={},
                    sources={}, path="test lens", section="lens")


# bf16 bounds for the toy: live, slack 0.25 (the toy's few log-probs: the fused flag's N2 sits at 1.13 x the control's
# distance to the reference; the repository table's slack is calibrated on tiny's model, not this toy's).
BF16 = T.Tolerances(tol={g: 0.0 for g in G.GATES} | {"N3": 2e-3}, slack={g: 0.25 for g in G.GATES}, golden_rel=0.0,
                    reasons={}, sources={}, path="test bf16")


def _silu_beta(x):  # a wrong constant: silu(x) with sigmoid((1 + 2^-10) x)
    return x * jax.nn.sigmoid((1.0 + 2.0**-10) * x)


def test_lens_passes_a_correct_flag_and_fails_a_sub_bf16_bug(tmp_path, capsys):
    r = runner_lib.Runner("toy", api=toy_model.api(), cache=record_lib.RecordCache(str(tmp_path)),
                          tolerances=BF16, lens_tolerances=LENS, progress=lambda m: None)
    spec = contracts.build_check("fused", {"moe_wi_gmm_fused_swiglu": True}, r.api.as_dict(r.base_flags), r.closure)
    good = r.run_check(spec)
    assert good.lens_results is not None and good.lens_passed and good.bf16_passed and good.passed
    assert good.records["control-lens"] == "computed"
    bad = r.run_check(spec, candidate_context=functools.partial(toy_model.override, "activation", _silu_beta))
    assert bad.bf16_passed, [x for x in bad.results if not x.passed]  # invisible under bf16 rounding
    assert not bad.lens_passed and not bad.passed  # the float32 lens sees it
    assert {"N4", "N5"} <= {x.gate for x in bad.lens_results if not x.passed}
    rep = report_lib.Report(config="toy", checks=[good, bad], golden=None, env={}, tolerances=r.tolerances)
    text = rep.table()
    assert "float32 lens: FAIL; bf16 gates: PASS" in text and "float32 lens: PASS; bf16 gates: PASS" in text
    assert rep.to_json()["checks"][1]["lens_passed"] is False


def test_exact_checks_do_not_run_the_lens(tmp_path):
    r = runner_lib.Runner("toy", api=toy_model.api(), cache=record_lib.RecordCache(str(tmp_path)),
                          tolerances=BF16, lens_tolerances=LENS, progress=lambda m: None)
    spec = contracts.build_check("hoist", {"fp8_fake_quant_hoist": "gather8"}, r.api.as_dict(r.base_flags), r.closure)
    res = r.run_check(spec)
    assert res.spec.contract == "exact" and res.lens_results is None and res.lens_passed is None and res.passed
