"""How many ranks each kind of parallelism gets, with the data-parallel size inferred."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["ParallelismSizes"]


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value}")


@dataclass(frozen=True, kw_only=True)
class ParallelismSizes:
    """Number of ranks per parallelism; ``dp_size=None`` (or ``-1``) takes the ranks that are left.

    Use :meth:`resolve` to fill in ``dp_size`` for a given world size and check that the
    sizes multiply to it.
    """

    dp_size: int | None = None
    """Data-parallel ranks (replicas x shards); None or -1 = ``world // (pp*cp*tp)``."""
    dp_replicate_size: int = 1
    """Data-parallel replicas (HSDP outer axis); must divide ``dp_size``."""
    tp_size: int = 1
    """Tensor-parallel ranks."""
    pp_size: int = 1
    """Pipeline-parallel stages."""
    cp_size: int = 1
    """Context-parallel ranks."""
    ep_size: int = 1
    """Expert-parallel ranks; must divide the non-pipeline ranks ``dp*cp*tp``."""

    def __post_init__(self) -> None:
        if self.dp_size == -1:
            object.__setattr__(self, "dp_size", None)
        if self.dp_size is not None:
            _check_positive_int("dp_size", self.dp_size)
        for name in ("dp_replicate_size", "tp_size", "pp_size", "cp_size", "ep_size"):
            _check_positive_int(name, getattr(self, name))

    @property
    def dp_shard_size(self) -> int:
        """Ranks that shard parameters: ``dp_size // dp_replicate_size`` (needs a resolved ``dp_size``)."""
        if self.dp_size is None:
            raise ValueError("dp_size is not resolved yet; call sizes.resolve(world_size) first")
        return self.dp_size // self.dp_replicate_size

    @property
    def non_pp_size(self) -> int:
        """Ranks in one pipeline stage: ``dp*cp*tp`` (needs a resolved ``dp_size``)."""
        if self.dp_size is None:
            raise ValueError("dp_size is not resolved yet; call sizes.resolve(world_size) first")
        return self.dp_size * self.cp_size * self.tp_size

    def resolve(self, world_size: int, *, allow_pure_replication: bool = True) -> ParallelismSizes:
        """Return a copy with ``dp_size`` filled in, after checking every size against ``world_size``.

        Args:
            world_size: number of ranks the mesh spans.
            allow_pure_replication: False under FSDP2, where ``dp_replicate_size == dp_size > 1``
                (replicas only, nothing sharded) is rejected in favour of DDP.

        Raises:
            TypeError: ``world_size`` is not an int.
            ValueError: the sizes do not multiply to ``world_size`` or do not divide each other.
        """
        _check_positive_int("world_size", world_size)
        pp, cp, tp = self.pp_size, self.cp_size, self.tp_size
        inner = pp * cp * tp
        if self.dp_size is None:
            if world_size % inner != 0:
                raise ValueError(
                    f"world_size {world_size} is not divisible by pp*cp*tp = {pp}*{cp}*{tp} = {inner}; "
                    f"choose sizes whose product divides the world size"
                )
            dp = world_size // inner
        else:
            dp = self.dp_size
            if dp * inner != world_size:
                raise ValueError(
                    f"dp*pp*cp*tp = {dp}*{pp}*{cp}*{tp} = {dp * inner} does not equal world_size "
                    f"{world_size}; set dp_size to None to infer it, or fix the sizes"
                )
        if dp % self.dp_replicate_size != 0:
            raise ValueError(
                f"dp_size {dp} is not divisible by dp_replicate_size {self.dp_replicate_size}; "
                f"dp_replicate_size must divide the data-parallel size"
            )
        if not allow_pure_replication and self.dp_replicate_size == dp > 1:
            raise ValueError(
                f"dp_replicate_size {self.dp_replicate_size} equals dp_size {dp}: that is pure "
                f"replication with nothing sharded; use DDPConfig instead of FSDP2Config, or lower "
                f"dp_replicate_size so FSDP shards over dp_size // dp_replicate_size ranks"
            )
        non_pp = dp * cp * tp
        if non_pp % self.ep_size != 0:
            raise ValueError(
                f"ep_size {self.ep_size} does not divide the non-pipeline ranks dp*cp*tp = "
                f"{dp}*{cp}*{tp} = {non_pp}; choose an ep_size that divides {non_pp}"
            )
        return dataclasses.replace(self, dp_size=dp)
