"""Taps: the values of the model's ops at one step, forward and backward, as outputs of the traced program.

Used by ``gates.explain`` only. A model built with ``build_log_probs(..., explain=True)`` owns a ``TapSession``
(``Ctx.taps``); every other build has ``Ctx.taps = None`` and the tap helpers below are never reached (the default
programs are unchanged: tests/model/test_taps.py compares their StableHLO text).

A tap is recorded in a **scope** (one per traced region whose values must leave it as outputs: the embedding, each
layer of the pattern (inside ``jax.checkpoint`` and the layer scan), the head). Inside a scope:

- ``value(op, x)``: the forward value ``x``, and its cotangent in the backward;
- ``call(op, fn, args, names, diff)``: ``fn(*args)``; the forward output, and the cotangents of the inputs ``diff`` (the
  op's backward's outputs);
- ``forward(op, x)``: a forward value only;
- ``deposit(op, x, fn, res)``: identity on ``x``; in the backward, ``fn(ct, *res)`` (any function of the cotangent of
  ``x``, e.g. the GDN context-parallel dh fold recomputed from it) is deposited.

Forward values are collected into the scope's ``forward`` dict, which the model returns as an extra output of the layer
function, the scan (stacked per layer) and the ``shard_map`` (one row per device). Backward values come back as
gradients: each backward tap adds a **probe**, a zero array given to the traced step as an input, to the tapped value
(``x + probe``: exact, the value does not change), so the gradient with respect to the probe IS the cotangent of the
value there; ``deposit`` uses a ``custom_vjp`` identity whose backward returns ``fn(ct, *res)`` as the probe's
cotangent. No host callbacks: all of it works under ``jit``, ``shard_map``, ``jax.checkpoint`` and ``lax.scan``.

The probes' shapes are found by a first trace without probes (``jax.eval_shape``; ``TapSession.shapes``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class TapSpec:
    """One tap of a scope: ``key`` is unique in the scope (``op`` or ``op[label]``); the parts it keeps."""

    key: str
    op: str
    label: str
    forward: tuple[str, ...]  # parts of the forward value (e.g. ("out",), ("M", "B"))
    backward: tuple[str, ...]  # parts of the backward value (an input's name, "out", "M", ...)


class Scope:
    """The taps of one traced region: specs in trace order, forward values, the probes given to it (or None)."""

    def __init__(self, name: str, probes: dict | None):
        self.name = name
        self.probes = probes or {}
        self.specs: dict[str, TapSpec] = {}
        self.forward: dict[str, dict[str, jax.Array]] = {}
        self.shapes: dict[str, dict[str, jax.ShapeDtypeStruct]] = {}

    def add(self, spec: TapSpec) -> None:
        if spec.key in self.specs:
            raise ValueError(f"taps: key {spec.key!r} tapped twice in scope {self.name!r}")
        self.specs[spec.key] = spec

    def probe(self, key: str, part: str, x):
        """``x + probe`` when this scope was given a probe for ``(key, part)``; records the probe's shape."""
        self.shapes.setdefault(key, {})[part] = jax.ShapeDtypeStruct(x.shape, x.dtype)
        p = self.probes.get(key, {}).get(part)
        return x if p is None else x + p.astype(x.dtype)


def _key(op: str, label: str) -> str:
    return f"{op}[{label}]" if label else op


def _differentiable(x) -> bool:
    return x is not None and jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)


class TapSession:
    """The taps of one explained model build (``Ctx.taps``)."""

    def __init__(self):
        self._stack: list[Scope] = []
        self.specs: dict[str, list[TapSpec]] = {}  # scope name -> specs in trace order (the last trace's)
        self.shapes: dict[str, dict[str, dict[str, jax.ShapeDtypeStruct]]] = {}  # scope -> key -> part -> shape

    @contextlib.contextmanager
    def scope(self, name: str, probes: dict | None) -> Iterator[Scope]:
        s = Scope(name, probes)
        self._stack.append(s)
        try:
            yield s
        finally:
            self._stack.pop()
            self.specs[name] = list(s.specs.values())
            self.shapes[name] = s.shapes

    @property
    def current(self) -> Scope:
        if not self._stack:
            raise RuntimeError("taps: a tap outside any scope (the model must open one around every tapped region)")
        return self._stack[-1]

    # ----------------------------------------------------------------------------------------------------- taps
    def value(self, op: str, x, label: str = "", backward: bool = True):
        s = self.current
        key = _key(op, label)
        back = ("out",) if backward and _differentiable(x) else ()
        s.add(TapSpec(key, op, label, ("out",), back))
        s.forward[key] = {"out": x}
        return s.probe(key, "out", x) if back else x

    def forward(self, op: str, values: dict, label: str = ""):
        s = self.current
        key = _key(op, label)
        s.add(TapSpec(key, op, label, tuple(values), ()))
        s.forward[key] = dict(values)

    def call(self, op: str, fn: Callable, args: Sequence, names: Sequence[str], diff: Sequence[int],
             label: str = ""):
        s = self.current
        key = _key(op, label)
        args = list(args)
        back = tuple(names[i] for i in diff if _differentiable(args[i]))
        for i in diff:
            if _differentiable(args[i]):
                args[i] = s.probe(key, names[i], args[i])
        out = fn(*args)
        first = out[0] if isinstance(out, tuple) else out
        s.add(TapSpec(key, op, label, ("out",), back))
        s.forward[key] = {"out": first}
        return out

    def deposit(self, op: str, x, fn: Callable, res: Sequence, label: str = ""):
        """Identity on ``x``; the backward tap is ``fn(ct_x, *res)`` (a dict of parts)."""
        s = self.current
        key = _key(op, label)
        shapes = jax.eval_shape(fn, x, *res)
        for part, sd in shapes.items():
            s.shapes.setdefault(key, {})[part] = jax.ShapeDtypeStruct(sd.shape, sd.dtype)
        s.add(TapSpec(key, op, label, (), tuple(shapes)))
        probe = s.probes.get(key)
        if probe is None:
            return x
        return _deposit(fn, x, {p: probe[p] for p in shapes}, tuple(res))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _deposit(fn, x, probe, res):
    del probe, res
    return x


def _deposit_fwd(fn, x, probe, res):
    return x, (probe, res)


def _deposit_bwd(fn, saved, ct):
    probe, res = saved
    out = fn(ct, *res)
    d_probe = {p: out[p].astype(probe[p].dtype) for p in probe}
    return ct, d_probe, jax.tree.map(jnp.zeros_like, res)


_deposit.defvjp(_deposit_fwd, _deposit_bwd)
