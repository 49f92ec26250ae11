"""nox sessions for nxgates.

    pip install nox && nox -s tests     # the test suite (8 host CPU devices, Pallas in interpret mode)
    nox -s lint                         # ruff

Sessions install the project into their own virtualenv on Python 3.12 (jax >= 0.12.0.1).
"""

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

PYTHON = "3.12"


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Run the pytest suite in parallel (xdist); arguments after `--` go to pytest (e.g. `-- --runslow`)."""
    session.install("-e", ".[test]")
    session.run("pytest", "-n", "2", "--dist", "loadfile", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """Lint and check import order with ruff."""
    session.install("ruff")
    session.run("ruff", "check", ".")
