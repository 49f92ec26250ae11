"""Tests of the float32 Gated DeltaNet references (reference/gdn.py).

The ground truth chain: ``gdn_recurrent`` against a float64 NumPy loop written here (``_oracle_gdn``, plus a
float64 finite-difference check of its autodiff gradients); then ``gdn_chunked``, ``gdn_chunk_maps`` / ``gdn_fold``
and ``gdn_context_parallel`` against ``gdn_recurrent`` (and the maps / folds against float64 products of the per-token
maps). Inputs are built in NumPy from a seed derived from the case id and rounded through bfloat16 (q and k
L2-normalized first, as the model does), so every side sees the same values.

Run: ``python -m pytest tests/reference/test_gdn.py -q -p no:cacheprovider``.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from nxgates.gates.diff import rel_l2
from nxgates.reference import gdn_chunk_maps, gdn_chunked, gdn_context_parallel, gdn_fold, gdn_recurrent

# Tolerances (rel L2), measured over this file's grid on CPU (jax 0.12.0.1) with a script that reruns every case:
# chunked / context-parallel vs recurrent <= 3.8e-7 forward and <= 8.4e-7 for any gradient (dg is the largest);
# recurrent vs the float64 loop <= 2.2e-7; chunk maps vs float64 <= 1.9e-7; tree vs sequential fold <= 2.6e-7.
# 1e-5 leaves >= 10x headroom, while a wrong term (decay missing or misplaced, correction on the undecayed state,
# maps composed in the wrong order) gives errors of 1e-2 and more.
F32_FWD_TOL = 1e-5
F32_GRAD_TOL = 1e-5
# Float32 recurrence (and maps) against the float64 loops: float32 rounding only.
ORACLE_TOL = 1e-5


# ----------------------------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------------------------


def _bf16(x: np.ndarray) -> np.ndarray:
    """Round through bfloat16, back to float32."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _case_id(b, t, h, dk, dv, chunk=None, strength=None, h0=False, ranks=None) -> str:
    parts = [f"B{b}", f"T{t}", f"H{h}", f"K{dk}", f"V{dv}"]
    if ranks is not None:
        parts.append(f"R{ranks}")
    if chunk is not None:
        parts.append(f"C{chunk}")
    if strength is not None:
        parts.append(f"s{strength:g}")
    if h0:
        parts.append("h0")
    return "-".join(parts)


def _inputs(case_id: str, b: int, t: int, h: int, dk: int, dv: int, strength: float, with_h0: bool) -> dict:
    """float32 NumPy inputs (bf16-rounded), seeded from the case id. ``g = -strength * u``, ``u ~ U(0, 1)``."""
    rng = np.random.default_rng(zlib.crc32(case_id.encode()))
    q = rng.standard_normal((b, t, h, dk))
    k = rng.standard_normal((b, t, h, dk))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True)  # the model L2-normalizes q and k
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((b, t, h, dv))
    g = -strength * rng.uniform(0.0, 1.0, (b, t, h))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, h))))  # sigmoid, as the model
    h0 = 0.5 * rng.standard_normal((b, h, dk, dv)) if with_h0 else None
    out = {name: _bf16(x) for name, x in dict(q=q, k=k, v=v, g=g, beta=beta).items()}
    out["initial_state"] = _bf16(h0) if with_h0 else None
    return out


def _cotangents(case_id: str, b: int, t: int, h: int, dk: int, dv: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(zlib.crc32(("cotangent-" + case_id).encode()))
    return _bf16(rng.standard_normal((b, t, h, dv))), _bf16(rng.standard_normal((b, h, dk, dv)))


# ----------------------------------------------------------------------------------------------------------------------
# Float64 NumPy oracles (loops; independent of the code under test)
# ----------------------------------------------------------------------------------------------------------------------


def _oracle_gdn(q, k, v, g, beta, scale=None, initial_state=None):
    """The GDN recurrence in float64, one token at a time, one (batch, head) at a time."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    scale = dk**-0.5 if scale is None else scale
    o = np.zeros((b, t, h, dv))
    final = np.zeros((b, h, dk, dv))
    for bi in range(b):
        for hi in range(h):
            s = np.zeros((dk, dv)) if initial_state is None else np.array(initial_state[bi, hi], np.float64)
            for ti in range(t):
                s = np.exp(g[bi, ti, hi]) * s
                kt = k[bi, ti, hi]
                s = s + np.outer(kt, beta[bi, ti, hi] * (v[bi, ti, hi] - s.T @ kt))
                o[bi, ti, hi] = s.T @ (scale * q[bi, ti, hi])
            final[bi, hi] = s
    return o, final


def _oracle_chunk_maps(k, v, g, beta, chunk):
    """float64 ``(M [B, N, H, K, K], B [B, N, H, K, V])``: products of the per-token maps over each chunk."""
    k, v, g, beta = (np.asarray(x, np.float64) for x in (k, v, g, beta))
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    n = -(-t // chunk)
    m_out = np.zeros((b, n, h, dk, dk))
    b_out = np.zeros((b, n, h, dk, dv))
    for bi in range(b):
        for hi in range(h):
            for c in range(n):
                m, bb = np.eye(dk), np.zeros((dk, dv))
                for ti in range(c * chunk, min((c + 1) * chunk, t)):
                    kt = k[bi, ti, hi]
                    m_tok = np.exp(g[bi, ti, hi]) * (np.eye(dk) - beta[bi, ti, hi] * np.outer(kt, kt))
                    m, bb = m_tok @ m, m_tok @ bb + beta[bi, ti, hi] * np.outer(kt, v[bi, ti, hi])
                m_out[bi, c, hi], b_out[bi, c, hi] = m, bb
    return m_out, b_out


def _oracle_fold(m, b_map):
    """float64 left-to-right composition of ``[B, N, H, ...]`` maps: apply chunk 0 first."""
    m, b_map = np.asarray(m, np.float64), np.asarray(b_map, np.float64)
    acc_m = np.broadcast_to(np.eye(m.shape[-1]), m[:, 0].shape).copy()
    acc_b = np.zeros(b_map[:, 0].shape)
    for c in range(m.shape[1]):
        acc_m, acc_b = m[:, c] @ acc_m, m[:, c] @ acc_b + b_map[:, c]
    return acc_m, acc_b


# ----------------------------------------------------------------------------------------------------------------------
# Jitted entry points (static: chunk_size, num_ranks, scale)
# ----------------------------------------------------------------------------------------------------------------------

_recurrent = jax.jit(gdn_recurrent, static_argnames=("scale",))
_chunked = jax.jit(gdn_chunked, static_argnames=("chunk_size", "scale"))
_context_parallel = jax.jit(gdn_context_parallel, static_argnames=("num_ranks", "chunk_size", "scale"))


def _args(x: dict):
    return x["q"], x["k"], x["v"], x["g"], x["beta"]


def _vjp(fn, x: dict, cts) -> dict:
    """``dq, dk, dv, dg, dbeta, dh0`` of ``fn(q, k, v, g, beta, initial_state=h0)`` for cotangents ``(do, dS)``."""

    def pullback(q, k, v, g, beta, h0, d_o, d_s):
        _, vjp_fn = jax.vjp(lambda *a: fn(*a[:5], initial_state=a[5]), q, k, v, g, beta, h0)
        return vjp_fn((d_o, d_s))

    grads = jax.jit(pullback)(*_args(x), x["initial_state"], *cts)
    return dict(zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, strict=True))


# ----------------------------------------------------------------------------------------------------------------------
# gdn_recurrent against the float64 oracle
# ----------------------------------------------------------------------------------------------------------------------

ORACLE_CASES = [
    # (B, T, H, K, V, strength, h0, scale)
    (2, 1, 2, 16, 16, 1.0, True, None),
    (1, 63, 2, 60, 100, 0.01, False, None),
    (2, 75, 1, 16, 64, 10.0, True, 0.3),
    (1, 500, 1, 16, 16, 0.1, True, None),
]


@pytest.mark.parametrize(
    "b,t,h,dk,dv,strength,with_h0,scale",
    ORACLE_CASES,
    ids=[_case_id(b, t, h, dk, dv, strength=s, h0=h0) + ("" if sc is None else f"-scale{sc}")
         for b, t, h, dk, dv, s, h0, sc in ORACLE_CASES],
)
def test_recurrent_matches_float64_oracle(b, t, h, dk, dv, strength, with_h0, scale):
    case = _case_id(b, t, h, dk, dv, strength=strength, h0=with_h0)
    x = _inputs(case, b, t, h, dk, dv, strength, with_h0)
    o, final = _recurrent(*_args(x), scale=scale, initial_state=x["initial_state"])
    o_ref, final_ref = _oracle_gdn(*_args(x), scale=scale, initial_state=x["initial_state"])
    assert o.shape == (b, t, h, dv) and final.shape == (b, h, dk, dv)
    assert o.dtype == jnp.float32 and final.dtype == jnp.float32
    assert rel_l2(o, o_ref) <= ORACLE_TOL, f"o: rel_l2={rel_l2(o, o_ref):.3e}"
    assert rel_l2(final, final_ref) <= ORACLE_TOL, f"final_state: rel_l2={rel_l2(final, final_ref):.3e}"


def test_recurrent_gradient_matches_float64_finite_differences():
    """Directional derivatives of <o, do> + <S, dS> by the float64 oracle (central differences) vs autodiff."""
    b, t, h, dk, dv = 1, 20, 2, 16, 8
    case = _case_id(b, t, h, dk, dv, strength=1.0, h0=True) + "-fd"
    x = _inputs(case, b, t, h, dk, dv, 1.0, True)
    d_o, d_s = _cotangents(case, b, t, h, dk, dv)
    grads = _vjp(gdn_recurrent, x, (d_o, d_s))
    names = ("q", "k", "v", "g", "beta", "initial_state")
    rng = np.random.default_rng(zlib.crc32(("direction-" + case).encode()))
    eps = 1e-6
    for name, grad_name in zip(names, ("dq", "dk", "dv", "dg", "dbeta", "dh0"), strict=True):
        direction = rng.standard_normal(x[name].shape)

        def loss(delta, name=name, direction=direction):
            xs = {n: np.asarray(x[n], np.float64) for n in names}
            xs[name] = xs[name] + delta * direction
            o, final = _oracle_gdn(*(xs[n] for n in names[:5]), initial_state=xs["initial_state"])
            return float(np.sum(o * d_o) + np.sum(final * d_s))

        fd = (loss(eps) - loss(-eps)) / (2 * eps)
        ad = float(np.sum(np.asarray(grads[grad_name], np.float64) * direction))
        # float32 autodiff vs float64 central differences (step 1e-6): measured <= 7e-7 relative.
        assert abs(ad - fd) <= 1e-5 * max(abs(fd), 1e-3), f"{grad_name}: autodiff {ad:.8e} vs finite diff {fd:.8e}"


# ----------------------------------------------------------------------------------------------------------------------
# gdn_chunked against gdn_recurrent: a sparse grid covering every T, K, V, chunk size, gate strength, with/without h0
# ----------------------------------------------------------------------------------------------------------------------

CHUNKED_CASES = [
    # (B, T, H, K, V, chunk, strength, h0)
    (2, 1, 2, 16, 16, 16, 1.0, True),
    (2, 63, 2, 60, 100, 16, 0.01, False),
    (1, 64, 2, 64, 64, 64, 1.0, True),
    (2, 75, 2, 100, 60, 32, 10.0, True),
    (1, 500, 2, 64, 16, 64, 0.1, False),
    (1, 500, 1, 100, 100, 32, 10.0, True),
    (2, 63, 2, 16, 64, 64, 10.0, False),
    (1, 75, 2, 60, 60, 16, 0.1, True),
    (1, 64, 2, 100, 16, 32, 0.01, True),
    (1, 1, 1, 64, 100, 64, 0.01, False),
    (1, 500, 2, 16, 60, 16, 1.0, True),
]


@pytest.mark.parametrize(
    "b,t,h,dk,dv,chunk,strength,with_h0",
    CHUNKED_CASES,
    ids=[_case_id(b, t, h, dk, dv, c, s, h0) for b, t, h, dk, dv, c, s, h0 in CHUNKED_CASES],
)
def test_chunked_matches_recurrent(b, t, h, dk, dv, chunk, strength, with_h0):
    case = _case_id(b, t, h, dk, dv, chunk, strength, with_h0)
    x = _inputs(case, b, t, h, dk, dv, strength, with_h0)
    o_ref, final_ref = _recurrent(*_args(x), initial_state=x["initial_state"])
    o, final = _chunked(*_args(x), chunk_size=chunk, initial_state=x["initial_state"])
    assert o.shape == (b, t, h, dv) and final.shape == (b, h, dk, dv)
    assert o.dtype == jnp.float32 and final.dtype == jnp.float32
    assert rel_l2(o, o_ref) <= F32_FWD_TOL, f"o: rel_l2={rel_l2(o, o_ref):.3e}"
    assert rel_l2(final, final_ref) <= F32_FWD_TOL, f"final_state: rel_l2={rel_l2(final, final_ref):.3e}"


GRAD_CASES = [
    # (B, T, H, K, V, chunk, strength)  all with a non-zero initial state
    (1, 63, 2, 60, 100, 16, 1.0),
    (2, 75, 1, 16, 64, 32, 10.0),
    (1, 64, 2, 64, 60, 64, 0.01),
    (1, 500, 1, 16, 16, 64, 0.1),
]


@pytest.mark.parametrize(
    "b,t,h,dk,dv,chunk,strength",
    GRAD_CASES,
    ids=[_case_id(b, t, h, dk, dv, c, s, True) for b, t, h, dk, dv, c, s in GRAD_CASES],
)
def test_chunked_gradients_match_recurrent(b, t, h, dk, dv, chunk, strength):
    case = _case_id(b, t, h, dk, dv, chunk, strength, True)
    x = _inputs(case, b, t, h, dk, dv, strength, True)
    cts = _cotangents(case, b, t, h, dk, dv)
    expected = _vjp(gdn_recurrent, x, cts)
    actual = _vjp(functools.partial(gdn_chunked, chunk_size=chunk), x, cts)
    for name, ref in expected.items():
        assert np.all(np.isfinite(actual[name])), f"{name} has non-finite values"
        err = rel_l2(actual[name], ref)
        assert err <= F32_GRAD_TOL, f"{name}: rel_l2={err:.3e}"


# ----------------------------------------------------------------------------------------------------------------------
# Chunk maps and their folds
# ----------------------------------------------------------------------------------------------------------------------

MAP_CASES = [
    # (B, T, H, K, V, chunk, strength): N = ceil(T / chunk) in {1, 2, 3, 5, 8}, last chunk partial where T allows.
    # Strengths stay <= 2 here: at 10 a whole chunk's decay (~exp(-160)) underflows float32 to 0 while the float64
    # oracle keeps 1e-57 (rel L2 = 1 for a correct map); strong gates are covered by the chunked / CP tests.
    (1, 10, 2, 16, 24, 16, 1.0),
    (2, 63, 1, 16, 16, 32, 2.0),
    (1, 75, 2, 60, 16, 32, 0.1),
    (1, 75, 1, 16, 60, 16, 0.01),
    (1, 120, 1, 16, 16, 16, 1.0),
]


@pytest.mark.parametrize(
    "b,t,h,dk,dv,chunk,strength",
    MAP_CASES,
    ids=[_case_id(b, t, h, dk, dv, c, s) for b, t, h, dk, dv, c, s in MAP_CASES],
)
def test_chunk_maps_and_folds(b, t, h, dk, dv, chunk, strength):
    """Maps vs float64 per-token products; tree and sequential folds agree and match the float64 fold of the same
    float32 maps; the folded map applied to h0 gives gdn_recurrent's final state."""
    case = _case_id(b, t, h, dk, dv, chunk, strength)
    x = _inputs(case, b, t, h, dk, dv, strength, True)
    m, b_map = jax.jit(gdn_chunk_maps, static_argnames=("chunk_size",))(
        x["k"], x["v"], x["g"], x["beta"], chunk_size=chunk
    )
    n = -(-t // chunk)
    assert m.shape == (b, n, h, dk, dk) and b_map.shape == (b, n, h, dk, dv)
    m_ref, b_ref = _oracle_chunk_maps(x["k"], x["v"], x["g"], x["beta"], chunk)
    assert rel_l2(m, m_ref) <= ORACLE_TOL, f"M: rel_l2={rel_l2(m, m_ref):.3e}"
    assert rel_l2(b_map, b_ref) <= ORACLE_TOL, f"B_c: rel_l2={rel_l2(b_map, b_ref):.3e}"

    fold = jax.jit(gdn_fold, static_argnames=("order",))
    seq = fold((m, b_map), order="sequential")
    tree = fold((m, b_map), order="tree")
    fold_ref = _oracle_fold(m, b_map)
    for label, folded in (("sequential", seq), ("tree", tree)):
        assert folded[0].shape == (b, h, dk, dk) and folded[1].shape == (b, h, dk, dv)
        for part, got, ref in (("M", folded[0], fold_ref[0]), ("B", folded[1], fold_ref[1])):
            assert rel_l2(got, ref) <= F32_FWD_TOL, f"{label} {part}: rel_l2 vs float64 fold={rel_l2(got, ref):.3e}"
    for part in (0, 1):
        assert rel_l2(tree[part], seq[part]) <= F32_FWD_TOL, f"tree vs sequential part {part}"

    _, final_ref = _recurrent(*_args(x), initial_state=x["initial_state"])
    for label, (fm, fb) in (("sequential", seq), ("tree", tree)):
        final = jnp.einsum("BHKL,BHLV->BHKV", fm, x["initial_state"], precision=jax.lax.Precision.HIGHEST) + fb
        assert rel_l2(final, final_ref) <= F32_FWD_TOL, f"{label} fold applied to h0 vs gdn_recurrent"


def test_fold_of_no_maps_is_identity():
    m = jnp.zeros((1, 0, 2, 4, 4))
    b_map = jnp.zeros((1, 0, 2, 4, 3))
    for order in ("sequential", "tree"):
        fm, fb = gdn_fold((m, b_map), order=order)
        np.testing.assert_array_equal(np.asarray(fm), np.broadcast_to(np.eye(4), (1, 2, 4, 4)))
        np.testing.assert_array_equal(np.asarray(fb), np.zeros((1, 2, 4, 3)))


# ----------------------------------------------------------------------------------------------------------------------
# Context parallel against gdn_recurrent
# ----------------------------------------------------------------------------------------------------------------------

CP_CASES = [
    # (B, T, H, K, V, ranks, chunk, strength, h0): T never a multiple of ranks * chunk
    (2, 75, 2, 16, 16, 1, 16, 1.0, True),
    (1, 63, 2, 60, 100, 2, 16, 0.01, False),
    (2, 100, 1, 16, 64, 3, 16, 10.0, True),
    (1, 75, 2, 64, 16, 4, 32, 0.1, True),  # 4 * 32 = 128 > 75: the last rank holds only padding
    (1, 75, 1, 16, 60, 8, 16, 1.0, True),  # 8 * 16 = 128: ranks 5..7 hold only padding
    (1, 500, 2, 100, 16, 8, 16, 0.1, True),
    (1, 500, 1, 16, 16, 3, 64, 10.0, False),
]


@pytest.mark.parametrize(
    "b,t,h,dk,dv,ranks,chunk,strength,with_h0",
    CP_CASES,
    ids=[_case_id(b, t, h, dk, dv, c, s, h0, r) for b, t, h, dk, dv, r, c, s, h0 in CP_CASES],
)
def test_context_parallel_matches_recurrent(b, t, h, dk, dv, ranks, chunk, strength, with_h0):
    case = _case_id(b, t, h, dk, dv, chunk, strength, with_h0, ranks)
    x = _inputs(case, b, t, h, dk, dv, strength, with_h0)
    o_ref, final_ref = _recurrent(*_args(x), initial_state=x["initial_state"])
    o, final = _context_parallel(*_args(x), num_ranks=ranks, chunk_size=chunk, initial_state=x["initial_state"])
    assert o.shape == (b, t, h, dv) and final.shape == (b, h, dk, dv)
    assert rel_l2(o, o_ref) <= F32_FWD_TOL, f"o: rel_l2={rel_l2(o, o_ref):.3e}"
    assert rel_l2(final, final_ref) <= F32_FWD_TOL, f"final_state: rel_l2={rel_l2(final, final_ref):.3e}"


def test_context_parallel_gradients_match_recurrent():
    b, t, h, dk, dv, ranks, chunk, strength = 1, 75, 2, 16, 24, 3, 16, 1.0
    case = _case_id(b, t, h, dk, dv, chunk, strength, True, ranks) + "-grad"
    x = _inputs(case, b, t, h, dk, dv, strength, True)
    cts = _cotangents(case, b, t, h, dk, dv)
    expected = _vjp(gdn_recurrent, x, cts)
    actual = _vjp(functools.partial(gdn_context_parallel, num_ranks=ranks, chunk_size=chunk), x, cts)
    for name, ref in expected.items():
        err = rel_l2(actual[name], ref)
        assert err <= F32_GRAD_TOL, f"{name}: rel_l2={err:.3e}"


# ----------------------------------------------------------------------------------------------------------------------
# Split with state: the first part's final state fed to the second part equals the whole
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["recurrent", "chunked-C16"])
def test_split_with_state(impl):
    b, t, h, dk, dv, split = 1, 75, 2, 16, 24, 40
    case = _case_id(b, t, h, dk, dv, strength=1.0, h0=True) + f"-split{split}"
    x = _inputs(case, b, t, h, dk, dv, 1.0, True)
    fn = _recurrent if impl == "recurrent" else functools.partial(_chunked, chunk_size=16)
    o_all, final_all = fn(*_args(x), initial_state=x["initial_state"])
    first = [a[:, :split] for a in _args(x)]
    second = [a[:, split:] for a in _args(x)]
    o1, mid = fn(*first, initial_state=x["initial_state"])
    o2, final = fn(*second, initial_state=mid)
    o_split = jnp.concatenate([o1, o2], axis=1)
    assert rel_l2(o_split, o_all) <= F32_FWD_TOL, f"o: rel_l2={rel_l2(o_split, o_all):.3e}"
    assert rel_l2(final, final_all) <= F32_FWD_TOL, f"final: rel_l2={rel_l2(final, final_all):.3e}"
    # the second part really depends on the carried state: starting it from zeros gives something else
    o2_zero, _ = fn(*second, initial_state=jnp.zeros_like(mid))
    assert rel_l2(o2_zero, o2) > 1e-2


# ----------------------------------------------------------------------------------------------------------------------
# Validation: every error names its argument (and value)
# ----------------------------------------------------------------------------------------------------------------------


def _small(**overrides):
    rng = np.random.default_rng(0)
    x = dict(
        q=rng.standard_normal((1, 5, 2, 4)).astype(np.float32),
        k=rng.standard_normal((1, 5, 2, 4)).astype(np.float32),
        v=rng.standard_normal((1, 5, 2, 3)).astype(np.float32),
        g=-np.ones((1, 5, 2), np.float32),
        beta=np.full((1, 5, 2), 0.5, np.float32),
    )
    x.update(overrides)
    return x


_G_POS = -np.ones((1, 5, 2), np.float32)
_G_POS[0, 3, 1] = 0.25
_G_NAN = -np.ones((1, 5, 2), np.float32)
_G_NAN[0, 1, 0] = np.nan

SEQ_FNS = {
    "recurrent": lambda x, **kw: gdn_recurrent(*_args(x), **kw),
    "chunked": lambda x, **kw: gdn_chunked(*_args(x), **kw),
    "context_parallel": lambda x, **kw: gdn_context_parallel(*_args(x), num_ranks=kw.pop("num_ranks", 2), **kw),
}

INPUT_ERRORS = [
    # (id, input overrides, keyword arguments, text the message must contain)
    ("q-rank", dict(q=np.zeros((5, 2, 4), np.float32)), {}, "q.shape=(5, 2, 4)"),
    ("q-dtype", dict(q=np.zeros((1, 5, 2, 4), np.int32)), {}, "q.dtype=int32"),
    ("k-shape", dict(k=np.zeros((1, 5, 2, 5), np.float32)), {}, "k.shape=(1, 5, 2, 5)"),
    ("v-shape", dict(v=np.zeros((1, 4, 2, 3), np.float32)), {}, "v.shape=(1, 4, 2, 3)"),
    ("g-shape", dict(g=np.zeros((1, 5), np.float32)), {}, "g.shape=(1, 5)"),
    ("beta-shape", dict(beta=np.zeros((1, 5, 3), np.float32)), {}, "beta.shape=(1, 5, 3)"),
    ("g-positive", dict(g=_G_POS), {}, "g[0, 3, 1]=0.25"),
    ("g-nan", dict(g=_G_NAN), {}, "g[0, 1, 0]=nan"),
    ("T-zero", dict(q=np.zeros((1, 0, 2, 4), np.float32), k=np.zeros((1, 0, 2, 4), np.float32),
                    v=np.zeros((1, 0, 2, 3), np.float32), g=np.zeros((1, 0, 2), np.float32),
                    beta=np.zeros((1, 0, 2), np.float32)), {}, "T=0"),
    ("h0-shape", {}, dict(initial_state=np.zeros((1, 2, 3, 4), np.float32)), "initial_state.shape=(1, 2, 3, 4)"),
    ("scale-nan", {}, dict(scale=float("nan")), "scale=nan"),
    ("scale-array", {}, dict(scale=np.ones(3)), "scale=array"),
]


@pytest.mark.parametrize("fn_name", list(SEQ_FNS))
@pytest.mark.parametrize("overrides,kwargs,needle", [e[1:] for e in INPUT_ERRORS], ids=[e[0] for e in INPUT_ERRORS])
def test_input_errors_name_the_argument(fn_name, overrides, kwargs, needle):
    with pytest.raises(ValueError) as err:
        SEQ_FNS[fn_name](_small(**overrides), **dict(kwargs))
    assert needle in str(err.value)


MAP_INPUT_ERRORS = [
    # gdn_chunk_maps(k, v, g, beta): (id, input overrides, text the message must contain)
    ("k-rank", dict(k=np.zeros((1, 5, 2), np.float32)), "k.shape=(1, 5, 2)"),
    ("k-dtype", dict(k=np.zeros((1, 5, 2, 4), np.int8)), "k.dtype=int8"),
    ("v-shape", dict(v=np.zeros((1, 4, 2, 3), np.float32)), "v.shape=(1, 4, 2, 3)"),
    ("g-shape", dict(g=np.zeros((1, 5), np.float32)), "g.shape=(1, 5)"),
    ("beta-shape", dict(beta=np.zeros((1, 5, 3), np.float32)), "beta.shape=(1, 5, 3)"),
    ("g-positive", dict(g=_G_POS), "g[0, 3, 1]=0.25"),
]


@pytest.mark.parametrize(
    "overrides,needle", [(e[1], e[2]) for e in MAP_INPUT_ERRORS], ids=[e[0] for e in MAP_INPUT_ERRORS]
)
def test_chunk_maps_input_errors_name_the_argument(overrides, needle):
    x = _small(**overrides)
    with pytest.raises(ValueError) as err:
        gdn_chunk_maps(x["k"], x["v"], x["g"], x["beta"], chunk_size=4)
    assert needle in str(err.value)


@pytest.mark.parametrize("chunk_size,needle", [(48, "chunk_size=48"), (0, "chunk_size=0"), (16.0, "chunk_size=16.0"),
                                               (True, "chunk_size=True")])
@pytest.mark.parametrize("fn_name", ["chunked", "context_parallel", "chunk_maps"])
def test_chunk_size_errors(fn_name, chunk_size, needle):
    x = _small()
    with pytest.raises(ValueError) as err:
        if fn_name == "chunk_maps":
            gdn_chunk_maps(x["k"], x["v"], x["g"], x["beta"], chunk_size=chunk_size)
        else:
            SEQ_FNS[fn_name](x, chunk_size=chunk_size)
    assert needle in str(err.value)


@pytest.mark.parametrize("num_ranks,needle", [(0, "num_ranks=0"), (-2, "num_ranks=-2"), (2.0, "num_ranks=2.0")])
def test_num_ranks_errors(num_ranks, needle):
    with pytest.raises(ValueError) as err:
        gdn_context_parallel(*_args(_small()), num_ranks=num_ranks, chunk_size=4)
    assert needle in str(err.value)


@pytest.mark.parametrize(
    "maps,order,needle",
    [
        ((np.zeros((1, 2, 2, 4, 4), np.float32), np.zeros((1, 2, 2, 4, 3), np.float32)), "bogus", "order='bogus'"),
        (np.zeros((1, 2, 2, 4, 4), np.float32), "tree", "maps must be a pair"),
        ((np.zeros((1, 2, 2, 4, 3), np.float32), np.zeros((1, 2, 2, 4, 3), np.float32)), "tree",
         "maps[0] (M).shape=(1, 2, 2, 4, 3)"),
        ((np.zeros((1, 2, 2, 4, 4), np.float32), np.zeros((1, 3, 2, 4, 3), np.float32)), "sequential",
         "maps[1] (B_c).shape=(1, 3, 2, 4, 3)"),
    ],
    ids=["order", "not-a-pair", "M-shape", "B-shape"],
)
def test_fold_errors(maps, order, needle):
    with pytest.raises(ValueError) as err:
        gdn_fold(maps, order=order)
    assert needle in str(err.value)


@pytest.mark.parametrize("impl", ["recurrent", "chunked-C16"])
def test_bf16_inputs_are_upcast(impl):
    """bf16 inputs give float32 outputs, identical to float32 inputs of the same (bf16-rounded) values."""
    b, t, h, dk, dv = 1, 20, 2, 16, 8
    case = _case_id(b, t, h, dk, dv, strength=1.0, h0=True) + "-bf16"
    x = _inputs(case, b, t, h, dk, dv, 1.0, True)
    fn = _recurrent if impl == "recurrent" else functools.partial(_chunked, chunk_size=16)
    o32, final32 = fn(*_args(x), initial_state=x["initial_state"])
    as_bf16 = [jnp.asarray(a, jnp.bfloat16) for a in (*_args(x), x["initial_state"])]
    o16, final16 = fn(*as_bf16[:5], initial_state=as_bf16[5])
    assert o16.dtype == jnp.float32 and final16.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(o16), np.asarray(o32))
    np.testing.assert_array_equal(np.asarray(final16), np.asarray(final32))
