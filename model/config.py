"""Model config and the trainer's flags: loaded from ``fixtures/configs/<name>.toml``, refused by name when wrong.

What lives here:
- ``ModelConfig``: the frozen model dimensions (each default with its reason; the defaults are the ``tiny`` CPU model),
  plus the config file's control flags (``cfg.control``) and the recipe's tuned values (``cfg.tuned``).
- ``Flags``: the frozen trainer flags, named by the trainer's MaxText keys. Tuning flags default off; the control
  settings (fp8 mode, remat policy, mesh, ...) default to the trainer's defaults and are set per config in ``[flags]``.
- ``parse_flags``: ``{"key": "value"}`` overrides (CLI strings, TOML values) -> ``Flags``; an unknown key or a malformed
  value is a ``ConfigError`` naming the key and the value.
- ``validate``: every cross-key rule (DESIGN.md's flag table plus structural rules) is a small named check. All violated
  rules are collected and raised as ONE ``ConfigError`` listing each, every key named with its value, before anything is
  traced. ``ConfigError.violations`` keeps them as data.
- ``load_config(name)``, ``tuning_flags(cfg)``, ``flags_for(cfg, overrides)``, ``with_prerequisites``, ``flags_alone``,
  ``tuned_flags``: what the gates use.

A config file has three sections:
    [model]   ModelConfig fields (unknown keys refused by name)
    [flags]   the control: production flags with every tuning flag off (tiles, remat policy, mesh, fp8 mode, ...)
    [tuned]   the recipe's tuned value of each tuning flag it changes at this config's shapes (only tuning flags;
              an entry equal to the control is refused: it would check nothing)
At load, the control and the tuned combination (control + every [tuned] entry) must both validate.

Checking a flag alone. The candidate "flag X alone" is: the control flags + X's tuned value + the minimal prerequisite
flags that are themselves tuning flags, at their tuned values. It is computed from the rules, not from a second table:
validate the candidate; every violated rule names the keys it reads; each named key that is a tuning flag in [tuned]
(and not chosen by the caller) is set to its tuned value; repeat until valid. Example on ``tiny``:
``moe_router_grad_from_wo_input`` alone = control + it + ``moe_wo_gmm_fused_dswiglu=True`` +
``wo_tile_dlhs_mlp_dim=128`` (the fused dSwiGLU needs one n tile). A prerequisite that is a control setting
(``fp8_moe_fake_quant`` for ``fp8_fake_quant_hoist=gather8``, ``scan_layers``, the mesh, the remat policy) is never
switched by the closure: the control itself must have it, because the control and the float32 reference run with it
too. That is why the configs' control runs in the trainer's fp8 mode (``fp8_moe_fake_quant = true``). Since the tuned
combination validates at load and every rule names every key it reads, the closure always succeeds for a [tuned] flag
(it ends no later than at the tuned values of the keys those rules read).

Where the mesh is checked: ``ici_fsdp_parallelism * ici_context_parallelism * ici_expert_parallelism`` must equal the
number of devices; that is checked where the mesh is built (``model.sharding.make_mesh``), since the device count is
not part of the config. The VMEM rule asks ``kernels.tiling.check_tiles_fit`` (imported when ``validate`` runs).

Run the tests: ``python -m pytest tests/model/test_config.py -q``.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tomllib
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Value = bool | int | str | float | tuple


class ConfigError(ValueError):
    """A refused config, flag or flag combination. ``violations`` holds each violated rule (empty for parse errors)."""

    def __init__(self, message: str, violations: tuple[Violation, ...] = ()):
        super().__init__(message)
        self.violations = violations


def format_setting(key: str, value: Value) -> str:
    """``key=value`` as the CLI spells it (``fp8_fake_quant_hoist=gather8``, ``scan_layers=True``)."""
    return f"{key}={value}"


def _suggest(key: str, valid: typing.Iterable[str]) -> str:
    valid = sorted(valid)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]!r}?"
    return "valid keys: " + ", ".join(valid)


# ----------------------------------------------------------------------------------------------------------------------
# Flags


_MLP_TILE_DEFAULT = 1024  # MaxText's default GMM tile for the embed and MLP dims
_M_TILE_DEFAULT = 512  # MaxText's default GMM tile for the batch*seq (m) dim

_GMMS = ("wi_tile_fwd", "wi_tile_dlhs", "wi_tile_drhs", "wo_tile_fwd", "wo_tile_dlhs", "wo_tile_drhs")
TILE_KEYS: tuple[str, ...] = tuple(f"{g}_{d}" for g in _GMMS for d in ("batch_seq", "embed_dim", "mlp_dim"))


def _tuning(default: Value) -> Value:
    return field(default=default, metadata={"tuning": True})


@dataclass(frozen=True)
class Flags:
    """The trainer's flags (MaxText key names). Tuning flags (``TUNING_FLAGS``) default off; the rest is the control."""

    # --- MoE kernel fusions (tuning, contract "rounding"): off is the unfused baseline the trainer runs by default.
    moe_wi_gmm_fused_swiglu: bool = _tuning(False)
    moe_wo_gmm_fused_dswiglu: bool = _tuning(False)
    moe_router_grad_from_wo_input: bool = _tuning(False)
    # --- fp8: the trainer's fp8 mode is a control setting (control and reference run with it); the hoist is tuning.
    fp8_moe_fake_quant: bool = False  # off: bf16 experts are the plain production default
    fp8_fake_quant_hoist: Literal["none", "gather8"] = _tuning("none")  # "none": quantize per layer after the gather
    # --- layers and rematerialization (control).
    scan_layers: bool = True  # MaxText's default: layers are stacked and run under jax.lax.scan
    remat_policy: Literal["full", "minimal", "custom"] = "full"  # MaxText's default: recompute everything
    query_proj: Literal["remat", "device"] = "remat"  # per-tensor choice of remat_policy=custom; MaxText's default
    query_proj_kernel_gather_once: bool = _tuning(False)
    # --- context parallelism (control: mode and load balance; tuning: the scans and the hoisted ids).
    gdn_cp_mode: Literal["seq", "none"] = "none"  # "none": GDN does not split the sequence (single-rank default)
    gdn_cp_m_scan: bool = _tuning(False)
    gdn_cp_dh_scan: bool = _tuning(False)
    context_parallel_attention_load_balance: bool = False  # off: plain contiguous slices (single-rank default)
    context_parallel_attention_load_balance_hoist_ids: bool = _tuning(False)
    # --- mesh ("fsdp", "context", "expert"); 1 each: a single device. The product is checked in model.sharding.
    ici_fsdp_parallelism: int = 1
    ici_context_parallelism: int = 1
    ici_expert_parallelism: int = 1
    # --- GMM tiles (tuning; m and n tiles "exact", k tiles "rounding"): MaxText's defaults, m = batch*seq rows.
    wi_tile_fwd_batch_seq: int = _tuning(_M_TILE_DEFAULT)
    wi_tile_fwd_embed_dim: int = _tuning(_MLP_TILE_DEFAULT)
    wi_tile_fwd_mlp_dim: int = _tuning(_MLP_TILE_DEFAULT)
    wi_tile_dlhs_batch_seq: int = _tuning(_M_TILE_DEFAULT)
    wi_tile_dlhs_embed_dim: int = _tuning(_MLP_TILE_DEFAULT)
    wi_tile_dlhs_mlp_dim: int = _tuning(_MLP_TILE_DEFAULT)
    wi_tile_drhs_batch_seq: int = _tuning(_M_TILE_DEFAULT)
    wi_tile_drhs_embed_dim: int = _tuning(_MLP_TILE_DEFAULT)
    wi_tile_drhs_mlp_dim: int = _tuning(_MLP_TILE_DEFAULT)
    wo_tile_fwd_batch_seq: int = _tuning(_M_TILE_DEFAULT)
    wo_tile_fwd_embed_dim: int = _tuning(_MLP_TILE_DEFAULT)
    wo_tile_fwd_mlp_dim: int = _tuning(_MLP_TILE_DEFAULT)
    wo_tile_dlhs_batch_seq: int = _tuning(_M_TILE_DEFAULT)
    wo_tile_dlhs_embed_dim: int = _tuning(_MLP_TILE_DEFAULT)
    wo_tile_dlhs_mlp_dim: int = _tuning(_MLP_TILE_DEFAULT)
    wo_tile_drhs_batch_seq: int = _tuning(_M_TILE_DEFAULT)
    wo_tile_drhs_embed_dim: int = _tuning(_MLP_TILE_DEFAULT)
    wo_tile_drhs_mlp_dim: int = _tuning(_MLP_TILE_DEFAULT)
    wi_tile_fwd_rhs_buffer_count: int = _tuning(2)  # Pallas' default double buffering of the streamed wi tile

    def __post_init__(self):
        for key, value in dataclasses.asdict(self).items():
            _check_flag_value(key, value)

    def changed(self, base: Flags) -> dict[str, Value]:
        """The keys whose value differs from ``base``, with this object's values (e.g. the candidate vs the control)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if getattr(base, k) != v}


_FLAG_FIELDS = {f.name: f for f in dataclasses.fields(Flags)}
_FLAG_TYPES = typing.get_type_hints(Flags)
FLAG_KEYS: tuple[str, ...] = tuple(_FLAG_FIELDS)
TUNING_FLAGS: tuple[str, ...] = tuple(k for k, f in _FLAG_FIELDS.items() if f.metadata.get("tuning"))
CONTROL_KEYS: tuple[str, ...] = tuple(k for k in FLAG_KEYS if k not in TUNING_FLAGS)


def flag_kind(key: str) -> str:
    """``"bool"``, ``"positive int"`` or ``"one of a|b"``: what a flag accepts (for messages and ``list-flags``)."""
    t = _FLAG_TYPES[key]
    if t is bool:
        return "bool"
    if t is int:
        return "positive int"
    return "one of " + "|".join(typing.get_args(t))


def _check_flag_value(key: str, value: object) -> None:
    t = _FLAG_TYPES[key]
    if t is bool:
        ok = isinstance(value, bool)
    elif t is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    else:
        ok = value in typing.get_args(t)
    if not ok:
        raise ConfigError(f"{format_setting(key, value)} is malformed: {key} expects {flag_kind(key)}, got {value!r}")


_TRUE = ("true", "1")
_FALSE = ("false", "0")


def _coerce(key: str, value: object) -> Value:
    """A CLI string or TOML value -> the flag's type; anything else is a ConfigError naming key and value."""
    t = _FLAG_TYPES[key]
    if t is bool and isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    if t is bool and type(value) is int and value in (0, 1):
        return bool(value)
    coerced = int(value.strip()) if t is int and isinstance(value, str) and value.strip().isdigit() else value
    try:
        _check_flag_value(key, coerced)
    except ConfigError:  # name the value as it was given ("0", not 0)
        raise ConfigError(
            f"{format_setting(key, value)} is malformed: {key} expects {flag_kind(key)}, got {value!r}"
        ) from None
    return coerced


def parse_flags(overrides: Mapping[str, str | bool | int], base: Flags | None = None) -> Flags:
    """Apply ``overrides`` on ``base`` (default ``Flags()``). Booleans accept ``true/false/1/0`` (any case); ints accept
    decimal strings; enums their exact choice. Unknown key or malformed value -> ``ConfigError`` naming it.
    No cross-key rule is checked here: call ``validate`` (or use ``flags_for``)."""
    base = Flags() if base is None else base
    parsed = {}
    for key, value in overrides.items():
        if key not in _FLAG_FIELDS:
            raise ConfigError(f"unknown flag {key!r} (value {value!r}); {_suggest(key, FLAG_KEYS)}")
        parsed[key] = _coerce(key, value)
    return dataclasses.replace(base, **parsed)


def moe_tiles(flags: Flags):
    """The ``kernels.tiling.MoeTiles`` of these flags (its fields are the trainer's tile keys)."""
    from nxgates.kernels.tiling import MoeTiles  # lazy: the config must load without the kernels

    return MoeTiles(**{f.name: getattr(flags, f.name) for f in dataclasses.fields(MoeTiles)})


# ----------------------------------------------------------------------------------------------------------------------
# ModelConfig

LAYER_KINDS = ("gdn", "attention")


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions of the small Qwen3.5-style model. Defaults are ``tiny`` (CPU): see fixtures/configs/tiny.toml."""

    name: str = "custom"  # set by load_config to the file's name; recorded in run metadata
    # --- trunk
    hidden_dim: int = 256  # small enough for 2 CPU cores, a multiple of 128 (TPU lane width) like the trainer's
    num_layers: int = 4  # one period of the layer pattern: every layer kind, scanned as one stacked group
    layer_pattern: tuple[str, ...] = ("gdn", "gdn", "gdn", "attention")  # the trainer's: full attention every 4th layer
    vocab_size: int = 512  # the LM head is not under test; small keeps the log-softmax cheap
    seq_len: int = 512  # 2 context ranks x 4 GDN chunks of 64: the CP fold sees more than one chunk per rank
    batch_size: int = 4  # divisible by the fsdp axis (2) of the default 2x2x2 mesh
    # --- MoE (routed SwiGLU experts through the GMM, plus a sigmoid-gated shared expert)
    num_experts: int = 8  # 4 per expert rank on a 2-way expert axis: the GMM sees several groups
    top_k: int = 2  # > 1 so the renormalized routing weights and d_route matter
    moe_mlp_dim: int = 128  # F: wi is [G, hidden_dim, 2F], wo [G, F, hidden_dim]; one 128 lane tile
    shared_expert_mlp_dim: int = 128  # the shared expert's F (the trainer's equals the routed one)
    # --- Gated DeltaNet
    gdn_num_key_heads: int = 2  # q/k heads; value heads are grouped over them like GQA
    gdn_num_value_heads: int = 4  # 2 value heads per key head, as the trainer's 64/16 ratio keeps grouping non-trivial
    gdn_key_dim: int = 64  # per head; the chunk kernels' K
    gdn_value_dim: int = 64  # per head; the chunk kernels' V
    gdn_conv_kernel: int = 4  # the short causal depthwise conv of q, k, v (Qwen3-Next uses 4)
    gdn_chunk_size: int = 64  # the chunked form's C: the trainer's and fla's default
    # --- gated attention (q projection also yields a sigmoid output gate)
    attn_num_q_heads: int = 4
    attn_num_kv_heads: int = 2  # GQA: 2 q heads per kv head
    attn_head_dim: int = 64
    partial_rotary_fraction: float = 0.25  # Qwen3-Next rotates a quarter of each head
    rope_theta: float = 10_000_000.0  # Qwen3-Next's long-context base
    # --- numerics and init
    rms_eps: float = 1e-6  # Qwen's RMSNorm epsilon
    init_scale: float = 0.02  # std of the normal init of projections (GPT-2 / MaxText convention)
    # --- the config file's flags (not read by the model: the model gets its flags explicitly)
    control: Flags = field(default_factory=Flags, repr=False)  # [flags]: the control run's flags
    tuned: tuple[tuple[str, Value], ...] = field(default=(), repr=False)  # [tuned]: (key, tuned value) pairs

    def __post_init__(self):
        ints = [f.name for f in dataclasses.fields(self) if f.type in ("int", int)]
        for key in ints:
            value = getattr(self, key)
            if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise ConfigError(f"{key}={value!r} must be a positive int")
        for key in ("partial_rotary_fraction", "rope_theta", "rms_eps", "init_scale"):
            value = getattr(self, key)
            if not (isinstance(value, int | float) and not isinstance(value, bool) and value > 0):
                raise ConfigError(f"{key}={value!r} must be a positive number")
        if not isinstance(self.layer_pattern, tuple) or not self.layer_pattern:
            raise ConfigError(f"layer_pattern={self.layer_pattern!r} must be a non-empty tuple of {LAYER_KINDS}")
        for kind in self.layer_pattern:
            if kind not in LAYER_KINDS:
                raise ConfigError(f"layer_pattern={self.layer_pattern!r}: {kind!r} is not one of {LAYER_KINDS}")
        rules = [
            (self.num_layers % len(self.layer_pattern) == 0,
             f"num_layers={self.num_layers} must be a multiple of len(layer_pattern)={len(self.layer_pattern)}"),
            (self.top_k <= self.num_experts, f"top_k={self.top_k} must be <= num_experts={self.num_experts}"),
            (self.gdn_num_value_heads % self.gdn_num_key_heads == 0,
             f"gdn_num_value_heads={self.gdn_num_value_heads} must be a multiple of "
             f"gdn_num_key_heads={self.gdn_num_key_heads}"),
            (self.attn_num_q_heads % self.attn_num_kv_heads == 0,
             f"attn_num_q_heads={self.attn_num_q_heads} must be a multiple of "
             f"attn_num_kv_heads={self.attn_num_kv_heads}"),
            (self.partial_rotary_fraction <= 1,
             f"partial_rotary_fraction={self.partial_rotary_fraction} must be in (0, 1]"),
            (self.rotary_dim >= 2 and self.rotary_dim % 2 == 0,
             f"rotary dim int(attn_head_dim * partial_rotary_fraction) = {self.rotary_dim} must be even and >= 2; "
             f"got attn_head_dim={self.attn_head_dim}, partial_rotary_fraction={self.partial_rotary_fraction}"),
        ]
        errors = [msg for ok, msg in rules if not ok]
        if errors:
            raise ConfigError("invalid model config:\n  " + "\n  ".join(errors))
        if not isinstance(self.control, Flags):
            raise ConfigError(f"control={self.control!r} must be a Flags")
        for key, value in self.tuned:
            if key not in TUNING_FLAGS:
                raise ConfigError(f"tuned entry {format_setting(key, value)}: {key} is not a tuning flag")
            _check_flag_value(key, value)

    @property
    def rotary_dim(self) -> int:
        """Rotated channels per attention head (the first ``rotary_dim`` of ``attn_head_dim``)."""
        return int(self.attn_head_dim * self.partial_rotary_fraction)

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """The kind of each of the ``num_layers`` layers: the pattern repeated."""
        return self.layer_pattern * (self.num_layers // len(self.layer_pattern))


_MODEL_FIELDS = {f.name: f for f in dataclasses.fields(ModelConfig) if f.name not in ("name", "control", "tuned")}


# ----------------------------------------------------------------------------------------------------------------------
# Cross-key rules


@dataclass(frozen=True)
class Violation:
    """One violated rule: its name, the message (every key with its value), and the keys it read."""

    rule: str
    message: str
    keys: tuple[str, ...]


_RuleFn = Callable[[ModelConfig, Flags], Iterator[Violation]]
RULES: dict[str, _RuleFn] = {}


def _rule(fn: _RuleFn) -> _RuleFn:
    RULES[fn.__name__.removeprefix("_check_")] = fn
    return fn


def _get(cfg: ModelConfig, flags: Flags, key: str) -> Value:
    return getattr(flags, key) if key in _FLAG_FIELDS else getattr(cfg, key)


def _requires(cfg, flags, rule, trigger: str, ok: bool, need: str, got: tuple[str, ...]) -> Iterator[Violation]:
    """MaxText style: ``"{trigger}={v} requires {need}; got {k}={v}, ..."``; the keys are the trigger and ``got``."""
    if not ok:
        got_text = ", ".join(format_setting(k, _get(cfg, flags, k)) for k in got)
        message = f"{format_setting(trigger, _get(cfg, flags, trigger))} requires {need}; got {got_text}"
        yield Violation(rule, message, (trigger, *got))


# --- structural rules: tiles divide their dims, the mesh divides the data


@_rule
def _check_tile_divides_dim(cfg: ModelConfig, flags: Flags) -> Iterator[Violation]:
    """Every k and n tile (clipped to its dim) divides its dim: ``*_embed_dim`` tiles divide hidden_dim,
    ``wi_*_mlp_dim`` the wi width 2*moe_mlp_dim (wi: [G, hidden_dim, 2F] = [gate | up]), ``wo_*_mlp_dim`` moe_mlp_dim.
    m tiles are free: the batch*seq rows are ragged per expert and masked at group boundaries."""
    for key in TILE_KEYS:
        tile = getattr(flags, key)  # a tile larger than its dim is clipped to it (kernels.tiling.effective)
        if key.endswith("_embed_dim"):
            dim, dim_text = cfg.hidden_dim, format_setting("hidden_dim", cfg.hidden_dim)
        elif key.startswith("wi_") and key.endswith("_mlp_dim"):
            dim = 2 * cfg.moe_mlp_dim
            dim_text = f"the wi width 2*moe_mlp_dim={dim} (moe_mlp_dim={cfg.moe_mlp_dim})"
        elif key.endswith("_mlp_dim"):
            dim, dim_text = cfg.moe_mlp_dim, format_setting("moe_mlp_dim", cfg.moe_mlp_dim)
        else:
            continue
        if dim % min(tile, dim):
            dim_key = "hidden_dim" if key.endswith("_embed_dim") else "moe_mlp_dim"
            yield Violation("tile_divides_dim", f"{format_setting(key, tile)} must divide {dim_text}", (key, dim_key))


@_rule
def _check_experts_divisible_by_expert_axis(cfg, flags):
    if cfg.num_experts % flags.ici_expert_parallelism:
        yield Violation(
            "experts_divisible_by_expert_axis",
            f"num_experts={cfg.num_experts} must be divisible by "
            f"ici_expert_parallelism={flags.ici_expert_parallelism} (experts are split over the expert axis)",
            ("num_experts", "ici_expert_parallelism"),
        )


@_rule
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


@_rule
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


@_rule
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


@_rule
def _check_query_proj_device_needs_custom_remat(cfg, flags):
    # Without the custom policy the per-tensor choice would be silently ignored.
    yield from _requires(cfg, flags, "query_proj_device_needs_custom_remat", "query_proj",
                         flags.query_proj == "remat" or flags.remat_policy == "custom",
                         "remat_policy=custom (per-tensor remat choices apply only under it)", ("remat_policy",))


# --- DESIGN.md's flag prerequisites


@_rule
def _check_fused_swiglu_tile(cfg, flags):
    # The fused kernel (kernels/gmm swiglu_gmm_call) reads per step tn/2 gate columns and the matching tn/2 up columns
    # (wi = [gate | up], tn the [gate | up] width, clipped to 2F): tn must be even and tn/2 must divide F.
    tn = min(flags.wi_tile_fwd_mlp_dim, 2 * cfg.moe_mlp_dim)
    yield from _requires(cfg, flags, "fused_swiglu_tile", "moe_wi_gmm_fused_swiglu",
                         not flags.moe_wi_gmm_fused_swiglu or (tn % 2 == 0 and cfg.moe_mlp_dim % (tn // 2) == 0),
                         "wi_tile_fwd_mlp_dim (the [gate | up] width of one step) to be even with its half dividing "
                         "moe_mlp_dim", ("wi_tile_fwd_mlp_dim", "moe_mlp_dim"))


@_rule
def _check_fused_dswiglu_one_n_tile(cfg, flags):
    # d_route = rowsum(g * h) needs the whole row of g = dy @ wo^T in one accumulator: one n tile.
    yield from _requires(cfg, flags, "fused_dswiglu_one_n_tile", "moe_wo_gmm_fused_dswiglu",
                         not flags.moe_wo_gmm_fused_dswiglu or flags.wo_tile_dlhs_mlp_dim == cfg.moe_mlp_dim,
                         "wo_tile_dlhs_mlp_dim == moe_mlp_dim (one n tile)", ("wo_tile_dlhs_mlp_dim", "moe_mlp_dim"))


@_rule
def _check_router_grad_needs_fused_dswiglu(cfg, flags):
    yield from _requires(cfg, flags, "router_grad_needs_fused_dswiglu", "moe_router_grad_from_wo_input",
                         not flags.moe_router_grad_from_wo_input or flags.moe_wo_gmm_fused_dswiglu,
                         "moe_wo_gmm_fused_dswiglu=True", ("moe_wo_gmm_fused_dswiglu",))


@_rule
def _check_gather8_needs_fp8_fake_quant(cfg, flags):
    yield from _requires(cfg, flags, "gather8_needs_fp8_fake_quant", "fp8_fake_quant_hoist",
                         flags.fp8_fake_quant_hoist != "gather8" or flags.fp8_moe_fake_quant,
                         "fp8_moe_fake_quant=True", ("fp8_moe_fake_quant",))


@_rule
def _check_gather8_needs_scan_layers(cfg, flags):
    yield from _requires(cfg, flags, "gather8_needs_scan_layers", "fp8_fake_quant_hoist",
                         flags.fp8_fake_quant_hoist != "gather8" or flags.scan_layers,
                         "scan_layers=True (the absmax is hoisted over the stacked layers)", ("scan_layers",))


@_rule
def _check_tiles_fit_vmem(cfg, flags):
    from nxgates.kernels.tiling import TileError, check_tiles_fit  # lazy: the config must load without the kernels

    fused = ("moe_wi_gmm_fused_swiglu", "moe_wo_gmm_fused_dswiglu", "moe_router_grad_from_wo_input")
    try:
        check_tiles_fit(moe_tiles(flags), _moe_dims(cfg, flags), _CHIP, fused_swiglu=flags.moe_wi_gmm_fused_swiglu,
                        fused_dswiglu=flags.moe_wo_gmm_fused_dswiglu,
                        router_grad_from_wo_input=flags.moe_router_grad_from_wo_input)
    except TileError as e:
        keys = (*TILE_KEYS, "wi_tile_fwd_rhs_buffer_count", *fused)
        settings = ", ".join(format_setting(k, getattr(flags, k)) for k in keys)
        dims = ("hidden_dim", "moe_mlp_dim", "batch_size", "seq_len", "top_k")
        dims_text = ", ".join(format_setting(k, getattr(cfg, k)) for k in dims)
        yield Violation("tiles_fit_vmem", f"the GMM tiles do not fit VMEM: {e}; got {settings}; {dims_text}, "
                        f"ici_fsdp_parallelism={flags.ici_fsdp_parallelism}, "
                        f"ici_context_parallelism={flags.ici_context_parallelism}",
                        (*keys, *dims, "ici_fsdp_parallelism", "ici_context_parallelism"))


for _flag in ("gdn_cp_m_scan", "gdn_cp_dh_scan"):

    def _seq_mode(cfg, flags, _flag=_flag):
        yield from _requires(cfg, flags, f"{_flag}_needs_seq_mode", _flag,
                             not getattr(flags, _flag) or flags.gdn_cp_mode == "seq", "gdn_cp_mode=seq",
                             ("gdn_cp_mode",))

    def _context(cfg, flags, _flag=_flag):
        yield from _requires(cfg, flags, f"{_flag}_needs_context", _flag,
                             not getattr(flags, _flag) or flags.ici_context_parallelism >= 2,
                             "ici_context_parallelism >= 2", ("ici_context_parallelism",))

    RULES[f"{_flag}_needs_seq_mode"] = _seq_mode
    RULES[f"{_flag}_needs_context"] = _context

_HOIST = "context_parallel_attention_load_balance_hoist_ids"


@_rule
def _check_hoist_ids_needs_load_balance(cfg, flags):
    yield from _requires(cfg, flags, "hoist_ids_needs_load_balance", _HOIST,
                         not getattr(flags, _HOIST) or flags.context_parallel_attention_load_balance,
                         "context_parallel_attention_load_balance=True", ("context_parallel_attention_load_balance",))


@_rule
def _check_hoist_ids_needs_even_context(cfg, flags):
    c = flags.ici_context_parallelism
    yield from _requires(cfg, flags, "hoist_ids_needs_even_context", _HOIST,
                         not getattr(flags, _HOIST) or (c >= 2 and c % 2 == 0),
                         "an even ici_context_parallelism >= 2", ("ici_context_parallelism",))


@_rule
def _check_hoist_ids_needs_custom_remat(cfg, flags):
    yield from _requires(cfg, flags, "hoist_ids_needs_custom_remat", _HOIST,
                         not getattr(flags, _HOIST) or flags.remat_policy == "custom", "remat_policy=custom",
                         ("remat_policy",))


@_rule
def _check_hoist_ids_needs_scan_layers(cfg, flags):
    yield from _requires(cfg, flags, "hoist_ids_needs_scan_layers", _HOIST,
                         not getattr(flags, _HOIST) or flags.scan_layers, "scan_layers=True", ("scan_layers",))


@_rule
def _check_gather_once_needs_custom_remat(cfg, flags):
    yield from _requires(cfg, flags, "gather_once_needs_custom_remat", "query_proj_kernel_gather_once",
                         not flags.query_proj_kernel_gather_once or flags.remat_policy == "custom",
                         "remat_policy=custom with query_proj=remat", ("remat_policy",))


@_rule
def _check_gather_once_needs_query_proj_remat(cfg, flags):
    yield from _requires(cfg, flags, "gather_once_needs_query_proj_remat", "query_proj_kernel_gather_once",
                         not flags.query_proj_kernel_gather_once or flags.query_proj == "remat",
                         "remat_policy=custom with query_proj=remat", ("query_proj",))


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
    return tuple(v for fn in RULES.values() for v in fn(cfg, flags))


def validate(cfg: ModelConfig, flags: Flags) -> Flags:
    """Raise one ``ConfigError`` listing every violated rule (each names every key with its value); return ``flags``."""
    found = violations(cfg, flags)
    if found:
        lines = "\n".join(f"  - [{v.rule}] {v.message}" for v in found)
        raise ConfigError(f"refused flag combination for config {cfg.name!r} ({len(found)} rule(s)):\n{lines}", found)
    return flags


# ----------------------------------------------------------------------------------------------------------------------
# Config files


def config_dir() -> Path:
    """``$NXGATES_CONFIG_DIR`` if set, else ``fixtures/configs`` of the repository holding this package."""
    env = os.environ.get("NXGATES_CONFIG_DIR")
    from nxgates import fixtures

    return Path(env) if env else fixtures.CONFIGS


def available_configs() -> tuple[str, ...]:
    d = config_dir()
    return tuple(sorted(p.stem for p in d.glob("*.toml"))) if d.is_dir() else ()


_SECTIONS = ("model", "flags", "tuned")


def load_config(name: str) -> ModelConfig:
    """Load ``fixtures/configs/<name>.toml`` (or a path to a .toml file). Refused with ``ConfigError``: an unknown name
    (the message lists the available ones), an unknown section or key (named), a malformed value, a control or tuned
    combination that does not validate, a [tuned] entry that is not a tuning flag or equals the control."""
    path = Path(name) if name.endswith(".toml") else config_dir() / f"{name}.toml"
    if not path.is_file():
        raise ConfigError(f"unknown config {name!r}: available configs are {list(available_configs())} "
                          f"(in {config_dir()})")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config {name!r}: {path} is not valid TOML: {e}") from None
    for section in data:
        if section not in _SECTIONS:
            raise ConfigError(f"config {name!r}: unknown section [{section}] in {path}; sections are {_SECTIONS}")
    model = dict(data.get("model", {}))
    for key, value in model.items():
        if key not in _MODEL_FIELDS:
            raise ConfigError(f"config {name!r} [model]: unknown key {key!r} (value {value!r}); "
                              f"{_suggest(key, _MODEL_FIELDS)}")
        if key == "layer_pattern" and isinstance(value, list):
            model[key] = tuple(value)
    try:
        control = parse_flags(data.get("flags", {}))
    except ConfigError as e:
        raise ConfigError(f"config {name!r} [flags]: {e}") from None
    tuned = {}
    for key, value in data.get("tuned", {}).items():
        if key in CONTROL_KEYS:
            raise ConfigError(f"config {name!r} [tuned]: {format_setting(key, value)}: {key} is a control setting, "
                              "not a tuning flag; set it in [flags] (the control and the reference run with it)")
        try:
            tuned[key] = getattr(parse_flags({key: value}), key)
        except ConfigError as e:
            raise ConfigError(f"config {name!r} [tuned]: {e}") from None
        if tuned[key] == getattr(control, key):
            raise ConfigError(f"config {name!r} [tuned]: {format_setting(key, tuned[key])} equals the control's "
                              f"value: a tuned entry must change something; remove it")
    cfg = ModelConfig(name=path.stem, control=control, tuned=tuple(tuned.items()), **model)
    tuned_combination = parse_flags(tuned, base=control)
    for what, flags in (("[flags] (the control)", control), ("[tuned] (the tuned combination)", tuned_combination)):
        try:
            validate(cfg, flags)
        except ConfigError as e:
            raise ConfigError(f"config {name!r} {what}: {e}", e.violations) from None
    return cfg


def tuning_flags(cfg: ModelConfig) -> dict[str, Value]:
    """Each tuning flag the recipe changes at this config's shapes -> its tuned value ([tuned], file order)."""
    return dict(cfg.tuned)


def flags_for(cfg: ModelConfig, overrides: Mapping[str, str | bool | int] | None = None) -> Flags:
    """The config's control flags with ``overrides`` applied, validated (``ConfigError`` names every key and value)."""
    return validate(cfg, parse_flags(overrides or {}, base=cfg.control))


def tuned_flags(cfg: ModelConfig) -> Flags:
    """The tuned combination: control + every [tuned] value (what the recipe's tuned switch runs), validated."""
    return flags_for(cfg, tuning_flags(cfg))


def with_prerequisites(cfg: ModelConfig, overrides: Mapping[str, str | bool | int]) -> dict[str, Value]:
    """``overrides`` plus the tuning flags their rules need, at their [tuned] values (see the module docstring).

    Returns the overrides to apply on the control (the caller's first, then the added prerequisites). Keys the caller
    chose are never changed; control settings are never switched: if a rule still fails, ``ConfigError`` names it."""
    chosen = {k: getattr(parse_flags({k: v}), k) for k, v in overrides.items()}
    tuned = tuning_flags(cfg)
    added: dict[str, Value] = {}
    while True:
        found = violations(cfg, parse_flags({**chosen, **added}, base=cfg.control))
        if not found:
            return {**chosen, **added}
        fixes = {k: tuned[k] for v in found for k in v.keys if k in tuned and k not in chosen and k not in added}
        if not fixes:
            asked = ", ".join(format_setting(k, v) for k, v in chosen.items())
            lines = "\n".join(f"  - [{v.rule}] {v.message}" for v in found)
            raise ConfigError(
                f"{asked} cannot run on config {cfg.name!r}: a rule fails that no tuned flag of this config fixes "
                f"(a control setting must change in its [flags], or the chosen values are wrong):\n{lines}", found)
        added.update(fixes)


def flags_alone(cfg: ModelConfig, key: str) -> Flags:
    """The candidate "tuning flag ``key`` alone": control + its tuned value + its prerequisite tuning flags."""
    tuned = tuning_flags(cfg)
    if key not in tuned:
        raise ConfigError(f"{key!r} has no tuned value in config {cfg.name!r}; its [tuned] flags are {list(tuned)}")
    return flags_for(cfg, with_prerequisites(cfg, {key: tuned[key]}))
