"""parallelize_moe on real gloo ranks: loss, gradients and optimizer steps equal the unsharded model."""

from __future__ import annotations

import copy

import pytest
import torch

from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes
from plait.strategies import parallelize_moe
from plait.testing import run_on_ranks
from plait.testing.moe_models import MoEDecoder, MoEDecoderConfig
from tests.strategies._parity import Parity, global_batch, lm_loss, local_rows, max_diff, mean_over_ranks

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
    """Loss + every gradient after one step, parameters after 2 SGD steps, losses over 3 AdamW steps."""
    batch = global_batch(cfg.vocab_size, torch.distributed.get_world_size())
    ref, par = _build(cfg, ep, ac)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    par_opt = torch.optim.SGD(par.parameters(), lr=0.5)
    loss_diff = 0.0
    for step in range(2):
        ref_loss = lm_loss(ref, batch)
        par_loss = lm_loss(par, local_rows(batch))
        ref_loss.backward()
        par_loss.backward()
        loss_diff = max(loss_diff, abs(mean_over_ranks(par_loss) - ref_loss.item()))
        if step == 0:
            grad_diff, worst_grad, compared = max_diff(ref, par, "grad")
        ref_opt.step()
        par_opt.step()
        ref_opt.zero_grad()
        par_opt.zero_grad()
    param_diff, worst_param, _ = max_diff(ref, par, "data")

    ref, par = _build(cfg, ep, ac)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    par_opt = torch.optim.AdamW(par.parameters(), lr=1e-2)
    adamw = 0.0
    for _ in range(3):
        ref_loss = lm_loss(ref, batch)
        par_loss = lm_loss(par, local_rows(batch))
        ref_loss.backward()
        par_loss.backward()
        adamw = max(adamw, abs(mean_over_ranks(par_loss) - ref_loss.item()))
        for opt in (ref_opt, par_opt):
            opt.step()
            opt.zero_grad()
    return Parity(loss_diff, grad_diff, worst_grad, compared, param_diff, worst_param, adamw)


def _assert_parity(results: list[Parity], num_params: int) -> None:
    for r in results:
        assert r.grads_compared == num_params, r
        assert r.loss_diff <= 1e-5, r
        assert r.grad_diff <= 1e-5, r
        assert r.param_diff <= 1e-5, r
        assert r.adamw_loss_diff <= 1e-4, r


SKEWED = MoEDecoderConfig(num_experts=8, zero_token_experts=(1, 2, 6))


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_matches_reference_with_idle_experts(ep: int) -> None:
    results = run_on_ranks(_moe_parity, 4, ep, False, SKEWED)
    _assert_parity(results, len(list(MoEDecoder(SKEWED).parameters())))
