"""How plait's TP translation lays out a Hugging Face model's blocks, for the planner's counts.

The planner prices a Llama-style block by default: attention heads sharded, an MLP gathered in and
reduce-scattered out under SP. Some Hugging Face plans differ: DeepSeek-V3's names no attention
entry (attention runs replicated), and plans with tensor-parallel experts run the MLP block on the
gathered sequence. This reads which, from the plan plait itself would apply (``hf_tp_plan``), on a
model built on the meta device with only the layers that differ (the dense ones and one MoE layer).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from plait.tp import SequenceParallelBlock, hf_tp_plan

__all__ = ["hf_block_layout"]


def _few_layers(config: Any) -> Any:
    """A copy of ``config`` with its dense layers and one MoE layer (at least one layer)."""
    small = copy.deepcopy(config)
    dense = int(getattr(config, "first_k_dense_replace", 0) or 0)
    layers = min(int(config.num_hidden_layers), dense + 1)
    small.num_hidden_layers = layers
    for name in ("layer_types", "mlp_layer_types"):
        value = getattr(small, name, None)
        if isinstance(value, list):
            setattr(small, name, value[:layers])
    return small


def _build(model_class: type[nn.Module], config: Any) -> nn.Module:
    with torch.device("meta"):
        try:
            return model_class(_few_layers(config))
        except (ValueError, IndexError, KeyError, TypeError):  # a config whose lists need every layer
            return model_class(config)


def _module(model: nn.Module, key: str) -> nn.Module | None:
    try:
        return model.get_submodule(key.replace("*", "0"))
    except AttributeError:
        return None


def _in_attention(model: nn.Module, key: str) -> bool:
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        module = _module(model, ".".join(parts[:i]))
        if module is not None and "attention" in type(module).__name__.lower():
            return True
    return False


def hf_block_layout(model_class: type[nn.Module], config: Any) -> dict[str, bool]:
    """``tp_attention`` and ``sp_whole_mlp`` (see :class:`plait.planner.ModelShape`) of a Hugging Face model.

    A model with no Hugging Face plan gets plait's Llama-style plan: the defaults.
    """
    model = _build(model_class, config)
    with warnings.catch_warnings():  # patterns the few-layer copy lacks (dense MLPs of an all-MoE model)
        warnings.simplefilter("ignore", UserWarning)
        # A family refusing SP still says by its plan without SP how attention is split.
        try:
            plan = hf_tp_plan(model, sequence_parallel=True)
        except ValueError:
            plan = hf_tp_plan(model, sequence_parallel=False)
    if plan is None:
        return {"tp_attention": True, "sp_whole_mlp": False}
    sharding = (ColwiseParallel, RowwiseParallel)
    attention = any(isinstance(s, sharding) and _in_attention(model, k) for k, s in plan.items())
    whole_mlp = any(
        isinstance(s, SequenceParallelBlock) and not s.replicate_params and not _in_attention(model, k)
        for k, s in plan.items()
    )
    return {"tp_attention": attention, "sp_whole_mlp": whole_mlp}
