"""The trainer with ``parallel.cp_size: 2`` gives the losses of the cp = 1 run of the same recipe (fp32).

The trainer runs in-process on the harness's gloo ranks (one rank for cp = 1, two for cp = 2: the
same single data-parallel replica, so the same batches).
"""

from __future__ import annotations

from pathlib import Path

from plait.testing import run_on_ranks

RECIPE = [
    "model.hf_config.hidden_size=32",
    "model.hf_config.intermediate_size=64",
    "model.hf_config.num_hidden_layers=2",
    "parallel.activation_checkpointing=false",
    "data.seq_len=32",
    "data.micro_batch_size=2",
    "data.max_bytes=60000",
    "train.val_batches=1",
]


def _train_losses(
    run_dir: str, overrides: list[str], steps: int, name: str = "hf_llama", base: list[str] = RECIPE
) -> list[float]:
    """The recipe ``name`` (``base`` and ``overrides`` on top) on this world: its train losses, then val."""
    import torch
    import torch.distributed as dist

    from plait.mesh import DistributedInfo
    from plait.train.recipes import load_recipe
    from plait.train.setup import check_recipe
    from plait.train.trainer import Trainer

    recipe = load_recipe(name, [*base, f"out_dir={run_dir}", *overrides])
    world = dist.get_world_size()
    info = DistributedInfo(
        rank=dist.get_rank(), world_size=world, local_rank=dist.get_rank(), device=torch.device("cpu")
    )
    trainer = Trainer(recipe, check_recipe(recipe, world), info)
    losses = [trainer.train_step()["loss"] for _ in range(steps)]
    losses.append(trainer.validate())
    return losses


def test_cp2_matches_cp1_over_five_steps(tmp_path: Path) -> None:
    ref = run_on_ranks(_train_losses, 1, str(tmp_path / "cp1"), [], 5)[0]
    for variant in ("ring", "all_gather"):
        overrides = ["parallel.cp_size=2", f"parallel.options.cp_attention={variant}"]
        for got in run_on_ranks(_train_losses, 2, str(tmp_path / variant), overrides, 5):
            assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5, (variant, ref, got)
    assert ref[4] < ref[0]  # it trained


def test_plan_shows_the_cp_split_and_its_memory() -> None:
    from plait.train.plan import plan
    from plait.train.recipes import load_recipe

    overrides = [*RECIPE, "parallel.cp_size=2", "parallel.options.cp_attention=ring"]
    report = plan(load_recipe("hf_llama", overrides), 4)
    assert "dp_shard=2 x cp=2 x tp=1" in report
    assert (
        "each sequence of 32 tokens in 4 chunks of 8; cp rank r holds chunks r and 3-r = 16 tokens per rank"
        in report
    )
    # micro-batch 2 x 16 tokens x 2 KV heads x head_dim 8 x (K + V) x 4 bytes = 4 KiB per layer
    assert "K/V kept for backward 4.0 KiB (local; re-sent in backward)" in report
    assert "cp_attention:" in report


def test_plan_prints_the_auto_choice_and_its_reason() -> None:
    """4 query / 2 KV heads at cp 2: all_to_all would send Q, K, V, O halves, more than K/V once: all_gather."""
    from plait.train.plan import plan
    from plait.train.recipes import load_recipe

    overrides = [*RECIPE, "parallel.cp_size=2", "parallel.options.cp_attention=auto"]
    report = plan(load_recipe("hf_llama", overrides), 2)
    assert (
        "cp_attention=all_gather (auto: G 2 + r 1 >= cp 2: all_gather sends no more than all_to_all)"
        in report
    )
    mha = plan(
        load_recipe("hf_llama", [*overrides, "parallel.cp_size=4", "model.hf_config.num_key_value_heads=4"]),
        4,
    )
    assert "cp_attention=all_to_all (auto: G 1 + r 1 < cp 4" in mha
    assert "(every token of 1/cp of the heads)" in mha


MOE = ["data.seq_len=32", "data.micro_batch_size=2", "data.max_bytes=60000", "train.val_batches=1"]


def test_moe_recipe_at_cp2_x_ep2_matches_its_fsdp_run(tmp_path: Path) -> None:
    """4 ranks (dp_shard 2 x cp 2, experts over ep 2) against FSDP on 2 ranks: the same 2-row global batch."""
    ref = run_on_ranks(_train_losses, 2, str(tmp_path / "fsdp"), ["parallel.ep_size=1"], 5, "moe_ep", MOE)[0]
    overrides = ["parallel.cp_size=2", "parallel.ep_size=2"]
    for got in run_on_ranks(_train_losses, 4, str(tmp_path / "cp2_ep2"), overrides, 5, "moe_ep", MOE):
        assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5, (ref, got)
    assert ref[4] < ref[0]  # it trained


def test_plan_lists_the_gathered_sequence_mixers_and_refuses_them_by_default() -> None:
    """LFM2's short convolutions run on the whole sequence only when the recipe asks for it."""
    import pytest

    from plait.train.plan import plan
    from plait.train.recipes import load_recipe

    lfm2 = [
        *RECIPE,
        "parallel.cp_size=2",
        "model.hf_class=Lfm2ForCausalLM",
        "model.hf_config.num_hidden_layers=4",
        "model.hf_config.layer_types=[conv,full_attention,conv,full_attention]",
    ]
    report = plan(load_recipe("hf_llama", [*lfm2, "parallel.options.cp_sequence_mixers=gather"]), 2)
    assert "nothing saved in them): 2 modules, model.layers.0.conv, model.layers.2.conv" in report
    with pytest.raises(
        ValueError, match=r"layers\.0\.conv\.conv: a convolution .*cp_sequence_mixers='gather'"
    ):
        plan(load_recipe("hf_llama", lfm2), 2)


def test_plan_of_a_pipelined_hf_model_describes_its_cp_attention() -> None:
    """pp 2 x cp 2: the cp lines read the whole model's attention (a pipeline rank holds a StageUnion)."""
    from plait.train.plan import plan
    from plait.train.recipes import load_recipe

    overrides = [*RECIPE, "parallel.cp_size=2", "parallel.pp_size=2", "checkpoint.export=false"]
    report = plan(load_recipe("hf_llama", [*overrides, "model.hf_config.num_hidden_layers=4"]), 4)
    assert "context parallel: cp=2, cp_attention=all_gather" in report
    assert "  cp_attention: " in report.split("communication per step")[1]  # its traffic is counted
