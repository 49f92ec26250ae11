"""The mutant harness on the toy model: a mutant passes only when it fails exactly its predicted gates, and an
override that never reaches the trace is reported, not counted. (The real mutants run in `nox -s mutants`.)

Run: python -m pytest tests/gates/test_mutants.py -q
"""

from __future__ import annotations

import jax

from nxgates.gates import mutants as M
from tests.gates import toy_model


def relu_override(cfg, flags):
    def relu_instead_of_silu(x):
        return jax.nn.relu(x)

    return [("activation", relu_instead_of_silu)]


TOY_MUTANTS = (
    M.Mutant("toy_loss_wrong_count", "token-mean over every token", {}, frozenset({"N1", "N3", "N4", "N5"}),
             "loss and gradient scale; AdamW is scale invariant", loss_fn=M._loss_wrong_count),
    M.Mutant("toy_relu", "relu instead of silu on the exact flag's path", {"fp8_fake_quant_hoist": "gather8"},
             M.ALL_BUT_N1, "forward changes; exact contract", overrides=relu_override),
    M.Mutant("toy_relu_wrong_prediction", "same bug, prediction deliberately wrong",
             {"fp8_fake_quant_hoist": "gather8"},
             frozenset({"N1"}), "wrong on purpose", overrides=relu_override),
    M.Mutant("toy_untraced_override", "an override of an op the model never calls", {},
             frozenset(), "must be reported as not traced",
             overrides=lambda cfg, flags: [("not_an_op", lambda *a: None)]),
)


def test_mutant_verdicts(tmp_path, capsys):
    results = {r.mutant.name: r for r in M.run_mutants("toy", api=toy_model.api(), mutants=TOY_MUTANTS,
                                                       cache_dir=str(tmp_path))}
    assert results["toy_loss_wrong_count"].ok, results["toy_loss_wrong_count"].failed
    relu = results["toy_relu"]
    assert relu.ok and relu.contract == "exact"
    assert relu.check.implementations["candidate"]["activation"] == "override:relu_instead_of_silu"
    wrong = results["toy_relu_wrong_prediction"]
    assert not wrong.ok and wrong.failed == M.ALL_BUT_N1
    untraced = results["toy_untraced_override"]
    assert not untraced.ok and untraced.failed == frozenset({"override not traced: not_an_op"})
    text = M.table(list(results.values()))
    assert "MISMATCH" in text and "toy_relu " in text
    err = capsys.readouterr().err
    assert err.index("mutant toy_relu: relu instead of silu") < err.index("candidate[toy_loss_wrong_count]")


def test_every_real_mutant_declares_its_gates():
    assert len(M.MUTANTS) >= 8 and len({m.name for m in M.MUTANTS}) == len(M.MUTANTS)
    for m in M.MUTANTS:
        assert m.expect_fail and m.expect_fail <= set(M.gates_lib.GATES) and m.why
        assert (m.loss_fn is None) != (m.overrides is M.Mutant.overrides)  # one injection each


def test_override_reaches_the_candidate_only(tmp_path):
    """With nothing cached, the control and the float32 reference are computed inside the mutant's check: the override
    must not be active then (they would carry the bug and the candidate would match them), nor after the check."""
    (res,) = M.run_mutants("toy", api=toy_model.api(), mutants=(TOY_MUTANTS[1],), cache_dir=str(tmp_path),
                           progress=lambda m: None)
    impl = res.check.implementations
    assert impl["candidate"]["activation"] == "override:relu_instead_of_silu"
    assert impl["control"]["activation"] == "silu" and impl["reference"]["activation"] == "silu"
    assert res.check.records["control"] == "computed" and res.ok
    assert toy_model._OVERRIDES == {}  # nothing left active for whatever runs next
