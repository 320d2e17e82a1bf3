"""Context parallelism: attention over a sequence split across the cp ranks, and the batch split."""

from plait.cp.all_to_all import kv_repeats
from plait.cp.apply import (
    apply_context_parallel,
    check_context_parallel_model,
    check_cp_inputs,
    cp_attention_choice,
    cp_gathered_modules,
)
from plait.cp.attention import ContextParallelAttention
from plait.cp.choice import CPAttentionChoice, choose_cp_attention, heads_of
from plait.cp.layout import (
    DOCUMENTS_KEY,
    chunk_ids,
    cp_mesh,
    document_ids,
    global_positions,
    rank_order,
    shard_sequence,
    unshard_sequence,
)

__all__ = [
    "DOCUMENTS_KEY",
    "CPAttentionChoice",
    "ContextParallelAttention",
    "apply_context_parallel",
    "check_context_parallel_model",
    "check_cp_inputs",
    "choose_cp_attention",
    "chunk_ids",
    "cp_attention_choice",
    "cp_gathered_modules",
    "cp_mesh",
    "document_ids",
    "global_positions",
    "heads_of",
    "kv_repeats",
    "rank_order",
    "shard_sequence",
    "unshard_sequence",
]
