"""``python -m nxgates`` (and the ``nxgates`` console script): the gates CLI, see ``nxgates.gates.cli``."""

import sys


def main() -> int:
    from nxgates.gates.__main__ import run

    return run(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
