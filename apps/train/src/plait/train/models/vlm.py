"""The vision-language reference model: ``visual`` tower + ``multi_modal_projector`` + ``language_model``.

Image patches go through the vision tower (``visual.blocks`` is the layer list), are projected to
the text width and prepended to the text embeddings; the language model is the dense backbone.
The logits cover the text positions only. The attribute names are the ones plait.sharding
recognises as a multimodal tower and projector (frozen-tower policies, layer groups).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from plait.train.models.dense import DecoderConfig, DecoderModel

__all__ = ["VLM", "VLMConfig", "VisionBlock", "VisionConfig", "VisionTower"]


@dataclass(kw_only=True)
class VisionConfig:
    """The ViT-style tower."""

    image_size: int = 16
    patch_size: int = 8
    num_channels: int = 3
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size ({self.image_size}) must be divisible by patch_size ({self.patch_size})"
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
    """Text and vision configs (Hugging Face style ``text_config`` / ``vision_config``)."""

    text_config: DecoderConfig = field(default_factory=DecoderConfig)
    vision_config: VisionConfig = field(default_factory=VisionConfig)
    use_cache: bool = False


class VisionBlock(nn.Module):
    """Pre-norm bidirectional self-attention + GELU MLP."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.norm1 = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.norm2 = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.fc1 = nn.Linear(h, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, h)
        x = x + self.proj(attn)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class VisionTower(nn.Module):
    """Patchify (a linear over flattened patches), position embedding, blocks, final norm."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = nn.Linear(config.num_channels * config.patch_size**2, config.hidden_size)
        self.position_embedding = nn.Embedding(config.num_patches, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        p = self.config.patch_size
        b, c, _, _ = pixel_values.shape
        patches = (
            pixel_values.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).reshape(b, -1, c * p * p)
        )
        x = self.patch_embed(patches) + self.position_embedding.weight
        for block in self.blocks:
            x = block(x)
        return self.post_layernorm(x)


class VLM(nn.Module):
    """``forward(input_ids, pixel_values=None) -> logits`` of the text positions."""

    _no_split_modules: ClassVar[list[str]] = ["DecoderLayer", "VisionBlock"]

    def __init__(self, config: VLMConfig) -> None:
        super().__init__()
        self.config = config
        text, vision = config.text_config, config.vision_config
        self.visual = VisionTower(vision)
        self.multi_modal_projector = nn.Sequential(
            nn.Linear(vision.hidden_size, text.hidden_size),
            nn.GELU(),
            nn.Linear(text.hidden_size, text.hidden_size),
        )
        self.language_model = DecoderModel(text)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None) -> torch.Tensor:
        embeds = self.language_model.embed_tokens(input_ids)
        if pixel_values is None:
            return self.lm_head(self.language_model(inputs_embeds=embeds))
        image = self.multi_modal_projector(self.visual(pixel_values.to(embeds.dtype)))
        hidden = self.language_model(inputs_embeds=torch.cat([image.to(embeds.dtype), embeds], dim=1))
        return self.lm_head(hidden[:, image.shape[1] :])
