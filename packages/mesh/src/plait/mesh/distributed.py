"""Initialise torch.distributed under a launcher (torchrun) or as a single local rank."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["DistributedInfo", "init_distributed"]

_LAUNCHER_VARS: tuple[str, ...] = ("RANK", "WORLD_SIZE")


@dataclass(frozen=True)
class DistributedInfo:
    """Where this process sits in the job."""

    rank: int
    """Global rank."""
    world_size: int
    """Number of ranks in the default process group."""
    local_rank: int
    """Rank on this node (``LOCAL_RANK``, else 0)."""
    device: torch.device
    """``cuda:<local_rank>`` under NCCL, else ``cpu``."""


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise ValueError(f"environment variable {name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _info() -> DistributedInfo:
    local_rank = _env_int("LOCAL_RANK", 0)
    uses_cuda = "nccl" in str(dist.get_backend()) and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if uses_cuda else torch.device("cpu")
    return DistributedInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


def init_distributed(backend: str | None = None, *, timeout: timedelta | None = None) -> DistributedInfo:
    """Initialise the default process group once and describe this rank.

    - Already initialised: nothing is changed.
    - Under a launcher (``RANK`` and ``WORLD_SIZE`` set): ``nccl`` when CUDA is available (the
      device is set from ``LOCAL_RANK`` first), else ``gloo``; rendezvous via ``MASTER_ADDR`` /
      ``MASTER_PORT``, on a store private to the restart attempt under torch's elastic agent.
    - No launcher: a single-rank ``gloo`` group on a free local port.

    Args:
        backend: force a backend (e.g. ``"gloo"``); None picks as above.
        timeout: collective timeout; None = torch's default.

    Raises:
        ValueError: only one of ``RANK`` / ``WORLD_SIZE`` is set, or they are not integers.
    """
    if dist.is_initialized():
        return _info()
    present = [v for v in _LAUNCHER_VARS if v in os.environ]
    if len(present) == 1:
        missing = next(v for v in _LAUNCHER_VARS if v not in present)
        raise ValueError(f"{present[0]} is set but {missing} is not; launch with torchrun or set both")
    kwargs = {} if timeout is None else {"timeout": timeout}
    if not present:
        dist.init_process_group(
            backend or "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1, **kwargs
        )
        return _info()
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK", 0)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    store = _elastic_attempt_store(rank, world_size)
    if store is not None:
        kwargs["store"] = store
    dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
    return _info()


def _elastic_attempt_store(rank: int, world_size: int) -> dist.Store | None:
    """Under torch's elastic agent, a store private to this restart attempt; None elsewhere.

    The agent keeps one TCPStore across restarts and ``env://`` adds no per-attempt prefix (torch
    2.15), so the ranks of a restarted job can read the previous attempt's gloo addresses and fail
    to connect or hang. Prefixing the store with ``TORCHELASTIC_RESTART_COUNT`` keeps attempts apart.
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None or "MASTER_ADDR" not in os.environ:
        return None
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        _env_int("MASTER_PORT"),
        world_size,
        is_master=rank == 0 and not agent_store,
        timeout=timedelta(minutes=10),
        multi_tenant=not agent_store,
    )
    return dist.PrefixStore(f"plait/attempt_{restart}/", store)
