"""The ``pallas_call``s of the MoE grouped matmuls: ragged GMM, tgmm, and the two fused SwiGLU kernels.

Rows are tokens sorted by expert: group ``i`` owns the ``group_sizes[i]`` contiguous rows after the rows of groups
``< i`` (the layout of ``reference.gmm``). The kernels here are raw: every dimension must already be a multiple of its
tile (``kernels/gmm/ops.py`` pads, validates and differentiates).

Group metadata (``make_group_metadata``, scalar-prefetched into SMEM). The rows ``[0, m)`` are cut into *segments*:
one per group plus, for the GMMs, a *tail* segment ``[sum(group_sizes), m)`` that belongs to no group. A *visit* is one
(m tile, segment) pair with a non-empty intersection, in row order; an m tile that straddles a boundary is therefore
visited once per segment, and each visit writes only its own rows (a row mask from the segment bounds). Empty groups
get no visit in the GMMs; in tgmm each empty group gets one visit whose mask is empty, so its output is written as
zeros. The tail's visits write zeros, so rows past ``sum(group_sizes)`` are exactly 0 and no output row is left
unwritten. The grid's visit axis has a static length ``V`` (an upper bound: ``num_m_tiles + G`` for the GMMs,
``num_m_tiles + G - 1`` for tgmm); visits past the real count repeat the last real visit's block indices (so no new
block is fetched or written) and do nothing.

Kernels (``tm, tk, tn`` = m tile, contraction tile, output-column tile of the GMMs; tgmm contracts over m):
- ``gmm_call``: ``out[rows_i] = lhs[rows_i] @ rhs[i]`` (``rhs: [G, k, n]``, or ``[G, n, k]`` with ``transpose_rhs``:
  the dlhs of a GMM). Grid ``(n tiles, V, k tiles)``; float32 VMEM accumulator; output dtype a parameter.
- ``tgmm_call``: ``out[i] = lhs[rows_i]^T @ rhs[rows_i]``. Grid ``(k tiles, n tiles, V)``; the accumulator lives
  across the consecutive visits of one group and is written at the group's last visit.
- ``swiglu_gmm_call`` (``moe_wi_gmm_fused_swiglu``): the wi GMM over ``wi = [W_gate | W_up]: [G, D, 2F]``; each grid
  step reads the gate columns ``[j tn/2, (j+1) tn/2)`` and the matching up columns ``F + [j tn/2, (j+1) tn/2)`` into two
  float32 accumulators; the epilogue writes ``h = silu(gate) * up`` from them, and ``gate``, ``up`` (the residual the
  backward needs), all rounded once to the output dtype.
- ``dswiglu_gmm_call`` (``moe_wo_gmm_fused_dswiglu``): the wo input-gradient GMM ``g = dy @ wo[i]^T`` with one n tile
  covering F (``acc: [tm, F]`` float32); the epilogue turns ``g`` into ``d[gate | up]`` and, with routing weights,
  ``d_route = rowsum(g * h)`` in float32 (``moe_router_grad_from_wo_input``), or writes ``g`` rounded for a separate
  router-gradient pass. The epilogue is a plain function of float32 tiles (``dswiglu_epilogue``) passed in by the
  caller, so tests and reports can substitute a deliberately wrong one.

Status: checked on CPU under the Pallas interpreter and the TPU interpreter (NaN-filled uninitialized memory); not yet
compiled with Mosaic on a TPU (none was available): the transposed-lhs dot of tgmm, the ``[tm, 1]`` routing-weight
blocks and the lane concatenation of the fused backward are the first things to check there.

Run the tests: ``python -m pytest tests/kernels/test_gmm.py tests/kernels/test_moe_mlp.py -q``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_F32 = jnp.float32
_NUM_META = 5  # scalar-prefetch operands: seg_start, seg_end, visit_seg, visit_tile, num_visits


@dataclasses.dataclass(frozen=True)
class GroupMetadata:
    """Visit schedule of a ragged GMM / tgmm (int32 arrays, scalar-prefetched).

    seg_start, seg_end: [S] row range of each segment (S = G, plus 1 for the tail segment of the GMMs).
    visit_seg: [V] segment of each visit (== G for the tail); visit_tile: [V] m tile of each visit.
    num_visits: [1] number of real visits (<= V); later visits repeat the last real one and do nothing.
    """

    seg_start: jax.Array
    seg_end: jax.Array
    visit_seg: jax.Array
    visit_tile: jax.Array
    num_visits: jax.Array

    def operands(self) -> tuple[jax.Array, ...]:
        return (self.seg_start, self.seg_end, self.visit_seg, self.visit_tile, self.num_visits)

    @property
    def max_visits(self) -> int:
        return int(self.visit_seg.shape[0])


def make_group_metadata(group_sizes: jax.Array, *, num_rows: int, tm: int, for_tgmm: bool) -> GroupMetadata:
    """Visit schedule for ``group_sizes: [G] int32`` over ``num_rows`` rows (a multiple of ``tm``).

    ``for_tgmm=False`` (the GMMs): segments are the G groups plus the tail ``[sum, num_rows)``; empty segments get no
    visit. ``for_tgmm=True``: segments are the G groups only; an empty group gets one visit (with an empty row mask).
    """
    num_groups = group_sizes.shape[0]
    num_tiles = num_rows // tm
    sizes_g = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    if for_tgmm:
        sizes_s = sizes_g
    else:
        tail = jnp.int32(num_rows) - jnp.sum(sizes_g)
        sizes_s = jnp.concatenate([sizes_g, tail[None]])  # [G + 1]: the groups, then the tail
    seg_end = jnp.cumsum(sizes_s, dtype=jnp.int32)
    seg_start = seg_end - sizes_s
    first_tile = jnp.minimum(seg_start // tm, num_tiles - 1)
    last_tile = (seg_end - 1) // tm
    if for_tgmm:
        count = jnp.where(sizes_s > 0, last_tile - first_tile + 1, 1)
        max_visits = num_tiles + num_groups - 1
    else:
        count = jnp.where(sizes_s > 0, last_tile - first_tile + 1, 0)
        max_visits = num_tiles + num_groups
    incl = jnp.cumsum(count, dtype=jnp.int32)
    excl = incl - count
    num_visits = incl[-1]
    # Visits past the real count repeat the last real visit (same blocks: nothing is fetched or written).
    v = jnp.minimum(jnp.arange(max_visits, dtype=jnp.int32), num_visits - 1)
    # The segment of visit v is the first one whose inclusive visit count exceeds v (segments with no visit skipped).
    visit_seg = jnp.searchsorted(incl, v, side="right").astype(jnp.int32)
    visit_tile = first_tile[visit_seg] + (v - excl[visit_seg])
    return GroupMetadata(seg_start, seg_end, visit_seg, visit_tile, num_visits[None])


# ------------------------------------------------------------------------------------------------ shared kernel pieces


def _visit_state(meta_refs, v, *, num_groups: int, tm: int):
    """Scalars of visit ``v``: (active, in_group, first visit of its m tile, row mask [tm, 1] of its segment)."""
    seg_start_ref, seg_end_ref, visit_seg_ref, visit_tile_ref, num_visits_ref = meta_refs
    seg = visit_seg_ref[v]
    tile = visit_tile_ref[v]
    active = v < num_visits_ref[0]
    in_group = seg < num_groups
    prev_tile = visit_tile_ref[jnp.maximum(v - 1, 0)]
    first_of_tile = jnp.logical_or(v == 0, prev_tile != tile)
    row = tile * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
    row_mask = jnp.logical_and(row >= seg_start_ref[seg], row < seg_end_ref[seg])
    return active, in_group, first_of_tile, row_mask


def _masked_store(out_ref, value, row_mask, in_group, first_of_tile):
    """Write ``value`` into this visit's rows of ``out_ref`` (zeros for the tail); keep the other visits' rows.

    The first visit of an m tile owns the block's initial content (uninitialized VMEM on TPU), so it writes every
    row: its own, and zeros elsewhere (later visits of the tile overwrite theirs).
    """
    value = jnp.where(in_group, value, 0.0).astype(out_ref.dtype)
    mask = jnp.broadcast_to(row_mask, value.shape)

    @pl.when(first_of_tile)
    def _():
        out_ref[...] = jnp.where(mask, value, jnp.zeros_like(value))

    @pl.when(jnp.logical_not(first_of_tile))
    def _():
        out_ref[...] = jnp.where(mask, value, out_ref[...])


def _dot(a, b, *, contract_a: int, contract_b: int):
    """``a . b`` over the given dims with a float32 result (HIGHEST precision for float32 inputs)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == _F32 else None
    return jax.lax.dot_general(
        a, b, (((contract_a,), (contract_b,)), ((), ())), precision=precision, preferred_element_type=_F32
    )


def _rhs_spec(block_shape, index_map, buffer_count: int):
    if buffer_count == 2:  # Pallas's default double buffering.
        return pl.BlockSpec(block_shape, index_map)
    return pl.BlockSpec(block_shape, index_map, pipeline_mode=pl.Buffered(buffer_count))


def _grid_spec(grid, in_specs, out_specs, scratch_shapes):
    return pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=_NUM_META, grid=grid, in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch_shapes
    )


# ------------------------------------------------------------------------------------------------------------ GMM


def gmm_call(
    lhs: jax.Array,
    rhs: jax.Array,
    meta: GroupMetadata,
    *,
    tiles: tuple[int, int, int],
    out_dtype,
    transpose_rhs: bool = False,
    rhs_buffer_count: int = 2,
    interpret=False,
) -> jax.Array:
    """Ragged GMM ``out[rows_i] = lhs[rows_i] @ rhs[i]`` (``rhs[i]^T`` with ``transpose_rhs``).

    lhs: [m, k]; rhs: [G, k, n] ([G, n, k] with ``transpose_rhs``); every dim a multiple of its tile ``(tm, tk, tn)``.
    Returns [m, n] ``out_dtype``; rows outside every group are 0.
    """
    tm, tk, tn = tiles
    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    n_k = k // tk

    def kernel(*refs):
        meta_refs, (lhs_ref, rhs_ref, out_ref, acc_ref) = refs[:_NUM_META], refs[_NUM_META:]
        v, kk = pl.program_id(1), pl.program_id(2)
        active, in_group, first_of_tile, row_mask = _visit_state(meta_refs, v, num_groups=num_groups, tm=tm)

        @pl.when(kk == 0)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        @pl.when(jnp.logical_and(active, in_group))
        def _():
            acc_ref[...] += _dot(lhs_ref[...], rhs_ref[...], contract_a=1, contract_b=1 if transpose_rhs else 0)

        @pl.when(jnp.logical_and(active, kk == n_k - 1))
        def _():
            _masked_store(out_ref, acc_ref[...], row_mask, in_group, first_of_tile)

    def lhs_map(j, v, kk, _ss, _se, _vs, vt, _nv):
        return vt[v], kk

    def rhs_map(j, v, kk, _ss, _se, vs, _vt, _nv):
        group = jnp.minimum(vs[v], num_groups - 1)  # the tail reads group G-1's block and skips the matmul
        return (group, j, kk) if transpose_rhs else (group, kk, j)

    def out_map(j, v, kk, _ss, _se, _vs, vt, _nv):
        return vt[v], j

    rhs_block = (None, tn, tk) if transpose_rhs else (None, tk, tn)
    grid_spec = _grid_spec(
        grid=(n // tn, meta.max_visits, n_k),
        in_specs=[pl.BlockSpec((tm, tk), lhs_map), _rhs_spec(rhs_block, rhs_map, rhs_buffer_count)],
        out_specs=pl.BlockSpec((tm, tn), out_map),
        scratch_shapes=[pltpu.VMEM((tm, tn), _F32)],
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
        name="gmm_t" if transpose_rhs else "gmm",
    )(*meta.operands(), lhs, rhs)


# ----------------------------------------------------------------------------------------------------------- tgmm


def tgmm_call(
    lhs: jax.Array, rhs: jax.Array, meta: GroupMetadata, *, tiles: tuple[int, int, int], out_dtype, interpret=False
) -> jax.Array:
    """``out[i] = lhs[rows_i]^T @ rhs[rows_i]`` (``meta`` built with ``for_tgmm=True``).

    lhs: [m, k], rhs: [m, n], each dim a multiple of its tile ``(tm, tk, tn)``. Returns [G, k, n] ``out_dtype``;
    an empty group gives exactly 0.
    """
    tm, tk, tn = tiles
    m, k = lhs.shape
    n = rhs.shape[1]
    num_groups = meta.seg_start.shape[0]

    def kernel(*refs):
        meta_refs, (lhs_ref, rhs_ref, out_ref, acc_ref) = refs[:_NUM_META], refs[_NUM_META:]
        _, _, visit_seg_ref, _, num_visits_ref = meta_refs
        v = pl.program_id(2)
        active, _, _, row_mask = _visit_state(meta_refs, v, num_groups=num_groups, tm=tm)
        seg = visit_seg_ref[v]
        first_of_group = jnp.logical_or(v == 0, visit_seg_ref[jnp.maximum(v - 1, 0)] != seg)
        last_of_group = jnp.logical_or(
            v == num_visits_ref[0] - 1, visit_seg_ref[jnp.minimum(v + 1, meta.max_visits - 1)] != seg
        )

        @pl.when(jnp.logical_and(active, first_of_group))
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        @pl.when(active)
        def _():
            # Rows of other groups (and rows past sum(group_sizes), whatever they hold) are zeroed on both sides.
            lhs_tile = jnp.where(row_mask, lhs_ref[...], jnp.zeros_like(lhs_ref[...]))
            rhs_tile = jnp.where(row_mask, rhs_ref[...], jnp.zeros_like(rhs_ref[...]))
            acc_ref[...] += _dot(lhs_tile, rhs_tile, contract_a=0, contract_b=0)

        @pl.when(jnp.logical_and(active, last_of_group))
        def _():
            out_ref[...] = acc_ref[...].astype(out_ref.dtype)

    def lhs_map(i, j, v, _ss, _se, _vs, vt, _nv):
        return vt[v], i

    def rhs_map(i, j, v, _ss, _se, _vs, vt, _nv):
        return vt[v], j

    def out_map(i, j, v, _ss, _se, vs, _vt, _nv):
        return vs[v], i, j

    grid_spec = _grid_spec(
        grid=(k // tk, n // tn, meta.max_visits),
        in_specs=[pl.BlockSpec((tm, tk), lhs_map), pl.BlockSpec((tm, tn), rhs_map)],
        out_specs=pl.BlockSpec((None, tk, tn), out_map),
        scratch_shapes=[pltpu.VMEM((tk, tn), _F32)],
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="tgmm",
    )(*meta.operands(), lhs, rhs)


# ------------------------------------------------------------------------------------------- fused SwiGLU forward


def swiglu_epilogue(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``h = silu(gate) * up`` on float32 tiles ``[tm, tn/2]``."""
    return gate * jax.nn.sigmoid(gate) * up


def swiglu_gmm_call(
    x: jax.Array,
    wi: jax.Array,
    meta: GroupMetadata,
    *,
    tiles: tuple[int, int, int],
    out_dtype,
    rhs_buffer_count: int = 2,
    epilogue: Callable[[jax.Array, jax.Array], jax.Array] = swiglu_epilogue,
    interpret=False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Fused wi GMM + SwiGLU: ``gate_up = x @ wi[i]`` in float32, then ``h = silu(gate) * up`` in the epilogue.

    x: [m, D]; wi: [G, D, 2F] = [W_gate | W_up]; ``tiles = (tm, tk, tn)`` with ``tn`` the width of the [gate | up]
    columns one step reads (``tn/2`` gate + ``tn/2`` up columns; ``tn/2`` divides F). Returns ``(h, gate, up)``,
    each [m, F] ``out_dtype``, rounded once from float32.
    """
    tm, tk, tn = tiles
    m, d_model = x.shape
    num_groups, _, two_f = wi.shape
    f_mlp = two_f // 2
    tn_half = tn // 2
    n_half_tiles = f_mlp // tn_half  # column blocks of width tn/2 per half: gate block j, up block j + n_half_tiles
    n_k = d_model // tk

    def kernel(*refs):
        meta_refs = refs[:_NUM_META]
        x_ref, wg_ref, wu_ref, h_ref, gate_ref, up_ref, acc_gate_ref, acc_up_ref = refs[_NUM_META:]
        v, kk = pl.program_id(1), pl.program_id(2)
        active, in_group, first_of_tile, row_mask = _visit_state(meta_refs, v, num_groups=num_groups, tm=tm)

        @pl.when(kk == 0)
        def _():
            acc_gate_ref[...] = jnp.zeros_like(acc_gate_ref)
            acc_up_ref[...] = jnp.zeros_like(acc_up_ref)

        @pl.when(jnp.logical_and(active, in_group))
        def _():
            x_tile = x_ref[...]
            acc_gate_ref[...] += _dot(x_tile, wg_ref[...], contract_a=1, contract_b=0)
            acc_up_ref[...] += _dot(x_tile, wu_ref[...], contract_a=1, contract_b=0)

        @pl.when(jnp.logical_and(active, kk == n_k - 1))
        def _():
            gate, up = acc_gate_ref[...], acc_up_ref[...]
            _masked_store(h_ref, epilogue(gate, up), row_mask, in_group, first_of_tile)
            _masked_store(gate_ref, gate, row_mask, in_group, first_of_tile)
            _masked_store(up_ref, up, row_mask, in_group, first_of_tile)

    def x_map(j, v, kk, _ss, _se, _vs, vt, _nv):
        return vt[v], kk

    def wg_map(j, v, kk, _ss, _se, vs, _vt, _nv):
        return jnp.minimum(vs[v], num_groups - 1), kk, j

    def wu_map(j, v, kk, _ss, _se, vs, _vt, _nv):
        return jnp.minimum(vs[v], num_groups - 1), kk, j + n_half_tiles

    def out_map(j, v, kk, _ss, _se, _vs, vt, _nv):
        return vt[v], j

    out_spec = pl.BlockSpec((tm, tn_half), out_map)
    grid_spec = _grid_spec(
        grid=(n_half_tiles, meta.max_visits, n_k),
        in_specs=[
            pl.BlockSpec((tm, tk), x_map),
            _rhs_spec((None, tk, tn_half), wg_map, rhs_buffer_count),
            _rhs_spec((None, tk, tn_half), wu_map, rhs_buffer_count),
        ],
        out_specs=[out_spec, out_spec, out_spec],
        scratch_shapes=[pltpu.VMEM((tm, tn_half), _F32), pltpu.VMEM((tm, tn_half), _F32)],
    )
    out_shape = jax.ShapeDtypeStruct((m, f_mlp), out_dtype)
    h, gate, up = pl.pallas_call(
        kernel,
        out_shape=(out_shape, out_shape, out_shape),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
        name="gmm_swiglu",
    )(*meta.operands(), x, wi, wi)
    return h, gate, up


# ------------------------------------------------------------------------------------------ fused SwiGLU backward


def dswiglu_epilogue(g, gate, up, r):
    """The fused backward's epilogue on float32 tiles: ``g, gate, up: [tm, F]``, ``r: [tm, 1]`` or None.

    Returns ``(dgate, dup, d_route)``: with ``s = sigmoid(gate)``, ``h = gate * s * up``, ``dh = r * g`` (``g``
    without routing weights), ``dgate = dh * up * s * (1 + gate * (1 - s))``, ``dup = dh * gate * s``,
    ``d_route = rowsum(g * h)`` ([tm, 1]; None without routing weights).
    """
    s = jax.nn.sigmoid(gate)
    if r is None:
        dh, d_route = g, None
    else:
        h = gate * s * up
        d_route = jnp.sum(g * h, axis=1, keepdims=True)
        dh = g * r
    dgate = dh * up * s * (1.0 + gate * (1.0 - s))
    dup = dh * gate * s
    return dgate, dup, d_route


def dswiglu_gmm_call(
    dy: jax.Array,
    wo: jax.Array,
    gate_up: jax.Array,
    route_weights: jax.Array | None,
    meta: GroupMetadata,
    *,
    tiles: tuple[int, int],
    out_dtype,
    emit_d_route: bool,
    emit_g: bool,
    epilogue=dswiglu_epilogue,
    interpret=False,
):
    """Fused wo dlhs GMM + SwiGLU backward.

    dy: [m, D]; wo: [G, F, D]; gate_up: [m, 2F]; route_weights: [m, 1] float32 or None; ``tiles = (tm, tk)`` (the n
    tile is F: the whole activation gradient of a row is in the accumulator when the epilogue runs).
    Returns ``(d_gate_up [m, 2F] out_dtype, d_route [m, 1] float32 | None, g [m, F] out_dtype | None)``.
    """
    tm, tk = tiles
    m, d_model = dy.shape
    num_groups, f_mlp, _ = wo.shape
    n_k = d_model // tk
    has_r = route_weights is not None
    if emit_d_route and not has_r:
        raise ValueError("emit_d_route=True needs route_weights")

    def kernel(*refs):
        meta_refs, refs = refs[:_NUM_META], list(refs[_NUM_META:])
        dy_ref, wo_ref, gate_ref, up_ref = refs[:4]
        refs = refs[4:]
        r_ref = refs.pop(0) if has_r else None
        dgu_ref = refs.pop(0)
        droute_ref = refs.pop(0) if emit_d_route else None
        g_ref = refs.pop(0) if emit_g else None
        (acc_ref,) = refs
        v, kk = pl.program_id(0), pl.program_id(1)
        active, in_group, first_of_tile, row_mask = _visit_state(meta_refs, v, num_groups=num_groups, tm=tm)

        @pl.when(kk == 0)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        @pl.when(jnp.logical_and(active, in_group))
        def _():
            # [tm, tk] x [F, tk] -> [tm, F]: wo's block is contracted over its last (D) dim, i.e. wo^T.
            acc_ref[...] += _dot(dy_ref[...], wo_ref[...], contract_a=1, contract_b=1)

        @pl.when(jnp.logical_and(active, kk == n_k - 1))
        def _():
            g = acc_ref[...]
            r = r_ref[...].astype(_F32) if has_r else None
            dgate, dup, d_route = epilogue(g, gate_ref[...].astype(_F32), up_ref[...].astype(_F32), r)
            # [tm, F] + [tm, F] -> [tm, 2F]: the [dgate | dup] block of these rows.
            _masked_store(dgu_ref, jnp.concatenate([dgate, dup], axis=1), row_mask, in_group, first_of_tile)
            if emit_d_route:
                _masked_store(droute_ref, d_route, row_mask, in_group, first_of_tile)
            if emit_g:
                _masked_store(g_ref, g, row_mask, in_group, first_of_tile)

    def row_map(v, kk, _ss, _se, _vs, vt, _nv):
        return vt[v], kk

    def wo_map(v, kk, _ss, _se, vs, _vt, _nv):
        return jnp.minimum(vs[v], num_groups - 1), 0, kk

    def gate_map(v, kk, _ss, _se, _vs, vt, _nv):
        return vt[v], 0

    def up_map(v, kk, _ss, _se, _vs, vt, _nv):
        return vt[v], 1

    in_specs = [
        pl.BlockSpec((tm, tk), row_map),
        pl.BlockSpec((None, f_mlp, tk), wo_map),
        pl.BlockSpec((tm, f_mlp), gate_map),  # gate_up[:, :F]
        pl.BlockSpec((tm, f_mlp), up_map),  # gate_up[:, F:]
    ]
    operands = [dy, wo, gate_up, gate_up]
    if has_r:
        in_specs.append(pl.BlockSpec((tm, 1), gate_map))
        operands.append(route_weights)
    out_specs = [pl.BlockSpec((tm, 2 * f_mlp), gate_map)]
    out_shape = [jax.ShapeDtypeStruct((m, 2 * f_mlp), out_dtype)]
    if emit_d_route:
        out_specs.append(pl.BlockSpec((tm, 1), gate_map))
        out_shape.append(jax.ShapeDtypeStruct((m, 1), _F32))
    if emit_g:
        out_specs.append(pl.BlockSpec((tm, f_mlp), gate_map))
        out_shape.append(jax.ShapeDtypeStruct((m, f_mlp), out_dtype))
    grid_spec = _grid_spec(
        grid=(meta.max_visits, n_k),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((tm, f_mlp), _F32)],
    )
    outs = list(
        pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid_spec=grid_spec,
            compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
            interpret=interpret,
            name="gmm_dswiglu",
        )(*meta.operands(), *operands)
    )
    d_gate_up = outs.pop(0)
    d_route = outs.pop(0) if emit_d_route else None
    g = outs.pop(0) if emit_g else None
    return d_gate_up, d_route, g


__all__ = [
    "GroupMetadata",
    "dswiglu_epilogue",
    "dswiglu_gmm_call",
    "gmm_call",
    "make_group_metadata",
    "swiglu_epilogue",
    "swiglu_gmm_call",
    "tgmm_call",
]
