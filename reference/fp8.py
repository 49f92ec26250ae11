"""fp8 (``float8_e4m3fn``, max 448) absmax scale, quantize, dequantize, fake-quant: the references of ``kernels/fp8``.

One convention, stated once: ``scale = amax / 448`` in float32, ``amax = max(|w|)`` over the reduction axes (kept as
size-1 dims); ``scale = 1`` when ``amax`` is 0 or non-finite (and when ``amax / 448`` underflows to 0, so that
``w / scale`` is always defined). ``codes = clip(w / scale, -448, 448).astype(float8_e4m3fn)`` (round to nearest,
ties to even); ``w_hat = codes * scale``.

Tests: ``python -m pytest tests/reference/test_fp8.py -q``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0


def _normalize_axes(axes, ndim: int) -> tuple[int, ...]:
    """``axes`` (int or sequence of ints, negatives allowed) -> sorted non-negative tuple; ``ValueError`` naming it."""
    axes_tuple = (axes,) if isinstance(axes, int) else tuple(axes)
    if not all(isinstance(a, int) and not isinstance(a, bool) for a in axes_tuple):
        raise ValueError(f"axes={axes!r} must be an int or a sequence of ints")
    out = []
    for a in axes_tuple:
        if not -ndim <= a < ndim:
            raise ValueError(f"axes={axes!r} out of range for w.ndim={ndim}")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"axes={axes!r} repeats an axis")
    return tuple(sorted(out))


def _ieee_divide(num: jax.Array, den: jax.Array) -> jax.Array:
    """``num / den`` elementwise as the IEEE float32 division, ``den`` broadcast to ``num``'s shape.

    XLA's simplifier turns a division by a broadcast (a constant, or a scale of size-1 dims) into a multiplication by
    the reciprocal, which is up to 1 ulp off (1 / 448 is not exact). Materializing the divisor at full shape behind an
    optimization barrier keeps the division a division.
    """
    den_full = jax.lax.optimization_barrier(jnp.broadcast_to(den, num.shape))
    return num / den_full


def fp8_scale(w: jax.Array, axes) -> jax.Array:
    """Per-slice absmax scale: ``scale = amax / 448`` (1 where ``amax`` is 0 or non-finite).

    Args:
      w: [...] floating, e.g. expert weights [E, K, N].
      axes: int or tuple of ints, the axes reduced for ``amax`` (K for [E, K, N]: ``axes=(1,)``).

    Returns:
      scale: float32, the shape of ``w`` with the reduced axes kept as size 1 (e.g. [E, 1, N]).
    """
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"w.dtype={w.dtype} must be a floating dtype")
    axes = _normalize_axes(axes, w.ndim)
    amax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=axes, keepdims=True)
    scale = _ieee_divide(amax, jnp.float32(FP8_MAX))
    usable = jnp.isfinite(amax) & (scale > 0)
    return jnp.where(usable, scale, 1.0).astype(jnp.float32)


def _check_scale(scale, w_shape, w_name: str) -> None:
    if scale.ndim != len(w_shape) or any(s not in (1, d) for s, d in zip(scale.shape, w_shape, strict=True)):
        raise ValueError(
            f"scale.shape={tuple(scale.shape)} must have {w_name}'s rank with each dim 1 or equal to "
            f"{w_name}.shape={tuple(w_shape)} (keepdims, as fp8_scale returns)"
        )


def fp8_quantize(w: jax.Array, scale: jax.Array) -> jax.Array:
    """``codes = clip(w / scale, -448, 448).astype(float8_e4m3fn)`` (round to nearest even).

    Args:
      w: [...] floating.
      scale: float32, broadcastable to ``w`` with ``w``'s rank (as ``fp8_scale`` returns it).

    Returns:
      codes: [...] float8_e4m3fn, the shape of ``w``.
    """
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"w.dtype={w.dtype} must be a floating dtype")
    _check_scale(scale, w.shape, "w")
    w_scaled = _ieee_divide(w.astype(jnp.float32), scale.astype(jnp.float32))
    return jnp.clip(w_scaled, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def fp8_dequantize(codes: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """``codes * scale`` computed in float32, returned as ``dtype``.

    Args:
      codes: [...] float8_e4m3fn.
      scale: float32, broadcastable to ``codes`` with its rank.
      dtype: output dtype (float32 by default).

    Returns:
      [...] ``dtype``, the shape of ``codes``.
    """
    if codes.dtype != FP8_DTYPE:
        raise ValueError(f"codes.dtype={codes.dtype} must be float8_e4m3fn")
    _check_scale(scale, codes.shape, "codes")
    return (codes.astype(jnp.float32) * scale.astype(jnp.float32)).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _fake_quant_ste(w: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    scale = fp8_scale(w, axes)
    codes = fp8_quantize(w, scale)
    # The barrier keeps XLA from folding the f32 -> fp8 -> f32 round trip away.
    codes, scale = jax.lax.optimization_barrier((codes, scale))
    return fp8_dequantize(codes, scale)


def _fake_quant_fwd(w, axes):
    return _fake_quant_ste(w, axes), None


def _fake_quant_bwd(axes, _, dw_hat):
    # Straight-through: the identity, and nothing flows through the scale.
    return (dw_hat,)


_fake_quant_ste.defvjp(_fake_quant_fwd, _fake_quant_bwd)


def fp8_fake_quant(w: jax.Array, axes) -> jax.Array:
    """``fp8_dequantize(fp8_quantize(w, fp8_scale(w, axes)), scale)``: ``w`` rounded to the fp8 grid.

    The gradient is the straight-through estimator: exactly the identity, with no gradient through the scale.

    Args:
      w: [...] floating.
      axes: int or tuple of ints reduced for the absmax scale (see ``fp8_scale``).

    Returns:
      [...] float32, the shape of ``w``.
    """
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"w.dtype={w.dtype} must be a floating dtype")
    return _fake_quant_ste(w.astype(jnp.float32), _normalize_axes(axes, w.ndim))
