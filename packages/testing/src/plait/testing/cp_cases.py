"""Rank-side context-parallel parity through plait.testing's driver, fp32.

Every rank builds the same seeded model and keeps an unsharded copy. The reference trains on the
whole global batch; each rank trains on its data-parallel rows, split along the sequence by
`plait.cp.shard_sequence` (the driver's ``local_inputs`` hook). Needs plait-cp (and plait-sidecar for
:func:`cp_parity`), which plait-testing does not declare.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait.cp import DOCUMENTS_KEY, shard_sequence
from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes
from plait.testing.driver import Inputs, paired, run_parity, token_batches
from plait.testing.hf_models import tiny_hf_model
from plait.testing.sweep import case_row

__all__ = [
    "CP_FEATURE_MODELS",
    "CP_SEQ",
    "CP_VOCAB",
    "PACKED_DOCUMENTS",
    "cp_decoder",
    "cp_local_inputs",
    "cp_parity",
    "packed_positions",
]

CP_VOCAB = 96
CP_SEQ = 16


CP_FEATURE_MODELS: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": 5, "attn_implementation": "sdpa"},
    "gemma2": {
        "sliding_window": 5,
        "attn_logit_softcapping": 1.0,
        "query_pre_attn_scalar": 4,
        "vector_noise": 0.1,
    },
    "gemma3_text": {
        "sliding_window": 5,
        "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 4,
        "vector_noise": 0.1,
    },
    "gpt_oss": {
        "sliding_window": 5,
        "intermediate_size": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 4,  # every expert: no top-k choice another CPU's rounding could flip
        "head_dim": 8,
    },
    "lfm2": {"layer_types": ["conv", "full_attention"], "attn_implementation": "sdpa"},
    "qwen3_5_text": {"layer_types": ["linear_attention", "full_attention"], "vector_noise": 0.1},
}
"""Families whose attention has a window, soft-capping or sinks, with settings that make them matter at
:data:`CP_SEQ` (a 5-token window spans chunk and rank boundaries at cp 2 and 4; soft-cap 1.0 bends
the scores; ``query_pre_attn_scalar`` 4 makes Gemma 2's and Gemma 3's scores large; Gemma 3 mixes a
sliding and a global layer), and hybrids whose sequence mixers cp runs gathered
(``cp_sequence_mixers='gather'``): LFM2's short convolution and Qwen3.5's gated delta net, each
next to a full-attention layer cp splits."""


def cp_decoder(kind: str) -> nn.Module:
    """A tiny seeded causal LM: ``llama`` / ``qwen3`` (Hugging Face, tied), a family of
    :data:`CP_FEATURE_MODELS`, or ``dense`` / ``dense_mha`` (plait reference: 4 query heads over 2
    KV heads, or 4 over 4)."""
    if kind in ("dense", "dense_mha"):
        from plait.models import DecoderConfig, DenseDecoder

        torch.manual_seed(0)
        kv_heads = {"num_key_value_heads": 4} if kind == "dense_mha" else {}
        return DenseDecoder(DecoderConfig(vocab_size=CP_VOCAB, **kv_heads))
    if kind in CP_FEATURE_MODELS:
        fields = dict(CP_FEATURE_MODELS[kind])
        noise = fields.pop("vector_noise", 0.0)
        return tiny_hf_model(kind, vocab_size=CP_VOCAB, vector_noise=noise, **fields)
    tied = {"tie_word_embeddings": True} if kind == "qwen3" else {}
    return tiny_hf_model(kind, attn_implementation="sdpa", vocab_size=CP_VOCAB, **tied)


def cp_local_inputs(ctx: MeshContext, seen: list[int]) -> Callable[[Inputs], Inputs]:
    """The driver's ``local_inputs`` under cp: this rank's chunks with their global positions.

    Each call appends the local sequence length to ``seen`` (a test checks the sequence was split).
    """

    def local(batch: Inputs) -> Inputs:
        kwargs, labels = batch
        part = shard_sequence({**kwargs, "labels": labels}, ctx)
        seen.append(int(part["input_ids"].shape[1]))
        keys = ("input_ids", "position_ids", DOCUMENTS_KEY)
        return {k: part[k] for k in keys if part.get(k) is not None}, part["labels"]

    return local


PACKED_DOCUMENTS = ((3, 6, 7), (11, 5))
"""Document lengths of each row of a packed :data:`CP_SEQ` batch (boundaries inside chunks and across ranks)."""


def packed_positions(lengths: tuple[tuple[int, ...], ...] = PACKED_DOCUMENTS) -> torch.Tensor:
    """``position_ids`` ``[rows, CP_SEQ]`` that restart at each document (transformers' packed format)."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])


def cp_parity(
    kind: str, sizes: dict[str, int], options: dict[str, Any], ac: str | bool = False, packed: bool = False
) -> dict[str, Any]:
    """One configuration on this rank: loss / gradient / parameter / AdamW differences and what was used.

    ``packed``: each row holds :data:`PACKED_DOCUMENTS` (``position_ids`` restart; the unsharded
    transformers model masks across documents itself). ``ok``: every difference within the driver's
    fp32 tolerances (and gradients compared).
    """
    from plait.sidecar import parallelize_model  # not a plait-cp dependency

    ctx = MeshContext.build(
        FSDP2Config(mp_policy=None, **options), ParallelismSizes(**sizes), activation_checkpointing=ac
    )

    def parallelize(model: nn.Module) -> nn.Module:
        return parallelize_model(model, ctx)  # compiles the layers when options hold enable_compile=True

    local_seq: list[int] = []
    local = cp_local_inputs(ctx, local_seq)

    dp = ctx.dp_mesh()
    parity = run_parity(
        paired(lambda: cp_decoder(kind), parallelize),
        token_batches(CP_VOCAB, dp.size(), seq=CP_SEQ, extra=_packed if packed else None),
        dp_rank=dp.get_local_rank(),
        case=f"{kind} {sizes} {options} ac={ac} packed={packed}",
        local_inputs=local,
    )
    return {
        "loss_diff": parity.loss_diff,
        "grad_rel": parity.grad_diff,
        "worst_grad": parity.worst_grad,
        "param_diff": parity.param_diff,
        "worst_param": parity.worst_param,
        "adamw_loss_diff": max(parity.adamw_loss_diffs),
        "adamw_floor": parity.adamw_floor,
        "compared": parity.grads_compared,
        "local_seq": local_seq[0],
        **{k: v for k, v in case_row(parity).items() if k in ("ok", "why")},
    }


def _packed(step: int, dp_rank: int) -> dict[str, torch.Tensor]:
    return {"position_ids": packed_positions()}
