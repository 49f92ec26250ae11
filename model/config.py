"""A config file and the model dimensions: loaded from ``fixtures/configs/<name>.toml``, refused by name when wrong.

- ``ModelConfig``: the frozen model dimensions (each default with its reason; the defaults are the ``tiny`` CPU model),
  plus the config file's control flags (``cfg.control``) and the recipe's tuned values (``cfg.tuned``).
- ``load_config(name)``, ``available_configs()``, ``config_dir()``, ``tuning_flags(cfg)``.

The flags themselves are declared in ``model.flags`` (one declaration per flag, and the parsing of overrides); the
cross-key rules and the prerequisite closure (``validate``, ``flags_for``, ``with_prerequisites``, ``flags_alone``) are
in ``model.rules``.

A config file has three sections:
    [model]   ModelConfig fields (unknown keys refused by name)
    [flags]   the control: production flags with every tuning flag off (tiles, remat policy, mesh, fp8 mode, ...)
    [tuned]   the recipe's tuned value of each tuning flag it changes at this config's shapes (only tuning flags;
              an entry equal to the control is refused: it would check nothing)
At load, the control and the tuned combination (control + every [tuned] entry) must both validate.

Run the tests: ``python -m pytest tests/model/test_config.py -q``.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from nxgates.model.flags import (
    CONTROL_KEYS,
    TUNING_FLAGS,
    ConfigError,
    Flags,
    Value,
    check_flag_value,
    format_setting,
    parse_flags,
    suggest,
)
from nxgates.model.rules import validate

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
            check_flag_value(key, value)

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
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"config {name!r}: {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"config {name!r}: {path} cannot be read ({e.strerror or e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config {name!r}: {path} is not valid TOML: {e}") from None
    for section, value in data.items():
        if section not in _SECTIONS:
            raise ConfigError(f"config {name!r}: unknown section [{section}] in {path}; sections are {_SECTIONS}")
        if not isinstance(value, dict):
            raise ConfigError(f"config {name!r}: {section} = {value!r} in {path} must be a table [{section}]")
    model = dict(data.get("model", {}))
    for key, value in model.items():
        if key not in _MODEL_FIELDS:
            raise ConfigError(f"config {name!r} [model]: unknown key {key!r} (value {value!r}); "
                              f"{suggest(key, _MODEL_FIELDS)}")
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
