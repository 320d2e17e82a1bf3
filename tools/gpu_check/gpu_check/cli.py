"""``tools/gpu_check/run [--dry-run]``: one-GPU throughput, MFU and memory against ``plan``."""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpu_check.checks import FLOAT8_VARIANTS, async_tp_check, float8_skip_reason, init_process_group
from gpu_check.estimate import plan_memory, plan_recipe
from gpu_check.report import derive, goals, titan_line
from gpu_check.shapes import (
    PEAK_BF16_DENSE_FLOPS,
    SHAPES,
    flops_per_token,
    non_embedding_params,
    peak_flops,
    pick_shape,
)
from gpu_check.train import Setup, run_variant
from plait.models import DecoderConfig, DenseDecoder

__all__ = ["main"]

RESULTS = Path(__file__).resolve().parents[1] / "results"
"""GPU runs write ``results/<date>-<commit>.json`` here."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tools/gpu_check/run", description=__doc__)
    p.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny model, seq 64: the CI path")
    p.add_argument(
        "--shape", default="auto", choices=["auto", *SHAPES], help="auto: 3B on >= 120 GiB, else 1B"
    )
    p.add_argument("--seq-len", type=int, default=None, help="default 8192 (dry run: 64)")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=None, help="default 3 (dry run: 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps; default 10 (dry run: 2)")
    p.add_argument("--no-compile", action="store_true", help="skip the compile variant")
    p.add_argument(
        "--out", type=Path, default=None, help="JSON file (GPU default: results/<date>-<commit>.json)"
    )
    return p


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=RESULTS.parent,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def _device(dry_run: bool) -> dict[str, Any]:
    """The device the run uses, its name, memory and peak bf16 dense FLOP/s (None when unknown)."""
    if dry_run:
        return {"type": "cpu", "name": "cpu", "total_memory_bytes": None, "peak_bf16_flops": None}
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device; run with --dry-run on a CPU")
    props = torch.cuda.get_device_properties(0)
    return {
        "type": "cuda",
        "name": props.name,
        "count": torch.cuda.device_count(),
        "total_memory_bytes": props.total_memory,
        "peak_bf16_flops": peak_flops(props.name),
    }


def _model_info(shape: str, seq_len: int) -> dict[str, Any]:
    arch = SHAPES[shape]
    with torch.device("meta"):
        model = DenseDecoder(DecoderConfig(**arch))
    params = non_embedding_params(model)
    return {
        "shape": shape,
        "arch": arch,
        "params": sum(p.numel() for p in model.parameters()),
        "non_embedding_params": params,
        "flops_per_token": flops_per_token(arch, params, seq_len),
        "seq_len": seq_len,
    }


def _variants(setup: Setup, compile_skip: str | None) -> list[dict[str, Any]]:
    results = [run_variant("eager", setup, compile=False)]
    if compile_skip is None:
        results.append(run_variant("compile", setup, compile=True))
    else:
        results.append({"variant": "compile", "skipped": compile_skip})
    reason = float8_skip_reason()
    results += [{"variant": name, "skipped": reason} for name in FLOAT8_VARIANTS]
    return results


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Plan, start the group, run the variants; the result document."""
    start = time.perf_counter()
    device = _device(args.dry_run)
    shape = pick_shape(args.shape, args.dry_run, device["total_memory_bytes"])
    seq_len = args.seq_len or (64 if args.dry_run else 8192)
    model = {**_model_info(shape, seq_len), "micro_batch": args.micro_batch}
    estimate = plan_memory(plan_recipe(SHAPES[shape], seq_len, args.micro_batch, compile=not args.no_compile))
    where = torch.device("cuda", 0) if device["type"] == "cuda" else torch.device("cpu")
    checks = [init_process_group(where)]
    setup = Setup(
        arch=SHAPES[shape],
        seq_len=seq_len,
        micro_batch=args.micro_batch,
        warmup=args.warmup if args.warmup is not None else (1 if args.dry_run else 3),
        steps=args.steps if args.steps is not None else (2 if args.dry_run else 10),
        device=where,
        bf16=True,
    )
    try:
        variants = _variants(setup, "--no-compile" if args.no_compile else None)
        checks.append(async_tp_check(setup.device))
    finally:
        dist.destroy_process_group()
    variants = [derive(v, model, device, estimate["estimate_bytes"]) for v in variants]
    return {
        "tool": "gpu_check",
        "dry_run": args.dry_run,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "commit": _commit(),
        "torch": torch.__version__,
        "device": device,
        "peak_bf16_flops_table": PEAK_BF16_DENSE_FLOPS,
        "model": model,
        "steps": {"warmup": setup.warmup, "timed": setup.steps},
        "plan": estimate,
        "variants": variants,
        "checks": checks,
        "goals": goals(variants),
        "elapsed_s": time.perf_counter() - start,
    }


def main(argv: list[str] | None = None) -> int:
    """Run, print one torchtitan-style line per variant and the JSON document (last line)."""
    args = _parser().parse_args(argv)
    doc = run(args)
    for variant in doc["variants"]:
        print(titan_line(variant, doc["device"]))
    out = args.out or (None if args.dry_run else RESULTS / f"{doc['date']}-{doc['commit']}.json")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"gpu_check: wrote {out}", file=sys.stderr)
    print(json.dumps(doc))
    return 0
