"""The built-in TP plan for Llama-style decoders (HF Llama / Qwen2 / Qwen3 / Mistral naming), registered as ``llama``.

The only home of this plan: plait.models' reference decoders carry none and get it from the registry.
"""

from __future__ import annotations

import inspect

from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from plait.tp.discovery import find_decoder, output_head_fqn
from plait.tp.embedding import VocabParallelEmbedding
from plait.tp.registry import register_model_tp_plan, register_tp_plan
from plait.tp.replicate import ReplicatedWithGradAllReduce, ReplicateParallel
from plait.tp.sequence import (
    GatherSequenceInput,
    RotaryEmbeddingParallel,
    SequenceParallelAllGather,
    SequenceParallelBlock,
    SequenceParallelNorm,
)
from plait.tp.styles import loss_parallel_head

__all__ = ["llama_tp_plan"]


def llama_tp_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The TP plan for Llama-style decoders (HF Llama / Qwen2 / Qwen3 / Mistral naming).

    Attention and MLP projections column-/row-wise, a vocab-parallel input embedding, per-head
    ``q_norm``/``k_norm`` (Qwen3) replicated with summed gradients, and a loss-parallel head (logits stay
    a vocab-sharded ``DTensor``; compute the loss under ``loss_parallel()``). With ``sequence_parallel``
    the residual stream between blocks is a ``Shard(1)`` ``DTensor`` and the norms are sequence-parallel.

    Raises:
        ValueError: the model has no module with ``embed_tokens`` and a non-empty ``layers`` list.
    """
    decoder = find_decoder(model)
    if decoder is None or len(decoder[1].layers) == 0:
        raise ValueError(
            f"{type(model).__name__} has no Llama-style decoder (a module with `embed_tokens` and a non-empty "
            "`layers` ModuleList); pass an explicit tp_plan"
        )
    base_fqn, base = decoder
    prefix = f"{base_fqn}." if base_fqn else ""
    sp = sequence_parallel
    embedding = (
        VocabParallelEmbedding(output_layouts=Shard(1), use_local_output=False)
        if sp
        else VocabParallelEmbedding()
    )
    plan: dict[str, ParallelStyle] = {f"{prefix}embed_tokens": embedding}
    plan |= _layer_plan(base.layers[0], f"{prefix}layers.*.", sp)
    head = output_head_fqn(model)
    if isinstance(getattr(base, "norm", None), nn.Module):
        final = SequenceParallelNorm() if head else SequenceParallelAllGather()
        plan[f"{prefix}norm"] = final if sp else ReplicateParallel()
    if sp and _rotary_needs_style(base):
        plan[f"{prefix}rotary_emb"] = RotaryEmbeddingParallel()
    if head is not None:
        plan[head] = loss_parallel_head(sequence_parallel=sp)
    return plan


_MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _layer_plan(layer: nn.Module, layers: str, sp: bool) -> dict[str, ParallelStyle]:
    """The entries under ``layers`` (``"<prefix>layers.*."``) for the children ``layer`` has."""
    plan: dict[str, ParallelStyle] = {}
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    rowwise = (
        (lambda: RowwiseParallel(output_layouts=Shard(1), use_local_output=False)) if sp else RowwiseParallel
    )
    for norm in ("input_layernorm", "post_attention_layernorm"):
        if hasattr(layer, norm):
            plan[layers + norm] = SequenceParallelNorm() if sp else ReplicateParallel()
    if sp:  # one all-gather per block feeds all its column-wise projections
        for block in ("self_attn", "mlp"):
            if isinstance(getattr(layer, block, None), nn.Module):
                plan[layers + block] = GatherSequenceInput()
        if isinstance(mlp, nn.Module) and not any(hasattr(mlp, n) for n in _MLP_PROJECTIONS):
            # no Llama MLP projections (an MoE block: router, grouped experts): it runs whole, on
            # the gathered sequence
            plan[layers + "mlp"] = SequenceParallelBlock()
    for name in ("q_proj", "k_proj", "v_proj"):
        if hasattr(attn, name):
            plan[f"{layers}self_attn.{name}"] = ColwiseParallel()
    if hasattr(attn, "o_proj"):
        plan[f"{layers}self_attn.o_proj"] = rowwise()
    for name in ("q_norm", "k_norm"):
        if hasattr(attn, name):
            plan[f"{layers}self_attn.{name}"] = ReplicatedWithGradAllReduce()
    for name in _MLP_PROJECTIONS[:2]:
        if hasattr(mlp, name):
            plan[f"{layers}mlp.{name}"] = ColwiseParallel()
    if hasattr(mlp, "down_proj"):
        plan[f"{layers}mlp.down_proj"] = rowwise()
    return plan


def _rotary_needs_style(base: nn.Module) -> bool:
    """Whether the rotary module must see the whole sequence under SP.

    A ``forward(x, position_ids)`` (the Hugging Face contract) takes the positions explicitly and only
    reads dtype/device from ``x``: it needs no style. Any other rotary module may derive positions
    from the (sequence-sharded) hidden state and gets ``RotaryEmbeddingParallel``.
    """
    rotary = getattr(base, "rotary_emb", None)
    if not isinstance(rotary, nn.Module):
        return False
    return "position_ids" not in inspect.signature(rotary.forward).parameters


_LLAMA_STYLE_CLASSES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "plait.models.dense.DenseDecoder",
    "plait.models.vlm.VLM",
)
"""Model classes that get this plan: Hugging Face's by bare name, plait.models' reference decoders by
qualified name (by name, so plait.tp needs no plait.models install; subclasses are not covered)."""

register_tp_plan("llama", llama_tp_plan)
for _name in _LLAMA_STYLE_CLASSES:
    register_model_tp_plan(_name, llama_tp_plan)
