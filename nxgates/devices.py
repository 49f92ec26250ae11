"""The one place nxgates sets XLA's host-device flag (before jax is imported).

The default mesh ``("fsdp", "context", "expert") = 2 x 2 x 2`` needs 8 devices. On a machine without accelerators,
XLA provides them as host CPU devices when ``--xla_force_host_platform_device_count=8`` is in ``XLA_FLAGS`` before jax
initializes its backend. The CLI entry, the test harness and the library's ``check`` call ``use_host_devices``;
nothing else touches ``XLA_FLAGS``.
"""

from __future__ import annotations

import os
import sys

HOST_DEVICE_COUNT = 8
_FLAG = "--xla_force_host_platform_device_count"


def host_device_flag(count: int = HOST_DEVICE_COUNT) -> str:
    return f"{_FLAG}={count}"


def use_host_devices(count: int = HOST_DEVICE_COUNT) -> None:
    """Ask XLA for ``count`` host CPU devices and select the CPU platform; must run before jax is imported.

    Raises ``RuntimeError`` naming the fix when jax was already imported with fewer devices (the flag would be
    ignored silently otherwise)."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    if host_device_flag(count) not in flags:
        flags = [f for f in flags if not f.startswith(_FLAG + "=")]
        os.environ["XLA_FLAGS"] = " ".join([*flags, host_device_flag(count)])
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # imported already: the flag counts only if its backend was not initialized yet
        import jax

        if len(jax.devices()) < count:
            raise RuntimeError(
                f"nxgates needs {count} devices, but jax was initialized before nxgates could ask for host devices "
                f"and has {len(jax.devices())}; set XLA_FLAGS={host_device_flag(count)} and JAX_PLATFORMS=cpu before "
                f"importing jax, or call nxgates.devices.use_host_devices() first"
            )
