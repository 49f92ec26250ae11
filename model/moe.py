"""The MoE block: softmax top-k router, routed SwiGLU experts through the GMM, a sigmoid-gated shared expert.

Runs inside the model's ``shard_map`` on local shards (see ``model/layers.py`` for ``Ctx`` / ``Weights``).

Routing (float32): ``probs = softmax(h @ W_router)``, the top-k experts of each token, their probabilities renormalized
to sum to 1. Expert parallelism without dropping a token: the tokens (with their expert ids and weights) are
all-gathered over ``expert``; each expert rank sorts all (token, slot) pairs by its local expert (pairs of other ranks'
experts go last and are outside ``sum(group_sizes)``, so the GMM gives them 0), runs ``moe_mlp`` (the routing weight
applied at the wo input), scatters the rows back to (token, slot), sums the slots in float32 and reduce-scatters over
``expert`` back to its own tokens. ``dropped`` counts the pairs no expert rank processed (0 by construction; the gates
check it).

fp8 (``fp8_moe_fake_quant``): the routed ``wi [E, D, 2F]`` / ``wo [E, F, D]`` go through the fp8 grid in the forward,
one scale per (expert, output channel) (the absmax over the contraction axis, which is the fsdp-sharded one),
straight-through gradient. Per layer (``fp8_fake_quant_hoist=none``): gather the bf16 weight, absmax, quantize,
dequantize. Hoisted (``gather8``): ``hoist_fp8`` computes every layer's absmax once before the layer scan (local max,
``pmax`` over fsdp), quantizes the local shards, and the layer gathers the fp8 codes (``gathered_dequant``); the values
are the same.

Tests: ``python -m pytest tests/model/test_layers.py -q`` (the MoE block against a per-token loop, on several meshes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from nxgates import reference
from nxgates.model import ops
from nxgates.model.layers import F32, Ctx, Weights, gather_fsdp

MOE_PARAMS = ("norm", "router", "wi", "wo", "shared_wi", "shared_wo", "shared_gate")


def moe_param_shapes(d) -> dict[str, tuple[int, ...]]:
    return {
        "norm": (d.d_model,),
        "router": (d.d_model, d.num_experts),
        "wi": (d.num_experts, d.d_model, 2 * d.moe_mlp),  # [E, D, gate | up]
        "wo": (d.num_experts, d.moe_mlp, d.d_model),
        "shared_wi": (d.d_model, 2 * d.shared_mlp),
        "shared_wo": (d.shared_mlp, d.d_model),
        "shared_gate": (d.d_model, 1),
    }


def match_vma(w, like):
    """``w`` cast to varying over the mesh axes ``like`` varies over (an explicit point where the gradient is
    psum'd)."""
    missing = tuple(sorted(ops.varying_axes(like) - ops.varying_axes(w)))
    return jax.lax.pcast(w, missing, to="varying") if missing else w


# ----------------------------------------------------------------------------------------------------------------------
# fp8 expert weights
# ----------------------------------------------------------------------------------------------------------------------


def hoist_fp8(ctx: Ctx, w_stack, axis: int):
    """Quantize a layer stack of local expert shards once: ``(codes fp8, scale f32)``, scale global over fsdp.

    ``w_stack``: ``[L, E_local, K_local, N]`` float32 master shards (``axis`` = the K axis, fsdp-sharded).
    Returns codes ``[L, E_local, K_local, N]`` float8_e4m3fn and scale ``[L, E_local, 1, N]``.
    """
    w_c = w_stack.astype(ctx.cdt)  # the same cast the per-layer path applies before its gather
    amax_fn = ctx.op("fp8_amax", "absmax", hoisted=True)
    amax = amax_fn(w_c, (axis,), "fsdp" if ctx.fsdp > 1 else None)  # [L, E_l, 1, N]
    scale = ops.scale_from_amax(amax)
    codes = reference.fp8_quantize(w_c, scale)
    return jax.lax.stop_gradient(codes), jax.lax.stop_gradient(scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def gathered_dequant(w_local, codes_local, scale, dim, fsdp, dtype):
    """``fp8_dequantize(all_gather(codes), scale)``; straight-through gradient to ``w_local`` (the f32 master shard).

    The backward is what autodiff gives the per-layer path: the cotangent reduce-scattered over fsdp (in ``dtype``),
    then cast to float32.
    """
    del w_local
    return reference.fp8_dequantize(gather_fsdp(codes_local, dim, fsdp), scale, dtype)


def _gathered_dequant_fwd(w_local, codes_local, scale, dim, fsdp, dtype):
    return gathered_dequant(w_local, codes_local, scale, dim, fsdp, dtype), (w_local, codes_local, scale)


def _gathered_dequant_bwd(dim, fsdp, dtype, res, dw_hat):
    w_local, codes_local, scale = res
    dw = dw_hat
    if dim is not None and fsdp > 1:
        dw = jax.lax.psum_scatter(dw, "fsdp", scatter_dimension=dim, tiled=True)
    return dw.astype(w_local.dtype), jnp.zeros_like(codes_local), jnp.zeros_like(scale)


gathered_dequant.defvjp(_gathered_dequant_fwd, _gathered_dequant_bwd)


def expert_weight(ctx: Ctx, W: Weights, name: str, hoisted, like):
    """The routed expert weight ``name`` (``"wi"``/``"wo"``) gathered over fsdp, fp8-rounded if the flags say so."""
    f = ctx.flags
    if not f.fp8_moe_fake_quant:
        w = W(name)
    elif hoisted is not None:
        codes, scale = hoisted
        w = gathered_dequant(W.params[name], codes, scale, W.gather_dims[name], ctx.fsdp, ctx.cdt)
    else:
        w = W(name)  # [E_l, K, N]
        amax = ctx.op("fp8_amax", "absmax", hoisted=False)(w, (1,), None)  # [E_l, 1, N]
        w = ctx.op("fp8_fake_quant", "reference")(w, amax)
    if ctx.taps is not None and f.fp8_moe_fake_quant:
        # hoisted or per layer, the same taps: the scale used and the fp8-rounded weight (its cotangent in the
        # backward: the straight-through gradient)
        ctx.taps.forward("fp8_amax", {"scale": hoisted[1] if hoisted is not None else ops.scale_from_amax(amax)},
                         name)
        w = ctx.tap("fp8_fake_quant", w, name)
    return match_vma(w, like)


# ----------------------------------------------------------------------------------------------------------------------
# routing and the block
# ----------------------------------------------------------------------------------------------------------------------


ROUTING_NAME = "moe_routing"  # the remat name of the routing decision


def route(ctx: Ctx, h_td, w_router, replay=None):
    """Top-k softmax routing in float32: ``(weights [T, k] f32 renormalized, experts [T, k] int32, own [T, k] int32)``.

    ``own`` is this run's top-k. ``replay``: ``None``, or ``(ids [T, k] int32, on: bool scalar)``: where ``on``, the
    experts are ``ids`` (another run's choice, routing replay) instead of ``own``. Either way the weights are this run's
    own softmax probabilities at the chosen experts, renormalized, so the router's numerics and gradient stay this
    run's; only the discrete choice is shared. The selection is an integer ``where``: the same program whether or not
    replay is on, and with ``ids == own`` the result is bit-identical to no replay.
    """
    prec = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("TD,DE->TE", h_td.astype(F32), w_router.astype(F32), precision=prec)  # [T, E]
    probs = jax.nn.softmax(logits, axis=-1)
    own = jax.lax.top_k(jax.lax.stop_gradient(probs), ctx.dims.top_k)[1].astype(jnp.int32)  # [T, k]
    top_e = own if replay is None else jnp.where(replay[1], replay[0], own)
    # Saved by every remat policy (model.transformer._remat_policy): the backward uses the experts the forward chose.
    top_e = checkpoint_name(top_e, ROUTING_NAME)
    top_w = jnp.take_along_axis(probs, top_e, axis=-1)  # [T, k]
    top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    return top_w, top_e, own


def _moe_impl(ctx: Ctx):
    f = ctx.flags
    if ctx.reference:
        return ctx.op("moe_mlp", "reference")
    from nxgates.model.flags import moe_tiles

    return ctx.op(
        "moe_mlp",
        "pallas",
        fused_swiglu=bool(f.moe_wi_gmm_fused_swiglu),
        fused_dswiglu=bool(f.moe_wo_gmm_fused_dswiglu),
        router_grad_from_wo_input=bool(f.moe_router_grad_from_wo_input),
        tiles=moe_tiles(f),
        interpret=ctx.interpret,
    )


def moe_block(ctx: Ctx, W: Weights, h, hoisted_wi=None, hoisted_wo=None, replay=None):
    """MoE on the normalized input ``h [B, S_local, D]``; returns ``(y [B, S_local, D], dropped int32 scalar,
    own [B, S_local, k] int32)``: ``own`` is this run's top-k choice; ``replay``: ``(ids [B, S_local, k], on)``
    (``route``).
    """
    d = ctx.dims
    b, s_local, dm = h.shape
    k = d.top_k
    h_td = h.reshape(b * s_local, dm)  # [T, D] local tokens
    if replay is not None:
        replay = (replay[0].reshape(b * s_local, k), replay[1])
    top_w, top_e, own = route(ctx, h_td, W("router", F32), replay)
    top_w = ctx.tap("router", top_w)  # the renormalized routing weights [T, k]
    ep, e_local = ctx.expert, d.num_experts // ctx.expert
    if ep > 1:
        # every expert rank sees the tokens of all expert ranks (rank-major), [N = ep * T, ...]
        x_all = jax.lax.all_gather(h_td, "expert", axis=0, tiled=True)
        w_all = jax.lax.all_gather(top_w, "expert", axis=0, tiled=True)
        e_all = jax.lax.all_gather(top_e, "expert", axis=0, tiled=True)
        first = jax.lax.axis_index("expert") * e_local
    else:
        x_all, w_all, e_all, first = h_td, top_w, top_e, 0
    n = x_all.shape[0]
    # (token, slot) pairs, flattened [N * k]
    local = e_all.reshape(n * k) - first
    is_local = (local >= 0) & (local < e_local)
    key = jnp.where(is_local, local, e_local)  # other ranks' experts sort last
    order = jnp.argsort(key, stable=True)  # [N * k]
    group_sizes = jnp.bincount(key, length=e_local + 1)[:e_local].astype(jnp.int32)  # [E_local]
    token_of_pair = order // k
    x_sorted = jnp.take(x_all, token_of_pair, axis=0).astype(ctx.cdt)  # [N * k, D]
    r_sorted = jnp.take(jnp.where(is_local, w_all.reshape(n * k), 0.0), order)  # [N * k] f32
    wi = expert_weight(ctx, W, "wi", hoisted_wi, x_sorted)  # [E_l, D, 2F]
    wo = expert_weight(ctx, W, "wo", hoisted_wo, x_sorted)  # [E_l, F, D]
    y_sorted = ctx.tap_call("moe_mlp", _moe_impl(ctx), (x_sorted, wi, wo, group_sizes, r_sorted),
                            ("x", "wi", "wo", "group_sizes", "route_weights"), (0, 1, 2, 4))  # [N * k, D]
    inverse = jnp.argsort(order)  # sorted row of each pair
    y_pairs = jnp.take(y_sorted, inverse, axis=0).astype(F32).reshape(n, k, dm)  # [N, k, D]
    y_tok = jnp.sum(y_pairs, axis=1)  # [N, D] f32
    if ep > 1:
        y_tok = jax.lax.psum_scatter(y_tok, "expert", scatter_dimension=0, tiled=True)  # [T, D] this rank's tokens
        processed = jax.lax.psum(jnp.sum(group_sizes), "expert")
    else:
        processed = jnp.sum(group_sizes)
    dropped = (n * k - processed).astype(jnp.int32)
    # shared expert, gated by sigmoid(h @ w_gate)
    gate_up = ctx.dot("TD,DN->TN", h_td, W("shared_wi"))  # [T, 2Fs]
    fs = d.shared_mlp
    h_shared = jax.nn.silu(gate_up[:, :fs].astype(F32)) * gate_up[:, fs:].astype(F32)  # [T, Fs]
    shared = ctx.dot("TF,FD->TD", h_shared, W("shared_wo"), out_dtype=F32)  # [T, D]
    shared_gate = jax.nn.sigmoid(ctx.dot("TD,DO->TO", h_td, W("shared_gate"), out_dtype=F32))  # [T, 1]
    y = (y_tok + ctx.tap("shared_expert", shared_gate * shared)).astype(ctx.cdt)
    return y.reshape(b, s_local, dm), dropped, own.reshape(b, s_local, k)

