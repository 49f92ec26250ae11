"""``kernels/tiling.py``: the VMEM accounting reproduces the trainer's TPU v7x calibration and refuses tiles that
do not fit with the numbers. Run: ``python -m pytest tests/kernels/test_tiling.py -q``."""

from __future__ import annotations

import dataclasses

import pytest

from nxgates.kernels.tiling import (
    MIB,
    MoeDims,
    MoeTiles,
    TileError,
    check_fit,
    check_tiles_fit,
    chip_budget,
    effective,
    vmem_footprint,
)

# The trainer's calibration tile: fused SwiGLU wi forward, embed 4096 x mlp 2048 (tm = 512, our reconstruction).
CAL_TILE = (512, 4096, 2048)


def test_one_bf16_weight_buffer_is_16_mib():
    two = vmem_footprint("swiglu_fwd", CAL_TILE, rhs_buffer_count=2)
    three = vmem_footprint("swiglu_fwd", CAL_TILE, rhs_buffer_count=3)
    assert two["wi gate+up x2"] == 32 * MIB
    assert three["total"] - two["total"] == 16 * MIB


def test_calibration_totals_and_budget():
    assert f"{vmem_footprint('swiglu_fwd', CAL_TILE, rhs_buffer_count=3)['total'] / MIB:.2f}" == "66.95"
    assert f"{vmem_footprint('swiglu_fwd', CAL_TILE, rhs_buffer_count=2)['total'] / MIB:.2f}" == "50.95"
    assert f"{chip_budget('tpu-v7x').usable_bytes / MIB:.2f}" == "57.60"


def test_three_buffers_at_2048_refused_with_the_numbers_two_fit():
    with pytest.raises(TileError, match=r"66\.95 MiB needed, 57\.60 MiB available"):
        check_fit("wi fwd", "swiglu_fwd", CAL_TILE, rhs_buffer_count=3, chip="tpu-v7x")
    fits = check_fit("wi fwd", "swiglu_fwd", CAL_TILE, rhs_buffer_count=2)
    assert fits["total"] < chip_budget("tpu-v7x").usable_bytes


def test_check_tiles_fit_over_the_six_gmms():
    dims = MoeDims(rows=4096, embed=4096, mlp=1024)
    tuned = MoeTiles(wi_tile_fwd_batch_seq=512, wi_tile_fwd_mlp_dim=2048)
    out = check_tiles_fit(tuned, dims, "tpu-v7x", fused_swiglu=True, fused_dswiglu=True, router_grad_from_wo_input=True)
    assert set(out) == {"wi_fwd", "wi_dlhs", "wi_drhs", "wo_fwd", "wo_dlhs", "wo_drhs"}
    assert f"{out['wi_fwd']['total'] / MIB:.2f}" == "50.95"
    with pytest.raises(TileError, match=r"wi fwd tile .* 66\.95 MiB needed, 57\.60 MiB available"):
        check_tiles_fit(dataclasses.replace(tuned, wi_tile_fwd_rhs_buffer_count=3), dims, "tpu-v7x", fused_swiglu=True)
    # The same tile fits a 128 MiB chip.
    check_tiles_fit(dataclasses.replace(tuned, wi_tile_fwd_rhs_buffer_count=3), dims, "tpu-v6e", fused_swiglu=True)


def test_effective_tiles_and_padding_of_narrow_blocks():
    assert effective((256, 4096, 1024), (45, 48, 64)) == (48, 48, 64)
    # A [tm, 1] f32 routing-weight block occupies [tm, 128] lanes.
    with_r = vmem_footprint("dswiglu_bwd", (256, 4096, 1024), route_weights=True)
    assert with_r["r x2"] == 2 * 256 * 128 * 4


def test_refusals():
    with pytest.raises(TileError, match="wi_tile_fwd_mlp_dim=0"):
        MoeTiles(wi_tile_fwd_mlp_dim=0)
    with pytest.raises(ValueError, match="chip='tpu-v9'"):
        chip_budget("tpu-v9")
    with pytest.raises(ValueError, match="kind='conv'"):
        vmem_footprint("conv", CAL_TILE)
    with pytest.raises(TileError, match="tn=2047"):
        vmem_footprint("swiglu_fwd", (512, 4096, 2047))
