"""Flag contracts and how the default checks are built (no model run: these are pure functions of the config).

Run: python -m pytest tests/gates/test_contracts.py -q
"""

from __future__ import annotations

import dataclasses
import importlib
import json

import pytest

from nxgates.gates import cli
from nxgates.gates import contracts as C
from nxgates.model import rules as rules_lib
from nxgates.model.config import available_configs, load_config, tuning_flags
from nxgates.model.flags import TUNING, FlagDeclarationError, parse_flags, tuning
from nxgates.model.rules import validate, with_prerequisites


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


BASE = {k: False for k in C.FLAGS} | {"fp8_fake_quant_hoist": "none", "wo_tile_dlhs_mlp_dim": 64,
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
    assert list(checks)[:len(C.FLAGS)] == list(C.FLAGS)
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
               for k, v in {k: C.FLAGS[k].on for k in C.FLAGS}.items())


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
    cfg = load_config("tiny")
    base = dataclasses.asdict(cfg.control)
    checks = {c.name: c for c in C.default_checks(base, tuning_flags(cfg), lambda o: with_prerequisites(cfg, o))}
    assert set(C.FLAGS) <= set(checks) and list(checks)[-1] == "tuned"
    router = checks["moe_router_grad_from_wo_input"].candidate_overrides
    assert router["moe_wo_gmm_fused_dswiglu"] is True and router["wo_tile_dlhs_mlp_dim"] == cfg.moe_mlp_dim
    for c in checks.values():  # every candidate is a valid combination
        validate(cfg, parse_flags(c.candidate_overrides, base=cfg.control))


@pytest.mark.parametrize("name", available_configs())
def test_every_tuned_key_reaches_a_check_and_list_flags(name, capsys):
    """A flag in a config's [tuned] that no check covered (or list-flags omitted) would pass the gates unchecked."""
    cfg = load_config(name)
    base = dataclasses.asdict(cfg.control)
    tuned = tuning_flags(cfg)
    assert tuned, f"config {name!r} tunes nothing"
    checks = C.default_checks(base, tuned, lambda o: with_prerequisites(cfg, o))
    alone = {k for c in checks if c.name != "tuned" for k in c.keys}
    combo = next(c for c in checks if c.name == "tuned").candidate_overrides
    assert cli.main(["list-flags", "--config", name, "--json"]) == 0
    listed = {r["flag"]: r for r in json.loads(capsys.readouterr().out)}
    for key, value in tuned.items():
        assert key in alone, f"{name}: [tuned] {key} is checked by no check of its own"
        assert combo[key] == value, f"{name}: [tuned] {key} is missing from the tuned combination"
        assert listed[key]["tuned"] == value and listed[key]["contract"] == C.contract_of(key), listed.get(key)


def test_a_tuning_flag_without_a_contract_is_refused_at_import(tmp_path, monkeypatch):
    """Declaring a tuning flag without its contract fails the import of the module that declares it."""
    (tmp_path / "flags_without_contract.py").write_text(
        "import dataclasses\n"
        "from nxgates.model.flags import tuning\n"
        "@dataclasses.dataclass(frozen=True)\n"
        "class MyFlags:\n"
        "    my_new_fusion: bool = tuning(False, doc='a fused kernel', op='moe_mlp', on=True)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(FlagDeclarationError, match=r"contract=None must be one of \('exact', 'rounding'\)"):
        importlib.import_module("flags_without_contract")
    with pytest.raises(FlagDeclarationError, match=r"op='nowhere'"):
        tuning(False, contract="exact", doc="x", op="nowhere")
    with pytest.raises(FlagDeclarationError, match=r"contract='bitwise'"):
        tuning(False, contract="bitwise", doc="x", op="moe_mlp")


def test_declared_rules_and_the_rules_agree():
    """A flag naming a rule that does not exist, or a rule triggered by a flag that does not name it, is refused."""
    rules_lib.check_declarations()  # the real tables agree
    bad_flag = {"gdn_cp_m_scan": dataclasses.replace(TUNING["gdn_cp_m_scan"], rules=("no_such_rule",))}
    with pytest.raises(TypeError, match=r"'gdn_cp_m_scan' declares rules \['no_such_rule'\]"):
        rules_lib.check_declarations(bad_flag, {})
    forgotten = {**TUNING, "gdn_cp_m_scan": dataclasses.replace(TUNING["gdn_cp_m_scan"], rules=())}
    with pytest.raises(TypeError, match=r"rule 'gdn_cp_m_scan_needs_seq_mode' is triggered by tuning flag "
                                        r"'gdn_cp_m_scan' but its declaration"):
        rules_lib.check_declarations(forgotten)
