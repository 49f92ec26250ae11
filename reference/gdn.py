"""Float32 references of the Gated DeltaNet (GDN) recurrence: per-token, chunked, chunk maps, fold, context parallel.

Layout follows flash-linear-attention: ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``, ``g, beta: [B, T, H]`` (``g`` is the
log decay, ``g <= 0``), state ``[B, H, K, V]``; ``scale`` defaults to ``K ** -0.5``. Per head, the recurrence
(decay first, then the delta correction on the decayed state) is::

    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T
    o_t = S_t^T (scale * q_t)

so every token is an affine map of the state, ``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, and
so is every chunk and every contiguous slice of tokens (their composition). The functions here:

- ``gdn_recurrent``: the per-token ``lax.scan``: the ground truth;
- ``gdn_chunked``: the chunked WY / UT form (what the kernels compute), equal to ``gdn_recurrent`` in float32;
- ``gdn_chunk_maps``: each chunk as the affine map ``S_out = M_c @ S_in + B_c``;
- ``gdn_fold``: the composition of consecutive chunk maps (a sequential scan or a pairwise tree);
- ``gdn_context_parallel``: the context-parallel algorithm simulated on one device.

Everything is float32 (inputs are upcast at entry), every matmul / einsum uses ``precision=HIGHEST``, and every function
is jittable (``chunk_size``, ``num_ranks``, ``scale`` and ``order`` static) and differentiable by JAX autodiff.

Validation raises ``ValueError`` naming the argument and its value. Shapes, dtypes and static arguments are always
checked; the value check on ``g`` (finite and ``<= 0``) runs only on concrete arrays: inside ``jax.jit``, ``grad`` or
``vmap`` ``g`` is a tracer and its values are not checked.

Tests: ``python -m pytest tests/reference/test_gdn.py -q`` (against a float64 NumPy loop written in the test).
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

_HIGHEST = jax.lax.Precision.HIGHEST

__all__ = ["gdn_recurrent", "gdn_chunked", "gdn_chunk_maps", "gdn_fold", "gdn_context_parallel"]


# ----------------------------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------------------------


def _check_float(name: str, x) -> None:
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{name}.dtype={dtype} must be a floating dtype")


def _check_chunk_size(chunk_size) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int | np.integer):
        raise ValueError(f"chunk_size={chunk_size!r} must be an int (a power of two)")
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size={chunk_size} must be a power of two >= 1")


def _check_g_values(g) -> None:
    """``g`` finite and ``<= 0``; skipped for tracers (inside jit / grad / vmap the values are unknown)."""
    if isinstance(g, jax.core.Tracer):
        return
    g_host = np.asarray(g, dtype=np.float32)
    bad = ~np.isfinite(g_host) | (g_host > 0)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"g must be finite and <= 0 (the log decay); got g{list(idx)}={float(g_host[idx])!r} "
            f"({int(bad.sum())} of {g_host.size} values out of range)"
        )


def _check_scale(scale, head_dim_k: int) -> float:
    if scale is None:
        return head_dim_k**-0.5
    if isinstance(scale, bool) or not isinstance(scale, int | float | np.integer | np.floating):
        raise ValueError(f"scale={scale!r} must be a Python float (static), or None for K ** -0.5")
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale={scale!r} must be finite")
    return float(scale)


def _check_kvgb(k, v, g, beta) -> tuple[int, int, int, int, int]:
    """Shapes of ``k [B,T,H,K]``, ``v [B,T,H,V]``, ``g, beta [B,T,H]``; returns ``(B, T, H, K, V)``."""
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        _check_float(name, x)
    if jnp.ndim(k) != 4:
        raise ValueError(f"k.shape={jnp.shape(k)} must be [B, T, H, K] (rank 4)")
    b, t, h, dk = jnp.shape(k)
    if t < 1:
        raise ValueError(f"k.shape={jnp.shape(k)}: the sequence length T={t} must be >= 1")
    if jnp.ndim(v) != 4 or tuple(jnp.shape(v)[:3]) != (b, t, h):
        raise ValueError(f"v.shape={jnp.shape(v)} must be [B, T, H, V] = [{b}, {t}, {h}, V] (k.shape={jnp.shape(k)})")
    for name, x in (("g", g), ("beta", beta)):
        if tuple(jnp.shape(x)) != (b, t, h):
            raise ValueError(f"{name}.shape={jnp.shape(x)} must be [B, T, H] = {[b, t, h]} (k.shape={jnp.shape(k)})")
    _check_g_values(g)
    return b, t, h, dk, jnp.shape(v)[3]


def _check_all(q, k, v, g, beta, scale, initial_state) -> tuple[tuple[int, int, int, int, int], float]:
    """Validate the arguments of the sequence functions; returns ``((B, T, H, K, V), scale)``."""
    _check_float("q", q)
    if jnp.ndim(q) != 4:
        raise ValueError(f"q.shape={jnp.shape(q)} must be [B, T, H, K] (rank 4)")
    if jnp.shape(k) != jnp.shape(q):
        raise ValueError(f"k.shape={jnp.shape(k)} must equal q.shape={jnp.shape(q)}")
    b, t, h, dk, dv = _check_kvgb(k, v, g, beta)
    if initial_state is not None:
        _check_float("initial_state", initial_state)
        if tuple(jnp.shape(initial_state)) != (b, h, dk, dv):
            raise ValueError(
                f"initial_state.shape={jnp.shape(initial_state)} must be [B, H, K, V] = {[b, h, dk, dv]}"
            )
    return (b, t, h, dk, dv), _check_scale(scale, dk)


def _f32(*xs):
    return tuple(jnp.asarray(x, jnp.float32) for x in xs)


def _zero_state(b: int, h: int, dk: int, dv: int, initial_state):
    if initial_state is None:
        return jnp.zeros((b, h, dk, dv), jnp.float32)
    return jnp.asarray(initial_state, jnp.float32)


# ----------------------------------------------------------------------------------------------------------------------
# The per-token recurrence: ground truth
# ----------------------------------------------------------------------------------------------------------------------


def gdn_recurrent(q, k, v, g, beta, scale=None, initial_state=None):
    """The GDN recurrence, one token at a time (``lax.scan`` over T): the ground truth.

    Args:
      q, k: ``[B, T, H, K]`` queries and keys (the model L2-normalizes them; not required here).
      v: ``[B, T, H, V]`` values.
      g: ``[B, T, H]`` log decay, ``g <= 0`` (checked when concrete).
      beta: ``[B, T, H]`` delta-rule write strength.
      scale: query scale, default ``K ** -0.5``.
      initial_state: ``[B, H, K, V]`` or None (zeros).

    Returns:
      ``(o [B, T, H, V], final_state [B, H, K, V])``, float32.
    """
    (b, _, h, dk, dv), scale = _check_all(q, k, v, g, beta, scale, initial_state)
    q, k, v, g, beta = _f32(q, k, v, g, beta)
    state_bhkv = _zero_state(b, h, dk, dv, initial_state)

    def step(s_bhkv, xs):
        q_bhk, k_bhk, v_bhv, g_bh, beta_bh = xs
        s_bhkv = jnp.exp(g_bh)[:, :, None, None] * s_bhkv  # decay first
        pred_bhv = jnp.einsum("BHKV,BHK->BHV", s_bhkv, k_bhk, precision=_HIGHEST)  # S^T k on the decayed state
        u_bhv = beta_bh[:, :, None] * (v_bhv - pred_bhv)
        s_bhkv = s_bhkv + jnp.einsum("BHK,BHV->BHKV", k_bhk, u_bhv, precision=_HIGHEST)
        o_bhv = jnp.einsum("BHKV,BHK->BHV", s_bhkv, scale * q_bhk, precision=_HIGHEST)
        return s_bhkv, o_bhv

    # Time-major for the scan: [B, T, H, ...] -> [T, B, H, ...].
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    final_bhkv, o_tbhv = jax.lax.scan(step, state_bhkv, xs)
    return jnp.moveaxis(o_tbhv, 0, 1), final_bhkv  # [T, B, H, V] -> [B, T, H, V]


# ----------------------------------------------------------------------------------------------------------------------
# The chunked (WY / UT) form
# ----------------------------------------------------------------------------------------------------------------------


def _pad_time(x, t_padded: int):
    """Pad axis 1 (T) with zeros to ``t_padded``. Zero q, k, v, g, beta tokens are neutral: ``M_t = I``, ``B_t = 0``."""
    pad = t_padded - x.shape[1]
    if pad == 0:
        return x
    return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))


def _to_chunks(x, chunk_size: int):
    """``[B, T, H, *D] -> [B, N, H, C, *D]`` (T = N * C)."""
    b, t, h = x.shape[:3]
    x = x.reshape(b, t // chunk_size, chunk_size, h, *x.shape[3:])  # [B, N, C, H, *D]
    return jnp.moveaxis(x, 3, 2)  # [B, N, H, C, *D]


def _from_chunks(x):
    """``[B, N, H, C, *D] -> [B, N * C, H, *D]``."""
    x = jnp.moveaxis(x, 2, 3)  # [B, N, C, H, *D]
    b, n, c = x.shape[:3]
    return x.reshape(b, n * c, *x.shape[3:])  # [B, T, H, *D]


def _chunk_terms(k_c, v_c, g_c, beta_c):
    """Per-chunk WY / UT quantities; every chunk independent (no state yet).

    Within a chunk (positions i, j = 0..C-1) with the inclusive cumulative log decay ``G_i = sum_{j <= i} g_j`` and
    ``gamma_i = exp(G_i)``, unrolling the recurrence from the chunk's incoming state ``S_0`` gives the corrections
    ``u_i = beta_i (v_i - S_{i-1}'^T k_i)`` as the solution of a unit lower-triangular system::

        (I + A) U = diag(beta) V - diag(beta * gamma) K S_0,   A_ij = beta_i (gamma_i / gamma_j) k_i . k_j   (j < i)

    so ``U = U~ - W S_0`` with ``W = (I + A)^{-1} diag(beta gamma) K`` and ``U~ = (I + A)^{-1} diag(beta) V``.

    Args:
      k_c: ``[B, N, H, C, K]``; v_c: ``[B, N, H, C, V]``; g_c, beta_c: ``[B, N, H, C]``.

    Returns:
      w ``[B, N, H, C, K]``, u_tilde ``[B, N, H, C, V]``, decay ``[B, N, H, C, C]`` (``gamma_i / gamma_j`` for
      ``j <= i``, else 0), gamma ``[B, N, H, C]``, to_end ``[B, N, H, C]`` (``gamma_last / gamma_j``).
    """
    c = g_c.shape[-1]
    cum_g = jnp.cumsum(g_c, axis=-1)  # [B, N, H, C] inclusive
    log_ratio = cum_g[..., :, None] - cum_g[..., None, :]  # [B, N, H, C(i), C(j)] = G_i - G_j
    causal = jnp.tril(jnp.ones((c, c), bool))  # j <= i
    strict = jnp.tril(jnp.ones((c, c), bool), -1)  # j < i
    # exp only where j <= i (G_i - G_j <= 0); the inner where keeps exp (and its gradient) finite above the diagonal.
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, log_ratio, 0.0)), 0.0)
    kk = jnp.einsum("BNHIK,BNHJK->BNHIJ", k_c, k_c, precision=_HIGHEST)
    a_strict = jnp.where(strict, beta_c[..., :, None] * decay * kk, 0.0)
    unit_lower = a_strict + jnp.eye(c, dtype=jnp.float32)  # I + A, unit lower triangular
    gamma = jnp.exp(cum_g)
    rhs = jnp.concatenate([(beta_c * gamma)[..., None] * k_c, beta_c[..., None] * v_c], axis=-1)  # [.., C, K + V]
    # Apply the unit lower-triangular inverse (I + A)^{-1} by forward substitution (exact triangular solve).
    sol = jax.lax.linalg.triangular_solve(unit_lower, rhs, left_side=True, lower=True, unit_diagonal=True)
    dk = k_c.shape[-1]
    w, u_tilde = sol[..., :dk], sol[..., dk:]
    to_end = jnp.exp(cum_g[..., -1:] - cum_g)  # [B, N, H, C] gamma_last / gamma_j
    return w, u_tilde, decay, gamma, to_end


def _chunked_core(q, k, v, g, beta, chunk_size: int, scale: float, state_bhkv):
    """Chunked forward on validated float32 inputs with T a multiple of ``chunk_size``; returns ``(o, final_state)``."""
    q_c, k_c, v_c = (_to_chunks(x, chunk_size) for x in (q, k, v))  # [B, N, H, C, K|V]
    g_c, beta_c = (_to_chunks(x, chunk_size) for x in (g, beta))  # [B, N, H, C]
    w, u_tilde, decay, gamma, to_end = _chunk_terms(k_c, v_c, g_c, beta_c)
    # Intra-chunk attention (q_i . k_j) gamma_i / gamma_j for j <= i, with the scale folded into q.
    q_c = scale * q_c
    qk = jnp.einsum("BNHIK,BNHJK->BNHIJ", q_c, k_c, precision=_HIGHEST) * decay
    k_to_end = to_end[..., None] * k_c  # [B, N, H, C, K]
    gamma_last = gamma[..., -1]  # [B, N, H]

    def step(s_bhkv, xs):
        q_hck, k_end_hck, w_hck, ut_hcv, qk_hcc, gamma_hc, gl_h = xs
        u_hcv = ut_hcv - jnp.einsum("BHCK,BHKV->BHCV", w_hck, s_bhkv, precision=_HIGHEST)
        o_hcv = gamma_hc[..., None] * jnp.einsum("BHCK,BHKV->BHCV", q_hck, s_bhkv, precision=_HIGHEST)
        o_hcv = o_hcv + jnp.einsum("BHIJ,BHJV->BHIV", qk_hcc, u_hcv, precision=_HIGHEST)
        s_bhkv = gl_h[..., None, None] * s_bhkv + jnp.einsum(
            "BHCK,BHCV->BHKV", k_end_hck, u_hcv, precision=_HIGHEST
        )
        return s_bhkv, o_hcv

    # Chunk-major for the scan over chunks: [B, N, ...] -> [N, B, ...].
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q_c, k_to_end, w, u_tilde, qk, gamma, gamma_last))
    final_bhkv, o_nbhcv = jax.lax.scan(step, state_bhkv, xs)
    return _from_chunks(jnp.moveaxis(o_nbhcv, 0, 1)), final_bhkv  # [N, B, H, C, V] -> [B, T, H, V]


def gdn_chunked(q, k, v, g, beta, chunk_size=64, scale=None, initial_state=None):
    """The chunked (WY / UT) form of the GDN recurrence; equal to ``gdn_recurrent`` up to float32 rounding.

    T is padded to a multiple of ``chunk_size`` with neutral tokens (zero q, k, v, g, beta: identity map) and the
    padding is cut from ``o``. Within a chunk the delta corrections come from a unit lower-triangular solve
    (see ``_chunk_terms``); across chunks a ``lax.scan`` carries the state.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g, beta: ``[B, T, H]`` (``g <= 0``).
      chunk_size: a power of two (static).
      scale: query scale, default ``K ** -0.5``.
      initial_state: ``[B, H, K, V]`` or None (zeros).

    Returns:
      ``(o [B, T, H, V], final_state [B, H, K, V])``, float32.
    """
    _check_chunk_size(chunk_size)
    (b, t, h, dk, dv), scale = _check_all(q, k, v, g, beta, scale, initial_state)
    q, k, v, g, beta = _f32(q, k, v, g, beta)
    state_bhkv = _zero_state(b, h, dk, dv, initial_state)
    t_padded = -(-t // chunk_size) * chunk_size
    q, k, v, g, beta = (_pad_time(x, t_padded) for x in (q, k, v, g, beta))
    o, final_bhkv = _chunked_core(q, k, v, g, beta, chunk_size, scale, state_bhkv)
    return o[:, :t], final_bhkv


# ----------------------------------------------------------------------------------------------------------------------
# Chunks as affine maps of the state, and their composition
# ----------------------------------------------------------------------------------------------------------------------


def _maps_core(k, v, g, beta, chunk_size: int):
    """Chunk maps of validated float32 inputs with T a multiple of ``chunk_size``."""
    k_c, v_c = _to_chunks(k, chunk_size), _to_chunks(v, chunk_size)  # [B, N, H, C, K|V]
    g_c, beta_c = _to_chunks(g, chunk_size), _to_chunks(beta, chunk_size)  # [B, N, H, C]
    w, u_tilde, _, gamma, to_end = _chunk_terms(k_c, v_c, g_c, beta_c)
    k_to_end = to_end[..., None] * k_c  # [B, N, H, C, K]
    dk = k_c.shape[-1]
    # S_out = gamma_last S_in + K^T diag(to_end) (U~ - W S_in).
    m = gamma[..., -1, None, None] * jnp.eye(dk, dtype=jnp.float32) - jnp.einsum(
        "BNHCK,BNHCL->BNHKL", k_to_end, w, precision=_HIGHEST
    )
    b_map = jnp.einsum("BNHCK,BNHCV->BNHKV", k_to_end, u_tilde, precision=_HIGHEST)
    return m, b_map


def gdn_chunk_maps(k, v, g, beta, chunk_size=64):
    """Each chunk of ``chunk_size`` tokens as an affine map of the state: ``S_out = M_c @ S_in + B_c``.

    ``M_c`` acts on the state ``[K, V]`` from the left (per batch row and head). The chunk axis is axis 1, after B.
    T is padded to ``N * chunk_size`` with neutral tokens, so the last chunk may hold fewer real tokens.
    (``q`` and ``scale`` do not enter: the maps only carry the state.)

    Args:
      k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g, beta: ``[B, T, H]`` (``g <= 0``).
      chunk_size: a power of two (static).

    Returns:
      ``(M [B, N, H, K, K], B_c [B, N, H, K, V])``, float32, ``N = ceil(T / chunk_size)``.
    """
    _check_chunk_size(chunk_size)
    _, t, _, _, _ = _check_kvgb(k, v, g, beta)
    k, v, g, beta = _f32(k, v, g, beta)
    t_padded = -(-t // chunk_size) * chunk_size
    k, v, g, beta = (_pad_time(x, t_padded) for x in (k, v, g, beta))
    return _maps_core(k, v, g, beta, chunk_size)


def _compose(first, second):
    """The map ``second(first(S))``: ``(M2 @ M1, M2 @ B1 + B2)``, batched over leading axes."""
    m1, b1 = first
    m2, b2 = second
    m = jnp.einsum("...KL,...LM->...KM", m2, m1, precision=_HIGHEST)
    b = jnp.einsum("...KL,...LV->...KV", m2, b1, precision=_HIGHEST) + b2
    return m, b


def _identity_maps(shape_m, shape_b):
    """Identity maps of shapes ``[..., K, K]`` and ``[..., K, V]``."""
    m = jnp.broadcast_to(jnp.eye(shape_m[-1], dtype=jnp.float32), shape_m)
    return m, jnp.zeros(shape_b, jnp.float32)


def _fold_sequential(m, b_map):
    """Compose ``[B, N, H, ...]`` maps with a ``lax.scan`` over N (chunk 0 applied first)."""
    shape_m, shape_b = m.shape[:1] + m.shape[2:], b_map.shape[:1] + b_map.shape[2:]
    init = _identity_maps(shape_m, shape_b)

    def step(acc, chunk_map):
        return _compose(acc, chunk_map), None

    # Chunk-major for the scan: [B, N, ...] -> [N, B, ...].
    out, _ = jax.lax.scan(step, init, (jnp.moveaxis(m, 1, 0), jnp.moveaxis(b_map, 1, 0)))
    return out


def _fold_tree(m, b_map):
    """Compose ``[B, N, H, ...]`` maps by a pairwise reduction tree: (0, 1), (2, 3), ... per level, earlier first."""
    while m.shape[1] > 1:
        if m.shape[1] % 2:  # an odd count: append an identity map after the last one (composition unchanged)
            eye_m, zero_b = _identity_maps(m[:, :1].shape, b_map[:, :1].shape)
            m, b_map = jnp.concatenate([m, eye_m], axis=1), jnp.concatenate([b_map, zero_b], axis=1)
        m, b_map = _compose((m[:, 0::2], b_map[:, 0::2]), (m[:, 1::2], b_map[:, 1::2]))
    if m.shape[1] == 0:
        return _identity_maps(m.shape[:1] + m.shape[2:], b_map.shape[:1] + b_map.shape[2:])
    return m[:, 0], b_map[:, 0]


def gdn_fold(maps, order: Literal["sequential", "tree"] = "sequential"):
    """Compose consecutive chunk maps along the chunk axis (axis 1); chunk 0 is applied first.

    ``S_out = M @ S_in + B`` of the result equals applying the N maps in order. ``order="sequential"`` is a
    ``lax.scan`` (one map after the other); ``order="tree"`` a pairwise reduction (log2 N levels of independent
    compositions). The two differ only by float32 rounding (composition is associative).

    Args:
      maps: ``(M [B, N, H, K, K], B_c [B, N, H, K, V])`` as returned by ``gdn_chunk_maps``; N may be 0 (identity).
      order: ``"sequential"`` or ``"tree"`` (static).

    Returns:
      ``(M [B, H, K, K], B [B, H, K, V])``, float32.
    """
    if not isinstance(maps, tuple | list) or len(maps) != 2:
        raise ValueError(f"maps must be a pair (M [B, N, H, K, K], B_c [B, N, H, K, V]); got {type(maps).__name__}")
    m, b_map = maps
    _check_float("maps[0] (M)", m)
    _check_float("maps[1] (B_c)", b_map)
    if jnp.ndim(m) != 5 or jnp.shape(m)[-1] != jnp.shape(m)[-2]:
        raise ValueError(f"maps[0] (M).shape={jnp.shape(m)} must be [B, N, H, K, K]")
    if jnp.ndim(b_map) != 5 or tuple(jnp.shape(b_map)[:4]) != tuple(jnp.shape(m)[:4]):
        raise ValueError(
            f"maps[1] (B_c).shape={jnp.shape(b_map)} must be [B, N, H, K, V] = {list(jnp.shape(m)[:4])} + [V] "
            f"(M.shape={jnp.shape(m)})"
        )
    m, b_map = _f32(m, b_map)
    if order == "sequential":
        return _fold_sequential(m, b_map)
    if order == "tree":
        return _fold_tree(m, b_map)
    raise ValueError(f"order={order!r} must be 'sequential' or 'tree'")


# ----------------------------------------------------------------------------------------------------------------------
# Context parallelism, simulated on one device
# ----------------------------------------------------------------------------------------------------------------------


def gdn_context_parallel(q, k, v, g, beta, num_ranks, chunk_size=64, scale=None, initial_state=None):
    """The context-parallel GDN algorithm on one device; equal to ``gdn_recurrent`` up to float32 rounding.

    1. Pad T with neutral tokens to a multiple of ``num_ranks * chunk_size`` and split it into ``num_ranks`` contiguous
       slices (rank r holds tokens ``[r * T_r, (r + 1) * T_r)``; trailing ranks may hold only padding).
    2. Each rank folds its slice's chunk maps into one map (``gdn_fold(..., order="tree")``).
    3. The ranks' maps are composed left to right; the exclusive prefix applied to ``initial_state`` is each rank's
       incoming state (rank 0 gets ``initial_state``).
    4. Each rank replays its slice with the chunked form from its incoming state; the last rank's final state is the
       global final state.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g, beta: ``[B, T, H]`` (``g <= 0``).
      num_ranks: number of context-parallel ranks, an int >= 1 (static).
      chunk_size: a power of two (static).
      scale: query scale, default ``K ** -0.5``.
      initial_state: ``[B, H, K, V]`` or None (zeros).

    Returns:
      ``(o [B, T, H, V], final_state [B, H, K, V])``, float32.
    """
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int | np.integer) or num_ranks < 1:
        raise ValueError(f"num_ranks={num_ranks!r} must be an int >= 1")
    _check_chunk_size(chunk_size)
    (b, t, h, dk, dv), scale = _check_all(q, k, v, g, beta, scale, initial_state)
    q, k, v, g, beta = _f32(q, k, v, g, beta)
    state_bhkv = _zero_state(b, h, dk, dv, initial_state)
    r = int(num_ranks)
    per_rank = -(-t // (r * chunk_size)) * chunk_size  # T_r, a multiple of chunk_size
    q, k, v, g, beta = (_pad_time(x, r * per_rank) for x in (q, k, v, g, beta))

    # Rank-major slices with the rank merged into the batch: [B, R * T_r, H, ...] -> [B * R, T_r, H, ...].
    def by_rank(x):
        return x.reshape(b * r, per_rank, *x.shape[2:])

    q_r, k_r, v_r, g_r, beta_r = (by_rank(x) for x in (q, k, v, g, beta))

    # Step 2: every rank's map, [B * R, H, K, K] and [B * R, H, K, V].
    m_rank, b_rank = gdn_fold(_maps_core(k_r, v_r, g_r, beta_r, chunk_size), order="tree")

    # Step 3: exclusive prefix over ranks, left to right, applied to the initial state.
    # [B * R, H, ...] -> [R, B, H, ...] (rank-major for the scan).
    m_rank = jnp.moveaxis(m_rank.reshape(b, r, h, dk, dk), 1, 0)
    b_rank = jnp.moveaxis(b_rank.reshape(b, r, h, dk, dv), 1, 0)

    def prefix(acc, rank_map):
        return _compose(acc, rank_map), acc  # emit the maps of ranks < r (exclusive)

    _, (m_pre, b_pre) = jax.lax.scan(prefix, _identity_maps(m_rank.shape[1:], b_rank.shape[1:]), (m_rank, b_rank))
    incoming = jnp.einsum("RBHKL,BHLV->RBHKV", m_pre, state_bhkv, precision=_HIGHEST) + b_pre  # [R, B, H, K, V]
    incoming = jnp.moveaxis(incoming, 0, 1).reshape(b * r, h, dk, dv)  # [R, B, ...] -> [B * R, H, K, V]

    # Step 4: replay every slice from its incoming state.
    o_r, final_r = _chunked_core(q_r, k_r, v_r, g_r, beta_r, chunk_size, scale, incoming)
    o = o_r.reshape(b, r * per_rank, h, dv)[:, :t]  # [B * R, T_r, H, V] -> [B, T, H, V]
    final_bhkv = final_r.reshape(b, r, h, dk, dv)[:, -1]  # [B * R, ...] -> [B, R, ...], the last rank
    return o, final_bhkv
