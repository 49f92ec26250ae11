"""Pallas ragged GMM / tgmm (``kernels/gmm``) against ``reference.gmm`` / ``reference.tgmm``.

Group metadata against a plain Python enumeration; forward, dlhs and drhs over zero-size groups, partial tiles (no dim
a multiple of its tile), ``sum(group_sizes) < m``, m tiles straddling group boundaries, several k tiles; float32 inputs
(tight) and bfloat16 (one bf16 rounding); one case under the TPU interpreter with NaN-filled uninitialized memory;
validation errors. Run: ``python -m pytest tests/kernels/test_gmm.py -q``.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from nxgates import reference as R
from nxgates.gates.diff import rel_l2
from nxgates.kernels.gmm import gmm, tgmm
from nxgates.kernels.gmm.kernel import make_group_metadata

# (m, k, n, group_sizes, tiles): every case has an empty group and a sum < m (or == m) and partial tiles.
CASES = {
    "M50-K24-N40-G5-tiles8x16x16": (50, 24, 40, (7, 0, 20, 3, 9), (8, 16, 16)),
    "M37-K40-N24-G4-tiles16x16x8-sum-eq-m": (37, 40, 24, (0, 16, 21, 0), (16, 16, 8)),
}


def _inputs(case_id, m, k, n, num_groups, dtype):
    rng = np.random.default_rng(zlib.crc32(case_id.encode()))
    # Rounded through bf16 so every side sees the same values whatever the dtype.
    lhs = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16).astype(np.float32)
    rhs = rng.standard_normal((num_groups, k, n)).astype(ml_dtypes.bfloat16).astype(np.float32)
    dout = rng.standard_normal((m, n)).astype(ml_dtypes.bfloat16).astype(np.float32)
    # Rows past sum(group_sizes) hold garbage: they must not reach any output or gradient.
    return jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype), jnp.asarray(dout, dtype)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def _fwd_and_grads(lhs, rhs, group_sizes, dout, *, tiles, interpret):
    out, vjp = jax.vjp(lambda a, b: gmm(a, b, group_sizes, tiles=tiles, interpret=interpret), lhs, rhs)
    dlhs, drhs = vjp(dout)
    return out, dlhs, drhs


def _reference(lhs, rhs, group_sizes, dout):
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    out, vjp = jax.vjp(lambda a, b: R.gmm(a, b, group_sizes), f32(lhs), f32(rhs))
    return (out, *vjp(f32(dout)))


# --------------------------------------------------------------------------------------------------- group metadata


def _expected_visits(sizes, num_rows, tm, for_tgmm):
    """Plain enumeration: (m tile, segment) for every tile a segment touches, in row order."""
    visits, start = [], 0
    segments = list(sizes) + ([] if for_tgmm else [num_rows - sum(sizes)])
    for seg, size in enumerate(segments):
        if size == 0:
            if for_tgmm:
                visits.append((min(start // tm, num_rows // tm - 1), seg))
            continue
        visits += [(t, seg) for t in range(start // tm, (start + size - 1) // tm + 1)]
        start += size
    return visits


@pytest.mark.parametrize("for_tgmm", [False, True], ids=["gmm", "tgmm"])
@pytest.mark.parametrize(
    "sizes,num_rows,tm",
    [((7, 0, 20, 3, 9), 56, 8), ((8, 8, 0, 16), 32, 8), ((0, 0, 0), 16, 8), ((5,), 40, 8), ((40, 0), 40, 8)],
    ids=["straddle-empty-tail", "on-tile-edges", "all-empty", "one-group-tail", "full-then-empty"],
)
def test_group_metadata_matches_enumeration(sizes, num_rows, tm, for_tgmm):
    meta = make_group_metadata(jnp.asarray(sizes, jnp.int32), num_rows=num_rows, tm=tm, for_tgmm=for_tgmm)
    expected = _expected_visits(sizes, num_rows, tm, for_tgmm)
    n = int(meta.num_visits[0])
    got = list(zip(np.asarray(meta.visit_tile)[:n].tolist(), np.asarray(meta.visit_seg)[:n].tolist(), strict=True))
    assert got == expected
    assert meta.max_visits >= n
    # Padding visits repeat the last real one (no new block is fetched or written).
    assert np.all(np.asarray(meta.visit_tile)[n:] == expected[-1][0])
    assert np.all(np.asarray(meta.visit_seg)[n:] == expected[-1][1])
    if not for_tgmm:  # the GMM segments tile [0, num_rows) exactly: every output row is written once
        covered = np.zeros(num_rows, int)
        for tile, seg in got:
            rows = np.arange(tile * tm, (tile + 1) * tm)
            covered[rows] += (rows >= int(meta.seg_start[seg])) & (rows < int(meta.seg_end[seg]))
        assert np.all(covered == 1)


# ------------------------------------------------------------------------------------------------ kernels vs refs


@pytest.mark.parametrize("case_id", list(CASES))
def test_gmm_fwd_dlhs_drhs_f32(case_id):
    m, k, n, sizes, tiles = CASES[case_id]
    group_sizes = jnp.asarray(sizes, jnp.int32)
    lhs, rhs, dout = _inputs(case_id, m, k, n, len(sizes), jnp.float32)
    got = _fwd_and_grads(lhs, rhs, group_sizes, dout, tiles=tiles, interpret=True)
    want = _reference(lhs, rhs, group_sizes, dout)
    for name, a, b in zip(("fwd", "dlhs", "drhs"), got, want, strict=True):
        assert a.shape == b.shape, name
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5, err_msg=name)
    total = sum(sizes)
    assert np.all(np.asarray(got[0])[total:] == 0.0)  # rows past sum(group_sizes): exactly 0
    assert np.all(np.asarray(got[1])[total:] == 0.0)
    for g, size in enumerate(sizes):  # empty groups: exactly 0 weight gradient
        if size == 0:
            assert np.all(np.asarray(got[2])[g] == 0.0)


def test_gmm_bf16_one_rounding():
    case_id = "M50-K24-N40-G5-tiles8x16x16"
    m, k, n, sizes, tiles = CASES[case_id]
    group_sizes = jnp.asarray(sizes, jnp.int32)
    lhs, rhs, dout = _inputs(case_id, m, k, n, len(sizes), jnp.bfloat16)
    got = _fwd_and_grads(lhs, rhs, group_sizes, dout, tiles=tiles, interpret=True)
    want = _reference(lhs, rhs, group_sizes, dout)
    for name, a, b in zip(("fwd", "dlhs", "drhs"), got, want, strict=True):
        assert a.dtype == jnp.bfloat16, name
        # One bf16 rounding of an f32-accumulated result: rel L2 ~1.6e-3 (bf16 spacing 2^-7).
        assert rel_l2(a, b) < 4e-3, name
    assert np.all(np.asarray(got[0], np.float32)[sum(sizes):] == 0.0)


def test_tgmm_direct_out_dtype_and_empty_groups():
    case_id = "M37-K40-N24-G4-tiles16x16x8-sum-eq-m"
    m, k, n, sizes, tiles = CASES[case_id]
    group_sizes = jnp.asarray(sizes, jnp.int32)
    lhs, _, rhs_mn = _inputs(case_id, m, k, n, len(sizes), jnp.float32)
    out = tgmm(lhs, rhs_mn, group_sizes, tiles=tiles, out_dtype=jnp.float32, interpret=True)
    assert out.shape == (len(sizes), k, n) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np.asarray(R.tgmm(lhs, rhs_mn, group_sizes)), rtol=2e-5, atol=2e-5)
    assert np.all(np.asarray(out)[0] == 0.0) and np.all(np.asarray(out)[3] == 0.0)


def test_gmm_tpu_interpreter_nan_uninitialized():
    """TPU semantics with NaN-filled uninitialized VMEM/outputs: every output row must be written, none left NaN."""
    case_id = "M24-K16-N16-G3-nan-interpreter"
    sizes, tiles = (5, 0, 12), (8, 16, 16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    lhs, rhs, dout = _inputs(case_id, 24, 16, 16, 3, jnp.float32)
    params = pltpu.InterpretParams(uninitialized_memory="nan")
    out = gmm(lhs, rhs, group_sizes, tiles=tiles, interpret=params)
    np.testing.assert_allclose(np.asarray(out), np.asarray(R.gmm(lhs, rhs, group_sizes)), rtol=2e-5, atol=2e-5)
    dw = tgmm(lhs, dout, group_sizes, tiles=tiles, interpret=params)
    np.testing.assert_allclose(np.asarray(dw), np.asarray(R.tgmm(lhs, dout, group_sizes)), rtol=2e-5, atol=2e-5)


# -------------------------------------------------------------------------------------------------------- validation


def test_validation_errors_name_the_argument():
    lhs = jnp.zeros((8, 4), jnp.float32)
    rhs = jnp.zeros((2, 4, 4), jnp.float32)
    ok = jnp.asarray([3, 4], jnp.int32)
    with pytest.raises(ValueError, match="sum\\(group_sizes\\)=9"):
        gmm(lhs, rhs, jnp.asarray([5, 4], jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="group_sizes.*negative"):
        gmm(lhs, rhs, jnp.asarray([-1, 4], jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="group_sizes.dtype"):
        gmm(lhs, rhs, jnp.asarray([3, 4], jnp.int64 if jax.config.jax_enable_x64 else jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="lhs must have rank 2"):
        gmm(lhs[None], rhs, ok, interpret=True)
    with pytest.raises(ValueError, match="disagree on k"):
        gmm(lhs, jnp.zeros((2, 5, 4), jnp.float32), ok, interpret=True)
    with pytest.raises(ValueError, match="tiles="):
        gmm(lhs, rhs, ok, tiles=(8, 0, 8), interpret=True)
    with pytest.raises(ValueError, match="rhs.dtype"):
        gmm(lhs, rhs.astype(jnp.bfloat16), ok, interpret=True)
    with pytest.raises(NotImplementedError, match="lhs.dtype=float16"):
        gmm(lhs.astype(jnp.float16), rhs.astype(jnp.float16), ok, interpret=True)
    with pytest.raises(ValueError, match="disagree on m"):
        tgmm(lhs, jnp.zeros((7, 4), jnp.float32), ok, interpret=True)
