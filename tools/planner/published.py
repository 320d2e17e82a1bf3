"""``plan --auto`` next to torchtitan's published Llama-3.1 layouts (docs/planner.md, "Published layouts").

Runs the planner on each published job (model, GPUs, batch), prices the published layout itself, and
prints a markdown table: the published figures, the planner's estimate of the published layout, and
the planner's own top choice. ``uv run python tools/planner/published.py``
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.planner import GIB, Candidate, Layout, ModelShape, cluster, evaluate, search

LLAMA = {"vocab_size": 128256, "rope_theta": 500000.0}
SHAPES = {
    "Llama-3.1-8B": {
        **LLAMA,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    "Llama-3.1-70B": {
        **LLAMA,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
    "Llama-3.1-405B": {
        **LLAMA,
        "hidden_size": 16384,
        "intermediate_size": 53248,
        "num_hidden_layers": 126,
        "num_attention_heads": 128,
        "num_key_value_heads": 8,
    },
}
SOURCE = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Dec 2024)"
GRAND_TETON = {"memory_gib": 95.0}
"""Their H100s have 96 GB HBM2e (500 W); the planner prices the same memory."""


@dataclass(frozen=True)
class Published:
    model: str
    gpus: int
    layout: Layout
    tokens_per_gpu: float
    memory_gib: float
    note: str


SEQ = 8192
JOBS = [
    Published(
        "Llama-3.1-8B",
        8,
        Layout(seq_len=SEQ, micro_batch=2, dp_shard=8, ac="selective"),
        5762,
        82.4,
        "table 1: FSDP 8, local batch 2, selective AC, eager bf16",
    ),
    Published(
        "Llama-3.1-70B",
        256,
        Layout(seq_len=SEQ, micro_batch=16, dp_shard=32, tp=8, sp=True, ac="full"),
        829,
        71.9,
        "table 4: FSDP 32 x TP 8, local batch 16, full AC, compile + float8",
    ),
    Published(
        "Llama-3.1-405B",
        512,
        Layout(seq_len=SEQ, micro_batch=32, dp_shard=8, tp=8, sp=True, pp=8, pp_microbatches=32, ac="full"),
        100,
        82.5,
        "table 5: FSDP 8 x TP 8 x PP 8 (1F1B), local batch 32, full AC, compile + float8 + async TP",
    ),
]


def _row(job: Published) -> list[str]:
    shape = ModelShape.from_config(SHAPES[job.model])
    machine = cluster("h100", nodes=job.gpus // 8, **GRAND_TETON)
    theirs = evaluate(shape, job.layout, machine)
    tokens = job.layout.micro_batch * job.layout.grad_accum * SEQ * job.layout.dp
    ours: Candidate = search(shape, machine, global_tokens=tokens, seq_len=SEQ, top=1).candidates[0]
    off = theirs.time.tokens_per_second_per_gpu / job.tokens_per_gpu - 1
    return [
        job.model,
        str(job.gpus),
        job.layout.describe(),
        f"{job.tokens_per_gpu:,.0f}",
        f"{job.memory_gib:.1f}",
        f"{theirs.time.tokens_per_second_per_gpu:,.0f} ({off:+.0%})",
        f"{theirs.memory.peak / GIB:.1f}",
        ours.layout.describe(),
        f"{ours.time.tokens_per_second_per_gpu:,.0f}",
        f"{ours.memory.peak / GIB:.1f}",
        "yes" if ours.fits else f"no (+{ours.over / GIB:.1f} GiB)",
    ]


def main() -> None:
    header = [
        "model",
        "GPUs",
        "published layout",
        "published tok/s/GPU",
        "published GiB",
        "estimate of it (off by)",
        "its estimated GiB",
        "plan --auto's choice",
        "its tok/s/GPU",
        "its GiB",
        "fits",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for job in JOBS:
        print("| " + " | ".join(_row(job)) + " |")
    print(f"\nSource: {SOURCE}. Notes: " + "; ".join(f"{j.model}: {j.note}" for j in JOBS))


if __name__ == "__main__":
    main()
