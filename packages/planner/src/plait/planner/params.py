"""What one rank holds of the model: its pipeline stages' layers and its share of every weight."""

from __future__ import annotations

from dataclasses import dataclass

from plait.planner.layout import Layout
from plait.planner.shape import ModelShape

__all__ = ["ParamSizes", "StageShare", "param_sizes", "stage_shares"]


@dataclass(frozen=True)
class StageShare:
    """What one pipeline rank holds: its layers (dense and MoE), and the embedding or head."""

    pp_rank: int
    dense_layers: int
    moe_layers: int
    embedding: bool
    head: bool


def _layers_per_stage(layers: int, stages: int) -> list[int]:
    base, extra = divmod(layers, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


def stage_shares(shape: ModelShape, layout: Layout, *, every_rank: bool = False) -> list[StageShare]:
    """The first and last pipeline rank's share (every rank's with ``every_rank``; one without pp)."""
    counts = _layers_per_stage(shape.num_layers, layout.stages)
    firsts = [sum(counts[:i]) for i in range(layout.stages)]
    v_shape = layout.pp_schedule == "zbv_zero_bubble"
    shares = []
    for rank in range(layout.pp) if every_rank else sorted({0, layout.pp - 1}):
        if v_shape:
            stages = [rank, 2 * layout.pp - 1 - rank]
        else:
            stages = [rank + j * layout.pp for j in range(layout.stages_per_rank)]
        dense = moe = 0
        for s in stages:
            for layer in range(firsts[s], firsts[s] + counts[s]):
                if shape.moe and layer >= shape.dense_layers:
                    moe += 1
                else:
                    dense += 1
        shares.append(StageShare(rank, dense, moe, 0 in stages, layout.stages - 1 in stages))
    return shares


@dataclass(frozen=True)
class ParamSizes:
    """Parameter elements of one rank: sharded (what it stores) and unsharded (what FSDP gathers)."""

    dense_local: float
    """Non-expert weights this rank stores (after TP, sharded over dp_shard x cp)."""
    expert_local: float
    """Expert weights this rank stores (1/ep of the experts, sharded over ep_shard)."""
    unsharded: float
    """Everything this rank's stages compute with once gathered (TP-local, 1/ep of the experts)."""
    largest_unit: float
    """The largest layer unit, gathered."""
    root: float
    """The root unit (embedding, head, final norm), gathered."""

    @property
    def local(self) -> float:
        """Every parameter element this rank stores."""
        return self.dense_local + self.expert_local


def param_sizes(shape: ModelShape, layout: Layout, share: StageShare) -> ParamSizes:
    """This rank's parameter elements for its stages (``share``)."""
    t, h = layout.tp, shape.hidden_size
    attn = shape.attention_params() / shape.head_split(t) + 2 * h
    dense_unit = attn + shape.dense_mlp_params() / t
    experts_gathered = shape.expert_params() / layout.ep
    moe_dense = attn + shape.moe_dense_params()
    root = (shape.vocab_size * h / t) * (int(share.embedding) + int(share.head and not shape.tied_embeddings))
    root += h if share.head else 0
    dense = share.dense_layers * dense_unit + share.moe_layers * moe_dense + root
    expert_shards = layout.ep_shard if layout.ep > 1 else layout.fsdp
    return ParamSizes(
        dense_local=dense / layout.fsdp,
        expert_local=share.moe_layers * experts_gathered / expert_shards,
        unsharded=dense + share.moe_layers * experts_gathered,
        largest_unit=max(
            dense_unit if share.dense_layers else 0.0,
            moe_dense + experts_gathered if share.moe_layers else 0.0,
        ),
        root=root,
    )
