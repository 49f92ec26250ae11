"""``python -m nxgates.gates`` (and ``python -m nxgates``, the ``nxgates`` script): the gates CLI (``cli.py``).

Unless ``--accelerator`` is given, the runs use 8 host CPU devices (``nxgates.devices.use_host_devices``, before
anything imports jax) so the default ("fsdp", "context", "expert") = 2 x 2 x 2 mesh exists on any machine.
"""

import sys


def run(argv: list[str]) -> int:
    if "--accelerator" not in argv:
        from nxgates.devices import use_host_devices

        use_host_devices()
    from nxgates.gates.cli import main

    return main(argv)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
