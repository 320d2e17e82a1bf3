"""Strategy configs by YAML name: ``fsdp2``, ``ddp``, ``megatron_fsdp`` (aliases ``megatron-fsdp``, ``mfsdp``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeAlias

from plait.mesh.configs import DDPConfig, FSDP2Config, MegatronFSDPConfig
from plait.mesh.normalize import normalize_strategy_name

__all__ = ["STRATEGY_CONFIGS", "StrategyConfig", "strategy_config_from_dict", "strategy_name"]

StrategyConfig: TypeAlias = FSDP2Config | DDPConfig | MegatronFSDPConfig
"""Any of the three strategy configs a :class:`~plait.mesh.MeshContext` may carry."""

STRATEGY_CONFIGS: dict[str, type[StrategyConfig]] = {
    "fsdp2": FSDP2Config,
    "ddp": DDPConfig,
    "megatron_fsdp": MegatronFSDPConfig,
}


def strategy_config_from_dict(
    spec: Mapping[str, Any] | str, options: Mapping[str, Any] | None = None
) -> StrategyConfig:
    """Build a strategy config from YAML: ``{"name": "fsdp2", **options}`` or ``("fsdp2", options)``.

    The name is case-insensitive (see :func:`~plait.mesh.normalize_strategy_name`); the options
    are read strictly by the config's ``from_dict``.

    Raises:
        TypeError: ``spec`` is neither a mapping nor a string, or an option has the wrong type.
        ValueError: no name, an unknown name, options given twice, or an unknown option key.
    """
    if isinstance(spec, Mapping):
        if options is not None:
            raise ValueError(
                "options were given both inside the strategy mapping and as the second argument; "
                "use one form: {'name': ..., **options} or (name, options)"
            )
        if "name" not in spec:
            raise ValueError(
                f"strategy mapping {dict(spec)!r} has no 'name' key; add name: fsdp2, ddp or megatron_fsdp"
            )
        options = {k: v for k, v in spec.items() if k != "name"}
        name = spec["name"]
    elif isinstance(spec, str):
        name = spec
    else:
        raise TypeError(
            f"strategy must be a mapping with a 'name' key or a strategy name, got {spec!r} ({type(spec).__name__})"
        )
    config_cls = STRATEGY_CONFIGS[normalize_strategy_name(name)]
    return config_cls.from_dict(options or {})


def strategy_name(config: object) -> str:
    """Return the YAML name of a strategy config.

    Raises:
        TypeError: ``config`` is not one of the three strategy configs.
    """
    for name, cls in STRATEGY_CONFIGS.items():
        if isinstance(config, cls):
            return name
    raise TypeError(
        f"unsupported strategy config {config!r} ({type(config).__name__}); use FSDP2Config, DDPConfig "
        f"or MegatronFSDPConfig"
    )
