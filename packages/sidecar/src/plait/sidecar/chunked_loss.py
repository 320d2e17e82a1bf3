"""Chunked linear cross-entropy: the output head's matmul and the loss, chunk by chunk over tokens.

The full ``[tokens, vocab]`` logits are never materialised. Each chunk's logits live only inside
the forward and are recomputed in the backward; what is saved is the hidden states, the head
weight (by reference), the labels and one fp32 log-sum-exp per token.

Two entries:

* :func:`chunked_linear_cross_entropy` ``(hidden, weight, labels)``: per-token losses. With a plain
  weight it is a local computation. With a vocabulary-parallel weight (a ``DTensor`` ``Shard(0)`` on a
  1-D tensor-parallel mesh, the loss-parallel head) each chunk's logits stay vocab-sharded: the row
  max, the sum of exponentials and the target logit are all-reduced over the TP group (loss parallel
  per chunk), and the hidden states' gradient is summed over the group in backward.
* :func:`chunked_loss` ``(model, labels)``: a context in which ``model(...)`` returns the per-token
  losses in place of its logits. It intercepts the head's ``F.linear`` call (a ``TorchFunctionMode``,
  matched by the head's weight), so the loss runs inside the head module's forward: under FSDP2 the
  head weight there is the unsharded one and FSDP's forward/backward hooks see the loss as the head's
  output; the TP plan's hooks lay it out like logits. No module is replaced or patched.

:func:`chunked_loss_sum` turns either result into the plain scalar sum over tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.overrides import TorchFunctionMode

from plait.tp import model_embeddings

__all__ = ["check_chunked_loss_model", "chunked_linear_cross_entropy", "chunked_loss", "chunked_loss_sum"]

DEFAULT_CHUNK_TOKENS = 1024
"""Tokens per chunk: the largest logits block alive is ``chunk_tokens x local vocabulary`` in fp32."""


def _check_arguments(labels: torch.Tensor, chunk_tokens: int) -> None:
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int):
        raise TypeError(f"chunk_tokens must be an int, got {chunk_tokens!r}; use e.g. chunk_tokens=1024")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}; use e.g. chunk_tokens=1024")
    if isinstance(labels, DTensor) or labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels must be a plain integer tensor, got {type(labels).__name__} {labels.dtype}")


def _check_labels(labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Every label is a vocabulary id or ``ignore_index`` (checked on every rank, before any collective)."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        value = int(labels[bad][0])
        raise ValueError(
            f"label {value} is outside the vocabulary [0, {vocab}) and is not ignore_index {ignore_index}; "
            "fix the data or the model's vocab_size"
        )


def _vocab_shard(weight: torch.Tensor) -> tuple[torch.Tensor, int, int, dist.ProcessGroup | None]:
    """``(local rows, first row's vocabulary id, vocabulary size, TP group)`` of the head weight."""
    if not isinstance(weight, DTensor):
        return weight, 0, weight.shape[0], None
    mesh, placements = weight.device_mesh, tuple(weight.placements)
    if mesh.ndim != 1 or placements != (Shard(0),):
        raise ValueError(
            f"the head weight is a DTensor on a {mesh.ndim}-D mesh with placements {placements}; the chunked "
            "loss takes a plain weight or a vocabulary-parallel one (Shard(0) on the 1-D TP mesh, as "
            "plait.tp.loss_parallel_head lays it out); call it where FSDP has unsharded the weight"
        )
    vocab, size = weight.shape[0], mesh.size()
    rows = -(-vocab // size)
    start = min(mesh.get_local_rank() * rows, vocab)
    return weight.to_local(), start, vocab, mesh.get_group()


def _local_hidden(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The hidden states as a plain tensor; a DTensor must be replicated on the weight's mesh."""
    if not isinstance(hidden, DTensor):
        return hidden
    if not isinstance(weight, DTensor) or hidden.device_mesh != weight.device_mesh:
        raise ValueError(
            "hidden is a DTensor on another mesh than the head weight's; pass both on the TP mesh"
        )
    if any(not p.is_replicate() for p in hidden.placements):
        hidden = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim)
    return hidden.to_local()


def _targets(
    labels: torch.Tensor, start: int, rows: int, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each label's row in this vocabulary shard (0 where not here) and whether this shard holds it."""
    here = (labels != ignore_index) & (labels >= start) & (labels < start + rows)
    return torch.where(here, labels - start, 0), here


def _all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None, op: dist.ReduceOp.RedOpType) -> None:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token losses of ``hidden @ weight.T`` (local vocabulary rows), chunk by chunk over tokens."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        start: int,
        group: dist.ProcessGroup | None,
        chunk: int,
        ignore_index: int,
        shape: tuple[int, ...],
    ) -> torch.Tensor:
        # allocated in labels' shape: a view of a flat result would be FSDP2's "returned a view" case
        result = torch.zeros(shape, dtype=torch.float32, device=hidden.device)
        losses = result.view(-1)
        lse = torch.zeros_like(losses)
        for s in range(0, labels.shape[0], chunk):
            y = labels[s : s + chunk]
            z = (hidden[s : s + chunk] @ weight.T).float()
            rows, here = _targets(y, start, weight.shape[0], ignore_index)
            target = z.gather(1, rows[:, None])[:, 0] * here
            peak = z.max(dim=-1).values if z.shape[1] else torch.full_like(y, -torch.inf, dtype=z.dtype)
            _all_reduce(peak, group, dist.ReduceOp.MAX)
            sums = torch.stack([z.sub_(peak[:, None]).exp_().sum(-1), target])  # in place: one chunk block
            _all_reduce(sums, group, dist.ReduceOp.SUM)
            lse[s : s + chunk] = peak + sums[0].log()
            losses[s : s + chunk] = torch.where(y != ignore_index, lse[s : s + chunk] - sums[1], 0.0)
            del z  # before the next chunk's block is made
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.start, ctx.group, ctx.chunk, ctx.ignore_index = start, group, chunk, ignore_index
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, labels, lse = ctx.saved_tensors
        grad = grad.reshape(-1)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for s in range(0, labels.shape[0], ctx.chunk):
            h, y = hidden[s : s + ctx.chunk], labels[s : s + ctx.chunk]
            rows, here = _targets(y, ctx.start, weight.shape[0], ctx.ignore_index)
            p = (h @ weight.T).float().sub_(lse[s : s + ctx.chunk, None]).exp_()
            p[here.nonzero()[:, 0], rows[here]] -= 1.0
            p *= torch.where(y != ctx.ignore_index, grad[s : s + ctx.chunk], 0.0)[:, None]
            grad_hidden[s : s + ctx.chunk] = p.to(weight.dtype) @ weight
            grad_weight.addmm_(p.T, h.float())
            del p
        _all_reduce(grad_hidden, ctx.group, dist.ReduceOp.SUM)  # each rank held part of the vocabulary
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Per-token cross-entropy of ``hidden @ weight.T`` against ``labels``, never holding all logits.

    Equals ``F.cross_entropy(F.linear(hidden, weight).float().flatten(0, -2), labels.flatten(),
    reduction="none")`` (0 at ``ignore_index``), in fp32.

    Args:
        hidden: ``[..., hidden_size]`` final hidden states (a replicated DTensor on the TP mesh allowed).
        weight: ``[vocab, hidden_size]`` head weight, plain or ``Shard(0)`` on a 1-D TP mesh.
        labels: ``[...]`` target ids, ``hidden.shape[:-1]``.
        chunk_tokens: tokens per chunk.
        ignore_index: label that contributes no loss.

    Returns:
        fp32 losses of ``labels``'s shape: a plain tensor, or a replicated DTensor for a sharded weight.

    Raises:
        TypeError / ValueError: a wrong ``chunk_tokens``, shapes or labels, or a weight layout not listed.
    """
    _check_arguments(labels, chunk_tokens)
    if tuple(hidden.shape[:-1]) != tuple(labels.shape) or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and labels {tuple(labels.shape)} do "
            "not fit: need hidden [..., H], weight [vocab, H] and labels hidden.shape[:-1]"
        )
    local_weight, start, vocab, group = _vocab_shard(weight)
    _check_labels(labels, vocab, ignore_index)
    local = _local_hidden(hidden, weight).reshape(-1, hidden.shape[-1])
    losses = _ChunkedCrossEntropy.apply(
        local, local_weight, labels.reshape(-1), start, group, chunk_tokens, ignore_index, tuple(labels.shape)
    )
    if isinstance(weight, DTensor):
        return DTensor.from_local(losses, weight.device_mesh, [Replicate()], run_check=False)
    return losses


def chunked_loss_sum(losses: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The sum of per-token losses as a plain scalar (a DTensor's over all its shards).

    Raises:
        ValueError: a plain tensor not of ``labels``'s shape (a head style that hands back local shards).
    """
    if isinstance(losses, DTensor):
        return losses.sum().full_tensor()
    if tuple(losses.shape) != tuple(labels.shape):
        raise ValueError(
            f"per-token losses {tuple(losses.shape)} do not match labels {tuple(labels.shape)}: the head's TP "
            "style returned a local shard; use plait.tp.loss_parallel_head (use_local_output=False)"
        )
    return losses.sum()


def _output_head(model: nn.Module) -> nn.Module:
    inner = getattr(model, "module", model)  # DistributedDataParallel wraps as .module
    head = model_embeddings(inner, "get_output_embeddings") or getattr(inner, "lm_head", None)
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"{type(inner).__name__} has no nn.Linear output head (get_output_embeddings() or lm_head); "
            "pass head=<the module applying the vocabulary projection>"
        )
    if head.bias is not None:
        raise ValueError(f"the output head {head} has a bias; the chunked loss supports bias-free heads only")
    return head


def _check_logit_transforms(model: nn.Module) -> None:
    """Refuse models that change the logits after the head (the loss would be transformed instead)."""
    config = getattr(getattr(model, "module", model), "config", None)
    transforms = {
        "final_logit_softcapping": None,
        "logit_scale": None,
        "logits_scaling": 1.0,
        "output_multiplier_scale": None,
    }
    for name, neutral in transforms.items():
        value = getattr(config, name, neutral)
        if value is not None and value != neutral:
            raise ValueError(
                f"{type(config).__name__}.{name}={value!r} transforms the logits after the head; the chunked "
                "loss would transform the losses instead: use the full loss for this model"
            )


def check_chunked_loss_model(model: nn.Module) -> nn.Module:
    """The output head :func:`chunked_loss` would use (a meta model is fine); changes nothing.

    Raises:
        ValueError: no bias-free ``nn.Linear`` head, or logits transformed after the head.
    """
    head = _output_head(model)
    _check_logit_transforms(model)
    return head


class _HeadLossMode(TorchFunctionMode):
    """Replace the one ``F.linear`` call on the head's weight by the chunked per-token loss."""

    def __init__(self, head: nn.Module, labels: torch.Tensor, chunk_tokens: int, ignore_index: int) -> None:
        super().__init__()
        self.head, self.labels = head, labels
        self.chunk_tokens, self.ignore_index = chunk_tokens, ignore_index
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.linear or len(args) < 2 or args[1] is not self.head.weight:
            return func(*args, **kwargs)
        self.calls += 1
        if self.calls > 1:
            raise ValueError(
                "the output head ran twice in one forward under chunked_loss; bind labels per call"
            )
        return chunked_linear_cross_entropy(
            args[0], args[1], self.labels, chunk_tokens=self.chunk_tokens, ignore_index=self.ignore_index
        )


@contextlib.contextmanager
def chunked_loss(
    model: nn.Module,
    labels: torch.Tensor,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ignore_index: int = -100,
    head: nn.Module | None = None,
) -> Iterator[None]:
    """Inside, one ``model(...)`` forward returns per-token losses (``labels``'s shape) in place of logits.

    The head's ``F.linear`` call becomes :func:`chunked_linear_cross_entropy` (matched by the head's
    current weight, which under FSDP2 is the unsharded one). Works on the plain, the TP (loss-parallel
    head), the FSDP2 and the FSDP2 x TP model alike; sum with :func:`chunked_loss_sum`, then backward
    (outside the context is fine). The head must not run under activation checkpointing (the recompute
    would run outside the context), nor the forward under ``torch.compile``.

    Raises:
        ValueError: no bias-free ``nn.Linear`` head, logits transformed after the head (soft-capping,
            scaling), a head that ran twice, or never (checked on exit).
    """
    found = check_chunked_loss_model(model)
    head = head if head is not None else found
    _check_arguments(labels, chunk_tokens)
    mode = _HeadLossMode(head, labels, chunk_tokens, ignore_index)
    with mode:
        yield
    if mode.calls == 0:
        raise ValueError(
            f"the model's forward never applied its head {type(head).__name__} with F.linear under chunked_loss; "
            "call model(...) inside the context, with a head that is a plain nn.Linear"
        )
