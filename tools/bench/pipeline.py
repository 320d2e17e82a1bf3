"""Pipeline bubble and per-stage memory: measured per schedule beside the theory ``(p-1)/(m+p-1)``.

For each schedule and microbatch count the pipeline trains a plait reference decoder on ``p`` gloo
ranks. Busy time per rank is measured by running the rank's stages alone (one microbatch forward +
backward, no pipeline) and multiplying by the microbatch count; the bubble is
``1 - busy / step_time`` on the slowest rank, median over the timed steps. Memory per stage: its
parameter and gradient bytes, and the process's peak RSS. Prints one JSON object.

    uv run python tools/bench/pipeline.py --pp 2 --microbatches 2 4 8 --hidden 256 --layers 8
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes
from plait.models import DecoderConfig, DenseDecoder
from plait.pipeline import PipelineConfig, pipeline_model
from plait.testing import run_on_ranks

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv_zero_bubble")


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _busy_seconds(pipe: Any, micro: int, seq: int, hidden: int, vocab: int, repeat: int) -> float:
    """One microbatch forward + backward through this rank's stages, run alone (median of ``repeat``)."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for module, index in zip(pipe.modules, pipe.stage_indices, strict=True):
            if index == 0:
                x = torch.randint(0, vocab, (micro, seq))
            else:
                x = torch.randn(micro, seq, hidden, requires_grad=True)
            out = module(x)
            out.float().square().mean().backward()
        times.append(time.perf_counter() - start)
    for module in pipe.modules:
        module.zero_grad(set_to_none=True)
    return statistics.median(times)


def _run(args: dict[str, Any]) -> dict[str, Any]:
    pp, seq, hidden, vocab = args["pp"], args["seq"], args["hidden"], args["vocab"]
    torch.manual_seed(0)
    cfg = DecoderConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=args["layers"],
        num_attention_heads=8,
        num_key_value_heads=8,
    )
    ctx = MeshContext.build(FSDP2Config(mp_policy=None), ParallelismSizes(pp_size=pp))
    pipe = pipeline_model(
        DenseDecoder(cfg),
        ctx,
        _loss,
        PipelineConfig(schedule=args["schedule"], microbatches=args["m"]),
    )
    batch = args["m"] * args["micro"]
    ids = torch.randint(0, vocab, (batch, seq + 1))
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    for _ in range(args["warmup"]):
        pipe.step(inputs, labels)
    steps = []
    for _ in range(args["steps"]):
        dist.barrier()
        start = time.perf_counter()
        pipe.step(inputs, labels)
        dist.barrier()
        steps.append(time.perf_counter() - start)
    for module in pipe.modules:
        module.zero_grad(set_to_none=True)
    busy = args["m"] * _busy_seconds(pipe, args["micro"], seq, hidden, vocab, args["steps"])
    step = statistics.median(steps)
    params = sum(p.numel() * p.element_size() for p in pipe.parameters())
    return {
        "rank": dist.get_rank(),
        "stages": pipe.stage_indices,
        "layers": [list(pipe.specs[i].layers) for i in pipe.stage_indices],
        "step_s": step,
        "busy_s": busy,
        "param_mib": params / 2**20,
        "grad_mib": params / 2**20,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    parser.add_argument("--micro", type=int, default=2, help="samples per microbatch")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    opts = parser.parse_args()
    rows = []
    for schedule in opts.schedules:
        for m in opts.microbatches:
            if schedule == "1f1b" and m < opts.pp:
                continue
            args = dict(vars(opts), schedule=schedule, m=m)
            ranks = run_on_ranks(_run, opts.pp, args, timeout=1800)
            slowest = max(ranks, key=lambda r: r["step_s"])
            p, v = opts.pp, len(ranks[0]["stages"])
            rows.append(
                {
                    "schedule": schedule,
                    "microbatches": m,
                    "step_s": slowest["step_s"],
                    "bubble_measured": max(0.0, 1.0 - max(r["busy_s"] for r in ranks) / slowest["step_s"]),
                    "bubble_theory": (p - 1) / (m + p - 1),
                    "bubble_theory_virtual": (p - 1) / (v * m + p - 1),
                    "stages_per_rank": v,
                    "per_rank": ranks,
                }
            )
    print(json.dumps({"pp": opts.pp, "config": vars(opts), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
