"""Where a run record comes from: the environment, the source hash, the replayed routing, and the record's cache keys.

A record is determined by its key (``record_key``): the config and its values, the flags, the precision, the protocol
settings, the seeds, the environment (versions, device), the sha256 of the sources that compute it, and the digest of
the routing it replays. Any change to one of them is a different record (a cache miss), never a stale one.

The sources' hash changes with any edit, a comment too; so the record itself is stored under ``program_record_key``,
what determines it once the model's program is lowered: the sha256 of that program's StableHLO text (no source
locations), the digests of its inputs (initial parameters, batch, replayed routing), the protocol settings and sketch,
the protocol's own sources (the optimizer's program, the host-side recording, the summaries), ``XLA_FLAGS``, the
environment, and the config, flags and precision it was asked for. ``record_key`` then only names the record
(``gates.runner``: an alias), and an edit that changes no program finds the record after one lowering, without
compiling or running anything.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import json
import os
import pathlib
import platform
import re
import subprocess
import tomllib
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


def code_bytes(path: pathlib.Path) -> bytes:
    """What of a file can change a record: a Python file's syntax tree without its docstrings (``ast.dump`` keeps no
    comments, no line numbers, no formatting), a TOML file's data (keys sorted), so an edit of a comment, a docstring
    or the layout gives the same bytes; any other file, or one that does not parse, its bytes as they are."""
    data = path.read_bytes()
    if path.suffix == ".toml":
        try:
            return json.dumps(tomllib.loads(data.decode()), sort_keys=True, default=str).encode()
        except (tomllib.TOMLDecodeError, UnicodeDecodeError):
            return data
    if path.suffix != ".py":
        return data
    try:
        tree = ast.parse(data)
    except (SyntaxError, ValueError):
        return data
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree).encode()


def source_hash(dirs: tuple[str, ...] = SOURCE_DIRS, files: tuple[str, ...] = SOURCE_FILES,
                extra: list[pathlib.Path] = ()) -> str:
    """sha256 over the code of the .py files of the packages ``nxgates.<dir>`` (sorted; ``code_bytes``: docstrings,
    comments and layout do not count), ``files`` and ``extra``, names included: a package's files by their path in
    the package, ``extra`` (a config's file) by its file name, so that the same tree in another folder, or another
    clone, has the same key."""
    h = hashlib.sha256()
    paths = []
    roots = {d: pathlib.Path(importlib.import_module(f"nxgates.{d}").__file__).resolve().parent for d in dirs}
    for d in dirs:
        paths += [(f"{d}/{p.relative_to(roots[d])}", p) for p in sorted(roots[d].rglob("*.py"))]
    gates_root = pathlib.Path(__file__).resolve().parent
    paths += [(f, gates_root / f.removeprefix("gates/")) for f in files]
    paths += [(f"extra/{pathlib.Path(p).name}", pathlib.Path(p)) for p in extra]
    for name, p in paths:
        if p.is_file():
            h.update(name.encode())
            h.update(b"\0")
            h.update(code_bytes(p))
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


def arrays_digest(arrays: Mapping[str, np.ndarray]) -> str:
    """sha256 of named arrays (names, dtypes, shapes and bytes, sorted by name)."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(np.asarray(arrays[name]))
        h.update(f"{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(a.tobytes())
    return h.hexdigest()


@functools.cache
def protocol_source_hash() -> str:
    """sha256 of the protocol's sources (``SOURCE_FILES``: the optimizer's program, the host-side recording and the
    summaries), read once per process: the code this process runs is the code it imported, and every record key it
    makes names the same sources even if a file is edited while it runs."""
    return source_hash(dirs=(), files=SOURCE_FILES)


def program_record_key(*, program_sha256: str, params0_sha256: str, batch_sha256: str, config: str,
                       config_values: Mapping[str, Any], flags: Mapping[str, Any], precision: str,
                       settings: Mapping[str, Any], env: Mapping[str, Any], implementations: Mapping[str, Any],
                       replay=None, sketch: Mapping[str, Any] | None = None) -> dict:
    """The parts that determine a run record once its program is lowered (see the module's docstring)."""
    parts = {
        "kind": "run-record-by-program",
        "program_sha256": program_sha256,
        "params0_sha256": params0_sha256,
        "batch_sha256": batch_sha256,
        "config": config,
        "config_values": config_values,
        "flags": flags,
        "precision": precision,
        "settings": settings,
        "env": env,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "protocol_sha256": protocol_source_hash(),
        "implementations": dict(implementations),
        "sketch": dict(sketch) if sketch is not None else None,
    }
    if replay is not None:
        parts["routing_replay_sha256"] = routing_digest(replay)
    return parts
