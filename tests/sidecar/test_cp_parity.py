"""Context parallel end to end through `parallelize_model`: loss, every gradient, params after 2 SGD steps.

Every variant on plait.models' decoder, HF Llama and Qwen3, and on the families with sliding
windows (Mistral; Gemma 2 with soft-capping and mixed local/global layers; Gemma 3; GPT-OSS with
sinks and mixed layers), and on hybrids whose convolutions and linear attention run gathered (LFM2,
Qwen3.5) (fp32, gloo); Gemma 2 and GPT-OSS also at cp 2 x tp 2, the CI subset of
``tools/hf_sweep``'s cp cases. Each multi-rank body runs several configurations
so the workers are reused; the full matrix (8 ranks, the reference decoder) is in
``tools/bench/cp_bench.py --parity``.
"""

from __future__ import annotations

from typing import Any

from plait.testing import cp_parity, run_on_ranks

TWO_RANKS: list[tuple[Any, ...]] = [
    ("llama", {"cp_size": 2}, {"cp_attention": "all_gather"}),
    ("qwen3", {"cp_size": 2}, {"cp_attention": "ring"}),
    ("dense", {"cp_size": 2}, {"cp_attention": "all_gather"}),  # plait.models' attention_fn
    ("dense", {"cp_size": 2}, {"cp_attention": "all_to_all"}),
    ("llama", {"cp_size": 2}, {"cp_attention": "all_to_all"}),
]
FEATURES: list[tuple[Any, ...]] = [
    ("mistral", {"cp_size": 2}, {"cp_attention": "ring"}),
    ("gemma2", {"cp_size": 2}, {"cp_attention": "all_gather"}),
    ("gpt_oss", {"cp_size": 2}, {"cp_attention": "all_to_all"}),
    ("gemma3_text", {"cp_size": 2}, {"cp_attention": "ring"}),  # q/k norms, a sliding and a global layer
]
# the HF sweep's cp2 x tp2 case (tools/hf_sweep: default variant, SP off) on its CI families: Gemma 2
# (soft-caps, mixed local/global layers) and GPT-OSS (sinks, sliding windows); Gemma 3, Mistral and
# Qwen3 pass it in the sweep, and each runs at cp 2 here
CP_TP_FAMILIES: list[tuple[Any, ...]] = [
    (kind, {"cp_size": 2, "tp_size": 2}, {}) for kind in ("gemma2", "gpt_oss")
]
GATHER = {"cp_sequence_mixers": "gather"}
GATHERED: list[tuple[Any, ...]] = [  # sequence mixers run on the whole sequence, attention split
    ("lfm2", {"cp_size": 2}, GATHER | {"cp_attention": "all_gather"}),  # short convolution
    ("qwen3_5_text", {"cp_size": 2}, GATHER | {"cp_attention": "ring"}, "full"),  # gated delta net + AC
]
PACKED: list[tuple[Any, ...]] = [  # position_ids restart at each document: block-causal attention
    ("llama", {"cp_size": 2}, {"cp_attention": "all_gather"}, False, True),
    ("qwen3", {"cp_size": 2}, {"cp_attention": "ring"}, False, True),
    ("gemma2", {"cp_size": 2}, {"cp_attention": "all_to_all"}, False, True),  # + windows, soft-caps
]
FOUR_RANKS: list[tuple[Any, ...]] = [
    ("dense", {"cp_size": 4}, {"cp_attention": "ring"}),
    ("qwen3", {"cp_size": 4}, {"cp_attention": "all_gather"}),
    ("qwen3", {"cp_size": 2}, {"cp_attention": "ring"}),  # dp_shard 2 x cp 2
    ("llama", {"cp_size": 2, "tp_size": 2}, {"cp_attention": "all_gather", "sequence_parallel": True}),
    ("dense", {"cp_size": 2, "tp_size": 2}, {"cp_attention": "ring"}, "full"),  # + activation checkpointing
    # 4 heads / 2 KV heads over tp 2: 1 KV head per rank, repeated for cp 2; + SP and checkpointing
    (
        "dense",
        {"cp_size": 2, "tp_size": 2},
        {"cp_attention": "all_to_all", "sequence_parallel": True},
        "full",
    ),
    ("llama", {"cp_size": 4}, {"cp_attention": "all_to_all"}),  # 2 KV heads repeated for cp 4
    ("qwen3", {"cp_size": 2}, {"cp_attention": "all_to_all"}),  # dp_shard 2 x cp 2
    ("lfm2", {"cp_size": 2, "tp_size": 2}, GATHER),  # a gathered convolution under TP
]


def _run(cases: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    return [cp_parity(*case) for case in cases]


def _check(cases: list[tuple[Any, ...]], world: int) -> None:
    for (
        case
    ) in cases:  # one call per case on the same workers: meshes' process groups are freed between calls
        for rank, (r,) in enumerate(run_on_ranks(_run, world, [case], timeout=400)):
            label = f"rank {rank} {case}"
            assert r["compared"] >= 20, label
            assert r["local_seq"] == 16 // case[1]["cp_size"], label  # the sequence really was split
            assert r["ok"], (label, r)  # the driver's fp32 contract: loss, gradients, SGD, AdamW vs its floor


def test_cp2_both_variants_hf() -> None:
    _check(TWO_RANKS, 2)


def test_cp4_and_with_fsdp_tp_sp_ac() -> None:
    _check(FOUR_RANKS, 4)


def test_cp2_sliding_windows_softcaps_and_sinks() -> None:
    _check(FEATURES, 2)


def test_cp2_gathered_sequence_mixers() -> None:
    """Convolutions and linear attention cp cannot split run on the whole sequence, exactly."""
    _check(GATHERED, 2)


def test_cp2_packed_documents() -> None:
    _check(PACKED, 2)


def test_cp2_tp2_hf_families() -> None:
    """Gemma 2 and GPT-OSS at cp 2 x tp 2 (Llama: in the four-rank cases, with SP)."""
    _check(CP_TP_FAMILIES, 4)
