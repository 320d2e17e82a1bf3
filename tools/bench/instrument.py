"""Measurement helpers for the side-by-side benchmark: collective bytes, held bytes, RSS, timing.

Collectives are counted by a ``TorchDispatchMode`` that is active only around the measured step.
Both the ``c10d::*`` ops (what ``torch.distributed.all_gather_single`` / ``reduce_scatter_single`` /
``all_reduce`` dispatch to — the entry points FSDP2 calls in torch 2.15) and the
``_c10d_functional::*`` ops (what DTensor redistribution calls) pass through the dispatcher, so
one mode sees both. For a DTensor argument the mode returns ``NotImplemented`` first, letting
DTensor desugar into plain collectives, which the mode then sees (the trick torch's own
``CommDebugMode`` uses). Nothing in torch is patched.

"Bytes sent" is the per-rank traffic of the ring algorithm for each collective over ``n`` ranks:
all-gather ``(n-1) x shard``, reduce-scatter ``(n-1)/n x input``, all-reduce ``2(n-1)/n x
buffer``, all-to-all ``(n-1)/n x input``, broadcast ``buffer``.
"""

from __future__ import annotations

import resource
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "CollectiveCounter",
    "CollectiveStats",
    "held_bytes",
    "median",
    "num_fsdp_units",
    "peak_rss_bytes",
    "per_step",
]

_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")
_NOT_COLLECTIVES = frozenset({"wait_tensor", "_wrap_tensor_autograd"})


def _kind(op_name: str) -> str | None:
    """Map an op name like ``c10d::_allgather_base_`` to a collective kind (None: not a collective)."""
    name = op_name.split("::")[-1].replace("_", "")
    for kind, keys in (
        ("reduce_scatter", ("reducescatter",)),
        ("all_gather", ("allgather",)),
        ("all_reduce", ("allreduce",)),
        ("all_to_all", ("alltoall",)),
        ("broadcast", ("broadcast",)),
    ):
        if any(key in name for key in keys):
            return kind
    return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _flat_tensors(obj: Any) -> list[torch.Tensor]:
    """All tensors in ``obj`` (a tensor or arbitrarily nested lists of tensors)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, list | tuple):
        return [t for item in obj for t in _flat_tensors(item)]
    return []


def _group_size(named: dict[str, Any]) -> int:
    """Size of the process group a collective runs on, from its schema-named arguments."""
    if "group_size" in named:
        return int(named["group_size"])
    if "group_name" in named:
        return dist.distributed_c10d._resolve_process_group(named["group_name"]).size()
    return dist.ProcessGroup.unbox(named["process_group"]).size()


def _sent_and_buffer(kind: str, func: Any, args: tuple, kwargs: dict) -> tuple[int, int]:
    """(bytes this rank sends, bytes of the largest buffer) for one collective call."""
    schema_args = func._schema.arguments
    named = {a.name: v for a, v in zip(schema_args, args, strict=False)} | kwargs
    first = schema_args[0].name
    if func.namespace == "c10d" and kind in ("all_gather", "reduce_scatter", "all_to_all"):
        # c10d ops take (output..., input..., group): the second argument is the input.
        inputs = _flat_tensors(args[1])
        outputs = _flat_tensors(args[0])
    else:
        inputs = _flat_tensors(named[first])
        outputs = []
    n = _group_size(named)
    size_in = sum(_nbytes(t) for t in inputs)
    size_out = sum(_nbytes(t) for t in outputs)
    if kind == "all_gather":
        return size_in * (n - 1), max(size_out, size_in * n)
    if kind == "reduce_scatter":
        return size_in * (n - 1) // n, size_in
    if kind == "all_reduce":
        return 2 * size_in * (n - 1) // n, size_in
    if kind == "all_to_all":
        return size_in * (n - 1) // n, max(size_in, size_out)
    return size_in, size_in


@dataclass
class CollectiveStats:
    """What one measured region communicated, per rank."""

    bytes_sent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_KINDS, 0))
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_KINDS, 0))
    largest_buffer: int = 0
    largest_buffer_op: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "bytes_sent": dict(self.bytes_sent),
            "bytes_sent_total": sum(self.bytes_sent.values()),
            "calls": dict(self.calls),
            "largest_buffer": self.largest_buffer,
            "largest_buffer_op": self.largest_buffer_op,
        }


class CollectiveCounter(TorchDispatchMode):
    """Counts collectives issued while active (``with CollectiveCounter() as c: ...; c.stats``)."""

    def __init__(self) -> None:
        super().__init__()
        self.stats = CollectiveStats()
        self.unknown: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(
        self, func: Any, types: Iterable[type], args: tuple = (), kwargs: dict | None = None
    ):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        namespace = getattr(func, "namespace", "")
        if namespace in ("c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional"):
            kind = _kind(func.name())
            if kind is None:
                if func.name().split("::")[-1] not in _NOT_COLLECTIVES:
                    self.unknown[func.name()] += 1
            else:
                sent, buffer = _sent_and_buffer(kind, func, args, kwargs)
                self.stats.bytes_sent[kind] += sent
                self.stats.calls[kind] += 1
                if buffer > self.stats.largest_buffer:
                    self.stats.largest_buffer, self.stats.largest_buffer_op = buffer, func.name()
        return func(*args, **kwargs)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (shared or padded buffers counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = _local(t).untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds (storage, padding included)."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "params": _storage_bytes(params),
        "grads": _storage_bytes(grads),
        "optim": _storage_bytes(states),
    }


def num_fsdp_units(model: nn.Module) -> int:
    """How many ``fully_shard`` calls wrapped the model (the root included; a list of modules is one unit)."""
    from torch.distributed.fsdp import FSDPModule

    return len({id(m._get_fsdp_state()) for m in model.modules() if isinstance(m, FSDPModule)})


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def per_step(
    per_rank_values: list[list[float]], warmup: int, combine: Callable[[Iterable[float]], float] = max
) -> list[float]:
    """Per step after ``warmup``, ``combine`` over ranks (default: the slowest rank's time)."""
    steps = [combine(vs) for vs in zip(*per_rank_values, strict=True)]
    return steps[warmup:] or steps


def median(values: Iterable[float]) -> float:
    return statistics.median(values)
