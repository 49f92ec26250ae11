"""The case sets of ``gates.testing.check_kernel``: per op, its calling convention, its float32 reference and cases.

An op (``OPS[name]``, an ``OpSpec``) fixes how the function under test is called (the reference's own signature,
``reference/``), which outputs it returns, and which arguments are differentiated for the gradient rows. A case
(``Case``) fixes the inputs: built in numpy from a seed derived from the case id, so every run sees the same values.

Inputs by dtype: a ``bf16`` case hands the function bfloat16 arrays; an ``f32`` case float32 arrays holding full
float32 values (not bf16-rounded ones), so a kernel that silently rounds its inputs to bf16 shows at the float32
tolerance. Integer arguments (``group_sizes``) are int32; GDN's ``g``, ``beta`` and state are float32 in both (the
trainer computes the decays in float32). The float32 reference always runs on the float32 upcast of those same values.
Cotangents are seeded per case and output, rounded through bfloat16 so that casting one to a bf16 output's dtype is
exact.

The ops and their cases (the ``cell`` cases, the trainer's shapes, run only on request: ``cases="cell"`` or ``"all"``):

- ``gmm``: ``fn(lhs [m, k], rhs [G, k, n], group_sizes [G] int32) -> out [m, n]``; gradients of lhs, rhs.
- ``tgmm``: ``fn(lhs [m, k], rhs [m, n], group_sizes [G]) -> out [G, k, n]``; gradients of lhs, rhs.
- ``swiglu``: ``fn(gate [m, F], up [m, F]) -> h``; gradients of gate, up.
- ``swiglu_bwd``: ``fn(gate, up, dh) -> (dgate, dup)``.
- ``dswiglu``: ``fn(dy [m, D], wo [G, F, D], gate_up [m, 2F], group_sizes, route_weights [m] f32)
  -> (d_gate_up [m, 2F], d_route [m])``.
- ``gdn``: ``fn(q, k [B, T, H, K], v [B, T, H, V], g, beta [B, T, H], initial_state [B, H, K, V] or None)
  -> (o, final_state)``; gradients of q, k, v, g, beta, initial_state (``dstate0``).
- ``gdn_chunk_maps``: ``fn(k, v, g, beta, chunk_size=C) -> (M [B, N, H, K, K], B [B, N, H, K, V])``; gradients of
  k, v, g, beta.
- ``gdn_fold``: ``fn(m [B, N, H, K, K], b [B, N, H, K, V]) -> (M [B, H, K, K], B [B, H, K, V])`` (chunk 0 applied
  first); gradients of m, b.
- ``fp8_fake_quant``: ``fn(w, axes) -> w_hat`` (the shape of w); gradient of w (straight-through: the identity).

``dswiglu`` is the fused wo input-gradient GMM with the dSwiGLU epilogue and the routing-weight gradient
(``reference.moe_wo_dlhs_dswiglu``); ``gdn_fold`` composes chunk maps (the context-parallel m-scan / dh-scan);
``gdn_chunk_maps`` pads T to a multiple of ``chunk_size``.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from nxgates import reference as R

DTYPES = {"f32": "float32", "bf16": "bfloat16"}


@dataclasses.dataclass(frozen=True)
class Case:
    """One input set of an op. ``name`` reads ``<kind>/<dtype>``; ``case_id`` (shapes and dtype) seeds the inputs."""

    op: str
    name: str
    case_id: str
    dtype: str  # "f32" | "bf16"
    cell: bool
    note: str
    build: Callable[[], tuple[dict[str, Any], dict[str, Any]]]  # -> (positional args by name, keyword statics)


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """How an op is called and checked. ``expected``, when set, replaces the default (``jax.vjp`` of ``reference``)."""

    name: str
    signature: str
    reference: Callable
    outputs: tuple[str, ...]
    grads: tuple[str, ...]  # differentiated positional arguments (a None argument is skipped)
    cases: tuple[Case, ...]
    grad_names: Mapping[str, str] = dataclasses.field(default_factory=dict)  # argument -> gradient row name
    expected: Callable | None = None

    def grad_name(self, arg: str) -> str:
        return self.grad_names.get(arg, f"d{arg}")

    def case(self, name: str) -> Case:
        for c in self.cases:
            if c.name == name:
                return c
        raise KeyError(name)


# ------------------------------------------------------------------------------------------------------------ inputs


def rng_for(case_id: str, salt: str = "") -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(f"{case_id}{salt}".encode()))


def _bf16_round(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def as_dtype(x: np.ndarray, dtype: str) -> jax.Array:
    """numpy -> jax in the case's dtype: bf16 values for ``bf16``, full float32 values for ``f32``."""
    x = np.asarray(x, np.float32)
    if dtype == "bf16":
        return jnp.asarray(x.astype(ml_dtypes.bfloat16))
    return jnp.asarray(x)


def cotangent(case_id: str, output: str, shape) -> jax.Array:
    """The seeded cotangent of ``output`` (float32, bf16-representable values)."""
    return jnp.asarray(_bf16_round(rng_for(case_id, f"/ct/{output}").standard_normal(shape)))


# --------------------------------------------------------------------------------------------------------------- GMM

# (m, k, n, group_sizes): m rows sorted by group; rows past sum(group_sizes) belong to no group (output and dlhs 0).
_GMM_GEOMETRY = {
    "awkward": (45, 72, 40, (9, 14, 11, 11), "m, k, n not multiples of 8 or 16; every group non-empty, sum == m"),
    "empty_groups": (32, 64, 48, (0, 12, 0, 20, 0), "empty first, middle and last groups"),
    "rows_past_sum": (48, 64, 32, (10, 7, 13), "18 rows past sum(group_sizes): out and dlhs must be exactly 0 there"),
    "cell": (2560, 4096, 2048, (512, 301, 0, 633, 467, 487), "the trainer's wi GMM per expert shard (one empty)"),
}


def _gmm_cases(op: str) -> tuple[Case, ...]:
    cases = []
    for kind, (m, k, n, gs, note) in _GMM_GEOMETRY.items():
        for tag in ("bf16",) if kind == "cell" else ("f32", "bf16"):
            case_id = f"{op}-M{m}-K{k}-N{n}-G{len(gs)}-{'-'.join(map(str, gs))}-{tag}"

            def build(op=op, m=m, k=k, n=n, gs=gs, tag=tag, case_id=case_id):
                rng = rng_for(case_id)
                lhs = rng.standard_normal((m, k))
                if op == "gmm":
                    rhs = rng.standard_normal((len(gs), k, n)) / np.sqrt(k)  # O(1) outputs
                else:
                    lhs, rhs = lhs / np.sqrt(max(sum(gs), 1)), rng.standard_normal((m, n))
                group_sizes = jnp.asarray(np.array(gs, np.int32))
                return {"lhs": as_dtype(lhs, tag), "rhs": as_dtype(rhs, tag), "group_sizes": group_sizes}, {}

            cases.append(Case(op, f"{kind}/{tag}", case_id, tag, kind == "cell", note, build))
    return tuple(cases)


# ------------------------------------------------------------------------------------------------------------ SwiGLU

_SWIGLU_GEOMETRY = {
    "awkward": (37, 45, 1.0, "m = 37, F = 45; gate ~ N(0, 1)"),
    "saturated": (24, 40, 8.0, "gate ~ N(0, 64): sigmoid saturates at both ends"),
    "cell": (2560, 1024, 1.0, "the trainer's [m, F] per expert shard"),
}


def _swiglu_cases(op: str) -> tuple[Case, ...]:
    cases = []
    for kind, (m, f, spread, note) in _SWIGLU_GEOMETRY.items():
        for tag in ("bf16",) if kind == "cell" else ("f32", "bf16"):
            case_id = f"{op}-M{m}-F{f}-s{spread}-{tag}"

            def build(op=op, m=m, f=f, spread=spread, tag=tag, case_id=case_id):
                rng = rng_for(case_id)
                args = {"gate": as_dtype(spread * rng.standard_normal((m, f)), tag),
                        "up": as_dtype(rng.standard_normal((m, f)), tag)}
                if op == "swiglu_bwd":
                    args["dh"] = as_dtype(rng.standard_normal((m, f)), tag)
                return args, {}

            cases.append(Case(op, f"{kind}/{tag}", case_id, tag, kind == "cell", note, build))
    return tuple(cases)


# (m, D, F, group_sizes)
_DSWIGLU_GEOMETRY = {
    "awkward": (45, 72, 20, (9, 14, 11, 11), "m = 45, D = 72, F = 20; sum == m"),
    "empty_groups_rows_past_sum": (40, 64, 32, (9, 0, 21, 0), "empty groups and 10 rows past the sum (exact 0 there)"),
    "cell": (2560, 4096, 1024, (512, 301, 0, 633, 467, 487), "the trainer's wo GMM per expert shard"),
}


def _dswiglu_cases() -> tuple[Case, ...]:
    cases = []
    for kind, (m, d, f, gs, note) in _DSWIGLU_GEOMETRY.items():
        for tag in ("bf16",) if kind == "cell" else ("f32", "bf16"):
            case_id = f"dswiglu-M{m}-D{d}-F{f}-G{len(gs)}-{'-'.join(map(str, gs))}-{tag}"

            def build(m=m, d=d, f=f, gs=gs, tag=tag, case_id=case_id):
                rng = rng_for(case_id)
                return {
                    "dy": as_dtype(rng.standard_normal((m, d)), tag),
                    "wo": as_dtype(rng.standard_normal((len(gs), f, d)) / np.sqrt(f), tag),
                    "gate_up": as_dtype(rng.standard_normal((m, 2 * f)), tag),
                    "group_sizes": jnp.asarray(np.array(gs, np.int32)),
                    "route_weights": jnp.asarray(rng.uniform(0.05, 1.0, m).astype(np.float32)),
                }, {}

            cases.append(Case("dswiglu", f"{kind}/{tag}", case_id, tag, kind == "cell", note, build))
    return tuple(cases)


# --------------------------------------------------------------------------------------------------------------- GDN


def gdn_arrays(case_id: str, *, b, t, h, k, v, strength, tag, with_state) -> dict[str, Any]:
    """q, k L2-normalized, beta = sigmoid(x), g = strength * log(sigmoid(x + 2)) <= 0 (the model's distributions)."""
    rng = rng_for(case_id)

    def unit(shape):
        x = rng.standard_normal(shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q, kk, vv = unit((b, t, h, k)), unit((b, t, h, k)), rng.standard_normal((b, t, h, v))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, h))))
    g = np.minimum(strength * -np.logaddexp(0.0, -(rng.standard_normal((b, t, h)) + 2.0)), 0.0)
    state0 = 0.5 * rng.standard_normal((b, h, k, v)) if with_state else None
    if tag == "bf16":  # float32 arrays holding bf16 values, as the bf16 path's gates would be
        beta, g = _bf16_round(beta), np.minimum(_bf16_round(g), 0.0)
    return {
        "q": as_dtype(q, tag), "k": as_dtype(kk, tag), "v": as_dtype(vv, tag),
        "g": jnp.asarray(g, jnp.float32), "beta": jnp.asarray(beta, jnp.float32),
        "initial_state": None if state0 is None else jnp.asarray(state0, jnp.float32),
    }  # fmt: skip


# (B, T, H, K, V, gate strength, initial state)
_GDN_GEOMETRY = {
    "weak_decay": (2, 37, 2, 16, 24, 0.1, True, "gate strength 0.1 (the state carries), initial state, T = 37"),
    "strong_decay": (2, 37, 2, 16, 24, 10.0, True, "gate strength 10 (forgets within tokens), non-zero initial state"),
    "no_initial_state": (1, 50, 3, 16, 16, 1.0, False, "initial_state=None (zeros), gate strength 1, T = 50"),
    "cell": (1, 8192, 64, 128, 128, 1.0, True, "the trainer's per-device shapes: 64 heads, K = V = 128, T = 8192"),
}


def _gdn_cases() -> tuple[Case, ...]:
    cases = []
    for kind, (b, t, h, k, v, strength, with_state, note) in _GDN_GEOMETRY.items():
        for tag in ("bf16",) if kind == "cell" else ("f32", "bf16"):
            case_id = f"gdn-B{b}-T{t}-H{h}-K{k}-V{v}-s{strength}-{'state' if with_state else 'nostate'}-{tag}"

            def build(b=b, t=t, h=h, k=k, v=v, s=strength, tag=tag, ws=with_state, case_id=case_id):
                return gdn_arrays(case_id, b=b, t=t, h=h, k=k, v=v, strength=s, tag=tag, with_state=ws), {}

            cases.append(Case("gdn", f"{kind}/{tag}", case_id, tag, kind == "cell", note, build))
    return tuple(cases)


def _gdn_expected(case: Case, args, kwargs, cts) -> dict[str, np.ndarray]:
    """``reference.gdn_recurrent`` and its VJP, segment by segment past 128 tokens (the cell case's memory)."""
    from nxgates.gates.kernel_cases.gdn import reference_results
    from nxgates.kernels.gdn.inputs import GdnInputs

    f32 = {n: (None if x is None else jnp.asarray(x, jnp.float32)) for n, x in args.items()}
    inp = GdnInputs(q=f32["q"], k=f32["k"], v=f32["v"], g=f32["g"], beta=f32["beta"], state0=f32["initial_state"],
                    d_o=cts["o"], d_state=cts["final_state"])
    return reference_results(inp, segment=128)


# (B, T, H, K, V, strength, chunk)
_MAPS_GEOMETRY = {
    "weak_decay": (1, 40, 2, 16, 24, 0.1, 16, "T = 40 over chunks of 16: the last chunk is half padding"),
    "strong_decay": (2, 48, 2, 16, 16, 10.0, 16, "gate strength 10: M is nearly the zero map"),
    "cell": (1, 2048, 64, 128, 128, 1.0, 64, "one context rank's slice of the cell: 32 chunks of 64, 64 heads"),
}


def _chunk_maps_cases() -> tuple[Case, ...]:
    cases = []
    for kind, (b, t, h, k, v, strength, chunk, note) in _MAPS_GEOMETRY.items():
        for tag in ("bf16",) if kind == "cell" else ("f32", "bf16"):
            case_id = f"gdn_chunk_maps-B{b}-T{t}-H{h}-K{k}-V{v}-s{strength}-C{chunk}-{tag}"

            def build(b=b, t=t, h=h, k=k, v=v, s=strength, chunk=chunk, tag=tag, case_id=case_id):
                a = gdn_arrays(case_id, b=b, t=t, h=h, k=k, v=v, strength=s, tag=tag, with_state=False)
                return {n: a[n] for n in ("k", "v", "g", "beta")}, {"chunk_size": chunk}

            cases.append(Case("gdn_chunk_maps", f"{kind}/{tag}", case_id, tag, kind == "cell", note, build))
    return tuple(cases)


# (B, N chunks, H, K, V, strength); the maps of real inputs, chunk 16 (float32 only: the fold runs in float32)
_FOLD_GEOMETRY = {
    "weak_decay": (1, 5, 2, 16, 24, 0.1, "5 chunk maps (odd), gate strength 0.1: M keeps weight, the order shows"),
    "strong_decay": (2, 8, 2, 16, 16, 10.0, "8 chunk maps, gate strength 10"),
    "one_chunk": (1, 1, 2, 16, 16, 1.0, "a single chunk map: the fold is the map itself"),
    "cell": (1, 32, 64, 128, 128, 1.0, "one context rank of the cell: 32 chunk maps, 64 heads, K = V = 128"),
}


def _fold_cases() -> tuple[Case, ...]:
    cases = []
    for kind, (b, n, h, k, v, strength, note) in _FOLD_GEOMETRY.items():
        case_id = f"gdn_fold-B{b}-N{n}-H{h}-K{k}-V{v}-s{strength}-f32"
        chunk = 16 if kind != "cell" else 64

        def build(b=b, n=n, h=h, k=k, v=v, s=strength, chunk=chunk, case_id=case_id):
            a = gdn_arrays(case_id, b=b, t=n * chunk, h=h, k=k, v=v, strength=s, tag="f32", with_state=False)
            m, b_map = R.gdn_chunk_maps(a["k"], a["v"], a["g"], a["beta"], chunk_size=chunk)
            return {"m": m, "b": b_map}, {}

        cases.append(Case("gdn_fold", f"{kind}/f32", case_id, "f32", kind == "cell", note, build))
    return tuple(cases)


# --------------------------------------------------------------------------------------------------------------- fp8

# (shape, reduced axes)
_FP8_GEOMETRY = {
    "experts": ((3, 40, 24), (1,), "expert weights [E, K, N], per (expert, channel) over K; magnitudes 2^-30..2^8, "
                                   "one all-zero channel (scale 1)"),
    "stacked": ((2, 3, 36, 20), (2,), "stacked [L, E, K, N] over K (the hoist's layout)"),
    "cell": ((2, 4, 4096, 2048), (2,), "the cell's stacked expert weights"),
}


def _fp8_cases() -> tuple[Case, ...]:
    cases = []
    for kind, (shape, axes, note) in _FP8_GEOMETRY.items():
        for tag in ("bf16",) if kind == "cell" else ("f32", "bf16"):
            case_id = f"fp8-{'x'.join(map(str, shape))}-ax{'.'.join(map(str, axes))}-{tag}"

            def build(shape=shape, axes=axes, tag=tag, case_id=case_id):
                rng = rng_for(case_id)
                mag_shape = [1] * len(shape)
                mag_shape[-1], mag_shape[-3] = shape[-1], shape[-3]
                w = rng.standard_normal(shape) * np.exp2(rng.uniform(-30, 8, mag_shape))
                w[(0,) * (len(shape) - 2) + (slice(None), 0)] = 0.0  # one all-zero channel
                return {"w": as_dtype(w, tag), "axes": axes}, {}

            cases.append(Case("fp8_fake_quant", f"{kind}/{tag}", case_id, tag, kind == "cell", note, build))
    return tuple(cases)


# --------------------------------------------------------------------------------------------------------------- ops


def _gdn_reference(q, k, v, g, beta, initial_state):
    return R.gdn_recurrent(q, k, v, g, beta, initial_state=initial_state)


def _fold_reference(m, b):
    return R.gdn_fold((m, b), order="sequential")


OPS: dict[str, OpSpec] = {
    "gmm": OpSpec("gmm", "fn(lhs [m, k], rhs [G, k, n], group_sizes [G] int32) -> out [m, n]", R.gmm,
                  ("out",), ("lhs", "rhs"), _gmm_cases("gmm")),
    "tgmm": OpSpec("tgmm", "fn(lhs [m, k], rhs [m, n], group_sizes [G] int32) -> out [G, k, n]", R.tgmm,
                   ("out",), ("lhs", "rhs"), _gmm_cases("tgmm")),
    "swiglu": OpSpec("swiglu", "fn(gate [m, F], up [m, F]) -> h [m, F]", R.swiglu, ("h",), ("gate", "up"),
                     _swiglu_cases("swiglu")),
    "swiglu_bwd": OpSpec("swiglu_bwd", "fn(gate [m, F], up [m, F], dh [m, F]) -> (dgate, dup)", R.swiglu_bwd,
                         ("dgate", "dup"), (), _swiglu_cases("swiglu_bwd")),
    "dswiglu": OpSpec(
        "dswiglu",
        "fn(dy [m, D], wo [G, F, D], gate_up [m, 2F], group_sizes [G] int32, route_weights [m] f32) "
        "-> (d_gate_up [m, 2F], d_route [m])",
        R.moe_wo_dlhs_dswiglu, ("d_gate_up", "d_route"), (), _dswiglu_cases(),
    ),
    "gdn": OpSpec(
        "gdn",
        "fn(q [B, T, H, K], k [B, T, H, K], v [B, T, H, V], g [B, T, H], beta [B, T, H], "
        "initial_state [B, H, K, V] or None) -> (o [B, T, H, V], final_state [B, H, K, V])",
        _gdn_reference, ("o", "final_state"), ("q", "k", "v", "g", "beta", "initial_state"), _gdn_cases(),
        grad_names={"initial_state": "dstate0"}, expected=_gdn_expected,
    ),
    "gdn_chunk_maps": OpSpec(
        "gdn_chunk_maps",
        "fn(k [B, T, H, K], v [B, T, H, V], g [B, T, H], beta [B, T, H], chunk_size=C) "
        "-> (M [B, N, H, K, K], B [B, N, H, K, V])",
        R.gdn_chunk_maps, ("M", "B"), ("k", "v", "g", "beta"), _chunk_maps_cases(),
    ),
    "gdn_fold": OpSpec(
        "gdn_fold",
        "fn(m [B, N, H, K, K], b [B, N, H, K, V]) -> (M [B, H, K, K], B [B, H, K, V]), chunk 0 applied first",
        _fold_reference, ("M", "B"), ("m", "b"), _fold_cases(),
    ),
    "fp8_fake_quant": OpSpec(
        "fp8_fake_quant", "fn(w [...], axes tuple[int]) -> w_hat [...] (straight-through gradient)",
        R.fp8_fake_quant, ("w_hat",), ("w",), _fp8_cases(),
    ),
}
