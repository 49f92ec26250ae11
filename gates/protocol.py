"""The three-step RL protocol with random advantages (docs/design.md, "The protocol").

One run = the same seeded batch (tokens, completion mask, one advantage per sequence) fed to three optimizer steps
of the GRPO policy loss, on-policy (``old = stop_gradient(logp)``, so the ratio is exactly 1), token-mean over the
completion mask, KL weight 0, ratio clipping off (available through ``ProtocolSettings.ratio_clip``), AdamW with
global-norm gradient clipping (optax). The loss value then depends only on the advantages and the mask; the gradient
carries the kernels' numerics. ``run_protocol`` returns a ``gates.record.RunRecord`` with every step's loss, per-token
log-probs, gradient, its global norm and the parameters after the update.

Routing replay (``run_protocol(..., replay=...)``): the MoE's top-k choice is discrete, and any rounding difference
upstream of a router flips the choice of the tokens nearest a tie (measured on tiny: the float32 reference would route
163 of 8192 (layer, token) pairs differently from the bf16 control at step 1, the fused SwiGLU candidate 66). A flipped
token moves its whole gradient contribution to another expert: with one random advantage per sequence that is about
1/sqrt(tokens) of the gradient per flip, so without replay the gates would measure routing flips, not the flag
(control vs reference, whole gradient, step 1: 8.2e-2 without replay and with the remat recompute free to re-route,
3.7e-2 with replay and the routing kept by the remat policy, ``model/transformer.py``).
So the control routes by its own top-k and records the experts it used at every step; the float32 reference and every
candidate replay them (their routing weights stay their own softmax probabilities, so the routers' numerics and
gradients are still compared). The report gives, per step, how many choices the candidate would have made differently.

The model is reached through a ``ModelAPI`` (the functions of ``model.config`` / ``model.transformer`` /
``model.sharding`` / ``model.ops``), so the same runner drives the real model and the toy model of the unit tests.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax

from nxgates.gates import record as record_lib
from nxgates.gates import recorder as recorder_lib
from nxgates.gates.sketch import SketchSpec

# The ratio's log is clipped to [-20, 20] before exp, as the trainer does, so a wild log-prob cannot overflow.
LOG_RATIO_CLIP = 20.0


@dataclasses.dataclass(frozen=True)
class ProtocolSettings:
    """Everything about a run that is not the model: steps, optimizer, loss options.

    Defaults: 3 steps (the gates compare every one); AdamW at an RL-scale learning rate, 1e-5 (RL recipes use ~1e-6):
    AdamW's first steps move every parameter by about lr whatever the gradient's scale, so the update (N6) is visible,
    while the three steps stay where rounding differences are not amplified by the training dynamics (measured on tiny
    at lr 1e-3: a benign k-tile reassociation's gradient distance grew from 2e-2 at step 1 to 0.25 at step 3, which
    would have forced useless tolerances); weight decay 0.1, betas (0.9, 0.95), eps 1e-8; the gradient clipped to
    global norm 1.0; no ratio clipping ("loss gates off"); KL weight 0 (anything else is refused).
    """

    steps: int = 3
    learning_rate: float = 1e-5
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    ratio_clip: float | None = None
    kl_weight: float = 0.0

    def __post_init__(self):
        if not (isinstance(self.steps, int) and self.steps >= 1):
            raise ValueError(f"ProtocolSettings: steps={self.steps!r} must be an int >= 1")
        if self.kl_weight != 0.0:
            raise NotImplementedError(f"ProtocolSettings: kl_weight={self.kl_weight!r}: only 0 is supported")
        if self.ratio_clip is not None and not (0.0 < float(self.ratio_clip) < 1.0):
            raise ValueError(f"ProtocolSettings: ratio_clip={self.ratio_clip!r} must be None or in (0, 1)")
        if not self.max_grad_norm > 0.0:
            raise ValueError(f"ProtocolSettings: max_grad_norm={self.max_grad_norm!r} must be > 0")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


DEFAULT_SETTINGS = ProtocolSettings()


def seed_for(case_id: str) -> int:
    """A stable 31-bit seed derived from a case id (``zlib.crc32``), e.g. ``seed_for("tiny/batch")``."""
    return zlib.crc32(case_id.encode()) & 0x7FFFFFFF


# The records' sketches (docs/records.md: the width from the measured error table); one seed for every run, so that
# any two records of this protocol are comparable.
DEFAULT_SKETCH = SketchSpec(seed=seed_for("nxgates/sketch"))


@dataclasses.dataclass(frozen=True)
class Batch:
    """The RL batch, the same every step.

    tokens: [B, S] int32; completion_mask: [B, S-1] float32 (1 where logp[:, t] scores a completion token t+1);
    advantages: [B] float32 (bf16-representable values).
    """

    tokens: np.ndarray
    completion_mask: np.ndarray
    advantages: np.ndarray
    seed: int

    @property
    def num_completion_tokens(self) -> int:
        return int(self.completion_mask.sum())


def make_batch(batch_size: int, seq_len: int, vocab_size: int, seed: int) -> Batch:
    """Seeded tokens, completion mask and advantages, built in numpy.

    Each sequence has a prompt of length p in [S/4, S/2] and a completion of length c in [S/4, S - p]; positions after
    the completion are padding (mask 0). logp[:, t] scores token t+1, so the completion tokens p .. p+c-1 are scored
    at t = p-1 .. p+c-2. Advantages are standard normal rounded through bfloat16, one per sequence.
    """
    for name, v in (("batch_size", batch_size), ("seq_len", seq_len), ("vocab_size", vocab_size)):
        if not (isinstance(v, (int, np.integer)) and v >= (4 if name == "seq_len" else 1)):
            raise ValueError(f"make_batch: {name}={v!r} must be an int >= {4 if name == 'seq_len' else 1}")
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab_size, size=(batch_size, seq_len), dtype=np.int64).astype(np.int32)
    mask = np.zeros((batch_size, seq_len - 1), np.float32)
    for b in range(batch_size):
        p = int(rng.integers(max(1, seq_len // 4), max(2, seq_len // 2) + 1))
        c = int(rng.integers(max(1, seq_len // 4), seq_len - p + 1))
        mask[b, p - 1 : p + c - 1] = 1.0
    adv = rng.standard_normal(batch_size).astype(np.float32)
    adv = adv.astype(ml_dtypes.bfloat16).astype(np.float32)  # bf16-representable: every side sees the same values
    return Batch(tokens=tokens, completion_mask=mask, advantages=adv, seed=int(seed))


def grpo_loss(logp, old_logp, advantages, mask, *, ratio_clip: float | None = None):
    """The GRPO policy loss, token-mean over the completion mask.

    logp, old_logp: [B, S-1] f32; advantages: [B]; mask: [B, S-1]. ratio = exp(clip(logp - old, -20, 20));
    per token -ratio * A (or, with ``ratio_clip=eps``, -min(ratio * A, clip(ratio, 1-eps, 1+eps) * A)).
    """
    logp = logp.astype(jnp.float32)
    ratio = jnp.exp(jnp.clip(logp - old_logp, -LOG_RATIO_CLIP, LOG_RATIO_CLIP))
    adv = advantages.astype(jnp.float32)[:, None]  # [B] -> [B, 1], broadcast over tokens
    per_token = ratio * adv
    if ratio_clip is not None:
        per_token = jnp.minimum(per_token, jnp.clip(ratio, 1.0 - ratio_clip, 1.0 + ratio_clip) * adv)
    mask = mask.astype(jnp.float32)
    return -jnp.sum(per_token * mask) / jnp.sum(mask)


LossFn = Callable[..., jax.Array]


def make_optimizer(settings: ProtocolSettings) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW."""
    return optax.chain(
        optax.clip_by_global_norm(settings.max_grad_norm),
        optax.adamw(settings.learning_rate, b1=settings.b1, b2=settings.b2, eps=settings.eps,
                    weight_decay=settings.weight_decay),
    )


def tree_to_named(tree) -> dict[str, np.ndarray]:
    """Nested-dict pytree -> {"a/b/c": host array}; the name is the "/".join of the dict keys."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = []
        for k in path:
            if isinstance(k, jax.tree_util.DictKey):
                parts.append(str(k.key))
            elif isinstance(k, jax.tree_util.SequenceKey):
                parts.append(str(k.idx))
            elif isinstance(k, jax.tree_util.GetAttrKey):
                parts.append(str(k.name))
            else:
                parts.append(str(k))
        out["/".join(parts)] = np.asarray(leaf)
    return out


def replay_routing(steps: Sequence[record_lib.StepRecord]) -> list[np.ndarray] | None:
    """The experts each step used, as other runs replay them (None for a model without routing)."""
    routes = [s.routing for s in steps]
    return None if any(r is None for r in routes) else routes


def run_protocol(
    log_probs_fn: Callable,
    params,
    batch: Batch,
    settings: ProtocolSettings = DEFAULT_SETTINGS,
    *,
    metadata: Mapping[str, Any] | None = None,
    loss_fn: LossFn = grpo_loss,
    progress: Callable[[str], None] | None = None,
    label: str = "run",
    replay: Sequence[np.ndarray] | None = None,
    lookup: Callable[[str], record_lib.RunRecord | None] | None = None,
    sketch: SketchSpec | None = None,
    recorder: recorder_lib.Recorder | None = None,
    summaries: bool = True,
    on_steps: Callable[[list[np.ndarray] | None], None] | None = None,
) -> record_lib.RunRecord:
    """Run ``settings.steps`` optimizer steps of the RL loss and record every step.

    log_probs_fn(params, tokens[B, S]) -> (logp[B, S-1] f32, aux with "dropped_tokens"). ``loss_fn`` has
    ``grpo_loss``'s signature (the mutants replace it). ``params`` is the float32 initial pytree.

    Routing replay: a model with discrete routing exposes ``log_probs_fn.routing_shape`` and takes
    ``log_probs_fn(params, tokens, (ids, on))``; its aux then carries "routing" (the experts used) and
    "routing_mismatch", recorded per step. ``replay=None``: every step routes by its own top-k (the control);
    ``replay=[ids of step 1, ...]``: step i uses those experts (the candidate and the reference replay the control's).
    Both run the same program (``on`` is data), so an exact flag stays bit-identical under replay.

    ``lookup(program_sha256)``: called once the model's program is lowered (before it is compiled), with the sha256 of
    its StableHLO text (no source locations: a docstring or comment edit leaves it unchanged); a record it returns is
    returned as is (the caller keys it with the inputs, ``gates.provenance.program_record_key``), else the run goes
    on. ``metadata["program_sha256"]`` keeps the digest.

    Summaries (docs/records.md): after every step, small programs compute, on the sharded device arrays, the
    gradient and update sketches (``sketch``: width and seed, default ``DEFAULT_SKETCH``), the bit fingerprints and
    the per-tensor gradient norms (``gates.recorder.summaries_by_tensor``: ``gates.recorder.summaries``'s bits, one
    program per tensor shape), kept in ``StepRecord.summaries``; they read the step's outputs only, so the first two
    programs are the same with or without them. ``summaries=False``: none (a record that
    is only digested and never stored, a check's candidate: ``gates.candidates``). ``recorder``: also write each step
    to that run directory as it ends (the record format; full tensors when the recorder has ``full_tensors``).

    ``on_steps(routing)``: called once the last step has run, with the experts each step used (``StepRecord.routing``,
    the list other runs replay; None for a model without routing), before the summaries: they are then computed after
    the steps instead of after each one, so the caller can start the runs that replay this one's routing (the prefetch
    workers, while the control's summaries are computed). Not with ``recorder``, which writes each step as it ends.
    """
    tokens = jnp.asarray(batch.tokens)
    mask = jnp.asarray(batch.completion_mask)
    adv = jnp.asarray(batch.advantages)
    opt = make_optimizer(settings)
    if on_steps is not None and recorder is not None:
        raise ValueError("run_protocol: on_steps defers the summaries past the steps; a recorder writes each step "
                         "as it ends")
    routing_shape = getattr(log_probs_fn, "routing_shape", None)
    if replay is not None:
        if routing_shape is None:
            raise ValueError("run_protocol: replay given, but log_probs_fn has no routing_shape (no routing to replay)")
        if len(replay) != settings.steps:
            raise ValueError(f"run_protocol: replay has {len(replay)} steps, settings.steps={settings.steps}")
        for i, ids in enumerate(replay):
            if tuple(np.shape(ids)) != tuple(routing_shape):
                raise ValueError(f"run_protocol: replay[{i}].shape={tuple(np.shape(ids))} must be {routing_shape}")

    def objective(p, routing):
        if routing_shape is None:
            logp, aux = log_probs_fn(p, tokens)
        else:
            logp, aux = log_probs_fn(p, tokens, routing)
        loss = loss_fn(logp, jax.lax.stop_gradient(logp), adv, mask, ratio_clip=settings.ratio_clip)
        return loss, (logp, aux)

    # Two programs: the model's loss and gradient (what the flags change), then the optimizer step. Kept apart so that
    # the optimizer's own reductions (the global norm, the clipping) compile to the same program for every run and an
    # `exact` flag that leaves the gradient bit-identical also leaves the update bit-identical.
    @jax.jit
    def grad_step(p, routing):
        (loss, (logp, aux)), grads = jax.value_and_grad(objective, has_aux=True)(p, routing)
        aux = aux if isinstance(aux, Mapping) else {}
        dropped = jnp.asarray(aux.get("dropped_tokens", 0), jnp.int32)
        used = aux.get("routing")
        mismatch = jnp.asarray(aux.get("routing_mismatch", 0), jnp.int32)
        return loss, logp, grads, dropped, used, mismatch

    @jax.jit
    def opt_step(p, opt_state, grads):
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = opt.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, grad_norm

    def routing_arg(i):
        if routing_shape is None:
            return None
        if replay is None:
            return jnp.zeros(routing_shape, jnp.int32), jnp.bool_(False)
        return jnp.asarray(replay[i], jnp.int32), jnp.bool_(True)

    phases = {"trace_s": 0.0, "lower_s": 0.0, "compile_s": 0.0, "stablehlo_bytes": 0}
    programs = {}

    def step(p, opt_state, i):
        loss, logp, grads, dropped, used, mismatch = programs["grad"](p, routing_arg(i))
        if "opt" not in programs:
            programs["opt"] = _compile(_lower(opt_step, (p, opt_state, grads), phases)[0], phases)
        p, opt_state, grad_norm = programs["opt"](p, opt_state, grads)
        return p, opt_state, loss, logp, grads, grad_norm, dropped, used, mismatch

    params = jax.tree.map(jnp.asarray, params)
    params0 = tree_to_named(params)
    # Every step feeds the parameters (and the optimizer state) in one committed layout: the optimizer's outputs may
    # come back laid out differently, and an uncommitted first input differs from a committed later one, either of
    # which would compile the model's program again at step 2.
    layout = jax.tree.map(lambda x: x.sharding, params)
    params = jax.device_put(params, layout)
    opt_state = opt.init(params)
    # The optimizer's scalars (the step count) are created on one device; on a mesh, replicate them over it like the
    # parameters so that both programs see one device set.
    mesh = next((s.mesh for s in jax.tree.leaves(layout) if isinstance(s, jax.sharding.NamedSharding)), None)
    opt_layout = jax.tree.map(
        lambda x: x.sharding
        if mesh is None or isinstance(x.sharding, jax.sharding.NamedSharding)
        else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
        opt_state,
    )
    opt_state = jax.device_put(opt_state, opt_layout)
    # The model's program, once per run (every step feeds the same shapes and layouts): lowered first, so that a
    # caller's ``lookup`` can find the record of the same program before anything is compiled or run.
    lowered, program_sha256 = _lower(grad_step, (params, routing_arg(0)), phases)
    if lookup is not None:
        found = lookup(program_sha256)
        if found is not None:
            return found
    programs["grad"] = _compile(lowered, phases)
    if recorder is not None and not summaries:
        raise ValueError("run_protocol: a recorder writes the summaries; summaries=False cannot go with it")
    sketch = DEFAULT_SKETCH if sketch is None else sketch
    summarize = (functools.partial(recorder_lib.summaries_by_tensor, width=sketch.width, seed=sketch.seed)
                 if summaries else (lambda *a, **k: {}))
    defer = on_steps is not None
    kept = []  # with on_steps: (grads, params, the parameters before the step) per step, for the summaries after

    def summarize_timed(*args, **kwargs):
        ts = time.perf_counter()
        out = _host(summarize(*args, **kwargs))
        return out, time.perf_counter() - ts

    first = params if defer else None  # with on_steps, step 0's summaries come after the steps
    summaries0, phases["summaries_s"] = ({}, 0.0) if defer else summarize_timed(None, params)
    if recorder is not None:
        recorder.step(0, summaries={**summaries0, **_full(recorder, None, params0)})
    steps = []
    step_s, summary_s = [], []
    t0 = time.perf_counter()
    for i in range(settings.steps):
        ts = time.perf_counter()
        building = sum(phases[k] for k in ("trace_s", "lower_s", "compile_s"))
        prev = params
        params, opt_state, loss, logp, grads, grad_norm, dropped, used, mismatch = step(params, opt_state, i)
        params = jax.device_put(params, layout)
        opt_state = jax.device_put(opt_state, opt_layout)
        jax.block_until_ready(params)
        step_s.append(time.perf_counter() - ts)
        # this step's execution: its wall time less the tracing, lowering and compiling done inside it (step 1)
        phases.setdefault("execute_s", []).append(
            step_s[-1] - (sum(phases[k] for k in ("trace_s", "lower_s", "compile_s")) - building))
        if defer:
            summ = {}
            kept.append((grads, params, prev))
        else:
            summ, seconds = summarize_timed(grads, params, prev_params=prev)
            summary_s.append(seconds)
            phases["summaries_s"] += seconds
        del prev
        steps.append(
            record_lib.StepRecord(
                loss=np.asarray(loss),
                logp=np.asarray(logp),
                grads=tree_to_named(grads),
                grad_norm=np.asarray(grad_norm),
                params=tree_to_named(params),
                dropped_tokens=int(dropped),
                routing=None if used is None else np.asarray(used, np.int32),
                routing_mismatch=int(mismatch),
                summaries=summ,
            )
        )
        if recorder is not None:
            s = steps[-1]
            recorder.step(i + 1, loss=s.loss, grad_norm=s.grad_norm, log_probs=s.logp, mask=batch.completion_mask,
                          routing=s.routing, routing_mismatch=s.routing_mismatch, dropped_tokens=s.dropped_tokens,
                          summaries={**summ, **_full(recorder, s.grads, s.params)})
        if progress is not None:
            replayed = f" routing replayed ({int(mismatch)} own choices differ)" if replay is not None else ""
            progress(f"{label}: step {i + 1}/{settings.steps} loss={float(loss):.6g} "
                     f"grad_norm={float(grad_norm):.6g}{replayed} elapsed {time.perf_counter() - t0:.1f}s")
    if defer:
        on_steps(replay_routing(steps))
        summaries0, phases["summaries_s"] = summarize_timed(None, first)
        for s, (grads, params_i, prev) in zip(steps, kept, strict=True):
            s.summaries, seconds = summarize_timed(grads, params_i, prev_params=prev)
            summary_s.append(seconds)
            phases["summaries_s"] += seconds
        kept.clear()
    del first
    meta = dict(metadata or {})
    meta.setdefault("settings", settings.as_dict())
    meta.setdefault("batch_seed", batch.seed)
    meta["program_sha256"] = program_sha256
    meta["wall_s"] = round(time.perf_counter() - t0, 3)
    meta["step_s"] = [round(t, 3) for t in step_s]
    meta["summary_s"] = [round(t, 3) for t in summary_s]  # the summaries' program (first: with its compile)
    meta["sketch"] = sketch.to_json()
    # The first step includes tracing + compilation; later steps reuse the executable.
    meta["compile_s_estimate"] = round(step_s[0] - (min(step_s[1:]) if len(step_s) > 1 else 0.0), 3)
    # Per phase (``_lower``, ``_compile``): seconds to trace, lower and compile the model's and the optimizer's programs
    # (compile: from the persistent compilation cache when it has them), their StableHLO size, each step's execution,
    # and the summaries (their program compiled and run by jit, the results copied to the host).
    meta["phases"] = {k: (round(v, 3) if isinstance(v, float) else [round(t, 3) for t in v] if isinstance(v, list)
                          else v) for k, v in phases.items()}
    return record_lib.RunRecord(params0=params0, steps=steps, mask=np.asarray(batch.completion_mask), metadata=meta,
                                summaries0=summaries0)


def _lower(fn, args, phases: dict):
    """(lowered, sha256 of its StableHLO text): ``fn`` (a ``jax.jit``) traced and lowered for ``args`` ahead of time,
    each phase timed into ``phases`` (``trace_s``, ``lower_s``, ``stablehlo_bytes``). The program is the one
    ``fn(*args)`` would compile; the text has no source locations."""
    t = time.perf_counter()
    traced = fn.trace(*args)
    phases["trace_s"] += time.perf_counter() - t
    t = time.perf_counter()
    lowered = traced.lower()
    phases["lower_s"] += time.perf_counter() - t
    text = lowered.as_text().encode()
    phases["stablehlo_bytes"] += len(text)
    return lowered, hashlib.sha256(text).hexdigest()


def _compile(lowered, phases: dict):
    """The executable of a ``_lower`` result, timed into ``phases["compile_s"]`` (a persistent compilation cache hit
    is a read). Calling it with arguments of another shape or layout raises instead of compiling again, so a run is
    one compile per program."""
    t = time.perf_counter()
    compiled = lowered.compile()
    phases["compile_s"] += time.perf_counter() - t
    return compiled


def _host(tree: Mapping[str, Any]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in jax.device_get(dict(tree)).items()}


def _full(recorder, grads, params) -> dict[str, np.ndarray]:
    """The full tensors as record fields when ``recorder`` keeps them (``grad/<path>``, ``param/<path>``)."""
    if recorder is None or not recorder.full_tensors:
        return {}
    out = {f"param/{n}": a for n, a in (params or {}).items()}
    out.update({f"grad/{n}": a for n, a in (grads or {}).items()})
    return out
