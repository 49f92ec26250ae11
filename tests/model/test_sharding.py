"""The mesh and the parameter layout (model/sharding.py).

Run: ``python -m pytest tests/model/test_sharding.py -q``.
"""

import dataclasses

import jax
import pytest
from jax.sharding import PartitionSpec as P

from nxgates.model import config, sharding, transformer
from nxgates.model import flags as flags_lib


def _flags(f, c, e):
    return flags_lib.parse_flags({"ici_fsdp_parallelism": f, "ici_context_parallelism": c, "ici_expert_parallelism": e})


@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 1, 1), (2, 1, 4)], ids=["2x2x2", "1x1x1", "2x1x4"])
def test_make_mesh_shape_and_axes(shape):
    mesh = sharding.make_mesh(_flags(*shape))
    assert mesh.axis_names == ("fsdp", "context", "expert")
    assert tuple(mesh.devices.shape) == shape
    assert sharding.axis_sizes(mesh) == dict(zip(("fsdp", "context", "expert"), shape, strict=True))


def test_make_mesh_refuses_too_many_devices():
    msg = "ici_fsdp_parallelism=4 x ici_context_parallelism=2 x ici_expert_parallelism=2"
    with pytest.raises(ValueError, match=msg):
        sharding.make_mesh(_flags(4, 2, 2))


def test_param_specs_of_tiny_on_2x2x2():
    cfg = config.load_config("tiny")
    shapes = transformer.param_shapes(cfg)
    structs = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s, "float32"), shapes,
                                     is_leaf=lambda x: isinstance(x, tuple))
    specs = sharding.param_specs(structs, sharding.make_mesh(_flags(2, 2, 2)))
    moe = specs["layers"]["layer_0"]["moe"]
    # experts over "expert", their fp8 reduction axis (wi: D, wo: F) over "fsdp"; the layer-stack dim never sharded
    assert moe["wi"] == P(None, "expert", "fsdp", None)
    assert moe["wo"] == P(None, "expert", "fsdp", None)
    assert specs["layers"]["layer_0"]["gdn"]["q_proj"] == P(None, "fsdp", None)  # [G, 256, 128]: the largest dim
    assert specs["layers"]["layer_3"]["attention"]["out_proj"] == P(None, "fsdp", None)
    assert specs["embed"]["embedding"] == P("fsdp", None)  # [512, 256]
    for path, spec in jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(x, P)):
        names = tuple(k.key for k in path)
        if names[0] == "layers":
            assert spec[0] is None, names
        assert "context" not in tuple(spec), names  # weights are replicated over the sequence axis


def test_param_spec_replicates_indivisible_dims():
    sizes = {"fsdp": 2, "context": 1, "expert": 1}
    assert sharding.param_spec(("layers", "layer_0", "gdn", "A_log"), (1, 3), sizes) == P(None, None)
    assert sharding.param_spec(("final_norm", "scale"), (6,), sizes) == P("fsdp")


def test_param_spec_refuses_experts_not_divisible():
    cfg = dataclasses.replace(config.load_config("tiny"), num_experts=6)
    with pytest.raises(ValueError, match="num_experts=6 must be divisible by expert=4"):
        sharding.param_spec(("layers", "layer_0", "moe", "wi"), (1, cfg.num_experts, 256, 256),
                            {"fsdp": 2, "context": 1, "expert": 4})
