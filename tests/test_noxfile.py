"""noxfile.py finds a Python 3.12 that runs, and a session without one fails instead of being skipped.

Under pyenv, ``python3.12`` on PATH is a shim that refuses to run where another version is selected; nox then
reported the interpreter missing and, outside CI, skipped the session with exit 0: ``nox -s gates`` passed without
checking anything. Run: python -m pytest tests/test_noxfile.py -q
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import stat
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _noxfile(monkeypatch):
    """noxfile.py imported with a stand-in ``nox`` module (the test environment does not install nox)."""
    options = types.SimpleNamespace()
    fake = types.SimpleNamespace(options=options, session=lambda **kw: (lambda f: f), Session=object)
    monkeypatch.setitem(sys.modules, "nox", fake)
    spec = importlib.util.spec_from_file_location("noxfile_under_test", ROOT / "noxfile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, options


def _exe(path: pathlib.Path, body: str) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.mark.skipif(sys.version_info[:2] != (3, 12), reason="needs a Python 3.12 interpreter to stand in for one")
def test_a_refusing_shim_is_passed_over_for_pyenvs_newest_312(tmp_path, monkeypatch):
    shims = tmp_path / "shims"
    _exe(shims / "python3.12", "echo 'pyenv: python3.12: command not found' >&2; exit 127")
    root = tmp_path / "pyenv"
    for version in ("3.12.1", "3.12.10", "3.12.9", "3.12.0rc1"):
        _exe(root / "versions" / version / "bin" / "python3.12", f'exec "{sys.executable}" "$@"')
    monkeypatch.setenv("PATH", f"{shims}{os.pathsep}/usr/bin{os.pathsep}/bin")
    monkeypatch.setenv("PYENV_ROOT", str(root))
    mod, options = _noxfile(monkeypatch)
    assert mod.PYTHON == str(root / "versions" / "3.12.10" / "bin" / "python3.12")
    assert options.error_on_missing_interpreters is True


def test_without_any_312_nox_is_told_to_report_it_missing(tmp_path, monkeypatch):
    _exe(tmp_path / "bin" / "python3.12", "exit 127")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin")
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "no-pyenv"))
    mod, options = _noxfile(monkeypatch)
    assert mod.PYTHON == "3.12"
    assert options.error_on_missing_interpreters is True
