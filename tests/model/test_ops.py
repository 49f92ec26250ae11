"""The dispatch table (model/ops.py): dispatch records, override replaces, and the small ops are right.

Run: ``python -m pytest tests/model/test_ops.py -q``.
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from nxgates import reference
from nxgates.model import ops


def _rng(case_id: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(case_id.encode()))


def _bf16_rounded(x: np.ndarray) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))


def test_dispatch_records_impl_and_options_in_the_callers_record():
    record, other = {}, {}
    ops.dispatch("attention", "xla", record=record)
    ops.dispatch("lb_ids", "zigzag", record=record, hoisted=True)
    ops.dispatch("attention", "reference", record=other)
    assert record == {"attention": "xla", "lb_ids": "zigzag(hoisted=True)"}
    assert other == {"attention": "reference"}  # each caller's own record: no module-wide state
    assert not hasattr(ops, "implementations") and not hasattr(ops, "reset")


def test_dispatch_refuses_unknown_names():
    with pytest.raises(ValueError, match="name='nope'"):
        ops.dispatch("nope", "reference", record=None)
    with pytest.raises(ValueError, match="impl='nope'"):
        ops.dispatch("attention", "nope", record=None)
    with pytest.raises(ValueError, match="name='nope'"):
        with ops.override("nope", lambda: None):
            pass


def test_override_replaces_op_inside_jit_and_is_recorded():
    def wrong_amax(w, axes, axis_name):
        return jnp.full_like(jnp.max(jnp.abs(w), axis=axes, keepdims=True), 448.0)

    record = {}

    def model(w):
        return ops.dispatch("fp8_amax", "absmax", record=record, hoisted=False)(w, (0,), None)

    w = jnp.asarray([[1.0, -3.0], [2.0, 0.5]], jnp.float32)
    with ops.override("fp8_amax", wrong_amax):
        inside = jax.jit(model)(w)
        assert record["fp8_amax"] == "override:wrong_amax"
    outside = jax.jit(lambda w: model(w) + 0.0)(w)  # a new trace after the block: the real op again
    np.testing.assert_array_equal(np.asarray(inside), [[448.0, 448.0]])
    np.testing.assert_array_equal(np.asarray(outside), [[2.0, 3.0]])
    assert record["fp8_amax"] == "absmax(hoisted=False)"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_fp8_fake_quant_matches_reference_and_is_straight_through(dtype):
    case = f"E3-K40-N24-{jnp.dtype(dtype).name}"
    w = jnp.asarray(_bf16_rounded(_rng(case).standard_normal((3, 40, 24)) * 0.05), dtype)
    amax = ops.dispatch("fp8_amax", "absmax", record=None, hoisted=False)(w, (1,), None)
    fq = ops.dispatch("fp8_fake_quant", "reference", record=None)
    w_hat = fq(w, amax)
    expected = reference.fp8_fake_quant(w.astype(jnp.float32), axes=(1,))
    assert w_hat.dtype == dtype
    expected = np.asarray(expected.astype(dtype)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(w_hat.astype(jnp.float32)), expected)
    assert not np.array_equal(np.asarray(w_hat), np.asarray(w))  # it really rounds
    ct = jnp.asarray(_rng(case + "-ct").standard_normal(w.shape), dtype)
    _, vjp = jax.vjp(fq, w, amax)
    dw, damax = vjp(ct)
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(ct))
    np.testing.assert_array_equal(np.asarray(damax), 0.0)


def test_fp8_amax_is_global_over_the_axis():
    """Under shard_map over 2 devices, the amax of a K-sharded weight is the max over both shards (pmax)."""
    w = jnp.asarray(_rng("E2-K8-N4").standard_normal((2, 8, 4)), jnp.float32)
    w = w.at[0, 7, 1].set(9.0)  # the largest value lives in the second K shard
    mesh = Mesh(np.asarray(jax.devices()[:2]), ("fsdp",))
    amax_fn = ops.dispatch("fp8_amax", "absmax", record=None, hoisted=True)

    def local(w_local):
        return amax_fn(w_local, (1,), "fsdp")

    got = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(None, "fsdp"), out_specs=P(), check_vma=False))(w)
    np.testing.assert_array_equal(np.asarray(got), np.max(np.abs(np.asarray(w)), axis=1, keepdims=True))
    assert float(got[0, 0, 1]) == 9.0


@pytest.mark.parametrize("seq_len,context", [(16, 2), (24, 3)], ids=["S16-C2", "S24-C3"])
def test_lb_ids_zigzag(seq_len, context):
    lb_ids = ops.dispatch("lb_ids", "zigzag", record=None, hoisted=False)
    half = seq_len // (2 * context)
    seen = []
    for rank in range(context):
        pos, seg = lb_ids(seq_len, context, rank)
        expected = list(range(rank * half, (rank + 1) * half))
        expected += list(range((2 * context - 1 - rank) * half, (2 * context - rank) * half))
        assert np.asarray(pos).tolist() == expected
        assert np.asarray(seg).tolist() == [0] * (2 * half)
        seen += expected
    assert sorted(seen) == list(range(seq_len))  # every position exactly once


def _attention_loop(q, k, v, q_pos, kv_pos):
    """float64 per query loop: causal by position, kv head = q head // (Hq / Hkv)."""
    b, sq, hq, dh = q.shape
    rep = hq // k.shape[2]
    out = np.zeros((b, sq, hq, dh))
    for bi in range(b):
        for i in range(sq):
            for h in range(hq):
                keep = [j for j in range(k.shape[1]) if kv_pos[j] <= q_pos[i]]
                logits = np.array([q[bi, i, h] @ k[bi, j, h // rep] for j in keep]) / np.sqrt(dh)
                p = np.exp(logits - logits.max())
                p /= p.sum()
                out[bi, i, h] = sum(pj * v[bi, j, h // rep] for pj, j in zip(p, keep, strict=True))
    return out


@pytest.mark.parametrize("impl,tol", [("reference", 1e-5), ("xla", 2e-2)], ids=["reference", "xla-bf16"])
def test_attention_matches_loop(impl, tol):
    case = f"B1-Sq6-Sk12-Hq4-Hkv2-D8-{impl}"
    r = _rng(case)
    q, k, v = (_bf16_rounded(r.standard_normal(s)) for s in ((1, 6, 4, 8), (1, 12, 2, 8), (1, 12, 2, 8)))
    kv_pos = np.asarray([0, 1, 2, 9, 10, 11, 3, 4, 5, 6, 7, 8], np.int32)  # a permuted (zigzag-like) kv order
    q_pos = kv_pos[3:9]
    dtype = jnp.float32 if impl == "reference" else jnp.bfloat16
    fn = ops.dispatch("attention", impl, record=None)
    seg_q, seg_kv = np.zeros(6, np.int32), np.zeros(12, np.int32)
    got = fn(*(jnp.asarray(x, dtype) for x in (q, k, v)), (jnp.asarray(q_pos), jnp.asarray(kv_pos)),
             (jnp.asarray(seg_q), jnp.asarray(seg_kv)))
    expected = _attention_loop(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), q_pos, kv_pos)
    err = np.linalg.norm(np.asarray(got, np.float64) - expected) / np.linalg.norm(expected)
    assert err < tol, f"{impl}: rel L2 {err:.3g} >= {tol}"


@functools.cache
def _moe_inputs():
    r = _rng("m12-D8-F4-G3")
    x = _bf16_rounded(r.standard_normal((12, 8)))
    wi = _bf16_rounded(r.standard_normal((3, 8, 8)) * 0.3)
    wo = _bf16_rounded(r.standard_normal((3, 4, 8)) * 0.3)
    rw = _bf16_rounded(r.uniform(0.1, 1.0, (12,)))
    return x, wi, wo, np.asarray([4, 0, 5], np.int32), rw


def test_moe_mlp_reference_matches_group_loop():
    x, wi, wo, gs, rw = _moe_inputs()
    got = ops.dispatch("moe_mlp", "reference", record=None)(*(jnp.asarray(a) for a in (x, wi, wo, gs, rw)))
    expected = np.zeros((12, 8))
    start = 0
    for g, n in enumerate(gs):
        for row in range(start, start + n):
            gu = x[row].astype(np.float64) @ wi[g]
            h = gu[:4] / (1 + np.exp(-gu[:4])) * gu[4:]
            expected[row] = (h * rw[row]) @ wo[g]
        start += n
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got)[9:], 0.0)  # rows past sum(group_sizes)


def test_the_ops_a_flag_declaration_may_name_are_the_dispatch_table():
    """model.flags keeps the op names as data (it imports without jax); they must be this table's, plus "remat"."""
    from nxgates.model import flags

    assert set(flags.REACHABLE) == set(ops.OP_NAMES) | {"remat"}
    assert {d.op for d in flags.TUNING.values()} <= set(flags.REACHABLE)
