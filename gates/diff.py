"""Float64 difference summaries between an array under test and its expected value.

Every metric the reports print comes from here, computed in float64 on the host so that the metric itself adds no
rounding of its own:

- ``rel_l2(a, b) = ||a - b|| / ||b||`` (0 when both are all-zero, inf when only ``b`` is);
- ``max_abs``: the largest ``|a - b|``, with the two values and the index where it occurs;
- ``pct_close``: the percentage of elements with ``|a - b| <= atol + rtol * |b|``;
- ``sqnr_db``: ``10 log10(||b||^2 / ||a - b||^2)`` (inf when equal).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


def as_f64(x) -> np.ndarray:
    """Host float64 copy of any array (jax, numpy, bf16 / fp8 via ml_dtypes)."""
    return np.asarray(np.asarray(x).astype(np.float64))


def rel_l2(a, b) -> float:
    """``||a - b|| / ||b||`` in float64; 0 when ``a == b == 0``, inf when only ``b`` is 0."""
    a64, b64 = as_f64(a), as_f64(b)
    if a64.shape != b64.shape:
        raise ValueError(f"rel_l2: shapes differ: a.shape={a64.shape} b.shape={b64.shape}")
    num = float(np.linalg.norm((a64 - b64).ravel()))
    den = float(np.linalg.norm(b64.ravel()))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


@dataclasses.dataclass(frozen=True)
class DiffSummary:
    """How far ``actual`` is from ``expected``; all numbers in float64."""

    rel_l2: float
    max_abs: float
    max_abs_index: tuple[int, ...]
    actual_at_max: float
    expected_at_max: float
    pct_close: float
    sqnr_db: float
    finite: bool
    size: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def summarize(actual, expected, *, rtol: float = 1e-2, atol: float = 1e-5) -> DiffSummary:
    """Summarize ``actual`` against ``expected`` (same shape); ``rtol``/``atol`` define "close" for ``pct_close``."""
    a64, b64 = as_f64(actual), as_f64(expected)
    if a64.shape != b64.shape:
        raise ValueError(f"summarize: shapes differ: actual.shape={a64.shape} expected.shape={b64.shape}")
    finite = bool(np.all(np.isfinite(a64)) and np.all(np.isfinite(b64)))
    if a64.size == 0:
        return DiffSummary(0.0, 0.0, (), 0.0, 0.0, 100.0, math.inf, finite, 0)
    err = np.abs(a64 - b64)
    # NaN anywhere makes the error at that element the largest possible.
    err_for_max = np.where(np.isnan(err), np.inf, err)
    flat = int(np.argmax(err_for_max))
    idx = tuple(int(i) for i in np.unravel_index(flat, a64.shape))
    close = err <= atol + rtol * np.abs(b64)
    sig = float(np.sum(b64 * b64))
    noise = float(np.sum((a64 - b64) ** 2)) if finite else math.inf
    if noise == 0.0:
        sqnr = math.inf
    elif sig == 0.0 or not math.isfinite(noise):  # nothing but noise, or a non-finite value (noise = inf)
        sqnr = -math.inf
    else:
        sqnr = 10.0 * math.log10(sig / noise)
    return DiffSummary(
        rel_l2=rel_l2(a64, b64) if finite else math.inf,
        max_abs=float(err_for_max.flat[flat]),
        max_abs_index=idx,
        actual_at_max=float(a64.flat[flat]),
        expected_at_max=float(b64.flat[flat]),
        pct_close=100.0 * float(np.mean(close)),
        sqnr_db=sqnr,
        finite=finite,
        size=int(a64.size),
    )
