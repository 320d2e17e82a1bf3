"""Mixtral (Hugging Face, random weights): expert parallel against FSDP only, and TP's expert sharding.

Run from the repository root (gloo ranks on CPU, through plait.testing's harness):

    uv run python tools/bench/moe_bench.py [--size tiny|small] [--steps 6] [--repeat 2]

One JSON object per contender, then one with the ratios. Every contender is plait's
``parallelize_model`` on an unmodified ``MixtralForCausalLM``, the same seed and batches, AdamW, fp32:

| contender | ranks | what it is |
|---|---|---|
| ``fsdp`` | 4 | ``dp_shard=4``: experts FSDP-sharded like every other weight, all-gathered every step |
| ``ep=2`` | 4 | ``ep_shard=2 x ep=2``: each rank owns 2 experts' halves; tokens move by all-to-all |
| ``tp=2`` | 2 | tp=2 alone with the model's own plan: every expert sharded over TP (``moe_tp_experts``) |
| ``tp=2 replicated experts`` | 2 | the same plan without its expert entries: every rank holds every expert |

Held bytes (after the last step, grads and AdamW state present): distinct storages behind
parameters, ``.grad``s and optimizer state, DTensors by their local shard, expert parameters (any
FQN with ``.experts.``) counted apart. Collective bytes: ``tools/bench/instrument.py``'s dispatch
mode on the second step (what this rank sends, ring model; all-to-all ``(n-1)/n x input``). Step
time: median over the timed steps of the slowest rank (every step starts after a barrier).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from plait.testing import named_hf_config, run_on_ranks
from tools.bench.instrument import CollectiveCounter, median, peak_rss_bytes, per_step

SIZES: dict[str, dict[str, int]] = {
    "tiny": {},
    "small": {
        "vocab_size": 1024,
        "hidden_size": 256,
        "intermediate_size": 896,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
    },
}
"""Overrides of plait.testing's ``mixtral_proportions`` config (tiny: hidden 64, 2 layers, vocab 256;
Mixtral's proportions: 8 experts, top-2, 2 KV heads, intermediate 3.5 x hidden)."""
CONTENDERS = {"fsdp": (4, {}), "ep=2": (4, {"ep_size": 2}), "tp=2": (2, {"tp_size": 2})}
REPLICATED = "tp=2 replicated experts"
WARMUP, COUNTED_STEP = 2, 1


def mixtral_config(size: str) -> Any:
    """The ``MixtralConfig`` of one of :data:`SIZES` (eager attention, no KV cache)."""
    return named_hf_config(
        "mixtral_proportions",
        attn_implementation="eager",
        **SIZES[size],
        max_position_embeddings=256,
        use_cache=False,
    )


def build_mixtral(size: str) -> nn.Module:
    """A random-weight ``MixtralForCausalLM`` of one of :data:`SIZES` (seed 0, eager attention)."""
    import transformers

    config = mixtral_config(size)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config)


def replicated_experts_plan(model: nn.Module) -> dict[str, str]:
    """The model's own TP plan without its expert entries (a user plan: TP everywhere but the experts)."""
    plan = {f"model.{k}": v for k, v in model.config.base_model_tp_plan.items() if ".experts" not in k}
    # The embedding vocab-parallel as the Hugging Face translation adds it: only the experts differ.
    return plan | {"model.embed_tokens": "embedding_rowwise"} | dict(type(model)._tp_plan)


def _context(contender: str, model: nn.Module) -> Any:
    from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes

    name = "tp=2" if contender == REPLICATED else contender
    plan = replicated_experts_plan(model) if contender == REPLICATED else None
    return MeshContext.build(
        FSDP2Config(mp_policy=None, tp_plan=plan), ParallelismSizes(**CONTENDERS[name][1])
    )


def _batch(
    step: int, vocab: int, rows: int, seq: int, dp_rank: int, dp: int
) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(1000 + step))
    mine = tokens.chunk(dp)[dp_rank]
    return mine[:, :-1], mine[:, 1:]


def _local_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(
        t.numel() * t.element_size() for t in (x.to_local() if isinstance(x, DTensor) else x for x in tensors)
    )


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _held(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Bytes this rank holds: per group (experts / other) the local parameter, gradient and AdamW-state
    tensors; ``storage_total``: the distinct storages behind all of them (FSDP padding and flat buffers)."""
    out: dict[str, Any] = {}
    everything: list[torch.Tensor] = []
    for group in ("experts", "other"):
        params = [p for n, p in model.named_parameters() if (".experts." in n) == (group == "experts")]
        states = [v for p in params for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        grads = [p.grad for p in params if p.grad is not None]
        sizes = {"params": _local_bytes(params), "grads": _local_bytes(grads), "optim": _local_bytes(states)}
        out[group] = sizes | {"total": sum(sizes.values())}
        everything += params + grads + states
    return out | {"storage_total": _storage_bytes(everything)}


def _step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, labels: torch.Tensor) -> float:
    logits = model(input_ids=ids).logits
    with loss_parallel() if isinstance(logits, DTensor) else nullcontext():
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
    opt.step()
    return float(loss.full_tensor() if isinstance(loss, DTensor) else loss.detach())


def run_contender(contender: str, spec: dict[str, Any]) -> dict[str, Any]:
    """On each rank: parallelize, train ``steps`` AdamW steps, and measure (one rank's figures)."""
    from plait.sidecar import parallelize_model

    model = build_mixtral(spec["size"])
    ctx = _context(contender, model)
    model = parallelize_model(model, ctx)
    dp_mesh = ctx.dp_mesh()
    dp, dp_rank = dp_mesh.size(), dist.get_rank(dp_mesh.get_group())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, times, comm = [], [], {}
    for step in range(spec["steps"]):
        opt.zero_grad(set_to_none=True)
        ids, labels = _batch(step, model.config.vocab_size, spec["rows"], spec["seq"], dp_rank, dp)
        dist.barrier()
        start = time.perf_counter()
        counter = CollectiveCounter() if step == COUNTED_STEP else nullcontext()
        with counter:
            loss = _step(model, opt, ids, labels)
        times.append(time.perf_counter() - start)
        if isinstance(counter, CollectiveCounter):
            comm = counter.stats.as_dict() | {"uncounted_ops": dict(counter.unknown)}
        mean = torch.tensor([loss / dist.get_world_size()])
        dist.all_reduce(mean)
        losses.append(float(mean))
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    return {
        "losses": losses,
        "times": times,
        "comm": comm,
        "held": _held(model, opt),
        "expert_bytes_total": experts,
        "rss": peak_rss_bytes(),
    }


def _summary(contender: str, runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    ranks = runs[0]
    held = {
        g: {k: max(r["held"][g][k] for r in ranks) for k in ranks[0]["held"][g]} for g in ("experts", "other")
    }
    steps = [t for run in runs for t in per_step([r["times"] for r in run], WARMUP)]
    return {
        "contender": contender,
        "ranks": len(ranks),
        "step_time_s": median(steps),
        "step_time_per_run_s": [median(per_step([r["times"] for r in run], WARMUP)) for run in runs],
        "held_bytes_max_rank": held | {"total": held["experts"]["total"] + held["other"]["total"]},
        "expert_bytes_total": ranks[0]["expert_bytes_total"],
        "comm_per_step_rank0": ranks[0]["comm"],
        "comm_bytes_sent_max_rank": max(r["comm"]["bytes_sent_total"] for r in ranks),
        "peak_rss_bytes": max(r["rss"] for r in ranks),
        "losses": ranks[0]["losses"],
    }


def _ratios(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ep, fsdp, tp, rep = rows["ep=2"], rows["fsdp"], rows["tp=2"], rows[REPLICATED]
    return {
        "ratios": "ep=2 / fsdp; tp=2 / tp=2 replicated experts",
        "ep_vs_fsdp_comm_bytes": ep["comm_bytes_sent_max_rank"] / fsdp["comm_bytes_sent_max_rank"],
        "ep_vs_fsdp_held_total": ep["held_bytes_max_rank"]["total"] / fsdp["held_bytes_max_rank"]["total"],
        "ep_expert_params_held_over_ideal": ep["held_bytes_max_rank"]["experts"]["params"]
        * ep["ranks"]
        / ep["expert_bytes_total"],
        "ep_vs_fsdp_step_time": ep["step_time_s"] / fsdp["step_time_s"],
        "ep_vs_fsdp_max_loss_diff": max(
            abs(a - b) for a, b in zip(ep["losses"], fsdp["losses"], strict=True)
        ),
        "tp_vs_replicated_held_total": tp["held_bytes_max_rank"]["total"]
        / rep["held_bytes_max_rank"]["total"],
        "tp_vs_replicated_max_loss_diff": max(
            abs(a - b) for a, b in zip(tp["losses"], rep["losses"], strict=True)
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=1, help="runs per contender, alternating (pooled)")
    args = parser.parse_args(argv)
    spec = {"size": args.size, "steps": args.steps, "rows": args.rows, "seq": args.seq}
    names = [*CONTENDERS, REPLICATED]
    runs: dict[str, list[list[dict[str, Any]]]] = {n: [] for n in names}
    for _ in range(args.repeat):
        for name in names:
            world = CONTENDERS["tp=2" if name == REPLICATED else name][0]
            runs[name].append(run_on_ranks(run_contender, world, name, spec, timeout=1800))
    rows = {name: _summary(name, runs[name]) for name in names}
    for row in rows.values():
        print(json.dumps(row), flush=True)
    print(json.dumps(_ratios(rows)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
