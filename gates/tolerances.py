"""The one reader of ``fixtures/tolerances.toml``: the gates' ``[gates.*]`` and the kernels' ``[kernels."<key>"]``.

- ``load_tolerances(path)`` -> ``Tolerances``: ``[gates.N1]`` .. ``[gates.N6]`` (each: rel, slack, reason, source) and
  ``[gates.golden]`` (rel, cross_env_rel, reason, source), for the six gates and the golden comparison.
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
    """Per gate: ``tol[gate]`` (the rounding bound against the control, the floor of the reference bound): one number
    for every step, or a tuple with one number per step (``tol_at``); ``slack[gate]`` (how much farther from the
    float32 reference than the control a candidate may be)."""

    tol: Mapping[str, float | tuple[float, ...]]
    slack: Mapping[str, float]
    golden_rel: float
    reasons: Mapping[str, str]
    sources: Mapping[str, str]
    path: str
    # the golden compared outside its environment key (another CPU target or versions): rel per step, loss and grad norm
    golden_cross_env_rel: float | None = None

    def tol_at(self, gate: str, step: int) -> float:
        """The tolerance of ``gate`` at ``step`` (1-based); a per-step table must cover the step."""
        t = self.tol[gate]
        if isinstance(t, (int, float)):
            return float(t)
        if not 1 <= step <= len(t):
            raise ValueError(f"tolerances: [gates.{gate}] rel has {len(t)} per-step values, no value for step {step} "
                             f"({self.path})")
        return float(t[step - 1])


def load_tolerances(path: str | pathlib.Path = DEFAULT_TOLERANCES) -> Tolerances:
    """Read ``[gates.N1]`` .. ``[gates.N6]`` (each: rel, slack, reason, source) and ``[gates.golden]`` (rel, reason,
    source). A missing section or key is refused with a ``ValueError`` naming it; so is the retired global
    ``[gates.slack]`` (the slack is per gate: a global one would silently be ignored)."""
    path = pathlib.Path(path)
    doc = read_table(path)
    section = doc.get("gates")
    if not isinstance(section, dict):
        raise ValueError(f"tolerances: {path} has no [gates] section")
    if "slack" in section:
        raise ValueError(f"tolerances: [gates.slack] in {path} is not read: the slack is per gate "
                         "([gates.N1] slack = ..., ... [gates.N6] slack = ...); remove it")
    tol, slack, reasons, sources = {}, {}, {}, {}
    for key in (*GATES, "golden"):
        entry = section.get(key)
        if not isinstance(entry, dict):
            raise ValueError(f"tolerances: [gates.{key}] missing in {path}")
        fields = ("rel", "slack") if key in GATES else ("rel", "cross_env_rel")
        for field in (*fields, "reason", "source"):
            if field not in entry:
                raise ValueError(f"tolerances: [gates.{key}] needs {field!r} (got keys {sorted(entry)}) in {path}")
        rel = entry["rel"]
        if isinstance(rel, list) and key in GATES:
            if not rel:
                raise ValueError(f"tolerances: [gates.{key}] rel=[] needs one number per step in {path}")
            tol[key] = tuple(_number(f"gates.{key}", f"rel[{i}]", v) for i, v in enumerate(rel))
        else:
            tol[key] = _number(f"gates.{key}", "rel", rel)
        if key in GATES:
            slack[key] = _number(f"gates.{key}", "slack", entry["slack"])
        reasons[key], sources[key] = str(entry["reason"]), str(entry["source"])
    return Tolerances(
        tol={g: tol[g] for g in GATES}, slack=slack, golden_rel=tol["golden"], reasons=reasons,
        sources=sources, path=str(path),
        golden_cross_env_rel=_number("gates.golden", "cross_env_rel", section["golden"]["cross_env_rel"]),
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
