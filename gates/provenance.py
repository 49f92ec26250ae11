"""Where a run record comes from: the environment, the source hash, the replayed routing, and the record's cache key.

A record is determined by its key (``record_key``): the config and its values, the flags, the precision, the protocol
settings, the seeds, the environment (versions, device), the sha256 of the sources that compute it, and the digest of
the routing it replays. Any change to one of them is a different record (a cache miss), never a stale one.
"""

from __future__ import annotations

import hashlib
import importlib
import pathlib
import platform
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


def environment() -> dict:
    """Versions and the device the runs execute on."""
    import jax
    import jaxlib
    import numpy
    import optax

    devs = jax.devices()
    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "numpy": numpy.__version__,
        "optax": optax.__version__,
        "platform": devs[0].platform,
        "device_kind": devs[0].device_kind,
        "device_count": len(devs),
    }


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
