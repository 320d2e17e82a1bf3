"""What compare.py prints after the per-contender objects: ratios, acceptance checks, a markdown table."""

from __future__ import annotations

from typing import Any

__all__ = ["markdown_table", "ratios"]


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def ratios(plait: dict[str, Any], base: dict[str, Any], ref: dict[str, Any] | None) -> dict[str, Any]:
    """plait / baseline for every measured figure, and the acceptance checks of the benchmark issue."""
    pc, bc = plait["comm_per_step"] or {}, base["comm_per_step"] or {}
    out: dict[str, Any] = {
        "ratios": "plait / baseline",
        "step_time": _ratio(plait["step_time_s"], base["step_time_s"]),
        "cpu_s_per_step": _ratio(plait["cpu_s_per_step"], base["cpu_s_per_step"]),
        "tokens_per_s": _ratio(plait["tokens_per_s"], base["tokens_per_s"]),
        "peak_rss": _ratio(plait["peak_rss_bytes"], base["peak_rss_bytes"]),
        "held_bytes": {k: _ratio(plait["held_bytes"][k], base["held_bytes"][k]) for k in plait["held_bytes"]},
        "comm_bytes_total": _ratio(pc.get("bytes_sent_total", 0), bc.get("bytes_sent_total", 0)),
        "comm_bytes": {
            k: _ratio(v, bc.get("bytes_sent", {}).get(k, 0)) for k, v in pc.get("bytes_sent", {}).items()
        },
        "largest_buffer": _ratio(pc.get("largest_buffer", 0), bc.get("largest_buffer", 0)),
        "fsdp_units": _ratio(plait["fsdp_units"], base["fsdp_units"]),
        "parallelize_s": _ratio(plait["parallelize_s"], base["parallelize_s"]),
    }
    checks = {
        "held_le_1.02x_ideal": max(plait["held_over_ideal"].values()) <= 1.02,
        "comm_le_baseline": pc.get("bytes_sent_total", 0) <= bc.get("bytes_sent_total", 0),
        "step_time_le_1.05x_baseline": plait["step_time_s"] <= 1.05 * base["step_time_s"],
    }
    diff = _max_diff(plait["losses"], base["losses"])
    out["plait_max_loss_diff_vs_baseline"] = diff
    if ref is not None:
        out["plait_max_loss_diff_vs_reference"] = _max_diff(plait["losses"], ref["losses"])
        out["baseline_max_loss_diff_vs_reference"] = _max_diff(base["losses"], ref["losses"])
    if ref is not None and plait["dtype"] == "fp32":  # bf16 runs are compared with the baseline only
        checks["plait_losses_match_reference_1e-5"] = out["plait_max_loss_diff_vs_reference"] <= 1e-5
    else:
        checks["plait_losses_match_baseline_1e-5"] = diff <= 1e-5
    return out | {"checks": checks}


_COLUMNS = (
    ("contender", lambda s: s["contender"]),
    ("step s", lambda s: f"{s['step_time_s']:.3f}"),
    ("tok/s", lambda s: f"{s['tokens_per_s']:.0f}"),
    ("CPU s/step", lambda s: f"{s['cpu_s_per_step']:.3f}"),
    ("peak RSS MiB", lambda s: f"{s['peak_rss_bytes'] / 2**20:.0f}"),
    ("held MiB p/g/o", lambda s: "/".join(f"{v / 2**20:.1f}" for v in s["held_bytes"].values())),
    ("held/ideal", lambda s: f"{max(s['held_over_ideal'].values()):.3f}"),
    ("AG MiB", lambda s: _comm(s, "all_gather")),
    ("RS MiB", lambda s: _comm(s, "reduce_scatter")),
    ("AR MiB", lambda s: _comm(s, "all_reduce")),
    ("A2A MiB", lambda s: _comm(s, "all_to_all")),
    ("max buf MiB", lambda s: f"{(s['comm_per_step'] or {}).get('largest_buffer', 0) / 2**20:.2f}"),
    ("units", lambda s: str(s["fsdp_units"])),
    ("par. s", lambda s: f"{s['parallelize_s']:.3f}"),
    ("final loss", lambda s: f"{s['losses'][-1]:.6f}"),
)


def _comm(summary: dict[str, Any], kind: str) -> str:
    return f"{(summary['comm_per_step'] or {}).get('bytes_sent', {}).get(kind, 0) / 2**20:.2f}"


def markdown_table(summaries: dict[str, dict[str, Any]]) -> str:
    """The summaries as one markdown table (the README's format)."""
    lines = ["| " + " | ".join(name for name, _ in _COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(cell(s) for _, cell in _COLUMNS) + " |" for s in summaries.values()]
    return "\n".join(lines)
