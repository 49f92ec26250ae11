"""What the case modules share with the reports that read them: the row type and the interpret switch.

Lives here, below both ``gates/kernel_report.py`` and the case modules, so neither imports the other: the report
imports the case modules (through ``OPS``), the case modules import only this file.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class KernelRow:
    """One compared output: ``actual`` (the implementation ``impl``) against ``expected`` (the float32 reference)."""

    kernel: str
    case: str
    output: str
    impl: str
    actual: np.ndarray
    expected: np.ndarray
    tol_key: str


def interpret_mode() -> bool:
    """How the case modules run Pallas kernels: compiled on TPU, the Pallas interpreter elsewhere (CPU, GPU)."""
    import jax

    return jax.default_backend() != "tpu"
