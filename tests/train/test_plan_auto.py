"""``plan --auto`` in the app: model sizes match built models, the written recipe validates, and the
planner's memory and traffic estimates hold against a measured step (gloo, CPU).

The full measured table (38 layouts) is tools/memory_model; four of its layouts run here: FSDP on 2
ranks without and with full checkpointing (activations dominate), TP + SP on 2 ranks, and the
collectives of DeepSeek-V3's Hugging Face plan (replicated attention, whole-sequence MLP) on 4.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from plait.models.presets import REFERENCE_MODELS, preset_arch
from plait.planner import ModelShape
from plait.testing import run_layout

sys.path.insert(0, str(Path(__file__).parents[2] / "tools" / "memory_model"))

from compare import estimate, measured
from measure import LAYOUTS

DEEPSEEK_V3_TINY = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "n_shared_experts": 1,
    "first_k_dense_replace": 3,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_group": 1,
    "topk_group": 1,
    "vocab_size": 1000,
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
        ("DeepseekV3Config", DEEPSEEK_V3_TINY),
    ],
)
def test_hugging_face_sizes_match_the_built_model(config_name: str, overrides: dict) -> None:
    import transformers

    config = getattr(transformers, config_name)(**overrides)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    # Per-head q/k norms (Qwen3) and similar vectors are not counted: within 1e-4 of the model.
    assert ModelShape.from_config(config).total_params() == pytest.approx(_numel(model), rel=1e-4)


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


@pytest.mark.parametrize("name", ["fsdp2_w2_ac_none", "fsdp2_w2_ac_full", "tp2_sp_w2"])
def test_estimate_is_within_ten_percent_of_the_measured_step(name: str, tmp_path: Path) -> None:
    spec = next(layout for layout in LAYOUTS if layout["name"] == name)
    ranks = run_layout(spec["recipe"], spec["overrides"], spec["world_size"], str(tmp_path))
    entry = {"layout": spec, "ranks": ranks}
    (est_peaks, est_comm), (got_peaks, got_comm) = estimate(entry), measured(entry)
    for est_peak, got_peak in zip(est_peaks, got_peaks, strict=True):
        assert 0.9 <= est_peak / got_peak <= 1.1, (est_peaks, got_peaks)
    for kind, got in got_comm.items():
        if got > 1 << 20:  # scalars (token counts, loss-parallel statistics) are not modelled
            assert 0.9 <= est_comm.get(kind, 0.0) / got <= 1.1, (kind, est_comm, got_comm)


def test_the_tp_collectives_of_deepseek_v3s_plan_are_counted_as_it_lays_out_its_blocks(
    tmp_path: Path,
) -> None:
    """Its plan leaves attention out (replicated) and runs the MLP on the gathered sequence under SP."""
    from plait.train import load_recipe, shape_of

    assert (
        shape_of(load_recipe("deepseek_v3")).tp_attention,
        shape_of(load_recipe("hf_llama")).tp_attention,
    ) == (
        False,
        True,
    )
    spec = next(layout for layout in LAYOUTS if layout["name"] == "recipe_deepseek_v3")
    entry = {
        "layout": spec,
        "ranks": run_layout(spec["recipe"], spec["overrides"], spec["world_size"], str(tmp_path)),
    }
    (_, est_comm), (_, got_comm) = estimate(entry), measured(entry)
    assert {"all_gather", "all_reduce", "reduce_scatter"} <= got_comm.keys()
    for kind, got in got_comm.items():
        assert 0.9 <= est_comm.get(kind, 0.0) / got <= 1.1, (kind, est_comm, got_comm)


def test_the_moe_hand_search_rejects_by_how_much_and_proposes_an_offloaded_layout_that_fits(capsys) -> None:
    """NeMo's hand-tried MoE layouts, from config alone: each listed with its peak, or refused."""
    from plait.train.cli import main

    config = str(Path(__file__).parents[2] / "docs" / "examples" / "mixtral_8x22b_config.json")
    args = ["--hf-config", config, "--nodes", "4", "--seq-len", "4096", "--global-tokens", "1048576"]
    considers = [
        "--consider",
        "pp=4,ep=8",
        "--consider",
        "pp=4,ep=8,dp_replicate=2",
        "--consider",
        "pp=8,ep=8",
    ]
    assert main(["plan", "--auto", *args, *considers]) == 0
    out = capsys.readouterr().out
    assert "considered pp=8,ep=8: not legal: ep does not divide the non-pipeline ranks" in out
    # On the GPUs alone nothing fits (each considered size is shown over by how much); with CPU
    # offload a 4-node layout does, and it is the proposal.
    for pin in ("pp=4,ep=8", "pp=4,ep=8,dp_replicate=2"):
        block = out.split(f"considered {pin}: best:\n", 1)[1].split("\nconsidered", 1)[0].splitlines()
        assert "offload=cpu" in block[0] and block[3] == "  without CPU offload, the closest:", block
        assert "-- out of memory by" in block[4], block
    best = out.split("best layouts", 1)[1].splitlines()[1]
    assert "offload=cpu" in best and float(best.split("peak ")[1].split(" GiB")[0]) <= 76.1, best


def test_an_offloaded_layout_is_written_as_the_recipes_offload_policy_and_read_back() -> None:
    from plait.planner import Layout, cluster
    from plait.train import layout_of_recipe, load_recipe
    from plait.train.config import recipe_from_dict
    from plait.train.plan_auto import layout_recipe

    layout = Layout(seq_len=1024, micro_batch=2, dp_shard=8, ac="full", offload=True)
    data = layout_recipe(load_recipe("dense_fsdp2"), layout, cluster("h100"))
    assert data["parallel"]["options"]["offload_policy"] == "cpu"
    assert layout_of_recipe(recipe_from_dict(data), 8).offload
    assert not layout_of_recipe(load_recipe("dense_fsdp2"), 8).offload
