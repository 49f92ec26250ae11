"""The mutant harness on the toy model: a mutant passes only when, in each lens, it fails every must-gate and nothing
outside must + may, and an override that never reaches the trace is reported, not counted. (The real mutants run in
`nox -s mutants`.)

Run: python -m pytest tests/gates/test_mutants.py -q
"""

from __future__ import annotations

import jax
import pytest

from nxgates.gates import mutants as M
from tests.gates import toy_model


def relu_override(cfg, flags):
    def relu_instead_of_silu(x):
        return jax.nn.relu(x)

    return [("activation", relu_instead_of_silu)]


TOY_MUTANTS = (
    M.Mutant("toy_loss_wrong_count", "token-mean over every token", {},
             M._all(("N1", "N3", "N4", "N5"), "the loss and the gradient scale"),
             "loss and gradient scale; AdamW is scale invariant", loss_fn=M._loss_wrong_count,
             may={"N6": "AdamW's epsilon", "N2": "steps 2-3 through the updates"}),
    M.Mutant("toy_relu", "relu instead of silu on the exact flag's path", {"fp8_fake_quant_hoist": "gather8"},
             M._all(M.ALL_BUT_N1, M.EXACT), "forward changes; exact contract", overrides=relu_override),
    M.Mutant("toy_relu_wrong_prediction", "same bug, prediction deliberately wrong",
             {"fp8_fake_quant_hoist": "gather8"},
             {"N1": "wrong on purpose"}, "wrong on purpose", overrides=relu_override),
    M.Mutant("toy_untraced_override", "an override of an op the model never calls", {},
             {"N1": "never reached"}, "must be reported as not traced",
             overrides=lambda cfg, flags: [("not_an_op", lambda *a: None)]),
)


def test_must_may_semantics():
    """A mutant passes when it fails every must-gate and nothing outside must + may; a may-gate needs its reason."""
    must, may = {"N4": "1.3 x"}, {"N2": "within 1% of its bound"}
    assert M.verdict(must, may, {"N4"}) and M.verdict(must, may, {"N4", "N2"})
    assert not M.verdict(must, may, {"N2"})  # a must-gate passed
    assert not M.verdict(must, may, {"N4", "N6"})  # a gate outside must + may failed
    assert not M.verdict(must, may, set())
    with pytest.raises(ValueError, match="needs its reason"):
        M.Mutant("x", "bug", {}, {"N4": "m"}, "why", may={"N2": ""})
    with pytest.raises(ValueError, match="both must and may"):
        M.Mutant("x", "bug", {}, {"N4": "m"}, "why", may={"N4": "near"})
    with pytest.raises(ValueError, match="not gates"):
        M.Mutant("x", "bug", {}, {"N9": "m"}, "why")
    with pytest.raises(ValueError, match="no gate it must fail"):
        M.Mutant("x", "bug", {}, {}, "why", may={"N4": "near"})


def test_mutant_result_needs_both_lenses():
    """The bf16 verdict and the float32 lens's are separate: a lens that misses a must-gate fails the mutant, and a
    lens verdict that was not declared (or a declared one that did not run) is a mismatch."""
    m = M.Mutant("x", "bug", {"moe_wi_gmm_fused_swiglu": True}, {}, "why", may={"N4": "near"},
                 lens_must={"N4": "far"}, lens_may={"N6": "sign flips"})
    assert M.MutantResult(m, "rounding", frozenset(), None, frozenset({"N4", "N6"})).ok
    assert not M.MutantResult(m, "rounding", frozenset({"N4"}), None, frozenset()).ok  # the lens missed N4
    assert not M.MutantResult(m, "rounding", frozenset(), None, None).ok  # declared, not run
    exact = M.Mutant("y", "bug", {}, {"N2": M.EXACT}, "why")
    assert M.MutantResult(exact, "exact", frozenset({"N2"}), None, None).ok
    assert not M.MutantResult(exact, "rounding", frozenset({"N2"}), None, frozenset()).ok  # lens ran, undeclared


def test_mutant_verdicts(tmp_path, capsys):
    # the repository's [lens.*] bounds are tiny's; the toy's mutants are judged by the bf16 gates alone (the lens's
    # verdicts: test_mutant_result_needs_both_lenses, tests/gates/test_lens.py)
    results = {r.mutant.name: r for r in M.run_mutants("toy", api=toy_model.api(), mutants=TOY_MUTANTS,
                                                       cache_dir=str(tmp_path), lens=False)}
    assert results["toy_loss_wrong_count"].ok, results["toy_loss_wrong_count"].failed
    relu = results["toy_relu"]
    assert relu.ok and relu.contract == "exact"
    assert relu.check.implementations["candidate"]["activation"] == "override:relu_instead_of_silu"
    wrong = results["toy_relu_wrong_prediction"]
    assert not wrong.ok and wrong.failed == frozenset(M.ALL_BUT_N1)
    untraced = results["toy_untraced_override"]
    assert not untraced.ok and untraced.failed == frozenset({"override not traced: not_an_op"})
    text = M.table(list(results.values()))
    assert "MISMATCH" in text and "toy_relu " in text
    err = capsys.readouterr().err
    assert err.index("mutant toy_relu: relu instead of silu") < err.index("candidate[toy_loss_wrong_count]")


def test_every_real_mutant_declares_its_gates():
    assert len(M.MUTANTS) >= 8 and len({m.name for m in M.MUTANTS}) == len(M.MUTANTS)
    for m in M.MUTANTS:
        assert (m.must or m.lens_must) and set(m.must) <= set(M.gates_lib.GATES) and m.why
        assert all(m.may.values()) and all(m.lens_may.values())  # every may-gate carries its reason
        assert (m.loss_fn is None) != (m.overrides is M.Mutant.overrides)  # one injection each


def test_override_reaches_the_candidate_only(tmp_path):
    """With nothing cached, the control and the float32 reference are computed inside the mutant's check: the override
    must not be active then (they would carry the bug and the candidate would match them), nor after the check."""
    (res,) = M.run_mutants("toy", api=toy_model.api(), mutants=(TOY_MUTANTS[1],), cache_dir=str(tmp_path),
                           progress=lambda m: None, lens=False)
    impl = res.check.implementations
    assert impl["candidate"]["activation"] == "override:relu_instead_of_silu"
    assert impl["control"]["activation"] == "silu" and impl["reference"]["activation"] == "silu"
    assert res.check.records["control"] == "computed" and res.ok
    assert toy_model._OVERRIDES == {}  # nothing left active for whatever runs next


def test_a_workers_rows_give_the_same_verdicts_and_table(tmp_path):
    """``mutants --jobs N``: each worker returns its mutant's ``to_json`` row; rebuilt in the parent, the verdicts,
    the clearances and the table are the ones the worker's own results give."""
    results = M.run_mutants("toy", api=toy_model.api(), mutants=TOY_MUTANTS, cache_dir=str(tmp_path),
                            progress=lambda m: None, lens=False)
    by_name = {m.name: m for m in TOY_MUTANTS}
    rebuilt = [M._from_json(d, by_name) for d in M.to_json(results)]
    assert [r.ok for r in rebuilt] == [r.ok for r in results] and not all(r.ok for r in rebuilt)
    assert [r.failed for r in rebuilt] == [r.failed for r in results]
    assert M.table(rebuilt) == M.table(results)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_mutants_in_worker_processes_on_smoke(tmp_path):
    """Two real mutants in two worker processes (smoke; a few minutes on 2 cores: --runslow)."""
    res = M.run_mutants_in_workers("smoke", 2, only=["swiglu_without_silu", "fp8_amax_per_shard"],
                                   cache_dir=str(tmp_path), progress=lambda m: None)
    assert [r.mutant.name for r in res] == ["swiglu_without_silu", "fp8_amax_per_shard"] and all(r.ok for r in res)
