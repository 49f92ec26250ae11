"""Benchmark (not a test): one forward + backward of a config on its mesh, compile and execution timed apart.

Run: ``python -m nxgates.model.bench [--config tiny] [--precision production] [--flags key=value ...] [--repeats 2]``.
Prints the compile wall/CPU time, each execution's wall time, and the process's peak resident memory (``ru_maxrss``).
The 8 host CPU devices are requested here, before jax is imported.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--precision", default="production", choices=("production", "reference", "lens"))
    parser.add_argument("--flags", nargs="*", default=[], help="key=value overrides of the config's control flags")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from nxgates.model import config, flags, rules, sharding, transformer

    try:
        cfg = config.load_config(args.config)
        overrides = dict(kv.split("=", 1) for kv in args.flags)
        model_flags = rules.flags_for(cfg, overrides)
    except (flags.ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    mesh = sharding.make_mesh(model_flags)
    params = sharding.shard_params(transformer.init_params(cfg, 0), mesh)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len)), jnp.int32)
    log_probs = transformer.build_log_probs(cfg, model_flags, precision=args.precision, mesh=mesh)

    def loss(p, t):
        logp, aux = log_probs(p, t)
        return jnp.mean(logp), aux

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    t0, c0 = time.perf_counter(), _cpu_s()
    compiled = step.lower(params, tokens).compile()
    compile_wall, compile_cpu = time.perf_counter() - t0, _cpu_s() - c0
    print(f"config={cfg.name} precision={args.precision} mesh={dict(mesh.shape)} devices={jax.device_count()} "
          f"({jax.devices()[0].platform})")
    print(f"compile: {compile_wall:.1f} s wall, {compile_cpu:.1f} s CPU")
    for i in range(args.repeats):
        t0, c0 = time.perf_counter(), _cpu_s()
        (value, aux), grads = compiled(params, tokens)
        jax.block_until_ready(grads)
        print(f"execute #{i}: {time.perf_counter() - t0:.2f} s wall, {_cpu_s() - c0:.1f} s CPU "
              f"(loss {float(value):.6f}, dropped_tokens {int(aux['dropped_tokens'])})")
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    print(f"peak RSS: {peak_mib:.0f} MiB")
    print("implementations:", log_probs.implementations())
    return 0


if __name__ == "__main__":
    sys.exit(main())
