"""parallelize_moe on real gloo ranks: loss, gradients and optimizer steps equal the unsharded model."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import CheckpointError

from plait.mesh import FSDP2Config, MeshContext, MoEConfig, ParallelismSizes
from plait.models import MoEDecoder, MoEDecoderConfig, TopKRouter
from plait.sharding import apply_activation_checkpointing, discover_layer_groups
from plait.strategies import parallelize_moe
from plait.strategies._routing_ac import save_routing_under_checkpoint
from plait.testing import run_on_ranks
from plait.testing.parity import max_grad_diff
from tests.strategies._parity import (
    Parity,
    global_batch,
    lm_loss,
    local_rows,
    run_parity,
)

_FP32 = FSDP2Config(mp_policy=None)


def _build(cfg: MoEDecoderConfig, ep: int, ac: bool | str) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    ref = MoEDecoder(cfg)
    ctx = MeshContext.build(_FP32, ParallelismSizes(ep_size=ep))
    par = parallelize_moe(
        copy.deepcopy(ref), ctx.device_mesh, ctx.moe_mesh, strategy_config=_FP32, activation_checkpointing=ac
    )
    return ref, par


def _moe_parity(ep: int, ac: bool | str, cfg: MoEDecoderConfig) -> Parity:
    return run_parity(lambda: _build(cfg, ep, ac), cfg.vocab_size)


SKEWED = MoEDecoderConfig(num_experts=8, zero_token_experts=(1, 2, 6))


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_matches_reference_with_idle_experts(ep: int) -> None:
    results = run_on_ranks(_moe_parity, 4, ep, False, SKEWED)
    for r in results:
        r.check()


def _perturb_routing(model: torch.nn.Module, blocked: tuple[int, ...]) -> None:
    """Block other experts than the forward did: a router recomputed in backward would now route differently."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, TopKRouter):
                module.expert_bias.zero_()
                module.expert_bias[list(blocked)] = -1.0e4


def _routing_saved_under_ac(mode: str) -> tuple[int, float, str]:
    cfg = MoEDecoderConfig(num_experts=8, zero_token_experts=(1, 6))
    batch = global_batch(cfg.vocab_size, torch.distributed.get_world_size())
    ref, par = _build(cfg, 2, mode)
    wrappers = sum(isinstance(m, CheckpointWrapper) for m in par.modules())
    ref_loss = lm_loss(ref, batch)
    par_loss = lm_loss(par, local_rows(batch))
    _perturb_routing(par, blocked=(0, 2, 3, 4, 5))
    ref_loss.backward()
    par_loss.backward()
    grad_diff, worst = max_grad_diff(ref, par)
    return wrappers, grad_diff, worst


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_routing_is_saved_not_recomputed_under_activation_checkpointing(mode: str) -> None:
    # The router is re-biased between forward and backward; gradients still equal the reference, so the
    # recompute reused the forward's routing.
    results = run_on_ranks(_routing_saved_under_ac, 4, mode)
    for wrappers, grad_diff, worst in results:
        assert wrappers > 0
        assert grad_diff <= 1e-5, worst


def test_rebiased_router_changes_gradients_without_routing_save() -> None:
    # Control for the test above, on one process: plain checkpointing recomputes the re-biased router.
    cfg = MoEDecoderConfig(num_experts=8, zero_token_experts=(1, 6))
    torch.manual_seed(0)
    ref = MoEDecoder(cfg)
    plain, saved = copy.deepcopy(ref), copy.deepcopy(ref)
    for model in (plain, saved):
        apply_activation_checkpointing(model, discover_layer_groups(model))
    routers = [m for m in saved.modules() if isinstance(m, TopKRouter)]
    assert save_routing_under_checkpoint(saved, routers, selective=False) == cfg.num_hidden_layers
    batch = global_batch(cfg.vocab_size, 2)
    ref_loss, plain_loss, saved_loss = (lm_loss(m, batch) for m in (ref, plain, saved))
    _perturb_routing(plain, blocked=(0, 2, 3, 4, 5))
    _perturb_routing(saved, blocked=(0, 2, 3, 4, 5))
    ref_loss.backward()
    saved_loss.backward()
    assert max_grad_diff(ref, saved)[0] <= 1e-6
    with pytest.raises(CheckpointError, match="different metadata"):
        plain_loss.backward()


def _experts_placements(ep: int, cfg: MoEDecoderConfig) -> list[str]:
    _, par = _build(cfg, ep, False)
    return [str(p.placements) for n, p in par.named_parameters() if n.endswith("experts.w1")]


def test_ep_shard_outnumbering_local_experts_shards_experts_on_dim1() -> None:
    # 2 experts over ep=2 leaves 1 local expert for 2 ep_shard ranks: FSDP shards the hidden dim (dim 1).
    one_local = MoEDecoderConfig(num_experts=2, num_experts_per_tok=1)
    placements = run_on_ranks(_experts_placements, 4, 2, one_local)[0]
    assert placements and all(p.startswith("(Shard(dim=1)") for p in placements), placements
    for r in run_on_ranks(_moe_parity, 4, 2, False, one_local):
        r.check()


def test_ep_shard_up_to_local_experts_shards_experts_on_dim0() -> None:
    placements = run_on_ranks(_experts_placements, 4, 2, SKEWED)[0]
    # dim 0 is also the ep dim, so FSDP's dim-0 shard of the ep-local experts shows as a strided shard.
    assert placements and all(re.match(r"\((_Strided)?Shard\(dim=0", p) for p in placements), placements


_TP_PLAN = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
}


def _tp_ep_parity() -> Parity:
    # tp=2 x dp=2 on 4 ranks, ep=2 across them: TP ranks share data and dispatch duplicate tokens.
    cfg = SKEWED
    config = FSDP2Config(mp_policy=None, tp_plan=_TP_PLAN)

    def build() -> tuple[torch.nn.Module, torch.nn.Module]:
        torch.manual_seed(0)
        ref = MoEDecoder(cfg)
        ctx = MeshContext.build(config, ParallelismSizes(tp_size=2, ep_size=2))
        par = parallelize_moe(copy.deepcopy(ref), ctx.device_mesh, ctx.moe_mesh, strategy_config=config)
        return ref, par

    data_rank = torch.distributed.get_rank() // 2
    return run_parity(build, cfg.vocab_size, data_ranks=2, rows=lambda b: local_rows(b, data_rank, 2))


def test_tensor_and_expert_parallel_together_match_reference() -> None:
    for r in run_on_ranks(_tp_ep_parity, 4):
        r.check()


def _unwrapped_outer_parity() -> tuple[Parity, bool, bool]:
    moe = MoEConfig(wrap_outer_model=False, lm_head_precision=torch.float32)

    def build() -> tuple[torch.nn.Module, torch.nn.Module]:
        torch.manual_seed(0)
        ref = MoEDecoder(SKEWED)
        ctx = MeshContext.build(_FP32, ParallelismSizes(ep_size=2))
        par = parallelize_moe(
            copy.deepcopy(ref), ctx.device_mesh, ctx.moe_mesh, strategy_config=_FP32, moe_config=moe
        )
        return ref, par

    _, par = build()
    root_is_unit, head_is_unit = isinstance(par, FSDPModule), isinstance(par.lm_head, FSDPModule)
    return run_parity(build, SKEWED.vocab_size), root_is_unit, head_is_unit


def test_outer_model_left_unwrapped_with_own_lm_head_unit() -> None:
    for parity, root_is_unit, head_is_unit in run_on_ranks(_unwrapped_outer_parity, 4):
        parity.check()
        assert not root_is_unit and head_is_unit
