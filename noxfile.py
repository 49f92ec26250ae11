"""nox sessions for nxgates.

    pip install nox && nox -s tests     # the test suite (8 host CPU devices, Pallas in interpret mode)
    nox -s gates                        # the blocking check: six gates for every flag + the tuned set
    nox -s kernels                      # per-kernel tolerance report
    nox -s mutants                      # deliberately wrong variants must fail their gates
    nox -s lint                         # ruff

Sessions install the project into their own virtualenv on Python 3.12 (jax >= 0.12.0.1, < 0.12.1: pyproject.toml).
"""

import glob
import os
import shutil
import subprocess

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True
# A session whose interpreter is missing fails (nox would skip it and exit 0 outside CI: a blocking check that passes
# without checking anything).
nox.options.error_on_missing_interpreters = True


def _runs_312(exe: str) -> bool:
    try:
        out = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and out.stdout.strip() == "True"


def python312() -> str:
    """The Python 3.12 the sessions build their virtualenvs from: ``python3.12`` where it runs, else the newest 3.12.x
    that pyenv has installed (a pyenv shim refuses ``python3.12`` where another version is selected, and nox would not
    find it); "3.12" where there is neither, so that nox reports it missing."""
    exe = shutil.which("python3.12")
    if exe and _runs_312(exe):
        return exe
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    def patch(exe: str) -> int:  # <root>/versions/3.12.N/bin/python3.12 -> N (0 for a pre-release such as 3.12.0rc1)
        n = os.path.basename(os.path.dirname(os.path.dirname(exe))).split(".")[-1]
        return int(n) if n.isdigit() else 0

    for exe in sorted(glob.glob(os.path.join(root, "versions", "3.12.*", "bin", "python3.12")), key=patch,
                      reverse=True):
        if _runs_312(exe):
            return exe
    return "3.12"


PYTHON = python312()


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
