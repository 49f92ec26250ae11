"""Config and flags: loading, parsing, and one refusal test per rule (the message names every key with its value).

Pure Python (no tracing): ``python -m pytest tests/model/test_config.py -q``.
"""

import dataclasses

import pytest

from nxgates.model.config import ModelConfig, load_config, tuning_flags
from nxgates.model.flags import CONTROL_KEYS, TUNING_FLAGS, ConfigError, Flags, format_setting, parse_flags
from nxgates.model.rules import (
    RULES,
    flags_alone,
    flags_for,
    tuned_flags,
    validate,
    violations,
    with_prerequisites,
)


@pytest.fixture(scope="module")
def tiny():
    return load_config("tiny")


@pytest.fixture(scope="module")
def cell():
    return load_config("cell")


# --- loading


def test_tiny_matches_issue(tiny):
    c = tiny
    assert (c.name, c.hidden_dim, c.num_layers, c.vocab_size, c.seq_len, c.batch_size) == ("tiny", 256, 4, 512, 512, 4)
    assert c.layer_kinds == ("gdn", "gdn", "gdn", "attention")
    assert (c.num_experts, c.top_k, c.moe_mlp_dim, c.shared_expert_mlp_dim) == (8, 2, 128, 128)
    assert (c.gdn_num_key_heads, c.gdn_num_value_heads) == (2, 4)
    assert (c.attn_num_q_heads, c.attn_num_kv_heads) == (4, 2)
    mesh = (c.control.ici_fsdp_parallelism, c.control.ici_context_parallelism, c.control.ici_expert_parallelism)
    assert mesh == (2, 2, 2)


def test_cell_matches_issue(cell):
    c = cell
    assert (c.hidden_dim, c.moe_mlp_dim, c.num_experts, c.top_k) == (4096, 1024, 512, 10)
    assert (c.gdn_num_key_heads, c.gdn_num_value_heads, c.gdn_key_dim, c.gdn_value_dim) == (16, 64, 128, 128)
    assert (c.attn_num_q_heads, c.attn_num_kv_heads, c.attn_head_dim) == (32, 2, 256)


@pytest.mark.parametrize("name", ["tiny", "cell", "smoke"])
def test_control_and_tuned_combination_validate(name):
    cfg = load_config(name)
    assert validate(cfg, cfg.control) is cfg.control
    tuned = tuned_flags(cfg)
    assert tuned.changed(cfg.control) == tuning_flags(cfg)
    # The tuned switch turns every boolean tuning flag on (and the hoist to gather8).
    bools = [k for k in TUNING_FLAGS if isinstance(getattr(Flags(), k), bool)]
    assert all(getattr(tuned, k) is True for k in bools), {k: getattr(tuned, k) for k in bools}
    assert tuned.fp8_fake_quant_hoist == "gather8"
    # The control has every tuning flag off.
    assert not any(getattr(cfg.control, k) for k in bools) and cfg.control.fp8_fake_quant_hoist == "none"


def test_unknown_config_lists_available():
    with pytest.raises(ConfigError, match=r"unknown config 'tinyy': available configs are \['cell', 'smoke', 'tiny'\]"):
        load_config("tinyy")


def _write(tmp_path, text, name="custom"):
    tiny_text = (load_config.__globals__["config_dir"]() / "tiny.toml").read_text()
    path = tmp_path / f"{name}.toml"
    path.write_text(text(tiny_text))
    return str(path)


def test_unknown_model_key_refused_by_name(tmp_path):
    path = _write(tmp_path, lambda t: t.replace("hidden_dim = 256", "hiden_dim = 256"))
    with pytest.raises(ConfigError, match=r"\[model\]: unknown key 'hiden_dim' \(value 256\); did you mean 'hidden_di"):
        load_config(path)


def test_unknown_flag_in_file_refused_by_name(tmp_path):
    path = _write(tmp_path, lambda t: t.replace("scan_layers = true", "scan_layer = true"))
    with pytest.raises(ConfigError, match=r"\[flags\]: unknown flag 'scan_layer'.*did you mean 'scan_layers'"):
        load_config(path)


def test_unknown_section_refused(tmp_path):
    path = _write(tmp_path, lambda t: t + "\n[extra]\nx = 1\n")
    with pytest.raises(ConfigError, match=r"unknown section \[extra\]"):
        load_config(path)


def test_tuned_control_key_refused(tmp_path):
    path = _write(tmp_path, lambda t: t + "fp8_moe_fake_quant = false\n")
    with pytest.raises(ConfigError, match=r"\[tuned\]: fp8_moe_fake_quant=False: fp8_moe_fake_quant is a control"):
        load_config(path)


def test_tuned_entry_equal_to_control_refused(tmp_path):
    path = _write(tmp_path, lambda t: t + "wo_tile_fwd_mlp_dim = 64\n")
    with pytest.raises(ConfigError, match=r"\[tuned\]: wo_tile_fwd_mlp_dim=64 equals the control"):
        load_config(path)


def test_invalid_tuned_combination_refused_at_load(tmp_path):
    bad = "wo_tile_dlhs_mlp_dim = 96 #"  # the tuned one n tile replaced by a tile that is not F
    path = _write(tmp_path, lambda t: t.replace("wo_tile_dlhs_mlp_dim = 128          #", bad))
    with pytest.raises(ConfigError, match=r"\[tuned\] \(the tuned combination\)") as e:
        load_config(path)
    assert "wo_tile_dlhs_mlp_dim=96" in str(e.value) and "moe_mlp_dim=128" in str(e.value)


def test_model_config_refuses_bad_dims():
    with pytest.raises(ConfigError, match=r"top_k=9 must be <= num_experts=8"):
        ModelConfig(top_k=9)
    with pytest.raises(ConfigError, match=r"num_layers=6 must be a multiple of len\(layer_pattern\)=4"):
        ModelConfig(num_layers=6)
    with pytest.raises(ConfigError, match=r"hidden_dim=0 must be a positive int"):
        ModelConfig(hidden_dim=0)
    with pytest.raises(ConfigError, match=r"'mamba' is not one of"):
        ModelConfig(layer_pattern=("gdn", "mamba"))


# --- parsing


def test_parse_flags_accepts_cli_strings():
    f = parse_flags({"scan_layers": "false", "moe_wi_gmm_fused_swiglu": "1", "gdn_cp_m_scan": "True",
                     "wi_tile_fwd_mlp_dim": "256", "remat_policy": "custom", "fp8_fake_quant_hoist": "gather8",
                     "gdn_cp_dh_scan": "0", "query_proj_kernel_gather_once": True, "ici_fsdp_parallelism": 4})
    assert (f.scan_layers, f.moe_wi_gmm_fused_swiglu, f.gdn_cp_m_scan, f.gdn_cp_dh_scan) == (False, True, True, False)
    assert (f.wi_tile_fwd_mlp_dim, f.remat_policy, f.fp8_fake_quant_hoist) == (256, "custom", "gather8")
    assert f.query_proj_kernel_gather_once is True and f.ici_fsdp_parallelism == 4
    base = Flags(wi_tile_fwd_batch_seq=64)
    assert parse_flags({"scan_layers": "false"}, base=base).wi_tile_fwd_batch_seq == 64


def test_unknown_flag_refused_with_suggestion():
    with pytest.raises(ConfigError, match=r"unknown flag 'moe_wi_gmm_fused_swiglo' \(value 'true'\); "
                                          r"did you mean 'moe_wi_gmm_fused_swiglu'"):
        parse_flags({"moe_wi_gmm_fused_swiglo": "true"})
    with pytest.raises(ConfigError, match=r"unknown flag 'zzz'.*valid keys: .*scan_layers"):
        parse_flags({"zzz": 1})


@pytest.mark.parametrize(
    "key,value,expected",
    [
        ("scan_layers", "yes", "expects bool"),
        ("scan_layers", 2, "expects bool"),
        ("wi_tile_fwd_mlp_dim", "12.5", "expects positive int"),
        ("wi_tile_fwd_mlp_dim", "0", "expects positive int"),
        ("wi_tile_fwd_mlp_dim", -128, "expects positive int"),
        ("wi_tile_fwd_mlp_dim", True, "expects positive int"),
        ("fp8_fake_quant_hoist", "GATHER8", "expects one of none|gather8"),
        ("remat_policy", "save_dot", "expects one of full|minimal|custom"),
    ],
    ids=lambda x: str(x),
)
def test_malformed_value_refused(key, value, expected):
    with pytest.raises(ConfigError) as e:
        parse_flags({key: value})
    msg = str(e.value)
    assert format_setting(key, value) in msg and expected in msg and repr(value) in msg, msg


def test_flags_constructor_refuses_malformed():
    with pytest.raises(ConfigError, match=r"wo_tile_fwd_batch_seq=0 is malformed"):
        Flags(wo_tile_fwd_batch_seq=0)


def test_flag_kinds_partition():
    assert set(TUNING_FLAGS) | set(CONTROL_KEYS) == {f.name for f in dataclasses.fields(Flags)}
    assert not set(TUNING_FLAGS) & set(CONTROL_KEYS)
    assert "fp8_moe_fake_quant" in CONTROL_KEYS and "fp8_fake_quant_hoist" in TUNING_FLAGS


# --- one refusal per rule, on tiny's control with the overrides: (rule, overrides, settings the message must name)

REFUSALS = [
    ("tile_divides_dim", {"wi_tile_fwd_embed_dim": 96}, ["wi_tile_fwd_embed_dim=96", "hidden_dim=256"]),
    ("tile_divides_dim", {"wi_tile_dlhs_mlp_dim": 96}, ["wi_tile_dlhs_mlp_dim=96", "moe_mlp_dim=128"]),
    ("tile_divides_dim", {"wo_tile_drhs_mlp_dim": 96}, ["wo_tile_drhs_mlp_dim=96", "moe_mlp_dim=128"]),
    ("tile_within_dim", {"wi_tile_fwd_mlp_dim": 1048576},
     ["wi_tile_fwd_mlp_dim=1048576 is larger than the dim it tiles", "moe_mlp_dim=128", "at most 256"]),
    ("tile_within_dim", {"wo_tile_fwd_embed_dim": 99999999999999999999999999},
     ["wo_tile_fwd_embed_dim=99999999999999999999999999", "hidden_dim=256"]),
    ("tile_within_dim", {"wi_tile_fwd_batch_seq": 2048},
     ["wi_tile_fwd_batch_seq=2048", "batch_size=4 x seq_len=512 x top_k=2", "= 1024, rounded up to 8: 1024"]),
    ("rhs_buffers_within_tiles", {"wi_tile_fwd_rhs_buffer_count": 1000},
     ["wi_tile_fwd_rhs_buffer_count=1000 is more than the 16 wi tiles", "num_experts=8", "at most 16"]),
    ("experts_divisible_by_expert_axis", {"ici_expert_parallelism": 3}, ["num_experts=8", "ici_expert_parallelism=3"]),
    ("batch_divisible_by_fsdp", {"ici_fsdp_parallelism": 3},
     ["batch_size=4", "ici_fsdp_parallelism=3", "ici_expert_parallelism=2"]),
    ("seq_divisible_by_context",
     {"ici_context_parallelism": 3, "context_parallel_attention_load_balance": False, "gdn_cp_mode": "none"},
     ["seq_len=512", "ici_context_parallelism=3"]),
    ("seq_divisible_by_context", {"ici_context_parallelism": 3, "gdn_cp_mode": "none"},
     ["context_parallel_attention_load_balance=True", "seq_len=512", "ici_context_parallelism=3"]),
    ("gdn_cp_whole_chunks", {"ici_context_parallelism": 16},
     ["gdn_cp_mode=seq", "seq_len=512", "ici_context_parallelism=16", "gdn_chunk_size=64"]),
    ("query_proj_device_needs_custom_remat", {"query_proj": "device", "remat_policy": "full"},
     ["query_proj=device", "remat_policy=full"]),
    ("fused_swiglu_tile", {"moe_wi_gmm_fused_swiglu": True, "wi_tile_fwd_mlp_dim": 1},
     ["moe_wi_gmm_fused_swiglu=True", "wi_tile_fwd_mlp_dim=1", "moe_mlp_dim=128"]),
    ("fused_dswiglu_one_n_tile", {"moe_wo_gmm_fused_dswiglu": True},
     ["moe_wo_gmm_fused_dswiglu=True", "wo_tile_dlhs_mlp_dim=64", "moe_mlp_dim=128"]),
    ("router_grad_needs_fused_dswiglu", {"moe_router_grad_from_wo_input": True},
     ["moe_router_grad_from_wo_input=True requires moe_wo_gmm_fused_dswiglu=True; got moe_wo_gmm_fused_dswiglu=False"]),
    ("gather8_needs_fp8_fake_quant", {"fp8_fake_quant_hoist": "gather8", "fp8_moe_fake_quant": False},
     ["fp8_fake_quant_hoist=gather8", "fp8_moe_fake_quant=False"]),
    ("gather8_needs_scan_layers", {"fp8_fake_quant_hoist": "gather8", "scan_layers": False},
     ["fp8_fake_quant_hoist=gather8", "scan_layers=False"]),
    ("tiles_fit_vmem", {"wi_tile_fwd_rhs_buffer_count": 2000},  # 2000 x a 32 KiB wi block: 62.5 MiB
     ["wi_tile_fwd_rhs_buffer_count=2000", "wi_tile_fwd_embed_dim=128", "wi_tile_fwd_mlp_dim=128", "MiB needed",
      "57.60 MiB available"]),
    ("gdn_cp_m_scan_needs_seq_mode", {"gdn_cp_m_scan": True, "gdn_cp_mode": "none"},
     ["gdn_cp_m_scan=True", "gdn_cp_mode=none"]),
    ("gdn_cp_m_scan_needs_context", {"gdn_cp_m_scan": True, "ici_context_parallelism": 1},
     ["gdn_cp_m_scan=True", "ici_context_parallelism=1"]),
    ("gdn_cp_dh_scan_needs_seq_mode", {"gdn_cp_dh_scan": True, "gdn_cp_mode": "none"},
     ["gdn_cp_dh_scan=True", "gdn_cp_mode=none"]),
    ("gdn_cp_dh_scan_needs_context", {"gdn_cp_dh_scan": True, "ici_context_parallelism": 1},
     ["gdn_cp_dh_scan=True", "ici_context_parallelism=1"]),
    ("hoist_ids_needs_load_balance",
     {"context_parallel_attention_load_balance_hoist_ids": True, "context_parallel_attention_load_balance": False},
     ["context_parallel_attention_load_balance_hoist_ids=True", "context_parallel_attention_load_balance=False"]),
    ("hoist_ids_needs_even_context",
     {"context_parallel_attention_load_balance_hoist_ids": True, "ici_context_parallelism": 1},
     ["context_parallel_attention_load_balance_hoist_ids=True", "ici_context_parallelism=1"]),
    ("hoist_ids_needs_even_context",  # odd context: seq 512 is not split into 2*3 chunks either (a second rule)
     {"context_parallel_attention_load_balance_hoist_ids": True, "ici_context_parallelism": 3},
     ["context_parallel_attention_load_balance_hoist_ids=True", "ici_context_parallelism=3"]),
    ("hoist_ids_needs_custom_remat",
     {"context_parallel_attention_load_balance_hoist_ids": True, "remat_policy": "full"},
     ["context_parallel_attention_load_balance_hoist_ids=True", "remat_policy=full"]),
    ("hoist_ids_needs_scan_layers",
     {"context_parallel_attention_load_balance_hoist_ids": True, "scan_layers": False},
     ["context_parallel_attention_load_balance_hoist_ids=True", "scan_layers=False"]),
    ("gather_once_needs_custom_remat", {"query_proj_kernel_gather_once": True, "remat_policy": "minimal"},
     ["query_proj_kernel_gather_once=True", "remat_policy=minimal"]),
    ("gather_once_needs_query_proj_remat", {"query_proj_kernel_gather_once": True, "query_proj": "device"},
     ["query_proj_kernel_gather_once=True", "query_proj=device"]),
]


@pytest.mark.parametrize("rule,overrides,named", REFUSALS, ids=[f"{r[0]}-{i}" for i, r in enumerate(REFUSALS)])
def test_refusal_names_every_key_and_value(tiny, rule, overrides, named):
    flags = parse_flags(overrides, base=tiny.control)
    with pytest.raises(ConfigError) as e:
        validate(tiny, flags)
    hits = [v for v in e.value.violations if v.rule == rule]
    assert hits, f"rule {rule} did not fire: {e.value}"
    msg = "\n".join(v.message for v in hits)
    for text in named:
        assert text in msg, f"{text!r} not in {msg!r}"
    for v in hits:  # every key the rule read is named with its value
        for key in v.keys:
            value = getattr(flags, key) if hasattr(flags, key) else getattr(tiny, key)
            assert format_setting(key, value) in v.message or f"{key}={value}" in v.message, (key, v.message)
    assert str(e.value).count(f"[{rule}]") == len(hits)  # listed in the raised message too


def test_every_rule_has_a_refusal_test():
    assert set(RULES) == {r[0] for r in REFUSALS}


def test_all_violated_rules_reported_at_once(tiny):
    flags = parse_flags({"moe_router_grad_from_wo_input": True, "scan_layers": False, "fp8_fake_quant_hoist": "gather8",
                         "ici_expert_parallelism": 3}, base=tiny.control)
    with pytest.raises(ConfigError) as e:
        flags_for(tiny, flags.changed(tiny.control))
    rules = {v.rule for v in e.value.violations}
    # expert=3 breaks two structural rules: 8 experts and a batch of 4 over fsdp x expert = 6 ranks.
    assert rules == {"router_grad_needs_fused_dswiglu", "gather8_needs_scan_layers",
                     "experts_divisible_by_expert_axis", "batch_divisible_by_fsdp"}, rules
    assert "(4 rule(s))" in str(e.value)


# --- flags alone and the prerequisite closure


def test_router_grad_alone_brings_its_tuning_prerequisites(tiny):
    assert with_prerequisites(tiny, {"moe_router_grad_from_wo_input": "true"}) == {
        "moe_router_grad_from_wo_input": True, "moe_wo_gmm_fused_dswiglu": True, "wo_tile_dlhs_mlp_dim": 128}


@pytest.mark.parametrize("name", ["tiny", "cell", "smoke"])
def test_every_tuned_flag_alone_validates_and_changes_only_what_it_needs(name):
    cfg = load_config(name)
    tuned = tuning_flags(cfg)
    for key, value in tuned.items():
        flags = flags_alone(cfg, key)
        changed = flags.changed(cfg.control)
        assert changed[key] == value
        assert all(tuned[k] == v for k, v in changed.items()), changed  # only tuned values of tuning flags
        for k in changed:  # minimal: without any one added prerequisite the combination is refused
            if k != key:
                rest = {kk: vv for kk, vv in changed.items() if kk != k}
                assert violations(cfg, parse_flags(rest, base=cfg.control)), (key, k)


def test_gather8_alone_needs_fp8_in_the_control(tiny):
    assert flags_alone(tiny, "fp8_fake_quant_hoist").changed(tiny.control) == {"fp8_fake_quant_hoist": "gather8"}
    no_fp8 = dataclasses.replace(tiny, control=dataclasses.replace(tiny.control, fp8_moe_fake_quant=False))
    with pytest.raises(ConfigError, match=r"(?s)fp8_fake_quant_hoist=gather8 cannot run.*fp8_moe_fake_quant=False"):
        flags_alone(no_fp8, "fp8_fake_quant_hoist")


def test_closure_never_changes_a_chosen_key(tiny):
    with pytest.raises(ConfigError, match=r"wo_tile_dlhs_mlp_dim=64"):
        with_prerequisites(tiny, {"moe_wo_gmm_fused_dswiglu": True, "wo_tile_dlhs_mlp_dim": 64})


def test_flags_alone_unknown_flag(tiny):
    with pytest.raises(ConfigError, match=r"'scan_layers' has no tuned value in config 'tiny'"):
        flags_alone(tiny, "scan_layers")


def test_vmem_refuses_the_trainers_measured_tile(cell):
    """The trainer's TPU v7x case: fused SwiGLU, k tile 4096, n 2048, tm 512, 3 wi buffers: 66.95 of 57.60 MiB."""
    overrides = {"moe_wi_gmm_fused_swiglu": True, "wi_tile_fwd_batch_seq": 512, "wi_tile_fwd_embed_dim": 4096,
                 "wi_tile_fwd_mlp_dim": 2048, "wi_tile_fwd_rhs_buffer_count": 3}
    with pytest.raises(ConfigError, match=r"66\.95 MiB needed, 57\.60 MiB available"):
        flags_for(cell, overrides)
    flags_for(cell, {**overrides, "wi_tile_fwd_rhs_buffer_count": 2})  # 50.95 MiB: fits
