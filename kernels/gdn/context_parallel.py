"""Context-parallel Gated DeltaNet: the sequence split over a mesh axis, chunk states composed as affine maps.

Each chunk maps the state ``[K, V]`` affinely, ``S_out = M_c S_in + B_c`` (``kernel.py`` writes ``M_c [K, K]`` and
``B_c [K, V]``). With T split contiguously over the ranks of ``axis_name``, the forward on each rank is:

1. the local chunk maps (Pallas chunk kernel, zero state) and their **fold** into one map per rank
   (``fold="tree"``: an XLA pairwise reduction tree; ``fold="m_scan"``: one sequential Pallas scan, ``gdn_cp_m_scan``);
2. an ``all_gather`` of the per-rank maps and, on every rank, the composition of ranks ``0 .. R-1`` in order applied to
   the initial state; the exclusive prefix is this rank's incoming state, the full composition is the final state;
3. the replay: the Pallas chunk kernel over the local slice from the incoming state.

The backward (``custom_vjp``; JAX code, everything float32 at HIGHEST precision, gradients rounded once to their inputs'
dtypes) runs the same idea on the transposed maps: the gradient at a chunk's input state is
``dS_in = M_c^T dS_out + G_c`` with ``G_c = P_c^T do_c`` (``P_c = d o_c / d S_in``). A rank **dh-folds** its chunks'
transposed maps from the last chunk to the first (``dh_fold="tree"`` or ``"dh_scan"``: the sequential Pallas scan,
``gdn_cp_dh_scan``), the ranks ``all_gather`` them, and the incoming-state gradient flows from the last rank (seeded
with the final state's cotangent) to the first, giving each rank the gradient at its outgoing state and the
initial-state gradient. Each rank then takes the VJP of its local chunked forward (from its incoming state, with that
outgoing-state gradient).

Fold callables (the injection point for the tests' deliberately wrong folds and the model's dispatch):
``fold(m [n, ..., K, K], b [n, ..., K, V]) -> (M [..., K, K], B [..., K, V])`` composes ``n`` maps ``S -> m[i] S +
b[i]`` in order, map 0 applied first: ``M = m[n-1] ... m[0]``. ``dh_fold`` has the same signature and is given the
backward's maps already in application order: ``m[i] = M_{n-1-i}^T``, ``b[i] = G_{n-1-i}`` (last chunk first).

Cotangent conventions inside ``shard_map``: with ``check_vma=True`` (q varying over ``axis_name``) the final state is
made device-invariant (a ``psum`` of rank 0's copy against zeros; every rank holds the same value) and the
initial-state gradient is returned invariant; with ``check_vma=False`` the final state's cotangents are summed over the
ranks and the initial-state gradient is returned on rank 0 (zeros elsewhere), matching ``shard_map``'s transpose (which
divides replicated cotangents by the number of ranks and sums replicated inputs' cotangents). Under ``check_vma=True``
run the kernels compiled or with ``interpret=pltpu.InterpretParams()``: the HLO interpreter of ``interpret=True``
(jax 0.12) rejects the kernels' iota constants as not varying. ``gdn_cp_sharded`` wraps it all for tests and reports.

Tests: ``tests/kernels/test_gdn_cp.py`` (8 host CPU devices).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from nxgates.kernels.gdn import kernel as _kernel
from nxgates.kernels.gdn import ops as _ops

_HI = jax.lax.Precision.HIGHEST
_F32 = jnp.float32

Fold = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


# ----------------------------------------------------------------------------------------------------------------------
# Folds: compose n affine maps in order (map 0 first)
# ----------------------------------------------------------------------------------------------------------------------


def _compose(m2, b2, m1, b1):
    """``(m2, b2) o (m1, b1)``: apply map 1, then map 2. ``m: [..., K, K]``, ``b: [..., K, V]``."""
    return (
        jnp.einsum("...ij,...jk->...ik", m2, m1, precision=_HI),
        jnp.einsum("...ij,...jv->...iv", m2, b1, precision=_HI) + b2,
    )


def fold_tree(m, b):
    """XLA pairwise reduction tree: ``log2(n)`` levels, each composing neighbours ``(2i, 2i + 1)``; float32.

    ``m: [n, ..., K, K]``, ``b: [n, ..., K, V]`` -> ``(M [..., K, K], B [..., K, V])``.
    """
    m, b = m.astype(_F32), b.astype(_F32)
    while m.shape[0] > 1:
        n = m.shape[0]
        pairs = n // 2
        mp, bp = _compose(m[1 : 2 * pairs : 2], b[1 : 2 * pairs : 2], m[0 : 2 * pairs : 2], b[0 : 2 * pairs : 2])
        if n % 2:  # the odd map out stays last, so the order is kept
            mp, bp = jnp.concatenate([mp, m[-1:]], 0), jnp.concatenate([bp, b[-1:]], 0)
        m, b = mp, bp
    return m[0], b[0]


def fold_scan(m, b, *, interpret=False):
    """The sequential Pallas scan (``kernel.map_scan``): float32 VMEM accumulators, ``M <- m[i] M``, ``B <- m[i] B +
    b[i]``.

    ``m: [n, ..., K, K]``, ``b: [n, ..., K, V]`` -> ``(M [..., K, K], B [..., K, V])``.
    """
    n, kdim, vdim = m.shape[0], m.shape[-1], b.shape[-1]
    batch = m.shape[1:-2]
    # [n, ..., K, *] -> [n, X, K, *]: the kernel's grid runs over X in parallel and over n in order.
    mo, bo = _kernel.map_scan(m.reshape(n, -1, kdim, kdim), b.reshape(n, -1, kdim, vdim), interpret=interpret)
    return mo.reshape(*batch, kdim, kdim), bo.reshape(*batch, kdim, vdim)  # [X, K, *] -> [..., K, *]


def resolve_fold(fold, *, arg_name, scan_name, interpret):
    """``"tree"`` -> ``fold_tree``; ``scan_name`` (``"m_scan"`` / ``"dh_scan"``) -> ``fold_scan``; a callable as is."""
    if callable(fold):
        return fold
    if fold == "tree":
        return fold_tree
    if fold == scan_name:
        return functools.partial(fold_scan, interpret=interpret)
    raise ValueError(f"{arg_name}={fold!r} must be 'tree', {scan_name!r} or a callable fold(m, b) -> (M, B)")


# ----------------------------------------------------------------------------------------------------------------------
# Cross-rank composition
# ----------------------------------------------------------------------------------------------------------------------


def _chain(ms, bs, x0):
    """Apply the maps ``x <- ms[r] x + bs[r]`` for ``r = 0 .. R-1``; returns the ``R + 1`` states ``[R + 1, ...]``."""
    states = [x0]
    for r in range(ms.shape[0]):
        states.append(jnp.einsum("...ij,...jv->...iv", ms[r], states[-1], precision=_HI) + bs[r])
    return jnp.stack(states)


def _vma_on(x, axis_name):
    """Whether ``x`` is typed as varying over ``axis_name`` (False everywhere under ``check_vma=False``)."""
    mat = getattr(jax.typeof(x), "mat", None)
    return mat is not None and axis_name in mat.varying


def _to_invariant(x, axis_name):
    """The value every rank holds identically, typed device-invariant: a psum of rank 0's copy against zeros (exact)."""
    idx = jax.lax.axis_index(axis_name)
    return jax.lax.psum(jnp.where(idx == 0, x, jnp.zeros_like(x)), axis_name)


def _dh_maps(q, k, v, g, beta, d_o, chunk_size, scale):
    """The backward's transposed maps in application order (last chunk first), the dh fold's input: ``(mt [N, B, H,
    K, K], gt [N, B, H, K, V])`` from float32 ``q, k, v, g, beta`` and the output's cotangent ``d_o``."""
    b, t, h, _ = q.shape
    n = t // chunk_size
    vdim = v.shape[3]
    terms = _ops.chunk_terms(q, k, v, g, beta, chunk_size=chunk_size, scale=scale, low=False)
    m_maps, _ = _ops.chunk_maps_from_terms(terms)  # [B, H, N, K, K]
    # P_c = d o_c / d S_in = qd - aqk w  [B, H, N, C, K]; G_c = P_c^T do_c  [B, H, N, K, V]
    p_c = terms["qd"] - jnp.einsum("BHNCD,BHNDK->BHNCK", terms["aqk"], terms["w"], precision=_HI)
    # do: [B, T, H, V] -> [B, N, C, H, V] -> [B, H, N, C, V]
    d_o_c = jnp.transpose(d_o.reshape(b, n, chunk_size, h, vdim), (0, 3, 1, 2, 4))
    g_c = jnp.einsum("BHNCK,BHNCV->BHNKV", p_c, d_o_c, precision=_HI)
    # The backward's maps in application order: last chunk first, transposed. [B, H, N, K, *] -> [N, B, H, K, *]
    mt = jnp.flip(jnp.moveaxis(jnp.swapaxes(m_maps, -1, -2), 2, 0), 0)
    gt = jnp.flip(jnp.moveaxis(g_c, 2, 0), 0)
    return mt, gt


# Explain taps (gates.explain via model.layers): the folds' inputs recomputed outside the custom_vjp, exactly as
# _gdn_cp_fwd / _gdn_cp_bwd compute them.


def rank_maps(q, k, v, g, beta, *, chunk_size=64, scale=None, interpret=False):
    """The forward fold's input on this rank (the Pallas chunk kernel's maps, chunk axis first)."""
    scale = _ops.validate(q, k, v, g, beta, chunk_size=chunk_size, scale=scale, initial_state=None,
                          name="rank_maps")[-1]
    return _chunk_maps(q, k, v, g, beta, chunk_size, scale, interpret)


def rank_maps_f32(q, k, v, g, beta, *, chunk_size=64, scale=None):
    """The forward fold's input computed in float32 at HIGHEST (``chunk_terms``), for the float32 reference."""
    scale = _ops.validate(q, k, v, g, beta, chunk_size=chunk_size, scale=scale, initial_state=None,
                          name="rank_maps_f32")[-1]
    f32 = tuple(x.astype(_F32) for x in (q, k, v, g, beta))
    m_maps, b_maps = _ops.chunk_maps_from_terms(_ops.chunk_terms(*f32, chunk_size=chunk_size, scale=scale, low=False))
    return jnp.moveaxis(m_maps, 2, 0), jnp.moveaxis(b_maps, 2, 0)


def dh_fold_inputs(q, k, v, g, beta, d_o, *, chunk_size=64, scale=None):
    """The dh fold's input on this rank for the output cotangent ``d_o`` (as ``_gdn_cp_bwd`` computes it)."""
    scale = _ops.validate(q, k, v, g, beta, chunk_size=chunk_size, scale=scale, initial_state=None,
                          name="dh_fold_inputs")[-1]
    f32 = tuple(x.astype(_F32) for x in (q, k, v, g, beta))
    return _dh_maps(*f32, d_o.astype(_F32), chunk_size, scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def _gdn_cp(q, k, v, g, beta, state0, axis_name, fold, dh_fold, chunk_size, scale, interpret):
    out, _ = _gdn_cp_fwd(q, k, v, g, beta, state0, axis_name, fold, dh_fold, chunk_size, scale, interpret)
    return out


def _chunk_maps(q, k, v, g, beta, chunk_size, scale, interpret):
    """This rank's chunk maps from the Pallas chunk kernel (zero state), chunk axis first: ``(m [N, B, H, K, K],
    b [N, B, H, K, V])``, the fold's input."""
    b, _, h, kdim = q.shape
    vdim = v.shape[3]
    zeros = jnp.zeros((b, h, kdim, vdim), _F32)
    _, _, (m_maps, b_maps) = _ops.kernel_forward(
        q, k, v, g, beta, zeros, chunk_size=chunk_size, scale=scale, interpret=interpret, with_maps=True
    )
    # [B, H, N, K, *] -> [N, B, H, K, *]: the fold runs over the leading (chunk) axis.
    return jnp.moveaxis(m_maps, 2, 0), jnp.moveaxis(b_maps, 2, 0)


def _gdn_cp_fwd(q, k, v, g, beta, state0, axis_name, fold, dh_fold, chunk_size, scale, interpret):
    m_rank, b_rank = fold(*_chunk_maps(q, k, v, g, beta, chunk_size, scale, interpret))
    m_all = jax.lax.all_gather(m_rank, axis_name)  # [R, B, H, K, K]
    b_all = jax.lax.all_gather(b_rank, axis_name)  # [R, B, H, K, V]
    states = _chain(m_all, b_all, state0.astype(_F32))  # [R + 1, B, H, K, V]
    idx = jax.lax.axis_index(axis_name)
    state_in = states[idx]
    o, _ = _ops.kernel_forward(q, k, v, g, beta, state_in, chunk_size=chunk_size, scale=scale, interpret=interpret)
    final = states[-1]
    if _vma_on(q, axis_name):
        final = _to_invariant(final, axis_name)
    return (o, final), (q, k, v, g, beta, state0, state_in)


def _gdn_cp_bwd(axis_name, fold, dh_fold, chunk_size, scale, interpret, res, cts):
    del fold, interpret
    q, k, v, g, beta, state0, state_in = res
    d_o, d_final = cts
    d_o = d_o.astype(_F32)
    d_final = d_final.astype(_F32)
    vma = _vma_on(q, axis_name)
    if not vma:  # check_vma=False: each rank was handed cotangent / R of the replicated final state.
        d_final = jax.lax.psum(d_final, axis_name)
    f32 = tuple(x.astype(_F32) for x in (q, k, v, g, beta))
    mt, gt = _dh_maps(*f32, d_o, chunk_size, scale)
    mt_rank, g_rank = dh_fold(mt, gt)
    mt_all = jax.lax.all_gather(mt_rank, axis_name)  # [R, B, H, K, K]
    g_all = jax.lax.all_gather(g_rank, axis_name)  # [R, B, H, K, V]
    # From the last rank to the first: dS_out[R-1] = d_final, dS_in[r] = Mt[r] dS_out[r] + G[r] = dS_out[r-1].
    d_states = _chain(jnp.flip(mt_all, 0), jnp.flip(g_all, 0), d_final)  # [R + 1]: dS_out[R-1], ..., dS_out[0], dS0
    num_ranks = mt_all.shape[0]
    idx = jax.lax.axis_index(axis_name)
    d_state_out = d_states[num_ranks - 1 - idx]
    d_state0 = d_states[num_ranks]

    def local_forward(q_, k_, v_, g_, beta_, s_in):
        return _ops.chunked_xla(q_, k_, v_, g_, beta_, s_in, chunk_size=chunk_size, scale=scale, low=False)

    _, vjp = jax.vjp(local_forward, *f32, state_in)
    dq, dk, dv, dg, dbeta, _ = vjp((d_o, d_state_out))
    if vma and not _vma_on(state0, axis_name):
        d_state0 = _to_invariant(d_state0, axis_name)
    else:  # the caller sums the per-rank cotangents of the replicated initial state
        d_state0 = jnp.where(idx == 0, d_state0, jnp.zeros_like(d_state0))
    grads = (dq, dk, dv, dg, dbeta, d_state0)
    return tuple(gr.astype(x.dtype) for gr, x in zip(grads, (q, k, v, g, beta, state0), strict=True))


_gdn_cp.defvjp(_gdn_cp_fwd, _gdn_cp_bwd)


def gdn_cp(
    q,
    k,
    v,
    g,
    beta,
    *,
    axis_name="context",
    fold: str | Fold = "tree",
    dh_fold: str | Fold = "tree",
    chunk_size=64,
    scale=None,
    initial_state=None,
    interpret=False,
):
    """Context-parallel GDN on this rank's slice; call inside ``jax.shard_map`` with T split over ``axis_name``.

    Args:
      q, k: [B, T_local, H, K]; v: [B, T_local, H, V] (bf16 or f32); g, beta: [B, T_local, H]; T_local a multiple of
        ``chunk_size`` (ranks hold contiguous slices in rank order).
      fold: ``"tree"`` (XLA pairwise tree, default), ``"m_scan"`` (sequential Pallas scan) or a callable (module doc).
      dh_fold: ``"tree"`` (default), ``"dh_scan"`` or a callable, for the backward's transposed maps.
      initial_state: [B, H, K, V], the global initial state (the same on every rank), or None (zeros).
      interpret: passed to the Pallas kernels.
    Returns:
      ``(o_local [B, T_local, H, V] in v's dtype, final_state [B, H, K, V] float32)``: the final state of the whole
      sequence, the same on every rank.
    """
    b, t, h, kdim, vdim, scale = _ops.validate(
        q, k, v, g, beta, chunk_size=chunk_size, scale=scale, initial_state=initial_state, name="gdn_cp"
    )
    if t % chunk_size:
        raise ValueError(f"gdn_cp: local T={t} (q.shape={q.shape}) must be a multiple of chunk_size={chunk_size}")
    fold_fn = resolve_fold(fold, arg_name="fold", scan_name="m_scan", interpret=interpret)
    dh_fold_fn = resolve_fold(dh_fold, arg_name="dh_fold", scan_name="dh_scan", interpret=interpret)
    state0 = jnp.zeros((b, h, kdim, vdim), _F32) if initial_state is None else initial_state.astype(_F32)
    return _gdn_cp(q, k, v, g, beta, state0, axis_name, fold_fn, dh_fold_fn, chunk_size, scale, interpret)


def gdn_cp_sharded(
    mesh,
    q,
    k,
    v,
    g,
    beta,
    *,
    axis_name="context",
    fold: str | Fold = "tree",
    dh_fold: str | Fold = "tree",
    chunk_size=64,
    scale=None,
    initial_state=None,
    interpret=False,
    check_vma=False,
):
    """``gdn_cp`` on global arrays: pad T to a multiple of ``R * chunk_size`` with neutral tokens, ``shard_map`` over
    ``axis_name`` (other mesh axes replicate), unpad. Differentiable in q, k, v, g, beta and initial_state.

    Args: as ``gdn_cp`` with global ``[B, T, ...]`` arrays, plus ``mesh`` (a ``jax.sharding.Mesh`` with ``axis_name``)
      and ``check_vma`` (``shard_map``'s; default False so that ``interpret=True`` works; both conventions are
      supported, see the module docstring).
    Returns: ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] float32)``.
    """
    b, t, h, kdim, vdim, scale = _ops.validate(
        q, k, v, g, beta, chunk_size=chunk_size, scale=scale, initial_state=initial_state, name="gdn_cp_sharded"
    )
    if axis_name not in mesh.shape:
        raise ValueError(f"gdn_cp_sharded: axis_name={axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
    num_ranks = mesh.shape[axis_name]
    state0 = jnp.zeros((b, h, kdim, vdim), _F32) if initial_state is None else initial_state.astype(_F32)
    qp, kp, vp, gp, bp = _ops.pad_to_chunk(q, k, v, g, beta, num_ranks * chunk_size)

    def body(q_, k_, v_, g_, beta_, s0_):
        return gdn_cp(
            q_, k_, v_, g_, beta_, axis_name=axis_name, fold=fold, dh_fold=dh_fold, chunk_size=chunk_size,
            scale=scale, initial_state=s0_, interpret=interpret,
        )  # fmt: skip

    seq = P(None, axis_name)  # T (axis 1) split contiguously over the ranks
    explicit = any(t_ == jax.sharding.AxisType.Explicit for t_ in mesh.axis_types)
    shard = lambda x, spec: jax.reshard(x, jax.sharding.NamedSharding(mesh, spec))  # noqa: E731
    if explicit:  # an explicit-axes mesh: lay the inputs out as shard_map expects them
        qp, kp, vp, gp, bp = (shard(x, seq) for x in (qp, kp, vp, gp, bp))
        state0 = shard(state0, P())
    o, final = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(seq, seq, seq, seq, seq, P()),
        out_specs=(seq, P()),
        check_vma=check_vma,
    )(qp, kp, vp, gp, bp, state0)
    if explicit and o.shape[1] != t:  # unpadding slices across shards: gather T first
        o = shard(o, P())
    return o[:, :t], final
