"""Deterministic GDN test inputs, shared by ``tests/kernels/test_gdn_*.py`` and ``gates/kernel_cases/gdn.py``.

Everything is drawn in NumPy from a seed derived from the case id (``zlib.crc32``) and rounded through bfloat16, so the
kernel, the XLA path and the float32 reference all see the same values whatever dtype they run in. The distribution
follows the model: L2-normalized q and k, ``beta = sigmoid(x)``, ``g = strength * log(sigmoid(x + 2))`` with
``x ~ N(0, 1)`` (mean ``g`` about ``-0.18 * strength`` per token: strength 0.01 barely decays, 10 forgets the state
within a few tokens).
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np


@dataclasses.dataclass(frozen=True)
class GdnInputs:
    """``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``, ``g, beta: [B, T, H]``, ``state0: [B, H, K, V]`` (float32, None if
    absent), and the cotangents ``d_o: [B, T, H, V]``, ``d_state: [B, H, K, V]`` for the gradient checks."""

    q: jnp.ndarray
    k: jnp.ndarray
    v: jnp.ndarray
    g: jnp.ndarray
    beta: jnp.ndarray
    state0: jnp.ndarray | None
    d_o: jnp.ndarray
    d_state: jnp.ndarray

    def args(self):
        return self.q, self.k, self.v, self.g, self.beta


def _bf16_round(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def make_inputs(
    case_id: str,
    *,
    b: int,
    t: int,
    h: int,
    k: int,
    v: int,
    dtype=jnp.float32,
    gate_strength: float = 1.0,
    with_state: bool = True,
    key_heads: int | None = None,
) -> GdnInputs:
    """Seeded inputs for ``case_id``; q, k, v in ``dtype`` (values bf16-representable), g, beta and the state float32.

    ``key_heads``: if set (dividing ``h``), q and k are drawn for ``key_heads`` heads and each is repeated for the
    ``h // key_heads`` value heads that share it (the model's expansion of key heads per value head).
    """
    rng = np.random.default_rng(zlib.crc32(case_id.encode()))
    kh = h if key_heads is None else key_heads
    if h % kh:
        raise ValueError(f"key_heads={key_heads} must divide h={h}")

    def unit(shape):
        x = rng.standard_normal(shape).astype(np.float32)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q = unit((b, t, kh, k))
    kk = unit((b, t, kh, k))
    if kh != h:  # [B, T, KH, K] -> [B, T, H, K]: key head j serves value heads j * (H / KH) ... (j + 1) * (H / KH) - 1
        q, kk = np.repeat(q, h // kh, axis=2), np.repeat(kk, h // kh, axis=2)
    vv = rng.standard_normal((b, t, h, v)).astype(np.float32)
    x_beta = rng.standard_normal((b, t, h)).astype(np.float32)
    x_g = rng.standard_normal((b, t, h)).astype(np.float32) + 2.0
    beta = 1.0 / (1.0 + np.exp(-x_beta))
    g = gate_strength * -np.logaddexp(0.0, -x_g)  # strength * log(sigmoid(x)) <= 0
    state0 = 0.5 * rng.standard_normal((b, h, k, v)).astype(np.float32) if with_state else None
    d_o = rng.standard_normal((b, t, h, v)).astype(np.float32)
    d_state = rng.standard_normal((b, h, k, v)).astype(np.float32)
    q, kk, vv, g, beta = (_bf16_round(x) for x in (q, kk, vv, g, beta))
    g = np.minimum(g, 0.0)
    return GdnInputs(
        q=jnp.asarray(q, dtype),
        k=jnp.asarray(kk, dtype),
        v=jnp.asarray(vv, dtype),
        g=jnp.asarray(g),
        beta=jnp.asarray(beta),
        state0=None if state0 is None else jnp.asarray(_bf16_round(state0)),
        d_o=jnp.asarray(_bf16_round(d_o)),
        d_state=jnp.asarray(_bf16_round(d_state)),
    )


OUTPUTS = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dstate0")


def outputs_and_grads(fn, inp: GdnInputs, *, jit=True) -> dict[str, np.ndarray]:
    """Run ``fn(q, k, v, g, beta, initial_state) -> (o, final_state)`` and its VJP with the cotangents of ``inp``.

    Returns host float32 arrays keyed by ``OUTPUTS`` (``dstate0`` only when ``inp.state0`` is set). The cotangent of
    ``o`` is cast to o's dtype, as autodiff hands it to the op.
    """
    args = (*inp.args(), inp.state0)

    def run(*a):
        out, vjp = _vjp(fn, a)
        d_o = inp.d_o.astype(out[0].dtype)
        grads = vjp((d_o, inp.d_state))
        return out, grads

    run_fn = jax.jit(run) if jit else run
    (o, final), grads = run_fn(*args)
    names = ("dq", "dk", "dv", "dg", "dbeta", "dstate0")
    result = {"o": o, "final_state": final}
    for name, gr in zip(names, grads, strict=True):
        if gr is not None:
            result[name] = gr
    return {name: np.asarray(jnp.asarray(x, jnp.float32)) for name, x in result.items()}


def _vjp(fn, args):
    if args[-1] is None:  # no initial state: differentiate in the five sequence inputs only
        out, vjp5 = jax.vjp(lambda *a: fn(*a, None), *args[:-1])
        return out, lambda ct: (*vjp5(ct), None)
    return jax.vjp(fn, *args)
