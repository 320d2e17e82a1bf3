"""The strategies' last steps (DDP, Megatron-FSDP) and the expert-parallel steps of the flow."""

from plait.strategies._moe_blocks import MoEBlockInfo, find_moe_blocks
from plait.strategies.ddp import wrap_ddp
from plait.strategies.experts import ExpertParallel, experts_convention, num_experts_of
from plait.strategies.megatron import check_megatron_fsdp, shard_megatron_fsdp
from plait.strategies.moe import (
    apply_expert_parallel,
    check_expert_parallel,
    moe_head,
    moe_reshard_after_forward,
    replays_ops_in_layers,
    routers_to_save,
    shard_experts,
    shard_moe_lm_head,
    shard_top_children,
    validate_moe_tp_plan,
    wraps_root,
)

__all__ = [
    "MoEBlockInfo",
    "find_moe_blocks",
    "ExpertParallel",
    "apply_expert_parallel",
    "check_expert_parallel",
    "experts_convention",
    "moe_reshard_after_forward",
    "moe_head",
    "num_experts_of",
    "wrap_ddp",
    "check_megatron_fsdp",
    "shard_megatron_fsdp",
    "replays_ops_in_layers",
    "routers_to_save",
    "shard_experts",
    "shard_moe_lm_head",
    "shard_top_children",
    "validate_moe_tp_plan",
    "wraps_root",
]
