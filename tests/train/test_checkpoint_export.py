"""The Hugging Face layout both ways: from_pretrained loads the export; pretrained_path reads it back.

An HF Llama trained 5 steps on dp_shard=2 x tp=2 is exported by its ranks; transformers'
``from_pretrained`` on the export and a 2-rank FSDP2 job with ``model.pretrained_path`` give the
trained model's logits. Export memory: each rank's peak RSS grows by about one tensor, not by
the model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.testing import run_on_ranks

LLAMA = [
    "model.source=hf",
    "model.hf_class=LlamaForCausalLM",
    "model.hf_config={vocab_size: 272, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,"
    " num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 64, tie_word_embeddings: false}",
    "parallel.activation_checkpointing=false",
    "data.seq_len=16",
    "data.max_bytes=40000",
    "data.micro_batch_size=2",
    "train.val_every=0",
    "train.val_batches=1",
    "train.log_every=100",
]


def _ids() -> torch.Tensor:
    return torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(3))


def _logits_of(trainer: object) -> torch.Tensor:
    logits = trainer._logits({"input_ids": _ids()})
    return (logits.full_tensor() if hasattr(logits, "full_tensor") else logits).detach()


def _train_and_export(run_dir: str, mesh: tuple[str, ...] = ("parallel.tp_size=2",)) -> tuple[Any, str]:
    """Train 5 steps and export; the trained logits (None under pp: no single forward) and the summary."""
    import torch.distributed as dist

    from plait.mesh import init_distributed
    from plait.train.recipes import load_recipe
    from plait.train.setup import check_recipe
    from plait.train.trainer import Trainer

    overrides = [*LLAMA, f"out_dir={run_dir}", *mesh, "train.steps=5", "checkpoint.every=0"]
    recipe = load_recipe(None, overrides)
    trainer = Trainer(recipe, check_recipe(recipe, dist.get_world_size()), init_distributed())
    trainer.fit()
    if trainer.pipe is not None:
        return None, trainer._summary()
    with torch.no_grad():
        return _logits_of(trainer), trainer._summary()


def _load_pretrained(run_dir: str, export: str) -> torch.Tensor:
    import torch.distributed as dist

    from plait.train.recipes import load_recipe
    from plait.train.setup import build_mesh_context, build_parallel_model, check_recipe

    recipe = load_recipe(
        None, [*LLAMA, f"out_dir={run_dir}", "parallel.tp_size=1", f"model.pretrained_path={export}"]
    )
    model = build_parallel_model(
        recipe, build_mesh_context(recipe, check_recipe(recipe, dist.get_world_size())), torch.device("cpu")
    )
    with torch.no_grad():
        logits = model(_ids()).logits
    return (logits.full_tensor() if hasattr(logits, "full_tensor") else logits).detach()


def test_an_hf_llama_export_loads_with_from_pretrained_and_as_pretrained_weights(tmp_path: Path):
    from transformers import AutoModelForCausalLM

    trained, summary = run_on_ranks(_train_and_export, 4, str(tmp_path / "run"))[0]
    assert "weights fresh init (plait.mesh.materialize, seed 0:" in summary and "precision fp32" in summary
    export = tmp_path / "run" / "export"
    index = json.loads((export / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model-00001-of-00001.safetensors"}
    assert "lm_head.weight" in index["weight_map"] and (export / "config.json").is_file()
    assert not (export / "sharded").exists()

    hf = AutoModelForCausalLM.from_pretrained(str(export), torch_dtype=torch.float32)
    with torch.no_grad():
        loaded = hf(_ids()).logits
    scale = float(trained.abs().max())
    assert float((loaded - trained).abs().max()) <= 1e-5 * scale

    again = run_on_ranks(_load_pretrained, 2, str(tmp_path / "again"), str(export))[0]
    assert float((again - trained).abs().max()) <= 1e-5 * scale


def test_a_pipeline_run_exports_the_whole_model(tmp_path: Path):
    """pp 2 x dp_shard 2: each stage writes its own tensors; from_pretrained gives the pp 1 run's logits."""
    from transformers import AutoModelForCausalLM

    mesh = ("parallel.tp_size=1", "parallel.pp_size=2")
    run_on_ranks(_train_and_export, 4, str(tmp_path / "pp2"), mesh)
    trained, _ = run_on_ranks(_train_and_export, 2, str(tmp_path / "pp1"), ("parallel.tp_size=1",))[0]
    export = tmp_path / "pp2" / "export"
    index = json.loads((export / "model.safetensors.index.json").read_text())
    reference = AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "pp1" / "export"), torch_dtype=torch.float32
    )
    assert set(index["weight_map"]) == set(reference.state_dict()) - {"model.rotary_emb.inv_freq"}
    hf = AutoModelForCausalLM.from_pretrained(str(export), torch_dtype=torch.float32)
    with torch.no_grad():
        loaded = hf(_ids()).logits
    assert float((loaded - trained).abs().max()) <= 1e-5 * float(trained.abs().max())


def test_pretrained_weights_of_another_shape_are_refused(tmp_path: Path):
    from safetensors.torch import save_file

    from plait.train.pretrained import load_pretrained

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    save_file({"0.weight": torch.zeros(3, 5), "0.bias": torch.zeros(3)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"missing: 1\.weight, 1\.bias; shape differs: 0\.weight \(3, 5\) in the files vs \(3, 4\)",
    ):
        load_pretrained(model, tmp_path)
    with pytest.raises(ValueError, match=r"not a directory with \*\.safetensors files"):
        load_pretrained(model, tmp_path / "nothing")


TENSOR_MIB = 64


def _export_peak_rss(directory: str) -> dict[str, float]:
    import gc

    from torch.distributed.fsdp import fully_shard

    from plait.train.export import export_model

    side = int((TENSOR_MIB * 2**20 / 4) ** 0.5)
    model = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(4)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset this process's peak RSS
    before = _status_kib("VmRSS")
    export_model(
        model, directory, max_file_bytes=2 * TENSOR_MIB * 2**20, write_chunk_bytes=TENSOR_MIB * 2**20
    )
    return {"extra_mib": (_status_kib("VmHWM") - before) / 1024}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def test_export_holds_about_one_tensor_beyond_the_shards_per_rank(tmp_path: Path):
    results = run_on_ranks(_export_peak_rss, 2, str(tmp_path / "export"))
    model_mib = 4 * TENSOR_MIB  # 256 MiB; each rank holds 128 MiB of shards
    for result in results:
        # One full tensor (64) + the shard piece being copied into it (32) + allocator slack.
        assert result["extra_mib"] <= 1.5 * TENSOR_MIB + 32 < model_mib, results
    index = json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
