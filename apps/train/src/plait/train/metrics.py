"""Rank-0 observability: one line per step, a JSONL metrics file, and a progress bar on a terminal."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch

__all__ = ["MetricsLogger", "memory_mib"]


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


def _format_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class MetricsLogger:
    """Writes metrics on the logging rank; every method is a no-op elsewhere.

    Args:
        path: JSONL file (appended, one object per line); None = no file.
        total_steps: for the progress bar's ETA.
        enabled: True on the rank that logs (rank 0).
        stream: where lines go (default stdout); a bar is drawn only if it is a terminal.
        log_every: print every N-th step line (the file gets every step).
    """

    def __init__(
        self,
        path: str | Path | None,
        *,
        total_steps: int,
        enabled: bool,
        stream: TextIO | None = None,
        log_every: int = 1,
    ) -> None:
        self.enabled = enabled
        self.total_steps = total_steps
        self.log_every = log_every
        self.stream = stream or sys.stdout
        self.tty = enabled and self.stream.isatty()
        self._file = None
        self._start = time.monotonic()
        self._first_step: int | None = None
        if enabled and path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a")  # noqa: SIM115 - closed in close()

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

    def step(self, step: int, **values: float) -> None:
        """Record one optimizer step (``loss``, ``lr``, ``grad_norm``, ``tokens_per_s``, ``mem_mib``...)."""
        if not self.enabled:
            return
        if self._first_step is None:
            self._first_step, self._start = step - 1, time.monotonic()
        self._write({"kind": "train", "step": step, **values})
        if step % self.log_every == 0 or step == self.total_steps:
            self._print(
                f"step {step:>6}/{self.total_steps} | loss {values['loss']:.4f} | lr {values['lr']:.2e} | "
                f"grad_norm {values['grad_norm']:.3f} | tok/s {values['tokens_per_s']:,.0f} | "
                f"mem {values['mem_mib']:,.0f} MiB"
            )
        if self.tty:
            self._bar(step)

    def validation(self, step: int, loss: float) -> None:
        """Record a validation loss."""
        if not self.enabled:
            return
        self._write({"kind": "val", "step": step, "val_loss": loss})
        self._print(f"step {step:>6}/{self.total_steps} | val_loss {loss:.4f}")

    def event(self, kind: str, **values: Any) -> None:
        """Record a non-step event (checkpoint saved, resumed, exported) in the file and on screen."""
        if not self.enabled:
            return
        self._write({"kind": kind, **values})
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
        """Finish the bar line and close the file."""
        if self.tty:
            self.stream.write("\n")
        if self._file is not None:
            self._file.close()
            self._file = None
