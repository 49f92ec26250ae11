"""``nxgates compare`` on records (gates/compare.py): a benign candidate passes; each gate fails on a deliberately
wrong candidate; n/a is never a pass; the exact contract is decided by fingerprints; bad records exit 2, named."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from nxgates.gates import compare, gates, recorder, records, tolerances

W = 1024
STEPS = 3
SHAPES = {"w": (64, 96), "v": (32, 64), "b": (8,)}  # w, v sketched (numel >= W); b kept exactly


def _base(seed=0):
    rng = np.random.default_rng(seed)
    grads = [{k: rng.standard_normal(s) * (0.1 if k == "b" else 1.0) for k, s in SHAPES.items()} for _ in range(STEPS)]
    p0 = {k: 0.02 * rng.standard_normal(s) for k, s in SHAPES.items()}
    logp = -np.abs(rng.standard_normal((2, 16)))
    mask = (rng.random((2, 16)) > 0.3).astype(np.float32)
    return grads, p0, logp, mask


def _noise(tree, rel, seed):
    rng = np.random.default_rng(seed)
    return {k: v * (1 + rel * rng.standard_normal(np.shape(v))) for k, v in tree.items()}


def write_run(path, *, noise=0.0, seed=1, extra=0.0, bug=None, full=False, drop=(), width=W, sk_seed=0, config=None,
              steps=STEPS, mask_flip=False, base=None):
    """A three-step run: the float64 'truth' perturbed by relative noise (rounding), optionally with a bug. ``base``:
    another truth (``_base()``'s tuple) to perturb."""
    grads, p0, logp, mask = base or _base()
    if mask_flip:
        mask = mask.copy()
        mask[0, 0] = 1 - mask[0, 0]
    rec = recorder.Recorder(path, sketch_width=width, seed=sk_seed, full_tensors=full,
                            meta={"trainer": "test", "config": config or {"d": 1}, "batch": {"seed": 5}})
    f32 = lambda t: {k: np.asarray(v, np.float32) for k, v in t.items()}  # noqa: E731
    params = f32(p0)
    rec.start(params=params)
    for i in range(steps):
        g = _noise(_noise(grads[i], noise, seed * 100 + i), extra, 77 + i)  # extra: a benign candidate's own rounding
        if bug == "N4":  # every tensor's gradient off by 5%
            g = _noise(g, 0.05, 999 + i)
        if bug == "N5":  # one small tensor wrong: invisible in the whole gradient
            g["b"] = g["b"] * 1.5
        if bug == "N3":
            g = {k: v * 1.01 for k, v in g.items()}
        upd = {k: -1e-3 * np.sign(v) for k, v in g.items()}
        if bug == "N6":
            upd = {k: v * (1 + (np.arange(v.size).reshape(v.shape) % 3 == 0)) for k, v in upd.items()}
        new = f32({k: params[k] + upd[k] for k in params})
        loss = np.float32(0.75 + (1e-3 if bug == "N1" else 0.0) + noise * 1e-3)
        lp = logp * (1 + noise * np.random.default_rng(seed * 7 + i).standard_normal(logp.shape)
                     + extra * np.random.default_rng(78 + i).standard_normal(logp.shape))
        if bug == "N2":
            lp = lp + 0.05
        gnorm = np.float32(np.sqrt(sum(np.sum(np.asarray(v, np.float32).astype(np.float64) ** 2) for v in g.values())))
        kw = dict(loss=loss, grad_norm=gnorm, log_probs=np.float32(lp), mask=mask, grads=f32(g), params=new,
                  prev_params=params)
        for k in drop:
            kw.pop(k)
        if "log_probs" in drop:
            kw.pop("mask")
        rec.step(**kw)
        params = new
    rec.close()
    return records.load_run(path)


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    d = tmp_path_factory.mktemp("trio")
    return {"dir": d, "reference": write_run(d / "ref", noise=0.0), "control": write_run(d / "ctrl", noise=1e-2),
            "benign": write_run(d / "benign", noise=1e-2, seed=1, extra=1e-3)}


def _n3_floor(d):
    """As the repository's table: N3 has a fixed floor (a gradient norm's rounding is not a distance that scales with
    the control's), every other gate's bound is the live control-to-reference distance."""
    return _table(d, {g: (5e-4 if g == "N3" else 0.0) for g in gates.GATES})


def test_benign_candidate_passes_every_gate_with_live_bounds(trio):
    rep = compare.compare(trio["control"], trio["benign"], trio["reference"], tolerances=_n3_floor(trio["dir"]))
    assert rep.judged == list(gates.GATES), rep.not_judged
    assert rep.exit_code == 0, rep.table()
    n4 = [r for r in rep.results if r.gate == "N4"]
    assert all(r.source == "sketch" and r.bound_reference > 0 for r in n4)
    assert [r.source for r in rep.results if r.gate == "N6"][0] == "sketch (updates)"


@pytest.mark.parametrize("gate", gates.GATES)
def test_each_gate_fails_on_a_deliberately_wrong_candidate(trio, gate):
    bad = write_run(trio["dir"] / f"bug_{gate}", noise=1e-2, seed=1, bug=gate)
    rep = compare.compare(trio["control"], bad, trio["reference"], tolerances=_n3_floor(trio["dir"]))
    failed = {r.gate for r in rep.failed}
    assert gate in failed, rep.table()
    assert rep.exit_code == 1


def test_sketch_metrics_estimate_the_exact_ones_with_the_same_verdicts(trio):
    d = trio["dir"]
    full = {k: write_run(d / f"full_{k}", noise=n, seed=s, full=True, bug=b)
            for k, n, s, b in (("ref", 0, 1, None), ("ctrl", 1e-2, 1, None), ("cand", 1e-2, 1, "N4"))}
    rep_exact = compare.compare(full["ctrl"], full["cand"], full["ref"])
    for run in full.values():  # the same runs without their full tensors
        for st in run.steps.values():
            st.arrays = {k: v for k, v in st.arrays.items() if not k.startswith(("grad/", "param/"))}
    rep_sketch = compare.compare(full["ctrl"], full["cand"], full["ref"])
    for e, s in zip(rep_exact.results, rep_sketch.results, strict=True):
        assert e.verdict == s.verdict, (e, s)
        if e.gate in ("N4", "N5", "N6"):
            assert e.source == "exact" and s.source.startswith("sketch")
            assert s.vs_control == pytest.approx(e.vs_control, rel=0.1), e.gate


def test_na_is_never_a_pass(trio):
    d = trio["dir"]
    no_lp = write_run(d / "no_lp", noise=1e-2, seed=1, drop=("log_probs",))
    rep = compare.compare(trio["control"], no_lp, trio["reference"])
    assert "N2" not in rep.judged and rep.exit_code == 0
    assert "no log_probs in candidate" in rep.not_judged["N2"]
    assert all(r.verdict == "n/a" for r in rep.results if r.gate == "N2")
    # the required gates: a record without a loss is refused (exit 2), however well the rest matches
    no_loss = write_run(d / "no_loss", noise=1e-2, seed=1, drop=("loss",))
    rep = compare.compare(trio["control"], no_loss, trio["reference"])
    assert rep.exit_code == 2 and "N1" not in rep.judged
    assert any("N1, " in line or "N1 must" in line or line.startswith("refused") for line in rep.summary())
    # no reference and no table: nothing bounds the rounding contract
    rep = compare.compare(trio["control"], trio["benign"])
    assert rep.judged == [] and rep.exit_code == 2
    # with a table and no reference: judged against the control only
    rep = compare.compare(trio["control"], trio["benign"], tolerances=_table(d, 5e-2))
    assert rep.judged == list(gates.GATES) and rep.exit_code == 0
    assert all(r.vs_reference is None for r in rep.results)
    rep = compare.compare(trio["control"], trio["benign"], tolerances=_table(d, 1e-4))
    assert rep.exit_code == 1


def _table(d, rel):
    """A tolerance table: ``rel`` one number for every gate, or {gate: rel}; slack 0.05 everywhere."""
    rels = rel if isinstance(rel, dict) else dict.fromkeys(gates.GATES, rel)
    text = "".join(f'[gates.{g}]\nrel = {rels[g]}\nslack = 0.05\nreason = "t"\nsource = "t"\n' for g in gates.GATES)
    p = d / f"tol_{abs(hash(tuple(rels.items())))}.toml"
    p.write_text(text + '[gates.golden]\nrel = 0.0\nreason = "t"\nsource = "t"\n')
    return tolerances.load_tolerances(p)


def test_n5_reads_the_tensors_of_at_least_min_size_elements(trio):
    """The 8-element ``b`` 50% off fails N5 with every tensor read; with ``[gates.N5] min_size = 16`` (sizes from the
    record's tensor list) N5 reads only ``w`` and ``v`` and passes, and a 5% error of ``v`` still fails it."""
    d = trio["dir"]
    small = write_run(d / "bug_small", noise=1e-2, seed=1, bug="N5")
    assert compare.tensor_sizes(small, small.steps[1]) == {"w": 64 * 96, "v": 32 * 64, "b": 8}
    every = _n3_floor(d)
    sized_path = d / "tol_min_size.toml"
    sized_path.write_text(pathlib.Path(every.path).read_text().replace("[gates.N5]\nrel = 0.0\n",
                                                                       "[gates.N5]\nrel = 0.0\nmin_size = 16\n"))
    sized = tolerances.load_tolerances(sized_path)
    assert sized.min_size == {"N5": 16}
    n5 = lambda rep: [r for r in rep.results if r.gate == "N5"]  # noqa: E731
    rep = compare.compare(trio["control"], small, trio["reference"], tolerances=every)
    assert {r.worst_tensor for r in n5(rep)} == {"b"} and any(r.verdict == compare.FAIL for r in n5(rep))
    rep = compare.compare(trio["control"], small, trio["reference"], tolerances=sized)
    assert "b" not in {r.worst_tensor for r in n5(rep)} and all(r.verdict == compare.PASS for r in n5(rep)), rep.table()
    grads, p0, logp, mask = _base()
    for i in range(STEPS):  # the same run with v 5% off as well
        grads[i]["v"] = grads[i]["v"] * 1.05
    big = write_run(d / "bug_big", noise=1e-2, seed=1, bug="N5", base=(grads, p0, logp, mask))
    rep = compare.compare(trio["control"], big, trio["reference"], tolerances=sized)
    assert {r.worst_tensor for r in n5(rep)} == {"v"} and all(r.verdict == compare.FAIL for r in n5(rep))


def test_exact_contract_is_decided_by_fingerprints(trio):
    d = trio["dir"]
    same = write_run(d / "same", noise=1e-2)  # the control's exact twin
    rep = compare.compare(trio["control"], same, trio["reference"], contract="exact")
    assert rep.exit_code == 0 and all(r.bit_identical for r in rep.results)
    # one bit of one sketched gradient changed: the sketch metric cannot see it, the fingerprint does
    twin = records.load_run(d / "same")
    g = twin.steps[2].arrays["grad_fp/w"].copy()
    g[0] ^= 1
    twin.steps[2].arrays["grad_fp/w"] = g
    rep = compare.compare(trio["control"], twin, trio["reference"], contract="exact")
    failed = {(r.gate, r.step) for r in rep.failed}
    assert failed == {("N3", 2), ("N4", 2), ("N5", 2)}, rep.table()
    assert all("not bit-identical" in r.reason for r in rep.failed)
    # without fingerprints the exact contract is n/a, never passed on sketches
    for st in twin.steps.values():
        st.arrays = {k: v for k, v in st.arrays.items() if "_fp/" not in k}
    rep = compare.compare(trio["control"], twin, trio["reference"], contract="exact")
    assert "N4" not in rep.judged and "cannot be decided from sketches" in rep.not_judged["N4"]


def _cli(*args):
    from nxgates.gates import cli

    return cli.main(["compare", *map(str, args)])


def test_bad_records_exit_2_with_named_messages(trio, capsys):
    d, ctrl, ref = trio["dir"], trio["dir"] / "ctrl", trio["dir"] / "ref"
    cases = {
        "missing": (d / "nothing", "missing record"),
        "steps": (write_run(d / "two_steps", noise=1e-2, steps=2).path, "different step list"),
        "width": (write_run(d / "w512", noise=1e-2, width=512).path, "different sketch width 512 vs 1024"),
        "seed": (write_run(d / "seed9", noise=1e-2, sk_seed=9).path, "different sketch seed 9 vs 0"),
        "config": (write_run(d / "cfg", noise=1e-2, config={"d": 2}).path, "different config (d=2 vs 1)"),
        "mask": (write_run(d / "mask", noise=1e-2, mask_flip=True).path, "different mask at step 1"),
    }
    corrupt = d / "corrupt"
    write_run(corrupt, noise=1e-2)
    p = corrupt / "steps" / "000002.npz"
    p.write_bytes(p.read_bytes()[:-10] + b"0123456789")
    cases["corrupt"] = (corrupt, "000002.npz: corrupt arrays of step 2: checksum mismatch")
    version = d / "v99"
    write_run(version, noise=1e-2)
    m = json.loads((version / "meta.json").read_text())
    m["format_version"] = 99
    (version / "meta.json").write_text(json.dumps(m))
    cases["version"] = (version, "format_version=99 is not one this version of nxgates reads")
    for name, (path, message) in cases.items():
        code = _cli(ctrl, path, "--reference", ref)
        err = capsys.readouterr().err
        assert code == 2, name
        assert message in err, (name, err)


def test_cli_module_json_and_out(trio, tmp_path):
    out = tmp_path / "rep"
    proc = subprocess.run([sys.executable, "-m", "nxgates", "compare", str(trio["dir"] / "ctrl"),
                           str(trio["dir"] / "benign"), "--reference", str(trio["dir"] / "ref"), "--json", "--out",
                           str(out), "--tolerances", _n3_floor(trio["dir"]).path],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["exit_code"] == 0 and rep["judged"] == list(gates.GATES)
    assert json.loads((out / "compare.json").read_text())["judged"] == list(gates.GATES)
    assert "PASS" in (out / "compare.md").read_text()
