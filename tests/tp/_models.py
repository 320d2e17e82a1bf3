"""Small test-only models for plan resolution and validation (no forward needed unless stated)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import transformers
from torch import nn

from plait.testing import tp_hf_config


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, qk_norm: bool = False) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.num_heads = heads
        self.num_key_value_heads = kv_heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)
        if qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim)
            self.k_norm = nn.RMSNorm(self.head_dim)


class _MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, 2 * hidden, bias=False)
        self.up_proj = nn.Linear(hidden, 2 * hidden, bias=False)
        self.down_proj = nn.Linear(2 * hidden, hidden, bias=False)


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, qk_norm: bool) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(hidden)
        self.self_attn = _Attention(hidden, heads, kv_heads, qk_norm)
        self.post_attention_layernorm = nn.RMSNorm(hidden)
        self.mlp = _MLP(hidden)


class _Backbone(nn.Module):
    def __init__(
        self, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, qk_norm: bool
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(_Layer(hidden, heads, kv_heads, qk_norm) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)


class TinyLM(nn.Module):
    """Llama naming (``model.embed_tokens``, ``model.layers.N.self_attn.q_proj``, ``lm_head``), no config."""

    def __init__(
        self,
        vocab: int = 50,
        hidden: int = 16,
        layers: int = 2,
        heads: int = 4,
        kv_heads: int = 2,
        *,
        qk_norm: bool = False,
        tie: bool = False,
    ) -> None:
        super().__init__()
        self.model = _Backbone(vocab, hidden, layers, heads, kv_heads, qk_norm)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


class ConfiguredLM(TinyLM):
    """TinyLM with an HF-like ``config`` (heads read from it)."""

    def __init__(self, heads: int = 4, kv_heads: int | None = 2, **kwargs: object) -> None:
        super().__init__(heads=heads, kv_heads=kv_heads or heads, **kwargs)
        self.config = SimpleNamespace(
            model_type="tiny", num_attention_heads=heads, num_key_value_heads=kv_heads
        )


class RemoteCodeLM(ConfiguredLM):
    """Looks like a ``trust_remote_code`` model: registered for an auto class, defined outside transformers."""

    _auto_class = "AutoModelForCausalLM"


class FusedExperts(nn.Module):
    """Transformers-5 style fused experts: 3-D ``gate_up_proj`` / ``down_proj`` (no forward needed here)."""

    def __init__(self, experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inter))


class _PlanLanguage(_Backbone):
    _tp_plan = {  # noqa: RUF012 (HF style class attribute)
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "layers.*.mlp.experts.down_proj": "rowwise",
        "layers.*.mlp.experts": "moe_tp_experts",
        "layers.*.mlp.down_proj": "rowwise_split_input",
    }

    def __init__(self) -> None:
        super().__init__(50, 16, 2, 4, 2, False)
        for layer in self.layers:
            layer.mlp.experts = FusedExperts(4, 16, 8)
            layer.mlp.gate = nn.Linear(16, 2)


class _PlanVision(nn.Module):
    _tp_plan = {"blocks.*.proj": "colwise"}  # noqa: RUF012

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"proj": nn.Linear(8, 8)}) for _ in range(2))


class NestedPlanVLM(nn.Module):
    """No root plan; a vision tower and a (deeper) language model each carry an HF ``_tp_plan``."""

    def __init__(self) -> None:
        super().__init__()
        self.vision_tower = _PlanVision()
        self.model = nn.Module()
        self.model.language_model = _PlanLanguage()
        self.lm_head = nn.Linear(16, 50, bias=False)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.language_model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


def hf_model(kind: str, **kwargs: object) -> nn.Module:
    """A randomly initialised tiny ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` (no hub access)."""
    cls = transformers.LlamaForCausalLM if kind == "llama" else transformers.Qwen3ForCausalLM
    return cls(tp_hf_config(kind, **kwargs)).to(torch.float32)


class UnregisteredLlama(transformers.LlamaForCausalLM):
    """An HF Llama under a class name no built-in plan is registered for: resolution reaches the HF plan."""


class HeadlessPlanLlama(transformers.LlamaForCausalLM):
    """An HF Llama whose TP plan leaves ``lm_head`` out (the head stays a plain replicated Linear)."""

    _tp_plan = {}  # noqa: RUF012
