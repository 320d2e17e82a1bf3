"""The dense reference model: a Llama-style decoder with Hugging Face Llama module names.

Names (``model.embed_tokens``, ``model.layers[i].self_attn.{q,k,v,o}_proj``,
``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``, ``model.norm``,
``model.rotary_emb``, ``lm_head``) let plait.tp's Llama plan and its built-in registry entry
for ``DenseDecoder`` apply unchanged. Attention keeps ``num_heads`` / ``num_key_value_heads`` /
``head_dim`` attributes and reshapes with ``-1`` heads, so TP-local shards just work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Attention",
    "DecoderConfig",
    "DecoderLayer",
    "DecoderModel",
    "DenseDecoder",
    "MLP",
    "RMSNorm",
    "RotaryEmbedding",
]


@dataclass(kw_only=True)
class DecoderConfig:
    """Architecture of the dense decoder (field names follow Hugging Face's LlamaConfig)."""

    vocab_size: int = 272
    """Embedding rows; the byte-level tokenizer uses 256 bytes + specials."""
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    """None = hidden_size // num_attention_heads."""
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    """Std of the normal init of matrices; output projections are scaled by 1/sqrt(2*layers)."""
    use_cache: bool = False
    """Kept for Hugging Face compatibility (activation checkpointing sets it False)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.arch.{name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads <= 0 or self.num_key_value_heads <= 0:
            raise ValueError(
                f"attention heads must be > 0, got num_attention_heads={self.num_attention_heads}, "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                    f"({self.num_attention_heads}), or set head_dim"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 (written with elementwise ops so DTensors work)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding; ``inv_freq`` is a non-persistent buffer rebuilt by ``reset_buffers``."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)
        if self.inv_freq.device.type != "meta":
            self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute ``inv_freq`` on its device, e.g. after ``to_empty``."""
        steps = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=self.inv_freq.device)
        with torch.no_grad():
            self.inv_freq.copy_(1.0 / (self.theta ** (steps / self.head_dim)))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape (batch, heads, seq, head_dim) by the (batch, seq, head_dim) angles."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Grouped-query causal self-attention; head counts are attributes TP may rewrite."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        assert config.head_dim is not None
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        batch, seq = hidden_states.shape[:2]
        shape = (batch, seq, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: attention then MLP, each with a residual."""

    def __init__(self, config: DecoderConfig, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp if mlp is not None else MLP(config.hidden_size, config.intermediate_size)

    def forward(
        self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings
        )
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DecoderModel(nn.Module):
    """The backbone: embeddings, layers, final norm, rotary embedding."""

    def __init__(self, config: DecoderConfig, layers: list[nn.Module] | None = None) -> None:
        super().__init__()
        assert config.head_dim is not None
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers or [DecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)

    def forward(
        self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        batch, seq = (input_ids if inputs_embeds is None else inputs_embeds).shape[:2]
        device = self.rotary_emb.inv_freq.device
        position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(batch, -1)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings)
        return self.norm(hidden_states)


class DenseDecoder(nn.Module):
    """Causal language model: ``forward(input_ids) -> logits`` of shape (batch, seq, vocab)."""

    _no_split_modules: ClassVar[list[str]] = ["DecoderLayer"]

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))
