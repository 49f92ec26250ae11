"""reference.fp8_* against an oracle written here with NumPy and ml_dtypes' own float8_e4m3fn cast.

The convention (docs/design.md): ``scale = amax / 448`` (IEEE float32 division) over the reduction axes, kept as size-1
dims; ``scale = 1`` when amax is 0 or non-finite; ``codes = clip(w / scale, -448, 448)`` (IEEE division) cast to
float8_e4m3fn, round to nearest even. The oracle does that arithmetic in NumPy float32 and the cast with ml_dtypes;
codes and scales are compared bit for bit (uint8 view). Inputs are seeded from the case id and rounded through bfloat16.

Run: ``python -m pytest tests/reference/test_fp8.py -q``.
"""

import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from nxgates.reference import fp8_dequantize, fp8_fake_quant, fp8_quantize, fp8_scale

E4M3 = ml_dtypes.float8_e4m3fn


def _rng(case_id: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(case_id.encode()))


# ---- the oracle -----------------------------------------------------------------------------------------------------


def scale_oracle(w32: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        amax = np.max(np.abs(w32), axis=axes, keepdims=True).astype(np.float32)
        scale = amax / np.float32(448.0)
    return np.where(np.isfinite(amax) & (scale > 0), scale, np.float32(1.0)).astype(np.float32)


def codes_oracle(w32: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """uint8 view of ml_dtypes' cast of clip(w / scale)."""
    with np.errstate(invalid="ignore", over="ignore"):
        scaled = (w32 / scale).astype(np.float32)
    return np.clip(scaled, -448.0, 448.0).astype(E4M3).view(np.uint8)


def _codes_u8(codes) -> np.ndarray:
    codes = np.asarray(codes)
    assert codes.dtype == E4M3, codes.dtype
    return codes.view(np.uint8)


def _weights(case_id: str, shape, axes) -> np.ndarray:
    """bf16-grid float32 weights whose slices span six decades of magnitude."""
    rng = _rng(case_id)
    kept_shape = tuple(1 if d in axes else s for d, s in enumerate(shape))
    slice_scale = 10.0 ** rng.uniform(-3, 3, kept_shape)
    return (rng.standard_normal(shape) * slice_scale).astype(ml_dtypes.bfloat16).astype(np.float32)


# ---- quantize / scale / dequantize ----------------------------------------------------------------------------------

CASES = [
    pytest.param((3, 40, 24), (1,), id="E3-K40-N24-axes1-bf16"),  # expert weights [E, K, N], per (expert, channel)
    pytest.param((2, 3, 16, 8), (2,), id="L2-E3-K16-N8-axes2-bf16"),  # the hoist's stacked [L, E, K, N]
    pytest.param((64, 33), (0, 1), id="K64-N33-axes01-bf16"),  # one scale per tensor
    pytest.param((5, 7, 9), (-1, 0), id="A5-B7-C9-axes-1_0-bf16"),  # negative and unsorted axes
]


@pytest.mark.parametrize("shape, axes", CASES)
def test_scale_and_quantize_bit_exact(shape, axes, request):
    w = _weights(request.node.callspec.id, shape, tuple(a % len(shape) for a in axes))
    axes_norm = tuple(sorted(a % len(shape) for a in axes))
    w_bf16 = jnp.asarray(w.astype(ml_dtypes.bfloat16))

    scale = fp8_scale(w_bf16, axes)
    expected_scale = scale_oracle(w, axes_norm)
    assert scale.dtype == jnp.float32 and scale.shape == expected_scale.shape
    np.testing.assert_array_equal(np.asarray(scale).view(np.uint32), expected_scale.view(np.uint32))

    codes = fp8_quantize(w_bf16, scale)
    expected_codes = codes_oracle(w, expected_scale)
    np.testing.assert_array_equal(_codes_u8(codes), expected_codes)
    # Every slice uses its range: its largest |w| maps to +-448 (code 0x7e / 0xfe).
    assert np.all(np.max(np.abs(np.asarray(codes).astype(np.float32)), axis=axes_norm) == 448.0)

    w_hat = fp8_dequantize(codes, scale)
    expected_w_hat = expected_codes.view(E4M3).astype(np.float32) * expected_scale
    assert w_hat.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(w_hat), expected_w_hat)
    w_hat_bf16 = fp8_dequantize(codes, scale, dtype=jnp.bfloat16)
    assert w_hat_bf16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(w_hat_bf16), expected_w_hat.astype(ml_dtypes.bfloat16))


def test_values_at_and_beyond_448_saturate():
    w = np.array([448.0, -448.0, 449.0, 463.9, 464.0, 480.0, 1e6, -3e38, np.inf, -np.inf, 447.0, 440.0, 424.0, 432.0],
                 np.float32)
    codes = fp8_quantize(jnp.asarray(w), jnp.ones((1,), jnp.float32))
    np.testing.assert_array_equal(_codes_u8(codes), codes_oracle(w, np.ones((1,), np.float32)))
    decoded = np.asarray(codes).astype(np.float32)
    # Independent of ml_dtypes: the e4m3fn grid near the top is 384, 416, 448 (step 32); ties go to the even mantissa.
    np.testing.assert_array_equal(
        decoded, [448, -448, 448, 448, 448, 448, 448, -448, 448, -448, 448, 448, 416, 448]
    )


def test_subnormals_and_ties_bit_exact():
    # Multiples of 2**-12 through the subnormal range (2**-9 .. 7 * 2**-9) into the first normal binades.
    w = (np.arange(-300, 301) * 2.0**-12).astype(np.float32)
    codes = fp8_quantize(jnp.asarray(w), jnp.ones((1,), jnp.float32))
    np.testing.assert_array_equal(_codes_u8(codes), codes_oracle(w, np.ones((1,), np.float32)))
    decoded = dict(zip(w.tolist(), np.asarray(codes).astype(np.float32).tolist(), strict=True))
    # Hand-checked: half the smallest subnormal ties to 0; 1.5 and 2.5 subnormal steps tie to the even 2 steps.
    assert decoded[2.0**-10] == 0.0
    assert decoded[3 * 2.0**-10] == 2 * 2.0**-9
    assert decoded[5 * 2.0**-10] == 2 * 2.0**-9
    assert decoded[7 * 2.0**-10] == 4 * 2.0**-9
    assert decoded[2.0**-9] == 2.0**-9


def test_every_fp8_value_round_trips():
    every_code = np.arange(256, dtype=np.uint8).view(E4M3)
    finite = every_code[np.isfinite(every_code.astype(np.float32))]
    codes = fp8_quantize(jnp.asarray(finite.astype(np.float32)), jnp.ones((1,), jnp.float32))
    np.testing.assert_array_equal(_codes_u8(codes), finite.view(np.uint8))


def test_zero_and_non_finite_amax_give_scale_one():
    w = _weights("E4-K8-N3-special-bf16", (4, 8, 3), (1,))
    w[0, :, 0] = 0.0  # amax == 0
    w[1, 3, 1] = np.inf  # amax == inf
    w[2, 5, 2] = np.nan  # amax == nan
    w[3, :, 1] = 1e-44  # amax / 448 underflows to 0
    scale = np.asarray(fp8_scale(jnp.asarray(w), (1,)))
    expected_scale = scale_oracle(w, (1,))
    np.testing.assert_array_equal(scale.view(np.uint32), expected_scale.view(np.uint32))
    assert scale[0, 0, 0] == 1.0 and scale[1, 0, 1] == 1.0 and scale[2, 0, 2] == 1.0 and scale[3, 0, 1] == 1.0
    assert np.sum(scale == 1.0) == 4, "only the four special slices get scale 1"

    codes = fp8_quantize(jnp.asarray(w), jnp.asarray(scale))
    finite = np.isfinite(w)
    np.testing.assert_array_equal(_codes_u8(codes)[finite], codes_oracle(w, expected_scale)[finite])
    decoded = np.asarray(codes).astype(np.float32)
    assert np.all(decoded[0, :, 0] == 0.0)
    assert decoded[1, 3, 1] == 448.0 and np.isnan(decoded[2, 5, 2])

    # fake quant follows the same convention: inf saturates to 448 * 1, NaN stays NaN, the rest is codes * scale.
    w_hat = np.asarray(fp8_fake_quant(jnp.asarray(w), (1,)))
    np.testing.assert_array_equal(w_hat, decoded * expected_scale)


# ---- fake quant -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape, axes", CASES)
def test_fake_quant_forward_bit_exact(shape, axes, request):
    w = _weights(request.node.callspec.id, shape, tuple(a % len(shape) for a in axes))
    axes_norm = tuple(sorted(a % len(shape) for a in axes))
    expected_scale = scale_oracle(w, axes_norm)
    expected = codes_oracle(w, expected_scale).view(E4M3).astype(np.float32) * expected_scale
    for name, fn in (("eager", fp8_fake_quant), ("jit", jax.jit(fp8_fake_quant, static_argnums=1))):
        w_hat = fn(jnp.asarray(w), axes)
        assert w_hat.dtype == jnp.float32, name
        np.testing.assert_array_equal(np.asarray(w_hat), expected, err_msg=name)
    assert not np.array_equal(expected, w), "the case must actually round"


def _barrier_input_dtypes(jaxpr) -> list[list]:
    """The input dtypes of every optimization_barrier in ``jaxpr`` and the jaxprs nested in its equations' params."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "optimization_barrier":
            found.append([v.aval.dtype for v in eqn.invars])
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)  # ClosedJaxpr -> Jaxpr
            if hasattr(inner, "eqns"):
                found += _barrier_input_dtypes(inner)
    return found


def test_fake_quant_round_trip_is_behind_an_optimization_barrier():
    closed = jax.make_jaxpr(lambda w: fp8_fake_quant(w, (0,)))(jnp.ones((4, 3), jnp.float32))
    barriers = _barrier_input_dtypes(closed.jaxpr)
    assert any(jnp.float8_e4m3fn in dtypes for dtypes in barriers), f"no barrier on the fp8 codes: {barriers}"


@pytest.mark.parametrize("shape, axes", CASES[:2])
def test_fake_quant_gradient_is_exactly_the_identity(shape, axes, request):
    case_id = request.node.callspec.id
    w = _weights(case_id, shape, axes)
    cotangent = _rng(case_id + "-cotangent").standard_normal(shape).astype(np.float32)
    _, pullback = jax.vjp(lambda x: fp8_fake_quant(x, axes), jnp.asarray(w))
    (dw,) = pullback(jnp.asarray(cotangent))
    # Bit for bit, including at each slice's amax element (where a gradient through the scale would land).
    np.testing.assert_array_equal(np.asarray(dw).view(np.uint32), cotangent.view(np.uint32))

    # Nothing flows through the scale: a loss that reads only the scale-determining element has gradient one-hot.
    amax_index = np.unravel_index(np.argmax(np.abs(w)), w.shape)
    grad = jax.grad(lambda x: fp8_fake_quant(x, axes)[amax_index])(jnp.asarray(w))
    one_hot = np.zeros(shape, np.float32)
    one_hot[amax_index] = 1.0
    np.testing.assert_array_equal(np.asarray(grad), one_hot)


# ---- validation: each error names the argument and its value -------------------------------------------------------

_W = np.ones((2, 3, 4), np.float32)
_S = np.ones((2, 1, 4), np.float32)
_C = np.ones((2, 3, 4), np.float32).astype(E4M3)

FP8_ERRORS = [
    pytest.param(lambda: fp8_scale(_W, (3,)), r"axes=\(3,\).*w\.ndim=3", id="scale-axes-range"),
    pytest.param(lambda: fp8_scale(_W, -4), r"axes=-4.*w\.ndim=3", id="scale-axes-negative-range"),
    pytest.param(lambda: fp8_scale(_W, (1, -2)), r"axes=\(1, -2\).*repeats", id="scale-axes-repeat"),
    pytest.param(lambda: fp8_scale(_W, ("1",)), r"axes=\('1',\).*int", id="scale-axes-str"),
    pytest.param(lambda: fp8_scale(_W.astype(np.int32), (1,)), r"w\.dtype=int32", id="scale-w-int"),
    pytest.param(lambda: fp8_quantize(_W, _S[0]), r"scale\.shape=\(1, 4\).*w\.shape=\(2, 3, 4\)", id="quant-rank"),
    pytest.param(lambda: fp8_quantize(_W, np.ones((2, 2, 4), np.float32)), r"scale\.shape=\(2, 2, 4\)",
                 id="quant-scale-shape"),
    pytest.param(lambda: fp8_quantize(_W.astype(np.int8), _S), r"w\.dtype=int8", id="quant-w-int"),
    pytest.param(lambda: fp8_dequantize(_W, _S), r"codes\.dtype=float32", id="dequant-codes-dtype"),
    pytest.param(lambda: fp8_dequantize(_C, _S[:, :, :2]), r"scale\.shape=\(2, 1, 2\).*codes\.shape=\(2, 3, 4\)",
                 id="dequant-scale-shape"),
    pytest.param(lambda: fp8_fake_quant(_W, (5,)), r"axes=\(5,\).*w\.ndim=3", id="fake-quant-axes-range"),
    pytest.param(lambda: fp8_fake_quant(_W.astype(np.int32), (1,)), r"w\.dtype=int32", id="fake-quant-w-int"),
]


@pytest.mark.parametrize("call, message", FP8_ERRORS)
def test_validation_error_names_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()
