"""Grouped matmul (GMM) and its transpose (tgmm): the float32 references of ``kernels/gmm``.

Rows of ``lhs`` are tokens sorted by group (expert): group ``i`` owns the ``group_sizes[i]`` contiguous rows after the
rows of groups ``< i``. Layout as in megablox / ``jax.lax.ragged_dot``.

- ``gmm(lhs[m, k], rhs[G, k, n], group_sizes[G]) -> [m, n]``: ``out[rows_i] = lhs[rows_i] @ rhs[i]``; rows past
  ``sum(group_sizes)`` are exactly 0.
- ``tgmm(lhs[m, k], rhs[m, n], group_sizes[G]) -> [G, k, n]``: ``out[i] = lhs[rows_i]^T @ rhs[rows_i]``; an empty group
  gives exactly 0.

Both are written with one-hot row -> group masks (one dense einsum per group, all groups at once), so they are
differentiable by plain JAX autodiff and jittable with traced ``group_sizes``. Inputs are masked before the matmul and
the output after it, so a non-finite value in a row outside a group never reaches that group's result or its gradients.
Cost is ``G`` dense matmuls: a reference, not a kernel.

Tests: ``python -m pytest tests/reference/test_gmm.py -q``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_HIGHEST = jax.lax.Precision.HIGHEST


def _check_float(name: str, x) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name}.dtype={x.dtype} must be a floating dtype")


def _check_rank(name: str, x, rank: int, layout: str) -> None:
    if x.ndim != rank:
        raise ValueError(f"{name} must have rank {rank} ({layout}), got {name}.shape={tuple(x.shape)}")


def check_group_sizes(group_sizes, *, num_groups: int | None, num_rows: int, name: str = "group_sizes") -> None:
    """Validate ``group_sizes: [G] int32`` against ``G = num_groups`` (None: any) and ``m = num_rows``.

    Raises ``ValueError`` naming ``name`` and its value. Type, shape and dtype are always checked. Values
    (non-negative, ``sum <= m``) are checked when ``group_sizes`` is concrete; under ``jit`` they are traced and
    cannot be checked: negative sizes then count as 0 and rows past ``m`` do not exist.
    """
    if not isinstance(group_sizes, jax.Array | np.ndarray):
        raise ValueError(f"{name}={group_sizes!r} must be a jax or numpy int32 array, not {type(group_sizes).__name__}")
    if group_sizes.ndim != 1:
        raise ValueError(f"{name} must have rank 1 ([G]), got {name}.shape={tuple(group_sizes.shape)}")
    if group_sizes.dtype != jnp.int32:
        raise ValueError(f"{name}.dtype={group_sizes.dtype} must be int32")
    if num_groups is not None and group_sizes.shape[0] != num_groups:
        raise ValueError(f"{name}.shape={tuple(group_sizes.shape)} must be ({num_groups},): one size per group")
    if isinstance(group_sizes, jax.core.Tracer):
        return
    sizes = np.asarray(group_sizes)
    if np.any(sizes < 0):
        raise ValueError(f"{name}={sizes.tolist()} has negative entries")
    total = int(sizes.astype(np.int64).sum())
    if total > num_rows:
        raise ValueError(f"sum({name})={total} exceeds the number of rows m={num_rows} ({name}={sizes.tolist()})")


def group_masks(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """``mask[G, m]`` bool: ``mask[i, r]`` is True when row ``r`` belongs to group ``i``.

    Group ``i`` owns rows ``[start_i, end_i)`` with ``end = cumsum(group_sizes)``, ``start = end - group_sizes``.
    """
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    end_g = jnp.cumsum(sizes)  # [G]
    start_g = end_g - sizes  # [G]
    row_m = jnp.arange(num_rows, dtype=jnp.int32)  # [m]
    return (row_m[None, :] >= start_g[:, None]) & (row_m[None, :] < end_g[:, None])  # [G, m]


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Grouped matmul: ``out[rows_i] = lhs[rows_i] @ rhs[i]``.

    Args:
      lhs: [m, k] floating, rows sorted by group.
      rhs: [G, k, n] floating, one matrix per group.
      group_sizes: [G] int32, rows per group; ``sum(group_sizes) <= m``.

    Returns:
      [m, n] float32; rows past ``sum(group_sizes)`` are exactly 0.
    """
    _check_rank("lhs", lhs, 2, "[m, k]")
    _check_rank("rhs", rhs, 3, "[G, k, n]")
    _check_float("lhs", lhs)
    _check_float("rhs", rhs)
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"lhs.shape={tuple(lhs.shape)} and rhs.shape={tuple(rhs.shape)} disagree on k")
    check_group_sizes(group_sizes, num_groups=rhs.shape[0], num_rows=lhs.shape[0])

    lhs_mk = lhs.astype(jnp.float32)
    rhs_gkn = rhs.astype(jnp.float32)
    mask_gm = group_masks(group_sizes, lhs_mk.shape[0])
    # [m, k] -> [G, m, k]: group i sees only its own rows (others are 0).
    lhs_gmk = jnp.where(mask_gm[:, :, None], lhs_mk[None, :, :], 0.0)
    out_gmn = jnp.einsum("GMK,GKN->GMN", lhs_gmk, rhs_gkn, precision=_HIGHEST)
    # [G, m, n] -> [m, n]: each row has at most one non-zero term, so the sum is exact.
    return jnp.sum(jnp.where(mask_gm[:, :, None], out_gmn, 0.0), axis=0)


def tgmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Transposed grouped matmul (the weight gradient of ``gmm``): ``out[i] = lhs[rows_i]^T @ rhs[rows_i]``.

    Args:
      lhs: [m, k] floating, rows sorted by group.
      rhs: [m, n] floating, the same row order.
      group_sizes: [G] int32, rows per group; ``sum(group_sizes) <= m``.

    Returns:
      [G, k, n] float32; an empty group gives exactly 0; rows past ``sum(group_sizes)`` contribute nothing.
    """
    _check_rank("lhs", lhs, 2, "[m, k]")
    _check_rank("rhs", rhs, 2, "[m, n]")
    _check_float("lhs", lhs)
    _check_float("rhs", rhs)
    if lhs.shape[0] != rhs.shape[0]:
        raise ValueError(f"lhs.shape={tuple(lhs.shape)} and rhs.shape={tuple(rhs.shape)} disagree on m")
    check_group_sizes(group_sizes, num_groups=None, num_rows=lhs.shape[0])

    mask_gm = group_masks(group_sizes, lhs.shape[0])
    # [m, k] / [m, n] -> [G, m, k] / [G, m, n]: group i sees only its own rows (others are 0).
    lhs_gmk = jnp.where(mask_gm[:, :, None], lhs.astype(jnp.float32)[None, :, :], 0.0)
    rhs_gmn = jnp.where(mask_gm[:, :, None], rhs.astype(jnp.float32)[None, :, :], 0.0)
    return jnp.einsum("GMK,GMN->GKN", lhs_gmk, rhs_gmn, precision=_HIGHEST)
