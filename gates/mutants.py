"""Mutants: deliberately wrong kernels and flag paths that the gates must catch (``python -m nxgates mutants``).

Each mutant injects one bug into the candidate run, through ``model.ops.override`` (a wrong implementation of one op,
traced only while the candidate is built) or through the protocol's loss, on the code path of the flag it names (the
flag and its prerequisite tuning flags are on in the candidate). Each declares, before it runs, the gates it must fail
and why; the session passes only if every mutant fails exactly those gates (a gate "fails" when it fails at any
step, against the control or against the reference pair).

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
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from nxgates.gates import atomic, contracts, protocol
from nxgates.gates import gates as gates_lib

ALL_BUT_N1 = frozenset({"N2", "N3", "N4", "N5", "N6"})


@dataclasses.dataclass(frozen=True)
class Mutant:
    """One deliberately wrong variant: its bug, the flag path it lives on, and the gates it must fail."""

    name: str
    bug: str
    flags: dict  # tuning flags turned on in the candidate (prerequisites are added by the model's closure)
    expect_fail: frozenset[str]
    why: str
    overrides: Callable[[object, object], list[tuple[str, Callable]]] = lambda cfg, flags: []  # (op name, fn)
    loss_fn: Callable | None = None


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


def _with_backward_edit(real, edit, name):
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


def _dswiglu_missing_factor(cfg, flags):
    from nxgates import reference
    def edit(primals, dy, grads):
        # The correct dgate is dh * up * s * (1 + gate * (1 - s)); the mutant drops the (1 + gate * (1 - s)) factor.
        # Added on top of the real kernel's cotangents: delta = buggy - correct = -dh * up * s * gate * (1 - s).
        x, wi, wo, gs, r = primals
        dx, dwi, dwo, dr = grads
        f = wo.shape[1]
        gate_up = reference.gmm(x, wi, gs)  # [m, 2F] f32
        gate, up = gate_up[:, :f], gate_up[:, f:]
        g = reference.gmm(dy, jnp.swapaxes(wo, 1, 2), gs)  # [m, F] = dy @ wo^T per group
        dh = g * r.astype(jnp.float32)[:, None]
        s = jax.nn.sigmoid(gate)
        d_delta = jnp.concatenate([-dh * up * s * gate * (1 - s), jnp.zeros_like(up)], axis=1)  # [m, 2F]
        dx = (dx.astype(jnp.float32) + reference.gmm(d_delta, jnp.swapaxes(wi, 1, 2), gs)).astype(dx.dtype)
        dwi = (dwi.astype(jnp.float32) + reference.tgmm(x, d_delta, gs)).astype(dwi.dtype)
        return dx, dwi, dwo, dr

    return [("moe_mlp", _with_backward_edit(_real_moe_mlp(flags), edit, "moe_mlp_dswiglu_missing_factor"))]


def _d_route_weighted(cfg, flags):
    def edit(primals, dy, grads):
        # d_route must be rowsum(g * h) (g = dy @ wo^T); the mutant uses rowsum(dh * h) with dh = r * g: scaled by r.
        r = primals[4]
        dx, dwi, dwo, dr = grads
        return dx, dwi, dwo, (dr * r.astype(dr.dtype)).astype(dr.dtype)

    return [("moe_mlp", _with_backward_edit(_real_moe_mlp(flags), edit, "moe_mlp_d_route_weighted"))]


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


def _loss_wrong_count(logp, old_logp, advantages, mask, *, ratio_clip=None):
    """The GRPO loss normalized by every token (B * (S-1)) instead of the completion tokens."""
    full = protocol.grpo_loss(logp, old_logp, advantages, mask, ratio_clip=ratio_clip)
    mask = mask.astype(jnp.float32)
    return full * jnp.sum(mask) / mask.size


# Predictions (the gates each mutant must fail), written before the mutants ran against the table calibrated on
# 2026-12-02 17:47 UTC (per-step rel = the control's distance to the float32 reference, slack from twelve benign k-tile
# reassociations; routing replayed from the control). Where an expected effect sits near a bound, its "why" says so.
# Two predictions were corrected after their first run; what was declared, and why it was wrong: docs/mutants.md.
MUTANTS: tuple[Mutant, ...] = (
    Mutant("dswiglu_missing_factor", "fused dSwiGLU epilogue drops the (1 + gate * (1 - s)) factor of silu'",
           {"moe_wo_gmm_fused_dswiglu": True}, frozenset({"N3", "N4", "N5", "N6"}),
           "every expert's d_gate and, through dx, every earlier layer's gradient is wrong by an error about as large "
           "as bf16's own (measured without routing replay: 3.7e-2 from the control at step 1), independent of it: "
           "about sqrt(2) x the control's distance to the float32 reference (N4, slack 0.05), the gradient norm moves "
           "(N3), the routers and the decay parameters more than the control's own distance (N5); the update's signs "
           "follow the gradient's (N6). The forward is untouched at step 1 and moves only through the updates (N2 "
           "passes)", overrides=_dswiglu_missing_factor),
    Mutant("d_route_weighted", "the router gradient from the weighted gradient: rowsum(r * g * h) for rowsum(g * h)",
           {"moe_router_grad_from_wo_input": True}, frozenset({"N3", "N4", "N5", "N6"}),
           "the routers' gradient shrinks by the routing weight (top-2 renormalized, ~1/2): the router tensors move "
           "~0.5 from the control, far past their bound (N5), and the norm moves (N3); the wrong router gradient also "
           "flows into every earlier layer through the router's input, an error independent of bf16's that puts the "
           "whole gradient 1.21-1.24 x the control's distance from the float32 reference (N4, slack 0.05), and the "
           "routers' halved gradients reach AdamW's second moment, so the step-2 and step-3 updates lie 1.06-1.075 x "
           "the control's distance (N6); the forward is untouched at step 1 and moves only through the updates (N2 "
           "passes)",
           overrides=_d_route_weighted),
    Mutant("fp8_amax_per_shard", "gather8 takes each fsdp shard's own absmax instead of the global one",
           {"fp8_fake_quant_hoist": "gather8"}, ALL_BUT_N1,
           "other fp8 scales change the forward weights; the flag is exact, so every changed bit fails",
           overrides=_amax_per_shard),
    Mutant("hoisted_ids_off_by_one", "hoisted load-balanced positions of the mirrored chunk off by one",
           {"context_parallel_attention_load_balance_hoist_ids": True}, ALL_BUT_N1,
           "attention sees one token too many and rotates by the wrong angle; the flag is exact",
           overrides=_hoisted_ids_off_by_one),
    Mutant("m_scan_skips_a_chunk", "the GDN CP fold composes every chunk map but one",
           {"gdn_cp_m_scan": True}, frozenset({"N2", "N4", "N5", "N6"}),
           "the state handed to the next context rank is wrong: the forward of its tokens changes (N2) and with it "
           "every gradient (N4, N5) by much more than rounding (measured without replay: 0.13 from the control at "
           "step 1); with routing replayed, the update's sign flips are the control's but for those the bug causes "
           "(N6, slack 0.05). The wrong state changes the gradient's direction (9.2e-2 from the control, 2.6 x the "
           "control's distance from the reference) but not its length: the norm stays within 4.3e-4 of the "
           "control's, under N3's 2e-3 (N3 passes)",
           overrides=_fold_skipping_a_chunk("gdn_cp_fold")),
    Mutant("dh_scan_skips_a_chunk", "the backward GDN CP fold composes every transposed map but one",
           {"gdn_cp_dh_scan": True}, frozenset({"N4"}),
           "the state gradient handed back from rank 1 to rank 0 misses one chunk: a backward-only bug (N2 passes). "
           "Measured in the routing-replay experiment (2026-12-02 17:33): its own error is ~0.4 x bf16's, so the whole "
           "gradient lies 1.07-1.09 x the control's distance from the reference (N4 fails at slack 0.05: narrowly); "
           "the decay parameters move most (1.17-1.20 x, under N5's calibrated slack 0.80), the norm by < 2e-3 "
           "(N3) and the update's signs by less than rounding (N6, 1.02-1.035 x)",
           overrides=_fold_skipping_a_chunk("gdn_cp_dh_fold")),
    Mutant("gmm_group_boundary_off_by_one", "the GMM's group boundaries one row late",
           {}, frozenset({"N4", "N5", "N6"}),
           "one row per group boundary multiplies the wrong expert, forward and backward. Measured in the "
           "routing-replay experiment (2026-12-02 17:33): the whole gradient 1.11-1.13 x the control's distance from "
           "the reference (N4), the updates 1.11-1.21 x (N6), and the attention layer after the MoE at step 1 "
           "1.43 x the control's own distance to the reference from the control (N5's bound against the control). "
           "The log-probs move 1.09-1.10 x (N2, under its calibrated slack 0.10: narrowly) and the norm by < 2e-3 (N3)",
           overrides=_group_boundary_off_by_one),
    Mutant("swiglu_without_silu", "the fused SwiGLU epilogue writes gate * up (no silu)",
           {"moe_wi_gmm_fused_swiglu": True}, ALL_BUT_N1,
           "every routed expert's output is wrong", overrides=_swiglu_without_silu),
    Mutant("loss_wrong_count", "the token-mean divides by every token instead of the completion tokens",
           {}, frozenset({"N1", "N3", "N4", "N5"}),
           "the loss and the gradient scale by count / (B * (S-1)); the global-norm clip (norm > 1) and AdamW's "
           "scale invariance leave the updates, hence N6 and the later log-probs, within rounding",
           loss_fn=_loss_wrong_count),
)


@dataclasses.dataclass
class MutantResult:
    mutant: Mutant
    contract: str
    failed: frozenset[str]
    check: object  # gates.runner.CheckResult

    @property
    def ok(self) -> bool:
        return self.failed == self.mutant.expect_fail


@contextlib.contextmanager
def _overriding(api, pairs: list[tuple[str, Callable]]):
    """Every (op name, fn) of ``pairs`` through ``api.override`` while the block runs, none after it."""
    with contextlib.ExitStack() as stack:
        for op, fn in pairs:
            stack.enter_context(api.override(op, fn))
        yield


def failed_gates(check) -> frozenset[str]:
    return frozenset(r.gate for r in check.results if not r.passed)


def run_mutants(config: str = "tiny", *, api=None, only=None, cache_dir=None, progress=None,
                mutants: tuple[Mutant, ...] = MUTANTS) -> list[MutantResult]:
    from nxgates.gates import record as record_lib
    from nxgates.gates import runner as runner_lib
    from nxgates.gates.errors import BadInput

    progress = progress or (lambda m: print(m, file=sys.stderr, flush=True))
    names = [m.name for m in mutants]
    for n in only or ():
        if n not in names:
            raise BadInput(f"--only {n}: unknown mutant; mutants are {names}")
    chosen = [m for m in mutants if not only or m.name in only]
    r = runner_lib.Runner(config, api=api, cache=record_lib.RecordCache(cache_dir, log=progress), progress=progress)
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
        progress(f"mutant {m.name}: {m.bug}; must fail {sorted(m.expect_fail)}")
    results = []
    for m, spec in zip(chosen, specs, strict=True):
        _, candidate_flags = r.resolve(spec)
        # The overrides are entered only when run_check enters this context, around the candidate alone, and are
        # removed when it exits: the control and the float32 reference (computed, and cached, first) never see them.
        check = r.run_check(spec, candidate_loss_fn=m.loss_fn or protocol.grpo_loss,
                            candidate_context=_overriding(r.api, m.overrides(r.cfg, candidate_flags)))
        res = MutantResult(m, spec.contract, failed_gates(check), check)
        impl = check.implementations["candidate"]
        injected = [op for op, _ in m.overrides(r.cfg, candidate_flags)]
        missing = [op for op in injected if not str(impl.get(op, "")).startswith("override:")]
        if missing:  # an override that never reached the trace proves nothing
            res.failed = frozenset({"override not traced: " + ", ".join(missing)})
        results.append(res)
        progress(f"mutant {m.name}: failed {sorted(res.failed)}; expected {sorted(m.expect_fail)}: "
                 f"{'OK' if res.ok else 'MISMATCH'} ({time.perf_counter() - r.t0:.0f}s)")
    return results


def table(results: list[MutantResult]) -> str:
    from tabulate import tabulate

    rows = []
    for res in results:
        worst = {g: max((x.vs_control for x in res.check.results if x.gate == g), default=0.0)
                 for g in gates_lib.GATES}
        rows.append([res.mutant.name, res.contract, " ".join(sorted(res.mutant.expect_fail)),
                     " ".join(sorted(res.failed)) or "-", "ok" if res.ok else "MISMATCH",
                     " ".join(f"{g}={worst[g]:.1e}" for g in gates_lib.GATES)])
    return tabulate(rows, headers=["mutant", "contract", "must fail", "failed", "verdict", "max m vs control"],
                    tablefmt="simple", disable_numparse=True)


def to_json(results: list[MutantResult]) -> list[dict]:
    return [{"name": r.mutant.name, "bug": r.mutant.bug, "flags": r.mutant.flags, "contract": r.contract,
             "expect_fail": sorted(r.mutant.expect_fail), "failed": sorted(r.failed), "ok": r.ok, "why": r.mutant.why,
             "gates": [g.as_dict() for g in r.check.results], "problems": r.check.problems} for r in results]


def main(args, api) -> int:
    results = run_mutants(args.config, api=api, only=args.only, cache_dir=args.cache_dir)
    atomic.write_json_atomic(f"{args.out}/mutants.json", to_json(results))
    if args.json:
        print(json.dumps(to_json(results), indent=2, default=str))
    else:
        print(table(results))
        bad = [r.mutant.name for r in results if not r.ok]
        print(f"{'PASS' if not bad else 'FAIL'}: {len(results) - len(bad)}/{len(results)} mutants fail exactly their "
              f"predicted gates" + (f"; mismatched: {', '.join(bad)}" if bad else ""))
    return 0 if all(r.ok for r in results) else 1

