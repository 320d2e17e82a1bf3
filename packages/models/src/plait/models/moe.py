"""The mixture-of-experts reference model: the dense decoder with a routed-experts MLP.

Each ``model.layers[i].mlp`` is a :class:`MoEBlock` with a ``router`` (``gate`` linear + top-k),
``experts`` (:class:`GroupedExperts`) and an optional ``shared_expert``. The experts follow
plait.strategies' experts contract: every parameter has the expert index as dim 0, and
``forward(tokens_grouped_by_expert, num_tokens_per_expert)`` works unchanged on a dim-0 shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from plait.models.dense import MLP, CausalLM, DecoderConfig, DecoderLayer, DecoderModel

__all__ = ["GroupedExperts", "MoEBlock", "MoEDecoder", "MoEDecoderConfig", "MoEDecoderLayer", "TopKRouter"]

_BLOCKED_LOGIT = -1.0e4


@dataclass(kw_only=True)
class MoEDecoderConfig(DecoderConfig):
    """Dense decoder fields plus the experts; the defaults are the ``test`` preset."""

    vocab_size: int = 96
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 16
    shared_expert_intermediate_size: int = 0
    """0 = no shared (always-on) expert."""
    norm_topk_prob: bool = True
    zero_token_experts: tuple[int, ...] = field(default_factory=tuple)
    """Experts the router never selects (their logit is pushed far down), so they receive zero tokens."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.zero_token_experts = tuple(self.zero_token_experts)
        if any(not 0 <= e < self.num_experts for e in self.zero_token_experts):
            raise ValueError(
                f"zero_token_experts {self.zero_token_experts} must be expert indices in [0, {self.num_experts})"
            )
        usable = self.num_experts - len(set(self.zero_token_experts))
        if not 0 < self.num_experts_per_tok <= usable:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, {usable}] (num_experts "
                f"{self.num_experts} minus {len(set(self.zero_token_experts))} blocked)"
            )


class TopKRouter(nn.Module):
    """Softmax router (in fp32): ``gate`` projection, then the top-k experts per token and their weights."""

    expert_bias: torch.Tensor

    def __init__(self, config: MoEDecoderConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.blocked = tuple(config.zero_token_experts)
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.register_buffer("expert_bias", torch.empty(config.num_experts), persistent=False)
        if self.expert_bias.device.type != "meta":
            self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute ``expert_bias`` (0, or a far-down logit for blocked experts), e.g. after ``to_empty``."""
        with torch.no_grad():
            self.expert_bias.zero_()
            self.expert_bias[list(self.blocked)] = _BLOCKED_LOGIT

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k], expert indices [T, k])`` for flat tokens ``x [T, H]``."""
        scores = F.softmax(self.gate(x).float() + self.expert_bias.float(), dim=-1)
        weights, indices = torch.topk(scores, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, indices


class GroupedExperts(nn.Module):
    """SwiGLU experts with stacked weights ``w1, w3 [E, H, I]`` and ``w2 [E, I, H]`` (dim 0 = expert).

    ``forward(tokens, num_tokens_per_expert)`` takes tokens grouped by expert (all tokens of expert 0,
    then expert 1, ...) and the per-expert counts; it works unchanged on a dim-0 shard of the experts.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden_size, intermediate_size) * hidden_size**-0.5)
        self.w3 = nn.Parameter(torch.randn(num_experts, hidden_size, intermediate_size) * hidden_size**-0.5)
        self.w2 = nn.Parameter(
            torch.randn(num_experts, intermediate_size, hidden_size) * intermediate_size**-0.5
        )

    def forward(self, tokens: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))
        counts = num_tokens_per_expert.tolist()
        assert len(counts) == w1.shape[0], (len(counts), w1.shape)
        outputs = [
            (F.silu(x @ w1[e]) * (x @ w3[e])) @ w2[e]
            for e, x in enumerate(torch.split(tokens, counts, dim=0))
        ]
        return torch.cat(outputs, dim=0) if outputs else tokens.new_zeros(0, w2.shape[-1])


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a DTensor parameter (experts compute on their own shard)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


class MoEBlock(nn.Module):
    """Route each token to its top-k experts, run them grouped by expert, and combine by weight."""

    def __init__(self, config: MoEDecoderConfig) -> None:
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


class MoEDecoderLayer(DecoderLayer):
    """The dense block with a :class:`MoEBlock` as its ``mlp``."""

    def __init__(self, config: MoEDecoderConfig) -> None:
        super().__init__(config, mlp=MoEBlock(config))


class MoEDecoder(CausalLM):
    """MoE causal LM: ``forward(input_ids, position_ids=None) -> logits [batch, seq, vocab]``.

    No ``_tp_plan``: under tensor parallel plait.tp's default Llama-style plan shards the attention
    and gathers the sequence before each ``mlp``; the experts stay whole (expert parallel shards them).
    """

    _no_split_modules: ClassVar[list[str]] = ["MoEDecoderLayer"]

    def __init__(self, config: MoEDecoderConfig | None = None) -> None:
        config = config if config is not None else MoEDecoderConfig()
        layers = [MoEDecoderLayer(config) for _ in range(config.num_hidden_layers)]
        super().__init__(config, DecoderModel(config, layers=layers))
