"""The GDN chunk kernel (``kernels/gdn/kernel.py``, ``ops.py``) and the bf16 XLA path against
``reference.gdn_recurrent``.

Forward (o, final state) and every gradient (dq, dk, dv, dg, dbeta, initial-state gradient) on awkward shapes (T not a
multiple of the chunk, K != V), gate strengths 0.01 to 10, a non-zero initial state, bf16 and f32; the kernel under the
TPU interpreter with NaN-filled uninitialized memory; split-with-state against the whole sequence; argument validation.
Tolerances come from ``fixtures/tolerances.toml`` ([kernels."gdn.*"]).

Run: ``python -m pytest tests/kernels/test_gdn_kernel.py -q``
"""

from __future__ import annotations

import dataclasses
import functools
import tomllib

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from nxgates import fixtures, reference
from nxgates.gates.diff import rel_l2
from nxgates.kernels.gdn import kernel, ops
from nxgates.kernels.gdn.inputs import make_inputs, outputs_and_grads

_TOLERANCES = fixtures.TOLERANCES


def tolerance(key: str) -> float:
    """``rel_l2`` of ``[kernels."<key>"]`` in the shared tolerance table."""
    with _TOLERANCES.open("rb") as f:
        return float(tomllib.load(f)["kernels"][key]["rel_l2"])


@dataclasses.dataclass(frozen=True)
class Case:
    b: int
    t: int
    h: int
    k: int
    v: int
    chunk: int
    strength: float
    dtype: str
    with_state: bool = True

    @property
    def shape_id(self) -> str:
        state = "" if self.with_state else "-nostate"
        return f"B{self.b}-T{self.t}-H{self.h}-K{self.k}-V{self.v}-C{self.chunk}-g{self.strength:g}{state}"

    @property
    def id(self) -> str:
        return f"{self.shape_id}-{'f32' if self.dtype == 'float32' else 'bf16'}"

    def inputs(self, dtype=None):
        # Seeded by the shape and gates, not the dtype: the bf16 and f32 runs of one shape see the same values.
        return make_inputs(
            self.shape_id, b=self.b, t=self.t, h=self.h, k=self.k, v=self.v, dtype=dtype or jnp.dtype(self.dtype),
            gate_strength=self.strength, with_state=self.with_state,
        )  # fmt: skip


@functools.cache
def reference_results(case: Case) -> dict[str, np.ndarray]:
    """Outputs and gradients of ``reference.gdn_recurrent`` on the float32 copy of the case's inputs."""
    return outputs_and_grads(
        lambda q, k, v, g, b, s: reference.gdn_recurrent(q, k, v, g, b, initial_state=s), case.inputs(jnp.float32)
    )


IMPLS = {
    "pallas": lambda c: functools.partial(_pallas, chunk=c.chunk, interpret=True),
    "xla": lambda c: functools.partial(_xla, chunk=c.chunk),
}


def _pallas(q, k, v, g, b, s, *, chunk, interpret):
    return ops.gdn_chunk(q, k, v, g, b, chunk_size=chunk, initial_state=s, interpret=interpret)


def _xla(q, k, v, g, b, s, *, chunk):
    return ops.gdn_chunk_xla(q, k, v, g, b, chunk_size=chunk, initial_state=s)


CASES = [
    Case(b=2, t=75, h=2, k=16, v=32, chunk=16, strength=1.0, dtype="float32"),
    Case(b=1, t=63, h=2, k=32, v=16, chunk=32, strength=10.0, dtype="bfloat16"),
    Case(b=1, t=100, h=1, k=16, v=16, chunk=64, strength=0.01, dtype="float32", with_state=False),
]
RUNS = [("pallas", c) for c in CASES] + [("xla", CASES[0]), ("xla", CASES[1])]


def assert_close(results, expected, tol_key, label):
    tol = tolerance(tol_key)
    errors = {name: rel_l2(results[name], expected[name]) for name in expected}
    bad = {name: err for name, err in errors.items() if not err <= tol}
    assert set(results) == set(expected), f"{label}: outputs {sorted(results)} != expected {sorted(expected)}"
    assert all(np.all(np.isfinite(x)) for x in results.values()), f"{label}: non-finite outputs"
    assert not bad, f"{label}: rel_l2 above {tol_key}={tol:g}: {bad} (all: {errors})"


@pytest.mark.parametrize(("impl", "case"), RUNS, ids=[f"{i}-{c.id}" for i, c in RUNS])
def test_matches_recurrent(impl, case):
    """Forward and all gradients of the kernel op / the XLA path against the per-token float32 reference."""
    results = outputs_and_grads(IMPLS[impl](case), case.inputs())
    dtype = "f32" if case.dtype == "float32" else "bf16"
    assert_close(results, reference_results(case), f"gdn.{impl}.{dtype}", f"{impl} {case.id}")


def test_outputs_keep_dtypes():
    case = CASES[1]
    inp = case.inputs()
    o, final = ops.gdn_chunk(*inp.args(), chunk_size=case.chunk, initial_state=inp.state0, interpret=True)
    o_x, final_x = ops.gdn_chunk_xla(*inp.args(), chunk_size=case.chunk, initial_state=inp.state0)
    assert (o.dtype, final.dtype, o.shape) == (jnp.bfloat16, jnp.float32, inp.v.shape)
    assert (o_x.dtype, final_x.dtype) == (jnp.bfloat16, jnp.float32)


@pytest.mark.parametrize("chunk", [16, 32], ids=["C16", "C32"])
def test_kernel_under_tpu_interpreter_nan_memory(chunk):
    """The raw kernel with NaN-filled uninitialized memory: o, final state and chunk maps against the reference."""
    case = Case(b=1, t=2 * chunk, h=1, k=16, v=16, chunk=chunk, strength=1.0, dtype="float32")
    inp = case.inputs()
    kq, kk, kv, kg, kb = ops.to_kernel_layout(*inp.args())
    s0 = inp.state0.reshape(case.h, case.k, case.v)  # [B=1, H, K, V] -> [B*H, K, V]
    o, final, (m_maps, b_maps) = kernel.chunk_forward(
        kq, kk, kv, kg, kb, s0, chunk_size=chunk, scale=case.k**-0.5, with_maps=True,
        interpret=pltpu.InterpretParams(uninitialized_memory="nan"),
    )  # fmt: skip
    o_ref, final_ref = reference.gdn_recurrent(*inp.args(), initial_state=inp.state0)
    m_ref, b_ref = reference.gdn_chunk_maps(inp.k, inp.v, inp.g, inp.beta, chunk_size=chunk)  # [B, N, H, K, *]
    tol = tolerance("gdn.pallas.f32")
    assert rel_l2(ops.from_kernel_layout(o, 1, case.h), o_ref) <= tol
    assert rel_l2(final.reshape(final_ref.shape), final_ref) <= tol
    assert rel_l2(m_maps, jnp.moveaxis(m_ref[0], 1, 0)) <= tol  # [N, H, K, K] -> [H, N, K, K] (B*H = H)
    assert rel_l2(b_maps, jnp.moveaxis(b_ref[0], 1, 0)) <= tol


def test_map_scan_kernel_matches_sequential_fold():
    """The m-scan kernel (NaN-filled memory) composes 5 maps like ``reference.gdn_fold(order="sequential")``."""
    rng = np.random.default_rng(5)
    m = jnp.asarray(rng.standard_normal((1, 5, 2, 8, 8)) / 3, jnp.float32)  # [B, N, H, K, K]
    b = jnp.asarray(rng.standard_normal((1, 5, 2, 8, 4)), jnp.float32)  # [B, N, H, K, V]
    m_ref, b_ref = reference.gdn_fold((m, b), order="sequential")
    # [B, N, H, K, *] -> [N, B*H, K, *]
    m_n = jnp.moveaxis(m, 1, 0).reshape(5, 2, 8, 8)
    b_n = jnp.moveaxis(b, 1, 0).reshape(5, 2, 8, 4)
    m_out, b_out = kernel.map_scan(m_n, b_n, interpret=pltpu.InterpretParams(uninitialized_memory="nan"))
    tol = tolerance("gdn.pallas.f32")
    assert rel_l2(m_out, m_ref.reshape(2, 8, 8)) <= tol
    assert rel_l2(b_out, b_ref.reshape(2, 8, 4)) <= tol


def test_split_with_state_equals_whole_sequence():
    """Running tokens [0, 37) and handing the final state to tokens [37, 75) gives the whole sequence's outputs."""
    case = CASES[0]
    inp = case.inputs()
    run = functools.partial(ops.gdn_chunk, chunk_size=case.chunk, interpret=True)
    o_all, final_all = run(*inp.args(), initial_state=inp.state0)
    first = [x[:, :37] for x in inp.args()]
    second = [x[:, 37:] for x in inp.args()]
    o_1, mid = run(*first, initial_state=inp.state0)
    o_2, final_2 = run(*second, initial_state=mid)
    tol = tolerance("gdn.pallas.f32")
    assert rel_l2(jnp.concatenate([o_1, o_2], axis=1), o_all) <= tol
    assert rel_l2(final_2, final_all) <= tol


def test_neutral_padding_tokens_change_nothing():
    """Explicit neutral tokens (g = 0, beta = 0, q = k = v = 0) appended to T leave o and the final state unchanged."""
    case = CASES[0]
    inp = case.inputs()
    run = functools.partial(ops.gdn_chunk_xla, chunk_size=case.chunk, initial_state=inp.state0)
    o, final = run(*inp.args())
    padded = ops.pad_to_chunk(*inp.args(), 128)
    o_p, final_p = run(*padded)
    np.testing.assert_array_equal(np.asarray(o_p[:, : case.t]), np.asarray(o))
    assert float(jnp.abs(o_p[:, case.t :]).max()) == 0.0
    assert rel_l2(final_p, final) <= tolerance("gdn.xla.f32")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(chunk_size=48), "chunk_size=48"),
        (dict(k=np.zeros((1, 8, 2, 4), np.float32)), r"k.shape=\(1, 8, 2, 4\)"),
        (dict(v=np.zeros((1, 8, 2, 4), np.int32)), "v.dtype=int32"),
        (dict(g=np.zeros((1, 8), np.float32)), "g must be a rank-3"),
        (dict(initial_state=np.zeros((1, 2, 8, 5), np.float32)), r"initial_state.shape=\(1, 2, 8, 5\)"),
        (dict(scale=-1.0), "scale=-1.0"),
    ],
    ids=["chunk", "k-shape", "v-dtype", "g-rank", "state-shape", "scale"],
)
@pytest.mark.parametrize("op", ["gdn_chunk", "gdn_chunk_xla"])
def test_bad_arguments_are_refused_by_name(op, change, match):
    args = dict(
        q=np.zeros((1, 8, 2, 8), np.float32),
        k=np.zeros((1, 8, 2, 8), np.float32),
        v=np.zeros((1, 8, 2, 4), np.float32),
        g=np.zeros((1, 8, 2), np.float32),
        beta=np.zeros((1, 8, 2), np.float32),
    )
    kwargs = dict(chunk_size=16)
    for name, value in change.items():
        (args if name in args else kwargs)[name] = jnp.asarray(value) if isinstance(value, np.ndarray) else value
    args = {name: jnp.asarray(x) for name, x in args.items()}
    with pytest.raises(ValueError, match=match):
        getattr(ops, op)(**args, **kwargs)


def test_gradients_are_not_silently_zero():
    """Guards the comparison itself: the reference gradients are non-trivial (a zero gradient would compare badly)."""
    ref = reference_results(CASES[0])
    for name in ("dq", "dk", "dv", "dg", "dbeta", "dstate0"):
        assert float(np.linalg.norm(ref[name])) > 1e-3, name
