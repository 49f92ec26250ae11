"""reference.swiglu / swiglu_bwd / moe_wo_dlhs_dswiglu against float64 NumPy oracles written here, and against jax.vjp.

The oracle's derivative of silu is taken by the complex step (``Im(silu(x + i h)) / h``, exact to float64 rounding),
not from the closed form under test. Inputs are seeded from the case id and rounded through bfloat16.

Tolerances (float32 against the float64 oracle):
- pointwise ops: elementwise ``|err| <= 16 * 2**-23 * magnitude`` (a few ulps of sigmoid/exp and three products), with
  ``magnitude = |expected|``, except for dgate, where ``1 + gate (1 - s)`` cancels near gate = -1.28 and the size of the
  uncancelled terms is used;
- the GMM-based gradient: normwise, rel L2 <= 1e-6 and max abs <= 1e-6 * max |expected|.

Run: ``python -m pytest tests/reference/test_swiglu.py -q``.
"""

import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from nxgates.gates.diff import rel_l2
from nxgates.reference import gmm, moe_wo_dlhs_dswiglu, swiglu, swiglu_bwd

EPS32 = 2.0**-23


def _rng(case_id: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(case_id.encode()))


def _bf16_values(rng: np.random.Generator, shape, scale: float = 1.0) -> np.ndarray:
    """float64 array of values on the bf16 grid."""
    return (scale * rng.standard_normal(shape)).astype(ml_dtypes.bfloat16).astype(np.float64)


def _bf16(x64: np.ndarray) -> jax.Array:
    return jnp.asarray(x64.astype(ml_dtypes.bfloat16))


# ---- float64 oracles ------------------------------------------------------------------------------------------------


def silu_oracle(x):
    return x / (1.0 + np.exp(-x))


def dsilu_oracle(x):
    """d silu / dx by the complex step: no subtraction, so exact to float64 rounding."""
    step = 1e-30
    return np.imag(silu_oracle(x + 1j * step)) / step


def moe_wo_oracle(dy, wo, gate_up, sizes, route_weights):
    """Loops over experts and their rows: g = wo[e] @ dy[row]; d_route = sum(g * h); dh = r g; d[gate | up]."""
    m, f_mlp = gate_up.shape[0], wo.shape[1]
    d_gate_up, d_route = np.zeros((m, 2 * f_mlp)), np.zeros(m)
    row = 0
    for expert, size in enumerate(sizes):
        for _ in range(size):
            gate, up = gate_up[row, :f_mlp], gate_up[row, f_mlp:]
            g = wo[expert] @ dy[row]  # [F, D] @ [D] -> [F]
            r = 1.0 if route_weights is None else route_weights[row]
            d_route[row] = np.sum(g * silu_oracle(gate) * up)
            dh = r * g
            d_gate_up[row, :f_mlp] = dh * up * dsilu_oracle(gate)
            d_gate_up[row, f_mlp:] = dh * silu_oracle(gate)
            row += 1
    return d_gate_up, (None if route_weights is None else d_route)


def _dgate_magnitude(gate, up, dh):
    """|dh * up| * s * (1 + |gate| (1 - s)): the terms' size before ``1 + gate (1 - s)`` cancels (gate ~ -1.28)."""
    s = 1.0 / (1.0 + np.exp(-gate))
    return np.abs(dh * up) * s * (1.0 + np.abs(gate) * (1.0 - s))


def _assert_pointwise_close(actual, expected, what: str, magnitude=None):
    """|actual - expected| <= 16 ulp of ``magnitude`` (default |expected|; the uncancelled size where terms cancel)."""
    actual = np.asarray(actual, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    magnitude = np.abs(expected) if magnitude is None else magnitude
    err = np.abs(actual - expected)
    bad = ~(err <= 16 * EPS32 * magnitude + 1e-37)
    assert not bad.any(), f"{what}: {int(bad.sum())} elements beyond 16 ulp; max err {err.max():.3g}"


def _assert_normwise_close(actual, expected, what: str):
    actual = np.asarray(actual, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert rel_l2(actual, expected) <= 1e-6, f"{what}: rel L2 {rel_l2(actual, expected):.3g} > 1e-6"
    max_abs = float(np.max(np.abs(actual - expected), initial=0.0))
    assert max_abs <= 1e-6 * float(np.max(np.abs(expected), initial=0.0)), f"{what}: max abs {max_abs:.3g}"


# ---- swiglu / swiglu_bwd --------------------------------------------------------------------------------------------

POINTWISE_CASES = [
    pytest.param((3, 7, 60), 1.0, id="B3-T7-F60-gate1-bf16"),
    pytest.param((5, 100), 4.0, id="M5-F100-gate4-bf16"),
    pytest.param((64,), 12.0, id="F64-gate12-bf16"),
]


def _pointwise_inputs(case_id, shape, gate_scale):
    rng = _rng(case_id)
    gate = _bf16_values(rng, shape, gate_scale)
    gate.flat[:7] = [-30.0, -10.0, -1.0, 0.0, 1.0, 10.0, 30.0][: gate.size]  # the tails and the origin, on purpose
    return gate, _bf16_values(rng, shape), _bf16_values(rng, shape)


@pytest.mark.parametrize("shape, gate_scale", POINTWISE_CASES)
def test_swiglu_matches_oracle(shape, gate_scale, request):
    gate, up, _ = _pointwise_inputs(request.node.callspec.id, shape, gate_scale)
    h = swiglu(_bf16(gate), _bf16(up))
    assert h.dtype == jnp.float32
    _assert_pointwise_close(h, silu_oracle(gate) * up, "swiglu")


@pytest.mark.parametrize("shape, gate_scale", POINTWISE_CASES)
def test_swiglu_bwd_matches_vjp_and_oracle(shape, gate_scale, request):
    gate, up, dh = _pointwise_inputs(request.node.callspec.id, shape, gate_scale)
    dgate, dup = swiglu_bwd(_bf16(gate), _bf16(up), _bf16(dh))
    assert dgate.dtype == jnp.float32 and dup.dtype == jnp.float32

    gate32, up32, dh32 = (jnp.asarray(x, jnp.float32) for x in (gate, up, dh))
    _, pullback = jax.vjp(swiglu, gate32, up32)
    dgate_vjp, dup_vjp = pullback(dh32)
    magnitude = _dgate_magnitude(gate, up, dh)
    _assert_pointwise_close(dgate, np.asarray(dgate_vjp, np.float64), "dgate vs jax.vjp(swiglu)", magnitude)
    _assert_pointwise_close(dup, np.asarray(dup_vjp, np.float64), "dup vs jax.vjp(swiglu)")

    _assert_pointwise_close(dgate, dh * up * dsilu_oracle(gate), "dgate vs oracle", magnitude)
    _assert_pointwise_close(dup, dh * silu_oracle(gate), "dup vs oracle")


# ---- moe_wo_dlhs_dswiglu --------------------------------------------------------------------------------------------

# (G, m, F, D, group_sizes, with route weights)
MOE_CASES = [
    (4, 37, 24, 20, (10, 0, 17, 10), True),  # a zero-size group; sum == m
    (4, 37, 24, 20, (10, 0, 17, 10), False),  # route_weights=None
    (3, 45, 60, 32, (0, 13, 20), True),  # sum 33 < m: rows 33.. exactly 0
    (8, 40, 16, 24, (0, 9, 0, 0, 14, 1, 0, 11), True),
]


def _moe_id(case):
    num_groups, m, f_mlp, d_model, sizes, routed = case
    sizes_id = "_".join(map(str, sizes))
    return f"G{num_groups}-m{m}-F{f_mlp}-D{d_model}-s{sizes_id}-{'routed' if routed else 'noroute'}-bf16"


@pytest.mark.parametrize("case", [pytest.param(c, id=_moe_id(c)) for c in MOE_CASES])
def test_moe_wo_dlhs_dswiglu_matches_vjp_and_oracle(case, request):
    num_groups, m, f_mlp, d_model, sizes, routed = case
    rng = _rng(request.node.callspec.id)
    dy = _bf16_values(rng, (m, d_model))
    wo = _bf16_values(rng, (num_groups, f_mlp, d_model), 0.2)
    gate_up = _bf16_values(rng, (m, 2 * f_mlp), 2.0)
    route = rng.uniform(0.05, 1.0, m).astype(ml_dtypes.bfloat16).astype(np.float64) if routed else None
    group_sizes = jnp.asarray(sizes, jnp.int32)

    d_gate_up, d_route = moe_wo_dlhs_dswiglu(
        _bf16(dy), _bf16(wo), _bf16(gate_up), group_sizes, None if route is None else _bf16(route)
    )
    assert d_gate_up.dtype == jnp.float32 and d_gate_up.shape == (m, 2 * f_mlp)

    # jax.vjp of the composed forward y = gmm(swiglu(gate, up) * r, wo).
    def forward(gate_up_mf, route_m):
        gate_mf, up_mf = jnp.split(gate_up_mf, 2, axis=1)
        h_mf = swiglu(gate_mf, up_mf)
        if route_m is not None:
            h_mf = h_mf * route_m[:, None]
        return gmm(h_mf, jnp.asarray(wo, jnp.float32), group_sizes)

    route32 = None if route is None else jnp.asarray(route, jnp.float32)
    _, pullback = jax.vjp(forward, jnp.asarray(gate_up, jnp.float32), route32)
    d_gate_up_vjp, d_route_vjp = pullback(jnp.asarray(dy, jnp.float32))

    expected_gate_up, expected_route = moe_wo_oracle(dy, wo, gate_up, sizes, route)
    _assert_normwise_close(d_gate_up, expected_gate_up, "d_gate_up vs oracle")
    _assert_normwise_close(d_gate_up, np.asarray(d_gate_up_vjp, np.float64), "d_gate_up vs jax.vjp")
    assert np.all(np.asarray(d_gate_up)[sum(sizes) :] == 0.0), "rows past sum(group_sizes) must be exactly 0"
    if route is None:
        assert d_route is None and d_route_vjp is None
    else:
        assert d_route.dtype == jnp.float32 and d_route.shape == (m,)
        _assert_normwise_close(d_route, expected_route, "d_route_weights vs oracle")
        _assert_normwise_close(d_route, np.asarray(d_route_vjp, np.float64), "d_route_weights vs jax.vjp")
        assert np.all(np.asarray(d_route)[sum(sizes) :] == 0.0)


# ---- validation: each error names the argument and its value -------------------------------------------------------

_A, _B = np.zeros((4, 6), np.float32), np.zeros((4, 5), np.float32)
_DY, _WO, _GU = np.zeros((6, 3), np.float32), np.zeros((2, 4, 3), np.float32), np.zeros((6, 8), np.float32)
_GS, _RW = np.array([2, 3], np.int32), np.ones((6,), np.float32)

SWIGLU_ERRORS = [
    pytest.param(lambda: swiglu(_A, _B), r"up\.shape=\(4, 5\).*gate\.shape=\(4, 6\)", id="swiglu-up-shape"),
    pytest.param(lambda: swiglu_bwd(_A, _B, _A), r"up\.shape=\(4, 5\)", id="swiglu_bwd-up-shape"),
    pytest.param(lambda: swiglu_bwd(_A, _A, _B), r"dh\.shape=\(4, 5\).*gate\.shape=\(4, 6\)", id="swiglu_bwd-dh"),
    pytest.param(lambda: moe_wo_dlhs_dswiglu(_DY[0], _WO, _GU, _GS), r"dy.*rank 2.*dy\.shape=\(3,\)", id="moe-dy"),
    pytest.param(lambda: moe_wo_dlhs_dswiglu(_DY, _WO[0], _GU, _GS), r"wo.*rank 3.*wo\.shape=\(4, 3\)", id="moe-wo"),
    pytest.param(lambda: moe_wo_dlhs_dswiglu(_DY, _WO, _GU[None], _GS), r"gate_up.*rank 2.*\(1, 6, 8\)", id="moe-gu"),
    pytest.param(lambda: moe_wo_dlhs_dswiglu(_DY[:, :2], _WO, _GU, _GS),
                 r"wo\.shape=\(2, 4, 3\).*dy\.shape=\(6, 2\).*D", id="moe-D"),
    pytest.param(lambda: moe_wo_dlhs_dswiglu(_DY, _WO, _GU[:, :6], _GS), r"gate_up\.shape=\(6, 6\).*\(6, 8\)",
                 id="moe-2F"),
    pytest.param(lambda: moe_wo_dlhs_dswiglu(_DY, _WO, _GU[:5], _GS), r"gate_up\.shape=\(5, 8\)", id="moe-m"),
    pytest.param(lambda: moe_wo_dlhs_dswiglu(_DY, _WO, _GU, _GS, _RW[:5]), r"route_weights\.shape=\(5,\).*\(6,\)",
                 id="moe-route-shape"),
    pytest.param(lambda: moe_wo_dlhs_dswiglu(_DY, _WO, _GU, _GS.astype(np.int64)), r"group_sizes\.dtype=int64",
                 id="moe-gs-int64"),
    pytest.param(lambda: moe_wo_dlhs_dswiglu(_DY, _WO, _GU, np.array([1, 1, 1], np.int32)),
                 r"group_sizes\.shape=\(3,\).*\(2,\)", id="moe-G"),
    pytest.param(lambda: moe_wo_dlhs_dswiglu(_DY, _WO, _GU, np.array([5, -1], np.int32)), r"group_sizes=\[5, -1\]",
                 id="moe-gs-neg"),
    pytest.param(lambda: moe_wo_dlhs_dswiglu(_DY, _WO, _GU, np.array([5, 2], np.int32)), r"sum\(group_sizes\)=7.*m=6",
                 id="moe-gs-sum"),
]


@pytest.mark.parametrize("call, message", SWIGLU_ERRORS)
def test_validation_error_names_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()
