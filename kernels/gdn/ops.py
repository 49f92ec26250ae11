"""Gated DeltaNet ops: the Pallas chunk kernel as a differentiable op, and the trainer's bf16 XLA chunked path.

Public API (layouts as ``reference/gdn.py``: ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``, ``g, beta: [B, T, H]``, state
``[B, H, K, V]``; ``g`` is the log decay, ``g <= 0``; ``scale`` defaults to ``K ** -0.5``):

- ``gdn_chunk(q, k, v, g, beta, *, chunk_size=64, scale=None, initial_state=None, interpret=False) -> (o,
  final_state)``: the forward is the Pallas kernel (``kernel.chunk_forward``); the backward is JAX code (see
  ``gdn_chunk``'s docstring).
- ``gdn_chunk_xla(q, k, v, g, beta, *, chunk_size=64, scale=None, initial_state=None) -> (o, final_state)``: the chunked
  WY/UT form in plain XLA as the trainer runs it without the kernel; differentiable by JAX autodiff (the baseline).

Both pad T to a multiple of the chunk with neutral tokens (``g = 0``: no decay; ``beta = 0``: no update; q = k = v = 0)
and drop the padded outputs. The per-chunk building blocks (``chunk_terms``, ``chunk_scan``) are shared with
``context_parallel.py``. Tests: ``tests/kernels/test_gdn_kernel.py``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

from nxgates.kernels.gdn import kernel as _kernel

_HI = jax.lax.Precision.HIGHEST
_F32 = jnp.float32
CHUNK_SIZES = (16, 32, 64)
_FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


# ----------------------------------------------------------------------------------------------------------------------
# Validation and layout
# ----------------------------------------------------------------------------------------------------------------------


def validate(q, k, v, g, beta, *, chunk_size, scale, initial_state, name="gdn"):
    """Check shapes and dtypes at the boundary; returns ``(B, T, H, K, V, scale)`` with the default scale filled in."""
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"{name}: chunk_size={chunk_size!r} must be one of {CHUNK_SIZES}")
    for arg_name, x, rank in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 3), ("beta", beta, 3)):
        if not hasattr(x, "shape") or x.ndim != rank:
            raise ValueError(f"{name}: {arg_name} must be a rank-{rank} array, got shape {getattr(x, 'shape', x)!r}")
    for arg_name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.dtype(x.dtype) not in _FLOAT_DTYPES:
            raise ValueError(f"{name}: {arg_name}.dtype={x.dtype} must be bfloat16 or float32")
    for arg_name, x in (("g", g), ("beta", beta)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name}: {arg_name}.dtype={x.dtype} must be a floating dtype")
    b, t, h, kdim = q.shape
    if k.shape != q.shape:
        raise ValueError(f"{name}: k.shape={k.shape} must equal q.shape={q.shape} ([B, T, H, K])")
    if v.shape[:3] != (b, t, h):
        raise ValueError(f"{name}: v.shape={v.shape} must be [B, T, H, V] with [B, T, H]={(b, t, h)}")
    for arg_name, x in (("g", g), ("beta", beta)):
        if x.shape != (b, t, h):
            raise ValueError(f"{name}: {arg_name}.shape={x.shape} must be [B, T, H]={(b, t, h)}")
    vdim = v.shape[3]
    if initial_state is not None and initial_state.shape != (b, h, kdim, vdim):
        raise ValueError(
            f"{name}: initial_state.shape={initial_state.shape} must be [B, H, K, V]={(b, h, kdim, vdim)}"
        )
    if t == 0:
        raise ValueError(f"{name}: q.shape={q.shape} has T=0 tokens")
    if scale is None:
        scale = kdim**-0.5
    elif not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{name}: scale={scale!r} must be a positive finite Python float")
    return b, t, h, kdim, vdim, float(scale)


def pad_to_chunk(q, k, v, g, beta, multiple):
    """Pad T up to a multiple of ``multiple`` with neutral tokens (q = k = v = 0, g = 0, beta = 0)."""
    t = q.shape[1]
    pad = (-t) % multiple
    if pad == 0:
        return q, k, v, g, beta
    pad4 = ((0, 0), (0, pad), (0, 0), (0, 0))
    pad3 = ((0, 0), (0, pad), (0, 0))
    return jnp.pad(q, pad4), jnp.pad(k, pad4), jnp.pad(v, pad4), jnp.pad(g, pad3), jnp.pad(beta, pad3)


def to_kernel_layout(q, k, v, g, beta):
    """[B, T, H, D] -> [B*H, T, D]; g, beta [B, T, H] -> [B*H, T, 1] float32."""
    b, t, h, _ = q.shape

    def seq(x):  # [B, T, H, D] -> [B, H, T, D] -> [B*H, T, D]
        return jnp.transpose(x, (0, 2, 1, 3)).reshape(b * h, t, x.shape[3])

    def gate(x):  # [B, T, H] -> [B, H, T] -> [B*H, T, 1]
        return jnp.transpose(x.astype(_F32), (0, 2, 1)).reshape(b * h, t, 1)

    return seq(q), seq(k), seq(v), gate(g), gate(beta)


def from_kernel_layout(x, b, h):
    """[B*H, T, D] -> [B, T, H, D]."""
    bh, t, d = x.shape
    return jnp.transpose(x.reshape(b, h, t, d), (0, 2, 1, 3))  # [B*H, T, D] -> [B, H, T, D] -> [B, T, H, D]


# ----------------------------------------------------------------------------------------------------------------------
# The chunked form in XLA (per-chunk terms, then a scan over chunks carrying the state)
# ----------------------------------------------------------------------------------------------------------------------


def _mm(spec, a, b, low):
    """einsum with float32 accumulation; ``low``: bf16 operands (the trainer's MXU path), else float32 at HIGHEST."""
    if low:
        return jnp.einsum(spec, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=_F32)
    return jnp.einsum(spec, a.astype(_F32), b.astype(_F32), precision=_HI, preferred_element_type=_F32)


def chunk_terms(q, k, v, g, beta, *, chunk_size, scale, low=False):
    """The state-independent per-chunk terms of the WY/UT form.

    Args:
      q, k: [B, T, H, K]; v: [B, T, H, V]; g, beta: [B, T, H]; T a multiple of ``chunk_size``.
      low: the trainer's bf16 numerics: q, k, v enter matmuls as bf16 (float32 accumulation) and ``u``, ``w`` are
      rounded
        to bf16; the decays, ``L``, the triangular inverse ``T`` stay float32. Otherwise float32 everywhere (HIGHEST).
    Returns a dict of arrays laid out [B, H, N, C, D] (N chunks of C tokens):
      u [.., C, V], w [.., C, K] (bf16-valued when ``low``), qd = scale exp(gamma) q [.., C, K],
      aqk = scale (q k^T * D) [.., C, C], kd = exp(gamma_C - gamma) k [.., C, K], decay_last = exp(gamma_C) [B, H, N].
    """
    b, t, h, kdim = q.shape
    c = chunk_size
    n = t // c

    def split(x):  # [B, T, H, D] -> [B, N, C, H, D] -> [B, H, N, C, D]
        return jnp.transpose(x.reshape(b, n, c, h, x.shape[-1]), (0, 3, 1, 2, 4))

    qc, kc, vc = split(q), split(k), split(v)
    gc = split(g.astype(_F32)[..., None])[..., 0]  # [B, H, N, C]
    bc = split(beta.astype(_F32)[..., None])[..., 0]  # [B, H, N, C]
    if not low:
        qc, kc, vc = qc.astype(_F32), kc.astype(_F32), vc.astype(_F32)
    gamma = jnp.cumsum(gc, axis=-1)  # [B, H, N, C]
    incl = jnp.tril(jnp.ones((c, c), bool))
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    diff = gamma[..., :, None] - gamma[..., None, :]  # [B, H, N, C, C]
    decay = jnp.where(incl, jnp.exp(jnp.where(incl, diff, 0.0)), 0.0)
    kk = _mm("BHNCK,BHNDK->BHNCD", kc, kc, low)
    lower = jnp.where(strict, bc[..., :, None] * kk * decay, 0.0)
    eye = jnp.eye(c, dtype=_F32)
    bv = bc[..., None] * vc.astype(_F32)  # [B, H, N, C, V]
    bk = (bc * jnp.exp(gamma))[..., None] * kc.astype(_F32)  # [B, H, N, C, K]
    # (I + L) [u | w] = [beta v | beta exp(gamma) k]: forward substitution in float32.
    rhs = jnp.concatenate([bv, bk], axis=-1)
    uw = solve_triangular(eye + lower, rhs, lower=True, unit_diagonal=True)
    u, w = uw[..., : v.shape[-1]], uw[..., v.shape[-1] :]
    if low:
        u, w = u.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    aqk = scale * _mm("BHNCK,BHNDK->BHNCD", qc, kc, low) * decay
    qd = scale * jnp.exp(gamma)[..., None] * qc.astype(_F32)
    gamma_last = gamma[..., -1:]  # [B, H, N, 1]
    kd = jnp.exp(gamma_last - gamma)[..., None] * kc.astype(_F32)
    return dict(u=u, w=w, qd=qd, aqk=aqk, kd=kd, decay_last=jnp.exp(gamma_last[..., 0]))


def chunk_maps_from_terms(terms):
    """``(M [B, H, N, K, K], B [B, H, N, K, V])`` float32: chunk c maps the state as ``S -> M_c S + B_c``."""
    kdim = terms["kd"].shape[-1]
    m_maps = terms["decay_last"][..., None, None] * jnp.eye(kdim, dtype=_F32) - jnp.einsum(
        "BHNCK,BHNCJ->BHNKJ", terms["kd"], terms["w"].astype(_F32), precision=_HI
    )
    b_maps = jnp.einsum("BHNCK,BHNCV->BHNKV", terms["kd"], terms["u"].astype(_F32), precision=_HI)
    return m_maps, b_maps


def chunk_scan(terms, state0, low=False):
    """Run the chunks in order from ``state0 [B, H, K, V]`` (float32 state); returns ``(o [B, H, N, C, V] f32, S_T)``.

    With ``low`` the intra-chunk product ``aqk @ corr`` takes bf16 operands (f32 accumulation); every product with the
    state is float32 (HIGHEST).
    """

    def step(state, xs):
        u, w, qd, aqk, kd, dl = xs  # one chunk: [B, H, C, *]
        corr = u.astype(_F32) - jnp.einsum("BHCK,BHKV->BHCV", w.astype(_F32), state, precision=_HI)
        o = jnp.einsum("BHCK,BHKV->BHCV", qd, state, precision=_HI) + _mm("BHCD,BHDV->BHCV", aqk, corr, low)
        new_state = dl[..., None, None] * state + jnp.einsum("BHCK,BHCV->BHKV", kd, corr, precision=_HI)
        return new_state, o

    def lead(x):  # [B, H, N, ...] -> [N, B, H, ...] (scan over chunks)
        return jnp.moveaxis(x, 2, 0)

    xs = tuple(lead(terms[name]) for name in ("u", "w", "qd", "aqk", "kd", "decay_last"))
    final, o = jax.lax.scan(step, state0.astype(_F32), xs)
    return jnp.moveaxis(o, 0, 2), final


def merge_chunks(o, b, t):
    """[B, H, N, C, V] -> [B, N*C, H, V] truncated to ``t`` tokens."""
    _, h, n, c, vdim = o.shape
    return jnp.transpose(o, (0, 2, 3, 1, 4)).reshape(b, n * c, h, vdim)[:, :t]  # [B, N, C, H, V] -> [B, T, H, V]


def chunked_xla(q, k, v, g, beta, state0, *, chunk_size, scale, low):
    """The whole chunked forward in XLA on padded inputs; ``(o [B, T, H, V] f32, final_state [B, H, K, V] f32)``."""
    terms = chunk_terms(q, k, v, g, beta, chunk_size=chunk_size, scale=scale, low=low)
    o, final = chunk_scan(terms, state0, low=low)
    return merge_chunks(o, q.shape[0], q.shape[1]), final


def gdn_chunk_xla(q, k, v, g, beta, *, chunk_size=64, scale=None, initial_state=None):
    """The trainer's chunked GDN in XLA (the baseline the kernel replaces). Differentiable by JAX autodiff.

    Numerics: with bf16 q, k, v (the trainer's case) the products of q, k, v with each other take bf16 operands with
    float32 accumulation, the decays, ``L``, the triangular inverse (``solve_triangular``, float32) and the state are
    float32, ``u = T (beta v)`` and ``w = T (beta exp(gamma) k)`` are rounded to bf16, products with the state are
    float32, and ``o`` is rounded to bf16. With float32 inputs everything is float32 at HIGHEST precision.

    Args:
      q, k: [B, T, H, K]; v: [B, T, H, V]; g, beta: [B, T, H]; initial_state: [B, H, K, V] or None (zeros).
    Returns:
      ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] float32)``.
    """
    b, t, h, kdim, vdim, scale = validate(
        q, k, v, g, beta, chunk_size=chunk_size, scale=scale, initial_state=initial_state, name="gdn_chunk_xla"
    )
    low = jnp.dtype(v.dtype) == jnp.bfloat16
    state0 = jnp.zeros((b, h, kdim, vdim), _F32) if initial_state is None else initial_state.astype(_F32)
    qp, kp, vp, gp, bp = pad_to_chunk(q, k, v, g, beta, chunk_size)
    o, final = chunked_xla(qp, kp, vp, gp, bp, state0, chunk_size=chunk_size, scale=scale, low=low)
    return o[:, :t].astype(v.dtype), final


# ----------------------------------------------------------------------------------------------------------------------
# The Pallas kernel as a differentiable op
# ----------------------------------------------------------------------------------------------------------------------


def kernel_forward(q, k, v, g, beta, state0, *, chunk_size, scale, interpret, with_maps=False):
    """Pallas forward on padded [B, T, H, *] inputs: (o [B, T, H, V] in v's dtype, S_T f32[, maps [B, H, N, ...]])."""
    b, t, h, kdim = q.shape
    vdim = v.shape[3]
    qk, kk, vk, gk, bk = to_kernel_layout(q, k, v, g, beta)
    s0 = state0.astype(_F32).reshape(b * h, kdim, vdim)  # [B, H, K, V] -> [B*H, K, V]
    outs = _kernel.chunk_forward(
        qk, kk, vk, gk, bk, s0, chunk_size=chunk_size, scale=scale, with_maps=with_maps, interpret=interpret
    )
    o = from_kernel_layout(outs[0], b, h)
    final = outs[1].reshape(b, h, kdim, vdim)  # [B*H, K, V] -> [B, H, K, V]
    if not with_maps:
        return o, final
    m_maps, b_maps = outs[2]
    n = t // chunk_size
    # [B*H, N, K, *] -> [B, H, N, K, *]
    return o, final, (m_maps.reshape(b, h, n, kdim, kdim), b_maps.reshape(b, h, n, kdim, vdim))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _gdn_chunk_padded(q, k, v, g, beta, state0, chunk_size, scale, interpret):
    return kernel_forward(q, k, v, g, beta, state0, chunk_size=chunk_size, scale=scale, interpret=interpret)


def _gdn_chunk_fwd(q, k, v, g, beta, state0, chunk_size, scale, interpret):
    out = kernel_forward(q, k, v, g, beta, state0, chunk_size=chunk_size, scale=scale, interpret=interpret)
    return out, (q, k, v, g, beta, state0)


def _gdn_chunk_bwd(chunk_size, scale, interpret, res, cts):
    del interpret
    q, k, v, g, beta, state0 = res
    d_o, d_final = cts

    def f32_forward(q_, k_, v_, g_, beta_, s0_):
        return chunked_xla(q_, k_, v_, g_, beta_, s0_, chunk_size=chunk_size, scale=scale, low=False)

    primals = tuple(x.astype(_F32) for x in (q, k, v, g, beta, state0))
    _, vjp = jax.vjp(f32_forward, *primals)
    grads = vjp((d_o.astype(_F32), d_final.astype(_F32)))
    return tuple(gr.astype(x.dtype) for gr, x in zip(grads, (q, k, v, g, beta, state0), strict=True))


_gdn_chunk_padded.defvjp(_gdn_chunk_fwd, _gdn_chunk_bwd)


def gdn_chunk(q, k, v, g, beta, *, chunk_size=64, scale=None, initial_state=None, interpret=False):
    """Chunked GDN: Pallas forward (``kernel.chunk_forward``), differentiable through a ``custom_vjp``.

    Forward numerics: inputs are upcast to float32 on load and every step of the chunk (cumulative decay, ``L``, the
    forward-substitution inverse, ``u``, ``w``, the state, ``o``) is float32; ``o`` is rounded once to v's dtype; the
    final state is float32.
    Backward numerics: JAX code, the VJP of the chunked WY/UT form recomputed from the saved inputs entirely in float32
    (inputs upcast, HIGHEST-precision matmuls, ``solve_triangular`` in float32, float32 state, no bf16 rounding of ``u``
    or ``w``, unlike the trainer's XLA path); each gradient is rounded once to its input's dtype at the end.

    Args:
      q, k: [B, T, H, K]; v: [B, T, H, V] (bf16 or f32); g, beta: [B, T, H]; initial_state: [B, H, K, V] or None.
      chunk_size: 16, 32 or 64; T is padded to a multiple of it with neutral tokens.
      interpret: passed to ``pallas_call`` (``True`` or ``pltpu.InterpretParams(...)`` on CPU).
    Returns:
      ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] float32)``.
    """
    b, t, h, kdim, vdim, scale = validate(
        q, k, v, g, beta, chunk_size=chunk_size, scale=scale, initial_state=initial_state, name="gdn_chunk"
    )
    state0 = jnp.zeros((b, h, kdim, vdim), _F32) if initial_state is None else initial_state.astype(_F32)
    qp, kp, vp, gp, bp = pad_to_chunk(q, k, v, g, beta, chunk_size)
    o, final = _gdn_chunk_padded(qp, kp, vp, gp, bp, state0, chunk_size, scale, interpret)
    return o[:, :t], final
