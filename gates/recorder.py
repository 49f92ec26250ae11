"""The recorder: write a run in the record format (docs/records.md) from any JAX trainer.

Outside the train step (small models, or raw trees the host may read)::

    from nxgates.gates import recorder
    with recorder.Recorder("runs/control", sketch_width=4096, seed=0, meta={"trainer": "my-trainer"}) as rec:
        rec.start(params=params)                       # optional: the initial parameters (step 0)
        for step in range(1, 4):
            new_params, opt_state, loss, grads = train_step(params, opt_state, batch)
            rec.step(loss=loss, grads=grads, params=new_params, prev_params=params)
            params = new_params

Inside a jitted, sharded train step (large models: nothing but the sketches leaves the devices)::

    @jax.jit
    def train_step(params, opt_state, batch):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        summ = recorder.summaries(grads, new_params, prev_params=params, width=4096, seed=0)
        return new_params, opt_state, loss, summ

    rec.step(loss=loss, grad_norm=gnorm, summaries=summ)

``summaries`` is a dict of small arrays ([w] per tensor); it is computed shard-locally (see gates/sketch.py) and is
the only thing that has to come back to the host.
"""

from __future__ import annotations

import functools
import pathlib
import platform
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nxgates.gates import records as records_lib
from nxgates.gates import sketch as sketch_lib
from nxgates.gates.sketch import DEFAULT_WIDTH, SketchSpec

META_KEYS = ("trainer", "config", "flags", "versions", "device", "seeds", "batch", "extra")


def summaries(grads=None, params=None, *, prev_params=None, width: int = DEFAULT_WIDTH, seed: int = 0) -> dict:
    """Everything a step records about its tensors, as one flat dict of small arrays (npz keys); jit-able.

    grads -> ``grad_sketch/<path>`` (f32 [w], or the exact values when numel < w), ``grad_fp/<path>`` (uint32 [2]),
    ``grad_sq/<path>`` (f32: the tensor's squared L2 norm); params (after the update) -> ``param_fp/<path>`` and
    ``param_sketch/<path>``; with ``prev_params`` (the parameters before the update) ``update_sketch/<path>`` instead
    of ``param_sketch``: the sketch of ``params - prev_params`` (the step's update, computed exactly in float32 before
    it is sketched; N6 reads the sum of these, far more precise than the difference of two parameter sketches).
    """
    out = {}
    if grads is not None:
        for p, s in sketch_lib.sketch(grads, width=width, seed=seed).items():
            out[f"grad_sketch/{p}"] = s
        for p, f in sketch_lib.fingerprint(grads).items():
            out[f"grad_fp/{p}"] = f
        for p, g in sketch_lib.named_leaves(grads).items():
            g32 = jnp.asarray(g).astype(jnp.float32)
            out[f"grad_sq/{p}"] = jnp.sum(g32 * g32)
    if params is not None:
        if prev_params is None:  # with prev_params the update sketch supersedes it (N6 reads the updates)
            for p, s in sketch_lib.sketch(params, width=width, seed=seed).items():
                out[f"param_sketch/{p}"] = s
        for p, f in sketch_lib.fingerprint(params).items():
            out[f"param_fp/{p}"] = f
    if prev_params is not None:
        if params is None:
            raise ValueError("summaries: prev_params given without params (the update is params - prev_params)")
        delta = jax.tree.map(lambda a, b: jnp.asarray(a).astype(jnp.float32) - jnp.asarray(b).astype(jnp.float32),
                             params, prev_params)
        for p, s in sketch_lib.sketch(delta, width=width, seed=seed).items():
            out[f"update_sketch/{p}"] = s
    return out


@functools.lru_cache(maxsize=8)
def jitted_summaries(width: int, seed: int):
    return jax.jit(functools.partial(summaries, width=width, seed=seed))


@functools.partial(jax.jit, static_argnames=("width",))
def _grad_summary(g, keys, *, width: int):
    g32 = jnp.asarray(g).astype(jnp.float32)
    sketch = sketch_lib.sketch_keyed(g, keys[0], width=width)
    return sketch, sketch_lib.fingerprint_keyed(g, keys[1:]), jnp.sum(g32 * g32)


@functools.partial(jax.jit, static_argnames=("width", "param_sketch"))
def _param_summary(p, q, keys, *, width: int, param_sketch: bool):
    out = {"param_fp": sketch_lib.fingerprint_keyed(p, keys[1:])}
    if param_sketch:
        out["param_sketch"] = sketch_lib.sketch_keyed(p, keys[0], width=width)
    if q is not None:
        delta = jnp.asarray(p).astype(jnp.float32) - jnp.asarray(q).astype(jnp.float32)
        out["update_sketch"] = sketch_lib.sketch_keyed(delta, keys[0], width=width)
    return out


def summaries_by_tensor(grads=None, params=None, *, prev_params=None, width: int = DEFAULT_WIDTH,
                        seed: int = 0) -> dict:
    """``summaries(...)`` under ``jax.jit``, the same arrays bit for bit, computed tensor by tensor outside a step.

    One program per tensor shape, dtype and sharding (a tensor's hash keys are an input, ``sketch.tensor_keys``)
    instead of one program over every tensor, which XLA is slow to compile: a step's first summaries of tiny's 74
    tensors took 10.2 to 11.9 s with the one program and 4.3 to 4.6 s by tensor (``benchmarks/summaries_compile.py``,
    docs/speed.md). For arrays laid out with an explicit sharding, whose sketches go through ``shard_map``, it is
    ``jitted_summaries`` itself. Not jit-able: it makes one call per tensor.
    """
    if prev_params is not None and params is None:
        raise ValueError("summaries: prev_params given without params (the update is params - prev_params)")
    sketch_lib._check_width_seed(width, seed)  # the same refusal of a bad width or seed as summaries()
    trees = [t for t in (grads, params, prev_params) if t is not None]
    if any(isinstance(x, jax.Array) and sketch_lib._explicit_sharding(x) is not None
           for t in trees for x in jax.tree.leaves(t)):
        return jitted_summaries(width, seed)(grads, params, prev_params=prev_params)
    groups: dict[str, dict] = {g: {} for g in ("grad_sketch", "grad_fp", "grad_sq", "param_sketch", "param_fp",
                                               "update_sketch")}
    if grads is not None:
        for p, g in sketch_lib.named_leaves(grads).items():
            sk, fp, sq = _grad_summary(g, sketch_lib.tensor_keys(p, seed), width=width)
            groups["grad_sketch"][p], groups["grad_fp"][p], groups["grad_sq"][p] = sk, fp, sq
    if params is not None:
        named = sketch_lib.named_leaves(params)
        prev = None
        if prev_params is not None:
            if jax.tree.structure(prev_params) != jax.tree.structure(params):
                raise ValueError("summaries: prev_params and params are not the same tree")
            prev = sketch_lib.named_leaves(prev_params)
        for p, x in named.items():
            out = _param_summary(x, None if prev is None else prev[p], sketch_lib.tensor_keys(p, seed), width=width,
                                 param_sketch=prev is None)
            for g, a in out.items():
                groups[g][p] = a
    # in the order of the jitted function's output (a dict pytree's keys, sorted)
    return dict(sorted((f"{g}/{p}", a) for g, by_path in groups.items() for p, a in by_path.items()))


def environment() -> tuple[dict, dict]:
    """(versions, device) of this process."""
    import jaxlib

    devs = jax.devices()
    versions = {"python": platform.python_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
                "numpy": np.__version__}
    device = {"platform": devs[0].platform, "device_kind": devs[0].device_kind, "device_count": len(devs)}
    return versions, device


def _scalar(name: str, value, *, integer: bool = False) -> np.ndarray:
    a = np.asarray(jax.device_get(value))
    if a.shape != ():
        raise ValueError(f"Recorder.step: {name} must be a scalar, got shape {a.shape}")
    if integer and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"Recorder.step: {name}={a!r} must be an integer")
    if not integer and not np.issubdtype(a.dtype, np.floating):
        raise ValueError(f"Recorder.step: {name} must be a floating-point scalar, got dtype {a.dtype}")
    return a


class Recorder:
    """Writes a run directory: meta.json at open (rewritten after every step and at close), one step file pair per
    step. ``meta``: any of trainer, config, flags, versions, device, seeds, batch (JSON-able; versions and device
    default to this process's; compare refuses records whose config or batch differ) and extra; other keys go into
    extra. ``full_tensors=True`` also stores whole gradients and
    parameters (small models only)."""

    def __init__(self, out_dir: str | pathlib.Path, *, sketch_width: int = DEFAULT_WIDTH, seed: int = 0,
                 meta: Mapping[str, Any] | None = None, full_tensors: bool = False, overwrite: bool = False):
        self.spec = SketchSpec(width=sketch_width, seed=seed)
        self.dir = pathlib.Path(out_dir)
        if self.dir.exists() and any(self.dir.iterdir()) and not overwrite:
            raise ValueError(f"Recorder: out_dir={str(self.dir)!r} exists and is not empty (pass overwrite=True "
                             "to replace its record)")
        if self.dir.exists() and overwrite:
            self._clear()
        meta = dict(meta or {})
        given = {k: meta.pop(k) for k in META_KEYS if k in meta}
        extra = dict(given.pop("extra", None) or {})
        extra.update(meta)
        versions, device = environment()
        self.meta = records_lib.new_meta(
            trainer=given.get("trainer", "unknown"), config=given.get("config"), flags=given.get("flags"),
            versions=given.get("versions", versions), device=given.get("device", device), seeds=given.get("seeds"),
            batch=given.get("batch"), sketch=self.spec, extra=extra)
        self.full_tensors = bool(full_tensors)
        self._last = 0
        self._closed = False
        self.bytes_written = 0
        records_lib.write_meta(self.dir, self.meta)

    def _clear(self) -> None:
        for p in (self.dir / records_lib.STEPS_DIR).glob("*"):
            p.unlink()
        (self.dir / records_lib.META_FILE).unlink(missing_ok=True)

    # ------------------------------------------------------------------------------------------------------ steps
    def start(self, *, params) -> None:
        """Step 0: the initial parameters (their sketches and fingerprints; the full tensors with full_tensors)."""
        self.step(0, params=params)

    def step(self, step: int | None = None, *, loss=None, grad_norm=None, log_probs=None, mask=None, grads=None,
             params=None, prev_params=None, routing=None, routing_mismatch=None, dropped_tokens=None,
             summaries: Mapping[str, Any] | None = None) -> int:
        """Record one step (any subset of the fields; ``step=None``: the next after the last). Raw trees are summarized
        here (one jitted call); ``summaries`` (from ``recorder.summaries`` inside the train step) is stored as is.
        Returns the step number."""
        if self._closed:
            raise ValueError(f"Recorder({str(self.dir)!r}): step() after close()")
        n = self._last + 1 if step is None else step
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0 or (n <= self._last and n != 0) or (
                n == 0 and self._last > 0):
            raise ValueError(f"Recorder.step: step={step!r} must be an int greater than the last step {self._last}")
        if n == 0 and any(v is not None for v in (loss, grad_norm, log_probs, grads, prev_params)):
            raise ValueError("Recorder.step: step 0 holds the initial parameters only")
        arrays: dict[str, np.ndarray] = {}
        if loss is not None:
            arrays["loss"] = _scalar("loss", loss)
        if grad_norm is not None:
            arrays["grad_norm"] = _scalar("grad_norm", grad_norm)
        if (log_probs is None) != (mask is None):
            raise ValueError("Recorder.step: log_probs and mask go together (the gates read log-probs over the mask)")
        if log_probs is not None:
            lp, m = np.asarray(jax.device_get(log_probs)), np.asarray(jax.device_get(mask))
            if lp.shape != m.shape:
                raise ValueError(f"Recorder.step: log_probs.shape={lp.shape} must equal mask.shape={m.shape}")
            arrays["log_probs"], arrays["mask"] = lp, m
            arrays["log_probs_fp"] = np.asarray(sketch_lib.fingerprint_array(lp, path="log_probs"))
        if routing is not None:
            arrays["routing"] = np.asarray(jax.device_get(routing)).astype(np.int32)
        if routing_mismatch is not None:
            arrays["routing_mismatch"] = _scalar("routing_mismatch", routing_mismatch, integer=True)
        if dropped_tokens is not None:
            arrays["dropped_tokens"] = _scalar("dropped_tokens", dropped_tokens, integer=True)
        if summaries is not None:
            for k, v in summaries.items():
                records_lib.field_group(k)  # refuses a key that is not a record field
                arrays[k] = np.asarray(jax.device_get(v))
        if grads is not None or params is not None:
            fn = jitted_summaries(self.spec.width, self.spec.seed)
            arrays.update({k: np.asarray(v) for k, v in jax.device_get(fn(grads, params, prev_params=prev_params))
                           .items()})
            self._note_tensors(grads, params)
            if self.full_tensors:
                for group, tree in (("grad", grads), ("param", params)):
                    if tree is not None:
                        for p, x in sketch_lib.named_leaves(tree).items():
                            arrays[f"{group}/{p}"] = np.asarray(jax.device_get(x))
        if summaries is not None and not self.meta["tensors"]:
            self._note_from_summaries(summaries)
        if not arrays:
            raise ValueError("Recorder.step: nothing to record (every field is None)")
        path = records_lib.write_step(self.dir, n, arrays)
        self.bytes_written += path.with_suffix(".npz").stat().st_size
        self._last = int(n)
        if n >= 1:
            self.meta["steps"].append(int(n))
        records_lib.write_meta(self.dir, self.meta)
        return int(n)

    def describe(self, tree) -> None:
        """Note each tensor's shape and dtype in meta.json (``tree``: the parameters, or their ``jax.ShapeDtypeStruct``
        s); compare checks them. Raw trees given to ``step`` are described automatically."""
        self._note_tensors(tree)
        records_lib.write_meta(self.dir, self.meta)

    def _note_tensors(self, *trees) -> None:
        for tree in trees:
            if tree is None:
                continue
            for p, x in sketch_lib.named_leaves(tree).items():
                shape = tuple(int(n) for n in np.shape(x))
                dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
                self.meta["tensors"][p] = {"shape": list(shape), "dtype": str(np.dtype(dtype)),
                                           "exact": sketch_lib.is_exact(int(np.prod(shape)), self.spec.width)}

    def _note_from_summaries(self, summ: Mapping[str, Any]) -> None:
        for k, v in summ.items():
            group, p = records_lib.field_group(k)
            if group in ("grad_sketch", "param_sketch", "update_sketch") and p not in self.meta["tensors"]:
                # Shape unknown from a sketch alone (describe() adds it); the length says exact (< w) or sketched.
                self.meta["tensors"][p] = {"shape": None, "dtype": None, "exact": int(np.shape(v)[0]) < self.spec.width}

    # ------------------------------------------------------------------------------------------------------ close
    def close(self) -> None:
        if self._closed:
            return
        self.meta["closed"] = True
        self.meta["closed_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        records_lib.write_meta(self.dir, self.meta)
        self._closed = True

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def sketch(tree, *, width: int = DEFAULT_WIDTH, seed: int = 0) -> dict:
    """``gates.sketch.sketch`` (re-exported: the recorder's in-step entry point for one tree)."""
    return sketch_lib.sketch(tree, width=width, seed=seed)
