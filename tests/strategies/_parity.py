"""Rank-side helpers shared by the strategies tests: seeded batches, losses and parity measurements."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """Parameter FQN without checkpoint / FSDP / compile wrappers and without DDP's ``module.`` prefix."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name.removeprefix("module.")


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective); a plain tensor unchanged."""
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if full_tensor is not None else t


def global_batch(vocab: int, world: int, per_rank: int = 2, seq: int = 8, seed: int = 1) -> torch.Tensor:
    """The same token batch on every rank; rank r trains on rows ``[r*per_rank, (r+1)*per_rank)``."""
    return torch.randint(0, vocab, (world * per_rank, seq), generator=torch.Generator().manual_seed(seed))


def local_rows(batch: torch.Tensor) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = batch.shape[0] // world
    return batch[rank * per_rank : (rank + 1) * per_rank]


def lm_loss(model: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def mean_over_ranks(value: torch.Tensor) -> float:
    out = value.detach().clone()
    dist.all_reduce(out)
    return out.item() / dist.get_world_size()


@dataclass
class Parity:
    """Worst differences between a parallel model and its unsharded reference."""

    loss_diff: float
    grad_diff: float
    worst_grad: str
    grads_compared: int
    param_diff: float = 0.0
    worst_param: str = ""
    adamw_loss_diff: float = 0.0


def max_diff(ref: nn.Module, par: nn.Module, attr: str) -> tuple[float, str, int]:
    """Largest |par - ref| over parameters (``attr`` = ``"grad"`` or ``"data"``), matched by clean FQN."""
    ref_params = dict(ref.named_parameters())
    worst, where, count = 0.0, "", 0
    for name, param in par.named_parameters():
        value = param.grad if attr == "grad" else param.detach()
        expected = getattr(ref_params[clean_name(name)], attr)
        if value is None or expected is None:
            if (value is None) != (expected is None):
                return float("inf"), f"{name}: grad presence differs", count
            continue
        diff = (full(value) - expected).abs().max().item()
        count += 1
        if diff >= worst:
            worst, where = diff, name
    return worst, where, count


def clear_dtensor_caches() -> None:
    """Forget DTensor sharding decisions cached by earlier calls on this worker.

    DeviceMeshes compare equal by layout, so a cached output spec can carry the mesh of an earlier
    call whose process groups the harness has destroyed since; call this first in every rank function.
    """
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
