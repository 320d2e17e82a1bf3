"""The FSDP unit record and the one reshard-after-forward policy every unit of the flow follows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["FSDPUnit", "UnitRole", "unit_reshard_after_forward"]


UnitRole = Literal["experts", "layer", "head", "input_embedding", "output_embedding", "child", "root"]
"""What an FSDP unit holds; its reshard-after-forward value follows from it (`unit_reshard_after_forward`)."""


@dataclass(frozen=True)
class FSDPUnit:
    """One planned FSDP unit: the modules wrapped together, what they are, the mesh and the reshard value."""

    modules: tuple[str, ...]
    """FQNs wrapped as one unit (``""`` = the root); more than one for a head with its companions."""
    role: UnitRole
    reshard_after_forward: bool | int
    mesh: str = "fsdp"
    """``fsdp`` (the context's FSDP mesh) or ``ep_shard`` (experts)."""

    @property
    def name(self) -> str:
        """The unit's modules joined by ``+`` (``<root>`` for the root)."""
        return "+".join(m or "<root>" for m in self.modules)


def unit_reshard_after_forward(
    role: UnitRole,
    *,
    explicit: bool | int | None = None,
    last: bool = False,
    pipeline_stage: bool = False,
    replays_ops: bool = False,
) -> bool | int:
    """The one reshard-after-forward policy of every FSDP unit the flow creates.

    Args:
        role: What the unit holds.
        explicit: The configured value (``FSDP2Config.reshard_after_forward``, or ``MoEConfig``'s under
            expert parallel); None = the per-role default.
        last: The unit is the last element of its layer container (its parameters are needed first
            in backward, so freeing them after forward only costs an all-gather).
        pipeline_stage: The model is one pipeline stage: each microbatch runs forward and later
            backward, so resharding would all-gather every unit again per microbatch.
        replays_ops: The layers run under torch's selective checkpoint, which replays the forward's
            ops by index: an experts unit that reshards would all-gather again inside the recompute.

    Returns:
        The value for ``fully_shard(..., reshard_after_forward=...)``.
    """
    if role in ("root", "head", "output_embedding", "child"):
        return False  # needed again at once (root, heads) or never worth freeing
    if role == "experts" and replays_ops:
        return False
    if explicit is None and pipeline_stage:
        explicit = False
    if role == "input_embedding":
        return explicit is not False
    if explicit is not None:
        return explicit
    return role == "experts" or not last
