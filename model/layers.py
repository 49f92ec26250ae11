"""The mixer layers (Gated DeltaNet, gated attention) and their building blocks, on per-device shards.

Everything here runs inside the model's ``shard_map`` (``model/transformer.py``): arrays are the local shards, weights
are all-gathered over ``fsdp`` at use (``Weights``), the sequence is split over ``context``. ``Ctx`` carries the static
choices (precision, mesh axis sizes, flags, sequence layout).

Precision: ``Ctx.cdt`` is the compute dtype (bf16 in production: the f32 master weights are cast to bf16 before the
gather, activations bf16, every matmul accumulates in f32; float32 in the reference, every matmul at HIGHEST). ``g``,
``beta``, the norms, RoPE and the softmax are computed in float32 in both. The float32 lens (``precision="lens"``) takes
the production code path (the kernels and fused paths the flags select) with float32 activations and weights, every
matmul at HIGHEST: it differs from the reference only by float32 reassociation and by the code path's own logic.

Sequence layout over ``context`` (C ranks): contiguous (rank r holds tokens ``[r S/C, (r+1) S/C)``) unless
``context_parallel_attention_load_balance``, where the residual stream is in the load-balanced ("zigzag") layout: the
sequence cut into 2C chunks, rank r holding chunks r and 2C-1-r (the caller permutes tokens and un-permutes log-probs).
Attention reads its ids (positions, segment ids) for that layout; a GDN layer needs its rank's contiguous slice: in the
zigzag layout it all-gathers its normalized input over ``context``, takes its contiguous slice (plus the conv halo), and
all-gathers its output back to the zigzag layout. In the contiguous layout the conv halo (the previous rank's last
``conv - 1`` rows of the conv input) comes with one ``ppermute``.

Tests: ``python -m pytest tests/model/test_layers.py -q``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from nxgates.kernels.gdn import context_parallel
from nxgates.model import ops

F32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class Dims:
    """The model dimensions the layers use (read from ``model.config.ModelConfig`` by ``from_config``)."""

    vocab: int
    d_model: int
    num_layers: int
    num_experts: int
    top_k: int
    moe_mlp: int
    shared_mlp: int
    gdn_key_heads: int
    gdn_value_heads: int
    gdn_key_dim: int
    gdn_value_dim: int
    gdn_conv: int
    gdn_chunk: int
    attn_heads: int
    attn_kv_heads: int
    attn_head_dim: int
    rotary_dim: int
    rope_theta: float
    norm_eps: float

    @classmethod
    def from_config(cls, cfg) -> Dims:
        head_dim = cfg.attn_head_dim
        return cls(
            vocab=cfg.vocab_size,
            d_model=cfg.hidden_dim,
            num_layers=cfg.num_layers,
            num_experts=cfg.num_experts,
            top_k=cfg.top_k,
            moe_mlp=cfg.moe_mlp_dim,
            shared_mlp=cfg.shared_expert_mlp_dim,
            gdn_key_heads=cfg.gdn_num_key_heads,
            gdn_value_heads=cfg.gdn_num_value_heads,
            gdn_key_dim=cfg.gdn_key_dim,
            gdn_value_dim=cfg.gdn_value_dim,
            gdn_conv=cfg.gdn_conv_kernel,
            gdn_chunk=cfg.gdn_chunk_size,
            attn_heads=cfg.attn_num_q_heads,
            attn_kv_heads=cfg.attn_num_kv_heads,
            attn_head_dim=head_dim,
            rotary_dim=cfg.rotary_dim,  # ModelConfig's (refused unless even and >= 2)
            rope_theta=float(cfg.rope_theta),
            norm_eps=float(cfg.rms_eps),
        )


@dataclasses.dataclass(frozen=True)
class Ctx:
    """Static choices of one model build, seen by every layer."""

    dims: Dims
    flags: object
    precision: str  # "production" | "reference" | "lens" (model.transformer.PRECISIONS)
    fsdp: int
    context: int
    expert: int
    seq_len: int  # global S
    load_balance: bool  # zigzag layout of the residual stream over context
    interpret: bool  # Pallas kernels in interpret mode (CPU)
    # The ops this build dispatched, {op: implementation}: owned by the build (model.transformer.build_log_probs
    # clears it at each trace and its function returns it), never a module global.
    record: dict[str, str] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    # The taps of an explained build (``model.taps.TapSession``, ``build_log_probs(..., explain=True)``); None
    # otherwise, and then the tap methods below return their value untouched (the program is unchanged).
    taps: object = dataclasses.field(default=None, compare=False, repr=False)

    def tap(self, op: str, x, label: str = "", backward: bool = True):
        """``x``; when explaining, its forward value and (``backward``) its cotangent are tapped."""
        return x if self.taps is None else self.taps.value(op, x, label, backward)

    def tap_call(self, op: str, fn, args, names, diff, label: str = ""):
        """``fn(*args)``; when explaining, its output and the cotangents of the inputs ``diff`` are tapped."""
        return fn(*args) if self.taps is None else self.taps.call(op, fn, args, names, diff, label)

    def op(self, name: str, impl: str, **options):
        """``model.ops.dispatch`` of op ``name`` in implementation ``impl``, recorded in this build's ``record``."""
        return ops.dispatch(name, impl, record=self.record, **options)

    @property
    def reference(self) -> bool:
        return self.precision == "reference"

    @property
    def lens(self) -> bool:
        """The float32 lens: the production code path (its kernels, epilogues, folds, hoists, tiles) in float32."""
        return self.precision == "lens"

    @property
    def cdt(self):
        return F32 if self.reference or self.lens else jnp.bfloat16

    def dot(self, eq: str, a, b, out_dtype=None):
        """einsum with float32 accumulation; output in ``out_dtype`` (default: the compute dtype)."""
        prec = _HI if self.reference or self.lens else None
        y = jnp.einsum(eq, a.astype(self.cdt), b.astype(self.cdt), precision=prec, preferred_element_type=F32)
        return y.astype(self.cdt if out_dtype is None else out_dtype)


class Weights:
    """Per-layer weight access: ``W(name)`` casts the local f32 shard to ``dtype`` and all-gathers it over fsdp."""

    def __init__(self, ctx: Ctx, params: dict, gather_dims: dict[str, int | None]):
        self.ctx, self.params, self.gather_dims = ctx, params, gather_dims

    def __call__(self, name: str, dtype=None):
        return gather_fsdp(self.params[name].astype(dtype or self.ctx.cdt), self.gather_dims[name], self.ctx.fsdp)


def gather_fsdp(w, dim: int | None, fsdp: int):
    if dim is None or fsdp == 1:
        return w
    return jax.lax.all_gather(w, "fsdp", axis=dim, tiled=True)


def rms_norm(x, scale, eps: float, out_dtype):
    """RMSNorm over the last axis in float32: ``x / rms(x) * scale``."""
    x32 = x.astype(F32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * scale.astype(F32)
    return y.astype(out_dtype)


def l2_normalize(x, eps: float = 1e-6):
    """``x / ||x||`` over the last axis, in float32."""
    x32 = x.astype(F32)
    return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)


def rope(x, positions, rotary_dim: int, theta: float):
    """Partial rotary embedding (rotate-half) on the first ``rotary_dim`` dims of ``x [B, S, H, Dh]``; float32 math."""
    if rotary_dim == 0:
        return x
    half = rotary_dim // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=F32) / half)  # [half]
    angles = positions.astype(F32)[:, None] * inv_freq[None, :]  # [S, half]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]  # [1, S, 1, half]
    x32 = x.astype(F32)
    x1, x2, rest = x32[..., :half], x32[..., half:rotary_dim], x32[..., rotary_dim:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
    return rotated.astype(x.dtype)


# ----------------------------------------------------------------------------------------------------------------------
# Sequence layout helpers (context axis)
# ----------------------------------------------------------------------------------------------------------------------


def zigzag_order(seq_len: int, context: int) -> list[int]:
    """Global position of each slot of the zigzag layout (rank-major): rank r holds chunks r and 2C-1-r."""
    half = seq_len // (2 * context)
    order = []
    for r in range(context):
        for c in ops.zigzag_chunks(context, r):
            order.extend(range(c * half, (c + 1) * half))
    return order


def contiguous_ids(seq_len: int, context: int, rank):
    """Positions (and one segment) of rank ``rank``'s contiguous slice."""
    s_local = seq_len // context
    positions = (rank * s_local + jnp.arange(s_local, dtype=jnp.int32)).astype(jnp.int32)
    return positions, jnp.zeros_like(positions)


def attention_ids(ctx: Ctx, hoisted: bool):
    """``(q_positions, q_segments, kv_positions, kv_segments)`` of this rank for the residual stream's layout."""
    rank = jax.lax.axis_index("context") if ctx.context > 1 else 0
    if ctx.load_balance:
        lb_ids = ctx.op("lb_ids", "zigzag", hoisted=hoisted)
        pos, seg = lb_ids(ctx.seq_len, ctx.context, rank)
    else:
        pos, seg = contiguous_ids(ctx.seq_len, ctx.context, rank)
    if ctx.context > 1:
        kv_pos = jax.lax.all_gather(pos, "context", axis=0, tiled=True)  # [S]: every rank's positions, rank-major
        kv_seg = jax.lax.all_gather(seg, "context", axis=0, tiled=True)
    else:
        kv_pos, kv_seg = pos, seg
    return pos, seg, kv_pos, kv_seg


def _natural_from_zigzag(x_full, seq_len: int, context: int):
    """``x_full [B, S, ...]`` gathered rank-major from the zigzag layout -> natural order."""
    order = zigzag_order(seq_len, context)
    inverse = [0] * seq_len
    for slot, pos in enumerate(order):
        inverse[pos] = slot
    return jnp.take(x_full, jnp.asarray(inverse, jnp.int32), axis=1)


# ----------------------------------------------------------------------------------------------------------------------
# Gated DeltaNet layer
# ----------------------------------------------------------------------------------------------------------------------

def gdn_param_shapes(d: Dims) -> dict[str, tuple[int, ...]]:
    qk, vv = d.gdn_key_heads * d.gdn_key_dim, d.gdn_value_heads * d.gdn_value_dim
    return {
        "norm": (d.d_model,),  # the pre-norm of the residual block
        "q_proj": (d.d_model, qk),
        "k_proj": (d.d_model, qk),
        "v_proj": (d.d_model, vv),
        "z_proj": (d.d_model, vv),
        "a_proj": (d.d_model, d.gdn_value_heads),
        "b_proj": (d.d_model, d.gdn_value_heads),
        "conv": (d.gdn_conv, 2 * qk + vv),  # depthwise causal conv over the channels [q | k | v]
        "A_log": (d.gdn_value_heads,),
        "dt_bias": (d.gdn_value_heads,),
        "out_norm": (d.gdn_value_dim,),
        "out_proj": (vv, d.d_model),
    }


def _gdn_impl(ctx: Ctx):
    """The ``gdn`` op the flags select."""
    d, f = ctx.dims, ctx.flags
    if ctx.reference:
        return ctx.op("gdn", "reference", chunk_size=d.gdn_chunk, axis_name="context", context_size=ctx.context)
    if f.gdn_cp_mode == "seq" and ctx.context > 1:
        if f.gdn_cp_m_scan:
            fold = ctx.op("gdn_cp_fold", "m_scan", interpret=ctx.interpret)
        else:
            fold = ctx.op("gdn_cp_fold", "tree")
        if f.gdn_cp_dh_scan:
            dh_fold = ctx.op("gdn_cp_dh_fold", "dh_scan", interpret=ctx.interpret)
        else:
            dh_fold = ctx.op("gdn_cp_dh_fold", "tree")
        fn = ctx.op(
            "gdn", "cp", chunk_size=d.gdn_chunk, axis_name="context", fold=fold, dh_fold=dh_fold,
            interpret=ctx.interpret,
        )
        if ctx.taps is not None:  # the folds the op runs, for the explain taps (_tapped_gdn)
            fn = functools.partial(fn)
            fn.folds = (fold, dh_fold)
        return fn
    return ctx.op("gdn", "xla", chunk_size=d.gdn_chunk, axis_name="context", context_size=ctx.context)


def _tapped_gdn(ctx: Ctx, gdn_fn, q, k, v, g, beta):
    """The ``gdn`` op with its taps (explain only): the context-parallel fold of this rank's chunk maps (forward), the
    op's output and input cotangents, and the dh fold of the backward's transposed maps (recomputed from the output's
    cotangent). The reference taps the same folds computed in float32 (chunk maps of ``chunk_terms`` at HIGHEST,
    composed by the pairwise tree)."""
    d, f = ctx.dims, ctx.flags
    cp = f.gdn_cp_mode == "seq" and ctx.context > 1
    if cp:
        # forward only: the fold's input recomputed without a gradient path (the Pallas kernels have no JVP)
        q_, k_, v_, g_, beta_ = (jax.lax.stop_gradient(x) for x in (q, k, v, g, beta))
        if ctx.reference:
            fold, dh_fold = context_parallel.fold_tree, context_parallel.fold_tree
            maps = context_parallel.rank_maps_f32(q_, k_, v_, g_, beta_, chunk_size=d.gdn_chunk)
        else:
            fold, dh_fold = gdn_fn.folds
            maps = context_parallel.rank_maps(q_, k_, v_, g_, beta_, chunk_size=d.gdn_chunk, interpret=ctx.interpret)
        m_rank, b_rank = fold(*maps)
        ctx.taps.forward("gdn_cp_fold", {"M": m_rank, "B": b_rank})
    o, _ = ctx.taps.call("gdn", gdn_fn, (q, k, v, g, beta, None), ("q", "k", "v", "g", "beta", "initial_state"),
                         (0, 1, 2, 3, 4))
    if cp:
        def dh(d_o, q_, k_, v_, g_, beta_):
            mt, gt = context_parallel.dh_fold_inputs(q_, k_, v_, g_, beta_, d_o, chunk_size=d.gdn_chunk)
            m_rank, g_rank = dh_fold(mt, gt)
            return {"M": m_rank, "G": g_rank}

        o = ctx.taps.deposit("gdn_cp_dh_fold", o, dh, (q, k, v, g, beta))
    return o


def gdn_layer(ctx: Ctx, W: Weights, h):
    """Gated DeltaNet mixer on the normalized input ``h [B, S_local, D]`` (residual layout).

    Returns ``[B, S_local, D]``.
    """
    d = ctx.dims
    b, s_local, _ = h.shape
    hk, hv, dk, dv, kc = d.gdn_key_heads, d.gdn_value_heads, d.gdn_key_dim, d.gdn_value_dim, d.gdn_conv
    w_qkv = jnp.concatenate([W("q_proj"), W("k_proj"), W("v_proj")], axis=1)  # [D, 2 Hk K + Hv V]
    if ctx.load_balance and ctx.context > 1:
        # zigzag -> this rank's contiguous slice, with the conv halo (the kc - 1 rows before it; zeros at the start).
        rank = jax.lax.axis_index("context")
        h_nat = _natural_from_zigzag(jax.lax.all_gather(h, "context", axis=1, tiled=True), ctx.seq_len, ctx.context)
        h_pad = jnp.pad(h_nat, ((0, 0), (kc - 1, 0), (0, 0)))  # [B, S + kc - 1, D]
        h_ext = jax.lax.dynamic_slice_in_dim(h_pad, rank * s_local, s_local + kc - 1, axis=1)  # [B, S_l + kc - 1, D]
        h_ctg = h_ext[:, kc - 1 :]  # [B, S_local, D]
        conv_in = ctx.dot("BSD,DC->BSC", h_ext, w_qkv)  # [B, S_l + kc - 1, C]
    else:
        h_ctg = h
        conv_in = ctx.dot("BSD,DC->BSC", h, w_qkv)  # [B, S_local, C]
        if ctx.context > 1:
            # the previous rank's last kc - 1 rows (rank 0 receives zeros: no source)
            tail = conv_in[:, s_local - (kc - 1) :]
            halo = jax.lax.ppermute(tail, "context", [(r, r + 1) for r in range(ctx.context - 1)])
        else:
            halo = jnp.zeros((b, kc - 1, conv_in.shape[2]), conv_in.dtype)
        conv_in = jnp.concatenate([halo, conv_in], axis=1)  # [B, S_l + kc - 1, C]
    w_conv = W("conv", F32)  # [kc, C]
    conv = sum(conv_in[:, j : j + s_local].astype(F32) * w_conv[j] for j in range(kc))  # causal depthwise, [B, S_l, C]
    conv = jax.nn.silu(conv)
    q, k, v = jnp.split(conv, [hk * dk, 2 * hk * dk], axis=-1)
    q = l2_normalize(q.reshape(b, s_local, hk, dk))  # [B, S_l, Hk, K]
    k = l2_normalize(k.reshape(b, s_local, hk, dk))
    v = v.reshape(b, s_local, hv, dv).astype(ctx.cdt)  # [B, S_l, Hv, V]
    # each key head serves hv / hk value heads
    q = jnp.repeat(q, hv // hk, axis=2).astype(ctx.cdt)  # [B, S_l, Hv, K]
    k = jnp.repeat(k, hv // hk, axis=2).astype(ctx.cdt)
    a = ctx.dot("BSD,DH->BSH", h_ctg, W("a_proj"), out_dtype=F32)  # [B, S_l, Hv]
    beta = jax.nn.sigmoid(ctx.dot("BSD,DH->BSH", h_ctg, W("b_proj"), out_dtype=F32))
    g = -jnp.exp(W("A_log", F32)) * jax.nn.softplus(a + W("dt_bias", F32))  # log decay <= 0, float32
    gdn_fn = _gdn_impl(ctx)
    if ctx.taps is None:
        o, _ = gdn_fn(q, k, v, g, beta, None)  # [B, S_l, Hv, V]
    else:
        o = _tapped_gdn(ctx, gdn_fn, q, k, v, g, beta)
    z = ctx.dot("BSD,DN->BSN", h_ctg, W("z_proj"), out_dtype=F32).reshape(b, s_local, hv, dv)
    o = ctx.tap("norm", rms_norm(o, W("out_norm", F32), d.norm_eps, F32), "gdn_out")
    o = o * jax.nn.silu(z)  # gated RMSNorm, [B, S_l, Hv, V]
    out = ctx.dot("BSN,ND->BSD", o.reshape(b, s_local, hv * dv).astype(ctx.cdt), W("out_proj"))  # [B, S_l, D]
    if ctx.load_balance and ctx.context > 1:
        # contiguous -> zigzag: gather the natural order, take this rank's zigzag positions
        rank = jax.lax.axis_index("context")
        full = jax.lax.all_gather(out, "context", axis=1, tiled=True)  # [B, S, D] natural order
        zig = jnp.asarray(zigzag_order(ctx.seq_len, ctx.context), jnp.int32).reshape(ctx.context, s_local)
        out = jnp.take(full, zig[rank], axis=1)  # [B, S_local, D]
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Gated attention layer
# ----------------------------------------------------------------------------------------------------------------------


def attention_param_shapes(d: Dims) -> dict[str, tuple[int, ...]]:
    hd = d.attn_head_dim
    return {
        "norm": (d.d_model,),  # the pre-norm of the residual block
        "q_proj": (d.d_model, d.attn_heads * 2 * hd),  # per head [query | output gate]
        "k_proj": (d.d_model, d.attn_kv_heads * hd),
        "v_proj": (d.d_model, d.attn_kv_heads * hd),
        "q_norm": (hd,),
        "k_norm": (hd,),
        "out_proj": (d.attn_heads * hd, d.d_model),
    }


def attention_layer(ctx: Ctx, W: Weights, h, ids):
    """Gated attention mixer on ``h [B, S_local, D]``; ``ids`` from ``attention_ids`` (hoisted) or None (per layer)."""
    from jax.ad_checkpoint import checkpoint_name

    d, f = ctx.dims, ctx.flags
    b, s_local, _ = h.shape
    hq, hkv, hd = d.attn_heads, d.attn_kv_heads, d.attn_head_dim
    if ids is None:
        ids = attention_ids(ctx, hoisted=False)
    q_pos, q_seg, kv_pos, kv_seg = ids
    wq = W("q_proj")  # [D, Hq * 2 * Dh]
    if f.query_proj_kernel_gather_once:
        wq = checkpoint_name(wq, "query_proj_kernel")  # the policy keeps the gathered kernel for the remat replay
    qg = checkpoint_name(ctx.dot("BSD,DN->BSN", h, wq), "query_proj")
    qg = qg.reshape(b, s_local, hq, 2 * hd)  # [B, S_l, Hq, query | gate]
    q, gate = qg[..., :hd], qg[..., hd:]
    k = ctx.dot("BSD,DN->BSN", h, W("k_proj")).reshape(b, s_local, hkv, hd)  # [B, S_l, Hkv, Dh]
    v = ctx.dot("BSD,DN->BSN", h, W("v_proj")).reshape(b, s_local, hkv, hd)
    q = rope(ctx.tap("norm", rms_norm(q, W("q_norm", F32), d.norm_eps, ctx.cdt), "q"), q_pos, d.rotary_dim,
             d.rope_theta)
    k = rope(ctx.tap("norm", rms_norm(k, W("k_norm", F32), d.norm_eps, ctx.cdt), "k"), q_pos, d.rotary_dim,
             d.rope_theta)
    if ctx.context > 1:
        k = jax.lax.all_gather(k, "context", axis=1, tiled=True)  # [B, S, Hkv, Dh], rank-major like kv_pos
        v = jax.lax.all_gather(v, "context", axis=1, tiled=True)
    attn = ctx.op("attention", "reference" if ctx.reference else "xla")
    if ctx.load_balance:
        ctx.tap("lb_ids", q_pos)  # the positions of this rank's queries (hoisted or per layer: the same tap)
    o = ctx.tap_call("attention", attn, (q, k, v, (q_pos, kv_pos), (q_seg, kv_seg)),
                     ("q", "k", "v", "positions", "segment_ids"), (0, 1, 2))  # [B, S_l, Hq, Dh]
    o = (o.astype(F32) * jax.nn.sigmoid(gate.astype(F32))).astype(ctx.cdt)  # sigmoid output gate
    return ctx.dot("BSN,ND->BSD", o.reshape(b, s_local, hq * hd), W("out_proj"))  # [B, S_l, D]

