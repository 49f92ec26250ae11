"""The device mesh ``("fsdp", "context", "expert")`` and how every array is laid out on it.

Layout (the whole forward runs inside one explicit ``jax.shard_map``; see ``model/transformer.py``):

- Weights: each tensor is sharded over ``fsdp`` on one dim (``fsdp_dim``) and all-gathered per layer inside the scan
  (autodiff turns the gathers into reduce-scatters); routed-expert tensors ``wi [L, E, D, 2F]`` / ``wo [L, E, F, D]``
  are sharded over ``expert`` on ``E`` and over ``fsdp`` on their fp8 reduction axis (``D`` / ``F``), so the fp8 absmax
  of a whole expert weight is a max over the fsdp shards. Dims not divisible by the fsdp size stay replicated.
- Tokens ``[B, S]``: batch over ``("fsdp", "expert")``, sequence over ``context``.

Tests: ``python -m pytest tests/model/test_sharding.py -q``.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("fsdp", "context", "expert")
BATCH_AXES = ("fsdp", "expert")
EXPERT_TENSORS = ("wi", "wo")  # leaf names of the routed-expert weights [L, E, K, N] (inside a "moe" dict)


def make_mesh(flags, devices=None) -> Mesh:
    """Mesh of ``ici_fsdp_parallelism x ici_context_parallelism x ici_expert_parallelism`` devices."""
    shape = (flags.ici_fsdp_parallelism, flags.ici_context_parallelism, flags.ici_expert_parallelism)
    keys = ("ici_fsdp_parallelism", "ici_context_parallelism", "ici_expert_parallelism")
    for key, n in zip(keys, shape, strict=True):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{key}={n!r} must be an int >= 1")
    devices = jax.devices() if devices is None else list(devices)
    need = int(np.prod(shape))
    if need > len(devices):
        raise ValueError(
            f"ici_fsdp_parallelism={shape[0]} x ici_context_parallelism={shape[1]} x ici_expert_parallelism={shape[2]} "
            f"= {need} devices, but only {len(devices)} are available"
        )
    return Mesh(np.asarray(devices[:need]).reshape(shape), AXES)


def axis_sizes(mesh: Mesh) -> dict[str, int]:
    """``{"fsdp": n, "context": n, "expert": n}``."""
    missing = [a for a in AXES if a not in mesh.shape]
    if missing:
        raise ValueError(f"mesh.axis_names={mesh.axis_names} must contain {AXES}; missing {missing}")
    return {a: int(mesh.shape[a]) for a in AXES}


def is_expert_tensor(path: tuple[str, ...]) -> bool:
    return len(path) >= 2 and path[-2] == "moe" and path[-1] in EXPERT_TENSORS


def fsdp_dim(path: tuple[str, ...], shape: tuple[int, ...], fsdp: int, stacked: bool) -> int | None:
    """The dim of ``shape`` sharded over fsdp (None: replicated over fsdp).

    ``stacked``: dim 0 is the layer-stack dim (never sharded). Expert tensors: their reduction axis (dim 2 of
    ``[L, E, K, N]``). Others: the largest dim divisible by ``fsdp`` (first on ties).
    """
    if fsdp == 1:
        return None
    if is_expert_tensor(path):
        dim = 2
        return dim if shape[dim] % fsdp == 0 else None
    first = 1 if stacked else 0
    best = None
    for d in range(first, len(shape)):
        if shape[d] % fsdp == 0 and (best is None or shape[d] > shape[best]):
            best = d
    return best


def param_spec(path: tuple[str, ...], shape: tuple[int, ...], sizes: dict[str, int]) -> P:
    """PartitionSpec of parameter ``path`` (dict keys) with ``shape`` on a mesh with axis ``sizes``."""
    stacked = path[0] == "layers"
    spec: list = [None] * len(shape)
    d = fsdp_dim(path, shape, sizes["fsdp"], stacked)
    if d is not None:
        spec[d] = "fsdp"
    if is_expert_tensor(path):
        if shape[1] % sizes["expert"]:
            raise ValueError(f"{'/'.join(path)}: num_experts={shape[1]} must be divisible by expert={sizes['expert']}")
        spec[1] = "expert"
    return P(*spec)


def _paths(tree) -> list[tuple[tuple[str, ...], object]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(tuple(k.key for k in path), leaf) for path, leaf in flat]


def param_specs(params, mesh: Mesh):
    """Pytree of PartitionSpecs matching ``params`` (arrays or ShapeDtypeStructs)."""
    sizes = axis_sizes(mesh)
    treedef = jax.tree_util.tree_structure(params)
    specs = [param_spec(path, tuple(leaf.shape), sizes) for path, leaf in _paths(params)]
    return jax.tree_util.tree_unflatten(treedef, specs)


def shard_params(params, mesh: Mesh):
    """``params`` placed on ``mesh`` per ``param_specs`` (optional: the model reshards unplaced inputs itself)."""
    specs = param_specs(params, mesh)
    return jax.tree_util.tree_map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)


def gather_dim(spec: P) -> int | None:
    """The dim of a (per-layer, stack dim removed by the caller) spec that is sharded over fsdp."""
    for d, s in enumerate(spec):
        if s == "fsdp":
            return d
    return None
