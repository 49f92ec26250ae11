"""Kernel-report cases of the MoE kernels (GMM / tgmm, fused SwiGLU forward and backward, d_route, moe_mlp) and fp8.

Every row compares an implementation (``IMPLS``, looked up at call time so the report can substitute one) with the
float32 reference of ``reference/`` on the same inputs: built in numpy from a seed derived from the case id, rounded
through bfloat16, so every side sees the same values.

Cases (``CASES``):
- ``tiny``: m=40 rows (38 routed, one empty expert, sum < m), D=64, F=32, G=4, tiles (16, 32, 32) so m tiles straddle
  group boundaries and D is split in two k tiles. Seconds on CPU.
- ``cell``: the trainer's shapes per expert shard: hidden D=4096, MoE MLP F=1024, G=6 local experts (one empty),
  m=2560 rows of which 2400 routed, the recipe's tiles tm=256, tk=4096, tn=1024. Minutes to an hour on CPU (the
  float32 references cost G dense matmuls each); ``--kernel`` selects a subset.

Kernels / outputs / implementations:
- ``gmm`` (the wi GMM ``x[m,D] @ wi[G,D,2F]``): ``fwd``, ``dlhs``, ``drhs``; ``pallas`` (``kernels.gmm.gmm``) and
  ``xla`` (``jax.lax.ragged_dot``), both bf16 in / bf16 out, gradients by ``jax.vjp``.
- ``swiglu_fwd``: ``h``, ``gate_up``; ``pallas_fused`` (``moe_wi_gmm_fused_swiglu``) and ``unfused`` (GMM writes bf16
  ``gate_up``, then ``h`` in a separate pass).
- ``dswiglu_bwd``: ``d_gate_up``, ``d_route``; ``pallas_fused`` (``moe_wo_gmm_fused_dswiglu`` +
  ``moe_router_grad_from_wo_input``), ``pallas_fused_no_router`` (``d_route`` from the rounded ``g``), ``unfused``.
  Reference: ``reference.moe_wo_dlhs_dswiglu``.
- ``moe_mlp``: ``y``, ``dx``, ``dwi``, ``dwo``, ``d_route``; ``flags_on`` (all three MoE flags) and ``flags_off``
  (the trainer's unfused path). Reference: ``jax.vjp`` of the float32 composition of reference ops.
- fp8 (``fp8_rows``): ``fp8_absmax_quantize`` ``codes`` and ``scale`` of stacked weights [L, E, K, N]; exact.

Run: ``python -m nxgates.kernel_report --op moe --op fp8 [--case cell]``.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from nxgates import reference as R
from nxgates.gates.kernel_cases.base import KernelRow, interpret_mode
from nxgates.kernels.fp8 import fp8_absmax_quantize
from nxgates.kernels.gmm import ops as G
from nxgates.kernels.tiling import MoeTiles

CASES = ("tiny", "cell")
_BF16 = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class MoeCase:
    name: str
    rows: int  # m
    embed: int  # D
    mlp: int  # F
    group_sizes: tuple[int, ...]  # G entries, sum <= rows
    tiles: tuple[int, int, int]  # (tm, tk, tn)
    fp8_shape: tuple[int, int, int, int]  # [L, E, K, N]

    @property
    def case_id(self) -> str:
        tm, tk, tn = self.tiles
        return f"M{self.rows}-D{self.embed}-F{self.mlp}-G{len(self.group_sizes)}-tm{tm}-tk{tk}-tn{tn}-bf16"

    def moe_tiles(self) -> MoeTiles:
        tm, tk, tn = self.tiles
        names = [f.name for f in dataclasses.fields(MoeTiles) if f.name != "wi_tile_fwd_rhs_buffer_count"]
        kw = {n: tm if n.endswith("batch_seq") else tk if n.endswith("embed_dim") else tn for n in names}
        kw["wo_tile_dlhs_mlp_dim"] = max(tn, self.mlp)  # the fused dSwiGLU needs one n tile over F
        return MoeTiles(**kw)


SPECS = {
    "tiny": MoeCase("tiny", 40, 64, 32, (9, 0, 21, 8), (16, 32, 32), (2, 3, 64, 48)),
    "cell": MoeCase("cell", 2560, 4096, 1024, (512, 301, 0, 633, 467, 487), (256, 4096, 1024), (2, 4, 4096, 2048)),
}


def _rng(case_id: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(case_id.encode()))


def _bf16(x: np.ndarray) -> jax.Array:
    """numpy float -> bf16 jax array (every side then sees these bf16 values)."""
    return jnp.asarray(np.asarray(x, np.float32).astype(ml_dtypes.bfloat16))


def _inputs(spec: MoeCase) -> dict[str, jax.Array]:
    rng = _rng(spec.case_id)
    m, d_model, f_mlp, num_groups = spec.rows, spec.embed, spec.mlp, len(spec.group_sizes)
    return {
        "x": _bf16(rng.standard_normal((m, d_model))),
        # Weights scaled so gate_up and y are O(1): 1/sqrt(fan-in).
        "wi": _bf16(rng.standard_normal((num_groups, d_model, 2 * f_mlp)) / np.sqrt(d_model)),
        "wo": _bf16(rng.standard_normal((num_groups, f_mlp, d_model)) / np.sqrt(f_mlp)),
        "group_sizes": jnp.asarray(np.array(spec.group_sizes, np.int32)),
        "route_weights": jnp.asarray(rng.uniform(0.05, 1.0, m).astype(np.float32)),
        "dy": _bf16(rng.standard_normal((m, d_model))),
        "dout_gmm": _bf16(rng.standard_normal((m, 2 * f_mlp))),
    }


# ------------------------------------------------------------------------------------------------ implementations


def _gmm_pallas(x, w, gs, tiles):
    return G.gmm(x, w, gs, tiles=tiles, interpret=interpret_mode())


def _gmm_xla(x, w, gs, tiles):
    del tiles
    return jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32).astype(x.dtype)


def _swiglu_fused(x, wi, gs, tiles):
    return G.swiglu_gmm(x, wi, gs, tiles=tiles, interpret=interpret_mode())


def _swiglu_unfused(x, wi, gs, tiles):
    return G.unfused_swiglu_fwd(x, wi, gs, tiles=tiles, interpret=interpret_mode())


def _dswiglu_fused(dy, wo, gate_up, gs, r, tiles):
    return G.dswiglu_gmm(dy, wo, gate_up, gs, r, tiles=tiles[:2], emit_d_route=True, interpret=interpret_mode())


def _dswiglu_fused_no_router(dy, wo, gate_up, gs, r, tiles):
    return G.dswiglu_gmm(dy, wo, gate_up, gs, r, tiles=tiles[:2], emit_d_route=False, interpret=interpret_mode())


def _dswiglu_unfused(dy, wo, gate_up, gs, r, tiles):
    return G.unfused_dswiglu_bwd(dy, wo, gate_up, gs, r, tiles=tiles, interpret=interpret_mode())


def _moe(flags_on: bool, x, wi, wo, gs, r, moe_tiles):
    return G.moe_mlp(x, wi, wo, gs, r, fused_swiglu=flags_on, fused_dswiglu=flags_on,
                     router_grad_from_wo_input=flags_on, tiles=moe_tiles, interpret=interpret_mode())


def _fp8_pallas(w):
    return fp8_absmax_quantize(w, interpret=interpret_mode())


IMPLS: dict[str, Callable] = {
    "gmm.pallas": _gmm_pallas,
    "gmm.xla": _gmm_xla,
    "swiglu_fwd.pallas_fused": _swiglu_fused,
    "swiglu_fwd.unfused": _swiglu_unfused,
    "dswiglu_bwd.pallas_fused": _dswiglu_fused,
    "dswiglu_bwd.pallas_fused_no_router": _dswiglu_fused_no_router,
    "dswiglu_bwd.unfused": _dswiglu_unfused,
    "moe_mlp.flags_on": functools.partial(_moe, True),
    "moe_mlp.flags_off": functools.partial(_moe, False),
    "fp8.pallas": _fp8_pallas,
}


def _np(x) -> np.ndarray:
    return np.asarray(jax.device_get(x))


def _impl(name: str) -> Callable:
    return IMPLS[name]  # looked up per call: the report may have overridden it


# ----------------------------------------------------------------------------------------------------------- rows


KERNELS = ("gmm", "swiglu_fwd", "dswiglu_bwd", "moe_mlp")


def rows(case: str, kernels: tuple[str, ...] | None = None) -> Iterator[KernelRow]:
    """The MoE rows of ``case`` (see the module docstring); ``kernels``: only these (default ``KERNELS``)."""
    if case not in SPECS:
        raise ValueError(f"case={case!r} must be one of {CASES}")
    kernels = KERNELS if kernels is None else tuple(kernels)
    unknown = sorted(set(kernels) - set(KERNELS))
    if unknown:
        raise ValueError(f"kernels={unknown} are not MoE kernels ({KERNELS})")
    spec = SPECS[case]
    inp = _inputs(spec)
    for kernel in KERNELS:
        if kernel in kernels:
            yield from _ROWS[kernel](case, spec, inp)


def _row(case, kernel, output, impl, actual, expected) -> KernelRow:
    return KernelRow(kernel, case, output, impl, _np(actual), _np(expected), f"{kernel}.{output}")


def _f32(x):
    return jnp.asarray(x, jnp.float32)


def _gmm_rows(case, spec, inp):
    """Forward, dlhs, drhs of the wi GMM's shapes."""
    x, wi, gs, dout = inp["x"], inp["wi"], inp["group_sizes"], inp["dout_gmm"]
    ref_fwd, ref_vjp = jax.vjp(lambda a, b: R.gmm(a, b, gs), _f32(x), _f32(wi))
    ref_dlhs, ref_drhs = ref_vjp(_f32(dout))
    for impl in ("pallas", "xla"):
        fn = _impl(f"gmm.{impl}")
        out, vjp = jax.vjp(lambda a, b, fn=fn: fn(a, b, gs, spec.tiles), x, wi)
        dlhs, drhs = vjp(dout.astype(out.dtype))
        yield _row(case, "gmm", "fwd", impl, out, ref_fwd)
        yield _row(case, "gmm", "dlhs", impl, dlhs, ref_dlhs)
        yield _row(case, "gmm", "drhs", impl, drhs, ref_drhs)


def _swiglu_fwd_rows(case, spec, inp):
    x, wi, gs, f_mlp = inp["x"], inp["wi"], inp["group_sizes"], spec.mlp
    gate_up_ref = R.gmm(x, wi, gs)
    h_ref = R.swiglu(gate_up_ref[:, :f_mlp], gate_up_ref[:, f_mlp:])
    for impl in ("pallas_fused", "unfused"):
        h, gate_up = _impl(f"swiglu_fwd.{impl}")(x, wi, gs, spec.tiles)
        yield _row(case, "swiglu_fwd", "h", impl, h, h_ref)
        yield _row(case, "swiglu_fwd", "gate_up", impl, gate_up, gate_up_ref)


def _dswiglu_bwd_rows(case, spec, inp):
    """Inputs: dy, wo, the wi GMM's bf16 gate_up (the trainer's residual), routing weights."""
    x, wi, wo, gs, r, dy = (inp[k] for k in ("x", "wi", "wo", "group_sizes", "route_weights", "dy"))
    gate_up = G.gmm(x, wi, gs, tiles=spec.tiles, interpret=interpret_mode())  # bf16 [m, 2F]
    dgu_ref, droute_ref = R.moe_wo_dlhs_dswiglu(dy, wo, gate_up, gs, r)
    for impl in ("pallas_fused", "pallas_fused_no_router", "unfused"):
        d_gate_up, d_route = _impl(f"dswiglu_bwd.{impl}")(dy, wo, gate_up, gs, r, spec.tiles)
        if impl != "pallas_fused_no_router":  # its d_gate_up comes from the same epilogue as pallas_fused's
            yield _row(case, "dswiglu_bwd", "d_gate_up", impl, d_gate_up, dgu_ref)
        yield _row(case, "dswiglu_bwd", "d_route", impl, d_route, droute_ref)


def _moe_mlp_rows(case, spec, inp):
    """y and the gradients of x, wi, wo, route_weights against jax.vjp of the float32 reference composition."""
    x, wi, wo, gs, r, dy = (inp[k] for k in ("x", "wi", "wo", "group_sizes", "route_weights", "dy"))
    f_mlp = spec.mlp

    def ref_mlp(x, wi, wo, r):
        gu = R.gmm(x, wi, gs)
        return R.gmm(R.swiglu(gu[:, :f_mlp], gu[:, f_mlp:]) * r[:, None], wo, gs)

    y_ref, vjp = jax.vjp(ref_mlp, _f32(x), _f32(wi), _f32(wo), r)
    grads_ref = vjp(_f32(dy))
    moe_tiles = spec.moe_tiles()
    for impl in ("flags_on", "flags_off"):
        fn = _impl(f"moe_mlp.{impl}")
        y, vjp = jax.vjp(lambda a, b, c, d, fn=fn: fn(a, b, c, gs, d, moe_tiles), x, wi, wo, r)
        grads = vjp(dy.astype(y.dtype))
        yield _row(case, "moe_mlp", "y", impl, y, y_ref)
        for name, g, g_ref in zip(("dx", "dwi", "dwo", "d_route"), grads, grads_ref, strict=True):
            yield _row(case, "moe_mlp", name, impl, g, g_ref)


_ROWS = {
    "gmm": _gmm_rows,
    "swiglu_fwd": _swiglu_fwd_rows,
    "dswiglu_bwd": _dswiglu_bwd_rows,
    "moe_mlp": _moe_mlp_rows,
}


def fp8_rows(case: str) -> Iterator[KernelRow]:
    """fp8 absmax + quantize of stacked expert weights [L, E, K, N]: codes and scales, bit-identical expected."""
    if case not in SPECS:
        raise ValueError(f"case={case!r} must be one of {CASES}")
    spec = SPECS[case]
    shape = spec.fp8_shape
    rng = _rng(f"fp8-L{shape[0]}-E{shape[1]}-K{shape[2]}-N{shape[3]}-bf16")
    # Channel magnitudes spread over 2^-30 .. 2^8, one all-zero channel (scale 1).
    w = rng.standard_normal(shape) * np.exp2(rng.uniform(-30, 8, (1, shape[1], 1, shape[3])))
    w[0, 0, :, 0] = 0.0
    w = _bf16(w)
    scale_ref = R.fp8_scale(w, axes=(2,))
    codes_ref = R.fp8_quantize(w, scale_ref)
    codes, scale = _impl("fp8.pallas")(w)
    yield KernelRow("fp8_absmax_quantize", case, "codes", "pallas", _np(codes), _np(codes_ref), "fp8.codes")
    yield KernelRow("fp8_absmax_quantize", case, "scale", "pallas", _np(scale), _np(scale_ref), "fp8.scale")
