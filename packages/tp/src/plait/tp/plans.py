"""Built-in Llama-family TP plans and the registries of named plans and per-model-class plans."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
)

from plait.tp.styles import (
    GatherSequenceInput,
    ReplicatedWithGradAllReduce,
    ReplicateParallel,
    RotaryEmbeddingParallel,
    SequenceParallelAllGather,
    SequenceParallelNorm,
    VocabParallelEmbedding,
    loss_parallel_head,
)

__all__ = [
    "PlanFactory",
    "find_decoder",
    "llama_tp_plan",
    "model_embeddings",
    "module_fqn",
    "register_model_tp_plan",
    "register_tp_plan",
]

PlanFactory = Callable[[nn.Module, bool], dict[str, Any]]
"""``(model, sequence_parallel) -> {fqn_pattern: ParallelStyle | str}``; must build fresh styles per call."""

_LANGUAGE_PARTS = ("language_model", "text_model")


def _language_rank(fqn: str) -> int:
    return int(any(part in _LANGUAGE_PARTS for part in fqn.split(".")))


def find_decoder(model: nn.Module) -> tuple[str, nn.Module] | None:
    """Find the Llama-style decoder stack: a module with an ``embed_tokens`` embedding and ``layers``.

    Prefers a module on a ``language_model`` / ``text_model`` path, then the shallowest one.
    """
    found = [
        (fqn, module)
        for fqn, module in model.named_modules()
        if isinstance(getattr(module, "embed_tokens", None), nn.Embedding)
        and isinstance(getattr(module, "layers", None), nn.ModuleList)
    ]
    if not found:
        return None
    return max(found, key=lambda item: (_language_rank(item[0]), -item[0].count(".") - bool(item[0])))


def module_fqn(model: nn.Module, target: nn.Module | None) -> str | None:
    """The FQN of ``target`` inside ``model`` (``None`` when absent or when it is the root)."""
    if target is None:
        return None
    for fqn, module in model.named_modules():
        if module is target and fqn:
            return fqn
    return None


def model_embeddings(model: nn.Module, getter: str) -> nn.Module | None:
    """``model.get_input_embeddings()`` / ``get_output_embeddings()`` when the model has them."""
    method = getattr(model, getter, None)
    try:
        found = method() if callable(method) else None
    except (AttributeError, NotImplementedError):
        return None
    return found if isinstance(found, nn.Module) else None


def _output_head_fqn(model: nn.Module) -> str | None:
    head = model_embeddings(model, "get_output_embeddings") or getattr(model, "lm_head", None)
    return module_fqn(model, head if isinstance(head, nn.Linear) else None)


def llama_tp_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The TP plan for Llama-style decoders (HF Llama / Qwen2 / Qwen3 / Mistral naming, plait's DenseDecoder).

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
    layer = base.layers[0]
    sp = sequence_parallel

    def rowwise() -> RowwiseParallel:
        return RowwiseParallel(output_layouts=Shard(1), use_local_output=False) if sp else RowwiseParallel()

    plan: dict[str, ParallelStyle] = {
        f"{prefix}embed_tokens": (
            VocabParallelEmbedding(output_layouts=Shard(1), use_local_output=False)
            if sp
            else VocabParallelEmbedding()
        )
    }
    layers = f"{prefix}layers.*."
    attn = getattr(layer, "self_attn", None)
    mlp = getattr(layer, "mlp", None)
    for norm in ("input_layernorm", "post_attention_layernorm"):
        if hasattr(layer, norm):
            plan[layers + norm] = SequenceParallelNorm() if sp else ReplicateParallel()
    if sp:  # one all-gather per block feeds all its column-wise projections
        for block in ("self_attn", "mlp"):
            if isinstance(getattr(layer, block, None), nn.Module):
                plan[layers + block] = GatherSequenceInput()
    for name in ("q_proj", "k_proj", "v_proj"):
        if hasattr(attn, name):
            plan[f"{layers}self_attn.{name}"] = ColwiseParallel()
    if hasattr(attn, "o_proj"):
        plan[f"{layers}self_attn.o_proj"] = rowwise()
    for name in ("q_norm", "k_norm"):
        if hasattr(attn, name):
            plan[f"{layers}self_attn.{name}"] = ReplicatedWithGradAllReduce()
    for name in ("gate_proj", "up_proj"):
        if hasattr(mlp, name):
            plan[f"{layers}mlp.{name}"] = ColwiseParallel()
    if hasattr(mlp, "down_proj"):
        plan[f"{layers}mlp.down_proj"] = rowwise()
    head = _output_head_fqn(model)
    if isinstance(getattr(base, "norm", None), nn.Module):
        final = SequenceParallelNorm() if head else SequenceParallelAllGather()
        plan[f"{prefix}norm"] = final if sp else ReplicateParallel()
    if sp and _rotary_needs_style(base):
        plan[f"{prefix}rotary_emb"] = RotaryEmbeddingParallel()
    if head is not None:
        plan[head] = loss_parallel_head(sequence_parallel=sp)
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


_NAMED_PLANS: dict[str, PlanFactory] = {}
_MODEL_PLANS: dict[str, PlanFactory] = {}


def register_tp_plan(name: str, factory: PlanFactory) -> None:
    """Register a named plan, usable as ``tp_plan: <name>``; re-registering a name replaces it.

    Raises:
        ValueError: empty name or a name with ``:`` (reserved for import paths).
        TypeError: ``factory`` is not callable.
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"TP plan name must be a non-empty string without ':', got {name!r}")
    if not callable(factory):
        raise TypeError(
            f"TP plan factory for {name!r} must be callable (model, sequence_parallel), got {factory!r}"
        )
    _NAMED_PLANS[name] = factory


def register_model_tp_plan(class_name: str | type, factory: PlanFactory) -> None:
    """Register the plan for a model class, by qualified (``pkg.mod.Cls``) or bare (``Cls``) name.

    Raises:
        ValueError: empty class name.
        TypeError: ``factory`` is not callable.
    """
    key = f"{class_name.__module__}.{class_name.__qualname__}" if isinstance(class_name, type) else class_name
    if not isinstance(key, str) or not key:
        raise ValueError(f"model class name must be a non-empty string or a class, got {class_name!r}")
    if not callable(factory):
        raise TypeError(
            f"TP plan factory for {key!r} must be callable (model, sequence_parallel), got {factory!r}"
        )
    _MODEL_PLANS[key] = factory


def _named_plan(name: str) -> PlanFactory | None:
    return _NAMED_PLANS.get(name)


def _model_class_plan(model: nn.Module) -> PlanFactory | None:
    cls = type(model)
    return _MODEL_PLANS.get(f"{cls.__module__}.{cls.__qualname__}") or _MODEL_PLANS.get(cls.__name__)


register_tp_plan("llama", llama_tp_plan)
for _name in (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
):
    register_model_tp_plan(_name, llama_tp_plan)
