"""The one reader of ``fixtures/tolerances.toml``: the gates' ``[gates.*]`` and the kernels' ``[kernels."<key>"]``.

- ``load_tolerances(path)`` -> ``Tolerances``: ``[gates.N1]`` .. ``[gates.N6]`` (each: floor, slack, live_range, reason,
  source; N5 also min_size, the smallest tensor it reads) and ``[gates.golden]`` (rel, cross_env_rel, reason,
  source), for the six gates and the golden comparison;
  ``load_tolerances(path, section="lens")``: ``[lens.N1]`` .. ``[lens.N6]``, the same fields for the float32 lens.
  The bounds of a rounding gate come from the run's own live control-to-reference distance ``c``: against the control
  ``max(floor, c)``, against the reference ``max(floor, (1 + slack) c)``; ``live_range`` is the calibrated range of
  ``c`` (a live ``c`` outside it is reported as an environment change, never a failure by itself). A table written
  before the floors (``rel = ...``, e.g. by ``calibrate-records``) is read with ``rel`` as the floor.
- ``load_kernel_tolerances(path)`` -> ``{key: KernelTolerance}``: every ``[kernels."<key>"]`` entry (rel_l2, reason,
  source), for the per-kernel report; ``kernel_tolerance(key, path)`` -> one entry (``KeyError`` naming the key).

Every entry carries its number, the reason for it and the command that measured it; anything missing or malformed is a
``ValueError`` naming the section, the field and the file. Nothing relaxes a tolerance at run time.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import tomllib
from collections.abc import Mapping

from nxgates import fixtures

DEFAULT_TOLERANCES = fixtures.TOLERANCES
GATES = ("N1", "N2", "N3", "N4", "N5", "N6")  # the six gates' sections, in order


def read_table(path: str | pathlib.Path = DEFAULT_TOLERANCES) -> dict:
    """The parsed TOML of the tolerance table; ``ValueError`` naming the path if it is missing or not TOML."""
    path = pathlib.Path(path)
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ValueError(f"tolerances: path={str(path)!r} does not exist") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"tolerances: {path} is not UTF-8 text ({e.reason} at byte {e.start})") from e
    except OSError as e:
        raise ValueError(f"tolerances: path={str(path)!r} cannot be read ({e.strerror or e})") from e
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"tolerances: {path} is not valid TOML ({e})") from e


def _number(section: str, field: str, value) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (value >= 0) or math.isinf(value):
        raise ValueError(f"tolerances: [{section}] {field}={value!r} must be a finite number >= 0")
    return float(value)


# ------------------------------------------------------------------------------------------------------------ gates
@dataclasses.dataclass(frozen=True)
class Tolerances:
    """Per gate: ``tol[gate]``, the floor of both bounds (``floor``, or a legacy table's ``rel``): one number for every
    step, or a tuple with one number per step (``tol_at``); ``slack[gate]`` (how much farther from the float32
    reference than the control a candidate may be); ``live_range[gate]``: the calibrated range of the live
    control-to-reference distance, ``(lo, hi)`` for every step or one pair per step (``live_range_at``), or absent."""

    tol: Mapping[str, float | tuple[float, ...]]
    slack: Mapping[str, float]
    golden_rel: float
    reasons: Mapping[str, str]
    sources: Mapping[str, str]
    path: str
    live_range: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    section: str = "gates"
    # [gates.golden] cross_env_rel: the golden compared outside its environment key (another CPU target or versions),
    # rel per step on the loss and the grad norm; None: the table has none (the golden is then not compared there)
    golden_cross_env_rel: float | None = None
    # [<section>.N5] min_size: N5 reads the tensors of at least this many elements (absent: every tensor)
    min_size: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def tol_at(self, gate: str, step: int) -> float:
        """The floor of ``gate`` at ``step`` (1-based); a per-step table must cover the step."""
        t = self.tol[gate]
        if isinstance(t, (int, float)):
            return float(t)
        if not 1 <= step <= len(t):
            raise ValueError(f"tolerances: [{self.section}.{gate}] floor has {len(t)} per-step values, no value for "
                             f"step {step} ({self.path})")
        return float(t[step - 1])

    def live_range_at(self, gate: str, step: int) -> tuple[float, float] | None:
        """The calibrated ``(lo, hi)`` of m(control, reference) for ``gate`` at ``step``; None without a range."""
        r = self.live_range.get(gate)
        if r is None:
            return None
        if isinstance(r[0], (int, float)):
            return float(r[0]), float(r[1])
        if not 1 <= step <= len(r):
            raise ValueError(f"tolerances: [{self.section}.{gate}] live_range has {len(r)} per-step ranges, none for "
                             f"step {step} ({self.path})")
        return float(r[step - 1][0]), float(r[step - 1][1])


def _pair(section: str, field: str, value) -> tuple[float, float]:
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError(f"tolerances: [{section}] {field}={value!r} must be [lo, hi]")
    lo, hi = (_number(section, f"{field}[{i}]", v) for i, v in enumerate(value))
    if lo > hi:
        raise ValueError(f"tolerances: [{section}] {field}={value!r} needs lo <= hi")
    return lo, hi


def _live_range(section: str, value) -> tuple:
    """``[lo, hi]`` (every step) or ``[[lo, hi], ...]`` (one per step)."""
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        return tuple(_pair(section, f"live_range[{i}]", v) for i, v in enumerate(value))
    return _pair(section, "live_range", value)


SECTIONS = ("gates", "lens")


def load_tolerances(path: str | pathlib.Path = DEFAULT_TOLERANCES, section: str = "gates") -> Tolerances:
    """Read ``[<section>.N1]`` .. ``[<section>.N6]`` (each: floor (or legacy rel), slack, reason, source; optional
    live_range) and, for ``gates``, ``[gates.golden]`` (rel, reason, source; optional cross_env_rel). A missing
    section or key is refused with a ``ValueError`` naming it; so is the retired global ``[gates.slack]`` (the slack is
    per gate: a global one would silently be ignored)."""
    if section not in SECTIONS:
        raise ValueError(f"tolerances: section={section!r} must be one of {SECTIONS}")
    path = pathlib.Path(path)
    doc = read_table(path)
    table = doc.get(section)
    if not isinstance(table, dict):
        raise ValueError(f"tolerances: {path} has no [{section}] section")
    if "slack" in table:
        raise ValueError(f"tolerances: [{section}.slack] in {path} is not read: the slack is per gate "
                         f"([{section}.N1] slack = ..., ... [{section}.N6] slack = ...); remove it")
    tol, slack, reasons, sources, live, min_size = {}, {}, {}, {}, {}, {}
    keys = (*GATES, "golden") if section == "gates" else GATES
    for key in keys:
        name = f"{section}.{key}"
        entry = table.get(key)
        if not isinstance(entry, dict):
            raise ValueError(f"tolerances: [{name}] missing in {path}")
        if key in GATES:
            if "floor" in entry and "rel" in entry:
                raise ValueError(f"tolerances: [{name}] has both floor and rel in {path}; rel is the legacy name of "
                                 "floor: keep one")
            bound_field = "floor" if "floor" in entry or "rel" not in entry else "rel"
            fields = (bound_field, "slack")
        else:
            bound_field, fields = "rel", ("rel",)
        for field in (*fields, "reason", "source"):
            if field not in entry:
                raise ValueError(f"tolerances: [{name}] needs {field!r} (got keys {sorted(entry)}) in {path}")
        rel = entry[bound_field]
        if isinstance(rel, list) and key in GATES:
            if not rel:
                raise ValueError(f"tolerances: [{name}] {bound_field}=[] needs one number per step in {path}")
            tol[key] = tuple(_number(name, f"{bound_field}[{i}]", v) for i, v in enumerate(rel))
        else:
            tol[key] = _number(name, bound_field, rel)
        if key in GATES:
            slack[key] = _number(name, "slack", entry["slack"])
            if "live_range" in entry:
                live[key] = _live_range(name, entry["live_range"])
            if "min_size" in entry:
                if key != "N5":
                    raise ValueError(f"tolerances: [{name}] min_size is read for N5 only (the worst tensor), not "
                                     f"{key}; remove it from {path}")
                v = entry["min_size"]
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"tolerances: [{name}] min_size={v!r} must be an integer >= 1 (elements)")
                min_size[key] = v
        reasons[key], sources[key] = str(entry["reason"]), str(entry["source"])
    return Tolerances(
        tol={g: tol[g] for g in GATES}, slack=slack, golden_rel=tol.get("golden", 0.0), reasons=reasons,
        sources=sources, path=str(path), live_range=live, section=section, min_size=min_size,
        golden_cross_env_rel=(_number(f"{section}.golden", "cross_env_rel", table["golden"]["cross_env_rel"])
                              if section == "gates" and "cross_env_rel" in table["golden"] else None),
    )


# ---------------------------------------------------------------------------------------------------------- kernels
@dataclasses.dataclass(frozen=True)
class KernelTolerance:
    """One ``[kernels."<key>"]`` entry: the bound on the rel L2 against the float32 reference, its reason and source."""

    key: str
    rel_l2: float
    reason: str
    source: str


def load_kernel_tolerances(path: str | pathlib.Path = DEFAULT_TOLERANCES) -> dict[str, KernelTolerance]:
    """Every ``[kernels."<key>"]`` entry (each: rel_l2, reason, source), key -> ``KernelTolerance``."""
    path = pathlib.Path(path)
    section = read_table(path).get("kernels", {})
    if not isinstance(section, dict):
        raise ValueError(f"tolerances: [kernels] in {path} must be a table of [kernels.\"<key>\"] entries")
    out = {}
    for key, entry in section.items():
        missing = [f for f in ("rel_l2", "reason", "source") if not isinstance(entry, dict) or f not in entry]
        if missing:
            got = sorted(entry) if isinstance(entry, dict) else entry
            raise ValueError(f"tolerances: [kernels.{key!r}] needs rel_l2, reason and source; missing {missing} "
                             f"(got {got}) in {path}")
        out[key] = KernelTolerance(key=key, rel_l2=_number(f"kernels.{key!r}", "rel_l2", entry["rel_l2"]),
                                   reason=str(entry["reason"]), source=str(entry["source"]))
    return out


def kernel_tolerance(key: str, path: str | pathlib.Path = DEFAULT_TOLERANCES) -> KernelTolerance:
    """The ``[kernels."<key>"]`` entry of the table; ``KeyError`` naming the key and the keys the table has."""
    table = load_kernel_tolerances(path)
    if key not in table:
        raise KeyError(f"tolerances: no [kernels.{key!r}] entry in {path}; entries are {sorted(table)}")
    return table[key]
