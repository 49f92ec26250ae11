"""The mixer layers (model/layers.py) and the MoE block (model/moe.py) on small meshes, float32 reference precision:
the sequence layouts over context (contiguous with a ppermute conv halo, zigzag with gathered relayouts) and the
expert-parallel MoE give the single-device values; the MoE equals a per-token float64 loop.

Run: ``python -m pytest tests/model/test_layers.py -q``.
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from nxgates.model import flags as flags_lib
from nxgates.model import layers, moe

DIMS = layers.Dims(vocab=32, d_model=32, num_layers=4, num_experts=4, top_k=2, moe_mlp=8, shared_mlp=8,
                   gdn_key_heads=2, gdn_value_heads=4, gdn_key_dim=8, gdn_value_dim=8, gdn_conv=4, gdn_chunk=8,
                   attn_heads=4, attn_kv_heads=2, attn_head_dim=8, rotary_dim=4, rope_theta=10000.0, norm_eps=1e-6)
B, S = 2, 32


def _rng(case_id: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(case_id.encode()))


def _params(shapes: dict, case: str) -> dict:
    r = _rng(case)
    out = {}
    for name, shape in shapes.items():
        if name in ("norm", "q_norm", "k_norm", "out_norm"):
            out[name] = 1.0 + 0.1 * r.standard_normal(shape)
        elif name == "A_log":
            out[name] = np.log(r.uniform(1.0, 4.0, shape))
        elif name == "dt_bias":
            out[name] = r.uniform(-4.0, -1.0, shape)
        else:
            out[name] = r.standard_normal(shape) * (0.5 if name == "conv" else 0.2)
    return {k: jnp.asarray(v, jnp.float32) for k, v in out.items()}


def _ctx(mesh_shape, load_balance: bool) -> layers.Ctx:
    flags = flags_lib.parse_flags({"fp8_moe_fake_quant": False,
                                   "context_parallel_attention_load_balance": load_balance})
    f, c, e = mesh_shape
    return layers.Ctx(dims=DIMS, flags=flags, precision="reference", fsdp=f, context=c, expert=e, seq_len=S,
                      load_balance=load_balance and c > 1, interpret=True)


def _run_layer(body, params, h, mesh_shape, load_balance: bool, param_specs: dict, gather_dims: dict):
    """Run ``body(ctx, W, h_local)`` under shard_map; ``h [B, S, D]`` given in natural order, output natural order."""
    mesh = Mesh(np.asarray(jax.devices()[: int(np.prod(mesh_shape))]).reshape(mesh_shape), ("fsdp", "context",
                                                                                             "expert"))
    ctx = _ctx(mesh_shape, load_balance)
    order = np.asarray(layers.zigzag_order(S, mesh_shape[1])) if ctx.load_balance else np.arange(S)

    def local(p, h_local):
        out = body(ctx, layers.Weights(ctx, p, gather_dims), h_local)
        return out[0] if isinstance(out, tuple) else out

    spec = P(("fsdp", "expert"), "context", None)
    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(param_specs, spec), out_specs=spec, check_vma=False))
    out = np.asarray(fn(params, h[:, order]))
    return out[:, np.argsort(order)]


def _replicated(params):
    return {k: P() for k in params}, {k: None for k in params}


LAYOUTS = [((1, 1, 1), False), ((1, 2, 1), False), ((1, 4, 1), False), ((2, 2, 1), True)]
LAYOUT_IDS = ["1dev", "C2-contiguous", "C4-contiguous", "F2-C2-zigzag"]


@functools.cache
def _gdn_case():
    params = _params(layers.gdn_param_shapes(DIMS), "gdn-D32")
    h = jnp.asarray(_rng("gdn-h-B2-S32-D32").standard_normal((B, S, DIMS.d_model)), jnp.float32)
    return params, h


@functools.cache
def _gdn_single():
    params, h = _gdn_case()
    return _run_layer(layers.gdn_layer, params, h, (1, 1, 1), False, *_replicated(params))


def _gdn_loop(params, h):
    """float64 per-token GDN layer (projections, causal conv, recurrence, gated norm) on one device."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    h = np.asarray(h, np.float64)
    hk, hv, dk, dv, kc = (DIMS.gdn_key_heads, DIMS.gdn_value_heads, DIMS.gdn_key_dim, DIMS.gdn_value_dim,
                          DIMS.gdn_conv)
    x = h @ np.concatenate([p["q_proj"], p["k_proj"], p["v_proj"]], axis=1)  # [B, S, C]
    xp = np.pad(x, ((0, 0), (kc - 1, 0), (0, 0)))
    conv = sum(xp[:, j : j + S] * p["conv"][j] for j in range(kc))
    conv = conv / (1 + np.exp(-conv))
    q, k, v = np.split(conv, [hk * dk, 2 * hk * dk], axis=-1)
    q = q.reshape(B, S, hk, dk)
    k = k.reshape(B, S, hk, dk)
    q = np.repeat(q / np.linalg.norm(q, axis=-1, keepdims=True), hv // hk, axis=2)
    k = np.repeat(k / np.linalg.norm(k, axis=-1, keepdims=True), hv // hk, axis=2)
    v = v.reshape(B, S, hv, dv)
    beta = 1 / (1 + np.exp(-(h @ p["b_proj"])))
    g = -np.exp(p["A_log"]) * np.log1p(np.exp(h @ p["a_proj"] + p["dt_bias"]))
    o = np.zeros((B, S, hv, dv))
    for b in range(B):
        for hh in range(hv):
            state = np.zeros((dk, dv))
            for t in range(S):
                state = np.exp(g[b, t, hh]) * state
                state = state + np.outer(k[b, t, hh], beta[b, t, hh] * (v[b, t, hh] - state.T @ k[b, t, hh]))
                o[b, t, hh] = state.T @ (q[b, t, hh] * dk**-0.5)
    z = (h @ p["z_proj"]).reshape(B, S, hv, dv)
    o = o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + DIMS.norm_eps) * p["out_norm"] * z / (1 + np.exp(-z))
    return o.reshape(B, S, hv * dv) @ p["out_proj"]


def test_gdn_layer_single_device_matches_per_token_loop():
    params, h = _gdn_case()
    expected = _gdn_loop(params, h)
    got = _gdn_single()
    err = np.linalg.norm(got - expected) / np.linalg.norm(expected)
    assert err < 1e-5, err


@pytest.mark.parametrize("mesh_shape,load_balance", LAYOUTS[1:], ids=LAYOUT_IDS[1:])
def test_gdn_layer_sequence_layouts_match_single_device(mesh_shape, load_balance):
    params, h = _gdn_case()
    specs = {k: P() for k in params}
    gather_dims = {k: None for k in params}
    if mesh_shape[0] > 1:  # the projections fsdp-sharded on their input dim and gathered at use
        for k in ("q_proj", "k_proj", "v_proj", "z_proj", "a_proj", "b_proj"):
            specs[k], gather_dims[k] = P("fsdp", None), 0
    got = _run_layer(layers.gdn_layer, params, h, mesh_shape, load_balance, specs, gather_dims)
    np.testing.assert_allclose(got, _gdn_single(), rtol=1e-5, atol=1e-5)


@functools.cache
def _attn_case():
    params = _params(layers.attention_param_shapes(DIMS), "attn-D32")
    h = jnp.asarray(_rng("attn-h-B2-S32-D32").standard_normal((B, S, DIMS.d_model)), jnp.float32)
    return params, h


def _attn_body(ctx, W, h):
    return layers.attention_layer(ctx, W, h, None)


@pytest.mark.parametrize("mesh_shape,load_balance", LAYOUTS[1:4], ids=LAYOUT_IDS[1:4])
def test_attention_layer_sequence_layouts_match_single_device(mesh_shape, load_balance):
    params, h = _attn_case()
    single = _run_layer(_attn_body, params, h, (1, 1, 1), False, *_replicated(params))
    got = _run_layer(_attn_body, params, h, mesh_shape, load_balance, *_replicated(params))
    np.testing.assert_allclose(got, single, rtol=1e-5, atol=1e-5)
    # causal: the first token's output depends on itself only
    h2 = h.at[:, 1:].set(0.0)
    first = _run_layer(_attn_body, params, h2, mesh_shape, load_balance, *_replicated(params))
    np.testing.assert_allclose(first[:, 0], single[:, 0], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------------------
# MoE block
# ----------------------------------------------------------------------------------------------------------------------


def _moe_loop(params, h):
    """float64 per token: softmax top-2 renormalized routing, SwiGLU experts, sigmoid-gated shared expert."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    x = np.asarray(h, np.float64).reshape(-1, DIMS.d_model)
    f, fs = DIMS.moe_mlp, DIMS.shared_mlp
    logits = x @ p["router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        top = np.argsort(-probs[t])[: DIMS.top_k]
        w = probs[t, top] / probs[t, top].sum()
        for e, we in zip(top, w, strict=True):
            gu = x[t] @ p["wi"][e]
            out[t] += we * ((gu[:f] / (1 + np.exp(-gu[:f])) * gu[f:]) @ p["wo"][e])
        gu = x[t] @ p["shared_wi"]
        shared = (gu[:fs] / (1 + np.exp(-gu[:fs])) * gu[fs:]) @ p["shared_wo"]
        out[t] += shared / (1 + np.exp(-(x[t] @ p["shared_gate"][:, 0])))
    return out.reshape(np.shape(h))


@pytest.mark.parametrize("mesh_shape", [(1, 1, 1), (2, 2, 2), (1, 1, 4)], ids=["1dev", "2x2x2", "E4"])
def test_moe_block_matches_per_token_loop(mesh_shape):
    params = _params(moe.moe_param_shapes(DIMS), "moe-D32-E4")
    h = jnp.asarray(_rng("moe-h-B2-S32-D32").standard_normal((B * 2, S, DIMS.d_model)), jnp.float32)
    specs = {k: P() for k in params}
    gather_dims = {k: None for k in params}
    specs["wi"] = specs["wo"] = P("expert", "fsdp", None)  # experts over expert, the contraction dim over fsdp
    gather_dims["wi"] = gather_dims["wo"] = 1
    got = _run_layer(lambda c, W, x: moe.moe_block(c, W, x), params, h, mesh_shape, False, specs, gather_dims)
    expected = _moe_loop(params, h)
    err = np.linalg.norm(got - expected) / np.linalg.norm(expected)
    assert err < 1e-5, err
