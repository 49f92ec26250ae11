"""A toy model with the interface of ``model.transformer`` / ``model.config``, for testing the gates on their own.

``params = {"embed": [V, D], "mlp": {"w_in": [D, H], "w_out": [H, D]}, "head": [D, V]}``; the forward is a causal
running mean of the token embeddings, a SiLU MLP with a residual, and an LM head. Production precision: bf16 compute
from the f32 master params, f32 accumulation, every activation rounded to bf16 between ops; reference: float32 with
``precision=HIGHEST``. Flags (named like the trainer's, so ``gates.contracts`` classifies them):
- ``moe_wi_gmm_fused_swiglu`` (rounding): the MLP hidden activation stays f32 (one bf16 rounding fewer);
- ``wi_tile_fwd_embed_dim`` (rounding, a k tile): ``c @ w_in`` summed over k chunks of this size in f32;
- ``wi_tile_fwd_batch_seq`` (exact, an m tile): ``c @ w_in`` computed in row blocks of this size;
- ``fp8_fake_quant_hoist`` (exact): ``"gather8"`` splits and re-joins the head weight (the same bits);
- ``fp8_moe_fake_quant`` (control setting): gather8 requires it (the refused-combination test);
- ``drop_tokens`` (control setting): reported as dropped tokens (the precondition test).
``override`` lets a test replace the MLP activation (the mutants' mechanism on this toy).
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from nxgates.gates.model_api import ModelAPI

HI = jax.lax.Precision.HIGHEST


class ToyConfigError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class ToyFlags:
    moe_wi_gmm_fused_swiglu: bool = False
    wi_tile_fwd_embed_dim: int = 16
    wi_tile_fwd_batch_seq: int = 64
    fp8_fake_quant_hoist: Literal["none", "gather8"] = "none"
    fp8_moe_fake_quant: bool = True
    drop_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    name: str = "toy"
    vocab_size: int = 32
    hidden_dim: int = 16
    mlp_dim: int = 32
    seq_len: int = 12
    batch_size: int = 4
    control: ToyFlags = ToyFlags()
    tuned: tuple = (("moe_wi_gmm_fused_swiglu", True), ("wi_tile_fwd_embed_dim", 8), ("wi_tile_fwd_batch_seq", 16),
                    ("fp8_fake_quant_hoist", "gather8"))


CONFIGS = {"toy": ToyConfig()}
_FIELDS = {f.name: f for f in dataclasses.fields(ToyFlags)}
_OVERRIDES: dict[str, object] = {}
_WRAPPERS: dict[str, object] = {}


def load_config(name: str) -> ToyConfig:
    if name not in CONFIGS:
        raise ToyConfigError(f"unknown config {name!r}: available configs are {sorted(CONFIGS)}")
    return CONFIGS[name]


def parse_flags(overrides, base=None) -> ToyFlags:
    base = base or ToyFlags()
    parsed = {}
    for k, v in overrides.items():
        if k not in _FIELDS:
            raise ToyConfigError(f"unknown flag {k!r} (value {v!r})")
        default = getattr(ToyFlags(), k)
        if isinstance(default, bool):
            if isinstance(v, bool):
                parsed[k] = v
            elif str(v).lower() in ("true", "false"):
                parsed[k] = str(v).lower() == "true"
            else:
                raise ToyConfigError(f"{k}={v} is malformed: {k} expects bool, got {v!r}")
        elif isinstance(default, int):
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                parsed[k] = v
            elif isinstance(v, str) and v.isdigit() and int(v) > 0:
                parsed[k] = int(v)
            else:
                raise ToyConfigError(f"{k}={v} is malformed: {k} expects positive int, got {v!r}")
        else:
            if v not in ("none", "gather8"):
                raise ToyConfigError(f"{k}={v} is malformed: {k} expects one of none|gather8, got {v!r}")
            parsed[k] = v
    return dataclasses.replace(base, **parsed)


def validate(cfg: ToyConfig, flags: ToyFlags) -> ToyFlags:
    if flags.fp8_fake_quant_hoist == "gather8" and not flags.fp8_moe_fake_quant:
        raise ToyConfigError(f"fp8_fake_quant_hoist=gather8 requires fp8_moe_fake_quant=True; "
                             f"got fp8_moe_fake_quant={flags.fp8_moe_fake_quant}")
    if cfg.hidden_dim % flags.wi_tile_fwd_embed_dim:
        raise ToyConfigError(f"wi_tile_fwd_embed_dim={flags.wi_tile_fwd_embed_dim} must divide "
                             f"hidden_dim={cfg.hidden_dim}")
    return flags


def init_params(cfg: ToyConfig, seed: int):
    rng = np.random.default_rng(seed)

    def w(*shape):
        return jnp.asarray((rng.standard_normal(shape) * 0.3).astype(np.float32))

    return {"embed": w(cfg.vocab_size, cfg.hidden_dim),
            "mlp": {"w_in": w(cfg.hidden_dim, cfg.mlp_dim), "w_out": w(cfg.mlp_dim, cfg.hidden_dim)},
            "head": w(cfg.hidden_dim, cfg.vocab_size)}


@contextlib.contextmanager
def wrap(name: str, wrapper):
    _WRAPPERS[name] = wrapper
    try:
        yield
    finally:
        del _WRAPPERS[name]


@contextlib.contextmanager
def override(name: str, fn):
    _OVERRIDES[name] = fn
    try:
        yield
    finally:
        del _OVERRIDES[name]


def build_log_probs(cfg: ToyConfig, flags: ToyFlags, *, precision: str, mesh=None):
    ref = precision == "reference"
    f32 = ref or precision == "lens"  # the float32 lens: the production path (tiles, fused MLP) in float32
    dt = jnp.float32 if f32 else jnp.bfloat16
    prec = HI if f32 else None
    act = _OVERRIDES.get("activation", jax.nn.silu)
    act_name = f"override:{act.__name__}" if "activation" in _OVERRIDES else "silu"
    if "activation" in _WRAPPERS:  # wrap(): the chosen activation inside the wrapper (model.ops.wrap's semantics)
        act_name = f"wrap:{_WRAPPERS['activation'].__name__}({act_name})"
        act = _WRAPPERS["activation"](act)
    chosen = {"activation": act_name,
              "mlp": "fused" if flags.moe_wi_gmm_fused_swiglu else "unfused"}

    def mm(a, b):
        return jnp.matmul(a.astype(dt), b.astype(dt), precision=prec, preferred_element_type=jnp.float32)

    def k_tiled(rows, w_in):  # rows: [M, D] -> [M, H] f32, k chunks accumulated in f32 (re-associates)
        tk = flags.wi_tile_fwd_embed_dim
        acc = None
        for k0 in range(0, rows.shape[1], tk):
            part = mm(rows[:, k0:k0 + tk], w_in[k0:k0 + tk])
            acc = part if acc is None else acc + part
        return acc

    @jax.custom_vjp
    def w_in_rows(rows, w_in):
        # m tiles: independent row blocks of the forward (exact); the backward is the untiled one, as a kernel's
        # custom_vjp with its own backward tiles would do.
        tm = flags.wi_tile_fwd_batch_seq
        return jnp.concatenate([k_tiled(rows[r0:r0 + tm], w_in) for r0 in range(0, rows.shape[0], tm)], axis=0)

    def w_in_rows_fwd(rows, w_in):
        return w_in_rows(rows, w_in), (rows, w_in)

    def w_in_rows_bwd(res, dy):
        return jax.vjp(k_tiled, *res)[1](dy)

    w_in_rows.defvjp(w_in_rows_fwd, w_in_rows_bwd)

    def w_in_product(c, w_in):  # c: [B, S, D] -> [B, S, H] (f32)
        if ref:
            return mm(c, w_in)
        b, s, d = c.shape
        return w_in_rows(c.reshape(b * s, d), w_in).reshape(b, s, -1)  # [B*S, D] rows -> [B, S, H]

    def fn(params, tokens):
        x = params["embed"][tokens].astype(dt)  # [B, S, D]
        count = jnp.arange(1, tokens.shape[1] + 1, dtype=jnp.float32)[None, :, None]
        c = (jnp.cumsum(x.astype(jnp.float32), axis=1) / count).astype(dt)  # causal running mean [B, S, D]
        h = act(w_in_product(c, params["mlp"]["w_in"]))  # [B, S, H] f32
        if ref:
            out = mm(h, params["mlp"]["w_out"])
        elif flags.moe_wi_gmm_fused_swiglu:  # fused: the f32 activation feeds the next product (no bf16 write)
            w_out = params["mlp"]["w_out"].astype(dt).astype(jnp.float32)
            out = jnp.matmul(h, w_out, precision=prec, preferred_element_type=jnp.float32)
        else:  # unfused: the activation is written to the compute dtype (bf16) first
            out = mm(h.astype(dt), params["mlp"]["w_out"])
        y = (c.astype(jnp.float32) + out).astype(dt)  # [B, S, D]
        head = params["head"]
        if flags.fp8_fake_quant_hoist == "gather8":
            half = head.shape[1] // 2
            head = jnp.concatenate([head[:, :half], head[:, half:]], axis=1)  # the same bits through another path
        logits = mm(y, head)  # [B, S, V] f32
        logp_all = jax.nn.log_softmax(logits, axis=-1)
        logp = jnp.take_along_axis(logp_all[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]  # [B, S-1]
        return logp, {"dropped_tokens": jnp.int32(flags.drop_tokens)}

    fn.implementations = lambda: dict(chosen)  # like model.transformer's: what this build dispatched
    return fn


def api() -> ModelAPI:
    def as_dict(obj):
        return {f.name: getattr(obj, f.name) if not dataclasses.is_dataclass(getattr(obj, f.name))
                else dataclasses.asdict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}

    return ModelAPI(
        load_config=load_config,
        parse_flags=parse_flags,
        validate=validate,
        init_params=init_params,
        build_log_probs=build_log_probs,
        make_mesh=lambda flags: None,
        implementations=lambda fn: fn.implementations(),
        base_flags=lambda cfg: cfg.control,
        tuned=lambda cfg: dict(cfg.tuned),
        dims=lambda cfg: (cfg.batch_size, cfg.seq_len, cfg.vocab_size),
        as_dict=as_dict,
        config_error=ToyConfigError,
        config_files=lambda name: [pathlib.Path(__file__)],
        source_dirs=(),
        override=override,
        wrap=wrap,
    )


# ---------------------------------------------------------------------------------------------- synthetic run records
def synthetic_record(seed: int = 0, steps: int = 3, *, shapes=None, metadata=None):
    """A RunRecord built in numpy (no model): for the gate, record and report tests. Same seed -> same record."""
    from nxgates.gates.record import RunRecord, StepRecord

    shapes = shapes or {"embed": (6, 4), "mlp/w_in": (4, 5), "mlp/w_out": (5, 4), "norm/scale": (3,), "head": (4, 6)}
    rng = np.random.default_rng(seed)
    params0 = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    mask = np.zeros((2, 7), np.float32)
    mask[:, 2:6] = 1.0
    recs, params = [], params0
    for i in range(steps):
        grads = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
        params = {n: (params[n] - 1e-2 * np.sign(grads[n])).astype(np.float32) for n in shapes}
        recs.append(StepRecord(loss=np.asarray(-0.25 - 0.0 * i, np.float32),
                               logp=(-3.0 + 0.1 * rng.standard_normal((2, 7))).astype(np.float32),
                               grads=grads,
                               grad_norm=np.asarray(np.sqrt(sum(float((g.astype(np.float64) ** 2).sum())
                                                                for g in grads.values())), np.float32),
                               params=params, dropped_tokens=0))
    return RunRecord(params0=params0, steps=recs, mask=mask, metadata=dict(metadata or {"env": {"jax": "x"}}))


_RUNS: dict = {}


def toy_run(label: str, overrides: dict | None = None, precision: str = "production"):
    """A protocol run of the toy model, memoized per (label, overrides, precision) for the whole test session."""
    from nxgates.gates import runner

    key = (label, tuple(sorted((overrides or {}).items())), precision)
    if key not in _RUNS:
        r = runner.Runner("toy", api=api(), use_cache=False, progress=None)
        _RUNS[key] = r.compute(r.flags_from(overrides or {}), precision, label)
    return _RUNS[key]
