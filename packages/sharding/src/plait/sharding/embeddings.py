"""Embeddings under FSDP: tie detection by parameter identity, the container guard, the untied split."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from plait.sharding._walk import join_fqn, owning_prefix, walk_unit_candidates
from plait.sharding.layer_groups import LayerGroup, discover_layer_groups


def tied_parameter_groups(model: nn.Module) -> list[list[str]]:
    """Return, for every parameter reachable under several names, those parameter FQNs.

    Tying is detected by identity: the same ``nn.Parameter`` object registered on two modules
    (or one module registered at two paths).
    """
    names: dict[int, list[str]] = {}
    for module_fqn, module in model.named_modules(remove_duplicate=False):
        for param_name, param in module.named_parameters(recurse=False):
            names.setdefault(id(param), []).append(join_fqn(module_fqn, param_name))
    return [fqns for fqns in names.values() if len(fqns) > 1]


def check_tied_parameters(model: nn.Module, unit_fqns: list[str]) -> None:
    """Raise when a tied parameter would be owned by two FSDP units.

    Args:
        model: The model about to be sharded (left untouched).
        unit_fqns: FQNs of the modules that will become FSDP units; everything else belongs to the root.

    Raises:
        ValueError: naming both tied FQNs and the unit that would split them.
    """
    for fqns in tied_parameter_groups(model):
        owners = {fqn: owning_prefix(fqn, unit_fqns) for fqn in fqns}
        if len(set(owners.values())) < 2:
            continue
        first, second = next((a, b) for a in fqns for b in fqns if owners[a] != owners[b])
        unit_a, unit_b = owners[first] or "<root>", owners[second] or "<root>"
        raise ValueError(
            f"Tied parameter '{first}' (FSDP unit '{unit_a}') and '{second}' (FSDP unit '{unit_b}') "
            "would be owned by two FSDP units: at least one of them lies inside a "
            "nn.ModuleList/nn.ModuleDict, whose elements each become their own unit. Move the tied "
            "modules out of the container (e.g. to the model's top level, so the root unit owns the "
            "parameter), or untie them. Nothing has been wrapped."
        )


def guard_tied_embeddings(model: nn.Module) -> None:
    """Raise before any wrapping when tied modules would land in different FSDP units.

    Uses the default unit selection (every element of every layer container is a unit).

    Raises:
        ValueError: naming both tied FQNs; the model is left untouched.
    """
    check_tied_parameters(model, [c.fqn for c in walk_unit_candidates(model)])


def _embedding(model: nn.Module, getter: str) -> nn.Module | None:
    get = getattr(model, getter, None)
    if not callable(get):
        return None
    try:
        module = get()
    except (NotImplementedError, AttributeError):
        return None
    return module if isinstance(module, nn.Module) else None


def _inside_fsdp_unit(model: nn.Module, target: nn.Module) -> bool:
    """Whether ``target`` is, or lies inside, an FSDP unit below ``model``."""
    units = [fqn for fqn, m in model.named_modules() if fqn and isinstance(m, FSDPModule)]
    target_fqns = [fqn for fqn, m in model.named_modules(remove_duplicate=False) if m is target]
    return any(owning_prefix(fqn, units) for fqn in target_fqns)


def _unit_numel(unit: nn.Module) -> int:
    """Trainable elements an FSDP unit reduce-scatters (its own parameters, not nested units')."""
    nested = [m for m in unit.modules() if m is not unit and isinstance(m, FSDPModule)]
    inner = {id(p) for m in nested for p in m.parameters()}
    return sum(p.numel() for p in unit.parameters() if p.requires_grad and id(p) not in inner)


def _largest_unit_numel(model: nn.Module) -> int:
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    return max((_unit_numel(unit) for unit in units), default=0)


def _needs_weight_in_backward(model: nn.Module, table: nn.Module) -> bool:
    """False only for plain ``nn.Embedding`` lookups: their gradient needs the indices, not the weight.

    A table under activation checkpointing reruns its forward in backward, so it needs the weight.
    """
    wrappers = [fqn for fqn, m in model.named_modules() if isinstance(m, CheckpointWrapper)]
    table_fqns = [fqn for fqn, m in model.named_modules(remove_duplicate=False) if m is table]
    if any(owning_prefix(fqn, wrappers) for fqn in table_fqns) or isinstance(model, CheckpointWrapper):
        return True
    for module in table.modules():
        if next(module.parameters(recurse=False), None) is None:
            continue
        plain_lookup = type(module).forward is nn.Embedding.forward and getattr(module, "max_norm", 0) is None
        if not plain_lookup:
            return True
    return False


def fully_shard_untied_embeddings(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy | None,
    offload_policy: OffloadPolicy | None,
    input_reshard_after_forward: bool,
    shard_fn: Callable[..., nn.Module] = fully_shard,
    layer_groups: Sequence[LayerGroup] | None = None,
) -> list[nn.Module]:
    """Give distinct, trainable input and output embedding tables their own FSDP units.

    When and why (the size rule, the head's companions, no unshard in backward) is in
    docs/behavior.md, "Untied embeddings".

    Args:
        model: Model with ``get_input_embeddings()`` / ``get_output_embeddings()`` (missing = None).
        mesh: The FSDP mesh.
        mp_policy: Mixed-precision policy of the surrounding units.
        offload_policy: Offload policy of the surrounding units.
        input_reshard_after_forward: Reshard policy of the input table (the head never reshards).
        shard_fn: The FSDP primitive, ``fully_shard`` by default (called with a module or a list).
        layer_groups: The model's layer containers (default: ``discover_layer_groups(model)``).

    Returns:
        The newly wrapped tables, input first.
    """
    inp, out = _embedding(model, "get_input_embeddings"), _embedding(model, "get_output_embeddings")
    candidates = _tables_to_split(model, inp, out, input_reshard_after_forward)
    for table, reshard in candidates:
        companions = _head_companions(model, layer_groups, inp, out) if table is out else []
        shard_fn(
            [table, *companions] if companions else table,
            mesh=mesh,
            reshard_after_forward=reshard,
            mp_policy=mp_policy or MixedPrecisionPolicy(),
            offload_policy=offload_policy or OffloadPolicy(),
        )
        if reshard and isinstance(table, FSDPModule) and not _needs_weight_in_backward(model, table):
            table.set_unshard_in_backward(False)
    return [table for table, _ in candidates]


def _tables_to_split(
    model: nn.Module, inp: nn.Module | None, out: nn.Module | None, input_reshard: bool
) -> list[tuple[nn.Module, bool]]:
    """``(table, reshard_after_forward)`` for each table that gets its own unit; none when tied or small."""
    if inp is None or out is None or inp is out:
        return []
    if {id(p) for p in inp.parameters()} & {id(p) for p in out.parameters()}:
        return []
    candidates = [
        (table, reshard)
        for table, reshard in ((inp, input_reshard), (out, False))
        if _is_free_trainable_table(model, table)
    ]
    tables_numel = sum(p.numel() for table, _ in candidates for p in table.parameters())
    return candidates if tables_numel > _largest_unit_numel(model) else []


def _is_free_trainable_table(model: nn.Module, table: nn.Module) -> bool:
    """A table with parameters, all trainable, not an FSDP unit and not inside one."""
    params = list(table.parameters())
    if not params or not all(p.requires_grad for p in params):
        return False
    return not isinstance(table, FSDPModule) and not _inside_fsdp_unit(model, table)


def _head_companions(
    model: nn.Module, layer_groups: Sequence[LayerGroup] | None, inp: nn.Module, out: nn.Module
) -> list[nn.Module]:
    """Trainable non-embedding siblings of the language layer containers (e.g. ``model.norm``)."""
    groups = discover_layer_groups(model) if layer_groups is None else layer_groups
    tied = {fqn for fqns in tied_parameter_groups(model) for fqn in fqns}
    found: list[nn.Module] = []
    for group in groups:
        if group.kind != "language":
            continue
        parent_fqn = group.path.rpartition(".")[0]
        parent = model.get_submodule(parent_fqn)
        for name, child in parent.named_children():
            fqn = join_fqn(parent_fqn, name)
            params = dict(child.named_parameters())
            if (
                child is inp
                or child is out
                or isinstance(child, nn.Embedding)
                or not params
                or not all(p.requires_grad for p in params.values())
                or any(join_fqn(fqn, n) in tied for n in params)
                or any(isinstance(m, FSDPModule) for m in child.modules())
                or _inside_fsdp_unit(model, child)
                or any(child is m for m in found)
            ):
                continue
            found.append(child)
    return found
