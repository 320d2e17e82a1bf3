"""Packed documents: no token attends across a document boundary, with and without cp.

A batch's ``position_ids`` restart at each document (transformers' packed format); under cp
`shard_sequence` adds the whole sequence's document ids, which the transformers model hands to its
attention. The probe: change every token of one document and check that the other documents'
logits do not move, on the unsharded model and on each cp rank's part.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from plait.cp import DOCUMENTS_KEY, apply_context_parallel, document_ids, shard_sequence
from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes
from plait.testing import CP_SEQ, CP_VOCAB, cp_decoder, packed_positions, run_on_ranks


def _batches() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    """Two batches that differ only in row 0's second document, and which tokens they share a document with."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(CP_VOCAB, (2, CP_SEQ), generator=gen)
    positions = packed_positions()
    docs = document_ids(positions)
    changed = ids.clone()
    changed[0][docs[0] == 1] = (changed[0][docs[0] == 1] + 1) % CP_VOCAB
    untouched = torch.ones_like(ids, dtype=torch.bool)
    untouched[0] = docs[0] != 1
    return (
        {"input_ids": ids, "position_ids": positions},
        {"input_ids": changed, "position_ids": positions},
        untouched,
    )


def _probe(kind: str, cp_size: int) -> tuple[float, float]:
    """(largest logit change on untouched tokens, on the changed document), this rank's tokens."""
    model = cp_decoder(kind)
    a, b, untouched = _batches()
    if cp_size > 1:
        ctx = MeshContext.build(FSDP2Config(mp_policy=None), ParallelismSizes(cp_size=cp_size))
        apply_context_parallel(model, ctx)
        a, b = shard_sequence(a, ctx), shard_sequence(b, ctx)
        assert DOCUMENTS_KEY in a
        untouched = shard_sequence({"input_ids": untouched}, ctx)["input_ids"]
    with torch.no_grad():
        delta = (model(**a).logits - model(**b).logits).abs().amax(-1)
    return float(delta[untouched].max()), float(delta[~untouched].max())


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_a_document_sees_no_other_document(kind: str) -> None:
    """Untouched documents move by rounding at most; the changed document moves (the probe can fail)."""
    for cp_size, results in ((1, run_on_ranks(_probe, 1, kind, 1)), (2, run_on_ranks(_probe, 2, kind, 2))):
        for untouched, changed in results:
            assert untouched <= 1e-5 and changed > 1e-2, (kind, cp_size, untouched, changed)


def _refusals() -> list[str]:
    ctx = MeshContext.build(FSDP2Config(mp_policy=None), ParallelismSizes(cp_size=2))
    messages = []
    batch, _, _ = _batches()
    for model, part in (
        (cp_decoder("dense"), shard_sequence(batch, ctx)),  # attention_fn: documents cannot reach it
        (
            cp_decoder("llama"),
            shard_sequence({"input_ids": batch["input_ids"]}, ctx)
            | {"position_ids": shard_sequence(batch, ctx)["position_ids"]},
        ),
    ):
        apply_context_parallel(model, ctx)
        try:
            model(**part)
        except ValueError as err:
            messages.append(str(err))
    dist.barrier()
    return messages


def test_documents_the_attention_cannot_see_are_refused() -> None:
    """An attention_fn model with packed documents, and packed positions without their document ids."""
    for messages in run_on_ranks(_refusals, 2):
        assert len(messages) == 2, messages
        assert "reach only a transformers model's attention" in messages[0]
        assert "are not the global positions" in messages[1]
