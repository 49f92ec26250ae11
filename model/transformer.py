"""The transformer: parameters, the scanned layer stack under remat, and per-token log-probs on the device mesh.

Public API (what ``gates.model_api.default_model_api`` wires into the gates):

- ``init_params(cfg, seed) -> params``: nested dict of float32 arrays (the master weights); names are the ``/``-joined
  keys, e.g. ``layers/layer_0/gdn/q_proj`` (stacked: leading dim = number of layer groups).
- ``build_log_probs(cfg, flags, *, precision, mesh) -> fn(params, tokens[B, S] int32, routing=None) -> (logp[B, S-1]
  f32, aux)``, ``logp[b, t] = log p(tokens[b, t+1] | tokens[b, :t+1])``, ``aux = {"dropped_tokens": int32 scalar,
  "routing": int32 [G, 4, B, S, k] (the experts each token used, per layer), "routing_mismatch": int32 scalar}``.
  Routing replay: ``routing=(ids [G, 4, B, S, k], on)`` (``fn.routing_shape``); where ``on``, every MoE layer uses
  ``ids`` instead of its own top-k (``model.moe.route``), and ``routing_mismatch`` counts the (layer, token) pairs
  whose own top-k set differs from ``ids``. The same program runs with ``on`` false (no replay): the gates' control
  records its routing that way and the candidate and the float32 reference replay it (``gates/protocol.py``).
  ``fn.implementations()``: ``{op: implementation}`` of every op the last trace of ``fn`` dispatched (``model.ops``).

Structure: embedding -> ``num_layers`` pre-norm residual blocks (mixer in the pattern gdn, gdn, gdn, attention; each
followed by a MoE block) -> final RMSNorm -> untied LM head -> ``log_softmax`` in float32.

Scan: the layers are grouped by the pattern period (4): ``params["layers"]["layer_i"]`` holds the i-th layer of every
group, stacked ``[G, ...]`` (G = num_layers / 4), and one ``jax.lax.scan`` runs over the G groups, the 4 layers of a
group unrolled in its body (``scan_layers=false``: a Python loop over groups instead). Each layer (mixer + MoE) is one
``jax.checkpoint`` under the remat policy: ``full`` saves nothing, ``minimal`` saves matmul outputs without batch dims,
``custom`` saves the names chosen per tensor: ``query_proj`` (``query_proj=device``) and ``query_proj_kernel`` (the
gathered query kernel, ``query_proj_kernel_gather_once``); everything else is recomputed in the backward.

Mesh: the whole forward is one ``jax.shard_map`` over ``("fsdp", "context", "expert")`` with named collectives (see
``model/sharding.py`` for the weight layout, ``model/layers.py`` for the sequence layout, ``model/moe.py`` for the
experts). Batch over ``("fsdp", "expert")``, sequence over ``context``. With load balancing the tokens are permuted into
the zigzag layout before the ``shard_map`` and the log-probs permuted back after it.

Hoisted per flags, before the scan: the attention ids (``context_parallel_attention_load_balance_hoist_ids``, read by
every attention layer and its remat replay) and the fp8 codes and scales of every layer's experts
(``fp8_fake_quant_hoist=gather8``).

Run: ``python -m nxgates.model.bench`` (one forward + backward of tiny on 8 host devices); tests: ``tests/model/``.
"""

from __future__ import annotations

import contextlib
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from nxgates.model import rules as rules_lib
from nxgates.model import sharding as sh
from nxgates.model import taps as taps_lib
from nxgates.model.layers import (
    F32,
    Ctx,
    Dims,
    Weights,
    attention_ids,
    attention_layer,
    attention_param_shapes,
    gdn_layer,
    gdn_param_shapes,
    rms_norm,
    zigzag_order,
)
from nxgates.model.moe import ROUTING_NAME, hoist_fp8, moe_block, moe_param_shapes

PRECISIONS = ("production", "reference", "lens")
# check_vma=False: the Pallas kernels' pallas_calls declare their outputs without a manual_axis_type, which
# check_vma=True refuses. Without the varying-axes types, shard_map's transpose sums each input's cotangent over the
# mesh axes its spec does not mention (context / expert for the weights): exactly the gradient of the replicated
# weights; every collective used here (all_gather, psum_scatter, ppermute) transposes to its exact adjoint.
CHECK_VMA = False
_LAYER_SHAPES = {"gdn": gdn_param_shapes, "attention": attention_param_shapes}


def layer_groups(cfg) -> tuple[tuple[str, ...], int]:
    """``(the layer pattern, the number of groups)``: the model scans ``num_layers / len(layer_pattern)`` groups, each
    the pattern's layers in order (the trainer's: three GDN layers, then one attention layer)."""
    pattern = tuple(cfg.layer_pattern)
    if not pattern or any(kind not in _LAYER_SHAPES for kind in pattern):
        raise ValueError(f"layer_pattern={pattern!r} must be a non-empty tuple of {tuple(_LAYER_SHAPES)}")
    if cfg.num_layers % len(pattern):
        raise ValueError(f"num_layers={cfg.num_layers} must be a multiple of the pattern length {len(pattern)}")
    return pattern, cfg.num_layers // len(pattern)


def param_shapes(cfg) -> dict:
    """Nested dict of parameter shapes (tuples)."""
    pattern, groups = layer_groups(cfg)
    d = Dims.from_config(cfg)
    layers = {}
    for i, kind in enumerate(pattern):
        layer = {kind: _LAYER_SHAPES[kind](d), "moe": moe_param_shapes(d)}
        layers[f"layer_{i}"] = jax.tree_util.tree_map(
            lambda s: (groups, *s), layer, is_leaf=lambda x: isinstance(x, tuple)
        )
    return {
        "embed": {"embedding": (d.vocab, d.d_model)},
        "layers": layers,
        "final_norm": {"scale": (d.d_model,)},
        "lm_head": {"kernel": (d.d_model, d.vocab)},
    }


def _init_tensor(name: str, shape: tuple[int, ...], rng: np.random.Generator, std: float) -> np.ndarray:
    leaf = name.rsplit("/", 1)[-1]
    if leaf in ("norm", "scale", "q_norm", "k_norm", "out_norm"):
        return np.ones(shape, np.float32)
    if leaf == "A_log":  # decay rates A in [1, 16]
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if leaf == "dt_bias":  # softplus(dt_bias) = dt in [1e-3, 1e-1], log-uniform
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), shape))
        return (dt + np.log(-np.expm1(-dt))).astype(np.float32)
    if leaf == "conv":
        return (rng.standard_normal(shape) / np.sqrt(shape[-2])).astype(np.float32)
    return (rng.standard_normal(shape) * std).astype(np.float32)


def init_params(cfg, seed: int) -> dict:
    """Float32 master parameters; each tensor from its own numpy generator seeded by ``crc32(f"{seed}/{name}")``."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise ValueError(f"seed={seed!r} must be an int")
    shapes = param_shapes(cfg)

    def make(path, shape):
        name = "/".join(k.key for k in path)
        rng = np.random.default_rng(zlib.crc32(f"{int(seed)}/{name}".encode()))
        return jnp.asarray(_init_tensor(name, shape, rng, float(cfg.init_scale)))

    return jax.tree_util.tree_map_with_path(make, shapes, is_leaf=lambda x: isinstance(x, tuple))


def _remat_policy(flags):
    """The layer's remat policy. Every policy also keeps the MoE routing decision (``moe_routing``, int32 [T, k] per
    layer, ``model.moe.route``): the backward's recompute of a layer is not bit-identical to its forward (XLA compiles
    it into another program), and at a near-tie the recomputed top-k would choose other experts than the forward did,
    so the backward would differentiate a routing the forward never took (measured on the reduced tiny config of
    tests/model/test_transformer.py, no replay against a replay of the same routing, custom policy: max |difference| /
    max |gradient| of the last layer's expert weights 0.19 on the 2x2x2 mesh, 0.59 on one device; that test now
    demands bit-identity)."""
    cp = jax.checkpoint_policies
    if flags.remat_policy == "full":
        base = cp.nothing_saveable
    elif flags.remat_policy == "minimal":
        base = cp.dots_with_no_batch_dims_saveable
    elif flags.remat_policy == "custom":
        names = []
        if flags.query_proj == "device":
            names.append("query_proj")
        if flags.query_proj_kernel_gather_once:
            names.append("query_proj_kernel")
        base = cp.save_only_these_names(*names)
    else:
        raise ValueError(f"remat_policy={flags.remat_policy!r} must be 'full', 'minimal' or 'custom'")
    return cp.save_from_both_policies(base, cp.save_only_these_names(ROUTING_NAME))


def _local_gather_dims(spec_tree) -> dict:
    """Per layer tensor: the fsdp dim of the per-layer (stack dim dropped) local shard."""

    def dim(spec):
        d = sh.gather_dim(spec)
        return None if d is None else d - 1

    return jax.tree_util.tree_map(dim, spec_tree, is_leaf=lambda x: isinstance(x, P))


def _scope(ctx, name, probes):
    """The taps' scope ``name`` when explaining (``model.taps``), else nothing."""
    return contextlib.nullcontext() if ctx.taps is None else ctx.taps.scope(name, probes)


def build_log_probs(cfg, flags, *, precision: str, mesh, explain: bool = False):
    """``fn(params, tokens) -> (logp [B, S-1] f32, {"dropped_tokens": int32})`` on ``mesh``; jittable, differentiable.

    ``precision="production"``: bf16 compute from the f32 master weights, f32 accumulation, the kernels the flags
    select; ``"reference"``: float32 everywhere through the ``reference/`` ops (same layout and collectives);
    ``"lens"``: the production code path (the same kernels, fused epilogues, folds, hoists and tiles) with float32
    activations and weights, every matmul at HIGHEST. fp8 fake-quant keeps its e4m3 grid in the lens (the codes and
    scales from the float32 master weights, as in the reference), so the hoist is compared like for like.

    ``explain=True`` (``gates.explain`` only; ``model/taps.py``): ``fn(params, tokens, routing, probes)`` also returns
    the taps' forward values in ``aux["taps"]`` (``{scope: {key: {part: [devices, ...]}}}``, layer scopes stacked per
    layer group: ``[devices, G, ...]``), and the gradient with respect to ``probes`` (zeros shaped by
    ``fn.probe_shapes(params, tokens, routing)``) is the taps' backward values; ``fn.tap_specs()`` lists each scope's
    taps in trace order. ``explain=False`` builds exactly the program it always did.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} must be one of {PRECISIONS}")
    rules_lib.validate(cfg, flags)
    sizes = sh.axis_sizes(mesh)
    for axis in sh.AXES:
        key = f"ici_{axis}_parallelism"
        if getattr(flags, key) != sizes[axis]:
            raise ValueError(f"{key}={getattr(flags, key)} but the mesh's {axis} axis has {sizes[axis]} devices "
                             f"(mesh.shape={dict(mesh.shape)}); build the mesh with model.sharding.make_mesh(flags)")
    pattern, groups = layer_groups(cfg)
    dims = Dims.from_config(cfg)
    lb = bool(flags.context_parallel_attention_load_balance) and sizes["context"] > 1
    ctx = Ctx(
        dims=dims, flags=flags, precision=precision, fsdp=sizes["fsdp"], context=sizes["context"],
        expert=sizes["expert"], seq_len=cfg.seq_len, load_balance=lb,
        interpret=mesh.devices.flat[0].platform == "cpu", taps=taps_lib.TapSession() if explain else None,
    )
    shapes = param_shapes(cfg)
    shape_structs = jax.tree_util.tree_map(
        lambda s: jax.ShapeDtypeStruct(s, F32), shapes, is_leaf=lambda x: isinstance(x, tuple)
    )
    specs = sh.param_specs(shape_structs, mesh)
    gdims = _local_gather_dims(specs["layers"])
    policy = _remat_policy(flags)
    hoist_ids = bool(flags.context_parallel_attention_load_balance_hoist_ids)
    gather8 = bool(flags.fp8_moe_fake_quant) and flags.fp8_fake_quant_hoist == "gather8"
    batch_ranks = sizes["fsdp"] * sizes["expert"]
    seq_multiple = sizes["context"] * (2 if lb else 1)

    norm = functools.partial(rms_norm, eps=dims.norm_eps, out_dtype=ctx.cdt)

    def layer(kind, i, x, lp, hoisted, ids, replay, probes=None):
        with _scope(ctx, f"layer_{i}", probes) as scope:
            gd = gdims[f"layer_{i}"]
            Wx = Weights(ctx, lp[kind], gd[kind])
            h = ctx.tap_call("norm", norm, (x, Wx("norm", F32)), ("x", "scale"), (0,), "mixer")
            mix = gdn_layer(ctx, Wx, h) if kind == "gdn" else attention_layer(ctx, Wx, h, ids)
            x = x + ctx.tap("mixer", mix)
            Wm = Weights(ctx, lp["moe"], gd["moe"])
            h = ctx.tap_call("norm", norm, (x, Wm("norm", F32)), ("x", "scale"), (0,), "moe")
            hoisted_wi, hoisted_wo = (None, None) if hoisted is None else (hoisted["wi"], hoisted["wo"])
            y, dropped, own = moe_block(ctx, Wm, h, hoisted_wi, hoisted_wo, replay)
            y = ctx.tap("moe", y)
        if ctx.taps is None:
            return x + y, (dropped, own)
        return x + y, (dropped, own, scope.forward)

    layer_fns = [
        jax.checkpoint(functools.partial(layer, kind, i), policy=policy, prevent_cse=not flags.scan_layers)
        for i, kind in enumerate(pattern)
    ]

    def local_forward(params, tokens, targets, replay_ids, replay_on, probes=None):
        """Per device: ``tokens, targets [B_local, S_local]``, ``replay_ids [G, P, B_local, S_local, k]`` ->
        ``(logp [B_local, S_local], dropped, own routing [G, P, B_local, S_local, k])`` (+ the forward taps when
        explaining; ``probes``: this device's, each with a leading axis of 1)."""
        if explain:
            probes = jax.tree.map(lambda a: a[0], probes)
            taps_out = {}
        table = Weights(ctx, params["embed"], {"embedding": sh.gather_dim(specs["embed"]["embedding"])})("embedding")
        x = jnp.take(table, tokens, axis=0)  # [B_l, S_l, D]
        with _scope(ctx, "embed", probes.get("embed") if explain else None) as scope:
            x = ctx.tap("embed", x)
        if explain:
            taps_out["embed"] = scope.forward
        ids = attention_ids(ctx, hoisted=True) if hoist_ids else None
        hoisted = None
        if gather8:
            hoisted = {
                f"layer_{i}": {
                    name: hoist_fp8(ctx, params["layers"][f"layer_{i}"]["moe"][name], axis=2) for name in ("wi", "wo")
                }
                for i in range(len(pattern))
            }

        def group(x, xs):
            gp, hg, rg = xs[:3]  # rg: this group's replayed routing [P, B_l, S_l, k]
            dropped = jnp.int32(0)
            owns = []
            taps_g = {}
            for i in range(len(pattern)):
                probe_args = (xs[3].get(f"layer_{i}", {}),) if explain else ()
                x, out = layer_fns[i](x, gp[f"layer_{i}"], None if hg is None else hg[f"layer_{i}"], ids,
                                      (rg[i], replay_on), *probe_args)
                dropped = dropped + out[0]
                owns.append(out[1])
                if explain:
                    taps_g[f"layer_{i}"] = out[2]
            if explain:
                return x, (dropped, jnp.stack(owns), taps_g)
            return x, (dropped, jnp.stack(owns))

        layer_probes = (probes.get("layers", {}),) if explain else ()
        if flags.scan_layers:
            x, ys = jax.lax.scan(group, x, (params["layers"], hoisted, replay_ids, *layer_probes))
            dropped, own = jnp.sum(ys[0]), ys[1]
            if explain:
                taps_out["layers"] = ys[2]
        else:
            dropped = jnp.int32(0)
            ys = []
            for gi in range(groups):
                take = functools.partial(jax.tree_util.tree_map, lambda a, gi=gi: a[gi])
                x, y = group(x, (take(params["layers"]), None if hoisted is None else take(hoisted),
                                 replay_ids[gi], *map(take, layer_probes)))
                dropped = dropped + y[0]
                ys.append(y)
            own = jnp.stack([y[1] for y in ys])
            if explain:
                taps_out["layers"] = jax.tree.map(lambda *a: jnp.stack(a), *[y[2] for y in ys])
        with _scope(ctx, "head", probes.get("head") if explain else None) as scope:
            h = ctx.tap_call("norm", norm, (x, Weights(ctx, params["final_norm"], {
                "scale": sh.gather_dim(specs["final_norm"]["scale"])})("scale", F32)), ("x", "scale"), (0,), "final")
            w_head = Weights(ctx, params["lm_head"], {"kernel": sh.gather_dim(specs["lm_head"]["kernel"])})("kernel")
            logits = ctx.tap_call("lm_head", functools.partial(ctx.dot, "BSD,DV->BSV", out_dtype=F32), (h, w_head),
                                  ("h", "kernel"), (0,))  # [B_l, S_l, V]
            logp_all = jax.nn.log_softmax(logits, axis=-1)
            logp = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]  # [B_l, S_l]
            logp = ctx.tap("logp", logp)
        dropped = jax.lax.psum(dropped, ("fsdp", "context"))
        if explain:
            taps_out["head"] = scope.forward
            return logp, dropped, own, jax.tree.map(lambda a: a[None], taps_out)
        return logp, dropped, own

    tok_spec = P(sh.BATCH_AXES, "context")
    route_spec = P(None, None, sh.BATCH_AXES, "context", None)  # [G, P, B, S, k]
    dev_spec = P(sh.AXES)  # explain: the taps and probes of every device, stacked on a leading axis
    extra = (dev_spec,) if explain else ()
    sharded = jax.shard_map(
        local_forward, mesh=mesh, in_specs=(specs, tok_spec, tok_spec, route_spec, P(), *extra),
        out_specs=(tok_spec, P(), route_spec, *extra), check_vma=CHECK_VMA
    )
    routing_shape = (groups, len(pattern), cfg.batch_size, cfg.seq_len, dims.top_k)

    def log_probs(params, tokens, routing=None, probes=None):
        if probes is not None and not explain:
            raise ValueError("probes: only a model built with explain=True takes probes")
        ctx.record.clear()  # this trace's dispatches replace the previous trace's
        if tokens.ndim != 2:
            raise ValueError(f"tokens.shape={tokens.shape} must be [B, S]")
        b, s = tokens.shape
        if s != cfg.seq_len:
            raise ValueError(f"tokens.shape={tokens.shape}: S={s} must equal seq_len={cfg.seq_len} of config")
        if b % batch_ranks:
            raise ValueError(f"tokens.shape={tokens.shape}: B={b} must be divisible by fsdp x expert = {batch_ranks}")
        if s % seq_multiple:
            raise ValueError(f"tokens.shape={tokens.shape}: S={s} must be divisible by {seq_multiple} (context ranks)")
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens.dtype={tokens.dtype} must be an integer dtype")
        tokens = tokens.astype(jnp.int32)
        targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)  # [B, S]; last is a dummy
        if lb:
            order = jnp.asarray(zigzag_order(s, sizes["context"]), jnp.int32)
            tokens, targets = tokens[:, order], targets[:, order]  # natural -> zigzag layout
        if routing is None:
            replay_ids, replay_on = jnp.zeros(routing_shape, jnp.int32), jnp.bool_(False)
        else:
            replay_ids, replay_on = routing
            if tuple(replay_ids.shape) != routing_shape:
                raise ValueError(f"routing ids shape {tuple(replay_ids.shape)} must be {routing_shape} "
                                 "(groups, pattern, batch, seq, top_k)")
            replay_ids, replay_on = jnp.asarray(replay_ids, jnp.int32), jnp.asarray(replay_on, jnp.bool_)
        # natural -> zigzag, like the tokens (replay_ids itself stays natural for the record below)
        outs = sharded(params, tokens, targets, replay_ids[:, :, :, order] if lb else replay_ids, replay_on,
                       *(({} if probes is None else probes),) if explain else ())
        logp, dropped, own = outs[:3]
        if lb:
            back = jnp.argsort(order)  # zigzag -> natural
            logp, own = logp[:, back], own[:, :, :, back]
        used = jnp.where(replay_on, replay_ids, own)
        # Tokens (per layer) whose own top-k set differs from the one used (0 without replay).
        mismatch = jnp.sum(jnp.any(jnp.sort(own, axis=-1) != jnp.sort(used, axis=-1), axis=-1)).astype(jnp.int32)
        aux = {"dropped_tokens": dropped, "routing": used, "routing_mismatch": mismatch}
        if explain:
            aux["taps"] = outs[3]
        return logp[:, : s - 1], aux

    log_probs.routing_shape = routing_shape
    if explain:
        n_dev = mesh.devices.size

        def probe_shapes(params, tokens, routing=None):
            """The global shapes of the probes (a trace without them: ``jax.eval_shape``)."""
            jax.eval_shape(functools.partial(log_probs, routing=routing), params, tokens)
            shapes = ctx.taps.shapes
            out = {"embed": {}, "head": {}, "layers": {}}
            for scope, keys in shapes.items():
                lead = (n_dev, groups) if scope.startswith("layer_") else (n_dev,)
                tree = {k: {p: jax.ShapeDtypeStruct(lead + sd.shape, sd.dtype) for p, sd in parts.items()}
                        for k, parts in keys.items()}
                if scope.startswith("layer_"):
                    out["layers"][scope] = tree
                else:
                    out[scope] = tree
            return out

        log_probs.probe_shapes = probe_shapes
        log_probs.tap_specs = lambda: dict(ctx.taps.specs)
        log_probs.pattern = pattern
        log_probs.groups = groups
    log_probs.implementations = lambda: dict(ctx.record)  # what the last trace dispatched, {op: implementation}
    return log_probs
