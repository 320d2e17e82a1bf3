"""One variant: build the decoder on meta, ``parallelize_model`` it, train a few timed steps."""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes, materialize
from plait.models import DecoderConfig, DenseDecoder
from plait.sidecar import parallelize_model

__all__ = ["Setup", "run_variant", "state_bytes"]


@dataclass(frozen=True)
class Setup:
    """What every variant shares."""

    arch: dict[str, Any]
    seq_len: int
    micro_batch: int
    warmup: int
    steps: int
    device: torch.device
    bf16: bool
    """Train in bf16: FSDP2's MixedPrecisionPolicy when plait applies FSDP units, else autocast."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_init(device: torch.device, seed: int) -> Callable[[str, torch.Size], torch.Tensor]:
    """A ``materialize`` source drawing on ``device`` (plait's CPU init takes minutes at 3B)."""
    generator = torch.Generator(device).manual_seed(seed)

    def source(fqn: str, shape: torch.Size) -> torch.Tensor:
        if len(shape) == 1:
            return torch.ones(shape, device=device)
        return torch.empty(shape, device=device).normal_(0.0, 0.02, generator=generator)

    return source


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's parameters, gradients and optimizer state (DTensors by local shard)."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    tensors = [local(p) for p in model.parameters()]
    tensors += [local(p.grad) for p in model.parameters() if p.grad is not None]
    for state in optimizer.state.values():
        tensors += [local(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return sum(t.numel() * t.element_size() for t in tensors)


def _build(setup: Setup, compile: bool) -> tuple[nn.Module, bool]:
    """The parallelized, materialised model and whether plait applied FSDP units to it."""
    config = (
        FSDP2Config(enable_compile=compile)
        if setup.bf16
        else FSDP2Config(enable_compile=compile, mp_policy=None)
    )
    ctx = MeshContext.build(config, ParallelismSizes())
    with torch.device("meta"):
        model = DenseDecoder(DecoderConfig(**setup.arch))
    model = parallelize_model(model, ctx)
    materialize(model, seed=0, device=setup.device, source=_device_init(setup.device, seed=0))
    return model, any(isinstance(m, FSDPModule) for m in model.modules())


@contextlib.contextmanager
def _released(device: torch.device) -> Iterator[None]:
    """Free what a variant allocated (on CUDA: cached blocks too) and reset the peak counter."""
    try:
        yield
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)


def run_variant(name: str, setup: Setup, *, compile: bool) -> dict[str, Any]:
    """Train ``warmup`` + ``steps`` steps; the timed ones give step time, tokens/s and memory."""
    with _released(setup.device):
        start = time.perf_counter()
        model, fsdp = _build(setup, compile)
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=3e-4,
            betas=(0.9, 0.95),
            weight_decay=0.1,
            fused=setup.device.type == "cuda",
        )
        amp = setup.bf16 and not fsdp
        precision = (
            ("bf16 autocast (no FSDP units on one rank)" if amp else "bf16 params, fp32 reduce (FSDP2)")
            if setup.bf16
            else "fp32"
        )
        step = _step_fn(model, optimizer, setup, amp)
        build_s = time.perf_counter() - start
        losses, times, first_s = _train(step, setup)
        result = {
            "variant": name,
            "compile": compile,
            "precision": precision,
            "fsdp_units": sum(isinstance(m, FSDPModule) for m in model.modules()),
            "build_s": build_s,
            "first_step_s": first_s,
            "step_time_s": statistics.median(times),
            "step_times_s": times,
            "loss_first": losses[0],
            "loss_last": losses[-1],
            "state_bytes": state_bytes(model, optimizer),
        }
        if setup.device.type == "cuda":
            result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(setup.device)
        del model, optimizer, step
    return result


def _step_fn(
    model: nn.Module, optimizer: torch.optim.Optimizer, setup: Setup, amp: bool
) -> Callable[[torch.Tensor], torch.Tensor]:
    """One optimizer step on a ``[micro_batch, seq + 1]`` batch; returns the loss (not synced)."""

    def step(batch: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)  # first, so the gradients stay for state_bytes
        inputs, labels = batch[:, :-1], batch[:, 1:]
        autocast = torch.autocast(setup.device.type, torch.bfloat16) if amp else contextlib.nullcontext()
        with autocast:
            logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def _train(
    step: Callable[[torch.Tensor], torch.Tensor], setup: Setup
) -> tuple[list[float], list[float], float]:
    """Losses of every step, the timed steps' wall times, and the first step's (compile) time."""
    generator = torch.Generator(setup.device).manual_seed(1)
    shape = (setup.micro_batch, setup.seq_len + 1)
    batches = [
        torch.randint(0, setup.arch["vocab_size"], shape, device=setup.device, generator=generator)
        for _ in range(2)
    ]
    losses: list[float] = []
    times: list[float] = []
    first_s = 0.0
    for i in range(setup.warmup + setup.steps):
        if i == setup.warmup and setup.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(setup.device)  # steady state: compile's own peaks excluded
        _sync(setup.device)
        start = time.perf_counter()
        loss = step(batches[i % 2])
        _sync(setup.device)
        elapsed = time.perf_counter() - start
        losses.append(loss.item())
        if i == 0:
            first_s = elapsed
        if i >= setup.warmup:
            times.append(elapsed)
    if not all(math.isfinite(x) for x in losses):
        raise FloatingPointError(f"non-finite loss: {losses}")
    return losses, times, first_s
