"""The library's default precision (FSDP2Config's bf16 parameters, fp32 reduction) against an fp32
reference, through ``parallelize_model``: FSDP2, HSDP, TP (+SP), MoE expert parallel and DDP.

DDP has no mixed-precision policy in plait (the trainer refuses ``mixed_precision: bf16`` with it), so
its bf16 case is a bf16-parameter model reduced in bf16. Tolerances: ``plait.testing.BF16``.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.mesh import DDPConfig, FSDP2Config, MeshContext, MoEConfig, ParallelismSizes
from plait.models import DecoderConfig, DenseDecoder, MoEDecoder, MoEDecoderConfig
from plait.sidecar import parallelize_model
from plait.testing import BF16, Parity, assert_parity, run_on_ranks
from tests.sidecar._parity import run_parity

VOCAB = 64


def _dense() -> nn.Module:
    return DenseDecoder(DecoderConfig(vocab_size=VOCAB))


def _moe() -> nn.Module:
    # Every token goes to every expert: bf16 router logits cannot flip a top-k choice against the fp32
    # reference (no routing tie to sit on), while dispatch and combine still cross the ep ranks.
    return MoEDecoder(MoEDecoderConfig(vocab_size=VOCAB, num_experts=4, num_experts_per_tok=4))


def _bf16_ddp(model: nn.Module, ctx: MeshContext) -> nn.Module:
    return parallelize_model(model.to(torch.bfloat16), ctx)


def _cases() -> list[Parity]:
    default = FSDP2Config()  # bf16 params, fp32 reduce
    assert default.mp_policy is not None and default.mp_policy.param_dtype == torch.bfloat16
    sp = FSDP2Config(sequence_parallel=True)
    cases = [
        run_parity("fsdp2", _dense, MeshContext.build(default), VOCAB),
        run_parity("hsdp", _dense, MeshContext.build(default, ParallelismSizes(dp_replicate_size=2)), VOCAB),
        run_parity("tp_sp", _dense, MeshContext.build(sp, ParallelismSizes(tp_size=2)), VOCAB),
        run_parity(
            "moe_ep",
            _moe,
            MeshContext.build(default, ParallelismSizes(ep_size=2), moe_config=MoEConfig()),
            VOCAB,
        ),
        run_parity("ddp", _dense, MeshContext.build(DDPConfig()), VOCAB, parallelize=_bf16_ddp),
    ]
    return cases


def test_every_strategy_matches_the_fp32_reference_in_bf16() -> None:
    results = run_on_ranks(_cases, 4)
    assert_parity(results, BF16)
    for rank in results:
        by_case = {p.case: p for p in rank}
        assert set(by_case) == {"fsdp2", "hsdp", "tp_sp", "moe_ep", "ddp"}
        # bf16 really ran: the fp32 tolerances would refuse each case.
        for case, p in by_case.items():
            assert p.loss_diff > 1e-5 or p.grad_diff > 1e-5, (case, p)
