"""The speed and memory targets of a gates run, measured: wall seconds, peak RSS and cache sizes, min / median of runs.

    python benchmarks/gates_targets.py [--config tiny] [--rounds 3] [--cases cold warm flag-cold flag-cached]
                                       [--flag moe_wi_gmm_fused_swiglu=true] [--work DIR] [--jobs 2]

Each case runs ``python -m nxgates run`` in a child process (``--out`` and ``--cache-dir`` under ``--work``):

- ``cold``: the default run, empty record and compilation caches;
- ``warm``: the default run again on the cache the cold run left (nothing changed);
- ``flag-cold``: one flag (``--flag``), empty caches;
- ``flag-cached``: one flag whose control, reference and the lens's control are cached (the cache of a default run of
  another flag's check is not reused: the case builds its base records first, with ``--flags`` of another flag, and
  times the second run).

Per run it prints the wall seconds, the seconds to the first check's verdict (its ``check 1/N`` progress line) and to
the run's verdict (the run's own ``PASS``/``FAIL`` line), the peak RSS of
the largest process (the run or one of its workers: ``getrusage(RUSAGE_CHILDREN)`` of a wrapper process per run), the
record cache's size (every file but the compiled programs) and the compiled programs' (``xla/``), and the exit code;
then min and median per case. The machine should be otherwise idle: say its load in the notes.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# Runs the command given as JSON and prints its wall seconds, exit code and the peak RSS of its largest descendant.
WRAPPER = """
import json, resource, subprocess, sys, time
t = time.perf_counter()
p = subprocess.run(json.loads(sys.argv[1]), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
wall = time.perf_counter() - t
sys.stdout.write(p.stdout)
print("@@" + json.dumps({"wall_s": wall, "rc": p.returncode,
                         "max_rss_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
"""

VERDICT = re.compile(r"^(PASS|FAIL): .*\((\d+(?:\.\d+)?)s\)$", re.M)
FIRST = re.compile(r"^\[\s*(\d+(?:\.\d+)?)s\] check 1/\d+: ", re.M)
OTHER_FLAG = "gdn_cp_m_scan=true"  # builds the base records of a flag-cached case


def size_mb(path: pathlib.Path, *, only: str | None = None, without: str | None = None) -> float:
    total = 0
    if not path.exists():
        return 0.0
    for p in path.rglob("*"):
        rel = p.relative_to(path).parts
        if not p.is_file() or (only and rel[0] != only) or (without and rel[0] == without):
            continue
        total += p.stat().st_size
    return total / 1e6


def run(argv: list[str], cache: pathlib.Path, out: pathlib.Path, log: pathlib.Path) -> dict:
    cmd = [sys.executable, "-m", "nxgates", "run", *argv, "--cache-dir", str(cache), "--out", str(out)]
    p = subprocess.run([sys.executable, "-c", WRAPPER, json.dumps(cmd)], stdout=subprocess.PIPE, text=True)
    text, _, stats = p.stdout.rpartition("@@")
    log.write_text(text)
    res = json.loads(stats)
    m = VERDICT.findall(text)
    res["verdict_s"] = float(m[-1][1]) if m else None
    res["verdict"] = m[-1][0] if m else None
    first = FIRST.search(text)
    res["first_verdict_s"] = float(first.group(1)) if first else None
    res["records_mb"] = round(size_mb(cache, without="xla"), 1)
    res["xla_mb"] = round(size_mb(cache, only="xla"), 1)
    res["max_rss_gb"] = round(res.pop("max_rss_kb") / 1e6, 2)
    res["wall_s"] = round(res["wall_s"], 1)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", nargs="+", default=["cold", "warm", "flag-cold", "flag-cached"],
                    choices=["cold", "warm", "flag-cold", "flag-cached"])
    ap.add_argument("--flag", default="moe_wi_gmm_fused_swiglu=true")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--work", default=None, help="where caches, reports and logs go (default: a temporary folder)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        print(f"error: --rounds={args.rounds} must be >= 1", file=sys.stderr)
        return 2
    work = pathlib.Path(args.work or tempfile.mkdtemp(prefix="nxgates-targets-"))
    work.mkdir(parents=True, exist_ok=True)
    base = ["--config", args.config, "--jobs", str(args.jobs)]
    rows: dict[str, list[dict]] = {c: [] for c in args.cases}
    for r in range(args.rounds):
        for case in args.cases:
            d = work / f"{case}-{r}"
            cache = work / f"cache-{r}" if case in ("cold", "warm") else d / "cache"
            if case == "cold" or case.startswith("flag"):
                shutil.rmtree(cache, ignore_errors=True)
            if case == "warm" and not cache.exists():
                print(f"warm-{r}: no cache of a cold run to reuse (put cold before warm in --cases)", file=sys.stderr)
                continue
            if case == "flag-cached":  # the base records (and the compiled programs) of another flag's check
                run([*base, "--flags", OTHER_FLAG], cache, d / "prep", d.with_suffix(".prep.log"))
            argv_ = base if case in ("cold", "warm") else [*base, "--flags", args.flag]
            t = time.strftime("%H:%M:%S")
            res = run(argv_, cache, d / "out", d.with_suffix(".log"))
            rows[case].append(res)
            print(f"{t} {case} round {r + 1}: {json.dumps(res)}", flush=True)
    print()
    print("| case | runs | wall s: min | median | first check's verdict s: min | median | to the verdict s: min "
          "| median | peak RSS GB: max | record cache MB | compiled MB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for case, rs in rows.items():
        if not rs:
            continue
        walls = [x["wall_s"] for x in rs]
        verdicts = [x["verdict_s"] for x in rs if x["verdict_s"] is not None] or [float("nan")]
        firsts = [x["first_verdict_s"] for x in rs if x["first_verdict_s"] is not None] or [float("nan")]
        print(f"| {case} | {len(rs)} | {min(walls):.1f} | {statistics.median(walls):.1f} | {min(firsts):.1f} | "
              f"{statistics.median(firsts):.1f} | {min(verdicts):.1f} | "
              f"{statistics.median(verdicts):.1f} | {max(x['max_rss_gb'] for x in rs):.2f} | "
              f"{max(x['records_mb'] for x in rs):.1f} | {max(x['xla_mb'] for x in rs):.1f} |")
    bad = [(c, x["rc"]) for c, rs in rows.items() for x in rs if x["rc"] != 0]
    if bad:
        print(f"runs that did not exit 0: {bad}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
