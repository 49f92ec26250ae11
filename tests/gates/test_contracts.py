"""Flag contracts and how the default checks are built (no model run: these are pure functions of the config).

Run: python -m pytest tests/gates/test_contracts.py -q
"""

from __future__ import annotations

import pytest

from nxgates.gates import contracts as C


@pytest.mark.parametrize(
    "key, contract",
    [
        ("moe_wi_gmm_fused_swiglu", "rounding"),
        ("moe_wo_gmm_fused_dswiglu", "rounding"),
        ("moe_router_grad_from_wo_input", "rounding"),
        ("fp8_fake_quant_hoist", "exact"),
        ("gdn_cp_m_scan", "rounding"),
        ("gdn_cp_dh_scan", "rounding"),
        ("context_parallel_attention_load_balance_hoist_ids", "exact"),
        ("query_proj_kernel_gather_once", "exact"),
        ("wi_tile_fwd_embed_dim", "rounding"),  # k of x[m, D] @ wi[D, 2F]
        ("wi_tile_fwd_mlp_dim", "exact"),  # n
        ("wi_tile_fwd_batch_seq", "exact"),  # m
        ("wi_tile_fwd_rhs_buffer_count", "exact"),
        ("wo_tile_fwd_mlp_dim", "rounding"),  # k of h[m, F] @ wo[F, D]
        ("wo_tile_dlhs_embed_dim", "rounding"),  # k of dy[m, D] @ wo^T
        ("wo_tile_dlhs_mlp_dim", "exact"),  # the fused dSwiGLU's one n tile
        ("wi_tile_drhs_batch_seq", "rounding"),  # tgmm reduces over the rows
    ],
)
def test_contract_of(key, contract):
    assert C.contract_of(key) == contract


def test_unknown_key_is_not_a_tuning_flag():
    with pytest.raises(KeyError):
        C.contract_of("scan_layers")
    assert not C.is_tuning_key("remat_policy") and C.is_tuning_key("wo_tile_drhs_mlp_dim")


BASE = {k: False for k in C.REGISTRY} | {"fp8_fake_quant_hoist": "none", "wo_tile_dlhs_mlp_dim": 64,
                                         "wi_tile_fwd_embed_dim": 128, "wi_tile_fwd_batch_seq": 128,
                                         "scan_layers": True}
TUNED = {"moe_wo_gmm_fused_dswiglu": True, "moe_router_grad_from_wo_input": True, "fp8_fake_quant_hoist": "gather8",
         "wo_tile_dlhs_mlp_dim": 128, "wi_tile_fwd_embed_dim": 256, "wi_tile_fwd_batch_seq": 256}


def closure(overrides):
    """A stand-in for model.config.with_prerequisites: the router needs the fused dSwiGLU and its one n tile."""
    out = dict(overrides)
    if out.get("moe_router_grad_from_wo_input"):
        out.setdefault("moe_wo_gmm_fused_dswiglu", True)
    if out.get("moe_wo_gmm_fused_dswiglu"):
        out.setdefault("wo_tile_dlhs_mlp_dim", 128)
    return out


def test_default_checks_every_flag_alone_then_tuned():
    checks = {c.name: c for c in C.default_checks(BASE, TUNED, closure)}
    assert list(checks)[:len(C.REGISTRY)] == list(C.REGISTRY)
    router = checks["moe_router_grad_from_wo_input"]
    assert router.candidate_overrides == {"moe_router_grad_from_wo_input": True, "moe_wo_gmm_fused_dswiglu": True,
                                          "wo_tile_dlhs_mlp_dim": 128}
    assert router.contract == "rounding" and router.keys == ("moe_router_grad_from_wo_input",)
    assert checks["fp8_fake_quant_hoist"].contract == "exact"
    assert checks["fp8_fake_quant_hoist"].candidate_overrides == {"fp8_fake_quant_hoist": "gather8"}
    # an untuned registered flag is checked at its on value
    assert checks["gdn_cp_m_scan"].candidate_overrides == {"gdn_cp_m_scan": True}
    # each tuned tile alone, with its own contract
    assert checks["wi_tile_fwd_batch_seq=256"].contract == "exact"
    assert checks["wi_tile_fwd_embed_dim=256"].contract == "rounding"
    assert checks["wo_tile_dlhs_mlp_dim=128"].contract == "exact"
    tuned = checks["tuned"]
    assert tuned.contract == "rounding" and list(checks)[-1] == "tuned"
    assert tuned.candidate_overrides["wi_tile_fwd_embed_dim"] == 256
    assert all(tuned.candidate_overrides[k] == (v if k not in TUNED else TUNED[k])
               for k, v in {k: C.REGISTRY[k].on_value for k in C.REGISTRY}.items())


def test_grouped_tiles_and_skipped_unchanged_keys():
    names = [c.name for c in C.default_checks(BASE, TUNED, closure, tiles="grouped")]
    assert "gmm tiles (exact)" in names and "gmm tiles (rounding)" in names
    assert not any(n.startswith("wi_tile") for n in names)
    # a registered flag the model does not have is skipped; a flag already on in the control is not checked
    base = {k: v for k, v in BASE.items() if k != "gdn_cp_dh_scan"} | {"query_proj_kernel_gather_once": True}
    names = [c.name for c in C.default_checks(base, {}, None)]
    assert "gdn_cp_dh_scan" not in names and "query_proj_kernel_gather_once" not in names
    with pytest.raises(ValueError, match="tiles='some'"):
        C.default_checks(BASE, TUNED, closure, tiles="some")


def test_build_check_refuses_a_non_tuning_key():
    with pytest.raises(ValueError, match="scan_layers=False is not a tuning flag"):
        C.build_check("x", {"scan_layers": False}, BASE)


def test_real_tiny_config_checks():
    """The checks the default gates run builds on the real tiny config (model.config; no model is run)."""
    mconfig = pytest.importorskip("nxgates.model.config")
    import dataclasses

    cfg = mconfig.load_config("tiny")
    base = dataclasses.asdict(cfg.control)
    checks = {c.name: c for c in C.default_checks(base, mconfig.tuning_flags(cfg),
                                                  lambda o: mconfig.with_prerequisites(cfg, o))}
    assert set(C.REGISTRY) <= set(checks) and list(checks)[-1] == "tuned"
    router = checks["moe_router_grad_from_wo_input"].candidate_overrides
    assert router["moe_wo_gmm_fused_dswiglu"] is True and router["wo_tile_dlhs_mlp_dim"] == cfg.moe_mlp_dim
    for c in checks.values():  # every candidate is a valid combination
        mconfig.validate(cfg, mconfig.parse_flags(c.candidate_overrides, base=cfg.control))
