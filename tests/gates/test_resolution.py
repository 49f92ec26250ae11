"""gates.resolution: errors of a known size injected at the op a flag changes; the float32 lens resolves far smaller
ones than the bf16 gates (toy model); every rounding flag has a site; bad input exits 2.

Run: python -m pytest tests/gates/test_resolution.py -q
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nxgates.gates import cli, contracts
from nxgates.gates import record as record_lib
from nxgates.gates import resolution as R
from nxgates.gates import runner as runner_lib
from nxgates.gates.errors import BadInput
from nxgates.model import ops
from nxgates.model.flags import TUNING_FLAGS
from tests.gates import toy_model
from tests.gates.test_lens import BF16, LENS


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_perturb_has_exactly_the_relative_size_and_is_deterministic():
    a = jax.random.normal(jax.random.PRNGKey(0), (64, 32), jnp.float32)
    for eps, within in ((1e-6, 2e-3), (1e-3, 1e-5), (1e-1, 1e-6)):  # float32 rounds a + eps * a to ~6e-8 of a
        assert _rel(R.perturb(a, eps, 7), a) == pytest.approx(eps, rel=within)
    assert np.array_equal(R.perturb(a, 1e-3, 7), R.perturb(a, 1e-3, 7))
    assert not np.array_equal(R.perturb(a, 1e-3, 7), R.perturb(a, 1e-3, 8))
    assert R.seed_of("k", "y") == R.seed_of("k", "y") != R.seed_of("k", "dx")
    # bf16 rounds an error below its spacing away: what the bf16 gates cannot see is gone before they look
    assert _rel(R.perturb(a.astype(jnp.bfloat16), 1e-5, 7).astype(jnp.float32), a.astype(jnp.bfloat16)) < 1e-5


def _moe_case():
    k = jax.random.split(jax.random.PRNGKey(1), 4)
    x = jax.random.normal(k[0], (12, 8), jnp.float32)
    wi = jax.random.normal(k[1], (2, 8, 6), jnp.float32) * 0.3
    wo = jax.random.normal(k[2], (2, 3, 8), jnp.float32) * 0.3
    r = jax.random.uniform(k[3], (12,), jnp.float32)
    return x, wi, wo, jnp.array([5, 7], jnp.int32), r


def _grads(fn, x, wi, wo, gs, r):
    return jax.grad(lambda a, b, c, d: jnp.sum(fn(a, b, c, gs, d) ** 2), argnums=(0, 1, 2, 3))(x, wi, wo, r)


def test_backward_site_moves_only_its_cotangents_by_eps():
    real = ops.dispatch("moe_mlp", "reference", record=None)
    case = _moe_case()
    site = R.Site("moe_mlp", ("dx", "d_route"), "backward")
    wrapped = R.wrapper("moe_router_grad_from_wo_input", site, 1e-2)(real)
    assert np.array_equal(wrapped(*case), real(*case))  # the forward is untouched
    g0, g1 = _grads(real, *case), _grads(wrapped, *case)
    assert _rel(g1[0], g0[0]) == pytest.approx(1e-2, rel=1e-3)  # dx
    assert _rel(g1[3], g0[3]) == pytest.approx(1e-2, rel=1e-3)  # d_route
    assert np.array_equal(g1[1], g0[1]) and np.array_equal(g1[2], g0[2])  # dwi, dwo untouched


def test_forward_site_moves_the_value_by_eps_and_keeps_the_ops_gradient():
    real = ops.dispatch("moe_mlp", "reference", record=None)
    case = _moe_case()
    wrapped = R.wrapper("moe_wi_gmm_fused_swiglu", R.Site("moe_mlp", ("y",)), 1e-3)(real)
    assert _rel(wrapped(*case), real(*case)) == pytest.approx(1e-3, rel=1e-3)
    lin = jax.jvp(lambda a: wrapped(a, *case[1:]), (case[0],), (jnp.ones_like(case[0]),))[1]
    lin0 = jax.jvp(lambda a: real(a, *case[1:]), (case[0],), (jnp.ones_like(case[0]),))[1]
    assert np.array_equal(lin, lin0)


def test_fold_site_perturbs_both_composed_maps():
    from nxgates.kernels.gdn import context_parallel

    k = jax.random.split(jax.random.PRNGKey(2), 2)
    m = jax.random.normal(k[0], (4, 2, 3, 3)) * 0.3
    b = jax.random.normal(k[1], (4, 2, 3, 5))
    big_m, big_b = context_parallel.fold_tree(m, b)
    pm, pb = R.wrapper("gdn_cp_m_scan", R.SITES["gdn_cp_m_scan"], 1e-4)(context_parallel.fold_tree)(m, b)
    assert _rel(pm, big_m) == pytest.approx(1e-4, rel=1e-3) and _rel(pb, big_b) == pytest.approx(1e-4, rel=1e-3)


def test_every_rounding_flag_has_a_site_and_an_exact_one_is_refused():
    rounding = [k for k in TUNING_FLAGS if contracts.contract_of(k) == "rounding"]
    assert rounding
    for key in rounding:
        site = R.site_of(key)
        assert site.op in ops.OP_NAMES and site.side in ("forward", "backward")
    with pytest.raises(BadInput, match="fp8_fake_quant_hoist"):
        R.site_of("fp8_fake_quant_hoist")


def test_wrap_is_recorded_around_the_chosen_implementation():
    rec = {}
    with ops.wrap("moe_mlp", R.wrapper("k", R.Site("moe_mlp", ("y",)), 1e-3)):
        ops.dispatch("moe_mlp", "reference", record=rec)
    assert rec["moe_mlp"] == "wrap:eps_1em03_k(reference)"
    ops.dispatch("moe_mlp", "reference", record=rec)
    assert rec["moe_mlp"] == "reference"  # gone after the block


def test_toy_lens_resolves_errors_bf16_cannot(tmp_path):
    r = runner_lib.Runner("toy", api=toy_model.api(), cache=record_lib.RecordCache(str(tmp_path)),
                          tolerances=BF16, lens_tolerances=LENS, progress=lambda m: None)
    sites = {"moe_wi_gmm_fused_swiglu": R.Site("activation", ("y",))}
    grid = (1e-6, 1e-4, 1e-2, 1e-1)
    [res] = R.run_resolution("toy", flags={"moe_wi_gmm_fused_swiglu": True}, eps_grid=grid, runner=r, sites=sites)
    assert res.own_check_passed
    bf16, lens = res.smallest(lens=False), res.smallest(lens=True)
    assert lens is not None and bf16 is not None and lens < bf16, res.points
    assert lens <= 1e-4 and bf16 >= 1e-2
    assert not res.points[0].bf16_failed  # 1e-6: far below bf16's resolution
    # each lens stops one grid point past its first failure
    assert res.largest_run(lens=True) == grid[grid.index(lens) + 1]
    text = R.table([res])
    assert "activation forward (y)" in text and f"{lens:.0e}" in text
    data = R.to_json([res], "toy", grid)
    assert data["flags"][0]["smallest_eps_failing"] == {"bf16": bf16, "lens": lens}


def test_an_injection_that_never_reaches_the_trace_is_refused(tmp_path):
    r = runner_lib.Runner("toy", api=toy_model.api(), cache=record_lib.RecordCache(str(tmp_path)),
                          tolerances=BF16, lens_tolerances=LENS, progress=lambda m: None)
    sites = {"moe_wi_gmm_fused_swiglu": R.Site("no_such_op", ("y",))}
    with pytest.raises(RuntimeError, match="never reached"):
        R.run_resolution("toy", flags={"moe_wi_gmm_fused_swiglu": True}, eps_grid=(1e-2,), runner=r, sites=sites)


@pytest.mark.parametrize("argv, needle", [
    (["resolution", "--eps", "2"], "invalid eps value: '2'"),
    (["resolution", "--eps", "x"], "invalid eps value: 'x'"),
    (["resolution", "--config", "nope"], "nope"),
])
def test_bad_input_exits_2(argv, needle, capsys, tmp_path):
    assert cli.main([*argv, "--out", str(tmp_path), "--cache-dir", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
