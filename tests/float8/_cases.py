"""Float8 parity cases: the float8 model through ``parallelize_model`` against the same float8 model unsharded.

The reference is the plain decoder converted by the same step on one process (``apply_float8`` with the
plan ``plan_float8`` makes for it), so the comparison isolates what sharding changes. The driver runs
the reference on each data-parallel micro-batch separately, so its activation scales are those each
rank computes; TP ranks scale with amaxes taken over the whole DTensor, as the unsharded model does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist
from torch import nn

from plait.float8 import apply_float8, plan_float8
from plait.mesh import Float8Config, FSDP2Config, MeshContext, ParallelismSizes
from plait.models import DecoderConfig, DenseDecoder
from plait.sidecar import get_parallel_plan, parallelize_model
from plait.testing import FP32, Parity, paired, run_parity, token_batches

__all__ = ["FLOAT8_TP", "VOCAB", "check", "converted", "decoder", "float8_case", "float8_linears"]

VOCAB = 128

FLOAT8_TP = dataclasses.replace(FP32, param=1e-2, adamw_loss=5e-2)
"""Under TP: step 0 (loss, every gradient) at the fp32 contract; after the weights moved, a band.

From identical weights TP changes only fp32 summation order, and these seeds cross no float8 rounding
boundary at step 0 (measured: loss 0, gradients <= 9.3e-7 relative). After an optimizer step one
element whose value moved by an fp32 ulp can round to the neighbouring float8 value (1/16 of it for
e4m3, 1/4 for e5m2 gradients), and the change cascades into more such crossings: measured on FSDP x
TP, parameters after 2 SGD steps 2.2e-3 apart and AdamW losses 1.7e-2 — as far as float8 is from fp32
on this model. So only step 0 tells a defect from rounding; the band after it catches what breaks
training (weights that stop moving, diverging losses)."""


def decoder() -> nn.Module:
    """A 2-layer decoder whose every projection is float8-eligible at tp 2 (dims multiples of 32)."""
    return DenseDecoder(
        DecoderConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4)
    )


def float8_linears(model: nn.Module) -> list[str]:
    """FQNs of the model's torchao ``Float8Linear`` modules (wrapper segments removed)."""
    from torchao.float8.float8_linear import Float8Linear

    return [
        fqn.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        for fqn, m in model.named_modules()
        if isinstance(m, Float8Linear)
    ]


def converted(model: nn.Module, config: Float8Config) -> None:
    """The reference's conversion: the same step on the unsharded model (no TP, CPU: emulated)."""
    apply_float8(model, plan_float8(model, config, device_type="cpu"))


def float8_case(
    case: str, sizes: ParallelismSizes, options: dict[str, Any], ac: str | bool = False
) -> tuple[Parity, list[str], list[str], dict[str, Any]]:
    """One parity run; also the converted modules of both sides and the plan's float8 decision."""
    cfg = FSDP2Config(mp_policy=None, **options)
    ctx = MeshContext.build(cfg, sizes, activation_checkpointing=ac)
    group = ctx.dp_mesh().get_group()
    dp_rank, dp_size = dist.get_rank(group), dist.get_world_size(group)
    models: dict[str, nn.Module] = {}

    def inspect(reference: nn.Module, parallel: nn.Module) -> dict[str, Any]:
        models.update(reference=reference, parallel=parallel)
        return {}

    parity = run_parity(
        paired(decoder, lambda m: parallelize_model(m, ctx)),
        token_batches(VOCAB, dp_size, batch=2, seq=16),
        dp_rank=dp_rank,
        case=case,
        prepare_reference=lambda m: converted(m, cfg.float8),
        inspect=inspect,
    )
    plan = get_parallel_plan(models["parallel"])
    return (
        parity,
        float8_linears(models["reference"]),
        float8_linears(models["parallel"]),
        plan.describe()["float8"],
    )


def check(results: list[tuple[Parity, list[str], list[str], dict[str, Any]]]) -> None:
    """Every rank: within the tolerance (``FLOAT8_TP`` with TP, else ``FP32``), and both sides converted
    the same, non-empty set of linears."""
    for parity, reference, parallel, _ in results:
        parity.check(FLOAT8_TP if parity.case.startswith(("tp", "fsdp_tp")) else FP32)
        assert reference and sorted(reference) == sorted(parallel), (parity.case, reference, parallel)
