"""The three-step RL protocol: batch, GRPO loss, optimizer, and the claim that the loss depends only on the
advantages and the mask (so candidate and control agree exactly on N1).

Run: python -m pytest tests/gates/test_protocol.py -q
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from nxgates.gates import protocol as P
from tests.gates.toy_model import toy_run


def test_batch_is_seeded_and_masks_only_completions():
    a = P.make_batch(4, 32, 50, P.seed_for("B4-S32-V50"))
    b = P.make_batch(4, 32, 50, P.seed_for("B4-S32-V50"))
    c = P.make_batch(4, 32, 50, P.seed_for("other"))
    assert a.tokens.tobytes() == b.tokens.tobytes() and a.completion_mask.tobytes() == b.completion_mask.tobytes()
    assert a.tokens.tobytes() != c.tokens.tobytes()
    assert a.tokens.dtype == np.int32 and a.tokens.shape == (4, 32) and a.completion_mask.shape == (4, 31)
    assert a.tokens.min() >= 0 and a.tokens.max() < 50
    for row in a.completion_mask:
        ones = np.flatnonzero(row)
        assert ones.size > 0 and np.all(np.diff(ones) == 1)  # one contiguous completion
        assert ones[0] >= 32 // 4 - 1  # the prompt (>= S/4 tokens) is never scored
    adv = a.advantages
    assert adv.shape == (4,) and np.array_equal(adv, adv.astype(ml_dtypes.bfloat16).astype(np.float32))
    with pytest.raises(ValueError, match="seq_len=2"):
        P.make_batch(4, 2, 50, 0)


def test_on_policy_loss_depends_only_on_advantages_and_mask():
    rng = np.random.default_rng(0)
    adv = jnp.asarray([0.5, -1.25, 2.0], jnp.float32)
    mask = jnp.asarray(rng.integers(0, 2, (3, 9)).astype(np.float32))
    expected = -float(np.sum(np.asarray(adv)[:, None] * np.asarray(mask)) / np.sum(np.asarray(mask)))
    losses = []
    for seed in range(3):  # three unrelated log-prob tensors, one of them wild
        logp = jnp.asarray(rng.standard_normal((3, 9)).astype(np.float32) * (1 + 100 * seed))
        losses.append(float(P.grpo_loss(logp, jax.lax.stop_gradient(logp), adv, mask)))
    assert losses[0] == losses[1] == losses[2] == pytest.approx(expected, rel=1e-6)
    # and its gradient with respect to the log-probs is -A * mask / count, whatever the log-probs are
    logp = jnp.asarray(rng.standard_normal((3, 9)).astype(np.float32))
    g = jax.grad(lambda lp: P.grpo_loss(lp, jax.lax.stop_gradient(lp), adv, mask))(logp)
    np.testing.assert_allclose(g, -np.asarray(adv)[:, None] * np.asarray(mask) / float(np.sum(np.asarray(mask))),
                               rtol=1e-6)


def test_ratio_clip_and_log_ratio_clip():
    adv = jnp.asarray([1.0], jnp.float32)
    mask = jnp.ones((1, 1), jnp.float32)
    old = jnp.zeros((1, 1), jnp.float32)
    logp = jnp.log(jnp.asarray([[1.5]], jnp.float32))  # ratio 1.5
    assert float(P.grpo_loss(logp, old, adv, mask)) == pytest.approx(-1.5, rel=1e-6)
    assert float(P.grpo_loss(logp, old, adv, mask, ratio_clip=0.2)) == pytest.approx(-1.2, rel=1e-6)
    huge = jnp.asarray([[50.0]], jnp.float32)  # log ratio clipped to 20 before exp
    assert float(P.grpo_loss(huge, old, adv, mask)) == pytest.approx(-float(np.exp(np.float32(20))), rel=1e-6)


def test_settings_refuse_bad_values():
    with pytest.raises(NotImplementedError, match="kl_weight=0.1"):
        P.ProtocolSettings(kl_weight=0.1)
    with pytest.raises(ValueError, match="steps=0"):
        P.ProtocolSettings(steps=0)
    with pytest.raises(ValueError, match="ratio_clip=1.5"):
        P.ProtocolSettings(ratio_clip=1.5)


def test_optimizer_clips_the_global_norm_then_adamw():
    s = P.ProtocolSettings(max_grad_norm=1.0)
    params = {"a": jnp.ones((3,), jnp.float32), "b": jnp.full((2,), 2.0, jnp.float32)}
    g1 = {"a": jnp.asarray([3.0, 0.0, -4.0]), "b": jnp.asarray([0.0, 0.0])}  # global norm 5: clipped to 1
    g2 = {"a": jnp.asarray([0.1, 0.2, 0.0]), "b": jnp.asarray([0.0, 0.1])}  # norm < 1: untouched
    opt = P.make_optimizer(s)
    state = opt.init(params)
    _, state = opt.update(g1, state, params)
    upd, _ = opt.update(g2, state, params)
    adamw = optax.adamw(s.learning_rate, b1=s.b1, b2=s.b2, eps=s.eps, weight_decay=s.weight_decay)
    ref_state = adamw.init(params)
    _, ref_state = adamw.update(jax.tree.map(lambda g: g / 5.0, g1), ref_state, params)
    expect, _ = adamw.update(g2, ref_state, params)
    for k in params:  # the second update depends on the first gradient's scale: only the clipped one matches
        np.testing.assert_allclose(upd[k], expect[k], rtol=1e-5)
    # the weight decay is there: a parameter whose gradients are 0 moves by -lr * wd * p
    np.testing.assert_allclose(upd["b"][0], -s.learning_rate * s.weight_decay * 2.0, rtol=1e-5)


def test_toy_run_records_every_step():
    rec = toy_run("control")
    assert rec.num_steps == 3
    assert set(rec.params0) == {"embed", "mlp/w_in", "mlp/w_out", "head"}
    for i, s in enumerate(rec.steps):
        assert s.loss.dtype == np.float32 and s.logp.shape == (4, 11) and s.dropped_tokens == 0
        assert set(s.grads) == set(rec.params0)
        gn = np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in s.grads.values()))
        assert float(s.grad_norm) == pytest.approx(gn, rel=1e-5)
        prev = rec.params0 if i == 0 else rec.steps[i - 1].params
        assert all(not np.array_equal(s.params[n], prev[n]) for n in prev)  # every tensor moved
    assert rec.metadata["implementations"] == {"activation": "silu", "mlp": "unfused"}
    assert rec.metadata["settings"]["steps"] == 3 and len(rec.metadata["step_s"]) == 3


def test_loss_is_bit_identical_across_flags_and_precisions():
    """The ratio is exactly 1: control, a rounding candidate and the float32 reference agree on every step's loss,
    while their log-probs and gradients differ."""
    control = toy_run("control")
    fused = toy_run("fused", {"moe_wi_gmm_fused_swiglu": True})
    reference = toy_run("reference", precision="reference")
    batch = P.make_batch(4, 12, 32, P.seed_for("toy/batch"))
    expected = np.float32(-np.sum(batch.advantages[:, None] * batch.completion_mask) / batch.completion_mask.sum())
    for i in range(3):
        losses = {r.steps[i].loss.tobytes() for r in (control, fused, reference)}
        assert len(losses) == 1
        assert float(control.steps[i].loss) == pytest.approx(float(expected), rel=1e-6)
        assert not np.array_equal(control.steps[i].grads["mlp/w_in"], fused.steps[i].grads["mlp/w_in"])
        assert not np.array_equal(control.steps[i].logp, reference.steps[i].logp)


def test_exact_flag_gives_bit_identical_run_and_is_reproducible():
    control = toy_run("control")
    again = toy_run("control again")
    hoisted = toy_run("gather8", {"fp8_fake_quant_hoist": "gather8"})
    for other in (again, hoisted):
        for a, b in zip(control.steps, other.steps, strict=True):
            assert a.grad_norm.tobytes() == b.grad_norm.tobytes() and a.logp.tobytes() == b.logp.tobytes()
            assert all(a.params[n].tobytes() == b.params[n].tobytes() for n in a.params)


def test_params_on_a_mesh_run_every_step_with_one_compile_each():
    """Parameters sharded over an 8-device mesh (as the model's are): the optimizer's scalar state must follow them
    onto the mesh (a step count left on one device makes step 1 fail with incompatible devices), and steps 2 and 3
    reuse the programs compiled at step 1."""
    import logging

    mesh = jax.make_mesh((8,), ("fsdp",))
    vocab, seq = 16, 12
    batch = P.make_batch(8, seq, vocab, P.seed_for("mesh-B8-S12-V16"))
    rng = np.random.default_rng(P.seed_for("mesh-params"))
    params = {"w": rng.standard_normal((vocab, vocab)).astype(np.float32) * 0.1}
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    params = jax.device_put(params, {"w": sharding})

    def log_probs(p, tokens):
        logits = jax.nn.one_hot(tokens[:, :-1], vocab) @ p["w"]  # [B, S-1, V]
        logp = jax.nn.log_softmax(logits, axis=-1)
        return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0], {"dropped_tokens": 0}

    compiled = []

    class _Collect(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            if msg.startswith("Compiling") and ("grad_step" in msg or "opt_step" in msg):
                compiled.append(msg.split(" with ")[0])

    handler = _Collect()
    logger = logging.getLogger("jax")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        with jax.log_compiles(True):
            rec = P.run_protocol(log_probs, params, batch)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert len(rec.steps) == 3 and all(np.isfinite(s.grad_norm) for s in rec.steps)
    assert sorted(compiled) == ["Compiling jit(grad_step)", "Compiling jit(opt_step)"], compiled


def _routing_toy(vocab: int = 11, shape=(1, 2, 2, 8, 2)):
    """A log-probs function with routing (``routing_shape``): the experts used scale the logits."""

    def log_probs(p, tokens, routing):
        ids, on = routing
        own = jnp.full(shape, 3, jnp.int32)
        used = jnp.where(on, ids, own)
        logits = jax.nn.one_hot(tokens[:, :-1], vocab) @ p["w"] * (1.0 + jnp.mean(used.astype(jnp.float32)))
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tokens[:, 1:, None], axis=-1)[..., 0]
        mismatch = jnp.sum(jnp.any(used != own, axis=-1)).astype(jnp.int32)
        return logp, {"dropped_tokens": 0, "routing": used, "routing_mismatch": mismatch}

    log_probs.routing_shape = shape
    return log_probs


def test_on_steps_gets_the_routing_before_the_summaries_and_changes_no_bit(monkeypatch):
    """on_steps is called once, after the last step and before any summary is computed, with the routing every step
    used (what other runs replay); the record, summaries included, is the same to the bit as without it. A recorder
    (which writes each step as it ends) cannot go with it."""
    from nxgates.gates import recorder

    vocab, shape = 11, (1, 2, 2, 8, 2)
    batch = P.make_batch(2, 8, vocab, P.seed_for("replay-B2-S8-V11"))
    params = {"w": jnp.asarray(np.random.default_rng(1).standard_normal((vocab, vocab)), jnp.float32)}
    replay = [np.full(shape, v, np.int32) for v in (3, 5, 7)]
    plain = P.run_protocol(_routing_toy(), params, batch, replay=replay)
    events = []
    real = recorder.summaries_by_tensor
    monkeypatch.setattr(recorder, "summaries_by_tensor", lambda *a, **k: events.append("summaries") or real(*a, **k))
    deferred = P.run_protocol(_routing_toy(), params, batch, replay=replay,
                              on_steps=lambda routing: events.append(routing))
    assert len(events) == 1 + 1 + 3 and isinstance(events[0], list), events  # the routing, then step 0 and 3 steps
    assert [int(r[0, 0, 0, 0, 0]) for r in events[0]] == [3, 5, 7]
    for a, b in zip(plain.steps, deferred.steps, strict=True):
        assert a.loss.tobytes() == b.loss.tobytes() and a.routing.tobytes() == b.routing.tobytes()
        assert all(a.params[n].tobytes() == b.params[n].tobytes() for n in a.params)
        assert list(a.summaries) == list(b.summaries) and a.summaries
        assert all(a.summaries[k].tobytes() == b.summaries[k].tobytes() for k in a.summaries)
    assert list(plain.summaries0) == list(deferred.summaries0) and plain.summaries0
    assert all(plain.summaries0[k].tobytes() == deferred.summaries0[k].tobytes() for k in plain.summaries0)
    with pytest.raises(ValueError, match="on_steps defers the summaries"):
        P.run_protocol(_routing_toy(), params, batch, on_steps=print, recorder=object())


def test_routing_replay_is_passed_per_step_and_recorded():
    """A model with routing: without replay every step gets (zeros, off) and its own choice is recorded; with replay,
    step i gets (replay[i], on); the record keeps the experts used and the mismatch count; a replay for a model without
    routing, or of the wrong length or shape, is refused by name."""
    vocab, shape = 11, (1, 2, 2, 8, 2)
    batch = P.make_batch(2, 8, vocab, P.seed_for("replay-B2-S8-V11"))
    params = {"w": jnp.asarray(np.random.default_rng(1).standard_normal((vocab, vocab)), jnp.float32)}
    log_probs = _routing_toy(vocab, shape)
    own = P.run_protocol(log_probs, params, batch)
    assert all(np.array_equal(s.routing, np.full(shape, 3)) and s.routing_mismatch == 0 for s in own.steps)
    replay = [np.full(shape, v, np.int32) for v in (3, 5, 7)]
    rep = P.run_protocol(log_probs, params, batch, replay=replay)
    assert [int(s.routing[0, 0, 0, 0, 0]) for s in rep.steps] == [3, 5, 7]
    assert [s.routing_mismatch for s in rep.steps] == [0, 32, 32]  # every (layer, token) pair of the 1 x 2 x 2 x 8
    assert own.steps[0].logp.tobytes() == rep.steps[0].logp.tobytes()  # replaying the own choice changes nothing
    assert own.steps[1].logp.tobytes() != rep.steps[1].logp.tobytes()
    with pytest.raises(ValueError, match="replay has 2 steps"):
        P.run_protocol(log_probs, params, batch, replay=replay[:2])
    with pytest.raises(ValueError, match=r"replay\[0\].shape=\(2,\)"):
        P.run_protocol(log_probs, params, batch, replay=[np.zeros(2, np.int32)] * 3)

    def no_routing(p, tokens):
        return log_probs(p, tokens, (jnp.zeros(shape, jnp.int32), False))[0], {"dropped_tokens": 0}

    with pytest.raises(ValueError, match="no routing_shape"):
        P.run_protocol(no_routing, params, batch, replay=replay)


def test_protocol_writes_the_record_format_step_by_step(tmp_path):
    """One format: run_protocol with a Recorder writes each step as it ends; the run directory reads back as the same
    RunRecord (bits), and its in-step summaries (computed on the device arrays) equal the host record's."""
    from nxgates.gates import compare, recorder, records, runner
    from nxgates.gates import record as record_lib
    from tests.gates import toy_model

    r = runner.Runner("toy", api=toy_model.api(), use_cache=False, progress=None)
    flags = r.flags_from({})
    fn = r.api.build_log_probs(r.cfg, flags, precision="production", mesh=None)
    with recorder.Recorder(tmp_path / "run", sketch_width=64, seed=1, full_tensors=True) as rec:
        out = P.run_protocol(fn, r.params0(), r.batch, sketch=P.SketchSpec(width=64, seed=1), recorder=rec)
    run = records.load_run(tmp_path / "run")
    assert run.step_numbers == [1, 2, 3] and run.meta["closed"] and run.spec == P.SketchSpec(width=64, seed=1)
    back = record_lib.from_run(run)
    for a, b in zip(out.steps, back.steps, strict=True):
        assert a.loss.tobytes() == b.loss.tobytes() and a.logp.tobytes() == b.logp.tobytes()
        assert all(a.grads[n].tobytes() == b.grads[n].tobytes() for n in a.grads)
        assert sorted(a.summaries) == sorted(b.summaries)
        assert all(np.array_equal(a.summaries[k], b.summaries[k]) for k in a.summaries)
    assert out.steps[0].summaries and "update_sketch/" in " ".join(out.steps[0].summaries)
    rep = compare.compare(run, run, run, contract="exact")
    assert rep.exit_code == 0 and rep.judged == ["N1", "N2", "N3", "N4", "N5", "N6"]
