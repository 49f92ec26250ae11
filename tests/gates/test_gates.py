"""The six gates on synthetic run records: each metric, each verdict, and a deliberately wrong input each gate catches.

Run: python -m pytest tests/gates/test_gates.py -q
"""

from __future__ import annotations

import copy
import dataclasses
import math
import pathlib

import numpy as np
import pytest

from nxgates.gates import gates as G
from nxgates.gates import tolerances as T
from tests.gates.toy_model import synthetic_record

TOLS = T.Tolerances(tol={"N1": 0.0, "N2": 1e-3, "N3": 2e-3, "N4": 1e-2, "N5": 2e-2, "N6": 5e-2},
                    slack={g: 0.25 for g in G.GATES},
                    golden_rel=0.0, reasons={}, sources={}, path="test")


def noisy(rec, scale, seed, *, loss=False):
    """A copy of ``rec`` with relative noise ``scale`` on logp, grads and the parameter updates (all steps)."""
    rng = np.random.default_rng(seed)
    out = copy.deepcopy(rec)
    for s in out.steps:
        s.logp = (s.logp * (1 + scale * rng.standard_normal(s.logp.shape))).astype(np.float32)
        for n in s.grads:
            s.grads[n] = (s.grads[n] * (1 + scale * rng.standard_normal(s.grads[n].shape))).astype(np.float32)
            delta = s.params[n].astype(np.float64) - rec.params0[n]
            s.params[n] = (rec.params0[n] + delta * (1 + scale * rng.standard_normal(delta.shape))).astype(np.float32)
        s.grad_norm = np.asarray(math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in s.grads.values())),
                                 np.float32)
        if loss:
            s.loss = np.asarray(s.loss * (1 + scale), np.float32)
    return out


@pytest.fixture(scope="module")
def trio():
    control = synthetic_record(0)
    reference = noisy(control, 1e-3, seed=1)
    return control, reference


def failed_gates(results):
    return {r.gate for r in results if not r.passed}


# --------------------------------------------------------------------------------------------------------- metrics
def test_metrics_match_their_definitions(trio):
    control, _ = trio
    cand = copy.deepcopy(control)
    s = cand.steps[1]
    s.loss = np.asarray(float(control.steps[1].loss) * 1.1, np.float32)
    s.logp = s.logp.copy()
    s.logp[0, 3] += 0.5  # inside the mask (cols 2..5)
    s.grads["head"] = s.grads["head"] * np.float32(2.0)
    ctrl = control.steps[1]
    assert G.metric("N1", cand, control, 1).value == pytest.approx(
        abs(float(s.loss) - float(ctrl.loss)) / abs(float(ctrl.loss)), rel=1e-12)
    m = control.mask > 0
    diff = (s.logp - ctrl.logp)[m].astype(np.float64)
    expect_n2 = np.linalg.norm(diff) / np.linalg.norm(ctrl.logp[m].astype(np.float64))
    assert G.metric("N2", cand, control, 1).value == pytest.approx(expect_n2, rel=1e-12)
    flat = lambda st: np.concatenate([st.grads[n].astype(np.float64).ravel() for n in sorted(st.grads)])  # noqa: E731
    a, b = flat(s), flat(ctrl)
    assert G.metric("N3", cand, control, 1).value == pytest.approx(
        abs(np.linalg.norm(a) - np.linalg.norm(b)) / np.linalg.norm(b), rel=1e-12)
    assert G.metric("N4", cand, control, 1).value == pytest.approx(np.linalg.norm(a - b) / np.linalg.norm(b), rel=1e-12)
    n5 = G.metric("N5", cand, control, 1)
    assert n5.value == pytest.approx(1.0, rel=1e-12) and n5.worst_tensor == "head"  # 2g vs g: rel L2 exactly 1
    assert G.metric("N6", cand, control, 1).value == 0.0  # params untouched


@pytest.mark.parametrize("min_size", [1, 4, 1024])
def test_metrics_of_one_pass_equal_each_gates_metric_to_the_bit(trio, min_size):
    """``metrics`` (what ``evaluate`` and ``calibrate`` read: N3-N5 from one pass over the gradients) hands each gate
    ``metric``'s value, name and note, at every min_size. (Both share the per-tensor sums; that those sums give the
    gates' definitions is test_metrics_match_their_definitions, and that evaluate's verdicts did not move was checked
    against the previous code on tiny's records, docs/speed.md.)"""
    control, reference = trio
    cand = noisy(control, 3e-3, seed=11)
    for s in cand.steps:
        s.grads["norm/scale"] = s.grads["norm/scale"] * np.float32(1.5)
    for a, b in ((cand, control), (cand, reference), (control, reference)):
        for step in range(control.num_steps):
            together = G.metrics(a, b, step, min_size=min_size)
            assert list(together) == list(G.GATES)
            for gate in G.GATES:
                alone = G.metric(gate, a, b, step, min_size=min_size)
                assert together[gate] == alone, (gate, step)


def test_n2_ignores_tokens_outside_the_completion_mask(trio):
    control, _ = trio
    cand = copy.deepcopy(control)
    cand.steps[0].logp = cand.steps[0].logp.copy()
    cand.steps[0].logp[:, 0] += 5.0  # the prompt: mask 0
    assert G.metric("N2", cand, control, 0).value == 0.0
    cand.steps[0].logp[:, 2] += 5.0  # a completion token
    assert G.metric("N2", cand, control, 0).value > 0.1


def test_n6_measures_the_change_since_step_0(trio):
    control, _ = trio
    cand = copy.deepcopy(control)
    n = "mlp/w_in"
    delta = control.steps[2].params[n].astype(np.float64) - control.params0[n]
    cand.steps[2].params[n] = (control.params0[n] + 1.5 * delta).astype(np.float32)
    d_all = np.concatenate([(control.steps[2].params[k].astype(np.float64) - control.params0[k]).ravel()
                            for k in sorted(control.params0)])
    expect = np.linalg.norm(0.5 * delta) / np.linalg.norm(d_all)
    assert G.metric("N6", cand, control, 2).value == pytest.approx(expect, rel=1e-5)


# ----------------------------------------------------------------------------------------------------------- gates
def test_identical_candidate_passes_exact_and_rounding(trio):
    control, reference = trio
    for contract in ("exact", "rounding"):
        results, problems = G.evaluate(copy.deepcopy(control), control, reference, contract, TOLS)
        assert not problems and len(results) == 18 and all(r.passed for r in results)


def test_rounding_noise_within_tolerance_passes(trio):
    control, reference = trio
    cand = noisy(control, 1e-4, seed=7)
    results, problems = G.evaluate(cand, control, reference, "rounding", TOLS)
    assert not problems and failed_gates(results) == set()
    # ... but the same noise breaks an exact contract: every gate that reads a changed array fails.
    results, _ = G.evaluate(cand, control, reference, "exact", TOLS)
    assert failed_gates(results) == {"N2", "N3", "N4", "N5", "N6"}
    assert all(r.note == "not bit-identical" for r in results if not r.passed)


def test_perturbed_gradient_fails_n4_n5_not_n1(trio):
    control, reference = trio
    cand = copy.deepcopy(control)
    for s in cand.steps:
        s.grads["mlp/w_out"] = s.grads["mlp/w_out"] * np.float32(1.2)  # one tensor's gradient 20% too large
    results, _ = G.evaluate(cand, control, reference, "rounding", TOLS)
    failed = failed_gates(results)
    assert {"N4", "N5"} <= failed and "N1" not in failed and "N2" not in failed and "N6" not in failed
    assert {r.worst_tensor for r in results if r.gate == "N5"} == {"mlp/w_out"}


def test_one_tensor_wrong_is_caught_by_n5_alone(trio):
    control, reference = trio
    cand = copy.deepcopy(control)
    for s in cand.steps:  # 3% on the smallest tensor: below N4's 1e-2 over the whole gradient, above N5's 2e-2
        s.grads["norm/scale"] = s.grads["norm/scale"] * np.float32(1.03)
    results, _ = G.evaluate(cand, control, reference, "rounding", TOLS)
    assert failed_gates(results) == {"N5"}


def test_n5_min_size_leaves_small_tensors_to_the_other_gates(trio):
    """A 3-element tensor 50% off: N5 names it with every tensor read; with min_size 4 it is out of N5 (the worst of
    the larger tensors is named instead), and N4 and N3 still fail on it. A large tensor's error still fails N5."""
    control, reference = trio
    cand = copy.deepcopy(control)
    for s in cand.steps:
        s.grads["norm/scale"] = s.grads["norm/scale"] * np.float32(1.5)
        s.grad_norm = np.asarray(math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in s.grads.values())),
                                 np.float32)
    every = G.metric("N5", cand, control, 1)
    assert every.worst_tensor == "norm/scale" and every.value == pytest.approx(0.5, rel=1e-6)
    large = G.metric("N5", cand, control, 1, min_size=4)
    assert large.worst_tensor != "norm/scale" and large.value == 0.0  # the other tensors are the control's own
    assert not large.note and not every.note
    # a min_size above every tensor never makes N5 vacuous: it reads every tensor, and says so
    above = G.metric("N5", cand, control, 1, min_size=1024)
    assert above.worst_tensor == "norm/scale" and above.value == every.value
    assert "no tensor has >= 1024 elements" in above.note and "largest has 24" in above.note
    results, _ = G.evaluate(cand, control, reference, "rounding", dataclasses.replace(TOLS, min_size={"N5": 1024}))
    assert all("N5 read every tensor" in r.note for r in results if r.gate == "N5")
    assert not any(r.note for r in results if r.gate != "N5")
    sized = dataclasses.replace(TOLS, min_size={"N5": 4})
    results, _ = G.evaluate(cand, control, reference, "rounding", sized)
    assert {"N3", "N4"} <= failed_gates(results) and "N5" not in failed_gates(results)
    results, _ = G.evaluate(cand, control, reference, "rounding", TOLS)
    assert "N5" in failed_gates(results)
    for s in cand.steps:  # a 20-element tensor 5% off: above min_size, so N5 still fails it
        s.grads["mlp/w_out"] = s.grads["mlp/w_out"] * np.float32(1.05)
    results, _ = G.evaluate(cand, control, reference, "rounding", sized)
    assert "N5" in failed_gates(results)
    assert {r.worst_tensor for r in results if r.gate == "N5"} == {"mlp/w_out"}


def test_n5_min_size_is_read_for_n5_only_and_must_be_a_count(tmp_path: pathlib.Path):
    good = T.DEFAULT_TOLERANCES.read_text()
    assert T.load_tolerances().min_size["N5"] > 1  # the repository table leaves tiny's 4-element vectors to N4
    p = tmp_path / "t.toml"
    for bad, match in (("0", r"\[gates.N5\] min_size=0 must be an integer >= 1"),
                       ("2.5", r"\[gates.N5\] min_size=2.5 must be an integer >= 1"),
                       ("true", r"\[gates.N5\] min_size=True must be an integer >= 1")):
        p.write_text(good.replace("[gates.N5]\nfloor = 0.0\nmin_size = 1024",
                                  f"[gates.N5]\nfloor = 0.0\nmin_size = {bad}"))
        with pytest.raises(ValueError, match=match):
            T.load_tolerances(p)
    p.write_text(good.replace("[gates.N4]\nfloor = 0.0\n", "[gates.N4]\nfloor = 0.0\nmin_size = 8\n"))
    with pytest.raises(ValueError, match=r"\[gates.N4\] min_size is read for N5 only"):
        T.load_tolerances(p)


def test_each_gate_catches_its_own_wrong_input(trio):
    control, reference = trio
    cases = {
        "N1": lambda s: setattr(s, "loss", np.asarray(float(s.loss) * 1.001, np.float32)),
        "N2": lambda s: setattr(s, "logp", (s.logp * np.float32(1.01)).astype(np.float32)),
        "N6": lambda s: s.params.update({n: (p + np.float32(0.01)).astype(np.float32) for n, p in s.params.items()}),
    }
    for gate, fn in cases.items():
        cand = copy.deepcopy(control)
        for s in cand.steps:
            fn(s)
        results, _ = G.evaluate(cand, control, reference, "rounding", TOLS)
        assert failed_gates(results) == {gate}, (gate, failed_gates(results))


def test_n3_scaled_gradient_fails_n3_only(trio):
    control, reference = trio
    cand = copy.deepcopy(control)
    for s in cand.steps:
        s.grads = {n: (g * np.float32(1.005)).astype(np.float32) for n, g in s.grads.items()}
    results, _ = G.evaluate(cand, control, reference, "rounding", TOLS)
    assert failed_gates(results) == {"N3"}


def test_reference_pair_catches_a_candidate_farther_from_the_truth(trio):
    control, _ = trio
    reference = noisy(control, 2e-2, seed=1)  # m(control, reference) = 2e-2 on N4
    # The candidate is within N4's rounding bound of the control, but moves away from the reference by more than
    # (1 + slack) times the control's distance: fail against the reference only.
    cand = copy.deepcopy(control)
    for s, rs in zip(cand.steps, reference.steps, strict=True):
        s.grads = {n: (g + 0.4 * (g - rs.grads[n])).astype(np.float32) for n, g in s.grads.items()}
    results, _ = G.evaluate(cand, control, reference, "rounding", TOLS)
    n4 = [r for r in results if r.gate == "N4"]
    assert all(r.passed_control and not r.passed_reference for r in n4)
    assert all(r.bound_reference == pytest.approx(1.25 * r.control_vs_reference) for r in n4)
    # The same candidate moved TOWARD the reference passes both.
    closer = copy.deepcopy(control)
    for s, rs in zip(closer.steps, reference.steps, strict=True):
        s.grads = {n: (g + 0.3 * (rs.grads[n] - g)).astype(np.float32) for n, g in s.grads.items()}
    results, _ = G.evaluate(closer, control, reference, "rounding", TOLS)
    assert all(r.passed for r in results if r.gate == "N4")


@pytest.mark.parametrize("where", ["candidate", "control", "reference"])
def test_non_finite_anywhere_fails_every_gate(trio, where):
    control, reference = trio
    recs = {"candidate": copy.deepcopy(control), "control": copy.deepcopy(control),
            "reference": copy.deepcopy(reference)}
    g = recs[where].steps[2].grads["head"].copy()
    g[0, 0] = np.nan
    recs[where].steps[2].grads["head"] = g
    results, problems = G.evaluate(recs["candidate"], recs["control"], recs["reference"], "rounding", TOLS)
    assert problems and f"{where} step 3: non-finite grads/head" in problems[0]
    assert not any(r.passed for r in results)


def test_dropped_token_fails_every_gate(trio):
    control, reference = trio
    cand = copy.deepcopy(control)
    cand.steps[0].dropped_tokens = 3
    results, problems = G.evaluate(cand, control, reference, "exact", TOLS)
    assert problems == ["candidate step 1: 3 dropped tokens"]
    assert not any(r.passed for r in results)


def test_records_that_do_not_line_up_are_refused(trio):
    control, reference = trio
    other = synthetic_record(5)  # other initial parameters
    _, problems = G.evaluate(other, control, reference, "rounding", TOLS)
    assert any("different initial parameters" in p for p in problems)
    with pytest.raises(ValueError, match="contract='fuzzy'"):
        G.evaluate(control, control, reference, "fuzzy", TOLS)


# ------------------------------------------------------------------------------------------------------ tolerances
def test_repository_table_loads_with_reason_and_source():
    t = T.load_tolerances()
    assert t.tol["N3"] == 2e-3
    assert set(t.tol) == set(G.GATES)
    assert all(t.reasons[k] and t.sources[k] for k in (*G.GATES, "golden"))
    assert set(t.slack) == set(G.GATES) and all(0 < t.slack[g] < 1 for g in G.GATES)


def test_slack_is_per_gate_and_read_from_the_table(tmp_path: pathlib.Path, trio):
    """Each gate's reference bound uses that gate's own slack: a table with N4's slack changed moves N4's bound only."""
    good = T.DEFAULT_TOLERANCES.read_text()
    base = T.load_tolerances()
    head, rest = good.split("[gates.N4]", 1)
    n4, tail = rest.split("[gates.N5]", 1)
    n4 = "\n".join("slack = 0.73" if line.startswith("slack =") else line for line in n4.split("\n"))
    p = tmp_path / "t.toml"
    p.write_text(head + "[gates.N4]" + n4 + "[gates.N5]" + tail)
    t = T.load_tolerances(p)
    assert t.slack["N4"] == 0.73 and base.slack["N4"] != 0.73
    assert all(t.slack[g] == base.slack[g] for g in G.GATES if g != "N4")
    control, reference = trio
    cand = noisy(control, 1e-3, seed=7)
    tol_big = T.Tolerances(tol={g: 0.0 for g in G.GATES}, slack=dict(t.slack), golden_rel=0.0, reasons={},
                           sources={}, path="t")
    results, _ = G.evaluate(cand, control, reference, "rounding", tol_big)
    for r in results:
        assert r.bound_reference == pytest.approx((1 + t.slack[r.gate]) * r.control_vs_reference)


def test_per_step_floor_bounds_each_step_by_its_own_value(tmp_path: pathlib.Path, trio):
    """``floor = [a, b, c]``: step i's bounds are at least the i-th value (above the live distance, the floor
    decides); a run longer than the list, an empty list or a negative entry is refused by name."""
    control, reference = trio
    cand = noisy(control, 1e-2, seed=11)  # 10 x the control's distance to the reference
    per_step = (1.0, 0.0, 1.0)  # step 2: the live bound alone, which this candidate exceeds; the others anything
    t = T.Tolerances(tol={g: per_step for g in G.GATES}, slack={g: 0.0 for g in G.GATES}, golden_rel=0.0,
                     reasons={}, sources={}, path="t")
    results, _ = G.evaluate(cand, control, reference, "rounding", t)
    assert {r.step for r in results if not r.passed_control} == {2}
    assert all(r.bound_control == max(per_step[r.step - 1], r.control_vs_reference) for r in results)
    with pytest.raises(ValueError, match=r"\[gates.N2\] floor has 3 per-step values, no value for step 4"):
        t.tol_at("N2", 4)
    good = T.DEFAULT_TOLERANCES.read_text()
    head, rest = good.split("[gates.N4]", 1)
    n4, tail = rest.split("[gates.N5]", 1)
    for bad, msg in (("floor = []", r"floor=\[\] needs one number per step"),
                     ("floor = [0.1, -1.0]", r"floor\[1\]=-1.0"),
                     ("floor = 0.0\nrel = 0.0", "both floor and rel"),
                     ("floor = 0.0\nlive_range = [2.0, 1.0]", "needs lo <= hi")):
        body = "\n".join(bad if line.startswith("floor =") else line for line in n4.split("\n")
                         if not line.startswith("live_range ="))
        p = tmp_path / "t.toml"
        p.write_text(head + "[gates.N4]" + body + "[gates.N5]" + tail)
        with pytest.raises(ValueError, match=msg):
            T.load_tolerances(p)


def test_bounds_travel_with_the_live_control_distance(trio):
    """Both bounds of a rounding gate follow the run's own m(control, reference): the same candidate-to-control
    distance passes next to a reference far from the control and fails next to a close one (a deliberately wrong
    candidate, 3 x the control's distance, fails every array gate)."""
    control, _ = trio
    zero = T.Tolerances(tol={g: 0.0 for g in G.GATES}, slack={g: 0.05 for g in G.GATES}, golden_rel=0.0,
                        reasons={}, sources={}, path="t")
    cand = noisy(control, 2e-4, seed=21)
    far_ref, near_ref = noisy(control, 5e-3, seed=22), noisy(control, 5e-5, seed=23)
    far, _ = G.evaluate(cand, control, far_ref, "rounding", zero)
    near, _ = G.evaluate(cand, control, near_ref, "rounding", zero)
    for r in far + near:
        assert r.bound_control == r.control_vs_reference
        assert r.bound_reference == pytest.approx(1.05 * r.control_vs_reference)
    arrays = {"N4", "N6"}  # whole-run arrays (the synthetic log-probs are too few for a stable N2)
    assert not failed_gates(far) & arrays
    assert arrays <= failed_gates(near)
    wrong = noisy(control, 3e-3, seed=24)
    ref = noisy(control, 1e-3, seed=25)
    results, _ = G.evaluate(wrong, control, ref, "rounding", zero)
    assert arrays <= {r.gate for r in results if not r.passed_control and not r.passed_reference}


def test_a_live_distance_outside_its_range_is_reported_not_failed(trio):
    """``live_range``: a control-to-reference distance outside the calibrated range is an environment change, with the
    numbers, and changes no verdict."""
    control, reference = trio
    cand = noisy(control, 1e-4, seed=31)
    base = dict(tol={g: 0.0 for g in G.GATES}, slack={g: 0.05 for g in G.GATES}, golden_rel=0.0, reasons={},
                sources={}, path="t")
    plain, _ = G.evaluate(cand, control, reference, "rounding", T.Tolerances(**base))
    ranged, _ = G.evaluate(cand, control, reference, "rounding",
                           T.Tolerances(**base, live_range={"N4": (1.0, 2.0), "N2": (0.0, 1.0)}))
    assert [r.passed for r in plain] == [r.passed for r in ranged]
    n4 = [r for r in ranged if r.gate == "N4"]
    assert all("outside the calibrated range [1.0000e+00, 2.0000e+00]" in r.environment for r in n4)
    assert all(f"{r.control_vs_reference:.4e}" in r.environment for r in n4)
    assert not any(r.environment for r in ranged if r.gate != "N4")


def test_repository_table_has_live_ranges_and_floors():
    t = T.load_tolerances()
    assert t.tol["N3"] == 2e-3 and t.tol["N4"] == 0.0
    for g in ("N2", "N3", "N4", "N5", "N6"):
        for step in (1, 2, 3):
            lo, hi = t.live_range_at(g, step)
            assert 0 < lo < hi


def test_missing_or_global_slack_is_refused(tmp_path: pathlib.Path):
    good = T.DEFAULT_TOLERANCES.read_text()
    p = tmp_path / "t.toml"
    head, rest = good.split("[gates.N5]", 1)
    n5, tail = rest.split("[gates.N6]", 1)
    p.write_text(head + "[gates.N5]" + n5.replace("\nslack =", "\nslackx =", 1) + "[gates.N6]" + tail)
    with pytest.raises(ValueError, match=r"\[gates.N5\] needs 'slack'"):
        T.load_tolerances(p)
    p.write_text(head + "[gates.N5]" + n5.replace("\nslack =", "\nslack = -0.1 #", 1) + "[gates.N6]" + tail)
    with pytest.raises(ValueError, match=r"\[gates.N5\] slack=-0.1 must be a finite number >= 0"):
        T.load_tolerances(p)
    p.write_text(good + '\n[gates.slack]\nslack = 0.6\nreason = "x"\nsource = "y"\n')
    with pytest.raises(ValueError, match=r"\[gates.slack\] .* is not read: the slack is per gate"):
        T.load_tolerances(p)


def test_table_entries_missing_fields_are_refused(tmp_path: pathlib.Path):
    good = T.DEFAULT_TOLERANCES.read_text()
    p = tmp_path / "t.toml"
    p.write_text(good.replace('[gates.N4]\nfloor = ', '[gates.N4]\nfloorx = '))
    with pytest.raises(ValueError, match=r"\[gates.N4\] needs 'floor'"):
        T.load_tolerances(p)
    p.write_text(good.replace("[gates.N2]", "[gates.N2x]"))
    with pytest.raises(ValueError, match=r"\[gates.N2\] missing"):
        T.load_tolerances(p)
    with pytest.raises(ValueError, match="path='/nonexistent.toml'"):
        T.load_tolerances("/nonexistent.toml")
