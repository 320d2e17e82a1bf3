"""The op-level activation-checkpoint policy: which ops' outputs to save, the rest recomputed."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts


def _existing(namespace: Any, names: Iterable[str]) -> frozenset[Any]:
    return frozenset(getattr(namespace, name).default for name in names if hasattr(namespace, name))


_MATMUL_OPS: frozenset[Any] = _existing(torch.ops.aten, ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm"))
"""Matmul ops; selective mode saves every other one (the 1st, 3rd, ... of each layer call)."""

_ATTENTION_OPS: frozenset[Any] = _existing(
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

_COLLECTIVE_OPS: frozenset[Any] = _existing(
    torch.ops._c10d_functional,
    ("reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce", "all_to_all_single"),
)
"""Functional collectives; always saved in selective mode (recomputing them would communicate again)."""

_ALWAYS_SAVED = _ATTENTION_OPS | _COLLECTIVE_OPS

_FACTORY_OPS: frozenset[Any] = frozenset(
    getattr(packet, overload)
    for name in (
        "zeros",
        "zeros_like",
        "ones",
        "ones_like",
        "empty",
        "empty_like",
        "full",
        "full_like",
        "new_zeros",
        "new_ones",
        "new_empty",
        "new_full",
        "arange",
        "scalar_tensor",
    )
    if (packet := getattr(torch.ops.aten, name, None)) is not None
    for overload in packet.overloads()
)
"""Ops that make a fresh tensor from shapes alone. Inside ``save_inside`` modules they, and the
in-place ops that fill them, are recomputed: transformers' DeepseekV3TopkRouter builds its group mask
with ``zeros_like`` then ``scatter_``, and a cached mask would be mutated ("Tensor cached during
selective activation checkpoint has been mutated"). The recompute rebuilds the mask from the saved
top-k indices, so the routing is still the forward's."""

_PROFILER_OPS: frozenset[Any] = frozenset(
    getattr(getattr(torch.ops.profiler, name), overload)
    for name, overload in (
        ("_record_function_enter", "default"),
        ("_record_function_enter_new", "default"),
        ("_record_function_exit", "_RecordFunction"),
    )
    if hasattr(torch.ops.profiler, name)
)
"""``record_function`` markers: they carry no values, and FSDP's hooks emit a different number of
them in a forward and in its recompute."""


def _ignore_profiler_ops() -> None:
    """Keep ``record_function`` markers out of selective checkpointing's saved-op accounting.

    torch 2.15 (the locked version) saves every effectful op in a selective region unless the policy
    says MUST_RECOMPUTE, and replays by per-op index. A nested FSDP unit (experts on the ep_shard mesh)
    recomputed in backward finds no forward root and emits an extra ``FSDP::root_pre_forward``
    marker, so the indices stop matching ("invocation index 2 ... not found in storage";
    pytorch/torchtitan#3427; fix proposed in pytorch/pytorch#185178, not in 2.15).
    ``SAC_IGNORED_OPS`` is torch's public set of ops both passes run without accounting.
    """
    SAC_IGNORED_OPS.update(_PROFILER_OPS)


class ForwardDepth:
    """How deep the running forward (or its recompute) is inside the watched modules.

    Forward pre- and post-hooks on every watched module raise and lower the depth; the post-hook
    runs even when the forward raises.
    """

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.depth = 0
        for module in modules:
            module.register_forward_pre_hook(self._enter)
            module.register_forward_hook(self._exit, always_call=True)

    def _enter(self, module: nn.Module, args: Any) -> None:
        self.depth += 1

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        self.depth -= 1


def selective_policy(
    *, selective: bool = True, save_inside: ForwardDepth | None = None
) -> Callable[..., CheckpointPolicy]:
    """Return a fresh op-level policy for ``create_selective_checkpoint_contexts``.

    In order: every op run inside a ``save_inside`` module is saved (but those that only make a fresh
    tensor, :data:`_FACTORY_OPS`); then, with ``selective``, the
    1st, 3rd, ... matmul of each checkpointed call, attention kernels and functional collectives are
    saved; everything else is recomputed. The forward and the recompute keep separate matmul counters, so both walk the same
    sequence and agree on which matmuls were saved (torch versions that consult the policy again
    during recompute need this; newer ones replay the forward's decisions).
    """
    counters = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if save_inside is not None and save_inside.depth:
            fresh = op in _FACTORY_OPS or op._schema.is_mutable  # see _FACTORY_OPS
            return CheckpointPolicy.PREFER_RECOMPUTE if fresh else CheckpointPolicy.MUST_SAVE
        if not selective:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if op in _MATMUL_OPS:
            key = "recompute" if ctx.is_recompute else "forward"
            counters[key] += 1
            keep = counters[key] % 2 == 1
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in _ALWAYS_SAVED else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _contexts(selective: bool, save_inside: ForwardDepth | None) -> tuple[Any, Any]:
    # A fresh policy (fresh counters) for every checkpointed call.
    return create_selective_checkpoint_contexts(
        selective_policy(selective=selective, save_inside=save_inside)
    )


def policy_context_fn(
    *, selective: bool, save_inside: ForwardDepth | None = None
) -> Callable[[], tuple[Any, Any]]:
    """Return a ``context_fn`` for ``torch.utils.checkpoint`` running :func:`selective_policy`."""
    _ignore_profiler_ops()
    return partial(_contexts, selective, save_inside)
