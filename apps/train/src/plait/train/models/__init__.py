"""Reference models (dense, MoE, VLM) with size presets, and Hugging Face models by class name."""

from __future__ import annotations

import torch
from torch import nn

from plait.train.config import ModelConfig, from_dict
from plait.train.models.dense import DecoderConfig, DenseDecoder
from plait.train.models.hf import build_hf_model, hf_logits
from plait.train.models.moe import MoEDecoder, MoEModelConfig
from plait.train.models.presets import PRESETS, preset_arch
from plait.train.models.vlm import VLM, VLMConfig

__all__ = [
    "PRESETS",
    "VLM",
    "DecoderConfig",
    "DenseDecoder",
    "MoEDecoder",
    "MoEModelConfig",
    "VLMConfig",
    "build_model",
    "hf_logits",
    "model_vocab_size",
]

_BUILTIN: dict[str, tuple[type, type]] = {
    "dense": (DecoderConfig, DenseDecoder),
    "moe": (MoEModelConfig, MoEDecoder),
    "vlm": (VLMConfig, VLM),
}


def build_model(cfg: ModelConfig, device: torch.device | str = "meta") -> nn.Module:
    """Build the recipe's model on ``device`` (``meta`` for a deferred, sharded materialisation).

    Parameters on a real device hold constructor values; the trainer overwrites them with the
    deterministic per-parameter init (or the pretrained weights) in any case.
    """
    with torch.device(device):
        if cfg.source == "hf":
            assert cfg.hf_class is not None
            model = build_hf_model(cfg.hf_class, cfg.hf_config, cfg.pretrained_path)
        else:
            config_cls, model_cls = _BUILTIN[cfg.source]
            config = from_dict(config_cls, preset_arch(cfg.source, cfg.preset, cfg.arch), "model.arch")
            model = model_cls(config)
    if cfg.source == "vlm" and cfg.freeze_vision:
        model.visual.requires_grad_(False)
    return model


def model_vocab_size(model: nn.Module) -> int:
    """Rows of the input embedding table."""
    return model.get_input_embeddings().weight.shape[0]
