"""The cross-key rules of a (config, flags) pair, each stated once, and the prerequisite closure built on them.

Every rule is a small named check (``RULES``: name -> ``Rule``). All violated rules are collected and raised as ONE
``ConfigError`` listing each, every key named with its value, before anything is traced; ``ConfigError.violations``
keeps them as data (``Violation``: rule, message, the keys it read, and where one exists the setting that would
satisfy it). A rule's ``triggers`` are the tuning flags it is a prerequisite rule of; each tuning flag's declaration
(``model.flags``) names its rules, and this module refuses at import a declared rule that does not exist or a rule a
tuning flag triggers that its declaration does not name.

Checking a flag alone. The candidate "flag X alone" is: the control flags + X's tuned value + the minimal prerequisite
flags that are themselves tuning flags, at their tuned values. It is computed from the rules, not from a second table:
validate the candidate; every violated rule names the keys it reads; each named key that is a tuning flag in [tuned]
(and not chosen by the caller) is set to its tuned value; repeat until valid (``with_prerequisites``). Example on
``tiny``: ``moe_router_grad_from_wo_input`` alone = control + it + ``moe_wo_gmm_fused_dswiglu=True`` +
``wo_tile_dlhs_mlp_dim=128`` (the fused dSwiGLU needs one n tile). A prerequisite that is a control setting
(``fp8_moe_fake_quant`` for ``fp8_fake_quant_hoist=gather8``, ``scan_layers``, the mesh, the remat policy) is never
switched by the closure: the control itself must have it, because the control and the float32 reference run with it
too. That is why the configs' control runs in the trainer's fp8 mode (``fp8_moe_fake_quant = true``). Since the tuned
combination validates at load and every rule names every key it reads, the closure always succeeds for a [tuned] flag
(it ends no later than at the tuned values of the keys those rules read). Where it cannot succeed (a chosen value, or a
control setting, breaks a rule), the refusal names the setting that would satisfy the rule.

Where the mesh is checked: ``ici_fsdp_parallelism * ici_context_parallelism * ici_expert_parallelism`` must equal the
number of devices; that is checked where the mesh is built (``model.sharding.make_mesh``), since the device count is
not part of the config. The VMEM rule asks ``kernels.tiling.check_tiles_fit`` (imported when the rule runs).

Run the tests: ``python -m pytest tests/model/test_config.py -q``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nxgates.model.flags import (
    TILE_KEYS,
    TUNING,
    ConfigError,
    Flags,
    Value,
    format_setting,
    moe_tiles,
    parse_flags,
)

if TYPE_CHECKING:
    from nxgates.model.config import ModelConfig

_FLAG_KEYS = frozenset(f.name for f in dataclasses.fields(Flags))


@dataclass(frozen=True)
class Violation:
    """One violated rule: its name, the message (every key with its value), the keys it read, and ``fix``: settings
    that would satisfy it (empty where no single setting does, e.g. the VMEM budget)."""

    rule: str
    message: str
    keys: tuple[str, ...]
    fix: Mapping[str, Value] = field(default_factory=dict)


@dataclass(frozen=True)
class Rule:
    name: str
    check: Callable[[ModelConfig, Flags], Iterator[Violation]]
    triggers: tuple[str, ...] = ()  # the tuning flags this is a prerequisite rule of


RULES: dict[str, Rule] = {}


def _rule(*triggers: str):
    """Register ``_check_<name>`` as rule ``<name>``, a prerequisite rule of the tuning flags ``triggers``."""

    def deco(fn):
        name = fn.__name__.removeprefix("_check_")
        RULES[name] = Rule(name, fn, tuple(triggers))
        return fn

    return deco


def _get(cfg: ModelConfig, flags: Flags, key: str) -> Value:
    return getattr(flags, key) if key in _FLAG_KEYS else getattr(cfg, key)


def _requires(cfg, flags, rule, trigger: str, ok: bool, need: str, got: tuple[str, ...],
              fix: Mapping[str, Value] | None = None) -> Iterator[Violation]:
    """MaxText style: ``"{trigger}={v} requires {need}; got {k}={v}, ..."``; the keys are the trigger and ``got``."""
    if not ok:
        got_text = ", ".join(format_setting(k, _get(cfg, flags, k)) for k in got)
        message = f"{format_setting(trigger, _get(cfg, flags, trigger))} requires {need}; got {got_text}"
        yield Violation(rule, message, (trigger, *got), dict(fix or {}))


# --- structural rules: tiles within and dividing their dims, the mesh divides the data

_DIM_TILES = tuple(k for k in TILE_KEYS if k.endswith(("_embed_dim", "_mlp_dim")))
_BUFFERS = "wi_tile_fwd_rhs_buffer_count"


def tile_dim(cfg: ModelConfig, flags: Flags, key: str) -> tuple[int, str, tuple[str, ...]]:
    """The dimension the tile ``key`` tiles: (size, how the message names it, the keys it is made of).
    ``*_embed_dim``: hidden_dim; ``wi_*_mlp_dim``: the wi width 2*moe_mlp_dim (wi: [G, hidden_dim, 2F] = [gate | up]);
    ``wo_*_mlp_dim``: moe_mlp_dim; ``*_batch_seq``: the GMM's rows on one device, at most ``moe_rows`` (the device's
    tokens x top_k), which the kernels round up to a multiple of 8 (``kernels.tiling.effective``)."""
    if key.endswith("_embed_dim"):
        return cfg.hidden_dim, format_setting("hidden_dim", cfg.hidden_dim), ("hidden_dim",)
    if key.endswith("_mlp_dim") and key.startswith("wi_"):
        dim = 2 * cfg.moe_mlp_dim
        return dim, f"the wi width 2*moe_mlp_dim={dim} (moe_mlp_dim={cfg.moe_mlp_dim})", ("moe_mlp_dim",)
    if key.endswith("_mlp_dim"):
        return cfg.moe_mlp_dim, format_setting("moe_mlp_dim", cfg.moe_mlp_dim), ("moe_mlp_dim",)
    rows = moe_rows(cfg, flags)
    dim = -(-max(rows, 1) // 8) * 8
    keys = ("batch_size", "seq_len", "top_k", "ici_fsdp_parallelism", "ici_context_parallelism")
    named = [format_setting(k, _get(cfg, flags, k)) for k in keys]
    return dim, (f"the GMM rows of one device, {named[0]} x {named[1]} x {named[2]} / ({named[3]} x {named[4]}) = "
                 f"{rows}, rounded up to 8: {dim}"), keys


@_rule(*TILE_KEYS)
def _check_tile_within_dim(cfg: ModelConfig, flags: Flags) -> Iterator[Violation]:
    """No tile is larger than the dimension it tiles (``tile_dim``). The kernels would clip it to the dimension, so the
    check would run the clipped tile under the name of the value typed: refused instead, naming the largest value."""
    for key in TILE_KEYS:
        tile = getattr(flags, key)
        dim, dim_text, dim_keys = tile_dim(cfg, flags, key)
        if tile > dim:
            yield Violation("tile_within_dim", f"{format_setting(key, tile)} is larger than the dim it tiles, "
                            f"{dim_text}: at most {dim}", (key, *dim_keys), {key: dim})


def rhs_tiles(cfg: ModelConfig, flags: Flags) -> int:
    """The distinct wi tiles the wi forward GMM streams on one device: its experts x k steps x n steps (what
    ``wi_tile_fwd_rhs_buffer_count`` buffers)."""
    k_steps = -(-cfg.hidden_dim // min(flags.wi_tile_fwd_embed_dim, cfg.hidden_dim))
    n_steps = -(-2 * cfg.moe_mlp_dim // min(flags.wi_tile_fwd_mlp_dim, 2 * cfg.moe_mlp_dim))
    return max(cfg.num_experts // flags.ici_expert_parallelism, 1) * k_steps * n_steps


@_rule(_BUFFERS)
def _check_rhs_buffers_within_tiles(cfg: ModelConfig, flags: Flags) -> Iterator[Violation]:
    """``wi_tile_fwd_rhs_buffer_count`` is at most the number of wi tiles the GMM streams (``rhs_tiles``): more
    buffers than tiles buffer nothing (and the VMEM rule alone passes any count where the tiles are small)."""
    n = rhs_tiles(cfg, flags)
    if flags.wi_tile_fwd_rhs_buffer_count > n:
        keys = (_BUFFERS, "num_experts", "ici_expert_parallelism", "hidden_dim", "wi_tile_fwd_embed_dim",
                "moe_mlp_dim", "wi_tile_fwd_mlp_dim")
        got = ", ".join(format_setting(k, _get(cfg, flags, k)) for k in keys[1:])
        yield Violation(
            "rhs_buffers_within_tiles",
            f"{format_setting(_BUFFERS, flags.wi_tile_fwd_rhs_buffer_count)} is more than the {n} wi tiles the wi "
            f"forward GMM streams on one device (experts per device x k steps over hidden_dim x n steps over "
            f"2*moe_mlp_dim; got {got}): at most {n}", keys, {_BUFFERS: n})


@_rule(*_DIM_TILES)
def _check_tile_divides_dim(cfg: ModelConfig, flags: Flags) -> Iterator[Violation]:
    """Every k and n tile divides its dim (``tile_dim``; a larger tile is ``tile_within_dim``'s refusal). m tiles are
    free: the batch*seq rows are ragged per expert and masked at group boundaries."""
    for key in _DIM_TILES:
        tile = getattr(flags, key)
        dim, dim_text, dim_keys = tile_dim(cfg, flags, key)
        if dim % min(tile, dim):
            yield Violation("tile_divides_dim", f"{format_setting(key, tile)} must divide {dim_text}",
                            (key, *dim_keys), {key: dim})


@_rule()
def _check_experts_divisible_by_expert_axis(cfg, flags):
    if cfg.num_experts % flags.ici_expert_parallelism:
        yield Violation(
            "experts_divisible_by_expert_axis",
            f"num_experts={cfg.num_experts} must be divisible by "
            f"ici_expert_parallelism={flags.ici_expert_parallelism} (experts are split over the expert axis)",
            ("num_experts", "ici_expert_parallelism"),
        )


@_rule()
def _check_batch_divisible_by_fsdp(cfg, flags):
    ranks = flags.ici_fsdp_parallelism * flags.ici_expert_parallelism
    if cfg.batch_size % ranks:
        yield Violation(
            "batch_divisible_by_fsdp",
            f"batch_size={cfg.batch_size} must be divisible by ici_fsdp_parallelism x ici_expert_parallelism={ranks} "
            f"(the batch is split over the fsdp and expert axes); got ici_fsdp_parallelism="
            f"{flags.ici_fsdp_parallelism}, ici_expert_parallelism={flags.ici_expert_parallelism}",
            ("batch_size", "ici_fsdp_parallelism", "ici_expert_parallelism"),
        )


@_rule()
def _check_seq_divisible_by_context(cfg, flags):
    c = flags.ici_context_parallelism
    if flags.context_parallel_attention_load_balance and cfg.seq_len % (2 * c):
        yield Violation(
            "seq_divisible_by_context",
            f"context_parallel_attention_load_balance=True requires seq_len divisible by 2*ici_context_parallelism="
            f"{2 * c} (each rank holds chunks i and 2C-1-i); got seq_len={cfg.seq_len}, ici_context_parallelism={c}",
            ("context_parallel_attention_load_balance", "seq_len", "ici_context_parallelism"),
        )
    elif cfg.seq_len % c:
        yield Violation(
            "seq_divisible_by_context",
            f"seq_len={cfg.seq_len} must be divisible by ici_context_parallelism={c} (the sequence is split over it)",
            ("seq_len", "ici_context_parallelism"),
        )


@_rule()
def _check_gdn_cp_whole_chunks(cfg, flags):
    c = flags.ici_context_parallelism
    if flags.gdn_cp_mode == "seq" and cfg.seq_len % (c * cfg.gdn_chunk_size):
        yield Violation(
            "gdn_cp_whole_chunks",
            f"gdn_cp_mode=seq requires seq_len divisible by ici_context_parallelism * gdn_chunk_size = "
            f"{c * cfg.gdn_chunk_size} (each rank holds whole chunks); got seq_len={cfg.seq_len}, "
            f"ici_context_parallelism={c}, gdn_chunk_size={cfg.gdn_chunk_size}",
            ("gdn_cp_mode", "seq_len", "ici_context_parallelism", "gdn_chunk_size"),
        )


@_rule()
def _check_query_proj_device_needs_custom_remat(cfg, flags):
    # Without the custom policy the per-tensor choice would be silently ignored.
    yield from _requires(cfg, flags, "query_proj_device_needs_custom_remat", "query_proj",
                         flags.query_proj == "remat" or flags.remat_policy == "custom",
                         "remat_policy=custom (per-tensor remat choices apply only under it)", ("remat_policy",),
                         {"remat_policy": "custom"})


# --- the tuning flags' prerequisites (each flag's declaration in model.flags names its rules)


@_rule("moe_wi_gmm_fused_swiglu")
def _check_fused_swiglu_tile(cfg, flags):
    # The fused kernel (kernels/gmm swiglu_gmm_call) reads per step tn/2 gate columns and the matching tn/2 up columns
    # (wi = [gate | up], tn the [gate | up] width, clipped to 2F): tn must be even and tn/2 must divide F.
    tn = min(flags.wi_tile_fwd_mlp_dim, 2 * cfg.moe_mlp_dim)
    yield from _requires(cfg, flags, "fused_swiglu_tile", "moe_wi_gmm_fused_swiglu",
                         not flags.moe_wi_gmm_fused_swiglu or (tn % 2 == 0 and cfg.moe_mlp_dim % (tn // 2) == 0),
                         "wi_tile_fwd_mlp_dim (the [gate | up] width of one step) to be even with its half dividing "
                         "moe_mlp_dim", ("wi_tile_fwd_mlp_dim", "moe_mlp_dim"),
                         {"wi_tile_fwd_mlp_dim": 2 * cfg.moe_mlp_dim})


@_rule("moe_wo_gmm_fused_dswiglu")
def _check_fused_dswiglu_one_n_tile(cfg, flags):
    # d_route = rowsum(g * h) needs the whole row of g = dy @ wo^T in one accumulator: one n tile.
    yield from _requires(cfg, flags, "fused_dswiglu_one_n_tile", "moe_wo_gmm_fused_dswiglu",
                         not flags.moe_wo_gmm_fused_dswiglu or flags.wo_tile_dlhs_mlp_dim == cfg.moe_mlp_dim,
                         "wo_tile_dlhs_mlp_dim == moe_mlp_dim (one n tile)", ("wo_tile_dlhs_mlp_dim", "moe_mlp_dim"),
                         {"wo_tile_dlhs_mlp_dim": cfg.moe_mlp_dim})


@_rule("moe_router_grad_from_wo_input")
def _check_router_grad_needs_fused_dswiglu(cfg, flags):
    yield from _requires(cfg, flags, "router_grad_needs_fused_dswiglu", "moe_router_grad_from_wo_input",
                         not flags.moe_router_grad_from_wo_input or flags.moe_wo_gmm_fused_dswiglu,
                         "moe_wo_gmm_fused_dswiglu=True", ("moe_wo_gmm_fused_dswiglu",),
                         {"moe_wo_gmm_fused_dswiglu": True})


@_rule("fp8_fake_quant_hoist")
def _check_gather8_needs_fp8_fake_quant(cfg, flags):
    yield from _requires(cfg, flags, "gather8_needs_fp8_fake_quant", "fp8_fake_quant_hoist",
                         flags.fp8_fake_quant_hoist != "gather8" or flags.fp8_moe_fake_quant,
                         "fp8_moe_fake_quant=True", ("fp8_moe_fake_quant",), {"fp8_moe_fake_quant": True})


@_rule("fp8_fake_quant_hoist")
def _check_gather8_needs_scan_layers(cfg, flags):
    yield from _requires(cfg, flags, "gather8_needs_scan_layers", "fp8_fake_quant_hoist",
                         flags.fp8_fake_quant_hoist != "gather8" or flags.scan_layers,
                         "scan_layers=True (the absmax is hoisted over the stacked layers)", ("scan_layers",),
                         {"scan_layers": True})


_FUSED = ("moe_wi_gmm_fused_swiglu", "moe_wo_gmm_fused_dswiglu", "moe_router_grad_from_wo_input")


@_rule(*TILE_KEYS, "wi_tile_fwd_rhs_buffer_count", *_FUSED)
def _check_tiles_fit_vmem(cfg, flags):
    from nxgates.kernels.tiling import TileError, check_tiles_fit  # lazy: the rules must load without the kernels

    try:
        check_tiles_fit(moe_tiles(flags), _moe_dims(cfg, flags), _CHIP, fused_swiglu=flags.moe_wi_gmm_fused_swiglu,
                        fused_dswiglu=flags.moe_wo_gmm_fused_dswiglu,
                        router_grad_from_wo_input=flags.moe_router_grad_from_wo_input)
    except TileError as e:
        keys = (*TILE_KEYS, "wi_tile_fwd_rhs_buffer_count", *_FUSED)
        settings = ", ".join(format_setting(k, getattr(flags, k)) for k in keys)
        dims = ("hidden_dim", "moe_mlp_dim", "batch_size", "seq_len", "top_k")
        dims_text = ", ".join(format_setting(k, getattr(cfg, k)) for k in dims)
        yield Violation("tiles_fit_vmem", f"the GMM tiles do not fit VMEM: {e}; got {settings}; {dims_text}, "
                        f"ici_fsdp_parallelism={flags.ici_fsdp_parallelism}, "
                        f"ici_context_parallelism={flags.ici_context_parallelism}",
                        (*keys, *dims, "ici_fsdp_parallelism", "ici_context_parallelism"))


def _cp_scan_rules(flag: str) -> None:
    """``gdn_cp_m_scan`` / ``gdn_cp_dh_scan``: the fold scans exist only where GDN splits the sequence over ranks."""

    def seq_mode(cfg, flags):
        yield from _requires(cfg, flags, f"{flag}_needs_seq_mode", flag,
                             not getattr(flags, flag) or flags.gdn_cp_mode == "seq", "gdn_cp_mode=seq",
                             ("gdn_cp_mode",), {"gdn_cp_mode": "seq"})

    def context(cfg, flags):
        yield from _requires(cfg, flags, f"{flag}_needs_context", flag,
                             not getattr(flags, flag) or flags.ici_context_parallelism >= 2,
                             "ici_context_parallelism >= 2", ("ici_context_parallelism",),
                             {"ici_context_parallelism": 2})

    RULES[f"{flag}_needs_seq_mode"] = Rule(f"{flag}_needs_seq_mode", seq_mode, (flag,))
    RULES[f"{flag}_needs_context"] = Rule(f"{flag}_needs_context", context, (flag,))


_cp_scan_rules("gdn_cp_m_scan")
_cp_scan_rules("gdn_cp_dh_scan")

_HOIST = "context_parallel_attention_load_balance_hoist_ids"


@_rule(_HOIST)
def _check_hoist_ids_needs_load_balance(cfg, flags):
    yield from _requires(cfg, flags, "hoist_ids_needs_load_balance", _HOIST,
                         not getattr(flags, _HOIST) or flags.context_parallel_attention_load_balance,
                         "context_parallel_attention_load_balance=True", ("context_parallel_attention_load_balance",),
                         {"context_parallel_attention_load_balance": True})


@_rule(_HOIST)
def _check_hoist_ids_needs_even_context(cfg, flags):
    c = flags.ici_context_parallelism
    yield from _requires(cfg, flags, "hoist_ids_needs_even_context", _HOIST,
                         not getattr(flags, _HOIST) or (c >= 2 and c % 2 == 0),
                         "an even ici_context_parallelism >= 2", ("ici_context_parallelism",),
                         {"ici_context_parallelism": 2})


@_rule(_HOIST)
def _check_hoist_ids_needs_custom_remat(cfg, flags):
    yield from _requires(cfg, flags, "hoist_ids_needs_custom_remat", _HOIST,
                         not getattr(flags, _HOIST) or flags.remat_policy == "custom", "remat_policy=custom",
                         ("remat_policy",), {"remat_policy": "custom"})


@_rule(_HOIST)
def _check_hoist_ids_needs_scan_layers(cfg, flags):
    yield from _requires(cfg, flags, "hoist_ids_needs_scan_layers", _HOIST,
                         not getattr(flags, _HOIST) or flags.scan_layers, "scan_layers=True", ("scan_layers",),
                         {"scan_layers": True})


@_rule("query_proj_kernel_gather_once")
def _check_gather_once_needs_custom_remat(cfg, flags):
    yield from _requires(cfg, flags, "gather_once_needs_custom_remat", "query_proj_kernel_gather_once",
                         not flags.query_proj_kernel_gather_once or flags.remat_policy == "custom",
                         "remat_policy=custom with query_proj=remat", ("remat_policy",), {"remat_policy": "custom"})


@_rule("query_proj_kernel_gather_once")
def _check_gather_once_needs_query_proj_remat(cfg, flags):
    yield from _requires(cfg, flags, "gather_once_needs_query_proj_remat", "query_proj_kernel_gather_once",
                         not flags.query_proj_kernel_gather_once or flags.query_proj == "remat",
                         "remat_policy=custom with query_proj=remat", ("query_proj",), {"query_proj": "remat"})


def check_declarations(tuning=None, rules=None) -> None:
    """Each tuning flag's declared rules exist, and each rule a tuning flag triggers is in its declaration; else
    ``TypeError`` naming the flag and the rule (run at import, so a flag and its rules cannot drift apart)."""
    tuning = TUNING if tuning is None else tuning
    rules = RULES if rules is None else rules
    for key, decl in tuning.items():
        missing = [r for r in decl.rules if r not in rules]
        if missing:
            raise TypeError(f"tuning flag {key!r} declares rules {missing} that model.rules does not define")
    for name, rule in rules.items():
        for key in rule.triggers:
            if key not in tuning:
                raise TypeError(f"rule {name!r} is triggered by {key!r}, which is not a declared tuning flag")
            if name not in tuning[key].rules:
                raise TypeError(f"rule {name!r} is triggered by tuning flag {key!r} but its declaration "
                                f"(model.flags) does not name it: rules={tuning[key].rules}")


check_declarations()

_CHIP = "tpu-v7x"  # the trainer's chip: the VMEM budget the tiles must fit (the tiles are a TPU property)


def moe_rows(cfg: ModelConfig, flags: Flags) -> int:
    """Routed rows (the GMMs' m) per device: the device's tokens (batch over fsdp, sequence over context) x top_k."""
    return cfg.batch_size * cfg.seq_len * cfg.top_k // (flags.ici_fsdp_parallelism * flags.ici_context_parallelism)


def _moe_dims(cfg: ModelConfig, flags: Flags):
    from nxgates.kernels.tiling import MoeDims

    # m only clips the m tile (a tile larger than m costs m rows), so the largest m a device can see is the safe one.
    return MoeDims(rows=max(moe_rows(cfg, flags), 1), embed=cfg.hidden_dim, mlp=cfg.moe_mlp_dim)


def violations(cfg: ModelConfig, flags: Flags) -> tuple[Violation, ...]:
    """Every violated rule, in rule order (empty: the combination is valid)."""
    return tuple(v for rule in RULES.values() for v in rule.check(cfg, flags))


def validate(cfg: ModelConfig, flags: Flags) -> Flags:
    """Raise one ``ConfigError`` listing every violated rule (each names every key with its value); return ``flags``."""
    found = violations(cfg, flags)
    if found:
        lines = "\n".join(f"  - [{v.rule}] {v.message}" for v in found)
        raise ConfigError(f"refused flag combination for config {cfg.name!r} ({len(found)} rule(s)):\n{lines}", found)
    return flags


# ----------------------------------------------------------------------------------------------------------------------
# The prerequisite closure


def flags_for(cfg: ModelConfig, overrides: Mapping[str, str | bool | int] | None = None) -> Flags:
    """The config's control flags with ``overrides`` applied, validated (``ConfigError`` names every key and value)."""
    return validate(cfg, parse_flags(overrides or {}, base=cfg.control))


def tuned_flags(cfg: ModelConfig) -> Flags:
    """The tuned combination: control + every [tuned] value (what the recipe's tuned switch runs), validated."""
    return flags_for(cfg, dict(cfg.tuned))


def _would_satisfy(v: Violation, chosen: Mapping[str, Value]) -> str:
    if not v.fix:
        return "no single setting satisfies it"
    parts = []
    for k, val in v.fix.items():
        if k in chosen:
            where = "instead of the chosen value"
        elif k in TUNING:
            where = "a tuning flag: pass it too, or give it a [tuned] value"
        else:
            where = "a control setting: set it in the config's [flags]"
        parts.append(f"{format_setting(k, val)} ({where})")
    return "would be satisfied by " + ", ".join(parts)


def with_prerequisites(cfg: ModelConfig, overrides: Mapping[str, str | bool | int]) -> dict[str, Value]:
    """``overrides`` plus the tuning flags their rules need, at their [tuned] values (see the module docstring).

    Returns the overrides to apply on the control (the caller's first, then the added prerequisites). Keys the caller
    chose are never changed; control settings are never switched: if a rule still fails, ``ConfigError`` names it and
    the setting that would satisfy it."""
    chosen = {k: getattr(parse_flags({k: v}), k) for k, v in overrides.items()}
    tuned = dict(cfg.tuned)
    added: dict[str, Value] = {}
    while True:
        found = violations(cfg, parse_flags({**chosen, **added}, base=cfg.control))
        if not found:
            return {**chosen, **added}
        fixes = {k: tuned[k] for v in found for k in v.keys if k in tuned and k not in chosen and k not in added}
        if not fixes:
            asked = ", ".join(format_setting(k, v) for k, v in chosen.items())
            lines = "\n".join(f"  - [{v.rule}] {v.message}; {_would_satisfy(v, chosen)}" for v in found)
            raise ConfigError(
                f"{asked} cannot run on config {cfg.name!r}: a rule fails that no tuned flag of this config fixes "
                f"(a control setting must change in its [flags], or the chosen values are wrong):\n{lines}", found)
        added.update(fixes)


def flags_alone(cfg: ModelConfig, key: str) -> Flags:
    """The candidate "tuning flag ``key`` alone": control + its tuned value + its prerequisite tuning flags."""
    tuned = dict(cfg.tuned)
    if key not in tuned:
        raise ConfigError(f"{key!r} has no tuned value in config {cfg.name!r}; its [tuned] flags are {list(tuned)}")
    return flags_for(cfg, with_prerequisites(cfg, {key: tuned[key]}))
