"""Tiny seeded mixture-of-experts decoder with Hugging Face-like naming, for expert-parallel tests.

Layout: ``model.embed_tokens``, ``model.layers[i].{input_layernorm, self_attn.{q,k,v,o}_proj,
post_attention_layernorm, mlp}``, ``model.norm``, ``lm_head``. Each ``mlp`` is a :class:`MoEBlock` with a
``router`` (``gate`` linear + top-k), ``experts`` (:class:`GroupedExperts`, stacked weights whose dim 0
is the expert index) and an optional ``shared_expert``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from plait.testing.decoder import RMSNorm

__all__ = [
    "GroupedExperts",
    "MoEAttention",
    "MoEBlock",
    "MoEDecoder",
    "MoEDecoderConfig",
    "MoEDecoderLayer",
    "RMSNorm",
    "TopKRouter",
]

_BLOCKED_LOGIT = -1.0e4


@dataclass
class MoEDecoderConfig:
    """Sizes of the tiny MoE decoder; the defaults run in milliseconds on CPU."""

    vocab_size: int = 96
    hidden_size: int = 32
    moe_intermediate_size: int = 16
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    num_experts: int = 8
    num_experts_per_tok: int = 2
    shared_expert_intermediate_size: int = 0
    """0 = no shared expert."""
    norm_topk_prob: bool = True
    zero_token_experts: tuple[int, ...] = field(default_factory=tuple)
    """Experts the router never selects (their logit is pushed far down), so they receive zero tokens."""
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    use_cache: bool = False

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_experts_per_tok > self.num_experts - len(self.zero_token_experts):
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts that can receive "
                f"tokens ({self.num_experts} - {len(self.zero_token_experts)} blocked)"
            )


class MoEAttention(nn.Module):
    """Causal grouped-query attention; reshapes with ``-1`` heads so TP-local shards work."""

    def __init__(self, config: MoEDecoderConfig) -> None:
        super().__init__()
        assert config.head_dim is not None
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, config.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        groups = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class TopKRouter(nn.Module):
    """Softmax router: ``gate`` projection, then the top-k experts per token and their weights."""

    def __init__(self, config: MoEDecoderConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        bias = torch.zeros(config.num_experts)
        bias[list(config.zero_token_experts)] = _BLOCKED_LOGIT
        self.register_buffer("expert_bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(weights [T, k], expert indices [T, k])`` for flat tokens ``x [T, H]``."""
        scores = F.softmax(self.gate(x) + self.expert_bias, dim=-1)
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
        if not outputs:
            return tokens.new_zeros(0, w2.shape[-1])
        return torch.cat(outputs, dim=0)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a DTensor parameter (experts compute on their own shard)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP used as the shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEBlock(nn.Module):
    """Route each token to its top-k experts, run them grouped by expert, and combine by weight."""

    def __init__(self, config: MoEDecoderConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.router = TopKRouter(config)
        self.experts = GroupedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_expert = (
            SwiGLU(config.hidden_size, config.shared_expert_intermediate_size)
            if config.shared_expert_intermediate_size > 0
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, indices = self.router(flat)
        top_k = indices.shape[-1]
        order = torch.argsort(indices.reshape(-1), stable=True)
        counts = torch.bincount(indices.reshape(-1), minlength=self.num_experts)
        token_of_slot = order // top_k
        routed = self.experts(flat[token_of_slot], counts)
        routed = routed * weights.reshape(-1)[order].unsqueeze(-1).to(routed.dtype)
        out = torch.zeros_like(flat).index_add(0, token_of_slot, routed.to(flat.dtype))
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        return out.reshape(shape)


class MoEDecoderLayer(nn.Module):
    """Pre-norm attention + MoE block."""

    def __init__(self, config: MoEDecoderConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MoEAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoEBlock(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class _MoEBackbone(nn.Module):
    def __init__(self, config: MoEDecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MoEDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class MoEDecoder(nn.Module):
    """Tiny MoE causal LM: ``forward(input_ids) -> logits [B, S, vocab]``."""

    _no_split_modules: ClassVar[list[str]] = ["MoEDecoderLayer"]

    def __init__(self, config: MoEDecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _MoEBackbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))
