"""Materialised weights are the same whatever the mesh; loss and global grad norm match the unsharded model."""

from __future__ import annotations

import pytest
import torch

from plait.testing import run_on_ranks

OVERRIDES = [
    "model.arch.hidden_size=64",
    "model.arch.intermediate_size=96",
    "model.arch.num_hidden_layers=2",
    "model.arch.vocab_size=262",  # not a multiple of the world size: uneven shards
    "train.seed=5",
]


def _step(tp_size: int) -> dict[str, object]:
    """Build, parallelize (meta) and materialise the recipe's model; one loss/backward on a fixed batch."""
    import torch.distributed as dist

    from plait.train.loss import loss_context, token_loss_sum
    from plait.train.optim import global_grad_norm
    from plait.train.recipes import load_recipe
    from plait.train.setup import build_mesh_context, build_parallel_model, check_recipe

    world = dist.get_world_size()
    recipe = load_recipe(
        None, [*OVERRIDES, f"parallel.tp_size={tp_size}", f"parallel.sequence_parallel={tp_size > 1}"]
    )
    ctx = build_mesh_context(recipe, check_recipe(recipe, world))
    model = build_parallel_model(recipe, ctx, torch.device("cpu"))
    full = {
        name.replace("._checkpoint_wrapped_module", ""): (p.full_tensor() if hasattr(p, "full_tensor") else p)
        .detach()
        .clone()
        for name, p in model.named_parameters()
    }
    ids = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    dp = ctx.dp_mesh()
    rows = 4 // dp.size()
    first = dp.get_local_rank() * rows
    inputs, labels = ids[first : first + rows, :-1], ids[first : first + rows, 1:]
    global_tokens = ids[:, 1:].numel()
    logits = model(inputs)
    with loss_context(logits):
        loss = token_loss_sum(logits, labels)
        (loss * dp.size() / global_tokens).backward()  # the trainer's scaling: DP averages gradients
    total = torch.tensor([float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)])
    if dp.size() > 1:
        dist.all_reduce(total, group=ctx.dp_cp_mesh().get_group())
    return {
        "full": full,
        "loss": float(total) / global_tokens,
        "grad_norm": float(global_grad_norm(model.parameters())),
    }


def test_weights_loss_and_grad_norm_identical_between_world_1_and_a_2x2_mesh():
    (reference,) = run_on_ranks(_step, 1, 1)
    for result in run_on_ranks(_step, 4, 2):
        assert result["full"].keys() == reference["full"].keys()
        for name, tensor in reference["full"].items():
            assert torch.equal(result["full"][name], tensor), name
        assert result["loss"] == pytest.approx(reference["loss"], abs=1e-5)
        assert result["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)


def _first_step(tmp: str, overrides: list[str]) -> dict[str, float]:
    import torch.distributed as dist

    from plait.mesh import init_distributed
    from plait.train.recipes import load_recipe
    from plait.train.setup import check_recipe
    from plait.train.trainer import Trainer

    base = [*OVERRIDES, "parallel.tp_size=1", "data.seq_len=16", "data.max_bytes=50000", f"out_dir={tmp}"]
    recipe = load_recipe(None, [*base, *overrides])
    trainer = Trainer(recipe, check_recipe(recipe, dist.get_world_size()), init_distributed())
    return trainer.train_step()


def test_gradient_accumulation_equals_one_large_batch(tmp_path):
    one = run_on_ranks(_first_step, 2, str(tmp_path / "a"), ["data.micro_batch_size=4"])
    accumulated = run_on_ranks(
        _first_step, 2, str(tmp_path / "b"), ["data.micro_batch_size=2", "train.grad_accum=2"]
    )
    for a, b in zip(one, accumulated, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
