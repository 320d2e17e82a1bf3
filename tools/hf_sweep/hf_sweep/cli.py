"""Run the sweep: one subprocess per family (a crash or hang never stops the sweep), then the report."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hf_sweep.family import Case, run_family, select_cases
from hf_sweep.report import apply_floors, markdown_table, summary

HERE = Path(__file__).resolve().parent.parent


def _run_family(
    model_type: str, timeout: float, case_timeout: float, cases: tuple[Case, ...]
) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    names = ",".join(c.name for c in cases)
    cmd = [
        sys.executable,
        "-m",
        "hf_sweep.family",
        model_type,
        "--timeout",
        str(case_timeout),
        "--cases",
        names,
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True
    )
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, _ = proc.communicate()
    records = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    done = {r["case"] for r in records}
    for name in (c.name for c in cases):
        if name not in done:
            why = (
                f"process exited with {proc.returncode}"
                if proc.returncode
                else f"family timeout {timeout:g}s"
            )
            records.append({"family": model_type, "case": name, "status": "crash", "message": why})
    return records


def _run_in_process(
    model_type: str, case_timeout: float, dtype: str, cases: tuple[Case, ...]
) -> list[dict[str, Any]]:
    try:
        return list(run_family(model_type, case_timeout, dtype, cases))
    except Exception as exc:  # building the family's config or model failed outside the ranks
        message = f"{type(exc).__name__}: {str(exc)[:400]}"
        return [{"family": model_type, "case": c.name, "status": "crash", "message": message} for c in cases]


def _finished(jsonl: Path, cases: tuple[Case, ...]) -> set[str]:
    """Families with a record in ``jsonl`` for each of ``cases``."""
    if not jsonl.exists():
        return set()
    records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    found: dict[str, set[str]] = {}
    for r in records:
        found.setdefault(r["family"], set()).add(r["case"])
    wanted = {c.name for c in cases}
    return {family for family, done in found.items() if wanted <= done}


def _line(r: dict[str, Any]) -> str:
    if r["status"] in ("pass", "mismatch"):
        detail = (
            f"loss {r['loss_diff']:.1e} grad {r['grad_diff']:.1e} ({r['worst_grad']}) "
            f"param {r['param_diff']:.1e}"
        )
    else:
        detail = r.get("message", "")[:200]
    return f"{r['family']:<24} {r['case']:<7} {r['status']:<8} {detail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="uv run tools/hf_sweep", description=__doc__)
    parser.add_argument("--families", default="", help="comma-separated model types (default: all)")
    parser.add_argument(
        "--out", type=Path, default=HERE / "results", help="folder for results.jsonl/.json/.md"
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="with --isolate: seconds per family (default 1500)"
    )
    parser.add_argument("--case-timeout", type=float, default=450.0, help="seconds per mesh configuration")
    parser.add_argument("--report-only", action="store_true", help="rebuild the report from results.jsonl")
    parser.add_argument(
        "--isolate",
        action="store_true",
        help="one subprocess per family (also survives a crash of the test process itself; slower)",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "float64"],
        default="float32",
        help="model dtype (float64: is a float32 MISMATCH rounding? use with --out elsewhere)",
    )
    parser.add_argument(
        "--resume", action="store_true", help="skip families with every chosen case in results.jsonl"
    )
    parser.add_argument(
        "--cases", default="", help="comma-separated cases, e.g. cp2,cp2_tp2 (default: every case)"
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="float32's own error next to the parallel copy's (hf_sweep/floor.py): OUT/floor.jsonl",
    )
    args = parser.parse_args(argv)
    if args.isolate and args.dtype != "float32":
        parser.error("--isolate runs float32 only; drop --isolate to sweep in float64")
    if args.timeout is not None and not args.isolate:
        parser.error("--timeout applies to --isolate (one process per family); use --case-timeout")
    family_timeout = 1500.0 if args.timeout is None else args.timeout
    from plait.testing import sweep_hf_families

    cases = select_cases(args.cases)

    args.out.mkdir(parents=True, exist_ok=True)
    if args.floor:
        from hf_sweep.floor import sweep_floor

        sweep_floor(
            sweep_hf_families([f for f in args.families.split(",") if f] or None),
            args.out,
            args.case_timeout,
            cases,
        )
        return 0
    jsonl = args.out / "results.jsonl"
    if not args.report_only:
        families = sweep_hf_families([f for f in args.families.split(",") if f] or None)
        if args.resume:
            families = [f for f in families if f not in _finished(jsonl, cases)]
        print(f"# {len(families)} families, cases {[c.name for c in cases]}", flush=True)
        for model_type in families:
            start = time.monotonic()
            if args.isolate:
                records = _run_family(model_type, family_timeout, args.case_timeout, cases)
            else:
                records = _run_in_process(model_type, args.case_timeout, args.dtype, cases)
            with jsonl.open("a") as f:
                for r in records:
                    r["seconds"] = round(time.monotonic() - start, 1)
                    f.write(json.dumps(r) + "\n")
                    print(_line(r), flush=True)
    if not jsonl.exists():
        parser.error(f"no {jsonl}: run the sweep first (without --report-only)")
    records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    latest = {(r["family"], r["case"]): r for r in records}  # a rerun replaces a family's earlier lines
    results = sorted(latest.values(), key=lambda r: (r["family"], r["case"]))
    floor_jsonl = args.out / "floor" / "floor.jsonl"
    if floor_jsonl.exists():
        results = apply_floors(
            results, [json.loads(line) for line in floor_jsonl.read_text().splitlines() if line.strip()]
        )
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "results.md").write_text(markdown_table(results) + "\n\n" + summary(results) + "\n")
    print(summary(results))
    return 0
