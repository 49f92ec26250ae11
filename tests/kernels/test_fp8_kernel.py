"""``kernels.fp8.fp8_absmax_quantize`` against ``reference.fp8_scale`` / ``fp8_quantize``: bit-identical.

Channel magnitudes over 2^-140 .. 2^8 (subnormal scales, where ``amax / 448`` underflows), an all-zero channel
(scale 1), +-inf (non-finite amax: scale 1, codes saturate), N not a multiple of the tile, bf16 and f32 inputs.
NaN inputs are left out: the reference's ``jnp.max`` over a non-minor axis drops NaN on XLA:CPU while a minor-axis
reduction propagates it, so NaN handling is backend-defined (reported to the lead).
Run: ``python -m pytest tests/kernels/test_fp8_kernel.py -q``.
"""

from __future__ import annotations

import zlib

import jax.numpy as jnp
import numpy as np
import pytest

from nxgates import reference as R
from nxgates.kernels.fp8 import fp8_absmax_quantize


def _weights(case_id, shape, dtype):
    rng = np.random.default_rng(zlib.crc32(case_id.encode()))
    w = rng.standard_normal(shape) * np.exp2(rng.uniform(-140, 8, (1, shape[1], 1, shape[3])))
    w[0, 0, :, 1] = 0.0
    w[-1, -1, 3, 2] = np.inf
    w[-1, 0, 1, 4] = -np.inf
    return jnp.asarray(w.astype(np.float32), dtype)


@pytest.mark.parametrize(
    "case_id,shape,dtype,tn",
    [
        ("L2-E3-K40-N20-tn8-f32", (2, 3, 40, 20), jnp.float32, 8),
        ("L1-E2-K64-N12-bf16", (1, 2, 64, 12), jnp.bfloat16, None),
    ],
    ids=["L2-E3-K40-N20-tn8-f32", "L1-E2-K64-N12-bf16"],
)
def test_bit_identical_to_reference(case_id, shape, dtype, tn):
    w = _weights(case_id, shape, dtype)
    codes, scale = fp8_absmax_quantize(w, tn=tn, interpret=True)
    scale_ref = R.fp8_scale(w, axes=(2,))
    codes_ref = R.fp8_quantize(w, scale_ref)
    assert codes.shape == shape and codes.dtype == jnp.float8_e4m3fn
    assert scale.shape == (shape[0], shape[1], 1, shape[3]) and scale.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(scale).view(np.uint32), np.asarray(scale_ref).view(np.uint32))
    np.testing.assert_array_equal(np.asarray(codes).view(np.uint8), np.asarray(codes_ref).view(np.uint8))
    assert float(scale[0, 0, 0, 1]) == 1.0  # zero channel


def test_validation():
    with pytest.raises(ValueError, match="w must have rank 4"):
        fp8_absmax_quantize(jnp.zeros((3, 4, 5)), interpret=True)
    with pytest.raises(ValueError, match="tn=0"):
        fp8_absmax_quantize(jnp.zeros((1, 1, 4, 4)), tn=0, interpret=True)
    with pytest.raises(ValueError, match="w.dtype=int32"):
        fp8_absmax_quantize(jnp.zeros((1, 1, 4, 4), jnp.int32), interpret=True)
