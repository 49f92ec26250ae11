"""A plain JAX + optax trainer, instrumented with the nxgates recorder: the proof that the gates judge any trainer.

Nothing here comes from nxgates' model or protocol: the model (a tiny causal-context MLP language model), its params
dict, the loss, the jitted train step and the AdamW loop are this file's own, as in any trainer. The instrumentation is
the three marked lines (``# nxgates``): the summaries computed inside the jitted step, ``Recorder.step`` on the host.

    python examples/plain_jax_trainer.py --out runs/control   --variant control
    python examples/plain_jax_trainer.py --out runs/reference --variant reference
    python examples/plain_jax_trainer.py --out runs/benign    --variant benign
    python examples/plain_jax_trainer.py --out runs/bug       --variant bug
    nxgates compare runs/control runs/benign --reference runs/reference     # exit 0
    nxgates compare runs/control runs/bug    --reference runs/reference     # exit 1

Variants (the same seeds, initial parameters and batch for all four):
- ``reference``: float32 parameters and activations, every matmul at ``Precision.HIGHEST``: the truth.
- ``control``: the production path: bf16 matmul operands and activations, float32 accumulation, float32 master weights,
  float32 log-softmax and loss.
- ``benign``: the control with every dense layer's contraction split in two halves (split-k: two float32 partial
  products added, then the one bf16 rounding): mathematically the same matmul, the float32 accumulation re-associated,
  like a different k tile of a GMM kernel. A ``rounding`` change that must pass.
- ``bug``: the control with a plausible logic error: the output projection is a scaled dense layer
  (``y = (h @ w_out_proj) * proj_scale``, a muP-style branch multiplier) whose hand-written ``custom_vjp`` forgets
  ``proj_scale`` in the weight gradient. The forward and the loss are untouched; the gradient of one tensor is wrong
  by a factor ``1 / proj_scale``. (AdamW normalizes each element's step, so the update hides most of it: the gradient
  gates N3, N4 and N5 are the ones that must catch it.)

Shapes: tokens [B, S] int32; embed [V, D]; w_in [D, H]; w_out_proj [H, D]; unembed [D, V]; log-probs [B, S-1].
On more than one device the batch is sharded over a 1-D "data" mesh and the weights over their first axis (FSDP style);
the summaries are computed on those sharded arrays inside the jitted step.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

from nxgates.gates import recorder  # nxgates: the only import from nxgates

VARIANTS = ("control", "reference", "benign", "bug")


def config_from_args(args) -> dict:
    """The model / run config: identical for every variant (compare refuses records whose configs differ)."""
    return {"vocab": args.vocab, "d_model": args.d_model, "d_hidden": args.d_hidden, "batch": args.batch,
            "seq": args.seq, "steps": args.steps, "lr": args.lr, "clip": 1.0, "seed": args.seed,
            "proj_scale": 0.25}


def init_params(cfg: dict) -> dict:
    """float32 parameters from the seed (the same for every variant)."""
    k = jax.random.split(jax.random.key(cfg["seed"]), 4)
    v, d, h = cfg["vocab"], cfg["d_model"], cfg["d_hidden"]
    return {
        "embed": jax.random.normal(k[0], (v, d), jnp.float32),
        "mlp": {"w_in": jax.random.normal(k[1], (d, h), jnp.float32) * d**-0.5,
                "b_in": jnp.zeros((h,), jnp.float32),
                "w_out_proj": jax.random.normal(k[2], (h, d), jnp.float32) * h**-0.5},
        "unembed": jax.random.normal(k[3], (d, v), jnp.float32) * d**-0.5,
    }


def make_batch(cfg: dict) -> tuple[np.ndarray, np.ndarray]:
    """Seeded tokens [B, S] and a completion mask [B, S-1] (a random prompt length per row, loss on the rest)."""
    rng = np.random.default_rng(cfg["seed"] + 1)
    b, s = cfg["batch"], cfg["seq"]
    tokens = rng.integers(0, cfg["vocab"], size=(b, s), dtype=np.int32)
    prompt = rng.integers(1, s // 2, size=(b, 1))
    mask = np.arange(1, s)[None, :] >= prompt  # [B, S-1]: target position t+1 is a completion token
    return tokens, mask


# ----------------------------------------------------------------------------------------------------- dense layers
def dense(x, w, variant: str):
    """x [..., K] @ w [K, N] in the variant's precision: the production path rounds the operands and the output to bf16
    and accumulates in float32 (the operands are upcast, so the autodiff transposes accumulate in float32 too)."""
    hi = jax.lax.Precision.HIGHEST
    if variant == "reference":
        return jnp.einsum("...k,kn->...n", x, w, precision=hi)
    xf = x.astype(jnp.bfloat16).astype(jnp.float32)
    wf = w.astype(jnp.bfloat16).astype(jnp.float32)
    if variant == "benign":  # split-k: the same sum, the float32 accumulation in another order
        k2 = w.shape[0] // 2
        acc = (jnp.einsum("...k,kn->...n", xf[..., :k2], wf[:k2], precision=hi)
               + jnp.einsum("...k,kn->...n", xf[..., k2:], wf[k2:], precision=hi))
    else:
        acc = jnp.einsum("...k,kn->...n", xf, wf, precision=hi)
    return acc.astype(jnp.bfloat16)


def scaled_dense(x, w, scale: float, variant: str):
    """(x @ w) * scale with a hand-written backward (the kind of custom_vjp a fused kernel comes with)."""

    @jax.custom_vjp
    def f(x, w):
        return (dense(x, w, variant).astype(jnp.float32) * scale).astype(x.dtype)

    def fwd(x, w):
        return f(x, w), (x, w)

    def bwd(res, dy):
        x, w = res
        dys = dy.astype(jnp.float32) * scale
        dx = dense(dys.astype(dy.dtype), w.T, variant).astype(x.dtype)
        x2 = x.reshape(-1, x.shape[-1])
        if variant == "bug":  # the logic error: the weight gradient forgets the branch multiplier
            dys = dy.astype(jnp.float32)
        dw = dense(x2.T, dys.astype(dy.dtype).reshape(-1, dy.shape[-1]), variant).astype(jnp.float32)
        return dx, dw.astype(w.dtype)

    f.defvjp(fwd, bwd)
    return f(x, w)


# ---------------------------------------------------------------------------------------------------------- the model
def log_probs(params, tokens, cfg: dict, variant: str):
    """Per-token log-probs of the next token [B, S-1], float32."""
    act = jnp.float32 if variant == "reference" else jnp.bfloat16
    e = params["embed"][tokens].astype(act)  # [B, S, D]
    # causal context: the mean of the embeddings up to and including position t
    ctx = (jnp.cumsum(e.astype(jnp.float32), axis=1) / jnp.arange(1, tokens.shape[1] + 1)[None, :, None]).astype(act)
    h = dense(ctx, params["mlp"]["w_in"], variant) + params["mlp"]["b_in"].astype(act)  # [B, S, H]
    h = jax.nn.gelu(h)
    y = ctx + scaled_dense(h, params["mlp"]["w_out_proj"], cfg["proj_scale"], variant)  # [B, S, D]
    logits = dense(y, params["unembed"], variant).astype(jnp.float32)  # [B, S, V]
    logp_all = jax.nn.log_softmax(logits[:, :-1], axis=-1)  # predicts tokens[:, 1:]
    return jnp.take_along_axis(logp_all, tokens[:, 1:, None], axis=-1)[..., 0]  # [B, S-1]


def loss_fn(params, tokens, mask, cfg, variant):
    lp = log_probs(params, tokens, cfg, variant)
    m = mask.astype(jnp.float32)
    return -jnp.sum(lp * m) / jnp.sum(m), lp


def make_optimizer(cfg: dict):
    return optax.chain(optax.clip_by_global_norm(cfg["clip"]), optax.adamw(cfg["lr"], weight_decay=0.01))


def make_train_step(cfg: dict, variant: str, opt, sketch_width: int, sketch_seed: int):
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, tokens, mask):
        (loss, lp), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens, mask, cfg, variant)
        updates, opt_state = opt.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        # nxgates: gradient, parameter and update sketches, fingerprints, per-tensor norms, inside the jitted step
        summ = recorder.summaries(grads, new_params, prev_params=params, width=sketch_width, seed=sketch_seed)
        return new_params, opt_state, loss, optax.tree.norm(grads), lp, summ

    return train_step


def _shardings(params, tokens, mask, devices: int | None):
    """FSDP-style placement over ``devices`` devices (default all): batch over "data", each weight over its first axis
    (where divisible)."""
    n = jax.device_count() if devices is None else devices
    if n == 1 or tokens.shape[0] % n:
        return params, tokens, mask
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n])
    P, NS = jax.sharding.PartitionSpec, jax.sharding.NamedSharding

    def place(x):
        spec = P("data") if x.ndim and x.shape[0] % n == 0 else P()
        return jax.device_put(x, NS(mesh, spec))

    return jax.tree.map(place, params), place(jnp.asarray(tokens)), place(jnp.asarray(mask))


def train(out: str, variant: str, cfg: dict, *, sketch_width: int = 256, sketch_seed: int = 0,
          devices: int | None = None) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} must be one of {VARIANTS}")
    tokens, mask = make_batch(cfg)
    params, tokens, mask = _shardings(init_params(cfg), tokens, mask, devices)
    opt = make_optimizer(cfg)
    opt_state = opt.init(params)
    step_fn = make_train_step(cfg, variant, opt, sketch_width, sketch_seed)
    meta = {"trainer": "examples/plain_jax_trainer.py", "config": cfg,
            "flags": {"variant": variant, "precision": "float32" if variant == "reference" else "bf16"},
            "seeds": {"init": cfg["seed"], "batch": cfg["seed"] + 1}}
    with recorder.Recorder(out, sketch_width=sketch_width, seed=sketch_seed, meta=meta) as rec:  # nxgates
        rec.start(params=params)
        for step in range(1, cfg["steps"] + 1):
            params, opt_state, loss, gnorm, lp, summ = step_fn(params, opt_state, tokens, mask)
            rec.step(step, loss=loss, grad_norm=gnorm, log_probs=lp, mask=mask, summaries=summ)  # nxgates
            print(f"[{variant}] step {step}: loss {float(loss):.6f}, grad norm {float(gnorm):.6f}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="run directory to write (the nxgates record)")
    p.add_argument("--variant", required=True, choices=VARIANTS)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--d-hidden", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sketch-width", type=int, default=256)
    p.add_argument("--sketch-seed", type=int, default=0)
    p.add_argument("--devices", type=int, default=None, help="shard over the first N devices (default: all)")
    args = p.parse_args(argv)
    for name in ("steps", "vocab", "d_model", "d_hidden", "batch", "seq", "sketch_width"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.seq < 4:
        p.error(f"--seq={args.seq} must be >= 4")
    if args.devices is not None and not 1 <= args.devices <= jax.device_count():
        p.error(f"--devices={args.devices} must be in [1, {jax.device_count()}]")
    train(args.out, args.variant, config_from_args(args), sketch_width=args.sketch_width,
          sketch_seed=args.sketch_seed, devices=args.devices)
    return 0


if __name__ == "__main__":
    sys.exit(main())
