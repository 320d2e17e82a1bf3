"""The machine a layout is priced on: GPUs per node, memory, peak FLOPs and link bandwidths."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["GPU_PRESETS", "Cluster", "cluster"]

GIB = 1024**3


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """``nodes`` x ``gpus_per_node`` GPUs; bandwidths are per GPU and per direction, in GB/s (1e9)."""

    nodes: int = 1
    gpus_per_node: int = 8
    gpu: str = "h100"
    memory_gib: float = 79.1
    """Device memory torch reports (``total_memory``)."""
    reserved_gib: float = 3.0
    """Held back from tensors: CUDA context, NCCL buffers, allocator fragmentation."""
    peak_tflops: float = 989.0
    """Dense bf16 tensor-core peak per GPU (the MFU denominator)."""
    intra_gbps: float = 450.0
    """NVLink/NVSwitch bandwidth per GPU, one direction."""
    inter_gbps: float = 50.0
    """Network bandwidth per GPU, one direction (400 Gb/s InfiniBand per GPU = 50 GB/s)."""
    compute_efficiency: float = 0.4
    """Fraction of peak a step's FLOPs run at (matmuls, attention and the memory-bound rest together);
    an assumption stated in docs/planner.md, not a measurement."""
    link_efficiency: float = 0.8
    """Fraction of link bandwidth a large collective reaches."""
    latency_us: float = 10.0
    """Fixed cost per collective call."""
    host_memory_gib: float = 224.0
    """Host memory per GPU that CPU offload may fill (a 2 TiB node of 8 GPUs, less 12.5 % for the OS,
    the data loader and pinned staging)."""
    pcie_gbps: float = 50.0
    """Host-to-device copy bandwidth per GPU, one direction (PCIe Gen5 x16, about 64 GB/s raw)."""
    host_gbps: float = 25.0
    """Host memory bandwidth per GPU an offloaded optimizer step reads and writes at (a node's
    ~400 GB/s of DDR5 shared by 8 GPUs, at about half)."""

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"Cluster.{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "memory_gib",
            "peak_tflops",
            "intra_gbps",
            "inter_gbps",
            "host_memory_gib",
            "pcie_gbps",
            "host_gbps",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"Cluster.{name} must be > 0, got {getattr(self, name)}")
        for name in ("compute_efficiency", "link_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"Cluster.{name} must be in (0, 1], got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        """Every GPU."""
        return self.nodes * self.gpus_per_node

    @property
    def usable_bytes(self) -> float:
        """Memory a rank's tensors may take."""
        return (self.memory_gib - self.reserved_gib) * GIB

    @property
    def host_bytes(self) -> float:
        """Host memory one rank's offloaded state may take."""
        return self.host_memory_gib * GIB

    def bandwidth(self, span: int) -> float:
        """Bytes/s of a collective over ``span`` consecutive ranks: NVLink within a node, else the network."""
        gbps = self.intra_gbps if span <= self.gpus_per_node else self.inter_gbps
        return gbps * 1e9 * self.link_efficiency


GPU_PRESETS: dict[str, dict[str, float]] = {
    "h100": {"memory_gib": 79.1, "peak_tflops": 989.0, "intra_gbps": 450.0, "inter_gbps": 50.0},
    "h200": {"memory_gib": 139.8, "peak_tflops": 989.0, "intra_gbps": 450.0, "inter_gbps": 50.0},
}
"""SXM nodes of 8 GPUs: H100 80 GB and H200 141 GB (the same compute and NVLink 4), 400 Gb/s per GPU."""


def cluster(gpu: str = "h100", *, nodes: int = 1, gpus_per_node: int = 8, **overrides: float) -> Cluster:
    """A preset GPU's cluster with ``overrides`` (any :class:`Cluster` field).

    Raises:
        ValueError: an unknown GPU or field, naming the known ones.
    """
    if gpu not in GPU_PRESETS:
        raise ValueError(
            f"unknown gpu {gpu!r}; choose one of: {', '.join(GPU_PRESETS)} (or give explicit numbers)"
        )
    known = {f.name for f in dataclasses.fields(Cluster)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown Cluster field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return Cluster(nodes=nodes, gpus_per_node=gpus_per_node, gpu=gpu, **{**GPU_PRESETS[gpu], **overrides})
