"""``train.loss: chunked`` gives the losses of ``train.loss: full`` (fp32), and is refused where not built.

The trainer runs in-process on the harness's gloo ranks: one rank unsharded, two ranks under
FSDP2 x TP (the vocabulary-parallel head) and under DDP, each against the full loss of the same
layout. 7-token chunks leave a ragged last chunk of each 64-token micro-batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.testing import run_on_ranks
from tests.train.test_cp_trainer import RECIPE, _train_losses

CHUNKED = ["train.loss=chunked", "train.loss_chunk_tokens=7"]
LAYOUTS = {
    "one rank": (1, []),
    "fsdp2 x tp2": (2, ["parallel.tp_size=2"]),
    "ddp": (2, ["parallel.strategy=ddp"]),
}
SLOW = {"fsdp2 x tp2"}
"""tools/slow_tests: the vocabulary-parallel chunked head is compared per parameter in
tests/sidecar/test_chunked_loss.py; the trainer's wiring runs here on one rank and under DDP."""


@pytest.mark.parametrize(
    "layout", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name for name in LAYOUTS]
)
def test_chunked_loss_trains_as_the_full_loss(tmp_path: Path, layout: str) -> None:
    ranks, overrides = LAYOUTS[layout]
    full = run_on_ranks(_train_losses, ranks, str(tmp_path / "full"), overrides, 3)
    chunked = run_on_ranks(_train_losses, ranks, str(tmp_path / "chunked"), [*overrides, *CHUNKED], 3)
    for ref, got in zip(full, chunked, strict=True):
        assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5, (layout, ref, got)
    assert full[0][2] < full[0][0]  # it trained


def _head_output_shapes(run_dir: str, overrides: list[str]) -> list[tuple[int, ...]]:
    """The shapes the output head's forward returns during one training step and one validation."""
    import torch

    from plait.mesh import DistributedInfo
    from plait.train.recipes import load_recipe
    from plait.train.setup import check_recipe
    from plait.train.trainer import Trainer

    recipe = load_recipe("hf_llama", [*RECIPE, f"out_dir={run_dir}", *overrides])
    info = DistributedInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    trainer = Trainer(recipe, check_recipe(recipe, 1), info)
    shapes: list[tuple[int, ...]] = []
    trainer.model.get_output_embeddings().register_forward_hook(
        lambda m, a, out: shapes.append(tuple(out.shape))
    )
    trainer.train_step()
    trainer.validate()
    return shapes


def test_chunked_loss_never_builds_the_logits(tmp_path: Path) -> None:
    """The head hands back per-token losses ``[batch, seq]``, not ``[batch, seq, vocab]`` logits."""
    full = run_on_ranks(_head_output_shapes, 1, str(tmp_path / "full"), [])[0]
    chunked = run_on_ranks(_head_output_shapes, 1, str(tmp_path / "chunked"), CHUNKED)[0]
    assert full == [(2, 32, 272)] * 2 and chunked == [(2, 32)] * 2, (full, chunked)


@pytest.mark.parametrize(
    ("recipe", "overrides", "match"),
    [
        ("pipeline", [], r"train.loss 'chunked' with parallel.pp_size 2 is not supported"),
        ("hf_llama", ["parallel.strategy=megatron_fsdp"], r"with parallel.strategy 'megatron_fsdp'"),
        (
            "hf_llama",
            ["model.hf_class=Gemma2ForCausalLM", "model.hf_config.final_logit_softcapping=30.0"],
            r"final_logit_softcapping=30.0 transforms the logits",
        ),
    ],
)
def test_chunked_loss_is_refused_where_not_built(recipe: str, overrides: list[str], match: str) -> None:
    from plait.train.recipes import load_recipe
    from plait.train.setup import check_recipe

    loaded = load_recipe(recipe, [*RECIPE, *CHUNKED, *overrides] if recipe == "hf_llama" else [*CHUNKED])
    with pytest.raises(ValueError, match=match):
        check_recipe(loaded, 4, devices=False)


def test_a_chunk_size_without_the_chunked_loss_is_refused() -> None:
    from plait.train.recipes import load_recipe

    with pytest.raises(ValueError, match=r"train.loss_chunk_tokens 7 is only read with train.loss: chunked"):
        load_recipe("hf_llama", ["train.loss_chunk_tokens=7"])
