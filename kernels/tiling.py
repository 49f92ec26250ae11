"""MoE GMM tile configurations (the trainer's keys) and the VMEM footprint of a tile choice, checked per chip.

``MoeTiles`` holds one ``(batch_seq, embed_dim, mlp_dim)`` tile per MoE GMM, named by the trainer's MaxText keys
(``wi_tile_fwd_batch_seq``, ...), plus ``wi_tile_fwd_rhs_buffer_count`` (how many wi weight tiles the fused SwiGLU
forward keeps in flight). Each GMM reads its tiles as ``(tm, tk, tn)`` = (m tile, contraction tile, output tile):

| GMM | computes | tm | tk (contracted) | tn |
| --- | --- | --- | --- | --- |
| wi fwd | ``x[m,D] @ wi[G,D,2F]`` | batch_seq | embed_dim | mlp_dim (over the ``[gate|up]`` width 2F) |
| wi dlhs | ``d_gate_up[m,2F] @ wi^T`` | batch_seq | mlp_dim | embed_dim |
| wi drhs | ``tgmm(x, d_gate_up) -> [G,D,2F]`` | batch_seq (contracted) | embed_dim | mlp_dim |
| wo fwd | ``h[m,F] @ wo[G,F,D]`` | batch_seq | mlp_dim | embed_dim |
| wo dlhs | ``dy[m,D] @ wo^T`` | batch_seq | embed_dim | mlp_dim (== F: one n tile when fused) |
| wo drhs | ``tgmm(h, dy) -> [G,F,D]`` | batch_seq (contracted) | mlp_dim | embed_dim |

A tile larger than its dimension is clipped to it (m: to ``m`` rounded up to 8).

VMEM accounting (``vmem_footprint``), in bytes, of one kernel's resident buffers:
- each input block x its buffer count (2 = Pallas's double buffering; the wi weight of the fused forward and of the
  plain wi GMM: ``wi_tile_fwd_rhs_buffer_count``);
- each output block x 2 (double-buffered write-back);
- the float32 accumulators (one per output tile; two in the fused SwiGLU forward: gate and up);
- every block padded to the VMEM tile ``(8 * 4 / itemsize, 128)`` (a ``[tm, 1]`` routing-weight block costs
  ``[tm, 128]``);
- a fixed per-kernel overhead ``ChipBudget.fixed_overhead`` (Mosaic internal scratch, semaphores, prefetched metadata).
The epilogues are elementwise on the accumulators and keep no tile-sized scratch of their own.

Calibration (the trainer, TPU v7x, fused SwiGLU wi forward, embed 4096 x mlp 2048, bf16): 66.95 MiB with three weight
buffers, 50.95 MiB with two, 57.60 MiB available; one weight buffer 16 MiB. Here: a weight buffer is
``4096 * 2048 * 2 B = 16 MiB`` exactly, so three buffers cost 16.00 MiB more than two, as the trainer measured (the
check the model can fail). The rest is reconstructed: with ``wi_tile_fwd_batch_seq = 512`` (our assumption; the trainer
reported only totals) the x blocks (2 x 4 MiB), the two float32 accumulators (4 MiB) and the h / gate / up output
blocks (3 x 2 x 1 MiB) sum to 18.00 MiB; the remaining 0.95 MiB is the fixed overhead, fitted to these two figures
(both give the same 0.95). 57.60 MiB = 90 % of v7x's 64 MiB VMEM per TensorCore.

Run the tests: ``python -m pytest tests/kernels/test_tiling.py -q``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

MIB = 1024 * 1024


class TileError(ValueError):
    """A tile choice that does not fit VMEM (or is malformed); the message carries the numbers."""


@dataclasses.dataclass(frozen=True)
class ChipBudget:
    """VMEM budget of one TensorCore: ``usable = vmem_bytes * usable_fraction``."""

    vmem_bytes: int
    usable_fraction: float
    fixed_overhead: int
    source: str

    @property
    def usable_bytes(self) -> float:
        return self.vmem_bytes * self.usable_fraction


_VMEM_SOURCE = "vmem_capacity_bytes in jax/_src/tpu_info.py (jax 0.12.0.1)"
_CALIBRATED = "usable fraction 0.9, fixed overhead 0.95 MiB: fitted to the trainer's TPU v7x figures (module docstring)"
_OVERHEAD = round(0.95 * MIB)

# The one per-chip budget table. Capacities per TensorCore from jax's TPU info table; the usable fraction and the fixed
# overhead were calibrated on v7x only and are assumed to carry over to the other chips.
CHIP_BUDGETS: dict[str, ChipBudget] = {
    "tpu-v7x": ChipBudget(64 * MIB, 0.9, _OVERHEAD, f"{_VMEM_SOURCE}; {_CALIBRATED}"),
    "tpu-v6e": ChipBudget(128 * MIB, 0.9, _OVERHEAD, f"{_VMEM_SOURCE}; v7x calibration assumed"),
    "tpu-v5p": ChipBudget(64 * MIB, 0.9, _OVERHEAD, f"{_VMEM_SOURCE}; v7x calibration assumed"),
    "tpu-v5e": ChipBudget(128 * MIB, 0.9, _OVERHEAD, f"{_VMEM_SOURCE}; v7x calibration assumed"),
}


def chip_budget(chip: str) -> ChipBudget:
    if chip not in CHIP_BUDGETS:
        raise ValueError(f"chip={chip!r} is not in the VMEM budget table; known: {sorted(CHIP_BUDGETS)}")
    return CHIP_BUDGETS[chip]


@dataclasses.dataclass(frozen=True)
class MoeTiles:
    """GMM tiles of the MoE MLP, one field per trainer key. Defaults: the recipe's tiles at the trainer's cell
    (``tm = 256``, ``tk = 4096``, ``tn = 1024``) and Pallas's double buffering."""

    wi_tile_fwd_batch_seq: int = 256
    wi_tile_fwd_embed_dim: int = 4096
    wi_tile_fwd_mlp_dim: int = 1024
    wi_tile_fwd_rhs_buffer_count: int = 2
    wi_tile_dlhs_batch_seq: int = 256
    wi_tile_dlhs_embed_dim: int = 4096
    wi_tile_dlhs_mlp_dim: int = 1024
    wi_tile_drhs_batch_seq: int = 256
    wi_tile_drhs_embed_dim: int = 4096
    wi_tile_drhs_mlp_dim: int = 1024
    wo_tile_fwd_batch_seq: int = 256
    wo_tile_fwd_embed_dim: int = 4096
    wo_tile_fwd_mlp_dim: int = 1024
    wo_tile_dlhs_batch_seq: int = 256
    wo_tile_dlhs_embed_dim: int = 4096
    wo_tile_dlhs_mlp_dim: int = 1024
    wo_tile_drhs_batch_seq: int = 256
    wo_tile_drhs_embed_dim: int = 4096
    wo_tile_drhs_mlp_dim: int = 1024

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise TileError(f"{field.name}={value!r} must be a positive int")

    # (tm, tk, tn) of each GMM (see the module table); clipped to the dims by ``effective``.
    def wi_fwd(self) -> tuple[int, int, int]:
        return (self.wi_tile_fwd_batch_seq, self.wi_tile_fwd_embed_dim, self.wi_tile_fwd_mlp_dim)

    def wi_dlhs(self) -> tuple[int, int, int]:
        return (self.wi_tile_dlhs_batch_seq, self.wi_tile_dlhs_mlp_dim, self.wi_tile_dlhs_embed_dim)

    def wi_drhs(self) -> tuple[int, int, int]:
        return (self.wi_tile_drhs_batch_seq, self.wi_tile_drhs_embed_dim, self.wi_tile_drhs_mlp_dim)

    def wo_fwd(self) -> tuple[int, int, int]:
        return (self.wo_tile_fwd_batch_seq, self.wo_tile_fwd_mlp_dim, self.wo_tile_fwd_embed_dim)

    def wo_dlhs(self) -> tuple[int, int, int]:
        return (self.wo_tile_dlhs_batch_seq, self.wo_tile_dlhs_embed_dim, self.wo_tile_dlhs_mlp_dim)

    def wo_drhs(self) -> tuple[int, int, int]:
        return (self.wo_tile_drhs_batch_seq, self.wo_tile_drhs_mlp_dim, self.wo_tile_drhs_embed_dim)


@dataclasses.dataclass(frozen=True)
class MoeDims:
    """Shapes of one MoE MLP call: ``rows`` routed rows (m), ``embed`` (D), ``mlp`` (F), element size in bytes."""

    rows: int
    embed: int
    mlp: int
    itemsize: int = 2  # bf16


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def effective(tiles: tuple[int, int, int], dims: tuple[int, int, int]) -> tuple[int, int, int]:
    """Clip ``(tm, tk, tn)`` to ``(m, k, n)``: tm to ``m`` rounded up to 8, the others to their dims."""
    (tm, tk, tn), (m, k, n) = tiles, dims
    return (min(tm, round_up(max(m, 1), 8)), min(tk, k), min(tn, n))


def _block_bytes(rows: int, cols: int, itemsize: int) -> int:
    """Bytes of a ``[rows, cols]`` VMEM block, padded to the (8 * 4 / itemsize, 128) VMEM tile."""
    sublanes = 8 * max(1, 4 // itemsize)
    return round_up(rows, sublanes) * round_up(cols, 128) * itemsize


KINDS = ("gmm", "tgmm", "swiglu_fwd", "dswiglu_bwd")


def vmem_footprint(
    kind: str,
    tiles: tuple[int, int, int],
    *,
    itemsize: int = 2,
    out_itemsize: int | None = None,
    rhs_buffer_count: int = 2,
    route_weights: bool = True,
    emit_d_route: bool = True,
    chip: str = "tpu-v7x",
) -> dict[str, int]:
    """Itemized VMEM bytes of one kernel with effective tiles ``(tm, tk, tn)``; ``"total"`` includes the overhead.

    kind: ``gmm`` (also the dlhs GMMs), ``tgmm``, ``swiglu_fwd`` (tn over [gate|up]), ``dswiglu_bwd`` (tn = F).
    itemsize: bytes per input element (2 for bf16); out_itemsize: of the outputs (default itemsize; tgmm: 4).
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} must be one of {KINDS}")
    if rhs_buffer_count < 1:
        raise TileError(f"rhs_buffer_count={rhs_buffer_count} must be >= 1")
    tm, tk, tn = tiles
    b_in = itemsize
    b_out = out_itemsize if out_itemsize is not None else (4 if kind == "tgmm" else itemsize)
    items: dict[str, int] = {}
    if kind == "gmm":
        items["lhs x2"] = 2 * _block_bytes(tm, tk, b_in)
        items[f"rhs x{rhs_buffer_count}"] = rhs_buffer_count * _block_bytes(tk, tn, b_in)
        items["acc f32"] = _block_bytes(tm, tn, 4)
        items["out x2"] = 2 * _block_bytes(tm, tn, b_out)
    elif kind == "tgmm":
        items["lhs x2"] = 2 * _block_bytes(tm, tk, b_in)
        items["rhs x2"] = 2 * _block_bytes(tm, tn, b_in)
        items["acc f32"] = _block_bytes(tk, tn, 4)
        items["out x2"] = 2 * _block_bytes(tk, tn, b_out)
    elif kind == "swiglu_fwd":
        if tn % 2:
            raise TileError(f"the fused SwiGLU mlp tile tn={tn} must be even ([gate | up] halves)")
        half = tn // 2
        items["x x2"] = 2 * _block_bytes(tm, tk, b_in)
        items[f"wi gate+up x{rhs_buffer_count}"] = rhs_buffer_count * 2 * _block_bytes(tk, half, b_in)
        items["acc gate+up f32"] = 2 * _block_bytes(tm, half, 4)
        items["out h+gate+up x2"] = 3 * 2 * _block_bytes(tm, half, b_out)
    else:  # dswiglu_bwd: tiles (tm, tk = D tile, tn = F)
        f_mlp = tn
        items["dy x2"] = 2 * _block_bytes(tm, tk, b_in)
        items[f"wo x{rhs_buffer_count}"] = rhs_buffer_count * _block_bytes(f_mlp, tk, b_in)
        items["gate+up x2"] = 2 * 2 * _block_bytes(tm, f_mlp, b_in)
        if route_weights:
            items["r x2"] = 2 * _block_bytes(tm, 1, 4)
        items["acc f32"] = _block_bytes(tm, f_mlp, 4)
        items["d_gate_up x2"] = 2 * _block_bytes(tm, 2 * f_mlp, b_out)
        if route_weights and emit_d_route:
            items["d_route x2"] = 2 * _block_bytes(tm, 1, 4)
        elif route_weights:
            items["g x2"] = 2 * _block_bytes(tm, f_mlp, b_out)
    items["fixed overhead"] = chip_budget(chip).fixed_overhead
    items["total"] = sum(items.values())
    return items


def mib(x: float) -> str:
    return f"{x / MIB:.2f} MiB"


def check_fit(name: str, kind: str, tiles: tuple[int, int, int], *, chip: str = "tpu-v7x", **kwargs) -> dict[str, int]:
    """``vmem_footprint`` of one kernel, or ``TileError`` naming it, its tiles and the numbers."""
    items = vmem_footprint(kind, tiles, chip=chip, **kwargs)
    budget = chip_budget(chip)
    if items["total"] > budget.usable_bytes:
        detail = ", ".join(f"{k} {mib(v)}" for k, v in items.items() if k != "total")
        raise TileError(
            f"{name} tile (tm, tk, tn)={tuple(tiles)} does not fit VMEM on {chip}: {mib(items['total'])} needed, "
            f"{mib(budget.usable_bytes)} available ({detail})"
        )
    return items


def check_tiles_fit(
    tiles: MoeTiles,
    dims: MoeDims,
    chip: str = "tpu-v7x",
    *,
    fused_swiglu: bool = False,
    fused_dswiglu: bool = False,
    router_grad_from_wo_input: bool = False,
    route_weights: bool = True,
) -> dict[str, dict[str, int]]:
    """Check the six MoE GMMs' effective tiles against ``chip``'s VMEM budget; return each one's itemized bytes.

    Raises ``TileError`` for the first kernel that does not fit ("66.95 MiB needed, 57.60 MiB available").
    """
    m, d_model, f_mlp, b = dims.rows, dims.embed, dims.mlp, dims.itemsize
    bufs = tiles.wi_tile_fwd_rhs_buffer_count
    out: dict[str, dict[str, int]] = {}
    wi_fwd = effective(tiles.wi_fwd(), (m, d_model, 2 * f_mlp))
    kind = "swiglu_fwd" if fused_swiglu else "gmm"
    out["wi_fwd"] = check_fit("wi fwd", kind, wi_fwd, chip=chip, itemsize=b, rhs_buffer_count=bufs)
    out["wi_dlhs"] = check_fit("wi dlhs", "gmm", effective(tiles.wi_dlhs(), (m, 2 * f_mlp, d_model)), chip=chip,
                               itemsize=b)
    out["wi_drhs"] = check_fit("wi drhs", "tgmm", effective(tiles.wi_drhs(), (m, d_model, 2 * f_mlp)), chip=chip,
                               itemsize=b)
    out["wo_fwd"] = check_fit("wo fwd", "gmm", effective(tiles.wo_fwd(), (m, f_mlp, d_model)), chip=chip, itemsize=b)
    wo_dlhs = effective(tiles.wo_dlhs(), (m, d_model, f_mlp))
    if fused_dswiglu:
        out["wo_dlhs"] = check_fit(
            "wo dlhs (fused dSwiGLU)", "dswiglu_bwd", (wo_dlhs[0], wo_dlhs[1], f_mlp), chip=chip, itemsize=b,
            route_weights=route_weights, emit_d_route=router_grad_from_wo_input,
        )
    else:
        out["wo_dlhs"] = check_fit("wo dlhs", "gmm", wo_dlhs, chip=chip, itemsize=b)
    out["wo_drhs"] = check_fit("wo drhs", "tgmm", effective(tiles.wo_drhs(), (m, f_mlp, d_model)), chip=chip,
                               itemsize=b)
    return out


__all__ = [
    "CHIP_BUDGETS",
    "ChipBudget",
    "MIB",
    "MoeDims",
    "MoeTiles",
    "TileError",
    "check_fit",
    "check_tiles_fit",
    "chip_budget",
    "effective",
    "round_up",
    "vmem_footprint",
]
