"""fp8 absmax + quantize of stacked expert weights (what ``fp8_fake_quant_hoist=gather8`` runs once per step).

``fp8_absmax_quantize(w[L, E, K, N], *, tn=None, interpret=False) -> (codes [L, E, K, N] float8_e4m3fn,
scale [L, E, 1, N] float32)``: bit-identical to ``reference.fp8_scale(w, axes=(2,))`` and
``reference.fp8_quantize(w, scale)``. Run the tests: ``python -m pytest tests/kernels/test_fp8_kernel.py -q``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nxgates.kernels.fp8.kernel import absmax_quantize_call

_SUPPORTED = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def fp8_absmax_quantize(w: jax.Array, *, tn: int | None = None, interpret=False) -> tuple[jax.Array, jax.Array]:
    """Per (layer, expert, output channel) absmax scale and fp8 codes of ``w`` in one Pallas pass.

    Args:
      w: [L, E, K, N] bf16 or f32 (K reduced for the absmax).
      tn: output-channel tile (default min(N, 512)); N is zero-padded to a multiple of it (a zero channel has
        scale 1 and codes 0, and is sliced away).
      interpret: False, True or ``pltpu.InterpretParams``.

    Returns:
      (codes [L, E, K, N] float8_e4m3fn, scale [L, E, 1, N] float32).
    """
    if not hasattr(w, "ndim") or w.ndim != 4:
        raise ValueError(f"w must have rank 4 ([L, E, K, N]), got w.shape={getattr(w, 'shape', type(w).__name__)}")
    if jnp.dtype(w.dtype) not in _SUPPORTED:
        if jnp.issubdtype(w.dtype, jnp.floating):
            raise NotImplementedError(f"w.dtype={w.dtype}: the fp8 kernel takes bfloat16 or float32")
        raise ValueError(f"w.dtype={w.dtype} must be a floating dtype")
    n = w.shape[3]
    if tn is None:
        tn = min(n, 512)
    if isinstance(tn, bool) or not isinstance(tn, int) or tn < 1:
        raise ValueError(f"tn={tn!r} must be a positive int")
    tn = min(tn, n)
    n_pad = -(-n // tn) * tn
    # [L, E, K, N] -> [L, E, K, n_pad]: zero channels past N.
    w_p = jnp.pad(w, ((0, 0), (0, 0), (0, 0), (0, n_pad - n))) if n_pad != n else w
    codes, scale = absmax_quantize_call(w_p, tn=tn, interpret=interpret)
    return codes[..., :n], scale[..., :n]
