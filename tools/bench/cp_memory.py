"""Context parallel on one rank: activation bytes autograd saves, bytes sent, and docs/cp.md's formula.

Used by `cp_bench.py` (it runs `measure` on 1, 2 or 4 gloo ranks through plait.testing's harness).

Memory: the bytes of the distinct storages autograd saves for backward during one forward
(``saved_tensors_hooks``, custom autograd functions' ``save_for_backward`` included) — the
activations a rank holds at the peak, parameters excluded. Bytes: what one rank sends in one
forward + backward, counted by a dispatch mode on the ``c10d`` ops (all-gather: input x (n-1);
reduce-scatter: input x (n-1)/n; all-to-all: input x (n-1)/n, the block kept by the rank itself
excluded; send: the tensor). The model is replicated (no FSDP), so every collective seen is cp
attention.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

VARIANTS = ("all_gather", "ring", "all_to_all")

_COUNTED = ("_allgather_base_", "_reduce_scatter_base_", "alltoall_base_", "send")
_RECEIVES = ("recv_",)
"""c10d ops that send nothing (the receiving half of the ring's point-to-point hops)."""


class Sent(TorchDispatchMode):
    """Bytes this rank sends through c10d all-gather, reduce-scatter, all-to-all and send ops."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.uncounted: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.__name__.split(".")[0]
        if func.namespace == "c10d" and name in _COUNTED:
            self.bytes[name] = self.bytes.get(name, 0) + _sent(name, args)
            self.calls[name] = self.calls.get(name, 0) + 1
        elif func.namespace == "c10d" and name not in _RECEIVES:
            self.uncounted.add(name)
        return func(*args, **(kwargs or {}))


def _sent(name: str, args: tuple) -> int:
    """Bytes one rank sends in one c10d call (ring algorithms over the world's ``n`` ranks)."""
    n = dist.get_world_size()
    if name == "send":
        return sum(t.numel() * t.element_size() for t in args[0])
    tensor = args[1]  # the input of _allgather_base_, _reduce_scatter_base_ and alltoall_base_
    size = tensor.numel() * tensor.element_size()
    return size * (n - 1) if name == "_allgather_base_" else size * (n - 1) // n


def saved_storages(params: set[int]) -> tuple[Any, dict[int, tuple[int, list[int], str]]]:
    """A ``saved_tensors_hooks`` context and the storages it records: ``data_ptr -> (bytes, shape, dtype)``.

    Storages in ``params`` (the parameters' data pointers) are left out: a linear layer saves its
    weight as a transposed view, which is no ``nn.Parameter``. The shape is that of the first saved
    tensor seen on the storage (for the breakdown only).
    """
    storages: dict[int, tuple[int, list[int], str]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages.setdefault(
                s.data_ptr(), (s.nbytes(), list(t.shape), str(t.dtype).removeprefix("torch."))
            )
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), storages


def formula(variant: str, cp: int, layers: int, kv_bytes: int, group: int, repeats: int) -> int:
    """docs/cp.md's bytes sent per rank in one forward + backward (no checkpointing), fp32.

    ``kv_bytes``: this rank's K+V of one layer (``2·L·B``); ``group``: query heads per KV head
    (``G``); ``repeats``: ``r``, how often ``all_to_all`` repeats each KV head.
    """
    if cp == 1:
        return 0
    if variant == "all_gather":  # K/V out forward, dK/dV reduce-scattered backward
        per_layer = 2 * (cp - 1) * kv_bytes
    elif variant == "ring":  # K/V hops forward and again backward, + cp hops of the fp32 dK/dV
        per_layer = 2 * (cp - 1) * kv_bytes + cp * kv_bytes
    else:  # all_to_all: (cp-1)/cp of Q, O and r x K, V each way: (2G + 2r)·L·B = (G + r)·kv_bytes
        per_layer = 2 * (cp - 1) * (group + repeats) * kv_bytes // cp
    return layers * per_layer


def _model(hidden: int, layers: int, heads: int, kv_heads: int, vocab: int) -> Any:
    from plait.models import DecoderConfig, DenseDecoder

    config = DecoderConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )
    return DenseDecoder(config), config


def _step(model: Any, batch: dict[str, Any]) -> tuple[Sent, dict[int, tuple[int, list[int], str]]]:
    """One forward (saved storages recorded) + loss + backward (bytes counted throughout)."""
    kwargs = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}
    hooks, storages = saved_storages({p.untyped_storage().data_ptr() for p in model.parameters()})
    counter = Sent()
    with counter:
        with hooks:
            logits = model(batch["input_ids"], **kwargs)
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        loss.backward()
    return counter, storages


def measure(
    seq: int, variant: str, hidden: int, layers: int, heads: int, kv_heads: int, vocab: int
) -> dict[str, Any]:
    """One rank's activation bytes and bytes sent for one step at cp = the world size."""
    from plait.cp import apply_context_parallel, kv_repeats, shard_sequence
    from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes

    cp = dist.get_world_size()
    model, config = _model(hidden, layers, heads, kv_heads, vocab)
    ctx = MeshContext.build(FSDP2Config(mp_policy=None, cp_attention=variant), ParallelismSizes(cp_size=cp))
    if cp > 1:
        apply_context_parallel(model, ctx)
    ids = torch.randint(0, vocab, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    batch = shard_sequence({"input_ids": ids[:, :-1], "labels": ids[:, 1:]}, ctx)
    start = time.perf_counter()
    counter, storages = _step(model, batch)
    seconds = time.perf_counter() - start
    kv_bytes = 2 * (seq // cp) * kv_heads * config.head_dim * 4
    group, repeats = heads // kv_heads, kv_repeats(kv_heads, cp)
    theory = formula(variant, cp, layers, kv_bytes, group, repeats)
    sent = sum(counter.bytes.values())
    largest = sorted(storages.values(), reverse=True)[:6]
    return {
        "cp": cp,
        "variant": variant if cp > 1 else "none (SDPA)",
        "seq": seq,
        "tokens_per_rank": seq // cp,
        "model": {"hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads, "vocab": vocab},
        "activation_bytes": sum(b for b, _, _ in storages.values()),
        "saved_storages": len(storages),
        "largest_saved": [{"bytes": b, "shape": s, "dtype": d} for b, s, d in largest],
        "bytes_sent": sent,
        "bytes_sent_by_op": counter.bytes,
        "calls_by_op": counter.calls,
        "uncounted_c10d_ops": sorted(counter.uncounted),
        "bytes_formula": theory,
        "sent_vs_formula": round(sent / theory, 6) if theory else None,
        "kv_repeats": repeats if variant == "all_to_all" and cp > 1 else None,
        "step_seconds": round(seconds, 3),
    }
