"""Mesh axis names, parallelism sizes, device meshes, MeshContext and strategy configs."""

from plait.mesh.axes import MeshAxisName, validate_axis_names
from plait.mesh.build import build_device_mesh, build_moe_mesh, default_device_type, plan_meshes
from plait.mesh.combinations import (
    COMBINATION_RULES,
    CombinationRequest,
    CombinationRule,
    check_combination,
    combination_request,
    context_request,
    refusal_of,
    table_pairs,
)
from plait.mesh.configs import (
    CP_ATTENTION_VARIANTS,
    CP_SEQUENCE_MIXERS,
    FLOAT8_SCALINGS,
    DDPConfig,
    Float8Config,
    FSDP2Config,
    MegatronFSDPConfig,
    MoEConfig,
    default_mp_policy,
)
from plait.mesh.consistency import (
    check_ranks_agree,
    describe_arguments,
    describe_config,
    describe_mesh_context,
    describe_module,
)
from plait.mesh.context import MeshContext
from plait.mesh.distributed import DistributedInfo, init_distributed
from plait.mesh.grad_norm import clip_grad_norm_, global_grad_norm
from plait.mesh.materialize import FullTensorSource, clean_fqn, init_value, materialize, param_seed
from plait.mesh.normalize import (
    ActivationCheckpointing,
    FrozenMultimodalSharding,
    normalize_ac_scope,
    normalize_activation_checkpointing,
    normalize_frozen_multimodal_sharding,
    normalize_strategy_name,
)
from plait.mesh.parsing import from_dict
from plait.mesh.sizes import ParallelismSizes
from plait.mesh.strategy import StrategyConfig, strategy_config_from_dict, strategy_name

__all__ = [
    "COMBINATION_RULES",
    "CombinationRequest",
    "CombinationRule",
    "check_combination",
    "combination_request",
    "context_request",
    "refusal_of",
    "table_pairs",
    "CP_ATTENTION_VARIANTS",
    "CP_SEQUENCE_MIXERS",
    "ActivationCheckpointing",
    "DDPConfig",
    "DistributedInfo",
    "FLOAT8_SCALINGS",
    "FSDP2Config",
    "Float8Config",
    "FrozenMultimodalSharding",
    "FullTensorSource",
    "MegatronFSDPConfig",
    "MeshAxisName",
    "MeshContext",
    "MoEConfig",
    "ParallelismSizes",
    "StrategyConfig",
    "build_device_mesh",
    "check_ranks_agree",
    "build_moe_mesh",
    "clean_fqn",
    "clip_grad_norm_",
    "default_device_type",
    "default_mp_policy",
    "describe_arguments",
    "describe_config",
    "describe_mesh_context",
    "describe_module",
    "from_dict",
    "global_grad_norm",
    "init_distributed",
    "init_value",
    "materialize",
    "normalize_ac_scope",
    "normalize_activation_checkpointing",
    "normalize_frozen_multimodal_sharding",
    "normalize_strategy_name",
    "param_seed",
    "plan_meshes",
    "strategy_config_from_dict",
    "strategy_name",
    "validate_axis_names",
]
