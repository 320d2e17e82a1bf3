"""Model shapes, the torchtitan FLOP count and the peak bf16 dense FLOP/s of known GPUs."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = [
    "PEAK_BF16_DENSE_FLOPS",
    "SHAPES",
    "flops_per_token",
    "non_embedding_params",
    "peak_flops",
    "pick_shape",
]

_LLAMA3_VOCAB = 128256

SHAPES: dict[str, dict[str, Any]] = {
    "llama3.2-3b": {
        "vocab_size": _LLAMA3_VOCAB,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
    },
    "llama3.2-1b": {
        "vocab_size": _LLAMA3_VOCAB,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
    },
    "tiny": {
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
}
"""``plait.models.DecoderConfig`` fields per shape. The Llama-3.2 dims, with an untied head (as in
torchtitan's Llama 3): ``plait.mesh.materialize`` unties a tied head on one rank (``to_empty``
gives each module its own parameter), which would double the table behind plan's back."""

_BIG_GPU_BYTES = 120 * 2**30
"""The 3B shape at seq 8192 without activation checkpointing needs ~110 GiB (fp32 + AdamW: 54 GiB)."""

PEAK_BF16_DENSE_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
}
"""Peak bf16 dense tensor-core FLOP/s by device-name substring, most specific first (torchtitan's
``get_peak_flops``; a plain "H100" is the SXM part)."""


def pick_shape(requested: str, dry_run: bool, device_bytes: int | None) -> str:
    """``auto``: ``tiny`` for the dry run, the 3B shape on >= 120 GiB GPUs, else the 1B shape."""
    if requested != "auto":
        return requested
    if dry_run:
        return "tiny"
    return "llama3.2-3b" if (device_bytes or 0) >= _BIG_GPU_BYTES else "llama3.2-1b"


def peak_flops(device_name: str) -> float | None:
    """Peak bf16 dense FLOP/s of a GPU by name; None when not in the table (or on CPU)."""
    for key, flops in PEAK_BF16_DENSE_FLOPS.items():
        if key in device_name:
            return flops
    return None


def non_embedding_params(model: nn.Module) -> int:
    """Parameters minus the input embedding table (a lookup, no matmul), as torchtitan counts them."""
    return sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()


def flops_per_token(arch: dict[str, Any], params: int, seq_len: int) -> int:
    """torchtitan's count: ``6 * params + 12 * layers * heads * head_dim * seq_len`` (fwd + bwd)."""
    heads = arch["num_attention_heads"]
    head_dim = arch.get("head_dim") or arch["hidden_size"] // heads
    return 6 * params + 12 * arch["num_hidden_layers"] * heads * head_dim * seq_len
