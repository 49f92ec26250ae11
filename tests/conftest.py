"""Test harness: XLA flags are set here, before anything imports jax.

Eight host CPU devices let the multi-device tests build the ("fsdp", "context", "expert") mesh on a laptop or CI.
Larger shapes are marked ``slow`` and run only with ``--runslow``.
"""

import os

_HOST_DEVICES = "--xla_force_host_platform_device_count=8"
if _HOST_DEVICES not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _HOST_DEVICES).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

if len(jax.devices()) < 8:  # jax was imported (and its backend initialized) before this file ran.
    raise RuntimeError(
        f"tests need 8 host devices, got {len(jax.devices())}: set XLA_FLAGS={_HOST_DEVICES} before jax is imported"
    )


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow (large shapes)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip_slow = pytest.mark.skip(reason="large shapes: pass --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)
