"""The trainer with ``parallel.pp_size: 2``: the pp=1 losses and grad norms over 5 steps (fp32), and resume."""

from __future__ import annotations

import pytest

from plait.testing import run_on_ranks

BASE = [
    "model.arch.hidden_size=32",
    "model.arch.intermediate_size=64",
    "model.arch.num_hidden_layers=4",
    "model.arch.vocab_size=262",
    "parallel.tp_size=1",
    "parallel.sequence_parallel=false",
    "parallel.mixed_precision=fp32",
    "data.seq_len=16",
    "data.max_bytes=50000",
    "data.micro_batch_size=4",
    "train.steps=5",
    "train.val_every=0",
    "train.seed=3",
    "optim.grad_clip=0.5",  # small enough to clip: the norm must cover every stage
    "checkpoint.export=false",
    "checkpoint.every=0",
]
PP = ["parallel.pp_size=2", "parallel.pipeline={schedule: interleaved_1f1b, microbatches: 2}"]


HF_LLAMA = [  # the hf_llama recipe (transformers' LlamaForCausalLM) at BASE's sizes
    "model.hf_config.hidden_size=32",
    "model.hf_config.intermediate_size=64",
    "model.hf_config.num_hidden_layers=4",
    "parallel.activation_checkpointing=false",
    *(o for o in BASE if not o.startswith("model.")),
]


def _train(
    tmp: str, overrides: list[str], resume_after: int | None = None, recipe_name: str | None = None
) -> list[dict[str, float]]:
    """Run ``train.steps`` steps; with ``resume_after`` save there, then continue in a fresh Trainer.

    ``recipe_name``: a shipped recipe with ``overrides`` alone; None: the default recipe with BASE.
    """
    import torch.distributed as dist

    from plait.mesh import init_distributed
    from plait.train.recipes import load_recipe
    from plait.train.setup import check_recipe
    from plait.train.trainer import Trainer

    base = BASE if recipe_name is None else []
    recipe = load_recipe(recipe_name, [*base, *overrides, f"out_dir={tmp}"])
    config = check_recipe(recipe, dist.get_world_size())
    trainer = Trainer(recipe, config, init_distributed())
    metrics = []
    for _ in range(resume_after or recipe.train.steps):
        trainer.step += 1
        metrics.append(trainer.train_step())
    if resume_after is None:
        metrics.append({"val_loss": trainer.validate()})
        _release(trainer)
        return metrics
    trainer.save()
    _release(trainer)  # the run lock: the resumed job takes it over
    resumed = Trainer(recipe, config, init_distributed())
    resumed.resume()
    assert resumed.step == resume_after
    while resumed.step < recipe.train.steps:
        resumed.step += 1
        metrics.append(resumed.train_step())
    _release(resumed)
    return metrics


def _release(trainer: object) -> None:
    lock = getattr(trainer, "run_lock", None)
    if lock is not None:
        lock.release()


def test_pp2_matches_pp1_and_a_resumed_run_matches_an_uninterrupted_one(tmp_path) -> None:
    (reference,) = run_on_ranks(_train, 1, str(tmp_path / "pp1"), [])
    pipelined = run_on_ranks(_train, 2, str(tmp_path / "pp2"), PP)
    resumed = run_on_ranks(_train, 2, str(tmp_path / "resume"), PP, 2)
    *steps, val = reference
    assert len(steps) == 5 and steps[0]["grad_norm"] > 0.5  # clipping is active
    for rank in pipelined:  # losses, grad norms (over both stages) and the validation loss
        assert rank[-1]["val_loss"] == pytest.approx(val["val_loss"], abs=1e-5)
    for rank in (*[r[:-1] for r in pipelined], *resumed):
        for ref, got in zip(steps, rank, strict=True):
            assert got["loss"] == pytest.approx(ref["loss"], abs=1e-5)
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    for uninterrupted, after_resume in zip(pipelined, resumed, strict=True):
        for a, b in zip(uninterrupted[2:-1], after_resume[2:], strict=True):
            assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)


def test_pp2_x_cp2_matches_pp1(tmp_path) -> None:
    """4 ranks: two stages, each context-parallel over 2 ranks (the same single replica's batches)."""
    (reference,) = run_on_ranks(_train, 1, str(tmp_path / "pp1"), [])
    for rank in run_on_ranks(_train, 4, str(tmp_path / "pp2_cp2"), [*PP, "parallel.cp_size=2"]):
        assert rank[-1]["val_loss"] == pytest.approx(reference[-1]["val_loss"], abs=1e-5)
        for ref, got in zip(reference[:-1], rank[:-1], strict=True):
            assert got["loss"] == pytest.approx(ref["loss"], abs=1e-5)
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)


def test_hf_llama_pp2_x_cp2_matches_pp1(tmp_path) -> None:
    """transformers' Llama in two stages, each context-parallel over 2 ranks (plan and run alike)."""
    (reference,) = run_on_ranks(_train, 1, str(tmp_path / "pp1"), HF_LLAMA, None, "hf_llama")
    overrides = [*HF_LLAMA, *PP, "parallel.cp_size=2"]
    for rank in run_on_ranks(_train, 4, str(tmp_path / "pp2_cp2"), overrides, None, "hf_llama"):
        for ref, got in zip(reference[:-1], rank[:-1], strict=True):
            assert got["loss"] == pytest.approx(ref["loss"], abs=1e-5)
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert rank[-1]["val_loss"] == pytest.approx(reference[-1]["val_loss"], abs=1e-5)


def test_pipeline_recipe_refusals() -> None:
    from plait.train.recipes import load_recipe
    from plait.train.setup import check_recipe

    for overrides, message in (
        (["parallel.pipeline={schedule: gpipe}"], "pp_size is 1"),
        ([*PP, "data.micro_batch_size=3"], "does not split into"),
        (["parallel.pp_size=2", "parallel.pipeline={schedul: gpipe}"], "unknown pipeline option"),
        (["parallel.pp_size=8", "parallel.pipeline={schedule: 1f1b, microbatches: 8}"], "8 pipeline stages"),
    ):
        recipe = load_recipe(None, [*BASE, "data.micro_batch_size=8", *overrides])
        with pytest.raises(ValueError, match=message):
            check_recipe(recipe, 8, devices=False)


MOE_EP = [  # the moe_ep recipe (activation checkpointing on, routing saved) at a 5-step size
    "data.seq_len=32",
    "data.micro_batch_size=2",
    "data.max_bytes=60000",
    "train.steps=5",
    "train.val_every=0",
    "train.val_batches=1",
    "checkpoint.export=false",
    "checkpoint.every=0",
]


def test_moe_ep_recipe_at_pp2_matches_its_fsdp_run(tmp_path) -> None:
    """pp 2 x dp_shard 2 with experts over ep 2, checkpointed layers, against FSDP on 2 ranks."""
    fsdp = [*MOE_EP, "parallel.ep_size=1"]
    (reference, _) = run_on_ranks(_train, 2, str(tmp_path / "fsdp"), fsdp, None, "moe_ep")
    overrides = [*MOE_EP, "parallel.pp_size=2", "parallel.pipeline={schedule: 1f1b, microbatches: 2}"]
    for rank in run_on_ranks(_train, 4, str(tmp_path / "pp2_ep2"), overrides, None, "moe_ep"):
        for ref, got in zip(reference[:-1], rank[:-1], strict=True):
            assert got["loss"] == pytest.approx(ref["loss"], abs=1e-5)
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert rank[-1]["val_loss"] == pytest.approx(reference[-1]["val_loss"], abs=1e-5)
    assert reference[4]["loss"] < reference[0]["loss"]  # it trained
