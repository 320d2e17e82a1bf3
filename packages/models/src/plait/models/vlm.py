"""The vision-language reference model: vision tower, projector and the dense language backbone.

Module names follow the common Hugging Face VLM layout (``visual.blocks``, ``multi_modal_projector``,
``language_model.layers``, ``lm_head``), which plait.sharding recognises as a multimodal tower and
projector (frozen-tower policies, layer groups).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from plait.models.attention import AttentionFn, sdpa_attention
from plait.models.dense import DecoderConfig, DecoderModel

__all__ = ["VLM", "VLMConfig", "VisionBlock", "VisionConfig", "VisionTower", "freeze_vision"]


@dataclass(kw_only=True)
class VisionConfig:
    """The ViT-style tower: square images cut into ``patch_size`` patches; defaults are the ``test`` preset."""

    image_size: int = 8
    patch_size: int = 4
    num_channels: int = 3
    hidden_size: int = 16
    intermediate_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("image_size", "patch_size", "num_channels", "hidden_size", "num_attention_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"vision {name} must be >= 1, got {getattr(self, name)}")
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size ({self.image_size}) must be a multiple of patch_size ({self.patch_size})"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"vision hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})"
            )

    @property
    def num_patches(self) -> int:
        """Image tokens per image."""
        return (self.image_size // self.patch_size) ** 2


@dataclass(kw_only=True)
class VLMConfig:
    """A :class:`VLM`'s configuration: Hugging Face style ``text_config`` and ``vision_config``."""

    text_config: DecoderConfig = field(default_factory=DecoderConfig)
    vision_config: VisionConfig = field(default_factory=VisionConfig)
    use_cache: bool = True
    """Only recorded (activation checkpointing turns it off); the model never caches."""

    @property
    def tie_word_embeddings(self) -> bool:
        return self.text_config.tie_word_embeddings

    def get_text_config(self) -> DecoderConfig:
        return self.text_config


class VisionAttention(nn.Module):
    """Bidirectional multi-head self-attention over patches (fused ``qkv``, then ``proj``)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.attention_fn: AttentionFn = sdpa_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, -1, self.head_dim)).permute(2, 0, 3, 1, 4)
        out = self.attention_fn(q, k, v, is_causal=False, scale=None, enable_gqa=False)
        return self.proj(out.transpose(1, 2).flatten(-2))


class VisionMLP(nn.Module):
    """GELU feed-forward ``fc2(gelu(fc1(x)))``."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class VisionBlock(nn.Module):
    """Pre-norm ViT block."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = VisionAttention(config)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTower(nn.Module):
    """Patch embedding (a Linear over flattened patches), ``blocks``, final norm."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = nn.Linear(config.num_channels * config.patch_size**2, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[batch, channels, H, W]`` -> patch features ``[batch, num_patches, hidden]``."""
        p = self.config.patch_size
        patches = F.unfold(pixel_values, kernel_size=p, stride=p).transpose(1, 2)
        x = self.patch_embed(patches)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class MultiModalProjector(nn.Module):
    """Two-layer MLP from vision features to the text hidden size (LLaVA's names)."""

    def __init__(self, vision_hidden: int, text_hidden: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_hidden, text_hidden)
        self.linear_2 = nn.Linear(text_hidden, text_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x)))


class VLM(nn.Module):
    """Image + text causal LM: ``forward(input_ids, pixel_values=None, position_ids=None) -> logits``.

    Logits are ``[batch, seq, vocab]``. With ``pixel_values`` the projected patch features replace the
    token embeddings of the first ``vision_config.num_patches`` positions (LLaVA's image placeholders;
    the sequence must be at least that long).
    """

    _no_split_modules: ClassVar[list[str]] = ["DecoderLayer", "VisionBlock"]

    def __init__(self, config: VLMConfig | None = None) -> None:
        super().__init__()
        self.config = config if config is not None else VLMConfig()
        text, vision = self.config.text_config, self.config.vision_config
        self.visual = VisionTower(vision)
        self.multi_modal_projector = MultiModalProjector(vision.hidden_size, text.hidden_size)
        self.language_model = DecoderModel(text)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        if text.tie_word_embeddings:
            self.lm_head.weight = self.language_model.embed_tokens.weight

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if pixel_values is None:
            return self.lm_head(self.language_model(input_ids=input_ids, position_ids=position_ids))
        n = self.config.vision_config.num_patches
        if input_ids.shape[1] < n:
            raise ValueError(
                f"with pixel_values the sequence needs >= {n} tokens (one per patch), got {input_ids.shape[1]}"
            )
        embeds = self.language_model.embed_tokens(input_ids)
        image = self.multi_modal_projector(self.visual(pixel_values.to(embeds.dtype)))
        embeds = torch.cat([image.to(embeds.dtype), embeds[:, n:]], dim=1)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :]
        return self.lm_head(self.language_model(inputs_embeds=embeds, position_ids=position_ids))


def freeze_vision(model: VLM) -> VLM:
    """Turn off gradients of the vision tower (the projector stays trainable); returns ``model``."""
    model.visual.requires_grad_(False)
    return model
