"""Test harness: XLA flags are set here, before anything imports jax.

Eight host CPU devices let the multi-device tests build the ("fsdp", "context", "expert") mesh on a laptop or CI.
Larger shapes are marked ``slow`` and run only with ``--runslow``.
"""

from nxgates.devices import use_host_devices

use_host_devices()  # raises, naming the fix, if jax was initialized with fewer devices before this file ran

import pathlib  # noqa: E402

import pytest  # noqa: E402

from nxgates.gates.profile import enable_compilation_cache  # noqa: E402

# One persistent compilation cache for every test process (xdist's workers too) and run: a program compiled by one
# test (the protocol's, a kernel's) is read by the next that builds the same one. Keyed by the program, the versions,
# XLA_FLAGS and the host CPU (``gates.profile``), so a hit is the executable the test would have compiled.
enable_compilation_cache(pathlib.Path(__file__).resolve().parent.parent / ".cache" / "gates")


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow (large shapes)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip_slow = pytest.mark.skip(reason="large shapes: pass --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)
