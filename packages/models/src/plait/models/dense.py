"""The dense reference model: a Llama-style causal LM with Hugging Face Llama module names.

Names (``model.embed_tokens``, ``model.layers[i].self_attn.{q,k,v,o}_proj``,
``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``, ``model.norm``,
``model.rotary_emb``, ``lm_head``) match ``transformers.LlamaForCausalLM``, so TP plans, FSDP unit
selection and activation checkpointing see the same structure. Attention splits heads with ``-1``
and reads the sequence length from the projections, so it runs on tensor-parallel shards (local
heads) and under sequence parallel (inputs gathered by the projections). The tensor-parallel plan
is not here: plait.tp owns the Llama-style plan and registers it for these classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from plait.models.attention import AttentionFn, sdpa_attention

__all__ = [
    "MLP",
    "Attention",
    "CausalLM",
    "DecoderConfig",
    "DecoderLayer",
    "DecoderModel",
    "DenseDecoder",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rotary",
]


@dataclass(kw_only=True)
class DecoderConfig:
    """Architecture of a dense decoder; field names follow ``transformers.LlamaConfig``.

    The defaults are the ``test`` preset: a 2-layer model that runs in milliseconds on a CPU.
    """

    vocab_size: int = 128
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    """Per-head size; None means hidden_size // num_attention_heads."""
    tie_word_embeddings: bool = False
    """Share one Parameter between ``model.embed_tokens.weight`` and ``lm_head.weight``."""
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    """Std a trainer's init uses for matrices (the constructors' own init is only a placeholder)."""
    use_cache: bool = True
    """Only recorded, as on Hugging Face configs (activation checkpointing turns it off); never caches."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_key_value_heads < 1:
            raise ValueError(f"num_key_value_heads must be >= 1, got {self.num_key_value_heads}")
        if self.num_hidden_layers < 0:
            raise ValueError(f"num_hidden_layers must be >= 0, got {self.num_hidden_layers}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                    f"({self.num_attention_heads}), or set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed in fp32 (elementwise ops, so DTensors work)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        h = hidden_states.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotary embeddings; ``forward(x, position_ids)`` as in HF Llama.

    ``inv_freq`` is a non-persistent buffer; :meth:`reset_buffers` recomputes it after a meta-device build.
    """

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.dim = head_dim  # not `head_dim`: that attribute marks attention modules (TP rewrites heads)
        self.theta = theta
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)
        if self.inv_freq.device.type != "meta":
            self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute ``inv_freq`` on its device, e.g. after ``to_empty``."""
        steps = torch.arange(0, self.dim, 2, dtype=torch.float32, device=self.inv_freq.device)
        with torch.no_grad():
            self.inv_freq.copy_(1.0 / (self.theta ** (steps / self.dim)))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each ``[batch, seq, head_dim]`` in ``x``'s dtype (``x`` only gives the dtype)."""
        freqs = position_ids[..., None].float() * self.inv_freq.float().to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [batch, heads, seq, head_dim]`` by the ``[batch, seq, head_dim]`` angles."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class Attention(nn.Module):
    """Causal grouped-query attention with rotary embeddings (HF names ``q_proj``..``o_proj``).

    The attention itself is ``self.attention_fn`` (see :mod:`plait.models.attention`), replaceable
    per instance; head counts are attributes a TP plan may rewrite.
    """

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
        self.attention_fn: AttentionFn = sdpa_attention

    def forward(
        self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        # Shapes come from the projections, not from hidden_states: under tensor parallel they hold
        # the local heads, under sequence parallel the gathered (full) sequence.
        q = self.q_proj(hidden_states).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        k = self.k_proj(hidden_states).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(hidden_states).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.attention_fn(q, k, v, is_causal=True, scale=None, enable_gqa=q.shape[1] != k.shape[1])
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: attention then ``mlp`` (SwiGLU unless given), each with a residual."""

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
    """The backbone (``LlamaModel``'s layout): embeddings, layers, final norm, rotary tables."""

    def __init__(self, config: DecoderConfig, layers: list[nn.Module] | None = None) -> None:
        super().__init__()
        assert config.head_dim is not None
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # Unit-variance logits when the table doubles as the output head (tied embeddings).
        nn.init.normal_(self.embed_tokens.weight, std=config.hidden_size**-0.5)
        if layers is None:
            layers = [DecoderLayer(config) for _ in range(config.num_hidden_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm; give exactly one of ``input_ids`` / ``inputs_embeds``.

        ``position_ids`` (``[batch or 1, seq]``, global positions) feed the rotary tables; they default
        to ``0..seq-1`` with ``seq`` read from ``input_ids`` when given (under sequence parallel the
        embeddings may hold only this rank's slice of the sequence).
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if position_ids is None:
            ref = input_ids if input_ids is not None else inputs_embeds
            position_ids = torch.arange(ref.shape[1], device=ref.device)[None, :]
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings)
        return self.norm(hidden_states)


class CausalLM(nn.Module):
    """A backbone ``model`` and the output head ``lm_head`` (sharing the input table when tied).

    ``forward(input_ids, position_ids=None) -> logits [batch, seq, vocab]``.
    """

    def __init__(self, config: DecoderConfig, model: DecoderModel) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(self.model(input_ids=input_ids, position_ids=position_ids))


class DenseDecoder(CausalLM):
    """The dense causal LM (``transformers.LlamaForCausalLM``'s layout)."""

    _no_split_modules: ClassVar[list[str]] = ["DecoderLayer"]

    def __init__(self, config: DecoderConfig | None = None) -> None:
        config = config if config is not None else DecoderConfig()
        super().__init__(config, DecoderModel(config))
