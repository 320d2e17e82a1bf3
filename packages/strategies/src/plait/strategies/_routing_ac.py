"""Keep MoE routing fixed under activation checkpointing: save every op a router runs, never recompute it.

A recomputed router can pick different experts than the forward did (non-deterministic kernels, ties in
top-k), which changes the token counts and breaks the all-to-all or silently corrupts gradients. After
:func:`plait.sharding.apply_activation_checkpointing` has wrapped the layers, each checkpoint wrapper that
contains a router gets a selective-checkpoint policy that marks the ops run inside a router's forward
(projection, softmax, top-k, ...) ``MUST_SAVE``; on recompute their saved outputs are reused. Other ops
follow the mode: ``full`` recomputes them, ``selective`` keeps plait.sharding's selective rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from plait.sharding.selective import ATTENTION_OPS, COLLECTIVE_OPS, MATMUL_OPS


class _RouterDepth:
    """How deep the running forward is inside router modules (forward hooks on every router)."""

    def __init__(self, routers: Sequence[nn.Module]) -> None:
        self.depth = 0
        for router in routers:
            router.register_forward_pre_hook(self._enter)
            router.register_forward_hook(self._exit, always_call=True)

    def _enter(self, module: nn.Module, args: Any) -> None:
        self.depth += 1

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        self.depth -= 1


def _policy(
    routing: _RouterDepth, selective: bool, counters: dict[str, int]
) -> Callable[..., CheckpointPolicy]:
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if getattr(op, "namespace", None) == "profiler":
            # record_function markers (FSDP's hooks emit them) carry no values and differ in number
            # between forward and recompute; saving them would misalign the saved-op indices.
            return CheckpointPolicy.PREFER_RECOMPUTE
        if routing.depth:
            return CheckpointPolicy.MUST_SAVE
        if not selective:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if op in MATMUL_OPS:
            key = "recompute" if ctx.is_recompute else "forward"
            counters[key] += 1
            return CheckpointPolicy.MUST_SAVE if counters[key] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
        if op in ATTENTION_OPS or op in COLLECTIVE_OPS:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _contexts(routing: _RouterDepth, selective: bool) -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_policy(routing, selective, {"forward": 0, "recompute": 0}))


def save_routing_under_checkpoint(model: nn.Module, routers: Sequence[nn.Module], *, selective: bool) -> int:
    """Give every checkpoint wrapper of ``model`` that contains a router the routing-saving policy.

    Args:
        model: The model after :func:`plait.sharding.apply_activation_checkpointing`.
        routers: The router (or gate) modules whose ops must be saved.
        selective: The layers were checkpointed in ``selective`` mode (keep its matmul/attention rule).

    Returns:
        The number of wrappers rewired.
    """
    router_ids = {id(r) for r in routers}
    wrappers = [
        m
        for m in model.modules()
        if isinstance(m, CheckpointWrapper) and any(id(s) in router_ids for s in m.modules())
    ]
    if not wrappers:
        return 0
    context_fn = partial(_contexts, _RouterDepth(routers), selective)
    for wrapper in wrappers:
        current = wrapper.checkpoint_fn
        assert isinstance(current, partial), type(current)
        wrapper.checkpoint_fn = partial(
            current.func, *current.args, **{**current.keywords, "context_fn": context_fn}
        )
    return len(wrappers)
