"""The fused SwiGLU kernels and ``moe_mlp`` (``kernels/gmm/ops.py``) against the float32 references.

- fused forward (``moe_wi_gmm_fused_swiglu``): ``h`` and ``gate_up`` against ``reference.swiglu(reference.gmm(...))``;
- fused backward (``moe_wo_gmm_fused_dswiglu``, with and without routing weights, ``d_route`` from the epilogue or from
  the rounded ``g``) against ``reference.moe_wo_dlhs_dswiglu``;
- ``moe_mlp`` (flags off / on) forward and the gradients of x, wi, wo, route_weights against ``jax.vjp`` of the float32
  reference composition. float32 inputs make every path exact up to float32 accumulation order (tight tolerances that
  a wrong epilogue or a wrong wiring cannot pass); bf16 checks bound the rounding.
Run: ``python -m pytest tests/kernels/test_moe_mlp.py -q``.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from nxgates import reference as R
from nxgates.gates.diff import rel_l2
from nxgates.kernels.gmm import dswiglu_gmm, moe_mlp, swiglu_gmm, unfused_dswiglu_bwd
from nxgates.kernels.tiling import MoeTiles

# m=45 rows, 41 routed (sum < m), an empty expert, boundaries inside 16-row tiles; D=48 over two k tiles of 32 (padded).
M, D, F, SIZES = 45, 48, 32, (6, 0, 27, 8)
TILES = MoeTiles(**{
    f.name: (16 if f.name.endswith("batch_seq") else 32)
    for f in dataclasses.fields(MoeTiles) if f.name != "wi_tile_fwd_rhs_buffer_count"
})
CASE_ID = f"M{M}-D{D}-F{F}-G{len(SIZES)}-sum{sum(SIZES)}"


def _inputs(dtype):
    rng = np.random.default_rng(zlib.crc32(CASE_ID.encode()))

    def rounded(shape, scale=1.0):
        return jnp.asarray((rng.standard_normal(shape) * scale).astype(ml_dtypes.bfloat16).astype(np.float32), dtype)

    x = rounded((M, D))
    wi = rounded((len(SIZES), D, 2 * F), D**-0.5)
    wo = rounded((len(SIZES), F, D), F**-0.5)
    dy = rounded((M, D))
    r = jnp.asarray(rng.uniform(0.05, 1.0, M).astype(np.float32))
    return x, wi, wo, jnp.asarray(SIZES, jnp.int32), r, dy


def _close(a, b, name, tol=2e-5):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol, err_msg=name)


# ---------------------------------------------------------------------------------------------------- fused forward


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_fused_swiglu_forward_vs_reference(dtype):
    x, wi, _, gs, _, _ = _inputs(dtype)
    h, gate_up = swiglu_gmm(x, wi, gs, tiles=(16, 32, 32), interpret=True)
    gate_up_ref = R.gmm(x, wi, gs)
    h_ref = R.swiglu(gate_up_ref[:, :F], gate_up_ref[:, F:])
    assert h.shape == (M, F) and gate_up.shape == (M, 2 * F) and h.dtype == dtype
    if dtype == jnp.float32:
        _close(h, h_ref, "h")
        _close(gate_up, gate_up_ref, "gate_up")
    else:  # h rounded once from the f32 accumulator
        assert rel_l2(h, h_ref) < 4e-3 and rel_l2(gate_up, gate_up_ref) < 4e-3
    assert np.all(np.asarray(h, np.float32)[sum(SIZES):] == 0.0)


# --------------------------------------------------------------------------------------------------- fused backward


@pytest.mark.parametrize(
    "with_r,emit_d_route", [(True, True), (True, False), (False, True)], ids=["r-epilogue", "r-from-g", "no-r"]
)
def test_fused_dswiglu_backward_f32_vs_reference(with_r, emit_d_route):
    x, wi, wo, gs, r, dy = _inputs(jnp.float32)
    gate_up = R.gmm(x, wi, gs)
    r = r if with_r else None
    d_gate_up, d_route = dswiglu_gmm(dy, wo, gate_up, gs, r, tiles=(16, 32), emit_d_route=emit_d_route,
                                     interpret=True)
    dgu_ref, droute_ref = R.moe_wo_dlhs_dswiglu(dy, wo, gate_up, gs, r)
    _close(d_gate_up, dgu_ref, "d_gate_up")
    if with_r:
        _close(d_route, droute_ref, "d_route")
        assert np.all(np.asarray(d_route)[sum(SIZES):] == 0.0)
    else:
        assert d_route is None
    assert np.all(np.asarray(d_gate_up)[sum(SIZES):] == 0.0)


def test_fused_dswiglu_bf16_rounds_once_and_beats_unfused():
    x, wi, wo, gs, r, dy = _inputs(jnp.bfloat16)
    gate_up = R.gmm(x, wi, gs).astype(jnp.bfloat16)
    dgu_ref, droute_ref = R.moe_wo_dlhs_dswiglu(dy, wo, gate_up, gs, r)
    d_gate_up, d_route = dswiglu_gmm(dy, wo, gate_up, gs, r, tiles=(16, 32), interpret=True)
    d_gate_up_u, d_route_u = unfused_dswiglu_bwd(dy, wo, gate_up, gs, r, tiles=(16, 32, 32), interpret=True)
    assert d_gate_up.dtype == jnp.bfloat16 and d_route.dtype == jnp.float32
    fused, unfused = rel_l2(d_gate_up, dgu_ref), rel_l2(d_gate_up_u, dgu_ref)
    assert fused < 3e-3  # one bf16 rounding of d_gate_up
    assert unfused < 5e-3  # g, dh, d_gate_up each rounded
    assert fused < unfused
    assert rel_l2(d_route, droute_ref) < 1e-5  # f32 epilogue vs bf16 g in the unfused pass
    assert 1e-4 < rel_l2(d_route_u, droute_ref) < 5e-3


# -------------------------------------------------------------------------------------------------------- moe_mlp


@functools.partial(jax.jit, static_argnames=("flags",))
def _moe_and_grads(x, wi, wo, gs, r, dy, *, flags):
    fused_swiglu, fused_dswiglu, router = flags
    fn = functools.partial(moe_mlp, group_sizes=gs, fused_swiglu=fused_swiglu, fused_dswiglu=fused_dswiglu,
                           router_grad_from_wo_input=router, tiles=TILES, interpret=True)
    y, vjp = jax.vjp(lambda a, b, c, d: fn(a, b, c, route_weights=d), x, wi, wo, r)
    return (y, *vjp(dy))


def _ref_moe_and_grads(x, wi, wo, gs, r, dy):
    def f(x, wi, wo, r):
        gu = R.gmm(x, wi, gs)
        return R.gmm(R.swiglu(gu[:, :F], gu[:, F:]) * r[:, None], wo, gs)

    y, vjp = jax.vjp(f, x, wi, wo, r)
    return (y, *vjp(dy))


@pytest.mark.parametrize(
    "flags", [(False, False, False), (True, True, True), (False, True, False)],
    ids=["flags-off", "flags-on", "fused-dswiglu-only"],
)
def test_moe_mlp_f32_forward_and_gradients(flags):
    x, wi, wo, gs, r, dy = _inputs(jnp.float32)
    got = _moe_and_grads(x, wi, wo, gs, r, dy, flags=flags)
    want = _ref_moe_and_grads(x, wi, wo, gs, r, dy)
    for name, a, b in zip(("y", "dx", "dwi", "dwo", "d_route"), got, want, strict=True):
        assert a.shape == b.shape and a.dtype == jnp.float32, name
        _close(a, b, name, tol=1e-4)
    assert np.all(np.asarray(got[0])[sum(SIZES):] == 0.0)
    assert np.all(np.asarray(got[2])[1] == 0.0)  # empty expert: zero wi gradient


def test_moe_mlp_refusals_name_the_flags():
    x, wi, wo, gs, r, _ = _inputs(jnp.bfloat16)
    with pytest.raises(ValueError, match="router_grad_from_wo_input=True requires fused_dswiglu=True"):
        moe_mlp(x, wi, wo, gs, r, router_grad_from_wo_input=True, interpret=True)
    with pytest.raises(ValueError, match="wo_tile_dlhs_mlp_dim=16"):
        moe_mlp(x, wi, wo, gs, r, fused_dswiglu=True, tiles=dataclasses.replace(TILES, wo_tile_dlhs_mlp_dim=16),
                interpret=True)
    with pytest.raises(ValueError, match="mlp tile 24"):
        moe_mlp(x, wi, wo, gs, r, fused_swiglu=True, tiles=dataclasses.replace(TILES, wi_tile_fwd_mlp_dim=24),
                interpret=True)
    with pytest.raises(ValueError, match="route_weights.shape"):
        moe_mlp(x, wi, wo, gs, r[:-1], interpret=True)
    with pytest.raises(ValueError, match="wi.shape"):
        moe_mlp(x, wi[:, :, :-2], wo, gs, r, interpret=True)
