"""Flag contracts: which tuning flags the gates know, what each claims, and how a check is built from them.

A flag's contract is ``exact`` (the flag may not change a single bit: N1..N6 demand bit-identity with the control) or
``rounding`` (it may change the numbers by bf16 rounding: the tolerances of ``fixtures/tolerances.toml`` apply).

Prerequisites are not restated here: they are the model's rules (``model.config``). A check "flag X alone" is the
config's control against control + X + the prerequisite tuning flags that the model's closure
(``model.config.with_prerequisites``) adds at their tuned values (``moe_router_grad_from_wo_input`` brings
``moe_wo_gmm_fused_dswiglu`` and its one-n-tile ``wo_tile_dlhs_mlp_dim``); the check's contract is the weakest of every
key the candidate changes. Control settings a flag needs (fp8 mode, scan_layers, remat policy, context parallelism)
are never switched by a check: the config's control carries them, so the control and the reference run with them too.

The GMM tile keys (``{wi,wo}_tile_{fwd,dlhs,drhs}_{batch_seq,embed_dim,mlp_dim}``, ``wi_tile_fwd_rhs_buffer_count``) are
classified by the dimension they tile: a tile of the GMM's reduction dimension re-associates the f32 accumulation
(``rounding``); any other tile, or the buffer count, only re-schedules the same arithmetic (``exact``).

``default_checks(...)`` turns a config's tuned values into ``CheckSpec`` s: every registered flag alone, every changed
tile key alone (or grouped by contract), then the tuned combination.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

Overrides = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class FlagContract:
    key: str
    contract: str  # "exact" | "rounding"
    on_value: Any  # the value that turns it on when the config's [tuned] does not name one
    doc: str


REGISTRY: dict[str, FlagContract] = {
    c.key: c
    for c in (
        FlagContract("moe_wi_gmm_fused_swiglu", "rounding", True,
                     "the wi GMM writes silu(gate) * up from its f32 accumulator (no bf16 gate_up in between)"),
        FlagContract("moe_wo_gmm_fused_dswiglu", "rounding", True,
                     "the wo input-gradient GMM turns its f32 accumulator into d[gate | up] in its epilogue"),
        FlagContract("moe_router_grad_from_wo_input", "rounding", True,
                     "the routing weight's gradient from the fused dSwiGLU epilogue (f32 accumulator)"),
        FlagContract("fp8_fake_quant_hoist", "exact", "gather8",
                     "fp8 absmax hoisted over the layer stack; the all-gathers move fp8 codes + scales"),
        FlagContract("gdn_cp_m_scan", "rounding", True,
                     "a rank's GDN chunk maps folded by one sequential Pallas scan instead of a pairwise tree"),
        FlagContract("gdn_cp_dh_scan", "rounding", True, "the backward twin of gdn_cp_m_scan"),
        FlagContract("context_parallel_attention_load_balance_hoist_ids", "exact", True,
                     "the load-balanced positions / segment ids computed once outside the layer scan"),
        FlagContract("query_proj_kernel_gather_once", "exact", True,
                     "the remat replay keeps the gathered query kernel instead of gathering it again"),
    )
}

_TILE_RE = re.compile(r"^(wi|wo)_tile_(fwd|dlhs|drhs)_(batch_seq|embed_dim|mlp_dim|rhs_buffer_count)$")
# The reduction (k) dimension of each GMM: wi fwd x[m,D] @ wi[D,2F] reduces D; wi dlhs dy[m,2F] @ wi^T reduces F;
# wo fwd h[m,F] @ wo[F,D] reduces F; wo dlhs dy[m,D] @ wo^T reduces D; both drhs (tgmm) reduce over the rows m.
_REDUCTION_DIM = {
    ("wi", "fwd"): "embed_dim", ("wi", "dlhs"): "mlp_dim", ("wi", "drhs"): "batch_seq",
    ("wo", "fwd"): "mlp_dim", ("wo", "dlhs"): "embed_dim", ("wo", "drhs"): "batch_seq",
}


def is_tile_key(key: str) -> bool:
    return _TILE_RE.match(key) is not None


def contract_of(key: str) -> str:
    """The contract of one tuning key; ``KeyError`` for a key that is not a tuning flag."""
    if key in REGISTRY:
        return REGISTRY[key].contract
    m = _TILE_RE.match(key)
    if m is None:
        raise KeyError(key)
    weight, pass_, dim = m.groups()
    return "rounding" if _REDUCTION_DIM[(weight, pass_)] == dim else "exact"


def is_tuning_key(key: str) -> bool:
    return key in REGISTRY or is_tile_key(key)


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
    """Every registered flag alone (its tuned value, else its on value), every tile key the config tunes (``tiles=
    "each"``: one check per key; ``"grouped"``: one check per contract), then the tuned combination (every [tuned]
    value, plus registered flags the config does not tune, at their on value)."""
    if tiles not in ("each", "grouped"):
        raise ValueError(f"default_checks: tiles={tiles!r} must be 'each' or 'grouped'")
    checks = []
    for key, spec in REGISTRY.items():
        if key not in base_values:  # a flag this model does not have
            continue
        value = tuned.get(key, spec.on_value)
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
    combo = {k: tuned.get(k, REGISTRY[k].on_value) for k in REGISTRY if k in base_values}
    combo.update(tile_changes)
    combo.update({k: v for k, v in tuned.items() if is_tuning_key(k)})
    combo = {k: v for k, v in combo.items() if base_values.get(k) != v}
    if combo:
        checks.append(build_check("tuned", combo, base_values, closure))
    return checks
