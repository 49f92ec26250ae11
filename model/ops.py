"""The dispatch table of the model path: every numerically relevant op goes through here.

``dispatch(name, impl, record=..., **options)`` returns the function of op ``name`` in implementation ``impl`` (built
with the static ``options``, e.g. the GMM flags and tiles) and writes which implementation it chose into ``record``, a
dict the caller owns: ``model.transformer.build_log_probs`` gives each built model its own (``Ctx.record``, cleared at
the start of every trace) and the built function returns it (``fn.implementations()``). ``override(name, fn)`` replaces
op ``name`` for everything traced while it is active and records ``"override:<fn.__name__>"`` (this is how the gates'
deliberately wrong variants are injected). ``wrap(name, wrapper)`` keeps the op the flags select and traces
``wrapper(fn)`` in its place, recorded as ``"wrap:<wrapper.__name__>(<what it wraps>)"`` (``gates.resolution`` injects
errors of a known size into the op a flag changes this way).

Ops and signatures (all called inside the model's ``shard_map`` on per-device shards):

- ``"moe_mlp"``: ``(x[m, D], wi[G, D, 2F], wo[G, F, D], group_sizes[G] int32, route_weights[m] f32) -> y[m, D]`` (rows
  sorted by local expert; rows past ``sum(group_sizes)`` give 0; routing weight applied at the wo input).
- ``"gdn"``: ``(q, k [B, T, H, K], v [B, T, H, V], g, beta [B, T, H], initial_state [B, H, K, V] | None) -> (o [B, T, H,
  V], final_state)`` on the local contiguous slice of the sequence (context axis).
- ``"gdn_cp_fold"`` / ``"gdn_cp_dh_fold"``: the fold passed to ``kernels.gdn.context_parallel.gdn_cp`` as ``fold`` /
  ``dh_fold`` (the kernel module's named switch, or an override's callable ``fold(M[n,...,K,K], B[n,...,K,V])``).
- ``"fp8_fake_quant"``: ``(w, amax) -> w_hat`` (``w`` on the fp8 grid with ``scale = amax / 448``; straight-through
  gradient).
- ``"fp8_amax"``: ``(w, axes, axis_name | None) -> amax`` (``max |w|`` over ``axes``, kept as size 1, then ``pmax`` over
  ``axis_name`` when given: the global absmax of an fsdp-sharded weight).
- ``"lb_ids"``: ``(seq_len, context_size, rank) -> (positions[S_local] int32, segment_ids[S_local] int32)``: the
  load-balanced ids of context rank ``rank`` (chunks ``rank`` and ``2C-1-rank`` of ``2C`` chunks).
- ``"attention"``: ``(q[B, Sq, Hq, Dh], k[B, Sk, Hkv, Dh], v[B, Sk, Hkv, Dh], positions, segment_ids) -> o[B, Sq, Hq,
  Dh]`` where ``positions = (q_positions[Sq], kv_positions[Sk])`` and ``segment_ids = (q_segments[Sq],
  kv_segments[Sk])``; causal by position within equal segments.

Tests: ``python -m pytest tests/model/test_ops.py -q``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp

from nxgates import reference
from nxgates.kernels.gdn import context_parallel
from nxgates.kernels.gdn import ops as gdn_ops
from nxgates.kernels.gmm import ops as gmm_ops
from nxgates.reference.gdn import gdn_chunked

OP_NAMES = ("moe_mlp", "gdn", "gdn_cp_fold", "gdn_cp_dh_fold", "fp8_fake_quant", "fp8_amax", "lb_ids", "attention")

# name -> impl -> factory(**options) -> fn
_FACTORIES: dict[str, dict[str, Callable[..., Callable]]] = {name: {} for name in OP_NAMES}
_OVERRIDES: dict[str, list[Callable]] = {}
_WRAPPERS: dict[str, list[Callable]] = {}

_HI = jax.lax.Precision.HIGHEST


def varying_axes(x) -> frozenset:
    """The mesh axes ``x`` is typed as varying over inside ``shard_map(check_vma=True)`` (empty outside)."""
    mat = getattr(jax.typeof(x), "mat", None)
    return frozenset(mat.varying) if mat is not None else frozenset()


def register(name: str, impl: str):
    """Decorator: register ``factory(**options) -> fn`` as implementation ``impl`` of op ``name``."""
    if name not in _FACTORIES:
        raise ValueError(f"register: name={name!r} is not an op; ops are {OP_NAMES}")

    def deco(factory):
        _FACTORIES[name][impl] = factory
        return factory

    return deco


def _describe(impl: str, options: dict) -> str:
    if not options:
        return impl
    args = ", ".join(f"{k}={v!r}" for k, v in sorted(options.items()) if not callable(v))
    return f"{impl}({args})"


def dispatch(name: str, impl: str, *, record: dict[str, str] | None, **options) -> Callable:
    """The function of op ``name`` in implementation ``impl`` (built with ``options``); ``record[name]`` says what was
    chosen (``record=None``: nothing is recorded, for a caller outside a model build).

    An active ``override(name, fn)`` wins over ``impl`` (recorded as ``"override:<fn.__name__>"``).
    """
    record = {} if record is None else record
    if name not in _FACTORIES:
        raise ValueError(f"dispatch: name={name!r} is not an op; ops are {OP_NAMES}")
    stack = _OVERRIDES.get(name)
    if stack:
        fn = stack[-1]
        chosen = f"override:{getattr(fn, '__name__', type(fn).__name__)}"
    else:
        table = _FACTORIES[name]
        if impl not in table:
            raise ValueError(f"dispatch: impl={impl!r} is not an implementation of op {name!r}; known: {sorted(table)}")
        chosen = _describe(impl, options)
        fn = table[impl](**options)
    for wrapper in _WRAPPERS.get(name, ()):
        fn = wrapper(fn)
        chosen = f"wrap:{getattr(wrapper, '__name__', type(wrapper).__name__)}({chosen})"
    record[name] = chosen
    return fn


@contextlib.contextmanager
def override(name: str, fn: Callable) -> Iterator[None]:
    """Replace op ``name`` by ``fn`` (same signature) for everything traced inside the ``with`` block.

    Note: a function already jitted and cached keeps its old trace; build (and jit) the model inside the block.
    """
    if name not in _FACTORIES:
        raise ValueError(f"override: name={name!r} is not an op; ops are {OP_NAMES}")
    if not callable(fn):
        raise ValueError(f"override: fn={fn!r} is not callable")
    _OVERRIDES.setdefault(name, []).append(fn)
    try:
        yield
    finally:
        _OVERRIDES[name].pop()


@contextlib.contextmanager
def wrap(name: str, wrapper: Callable[[Callable], Callable]) -> Iterator[None]:
    """Trace ``wrapper(fn)`` in place of op ``name``'s function ``fn`` (the implementation the flags select, or an
    active override) for everything traced inside the ``with`` block; wrappers entered later wrap the earlier ones."""
    if name not in _FACTORIES:
        raise ValueError(f"wrap: name={name!r} is not an op; ops are {OP_NAMES}")
    if not callable(wrapper):
        raise ValueError(f"wrap: wrapper={wrapper!r} is not callable")
    _WRAPPERS.setdefault(name, []).append(wrapper)
    try:
        yield
    finally:
        _WRAPPERS[name].pop()


# ----------------------------------------------------------------------------------------------------------------------
# moe_mlp
# ----------------------------------------------------------------------------------------------------------------------


@register("moe_mlp", "reference")
def _moe_mlp_reference():
    """float32 composition of the references: ``gmm(swiglu(gmm(x, wi)) * r, wo)``, output in ``x.dtype``."""

    def moe_mlp_reference(x, wi, wo, group_sizes, route_weights):
        f = wo.shape[1]
        gate_up = reference.gmm(x, wi, group_sizes)  # [m, 2F]
        h = reference.swiglu(gate_up[:, :f], gate_up[:, f:])  # [m, F]
        if route_weights is not None:
            h = h * route_weights.astype(jnp.float32)[:, None]
        return reference.gmm(h, wo, group_sizes).astype(x.dtype)

    return moe_mlp_reference


@register("moe_mlp", "pallas")
def _moe_mlp_pallas(
    *, fused_swiglu: bool, fused_dswiglu: bool, router_grad_from_wo_input: bool, tiles, interpret: bool
):
    """``kernels.gmm.ops.moe_mlp`` with the flags' fused paths (all off: the trainer's unfused baseline)."""
    return functools.partial(
        gmm_ops.moe_mlp,
        fused_swiglu=fused_swiglu,
        fused_dswiglu=fused_dswiglu,
        router_grad_from_wo_input=router_grad_from_wo_input,
        tiles=tiles,
        interpret=interpret,
    )


# ----------------------------------------------------------------------------------------------------------------------
# gdn (on the local slice; the context axis is handled by the implementation)
# ----------------------------------------------------------------------------------------------------------------------


def _gathered_gdn(fn, axis_name: str | None, context_size: int):
    """Run the full-sequence ``fn`` on the all-gathered sequence and keep this rank's contiguous slice."""

    def run(q, k, v, g, beta, initial_state):
        if initial_state is None:
            # explicit zeros typed like the (device-varying) inputs, so the references' state scan type-checks
            b, _, h, dk = k.shape
            zeros = jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32)
            vma = tuple(sorted(varying_axes(v)))
            initial_state = jax.lax.pcast(zeros, vma, to="varying") if vma else zeros
        if context_size == 1:
            return fn(q, k, v, g, beta, initial_state)
        t_local = q.shape[1]
        q, k, v, g, beta = (jax.lax.all_gather(x, axis_name, axis=1, tiled=True) for x in (q, k, v, g, beta))
        o, final = fn(q, k, v, g, beta, initial_state)
        start = jax.lax.axis_index(axis_name) * t_local
        o = jax.lax.dynamic_slice_in_dim(o, start, t_local, axis=1)  # [B, T_local, H, V]
        return o, final

    return run


@register("gdn", "reference")
def _gdn_reference(*, chunk_size: int, axis_name: str | None, context_size: int):
    """``reference.gdn_chunked`` (float32) on the gathered sequence."""

    def gdn_reference(q, k, v, g, beta, initial_state):
        return gdn_chunked(q, k, v, g, beta, chunk_size=chunk_size, initial_state=initial_state)

    return _gathered_gdn(gdn_reference, axis_name, context_size)


@register("gdn", "xla")
def _gdn_xla(*, chunk_size: int, axis_name: str | None, context_size: int):
    """``kernels.gdn.ops.gdn_chunk_xla`` (the trainer's bf16 XLA path) on the gathered sequence (gdn_cp_mode=none)."""
    def gdn_xla(q, k, v, g, beta, initial_state):
        return gdn_ops.gdn_chunk_xla(q, k, v, g, beta, chunk_size=chunk_size, initial_state=initial_state)

    return _gathered_gdn(gdn_xla, axis_name, context_size)


@register("gdn", "cp")
def _gdn_cp(*, chunk_size: int, axis_name: str, fold, dh_fold, interpret: bool):
    """``kernels.gdn.context_parallel.gdn_cp`` (gdn_cp_mode=seq): each rank its slice, maps folded over ranks."""
    def gdn_cp(q, k, v, g, beta, initial_state):
        return context_parallel.gdn_cp(
            q, k, v, g, beta, axis_name=axis_name, fold=fold, dh_fold=dh_fold, chunk_size=chunk_size,
            initial_state=initial_state, interpret=interpret,
        )

    return gdn_cp


@register("gdn_cp_fold", "tree")
@register("gdn_cp_dh_fold", "tree")
def _fold_tree():
    """``kernels.gdn.context_parallel.fold_tree``: the XLA pairwise reduction tree."""
    return context_parallel.fold_tree


@register("gdn_cp_fold", "m_scan")
@register("gdn_cp_dh_fold", "dh_scan")
def _fold_scan(*, interpret: bool):
    """``kernels.gdn.context_parallel.fold_scan``: one sequential Pallas scan (gdn_cp_m_scan / gdn_cp_dh_scan)."""
    return functools.partial(context_parallel.fold_scan, interpret=interpret)


# ----------------------------------------------------------------------------------------------------------------------
# fp8
# ----------------------------------------------------------------------------------------------------------------------


def scale_from_amax(amax: jax.Array) -> jax.Array:
    """``reference.fp8_scale`` convention applied to an already reduced ``amax`` (max over its size-1 axes is
    itself)."""
    return reference.fp8_scale(amax, tuple(i for i, n in enumerate(amax.shape) if n == 1))


@functools.partial(jax.custom_vjp, nondiff_argnums=())
def _fake_quant_ste(w, amax):
    scale = scale_from_amax(amax)
    codes = reference.fp8_quantize(w, scale)
    codes, scale = jax.lax.optimization_barrier((codes, scale))  # keep XLA from folding the fp8 round trip
    return reference.fp8_dequantize(codes, scale, w.dtype)


def _fake_quant_fwd(w, amax):
    return _fake_quant_ste(w, amax), amax


def _fake_quant_bwd(amax, dw_hat):
    return dw_hat, jnp.zeros_like(amax)  # straight-through; nothing flows through the scale


_fake_quant_ste.defvjp(_fake_quant_fwd, _fake_quant_bwd)


@register("fp8_fake_quant", "reference")
def _fp8_fake_quant_reference():
    """``reference.fp8_quantize`` / ``fp8_dequantize`` with ``scale = amax / 448``; output in ``w.dtype``; STE."""

    def fp8_fake_quant(w, amax):
        if amax.ndim != w.ndim:
            raise ValueError(f"fp8_fake_quant: amax.shape={amax.shape} must have w's rank (w.shape={w.shape})")
        return _fake_quant_ste(w, amax)

    return fp8_fake_quant


@register("fp8_amax", "absmax")
def _fp8_amax(*, hoisted: bool):
    """``max |w|`` (float32) over ``axes`` kept as size 1, then ``pmax`` over ``axis_name`` when given.

    ``hoisted`` only labels the record: once for the layer stack before the scan (gather8), or per layer.
    """
    del hoisted

    def fp8_amax(w, axes, axis_name):
        w = jax.lax.stop_gradient(w)  # no gradient through the scale (and pmax has no differentiation rule)
        amax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=tuple(axes), keepdims=True)
        if axis_name is not None:
            amax = jax.lax.pmax(amax, axis_name)
        return amax

    return fp8_amax


# ----------------------------------------------------------------------------------------------------------------------
# load-balanced ids and attention
# ----------------------------------------------------------------------------------------------------------------------


def zigzag_chunks(context_size: int, rank: int) -> tuple[int, int]:
    """The two chunks (of ``2C``) that context rank ``rank`` holds under load balancing: ``rank`` and ``2C-1-rank``."""
    return rank, 2 * context_size - 1 - rank


@register("lb_ids", "zigzag")
def _lb_ids_zigzag(*, hoisted: bool):
    """Positions of chunks ``rank`` and ``2C-1-rank`` (each ``seq_len / 2C`` tokens); one segment (id 0).

    ``hoisted`` only labels the record: computed once outside the layer scan, or inside every attention layer.
    """
    del hoisted

    def lb_ids(seq_len, context_size, rank):
        half = seq_len // (2 * context_size)
        first = rank * half + jnp.arange(half, dtype=jnp.int32)
        second = (2 * context_size - 1 - rank) * half + jnp.arange(half, dtype=jnp.int32)
        positions = jnp.concatenate([first, second]).astype(jnp.int32)  # [2 * half] = [S_local]
        return positions, jnp.zeros_like(positions)

    return lb_ids


def _attention(q, k, v, positions, segment_ids, *, f32: bool):
    b, sq, hq, dh = q.shape
    hkv = k.shape[2]
    if hq % hkv:
        raise ValueError(f"attention: q heads {hq} must be a multiple of kv heads {hkv} (q.shape={q.shape})")
    q_pos, kv_pos = positions
    q_seg, kv_seg = segment_ids
    prec = _HI if f32 or q.dtype == jnp.float32 else None  # float32 inputs (the float32 lens): full precision
    q5 = q.reshape(b, sq, hkv, hq // hkv, dh)  # [B, Sq, Hkv, R, Dh]: the R query heads sharing one kv head
    if f32:
        q5, k, v = (x.astype(jnp.float32) for x in (q5, k, v))
    logits = jnp.einsum("BQHRD,BKHD->BHRQK", q5, k, precision=prec, preferred_element_type=jnp.float32)
    logits = logits * (dh**-0.5)
    mask = (kv_pos[None, :] <= q_pos[:, None]) & (kv_seg[None, :] == q_seg[:, None])  # [Sq, Sk]
    logits = jnp.where(mask, logits, -1e30)
    probs = jax.nn.softmax(logits, axis=-1)
    o = jnp.einsum("BHRQK,BKHD->BQHRD", probs.astype(v.dtype), v, precision=prec, preferred_element_type=jnp.float32)
    return o.reshape(b, sq, hq, dh).astype(q.dtype)  # [B, Sq, Hq, Dh]


@register("attention", "reference")
def _attention_reference():
    """float32 causal GQA attention, every einsum at HIGHEST."""
    return functools.partial(_attention, f32=True)


@register("attention", "xla")
def _attention_xla():
    """bf16 q/k/v, float32 logits / softmax / accumulation (the trainer's XLA attention)."""
    return functools.partial(_attention, f32=False)
