"""Kernel-report cases of Gated DeltaNet: the Pallas chunk kernel, the bf16 XLA path and context parallelism.

Every row compares an implementation with ``reference.gdn_recurrent`` (float32, per token; its gradients by
``jax.vjp``) on the same inputs (``kernels/gdn/inputs.py``: numpy, seeded by the case id, rounded through bfloat16),
for each output: ``o``, ``final_state`` and the gradients ``dq``, ``dk``, ``dv``, ``dg``, ``dbeta``, ``dstate0`` (the
cotangents of o and the final state are seeded random arrays).

Kernels / implementations (``impl`` ends with the input dtype, ``/f32`` or ``/bf16``):
- ``gdn_chunk``: ``pallas`` (``kernels.gdn.ops.gdn_chunk``: Pallas forward, float32 JAX backward) and ``xla``
  (``gdn_chunk_xla``, the trainer's path without the kernel).
- ``gdn_cp``: ``kernels.gdn.context_parallel.gdn_cp_sharded`` over a ``context`` mesh axis, one impl per switch pair:
  ``tree+tree``, ``m_scan+tree`` (``gdn_cp_m_scan``), ``tree+dh_scan`` (``gdn_cp_dh_scan``), ``m_scan+dh_scan``.
- ``gdn_cp_fold_diff``: the scan against the tree on the same path, ``expected`` = the ``tree+tree`` result:
  ``m_scan-vs-tree`` (every output) and ``dh_scan-vs-tree`` (the gradients; the forward does not use the dh fold).

Cases (``CASES``):
- ``tiny``: B=1, T=200, H=2, K=16, V=32, chunk 16, context 4 (256 padded tokens: 4 chunks per rank), f32 and bf16,
  gate strength 0.1 (``kernels/gdn/inputs.py``).
- ``medium``: B=1, T=1000, H=4 value heads over 2 key heads, K=V=64, chunk 64, context 4, f32 and bf16, gate
  strength 0.1: a CPU-sized case with the cell's chunk (run with ``rows("medium")``; the CLI offers tiny and cell).
- ``cell``: the trainer's per-device GDN shapes: 64 value heads over 16 key heads of dim 128 (expanded per value head),
  V=128, chunk 64, context 4, 2048 tokens per rank (T=8192), bf16, gate strength 1. Slow on CPU (the reference is
  8192 sequential steps, its gradient run segment by segment); minutes on an accelerator.

``IMPLS`` holds what the rows call (the report can substitute one, e.g. a deliberately wrong ``m_scan`` fold).
The context mesh uses the first 4 devices: on CPU the process must start with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (``python -m nxgates`` sets it before importing jax);
this module sets nothing process-global.

Run: ``python -m nxgates.kernel_report --op gdn [--case cell]``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from nxgates import reference
from nxgates.gates.kernel_cases.base import KernelRow, interpret_mode
from nxgates.kernels.gdn import context_parallel as cp
from nxgates.kernels.gdn import ops
from nxgates.kernels.gdn.inputs import OUTPUTS, GdnInputs, make_inputs, outputs_and_grads

CASES = ("tiny", "medium", "cell")
KERNELS = ("gdn_chunk", "gdn_cp", "gdn_cp_fold_diff")
GRADIENTS = ("dq", "dk", "dv", "dg", "dbeta", "dstate0")


@dataclasses.dataclass(frozen=True)
class GdnCase:
    name: str
    b: int
    t: int
    h: int
    k: int
    v: int
    chunk: int
    context: int
    dtypes: tuple[str, ...]
    key_heads: int | None = None
    gate_strength: float = 1.0
    reference_segment: int = 1024  # tokens per segment of the reference's gradient (memory: one segment's states)

    def inputs(self, dtype) -> GdnInputs:
        return make_inputs(
            f"gdn-{self.name}", b=self.b, t=self.t, h=self.h, k=self.k, v=self.v, dtype=dtype,
            gate_strength=self.gate_strength, key_heads=self.key_heads,
        )  # fmt: skip


SPECS = {
    # Weak gates (strength 0.1) in tiny and medium: a rank's folded map M keeps weight, so the fold order shows.
    "tiny": GdnCase(
        "tiny", b=1, t=200, h=2, k=16, v=32, chunk=16, context=4, dtypes=("float32", "bfloat16"), gate_strength=0.1
    ),
    "medium": GdnCase(
        "medium", b=1, t=1000, h=4, k=64, v=64, chunk=64, context=4, dtypes=("float32", "bfloat16"), key_heads=2,
        gate_strength=0.1,
    ),  # fmt: skip
    "cell": GdnCase(
        "cell", b=1, t=8192, h=64, k=128, v=128, chunk=64, context=4, dtypes=("bfloat16",), key_heads=16,
        reference_segment=128,
    ),  # fmt: skip
}


def _fold_scan(m, b):
    return cp.fold_scan(m, b, interpret=interpret_mode())


def _gdn_chunk(q, k, v, g, beta, initial_state, *, chunk_size):
    return ops.gdn_chunk(
        q, k, v, g, beta, chunk_size=chunk_size, initial_state=initial_state, interpret=interpret_mode()
    )


def _gdn_chunk_xla(q, k, v, g, beta, initial_state, *, chunk_size):
    return ops.gdn_chunk_xla(q, k, v, g, beta, chunk_size=chunk_size, initial_state=initial_state)


def _gdn_cp(mesh, q, k, v, g, beta, initial_state, *, fold, dh_fold, chunk_size):
    return cp.gdn_cp_sharded(
        mesh, q, k, v, g, beta, fold=fold, dh_fold=dh_fold, chunk_size=chunk_size, initial_state=initial_state,
        interpret=interpret_mode(), check_vma=False,
    )  # fmt: skip


# Looked up at call time: the report (and its tests) may substitute any entry, e.g. a deliberately wrong "m_scan".
IMPLS = {
    "pallas": _gdn_chunk,
    "xla": _gdn_chunk_xla,
    "cp": _gdn_cp,
    "tree": cp.fold_tree,
    "m_scan": _fold_scan,
    "dh_scan": _fold_scan,
}
CP_SWITCHES = (("tree", "tree"), ("m_scan", "tree"), ("tree", "dh_scan"), ("m_scan", "dh_scan"))


def reference_results(inp: GdnInputs, *, segment: int) -> dict[str, np.ndarray]:
    """Outputs and gradients of ``reference.gdn_recurrent``, segment by segment when T > ``segment``.

    The same per-token recurrence (each segment starts from the previous one's final state), so the same values; the
    gradient runs segment by segment backwards from the stored boundary states (``jax.vjp`` of one jitted segment),
    so memory holds one segment's per-token states instead of all T (the cell case needs this on CPU).
    """

    def ref(q, k, v, g, beta, initial_state):
        return reference.gdn_recurrent(q, k, v, g, beta, initial_state=initial_state)

    t = inp.q.shape[1]
    if t <= segment:
        return outputs_and_grads(ref, inp)
    state0 = inp.state0
    if state0 is None:
        b, _, h, kdim = inp.q.shape
        state0 = jnp.zeros((b, h, kdim, inp.v.shape[3]), jnp.float32)
    starts = list(range(0, t, segment))
    pieces = [tuple(x[:, s : s + segment] for x in inp.args()) for s in starts]
    fwd = jax.jit(ref)

    @jax.jit
    def bwd(q, k, v, g, beta, s_in, d_o, d_s):
        _, vjp = jax.vjp(ref, q, k, v, g, beta, s_in)
        return vjp((d_o, d_s))

    states, outs = [state0], []
    for piece in pieces:  # forward: keep only the boundary states
        o, s_out = fwd(*piece, states[-1])
        outs.append(np.asarray(o))
        states.append(s_out)
    grads = {name: [None] * len(pieces) for name in ("dq", "dk", "dv", "dg", "dbeta")}
    d_s = inp.d_state
    for i in reversed(range(len(pieces))):  # backward: last segment first, handing the state gradient back
        d_o = inp.d_o[:, starts[i] : starts[i] + segment]
        *d_seq, d_s = bwd(*pieces[i], states[i], d_o, d_s)
        for name, d in zip(grads, d_seq, strict=True):
            grads[name][i] = np.asarray(d)
    result = {"o": np.concatenate(outs, axis=1), "final_state": np.asarray(states[-1])}
    result.update({name: np.concatenate(parts, axis=1) for name, parts in grads.items()})
    if inp.state0 is not None:
        result["dstate0"] = np.asarray(d_s)
    return {name: np.asarray(x, np.float32) for name, x in result.items()}


def _dtype_tag(dtype: str) -> str:
    return "f32" if dtype == "float32" else "bf16"


def _rows_for(case, kernel, impl, results, expected, tol_key, outputs=OUTPUTS) -> Iterator[KernelRow]:
    for name in outputs:
        yield KernelRow(kernel, case, name, impl, results[name], expected[name], tol_key)


def rows(case: str, kernels: tuple[str, ...] = KERNELS) -> Iterator[KernelRow]:
    """The report rows of ``case`` (``kernels``: only these kernels' rows are computed)."""
    if case not in SPECS:
        raise ValueError(f"case={case!r} must be one of {tuple(SPECS)}")
    spec = SPECS[case]
    if len(jax.devices()) < spec.context:
        raise ValueError(
            f"case={case!r} needs {spec.context} devices for the context mesh, found {len(jax.devices())}: start the "
            "process with XLA_FLAGS=--xla_force_host_platform_device_count=8 (before jax is imported)"
        )
    mesh = jax.make_mesh((spec.context,), ("context",), devices=jax.devices()[: spec.context])
    expected = reference_results(spec.inputs(jnp.float32), segment=spec.reference_segment)
    for dtype in spec.dtypes:
        tag = _dtype_tag(dtype)
        inp = spec.inputs(jnp.dtype(dtype))
        if "gdn_chunk" in kernels:
            for impl in ("pallas", "xla"):
                fn = functools.partial(IMPLS[impl], chunk_size=spec.chunk)
                results = outputs_and_grads(fn, inp)
                yield from _rows_for(case, "gdn_chunk", f"{impl}/{tag}", results, expected, f"gdn.{impl}.{tag}")
                del results
        if "gdn_cp" in kernels or "gdn_cp_fold_diff" in kernels:
            by_switch = {}
            for fold, dh_fold in CP_SWITCHES:
                fn = functools.partial(
                    IMPLS["cp"], mesh, fold=IMPLS[fold], dh_fold=IMPLS[dh_fold], chunk_size=spec.chunk
                )
                results = outputs_and_grads(fn, inp)
                if "gdn_cp" in kernels:
                    impl = f"{fold}+{dh_fold}/{tag}"
                    yield from _rows_for(case, "gdn_cp", impl, results, expected, f"gdn.cp.{tag}")
                if (fold, dh_fold) != ("m_scan", "dh_scan"):  # the diff rows need tree+tree, m_scan+tree, tree+dh_scan
                    by_switch[(fold, dh_fold)] = results
            if "gdn_cp_fold_diff" in kernels:
                tree = by_switch[("tree", "tree")]
                yield from _rows_for(
                    case, "gdn_cp_fold_diff", f"m_scan-vs-tree/{tag}", by_switch[("m_scan", "tree")], tree,
                    f"gdn.fold_diff.{tag}",
                )  # fmt: skip
                yield from _rows_for(
                    case, "gdn_cp_fold_diff", f"dh_scan-vs-tree/{tag}", by_switch[("tree", "dh_scan")], tree,
                    f"gdn.fold_diff.{tag}", outputs=GRADIENTS,
                )  # fmt: skip
            del by_switch
