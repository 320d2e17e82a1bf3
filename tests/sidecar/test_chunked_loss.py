"""The chunked linear cross-entropy against the plain loss: plain head, TP loss parallel, FSDP2, FSDP2 x TP.

Each parity case trains the unsharded reference with the driver's full-logits loss and the parallel
model with ``chunked_loss`` (5-token chunks: 16 tokens per micro-batch end in a ragged chunk), and
compares the fp32 loss, every parameter's gradient, the parameters after SGD and the AdamW losses.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes
from plait.models import DecoderConfig, DenseDecoder
from plait.sidecar import chunked_linear_cross_entropy, chunked_loss, chunked_loss_sum, parallelize_model
from plait.testing import (
    Inputs,
    Parity,
    assert_parity,
    full_tensor,
    logits_of,
    paired,
    run_on_ranks,
    run_parity,
    token_batches,
)
from plait.tp import apply_tp, llama_tp_plan
from tests.sidecar._parity import dp_coordinates

VOCAB = 160
CHUNK = 5


def _dense() -> nn.Module:
    return DenseDecoder(DecoderConfig(vocab_size=VOCAB))


def _chunked_step(model: nn.Module, batch: Inputs) -> torch.Tensor:
    """The micro-batch's mean token loss through ``chunked_loss``, back-propagated."""
    kwargs, labels = batch
    with chunked_loss(model, labels, chunk_tokens=CHUNK):
        losses = logits_of(model(**kwargs))
    assert losses.shape == labels.shape, losses.shape  # per-token losses, never [tokens, vocab] logits
    loss = chunked_loss_sum(losses, labels) / labels.numel()
    loss.backward()
    return loss.detach()


def _parity(case: str, parallelize: Callable[[nn.Module], nn.Module], dp_rank: int, dp_size: int) -> Parity:
    return run_parity(
        paired(_dense, parallelize),
        token_batches(VOCAB, dp_size, batch=2, seq=8),
        dp_rank=dp_rank,
        case=case,
        parallel_step=_chunked_step,
    )


def _plain() -> Parity:
    return _parity("plain", lambda model: model, 0, 1)


def _tp() -> Parity:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    return _parity("tp", lambda model: apply_tp(model, mesh, llama_tp_plan(model, False)), 0, 1)


def _fsdp(sizes: ParallelismSizes, sequence_parallel: bool = False) -> Parity:
    ctx = MeshContext.build(FSDP2Config(mp_policy=None, sequence_parallel=sequence_parallel), sizes)
    dp_rank, dp_size = dp_coordinates(ctx)
    return _parity(f"fsdp tp{sizes.tp_size}", lambda model: parallelize_model(model, ctx), dp_rank, dp_size)


def test_plain_head_matches_the_full_loss() -> None:
    assert_parity(run_on_ranks(_plain, 1))


def test_tp_loss_parallel_head_matches_the_full_loss() -> None:
    assert_parity(run_on_ranks(_tp, 2))


def test_fsdp2_head_matches_the_full_loss() -> None:
    assert_parity(run_on_ranks(_fsdp, 2, ParallelismSizes()))


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_fsdp2_tp_head_matches_the_full_loss(sequence_parallel: bool) -> None:
    assert_parity(run_on_ranks(_fsdp, 4, ParallelismSizes(tp_size=2), sequence_parallel))


def _reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight).float().flatten(0, -2)
    return F.cross_entropy(logits, labels.flatten(), reduction="none").view(labels.shape)


def _inputs(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 7, 16, generator=gen)
    weight = torch.randn(vocab, 16, generator=gen)
    labels = torch.randint(vocab, (3, 7), generator=gen)
    labels[0, :3] = -100
    return hidden, weight, labels


def _grads_diff(
    vocab: int,
    chunked: Callable[..., torch.Tensor],
    shard: Callable[[torch.Tensor], torch.Tensor] = lambda w: w,
) -> tuple[float, float, float]:
    """Loss and both gradients (relative to the reference's max) of ``chunked`` vs the full loss.

    ``shard`` lays out the chunked side's weight leaf (a DTensor is gathered back for the comparison).
    """
    hidden, weight, labels = _inputs(vocab)
    results = []
    for fn, layout in ((_reference, lambda w: w), (chunked, shard)):
        h, w = hidden.clone().requires_grad_(), layout(weight.clone()).requires_grad_()
        loss = fn(h, w, labels)
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        (loss * torch.linspace(0.5, 1.5, loss.numel()).view(loss.shape)).sum().backward()
        results.append((loss.detach(), h.grad, full_tensor(w.grad)))
    (ref_l, ref_h, ref_w), (got, g_h, g_w) = results
    assert float(got[0, :3].abs().max()) == 0.0  # ignored tokens: no loss
    return (
        float((got - ref_l).abs().max() / ref_l.abs().max()),
        float((g_h - ref_h).abs().max() / ref_h.abs().max()),
        float((g_w - ref_w).abs().max() / ref_w.abs().max()),
    )


def _chunked(chunk: int) -> Callable[..., torch.Tensor]:
    return lambda h, w, y: chunked_linear_cross_entropy(h, w, y, chunk_tokens=chunk)


def test_function_matches_per_token_cross_entropy_with_ignored_labels() -> None:
    for chunk in (1, 4, 21, 64):
        diffs = _grads_diff(37, _chunked(chunk))
        assert max(diffs) <= 1e-5, (chunk, diffs)


def _sharded_uneven() -> tuple[float, float, float]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return _grads_diff(37, _chunked(4), lambda w: distribute_tensor(w, mesh, [Shard(0)]))  # 19 + 18 rows


def test_vocab_sharded_weight_with_uneven_shards() -> None:
    for diffs in run_on_ranks(_sharded_uneven, 2):
        assert max(diffs) <= 1e-5, diffs


def test_refusals_name_the_value() -> None:
    hidden, weight, labels = _inputs(37)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        chunked_linear_cross_entropy(hidden, weight, labels, chunk_tokens=0)
    with pytest.raises(ValueError, match="label 37 is outside the vocabulary"):
        chunked_linear_cross_entropy(hidden, weight, torch.full_like(labels, 37))
    with pytest.raises(ValueError, match="do not fit"):
        chunked_linear_cross_entropy(hidden, weight, labels[:, :3])
    model = _dense()
    with pytest.raises(ValueError, match="never applied its head"), chunked_loss(model, labels):
        pass
    model.lm_head.bias = nn.Parameter(torch.zeros(VOCAB))
    with pytest.raises(ValueError, match="has a bias"), chunked_loss(model, labels):
        pass
