"""Packaging: the install exposes one package, ``nxgates``, and coexists with a trainer's own ``model`` and ``gates``.

- ``pyproject.toml``'s ``packages`` list names every package folder of the repository (a new subpackage left out would
  be missing from a wheel) and nothing else.
- In a fresh virtual environment (the dependencies reused from this one through a ``.pth`` file, so nothing is
  downloaded but the build backend) where a trainer's modules named ``model`` and ``gates`` sit on the path: nxgates is
  installed from a copy of the repository (not editable: what a user gets), ``import nxgates.model.config`` loads a
  packaged config, the trainer's ``model`` and ``gates`` still import as theirs, nxgates imports no top-level
  ``model`` / ``gates`` / ``kernels`` / ``reference``, and the console script ``nxgates list-flags`` runs.

Run: ``python -m pytest tests/test_packaging.py -q``.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYERS = ("reference", "kernels", "model", "gates", "fixtures")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_packages_list_names_every_package_folder():
    setup = _pyproject()["tool"]["setuptools"]
    package_dir = setup["package-dir"]
    folders = {"nxgates"} | {f"nxgates.{layer}" for layer in LAYERS}
    assert {k: v for k, v in package_dir.items()} == {"nxgates": "nxgates", **{f"nxgates.{x}": x for x in LAYERS}}
    found = set()
    for package in folders:
        base = ROOT / package_dir[package]
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base).parts
            found.add(".".join((package, *rel)))
    assert set(setup["packages"]) == found, {"missing from packages": sorted(found - set(setup["packages"])),
                                              "listed but no package folder": sorted(set(setup["packages"]) - found)}


def _copy_source(dst: pathlib.Path) -> None:
    """What a clone holds that the build reads (no caches, no build leftovers)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in ("nxgates", *LAYERS):
        shutil.copytree(ROOT / name, dst / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dst / name)


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    assert res.returncode == 0, f"{cmd} exited {res.returncode}:\n{res.stdout}\n{res.stderr}"
    return res


USER_CHECK = textwrap.dedent("""
    import sys
    import model, gates                       # the trainer's own modules (cwd)
    assert model.WHO == "trainer" and gates.WHO == "trainer", (model, gates)
    import nxgates, nxgates.model.config as config, nxgates.gates.cli, nxgates.gates.suite
    import nxgates.model.transformer, nxgates.kernels.gmm.ops, nxgates.reference
    assert "site-packages" in nxgates.__file__, nxgates.__file__   # the installed copy, not a checkout
    cfg = config.load_config("tiny")          # a config packaged as data
    assert cfg.name == "tiny" and cfg.hidden_dim == 256
    assert sys.modules["model"] is model and sys.modules["gates"] is gates and model.WHO == "trainer"
    import model as again
    assert again is model and again.WHO == "trainer"
    generic = sorted(n for n in ("kernels", "reference", "fixtures") if n in sys.modules)
    assert not generic, generic
    print("ok", nxgates.__file__)
""")


def test_fresh_install_beside_a_trainers_model_and_gates(tmp_path):
    src, venv, user = tmp_path / "src", tmp_path / "venv", tmp_path / "trainer"
    src.mkdir()
    _copy_source(src)
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    # The dependencies (jax, numpy, ...) from this environment, appended after the fresh site-packages: plain path
    # entries, so this environment's own .pth files (an editable nxgates) are not processed there.
    purelib = pathlib.Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
                           .stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (purelib / "_nxgates_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(src)]
    if importlib.util.find_spec("setuptools") is not None:  # build with this environment's setuptools (faster)
        install.insert(-1, "--no-build-isolation")
    _run(install)
    user.mkdir()
    (user / "model").mkdir()
    (user / "model" / "__init__.py").write_text('WHO = "trainer"\n')
    (user / "gates.py").write_text('WHO = "trainer"\n')
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["XLA_FLAGS"] = ""
    env["JAX_PLATFORMS"] = "cpu"
    out = _run([str(python), "-c", USER_CHECK], cwd=user, env=env).stdout
    assert out.startswith("ok ") and str(venv) in out
    # the console script runs the CLI from the installed package, in the trainer's folder
    flags = _run([str(venv / "bin" / "nxgates"), "list-flags", "--config", "tiny", "--json"], cwd=user, env=env)
    assert '"flag": "moe_wo_gmm_fused_dswiglu"' in flags.stdout
