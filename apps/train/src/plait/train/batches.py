"""From a packed corpus to a rank's micro-batches: windows, the resumable global order, extra inputs."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["GlobalSampler", "PackedDataset", "document_positions", "synthetic_images"]


class PackedDataset:
    """A token stream cut into ``seq_len + 1`` windows: ``inputs = w[:-1]``, ``labels = w[1:]``."""

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)`` of shape (len(indices), seq_len), int64."""
        s = self.seq_len
        windows = np.stack([self.tokens[i * s : i * s + s + 1] for i in indices]).astype(np.int64)
        data = torch.from_numpy(windows)
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()


class GlobalSampler:
    """Indices of one global order, sliced per data-parallel rank; resumable by position."""

    def __init__(
        self, num_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int, *, seed: int, shuffle: bool
    ) -> None:
        self.num_samples = num_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.position = 0
        self._epoch = -1
        self._order = np.arange(num_samples)

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_samples)
        if self.shuffle and epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            self._order = torch.randperm(self.num_samples, generator=generator).numpy()
            self._epoch = epoch
        return int(self._order[offset])

    def next_indices(self) -> list[int]:
        """This rank's sample indices of the next micro-batch; advances the global position."""
        start = self.position + self.dp_rank * self.micro_batch_size
        indices = [self._index(start + i) for i in range(self.micro_batch_size)]
        self.position += self.micro_batch_size * self.dp_size
        return indices

    def state_dict(self) -> dict[str, int]:
        """``position``: samples consumed in the global order (all dp ranks together), the whole
        resumable state; it does not depend on the mesh, so a job may resume on another dp size."""
        return {"position": self.position, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a :meth:`state_dict`.

        Raises:
            ValueError: the state was saved over a corpus with a different number of samples.
        """
        saved = state.get("num_samples", self.num_samples)
        if saved != self.num_samples:
            raise ValueError(
                f"the checkpoint's data position is over {saved} training sequences but this corpus has "
                f"{self.num_samples}; resume with the same data, tokenizer and data.seq_len"
            )
        self.position = int(state["position"])


def document_positions(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """``position_ids`` that restart at each document: a document begins after every ``eos_id``.

    The EOS ends its document (it is the last token that document attends to); the first token of
    a row starts at 0 whether or not a document began there.
    """
    seq = input_ids.shape[1]
    index = torch.arange(seq, device=input_ids.device).expand_as(input_ids)
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 1:] = input_ids[:, :-1] == eos_id
    first = torch.where(starts, index, 0).cummax(dim=1).values
    return index - first


def synthetic_images(indices: list[int], channels: int, size: int, seed: int) -> torch.Tensor:
    """Deterministic pseudo-images for VLM recipes on a text corpus: one per sample index."""
    images = [
        torch.rand(channels, size, size, generator=torch.Generator().manual_seed(seed * 7919 + 104729 + i))
        for i in indices
    ]
    return torch.stack(images)
