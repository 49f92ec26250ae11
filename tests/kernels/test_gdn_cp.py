"""Context-parallel GDN (``kernels/gdn/context_parallel.py``) on 8 host CPU devices against ``reference.gdn_recurrent``.

Context sizes 2, 4, 8; forward and every gradient (dq, dk, dv, dg, dbeta, initial-state gradient); T not a multiple of
context x chunk; a non-zero initial state; gate strengths 0.01 to 10; the fold switches (tree / m scan, tree / dh scan)
on and off; the scan-vs-tree difference; deliberately wrong folds injected through the fold callables must be caught;
split-with-state against the whole sequence; both ``check_vma`` conventions. The full switch grid is ``slow``.

Run: ``python -m pytest tests/kernels/test_gdn_cp.py -q`` (``--runslow`` for the full grid).
"""

from __future__ import annotations

import dataclasses
import functools
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from nxgates import fixtures, reference
from nxgates.gates.diff import rel_l2
from nxgates.kernels.gdn import context_parallel as cp
from nxgates.kernels.gdn.inputs import make_inputs, outputs_and_grads

_TOLERANCES = fixtures.TOLERANCES
CHUNK = 16


def tolerance(key: str) -> float:
    """``rel_l2`` of ``[kernels."<key>"]`` in the shared tolerance table."""
    with _TOLERANCES.open("rb") as f:
        return float(tomllib.load(f)["kernels"][key]["rel_l2"])


def context_mesh(ranks: int) -> jax.sharding.Mesh:
    return jax.make_mesh((ranks,), ("context",), devices=jax.devices()[:ranks])


@dataclasses.dataclass(frozen=True)
class Shape:
    t: int
    strength: float
    b: int = 1
    h: int = 2
    k: int = 16
    v: int = 32

    @property
    def id(self) -> str:
        return f"B{self.b}-T{self.t}-H{self.h}-K{self.k}-V{self.v}-C{CHUNK}-g{self.strength:g}"

    def inputs(self, dtype):
        return make_inputs(
            self.id, b=self.b, t=self.t, h=self.h, k=self.k, v=self.v, dtype=dtype, gate_strength=self.strength
        )


@dataclasses.dataclass(frozen=True)
class Run:
    ranks: int
    fold: str
    dh_fold: str
    dtype: str
    shape: Shape

    @property
    def id(self) -> str:
        dt = "f32" if self.dtype == "float32" else "bf16"
        return f"R{self.ranks}-{self.fold}-{self.dh_fold}-{dt}-{self.shape.id}"


# T = 200 over 4 ranks: 256 padded tokens, 4 chunks of 16 per rank (the tree and the scan associate differently).
SHAPE_R4 = Shape(t=200, strength=0.1)
SHAPE_R2 = Shape(t=120, strength=0.01)  # 128 padded: 4 chunks per rank
SHAPE_R8 = Shape(t=250, strength=10.0)  # 256 padded: 2 chunks per rank
RUNS = [
    Run(4, "tree", "tree", "float32", SHAPE_R4),
    Run(4, "m_scan", "dh_scan", "float32", SHAPE_R4),
    Run(2, "m_scan", "tree", "bfloat16", SHAPE_R2),
    Run(8, "tree", "dh_scan", "float32", SHAPE_R8),
]
SLOW_RUNS = [
    Run(r, f, d, dt, s)
    for r, s in ((2, SHAPE_R2), (4, SHAPE_R4), (8, SHAPE_R8))
    for f in ("tree", "m_scan")
    for d in ("tree", "dh_scan")
    for dt in ("float32", "bfloat16")
    if Run(r, f, d, dt, s) not in RUNS
]


@functools.cache
def reference_results(shape: Shape) -> dict[str, np.ndarray]:
    return outputs_and_grads(
        lambda q, k, v, g, b, s: reference.gdn_recurrent(q, k, v, g, b, initial_state=s), shape.inputs(jnp.float32)
    )


def cp_fn(ranks, fold, dh_fold, *, interpret=True, check_vma=False):
    mesh = context_mesh(ranks)

    def fn(q, k, v, g, b, s):
        return cp.gdn_cp_sharded(
            mesh, q, k, v, g, b, fold=fold, dh_fold=dh_fold, chunk_size=CHUNK, initial_state=s, interpret=interpret,
            check_vma=check_vma,
        )  # fmt: skip

    return fn


@functools.cache
def cp_results(run: Run) -> dict[str, np.ndarray]:
    return outputs_and_grads(cp_fn(run.ranks, run.fold, run.dh_fold), run.shape.inputs(jnp.dtype(run.dtype)))


def errors_against(results, expected):
    return {name: rel_l2(results[name], expected[name]) for name in expected}


def check_run(run: Run):
    results = cp_results(run)
    expected = reference_results(run.shape)
    assert set(results) == set(expected)
    assert all(np.all(np.isfinite(x)) for x in results.values()), f"{run.id}: non-finite outputs"
    key = "gdn.cp.f32" if run.dtype == "float32" else "gdn.cp.bf16"
    tol = tolerance(key)
    errors = errors_against(results, expected)
    bad = {name: e for name, e in errors.items() if not e <= tol}
    assert not bad, f"{run.id}: rel_l2 above {key}={tol:g}: {bad} (all: {errors})"


@pytest.mark.parametrize("run", RUNS, ids=[r.id for r in RUNS])
def test_cp_matches_recurrent(run):
    check_run(run)


@pytest.mark.slow
@pytest.mark.parametrize("run", SLOW_RUNS, ids=[r.id for r in SLOW_RUNS])
def test_cp_matches_recurrent_full_grid(run):
    check_run(run)


def test_scan_against_tree_is_reassociation_only():
    """m scan + dh scan against tree + tree on the same inputs: float32 reassociation, every output."""
    tree, scan = cp_results(RUNS[0]), cp_results(RUNS[1])
    tol = tolerance("gdn.fold_diff.f32")
    diffs = errors_against(scan, tree)
    assert all(d <= tol for d in diffs.values()), diffs


def test_fold_functions_compose_like_the_reference():
    """tree, Pallas scan (NaN-filled memory) and reference.gdn_fold agree on 7 maps (odd: the tree's leftover)."""
    rng = np.random.default_rng(7)
    m = jnp.asarray(rng.standard_normal((7, 1, 2, 8, 8)) / 3, jnp.float32)  # [n, B, H, K, K]
    b = jnp.asarray(rng.standard_normal((7, 1, 2, 8, 4)), jnp.float32)  # [n, B, H, K, V]
    m_ref, b_ref = reference.gdn_fold((jnp.moveaxis(m, 0, 1), jnp.moveaxis(b, 0, 1)), order="sequential")
    tol = tolerance("gdn.fold_diff.f32")
    nan_memory = pltpu.InterpretParams(uninitialized_memory="nan")
    for fold in (cp.fold_tree, functools.partial(cp.fold_scan, interpret=nan_memory)):
        m_out, b_out = fold(m, b)
        assert rel_l2(m_out, m_ref) <= tol and rel_l2(b_out, b_ref) <= tol


def _skip_last_chunk(m, b):
    return cp.fold_tree(m[:-1], b[:-1])


def _reversed_order(m, b):
    return cp.fold_tree(jnp.flip(m, 0), jnp.flip(b, 0))


def _reference_sequential(m, b):
    # [n, B, H, K, *] -> [B, n, H, K, *] for reference.gdn_fold
    return reference.gdn_fold((jnp.moveaxis(m, 0, 1), jnp.moveaxis(b, 0, 1)), order="sequential")


@pytest.mark.parametrize(
    ("which", "fold", "caught"),
    [
        ("fold", _reference_sequential, False),
        ("fold", _skip_last_chunk, True),
        ("fold", _reversed_order, True),
        ("dh_fold", _skip_last_chunk, True),
    ],
    ids=["fold-reference-sequential", "fold-skip-last-chunk", "fold-reversed", "dh_fold-skip-last-chunk"],
)
def test_injected_folds(which, fold, caught):
    """A fold callable is used as given: the reference's sequential fold passes, deliberately wrong folds are caught."""
    run = RUNS[0]
    folds = {"fold": "tree", "dh_fold": "tree", which: fold}
    inp = run.shape.inputs(jnp.float32)
    fn = cp_fn(run.ranks, folds["fold"], folds["dh_fold"])
    if which == "fold":  # the forward alone shows a wrong forward fold
        o, final = jax.jit(fn)(*inp.args(), inp.state0)
        results = {"o": np.asarray(o), "final_state": np.asarray(final)}
    else:
        results = outputs_and_grads(fn, inp)
    expected = reference_results(run.shape)
    errors = errors_against(results, {name: expected[name] for name in results})
    tol = tolerance("gdn.cp.f32")
    failing = {name: e for name, e in errors.items() if not e <= tol}
    if caught:
        assert failing, f"a wrong {which} went unnoticed: {errors}"
    else:
        assert not failing, errors


def test_split_with_state_equals_whole_sequence():
    """CP over tokens [0, 64) then CP over [64, 128) from the first part's final state equals CP over all 128 tokens."""
    shape = Shape(t=128, strength=1.0)
    inp = shape.inputs(jnp.float32)
    fn = jax.jit(cp_fn(2, "m_scan", "tree"))
    o_all, final_all = fn(*inp.args(), inp.state0)
    o_1, mid = fn(*(x[:, :64] for x in inp.args()), inp.state0)
    o_2, final_2 = fn(*(x[:, 64:] for x in inp.args()), mid)
    tol = tolerance("gdn.cp.f32")
    assert rel_l2(jnp.concatenate([o_1, o_2], axis=1), o_all) <= tol
    assert rel_l2(final_2, final_all) <= tol


def test_check_vma_true_under_tpu_interpreter():
    """With ``check_vma=True`` (device-invariant final state and initial-state gradient) the values are the same.

    (``interpret=True``'s HLO interpreter rejects kernels whose constants are not marked varying under check_vma, so
    this convention runs under the TPU interpreter.)
    """
    shape = Shape(t=40, strength=1.0, h=1, v=16)
    fn = cp_fn(2, "m_scan", "dh_scan", interpret=pltpu.InterpretParams(), check_vma=True)
    results = outputs_and_grads(fn, shape.inputs(jnp.float32))
    errors = errors_against(results, reference_results(shape))
    tol = tolerance("gdn.cp.f32")
    assert all(e <= tol for e in errors.values()), errors


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(fold="scan"), "fold='scan'"),
        (dict(dh_fold="m_scan"), "dh_fold='m_scan'"),
        (dict(axis_name="seq"), "axis_name='seq'"),
        (dict(chunk_size=20), "chunk_size=20"),
    ],
    ids=["fold", "dh_fold", "axis", "chunk"],
)
def test_bad_arguments_are_refused_by_name(kwargs, match):
    x = jnp.zeros((1, 64, 1, 8), jnp.float32)
    gates = jnp.zeros((1, 64, 1), jnp.float32)
    with pytest.raises(ValueError, match=match):
        cp.gdn_cp_sharded(context_mesh(2), x, x, x, gates, gates, **{"chunk_size": 16, **kwargs})


def test_local_slice_must_be_whole_chunks():
    auto = (jax.sharding.AxisType.Auto,)
    mesh = jax.make_mesh((2,), ("context",), devices=jax.devices()[:2], axis_types=auto)
    x = jnp.zeros((1, 48, 1, 8), jnp.float32)  # 24 tokens per rank: not a multiple of 16
    gates = jnp.zeros((1, 48, 1), jnp.float32)

    def body(q, g):
        return cp.gdn_cp(q, q, q, g, g, chunk_size=16)

    seq = jax.sharding.PartitionSpec(None, "context")
    replicated = jax.sharding.PartitionSpec()
    f = jax.shard_map(body, mesh=mesh, in_specs=(seq, seq), out_specs=(seq, replicated), check_vma=False)
    with pytest.raises(ValueError, match="local T=24"):
        f(x, gates)
