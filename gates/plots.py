"""Pictures for the reports (matplotlib, the optional ``plots`` extra): every function returns None without it.

- ``explain_heatmap(explanation, path)``: layer x op, each tap's distance over its bound: the candidate's distance to
  the control over the control's own distance to the reference there (the bound against the control of a rounding
  check; the worst part of each cell), forward and backward side by side, on a log color scale; cells over either of
  their bounds (and, for an exact check, not bit-identical) are marked ``x``.
- ``gate_curves(check, path)``: per gate, the metric against the control and against the float32 reference over the
  steps, with the bounds they are held to. A picture already at ``path`` that was drawn from the same numbers by the
  same code (its PNG text chunk ``nxgates-key``: the sha256 of the plotted values, this module's source and
  matplotlib's version) is kept as it is: a rerun whose results did not change draws nothing.
"""

from __future__ import annotations

import hashlib
import json
import math
import pathlib

KEY_FIELD = "nxgates-key"  # the PNG text chunk naming what a picture was drawn from


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(fig, plt, path, key: str | None = None) -> pathlib.Path:
    from nxgates.gates import atomic

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {KEY_FIELD: key} if key else None
    try:
        return atomic.write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110, bbox_inches="tight",
                                                               metadata=metadata))
    finally:
        plt.close(fig)


def picture_key(values) -> str:
    """The sha256 of what a picture shows (``values``, JSON-able), of this module's source and of matplotlib's
    version."""
    import matplotlib

    h = hashlib.sha256(pathlib.Path(__file__).read_bytes())
    h.update(matplotlib.__version__.encode())
    h.update(json.dumps(values, sort_keys=True, default=repr).encode())
    return h.hexdigest()


def drawn_from(path) -> str | None:
    """The ``nxgates-key`` of the PNG at ``path`` (None: no file, not a PNG, no key)."""
    try:
        from PIL import Image

        with Image.open(path) as im:
            return (getattr(im, "text", None) or {}).get(KEY_FIELD)
    except (OSError, ValueError, ImportError, SyntaxError):
        return None


def explain_heatmap(ex, path) -> pathlib.Path | None:
    plt = _pyplot()
    if plt is None:
        return None
    import numpy as np
    from matplotlib.colors import LogNorm

    wheres = list(dict.fromkeys(r.where for r in ex.rows))
    ops = list(dict.fromkeys(r.op + (f"[{r.label}]" if r.label else "") for r in ex.rows))
    fig, axes = plt.subplots(1, 2, figsize=(2.0 + 0.45 * len(ops) * 2, 1.2 + 0.4 * len(wheres)), squeeze=False)
    floor, top = 1e-3, 1e3
    im = None
    for ax, direction in zip(axes[0], ("forward", "backward"), strict=True):
        grid = np.full((len(wheres), len(ops)), np.nan)
        over = np.zeros_like(grid, dtype=bool)
        for r in ex.rows:
            if r.direction != direction:
                continue
            i, j = wheres.index(r.where), ops.index(r.op + (f"[{r.label}]" if r.label else ""))
            v = r.vs_control / max(r.control_vs_reference, ex.bounds.floor)
            v = v if math.isfinite(v) else top
            grid[i, j] = np.nanmax([grid[i, j], min(max(v, floor), top)])
            over[i, j] |= r.over
        im = ax.imshow(np.ma.masked_invalid(grid), norm=LogNorm(floor, top), cmap="RdYlGn_r", aspect="auto")
        for i, j in zip(*np.nonzero(over), strict=True):
            ax.text(j, i, "x", ha="center", va="center", fontsize=9, fontweight="bold")
        ax.set_xticks(range(len(ops)), ops, rotation=70, fontsize=7)
        ax.set_yticks(range(len(wheres)), wheres, fontsize=7)
        ax.set_title(f"{direction} (step 1)", fontsize=9)
    fig.colorbar(im, ax=axes[0].tolist(), label="rel(candidate, control) / rel(control, reference)", shrink=0.8)
    first = ex.first
    fig.suptitle(f"explain {ex.check} ({ex.config}): " + (first.line() if first else "no tap over its bound"),
                 fontsize=8)
    return _save(fig, plt, path)


def gate_curves(check, path) -> pathlib.Path | None:
    plt = _pyplot()
    if plt is None:
        return None
    from matplotlib import ticker

    from nxgates.gates import gates as gates_lib

    fields = ("gate", "step", "vs_control", "vs_reference", "bound_control", "bound_reference", "passed")
    key = picture_key({"check": check.spec.name, "passed": check.passed,
                       "results": [[repr(getattr(r, f)) for f in fields] for r in check.results]})
    if drawn_from(path) == key:
        return pathlib.Path(path)
    gates = list(dict.fromkeys(r.gate for r in check.results))
    fig, axes = plt.subplots(1, len(gates), figsize=(2.6 * len(gates), 2.6), squeeze=False)
    for ax, gate in zip(axes[0], gates, strict=True):
        rs = [r for r in check.results if r.gate == gate]
        steps = [r.step for r in rs]

        def pos(xs):
            return [x if (math.isfinite(x) and x > 0) else float("nan") for x in xs]

        ax.plot(steps, pos([r.vs_control for r in rs]), "o-", label="vs control")
        ax.plot(steps, pos([r.vs_reference for r in rs]), "s-", label="vs reference")
        ax.plot(steps, pos([r.bound_control for r in rs]), "--", color="C0", label="bound (control)")
        ax.plot(steps, pos([r.bound_reference for r in rs]), "--", color="C1", label="bound (reference)")
        for r in rs:
            if not r.passed:
                ax.annotate("FAIL", (r.step, max(pos([r.vs_control, r.vs_reference]), default=0) or 1),
                            fontsize=7, color="red")
        values = pos([r.vs_control for r in rs] + [r.vs_reference for r in rs])
        if all(math.isnan(v) for v in values):  # a log axis shows nothing of an all-zero metric: say it
            ax.text(0.5, 0.5, "0 against the control and\nthe reference at every step", ha="center", va="center",
                    transform=ax.transAxes, fontsize=7)
        else:
            ax.set_yscale("log")
            # Plain-text tick labels: the default ones are mathtext (10^{-3}), whose layout took ~1 s per label on
            # the 2-core machine (most of a report's plotting time); the same ticks, labelled as 1.2e-03.
            ax.yaxis.set_major_formatter(ticker.LogFormatter(labelOnlyBase=False))
            ax.yaxis.set_minor_formatter(ticker.LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.4)))
        ax.set_xticks(steps)
        ax.set_xlabel("step")
        ax.set_title(f"{gate} {gates_lib.GATE_NAMES.get(gate, '')}", fontsize=9)
    axes[0][0].legend(fontsize=6)
    fig.suptitle(f"check {check.spec.name}: {'PASS' if check.passed else 'FAIL'}", fontsize=9)
    fig.tight_layout()
    return _save(fig, plt, path, key)


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)[:120]


def report_plots(report, out) -> dict:
    """Each check's gate curves and each explanation's heatmap beside the reports: {check: [(title, file name)]}
    ({} without matplotlib)."""
    if _pyplot() is None:
        return {}
    out = pathlib.Path(out)
    made = {}
    for c in report.checks:
        stem = _slug(c.spec.name)
        entries = []
        if gate_curves(c, out / f"{stem}-gates.png") is not None:
            entries.append((f"{c.spec.name}: the six gates over the steps", f"{stem}-gates.png"))
        ex = getattr(c, "explanation", None)
        if ex is not None and not isinstance(ex, str) and explain_heatmap(ex, out / f"{stem}-explain.png"):
            entries.append((f"{c.spec.name}: each tap over its bound, layer x op", f"{stem}-explain.png"))
        made[c.spec.name] = entries
    return made
