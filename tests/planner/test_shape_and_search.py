"""The planner's model sizes match built models, its search is fast, and what it writes runs."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from plait.models.presets import REFERENCE_MODELS, preset_arch
from plait.planner import Layout, ModelShape, cluster, refusal, search

LLAMA_405B = {
    "vocab_size": 128256,
    "hidden_size": 16384,
    "intermediate_size": 53248,
    "num_hidden_layers": 126,
    "num_attention_heads": 128,
    "num_key_value_heads": 8,
}
DEEPSEEK_V3 = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048,
    "n_shared_experts": 1,
    "first_k_dense_replace": 3,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}


def _numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("kind", "preset"), [("dense", "llama3-8b"), ("dense", "small"), ("moe", "small")])
def test_reference_model_sizes_match_the_built_model(kind: str, preset: str) -> None:
    arch = preset_arch(kind, preset)
    config_cls, model_cls = REFERENCE_MODELS[kind]
    with torch.device("meta"):
        model = model_cls(config_cls(**arch))
    assert ModelShape.from_config(arch).total_params() == _numel(model)


@pytest.mark.parametrize(
    ("config_name", "overrides"),
    [
        ("LlamaConfig", {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2}),
        ("Qwen3MoeConfig", {"hidden_size": 128, "num_hidden_layers": 2, "num_experts": 8, "head_dim": 32}),
        (
            "DeepseekV3Config",
            {
                **DEEPSEEK_V3,
                "hidden_size": 256,
                "num_hidden_layers": 4,
                "n_routed_experts": 8,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "moe_intermediate_size": 64,
                "intermediate_size": 512,
                "num_experts_per_tok": 2,
                "q_lora_rank": 64,
                "kv_lora_rank": 32,
                "qk_nope_head_dim": 16,
                "qk_rope_head_dim": 8,
                "v_head_dim": 16,
                "n_group": 1,
                "topk_group": 1,
                "vocab_size": 1000,
            },
        ),
    ],
)
def test_hugging_face_sizes_match_the_built_model(config_name: str, overrides: dict) -> None:
    import transformers

    config = getattr(transformers, config_name)(**overrides)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    # Per-head q/k norms (Qwen3) and similar vectors are not counted: within 1e-4 of the model.
    assert ModelShape.from_config(config).total_params() == pytest.approx(_numel(model), rel=1e-4)


@pytest.mark.parametrize(
    ("name", "config", "nodes", "limit"),
    [
        ("llama-3.1-8b", preset_arch("dense", "llama3-8b"), 8, 10.0),
        ("llama-3.1-405b", LLAMA_405B, 2048, 60.0),
        ("deepseek-v3", DEEPSEEK_V3, 2048, 60.0),
    ],
)
def test_search_is_fast_and_finds_a_fitting_legal_layout(
    name: str, config: dict, nodes: int, limit: float
) -> None:
    shape = ModelShape.from_config(config)
    start = time.perf_counter()
    result = search(shape, cluster("h100", nodes=nodes), global_tokens=nodes * 8 * 8192, seq_len=8192)
    took = time.perf_counter() - start
    assert took <= limit, (name, took)
    best = result.candidates[0]
    assert best.fits and refusal(best.layout, shape) is None, best.layout
    assert best.layout.world == nodes * 8
    assert result.rejected["out of memory"] > 0  # the search does reject: memory is priced


def test_refusals_name_the_reason_and_the_combination_table() -> None:
    shape = ModelShape.from_config(preset_arch("dense", "llama3-8b"))
    assert refusal(Layout(seq_len=8192, tp=64), shape).startswith("heads not divisible")
    assert refusal(Layout(seq_len=8192, ep=2, dp_shard=2), shape).startswith("ep without experts")
    moe = ModelShape.from_config(preset_arch("moe", "small"))
    float8_free = refusal(Layout(seq_len=1024, ep=2, dp_shard=2), moe)
    assert float8_free is None


def test_the_written_recipe_validates(tmp_path: Path) -> None:
    from plait.train.cli import main

    out = tmp_path / "auto.yaml"
    args = [
        "--recipe",
        "dense_fsdp2",
        "--set",
        "model.preset=small",
        "--gpus-per-node",
        "4",
        "--seq-len",
        "512",
    ]
    assert main(["plan", "--auto", *args, "--global-tokens", "8192", "--write", str(out)]) == 0
    assert main(["validate", "--recipe", str(out), "--world-size", "4"]) == 0


def test_the_planner_knows_every_pipeline_schedule() -> None:
    from plait.pipeline import SCHEDULES
    from plait.planner import PP_SCHEDULES

    assert set(PP_SCHEDULES) == set(SCHEDULES)
