"""Differentiable MoE grouped matmuls over the Pallas kernels of ``kernels/gmm/kernel.py``, and the MoE MLP op.

- ``gmm(lhs[m,k], rhs[G,k,n], group_sizes[G], *, tiles, out_dtype, interpret) -> [m,n]`` (custom_vjp: dlhs is a GMM
  against ``rhs`` transposed, drhs a tgmm, each with its own tiles: ``tiles`` is ``(tm, tk, tn)`` for all three or a
  ``GmmTiles(fwd, dlhs, drhs)``).
- ``tgmm(lhs[m,k], rhs[m,n], group_sizes[G], *, tiles, out_dtype=float32, interpret) -> [G,k,n]``.
- ``swiglu_gmm(x, wi, group_sizes, ...) -> (h, gate_up)``: the fused SwiGLU forward (``moe_wi_gmm_fused_swiglu``).
- ``dswiglu_gmm(dy, wo, gate_up, group_sizes, route_weights, ...) -> (d_gate_up, d_route)``: the fused SwiGLU backward
  (``moe_wo_gmm_fused_dswiglu``; ``d_route`` from the float32 epilogue with ``moe_router_grad_from_wo_input``).
- ``unfused_swiglu_fwd`` / ``unfused_dswiglu_bwd``: the trainer's path without the flags (GMM kernel, then XLA
  elementwise passes, every intermediate rounded to the compute dtype).
- ``moe_mlp(x, wi, wo, group_sizes, route_weights, *, fused_swiglu, fused_dswiglu, router_grad_from_wo_input, tiles,
  interpret) -> y``: ``y = gmm(swiglu(x @ wi_gate, x @ wi_up) * r, wo)`` per group, differentiable in x, wi, wo and
  route_weights; the op the model calls.

Tile sizes larger than a dimension are clipped to it (``kernels.tiling.effective``); a dimension that is not a multiple
of its tile is zero-padded here (rows, contraction and output columns) and the result sliced back. Inputs must be bf16
or float32; all dots accumulate in float32.

Run the tests: ``python -m pytest tests/kernels/test_gmm.py tests/kernels/test_moe_mlp.py -q``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from nxgates.kernels.gmm import kernel as K
from nxgates.kernels.tiling import MoeTiles, effective, round_up
from nxgates.reference.gmm import check_group_sizes

_F32 = jnp.float32
_SUPPORTED = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
_DEFAULT_TILES = (128, 512, 512)


class GmmTiles(NamedTuple):
    """``(tm, tk, tn)`` of the forward GMM, its dlhs GMM (contracting n, output k) and its drhs tgmm."""

    fwd: tuple[int, int, int]
    dlhs: tuple[int, int, int]
    drhs: tuple[int, int, int]


# ------------------------------------------------------------------------------------------------------- validation


def _check_tiles(name: str, tiles, length: int = 3) -> tuple[int, ...]:
    if (
        not isinstance(tiles, tuple | list)
        or len(tiles) != length
        or not all(isinstance(t, int) and not isinstance(t, bool) and t > 0 for t in tiles)
    ):
        raise ValueError(f"{name}={tiles!r} must be a tuple of {length} positive ints")
    return tuple(int(t) for t in tiles)


def _check_array(name: str, x, rank: int, layout: str) -> None:
    if not hasattr(x, "ndim") or x.ndim != rank:
        shape = tuple(x.shape) if hasattr(x, "shape") else type(x).__name__
        raise ValueError(f"{name} must have rank {rank} ({layout}), got {name}.shape={shape}")
    if jnp.dtype(x.dtype) not in _SUPPORTED:
        if jnp.issubdtype(x.dtype, jnp.floating):
            raise NotImplementedError(f"{name}.dtype={x.dtype}: the GMM kernels take bfloat16 or float32")
        raise ValueError(f"{name}.dtype={x.dtype} must be bfloat16 or float32")


def _resolve_gmm_tiles(tiles) -> GmmTiles:
    if tiles is None:
        return GmmTiles(_DEFAULT_TILES, _DEFAULT_TILES, _DEFAULT_TILES)
    if isinstance(tiles, GmmTiles):
        return GmmTiles(*(_check_tiles(f"tiles.{f}", t) for f, t in zip(GmmTiles._fields, tiles, strict=True)))
    t = _check_tiles("tiles", tiles)
    return GmmTiles(t, t, t)


def _pad(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Zero-pad ``x`` along ``axis`` to ``size``."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


# ------------------------------------------------------------------------------------------- raw (padded) kernel calls


def _gmm_raw(lhs, rhs, group_sizes, *, tiles, out_dtype, transpose_rhs=False, rhs_buffer_count=2, interpret=False):
    """Pad to the tiles, run ``gmm_call``, slice back. lhs: [m, k]; rhs: [G, k, n] ([G, n, k] if transposed)."""
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tm, tk, tn = effective(tiles, (m, k, n))
    m_p, k_p, n_p = round_up(m, tm), round_up(k, tk), round_up(n, tn)
    lhs_p = _pad(_pad(lhs, 0, m_p), 1, k_p)
    rhs_p = _pad(_pad(rhs, 1, n_p), 2, k_p) if transpose_rhs else _pad(_pad(rhs, 1, k_p), 2, n_p)
    meta = K.make_group_metadata(group_sizes, num_rows=m_p, tm=tm, for_tgmm=False)
    out = K.gmm_call(
        lhs_p, rhs_p, meta, tiles=(tm, tk, tn), out_dtype=out_dtype, transpose_rhs=transpose_rhs,
        rhs_buffer_count=rhs_buffer_count, interpret=interpret,
    )
    return out[:m, :n]


def _tgmm_raw(lhs, rhs, group_sizes, *, tiles, out_dtype, interpret=False):
    """Pad to the tiles, run ``tgmm_call``, slice back. lhs: [m, k]; rhs: [m, n] -> [G, k, n]."""
    m, k = lhs.shape
    n = rhs.shape[1]
    tm, tk, tn = effective(tiles, (m, k, n))
    m_p, k_p, n_p = round_up(m, tm), round_up(k, tk), round_up(n, tn)
    lhs_p = _pad(_pad(lhs, 0, m_p), 1, k_p)
    rhs_p = _pad(_pad(rhs, 0, m_p), 1, n_p)
    meta = K.make_group_metadata(group_sizes, num_rows=m_p, tm=tm, for_tgmm=True)
    out = K.tgmm_call(lhs_p, rhs_p, meta, tiles=(tm, tk, tn), out_dtype=out_dtype, interpret=interpret)
    return out[:, :k, :n]


# ----------------------------------------------------------------------------------------------------- gmm / tgmm


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gmm(lhs, rhs, group_sizes, tiles: GmmTiles, out_dtype, interpret):
    return _gmm_raw(lhs, rhs, group_sizes, tiles=tiles.fwd, out_dtype=out_dtype, interpret=interpret)


def _gmm_fwd(lhs, rhs, group_sizes, tiles, out_dtype, interpret):
    return _gmm(lhs, rhs, group_sizes, tiles, out_dtype, interpret), (lhs, rhs, group_sizes)


def _gmm_bwd(tiles, out_dtype, interpret, res, dout):
    lhs, rhs, group_sizes = res
    # dlhs[m, k] = dout[m, n] @ rhs[g]^T: a GMM against rhs read transposed ([G, k, n] seen as [G, n', k'] with
    # n' = k the output and k' = n the contraction).
    dlhs = _gmm_raw(
        dout, rhs, group_sizes, tiles=tiles.dlhs, out_dtype=lhs.dtype, transpose_rhs=True, interpret=interpret
    )
    drhs = _tgmm_raw(lhs, dout, group_sizes, tiles=tiles.drhs, out_dtype=_F32, interpret=interpret)
    return dlhs, drhs.astype(rhs.dtype), None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def gmm(lhs, rhs, group_sizes, *, tiles=None, out_dtype=None, interpret=False) -> jax.Array:
    """Ragged grouped matmul ``out[rows_i] = lhs[rows_i] @ rhs[i]``, differentiable in ``lhs`` and ``rhs``.

    Args:
      lhs: [m, k] bf16 or f32, rows sorted by group.
      rhs: [G, k, n], the dtype of ``lhs``.
      group_sizes: [G] int32, ``sum <= m``.
      tiles: ``(tm, tk, tn)`` for the forward, dlhs and drhs, or ``GmmTiles``; None: (128, 512, 512) clipped.
      out_dtype: output dtype (default ``lhs.dtype``).
      interpret: False (compile for TPU), True (Pallas interpreter) or ``pltpu.InterpretParams``.

    Returns:
      [m, n] ``out_dtype``; rows past ``sum(group_sizes)`` are 0.
    """
    _check_array("lhs", lhs, 2, "[m, k]")
    _check_array("rhs", rhs, 3, "[G, k, n]")
    if rhs.dtype != lhs.dtype:
        raise ValueError(f"rhs.dtype={rhs.dtype} must equal lhs.dtype={lhs.dtype}")
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"lhs.shape={tuple(lhs.shape)} and rhs.shape={tuple(rhs.shape)} disagree on k")
    check_group_sizes(group_sizes, num_groups=rhs.shape[0], num_rows=lhs.shape[0])
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    if lhs.shape[0] == 0:
        return jnp.zeros((0, rhs.shape[2]), out_dtype)
    return _gmm(lhs, rhs, group_sizes, _resolve_gmm_tiles(tiles), out_dtype, interpret)


def tgmm(lhs, rhs, group_sizes, *, tiles=None, out_dtype=jnp.float32, interpret=False) -> jax.Array:
    """``out[i] = lhs[rows_i]^T @ rhs[rows_i]`` (the weight gradient of ``gmm``); not differentiable.

    Args:
      lhs: [m, k] bf16 or f32; rhs: [m, n], the dtype of ``lhs``; group_sizes: [G] int32, ``sum <= m``.
      tiles: ``(tm, tk, tn)`` with tm the contracted row tile; None: (128, 512, 512) clipped.

    Returns:
      [G, k, n] ``out_dtype``; an empty group gives exactly 0.
    """
    _check_array("lhs", lhs, 2, "[m, k]")
    _check_array("rhs", rhs, 2, "[m, n]")
    if rhs.dtype != lhs.dtype:
        raise ValueError(f"rhs.dtype={rhs.dtype} must equal lhs.dtype={lhs.dtype}")
    if lhs.shape[0] != rhs.shape[0]:
        raise ValueError(f"lhs.shape={tuple(lhs.shape)} and rhs.shape={tuple(rhs.shape)} disagree on m")
    check_group_sizes(group_sizes, num_groups=None, num_rows=lhs.shape[0])
    tiles = _check_tiles("tiles", tiles) if tiles is not None else _DEFAULT_TILES
    out_dtype = jnp.dtype(out_dtype)
    if lhs.shape[0] == 0:
        return jnp.zeros((group_sizes.shape[0], lhs.shape[1], rhs.shape[1]), out_dtype)
    return _tgmm_raw(lhs, rhs, group_sizes, tiles=tiles, out_dtype=out_dtype, interpret=interpret)


# ----------------------------------------------------------------------------------------- fused SwiGLU fwd / bwd


def _check_moe_shapes(x, wi, wo, group_sizes, route_weights):
    _check_array("x", x, 2, "[m, D]")
    _check_array("wi", wi, 3, "[G, D, 2F]")
    _check_array("wo", wo, 3, "[G, F, D]")
    m, d_model = x.shape
    num_groups, f_mlp, _ = wo.shape
    if wi.shape != (num_groups, d_model, 2 * f_mlp):
        raise ValueError(
            f"wi.shape={tuple(wi.shape)} must be (G, D, 2F)=({num_groups}, {d_model}, {2 * f_mlp}) for "
            f"x.shape={tuple(x.shape)}, wo.shape={tuple(wo.shape)}"
        )
    if wo.shape[2] != d_model:
        raise ValueError(f"wo.shape={tuple(wo.shape)} must be (G, F, D) with D={d_model} from x.shape={tuple(x.shape)}")
    check_group_sizes(group_sizes, num_groups=num_groups, num_rows=m)
    if route_weights is not None:
        if not hasattr(route_weights, "shape") or tuple(route_weights.shape) != (m,):
            raise ValueError(f"route_weights.shape={getattr(route_weights, 'shape', None)} must be (m,)=({m},)")
        if not jnp.issubdtype(route_weights.dtype, jnp.floating):
            raise ValueError(f"route_weights.dtype={route_weights.dtype} must be floating")


def _fused_fwd_tiles(tiles: tuple[int, int, int], m: int, d_model: int, f_mlp: int) -> tuple[int, int, int]:
    """Effective (tm, tk, tn) of the fused SwiGLU forward; tn spans [gate | up] and must split F evenly."""
    tm, tk, tn = effective(tiles, (m, d_model, 2 * f_mlp))
    if tn % 2 or f_mlp % (tn // 2):
        raise ValueError(
            f"fused SwiGLU: the wi fwd mlp tile {tiles[2]} (effective {tn}, over the [gate | up] width 2F={2 * f_mlp}) "
            f"must be even with tn/2 dividing the MoE MLP dim F={f_mlp}"
        )
    return tm, tk, tn


def swiglu_gmm(
    x, wi, group_sizes, *, tiles=(256, 4096, 1024), out_dtype=None, rhs_buffer_count=2,
    epilogue=K.swiglu_epilogue, interpret=False,
):
    """The fused SwiGLU forward: ``h = silu(x @ wi_gate) * (x @ wi_up)`` from one float32 accumulator pass.

    x: [m, D]; wi: [G, D, 2F] = [W_gate | W_up]; ``tiles = (tm, tk, tn)`` with tn over the [gate | up] width.
    Returns ``(h [m, F], gate_up [m, 2F])`` in ``out_dtype`` (default x's); rows past ``sum`` are 0. Not differentiable
    on its own (``moe_mlp`` is).
    """
    _check_array("x", x, 2, "[m, D]")
    _check_array("wi", wi, 3, "[G, D, 2F]")
    if wi.shape[1] != x.shape[1] or wi.shape[2] % 2:
        raise ValueError(f"wi.shape={tuple(wi.shape)} must be (G, D, 2F) with D={x.shape[1]} from x.shape={x.shape}")
    check_group_sizes(group_sizes, num_groups=wi.shape[0], num_rows=x.shape[0])
    h, gate, up = _swiglu_raw(
        x, wi, group_sizes, tiles=tiles, out_dtype=jnp.dtype(out_dtype or x.dtype), rhs_buffer_count=rhs_buffer_count,
        epilogue=epilogue, interpret=interpret,
    )
    # [m, F] + [m, F] -> [m, 2F]: the gate_up residual in the layout of the unfused wi GMM.
    return h, jnp.concatenate([gate, up], axis=1)


def _swiglu_raw(x, wi, group_sizes, *, tiles, out_dtype, rhs_buffer_count, epilogue, interpret):
    m, d_model = x.shape
    f_mlp = wi.shape[2] // 2
    tm, tk, tn = _fused_fwd_tiles(_check_tiles("tiles", tiles), m, d_model, f_mlp)
    m_p, d_p = round_up(m, tm), round_up(d_model, tk)
    meta = K.make_group_metadata(group_sizes, num_rows=m_p, tm=tm, for_tgmm=False)
    h, gate, up = K.swiglu_gmm_call(
        _pad(_pad(x, 0, m_p), 1, d_p), _pad(wi, 1, d_p), meta, tiles=(tm, tk, tn), out_dtype=out_dtype,
        rhs_buffer_count=rhs_buffer_count, epilogue=epilogue, interpret=interpret,
    )
    return h[:m], gate[:m], up[:m]


def dswiglu_gmm(
    dy, wo, gate_up, group_sizes, route_weights=None, *, tiles=(256, 4096), out_dtype=None, emit_d_route=True,
    epilogue=K.dswiglu_epilogue, interpret=False,
):
    """The fused SwiGLU backward: ``g = dy @ wo^T`` in float32 (one n tile = F), then ``d[gate | up]`` and
    ``d_route = rowsum(g * h)`` in the epilogue.

    dy: [m, D]; wo: [G, F, D]; gate_up: [m, 2F]; route_weights: [m] or None; ``tiles = (tm, tk)`` (tk tiles D).
    ``emit_d_route=True`` (``moe_router_grad_from_wo_input``): ``d_route`` from the float32 ``g`` in the epilogue;
    False: the epilogue writes ``g`` rounded to ``out_dtype`` and ``d_route = rowsum(g * h)`` is a separate XLA pass
    over the rounded ``g`` and ``h``.
    Returns ``(d_gate_up [m, 2F] out_dtype (default gate_up's), d_route [m] float32 | None)``; rows past ``sum`` are 0.
    """
    _check_array("dy", dy, 2, "[m, D]")
    _check_array("wo", wo, 3, "[G, F, D]")
    _check_array("gate_up", gate_up, 2, "[m, 2F]")
    m, d_model = dy.shape
    if wo.shape[2] != d_model or gate_up.shape != (m, 2 * wo.shape[1]):
        raise ValueError(
            f"dy.shape={tuple(dy.shape)}, wo.shape={tuple(wo.shape)}, gate_up.shape={tuple(gate_up.shape)} must be "
            "[m, D], [G, F, D], [m, 2F]"
        )
    check_group_sizes(group_sizes, num_groups=wo.shape[0], num_rows=m)
    if route_weights is not None and tuple(route_weights.shape) != (m,):
        raise ValueError(f"route_weights.shape={tuple(route_weights.shape)} must be (m,)=({m},)")
    tiles = _check_tiles("tiles", tiles, 2)
    out_dtype = jnp.dtype(out_dtype or gate_up.dtype)
    d_gate_up, d_route, g = _dswiglu_raw(
        dy, wo, gate_up, group_sizes, route_weights, tiles=tiles, out_dtype=out_dtype,
        emit_d_route=emit_d_route, epilogue=epilogue, interpret=interpret,
    )
    if route_weights is not None and not emit_d_route:
        h = _swiglu_xla(gate_up, out_dtype)
        d_route = jnp.sum(g.astype(_F32) * h.astype(_F32), axis=1)
    return d_gate_up, d_route


def _dswiglu_raw(dy, wo, gate_up, group_sizes, route_weights, *, tiles, out_dtype, emit_d_route, epilogue, interpret):
    """Pad, run ``dswiglu_gmm_call``, slice. Returns (d_gate_up [m, 2F], d_route [m] | None, g [m, F] | None)."""
    m, d_model = dy.shape
    f_mlp = wo.shape[1]
    tm, tk, _ = effective((tiles[0], tiles[1], f_mlp), (m, d_model, f_mlp))
    m_p, d_p = round_up(m, tm), round_up(d_model, tk)
    has_r = route_weights is not None
    # [m] -> [m, 1]: one routing weight per row, as a column block of the row tile.
    r_m1 = _pad(route_weights.astype(_F32)[:, None], 0, m_p) if has_r else None
    meta = K.make_group_metadata(group_sizes, num_rows=m_p, tm=tm, for_tgmm=False)
    d_gate_up, d_route, g = K.dswiglu_gmm_call(
        _pad(_pad(dy, 0, m_p), 1, d_p), _pad(wo, 2, d_p), _pad(gate_up, 0, m_p), r_m1, meta, tiles=(tm, tk),
        out_dtype=out_dtype, emit_d_route=has_r and emit_d_route, emit_g=has_r and not emit_d_route,
        epilogue=epilogue, interpret=interpret,
    )
    # [m, 1] -> [m]
    return d_gate_up[:m], (d_route[:m, 0] if d_route is not None else None), (g[:m] if g is not None else None)


def _swiglu_xla(gate_up, dtype):
    """``h = silu(gate) * up`` as a separate XLA pass over a rounded ``gate_up [m, 2F]``, rounded to ``dtype``."""
    gate, up = jnp.split(gate_up.astype(_F32), 2, axis=1)
    return (gate * jax.nn.sigmoid(gate) * up).astype(dtype)


def unfused_swiglu_fwd(x, wi, group_sizes, *, tiles=(256, 4096, 1024), interpret=False):
    """The trainer's wi forward without ``moe_wi_gmm_fused_swiglu``: the GMM writes ``gate_up`` rounded to x's dtype,
    then a separate pass computes ``h`` (rounded again). Returns ``(h [m, F], gate_up [m, 2F])``."""
    gate_up = gmm(x, wi, group_sizes, tiles=_check_tiles("tiles", tiles), out_dtype=x.dtype, interpret=interpret)
    return _swiglu_xla(gate_up, x.dtype), gate_up


def unfused_dswiglu_bwd(dy, wo, gate_up, group_sizes, route_weights=None, *, tiles=(256, 4096, 1024),
                        interpret=False):
    """The trainer's wo backward without the fused flags: ``g = dy @ wo^T`` rounded, ``d_route = rowsum(g * h)`` from
    the rounded ``g`` and ``h``, ``dh = r * g`` rounded, then the SwiGLU backward rounded.

    Returns ``(d_gate_up [m, 2F] in gate_up's dtype, d_route [m] float32 | None)``.
    """
    dtype = gate_up.dtype
    g = _gmm_raw(dy, wo, group_sizes, tiles=_check_tiles("tiles", tiles), out_dtype=dtype, transpose_rhs=True,
                 interpret=interpret)
    return _dswiglu_xla(g, gate_up, route_weights)


def _dswiglu_xla(g, gate_up, route_weights):
    dtype = gate_up.dtype
    gate, up = jnp.split(gate_up.astype(_F32), 2, axis=1)
    s = jax.nn.sigmoid(gate)
    g32 = g.astype(_F32)
    if route_weights is None:
        d_route, dh = None, g32
    else:
        h = (gate * s * up).astype(dtype).astype(_F32)
        d_route = jnp.sum(g32 * h, axis=1)
        dh = (g32 * route_weights.astype(_F32)[:, None]).astype(dtype).astype(_F32)
    dgate = (dh * up * s * (1.0 + gate * (1.0 - s))).astype(dtype)
    dup = (dh * gate * s).astype(dtype)
    # [m, F] + [m, F] -> [m, 2F]
    return jnp.concatenate([dgate, dup], axis=1), d_route


# --------------------------------------------------------------------------------------------------------- moe_mlp


class _MoeCfg(NamedTuple):
    fused_swiglu: bool
    fused_dswiglu: bool
    router_grad_from_wo_input: bool
    tiles: MoeTiles
    interpret: object


def _moe_forward(x, wi, wo, group_sizes, route_weights, cfg: _MoeCfg):
    """Returns (y, residuals). All compute in x's dtype with float32 accumulation."""
    dtype = x.dtype
    wi_c, wo_c = wi.astype(dtype), wo.astype(dtype)
    t = cfg.tiles
    if cfg.fused_swiglu:
        h, gate, up = _swiglu_raw(
            x, wi_c, group_sizes, tiles=t.wi_fwd(), out_dtype=dtype, rhs_buffer_count=t.wi_tile_fwd_rhs_buffer_count,
            epilogue=K.swiglu_epilogue, interpret=cfg.interpret,
        )
        # [m, F] + [m, F] -> [m, 2F]: the residual the backward reads.
        gate_up = jnp.concatenate([gate, up], axis=1)
    else:
        gate_up = _gmm_raw(x, wi_c, group_sizes, tiles=t.wi_fwd(), out_dtype=dtype,
                           rhs_buffer_count=t.wi_tile_fwd_rhs_buffer_count, interpret=cfg.interpret)
        h = _swiglu_xla(gate_up, dtype)
    if route_weights is None:
        h_r = h
    else:
        h_r = (h.astype(_F32) * route_weights.astype(_F32)[:, None]).astype(dtype)
    y = _gmm_raw(h_r, wo_c, group_sizes, tiles=t.wo_fwd(), out_dtype=dtype, interpret=cfg.interpret)
    return y, (x, wi_c, wo_c, group_sizes, route_weights, gate_up, h, h_r)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _moe_mlp(x, wi, wo, group_sizes, route_weights, cfg):
    return _moe_forward(x, wi, wo, group_sizes, route_weights, cfg)[0]


def _moe_mlp_fwd(x, wi, wo, group_sizes, route_weights, cfg):
    y, res = _moe_forward(x, wi, wo, group_sizes, route_weights, cfg)
    # Zero-size arrays carry the primal weights' dtypes (residuals must be arrays) for the gradients' dtypes.
    return y, (res, jnp.zeros((0,), wi.dtype), jnp.zeros((0,), wo.dtype))


def _moe_mlp_bwd(cfg, saved, dy):
    (x, wi_c, wo_c, group_sizes, route_weights, gate_up, h, h_r), wi_like, wo_like = saved
    wi_dtype, wo_dtype = wi_like.dtype, wo_like.dtype
    dtype = x.dtype
    t = cfg.tiles
    dy = dy.astype(dtype)
    dwo = _tgmm_raw(h_r, dy, group_sizes, tiles=t.wo_drhs(), out_dtype=_F32, interpret=cfg.interpret)
    if cfg.fused_dswiglu:
        tm, tk, _ = t.wo_dlhs()
        d_gate_up, d_route, g = _dswiglu_raw(
            dy, wo_c, gate_up, group_sizes, route_weights, tiles=(tm, tk), out_dtype=dtype,
            emit_d_route=cfg.router_grad_from_wo_input, epilogue=K.dswiglu_epilogue, interpret=cfg.interpret,
        )
        if route_weights is not None and not cfg.router_grad_from_wo_input:
            d_route = jnp.sum(g.astype(_F32) * h.astype(_F32), axis=1)
    else:
        g = _gmm_raw(dy, wo_c, group_sizes, tiles=t.wo_dlhs(), out_dtype=dtype, transpose_rhs=True,
                     interpret=cfg.interpret)
        d_gate_up, d_route = _dswiglu_xla(g, gate_up, route_weights)
    dx = _gmm_raw(d_gate_up, wi_c, group_sizes, tiles=t.wi_dlhs(), out_dtype=dtype, transpose_rhs=True,
                  interpret=cfg.interpret)
    dwi = _tgmm_raw(x, d_gate_up, group_sizes, tiles=t.wi_drhs(), out_dtype=_F32, interpret=cfg.interpret)
    dr = None if route_weights is None else d_route.astype(route_weights.dtype)
    return dx, dwi.astype(wi_dtype), dwo.astype(wo_dtype), None, dr


_moe_mlp.defvjp(_moe_mlp_fwd, _moe_mlp_bwd)


def moe_mlp(
    x, wi, wo, group_sizes, route_weights=None, *, fused_swiglu=False, fused_dswiglu=False,
    router_grad_from_wo_input=False, tiles: MoeTiles | None = None, interpret=False,
) -> jax.Array:
    """Routed SwiGLU experts: ``y = gmm(swiglu(x @ wi[:, :, :F], x @ wi[:, :, F:]) * r[:, None], wo)`` per group.

    Args:
      x: [m, D] bf16 (or f32): tokens sorted by expert; the compute dtype.
      wi: [G, D, 2F] = [W_gate | W_up]; wo: [G, F, D] (cast to x's dtype at use; gradients in their own dtype).
      group_sizes: [G] int32, ``sum <= m``; rows past the sum give y = 0 and zero gradients.
      route_weights: [m] float or None: the routing weight, applied at the wo input.
      fused_swiglu: ``moe_wi_gmm_fused_swiglu``; fused_dswiglu: ``moe_wo_gmm_fused_dswiglu``;
      router_grad_from_wo_input: ``moe_router_grad_from_wo_input`` (requires fused_dswiglu).
      tiles: ``MoeTiles`` (default: the recipe's tiles, clipped to the dims).

    With every flag off this is the trainer's unfused path: every intermediate (gate_up, h, h * r, g, dh, d_gate_up)
    rounded to x's dtype between separate passes. Differentiable in x, wi, wo and route_weights.
    """
    _check_moe_shapes(x, wi, wo, group_sizes, route_weights)
    tiles = MoeTiles() if tiles is None else tiles
    if not isinstance(tiles, MoeTiles):
        raise ValueError(f"tiles={tiles!r} must be a kernels.tiling.MoeTiles")
    if router_grad_from_wo_input and not fused_dswiglu:
        raise ValueError(
            "router_grad_from_wo_input=True requires fused_dswiglu=True "
            "(moe_router_grad_from_wo_input=True requires moe_wo_gmm_fused_dswiglu=True); got fused_dswiglu=False"
        )
    m, d_model = x.shape
    f_mlp = wo.shape[1]
    if fused_swiglu:
        _fused_fwd_tiles(tiles.wi_fwd(), m, d_model, f_mlp)
    if fused_dswiglu and min(tiles.wo_tile_dlhs_mlp_dim, f_mlp) != f_mlp:
        raise ValueError(
            f"fused_dswiglu=True needs one n tile over F: wo_tile_dlhs_mlp_dim={tiles.wo_tile_dlhs_mlp_dim} must be "
            f">= the MoE MLP dim F={f_mlp}"
        )
    if m == 0:
        return jnp.zeros((0, d_model), x.dtype)
    cfg = _MoeCfg(bool(fused_swiglu), bool(fused_dswiglu), bool(router_grad_from_wo_input), tiles, interpret)
    return _moe_mlp(x, wi, wo, group_sizes, route_weights, cfg)


__all__ = [
    "GmmTiles",
    "dswiglu_gmm",
    "gmm",
    "moe_mlp",
    "swiglu_gmm",
    "tgmm",
    "unfused_dswiglu_bwd",
    "unfused_swiglu_fwd",
]
