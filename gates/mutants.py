"""Mutants: deliberately wrong kernels and flag paths that the gates must catch (``python -m nxgates mutants``).

Each mutant injects one bug into the candidate run, through ``model.ops.override`` (a wrong implementation of one op,
traced only while the candidate is built) or through the protocol's loss, on the code path of the flag it names (the
flag and its prerequisite tuning flags are on in the candidate). Each declares, before it runs, per lens (the bf16 gates
and, for a rounding check, the float32 lens), the gates it MUST fail (clear of the bound, with the margin stated) and
the gates it MAY fail (near a bound, with the reason); a mutant passes when, in each lens, it fails every must-gate and
no gate outside must + may (a gate "fails" when it fails at any step, against the control or against the reference
pair). A prediction of the exact set would flip whenever a metric sits within 1% of its bound (issue 15: another
machine's N2 for ``gmm_group_boundary_off_by_one``); must/may does not. The measured clearance of every failed gate
(the largest metric / bound over the steps and both sides) is reported next to the declaration.

Why N1 passes for every bug outside the loss: the loss value depends only on the advantages and the completion mask
(the ratio is exactly 1), so a wrong forward or backward cannot move it; only a wrong loss can.
Why a backward-only bug leaves N2 alone: the log-probs of step 1 are computed before any update, and those of steps 2
and 3 move by AdamW steps of lr 1e-5, too little to lift their distance above N2's bound (measured by the
mutants run).

Run: python -m nxgates mutants [--config tiny] [--only NAME ...]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from nxgates.gates import atomic, contracts, protocol
from nxgates.gates import gates as gates_lib

ALL_BUT_N1 = ("N2", "N3", "N4", "N5", "N6")
EXACT = "any changed bit fails an exact gate (bound 0)"


def _all(gates, margin: str) -> dict[str, str]:
    return {g: margin for g in gates}


@dataclasses.dataclass(frozen=True)
class Mutant:
    """One deliberately wrong variant: its bug, the flag path it lives on, and per lens the gates it must and may fail.

    ``must``: gate -> the stated margin by which it clears its bound; ``may``: gate -> why it sits near a bound (a
    may-gate must carry its reason). ``lens_must`` / ``lens_may``: the same for the float32 lens (None: the lens does
    not run, an ``exact`` check)."""

    name: str
    bug: str
    flags: dict  # tuning flags turned on in the candidate (prerequisites are added by the model's closure)
    must: dict
    why: str
    overrides: Callable[[object, object], list[tuple[str, Callable]]] = lambda cfg, flags: []  # (op name, fn)
    loss_fn: Callable | None = None
    may: dict = dataclasses.field(default_factory=dict)
    lens_must: dict | None = None
    lens_may: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for label, decl in (("must", self.must), ("may", self.may), ("lens_must", self.lens_must or {}),
                            ("lens_may", self.lens_may)):
            bad = [g for g in decl if g not in gates_lib.GATES]
            if bad:
                raise ValueError(f"mutant {self.name}: {label} names {bad}, not gates {gates_lib.GATES}")
            if label.endswith("may") and not all(isinstance(r, str) and r.strip() for r in decl.values()):
                raise ValueError(f"mutant {self.name}: every {label} gate needs its reason (got {decl!r})")
        for a, b in ((self.must, self.may), (self.lens_must or {}, self.lens_may)):
            if set(a) & set(b):
                raise ValueError(f"mutant {self.name}: gates {sorted(set(a) & set(b))} are both must and may")
        if not self.must and not self.lens_must:
            raise ValueError(f"mutant {self.name}: declares no gate it must fail in either lens")

    @property
    def expect_fail(self) -> frozenset[str]:  # the bf16 must-gates (the name the reports used before must/may)
        return frozenset(self.must)


def verdict(must, may, failed) -> bool:
    """must/may semantics: every must-gate failed, and nothing failed outside must + may."""
    failed = frozenset(failed)
    return set(must) <= failed and failed <= set(must) | set(may)


# ------------------------------------------------------------------------------------------------ moe_mlp helpers
def _real_moe_mlp(flags):
    """The production ``moe_mlp`` the flags select (what ``model.moe`` dispatches), for wrapping."""
    from nxgates.kernels.gmm import ops as gmm_ops
    from nxgates.model.flags import moe_tiles

    return functools.partial(
        gmm_ops.moe_mlp, fused_swiglu=bool(flags.moe_wi_gmm_fused_swiglu),
        fused_dswiglu=bool(flags.moe_wo_gmm_fused_dswiglu),
        router_grad_from_wo_input=bool(flags.moe_router_grad_from_wo_input), tiles=moe_tiles(flags),
        interpret=jax.devices()[0].platform == "cpu",
    )


def with_backward_edit(real, edit, name):
    """``real``'s forward and backward, then ``edit(primals, dy, grads) -> grads`` on the cotangents."""

    @jax.custom_vjp
    def f(x, wi, wo, group_sizes, route_weights):
        return real(x, wi, wo, group_sizes, route_weights)

    def fwd(x, wi, wo, group_sizes, route_weights):
        y, vjp = jax.vjp(lambda a, b, c, r: real(a, b, c, group_sizes, r), x, wi, wo, route_weights)
        return y, (vjp, x, wi, wo, group_sizes, route_weights)

    def bwd(res, dy):
        vjp, x, wi, wo, group_sizes, route_weights = res
        dx, dwi, dwo, dr = vjp(dy)
        dx, dwi, dwo, dr = edit((x, wi, wo, group_sizes, route_weights), dy, (dx, dwi, dwo, dr))
        return dx, dwi, dwo, None, dr

    f.defvjp(fwd, bwd)
    f.__name__ = name
    return f


def _dswiglu_epilogue_edit(flags, name: str, delta):
    """The real MoE MLP with a wrong fused dSwiGLU epilogue: ``delta(gate, up, dh)`` -> [m, 2F], the wrong epilogue's
    cotangent of ``gate_up`` minus the correct one (dh = route weight * dy @ wo^T per group), added on top of the real
    kernel's dx and dwi through the reference GMMs."""
    from nxgates import reference

    def edit(primals, dy, grads):
        x, wi, wo, gs, r = primals
        dx, dwi, dwo, dr = grads
        f = wo.shape[1]
        gate_up = reference.gmm(x, wi, gs)  # [m, 2F] f32
        gate, up = gate_up[:, :f], gate_up[:, f:]
        dh = reference.gmm(dy, jnp.swapaxes(wo, 1, 2), gs) * r.astype(jnp.float32)[:, None]  # [m, F]
        d_delta = delta(gate, up, dh)
        dx = (dx.astype(jnp.float32) + reference.gmm(d_delta, jnp.swapaxes(wi, 1, 2), gs)).astype(dx.dtype)
        dwi = (dwi.astype(jnp.float32) + reference.tgmm(x, d_delta, gs)).astype(dwi.dtype)
        return dx, dwi, dwo, dr

    return [("moe_mlp", with_backward_edit(_real_moe_mlp(flags), edit, name))]


def _dswiglu_missing_factor(cfg, flags):
    def delta(gate, up, dh):
        # The correct dgate is dh * up * s * (1 + gate * (1 - s)); the mutant drops the (1 + gate * (1 - s)) factor:
        # buggy - correct = -dh * up * s * gate * (1 - s) on the gate half.
        s = jax.nn.sigmoid(gate)
        return jnp.concatenate([-dh * up * s * gate * (1 - s), jnp.zeros_like(up)], axis=1)

    return _dswiglu_epilogue_edit(flags, "moe_mlp_dswiglu_missing_factor", delta)


def _d_route_weighted(cfg, flags):
    def edit(primals, dy, grads):
        # d_route must be rowsum(g * h) (g = dy @ wo^T); the mutant uses rowsum(dh * h) with dh = r * g: scaled by r.
        r = primals[4]
        dx, dwi, dwo, dr = grads
        return dx, dwi, dwo, (dr * r.astype(dr.dtype)).astype(dr.dtype)

    return [("moe_mlp", with_backward_edit(_real_moe_mlp(flags), edit, "moe_mlp_d_route_weighted"))]


def _group_boundary_off_by_one(cfg, flags):
    real = _real_moe_mlp(flags)

    def moe_mlp_group_boundary_off_by_one(x, wi, wo, group_sizes, route_weights):
        # Each group boundary one row late: the first row of every non-empty group g >= 1 goes to group g - 1.
        gs = group_sizes.astype(jnp.int32)
        take = jnp.concatenate([jnp.zeros((1,), jnp.int32), (gs[1:] > 0).astype(jnp.int32)])  # [G]
        shifted = gs - take + jnp.concatenate([take[1:], jnp.zeros((1,), jnp.int32)])
        return real(x, wi, wo, shifted, route_weights)

    return [("moe_mlp", moe_mlp_group_boundary_off_by_one)]


def _swiglu_without_silu(cfg, flags):
    from nxgates import reference
    def moe_mlp_swiglu_without_silu(x, wi, wo, group_sizes, route_weights):
        # The fused SwiGLU epilogue writes gate * up: the silu is missing. float32 reference composition otherwise.
        f = wo.shape[1]
        gate_up = reference.gmm(x, wi, group_sizes)  # [m, 2F]
        h = gate_up[:, :f] * gate_up[:, f:] * route_weights.astype(jnp.float32)[:, None]
        return reference.gmm(h, wo, group_sizes).astype(x.dtype)

    return [("moe_mlp", moe_mlp_swiglu_without_silu)]


# ------------------------------------------------------------------------------------------------------ other ops
def _amax_per_shard(cfg, flags):
    def fp8_amax_per_shard(w, axes, axis_name):
        # The hoisted absmax must be global over the fsdp shards (pmax); the mutant keeps each shard's own.
        del axis_name
        return jax.lax.stop_gradient(jnp.max(jnp.abs(w.astype(jnp.float32)), axis=tuple(axes), keepdims=True))

    return [("fp8_amax", fp8_amax_per_shard)]


def _hoisted_ids_off_by_one(cfg, flags):
    def lb_ids_off_by_one(seq_len, context_size, rank):
        # The mirrored chunk 2C-1-rank starts one position early: its first token shares the position of the token
        # before it, so it sees one token too many and RoPE rotates the whole chunk by one position less.
        half = seq_len // (2 * context_size)
        first = rank * half + jnp.arange(half, dtype=jnp.int32)
        second = (2 * context_size - 1 - rank) * half - 1 + jnp.arange(half, dtype=jnp.int32)
        positions = jnp.concatenate([first, second]).astype(jnp.int32)  # [S_local]
        return positions, jnp.zeros_like(positions)

    return [("lb_ids", lb_ids_off_by_one)]


def _fold_skipping_a_chunk(name):
    def make(cfg, flags):
        from nxgates.kernels.gdn import context_parallel

        def fold(m, b):
            # m: [n, ..., K, K], b: [n, ..., K, V]: the mutant composes every map but the second one.
            if m.shape[0] > 1:
                m = jnp.concatenate([m[:1], m[2:]], axis=0)
                b = jnp.concatenate([b[:1], b[2:]], axis=0)
            return context_parallel.fold_tree(m, b)

        fold.__name__ = f"{name}_skips_a_chunk"
        return [(name, fold)]

    return make


def _swiglu_swish_beta(cfg, flags):
    from nxgates import reference

    def moe_mlp_swiglu_swish_beta(x, wi, wo, group_sizes, route_weights):
        # A wrong constant in the fused SwiGLU epilogue: silu(gate) = gate * sigmoid(beta * gate) with beta = 1 + 2^-7
        # instead of 1. float32 composition of the references otherwise (output in x's dtype).
        f = wo.shape[1]
        gate_up = reference.gmm(x, wi, group_sizes)  # [m, 2F]
        gate, up = gate_up[:, :f], gate_up[:, f:]
        h = gate * jax.nn.sigmoid((1.0 + 2.0**-7) * gate) * up * route_weights.astype(jnp.float32)[:, None]
        return reference.gmm(h, wo, group_sizes).astype(x.dtype)

    return [("moe_mlp", moe_mlp_swiglu_swish_beta)]


def _dswiglu_stale_scale(cfg, flags):
    def delta(gate, up, dh):
        # A stale constant: d_up = (1 - 2^-8) * dh * silu(gate) instead of dh * silu(gate): -2^-8 * dh * silu(gate)
        # on the up half.
        return jnp.concatenate([jnp.zeros_like(gate), -(2.0**-8) * dh * jax.nn.silu(gate)], axis=1)

    return _dswiglu_epilogue_edit(flags, "moe_mlp_dswiglu_stale_scale", delta)


def _d_route_stale_scale(cfg, flags):
    def edit(primals, dy, grads):
        # A stale normalization constant: d_route = (1 - 2^-6) * rowsum(g * h).
        dx, dwi, dwo, dr = grads
        return dx, dwi, dwo, (dr.astype(jnp.float32) * (1.0 - 2.0**-6)).astype(dr.dtype)

    return [("moe_mlp", with_backward_edit(_real_moe_mlp(flags), edit, "moe_mlp_d_route_stale_scale"))]


def _m_scan_damped(cfg, flags):
    from nxgates.kernels.gdn import context_parallel

    def gdn_cp_fold_damped(m, b):
        # Every chunk map's decay part scaled by 1 - 2^-10 (a wrong constant): the state handed across context
        # ranks forgets slightly too fast.
        return context_parallel.fold_tree(m * (1.0 - 2.0**-10), b)

    return [("gdn_cp_fold", gdn_cp_fold_damped)]


def _loss_wrong_count(logp, old_logp, advantages, mask, *, ratio_clip=None):
    """The GRPO loss normalized by every token (B * (S-1)) instead of the completion tokens."""
    full = protocol.grpo_loss(logp, old_logp, advantages, mask, ratio_clip=ratio_clip)
    mask = mask.astype(jnp.float32)
    return full * jnp.sum(mask) / mask.size


# Predictions, written before the mutants ran: the bf16 must/may from the table calibrated on 2026-12-02 17:47 UTC and
# the routing-replay measurements quoted in each "why" (margins: the measured metric / bound); the float32 lens's from
# the lens's bounds (float32 reassociation noise, ~1e-6 relative, gates/calibrate.py derive_lens_tolerances): any
# logic error well above that fails the gates it reaches. Corrections of earlier predictions: docs/mutants.md.
_STEPS_2_3 = ("steps 2-3 log-probs move only through the wrong updates (AdamW, lr 1e-5): far below bf16, near float32 "
              "noise")
_N6_LENS = ("AdamW's first updates are ~lr * sign(g): the update moves where the gradient's sign flips, which "
            "depends on how many elements sit near 0; its float32 bound may or may not be crossed")
MUTANTS: tuple[Mutant, ...] = (
    Mutant("dswiglu_missing_factor", "fused dSwiGLU epilogue drops the (1 + gate * (1 - s)) factor of silu'",
           {"moe_wo_gmm_fused_dswiglu": True},
           {"N3": "the norm moves by the missing factor, well over 2e-3",
            "N4": "an error as large as bf16's, independent of it: ~sqrt(2) = 1.41 x the control's distance vs 1.05",
            "N5": "the routers and the decay parameters move more than the control's own distance",
            "N6": "the update's signs follow the wrong gradient"},
           "every expert's d_gate and, through dx, every earlier layer's gradient is wrong by an error about as large "
           "as bf16's own (measured without routing replay: 3.7e-2 from the control at step 1), independent of it. "
           "The forward is untouched at step 1 and moves only through the updates (N2 passes in bf16)",
           overrides=_dswiglu_missing_factor,
           lens_must=_all(("N3", "N4", "N5"), "an error ~bf16's size against float32 noise (~1e-6)"),
           lens_may={"N2": _STEPS_2_3, "N6": _N6_LENS}),
    Mutant("d_route_weighted", "the router gradient from the weighted gradient: rowsum(r * g * h) for rowsum(g * h)",
           {"moe_router_grad_from_wo_input": True},
           {"N3": "the norm moves with the routers' halved gradient",
            "N4": "1.21-1.24 x the control's distance from the reference vs 1.05 (clear by 15%)",
            "N5": "the routers' gradient ~0.5 from the control, far past their bound"},
           "the routers' gradient shrinks by the routing weight (top-2 renormalized, ~1/2) and flows into every "
           "earlier layer through the router's input; the forward is untouched at step 1 (N2 passes in bf16)",
           overrides=_d_route_weighted,
           may={"N6": "the halved router gradients reach AdamW's second moment: the step-2/3 updates lie 1.06-1.075 x "
                      "the control's distance vs the bound 1.05 (within 3%)"},
           lens_must=_all(("N3", "N4", "N5"), "a ~50% error of the router tensors against float32 noise"),
           lens_may={"N2": _STEPS_2_3, "N6": _N6_LENS}),
    Mutant("fp8_amax_per_shard", "gather8 takes each fsdp shard's own absmax instead of the global one",
           {"fp8_fake_quant_hoist": "gather8"}, _all(ALL_BUT_N1, EXACT),
           "other fp8 scales change the forward weights; the flag is exact, so every changed bit fails",
           overrides=_amax_per_shard),
    Mutant("hoisted_ids_off_by_one", "hoisted load-balanced positions of the mirrored chunk off by one",
           {"context_parallel_attention_load_balance_hoist_ids": True}, _all(ALL_BUT_N1, EXACT),
           "attention sees one token too many and rotates by the wrong angle; the flag is exact",
           overrides=_hoisted_ids_off_by_one),
    Mutant("m_scan_skips_a_chunk", "the GDN CP fold composes every chunk map but one",
           {"gdn_cp_m_scan": True},
           {"N2": "the forward of the next rank's tokens changes by much more than rounding",
            "N4": "9.2e-2 from the control, 2.6 x the control's distance from the reference",
            "N5": "every gradient moves by much more than rounding (0.13 from the control without replay)",
            "N6": "the update's sign flips are the control's but for those the bug causes"},
           "the state handed to the next context rank is wrong. The wrong state changes the gradient's direction but "
           "not its length: the norm stays within 4.3e-4 of the control's, under N3's 2e-3 (N3 passes in bf16)",
           overrides=_fold_skipping_a_chunk("gdn_cp_fold"),
           lens_must=_all(("N2", "N3", "N4", "N5"), "a forward error far above float32 noise"),
           lens_may={"N6": _N6_LENS}),
    Mutant("dh_scan_skips_a_chunk", "the backward GDN CP fold composes every transposed map but one",
           {"gdn_cp_dh_scan": True}, {},
           "the state gradient handed back from rank 1 to rank 0 misses one chunk: a backward-only bug (N2 passes). "
           "Measured in the routing-replay experiment (2026-12-02 17:33): its own error is ~0.4 x bf16's; the decay "
           "parameters move most (1.17-1.20 x, under N5's calibrated slack 0.80), the norm by < 2e-3 (N3) and the "
           "update's signs by less than rounding (N6, 1.02-1.035 x). The bf16 gates cannot vouch for it; the float32 "
           "lens must",
           overrides=_fold_skipping_a_chunk("gdn_cp_dh_fold"),
           may={"N4": "the whole gradient lies 1.07-1.09 x the control's distance from the reference vs the bound "
                      "1.05: within 2-4% of it",
                "N5": "the largest tensor within 1% of its bound: 1.01 x on a znver3 CPU (2026-12-05), under it on "
                      "znver4; which side depends on the machine's bf16 rounding"},
           lens_must=_all(("N3", "N4", "N5"), "a ~0.4 x bf16-sized gradient error against float32 noise"),
           lens_may={"N2": _STEPS_2_3, "N6": _N6_LENS}),
    Mutant("gmm_group_boundary_off_by_one", "the GMM's group boundaries one row late",
           {},
           {"N4": "1.11-1.13 x the control's distance from the reference vs 1.05 (clear by 6-8%)",
            "N5": "the attention layer after the MoE at step 1: 1.43 x the control's own distance (bound vs control)",
            "N6": "the updates 1.11-1.21 x vs 1.05"},
           "one row per group boundary multiplies the wrong expert, forward and backward (routing-replay experiment, "
           "2026-12-02 17:33); the norm moves by < 2e-3 (N3)",
           overrides=_group_boundary_off_by_one,
           may={"N2": "the log-probs move 1.09-1.10 x vs the slack 0.10: within 1% of the bound (failed on another "
                      "machine, issue 15)"},
           lens_must=_all(ALL_BUT_N1[:4], "a forward error far above float32 noise"), lens_may={"N6": _N6_LENS}),
    Mutant("swiglu_without_silu", "the fused SwiGLU epilogue writes gate * up (no silu)",
           {"moe_wi_gmm_fused_swiglu": True}, _all(ALL_BUT_N1, "every routed expert's output is wrong: far past"),
           "every routed expert's output is wrong", overrides=_swiglu_without_silu,
           lens_must=_all(ALL_BUT_N1, "every routed expert's output is wrong: far past")),
    Mutant("loss_wrong_count", "the token-mean divides by every token instead of the completion tokens",
           {}, {"N1": "the loss scales by count / (B * (S-1))", "N3": "so does the gradient norm",
                "N4": "and the gradient", "N5": "and every tensor's gradient"},
           "the global-norm clip (norm > 1) and AdamW's scale invariance leave the updates, hence N6 and the later "
           "log-probs, within rounding", loss_fn=_loss_wrong_count,
           lens_must=_all(("N1", "N3", "N4", "N5"), "the loss and the gradient scale"),
           lens_may={"N2": _STEPS_2_3, "N6": "AdamW is scale invariant only up to its epsilon: the float32 updates may "
                                             "differ above float32 noise"}),
    # Below bf16's own error (issue 15, item 4): each moves the run by less than 0.2 x the control's distance to the
    # float32 reference, so no bf16 gate can see it (sqrt(1 + 0.2^2) = 1.02 < 1.05); the float32 lens must catch it.
    Mutant("swiglu_swish_beta", "the fused SwiGLU epilogue's silu uses sigmoid((1 + 2^-7) * gate)",
           {"moe_wi_gmm_fused_swiglu": True}, {},
           "a wrong constant: h moves by 2^-7 * gate * (1 - s) relative, ~1e-3 for gates ~0.2-0.5, systematic; the "
           "gradient by ~1e-3 relative, under 0.2 x bf16's 3.7e-2 (N4)", overrides=_swiglu_swish_beta,
           lens_must=_all(("N2", "N3", "N4", "N5"), "~1e-3 relative against float32 noise (~1e-6)"),
           lens_may={"N6": _N6_LENS}),
    Mutant("d_route_stale_scale", "the router gradient scaled by a stale constant 1 - 2^-6",
           {"moe_router_grad_from_wo_input": True}, {},
           "the routers' gradient moves by 1.6%; the rest of the gradient through the router's input by much less",
           overrides=_d_route_stale_scale,
           may={"N5": "since N5 reads the tensors of >= 1024 elements (bound 5e-2 instead of 0.13-0.16): the routers' "
                      "own bf16 distance is ~5%, so 1.6% on top lies 0.99-1.004 x the reference bound (2026-12-03, "
                      "docs/mutants.md): on the bound"},
           lens_must=_all(("N4", "N5"), "the routers' gradient 1.6% off against float32 noise"),
           lens_may={"N2": _STEPS_2_3, "N3": "the routers are a small part of the norm: 1.6% of their share may sit "
                                             "near the float32 floor", "N6": _N6_LENS}),
    Mutant("dswiglu_stale_scale", "the fused dSwiGLU epilogue scales d_up by a stale constant 1 - 2^-8",
           {"moe_wo_gmm_fused_dswiglu": True}, {},
           "the up half of every expert's wi gradient moves by 0.4% and dx by less, against bf16's ~4.5% on wi: "
           "sqrt(1 + 0.09^2) = 1.004 x the control's distance at most, under N5's 1.10. Measured (2026-12-03): N2 N4 "
           "N5 N6 at 0.93-0.96 of their bounds, where the flag's own check sits (N4 0.96-0.97, native and AVX2)",
           overrides=_dswiglu_stale_scale,
           lens_must=_all(("N3", "N4", "N5"), "a 0.4% error of the wi gradient against float32 noise (~1e-6)"),
           lens_may={"N2": _STEPS_2_3, "N6": _N6_LENS}),
    Mutant("m_scan_damped", "the GDN CP forward fold scales every chunk map's decay by 1 - 2^-10",
           {"gdn_cp_m_scan": True}, {},
           "a wrong constant: the state handed across context ranks is ~1e-3 too small, only for the tokens after "
           "the first rank; the log-probs and gradients move far less than bf16's own error",
           overrides=_m_scan_damped,
           lens_must=_all(("N2", "N4", "N5"), "a ~1e-3 state error against float32 noise"),
           lens_may={"N3": "the norm may move less than its float32 floor", "N6": _N6_LENS}),
)


@dataclasses.dataclass
class MutantResult:
    mutant: Mutant
    contract: str
    failed: frozenset[str]
    check: object  # gates.runner.CheckResult
    lens_failed: frozenset[str] | None = None  # None: the lens did not run

    @property
    def bf16_ok(self) -> bool:
        return verdict(self.mutant.must, self.mutant.may, self.failed)

    @property
    def lens_ok(self) -> bool | None:
        if self.mutant.lens_must is None:
            return None if self.lens_failed is None else False  # an undeclared lens verdict is a mismatch
        if self.lens_failed is None:
            return False  # declared but the lens did not run
        return verdict(self.mutant.lens_must, self.mutant.lens_may, self.lens_failed)

    @property
    def ok(self) -> bool:
        return self.bf16_ok and self.lens_ok is not False


@contextlib.contextmanager
def _overriding(api, pairs: list[tuple[str, Callable]]):
    """Every (op name, fn) of ``pairs`` through ``api.override`` while the block runs, none after it."""
    with contextlib.ExitStack() as stack:
        for op, fn in pairs:
            stack.enter_context(api.override(op, fn))
        yield


def failed_gates(check, lens: bool = False) -> frozenset[str] | None:
    results = check.lens_results if lens else check.results
    if results is None:
        return None
    return frozenset(r.gate for r in results if not r.passed)


def clearance(results, gate: str) -> float:
    """The largest metric / bound of ``gate`` over the steps and both sides (inf past a 0 bound; 0 when equal)."""
    def ratio(x, b):
        return (math.inf if x > 0 else 0.0) if b == 0 else x / b
    return max((max(ratio(r.vs_control, r.bound_control), ratio(r.vs_reference, r.bound_reference))
                for r in results if r.gate == gate), default=0.0)


def run_mutants(config: str = "tiny", *, api=None, only=None, cache_dir=None, progress=None,
                mutants: tuple[Mutant, ...] = MUTANTS, lens: bool | None = None) -> list[MutantResult]:
    """Every mutant of ``mutants`` (or those named in ``only``) through its check; ``lens``: the runner's float32 lens
    (None: on when the tolerance table has ``[lens.*]``)."""
    from nxgates.gates import record as record_lib
    from nxgates.gates import runner as runner_lib
    from nxgates.gates.errors import BadInput

    progress = progress or (lambda m: print(m, file=sys.stderr, flush=True))
    names = [m.name for m in mutants]
    for n in only or ():
        if n not in names:
            raise BadInput(f"--only {n}: unknown mutant; mutants are {names}")
    chosen = [m for m in mutants if not only or m.name in only]
    r = runner_lib.Runner(config, api=api, cache=record_lib.RecordCache(cache_dir, log=progress), progress=progress,
                          lens=lens)
    base = r.api.as_dict(r.base_flags)
    specs = []
    for m in chosen:  # every combination is validated before anything runs
        if m.flags:
            spec = contracts.build_check(m.name, m.flags, base, r.closure)
        else:
            spec = contracts.CheckSpec(name=m.name, contract="rounding", candidate_overrides={}, keys=())
        r.resolve(spec)
        specs.append(spec)
    for m in chosen:
        progress(f"mutant {m.name}: {m.bug}; must fail {sorted(m.must)}, may fail {sorted(m.may)}; float32 lens: "
                 f"{'n/a' if m.lens_must is None else f'must {sorted(m.lens_must)}, may {sorted(m.lens_may)}'}")
    results = []
    for m, spec in zip(chosen, specs, strict=True):
        _, candidate_flags = r.resolve(spec)
        # The overrides are entered only when run_check enters this context, around the candidate alone, and are
        # removed when it exits: the control and the float32 reference (computed, and cached, first) never see them.
        check = r.run_check(spec, candidate_loss_fn=m.loss_fn or protocol.grpo_loss,
                            candidate_context=functools.partial(_overriding, r.api,
                                                                m.overrides(r.cfg, candidate_flags)))
        res = MutantResult(m, spec.contract, failed_gates(check), check, failed_gates(check, lens=True))
        impl = check.implementations["candidate"]
        injected = [op for op, _ in m.overrides(r.cfg, candidate_flags)]
        missing = [op for op in injected if not str(impl.get(op, "")).startswith("override:")]
        if missing:  # an override that never reached the trace proves nothing
            res.failed = frozenset({"override not traced: " + ", ".join(missing)})
        results.append(res)
        lens = "n/a" if res.lens_failed is None else sorted(res.lens_failed)
        progress(f"mutant {m.name}: failed {sorted(res.failed)} (must {sorted(m.must)}, may {sorted(m.may)}); "
                 f"float32 lens failed {lens}: {'OK' if res.ok else 'MISMATCH'} ({time.perf_counter() - r.t0:.0f}s)")
    return results


def _decl(must, may) -> str:
    return " ".join(sorted(must)) + (" | may " + " ".join(sorted(may)) if may else "")


def _failed(results, failed) -> str:
    if failed is None:
        return "n/a"
    return " ".join(f"{g}({clearance(results, g):.2f}x)" for g in sorted(failed)) or "-"


def table(results: list[MutantResult]) -> str:
    """One row per mutant: per lens the declaration (must | may), the failed gates with their measured clearance
    (metric / bound), the verdict."""
    from tabulate import tabulate

    rows = []
    for res in results:
        m = res.mutant
        lens_decl = "n/a" if m.lens_must is None else _decl(m.lens_must, m.lens_may)
        lens_ok = {None: "n/a", True: "ok", False: "MISMATCH"}[res.lens_ok]
        rows.append([m.name, res.contract, _decl(m.must, m.may) or "-", _failed(res.check.results, res.failed),
                     "ok" if res.bf16_ok else "MISMATCH", lens_decl,
                     _failed(res.check.lens_results or (), res.lens_failed), lens_ok])
    return tabulate(rows, headers=["mutant", "contract", "bf16 must | may", "bf16 failed (clearance)", "bf16",
                                   "lens must | may", "lens failed (clearance)", "lens"],
                    tablefmt="simple", disable_numparse=True)


def to_json(results: list[MutantResult]) -> list[dict]:
    return [{"name": r.mutant.name, "bug": r.mutant.bug, "flags": r.mutant.flags, "contract": r.contract,
             "must": r.mutant.must, "may": r.mutant.may, "lens_must": r.mutant.lens_must,
             "lens_may": r.mutant.lens_may, "failed": sorted(r.failed),
             "lens_failed": None if r.lens_failed is None else sorted(r.lens_failed), "bf16_ok": r.bf16_ok,
             "lens_ok": r.lens_ok, "ok": r.ok, "why": r.mutant.why,
             "gates": [g.as_dict() for g in r.check.results],
             "lens_gates": [g.as_dict() for g in r.check.lens_results or ()], "problems": r.check.problems,
             "lens_problems": r.check.lens_problems} for r in results]


def _from_json(d: dict, by_name: dict) -> MutantResult:
    """A worker's ``to_json`` row as a ``MutantResult`` (its check: the gate rows the table and report read)."""
    import types

    def rows(items):
        return [gates_lib.GateResult(**{k: v for k, v in g.items() if k != "passed"}) for g in items]

    lens = None if d["lens_failed"] is None else rows(d["lens_gates"])
    check = types.SimpleNamespace(results=rows(d["gates"]), lens_results=lens, problems=d["problems"],
                                  lens_problems=d["lens_problems"])
    return MutantResult(by_name[d["name"]], d["contract"], frozenset(d["failed"]), check,
                        None if d["lens_failed"] is None else frozenset(d["lens_failed"]))


def _mutant_in_worker(config: str, name: str, cache_dir: str | None, xla_dir: str | None, lens: bool | None) -> dict:
    """Worker process (``run_mutants_in_workers``): one mutant through its check; its ``to_json`` row."""
    from nxgates.gates.profile import use_compilation_cache_dir

    if xla_dir is not None:
        use_compilation_cache_dir(xla_dir)
    progress = lambda m: print(f"  [{name}] {m}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        return to_json(run_mutants(config, only=[name], cache_dir=cache_dir, progress=progress, lens=lens))[0]
    finally:
        import jax

        jax.clear_caches()  # the next mutant in this process compiles its own programs; keep none of this one's


def run_mutants_in_workers(config: str, jobs: int, *, only=None, cache_dir=None, progress=None,
                           lens: bool | None = None) -> list[MutantResult]:
    """``run_mutants`` with the mutants spread over ``jobs`` worker processes (the built-in model; each mutant is one
    task, so the two cores of a 2-core machine each compile and run one). The control, the float32 reference and the
    lens's control are computed first, here, into the record cache, so no worker computes them again. The workers
    die with this process (``gates.prefetch``)."""
    import concurrent.futures

    from nxgates.gates import prefetch
    from nxgates.gates import record as record_lib
    from nxgates.gates import runner as runner_lib
    from nxgates.gates.errors import BadInput
    from nxgates.gates.profile import active_compilation_cache_dir

    progress = progress or (lambda m: print(m, file=sys.stderr, flush=True))
    by_name = {m.name: m for m in MUTANTS}
    for n in only or ():
        if n not in by_name:
            raise BadInput(f"--only {n}: unknown mutant; mutants are {list(by_name)}")
    names = [m.name for m in MUTANTS if not only or m.name in only]
    r = runner_lib.Runner(config, cache=record_lib.RecordCache(cache_dir, log=progress), progress=progress, lens=lens)
    control, _ = r.shared_record(r.base_flags, "production", "control")
    replay = runner_lib.control_routing(control)
    r.shared_record(r.base_flags, "reference", "reference", replay)
    if r.lens and any(by_name[n].lens_must is not None for n in names):
        r.shared_record(r.base_flags, "lens", "control-lens", replay)
    progress(f"mutants: {len(names)} in {jobs} worker processes")
    pool = prefetch.worker_pool(jobs)
    try:
        futures = {n: pool.submit(_mutant_in_worker, config, n, cache_dir, active_compilation_cache_dir(), r.lens)
                   for n in names}
        rows = {}
        for fut in concurrent.futures.as_completed(futures.values()):
            d = fut.result()
            rows[d["name"]] = d
            res = _from_json(d, by_name)
            progress(f"mutant {d['name']}: failed {sorted(res.failed)}; float32 lens failed "
                     f"{'n/a' if res.lens_failed is None else sorted(res.lens_failed)}: "
                     f"{'OK' if res.ok else 'MISMATCH'} ({time.perf_counter() - r.t0:.0f}s)")
    except BaseException:
        prefetch.stop_pool(pool)
        raise
    pool.shutdown(wait=True)
    return [_from_json(rows[n], by_name) for n in names]


def main(args, api) -> int:
    jobs = getattr(args, "jobs", 1) or 1
    from nxgates.model import ops

    if jobs > 1 and api.override is ops.override:  # the built-in model, which a worker process can build again
        results = run_mutants_in_workers(args.config, jobs, only=args.only, cache_dir=args.cache_dir)
    else:  # one process (a custom model API cannot be rebuilt in a worker)
        results = run_mutants(args.config, api=api, only=args.only, cache_dir=args.cache_dir)
    atomic.write_json_atomic(f"{args.out}/mutants.json", to_json(results))
    if args.json:
        print(json.dumps(to_json(results), indent=2, default=str))
    else:
        print(table(results))
        bad = [r.mutant.name for r in results if not r.ok]
        print(f"{'PASS' if not bad else 'FAIL'}: {len(results) - len(bad)}/{len(results)} mutants fail every must-gate "
              f"and nothing outside must + may, in both lenses" + (f"; mismatched: {', '.join(bad)}" if bad else ""))
    return 0 if all(r.ok for r in results) else 1

