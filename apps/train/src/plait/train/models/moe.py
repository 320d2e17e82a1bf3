"""The mixture-of-experts reference model: the dense decoder with a routed-experts MLP.

Each ``model.layers[i].mlp`` is a :class:`MoEBlock` with a ``router`` (``gate`` linear + top-k) and
``experts`` (:class:`GroupedExperts`) that follow plait.strategies' experts contract: every
parameter has the expert index as dim 0, and ``forward(tokens_grouped_by_expert,
num_tokens_per_expert)`` works unchanged on a dim-0 shard (expert parallel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from plait.train.models.dense import MLP, DecoderConfig, DecoderLayer, DecoderModel

__all__ = ["GroupedExperts", "MoEBlock", "MoEDecoder", "MoEModelConfig", "TopKRouter"]


@dataclass(kw_only=True)
class MoEModelConfig(DecoderConfig):
    """Dense decoder fields plus the experts."""

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    shared_expert_intermediate_size: int = 0
    """0 = no shared (always-on) expert."""
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, num_experts={self.num_experts}]"
            )


class TopKRouter(nn.Module):
    """Softmax router: ``gate`` projection, then the top-k experts per token and their weights."""

    def __init__(self, config: MoEModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k], expert indices [T, k])`` for flat tokens ``x [T, H]``."""
        scores = F.softmax(self.gate(x).float(), dim=-1)
        weights, indices = torch.topk(scores, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, indices


class GroupedExperts(nn.Module):
    """SwiGLU experts with stacked weights ``w1, w3 [E, H, I]`` and ``w2 [E, I, H]`` (dim 0 = expert)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))

    def forward(self, tokens: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))
        counts = num_tokens_per_expert.tolist()
        outputs = [
            (F.silu(x @ w1[e]) * (x @ w3[e])) @ w2[e]
            for e, x in enumerate(torch.split(tokens, counts, dim=0))
        ]
        return torch.cat(outputs, dim=0) if outputs else tokens.new_zeros(0, w2.shape[-1])


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


class MoEBlock(nn.Module):
    """Route each token to its top-k experts, run them grouped by expert, combine by weight."""

    def __init__(self, config: MoEModelConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.router = TopKRouter(config)
        self.experts = GroupedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_expert = (
            MLP(config.hidden_size, config.shared_expert_intermediate_size)
            if config.shared_expert_intermediate_size > 0
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, indices = self.router(flat)
        order = torch.argsort(indices.reshape(-1), stable=True)
        counts = torch.bincount(indices.reshape(-1), minlength=self.num_experts)
        token_of_slot = order // indices.shape[-1]
        routed = self.experts(flat[token_of_slot], counts)
        routed = routed * weights.reshape(-1)[order].unsqueeze(-1).to(routed.dtype)
        out = torch.zeros_like(flat).index_add(0, token_of_slot, routed.to(flat.dtype))
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        return out.reshape(shape)


class MoEDecoder(nn.Module):
    """MoE causal language model: ``forward(input_ids) -> logits`` (HF Llama-like naming)."""

    _no_split_modules: ClassVar[list[str]] = ["DecoderLayer"]

    def __init__(self, config: MoEModelConfig) -> None:
        super().__init__()
        self.config = config
        layers = [DecoderLayer(config, mlp=MoEBlock(config)) for _ in range(config.num_hidden_layers)]
        self.model = DecoderModel(config, layers=layers)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))
