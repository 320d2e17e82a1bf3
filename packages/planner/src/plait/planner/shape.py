"""The sizes of a decoder the planner prices: read from a Hugging Face-style config, no model built."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelShape"]

_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def _get(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if value is not None:
            return value
    return default


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A Llama-style decoder (optionally MoE, optionally MLA attention) by its sizes.

    Field names follow Hugging Face configs; :meth:`from_config` reads one (a dict or a config
    object, a VLM's ``text_config`` included).
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    """Dense MLP width (the dense layers of an MoE model too)."""
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_intermediate_size: int = 0
    """Width of the shared expert(s) of an MoE layer (0: none)."""
    dense_layers: int = 0
    """Leading layers with a dense MLP in an MoE model (DeepSeek's ``first_k_dense_replace``)."""
    tied_embeddings: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    """MLA attention (DeepSeek): 0 for standard grouped-query attention."""
    v_head_dim: int = 0
    rope_head_dim: int = 0
    tp_attention: bool = True
    """Whether TP shards the attention heads; False: the model's TP plan leaves attention out, so it
    runs replicated on the whole sequence (Hugging Face's DeepSeek-V3 plan)."""
    sp_whole_mlp: bool = False
    """Under SP the MLP block runs on the gathered sequence, its row-wise output all-reduced, then
    sliced (Hugging Face plans whose experts are tensor-parallel); False: gathered in, reduce-scattered out."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"experts_per_token must be in [1, num_experts={self.num_experts}], got {self.experts_per_token}"
            )

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """Read a Hugging Face-style config (object or dict); a VLM's ``text_config`` is the decoder."""
        text = _get(config, "text_config") or config
        hidden = int(_get(text, "hidden_size"))
        heads = int(_get(text, "num_attention_heads"))
        experts = int(_get(text, *_EXPERT_KEYS, default=0))
        # Mixtral's experts are intermediate_size wide (it has no moe_intermediate_size).
        moe_width = int(
            _get(text, "moe_intermediate_size", default=0) or _get(text, "intermediate_size", default=0)
        )
        shared = int(_get(text, "shared_expert_intermediate_size", default=0))
        shared = shared or int(_get(text, "n_shared_experts", default=0)) * moe_width
        kv_lora = int(_get(text, "kv_lora_rank", default=0))
        nope = int(_get(text, "qk_nope_head_dim", default=0))
        rope = int(_get(text, "qk_rope_head_dim", default=0))
        head_dim = (nope + rope) if kv_lora else int(_get(text, "head_dim", default=hidden // heads))
        return cls(
            vocab_size=int(_get(text, "vocab_size", default=_get(config, "vocab_size"))),
            hidden_size=hidden,
            num_layers=int(_get(text, "num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(_get(text, "num_key_value_heads", default=heads)),
            head_dim=head_dim,
            intermediate_size=int(_get(text, "intermediate_size", default=4 * hidden)),
            num_experts=experts,
            experts_per_token=int(_get(text, "num_experts_per_tok", default=0)) if experts else 0,
            moe_intermediate_size=moe_width if experts else 0,
            shared_intermediate_size=shared if experts else 0,
            dense_layers=int(_get(text, "first_k_dense_replace", default=0)) if experts else 0,
            tied_embeddings=bool(_get(text, "tie_word_embeddings", default=False)),
            q_lora_rank=int(_get(text, "q_lora_rank", default=0) or 0),
            kv_lora_rank=kv_lora,
            v_head_dim=int(_get(text, "v_head_dim", default=0)) if kv_lora else 0,
            rope_head_dim=rope if kv_lora else 0,
        )

    # -- sizes ---------------------------------------------------------------------------------

    @property
    def moe(self) -> bool:
        """Whether the model has expert layers."""
        return self.num_experts > 0

    @property
    def moe_layers(self) -> int:
        """Layers with experts."""
        return self.num_layers - self.dense_layers if self.moe else 0

    def head_split(self, tp: int) -> int:
        """The ranks attention heads are split over under ``tp``: tp, or 1 where the TP plan leaves attention whole."""
        return tp if self.tp_attention else 1

    @property
    def q_width(self) -> int:
        """Query (and attention output) width: heads x head_dim."""
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Key width per token (MLA: the expanded per-head keys)."""
        return (self.num_heads if self.kv_lora_rank else self.num_kv_heads) * self.head_dim

    @property
    def v_width(self) -> int:
        """Value width per token."""
        return self.num_heads * self.v_head_dim if self.kv_lora_rank else self.kv_width

    def attention_params(self) -> int:
        """Projection weights of one attention block (TP-shardable)."""
        h = self.hidden_size
        if not self.kv_lora_rank:
            return h * (2 * self.q_width + 2 * self.kv_width)
        q = h * self.q_lora_rank + self.q_lora_rank * self.q_width if self.q_lora_rank else h * self.q_width
        nope = self.head_dim - self.rope_head_dim
        kv = h * (self.kv_lora_rank + self.rope_head_dim) + self.kv_lora_rank * self.num_heads * (
            nope + self.v_head_dim
        )
        return q + kv + self.v_width * h + self.q_lora_rank + self.kv_lora_rank  # + the two low-rank norms

    def dense_mlp_params(self) -> int:
        """One dense SwiGLU MLP."""
        return 3 * self.hidden_size * self.intermediate_size

    def expert_params(self) -> int:
        """The routed experts of one MoE layer (all of them)."""
        return self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    def moe_dense_params(self) -> int:
        """The non-expert weights of one MoE layer's block: router and shared expert."""
        return self.hidden_size * self.num_experts + 3 * self.hidden_size * self.shared_intermediate_size

    def embedding_params(self) -> int:
        """Input embedding (and the output head, unless tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    def total_params(self) -> int:
        """Every parameter."""
        per_layer = self.attention_params() + 2 * self.hidden_size
        dense = (self.num_layers - self.moe_layers) * self.dense_mlp_params()
        moe = self.moe_layers * (self.expert_params() + self.moe_dense_params())
        return self.num_layers * per_layer + dense + moe + self.embedding_params() + self.hidden_size

    def active_params(self) -> int:
        """Parameters one token uses (routed experts: ``experts_per_token`` of them), embeddings excluded."""
        per_layer = self.attention_params() + 2 * self.hidden_size
        dense = (self.num_layers - self.moe_layers) * self.dense_mlp_params()
        routed = self.experts_per_token * 3 * self.hidden_size * self.moe_intermediate_size
        moe = self.moe_layers * (routed + self.moe_dense_params())
        head = 0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        return self.num_layers * per_layer + dense + moe + head

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, torchtitan's formula: ``6 N + 12 L H Q T`` (N: active, no input embedding)."""
        attention = 12 * self.num_layers * self.num_heads * self.head_dim * seq_len
        return 6.0 * self.active_params() + attention
