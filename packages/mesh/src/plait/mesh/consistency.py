"""Check that every rank asks for the same thing before the first collective.

A configuration that differs on one rank (a ``tp_size``, a layer count) otherwise makes the ranks
issue different collectives, and the job hangs until the process-group timeout (30 min on gloo).
:func:`check_ranks_agree` compares a small description of the call across all ranks through the
default process group's key-value store, never through a collective: each wait is bounded by a
short timeout, so a rank that disagrees or never arrives is one ``ValueError`` on every rank
within seconds.

Exchange: the first rank of the group publishes its description; every other rank compares its own and,
when they differ, files a report; every rank then counts itself in, and the last one to arrive
opens the gate. All ranks read the same reports, so all raise the same one-line message.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import itertools
import json
import os
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from plait.mesh.context import MeshContext

__all__ = [
    "CONSISTENCY_TIMEOUT_ENV",
    "check_ranks_agree",
    "describe_arguments",
    "describe_config",
    "describe_mesh_context",
    "describe_module",
]

CONSISTENCY_TIMEOUT_ENV = "PLAIT_CONSISTENCY_TIMEOUT_S"
"""Seconds a rank waits for the others at a check (default 60)."""
_DEFAULT_TIMEOUT_S = 60.0
_MAX_REPORTS = 3
_MAX_DIFFS = 3
_MAX_DEPTH = 6
_LISTED_RANKS = 1024
_CALLS: dict[str, itertools.count[int]] = {}
"""Sequence numbers of this process's checks per group of ranks: its ranks make the same checks in order."""


def describe_config(value: Any, prefix: str) -> dict[str, str]:
    """Flatten a config (dataclasses, mappings, scalars) into ``{"prefix.field": "value"}``.

    Objects are described by type and attributes, never by address, so equal configs on two
    ranks give equal descriptions.
    """
    out: dict[str, str] = {}
    _flatten(value, prefix, out, 0)
    return out


def describe_arguments(**arguments: Any) -> dict[str, str]:
    """:func:`describe_config` of each keyword argument under its own name."""
    out: dict[str, str] = {}
    for name, value in arguments.items():
        _flatten(value, name, out, 0)
    return out


def _flatten(value: Any, key: str, out: dict[str, str], depth: int) -> None:
    if depth < _MAX_DEPTH and dataclasses.is_dataclass(value) and not isinstance(value, type):
        out[key] = type(value).__qualname__
        for f in dataclasses.fields(value):
            _flatten(getattr(value, f.name), f"{key}.{f.name}", out, depth + 1)
    elif depth < _MAX_DEPTH and isinstance(value, Mapping):
        out[key] = f"mapping of {len(value)}"
        for k in sorted(value, key=str):
            _flatten(value[k], f"{key}[{k!r}]", out, depth + 1)
    else:
        text = _leaf(value, depth)
        out[key] = text if len(text) <= 200 else f"{text[:60]}... (sha256 {_digest(text)[:16]})"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _leaf(value: Any, depth: int) -> str:
    if value is None or isinstance(value, bool | int | float | str | torch.dtype | torch.device | enum.Enum):
        return repr(value)
    if isinstance(value, list | tuple):
        return f"[{', '.join(_leaf(v, depth + 1) for v in value)}]"
    if isinstance(value, set | frozenset):
        return f"{{{', '.join(sorted(_leaf(v, depth + 1) for v in value))}}}"
    if isinstance(value, type) or (callable(value) and hasattr(value, "__qualname__")):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    attrs = getattr(value, "__dict__", None)
    if depth < _MAX_DEPTH and attrs:
        inner = ", ".join(
            f"{k}={_leaf(v, depth + 1)}" for k, v in sorted(attrs.items()) if not k.startswith("_")
        )
        return f"{type(value).__qualname__}({inner})"
    return type(value).__qualname__


def describe_module(model: nn.Module) -> dict[str, str]:
    """The model's structure: class, and every parameter's and buffer's name, shape, dtype, device type."""
    out = {"model.class": f"{type(model).__module__}.{type(model).__qualname__}"}
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            frozen = "" if kind == "buffer" or t.requires_grad else " frozen"
            out[f"{kind} {name}"] = f"{tuple(t.shape)} {t.dtype} {t.device.type}{frozen}"
    return out


def describe_mesh_context(ctx: MeshContext) -> dict[str, str]:
    """A mesh context's sizes, mesh shapes, strategy and options."""
    out = {
        "sizes": f"pp={ctx.pp_size} dp={ctx.dp_size} dp_replicate={ctx.dp_replicate_size} "
        f"dp_shard={ctx.dp_shard_size} cp={ctx.cp_size} tp={ctx.tp_size} ep={ctx.ep_size}",
        "activation_checkpointing": repr(ctx.activation_checkpointing),
        "reapply_trainability": _leaf(ctx.reapply_trainability, 0),
    }
    for name in ("device_mesh", "moe_mesh"):
        mesh = getattr(ctx, name)
        out[name] = (
            "None" if mesh is None else f"{mesh.device_type} {tuple(mesh.shape)} {mesh.mesh_dim_names}"
        )
    out.update(describe_config(ctx.strategy_config, "strategy_config"))
    out.update(describe_config(ctx.moe_config, "moe_config"))
    return out


def _timeout() -> float:
    raw = os.environ.get(CONSISTENCY_TIMEOUT_ENV)
    if raw is None:
        return _DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{CONSISTENCY_TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
    return value


def _active() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake"


def check_ranks_agree(
    what: str,
    description: Mapping[str, str],
    *,
    ranks: Sequence[int] | None = None,
    timeout: float | None = None,
) -> None:
    """Raise the same ValueError on every rank unless every rank passes an equal ``description``.

    Does nothing without an initialised multi-rank process group (or on torch's fake group).
    Every rank of ``ranks`` must call this, in the same order as its other checks of those ranks.

    Args:
        what: the call being checked (named in the message), e.g. ``"MeshContext.build"``.
        description: ``{key: value}`` strings; see :func:`describe_config` / :func:`describe_module`.
        ranks: the global ranks that must agree (e.g. one pipeline stage's); None = every rank.
        timeout: seconds to wait for the other ranks (default 60, or ``PLAIT_CONSISTENCY_TIMEOUT_S``).

    Raises:
        ValueError: a rank's description differs from the first rank's (what differs and which
            ranks are named), or a rank did not arrive within the timeout.
    """
    if not _active():
        return
    group = tuple(sorted(ranks)) if ranks is not None else tuple(range(dist.get_world_size()))
    rank = dist.get_rank()
    if len(group) < 2 or rank not in group:
        return
    seconds = timeout if timeout is not None else _timeout()
    name = "all" if ranks is None else _digest(repr(group))[:16]
    seq = next(_CALLS.setdefault(name, itertools.count()))
    # The default store is the one every rank already shares; torch exposes no public accessor.
    store = dist.PrefixStore(f"plait/consistency/{name}/{seq}/", dist.distributed_c10d._get_default_store())
    bad = _exchange(store, what, {"check": what, **description}, group, seconds)
    if bad:
        reports = [store.get(f"bad/{i}").decode() for i in range(1, min(bad, _MAX_REPORTS) + 1)]
        more = f"; and {bad - _MAX_REPORTS} more rank(s)" if bad > _MAX_REPORTS else ""
        raise ValueError(
            f"ranks disagree at {what} (checked before any collective; {bad} of {len(group)} ranks differ "
            f"from rank {group[0]}): {'; '.join(reports)}{more}; give every rank the same configuration and model"
        )


def _exchange(
    store: dist.Store, what: str, mine: dict[str, str], group: tuple[int, ...], seconds: float
) -> int:
    """Compare ``mine`` with the first rank's through ``store``; return how many ranks differ."""
    rank, first = dist.get_rank(), group[0]
    text = json.dumps(mine)
    if rank == first:
        store.set("ref", text)
        store.set("ref_digest", _digest(text))
    else:
        _wait(store, "ref_digest", seconds, lambda: f"rank {first} did not reach {what} within {seconds:g} s")
    if rank != first and store.get("ref_digest").decode() != _digest(text):
        differences = _differences(mine, json.loads(store.get("ref")), first)
        store.set(f"bad/{store.add('bad', 1)}", f"rank {rank} has {differences}")
    store.set(f"in/{rank}", "1")
    if store.add("arrived", 1) == len(group):
        store.set("done", "1")
    _wait(store, "done", seconds, lambda: _missing(store, what, group, seconds))
    if rank == first:
        store.delete_key("ref")
    return store.add("bad", 0)


def _wait(store: dist.Store, key: str, seconds: float, message: Any) -> None:
    try:
        store.wait([key], timedelta(seconds=seconds))
    except (dist.DistStoreError, RuntimeError):
        raise ValueError(message()) from None


def _missing(store: dist.Store, what: str, group: tuple[int, ...], seconds: float) -> str:
    world = len(group)
    absent = [r for r in group[:_LISTED_RANKS] if not store.check([f"in/{r}"])]
    listed = f"rank(s) {absent[:16]}{' ...' if len(absent) > 16 else ''}" if absent else "some ranks"
    return (
        f"{listed} of {world} did not reach {what} within {seconds:g} s (they failed earlier or run a "
        f"different program); see their output, or raise {CONSISTENCY_TIMEOUT_ENV} if they are only slow"
    )


def _differences(mine: Mapping[str, str], reference: Mapping[str, str], first: int) -> str:
    keys = [k for k in dict.fromkeys([*reference, *mine]) if mine.get(k) != reference.get(k)]
    shown = [
        f"{k} {_show(mine.get(k))} where rank {first} has {_show(reference.get(k))}"
        for k in keys[:_MAX_DIFFS]
    ]
    more = f" (+{len(keys) - _MAX_DIFFS} more differences)" if len(keys) > _MAX_DIFFS else ""
    return ", ".join(shown) + more


def _show(value: str | None) -> str:
    if value is None:
        return "(absent)"
    return value if len(value) <= 120 else value[:117] + "..."
