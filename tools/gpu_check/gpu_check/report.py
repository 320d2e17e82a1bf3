"""From timed steps to torchtitan's numbers (tokens/s/GPU, TFLOPs, MFU), the goals, one line each."""

from __future__ import annotations

from typing import Any

__all__ = ["derive", "goals", "titan_line"]

MFU_GOAL = 0.39
FLOAT8_SPEEDUP_GOAL = 1.25
PLAN_TOLERANCE = 0.10


def derive(
    variant: dict[str, Any], model: dict[str, Any], device: dict[str, Any], plan_bytes: int
) -> dict[str, Any]:
    """Add tokens/s/GPU, TFLOP/s, MFU (None without a known peak) and memory against ``plan``."""
    if "skipped" in variant:
        return variant
    tokens_per_s = model["micro_batch"] * model["seq_len"] / variant["step_time_s"]
    flops = tokens_per_s * model["flops_per_token"]
    peak = device["peak_bf16_flops"]
    peak_bytes = variant.get("peak_allocated_bytes")
    return {
        **variant,
        "tokens_per_s_per_gpu": tokens_per_s,
        "tflops_per_gpu": flops / 1e12,
        "mfu": flops / peak if peak else None,
        "plan_estimate_bytes": plan_bytes,
        "state_over_plan": variant["state_bytes"] / plan_bytes,
        "peak_over_plan": peak_bytes / plan_bytes if peak_bytes is not None else None,
    }


def _ran(variants: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    return next((v for v in variants if v["variant"] == name and "skipped" not in v), None)


def goals(variants: list[dict[str, Any]]) -> dict[str, Any]:
    """Each goal's value and whether it is met (None: not measurable in this run)."""
    compiled = _ran(variants, "compile")
    mfu = compiled["mfu"] if compiled else None
    peak = compiled["peak_over_plan"] if compiled else None
    result: dict[str, Any] = {
        "mfu_compiled_bf16": {
            "target": f">= {MFU_GOAL}",
            "value": mfu,
            "met": None if mfu is None else mfu >= MFU_GOAL,
        },
        "peak_memory_vs_plan": {
            "target": f"within {PLAN_TOLERANCE:.0%} of plan's estimate",
            "value": peak,
            "met": None if peak is None else abs(peak - 1) <= PLAN_TOLERANCE,
        },
    }
    for v in variants:
        if v["variant"].startswith("compile+float8"):
            fp8 = _ran(variants, v["variant"])
            speedup = (
                fp8["tokens_per_s_per_gpu"] / compiled["tokens_per_s_per_gpu"] if fp8 and compiled else None
            )
            result[f"{v['variant']}_speedup"] = {
                "target": f">= {FLOAT8_SPEEDUP_GOAL}x compiled bf16 tokens/s",
                "value": speedup,
                "met": None if speedup is None else speedup >= FLOAT8_SPEEDUP_GOAL,
            }
    return result


def titan_line(variant: dict[str, Any], device: dict[str, Any]) -> str:
    """torchtitan's log line: ``step  loss  memory  tps  tflops  mfu`` (memory: peak allocated)."""
    name = f"gpu_check {variant['variant']:<26}"
    if "skipped" in variant:
        return f"{name} skipped: {variant['skipped']}"
    steps = len(variant["step_times_s"])
    peak = variant.get("peak_allocated_bytes")
    total = device["total_memory_bytes"]
    memory = f"{peak / 2**30:.2f}GiB({peak / total:.2%})" if peak is not None and total else "n/a (cpu)"
    mfu = f"{variant['mfu']:.2%}" if variant["mfu"] is not None else "n/a"
    return (
        f"{name} step: {steps:2d}  loss: {variant['loss_last']:7.4f}  memory: {memory}  "
        f"tps: {variant['tokens_per_s_per_gpu']:,.0f}  tflops: {variant['tflops_per_gpu']:,.2f}  mfu: {mfu}"
    )
