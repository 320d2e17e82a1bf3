"""Rank-0 observability: one line per step, a JSONL metrics file, optional TensorBoard, a progress bar.

Each step record carries the loss, the step time, tokens/s (global and per device), TFLOPs per
device and MFU (model FLOPs over the accelerator's peak; ``null`` where the peak is unknown, as
on CPU), memory, the gradient norm, the learning rate and a wall-clock timestamp. Every attempt of
a run (a fresh start, a restart after a failure, a manual re-run) opens its own section of
``metrics.jsonl`` with a ``run_start`` record (its attempt number and start time) and, with
TensorBoard on, writes into its own ``tensorboard/attempt_N`` directory: nothing is appended silently.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

__all__ = ["PEAK_TFLOPS", "MetricsLogger", "flops_per_token", "memory_mib", "peak_tflops", "throughput"]

PEAK_TFLOPS: dict[str, float] = {
    "B200": 2250.0,
    "H200": 989.0,
    "GH200": 989.0,
    "H100 SXM": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10G": 70.0,
    "MI300X": 1307.0,
    "MI250X": 383.0,
}
"""Dense bf16 tensor-core peak TFLOPs per device, by a substring of ``torch.cuda.get_device_name()``
(first match in this order); MFU is measured against this peak whatever the training dtype."""


def peak_tflops(device: torch.device) -> float | None:
    """The accelerator's dense bf16 peak from :data:`PEAK_TFLOPS`; None on CPU or an unknown device."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops for key, tflops in PEAK_TFLOPS.items() if key in name), None)


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: ``6 * non-embedding parameters + 12 * layers * hidden * seq_len``.

    The first term is forward + backward of every matmul weight; the second the attention scores
    and their weighted sum (as in the PaLM paper's appendix). Activation recomputation is not counted,
    so this is model FLOPs (MFU), not hardware FLOPs.
    """
    params = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if isinstance(embedding, nn.Module):
        params -= sum(p.numel() for p in embedding.parameters())
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    layers = getattr(text, "num_hidden_layers", 0) or 0
    hidden = getattr(text, "hidden_size", 0) or 0
    return 6.0 * params + 12.0 * layers * hidden * seq_len


def throughput(
    global_tokens: float, seconds: float, world_size: int, flops_per_token: float, peak: float | None
) -> dict[str, float | None]:
    """Step time, tokens/s (global and per device), TFLOPs per device and MFU (None without a peak)."""
    per_device = global_tokens / seconds / world_size
    tflops = per_device * flops_per_token / 1e12
    return {
        "step_time_s": seconds,
        "tokens_per_s": global_tokens / seconds,
        "tokens_per_s_per_device": per_device,
        "tflops_per_device": tflops,
        "mfu": tflops / peak if peak else None,
    }


def memory_mib(device: torch.device) -> float:
    """Peak accelerator memory (CUDA) or the process's current resident memory (CPU), in MiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        import resource

        return pages * resource.getpagesize() / 2**20
    except (OSError, ValueError, ImportError):
        return float("nan")


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")


def _format_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _previous_attempts(path: Path) -> int:
    if not path.is_file():
        return 0
    with path.open() as f:
        return sum('"kind": "run_start"' in line for line in f)


def _line(step: int, total: int, v: dict[str, Any]) -> str:
    mfu = f"{v['mfu']:.1%}" if v.get("mfu") is not None else "n/a"
    tflops = v.get("tflops_per_device")
    tflops = "n/a" if tflops is None else f"{tflops:.2f}" if tflops >= 0.01 else "<0.01"
    parts = [
        f"step {step:>6}/{total}",
        f"loss {v['loss']:.4f}",
        f"lr {v['lr']:.2e}",
        f"grad_norm {v['grad_norm']:.3f}",
    ]
    if "step_time_s" in v:
        parts.append(f"{v['step_time_s'] * 1000:,.0f} ms")
    parts.append(f"tok/s {v['tokens_per_s']:,.0f}")
    if "tokens_per_s_per_device" in v:
        parts.append(f"tok/s/dev {v['tokens_per_s_per_device']:,.0f}")
        parts.append(f"TFLOPs/dev {tflops}")
        parts.append(f"MFU {mfu}")
    parts.append(f"mem {v['mem_mib']:,.0f} MiB")
    return " | ".join(parts)


class MetricsLogger:
    """Writes metrics on the logging rank; every method is a no-op elsewhere.

    Args:
        path: JSONL file (a new ``run_start`` section per logger, never a silent append); None = no file.
        total_steps: for the progress bar's ETA.
        enabled: True on the rank that logs (rank 0).
        stream: where lines go (default stdout); a bar is drawn only if it is a terminal.
        log_every: print every N-th step line, and always the first and the last step (the file
            gets every step).
        tensorboard_dir: also write scalars to TensorBoard under ``<dir>/attempt_N`` (needs the
            ``tensorboard`` package: ``plait-train[tensorboard]``); None = off.
        run_info: extra fields of the ``run_start`` record (e.g. the run name, world size).
    """

    def __init__(
        self,
        path: str | Path | None,
        *,
        total_steps: int,
        enabled: bool,
        stream: TextIO | None = None,
        log_every: int = 1,
        tensorboard_dir: str | Path | None = None,
        run_info: dict[str, Any] | None = None,
    ) -> None:
        self.enabled = enabled
        self.total_steps = total_steps
        self.log_every = log_every
        self.stream = stream or sys.stdout
        self.tty = enabled and self.stream.isatty()
        self._file = None
        self._tb = None
        self._start = time.monotonic()
        self._first_step: int | None = None
        if not enabled:
            return
        self.attempt = _previous_attempts(Path(path)) if path is not None else 0
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a")  # noqa: SIM115 - closed in close()
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(Path(tensorboard_dir) / f"attempt_{self.attempt}"))
        self._write({"kind": "run_start", "attempt": self.attempt, "time": _now(), **(run_info or {})})

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def _print(self, line: str) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
        self.stream.write(line + "\n")
        self.stream.flush()

    def info(self, text: str) -> None:
        """Print free text (summary, notices)."""
        if self.enabled:
            for line in text.splitlines():
                self._print(line)

    def step(self, step: int, **values: Any) -> None:
        """Record one optimizer step (``loss``, ``lr``, ``grad_norm``, ``tokens_per_s``, ``mem_mib``...)."""
        if not self.enabled:
            return
        first = self._first_step is None
        if first:
            self._first_step, self._start = step - 1, time.monotonic()
        self._write({"kind": "train", "step": step, "time": _now(), **values})
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, int | float):
                    self._tb.add_scalar(f"train/{key}", value, step)
        if first or step % self.log_every == 0 or step == self.total_steps:
            self._print(_line(step, self.total_steps, values))
        if self.tty:
            self._bar(step)

    def validation(self, step: int, loss: float) -> None:
        """Record a validation loss."""
        if not self.enabled:
            return
        self._write({"kind": "val", "step": step, "time": _now(), "val_loss": loss})
        if self._tb is not None:
            self._tb.add_scalar("val/loss", loss, step)
        self._print(f"step {step:>6}/{self.total_steps} | val_loss {loss:.4f}")

    def event(self, kind: str, **values: Any) -> None:
        """Record a non-step event (checkpoint saved, resumed, exported) in the file and on screen."""
        if not self.enabled:
            return
        self._write({"kind": kind, "time": _now(), **values})
        self._print(f"[{kind}] " + " ".join(f"{k}={v}" for k, v in values.items()))

    def _bar(self, step: int) -> None:
        done = step - (self._first_step or 0)
        left = self.total_steps - step
        elapsed = time.monotonic() - self._start
        eta = elapsed / done * left if done > 0 else 0.0
        width = 30
        filled = int(width * step / max(1, self.total_steps))
        self.stream.write(
            f"[{'#' * filled}{'.' * (width - filled)}] {step}/{self.total_steps} eta {_format_eta(eta)}"
        )
        self.stream.flush()

    def close(self) -> None:
        """Finish the bar line and close the file (and TensorBoard writer)."""
        if self.tty:
            self.stream.write("\n")
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
