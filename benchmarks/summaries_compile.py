"""A record's summaries computed two ways, timed side by side: ``recorder.jitted_summaries`` (one program over every
tensor, what the protocol used before) against ``recorder.summaries_by_tensor`` (one program per tensor shape).

    python benchmarks/summaries_compile.py [--config tiny] [--rounds 3]

Each round runs both ways in fresh child processes, alternating which goes first. A child builds the config's control
model on its mesh, computes one gradient and one optimizer step (not timed), then times the summaries of step 0 (the
parameters) and of steps 1 and 2 (gradients, parameters, update; step 1 compiles, step 2 reuses the programs), with the
persistent compilation cache off. It prints the seconds and the sha256 of every summary array's bytes: the two ways
must agree bit for bit (the benchmark exits 1 otherwise). Then min / median per way and phase.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import hashlib, json, sys, time
from nxgates.devices import use_host_devices
use_host_devices()
import jax, jax.numpy as jnp, numpy as np
from nxgates.gates import protocol, recorder
from nxgates.gates.runner import Runner
way, config = sys.argv[1], sys.argv[2]
r = Runner(config, progress=None, lens=False)
flags = r.base_flags
mesh = r.api.make_mesh(flags)
fn = r.api.build_log_probs(r.cfg, flags, precision="production", mesh=mesh)
params = r.api.place_params(r.params0(), mesh)
b = r.batch
routing = (jnp.zeros(fn.routing_shape, jnp.int32), jnp.bool_(False))

def loss(p):
    logp, _ = fn(p, jnp.asarray(b.tokens), routing)
    return protocol.grpo_loss(logp, jax.lax.stop_gradient(logp), jnp.asarray(b.advantages),
                              jnp.asarray(b.completion_mask), ratio_clip=None)

grads = jax.jit(jax.grad(loss))(params)
new = jax.jit(lambda p, g: jax.tree.map(lambda a, d: a - 1e-3 * d, p, g))(params, grads)
jax.block_until_ready((grads, new))
w, s = protocol.DEFAULT_SKETCH.width, protocol.DEFAULT_SKETCH.seed
if way == "fused":
    f = recorder.jitted_summaries(w, s)
    call = lambda *a, **k: f(*a, **k)
else:
    call = lambda *a, **k: recorder.summaries_by_tensor(*a, **k, width=w, seed=s)
out, digest = {}, hashlib.sha256()
for name, args, kw in (("step0", (None, params), {}), ("step1", (grads, new), {"prev_params": params}),
                       ("step2", (grads, new), {"prev_params": params})):
    t = time.perf_counter()
    summ = jax.device_get(call(*args, **kw))
    out[name] = time.perf_counter() - t
    for k in sorted(summ):
        digest.update(k.encode() + np.asarray(summ[k]).tobytes())
print("@@" + json.dumps({**out, "sha256": digest.hexdigest(), "tensors": len(jax.tree.leaves(params))}))
"""


def run_child(way: str, config: str) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD, way, config], capture_output=True, text=True)
    line = next((x for x in p.stdout.splitlines() if x.startswith("@@")), None)
    if p.returncode != 0 or line is None:
        raise SystemExit(f"summaries_compile: the {way} child failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(line[2:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds={args.rounds} must be at least 1")
    results: dict[str, list[dict]] = {"fused": [], "by_tensor": []}
    for i in range(args.rounds):
        for way in (("fused", "by_tensor") if i % 2 == 0 else ("by_tensor", "fused")):
            res = run_child(way, args.config)
            results[way].append(res)
            print(f"round {i + 1} {way}: step0 {res['step0']:.2f} s, step1 {res['step1']:.2f} s, "
                  f"step2 {res['step2']:.2f} s ({res['tensors']} tensors), sha256 {res['sha256'][:16]}", flush=True)
    digests = {res["sha256"] for rs in results.values() for res in rs}
    print("\n| way | runs | step 0 s (min, median) | step 1 s | step 2 s |\n| --- | ---: | --- | --- | --- |")
    for way, rs in results.items():
        cells = [f"{min(x[k] for x in rs):.2f}, {statistics.median(x[k] for x in rs):.2f}"
                 for k in ("step0", "step1", "step2")]
        print(f"| {way} | {len(rs)} | " + " | ".join(cells) + " |")
    if len(digests) != 1:
        print(f"the two ways differ: {len(digests)} distinct digests of the summaries", file=sys.stderr)
        return 1
    print("the same summaries, bit for bit, every run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
