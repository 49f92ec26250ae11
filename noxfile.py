"""nox sessions for nxgates.

    pip install nox && nox -s tests     # the test suite (8 host CPU devices, Pallas in interpret mode)
    nox -s gates                        # the blocking check: six gates for every flag + the tuned set
    nox -s kernels                      # per-kernel tolerance report
    nox -s mutants                      # deliberately wrong variants must fail their gates
    nox -s lint                         # ruff

Sessions install the project into their own virtualenv on Python 3.12 (jax >= 0.12.0.1, < 0.12.1: pyproject.toml).
"""

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

PYTHON = "3.12"


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Run the pytest suite in parallel (xdist); arguments after `--` go to pytest (e.g. `-- --runslow`)."""
    session.install("-e", ".[test,plots]")
    session.run("pytest", "-n", "2", "--dist", "loadfile", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """Lint and check import order with ruff."""
    session.install("ruff")
    session.run("ruff", "check", ".")


@nox.session(python=PYTHON)
def gates(session: nox.Session) -> None:
    """The blocking check: every registered flag alone and the tuned combination through the six gates.

    Arguments after `--` go to `nxgates` (e.g. `-- --flags moe_wi_gmm_fused_swiglu=true`, `-- --config smoke`).
    Exit 0: all gates pass; 1: a gate fails; 2: bad flags, config or input (the message names the key and value).
    """
    session.install("-e", ".[plots]")
    session.run("python", "-m", "nxgates", *session.posargs)


@nox.session(python=PYTHON)
def kernels(session: nox.Session) -> None:
    """Per-kernel tolerance report: Pallas kernels and XLA baselines against the float32 references."""
    session.install("-e", ".")
    session.run("python", "-m", "nxgates", "kernels", *session.posargs)


@nox.session(python=PYTHON)
def mutants(session: nox.Session) -> None:
    """Deliberately wrong kernels and flag paths: each must fail exactly the gates it declares."""
    session.install("-e", ".[plots]")
    session.run("python", "-m", "nxgates", "mutants", *session.posargs)
