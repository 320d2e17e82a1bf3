"""DDP, Megatron-FSDP and MoE expert parallelism."""

__all__: list[str] = []
