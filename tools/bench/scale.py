"""Parallelize time and peak RSS at large worlds, on torch's fake process group (one process = rank 0).

    uv run tools/bench/scale.py [--worlds 64,1024,16384] [--shapes 8b,70b] [--tp 8]

Builds 8B- and 70B-shaped Llama decoders on the meta device and parallelizes them with plait and
with the hand-written baseline, each configuration in a fresh subprocess so that peak RSS belongs
to that configuration alone. Mesh: ``dp_shard = world / tp, tp``. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench.instrument import num_fsdp_units, peak_rss_bytes

SHAPES = {  # vocab, hidden, intermediate, layers, heads, kv heads (Llama-3 8B / 70B)
    "8b": (128256, 4096, 14336, 32, 32, 8),
    "70b": (128256, 8192, 28672, 80, 64, 8),
}


def _meta_model(model_name: str, shape: str) -> nn.Module:
    vocab, hidden, inter, layers, heads, kv = SHAPES[shape]
    dims = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "tie_word_embeddings": False,
    }
    with torch.device("meta"):
        if model_name == "decoder":
            from plait.models import DecoderConfig, DenseDecoder

            return DenseDecoder(DecoderConfig(**dims))
        import transformers

        cls = getattr(transformers, model_name)
        return cls(cls.config_class(**dims, use_cache=False))


def run_one(config: dict[str, Any]) -> dict[str, Any]:
    """Build the meshes and the meta model, parallelize once, and measure (runs in the child)."""
    from plait.testing import fake_process_group

    world, tp = config["world"], config["tp"]
    with fake_process_group(world):
        model = _meta_model(config["model"], config["shape"])
        rss_model = peak_rss_bytes()
        start = time.perf_counter()
        if config["contender"] == "baseline":
            from tools.bench.baseline import build_baseline_meshes, parallelize_baseline

            meshes: Any = build_baseline_meshes(1, world // tp, tp)
        else:
            from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes

            meshes = MeshContext.build(FSDP2Config(), ParallelismSizes(tp_size=tp))
        mesh_s, rss_mesh, start = time.perf_counter() - start, peak_rss_bytes(), time.perf_counter()
        if config["contender"] == "baseline":
            from torch.distributed.fsdp import MixedPrecisionPolicy

            bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            model = parallelize_baseline(model, meshes, mp_policy=bf16)
        else:
            from plait.sidecar import parallelize_model

            model = parallelize_model(model, meshes)
        parallelize_s = time.perf_counter() - start
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
        return config | {
            "mesh_s": mesh_s,
            "parallelize_s": parallelize_s,
            "peak_rss_bytes": peak_rss_bytes(),
            "rss_after_model_bytes": rss_model,
            "rss_after_mesh_bytes": rss_mesh,
            "fsdp_units": num_fsdp_units(model),
            "local_params": local,
        }


def _spawn(config: dict[str, Any], timeout: float) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "--one", json.dumps(config)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        return config | {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _row(r: dict[str, Any]) -> str:
    head = f"| {r['shape']} | {r['world']:,} | dp_shard={r['world'] // r['tp']},tp={r['tp']} | {r['contender']} |"
    if "error" in r:
        return f"{head} error: {r['error'][:80]} | | | | | |"
    mib = 2**20
    return (
        f"{head} {r['mesh_s']:.2f} | {(r['rss_after_mesh_bytes'] - r['rss_after_model_bytes']) / mib:,.0f} | "
        f"{r['parallelize_s']:.2f} | {(r['peak_rss_bytes'] - r['rss_after_mesh_bytes']) / mib:,.0f} | "
        f"{r['peak_rss_bytes'] / mib:,.0f} | {r['fsdp_units']} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="decoder", help="'decoder' (plait.models) or a transformers class")
    parser.add_argument("--shapes", default="8b,70b")
    parser.add_argument("--worlds", default="64,1024,16384")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--contenders", default="plait,baseline")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return 0
    print(
        "| shape | world | mesh | contender | mesh s | mesh RSS +MiB | parallelize s | parallelize RSS +MiB "
        "| peak RSS MiB | units |"
    )
    print("|---" * 10 + "|")
    failed = False
    for shape in args.shapes.split(","):
        for world in (int(w) for w in args.worlds.split(",")):
            for contender in args.contenders.split(","):
                config = {
                    "model": args.model,
                    "shape": shape,
                    "world": world,
                    "tp": args.tp,
                    "contender": contender,
                }
                result = _spawn(config, args.timeout)
                failed |= "error" in result
                print(_row(result), flush=True)
    return int(failed)


if __name__ == "__main__":
    raise SystemExit(main())
