"""CountSketch and bit fingerprints (gates/sketch.py): the estimate, exact small tensors, the rounding floor, sharding
invariance (auto-sharded jit, explicit sharding, shard_map + psum) with no all-gather, and fingerprints that see one
flipped bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nxgates.gates import sketch as S

W = 1024


def _est_ratio(a, b, *, width=W, seed=0, path="t", seed_b=None):
    sa = np.asarray(S.sketch_array(a, path=path, width=width, seed=seed))
    sb = np.asarray(S.sketch_array(b, path=path, width=width, seed=seed if seed_b is None else seed_b))
    exact = np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    return np.sqrt(S.estimate_sq(sa, sb)) / exact


def _mesh(explicit=False):
    kw = {"axis_types": (AxisType.Explicit,) * 3} if explicit else {}
    return Mesh(np.asarray(jax.devices()[:8]).reshape(2, 2, 2), ("fsdp", "context", "expert"), **kw)


def test_estimate_within_its_error_and_a_wrong_seed_is_garbage():
    rng = np.random.default_rng(0)
    ratios = []
    for i in range(20):
        a = rng.standard_normal((16, 64, 32)).astype(np.float32)
        b = a + 0.01 * rng.standard_normal(a.shape).astype(np.float32)
        ratios.append(_est_ratio(a, b, seed=i))
    err = np.abs(np.asarray(ratios) - 1.0)
    # 1/sqrt(2w) = 2.2% standard deviation at w=1024: 20 draws all within 4 sigma
    assert err.max() < 4 / np.sqrt(2 * W), err
    # sketches with different seeds do not line up: the "estimate" is then of ||a|| + ||b||, not ||a - b||
    a = rng.standard_normal((16, 64, 32)).astype(np.float32)
    b = a + 0.01 * rng.standard_normal(a.shape).astype(np.float32)
    assert _est_ratio(a, b, seed=0, seed_b=1) > 50
    assert _est_ratio(a, b, path="x") == pytest.approx(_est_ratio(a, b, path="x"))


def test_small_tensors_are_kept_exactly():
    x = np.arange(W - 1, dtype=np.float32).reshape(3, -1) if (W - 1) % 3 == 0 else np.arange(W - 1, dtype=np.float32)
    s = np.asarray(S.sketch_array(x, path="small", width=W, seed=3))
    np.testing.assert_array_equal(s, x.reshape(-1))
    big = np.ones((W,), np.float32)  # numel == width: sketched (the stored length tells exact from sketched)
    assert not S.is_exact(big.size, W) and S.is_exact(W - 1, W)
    sb = np.asarray(S.sketch_array(big, path="big", width=W, seed=3))
    assert sb.shape == (W,) and not np.array_equal(sb, big)


def test_sketch_floor_is_far_below_the_differences_it_measures():
    """Two nearly equal tensors sketched separately and subtracted: the rounding of the float32 sketch is measured as
    the distance between two summation orders of the same tensor (unsharded vs 8 shards), relative to its norm."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((8, 256, 256)).astype(np.float32)
    s1 = np.asarray(S.sketch_array(a, path="w", width=4096, seed=0))
    a8 = jax.device_put(a, NamedSharding(_mesh(), P("expert", "fsdp", "context")))
    s8 = np.asarray(jax.jit(lambda x: S.sketch_array(x, path="w", width=4096, seed=0))(a8))
    floor = np.sqrt(S.estimate_sq(s1, s8)) / np.linalg.norm(a.astype(np.float64))
    assert 0 < floor < 1e-6, floor  # float32 summation order only
    # a difference 100x above the floor is estimated as well as any other (within the width's error)
    for rel in (1e-4, 1e-3):
        b = (a.astype(np.float64) * (1 + rel * rng.standard_normal(a.shape))).astype(np.float32)
        r = _est_ratio(a, b, width=4096, path="w")
        assert abs(r - 1) < 4 / np.sqrt(2 * 4096), (rel, r)


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_sharding_invariance_and_no_all_gather(explicit):
    mesh = _mesh(explicit)
    rng = np.random.default_rng(2)
    tree = {"wi": rng.standard_normal((8, 64, 96)).astype(np.float32),
            "norm": rng.standard_normal((64,)).astype(np.float32),
            "h": rng.standard_normal((4, 512)).astype(jnp.bfloat16)}
    specs = {"wi": P("expert", "fsdp", "context"), "norm": P(), "h": P(None, ("fsdp", "context"))}
    f = jax.jit(lambda t: (S.sketch(t, width=W, seed=7), S.fingerprint(t)))
    s1, f1 = jax.device_get(f(tree))
    sharded = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in tree.items()}
    s8, f8 = jax.device_get(f(sharded))
    for k in tree:
        rel = np.linalg.norm(s1[k].astype(np.float64) - s8[k]) / np.linalg.norm(s1[k].astype(np.float64))
        assert rel < 1e-6, (k, rel)
        np.testing.assert_array_equal(f1[k], f8[k])
    hlo = f.lower(sharded).compile().as_text()
    assert "all-gather" not in hlo
    assert "all-reduce" in hlo


def test_shard_map_sketch_shard_plus_psum_equals_the_unsharded_sketch():
    mesh = _mesh()
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 64, 96)).astype(np.float32)
    spec = P("expert", ("fsdp", "context"))

    def body(xl):
        off = S.shard_offsets(spec, xl.shape, mesh.shape)
        s = S.sketch_shard(xl, path="w", global_shape=x.shape, offsets=off, width=W, seed=5)
        fp = S.fingerprint_shard(xl, path="w", offsets=off)
        return jax.lax.psum(s, ("expert", "fsdp", "context")), jax.lax.psum(fp, ("expert", "fsdp", "context"))

    sm = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(P(), P())))
    s8, f8 = jax.device_get(sm(jax.device_put(x, NamedSharding(mesh, spec))))
    s1 = np.asarray(S.sketch_array(x, path="w", width=W, seed=5))
    assert np.linalg.norm(s8 - s1) / np.linalg.norm(s1) < 1e-6
    np.testing.assert_array_equal(f8, np.asarray(S.fingerprint_array(x, path="w")))
    # wrong offsets (every shard at 0) are not the same sketch: the global index matters
    bad = jax.jit(jax.shard_map(
        lambda xl: jax.lax.psum(S.sketch_shard(xl, path="w", global_shape=x.shape, offsets=(0, 0, 0), width=W,
                                               seed=5), ("expert", "fsdp", "context")),
        mesh=mesh, in_specs=spec, out_specs=P()))
    sb = np.asarray(bad(jax.device_put(x, NamedSharding(mesh, spec))))
    assert np.linalg.norm(sb - s1) / np.linalg.norm(s1) > 0.5


def test_fingerprint_sees_one_bit_a_swap_and_signed_zero():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((32, 33)).astype(np.float32)
    base = np.asarray(S.fingerprint_array(x, path="t"))
    assert base.dtype == np.uint32 and base.shape == (2,)
    np.testing.assert_array_equal(base, np.asarray(S.fingerprint_array(x.copy(), path="t")))
    flipped = x.copy().view(np.uint32)
    flipped[17, 5] ^= 1  # lowest mantissa bit of one element
    assert np.all(np.asarray(S.fingerprint_array(flipped.view(np.float32), path="t")) != base)
    swapped = x.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert np.all(np.asarray(S.fingerprint_array(swapped, path="t")) != base)
    z = np.zeros((4,), np.float32)
    assert np.all(np.asarray(S.fingerprint_array(z, path="z")) != np.asarray(S.fingerprint_array(-z, path="z")))
    hb = x.astype(jnp.bfloat16)
    hb2 = hb.copy()
    hb2[0, 0] = -hb2[0, 0]
    assert np.all(np.asarray(S.fingerprint_array(hb, path="t")) != np.asarray(S.fingerprint_array(hb2, path="t")))


def test_bad_width_seed_and_spec_are_refused():
    for kw in ({"width": 0, "seed": 0}, {"width": 2.5, "seed": 0}, {"width": 8, "seed": -1}):
        with pytest.raises(ValueError, match="width|seed"):
            S.sketch({"a": np.ones(3, np.float32)}, **kw)
    with pytest.raises(ValueError, match="kind"):
        S.SketchSpec.from_json({"kind": "other", "width": 8, "seed": 0})
    spec = S.SketchSpec(width=64, seed=3)
    assert S.SketchSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError, match="two leaves"):
        S.named_leaves({"a/b": 1.0, "a": {"b": 2.0}})


def test_small_sharded_tensors_are_kept_exactly():
    """Below the width a tensor is stored whole, so XLA may gather it (at most w floats, like the sketch's
    all-reduce); the values are exact whatever the sharding, and inside shard_map ``exact_shard`` + psum places each
    block at its offsets."""
    mesh = _mesh()
    x = np.arange(2 * 4 * 8, dtype=np.float32).reshape(2, 4, 8)
    spec = P("fsdp", "context", "expert")
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    f = jax.jit(lambda t: S.sketch_array(t, path="s", width=W, seed=0))
    np.testing.assert_array_equal(np.asarray(f(xs)), x.reshape(-1))
    sm = jax.jit(jax.shard_map(
        lambda xl: jax.lax.psum(S.exact_shard(xl, global_shape=x.shape, offsets=S.shard_offsets(spec, xl.shape,
                                                                                                mesh.shape)),
                                ("fsdp", "context", "expert")), mesh=mesh, in_specs=spec, out_specs=P()))
    np.testing.assert_array_equal(np.asarray(sm(xs)), x.reshape(-1))
