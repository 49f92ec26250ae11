"""Where a run record comes from: the environment, the source hash, the replayed routing, and the record's cache key.

A record is determined by its key (``record_key``): the config and its values, the flags, the precision, the protocol
settings, the seeds, the environment (versions, device), the sha256 of the sources that compute it, and the digest of
the routing it replays. Any change to one of them is a different record (a cache miss), never a stale one.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import pathlib
import platform
import re
import subprocess
from collections.abc import Mapping
from typing import Any

import numpy as np

from nxgates.gates.model_api import SOURCE_DIRS

# Besides SOURCE_DIRS, the gates modules that compute every record (the protocol and the summaries it records).
SOURCE_FILES = ("gates/protocol.py", "gates/sketch.py", "gates/recorder.py")


def routing_digest(replay) -> str:
    """sha256 of a per-step routing (int32 arrays, shapes included)."""
    h = hashlib.sha256()
    for ids in replay:
        a = np.ascontiguousarray(np.asarray(ids, np.int32))
        h.update(repr(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def source_hash(dirs: tuple[str, ...] = SOURCE_DIRS, files: tuple[str, ...] = SOURCE_FILES,
                extra: list[pathlib.Path] = ()) -> str:
    """sha256 over the .py files of the packages ``nxgates.<dir>`` (sorted), ``files`` and ``extra``, names included."""
    h = hashlib.sha256()
    paths = []
    roots = {d: pathlib.Path(importlib.import_module(f"nxgates.{d}").__file__).resolve().parent for d in dirs}
    for d in dirs:
        paths += [(f"{d}/{p.relative_to(roots[d])}", p) for p in sorted(roots[d].rglob("*.py"))]
    gates_root = pathlib.Path(__file__).resolve().parent
    paths += [(f, gates_root / f.removeprefix("gates/")) for f in files]
    paths += [(str(p), p) for p in extra]
    for name, p in paths:
        if p.is_file():
            h.update(name.encode())
            h.update(b"\0")
            h.update(p.read_bytes())
            h.update(b"\0")
    return h.hexdigest()


# The CPU target XLA compiles for, as its serialized CPU executable records it: the target triple, the CPU name and
# the LLVM feature string ("+avx2,+fma,-avx512f,..."), three length-delimited protobuf strings in a row.
_TARGET = re.compile(rb"\n([\x01-\x7f])([A-Za-z0-9_.\-]+)\x12([\x01-\x7f])([A-Za-z0-9_.\-]+)"
                     rb"\x1a(?:[\x80-\xff]*)[\x00-\x7f]((?:[+-][A-Za-z0-9_.\-]+,)*[+-][A-Za-z0-9_.\-]+)")


def _parse_target(blob: bytes) -> dict | None:
    for m in _TARGET.finditer(blob):
        triple, cpu = m.group(2).decode(), m.group(4).decode()
        if len(triple) == m.group(1)[0] and len(cpu) == m.group(3)[0] and "-" in triple:
            return {"triple": triple, "cpu": cpu, "features": m.group(5).decode()}
    return None


def _cpuinfo_target() -> dict:
    """Fallback: the processor's model name and flags as the OS reports them (Linux /proc/cpuinfo)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return {"source": "unknown (no XLA target and no /proc/cpuinfo)", "cpu": platform.processor() or "?",
                "features": ""}
    fields = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        fields.setdefault(k.strip(), v.strip())
    flags = fields.get("flags") or fields.get("Features") or ""
    return {"source": "/proc/cpuinfo", "cpu": fields.get("model name", "?"),
            "features": ",".join(sorted(flags.split()))}


@functools.cache
def cpu_target() -> dict:
    """The CPU target XLA's CPU backend compiles for: {"source", "triple", "cpu", "features", "features_sha256"}.

    Read from a compiled trivial program (the target machine options XLA stores in a serialized CPU executable: what
    it really generates code for, after ``--xla_cpu_max_isa``); if that cannot be read, the OS's processor flags. Two
    machines with the same versions can round differently when these differ (XLA picks other instructions), which is
    why the golden's exact comparison keys on them."""
    import jax
    import jax.numpy as jnp

    target = None
    try:
        from jax._src import xla_bridge

        backend = xla_bridge.get_backend("cpu")
        x = jax.device_put(jnp.ones((8,), jnp.float32), jax.devices("cpu")[0])
        compiled = jax.jit(lambda v: v * 2.0 + 1.0).lower(x).compile()
        target = _parse_target(bytes(backend.serialize_executable(compiled.runtime_executable())))
        if target is not None:
            target["source"] = "XLA CPU executable"
    except Exception:  # noqa: BLE001 - any failure: the OS's description below, and the source says so
        target = None
    target = target or _cpuinfo_target()
    features = sorted(f for f in target["features"].split(",") if f)
    target["features_sha256"] = hashlib.sha256(",".join(features).encode()).hexdigest()[:16]
    return {k: target.get(k, "") for k in ("source", "triple", "cpu", "features", "features_sha256")}


def environment() -> dict:
    """Versions, the device the runs execute on, and (on CPU) the CPU target XLA compiles for (``cpu_target``)."""
    import jax
    import jaxlib
    import numpy
    import optax

    devs = jax.devices()
    env = {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "numpy": numpy.__version__,
        "optax": optax.__version__,
        "platform": devs[0].platform,
        "device_kind": devs[0].device_kind,
        "device_count": len(devs),
    }
    if devs[0].platform == "cpu":
        target = cpu_target()
        env["cpu_target"] = {k: target[k] for k in ("source", "triple", "cpu", "features_sha256")}
    return env


def git_commit(start: str | pathlib.Path | None = None) -> str | None:
    """The commit of the git checkout holding this package, "+dirty" when tracked files differ; None outside git."""
    root = pathlib.Path(start or pathlib.Path(__file__).resolve().parent.parent)
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def record_key(*, config: str, config_values: Mapping[str, Any], flags: Mapping[str, Any], precision: str,
               settings: Mapping[str, Any], seeds: Mapping[str, int], env: Mapping[str, Any], source_sha256: str,
               replay=None, sketch: Mapping[str, Any] | None = None) -> dict:
    """The parts that determine a run record (``gates.record.key_digest`` hashes them); ``sketch``: the record's
    sketch spec (its width and seed decide the summaries)."""
    parts = {
        "kind": "run-record",
        "config": config,
        "config_values": config_values,
        "flags": flags,
        "precision": precision,
        "settings": settings,
        "seeds": seeds,
        "env": env,
        "source_sha256": source_sha256,
        "sketch": dict(sketch) if sketch is not None else None,
    }
    if replay is not None:  # a replaying run depends on the routing it replays
        parts["routing_replay_sha256"] = routing_digest(replay)
    return parts
