"""DDP, Megatron-FSDP and MoE expert parallelism."""

from plait.strategies.ddp import parallelize_ddp
from plait.strategies.experts import ExpertParallel, num_experts_of
from plait.strategies.megatron import parallelize_megatron_fsdp
from plait.strategies.moe import parallelize_moe, validate_moe_tp_plan

__all__ = [
    "ExpertParallel",
    "num_experts_of",
    "parallelize_ddp",
    "parallelize_megatron_fsdp",
    "parallelize_moe",
    "validate_moe_tp_plan",
]
