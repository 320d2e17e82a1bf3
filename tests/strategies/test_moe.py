"""Routing saved under activation checkpointing (``save_inside``), on one process: the control for tests/sidecar."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import CheckpointError

from plait.models import MoEDecoder, MoEDecoderConfig, TopKRouter
from plait.sharding import apply_activation_checkpointing, discover_layer_groups
from plait.testing.parity import max_grad_diff
from tests.strategies._parity import global_batch, lm_loss


def _perturb_routing(model: torch.nn.Module, blocked: tuple[int, ...]) -> None:
    """Block other experts than the forward did: a router recomputed in backward would now route differently."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, TopKRouter):
                module.expert_bias.zero_()
                module.expert_bias[list(blocked)] = -1.0e4


def test_rebiased_router_changes_gradients_without_routing_save() -> None:
    # Control for the test above, on one process: plain checkpointing recomputes the re-biased router.
    cfg = MoEDecoderConfig(num_experts=8, zero_token_experts=(1, 6))
    torch.manual_seed(0)
    ref = MoEDecoder(cfg)
    plain, saved = copy.deepcopy(ref), copy.deepcopy(ref)
    apply_activation_checkpointing(plain, discover_layer_groups(plain))
    routers = [m for m in saved.modules() if isinstance(m, TopKRouter)]
    assert apply_activation_checkpointing(saved, discover_layer_groups(saved), save_inside=routers) > 0
    batch = global_batch(cfg.vocab_size, 2)
    ref_loss, plain_loss, saved_loss = (lm_loss(m, batch) for m in (ref, plain, saved))
    _perturb_routing(plain, blocked=(0, 2, 3, 4, 5))
    _perturb_routing(saved, blocked=(0, 2, 3, 4, 5))
    ref_loss.backward()
    saved_loss.backward()
    assert max_grad_diff(ref, saved)[0] <= 1e-6
    with pytest.raises(CheckpointError, match="different metadata"):
        plain_loss.backward()
