"""Context parallel: activation memory per rank and bytes per step, and the full parity matrix.

Run from the repository root (gloo ranks on CPU, through plait.testing's harness):

    uv run tools/bench/cp_bench.py [--seq 8192] [--cp 1,2,4]      # memory + bytes, one JSON line per run
    uv run tools/bench/cp_bench.py --parity                        # every acceptance configuration
                                                                   # (plait.testing.run_cases: JSON lines, --out)

Memory: the bytes of the distinct storages autograd saves for backward during one forward
(``saved_tensors_hooks``) — the activations a rank holds at the peak, parameters excluded. Bytes:
what one rank sends in one forward + backward, counted by a dispatch mode on the ``c10d`` ops
(all-gather: input x (n-1); reduce-scatter: input x (n-1)/n; send: the tensor), beside the
count docs/cp.md gives. The model is replicated (no FSDP) so every collective seen is cp attention.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from plait.testing import cp_parity, run_cases, run_on_ranks

VARIANTS = ("all_gather", "ring")


class _Sent(TorchDispatchMode):
    """Bytes this rank sends through c10d all-gather, reduce-scatter and send ops."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.__name__.split(".")[0]
        if func.namespace == "c10d" and name in ("_allgather_base_", "_reduce_scatter_base_", "send"):
            tensor = args[1] if name != "send" else args[0][0]
            n = dist.get_world_size()
            size = tensor.numel() * tensor.element_size()
            sent = {"_allgather_base_": size * (n - 1), "_reduce_scatter_base_": size * (n - 1) // n}.get(
                name, size
            )
            self.bytes[name] = self.bytes.get(name, 0) + sent
        return func(*args, **(kwargs or {}))


def _saved_bytes() -> tuple[Any, dict[int, int]]:
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), storages


def _theory(cp: int, variant: str, layers: int, kv_bytes: int) -> int:
    if cp == 1:
        return 0
    sent = 2 * (cp - 1) * kv_bytes  # K/V out in forward; dK/dV (all-gather) or K/V again (ring) in backward
    if variant == "ring":
        sent += cp * kv_bytes  # the fp32 dK/dV accumulators' hops
    return layers * sent


def _measure(seq: int, variant: str, hidden: int, layers: int) -> dict[str, Any]:
    from plait.cp import apply_context_parallel, shard_sequence
    from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes
    from plait.models import DecoderConfig, DenseDecoder

    cp = dist.get_world_size()
    config = DecoderConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers
    )
    model = DenseDecoder(config)
    ctx = MeshContext.build(FSDP2Config(mp_policy=None, cp_attention=variant), ParallelismSizes(cp_size=cp))
    if cp > 1:
        apply_context_parallel(model, ctx)
    ids = torch.randint(0, 256, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    batch = shard_sequence({"input_ids": ids[:, :-1], "labels": ids[:, 1:]}, ctx)
    kwargs = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}
    hooks, storages = _saved_bytes()
    counter = _Sent()
    with counter:
        with hooks:
            loss = F.cross_entropy(
                model(batch["input_ids"], **kwargs).flatten(0, 1), batch["labels"].flatten()
            )
        loss.backward()
    kv_bytes = 2 * (seq // cp) * config.num_key_value_heads * config.head_dim * 4
    return {
        "cp": cp,
        "variant": variant if cp > 1 else "none (SDPA)",
        "seq": seq,
        "tokens_per_rank": seq // cp,
        "activation_bytes": sum(storages.values()),
        "bytes_sent": sum(counter.bytes.values()),
        "bytes_sent_by_op": counter.bytes,
        "bytes_theory": _theory(cp, variant, layers, kv_bytes),
    }


def _memory_and_bytes(args: argparse.Namespace) -> None:
    baseline = None
    for cp in args.cp:
        for variant in VARIANTS if cp > 1 else VARIANTS[:1]:
            result = run_on_ranks(_measure, cp, args.seq, variant, args.hidden, args.layers, timeout=1800)[0]
            baseline = baseline or result["activation_bytes"]
            result["activation_vs_cp1"] = round(result["activation_bytes"] / baseline, 4)
            print(json.dumps(result), flush=True)


PARITY: list[tuple[int, str, dict[str, int], dict[str, Any], Any]] = [
    (2, kind, {"cp_size": 2}, {}, False) for kind in ("dense", "llama", "qwen3")
] + [
    *((4, kind, {"cp_size": 4}, {}, False) for kind in ("dense", "llama", "qwen3")),
    (4, "dense", {"cp_size": 2}, {}, False),  # dp_shard 2 x cp 2
    (4, "qwen3", {"cp_size": 2, "tp_size": 2}, {}, False),
    (4, "dense", {"cp_size": 2, "tp_size": 2}, {"sequence_parallel": True}, "full"),
    (8, "llama", {"cp_size": 2, "tp_size": 2}, {}, False),  # dp_shard 2 x cp 2 x tp 2
    (8, "dense", {"cp_size": 2, "tp_size": 2}, {"sequence_parallel": True}, False),
    (
        8,
        "llama",
        {"cp_size": 2, "dp_replicate_size": 2},
        {},
        False,
    ),  # HSDP: dp_replicate 2 x dp_shard 2 x cp 2
]


COMPILE = [(2, "dense", {"cp_size": 2}, {"enable_compile": True}, False)]
"""Per-layer torch.compile (inductor on CPU: minutes per case), with ``--parity --compile``."""


def _parity(matrix: list[tuple[Any, ...]], only_world: int | None, out: Path) -> bool:
    """Each configuration of ``matrix`` in both variants through ``cp_parity``; whether all pass."""
    rows = []
    for world in sorted({c[0] for c in matrix if only_world in (None, c[0])}):
        cases = {
            f"{kind} {sizes} {options} {variant} ac={ac}": (
                kind,
                sizes,
                {**options, "cp_attention": variant},
                ac,
            )
            for w, kind, sizes, options, ac in matrix
            if w == world
            for variant in VARIANTS
        }
        rows += run_cases(cases, cp_parity, world, out=out, timeout=1800)
    return all(row["ok"] for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parity", action="store_true", help="run the parity matrix instead")
    parser.add_argument("--compile", action="store_true", help="with --parity: only the compile cases")
    parser.add_argument("--world", type=int, default=None, help="with --parity: only this world size")
    parser.add_argument(
        "--out", type=Path, default=Path("runs/cp_parity.json"), help="with --parity: JSON rows"
    )
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--cp", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    if args.parity:
        sys.exit(0 if _parity(COMPILE if args.compile else PARITY, args.world, args.out) else 1)
    _memory_and_bytes(args)


if __name__ == "__main__":
    main()
