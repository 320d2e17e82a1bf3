"""The reference VLM with a frozen vision tower, under each frozen-multimodal policy, matches the reference."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from plait.mesh import FSDP2Config, MeshContext
from plait.models import VLM as TinyVLM
from plait.models import DecoderConfig, VisionConfig, VLMConfig, freeze_vision
from plait.testing import run_on_ranks
from tests.sidecar._parity import Parity, assert_parity, run_parity

VOCAB = 64
POLICIES = ("root", "per_layer", "replicate")


def _vlm() -> nn.Module:
    text = DecoderConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    return TinyVLM(VLMConfig(text_config=text, vision_config=VisionConfig()))


def _pixels(rows: int, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(2000 + step)
    return {"pixel_values": torch.randn(rows, 3, 8, 8, generator=gen)}


def _vision_layout(model: nn.Module) -> dict[str, Any]:
    visual = list(model.visual.parameters())
    return {
        "blocks_are_units": [isinstance(b, FSDPModule) for b in model.visual.blocks],
        "vision_dtensors": sum(isinstance(p, DTensor) for p in visual),
        "vision_params": len(visual),
        "vision_trainable": sum(p.requires_grad for p in visual),
        "language_units": sum(isinstance(layer, FSDPModule) for layer in model.language_model.layers),
    }


def _policies() -> list[Parity]:
    results = []
    for policy in POLICIES:
        ctx = MeshContext.build(
            FSDP2Config(mp_policy=None, frozen_multimodal_sharding=policy), reapply_trainability=freeze_vision
        )
        results.append(
            run_parity(
                f"vlm/{policy}",
                _vlm,
                ctx,
                VOCAB,
                extra_inputs=_pixels,
                prepare=freeze_vision,
                inspect=_vision_layout,
            )
        )
    return results


def test_frozen_vision_tower_under_each_policy_matches_reference() -> None:
    results = run_on_ranks(_policies, 2)
    assert_parity(results)
    for rank in results:
        layout = {p.case.split("/")[1]: p.extra for p in rank}
        for policy, s in layout.items():
            assert s["vision_trainable"] == 0 and s["language_units"] == 2, (policy, s)
        assert layout["root"]["blocks_are_units"] == [False, False], layout["root"]
        assert layout["root"]["vision_dtensors"] == layout["root"]["vision_params"], layout["root"]
        assert layout["per_layer"]["blocks_are_units"] == [True, True], layout["per_layer"]
        assert layout["replicate"]["blocks_are_units"] == [False, False], layout["replicate"]
        assert layout["replicate"]["vision_dtensors"] == 0, layout["replicate"]
