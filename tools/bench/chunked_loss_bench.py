"""Peak memory and time of the output head + cross-entropy: full logits against the chunked loss.

Run from the repository root:

    uv run python tools/bench/chunked_loss_bench.py [--vocab 128256] [--tokens 8192] [--hidden 256]
        [--chunk 1024] [--device cpu|cuda]

Each contender runs forward and backward of ``hidden [tokens, H] @ weight [vocab, H].T`` and the
summed token cross-entropy, in a fresh process of its own (so the peak belongs to it alone):

| contender | what it is |
|---|---|
| ``full`` | ``F.cross_entropy(F.linear(hidden, weight).float(), labels)``: the ``[tokens, vocab]`` logits |
| ``chunked`` | ``plait.sidecar.chunked_linear_cross_entropy``: ``--chunk`` tokens at a time, recomputed in backward |

Peak: on CUDA ``torch.cuda.max_memory_allocated`` above what was allocated before the loss; on CPU
the process's peak resident set (``ru_maxrss``) above its resident set before the loss (inputs,
weight and their gradients' buffers are made before). Output: one JSON object per contender, then
one with the ratios (``full / chunked`` peak, ``chunked / full`` time) and the loss difference.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from plait.sidecar import chunked_linear_cross_entropy


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def _one(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=gen).to(device).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) * 0.02).to(device).requires_grad_()
    labels = torch.randint(args.vocab, (args.tokens,), generator=gen).to(device)
    hidden.grad, weight.grad = torch.zeros_like(hidden), torch.zeros_like(weight)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _rss_bytes()
    start = time.perf_counter()
    if args.one == "full":
        loss = F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="sum")
    else:
        loss = chunked_linear_cross_entropy(hidden, weight, labels, chunk_tokens=args.chunk).sum()
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {
        "contender": args.one,
        "device": device.type,
        "vocab": args.vocab,
        "tokens": args.tokens,
        "hidden": args.hidden,
        "chunk": args.chunk if args.one == "chunked" else None,
        "peak_bytes_above_inputs": peak,
        "logits_fp32_bytes": args.tokens * args.vocab * 4,
        "seconds": time.perf_counter() - start,
        "loss": float(loss),
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--one", choices=["full", "chunked"], help=argparse.SUPPRESS)
    return p


def main() -> int:
    """Each contender in its own process, then the ratios."""
    args = _parser().parse_args()
    if args.one:
        print(json.dumps(_one(args)))
        return 0
    results = []
    for contender in ("full", "chunked"):
        cmd = [sys.executable, __file__, "--one", contender, *sys.argv[1:]]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    full, chunked = results
    print(
        json.dumps(
            {
                "peak_full_over_chunked": full["peak_bytes_above_inputs"]
                / max(chunked["peak_bytes_above_inputs"], 1),
                "time_chunked_over_full": chunked["seconds"] / full["seconds"],
                "loss_rel_diff": abs(full["loss"] - chunked["loss"]) / abs(full["loss"]),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
