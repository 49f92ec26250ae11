"""Where one record's CPU goes: trace, lower, compile and execute the model's loss-and-gradient program of one check.

    python benchmarks/program_cost.py [--config tiny] [--flags moe_wi_gmm_fused_swiglu=true] [--precision production]
                                      [--compile-options '{"xla_cpu_parallel_codegen_split_count": 1}'] [--runs 3]

It builds the program ``gates.protocol.run_protocol`` compiles for the check (the control's flags with ``--flags``, on
the config's mesh, the routing input as the control's), without the persistent compilation cache, and prints per phase
the wall and the CPU seconds of this process (CPU above wall: XLA used more than one core), the execution of
``--runs`` more calls, and the sha256 of every output byte: a compile option that changes it changes the numbers the
gates read. ``XLA_FLAGS`` in the environment applies too (``--xla_backend_extra_options=...``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time

from nxgates.devices import use_host_devices

use_host_devices()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from nxgates.gates import protocol  # noqa: E402
from nxgates.gates.cli import parse_flag_items  # noqa: E402
from nxgates.gates.runner import Runner  # noqa: E402


def timed(fn):
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t, time.process_time() - c


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--flags", default="moe_wi_gmm_fused_swiglu=true",
                    help='space-separated key=value items; "": the control')
    ap.add_argument("--precision", default="production", choices=("production", "lens", "reference"))
    ap.add_argument("--compile-options", default="{}", help="JSON: XLA options for this compile only")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    options = json.loads(args.compile_options)
    r = Runner(args.config, progress=None, lens=False)
    flags = r.flags_from(parse_flag_items(args.flags.split()) if args.flags else {})
    mesh = r.api.make_mesh(flags)
    fn = r.api.build_log_probs(r.cfg, flags, precision=args.precision, mesh=mesh)
    params = r.params0()
    if r.api.place_params is not None:
        params = r.api.place_params(params, mesh)
    b = r.batch
    tokens, mask, adv = jnp.asarray(b.tokens), jnp.asarray(b.completion_mask), jnp.asarray(b.advantages)
    routing = (jnp.zeros(fn.routing_shape, jnp.int32), jnp.bool_(False))

    def objective(p):
        logp, _ = fn(p, tokens, routing)
        return protocol.grpo_loss(logp, jax.lax.stop_gradient(logp), adv, mask, ratio_clip=None), logp

    step = jax.jit(jax.value_and_grad(objective, has_aux=True))
    traced, t_trace, c_trace = timed(lambda: step.trace(params))
    lowered, t_lower, c_lower = timed(traced.lower)
    compiled, t_comp, c_comp = timed(lambda: lowered.compile(compiler_options=options) if options else
                                     lowered.compile())
    out, t_first, c_first = timed(lambda: jax.block_until_ready(compiled(params)))
    runs = [timed(lambda: jax.block_until_ready(compiled(params)))[1:] for _ in range(args.runs)]
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(out):
        digest.update(np.asarray(leaf).tobytes())
    print(f"{args.config} {args.flags or '(control)'} {args.precision} options={options}")
    print(f"trace   {t_trace:6.2f} s wall {c_trace:6.2f} s CPU")
    print(f"lower   {t_lower:6.2f} s wall {c_lower:6.2f} s CPU ({len(lowered.as_text()) / 1024:.0f} KiB StableHLO)")
    print(f"compile {t_comp:6.2f} s wall {c_comp:6.2f} s CPU")
    print(f"execute {t_first:6.2f} s wall {c_first:6.2f} s CPU (first call); {args.runs} more: wall min "
          f"{min(w for w, _ in runs):.2f} median {statistics.median(w for w, _ in runs):.2f} s, CPU median "
          f"{statistics.median(c for _, c in runs):.2f} s")
    print(f"outputs sha256 {digest.hexdigest()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
