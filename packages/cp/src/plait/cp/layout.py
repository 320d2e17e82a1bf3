"""The load-balanced sequence layout: which chunks of the sequence each cp rank holds.

The sequence is cut into ``2 * cp`` equal chunks; cp rank ``r`` holds chunk ``r`` (the head) followed
by chunk ``2 * cp - 1 - r`` (the tail). Under a causal mask an early chunk attends to little and a
late one to a lot, so pairing them gives every rank the same amount of attention work.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from plait.mesh import MeshContext

__all__ = [
    "DOCUMENTS_KEY",
    "chunk_ids",
    "cp_mesh",
    "document_ids",
    "global_positions",
    "rank_order",
    "shard_sequence",
    "unshard_sequence",
]

SEQUENCE_KEYS = ("input_ids", "labels", "position_ids", "attention_mask", "inputs_embeds")
"""Batch entries split along the sequence (dim 1); every other entry is passed through unchanged."""
DOCUMENTS_KEY = "document_ids"
"""The entry `shard_sequence` adds for packed documents: the whole sequence's document ids, unsplit."""


def document_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Document ids ``[batch, seq]`` of packed ``position_ids``, or None when each row is one document.

    A document starts where the position is not the previous one plus 1 (transformers' rule for
    packed sequences), so ``[0, 1, 2, 0, 1, 0]`` holds documents ``[0, 0, 0, 1, 1, 2]``.
    """
    first = position_ids[:, :1] - 1
    starts = torch.diff(position_ids, prepend=first, dim=-1) != 1
    ids = starts.cumsum(-1)
    return None if not bool(ids[:, -1].any()) else ids


def chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunk indices (head, tail) that ``cp_rank`` holds, in the order it holds them."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def global_positions(
    seq_len: int, cp_rank: int, cp_size: int, device: torch.device | None = None
) -> torch.Tensor:
    """Global positions (int64, ``[seq_len // cp_size]``) of the tokens ``cp_rank`` holds."""
    _check_divisible(seq_len, cp_size)
    chunk = seq_len // (2 * cp_size)
    head, tail = chunk_ids(cp_rank, cp_size)
    return torch.cat(
        [
            torch.arange(head * chunk, (head + 1) * chunk, device=device),
            torch.arange(tail * chunk, (tail + 1) * chunk, device=device),
        ]
    )


def rank_order(local_seq: int, cp_size: int, device: torch.device | None = None) -> torch.Tensor:
    """Global position of each token of every rank's tokens concatenated rank by rank (an all-gather's order)."""
    seq = local_seq * cp_size
    return torch.cat([global_positions(seq, rank, cp_size, device) for rank in range(cp_size)])


def cp_mesh(mesh_context: MeshContext) -> DeviceMesh | None:
    """The 1-D ``cp`` mesh of the context, or None when cp is 1."""
    if mesh_context.cp_size == 1:
        return None
    return mesh_context.device_mesh["cp"]


def shard_sequence(
    batch: Mapping[str, torch.Tensor | None], mesh_context: MeshContext
) -> dict[str, torch.Tensor | None]:
    """This cp rank's part of a batch: inputs, labels and positions split the same load-balanced way.

    Entries named in ``SEQUENCE_KEYS`` are split along dim 1 (``[batch, seq, ...]``); ``position_ids``
    is added (global positions, ``[batch, seq // cp]``) when the batch has none, so rotary embeddings
    see where each token really is. Packed documents (``position_ids`` that restart, see
    `document_ids`) add ``DOCUMENTS_KEY``: the whole sequence's document ids, which the model's
    forward takes with the rest (a transformers model hands them to its attention), so no token
    attends across a document boundary. Other entries are returned unchanged. With cp = 1 the batch is
    returned as a new dict, unchanged. No collective: every rank must pass the same full batch.

    Raises:
        ValueError: the sequence length is not a multiple of ``2 * cp_size``, or the sequence
            entries disagree on it.
    """
    out = dict(batch)
    mesh = cp_mesh(mesh_context)
    if mesh is None:
        return out
    cp_size, cp_rank = mesh.size(), mesh.get_local_rank()
    seq_len = _sequence_length(batch)
    if out.get("position_ids") is None:
        ref = next(batch[k] for k in SEQUENCE_KEYS if batch.get(k) is not None)
        out["position_ids"] = torch.arange(seq_len, device=ref.device).expand(ref.shape[0], seq_len)
    elif (documents := document_ids(out["position_ids"])) is not None:
        out[DOCUMENTS_KEY] = documents
    index = global_positions(seq_len, cp_rank, cp_size)
    for key in SEQUENCE_KEYS:
        value = out.get(key)
        if value is not None:
            out[key] = value.index_select(1, index.to(value.device)).contiguous()
    return out


def unshard_sequence(local: torch.Tensor, cp_rank: int, cp_size: int, full: torch.Tensor) -> torch.Tensor:
    """Write ``local`` (``[batch, seq // cp, ...]``, this rank's part) into ``full`` at its global positions."""
    index = global_positions(full.shape[1], cp_rank, cp_size, device=full.device)
    return full.index_copy(1, index, local)


def _sequence_length(batch: Mapping[str, torch.Tensor | None]) -> int:
    lengths = {k: v.shape[1] for k in SEQUENCE_KEYS if (v := batch.get(k)) is not None}
    if not lengths:
        raise ValueError(f"shard_sequence found none of {list(SEQUENCE_KEYS)} in the batch {sorted(batch)}")
    if len(set(lengths.values())) != 1:
        raise ValueError(f"shard_sequence: batch entries disagree on the sequence length (dim 1): {lengths}")
    return next(iter(lengths.values()))


def _check_divisible(seq_len: int, cp_size: int) -> None:
    if cp_size < 1 or seq_len % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq_len} must be a multiple of 2 * cp_size = {2 * cp_size} (each cp rank "
            "holds a head and a tail chunk); pad or choose data.seq_len accordingly"
        )
