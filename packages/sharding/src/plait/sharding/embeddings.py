"""Embeddings under FSDP: tie detection by parameter identity, the container guard, the untied split."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from plait.sharding._walk import join_fqn, owning_prefix, walk_unit_candidates
from plait.sharding.layer_groups import LayerGroup, discover_layer_groups
from plait.sharding.unit_policy import FSDPUnit


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


def _fqn_of(model: nn.Module, target: nn.Module) -> list[str]:
    return [fqn for fqn, m in model.named_modules(remove_duplicate=False) if m is target]


def _in_unit(fqns: Sequence[str], units: list[str]) -> bool:
    """Whether any of ``fqns`` is, or lies inside, one of ``units``."""
    return any(owning_prefix(fqn, units) for fqn in fqns)


def _unit_numel(model: nn.Module, unit: str, units: list[str]) -> int:
    """Trainable elements a unit reduce-scatters (its own parameters, not nested units')."""
    return sum(
        p.numel()
        for name, p in model.named_parameters()
        if p.requires_grad and owning_prefix(name, units) == unit
    )


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

    The units are :func:`plan_untied_embedding_units` of the units already wrapped. When and why
    (the size rule, the head's companions, no unshard in backward) is in docs/behavior.md,
    "Untied embeddings".

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
    wrapped = [fqn for fqn, m in model.named_modules() if fqn and isinstance(m, FSDPModule)]
    planned = plan_untied_embedding_units(
        model, wrapped, input_reshard_after_forward=input_reshard_after_forward, layer_groups=layer_groups
    )
    tables = []
    for unit in planned:
        modules = [model.get_submodule(fqn) for fqn in unit.modules]
        shard_fn(
            modules if len(modules) > 1 else modules[0],
            mesh=mesh,
            reshard_after_forward=unit.reshard_after_forward,
            mp_policy=mp_policy or MixedPrecisionPolicy(),
            offload_policy=offload_policy or OffloadPolicy(),
        )
        table = modules[0]
        if (
            unit.reshard_after_forward
            and isinstance(table, FSDPModule)
            and not _needs_weight_in_backward(model, table)
        ):
            table.set_unshard_in_backward(False)
        tables.append(table)
    return tables


def plan_untied_embedding_units(
    model: nn.Module,
    units: list[str],
    *,
    input_reshard_after_forward: bool,
    layer_groups: Sequence[LayerGroup] | None = None,
) -> list[FSDPUnit]:
    """The units :func:`fully_shard_untied_embeddings` adds after the units ``units`` (FQNs), input first.

    None when the tables are tied, frozen, inside a unit, or together no larger than the largest unit.
    """
    inp, out = _embedding(model, "get_input_embeddings"), _embedding(model, "get_output_embeddings")
    if inp is None or out is None or inp is out:
        return []
    if {id(p) for p in inp.parameters()} & {id(p) for p in out.parameters()}:
        return []
    candidates = [
        (table, role)
        for table, role in ((inp, "input_embedding"), (out, "output_embedding"))
        if _is_free_trainable_table(model, table, units)
    ]
    tables_numel = sum(p.numel() for table, _ in candidates for p in table.parameters())
    if tables_numel <= max((_unit_numel(model, u, units) for u in units), default=0):
        return []
    planned = []
    for table, role in candidates:
        companions = _head_companions(model, layer_groups, inp, out, units) if table is out else []
        reshard = input_reshard_after_forward if role == "input_embedding" else False
        fqns = (_fqn_of(model, table)[0], *(_fqn_of(model, c)[0] for c in companions))
        planned.append(FSDPUnit(fqns, role, reshard))
    return planned


def _is_free_trainable_table(model: nn.Module, table: nn.Module, units: list[str]) -> bool:
    """A table with parameters, all trainable, not a unit and not inside one."""
    params = list(table.parameters())
    if not params or not all(p.requires_grad for p in params):
        return False
    return not isinstance(table, FSDPModule) and not _in_unit(_fqn_of(model, table), units)


def _head_companions(
    model: nn.Module,
    layer_groups: Sequence[LayerGroup] | None,
    inp: nn.Module,
    out: nn.Module,
    units: list[str],
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
                or any(u == fqn or u.startswith(fqn + ".") for u in units)
                or _in_unit([fqn], units)
                or any(child is m for m in found)
            ):
                continue
            found.append(child)
    return found
