"""Context parallelism: attention over a sequence split across the cp ranks, and the batch split."""

from plait.cp.apply import apply_context_parallel, check_context_parallel_model
from plait.cp.attention import ContextParallelAttention
from plait.cp.layout import (
    DOCUMENTS_KEY,
    chunk_ids,
    cp_mesh,
    document_ids,
    global_positions,
    shard_sequence,
    unshard_sequence,
)

__all__ = [
    "DOCUMENTS_KEY",
    "ContextParallelAttention",
    "apply_context_parallel",
    "check_context_parallel_model",
    "chunk_ids",
    "cp_mesh",
    "document_ids",
    "global_positions",
    "shard_sequence",
    "unshard_sequence",
]
