"""Run records and their on-disk cache.

A ``RunRecord`` is everything the gates compare about one run of the protocol: the initial parameters and, per step,
the loss, the per-token log-probs, the gradient (one array per parameter tensor, named by the "/".join of its dict
keys), its global norm, the parameters after the update and the number of dropped tokens; plus metadata (config,
flags, versions, device kind, seeds, the implementation of every op).

``RecordCache`` stores records as ``<key>.npz`` (arrays) + ``<key>.json`` (the key's parts, metadata, the npz's
sha256), both written atomically, the JSON last (it is the commit marker). The key is the sha256 of everything that
determines the record (``gates.runner.Runner.key_parts``: config, flags, precision, protocol settings, seeds, versions,
device kind and count, a hash of the reference/kernels/model sources). A missing, truncated, corrupted (checksum
mismatch, unreadable) or stale (different key parts or format) entry is reported and recomputed, never trusted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from nxgates.gates import atomic

FORMAT_VERSION = 2  # 2: per-step routing (the experts used) and routing_mismatch


@dataclasses.dataclass
class StepRecord:
    """One optimizer step. loss, grad_norm: 0-d float32 arrays (exact bits kept); logp: [B, S-1] f32;
    grads, params: {name: array} (params after this step's update); routing: the experts every MoE layer used
    (int32 [G, 4, B, S, k]; None for a model without routing); routing_mismatch: (layer, token) pairs whose own top-k
    differed from the replayed one (0 without replay)."""

    loss: np.ndarray
    logp: np.ndarray
    grads: dict[str, np.ndarray]
    grad_norm: np.ndarray
    params: dict[str, np.ndarray]
    dropped_tokens: int
    routing: np.ndarray | None = None
    routing_mismatch: int = 0


@dataclasses.dataclass
class RunRecord:
    """A whole run: params0 {name: array} (before step 1), steps, the completion mask [B, S-1], metadata (JSON-able)."""

    params0: dict[str, np.ndarray]
    steps: list[StepRecord]
    mask: np.ndarray
    metadata: dict[str, Any]

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    def tensor_names(self) -> list[str]:
        return sorted(self.params0)

    def to_arrays(self) -> dict[str, np.ndarray]:
        out = {"mask": self.mask}
        for name, a in self.params0.items():
            out[f"params0/{name}"] = a
        for i, s in enumerate(self.steps):
            out[f"step{i}/loss"] = np.asarray(s.loss)
            out[f"step{i}/logp"] = s.logp
            out[f"step{i}/grad_norm"] = np.asarray(s.grad_norm)
            out[f"step{i}/dropped_tokens"] = np.asarray(s.dropped_tokens, np.int64)
            out[f"step{i}/routing_mismatch"] = np.asarray(s.routing_mismatch, np.int64)
            if s.routing is not None:
                out[f"step{i}/routing"] = s.routing
            for name, a in s.grads.items():
                out[f"step{i}/grads/{name}"] = a
            for name, a in s.params.items():
                out[f"step{i}/params/{name}"] = a
        return out

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], metadata: dict[str, Any]) -> RunRecord:
        num_steps = int(metadata["num_steps"])
        params0 = {k[len("params0/"):]: arrays[k] for k in arrays if k.startswith("params0/")}
        steps = []
        for i in range(num_steps):
            g, p = f"step{i}/grads/", f"step{i}/params/"
            steps.append(
                StepRecord(
                    loss=np.asarray(arrays[f"step{i}/loss"]),
                    logp=np.asarray(arrays[f"step{i}/logp"]),
                    grads={k[len(g):]: arrays[k] for k in arrays if k.startswith(g)},
                    grad_norm=np.asarray(arrays[f"step{i}/grad_norm"]),
                    params={k[len(p):]: arrays[k] for k in arrays if k.startswith(p)},
                    dropped_tokens=int(arrays[f"step{i}/dropped_tokens"]),
                    routing=np.asarray(arrays[f"step{i}/routing"]) if f"step{i}/routing" in arrays else None,
                    routing_mismatch=int(arrays[f"step{i}/routing_mismatch"]),
                )
            )
        rec = cls(params0=params0, steps=steps, mask=np.asarray(arrays["mask"]), metadata=metadata)
        names = set(params0)
        for i, s in enumerate(steps):
            if set(s.grads) != names or set(s.params) != names:
                raise ValueError(f"record: step {i} tensors differ from params0 "
                                 f"({len(s.grads)} grads, {len(names)} params)")
        return rec


class CacheEntryInvalid(Exception):
    """A cache entry that must not be trusted; the message says why."""


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def key_digest(key_parts: Mapping[str, Any]) -> str:
    return hashlib.sha256(canonical_json(key_parts).encode()).hexdigest()[:32]


def _npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


class RecordCache:
    """Records on disk under ``root`` (default ``$NXGATES_CACHE`` or ``.cache/gates``), keyed by their key parts."""

    def __init__(self, root: str | os.PathLike | None = None, *, log: Callable[[str], None] | None = None):
        self.root = pathlib.Path(root or os.environ.get("NXGATES_CACHE", ".cache/gates"))
        self.log = log or (lambda msg: None)

    def paths(self, key_parts: Mapping[str, Any]) -> tuple[pathlib.Path, pathlib.Path]:
        d = key_digest(key_parts)
        return self.root / f"{d}.npz", self.root / f"{d}.json"

    def store(self, key_parts: Mapping[str, Any], rec: RunRecord) -> pathlib.Path:
        npz_path, json_path = self.paths(key_parts)
        data = _npz_bytes(rec.to_arrays())
        atomic.write_atomic(npz_path, lambda f: f.write(data))
        meta = dict(rec.metadata)
        meta["num_steps"] = rec.num_steps
        atomic.write_json_atomic(
            json_path,
            {"format": FORMAT_VERSION, "key": json.loads(canonical_json(key_parts)), "metadata": meta,
             "npz_sha256": hashlib.sha256(data).hexdigest(), "npz_bytes": len(data)},
        )
        return json_path

    def load(self, key_parts: Mapping[str, Any]) -> RunRecord:
        """The stored record for ``key_parts``; ``FileNotFoundError`` or ``CacheEntryInvalid`` (with the reason)."""
        npz_path, json_path = self.paths(key_parts)
        if not json_path.exists():
            raise FileNotFoundError(json_path)
        try:
            entry = json.loads(json_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CacheEntryInvalid(f"{json_path}: unreadable JSON ({e})") from e
        if not isinstance(entry, dict) or entry.get("format") != FORMAT_VERSION:
            fmt = entry.get("format") if isinstance(entry, dict) else "?"
            raise CacheEntryInvalid(f"{json_path}: stale format {fmt}")
        if entry.get("key") != json.loads(canonical_json(key_parts)):
            raise CacheEntryInvalid(f"{json_path}: stale entry, its key parts differ from the requested ones")
        try:
            data = npz_path.read_bytes()
        except FileNotFoundError as e:
            raise CacheEntryInvalid(f"{npz_path}: missing arrays") from e
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry.get("npz_sha256") or len(data) != entry.get("npz_bytes"):
            raise CacheEntryInvalid(f"{npz_path}: checksum mismatch (sha256 {digest[:12]}.. != "
                                    f"{str(entry.get('npz_sha256'))[:12]}..)")
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
            return RunRecord.from_arrays(arrays, entry["metadata"])
        except Exception as e:  # noqa: BLE001 - any decoding failure means the entry is not to be trusted
            raise CacheEntryInvalid(f"{npz_path}: undecodable ({type(e).__name__}: {e})") from e

    def get_or_compute(
        self, key_parts: Mapping[str, Any], compute: Callable[[], RunRecord], *, label: str = "record"
    ) -> tuple[RunRecord, str]:
        """(record, how) with how in {"cached", "computed", "recomputed: <reason>"}; stores what it computes."""
        how = "computed"
        try:
            rec = self.load(key_parts)
            self.log(f"{label}: cached ({self.paths(key_parts)[1]})")
            return rec, "cached"
        except FileNotFoundError:
            pass
        except CacheEntryInvalid as e:
            how = f"recomputed: {e}"
            self.log(f"{label}: cache entry rejected, recomputing: {e}")
        rec = compute()
        self.store(key_parts, rec)
        return rec, how
