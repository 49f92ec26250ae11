"""The trainer's flags: ONE declaration per flag, and the parsing of ``key=value`` overrides.

``Flags`` is the frozen dataclass of the trainer's flags, named by its MaxText keys. A field is either

- a control setting (fp8 mode, remat policy, mesh, ...): a plain default, set per config in ``[flags]``; or
- a tuning flag: ``tuning(...)`` / ``tile(...)`` declare, in the one place, its control value (the default), its
  contract (``exact``: may not change a bit; ``rounding``: may change the numbers by bf16 rounding), a one-line
  description, the model rules it triggers (``model.rules``) and the op of ``model.ops`` it reaches.

Everything else derives from these declarations: ``TUNING`` (name -> ``TuningFlag``), ``TUNING_FLAGS``,
``CONTROL_KEYS``, the gates' contracts and default checks (``gates.contracts``) and ``nxgates list-flags``. A tuning
flag declared without a valid contract, description or op is refused when this module is imported
(``FlagDeclarationError``); ``model.rules`` refuses, at its import, a rule name a declaration names but no rule has,
and a rule triggered by a tuning flag that its declaration does not name.

``parse_flags``: ``{"key": "value"}`` overrides (CLI strings, TOML values) -> ``Flags``; an unknown key or a malformed
value is a ``ConfigError`` naming the key and the value. No cross-key rule is checked here (``model.rules``).

Adding a flag: see ``docs/adding-a-flag.md``.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

Value = bool | int | str | float | tuple

CONTRACTS = ("exact", "rounding")
# The ops of ``model.ops`` (OP_NAMES) a flag can reach, plus "remat" (the layer's remat policy,
# ``model.transformer._remat_policy``). Kept here as data so this module imports without jax; tests/model/test_flags.py
# checks it against ``model.ops.OP_NAMES``.
REACHABLE = ("moe_mlp", "gdn", "gdn_cp_fold", "gdn_cp_dh_fold", "fp8_fake_quant", "fp8_amax", "lb_ids", "attention",
             "remat")


class ConfigError(ValueError):
    """A refused config, flag or flag combination. ``violations`` holds each violated rule (empty for parse errors)."""

    def __init__(self, message: str, violations: tuple = ()):
        super().__init__(message)
        self.violations = violations


class FlagDeclarationError(TypeError):
    """A tuning flag declared without what every tuning flag must state (raised at import)."""


def format_setting(key: str, value: Value) -> str:
    """``key=value`` as the CLI spells it (``fp8_fake_quant_hoist=gather8``, ``scan_layers=True``)."""
    return f"{key}={value}"


def suggest(key: str, valid: Iterable[str]) -> str:
    """``did you mean 'x'?`` for a near miss, else the list of valid keys."""
    valid = sorted(valid)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]!r}?"
    return "valid keys: " + ", ".join(valid)


@dataclass(frozen=True)
class TuningFlag:
    """The declaration of one tuning flag. ``name``, ``kind`` and ``control`` are filled in from its ``Flags`` field.

    ``on``: the value a check turns it on at when a config's ``[tuned]`` does not name one; ``None`` (the GMM tiles):
    checked only at a config's tuned value. ``rules``: the names of the ``model.rules`` rules it triggers (its
    prerequisites). ``op``: what it reaches, an op of ``model.ops`` or ``"remat"``. ``tile``: a GMM tile key (the
    gates can group those by contract)."""

    contract: str
    doc: str
    op: str
    rules: tuple[str, ...] = ()
    on: Value | None = None
    tile: bool = False
    name: str = ""
    kind: str = ""
    control: Value | None = None


def tuning(default: Value, *, contract: str | None = None, doc: str | None = None, op: str | None = None,
           rules: tuple[str, ...] = (), on: Value | None = None, tile: bool = False, gmm_dim: tuple | None = None):
    """A ``Flags`` field that is a tuning flag: ``default`` is its control value (off). Refused (at import) without a
    contract in ``CONTRACTS``, a description, or an op in ``REACHABLE``."""
    if contract not in CONTRACTS:
        raise FlagDeclarationError(f"tuning flag with default {default!r}: contract={contract!r} must be one of "
                                   f"{CONTRACTS} (every tuning flag states its contract)")
    if not doc:
        raise FlagDeclarationError(f"tuning flag with default {default!r}: doc={doc!r} must describe it in one line")
    if op not in REACHABLE:
        raise FlagDeclarationError(f"tuning flag with default {default!r}: op={op!r} must be one of {REACHABLE}")
    decl = TuningFlag(contract=contract, doc=doc, op=op, rules=tuple(rules), on=on, tile=tile)
    return field(default=default, metadata={"tuning": decl, "gmm_dim": gmm_dim})


# A GMM tile tiles one dim of its GMM. A tile of the reduction (k) dim re-associates the f32 accumulation: "rounding";
# any other tile, or the buffer count, only re-schedules the same arithmetic: "exact". The reduction dim of each GMM:
# wi fwd x[m,D] @ wi[D,2F] reduces D; wi dlhs dy[m,2F] @ wi^T reduces F; wo fwd h[m,F] @ wo[F,D] reduces F;
# wo dlhs dy[m,D] @ wo^T reduces D; both drhs (tgmm) reduce over the rows m.
REDUCTION_DIM = {"wi fwd": "embed_dim", "wi dlhs": "mlp_dim", "wi drhs": "batch_seq",
                 "wo fwd": "mlp_dim", "wo dlhs": "embed_dim", "wo drhs": "batch_seq"}


def tile(default: int, gmm: str, dim: str):
    """The tile key ``{gmm}_tile_{dim}`` (``gmm`` like ``"wi fwd"``; ``dim`` batch_seq, embed_dim, mlp_dim, or
    rhs_buffer_count: the VMEM buffers of the streamed rhs tile). Its contract follows ``REDUCTION_DIM``."""
    if gmm not in REDUCTION_DIM or dim not in ("batch_seq", "embed_dim", "mlp_dim", "rhs_buffer_count"):
        raise FlagDeclarationError(f"tile: gmm={gmm!r} must be one of {tuple(REDUCTION_DIM)} and dim={dim!r} a "
                                   "tiled dim (batch_seq, embed_dim, mlp_dim) or rhs_buffer_count")
    reduced = REDUCTION_DIM[gmm] == dim
    what = ("VMEM buffers of the streamed rhs tile" if dim == "rhs_buffer_count"
            else f"{dim} tile ({'the reduction: re-associates the f32 sum' if reduced else 'not reduced'})")
    # No tile exceeds its dim (tile_within_dim); the embed and MLP tiles divide it (m rows are ragged per expert and
    # masked); the buffers are at most the tiles streamed (rhs_buffers_within_tiles); all fit VMEM.
    if dim == "rhs_buffer_count":
        rules = ("rhs_buffers_within_tiles", "tiles_fit_vmem")
    elif dim in ("embed_dim", "mlp_dim"):
        rules = ("tile_within_dim", "tile_divides_dim", "tiles_fit_vmem")
    else:
        rules = ("tile_within_dim", "tiles_fit_vmem")
    return tuning(default, contract="rounding" if reduced else "exact", doc=f"GMM {gmm}: {what}", op="moe_mlp",
                  rules=rules, tile=True, gmm_dim=(gmm, dim))


_MLP = 1024  # MaxText's default GMM tile for the embed and MLP dims
_M = 512  # MaxText's default GMM tile for the batch*seq (m) dim
_FUSED_MOE_RULES = ("tiles_fit_vmem",)  # the fused kernels' VMEM footprint differs from the unfused ones'


@dataclass(frozen=True)
class Flags:
    """The trainer's flags (MaxText key names). Tuning flags (``TUNING_FLAGS``) default off; the rest is the control."""

    # --- MoE kernel fusions: off is the unfused baseline the trainer runs by default.
    moe_wi_gmm_fused_swiglu: bool = tuning(
        False, contract="rounding", on=True, op="moe_mlp", rules=("fused_swiglu_tile", *_FUSED_MOE_RULES),
        doc="the wi GMM writes silu(gate) * up from its f32 accumulator (no bf16 gate_up in between)")
    moe_wo_gmm_fused_dswiglu: bool = tuning(
        False, contract="rounding", on=True, op="moe_mlp", rules=("fused_dswiglu_one_n_tile", *_FUSED_MOE_RULES),
        doc="the wo input-gradient GMM turns its f32 accumulator into d[gate | up] in its epilogue")
    moe_router_grad_from_wo_input: bool = tuning(
        False, contract="rounding", on=True, op="moe_mlp",
        rules=("router_grad_needs_fused_dswiglu", *_FUSED_MOE_RULES),
        doc="the routing weight's gradient from the fused dSwiGLU epilogue (f32 accumulator)")
    # --- fp8: the trainer's fp8 mode is a control setting (control and reference run with it); the hoist is tuning.
    fp8_moe_fake_quant: bool = False  # off: bf16 experts are the plain production default
    fp8_fake_quant_hoist: Literal["none", "gather8"] = tuning(
        "none", contract="exact", on="gather8", op="fp8_amax",
        rules=("gather8_needs_fp8_fake_quant", "gather8_needs_scan_layers"),
        doc="fp8 absmax hoisted over the layer stack; the all-gathers move fp8 codes + scales")
    # --- layers and rematerialization (control).
    scan_layers: bool = True  # MaxText's default: layers are stacked and run under jax.lax.scan
    remat_policy: Literal["full", "minimal", "custom"] = "full"  # MaxText's default: recompute everything
    query_proj: Literal["remat", "device"] = "remat"  # per-tensor choice of remat_policy=custom; MaxText's default
    query_proj_kernel_gather_once: bool = tuning(
        False, contract="exact", on=True, op="remat",
        rules=("gather_once_needs_custom_remat", "gather_once_needs_query_proj_remat"),
        doc="the remat replay keeps the gathered query kernel instead of gathering it again")
    # --- context parallelism (control: mode and load balance; tuning: the scans and the hoisted ids).
    gdn_cp_mode: Literal["seq", "none"] = "none"  # "none": GDN does not split the sequence (single-rank default)
    gdn_cp_m_scan: bool = tuning(
        False, contract="rounding", on=True, op="gdn_cp_fold",
        rules=("gdn_cp_m_scan_needs_seq_mode", "gdn_cp_m_scan_needs_context"),
        doc="a rank's GDN chunk maps folded by one sequential Pallas scan instead of a pairwise tree")
    gdn_cp_dh_scan: bool = tuning(
        False, contract="rounding", on=True, op="gdn_cp_dh_fold",
        rules=("gdn_cp_dh_scan_needs_seq_mode", "gdn_cp_dh_scan_needs_context"),
        doc="the backward twin of gdn_cp_m_scan")
    context_parallel_attention_load_balance: bool = False  # off: plain contiguous slices (single-rank default)
    context_parallel_attention_load_balance_hoist_ids: bool = tuning(
        False, contract="exact", on=True, op="lb_ids",
        rules=("hoist_ids_needs_load_balance", "hoist_ids_needs_even_context", "hoist_ids_needs_custom_remat",
               "hoist_ids_needs_scan_layers"),
        doc="the load-balanced positions / segment ids computed once outside the layer scan")
    # --- mesh ("fsdp", "context", "expert"); 1 each: a single device. The product is checked in model.sharding.
    ici_fsdp_parallelism: int = 1
    ici_context_parallelism: int = 1
    ici_expert_parallelism: int = 1
    # --- GMM tiles: MaxText's defaults, m = batch*seq rows (see the reduction dims above and kernels/tiling.py).
    wi_tile_fwd_batch_seq: int = tile(_M, "wi fwd", "batch_seq")
    wi_tile_fwd_embed_dim: int = tile(_MLP, "wi fwd", "embed_dim")
    wi_tile_fwd_mlp_dim: int = tile(_MLP, "wi fwd", "mlp_dim")
    wi_tile_dlhs_batch_seq: int = tile(_M, "wi dlhs", "batch_seq")
    wi_tile_dlhs_embed_dim: int = tile(_MLP, "wi dlhs", "embed_dim")
    wi_tile_dlhs_mlp_dim: int = tile(_MLP, "wi dlhs", "mlp_dim")
    wi_tile_drhs_batch_seq: int = tile(_M, "wi drhs", "batch_seq")
    wi_tile_drhs_embed_dim: int = tile(_MLP, "wi drhs", "embed_dim")
    wi_tile_drhs_mlp_dim: int = tile(_MLP, "wi drhs", "mlp_dim")
    wo_tile_fwd_batch_seq: int = tile(_M, "wo fwd", "batch_seq")
    wo_tile_fwd_embed_dim: int = tile(_MLP, "wo fwd", "embed_dim")
    wo_tile_fwd_mlp_dim: int = tile(_MLP, "wo fwd", "mlp_dim")
    wo_tile_dlhs_batch_seq: int = tile(_M, "wo dlhs", "batch_seq")
    wo_tile_dlhs_embed_dim: int = tile(_MLP, "wo dlhs", "embed_dim")
    wo_tile_dlhs_mlp_dim: int = tile(_MLP, "wo dlhs", "mlp_dim")
    wo_tile_drhs_batch_seq: int = tile(_M, "wo drhs", "batch_seq")
    wo_tile_drhs_embed_dim: int = tile(_MLP, "wo drhs", "embed_dim")
    wo_tile_drhs_mlp_dim: int = tile(_MLP, "wo drhs", "mlp_dim")
    wi_tile_fwd_rhs_buffer_count: int = tile(2, "wi fwd", "rhs_buffer_count")  # Pallas' default double buffering

    def __post_init__(self):
        for key, value in dataclasses.asdict(self).items():
            check_flag_value(key, value)

    def changed(self, base: Flags) -> dict[str, Value]:
        """The keys whose value differs from ``base``, with this object's values (e.g. the candidate vs the control)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if getattr(base, k) != v}


_FLAG_FIELDS = {f.name: f for f in dataclasses.fields(Flags)}
_FLAG_TYPES = typing.get_type_hints(Flags)
FLAG_KEYS: tuple[str, ...] = tuple(_FLAG_FIELDS)


def flag_kind(key: str) -> str:
    """``"bool"``, ``"positive int"`` or ``"one of a|b"``: what a flag accepts (for messages and ``list-flags``)."""
    t = _FLAG_TYPES[key]
    if t is bool:
        return "bool"
    if t is int:
        return "positive int"
    return "one of " + "|".join(typing.get_args(t))


def declarations(cls: type) -> dict[str, TuningFlag]:
    """The tuning flags declared in the dataclass ``cls`` (``Flags``), name -> ``TuningFlag`` with name, kind and
    control value filled in."""
    out = {}
    for f in dataclasses.fields(cls):
        decl = f.metadata.get("tuning")
        gmm_dim = f.metadata.get("gmm_dim")
        if gmm_dim is not None and f.name != "{}_tile_{}_{}".format(*gmm_dim[0].split(), gmm_dim[1]):
            raise FlagDeclarationError(f"{cls.__name__}.{f.name} is declared as the tile of {gmm_dim}: the name says "
                                       "otherwise")
        if decl is not None:
            out[f.name] = dataclasses.replace(decl, name=f.name, kind=flag_kind(f.name) if cls is Flags else "",
                                              control=f.default)
    return out


TUNING: dict[str, TuningFlag] = declarations(Flags)
TUNING_FLAGS: tuple[str, ...] = tuple(TUNING)
CONTROL_KEYS: tuple[str, ...] = tuple(k for k in FLAG_KEYS if k not in TUNING)
# The GMM tiles proper (the tile keys but the buffer count): the fields of ``kernels.tiling.MoeTiles``.
TILE_KEYS: tuple[str, ...] = tuple(k for k, d in TUNING.items() if d.tile and not k.endswith("_rhs_buffer_count"))


def check_flag_value(key: str, value: object) -> None:
    """``ConfigError`` naming ``key`` and ``value`` unless ``value`` has the flag's type (ints: positive)."""
    t = _FLAG_TYPES[key]
    if t is bool:
        ok = isinstance(value, bool)
    elif t is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    else:
        ok = value in typing.get_args(t)
    if not ok:
        raise ConfigError(f"{format_setting(key, value)} is malformed: {key} expects {flag_kind(key)}, got {value!r}")


_DECIMAL = re.compile(r"[0-9]{1,1000}", re.ASCII)  # int() refuses more than 4300 digits
_TRUE = ("true", "1")
_FALSE = ("false", "0")


def _coerce(key: str, value: object) -> Value:
    """A CLI string or TOML value -> the flag's type; anything else is a ConfigError naming key and value."""
    t = _FLAG_TYPES[key]
    if t is bool and isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    if t is bool and type(value) is int and value in (0, 1):
        return bool(value)
    # ASCII decimal digits only: str.isdigit() also accepts superscripts ("²", which int() refuses) and int() reads
    # other scripts' digits ("１２８" in full-width digits): a value is taken as typed or refused, never reinterpreted.
    coerced = int(value.strip()) if t is int and isinstance(value, str) and _DECIMAL.fullmatch(value.strip()) else value
    try:
        check_flag_value(key, coerced)
    except ConfigError:  # name the value as it was given ("0", not 0)
        text, shown = str(value), repr(value)
        if len(shown) > 80:
            text = shown = f"{shown[:40]}...{shown[-20:]} ({len(shown)} characters)"
        digits = " (ASCII decimal digits)" if flag_kind(key) == "positive int" else ""
        raise ConfigError(
            f"{key}={text} is malformed: {key} expects {flag_kind(key)}{digits}, got {shown}"
        ) from None
    return coerced


def parse_flags(overrides: Mapping[str, str | bool | int], base: Flags | None = None) -> Flags:
    """Apply ``overrides`` on ``base`` (default ``Flags()``). Booleans accept ``true/false/1/0`` (any case); ints accept
    decimal strings; enums their exact choice. Unknown key or malformed value -> ``ConfigError`` naming it.
    No cross-key rule is checked here: call ``model.rules.validate`` (or use ``model.rules.flags_for``)."""
    base = Flags() if base is None else base
    parsed = {}
    for key, value in overrides.items():
        if key not in _FLAG_FIELDS:
            raise ConfigError(f"unknown flag {key!r} (value {value!r}); {suggest(key, FLAG_KEYS)}")
        parsed[key] = _coerce(key, value)
    return dataclasses.replace(base, **parsed)


def moe_tiles(flags: Flags):
    """The ``kernels.tiling.MoeTiles`` of these flags (its fields are the trainer's tile keys)."""
    from nxgates.kernels.tiling import MoeTiles  # lazy: the flags must load without the kernels

    return MoeTiles(**{f.name: getattr(flags, f.name) for f in dataclasses.fields(MoeTiles)})
