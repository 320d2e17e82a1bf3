"""The recipe's model: a plait.models reference model from its preset, or a Hugging Face class."""

from __future__ import annotations

import torch
from torch import nn

from plait.mesh import from_dict
from plait.models import REFERENCE_MODELS, freeze_vision, preset_arch
from plait.train.config import ModelConfig
from plait.train.models.hf import build_hf_model, hf_logits

__all__ = ["build_model", "hf_logits", "model_vocab_size"]


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
            config_cls, model_cls = REFERENCE_MODELS[cfg.source]
            config = from_dict(
                config_cls, preset_arch(cfg.source, cfg.preset, cfg.arch), "model.arch", what="recipe"
            )
            model = model_cls(config)
    if cfg.source == "vlm" and cfg.freeze_vision:
        freeze_vision(model)
    return model


def model_vocab_size(model: nn.Module) -> int:
    """Rows of the input embedding table."""
    return model.get_input_embeddings().weight.shape[0]
