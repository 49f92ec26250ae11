"""SwiGLU forward, its closed-form backward, and the reference of the fused wo-backward epilogue.

- ``swiglu(gate, up) -> h = silu(gate) * up``.
- ``swiglu_bwd(gate, up, dh) -> (dgate, dup)`` with ``s = sigmoid(gate)``:
  ``dgate = dh * up * s * (1 + gate * (1 - s))``, ``dup = dh * gate * s``.
- ``moe_wo_dlhs_dswiglu(dy, wo, gate_up, group_sizes, route_weights=None) -> (d_gate_up, d_route_weights)``: what the
  fused kernel (``moe_wo_gmm_fused_dswiglu``) computes in its epilogue: the wo input gradient ``g = gmm(dy, wo^T)``,
  then the routing weight's gradient and the SwiGLU backward, for the forward ``y = gmm(swiglu(gate, up) * r, wo)``.

Tests: ``python -m pytest tests/reference/test_swiglu.py -q``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nxgates.reference.gmm import check_group_sizes, gmm, group_masks


def _check_same_shape(**arrays) -> None:
    (first_name, first), *rest = arrays.items()
    for name, x in rest:
        if tuple(x.shape) != tuple(first.shape):
            raise ValueError(f"{name}.shape={tuple(x.shape)} must equal {first_name}.shape={tuple(first.shape)}")


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``h = silu(gate) * up = gate * sigmoid(gate) * up``.

    Args:
      gate: [..., F] floating.
      up: [..., F] floating, the shape of ``gate``.

    Returns:
      h: [..., F] float32.
    """
    _check_same_shape(gate=gate, up=up)
    gate = gate.astype(jnp.float32)
    return gate * jax.nn.sigmoid(gate) * up.astype(jnp.float32)


def swiglu_bwd(gate: jax.Array, up: jax.Array, dh: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Closed-form backward of ``swiglu``.

    Args:
      gate, up: [..., F] floating, the forward's inputs.
      dh: [..., F] floating, the cotangent of ``h``.

    Returns:
      (dgate, dup): [..., F] float32 each; ``s = sigmoid(gate)``, ``dgate = dh * up * s * (1 + gate * (1 - s))``,
      ``dup = dh * gate * s``.
    """
    _check_same_shape(gate=gate, up=up, dh=dh)
    gate, up, dh = (x.astype(jnp.float32) for x in (gate, up, dh))
    s = jax.nn.sigmoid(gate)
    dgate = dh * up * s * (1.0 + gate * (1.0 - s))
    dup = dh * gate * s
    return dgate, dup


def moe_wo_dlhs_dswiglu(
    dy: jax.Array,
    wo: jax.Array,
    gate_up: jax.Array,
    group_sizes: jax.Array,
    route_weights: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Gradients of ``y = gmm(swiglu(gate, up) * r[:, None], wo)`` with respect to ``gate_up`` and ``r``.

    Rows are tokens sorted by expert; ``gate_up = [gate | up]`` is the wi GMM output. With ``g = gmm(dy, wo^T)``:
    ``h = swiglu(gate, up)``, ``d_route = rowsum(g * h)``, ``dh = r * g`` (``dh = g`` without routing weights), then
    ``swiglu_bwd``.

    Args:
      dy: [m, D] floating, the cotangent of ``y``.
      wo: [G, F, D] floating, the per-expert output projection.
      gate_up: [m, 2F] floating, ``[gate | up]``.
      group_sizes: [G] int32, rows per expert; ``sum(group_sizes) <= m``.
      route_weights: [m] floating or None (the routing weight applied at the wo input).

    Returns:
      (d_gate_up [m, 2F] float32 = [dgate | dup], d_route_weights [m] float32 or None when ``route_weights`` is None).
      Rows past ``sum(group_sizes)`` are exactly 0 in both.
    """
    if dy.ndim != 2:
        raise ValueError(f"dy must have rank 2 ([m, D]), got dy.shape={tuple(dy.shape)}")
    if wo.ndim != 3:
        raise ValueError(f"wo must have rank 3 ([G, F, D]), got wo.shape={tuple(wo.shape)}")
    if gate_up.ndim != 2:
        raise ValueError(f"gate_up must have rank 2 ([m, 2F]), got gate_up.shape={tuple(gate_up.shape)}")
    m, d_model = dy.shape
    num_groups, f_mlp, _ = wo.shape
    if wo.shape[2] != d_model:
        raise ValueError(f"wo.shape={tuple(wo.shape)} and dy.shape={tuple(dy.shape)} disagree on D")
    if gate_up.shape != (m, 2 * f_mlp):
        raise ValueError(
            f"gate_up.shape={tuple(gate_up.shape)} must be (m, 2F)=({m}, {2 * f_mlp}) "
            f"for dy.shape={tuple(dy.shape)}, wo.shape={tuple(wo.shape)}"
        )
    if route_weights is not None and tuple(route_weights.shape) != (m,):
        raise ValueError(f"route_weights.shape={tuple(route_weights.shape)} must be (m,)=({m},)")
    check_group_sizes(group_sizes, num_groups=num_groups, num_rows=m)

    # [G, F, D] -> [G, D, F]: the wo input gradient is a GMM against wo transposed.
    wo_t_gdf = jnp.swapaxes(wo.astype(jnp.float32), 1, 2)
    g_mf = gmm(dy.astype(jnp.float32), wo_t_gdf, group_sizes)
    gate_mf, up_mf = jnp.split(gate_up.astype(jnp.float32), 2, axis=1)
    # Rows past sum(group_sizes) belong to no expert: their gradients are exactly 0.
    in_group_m = jnp.any(group_masks(group_sizes, m), axis=0)

    if route_weights is None:
        d_route_m = None
        dh_mf = g_mf
    else:
        h_mf = swiglu(gate_mf, up_mf)
        d_route_m = jnp.where(in_group_m, jnp.sum(g_mf * h_mf, axis=1), 0.0)
        dh_mf = route_weights.astype(jnp.float32)[:, None] * g_mf
    dgate_mf, dup_mf = swiglu_bwd(gate_mf, up_mf, dh_mf)
    d_gate_up = jnp.where(in_group_m[:, None], jnp.concatenate([dgate_mf, dup_mf], axis=1), 0.0)
    return d_gate_up, d_route_m
