"""reference.gmm / reference.tgmm against a float64 NumPy loop oracle written here.

Inputs are built in NumPy from a seed derived from the case id and rounded through bfloat16, so the reference (given
bf16 arrays) and the oracle (given the same values in float64) see identical numbers. Products of bf16 values are exact
in float32, so the reference's only error is float32 summation, bounded elementwise by
``k * 2**-23 * (|lhs| @ |rhs|)`` (twice the textbook ``k * u`` bound): an element that must be 0 must be exactly 0.

Run: ``python -m pytest tests/reference/test_gmm.py -q``.
"""

import itertools
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from nxgates.reference import gmm, tgmm

EPS32 = 2.0**-23


def _rng(case_id: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(case_id.encode()))


def _bf16_values(rng: np.random.Generator, shape) -> np.ndarray:
    """float64 array of values on the bf16 grid."""
    return rng.standard_normal(shape).astype(ml_dtypes.bfloat16).astype(np.float64)


def _bf16(x64: np.ndarray) -> jax.Array:
    return jnp.asarray(x64.astype(ml_dtypes.bfloat16))


# ---- the oracle: plain loops over groups and rows, float64 ---------------------------------------------------------


def gmm_oracle(lhs, rhs, sizes):
    """lhs [m, k], rhs [G, k, n] -> [m, n]; rows past sum(sizes) stay 0. Returns (out, |lhs| @ |rhs| per row)."""
    m, n = lhs.shape[0], rhs.shape[2]
    out, abs_prod = np.zeros((m, n)), np.zeros((m, n))
    row = 0
    for group, size in enumerate(sizes):
        for _ in range(size):
            out[row] = lhs[row] @ rhs[group]
            abs_prod[row] = np.abs(lhs[row]) @ np.abs(rhs[group])
            row += 1
    return out, abs_prod


def tgmm_oracle(lhs, rhs, sizes):
    """lhs [m, k], rhs [m, n] -> [G, k, n]: per group, the sum over its rows of outer(lhs[row], rhs[row])."""
    k, n = lhs.shape[1], rhs.shape[1]
    out, abs_prod = np.zeros((len(sizes), k, n)), np.zeros((len(sizes), k, n))
    row = 0
    for group, size in enumerate(sizes):
        for _ in range(size):
            out[group] += np.outer(lhs[row], rhs[row])
            abs_prod[group] += np.outer(np.abs(lhs[row]), np.abs(rhs[row]))
            row += 1
    return out, abs_prod


def _assert_within_f32_bound(actual, expected, abs_prod, depth: int, what: str):
    """|actual - expected| <= depth * 2**-23 * abs_prod elementwise (0 where the oracle's terms are all 0)."""
    actual = np.asarray(actual, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err = np.abs(actual - expected)
    bound = depth * EPS32 * abs_prod
    bad = ~(err <= bound)
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} elements beyond the float32 bound; worst at "
        f"{np.unravel_index(np.argmax(np.where(bad, err, -1)), err.shape)}: err={err.max():.3g}"
    )


# ---- cases ----------------------------------------------------------------------------------------------------------

# (G, m, k, n, group_sizes)
CASES = [
    (1, 8, 16, 8, (8,)),
    (4, 37, 24, 20, (10, 0, 17, 10)),  # a zero-size group; sum == m
    (3, 45, 60, 100, (0, 13, 20)),  # leading empty group; sum 33 < m: rows 33.. are exactly 0
    (8, 64, 32, 48, (0, 9, 0, 0, 30, 1, 0, 20)),  # several empty groups, a group of one row; sum 60 < m
    (4, 17, 8, 12, (0, 0, 0, 0)),  # every group empty: all zeros
]


def _case_id(case) -> str:
    num_groups, m, k, n, sizes = case
    return f"G{num_groups}-m{m}-k{k}-n{n}-s{'_'.join(map(str, sizes))}-bf16"


def _inputs(case_id: str, m: int, k: int, n: int, num_groups: int):
    rng = _rng(case_id)
    return _bf16_values(rng, (m, k)), _bf16_values(rng, (num_groups, k, n)), _bf16_values(rng, (m, n))


def _patterns_g4():
    """Every empty / non-empty pattern of 4 groups; non-empty groups get 1..5 rows; m = 23 > any sum."""
    for pattern in itertools.product((0, 1), repeat=4):
        pattern_id = "".join(map(str, pattern))
        rng = _rng(pattern_id)
        sizes = tuple(int(rng.integers(1, 6)) if nonempty else 0 for nonempty in pattern)
        yield pytest.param((4, 23, 8, 12, sizes), id=f"G4-m23-k8-n12-pattern{pattern_id}-bf16")


ALL_CASES = [pytest.param(c, id=_case_id(c)) for c in CASES] + list(_patterns_g4())


@pytest.mark.parametrize("case", ALL_CASES)
def test_gmm_and_tgmm_match_oracle(case, request):
    num_groups, m, k, n, sizes = case
    lhs, rhs, rhs_t = _inputs(request.node.callspec.id, m, k, n, num_groups)
    group_sizes = jnp.asarray(sizes, jnp.int32)

    out = gmm(_bf16(lhs), _bf16(rhs), group_sizes)
    assert out.dtype == jnp.float32 and out.shape == (m, n)
    expected, abs_prod = gmm_oracle(lhs, rhs, sizes)
    _assert_within_f32_bound(out, expected, abs_prod, k, "gmm")
    total = sum(sizes)
    assert np.all(np.asarray(out)[total:] == 0.0), "gmm rows past sum(group_sizes) must be exactly 0"

    out_t = tgmm(_bf16(lhs), _bf16(rhs_t), group_sizes)
    assert out_t.dtype == jnp.float32 and out_t.shape == (num_groups, k, n)
    expected_t, abs_prod_t = tgmm_oracle(lhs, rhs_t, sizes)
    _assert_within_f32_bound(out_t, expected_t, abs_prod_t, max(sizes + (1,)), "tgmm")
    for group, size in enumerate(sizes):
        if size == 0:
            assert np.all(np.asarray(out_t)[group] == 0.0), f"tgmm of empty group {group} must be exactly 0"
        else:
            assert np.any(np.asarray(out_t)[group] != 0.0), f"tgmm of non-empty group {group} is all 0"


VJP_CASES = [pytest.param(c, id=_case_id(c)) for c in CASES[1:4]]


@pytest.mark.parametrize("case", VJP_CASES)
def test_gmm_vjp_is_gmm_of_rhs_transposed_and_tgmm(case, request):
    num_groups, m, k, n, sizes = case
    lhs, rhs, dout = _inputs(request.node.callspec.id, m, k, n, num_groups)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    lhs32, rhs32, dout32 = (jnp.asarray(x, jnp.float32) for x in (lhs, rhs, dout))

    _, pullback = jax.vjp(lambda a, b: gmm(a, b, group_sizes), lhs32, rhs32)
    dlhs, drhs = pullback(dout32)

    # The backward identities, through the references themselves.
    dlhs_gmm = gmm(dout32, jnp.swapaxes(rhs32, 1, 2), group_sizes)  # [G, k, n] -> [G, n, k]
    drhs_tgmm = tgmm(lhs32, dout32, group_sizes)
    np.testing.assert_allclose(np.asarray(dlhs), np.asarray(dlhs_gmm), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(drhs), np.asarray(drhs_tgmm), rtol=1e-6, atol=1e-6)

    # And against the float64 oracle: dlhs = gmm(dout, rhs^T), drhs = tgmm(lhs, dout).
    expected_dlhs, abs_dlhs = gmm_oracle(dout, np.swapaxes(rhs, 1, 2), sizes)
    expected_drhs, abs_drhs = tgmm_oracle(lhs, dout, sizes)
    _assert_within_f32_bound(dlhs, expected_dlhs, abs_dlhs, n, "dlhs")
    _assert_within_f32_bound(drhs, expected_drhs, abs_drhs, max(sizes), "drhs")
    assert np.all(np.asarray(dlhs)[sum(sizes):] == 0.0), "dlhs rows past sum(group_sizes) must be exactly 0"


def test_gmm_jits_with_traced_group_sizes():
    num_groups, m, k, n = 4, 37, 24, 20
    lhs, rhs, _ = _inputs("G4-m37-k24-n20-jit-bf16", m, k, n, num_groups)
    traces = []

    @jax.jit
    def gmm_jit(a, b, group_sizes):
        traces.append(group_sizes)
        return gmm(a, b, group_sizes)

    for sizes in ((10, 0, 17, 10), (0, 5, 5, 20)):
        out = gmm_jit(_bf16(lhs), _bf16(rhs), jnp.asarray(sizes, jnp.int32))
        expected, abs_prod = gmm_oracle(lhs, rhs, sizes)
        _assert_within_f32_bound(out, expected, abs_prod, k, f"jit gmm sizes={sizes}")
    assert len(traces) == 1 and isinstance(traces[0], jax.core.Tracer), "group_sizes must be traced, traced once"


def test_rows_outside_groups_do_not_leak_non_finite_values():
    num_groups, m, k, n, sizes = 3, 20, 8, 12, (4, 0, 9)
    lhs, rhs, rhs_t = _inputs("G3-m20-k8-n12-nan-bf16", m, k, n, num_groups)
    total = sum(sizes)
    lhs[total:] = np.nan
    lhs[total + 1 :] = np.inf
    rhs_t[total:] = -np.inf
    group_sizes = jnp.asarray(sizes, jnp.int32)
    lhs32, rhs32 = jnp.asarray(lhs, jnp.float32), jnp.asarray(rhs, jnp.float32)

    out, pullback = jax.vjp(lambda a, b: gmm(a, b, group_sizes), lhs32, rhs32)
    dlhs, drhs = pullback(jnp.ones_like(out))
    expected, abs_prod = gmm_oracle(lhs, rhs, sizes)  # the oracle never reads rows past sum(sizes)
    _assert_within_f32_bound(out, expected, abs_prod, k, "gmm with NaN/inf rows past the groups")
    assert np.all(np.isfinite(np.asarray(drhs))), "drhs picked up NaN/inf from rows outside every group"
    assert np.all(np.asarray(dlhs)[total:] == 0.0)
    out_t = tgmm(lhs32, jnp.asarray(rhs_t, jnp.float32), group_sizes)
    expected_t, abs_prod_t = tgmm_oracle(lhs, rhs_t, sizes)
    _assert_within_f32_bound(out_t, expected_t, abs_prod_t, max(sizes), "tgmm with NaN/inf rows past the groups")


# ---- validation: each error names the argument and its value -------------------------------------------------------

_L, _R, _RT = np.zeros((6, 4), np.float32), np.zeros((2, 4, 3), np.float32), np.zeros((6, 3), np.float32)
_GS = np.array([2, 3], np.int32)

GMM_ERRORS = [
    pytest.param(lambda: gmm(_L[None], _R, _GS), r"lhs.*rank 2.*lhs\.shape=\(1, 6, 4\)", id="gmm-lhs-rank3"),
    pytest.param(lambda: gmm(_L, _R[0], _GS), r"rhs.*rank 3.*rhs\.shape=\(4, 3\)", id="gmm-rhs-rank2"),
    pytest.param(lambda: gmm(_L.astype(np.int32), _R, _GS), r"lhs\.dtype=int32", id="gmm-lhs-int"),
    pytest.param(lambda: gmm(_L[:, :3], _R, _GS), r"lhs\.shape=\(6, 3\).*rhs\.shape=\(2, 4, 3\).*k", id="gmm-k"),
    pytest.param(lambda: gmm(_L, _R, _GS[None]), r"group_sizes.*rank 1.*\(1, 2\)", id="gmm-gs-rank2"),
    pytest.param(lambda: gmm(_L, _R, _GS.astype(np.int64)), r"group_sizes\.dtype=int64", id="gmm-gs-int64"),
    pytest.param(lambda: gmm(_L, _R, _GS.astype(np.float32)), r"group_sizes\.dtype=float32", id="gmm-gs-float"),
    pytest.param(lambda: gmm(_L, _R, [2, 3]), r"group_sizes=\[2, 3\].*list", id="gmm-gs-list"),
    pytest.param(lambda: gmm(_L, _R, np.array([1, 2, 3], np.int32)), r"group_sizes\.shape=\(3,\).*\(2,\)", id="gmm-G"),
    pytest.param(lambda: gmm(_L, _R, np.array([3, -1], np.int32)), r"group_sizes=\[3, -1\].*negative", id="gmm-neg"),
    pytest.param(lambda: gmm(_L, _R, np.array([4, 3], np.int32)), r"sum\(group_sizes\)=7.*m=6", id="gmm-sum-gt-m"),
    pytest.param(lambda: tgmm(_L[0], _RT, _GS), r"lhs.*rank 2.*lhs\.shape=\(4,\)", id="tgmm-lhs-rank1"),
    pytest.param(lambda: tgmm(_L, _R, _GS), r"rhs.*rank 2.*rhs\.shape=\(2, 4, 3\)", id="tgmm-rhs-rank3"),
    pytest.param(lambda: tgmm(_L, _RT[:5], _GS), r"lhs\.shape=\(6, 4\).*rhs\.shape=\(5, 3\).*m", id="tgmm-m"),
    pytest.param(lambda: tgmm(_L, _RT, _GS.astype(np.uint32)), r"group_sizes\.dtype=uint32", id="tgmm-gs-uint32"),
    pytest.param(lambda: tgmm(_L, _RT, np.array([0, -2], np.int32)), r"group_sizes=\[0, -2\]", id="tgmm-neg"),
    pytest.param(lambda: tgmm(_L, _RT, np.array([6, 1], np.int32)), r"sum\(group_sizes\)=7.*m=6", id="tgmm-sum-gt-m"),
]


@pytest.mark.parametrize("call, message", GMM_ERRORS)
def test_validation_error_names_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()
