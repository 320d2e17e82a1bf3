"""``precompute_float8_scales`` after each optimizer step: FSDP2's float8 all-gather on gloo, and why every step.

gloo carries FSDP2's float8 all-gather (torchao sends the float8 bytes through FSDP's byte buffer),
so ``fsdp_all_gather`` is built on CPU; its parity with the unsharded model is in test_parity.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from plait.float8 import precompute_float8_scales
from plait.mesh import Float8Config, FSDP2Config, MeshContext
from plait.sidecar import parallelize_model
from plait.testing import make_batch, run_on_ranks
from tests.float8._cases import VOCAB, decoder


def _scales(model: nn.Module) -> list[torch.Tensor | None]:
    return [
        getattr(p._local_tensor, "_precomputed_scale", None)  # where torchao keeps it
        for n, p in model.named_parameters()
        if isinstance(p, DTensor) and n.endswith("proj.weight")
    ]


def _losses(schedule: str, all_gather: bool = True) -> tuple[list[float], list[bool]]:
    """Four SGD steps; ``precompute_float8_scales`` after ``every`` step, ``never``, or only the ``first``."""
    ctx = MeshContext.build(FSDP2Config(mp_policy=None, float8=Float8Config(fsdp_all_gather=all_gather)))
    torch.manual_seed(0)
    model = parallelize_model(decoder(), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, set_after = [], []
    for step in range(4):
        ids, labels = make_batch(VOCAB, 2, 16, seed=100 * step + dist.get_rank())
        loss = F.cross_entropy(model(input_ids=ids).flatten(0, -2), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if schedule == "every" or (schedule == "first" and step == 0):
            precompute_float8_scales(model)
        set_after.append(all(s is not None for s in _scales(model)) and bool(_scales(model)))
        losses.append(float(loss.detach()))
    return losses, set_after


def _schedules() -> dict[str, tuple[list[float], list[bool]]]:
    return {s: _losses(s) for s in ("every", "never", "first")} | {
        "plain": _losses("every", all_gather=False)
    }


def test_precompute_after_every_step_matches_the_dynamic_scales_and_a_stale_scale_does_not() -> None:
    for result in run_on_ranks(_schedules, 2):
        every, never, first = (result[s][0] for s in ("every", "never", "first"))
        assert result["every"][1] == [True] * 4, (
            "precompute_float8_scales left no scale on the float8 weights"
        )
        assert result["never"][1] == [False] * 4
        assert every == never, (every, never)  # the same scales, one all-reduce instead of one per weight
        assert first[:2] == every[:2] and first[2:] != every[2:], (first, every)  # a scale two steps old
        assert result["plain"][1] == [False] * 4  # no float8 all-gather: a no-op
