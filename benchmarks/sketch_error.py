"""How well a CountSketch's distance estimates the exact rel L2, what it costs on tiny, and how big a record is.

    python benchmarks/sketch_error.py [--pairs 200] [--widths 1024 4096 16384] [--cache .cache/gates] [--json F]

1. Error table: for each width and each kind of pair (a, b) of one tensor (the shapes of tiny's large tensors),
   ``|estimate / exact - 1|`` of ``||a - b|| / ||b||`` (N5's per-tensor metric; N4 sums over tensors and is tighter):
   the median, the 99th percentile and the max over the pairs, with the exact denominator (N4/N5 divide by the
   recorded per-tensor norms) and with a sketched one (N6 divides by the sketch of the control's update). Hash seeds
   cycle over 8 values (each a compile per shape). Kinds: gaussian relative noise (rounding-like), the
   difference of bf16 roundings (a realistic rounding pair), heavy-tailed values (Student t, 2 dof), a low-rank
   difference, a sparse difference (0.5% of elements). With ``--cache``: also every (control, candidate) and (control,
   reference) gradient pair of the tiny records found there (real pairs, per tensor over the sketched tensors).
2. Floor: one tensor sketched unsharded and on the 2x2x2 mesh: ``||S1 - S8|| / ||a||`` (float32 summation order).
3. Cost on tiny: ``recorder.summaries`` of the gradient and parameter trees placed like the model's, jitted on the
   8-device mesh: wall time (min / median of 5) and XLA's temp memory, beside the size of the trees.
4. Record size: one step's arrays, full tensors (today's records) vs summaries.
"""

from __future__ import annotations

import argparse
import io
import json
import pathlib
import statistics
import sys
import time

from nxgates.devices import use_host_devices

use_host_devices()

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from nxgates.gates import recorder  # noqa: E402
from nxgates.gates import sketch as S  # noqa: E402

SHAPES = [(256, 256), (1, 8, 256, 256), (256, 512)]


def _pair(kind: str, shape, rng):
    a = rng.standard_normal(shape)
    if kind == "gaussian":
        b = a * (1 + 1e-2 * rng.standard_normal(shape))
    elif kind == "bf16-rounding":
        a = a * np.exp(rng.standard_normal(shape))  # spread of magnitudes
        b = a.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
        a = (a * (1 + 1e-3 * rng.standard_normal(shape))).astype(np.float32).astype(ml_dtypes.bfloat16) \
            .astype(np.float64)
    elif kind == "heavy-tailed":
        a = rng.standard_t(2, shape)
        b = a + 1e-2 * rng.standard_t(2, shape)
    elif kind == "low-rank":
        m = a.reshape(-1, shape[-1])
        u, v = rng.standard_normal((m.shape[0], 2)), rng.standard_normal((2, m.shape[1]))
        b = (m + 1e-2 * (u @ v)).reshape(shape)
    elif kind == "sparse":
        d = np.zeros(a.size)
        idx = rng.choice(a.size, size=max(1, a.size // 200), replace=False)
        d[idx] = rng.standard_normal(idx.size)
        b = a + d.reshape(shape)
    else:
        raise ValueError(kind)
    return a.astype(np.float32), b.astype(np.float32)


def _ratios(a, b, width, seed, path="t"):
    """(estimate / exact of ||a - b|| / ||b|| with the exact denominator, as N4/N5 read it with the recorded per-tensor
    norms; the same with the sketched denominator, as N6 reads it)."""
    f = _sk(width)
    sa, sb = np.asarray(f(a, seed, path)), np.asarray(f(b, seed, path))
    num = np.linalg.norm(a.astype(np.float64) - b)
    den = np.linalg.norm(b.astype(np.float64))
    est = np.sqrt(S.estimate_sq(sa, sb))
    return est / num, (est / np.linalg.norm(sb.astype(np.float64))) / (num / den)


def _ratio(a, b, width, seed, path="t"):
    return _ratios(a, b, width, seed, path)[0]


_SK = {}


def _sk(width):
    if width not in _SK:
        cache = {}

        def f(x, seed, path):
            key = (x.shape, seed, path)
            if key not in cache:
                cache[key] = jax.jit(lambda y: S.sketch_array(y, path=path, width=width, seed=seed))
            return cache[key](x)

        _SK[width] = f
    return _SK[width]


def error_table(widths, pairs: int) -> list[dict]:
    rows = []
    for kind in ("gaussian", "bf16-rounding", "heavy-tailed", "low-rank", "sparse"):
        rng = np.random.default_rng(abs(hash(kind)) % 2**31)
        data = [_pair(kind, SHAPES[i % len(SHAPES)], rng) for i in range(pairs)]
        for w in widths:
            r = np.asarray([_ratios(a, b, w, seed=i % 8) for i, (a, b) in enumerate(data)])
            err, err2 = np.abs(r[:, 0] - 1), np.abs(r[:, 1] - 1)
            rows.append({"pairs": kind, "n": pairs, "width": w, "median": float(np.median(err)),
                         "p99": float(np.quantile(err, 0.99)), "max": float(err.max()),
                         "p99_sketched_denominator": float(np.quantile(err2, 0.99)),
                         "max_sketched_denominator": float(err2.max())})
            print(f"  {kind:14s} w={w:6d}: median {rows[-1]['median']:.4f} p99 {rows[-1]['p99']:.4f} "
                  f"max {rows[-1]['max']:.4f} | sketched denominator p99 {rows[-1]['p99_sketched_denominator']:.4f} "
                  f"max {rows[-1]['max_sketched_denominator']:.4f}", file=sys.stderr, flush=True)
    return rows


def real_pairs(cache_dir: pathlib.Path, widths) -> list[dict]:
    """Every gradient tensor pair (the tiny control vs each other tiny record: reference, candidates) from a record
    cache of run directories (``python -m nxgates run --cache-dir DIR``), per tensor and whole-gradient (N4)."""
    from nxgates.gates import records

    runs = []
    for d in sorted(p for p in cache_dir.iterdir() if (p / "meta.json").is_file()):
        run = records.load_run(d)
        md = (run.meta.get("extra") or {}).get("metadata") or {}
        if md.get("config") == "tiny":
            runs.append((md.get("precision") == "production" and "routing_replay_sha256" not in md, run))
    controls = [r for is_control, r in runs if is_control]
    if not controls:
        return []
    control, others = controls[0], [r for _, r in runs if r is not controls[0]]
    rows = []
    for w in widths:
        errs, whole = [], []
        for other in others:
            for step in control.step_numbers:
                ga, gb = other.steps[step].group("grad"), control.steps[step].group("grad")
                num_e = num_s = 0.0
                for k, b in gb.items():
                    a = ga[k]
                    if S.is_exact(a.size, w):
                        continue
                    r = _ratio(a, b, w, seed=0, path=k)
                    if np.isfinite(r):
                        errs.append(abs(r - 1))
                    sa, sb = _sk(w)(a, 0, k), _sk(w)(b, 0, k)
                    num_s += S.estimate_sq(np.asarray(sa), np.asarray(sb))
                    num_e += float(np.sum((a.astype(np.float64) - b) ** 2))
                if num_e > 0:
                    whole.append(abs(np.sqrt(num_s / num_e) - 1))
        e, wa = np.asarray(errs), np.asarray(whole)
        rows.append({"pairs": f"tiny records, per tensor ({len(others)} records vs the control x 3 steps)",
                     "n": int(e.size), "width": w, "median": float(np.median(e)), "p99": float(np.quantile(e, 0.99)),
                     "max": float(e.max())})
        rows.append({"pairs": "tiny records, whole gradient (N4, sketched tensors)", "n": int(wa.size), "width": w,
                     "median": float(np.median(wa)), "p99": float(np.quantile(wa, 0.99)), "max": float(wa.max())})
        for r in rows[-2:]:
            print(f"  {r['pairs']} w={w}: median {r['median']:.4f} p99 {r['p99']:.4f} max {r['max']:.4f}",
                  file=sys.stderr, flush=True)
    return rows


def floor() -> dict:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((8, 256, 256)).astype(np.float32)
    mesh = jax.make_mesh((2, 2, 2), ("fsdp", "context", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    out = {}
    for w in (1024, 4096, 16384):
        f = jax.jit(lambda x, w=w: S.sketch_array(x, path="w", width=w, seed=0))
        s1 = np.asarray(f(a), np.float64)
        s8 = np.asarray(f(jax.device_put(a, NamedSharding(mesh, P("expert", "fsdp", "context")))), np.float64)
        out[w] = {"rel_diff_1_vs_8_devices": float(np.linalg.norm(s1 - s8) / np.linalg.norm(a.astype(np.float64))),
                  "max_abs": float(np.abs(s1 - s8).max())}
    return out


def _largest_gather(hlo: str) -> int:
    """The most elements any all-gather in the HLO produces (0: none); tensors below the width are stored whole and
    may be gathered, a sketched tensor never is."""
    import re

    sizes = [0]
    for m in re.finditer(r"= [a-z0-9]+\[([0-9,]*)\][^ ]* all-gather\(", hlo):
        sizes.append(int(np.prod([int(d) for d in m.group(1).split(",") if d] or [1])))
    return max(sizes)


def cost(widths) -> list[dict]:
    from nxgates.model import config as mconfig
    from nxgates.model import sharding as msharding
    from nxgates.model import transformer

    cfg = mconfig.load_config("tiny")
    mesh = msharding.make_mesh(cfg.control)
    params = msharding.shard_params(transformer.init_params(cfg, 0), mesh)
    grads = jax.tree.map(lambda x: x * 0.5 + 1e-3, params)
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    rows = []
    for w in widths:
        f = jax.jit(lambda g, p, q, w=w: recorder.summaries(g, p, prev_params=q, width=w, seed=0))
        compiled = f.lower(grads, params, params).compile()
        hlo = compiled.as_text()
        mem = compiled.memory_analysis()
        jax.block_until_ready(f(grads, params, params))
        times = []
        for _ in range(5):
            t = time.perf_counter()
            jax.block_until_ready(f(grads, params, params))
            times.append(time.perf_counter() - t)
        out = jax.device_get(f(grads, params, params))
        buf = io.BytesIO()
        np.savez(buf, **out)
        rows.append({"width": w, "min_s": min(times), "median_s": statistics.median(times),
                     "temp_bytes": int(getattr(mem, "temp_size_in_bytes", -1)), "tree_bytes": int(nbytes),
                     "summaries_npz_bytes": len(buf.getvalue()), "largest_all_gather_elements": _largest_gather(hlo)})
        print(f"  cost w={w}: min {min(times) * 1e3:.1f} ms median {statistics.median(times) * 1e3:.1f} ms, "
              f"temp {rows[-1]['temp_bytes'] / 2**20:.1f} MiB, summaries {len(buf.getvalue()) / 2**20:.2f} MiB/step "
              f"(trees {nbytes / 2**20:.1f} MiB each), largest all-gather "
              f"{rows[-1]['largest_all_gather_elements']} elements", file=sys.stderr)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--widths", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--cache", default=None, help="a record cache with tiny records (real gradient pairs)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["synthetic", "real", "floor", "cost"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = {"command": " ".join(["python benchmarks/sketch_error.py", *(argv or sys.argv[1:])])}
    if "synthetic" not in args.skip:
        res["synthetic"] = error_table(args.widths, args.pairs)
    if args.cache and "real" not in args.skip:
        res["real"] = real_pairs(pathlib.Path(args.cache), args.widths)
    if "floor" not in args.skip:
        res["floor"] = floor()
        print(f"  floor: {res['floor']}", file=sys.stderr)
    if "cost" not in args.skip:
        res["cost"] = cost(args.widths)
    text = json.dumps(res, indent=2)
    if args.json:
        pathlib.Path(args.json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
