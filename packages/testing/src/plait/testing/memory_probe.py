"""Measure one steady-state training step per rank: peak tensor memory by category and collective bytes.

:func:`measure_step` runs inside a rank (under :func:`plait.testing.run_on_ranks`): it builds the
recipe's :class:`plait.train.trainer.Trainer`, runs one warm-up step (so AdamW state exists), then
measures the second step with torch's ``MemTracker`` (``FSDPMemTracker`` when the model is an FSDP2
module) and a :class:`CollectiveCounter` dispatch mode that counts the bytes each rank puts into
every ``c10d`` / functional collective. :func:`run_layout` runs it on ``world_size`` gloo ranks.

plait.train is imported inside the functions: plait-testing does not depend on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from plait.testing.harness import run_on_ranks

__all__ = ["COLLECTIVE_OPS", "CollectiveCounter", "measure_step", "run_layout"]

_C10D = "c10d"
_FUNCTIONAL = ("_c10d_functional", "_c10d_functional_autograd")
_IGNORED = ("wait_tensor", "_wrap_tensor_autograd")

COLLECTIVE_OPS: dict[str, tuple[str, int]] = {
    # c10d ops (ProcessGroup methods: dist.all_gather_into_tensor, dist.isend, ...): kind, input arg
    "c10d._allgather_base_": ("all_gather", 1),
    "c10d.allgather_": ("all_gather", 1),
    "c10d.allgather_coalesced_": ("all_gather", 1),
    "c10d.allgather_into_tensor_coalesced_": ("all_gather", 1),
    "c10d._reduce_scatter_base_": ("reduce_scatter", 1),
    "c10d.reduce_scatter_": ("reduce_scatter", 1),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "c10d.allreduce_": ("all_reduce", 0),
    "c10d.allreduce_coalesced_": ("all_reduce", 0),
    "c10d.alltoall_base_": ("all_to_all", 1),
    "c10d.alltoall_": ("all_to_all", 1),
    "c10d.broadcast_": ("broadcast", 0),
    "c10d.reduce_": ("reduce", 0),
    "c10d.gather_": ("gather", 1),
    "c10d.scatter_": ("scatter", 1),
    "c10d.send": ("send", 0),
    "c10d.recv_": ("recv", 0),
    "c10d.recv_any_source_": ("recv", 0),
    "c10d.barrier": ("barrier", -1),
    # functional collectives (DTensor redistribute, tensor parallel, context parallel): input is arg 0
    "all_gather_into_tensor": ("all_gather", 0),
    "all_gather_into_tensor_out": ("all_gather", 0),
    "all_gather_into_tensor_coalesced": ("all_gather", 0),
    "reduce_scatter_tensor": ("reduce_scatter", 0),
    "reduce_scatter_tensor_out": ("reduce_scatter", 0),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "all_reduce": ("all_reduce", 0),
    "all_reduce_": ("all_reduce", 0),
    "all_reduce_coalesced": ("all_reduce", 0),
    "all_reduce_coalesced_": ("all_reduce", 0),
    "all_to_all_single": ("all_to_all", 0),
    "broadcast": ("broadcast", 0),
    "broadcast_": ("broadcast", 0),
}
"""Op name (``c10d.<op>``, or the bare name of a ``_c10d_functional`` op) -> (kind, index of the input arg)."""


def _op_key(func: Any) -> str | None:
    """The :data:`COLLECTIVE_OPS` key of an OpOverload, or None when it is no collective."""
    namespace = getattr(func, "namespace", None)
    name = func._schema.name.split("::")[-1] if hasattr(func, "_schema") else ""
    if namespace == _C10D:
        return f"c10d.{name}"
    if namespace in _FUNCTIONAL:
        return name
    return None


def _tensor_bytes(value: Any) -> int:
    """Bytes of the local tensors in ``value`` (nested lists of tensors)."""
    leaves, _ = tree_flatten(value)
    total = 0
    for leaf in leaves:
        if isinstance(leaf, DTensor):
            leaf = leaf.to_local()
        if isinstance(leaf, torch.Tensor):
            total += leaf.numel() * leaf.element_size()
    return total


def _process_group(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The ProcessGroup a collective runs on (None when it cannot be found)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, str) and func.namespace in _FUNCTIONAL:  # the group's name
            with contextlib.suppress(Exception):
                return dist.distributed_c10d._resolve_process_group(value)
        if isinstance(value, torch.ScriptObject):  # c10d ops get the ProcessGroup boxed
            with contextlib.suppress(Exception):
                return dist.ProcessGroup.unbox(value)
    return None


def _group_label(group: Any) -> str:
    """``<description> x<size>``: DeviceMesh names its groups ``mesh_<dim>``; the world is ``default_pg``."""
    if group is None:
        return "unknown"
    desc = getattr(group, "group_desc", "") or getattr(group, "group_name", "") or "group"
    return f"{desc} x{group.size()}"


class CollectiveCounter(TorchDispatchMode):
    """Count the collectives issued under it: per kind the calls and input bytes, also split by group.

    It sees ``torch.ops.c10d.*`` (what ``torch.distributed``'s ProcessGroup calls dispatch to) and
    ``torch.ops._c10d_functional*.*``; DTensor ops are passed on (``NotImplemented``) so that their
    local collectives are seen once desugared. ``ops`` keeps the raw per-op counts.
    """

    def __init__(self) -> None:
        super().__init__()
        self.kinds: dict[str, dict[str, Any]] = {}
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Record ``func`` when it is a collective, then run it."""
        if any(t is DTensor for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        key = _op_key(func)
        if key is not None and key in COLLECTIVE_OPS:
            self._record(key, func, args, kwargs)
        elif key is not None and key not in _IGNORED:
            self.ops[f"unclassified:{key}"] = self.ops.get(f"unclassified:{key}", 0) + 1
        return func(*args, **kwargs)

    def _record(self, key: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        kind, index = COLLECTIVE_OPS[key]
        nbytes = _tensor_bytes(args[index]) if 0 <= index < len(args) else 0
        entry = self.kinds.setdefault(kind, {"count": 0, "bytes": 0, "by_group": {}})
        label = _group_label(_process_group(func, args, kwargs))
        per_group = entry["by_group"].setdefault(label, {"count": 0, "bytes": 0})
        for slot in (entry, per_group):
            slot["count"] += 1
            slot["bytes"] += nbytes
        self.ops[key] = self.ops.get(key, 0) + 1


def _is_root_rerun(tracker: MemTracker, module: torch.nn.Module) -> bool:
    """Whether ``module`` starts a forward again at the top level (the next pipeline microbatch)."""
    if module not in tracker.memory_tracking or tracker._mod_tracker.is_bw:
        return False
    name = tracker._mod_tracker.get_known_fqn(module)
    return tracker._mod_tracker.parents - {name} == {"Global"}


class _RepeatableMemTracker(MemTracker):
    """``MemTracker`` whose root module may run forward several times (microbatches, accumulation).

    torch refuses a second top-level forward of a tracked module; here its per-module stats are
    dropped instead (only the tracker-wide peak is read).
    """

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        if _is_root_rerun(self, module):
            del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)


class _RepeatableFSDPMemTracker(FSDPMemTracker):
    """``FSDPMemTracker`` whose root module may run forward several times (see ``_RepeatableMemTracker``)."""

    def _fsdp_state_pre_forward(self, fsdp_mod: Any, orig_fsdp_state_pre_fw: Any) -> Any:
        inner = super()._fsdp_state_pre_forward(fsdp_mod, orig_fsdp_state_pre_fw)

        def pre_forward(*args: Any, **kwargs: Any) -> Any:
            if _is_root_rerun(self, fsdp_mod):
                del self.memory_tracking[fsdp_mod]
            return inner(*args, **kwargs)

        return pre_forward


def _make_tracker(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[MemTracker, str]:
    """``FSDPMemTracker`` for an FSDP2 root module, else ``MemTracker`` tracking model and optimizer."""
    if isinstance(model, FSDPModule):
        return _RepeatableFSDPMemTracker(model, optimizer), "FSDPMemTracker"
    tracker = _RepeatableMemTracker()
    tracker.track_external(model, optimizer)
    return tracker, "MemTracker"


def _category(key: Any) -> str:
    return str(getattr(key, "value", key))


def _peak(tracker: Any) -> tuple[int, dict[str, int]]:
    """Total peak bytes and its split by category over every device the tracker saw."""
    by_category: dict[str, int] = {}
    for snap in tracker.get_tracker_snapshot("peak").values():
        for key, value in snap.items():
            name = _category(key)
            by_category[name] = by_category.get(name, 0) + int(value)
    total = by_category.pop("Total", sum(by_category.values()))
    return total, by_category


@contextlib.contextmanager
def _measuring(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[dict[str, Any]]:
    """Run the body under a memory tracker and a :class:`CollectiveCounter`; fill the yielded dict."""
    tracker, name = _make_tracker(model, optimizer)
    counter = CollectiveCounter()
    out: dict[str, Any] = {"tracker": name}
    with tracker, counter:
        yield out
    out["peak_bytes"], out["peak_by_category"] = _peak(tracker)
    out["collectives"] = counter.kinds
    out["collective_ops"] = counter.ops


def measure_step(recipe_name: str, overrides: list[str], run_dir: str) -> dict[str, Any]:
    """Build the recipe's trainer on this rank, warm up one step, then measure the next step.

    Args:
        recipe_name: a shipped recipe name (or path) for :func:`plait.train.recipes.load_recipe`.
        overrides: dotted ``key=value`` overrides on top of the recipe.
        run_dir: the run directory (``out_dir``) of this measurement.

    Returns:
        Plain JSON-able data: rank, world_size, tracker, peak_bytes, peak_by_category,
        collectives (kind -> count, bytes, by_group), collective_ops, step_loss.
    """
    from plait.mesh import DistributedInfo
    from plait.train import Trainer, check_recipe, load_recipe

    recipe = load_recipe(recipe_name, [*overrides, f"out_dir={run_dir}"])
    rank, world = dist.get_rank(), dist.get_world_size()
    info = DistributedInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    trainer = Trainer(recipe, check_recipe(recipe, world), info)
    try:
        trainer.train_step()  # warm-up: AdamW state exists from here on
        dist.barrier()
        with _measuring(trainer.model, trainer.optimizer) as result:
            metrics = trainer.train_step()
    finally:
        if trainer.run_lock is not None:
            trainer.run_lock.release()
    return {"rank": rank, "world_size": world, **result, "step_loss": float(metrics["loss"])}


def run_layout(recipe_name: str, overrides: list[str], world_size: int, run_dir: str) -> list[dict[str, Any]]:
    """Run :func:`measure_step` on ``world_size`` gloo ranks; one result dict per rank, in rank order."""
    return run_on_ranks(measure_step, world_size, recipe_name, overrides, run_dir, timeout=600.0)
