"""Taps (model/taps.py): the default program is unchanged, and the taps hold the values they claim.

Run: ``python -m pytest tests/model/test_taps.py -q`` (the reduced tiny config of test_transformer.py, one GDN and one
attention layer, with one layer group, to keep the suite's time: the layer scan is traced all the same and the taps
stack per group; the program comparisons are lowered only, one explained step is compiled).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nxgates.model import layers, rules, sharding, taps, transformer
from tests.model.test_transformer import _inputs, small_cfg


@functools.cache
def _one_group_cfg():
    """One layer group (half the lowering time of small_cfg): the tap hooks are all on the traced path either way."""
    import dataclasses

    cfg = small_cfg()
    return dataclasses.replace(cfg, num_layers=len(cfg.layer_pattern))


def _default_text() -> str:
    cfg = _one_group_cfg()
    flags = rules.flags_for(cfg, {})
    log_probs = transformer.build_log_probs(cfg, flags, precision="production", mesh=sharding.make_mesh(flags))
    params = transformer.init_params(cfg, 0)
    tokens = _inputs()[1]

    def loss(p, t):
        logp, aux = log_probs(p, t)
        return jnp.mean(logp), aux

    return jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(params, tokens).as_text()


@functools.cache
def _explained():
    """One explained step of the production control: (forward taps, backward taps, specs, logp, weights)."""
    cfg = _one_group_cfg()
    flags = rules.flags_for(cfg, {})
    mesh = sharding.make_mesh(flags)
    fn = transformer.build_log_probs(cfg, flags, precision="production", mesh=mesh, explain=True)
    params, tokens = transformer.init_params(cfg, 0), _inputs()[1]
    params = sharding.shard_params(params, mesh)
    routing = (jnp.zeros(fn.routing_shape, jnp.int32), jnp.bool_(False))
    structure = fn.probe_shapes(params, tokens, routing)
    probes = jax.tree.map(lambda sd: jnp.zeros(sd.shape, sd.dtype), structure)
    w = jnp.asarray(np.random.default_rng(7).standard_normal((tokens.shape[0], tokens.shape[1] - 1)), jnp.float32)

    def loss(p, pr):
        logp, aux = fn(p, tokens, routing, pr)
        return jnp.sum(logp * w), (logp, aux["taps"])

    (_, (logp, fwd)), bwd = jax.jit(jax.value_and_grad(loss, argnums=1, has_aux=True))(params, probes)
    return jax.tree.map(np.asarray, fwd), jax.tree.map(np.asarray, bwd), fn.tap_specs(), np.asarray(logp), \
        np.asarray(w), structure


def test_default_program_unchanged_by_the_tap_machinery(monkeypatch):
    """The StableHLO text of the default step (value_and_grad of the log-probs) is the same after an explained build
    was traced in this process and without the machinery (tap hooks that cannot record anything, no session); and
    the comparison can fail: a hook that adds zero to every tapped value changes it."""
    before = _default_text()
    _explained()  # an explained build traced in this process leaves nothing behind
    assert _default_text() == before
    with monkeypatch.context() as m:
        m.setattr(layers.Ctx, "tap", lambda self, op, x, label="", backward=True: x)
        m.setattr(layers.Ctx, "tap_call", lambda self, op, fn, args, names, diff, label="": fn(*args))
        m.setattr(taps, "TapSession", None)
        assert _default_text() == before
    monkeypatch.setattr(layers.Ctx, "tap", lambda self, op, x, label="", backward=True: x + jnp.zeros((), x.dtype))
    assert _default_text() != before


def test_taps_cover_every_scope_and_stack_per_layer_group():
    fwd, bwd, specs, *_ , structure = _explained()
    cfg = _one_group_cfg()
    n_dev, groups = 8, cfg.num_layers // len(cfg.layer_pattern)
    assert cfg.layer_pattern == ("gdn", "attention")
    assert set(specs) == {"embed", "layer_0", "layer_1", "head"}
    ops_0 = {s.op for s in specs["layer_0"]}
    assert {"norm", "gdn_cp_fold", "gdn", "gdn_cp_dh_fold", "router", "fp8_amax", "fp8_fake_quant", "moe_mlp",
            "shared_expert", "moe", "mixer"} <= ops_0
    assert {"lb_ids", "attention"} <= {s.op for s in specs["layer_1"]}
    assert {"lm_head", "logp"} <= {s.op for s in specs["head"]}
    for scope in ("layer_0", "layer_1"):
        for leaf in jax.tree.leaves(fwd["layers"][scope]):
            assert leaf.shape[:2] == (n_dev, groups)
    # every backward tap has its probe, shaped like it
    assert jax.tree.structure(bwd) == jax.tree.structure(structure)


def test_backward_tap_is_the_cotangent_and_forward_tap_the_value():
    """loss = sum(logp * w): the cotangent of logp at its tap is w at every scored position and 0 at each sequence's
    last (dummy) position; the forward tap holds the returned log-probs."""
    fwd, bwd, _, logp, w, _ = _explained()
    ct = bwd["head"]["logp"]["out"].ravel()
    b = w.shape[0]
    np.testing.assert_array_equal(np.sort(ct), np.sort(np.concatenate([w.ravel(), np.zeros(b, np.float32)])))
    tapped = fwd["head"]["logp"]["out"].ravel()
    assert np.isin(logp.ravel(), tapped).all()
    assert tapped.size == logp.size + b


def test_probes_refused_by_a_default_build():
    cfg = small_cfg()
    flags = rules.flags_for(cfg, {})
    fn = transformer.build_log_probs(cfg, flags, precision="production", mesh=sharding.make_mesh(flags))
    params, tokens = _inputs()
    with pytest.raises(ValueError, match="explain=True"):
        fn(params, tokens, None, {})
