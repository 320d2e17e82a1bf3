"""Op-level activation-checkpoint policy: which ops' outputs to save, the rest recomputed."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts


def _existing(namespace: Any, names: Iterable[str]) -> frozenset[Any]:
    return frozenset(getattr(namespace, name).default for name in names if hasattr(namespace, name))


MATMUL_OPS: frozenset[Any] = _existing(torch.ops.aten, ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm"))
"""Matmul ops; selective mode saves every other one (the 1st, 3rd, ... of each layer call)."""

ATTENTION_OPS: frozenset[Any] = _existing(
    torch.ops.aten,
    (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    ),
)
"""Attention kernels; always saved in selective mode."""

COLLECTIVE_OPS: frozenset[Any] = _existing(
    torch.ops._c10d_functional,
    ("reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce", "all_to_all_single"),
)
"""Functional collectives; always saved in selective mode (recomputing them would communicate again)."""


def _overloads(ops: Iterable[Any]) -> frozenset[Any]:
    """Expand op packets (``torch.ops.aten.topk``) into their overloads; keep overloads as they are."""
    out: set[Any] = set()
    for op in ops:
        if isinstance(op, torch._ops.OpOverloadPacket):
            out.update(getattr(op, name) for name in op.overloads())
        else:
            out.add(op)
    return frozenset(out)


def selective_policy(
    save_ops: Iterable[Any] | None = None, *, alternate_matmuls: bool = True
) -> Callable[..., Any]:
    """Return a fresh op-level policy for ``create_selective_checkpoint_contexts``.

    With ``alternate_matmuls`` the 1st, 3rd, ... matmul of each checkpointed call is saved and
    attention kernels and functional collectives are saved too; ``save_ops`` are always saved;
    everything else is recomputed. The forward and the recompute keep separate matmul counters, so
    both walk the same sequence and agree on which matmuls were saved (torch versions that consult
    the policy again during recompute need this; newer ones replay the forward's decisions).
    """
    save = _overloads(save_ops or ())
    if alternate_matmuls:
        save |= ATTENTION_OPS | COLLECTIVE_OPS
    counters = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if alternate_matmuls and op in MATMUL_OPS:
            key = "recompute" if ctx.is_recompute else "forward"
            counters[key] += 1
            keep = counters[key] % 2 == 1
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _contexts(save_ops: frozenset[Any], alternate_matmuls: bool) -> tuple[Any, Any]:
    # A fresh policy (fresh counters) for every checkpointed call.
    return create_selective_checkpoint_contexts(
        selective_policy(save_ops, alternate_matmuls=alternate_matmuls)
    )


def selective_context_fn(save_ops: Iterable[Any] | None = None) -> Callable[[], tuple[Any, Any]]:
    """Return a ``context_fn`` for ``torch.utils.checkpoint`` with the selective policy.

    Saves attention kernels, functional collectives, every other matmul and ``save_ops`` (op
    overloads or packets); everything else is recomputed in backward.
    """
    return partial(_contexts, _overloads(save_ops or ()), True)


def save_only_context_fn(save_ops: Iterable[Any]) -> Callable[[], tuple[Any, Any]]:
    """Return a ``context_fn`` that saves only ``save_ops`` (e.g. a router's top-k) and recomputes the rest."""
    return partial(_contexts, _overloads(save_ops), False)
