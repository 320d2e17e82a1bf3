"""The load-balanced layout and `shard_sequence`: head + tail chunks, global positions, equal causal work."""

from __future__ import annotations

import pytest
import torch

from plait.cp import chunk_ids, global_positions, shard_sequence, unshard_sequence
from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes


def test_each_rank_holds_a_head_and_a_tail_chunk() -> None:
    assert [chunk_ids(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert global_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    covered = torch.cat([global_positions(32, r, 4) for r in range(4)])
    assert sorted(covered.tolist()) == list(range(32))


def test_causal_work_is_balanced() -> None:
    """Visible (query, key) pairs under a causal mask are the same on every rank."""
    work = {r: int((global_positions(64, r, 4) + 1).sum()) for r in range(4)}
    assert len(set(work.values())) == 1, work


def test_shard_sequence_splits_inputs_labels_and_positions_alike(fake_pg) -> None:
    ids = torch.arange(24).view(2, 12)
    batch = {"input_ids": ids, "labels": ids + 100, "pixel_values": torch.ones(3)}
    full = torch.zeros_like(ids)
    for rank in (2, 3):  # cp ranks 0 and 1 of the second dp group on a (dp=2, cp=2) mesh
        with fake_pg(4, rank=rank):
            ctx = MeshContext.build(FSDP2Config(), ParallelismSizes(cp_size=2))
            local = shard_sequence(batch, ctx)
        cp_rank = rank % 2
        expected = global_positions(12, cp_rank, 2)
        assert torch.equal(local["position_ids"], expected.expand(2, -1))
        assert torch.equal(local["input_ids"], ids[:, expected])
        assert torch.equal(local["labels"], local["input_ids"] + 100)
        assert local["pixel_values"] is batch["pixel_values"]
        full = unshard_sequence(local["input_ids"], cp_rank, 2, full)
    assert torch.equal(full, ids)


def test_shard_sequence_refuses_an_indivisible_length(fake_pg) -> None:
    with fake_pg(2):
        ctx = MeshContext.build(FSDP2Config(), ParallelismSizes(cp_size=2))
        with pytest.raises(ValueError, match=r"sequence length 6 must be a multiple of 2 \* cp_size = 4"):
            shard_sequence({"input_ids": torch.zeros(1, 6, dtype=torch.long)}, ctx)
        with pytest.raises(ValueError, match="disagree on the sequence length"):
            shard_sequence({"input_ids": torch.zeros(1, 8), "labels": torch.zeros(1, 4)}, ctx)


def test_cp_one_returns_the_batch_unchanged(fake_pg) -> None:
    with fake_pg(2):
        ctx = MeshContext.build(FSDP2Config(), ParallelismSizes())
        batch = {"input_ids": torch.zeros(1, 6)}
        assert shard_sequence(batch, ctx) == batch
