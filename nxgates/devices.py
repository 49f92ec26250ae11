"""The one place nxgates sets XLA's host-device flag and OpenBLAS's thread count (before jax is imported).

The default mesh ``("fsdp", "context", "expert") = 2 x 2 x 2`` needs 8 devices. On a machine without accelerators,
XLA provides them as host CPU devices when ``--xla_force_host_platform_device_count=8`` is in ``XLA_FLAGS`` before jax
initializes its backend. The CLI entry, the test harness and the library's ``check`` call ``use_host_devices``;
nothing else touches ``XLA_FLAGS``.

XLA's CPU backend runs triangular solves (the GDN chunk scan's ``solve_triangular``, forward and backward) as the
``lapack_strsm_ffi`` custom call, which calls scipy's OpenBLAS. OpenBLAS starts one thread per core, and its threads
wait for work by spinning, on the cores XLA's own thread pool runs on. The solves are small (one chunk of 64 rows), so
a second BLAS thread buys nothing and its spinning costs: on a 2-core machine the GDN scan's forward and backward
(float32, b2 t2048 h4 d64) ran in 0.14-0.17 s with OpenBLAS's default of 2 threads and in 0.10-0.11 s with one, and a
one-flag gates run on tiny took 170 s against 125-137 s (docs/speed.md). So ``use_host_devices`` sets
``OPENBLAS_NUM_THREADS=1`` unless the environment already chose a value. The thread count changes no bit of the
output (``tests/test_devices.py``).
"""

from __future__ import annotations

import os
import sys

HOST_DEVICE_COUNT = 8
_FLAG = "--xla_force_host_platform_device_count"
BLAS_THREADS_VAR = "OPENBLAS_NUM_THREADS"


def host_device_flag(count: int = HOST_DEVICE_COUNT) -> str:
    return f"{_FLAG}={count}"


def use_host_devices(count: int = HOST_DEVICE_COUNT) -> None:
    """Ask XLA for ``count`` host CPU devices, select the CPU platform and give OpenBLAS one thread unless the
    environment set ``OPENBLAS_NUM_THREADS``; must run before jax is imported (OpenBLAS reads it when it loads).

    Raises ``RuntimeError`` naming the fix when jax was already imported with fewer devices (the flag would be
    ignored silently otherwise)."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    if host_device_flag(count) not in flags:
        flags = [f for f in flags if not f.startswith(_FLAG + "=")]
        os.environ["XLA_FLAGS"] = " ".join([*flags, host_device_flag(count)])
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault(BLAS_THREADS_VAR, "1")
    if "jax" in sys.modules:  # imported already: the flag counts only if its backend was not initialized yet
        import jax

        if len(jax.devices()) < count:
            raise RuntimeError(
                f"nxgates needs {count} devices, but jax was initialized before nxgates could ask for host devices "
                f"and has {len(jax.devices())}; set XLA_FLAGS={host_device_flag(count)} and JAX_PLATFORMS=cpu before "
                f"importing jax, or call nxgates.devices.use_host_devices() first"
            )
