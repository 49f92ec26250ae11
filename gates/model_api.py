"""The adapter between the gates and a model: ``ModelAPI`` (the functions the runner calls) and the real model's.

The gates never import the model directly: the runner, the calibration and the mutants reach it through a ``ModelAPI``
(``default_model_api()`` wires ``nxgates.model``; tests/gates/toy_model.py wires a toy one), so the gates' machinery is
tested on its own and another model with the same interface can be checked by the same gates.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

# Source folders whose code determines a run record of the real model (a change invalidates the record cache).
SOURCE_DIRS = ("reference", "kernels", "model")


@dataclasses.dataclass(frozen=True)
class ModelAPI:
    """The model functions the runner needs (the real ones: ``model.config``, ``model.flags``, ``model.rules``,
    ``model.transformer``, ``model.sharding``, ``model.ops``)."""

    load_config: Callable[[str], Any]
    parse_flags: Callable[..., Any]  # (overrides: dict, base: Flags | None) -> Flags
    validate: Callable[[Any, Any], None]
    init_params: Callable[[Any, int], Any]
    build_log_probs: Callable[..., Callable]
    make_mesh: Callable[[Any], Any]
    implementations: Callable[[Callable], dict]  # built fn -> {op: implementation} its last trace dispatched
    base_flags: Callable[[Any], Any]  # cfg -> the config's control Flags ([flags])
    tuned: Callable[[Any], Mapping[str, Any]]  # cfg -> the config's [tuned] values
    dims: Callable[[Any], tuple[int, int, int]]  # cfg -> (batch, seq_len, vocab)
    as_dict: Callable[[Any], dict]  # a config or Flags -> JSON-able dict
    config_error: type[Exception]
    config_files: Callable[[str], list[pathlib.Path]]  # the files defining a config (hashed into cache keys)
    with_prerequisites: Callable[[Any, Mapping[str, Any]], dict] | None = None  # (cfg, overrides) -> + prerequisites
    place_params: Callable[[Any, Any], Any] | None = None  # (params, mesh) -> params placed on the mesh
    override: Callable[[str, Callable], Any] | None = None  # model.ops.override (the mutants inject through it)
    wrap: Callable[[str, Callable], Any] | None = None  # model.ops.wrap (gates.resolution injects through it)
    source_dirs: tuple[str, ...] = SOURCE_DIRS


def jsonable(v):
    """A config / flags value as JSON-able data (dataclasses as dicts, tuples as lists, anything else as str)."""
    if dataclasses.is_dataclass(v):
        return {f.name: jsonable(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    return str(v)


def default_model_api() -> ModelAPI:
    """The real model package (imports jax)."""
    from nxgates.model import config as mconfig
    from nxgates.model import flags as mflags
    from nxgates.model import ops as mops
    from nxgates.model import rules as mrules
    from nxgates.model import sharding as msharding
    from nxgates.model import transformer as mtransformer

    def as_dict(obj):
        if dataclasses.is_dataclass(obj):
            return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return dict(obj)

    return ModelAPI(
        load_config=mconfig.load_config,
        parse_flags=mflags.parse_flags,
        validate=mrules.validate,
        init_params=mtransformer.init_params,
        build_log_probs=mtransformer.build_log_probs,
        make_mesh=msharding.make_mesh,
        implementations=lambda fn: fn.implementations(),
        base_flags=lambda cfg: cfg.control,
        tuned=mconfig.tuning_flags,
        dims=lambda cfg: (int(cfg.batch_size), int(cfg.seq_len), int(cfg.vocab_size)),
        as_dict=as_dict,
        config_error=mflags.ConfigError,
        config_files=lambda name: [pathlib.Path(name) if name.endswith(".toml")
                                   else mconfig.config_dir() / f"{name}.toml"],
        with_prerequisites=mrules.with_prerequisites,
        place_params=msharding.shard_params,
        override=mops.override,
        wrap=mops.wrap,
    )
