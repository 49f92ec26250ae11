"""``python -m gates``: the gates CLI (see ``gates/cli.py`` for the commands).

This is the one place the CLI sets XLA flags, before anything imports jax: unless ``--accelerator`` is given, the
runs use 8 host CPU devices (``--xla_force_host_platform_device_count=8``, ``JAX_PLATFORMS=cpu``) so the default
("fsdp", "context", "expert") = 2 x 2 x 2 mesh exists on any machine.
"""

import os
import sys

_HOST_DEVICES = "--xla_force_host_platform_device_count=8"


def _set_platform(argv: list[str]) -> None:
    if "--accelerator" in argv:
        return
    if _HOST_DEVICES not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _HOST_DEVICES).strip()
    os.environ["JAX_PLATFORMS"] = "cpu"


if __name__ == "__main__":
    if "jax" in sys.modules:
        raise RuntimeError("gates/__main__.py: jax was imported before the XLA flags were set")
    _set_platform(sys.argv[1:])
    from gates.cli import main

    sys.exit(main(sys.argv[1:]))
