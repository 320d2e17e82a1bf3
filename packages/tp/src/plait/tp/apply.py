"""Apply a resolved TP plan: parallelize matched modules, re-tie tied parameters, rewrite local head counts."""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from plait.tp.discovery import model_embeddings, module_fqn
from plait.tp.regions import install_region_hooks, plan_regions, shards_output
from plait.tp.resolve import normalize_plan, unmatched_message
from plait.tp.validate import KV_HEAD_ATTRS, Q_HEAD_ATTRS, check_divisible

__all__ = ["apply_tp"]

_Owner = tuple[nn.Module, str, str]  # (module, module FQN, parameter name)


def _expand(model: nn.Module, plan: dict[str, ParallelStyle]) -> list[tuple[str, ParallelStyle]]:
    """Concrete ``(fqn, style)`` pairs in plan order; every pattern must match, no module twice."""
    fqns = [fqn for fqn, _ in model.named_modules() if fqn]
    claimed: dict[str, str] = {}
    pairs: list[tuple[str, ParallelStyle]] = []
    for pattern, style in plan.items():
        matched = [fqn for fqn in fqns if fnmatchcase(fqn, pattern)]
        if not matched:
            raise ValueError(
                f"{unmatched_message(model, pattern, fqns, 'tp_plan')}; fix or remove the pattern"
            )
        for fqn in matched:
            if fqn in claimed:
                raise ValueError(
                    f"module {fqn!r} is matched by tp_plan patterns {claimed[fqn]!r} and {pattern!r}; "
                    "make the patterns disjoint"
                )
            claimed[fqn] = pattern
            pairs.append((fqn, style))
    return pairs


def _tied_groups(model: nn.Module) -> list[list[_Owner]]:
    """Groups of (module, fqn, name) that share one parameter object, over distinct modules."""
    owners: dict[int, list[_Owner]] = {}
    seen: set[tuple[int, str]] = set()
    for fqn, module in model.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is None or (id(module), name) in seen:
                continue
            seen.add((id(module), name))
            owners.setdefault(id(param), []).append((module, fqn, name))
    return [group for group in owners.values() if len(group) > 1]


def _check_tied_coverage(groups: list[list[_Owner]], targets: set[str]) -> None:
    for group in groups:
        covered = [fqn in targets for _, fqn, _ in group]
        if any(covered) and not all(covered):
            names = ", ".join(f"{fqn}.{name}" for _, fqn, name in group)
            missing = [fqn for (_, fqn, _), hit in zip(group, covered, strict=True) if not hit]
            raise ValueError(
                f"tied parameters ({names}) must be parallelized together, but {missing} is not in the tp_plan; "
                "add it with a style that shards the weight the same way, or untie the weights"
            )


def _retie(groups: list[list[_Owner]]) -> None:
    for group in groups:
        first_module, first_fqn, first_name = group[0]
        keep = getattr(first_module, first_name)
        for module, fqn, name in group[1:]:
            other = getattr(module, name)
            if other is keep:
                continue
            same = (
                isinstance(keep, DTensor)
                and isinstance(other, DTensor)
                and keep.placements == other.placements
                and keep.device_mesh == other.device_mesh
                and keep.shape == other.shape
            )
            if not same:
                raise ValueError(
                    f"tied parameters {first_fqn}.{first_name} and {fqn}.{name} were sharded differently "
                    f"({_layout(keep)} vs {_layout(other)}); give both modules styles that shard the weight alike"
                )
            module.register_parameter(name, keep)


def _layout(param: Any) -> str:
    return str(param.placements) if isinstance(param, DTensor) else "not sharded"


def _head_modules(
    model: nn.Module, pairs: list[tuple[str, ParallelStyle]], tp_size: int, head: str | None
) -> list[nn.Module]:
    """Modules with head-count attributes whose direct child shards its output column-wise (by head).

    A column-wise projection whose output is gathered (``colwise_gather_output``) hands the module
    every head, so its head counts stay as they are.
    """
    colwise_parents = {fqn.rpartition(".")[0] for fqn, style in pairs if shards_output(style) and fqn != head}
    found: list[nn.Module] = []
    for fqn in sorted(colwise_parents):
        module = model.get_submodule(fqn)
        attrs = [a for a in Q_HEAD_ATTRS + KV_HEAD_ATTRS if isinstance(vars(module).get(a), int)]
        for attr in attrs:
            check_divisible(f"{fqn or type(model).__name__}.{attr}", getattr(module, attr), tp_size)
        if attrs:
            found.append(module)
    return found


def _rewrite_local_heads(modules: list[nn.Module], tp_size: int) -> None:
    for module in modules:
        for attr in Q_HEAD_ATTRS + KV_HEAD_ATTRS:
            value = vars(module).get(attr)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(module, attr, value // tp_size)


def _validate_styles(model: nn.Module, pairs: list[tuple[str, ParallelStyle]], tp_size: int) -> None:
    """Run the styles' own checks (those that define ``validate``) before any of them communicates."""
    for fqn, style in pairs:
        validate = getattr(style, "validate", None)
        if callable(validate):
            validate(fqn, model.get_submodule(fqn), tp_size)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, ParallelStyle | str]) -> nn.Module:
    """Parallelize ``model`` in place over the 1-D ``tp_mesh`` with ``plan``; returns the same model.

    Patterns are expanded with ``fnmatch`` over module FQNs (a pattern matching nothing, or two patterns
    matching one module, is an error) and each matched module gets ``parallelize_module`` in plan
    order. Parameters tied before (e.g. input embedding and ``lm_head``) are tied again afterwards.
    Attention modules whose projections shard their outputs column-wise get local head counts
    (``num_heads``, ``num_key_value_heads``, ... divided by the TP size; ``head_dim`` kept; configs are
    not touched); gathered outputs leave them whole. Every parameterised module inside a block with
    sharded projections gets replicated DTensor parameters whose gradient is summed over TP exactly
    when the module ran on sharded activations (see ``plan_regions``).

    Raises:
        ValueError: a non 1-D mesh, unmatched or overlapping patterns, tied parameters only partly in the
            plan or sharded differently, head counts not divisible by the TP size, a style's own check
            (e.g. experts parameters the plan leaves whole). All raised before any collective.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(
            f"apply_tp needs a 1-D TP mesh, got a {tp_mesh.ndim}-D mesh {tp_mesh.mesh_dim_names}"
        )
    tp_size = tp_mesh.size()
    pairs = _expand(model, normalize_plan(plan, "tp_plan"))
    head = module_fqn(model, model_embeddings(model, "get_output_embeddings"))
    heads = _head_modules(model, pairs, tp_size, head)
    regions, pairs = plan_regions(model, pairs, head)
    tied = _tied_groups(model)
    _check_tied_coverage(tied, {fqn for fqn, _ in pairs})
    _validate_styles(model, pairs, tp_size)
    for fqn, style in pairs:
        parallelize_module(model.get_submodule(fqn), tp_mesh, style)
    install_region_hooks(model, regions)
    _retie(tied)
    _rewrite_local_heads(heads, tp_size)
    return model
