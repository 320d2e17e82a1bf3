"""Recipe checks that need no process group: vocabulary, data paths, this machine's devices.

Each raises ``ValueError`` naming the setting and the fix; the CLI prints it as one line and exits
with 2 on every rank before any collective (``validate``, ``plan`` and training all run them).
"""

from __future__ import annotations

import importlib.util

import torch

from plait.train.config import Recipe
from plait.train.data import check_paths
from plait.train.models import build_model, model_vocab_size
from plait.train.tokenizer import Tokenizer, load_tokenizer

__all__ = ["check_data", "check_devices", "check_vocabulary"]


def check_data(recipe: Recipe) -> Tokenizer:
    """Data paths match files, the tokenizer loads, the metric sinks are installed; return the tokenizer."""
    check_paths(recipe.data)
    if recipe.train.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ValueError(
            "train.tensorboard needs the `tensorboard` package: install plait-train[tensorboard] "
            "or set train.tensorboard: false"
        )
    return load_tokenizer(recipe.data.tokenizer, recipe.data.eos_token)


def check_vocabulary(recipe: Recipe, tokenizer: Tokenizer) -> int:
    """The model's embedding table holds every id the tokenizer can produce; return its size.

    The model is built on the meta device (no memory), so this is cheap for any size.
    """
    vocab = model_vocab_size(build_model(recipe.model, "meta"))
    if vocab < tokenizer.vocab_size:
        key = "model.hf_config.vocab_size" if recipe.model.source == "hf" else "model.arch.vocab_size"
        raise ValueError(
            f"model vocab_size {vocab} is smaller than the vocabulary of tokenizer {tokenizer.name!r} "
            f"({tokenizer.vocab_size} ids); set {key} >= {tokenizer.vocab_size}"
        )
    return vocab


def check_devices(recipe: Recipe) -> None:
    """Settings that need CUDA fail here, naming the setting, when this machine has no GPU."""
    if torch.cuda.is_available():
        return
    p = recipe.parallel
    needs = []
    if recipe.train.device == "cuda":
        needs.append("train.device 'cuda' (use train.device: auto or cpu)")
    if p.strategy == "megatron_fsdp":
        needs.append("parallel.strategy 'megatron_fsdp' (Megatron-FSDP runs on CUDA only; use fsdp2)")
    if p.options.get("offload_policy") not in (None, False):
        needs.append("parallel.options.offload_policy (CPU offload moves parameters off a GPU; remove it)")
    if needs:
        raise ValueError(f"no CUDA GPU is available on this machine, but {'; '.join(needs)} needs one")
