"""Pallas kernels of Gated DeltaNet: the chunked forward and the sequential fold of affine state maps.

Two ``pallas_call`` builders live here; the differentiable wrappers and the argument validation live in ``ops.py`` and
``context_parallel.py``.

``chunk_forward(q, k, v, g, beta, state0, ...)``: the chunked (WY / UT) GDN forward. Grid ``(B*H, N)``: the first axis
is parallel, the chunk axis is sequential ("arbitrary") and carries the state ``S [K, V]`` in a float32 VMEM scratch
from one chunk to the next. Per chunk of ``C`` tokens (all arithmetic in float32, inputs upcast on load):

    gamma_i   = sum_{j <= i} g_j                         (in-chunk cumulative log decay, a triangular matmul)
    D_ij      = exp(gamma_i - gamma_j) for i >= j, else 0
    L_ij      = beta_i (k_i . k_j) D_ij   for i > j      (strictly lower)
    T         = (I + L)^-1                               (unit lower triangular; forward substitution, row by row)
    u         = T (beta * v)              [C, V]         w = T (beta * exp(gamma) * k)   [C, K]
    U         = u - w S                   [C, V]         (the delta-rule corrections given the incoming state S)
    o         = scale * (exp(gamma) q S + (q k^T * D) U)
    kd        = exp(gamma_C - gamma) * k  [C, K]
    S'        = exp(gamma_C) S + kd^T U
    M_c       = exp(gamma_C) I - kd^T w   [K, K]         B_c = kd^T u   [K, V]        (S' = M_c S + B_c)

Optionally the chunk maps ``(M_c, B_c)`` are written too (the context-parallel path folds them). No exp of a positive
number is ever taken (only differences ``gamma_i - gamma_j`` with ``i >= j``), so strong gates (g = -10 per token)
underflow to 0 instead of overflowing.

``map_scan(m, b, ...)``: composes ``n`` affine maps ``S -> M_i S + B_i`` in order (map 0 applied first) with one
sequential Pallas scan: grid ``(X, n)``, the running ``(M, B)`` in float32 VMEM scratch, ``M <- M_i M``, ``B <- M_i B +
B_i``. This is the ``gdn_cp_m_scan`` fold (and, fed the transposed maps in reverse order, the ``gdn_cp_dh_scan`` fold).

Layouts (kernel-side; ops.py converts): ``q, k: [BH, T, K]``, ``v: [BH, T, V]``, ``g, beta: [BH, T, 1]`` float32,
``state0: [BH, K, V]`` float32.

Run on CPU with ``interpret=True`` (or ``pltpu.InterpretParams(...)``); the tests are
``tests/kernels/test_gdn_kernel.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_HI = jax.lax.Precision.HIGHEST
_F32 = jnp.float32


def _dot(a, b):
    """``a @ b`` in float32 at full precision."""
    return jnp.dot(a, b, precision=_HI, preferred_element_type=_F32)


def _dot_tn(a, b):
    """``a^T @ b`` (contract the leading axes) in float32 at full precision."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_HI, preferred_element_type=_F32)


def _dot_nt(a, b):
    """``a @ b^T`` (contract the trailing axes) in float32 at full precision."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_HI, preferred_element_type=_F32)


def _out_struct(shape, dtype, like):
    """An output ``ShapeDtypeStruct`` varying over the manual mesh axes of ``like`` (needed under ``check_vma``)."""
    mat = getattr(jax.typeof(like), "mat", None)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)


def unit_lower_inverse(lower):
    """``(I + lower)^-1`` for a strictly lower-triangular ``lower: [C, C]`` by forward substitution, in float32.

    Row ``i`` of ``T = (I + L)^-1`` is ``e_i - L[i, :] T`` and only needs rows ``< i`` of ``T`` (L is strictly lower),
    so the rows are filled in order. Written with iota masks (no dynamic slicing) so that it lowers inside a kernel.
    """
    c = lower.shape[0]
    row = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    eye = (row == col).astype(_F32)

    def body(i, t):
        l_row = jnp.sum(jnp.where(row == i, lower, 0.0), axis=0, keepdims=True)  # [1, C]: row i of L
        new_row = jnp.where(col[:1] == i, 1.0, 0.0) - _dot(l_row, t)  # [1, C]
        return jnp.where(row == i, new_row, t)

    return jax.lax.fori_loop(1, c, body, eye)


def _chunk_body(q, k, v, g, beta, state, *, scale):
    """One chunk of the WY/UT form in float32; returns ``(o [C, V], new_state [K, V], (M [K, K], B [K, V]))``.

    ``q, k: [C, K]``, ``v: [C, V]``, ``g, beta: [C, 1]``, ``state: [K, V]``, all float32.
    """
    c = q.shape[0]
    row = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    incl = row >= col
    gamma = _dot(incl.astype(_F32), g)  # [C, 1]: in-chunk cumulative log decay
    gamma_last = gamma[c - 1 :, :]  # [1, 1]
    diff = gamma - gamma.T  # [C, C]
    decay = jnp.where(incl, jnp.exp(jnp.where(incl, diff, 0.0)), 0.0)
    lower = jnp.where(row > col, beta * _dot_nt(k, k) * decay, 0.0)
    t_inv = unit_lower_inverse(lower)
    u = _dot(t_inv, beta * v)  # [C, V]
    w = _dot(t_inv, (beta * jnp.exp(gamma)) * k)  # [C, K]
    corr = u - _dot(w, state)  # [C, V]
    o = scale * (_dot(jnp.exp(gamma) * q, state) + _dot(_dot_nt(q, k) * decay, corr))
    kd = jnp.exp(gamma_last - gamma) * k  # [C, K]
    decay_last = jnp.exp(gamma_last)  # [1, 1]
    new_state = decay_last * state + _dot_tn(kd, corr)
    kdim = k.shape[1]
    eye_k = (
        jax.lax.broadcasted_iota(jnp.int32, (kdim, kdim), 0) == jax.lax.broadcasted_iota(jnp.int32, (kdim, kdim), 1)
    ).astype(_F32)
    m_map = decay_last * eye_k - _dot_tn(kd, w)
    b_map = _dot_tn(kd, u)
    return o, new_state, (m_map, b_map)


def _chunk_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s0_ref, *refs, scale, with_maps):
    if with_maps:
        o_ref, st_ref, m_ref, b_ref, state_scr = refs
    else:
        o_ref, st_ref, state_scr = refs
    n = pl.program_id(1)

    @pl.when(n == 0)
    def _():
        state_scr[...] = s0_ref[...].astype(_F32)

    o, new_state, (m_map, b_map) = _chunk_body(
        q_ref[...].astype(_F32),
        k_ref[...].astype(_F32),
        v_ref[...].astype(_F32),
        g_ref[...].astype(_F32),
        beta_ref[...].astype(_F32),
        state_scr[...],
        scale=scale,
    )
    state_scr[...] = new_state
    o_ref[...] = o.astype(o_ref.dtype)
    if with_maps:
        m_ref[...] = m_map
        b_ref[...] = b_map

    @pl.when(n == pl.num_programs(1) - 1)
    def _():
        st_ref[...] = new_state


@functools.partial(jax.jit, static_argnames=("chunk_size", "scale", "with_maps", "out_dtype", "interpret"))
def chunk_forward(q, k, v, g, beta, state0, *, chunk_size, scale, with_maps=False, out_dtype=None, interpret=False):
    """The chunked GDN forward ``pallas_call``.

    Args:
      q, k: [BH, T, K]; v: [BH, T, V] (bf16 or f32; upcast to float32 in the kernel); T a multiple of ``chunk_size``.
      g, beta: [BH, T, 1] float32 (log decay <= 0, and the write strength).
      state0: [BH, K, V] float32, the state before token 0.
      chunk_size: C, the tokens per grid step; scale: the query scale (a Python float).
      with_maps: also return the chunk maps.
      out_dtype: dtype of ``o`` (default: v's).
    Returns:
      ``(o [BH, T, V], final_state [BH, K, V] f32)`` and, with ``with_maps``, ``(M [BH, N, K, K], B [BH, N, K, V])``
      f32.
    """
    bh, t, kdim = q.shape
    vdim = v.shape[2]
    c = chunk_size
    n_chunks = t // c
    out_dtype = v.dtype if out_dtype is None else out_dtype
    seq = lambda d: pl.BlockSpec((None, c, d), lambda b, n: (b, n, 0))  # noqa: E731
    per_bh = lambda a, b_: pl.BlockSpec((None, a, b_), lambda b, n: (b, 0, 0))  # noqa: E731
    per_chunk = lambda a, b_: pl.BlockSpec((None, None, a, b_), lambda b, n: (b, n, 0, 0))  # noqa: E731
    in_specs = [seq(kdim), seq(kdim), seq(vdim), seq(1), seq(1), per_bh(kdim, vdim)]
    out_shape = [_out_struct((bh, t, vdim), out_dtype, q), _out_struct((bh, kdim, vdim), _F32, q)]
    out_specs = [seq(vdim), per_bh(kdim, vdim)]
    if with_maps:
        out_shape += [
            _out_struct((bh, n_chunks, kdim, kdim), _F32, q),
            _out_struct((bh, n_chunks, kdim, vdim), _F32, q),
        ]
        out_specs += [per_chunk(kdim, kdim), per_chunk(kdim, vdim)]
    outs = pl.pallas_call(
        functools.partial(_chunk_kernel, scale=scale, with_maps=with_maps),
        out_shape=out_shape,
        grid=(bh, n_chunks),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((kdim, vdim), _F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="gdn_chunk_forward",
    )(q, k, v, g, beta, state0)
    if with_maps:
        o, st, m_maps, b_maps = outs
        return o, st, (m_maps, b_maps)
    o, st = outs
    return o, st


def _scan_kernel(m_ref, b_ref, mo_ref, bo_ref, m_scr, b_scr):
    i = pl.program_id(1)
    m_i = m_ref[...].astype(_F32)
    b_i = b_ref[...].astype(_F32)

    @pl.when(i == 0)
    def _():
        m_scr[...] = m_i
        b_scr[...] = b_i

    @pl.when(i > 0)
    def _():
        b_scr[...] = _dot(m_i, b_scr[...]) + b_i
        m_scr[...] = _dot(m_i, m_scr[...])

    @pl.when(i == pl.num_programs(1) - 1)
    def _():
        mo_ref[...] = m_scr[...]
        bo_ref[...] = b_scr[...]


@functools.partial(jax.jit, static_argnames=("interpret",))
def map_scan(m, b, *, interpret=False):
    """Compose ``n`` affine maps in order with a sequential Pallas scan (float32 VMEM accumulators).

    Args:
      m: [n, X, K, K]; b: [n, X, K, V] (map i is ``S -> m[i] S + b[i]``, map 0 applied first).
    Returns:
      ``(M [X, K, K], B [X, K, V])`` float32 with ``M = m[n-1] ... m[0]`` and ``B`` the image of the zero state.
    """
    n, x, kdim, _ = m.shape
    vdim = b.shape[3]
    return pl.pallas_call(
        _scan_kernel,
        out_shape=[_out_struct((x, kdim, kdim), _F32, m), _out_struct((x, kdim, vdim), _F32, m)],
        grid=(x, n),
        in_specs=[
            pl.BlockSpec((None, None, kdim, kdim), lambda j, i: (i, j, 0, 0)),
            pl.BlockSpec((None, None, kdim, vdim), lambda j, i: (i, j, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, kdim, kdim), lambda j, i: (j, 0, 0)),
            pl.BlockSpec((None, kdim, vdim), lambda j, i: (j, 0, 0)),
        ],
        scratch_shapes=[pltpu.VMEM((kdim, kdim), _F32), pltpu.VMEM((kdim, vdim), _F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="gdn_map_scan",
    )(m, b)
