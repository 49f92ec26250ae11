"""Kernels this project did not write, and two deliberately wrong ones, for ``tests/gates/test_testing.py``.

Importable by path for the CLI: ``nxgates kernels --impl tests.gates.peer_kernels:ragged_dot_gmm --op gmm`` (from the
repository root).

- ``ragged_dot_gmm``: ``jax.lax.ragged_dot`` as a GMM (XLA's ragged matmul, its gradients by JAX).
- ``megablox_gmm``: JAX's megablox GMM (``jax.experimental.pallas.ops.tpu.megablox.gmm``, a ``custom_vjp`` over the
  Pallas TPU kernel: dlhs is a gmm against the transposed weights, drhs a tgmm), run in interpret mode off TPU. Its
  contract leaves the rows past ``sum(group_sizes)`` unwritten (the Pallas interpreter fills them with NaN), so it is
  checked with ``adapter=rows_past_group_sum_unspecified``.
- ``gmm_boundaries_one_row_late``: every group boundary one row late (the first row of group i + 1 is multiplied by
  group i's weights; the row after the last group by the last group's): must fail.
- ``gdn_decay_after_delta``: the GDN recurrence with the decay applied after the delta correction instead of before:
  must fail.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import megablox

_HI = jax.lax.Precision.HIGHEST


def ragged_dot_gmm(lhs, rhs, group_sizes):
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)


def _megablox_tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
    """megablox needs tm to divide m (k and n may be ragged): the largest divisor of m up to 128."""
    tm = max(d for d in range(1, min(m, 128) + 1) if m % d == 0)
    return tm, min(k, 128), min(n, 128)


def megablox_gmm(lhs, rhs, group_sizes):
    m, k = lhs.shape
    tiling = _megablox_tiling(m, k, rhs.shape[2])
    interpret = jax.default_backend() != "tpu"
    # Positional: megablox.gmm is a custom_vjp whose non-differentiable arguments (3, 4, 7, 8) are
    # preferred_element_type, tiling, transpose_rhs and interpret.
    return megablox.gmm(lhs, rhs, group_sizes, lhs.dtype, tiling, None, None, False, interpret)


def gmm_boundaries_one_row_late(lhs, rhs, group_sizes):
    m = lhs.shape[0]
    late_ends = jnp.cumsum(group_sizes) + 1  # the deliberate error: every boundary one row late
    group_of_row = jnp.searchsorted(late_ends, jnp.arange(m), side="right")  # [m]; G means "no group"
    num_groups = rhs.shape[0]
    onehot = (group_of_row[None, :] == jnp.arange(num_groups)[:, None]).astype(jnp.float32)  # [G, m]
    per_group = jnp.einsum("MK,GKN->GMN", lhs.astype(jnp.float32), rhs.astype(jnp.float32), precision=_HI)
    return jnp.einsum("GM,GMN->MN", onehot, per_group, precision=_HI).astype(lhs.dtype)


def gdn_decay_after_delta(q, k, v, g, beta, initial_state):
    b, _, h, dk = q.shape
    dv = v.shape[-1]
    scale = dk**-0.5
    state = jnp.zeros((b, h, dk, dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)

    def step(s, x):
        q_t, k_t, v_t, g_t, b_t = x  # [B, H, K], [B, H, K], [B, H, V], [B, H], [B, H]
        pred = jnp.einsum("BHKV,BHK->BHV", s, k_t, precision=_HI)
        s = s + jnp.einsum("BHK,BHV->BHKV", k_t, b_t[..., None] * (v_t - pred), precision=_HI)
        s = jnp.exp(g_t)[..., None, None] * s  # the deliberate error: the decay after the delta correction
        return s, jnp.einsum("BHKV,BHK->BHV", s, scale * q_t, precision=_HI)

    # [B, T, H, ...] -> [T, B, H, ...] for the scan over tokens.
    xs = tuple(jnp.moveaxis(x.astype(jnp.float32), 1, 0) for x in (q, k, v, g, beta))
    final, o = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 1).astype(q.dtype), final


# ------------------------------------------------------------------ the project's own kernels, in the ops' conventions


def _interpret() -> bool:
    return jax.default_backend() != "tpu"


def project_gmm(lhs, rhs, group_sizes):
    from nxgates.kernels.gmm import ops

    return ops.gmm(lhs, rhs, group_sizes, tiles=(16, 32, 32), interpret=_interpret())


def project_dswiglu(dy, wo, gate_up, group_sizes, route_weights):
    from nxgates.kernels.gmm import ops

    return ops.dswiglu_gmm(dy, wo, gate_up, group_sizes, route_weights, tiles=(16, 32), interpret=_interpret())


def project_gdn_chunk(q, k, v, g, beta, initial_state):
    from nxgates.kernels.gdn import ops

    return ops.gdn_chunk(q, k, v, g, beta, chunk_size=16, initial_state=initial_state, interpret=_interpret())


def project_fold_scan(m, b):
    """``kernels.gdn.context_parallel.fold_scan`` (the m-scan / dh-scan): chunk axis first, so check it with
    ``adapter=chunks_first_fold``."""
    from nxgates.kernels.gdn import context_parallel

    return context_parallel.fold_scan(m, b, interpret=_interpret())


def project_fp8_fake_quant(w, axes):
    """``kernels.fp8.fp8_absmax_quantize`` (reduces axis -2) dequantized, with the straight-through gradient."""
    from nxgates.kernels.fp8 import fp8_absmax_quantize

    if w.ndim not in (3, 4) or tuple(axes) != (w.ndim - 2,):
        raise NotImplementedError(f"axes={axes}: the kernel reduces axis -2 only")

    @jax.custom_vjp
    def fake_quant(x):
        stacked = x if x.ndim == 4 else x[None]  # the kernel takes [L, E, K, N]
        codes, scale = fp8_absmax_quantize(stacked, interpret=_interpret())
        out = codes.astype(jnp.float32) * scale  # scale [L, E, 1, N]
        return out if x.ndim == 4 else out[0]

    fake_quant.defvjp(lambda x: (fake_quant(x), None), lambda _, ct: (ct,))
    return fake_quant(w)


# ------------------------------------------------------------------------------------- layouts and shapes, for the CLI


def gmm_rhs_transposed(lhs, rhs_t, group_sizes):
    """A GMM taking ``rhs_t [G, n, k]`` (check with ``--adapter transposed_rhs_gmm``)."""
    return jax.lax.ragged_dot(lhs, jnp.swapaxes(rhs_t, 1, 2), group_sizes)


def gdn_heads_first(q, k, v, g, beta, initial_state):
    """``reference.gdn_chunked`` taking ``[B, H, T, K]`` (check with ``--adapter heads_first_gdn``)."""
    from nxgates import reference

    def t(x):
        return jnp.swapaxes(x, 1, 2)  # [B, H, T, ...] <-> [B, T, H, ...]

    o, final = reference.gdn_chunked(t(q), t(k), t(v), t(g), t(beta), chunk_size=16, initial_state=initial_state)
    return t(o), final


def gmm_drops_last_column(lhs, rhs, group_sizes):
    """Returns ``[m, n - 1]``: a shape the op does not have (exit 2, named)."""
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)[:, :-1]
REPO_NOTE = "not a function (for the CLI test)"
