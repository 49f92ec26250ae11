"""Where a run's time goes (``nxgates run --profile``) and JAX's persistent compilation cache.

Profile: every record a run obtained, with how (computed / cached), the seconds ``gates.protocol.run_protocol`` spent
tracing, lowering and compiling its two programs and executing its steps, the size of the programs (StableHLO text),
the seconds outside them (building the model function, the parameters, the record cache's reads and writes), and the
total per phase. A cached record shows the phases of the run that computed it (in brackets) and costs only its read.

Compilation cache: ``enable_compilation_cache(root)`` points JAX's persistent compilation cache at ``<root>/xla/<host>``
(every program, however small or quick to compile). JAX keys an entry by the program (the StableHLO module without
its source locations), the jaxlib version, the backend platform and its version, ``XLA_FLAGS``, the compile options
(the device assignment included), the devices' kind and topology, and the compression (``jax._src.cache_key.get``).
The CPU backend's version does not name the host's instruction set, and XLA compiles for the host it runs on: so the
folder adds ``<host>``, a digest of the CPU's model and feature flags, and a cache copied to another kind of CPU is
never read. A hit loads the executable XLA compiled for the same key; the numbers are the same bits
(``tests/gates/test_profile.py`` runs a record with and without a hit).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import platform
import sys

from tabulate import tabulate

PHASES = ("trace_s", "lower_s", "compile_s", "execute_s", "summaries_s")


def host_id() -> str:
    """A short digest of this host's CPU: the machine, the model name and the feature flags (Linux's /proc/cpuinfo;
    elsewhere ``platform.processor()``)."""
    parts = [platform.machine(), platform.processor()]
    try:
        info = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    for line in info.splitlines():
        key = line.split(":", 1)[0].strip()
        if key in ("model name", "flags", "Features", "CPU implementer", "CPU part"):
            parts.append(line.strip())
            if key in ("flags", "Features"):
                break  # the first core's; the others repeat it
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def compilation_cache_dir(root: str | os.PathLike | None = None) -> pathlib.Path:
    """``<root>/xla/<host_id>``; root: the record cache's (``$NXGATES_CACHE`` or ``.cache/gates``)."""
    root = pathlib.Path(root or os.environ.get("NXGATES_CACHE", ".cache/gates"))
    return root / "xla" / host_id()


def enable_compilation_cache(root: str | os.PathLike | None = None) -> pathlib.Path:
    """Turn on JAX's persistent compilation cache under ``compilation_cache_dir(root)`` for every program (no minimum
    compile time or size). Returns the folder. Call before the first compile; later calls move it."""
    path = compilation_cache_dir(root)
    use_compilation_cache_dir(path)
    return path


def use_compilation_cache_dir(path: str | os.PathLike) -> None:
    """JAX's persistent compilation cache in ``path`` (as made by ``enable_compilation_cache``), for every program."""
    import jax

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    try:  # jax initializes the cache once per process; a later change of folder needs a reset
        from jax._src import compilation_cache

        compilation_cache.reset_cache()
    except (ImportError, AttributeError):
        pass


def active_compilation_cache_dir() -> str | None:
    """The folder JAX's persistent compilation cache uses in this process (None: off)."""
    import jax

    return jax.config.jax_compilation_cache_dir or None


def peak_rss_mb() -> float | None:
    """The largest resident set this process has had so far, in MB (None where ``resource`` is missing)."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux, bytes on macOS
    return round(peak / (1e6 if sys.platform == "darwin" else 1e3), 1)


def row(label: str, how: str, metadata: dict, wall_s: float, cpu_s: float | None = None) -> dict:
    """One record's profile row. ``metadata``: the record's (``phases`` from ``run_protocol``); ``wall_s``,
    ``cpu_s``: what obtaining it cost this process (its run, or its read from the cache) in wall-clock and CPU seconds
    (all threads; on a loaded machine the CPU seconds are the steadier figure); ``peak_rss_mb``: the peak resident
    set of this process (the one that obtained the record: a worker for a worker's row) once it had it."""
    ph = metadata.get("phases", {})
    execute = ph.get("execute_s", [])
    by_worker = "by a prefetch worker" in how  # the worker's own row counts its phases
    computed = not how.startswith("cached") and not by_worker
    out = {"record": label, "how": "worker's" if by_worker else how.split(" (")[0].split(":")[0],
           "wall_s": round(wall_s, 2), "cpu_s": None if cpu_s is None else round(cpu_s, 2), "computed": computed,
           "peak_rss_mb": peak_rss_mb()}
    for k in ("trace_s", "lower_s", "compile_s"):
        out[k] = ph.get(k)
    out["execute_s"] = round(sum(execute), 3) if execute else None
    out["summaries_s"] = ph.get("summaries_s")
    out["steps_s"] = execute
    out["stablehlo_kb"] = round(ph.get("stablehlo_bytes", 0) / 1024) if ph else None
    return out


def table(rows: list[dict]) -> str:
    """The rows and a total per phase (computed records only: a cached one's phases were spent by an earlier run)."""

    def cell(r, k):
        v = r.get(k)
        if v is None:
            return "-"
        return f"{v:.1f}" if r["computed"] else f"({v:.1f})"

    body = []
    for r in rows:
        body.append([r["record"], r["how"], *[cell(r, k) for k in PHASES],
                     "-" if r["stablehlo_kb"] is None else r["stablehlo_kb"], f"{r['wall_s']:.1f}",
                     "-" if r.get("cpu_s") is None else f"{r['cpu_s']:.1f}",
                     "-" if r.get("peak_rss_mb") is None else f"{r['peak_rss_mb']:.0f}"])
    computed = [r for r in rows if r["computed"]]
    totals = [sum(r[k] or 0.0 for r in computed) for k in PHASES]
    peaks = [r["peak_rss_mb"] for r in rows if r.get("peak_rss_mb") is not None]
    body.append(["total", f"{len(computed)} computed / {len(rows)}", *[f"{t:.1f}" for t in totals],
                 sum(r["stablehlo_kb"] or 0 for r in computed), f"{sum(r['wall_s'] for r in rows):.1f}",
                 f"{sum(r.get('cpu_s') or 0.0 for r in rows):.1f}", f"{max(peaks):.0f}" if peaks else "-"])
    headers = ("record", "how", "trace s", "lower s", "compile s", "execute s", "summaries s", "StableHLO KiB",
               "wall s", "cpu s", "peak RSS MB")
    return tabulate(body, headers=headers, tablefmt="simple", disable_numparse=True)
