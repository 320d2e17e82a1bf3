"""FSDP2 units, prefetch, embeddings, frozen multimodal towers and activation checkpointing."""

__all__: list[str] = []
