"""Frozen multimodal towers under the three policies, and ranks that see different modalities."""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from plait.models import VLM as TinyVLM
from plait.models import DecoderConfig, VisionConfig, VLMConfig, freeze_vision
from plait.sharding import (
    apply_fsdp_sharding,
    find_frozen_multimodal_modules,
    find_multimodal_modules,
    frozen_multimodal_ignored_params,
    fully_shard_root,
)
from plait.testing import Inputs, Parity, paired, run_on_ranks, run_parity
from plait.testing.models import make_batch

_VOCAB = 64


def _vlm(frozen: str) -> TinyVLM:
    """``frozen``: "none", "tower" (the projector stays trainable) or "all" (tower and projector)."""
    config = VLMConfig(
        text_config=DecoderConfig(
            vocab_size=_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2
        ),
        vision_config=VisionConfig(image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=2),
    )
    model = TinyVLM(config)
    if frozen in ("tower", "all"):
        freeze_vision(model)
    if frozen == "all":
        model.multi_modal_projector.requires_grad_(False)
    return model


def _batches(images_on: tuple[int, ...], world: int) -> list[list[Inputs]]:
    """Five global batches; only the ranks in ``images_on`` get ``pixel_values``."""
    gen = torch.Generator().manual_seed(7)
    steps = []
    for step in range(5):
        micro = []
        for rank in range(world):
            ids, labels = make_batch(_VOCAB, 2, 8, seed=step * 100 + rank)
            kwargs = {"input_ids": ids}
            if rank in images_on:
                kwargs["pixel_values"] = torch.randn(2, 3, 8, 8, generator=gen)
            micro.append((kwargs, labels))
        steps.append(micro)
    return steps


def _shard_vlm(model: nn.Module, policy: str, log: list[str]) -> nn.Module:
    """The sidecar's FSDP2 order: frozen discovery, layer units, the root last with the same ignored set."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ignored = frozen_multimodal_ignored_params(find_frozen_multimodal_modules(model), policy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_fsdp_sharding(model, mesh, frozen_multimodal_sharding=policy)
    log.extend(str(w.message) for w in caught)
    return fully_shard_root(model, mesh, mp_policy=None, offload_policy=None, ignored_params=ignored)


def _layout(log: list[str], ref: nn.Module, par: nn.Module) -> dict[str, Any]:
    full = dict(ref.named_parameters())
    return {
        "units": [fqn for fqn, m in par.named_modules() if isinstance(m, FSDPModule)],
        "visual_local": {
            n: tuple(_local(p).shape) for n, p in par.named_parameters() if n.startswith("visual.")
        },
        "visual_full": {n: tuple(full[n].shape) for n in full if n.startswith("visual.")},
        "visual_dtensor": sorted({isinstance(p, DTensor) for p in par.visual.parameters()}),
        "warnings": log,
    }


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _vlm_parity(frozen: str, policy: str, images_on: tuple[int, ...]) -> Parity:
    log: list[str] = []
    return run_parity(
        paired(partial(_vlm, frozen), partial(_shard_vlm, policy=policy, log=log)),
        _batches(images_on, dist.get_world_size()),
        dp_rank=dist.get_rank(),
        inspect=partial(_layout, log),
    )


_LANGUAGE_UNITS = ["language_model.layers.0", "language_model.layers.1"]


@pytest.mark.parametrize("frozen", ["tower", "all"])
def test_root_policy_with_rank_divergent_modalities_matches_reference(frozen: str) -> None:
    # Rank 0 sees images, rank 1 text only. "tower" keeps the projector trainable: rank 1 has no
    # gradient for it, and the root unit must still reduce-scatter (zeros) or the job dies.
    results = run_on_ranks(_vlm_parity, 2, frozen, "root", (0,))
    for result in results:
        result.check()
        assert result.extra["units"] == ["", *_LANGUAGE_UNITS]
        assert result.extra["visual_dtensor"] == [True]  # sharded, inside the root unit
        assert result.extra["warnings"] == []


def test_replicate_policy_keeps_full_copies_and_tolerates_divergence() -> None:
    results = run_on_ranks(_vlm_parity, 2, "all", "replicate", (1,))
    for result in results:
        result.check()
        assert result.extra["units"] == ["", *_LANGUAGE_UNITS]
        assert result.extra["visual_dtensor"] == [False]
        assert result.extra["visual_local"] == result.extra["visual_full"]


def test_per_layer_policy_shards_the_tower_and_warns() -> None:
    results = run_on_ranks(_vlm_parity, 2, "all", "per_layer", (0, 1))
    for rank, result in enumerate(results):
        result.check()
        assert result.extra["units"] == ["", "visual.blocks.0", "visual.blocks.1", *_LANGUAGE_UNITS]
        assert result.extra["visual_dtensor"] == [True]
        local, full = result.extra["visual_local"], result.extra["visual_full"]
        qkv = "visual.blocks.0.attn.qkv.weight"
        assert local[qkv] == (full[qkv][0] // 2, full[qkv][1]), rank
        assert any("per_layer" in w and "hang" in w for w in result.extra["warnings"])


def test_multimodal_discovery_is_by_name_and_maximal() -> None:
    model = _vlm("tower")
    assert set(find_multimodal_modules(model)) == {"visual", "multi_modal_projector"}
    assert set(find_frozen_multimodal_modules(model)) == {"visual"}
    frozen = find_frozen_multimodal_modules(_vlm("all"))
    assert set(frozen) == {"visual", "multi_modal_projector"}
    assert frozen_multimodal_ignored_params(frozen, "Replicate") == {
        p for m in frozen.values() for p in m.parameters()
    }
    assert frozen_multimodal_ignored_params(frozen, "per-layer") == set()
    with pytest.raises(ValueError, match="'everywhere'"):
        frozen_multimodal_ignored_params(frozen, "everywhere")
