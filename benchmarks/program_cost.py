"""Where one record's CPU goes: trace, lower, compile and execute the model's loss-and-gradient program of one check.

    python benchmarks/program_cost.py [--config tiny] [--flags moe_wi_gmm_fused_swiglu=true] [--precision production]
                                      [--compile-options '{"xla_cpu_parallel_codegen_split_count": 1}'] [--runs 3]
                                      [--cprofile 25 [--cprofile-match pallas]]

It builds the program ``gates.protocol.run_protocol`` compiles for the check (the control's flags with ``--flags``, on
the config's mesh, the routing input as the control's), without the persistent compilation cache, and prints per phase
the wall and the CPU seconds of this process (CPU above wall: XLA used more than one core), the execution of
``--runs`` more calls, and the sha256 of every output byte: a compile option that changes it changes the numbers the
gates read. ``XLA_FLAGS`` in the environment applies too (``--xla_backend_extra_options=...``). ``--cprofile N``: trace
and lower under ``cProfile`` (slower) and print, for each, the N functions with the most cumulative time (with
``--cprofile-match RE``: among those whose file and name match RE, e.g. ``pallas`` or ``nxgates``, and the self
time of all of those summed).
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import json
import pstats
import re
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


def profiled(fn, top: int, match: str | None = None):
    """``timed(fn)``, under cProfile when ``top``; returns (out, wall, cpu, the top functions by cumulative time)."""
    if not top:
        return (*timed(fn), "")
    prof = cProfile.Profile()
    out = timed(lambda: prof.runcall(fn))
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(*([match] if match else []), top)
    if match:  # the time spent in the matching functions' own lines (cProfile's tottime), not in what they call
        own = sum(row[2] for (file, _, name), row in stats.stats.items() if re.search(match, f"{file}:{name}"))
        text.write(f"self time of the functions matching {match!r}: {own:.3f} s\n")
    return (*out, text.getvalue())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--flags", default="moe_wi_gmm_fused_swiglu=true",
                    help='space-separated key=value items; "": the control')
    ap.add_argument("--precision", default="production", choices=("production", "lens", "reference"))
    ap.add_argument("--compile-options", default="{}", help="JSON: XLA options for this compile only")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="profile trace and lower; print the N functions with the most cumulative time of each")
    ap.add_argument("--cprofile-match", default=None, metavar="RE", help="with --cprofile: only functions matching RE")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error(f"--runs={args.runs} must be >= 1")
    if args.cprofile < 0:
        ap.error(f"--cprofile={args.cprofile} must be >= 0")
    if args.cprofile_match is not None and not args.cprofile:
        ap.error(f"--cprofile-match={args.cprofile_match!r} needs --cprofile N")
    if args.cprofile_match is not None:
        try:
            re.compile(args.cprofile_match)
        except re.error as e:
            ap.error(f"--cprofile-match={args.cprofile_match!r}: not a regular expression ({e})")
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
    traced, t_trace, c_trace, prof_trace = profiled(lambda: step.trace(params), args.cprofile,
                                                       args.cprofile_match)
    lowered, t_lower, c_lower, prof_lower = profiled(traced.lower, args.cprofile, args.cprofile_match)
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
    for phase, text in (("trace", prof_trace), ("lower", prof_lower)):
        if text:
            print(f"\n--- {phase}, under cProfile ---\n{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
