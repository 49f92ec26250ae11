"""Run records on disk: one versioned format for every trainer (docs/records.md).

A run is a directory::

    RUN/meta.json          format, format_version, trainer, config, flags, versions, device, seeds, batch, sketch spec,
                           tensors (path -> shape, dtype, exact), steps, closed, created, extra
    RUN/steps/000001.npz   the step's arrays (any subset of the fields below)
    RUN/steps/000001.json  the step's sidecar, written after the npz (the commit marker): step, fields, the npz's
                           sha256 and size, every array's dtype and shape

Both files of a step and meta.json are written atomically (``gates.atomic``), so a run killed during step 3 leaves
steps 1-2 readable. Step 0 (optional) holds the initial parameters. A step whose sidecar is missing, whose npz is
missing or fails its checksum, or whose sidecar disagrees with the npz is refused with ``RecordError`` naming the file;
nothing is silently skipped.

Per-step fields (npz keys): ``loss``, ``grad_norm``, ``log_probs``, ``mask``, ``log_probs_fp``, ``routing``,
``routing_mismatch``, ``dropped_tokens``, and per parameter tensor ``<group>/<path>`` with group one of
``grad_sketch``, ``param_sketch``, ``update_sketch``, ``grad_fp``, ``param_fp``, ``grad_sq``, ``grad``, ``param``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import pathlib
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from nxgates.gates import atomic
from nxgates.gates.sketch import SketchSpec

FORMAT = "nxgates.record"
FORMAT_VERSION = 3
KNOWN_VERSIONS = (3,)
META_FILE = "meta.json"
STEPS_DIR = "steps"

SCALAR_FIELDS = ("loss", "grad_norm", "routing_mismatch", "dropped_tokens")
ARRAY_FIELDS = ("log_probs", "mask", "log_probs_fp", "routing")
TENSOR_GROUPS = ("grad_sketch", "param_sketch", "update_sketch", "grad_fp", "param_fp", "grad_sq", "grad", "param")
_STEP_RE = re.compile(r"^(\d{6})\.(npz|json)$")


class RecordError(ValueError):
    """A record that cannot be read as one: missing, corrupt, or in a format version this code does not know. The
    message names the path and the problem."""


def step_stem(step: int) -> str:
    if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or not 0 <= step <= 999_999:
        raise ValueError(f"records: step={step!r} must be an int in [0, 999999]")
    return f"{int(step):06d}"


def field_group(key: str) -> tuple[str, str | None]:
    """("grad_sketch", "layers/wi") for "grad_sketch/layers/wi"; ("loss", None) for "loss"."""
    head, sep, rest = key.partition("/")
    if sep and head in TENSOR_GROUPS and rest:
        return head, rest
    if not sep and key in (*SCALAR_FIELDS, *ARRAY_FIELDS):
        return key, None
    raise ValueError(f"records: field {key!r} is not one of {SCALAR_FIELDS + ARRAY_FIELDS} or <group>/<path> with "
                     f"group in {TENSOR_GROUPS}")


def npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **{k: np.asarray(v) for k, v in arrays.items()})
    return buf.getvalue()


# ----------------------------------------------------------------------------------------------------------- writing
def new_meta(*, trainer: str = "unknown", config: Any = None, flags: Any = None, versions: Any = None,
             device: Any = None, seeds: Any = None, sketch: SketchSpec | None = None, extra: Any = None,
             batch: Any = None, created: str | None = None) -> dict:
    import time

    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "trainer": str(trainer),
        "config": config if config is not None else {},
        "flags": flags if flags is not None else {},
        "versions": versions if versions is not None else {},
        "device": device if device is not None else {},
        "seeds": seeds if seeds is not None else {},
        "batch": batch,
        "sketch": None if sketch is None else sketch.to_json(),
        "tensors": {},
        "steps": [],
        "closed": False,
        "created": created or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "extra": extra if extra is not None else {},
    }


def write_meta(run_dir: str | pathlib.Path, meta: Mapping[str, Any]) -> pathlib.Path:
    return atomic.write_json_atomic(pathlib.Path(run_dir) / META_FILE, dict(meta))


def write_step(run_dir: str | pathlib.Path, step: int, arrays: Mapping[str, Any]) -> pathlib.Path:
    """Write one step: the npz, then its sidecar (the commit marker). Field names are checked first."""
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    for k in arrays:
        field_group(k)
    d = pathlib.Path(run_dir) / STEPS_DIR
    stem = step_stem(step)
    data = npz_bytes(arrays)
    atomic.write_atomic(d / f"{stem}.npz", lambda f: f.write(data))
    sidecar = {
        "step": int(step),
        "fields": sorted(arrays),
        "npz_sha256": hashlib.sha256(data).hexdigest(),
        "npz_bytes": len(data),
        "arrays": {k: {"dtype": str(a.dtype), "shape": list(a.shape)} for k, a in sorted(arrays.items())},
    }
    return atomic.write_json_atomic(d / f"{stem}.json", sidecar)


# ----------------------------------------------------------------------------------------------------------- reading
@dataclasses.dataclass
class Step:
    """One step's arrays (``arrays``: npz key -> array) with accessors by field and group."""

    step: int
    arrays: dict[str, np.ndarray]

    def get(self, field: str) -> np.ndarray | None:
        return self.arrays.get(field)

    def group(self, group: str) -> dict[str, np.ndarray]:
        """{path: array} of one tensor group ("grad_sketch", "param_fp", ...); {} when the step has none."""
        prefix = group + "/"
        return {k[len(prefix):]: a for k, a in self.arrays.items() if k.startswith(prefix)}

    def has_group(self, group: str) -> bool:
        prefix = group + "/"
        return any(k.startswith(prefix) for k in self.arrays)


@dataclasses.dataclass
class Run:
    """A run read from disk: ``meta`` (meta.json), ``steps`` {step number: Step}, ``spec`` (None without sketches)."""

    path: str
    meta: dict
    steps: dict[int, Step]
    spec: SketchSpec | None

    @property
    def step_numbers(self) -> list[int]:
        """The training steps (>= 1), sorted; step 0 (initial parameters) is not one."""
        return sorted(s for s in self.steps if s >= 1)

    @property
    def tensors(self) -> dict[str, dict]:
        return dict(self.meta.get("tensors") or {})

    @property
    def label(self) -> str:
        return self.path


def _load_json(path: pathlib.Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise RecordError(f"{path}: missing {what}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RecordError(f"{path}: corrupt {what} (unreadable JSON: {e})") from e


def check_meta(meta: Any, where: str) -> dict:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise RecordError(f"{where}: not an nxgates record (format={got!r}, expected {FORMAT!r})")
    v = meta.get("format_version")
    if v not in KNOWN_VERSIONS:
        raise RecordError(f"{where}: format_version={v!r} is not one this version of nxgates reads {KNOWN_VERSIONS}")
    for key in ("config", "flags", "tensors", "seeds"):
        if key in meta and not isinstance(meta[key], dict):
            raise RecordError(f"{where}: corrupt meta, {key!r} must be an object (got {type(meta[key]).__name__})")
    return meta


def load_step(run_dir: pathlib.Path, step: int) -> Step:
    stem = step_stem(step)
    side_path = run_dir / STEPS_DIR / f"{stem}.json"
    npz_path = run_dir / STEPS_DIR / f"{stem}.npz"
    side = _load_json(side_path, f"sidecar of step {step}")
    if not isinstance(side, dict) or side.get("step") != step:
        raise RecordError(f"{side_path}: corrupt sidecar (step={side.get('step') if isinstance(side, dict) else '?'!r},"
                          f" expected {step})")
    try:
        data = npz_path.read_bytes()
    except FileNotFoundError as e:
        raise RecordError(f"{npz_path}: missing arrays of step {step} (its sidecar exists)") from e
    digest = hashlib.sha256(data).hexdigest()
    if digest != side.get("npz_sha256") or len(data) != side.get("npz_bytes"):
        raise RecordError(f"{npz_path}: corrupt arrays of step {step}: checksum mismatch (sha256 {digest[:12]}.., "
                          f"{len(data)} bytes; the sidecar says {str(side.get('npz_sha256'))[:12]}.., "
                          f"{side.get('npz_bytes')} bytes)")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except Exception as e:  # noqa: BLE001 - any decoding failure means the step is not to be trusted
        raise RecordError(f"{npz_path}: corrupt arrays of step {step} ({type(e).__name__}: {e})") from e
    if sorted(arrays) != side.get("fields"):
        raise RecordError(f"{npz_path}: corrupt step {step}: its arrays {sorted(arrays)[:4]}.. differ from the "
                          f"sidecar's fields")
    for k in arrays:
        try:
            field_group(k)
        except ValueError as e:
            raise RecordError(f"{npz_path}: {e}") from e
    return Step(step=step, arrays=arrays)


def load_run(path: str | pathlib.Path) -> Run:
    """Read a run directory; ``RecordError`` (naming the file) for a missing, corrupt or unknown-version record."""
    run_dir = pathlib.Path(path)
    if not run_dir.is_dir():
        raise RecordError(f"{run_dir}: missing record (no such directory)")
    meta = check_meta(_load_json(run_dir / META_FILE, "meta.json"), str(run_dir / META_FILE))
    spec = None
    if meta.get("sketch") is not None:
        try:
            spec = SketchSpec.from_json(meta["sketch"])
        except ValueError as e:
            raise RecordError(f"{run_dir / META_FILE}: corrupt sketch spec ({e})") from e
    steps_dir = run_dir / STEPS_DIR
    stems: dict[int, set[str]] = {}
    if steps_dir.is_dir():
        for p in steps_dir.iterdir():
            m = _STEP_RE.match(p.name)
            if m:
                stems.setdefault(int(m.group(1)), set()).add(m.group(2))
    steps = {}
    for n in sorted(stems):
        if "json" not in stems[n]:
            # The npz was written but the run ended before its sidecar: an unfinished step, refused by name.
            raise RecordError(f"{steps_dir / (step_stem(n) + '.npz')}: corrupt record, step {n} has no sidecar "
                              "(the run ended while writing it); delete the file to read the steps before it")
        steps[n] = load_step(run_dir, n)
    if not any(n >= 1 for n in steps):
        raise RecordError(f"{run_dir}: missing steps (no step >= 1 under {STEPS_DIR}/)")
    return Run(path=str(run_dir), meta=meta, steps=steps, spec=spec)

