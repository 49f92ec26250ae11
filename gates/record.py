"""Run records and their on-disk cache.

A ``RunRecord`` is everything the gates compare about one run of the protocol: the initial parameters and, per step,
the loss, the per-token log-probs, the gradient (one array per parameter tensor, named by the "/".join of its dict
keys), its global norm, the parameters after the update and the number of dropped tokens; plus metadata (config,
flags, versions, device kind, seeds, the implementation of every op) and the step's summaries (gradient and update
sketches, bit fingerprints, per-tensor gradient norms: ``gates.recorder.summaries``).

On disk a record is a run directory in the one record format (``gates.records``, docs/records.md), the same format
any trainer's recorder writes: ``RecordCache`` stores ``<root>/<key>/`` with meta.json (format, config, flags, seeds,
batch, sketch spec, and in ``extra`` the key's parts and the record's metadata) and one step file pair per step
(step 0: the initial parameters), full tensors included. The key is the sha256 of everything that determines the record
(``gates.runner.Runner.key_parts``: config, flags, precision, protocol settings, seeds, versions, device kind and count,
a hash of the reference/kernels/model sources). A missing, unfinished (not closed), corrupted (checksum mismatch,
unreadable) or stale (different key parts or format) entry is reported and recomputed, never trusted; so is an entry
in the previous format (``<key>.npz`` + ``<key>.json``), which is no longer read.

Every byte of a cache entry is covered by its check: after the run directory is written, ``ENTRY_CHECKSUM``
(``entry.sha256.json``, the entry's commit marker) records the sha256 of every file in it (meta.json with the metadata
and key parts, each step's sidecar and arrays) and their list. On read, an entry without it, with a file added,
missing or changed (a metadata byte such as ``num_steps`` edited, a step's files deleted) is rejected, naming the file,
and recomputed, before anything in it is parsed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import shutil
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from nxgates.gates import atomic, records
from nxgates.gates.sketch import SketchSpec, is_exact

try:
    import fcntl
except ImportError:  # not POSIX: no cross-process lock (RecordCache.lock)
    fcntl = None

FORMAT_VERSION = 3  # 2: per-step routing (the experts used) and routing_mismatch; 3: the record format of gates.records
ENTRY_CHECKSUM = "entry.sha256.json"  # a cache entry's checksum of every file in it (written last)


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
    summaries: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # gates.recorder.summaries keys


@dataclasses.dataclass
class RunRecord:
    """A whole run: params0 {name: array} (before step 1), steps, the completion mask [B, S-1], metadata (JSON-able)."""

    params0: dict[str, np.ndarray]
    steps: list[StepRecord]
    mask: np.ndarray
    metadata: dict[str, Any]
    summaries0: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # of params0 (param_sketch, param_fp)

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    def tensor_names(self) -> list[str]:
        return sorted(self.params0)


class CacheEntryInvalid(Exception):
    """A cache entry that must not be trusted; the message says why."""


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def key_digest(key_parts: Mapping[str, Any]) -> str:
    return hashlib.sha256(canonical_json(key_parts).encode()).hexdigest()[:32]


# ------------------------------------------------------------------------------------- RunRecord <-> the record format
def ensure_summaries(rec: RunRecord, spec: SketchSpec | None = None) -> SketchSpec:
    """Fill the summaries a record lacks (computed from its full tensors on the host) with ``spec`` (default: the
    record's ``metadata["sketch"]``, else the default width and seed 0); returns the spec used."""
    from nxgates.gates import recorder

    spec = spec or (SketchSpec.from_json(rec.metadata["sketch"]) if rec.metadata.get("sketch") else SketchSpec())
    summarize = functools.partial(recorder.summaries_by_tensor, width=spec.width, seed=spec.seed)
    if not rec.summaries0:
        rec.summaries0 = _host(summarize(None, rec.params0))
    prev = rec.params0
    for s in rec.steps:
        if not s.summaries:
            s.summaries = _host(summarize(s.grads, s.params, prev_params=prev))
        prev = s.params
    rec.metadata["sketch"] = spec.to_json()
    return spec


def _host(tree: Mapping[str, Any]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in tree.items()}


def step_arrays(rec: RunRecord) -> dict[int, dict[str, np.ndarray]]:
    """{step: npz arrays} of a record in the record format (step 0: the initial parameters); full tensors included."""
    out = {0: {**{f"param/{n}": a for n, a in rec.params0.items()}, **rec.summaries0}}
    for i, s in enumerate(rec.steps):
        arrays = {"loss": np.asarray(s.loss), "grad_norm": np.asarray(s.grad_norm), "log_probs": np.asarray(s.logp),
                  "mask": np.asarray(rec.mask), "dropped_tokens": np.asarray(s.dropped_tokens, np.int64),
                  "routing_mismatch": np.asarray(s.routing_mismatch, np.int64)}
        if s.routing is not None:
            arrays["routing"] = np.asarray(s.routing, np.int32)
        arrays.update({f"grad/{n}": a for n, a in s.grads.items()})
        arrays.update({f"param/{n}": a for n, a in s.params.items()})
        arrays.update(s.summaries)
        out[i + 1] = arrays
    return out


def record_meta(rec: RunRecord, spec: SketchSpec, key_parts: Mapping[str, Any] | None = None) -> dict:
    """meta.json of a protocol record: the record format's fields, the RunRecord's metadata in ``extra``."""
    md = dict(rec.metadata)
    md["num_steps"] = rec.num_steps
    env = md.get("env") or {}
    meta = records.new_meta(
        trainer="nxgates", config=md.get("config_values") or {"name": md.get("config")},
        flags={**(md.get("flags") or {}), "precision": md.get("precision")},
        versions={k: env[k] for k in ("python", "jax", "jaxlib", "numpy", "optax") if k in env},
        device={k: env[k] for k in ("platform", "device_kind", "device_count") if k in env},
        seeds=md.get("seeds") or {}, sketch=spec,
        batch={"seed": md.get("batch_seed"), "mask_sha256": hashlib.sha256(np.asarray(rec.mask).tobytes()).hexdigest()},
        extra={"config_name": md.get("config"), "metadata": json.loads(canonical_json(md)),
               "key": None if key_parts is None else json.loads(canonical_json(key_parts))})
    meta["tensors"] = {n: {"shape": list(a.shape), "dtype": str(a.dtype), "exact": is_exact(a.size, spec.width)}
                       for n, a in sorted(rec.params0.items())}
    meta["steps"] = list(range(1, rec.num_steps + 1))
    return meta


def write_run(rec: RunRecord, run_dir: str | os.PathLike, key_parts: Mapping[str, Any] | None = None) -> pathlib.Path:
    """Write ``rec`` as a run directory (steps first, each atomically; meta.json with closed=True last)."""
    spec = ensure_summaries(rec)
    run_dir = pathlib.Path(run_dir)
    meta = record_meta(rec, spec, key_parts)
    meta["closed"] = False
    records.write_meta(run_dir, meta)
    for n, arrays in step_arrays(rec).items():
        records.write_step(run_dir, n, arrays)
    meta["closed"] = True
    records.write_meta(run_dir, meta)
    return run_dir


def from_run(run: records.Run) -> RunRecord:
    """The RunRecord of a run directory that holds full tensors (a protocol record); ValueError naming what is
    missing otherwise."""
    if 0 not in run.steps or not run.steps[0].group("param"):
        raise ValueError(f"{run.path}: no full initial parameters (step 0 param/*): not a full record")
    params0 = run.steps[0].group("param")
    summary_groups = ("grad_sketch", "param_sketch", "update_sketch", "grad_fp", "param_fp", "grad_sq")
    steps, mask = [], None
    for n in run.step_numbers:
        st = run.steps[n]
        for field in ("loss", "grad_norm", "log_probs", "mask"):
            if st.get(field) is None:
                raise ValueError(f"{run.path}: step {n} has no {field}: not a full record")
        mask = st.get("mask")
        steps.append(StepRecord(
            loss=st.get("loss"), logp=st.get("log_probs"), grads=st.group("grad"), grad_norm=st.get("grad_norm"),
            params=st.group("param"), dropped_tokens=int(st.get("dropped_tokens") if st.get("dropped_tokens")
                                                         is not None else 0),
            routing=st.get("routing"), routing_mismatch=int(st.get("routing_mismatch") if st.get("routing_mismatch")
                                                            is not None else 0),
            summaries={k: a for k, a in st.arrays.items() if k.split("/", 1)[0] in summary_groups}))
    md = dict((run.meta.get("extra") or {}).get("metadata") or {})
    rec = RunRecord(params0=params0, steps=steps, mask=mask, metadata=md,
                    summaries0={k: a for k, a in run.steps[0].arrays.items() if not k.startswith("param/")})
    names = set(params0)
    for i, s in enumerate(steps):
        if set(s.grads) != names or set(s.params) != names:
            raise ValueError(f"record: step {i} tensors differ from params0 ({len(s.grads)} grads, "
                             f"{len(names)} params)")
    return rec


def to_run(rec: RunRecord, path: str = "<memory>") -> records.Run:
    """The records.Run of a RunRecord, in memory (what ``write_run`` + ``records.load_run`` would give)."""
    spec = ensure_summaries(rec)
    steps = {n: records.Step(step=n, arrays=a) for n, a in step_arrays(rec).items()}
    return records.Run(path=path, meta=record_meta(rec, spec), steps=steps, spec=spec)


# --------------------------------------------------------------------------------------------------------------- cache
def entry_files(d: pathlib.Path) -> dict[str, str]:
    """{path relative to ``d``: sha256} of every file under the entry ``d`` but its checksum file."""
    out = {}

    def unreadable(e: OSError) -> None:
        raise e

    root = os.fspath(d)
    for top, _, names in os.walk(root, onerror=unreadable):  # os.walk: rglob + relative_to cost more than hashing
        prefix = os.path.relpath(top, root).replace(os.sep, "/") + "/"
        for name in names:
            rel = name if prefix == "./" else prefix + name
            path = os.path.join(top, name)
            if rel != ENTRY_CHECKSUM and not os.path.isdir(path):  # a link to a folder: a folder, as rglob saw it
                with open(path, "rb") as f:
                    out[rel] = hashlib.file_digest(f, "sha256").hexdigest()
    return dict(sorted(out.items()))


def _digest_of(files: Mapping[str, str]) -> str:
    return hashlib.sha256(canonical_json(dict(files)).encode()).hexdigest()


def verify_entry(d: pathlib.Path) -> None:
    """``CacheEntryInvalid`` naming the file, unless every file of the entry ``d`` is the one its checksum recorded
    (no file added, missing or changed)."""
    marker = d / ENTRY_CHECKSUM
    try:
        saved = json.loads(marker.read_text(encoding="utf-8"))
        files = saved["files"]
        if not isinstance(files, dict) or saved.get("sha256") != _digest_of(files):
            raise ValueError("its own digest does not match its file list")
    except FileNotFoundError:
        raise CacheEntryInvalid(f"{d}: no {ENTRY_CHECKSUM} (an unfinished entry, or one written before entries had "
                                "checksums)") from None
    except (ValueError, KeyError, TypeError) as e:  # JSON, UTF-8 and shape errors
        raise CacheEntryInvalid(f"{marker}: corrupt checksum file ({type(e).__name__}: {e})") from None
    try:
        now = entry_files(d)
    except OSError as e:
        raise CacheEntryInvalid(f"{d}: unreadable ({e})") from None
    missing = sorted(set(files) - set(now))
    added = sorted(set(now) - set(files))
    changed = sorted(k for k in set(files) & set(now) if files[k] != now[k])
    problems = ([f"{d / k}: changed since the entry was written (sha256 mismatch)" for k in changed]
                + [f"{d / k}: missing" for k in missing] + [f"{d / k}: not part of the entry" for k in added])
    if problems:
        raise CacheEntryInvalid("; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3
                                                             else ""))


_HELD: dict[int, dict[str, bool]] = {}  # per process: the cache locks it holds (RecordCache.lock)
_HELD_GUARD = threading.Lock()


class RecordCache:
    """Records on disk under ``root`` (default ``$NXGATES_CACHE`` or ``.cache/gates``), keyed by their key parts: one
    run directory per record."""

    def __init__(self, root: str | os.PathLike | None = None, *, log: Callable[[str], None] | None = None):
        self.root = pathlib.Path(root or os.environ.get("NXGATES_CACHE", ".cache/gates"))
        self.log = log or (lambda msg: None)

    def path(self, key_parts: Mapping[str, Any]) -> pathlib.Path:
        return self.root / key_digest(key_parts)

    @contextlib.contextmanager
    def lock(self, name: str) -> Iterator[None]:
        """Hold ``<root>/locks/<name>.lock`` exclusively (``fcntl.flock``; no-op where there is none): two processes
        that need the same record (a run's prefetch workers, two runs on one cache) compute it once, the second
        waiting and then reading it. The kernel drops the lock of a process that dies. Re-entrant in a process."""
        held = _HELD.setdefault(os.getpid(), {})
        key = str(self.root / "locks" / f"{name}.lock")
        with _HELD_GUARD:
            outer = key not in held
        if not outer or fcntl is None:
            yield
            return
        path = pathlib.Path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a+b") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            with _HELD_GUARD:
                held[key] = True
            try:
                yield
            finally:
                with _HELD_GUARD:
                    held.pop(key, None)
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def store(self, key_parts: Mapping[str, Any], rec: RunRecord) -> pathlib.Path:
        d = self.path(key_parts)
        if d.exists():  # a damaged or stale entry: replaced as a whole
            shutil.rmtree(d)
        path = write_run(rec, d, key_parts)
        files = entry_files(d)
        atomic.write_json_atomic(d / ENTRY_CHECKSUM, {"files": files, "sha256": _digest_of(files)})
        return path

    def load(self, key_parts: Mapping[str, Any]) -> RunRecord:
        """The stored record for ``key_parts``; ``FileNotFoundError`` or ``CacheEntryInvalid`` (with the reason)."""
        d = self.path(key_parts)
        if not d.exists():
            raise FileNotFoundError(d)
        verify_entry(d)  # every byte, before anything in the entry is parsed
        try:
            run = records.load_run(d)
        except records.RecordError as e:
            raise CacheEntryInvalid(str(e)) from e
        if run.meta.get("format_version") != FORMAT_VERSION:
            raise CacheEntryInvalid(f"{d}: stale format {run.meta.get('format_version')}")
        if not run.meta.get("closed"):
            raise CacheEntryInvalid(f"{d}: unfinished entry (meta.json not closed)")
        if (run.meta.get("extra") or {}).get("key") != json.loads(canonical_json(key_parts)):
            raise CacheEntryInvalid(f"{d}: stale entry, its key parts differ from the requested ones")
        try:
            return from_run(run)
        except Exception as e:  # noqa: BLE001 - any decoding failure means the entry is not to be trusted
            raise CacheEntryInvalid(f"{d}: undecodable ({type(e).__name__}: {e})") from e

    def get_or_compute(
        self, key_parts: Mapping[str, Any], compute: Callable[[], RunRecord], *, label: str = "record"
    ) -> tuple[RunRecord, str]:
        """(record, how) with how in {"cached", "computed", "recomputed: <reason>"}; stores what it computes."""
        how = "computed"
        try:
            rec = self.load(key_parts)
            self.log(f"{label}: cached ({self.path(key_parts)})")
            return rec, "cached"
        except FileNotFoundError:
            pass
        except CacheEntryInvalid as e:
            how = f"recomputed: {e}"
            self.log(f"{label}: cache entry rejected, recomputing: {e}")
        rec = compute()
        self.store(key_parts, rec)
        return rec, how
