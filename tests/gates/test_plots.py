"""The report's gate curves: drawn with the key of what they show, and not drawn again from the same numbers.

Run: python -m pytest tests/gates/test_plots.py -q
"""

from __future__ import annotations

import dataclasses
import types

import pytest

from nxgates.gates import gates as G
from tests.gates.test_gates import TOLS, noisy
from tests.gates.toy_model import synthetic_record

pytest.importorskip("matplotlib")
from nxgates.gates import plots  # noqa: E402


def _check(scale: float):
    control = synthetic_record(0)
    results, _ = G.evaluate(noisy(control, scale, seed=2), control, noisy(control, 1e-3, seed=1), "rounding", TOLS)
    return types.SimpleNamespace(spec=types.SimpleNamespace(name="k"), results=results,
                                 passed=all(r.passed for r in results))


def test_a_picture_of_the_same_numbers_is_not_drawn_again(tmp_path, monkeypatch):
    path = tmp_path / "k-gates.png"
    check = _check(2e-3)
    assert plots.gate_curves(check, path) == path
    key = plots.drawn_from(path)
    assert key is not None and len(key) == 64
    drawn = []
    real = plots._save
    monkeypatch.setattr(plots, "_save", lambda *a, **k: drawn.append(a[2]) or real(*a, **k))
    assert plots.gate_curves(check, path) == path and drawn == []  # the same numbers: kept
    changed = dataclasses.replace(check.results[3], vs_control=check.results[3].vs_control * 2)
    other = types.SimpleNamespace(spec=check.spec, results=[*check.results[:3], changed, *check.results[4:]],
                                  passed=check.passed)
    plots.gate_curves(other, path)  # one value changed: drawn again, under another key
    assert drawn == [path] and plots.drawn_from(path) not in (None, key)
    path.write_bytes(b"not a png")  # a damaged file is drawn again
    plots.gate_curves(check, path)
    assert plots.drawn_from(path) == key
