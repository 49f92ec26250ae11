"""The recorder (gates/recorder.py): raw trees and in-step summaries give the same record, step numbering, a run
that is never closed stays readable, bad calls are refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nxgates.gates import recorder, records

W = 64


def _tree(seed):
    rng = np.random.default_rng(seed)
    return {"big": {"w": rng.standard_normal((16, 8)).astype(np.float32)}, "small": rng.standard_normal(5)
            .astype(np.float32)}


def test_raw_trees_and_jitted_summaries_write_the_same_step(tmp_path):
    g, p0 = _tree(0), _tree(1)
    p1 = jax.tree.map(lambda x: x - 1e-3 * np.sign(x), p0)
    with recorder.Recorder(tmp_path / "a", sketch_width=W, seed=3, meta={"trainer": "t", "note": "x"}) as rec:
        rec.start(params=p0)
        rec.step(loss=np.float32(1.25), grad_norm=np.float32(2.0), grads=g, params=p1, prev_params=p0)
    summ = jax.jit(lambda g, p, q: recorder.summaries(g, p, prev_params=q, width=W, seed=3))(g, p1, p0)
    with recorder.Recorder(tmp_path / "b", sketch_width=W, seed=3) as rec:
        rec.describe(p0)
        rec.step(1, loss=np.float32(1.25), summaries=summ)
    a, b = records.load_run(tmp_path / "a"), records.load_run(tmp_path / "b")
    assert a.meta["trainer"] == "t" and a.meta["extra"] == {"note": "x"} and a.meta["closed"] and a.meta["steps"] == [1]
    assert sorted(a.steps) == [0, 1] and a.tensors == b.tensors
    assert a.tensors["small"] == {"shape": [5], "dtype": "float32", "exact": True}
    assert a.tensors["big/w"]["exact"] is False
    assert not a.steps[1].has_group("param_sketch")  # the update sketch supersedes it
    for group in ("grad_sketch", "grad_fp", "grad_sq", "param_fp", "update_sketch"):
        ga, gb = a.steps[1].group(group), b.steps[1].group(group)
        assert sorted(ga) == ["big/w", "small"], group
        for k in ga:
            np.testing.assert_array_equal(ga[k], gb[k])
    np.testing.assert_array_equal(a.steps[1].group("grad_sketch")["small"], g["small"])  # exact below the width
    np.testing.assert_allclose(a.steps[1].group("grad_sq")["big/w"], np.sum(g["big"]["w"].astype(np.float64) ** 2),
                               rtol=1e-6)
    upd = a.steps[1].group("update_sketch")["small"]
    np.testing.assert_array_equal(upd, p1["small"] - p0["small"])
    assert a.steps[0].has_group("param_sketch") and a.steps[0].get("loss") is None


def test_full_tensors_log_probs_and_an_unclosed_run(tmp_path):
    g, p = _tree(0), _tree(1)
    rec = recorder.Recorder(tmp_path / "r", sketch_width=W, full_tensors=True)
    lp = -np.abs(np.random.default_rng(2).standard_normal((2, 6))).astype(np.float32)
    mask = np.ones((2, 6), np.float32)
    rec.step(loss=jnp.float32(0.5), grads=g, params=p, log_probs=lp, mask=mask, routing=np.zeros((2, 3), np.int32),
             routing_mismatch=0)
    rec.step(loss=np.float32(0.25))
    run = records.load_run(tmp_path / "r")  # never closed: a killed run reads as far as it got
    assert not run.meta["closed"] and run.step_numbers == [1, 2]
    np.testing.assert_array_equal(run.steps[1].group("grad")["big/w"], g["big"]["w"])
    np.testing.assert_array_equal(run.steps[1].get("log_probs"), lp)
    assert run.steps[1].get("log_probs_fp").shape == (2,)


def test_bad_calls_are_refused(tmp_path):
    rec = recorder.Recorder(tmp_path / "r", sketch_width=W)
    with pytest.raises(ValueError, match="log_probs and mask"):
        rec.step(loss=np.float32(1), log_probs=np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="loss must be a scalar"):
        rec.step(loss=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="nothing to record"):
        rec.step()
    rec.step(2, loss=np.float32(1))
    with pytest.raises(ValueError, match="step=2 must be an int greater than the last step 2"):
        rec.step(2, loss=np.float32(1))
    with pytest.raises(ValueError, match="not one of"):
        rec.step(summaries={"sketch/w": np.zeros(4)})
    with pytest.raises(ValueError, match="exists and is not empty"):
        recorder.Recorder(tmp_path / "r", sketch_width=W)
    rec.close()
    with pytest.raises(ValueError, match="after close"):
        rec.step(loss=np.float32(1))


def _sharded_trees(explicit: bool):
    """(grads, params, prev_params) on a 2x4 mesh of host devices: split and replicated tensors, two of one shape (one
    program for both: the keys are inputs), bf16, a tensor below the sketch width (kept exactly) and a scalar."""
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    kw = {"axis_types": (AxisType.Explicit,) * 2} if explicit else {}
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("a", "b"), **kw)
    specs = {"w1": P("a", "b"), "w2": P("a", "b"), "v": P(None, "b"), "h": P("b"), "small": P(), "scale": P()}
    rng = np.random.default_rng(11)

    def tree(shift):
        arrays = {"w1": rng.standard_normal((16, 8)), "w2": rng.standard_normal((16, 8)),
                  "v": rng.standard_normal((6, 24)), "h": rng.standard_normal(96), "small": rng.standard_normal(5),
                  "scale": np.asarray(1.5 + shift)}
        out = {}
        for k, a in arrays.items():
            dtype = jnp.bfloat16 if k == "v" else jnp.float32
            out[k] = jax.device_put(jnp.asarray(a + shift, dtype), NamedSharding(mesh, specs[k]))
        return {"block": {k: out[k] for k in ("w1", "w2", "v")}, "h": out["h"], "small": out["small"],
                "scale": out["scale"]}

    return tree(0.0), tree(1.0), tree(0.5)


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_summaries_by_tensor_are_the_jitted_summaries_bit_for_bit(explicit):
    """summaries_by_tensor (one program per tensor shape, the keys as inputs) gives summaries()'s arrays under jit, in
    its key order, bit for bit: a step's (grads, params, update) and step 0's (params alone); on an explicit mesh it is
    the jitted function itself. Two tensors of one shape share a program and still get their own sketches."""
    g, p, q = _sharded_trees(explicit)
    for args, kw in (((g, p), {"prev_params": q}), ((None, p), {}), ((g, None), {})):
        want = recorder.jitted_summaries(W, 5)(*args, **kw)
        got = recorder.summaries_by_tensor(*args, **kw, width=W, seed=5)
        assert list(got) == list(want)
        for k in want:
            a, b = np.asarray(got[k]), np.asarray(want[k])
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), k
    got = recorder.summaries_by_tensor(g, p, prev_params=q, width=W, seed=5)
    assert not np.array_equal(got["grad_sketch/block/w1"], got["grad_sketch/block/w2"])
    assert not np.array_equal(got["grad_fp/block/w1"], got["grad_fp/block/w2"])


def test_summaries_by_tensor_refuses_what_summaries_refuses():
    g, p, q = _tree(0), _tree(1), _tree(2)
    with pytest.raises(ValueError, match="prev_params given without params"):
        recorder.summaries_by_tensor(g, prev_params=q, width=W)
    with pytest.raises(ValueError, match="not the same tree"):
        recorder.summaries_by_tensor(g, p, prev_params={"big": q["big"]}, width=W)
    with pytest.raises(ValueError, match="width"):
        recorder.summaries_by_tensor(g, p, width=0)
