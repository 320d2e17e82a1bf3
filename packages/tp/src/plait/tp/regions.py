"""Blocks whose projections shard activations over TP, and complete gradients for the parameters inside them."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from plait.tp.replicate import ReplicateParallel, ShardedRegion

__all__ = ["Region", "install_region_hooks", "plan_regions", "shards_output"]


def shards_output(style: ParallelStyle) -> bool:
    """Whether ``style`` is column-wise with a sharded (not gathered) output: its consumers see shards."""
    return isinstance(style, ColwiseParallel) and all(isinstance(p, Shard) for p in style.output_layouts)


@dataclass
class Region:
    """A block (the parent of sharded column-wise projections) and the modules the region tracks."""

    fqn: str
    state: ShardedRegion
    projections: list[str] = field(default_factory=list)


def _parent(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _inside(fqn: str, root: str) -> bool:
    return root == "" or fqn.startswith(root + ".")


def plan_regions(
    model: nn.Module, pairs: list[tuple[str, ParallelStyle]], head: str | None
) -> tuple[list[Region], list[tuple[str, ParallelStyle]]]:
    """Find the sharded regions and give every parameterised module inside one a region-aware style.

    A region is the parent of one or more column-wise projections with sharded outputs (the output
    head excepted). A module inside it that the plan leaves out gets ``ReplicateParallel`` and a
    planned ``ReplicateParallel`` (e.g. ``replicated_with_grad_allreduce``) is bound to the region:
    either way its gradient is summed over TP exactly when its input was computed from a sharded
    projection output, whatever the plan says about it.

    Returns:
        The regions and the ``(fqn, style)`` pairs to apply: the plan's own, each bound style a copy
        of its own (one plan pattern may match the blocks of every layer), then the added ones.

    Raises:
        ValueError: a region's block owns parameters that no style covers (they would see sharded
            activations with whole weights).
    """
    styles = dict(pairs)
    roots: dict[str, Region] = {}
    for fqn, style in pairs:
        if fqn != head and shards_output(style):
            root = _parent(fqn)
            roots.setdefault(
                root, Region(root, ShardedRegion(root or type(model).__name__))
            ).projections.append(fqn)
    bound: dict[str, ParallelStyle] = {}
    extra: list[tuple[str, ParallelStyle]] = []
    for region in roots.values():
        _check_root_params(model, region, styles)
        nested = [r for r in roots if r != region.fqn and _inside(r, region.fqn)]
        for fqn, module in model.get_submodule(region.fqn).named_modules(prefix=region.fqn):
            if fqn == region.fqn or _under_planned(fqn, styles, region.fqn):
                continue
            if any(fqn == r or _inside(fqn, r) for r in nested):
                continue  # the innermost region tracks it
            style = styles.get(fqn)
            if isinstance(style, ReplicateParallel):
                bound[fqn] = copy.copy(style)
                bound[fqn].region = region.state
            elif style is None and _own_plain_params(module):
                added = ReplicateParallel()
                added.region = region.state
                extra.append((fqn, added))
    return list(roots.values()), [(fqn, bound.get(fqn, style)) for fqn, style in pairs] + extra


def _own_plain_params(module: nn.Module) -> list[str]:
    return [n for n, p in module.named_parameters(recurse=False) if not isinstance(p, DTensor)]


def _under_planned(fqn: str, styles: dict[str, ParallelStyle], root: str) -> bool:
    """Whether a planned module strictly between ``root`` and ``fqn`` owns ``fqn``'s forward."""
    parent = _parent(fqn)
    while parent and parent != root:
        if parent in styles:
            return True
        parent = _parent(parent)
    return False


def _check_root_params(model: nn.Module, region: Region, styles: dict[str, ParallelStyle]) -> None:
    if region.fqn in styles and not isinstance(styles[region.fqn], ReplicateParallel):
        own = getattr(styles[region.fqn], "param_styles", {})
    else:
        own = {}
    plain = [n for n in _own_plain_params(model.get_submodule(region.fqn)) if n not in own]
    if plain:
        name = region.fqn or type(model).__name__
        raise ValueError(
            f"{name!r} holds parameters {plain} and runs on activations its sharded projections "
            f"{region.projections} split over TP; plait cannot tell how they combine with the shards; "
            f"name them in the tp_plan (e.g. '{region.fqn}.{plain[0]}': 'colwise' with "
            f"'{region.fqn}': 'local_params'), or gather the projections' outputs ('colwise_gather_output')"
        )


def install_region_hooks(model: nn.Module, regions: list[Region]) -> None:
    """Hook each region's block (its inputs) and sharded projections (their outputs); after the styles ran."""
    for region in regions:
        block = model.get_submodule(region.fqn)
        block.register_forward_pre_hook(region.state.enter, with_kwargs=True)
        block.register_forward_hook(region.state.leave)
        for fqn in region.projections:
            model.get_submodule(fqn).register_forward_hook(region.state.mark)
