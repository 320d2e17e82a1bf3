"""Export the weights in the Hugging Face layout, each rank writing its own shards (no full gather).

``<run>/export/`` holds ``model-0000i-of-0000N.safetensors`` (full tensors, grouped into files of
about ``max_file_bytes``), ``model.safetensors.index.json`` (tensor name -> file) and

- ``config.json`` for a ``transformers`` model, so ``from_pretrained(<run>/export)`` loads it;
- ``plait_model.json`` (the recipe's ``model`` section) for the reference models, so a recipe
  with ``model.pretrained_path: <run>/export`` (and the same ``model`` section) starts from it.

How: ``torch.distributed.checkpoint`` saves the sharded state dict through its
``HuggingFaceStorageWriter`` — every rank writes only the shards it holds into ``sharded/`` —
then every rank assembles the output files assigned to it, one full tensor in memory at a time
(:func:`plait.train.hf_files.assemble`), and the ``sharded/`` files are removed. The
directory appears under its final name only when complete. The export directory must be on a
filesystem all ranks share.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from plait.train.config import ModelConfig, to_dict
from plait.train.hf_files import INDEX_FILE, assemble, write_index
from plait.train.integrity import fsync_dir

__all__ = ["INDEX_FILE", "PLAIT_CONFIG_FILE", "export_model", "file_index"]

PLAIT_CONFIG_FILE = "plait_model.json"
_DEFAULT_FILE_BYTES = 2 * 2**30
_DEFAULT_WRITE_BYTES = 256 * 2**20


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


Specs = dict[str, tuple[list[int], torch.dtype]]
"""Tensor name -> (global shape, dtype)."""


def file_index(specs: Specs, max_file_bytes: int) -> dict[str, int]:
    """Tensor name -> output file (1..N): names in order, a new file when one would pass ``max_file_bytes``."""
    index, used, mapping = 1, 0, {}
    for key, (shape, dtype) in specs.items():
        size = math.prod(shape) * dtype.itemsize
        if used and used + size > max_file_bytes:
            index, used = index + 1, 0
        mapping[key] = index
        used += size
    return mapping


def _hf_config(model: nn.Module) -> Any:
    inner = getattr(model, "module", model)  # DDP wraps as .module
    config = getattr(inner, "config", None)
    return config if hasattr(config, "to_json_file") else None


def _write_config(model: nn.Module, directory: Path, model_cfg: ModelConfig | None) -> None:
    config = _hf_config(model) if model_cfg is None or model_cfg.source == "hf" else None
    if config is not None:
        config.to_json_file(str(directory / "config.json"))
    elif model_cfg is not None:
        (directory / PLAIT_CONFIG_FILE).write_text(json.dumps(to_dict(model_cfg), indent=1))


def _global_specs(state: dict[str, torch.Tensor]) -> Specs:
    """Every rank's tensors (a pipeline rank holds only its stages'), in rank order, first seen first."""
    local = [(k, list(v.shape), v.dtype) for k, v in state.items()]
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {k: (shape, dtype) for k, shape, dtype in local}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    specs: Specs = {}
    for rank_specs in gathered:
        for k, shape, dtype in rank_specs:
            specs.setdefault(k, (shape, dtype))
    return specs


def export_model(
    model: nn.Module,
    directory: str | Path,
    model_cfg: ModelConfig | None = None,
    *,
    max_file_bytes: int = _DEFAULT_FILE_BYTES,
    write_chunk_bytes: int = _DEFAULT_WRITE_BYTES,
    config_model: nn.Module | None = None,
) -> Path:
    """Write ``model``'s weights to ``directory`` in the Hugging Face layout (all ranks call this).

    Args:
        model: the parallelized (or plain) model; under pipeline parallel, the local stages' state
            module (``Pipeline.state_module()``): each rank writes its stages' shards.
        directory: the export directory; replaced when it exists.
        model_cfg: the recipe's model section (``plait_model.json`` for reference models); None =
            ``config.json`` only, when the model has a ``transformers`` config.
        max_file_bytes: the size at which a new ``model-*.safetensors`` file starts.
        write_chunk_bytes: the shard files of the first stage group about this many (global)
            bytes; a rank serializes one such file at a time, so this bounds its extra memory.
        config_model: the module whose ``transformers`` config becomes ``config.json`` (default
            ``model``; under pipeline parallel a stage, which shares the whole model's config).
    """
    final = Path(directory)
    tmp = final.with_name(f".tmp-{final.name}")
    sharded = tmp / "sharded"
    state = {k: v.detach() for k, v in get_model_state_dict(model).items() if isinstance(v, torch.Tensor)}
    specs = _global_specs(state)
    mapping = file_index(specs, max_file_bytes)
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        sharded.mkdir(parents=True)
    _barrier()
    chunks = file_index(specs, write_chunk_bytes)
    writer = HuggingFaceStorageWriter(str(sharded), fqn_to_index_mapping=chunks, save_distributed=True)
    dcp.save(state, storage_writer=writer)
    del state
    world = dist.get_world_size() if dist.is_initialized() else 1
    assemble(sharded, tmp, specs, mapping, _rank(), world)
    _barrier()
    if _rank() == 0:
        shutil.rmtree(sharded)
        write_index(tmp, specs, mapping)
        _write_config(model if config_model is None else config_model, tmp, model_cfg)
        for name in os.listdir(tmp):
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        fsync_dir(final.parent)
    _barrier()
    return final
