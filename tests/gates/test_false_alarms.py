"""gates.false_alarms: benign variants through both lenses on the toy model; a table too tight to pass correct code
turns them into counted failures; a variant that never reaches the trace is refused.

Run: python -m pytest tests/gates/test_false_alarms.py -q
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from nxgates.gates import false_alarms as FA
from nxgates.gates import gates as G
from nxgates.gates import record as record_lib
from nxgates.gates import runner as runner_lib
from nxgates.gates import tolerances as T
from nxgates.gates.errors import BadInput
from nxgates.kernels.gdn import context_parallel
from tests.gates import toy_model
from tests.gates.test_lens import BF16, LENS


def _toy_lens(tmp_path) -> T.Tolerances:
    """The toy's [lens.*] by THE rule (gates.calibrate.derive_lens_tolerances) from its own benign k-tile draws: the
    float32 N6 measures AdamW's first update, ~lr * sign(g), where the elements whose gradient sits at float32 noise
    flip sign under any reassociation, so its floor must be measured, not guessed (test_lens's LENS is not)."""
    from nxgates.gates import calibrate

    res = calibrate.calibrate("toy", toy_model.api(), cache_dir=str(tmp_path / "cal"), lens=True,
                              progress=lambda m: None)
    p = res["proposed"]
    return T.Tolerances(tol={g: p[g]["floor"] for g in p}, slack={g: p[g]["slack"] for g in p}, golden_rel=0.0,
                        reasons={}, sources={}, path="toy lens (derive_lens_tolerances)", section="lens")


def _factory(tmp_path, tolerances=BF16, lens=LENS):
    def make(batch_case):
        return runner_lib.Runner("toy", api=toy_model.api(), cache=record_lib.RecordCache(str(tmp_path)),
                                 tolerances=tolerances, lens_tolerances=lens, progress=lambda m: None,
                                 batch_case=batch_case)
    return make


def test_benign_variants_pass_both_lenses_and_are_counted(tmp_path):
    lens = _toy_lens(tmp_path)
    variants = FA.run_false_alarms("toy", only=("tiles", "seeds"), seeds=2,
                                   runner_factory=_factory(tmp_path, lens=lens))
    kinds = {v.kind for v in variants}
    assert kinds == {"tiles", "seeds"}
    assert all(v.lens_passed is not None for v in variants)  # both lenses ran on every variant
    assert all(v.passed for v in variants), [(v.name, v.failed) for v in variants if not v.passed]
    assert FA.summary(variants).startswith(f"{len(variants)} benign variants tried") and ", 0 failed" in \
        FA.summary(variants)
    # another batch seed is another batch: its own control
    r0, r1 = _factory(tmp_path)("batch"), _factory(tmp_path)("batch/false-alarms-1")
    assert not np.array_equal(r0.batch.tokens, r1.batch.tokens)


def test_a_table_too_tight_for_correct_code_shows_as_false_alarms(tmp_path):
    zero = T.Tolerances(tol={g: 0.0 for g in G.GATES}, slack={g: 0.0 for g in G.GATES}, golden_rel=0.0, reasons={},
                        sources={}, path="zero lens", section="lens")
    variants = FA.run_false_alarms("toy", only=("tiles",), runner_factory=_factory(tmp_path, lens=zero))
    assert variants and not any(v.passed for v in variants)
    assert all(any(f.startswith("lens ") for f in v.failed) for v in variants)
    assert f"{len(variants)} failed" in FA.summary(variants)


def test_a_fold_variant_that_never_reaches_the_trace_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match="never reached the trace"):
        FA.run_false_alarms("toy", only=("folds",), runner_factory=_factory(tmp_path))


def test_bad_choices_are_refused(tmp_path):
    with pytest.raises(BadInput, match="--only"):
        FA.run_false_alarms("toy", only=("nope",), runner_factory=_factory(tmp_path))
    with pytest.raises(BadInput, match="--seeds"):
        FA.run_false_alarms("toy", seeds=0, runner_factory=_factory(tmp_path))


def test_left_to_right_fold_is_the_same_maps_in_another_association():
    k = jax.random.split(jax.random.PRNGKey(3), 2)
    m = jax.random.normal(k[0], (4, 2, 3, 3)) * 0.3
    b = jax.random.normal(k[1], (4, 2, 3, 5))
    tm, tb = context_parallel.fold_tree(m, b)
    sm, sb = FA.fold_left_to_right(m, b)
    np.testing.assert_allclose(sm, tm, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sb, tb, rtol=1e-5, atol=1e-6)
