"""Side-by-side benchmark: the same model, data and mesh parallelized by plait and by hand.

    uv run tools/bench/compare.py --model decoder --mesh dp_shard=2,tp=2 --steps 10 [--bf16]

Launches ``world = product of mesh sizes`` gloo ranks on CPU for each contender in turn (fresh
processes each, so peak RSS is per contender), on the same seed and the same batches, and prints
one JSON object per contender, then one with the ratios plait / baseline and the acceptance checks.
Contenders: ``reference`` (unsharded, one process, global batch), ``baseline`` (hand-written
torchtitan-style FSDP2 + TP, see baseline.py) and ``plait`` (``plait.sidecar.parallelize_model``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench.baseline import build_baseline_meshes, parallelize_baseline
from tools.bench.instrument import (
    CollectiveCounter,
    held_bytes,
    median,
    num_fsdp_units,
    peak_rss_bytes,
    per_step,
)
from tools.bench.report import markdown_table, ratios

CONTENDERS = ("reference", "baseline", "plait")
MESH_AXES = ("dp_replicate", "dp_shard", "tp")
WARMUP = 2
COUNTED_STEP = 1  # collectives are counted on the second warm-up step (steady state, untimed)
SIZES = {  # vocab, hidden, intermediate, layers, heads, kv heads
    "tiny": (256, 64, 128, 2, 4, 2),
    "small": (2048, 256, 688, 4, 8, 4),
    "ref": (4096, 512, 1376, 8, 8, 4),
}


def parse_mesh(text: str) -> dict[str, int]:
    """``"dp_shard=2,tp=2"`` -> ``{"dp_replicate": 1, "dp_shard": 2, "tp": 2}``."""
    sizes = dict.fromkeys(MESH_AXES, 1)
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        if name.strip() not in sizes or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"--mesh entry {part!r}: use <axis>=<positive int> with axis in {MESH_AXES}")
        sizes[name.strip()] = int(value)
    return sizes


def build_model(spec: dict[str, Any]) -> nn.Module:
    """The model named by ``--model`` at ``--size``, seeded: ``decoder`` or a transformers class name."""
    vocab, hidden, inter, layers, heads, kv = SIZES[spec["size"]]
    torch.manual_seed(spec["seed"])
    if spec["model"] == "decoder":
        from plait.models import DecoderConfig, DenseDecoder

        cfg = DecoderConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            tie_word_embeddings=False,
        )
        return DenseDecoder(cfg)
    import transformers

    cls = getattr(transformers, spec["model"], None)
    if cls is None or not hasattr(cls, "config_class"):
        raise ValueError(f"--model {spec['model']!r} is neither 'decoder' nor a transformers model class")
    cfg = cls.config_class(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=max(spec["seq"], 128),
        tie_word_embeddings=False,
        use_cache=False,
    )
    return cls(cfg)


def batch(spec: dict[str, Any], step: int, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's rows of the global batch of ``step`` (inputs, next-token labels)."""
    vocab = SIZES[spec["size"]][0]
    gen = torch.Generator().manual_seed(spec["seed"] * 100_003 + step)
    tokens = torch.randint(vocab, (spec["batch"], spec["seq"] + 1), generator=gen)
    rows = tokens.chunk(dp_size)[dp_rank]
    return rows[:, :-1], rows[:, 1:]


def _train_step(
    model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    out = model(ids)
    logits = getattr(out, "logits", out)
    with loss_parallel() if isinstance(logits, DTensor) else nullcontext():
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
    opt.step()
    return loss.full_tensor() if isinstance(loss, DTensor) else loss.detach()


def _meshes(contender: str, spec: dict[str, Any]) -> Any:
    """Each contender's device meshes (built before the parallelize timer starts)."""
    mesh = spec["mesh"]
    if contender == "baseline":
        return build_baseline_meshes(mesh["dp_replicate"], mesh["dp_shard"], mesh["tp"])
    from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes

    cfg = FSDP2Config(mp_policy=_mp_policy(spec["bf16"]), sequence_parallel=spec["sp"], **spec["plait_set"])
    ctx = MeshContext.build(cfg, ParallelismSizes(dp_replicate_size=mesh["dp_replicate"], tp_size=mesh["tp"]))
    assert ctx.dp_shard_size == mesh["dp_shard"], (ctx.dp_shard_size, mesh)
    return ctx


def _parallelize(contender: str, model: nn.Module, meshes: Any, spec: dict[str, Any]) -> nn.Module:
    if contender == "baseline":
        return parallelize_baseline(
            model, meshes, mp_policy=_mp_policy(spec["bf16"]), sequence_parallel=spec["sp"]
        )
    from plait.sidecar import parallelize_model

    return parallelize_model(model, meshes)


def _mp_policy(bf16: bool) -> MixedPrecisionPolicy:
    if bf16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)


def run_contender(contender: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Build, parallelize and train one contender on this rank; return this rank's measurements."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    tp = spec["mesh"]["tp"] if contender != "reference" else 1
    dp_size, dp_rank = world // tp, rank // tp
    base_rss = peak_rss_bytes()
    model = build_model(spec)
    total_param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    start = time.perf_counter()
    meshes = _meshes(contender, spec) if contender != "reference" else None
    mesh_s, start = time.perf_counter() - start, time.perf_counter()
    if contender != "reference":
        model = _parallelize(contender, model, meshes, spec)
    parallelize_s = time.perf_counter() - start
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"])
    losses, times, cpu_times, comm = [], [], [], None
    for step in range(spec["steps"]):
        ids, labels = batch(spec, step, dp_rank, dp_size)
        if world > 1:
            dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        counter = CollectiveCounter() if step == COUNTED_STEP else nullcontext()
        with counter:
            loss = _train_step(model, opt, ids, labels)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        if isinstance(counter, CollectiveCounter):
            comm = counter.stats.as_dict() | {"uncounted_ops": dict(counter.unknown)}
        if world > 1:  # every rank's loss is its dp group's mean over equal token counts
            dist.all_reduce(loss, op=dist.ReduceOp.SUM)
            loss = loss / world
        losses.append(loss.item())
    return {
        "losses": losses,
        "times": times,
        "cpu_times": cpu_times,
        "comm": comm,
        "held": held_bytes(model, opt),
        "total_param_bytes": total_param_bytes,
        "peak_rss": peak_rss_bytes(),
        "base_rss": base_rss,
        "parallelize_s": parallelize_s,
        "mesh_s": mesh_s,
        "fsdp_units": num_fsdp_units(model),
    }


def _rank_main(rank: int, world: int, port: int, contender: str, spec: dict[str, Any], out: str) -> None:
    torch.set_num_threads(1)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = run_contender(contender, spec)
        results = [result]
        if world > 1:
            results = [None] * world
            dist.all_gather_object(results, result)
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        if world > 1:
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(contender: str, spec: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """Run ``contender`` on fresh spawned ranks; return each rank's measurements."""
    world = 1 if contender == "reference" else math.prod(spec["mesh"].values())
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        ctx = mp.start_processes(
            _rank_main,
            args=(world, _free_port(), contender, spec, out),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    proc.kill()
                raise TimeoutError(f"{contender} did not finish within {timeout:.0f}s")
        return json.loads(Path(out).read_text())


def _launch_with_retry(contender: str, spec: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """``launch``, once more on a crash (e.g. the free port taken before rank 0 bound it); said on stderr."""
    try:
        return launch(contender, spec, timeout)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
        print(f"{contender} failed, retrying once: {str(err).strip().splitlines()[-1]}", file=sys.stderr)
        return launch(contender, spec, timeout)


def summarize(contender: str, runs: list[list[dict[str, Any]]], spec: dict[str, Any]) -> dict[str, Any]:
    """One contender's JSON object from its repeated runs (each a list of per-rank measurements).

    Step time: the median, over every timed step of every run, of the slowest rank's wall time.
    CPU time: the same median of the CPU seconds all ranks together spent on a step (less sensitive
    to other load on the machine). Losses, bytes and units come from the first run (deterministic).
    """
    step_s = median(t for run in runs for t in per_step([r["times"] for r in run], WARMUP))
    cpu_s = median(t for run in runs for t in per_step([r["cpu_times"] for r in run], WARMUP, sum))
    ranks = runs[0]
    tokens = spec["batch"] * spec["seq"]
    mesh = spec["mesh"]
    degree = 1 if contender == "reference" else mesh["dp_shard"] * mesh["tp"]
    ideal_params = ranks[0]["total_param_bytes"] / degree
    ideal = {"params": ideal_params, "grads": ideal_params, "optim": 2 * ideal_params}
    held = {k: max(r["held"][k] for r in ranks) for k in ideal}
    comm = max((r["comm"] for r in ranks if r["comm"]), key=lambda c: c["bytes_sent_total"], default=None)
    return {
        "contender": contender,
        "model": spec["model"],
        "size": spec["size"],
        "mesh": "single process" if contender == "reference" else spec["mesh_text"],
        "ranks": len(ranks),
        "dtype": "bf16 params / fp32 reduce" if spec["bf16"] and contender != "reference" else "fp32",
        "losses": ranks[0]["losses"],
        "step_time_s": step_s,
        "step_time_per_run_s": [median(per_step([r["times"] for r in run], WARMUP)) for run in runs],
        "tokens_per_s": tokens / step_s,
        "cpu_s_per_step": cpu_s,
        "runs": len(runs),
        "peak_rss_bytes": max(r["peak_rss"] for run in runs for r in run),
        "peak_rss_above_start_bytes": max(r["peak_rss"] - r["base_rss"] for run in runs for r in run),
        "held_bytes": held,
        "held_over_ideal": {k: held[k] / ideal[k] for k in ideal},
        "comm_per_step": comm,
        "fsdp_units": ranks[0]["fsdp_units"],
        "parallelize_s": median(max(r["parallelize_s"] for r in run) for run in runs),
        "mesh_build_s": median(max(r["mesh_s"] for r in run) for run in runs),
    }


def _run_order(contenders: list[str], repeat: int) -> list[str]:
    """Contenders of one repeat: the reference once (its figures are deterministic or informative
    only), the others in turn, reversed every other repeat (A B B A ...) so that neither always runs
    right after the other: on a shared machine a fixed order turns load drift into a bias."""
    order = [c for c in contenders if c != "reference" or repeat == 0]
    return order if repeat % 2 == 0 else order[::-1]


def _json_or_str(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="decoder", help="'decoder' (plait.models) or a transformers class")
    parser.add_argument("--size", default="ref", choices=sorted(SIZES))
    parser.add_argument(
        "--mesh", default="dp_shard=2,tp=2", help="e.g. dp_shard=4 | dp_replicate=2,dp_shard=2"
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bf16", action="store_true", help="bf16 params in FSDP (fp32 reduce)")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument(
        "--plait-set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override an FSDP2Config field for plait (ablations), e.g. enable_fsdp2_prefetch=false",
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="run baseline and plait this many times each (ABBA order)"
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per contender")
    parser.add_argument("--markdown", action="store_true", help="also print a markdown table")
    args = parser.parse_args(argv)
    mesh = parse_mesh(args.mesh)
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    if unknown := set(contenders) - set(CONTENDERS):
        parser.error(f"unknown contenders {sorted(unknown)}; choose from {CONTENDERS}")
    if args.steps <= WARMUP or args.batch % (mesh["dp_replicate"] * mesh["dp_shard"]):
        parser.error(f"need --steps > {WARMUP} and --batch divisible by dp_replicate*dp_shard")
    plait_set = {k: _json_or_str(v) for k, _, v in (item.partition("=") for item in args.plait_set)}
    spec = vars(args) | {
        "mesh": mesh,
        "mesh_text": args.mesh,
        "sp": args.sequence_parallel,
        "plait_set": plait_set,
    }
    runs: dict[str, list[list[dict[str, Any]]]] = {c: [] for c in contenders}
    for repeat in range(args.repeat):
        for contender in _run_order(contenders, repeat):
            runs[contender].append(_launch_with_retry(contender, spec, args.timeout))
    summaries = {c: summarize(c, runs[c], spec) for c in contenders}
    for summary in summaries.values():
        print(json.dumps(summary), flush=True)
    if "plait" in summaries and "baseline" in summaries:
        print(json.dumps(ratios(summaries["plait"], summaries["baseline"], summaries.get("reference"))))
    if args.markdown:
        print(markdown_table(summaries))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
