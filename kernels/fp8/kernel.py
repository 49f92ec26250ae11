"""The ``pallas_call`` of the fp8 hoist: absmax and quantize of a stacked expert-weight tensor in one pass.

``w: [L, E, K, N]`` (layers, experts, contraction K, output channels N). Grid ``(L, E, N / tn)``; each step holds the
whole K column block ``[K, tn]`` of one (layer, expert), so the per-(layer, expert, output channel) absmax and the
quantization happen in the same pass over ``w``:

    amax = max_K |w|;  scale = amax / 448 (1 where amax is 0 or non-finite, or the quotient underflows to 0);
    codes = clip(w / scale, -448, 448).astype(float8_e4m3fn)

the same float32 operations, in the same order, as ``reference.fp8_scale`` / ``fp8_quantize``, divisions kept
IEEE divisions as in the reference (so the results are bit-identical on the CPU interpreter).

Run the tests: ``python -m pytest tests/kernels/test_fp8_kernel.py -q``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0


def _divide(num: jax.Array, den: jax.Array, *, keep_division: bool) -> jax.Array:
    """``num / den`` with ``den`` broadcast to ``num``'s shape, kept an IEEE division under XLA (interpret mode).

    XLA's simplifier rewrites a division by a broadcast (the constant 448, a [1, tn] scale) into a multiplication by
    the reciprocal, up to 1 ulp off; the reference prevents it with an optimization barrier on the materialized
    divisor, and so does the interpreted kernel. Mosaic has no optimization barrier: compiled for TPU the plain
    division is emitted (bit-identity with the CPU reference is then not claimed).
    """
    den_full = jnp.broadcast_to(den, num.shape)
    if keep_division:
        den_full = jax.lax.optimization_barrier(den_full)
    return num / den_full


def absmax_quantize_call(w: jax.Array, *, tn: int, interpret=False) -> tuple[jax.Array, jax.Array]:
    """w: [L, E, K, N] with N a multiple of tn -> (codes [L, E, K, N] float8_e4m3fn, scale [L, E, 1, N] float32)."""
    num_layers, num_experts, k, n = w.shape
    keep_division = interpret is not False

    def kernel(w_ref, codes_ref, scale_ref):
        w_kn = w_ref[...].astype(jnp.float32)  # [K, tn]
        amax = jnp.max(jnp.abs(w_kn), axis=0, keepdims=True)  # [1, tn]
        scale = _divide(amax, jnp.float32(FP8_MAX), keep_division=keep_division)
        usable = jnp.logical_and(jnp.isfinite(amax), scale > 0)
        scale = jnp.where(usable, scale, 1.0).astype(jnp.float32)
        w_scaled = _divide(w_kn, scale, keep_division=keep_division)
        codes_ref[...] = jnp.clip(w_scaled, -FP8_MAX, FP8_MAX).astype(codes_ref.dtype)
        scale_ref[...] = scale

    block = pl.BlockSpec((None, None, k, tn), lambda li, ei, j: (li, ei, 0, j))
    scale_block = pl.BlockSpec((None, None, 1, tn), lambda li, ei, j: (li, ei, 0, j))
    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((num_layers, num_experts, k, n), FP8_DTYPE),
            jax.ShapeDtypeStruct((num_layers, num_experts, 1, n), jnp.float32),
        ),
        grid=(num_layers, num_experts, n // tn),
        in_specs=[block],
        out_specs=(block, scale_block),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=interpret,
        name="fp8_absmax_quantize",
    )(w)
