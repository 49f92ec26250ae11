"""Flag contracts: which tuning flags the gates know, what each claims, and how a check is built from them.

Nothing here is declared: every tuning flag, its contract, its description and the value a check turns it on at come
from its one declaration in ``model.flags`` (``TUNING``). A flag's contract is ``exact`` (the flag may not change a
single bit: N1..N6 demand bit-identity with the control) or ``rounding`` (it may change the numbers by bf16 rounding:
the tolerances of ``fixtures/tolerances.toml`` apply). The GMM tile keys' contracts follow the dimension they tile
(``model.flags.REDUCTION_DIM``): a tile of the GMM's reduction dimension re-associates the f32 accumulation
(``rounding``); any other tile, or the buffer count, only re-schedules the same arithmetic (``exact``).

Prerequisites are not restated here: they are the model's rules (``model.rules``). A check "flag X alone" is the
config's control against control + X + the prerequisite tuning flags that the model's closure
(``model.rules.with_prerequisites``) adds at their tuned values (``moe_router_grad_from_wo_input`` brings
``moe_wo_gmm_fused_dswiglu`` and its one-n-tile ``wo_tile_dlhs_mlp_dim``); the check's contract is the weakest of every
key the candidate changes. Control settings a flag needs (fp8 mode, scan_layers, remat policy, context parallelism)
are never switched by a check: the config's control carries them, so the control and the reference run with them too.

``default_checks(...)`` turns a config's tuned values into ``CheckSpec`` s: every non-tile tuning flag alone, every
changed tile key alone (or grouped by contract), then the tuned combination.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from nxgates.model.flags import TUNING, TuningFlag

Overrides = dict[str, Any]

# The non-tile tuning flags: each is checked alone by the default run (at its tuned value, else its "on" value).
FLAGS: dict[str, TuningFlag] = {k: d for k, d in TUNING.items() if not d.tile}


def declaration(key: str) -> TuningFlag:
    """The ``model.flags`` declaration of a tuning key; ``KeyError`` for a key that is not a tuning flag."""
    return TUNING[key]


def is_tile_key(key: str) -> bool:
    return key in TUNING and TUNING[key].tile


def contract_of(key: str) -> str:
    """The contract of one tuning key; ``KeyError`` for a key that is not a tuning flag."""
    return TUNING[key].contract


def is_tuning_key(key: str) -> bool:
    return key in TUNING


def weakest(contracts) -> str:
    return "rounding" if "rounding" in set(contracts) else "exact"


@dataclasses.dataclass(frozen=True)
class CheckSpec:
    """One check: control = config's control + ``control_overrides`` (only a user's explicit control settings);
    candidate = that control + ``candidate_overrides``."""

    name: str
    contract: str
    candidate_overrides: Overrides
    keys: tuple[str, ...]  # the tuning keys the check is about (the prerequisites it added are in the overrides)
    control_overrides: Overrides = dataclasses.field(default_factory=dict)
    # --flags: the prerequisite tuning flags the closure added to the user's keys (already in candidate_overrides)
    added_prerequisites: Overrides = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


Closure = Callable[[Mapping[str, Any]], Overrides]  # overrides -> overrides + prerequisite tuning flags


def build_check(name: str, changes: Mapping[str, Any], base_values: Mapping[str, Any],
                closure: Closure | None = None) -> CheckSpec:
    """The check turning the tuning keys ``changes`` on, plus what ``closure`` adds; contract = the weakest involved.

    ``base_values``: the control's flag values ({key: value}).
    """
    overrides = dict(closure(changes) if closure is not None else changes)
    changed = {k: v for k, v in overrides.items() if base_values.get(k) != v}
    unknown = [k for k in changed if not is_tuning_key(k)]
    if unknown:
        raise ValueError(f"check {name}: {', '.join(f'{k}={changed[k]!r}' for k in unknown)} is not a tuning flag")
    return CheckSpec(name=name, contract=weakest(contract_of(k) for k in changed), candidate_overrides=changed,
                     keys=tuple(changes))


def default_checks(base_values: Mapping[str, Any], tuned: Mapping[str, Any], closure: Closure | None = None,
                   *, tiles: str = "each") -> list[CheckSpec]:
    """Every non-tile tuning flag alone (its tuned value, else its on value), every tile key the config tunes
    (``tiles="each"``: one check per key; ``"grouped"``: one check per contract), then the tuned combination (every
    [tuned] value, plus non-tile flags the config does not tune, at their on value)."""
    if tiles not in ("each", "grouped"):
        raise ValueError(f"default_checks: tiles={tiles!r} must be 'each' or 'grouped'")
    checks = []
    for key, spec in FLAGS.items():
        if key not in base_values:  # a flag this model does not have
            continue
        value = tuned.get(key, spec.on)
        if base_values.get(key) == value:  # already on in the control: nothing to check
            continue
        checks.append(build_check(key, {key: value}, base_values, closure))
    tile_changes = {k: v for k, v in tuned.items() if is_tile_key(k) and base_values.get(k) != v}
    if tiles == "each":
        checks += [build_check(f"{k}={v}", {k: v}, base_values, closure) for k, v in tile_changes.items()]
    else:
        for contract in ("exact", "rounding"):
            group = {k: v for k, v in tile_changes.items() if contract_of(k) == contract}
            if group:
                checks.append(build_check(f"gmm tiles ({contract})", group, base_values, closure))
    combo = {k: tuned.get(k, FLAGS[k].on) for k in FLAGS if k in base_values}
    combo.update(tile_changes)
    combo.update({k: v for k, v in tuned.items() if is_tuning_key(k)})
    combo = {k: v for k, v in combo.items() if base_values.get(k) != v}
    if combo:
        checks.append(build_check("tuned", combo, base_values, closure))
    return checks


def flag_table_markdown() -> str:
    """The tuning flags as a Markdown table, from their declarations (``docs/design.md`` holds this text verbatim;
    tests/test_docs.py checks it): each non-tile flag on its own row, the GMM tile keys grouped by contract."""
    rows = ["| flag | contract | checked at | reaches | prerequisite rules (`model.rules`) | what |",
            "| --- | --- | --- | --- | --- | --- |"]
    for key, d in FLAGS.items():
        rules = ", ".join(f"`{r}`" for r in d.rules)
        rows.append(f"| `{key}` | {d.contract} | `{d.on}` | `{d.op}` | {rules} | {d.doc.replace('|', '\\|')} |")
    for contract, what in (("exact", "m and n tiles (not the reduction), the rhs buffer count: the same arithmetic "
                                     "re-scheduled"),
                           ("rounding", "k tiles (the GMM's reduction dim): the f32 accumulation re-associated")):
        keys = [k for k, d in TUNING.items() if d.tile and d.contract == contract]
        rules = sorted({r for k in keys for r in TUNING[k].rules})
        rows.append(f"| {', '.join(f'`{k}`' for k in keys)} | {contract} | the config's `[tuned]` value | "
                    f"`moe_mlp` | {', '.join(f'`{r}`' for r in rules)} | {what} |")
    return "\n".join(rows)
