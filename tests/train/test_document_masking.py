"""``data.document_masking: true``: the trainer's loss is the unsharded model's, fed one document at a time.

Each packed row's ``position_ids`` restart after every EOS; a transformers model then keeps
attention inside each document, and under cp the batch's document ids reach every rank's attention.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.testing import run_on_ranks
from tests.train.test_cp_trainer import RECIPE, _train_losses

DOCS = ["data.document_masking=true", "data.seq_len=64", "data.source=files"]


def _corpus(tmp_path: Path) -> list[str]:
    """Short text documents (12-40 bytes: several per 64-token row) and the overrides reading them."""
    import json
    import random

    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "tau", "rho"]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(2, 6))) for _ in range(3000)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    return [*DOCS, f"data.paths=[{path}]"]


def _first_loss_and_per_document(run_dir: str, overrides: list[str]) -> tuple[float, float, float, int]:
    """(trainer's step-0 loss, the same from one forward per document, the loss without masking, docs)."""
    import torch
    import torch.nn.functional as F

    from plait.cp import document_ids
    from plait.mesh import DistributedInfo
    from plait.train.recipes import load_recipe
    from plait.train.setup import check_recipe
    from plait.train.trainer import Trainer

    recipe = load_recipe("hf_llama", [*RECIPE, *overrides, f"out_dir={run_dir}"])
    info = DistributedInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    trainer = Trainer(recipe, check_recipe(recipe, 1), info)
    batch = trainer._batch(trainer.corpus.train, [0, 1])
    model, labels = trainer.model, batch["labels"]
    with torch.no_grad():
        masked = float(trainer.token_loss(lambda: trainer._logits(batch), labels, None))
        unmasked = float(trainer.token_loss(lambda: model(batch["input_ids"]).logits, labels, None))
        docs = document_ids(batch["position_ids"])
        total, count = 0.0, 0
        for row in range(labels.shape[0]):
            for doc in docs[row].unique():
                at = docs[row] == doc
                logits = model(batch["input_ids"][row, at][None]).logits[0]
                total += float(F.cross_entropy(logits.float(), labels[row, at], reduction="sum"))
                count += 1
    return masked, total, unmasked, count


def test_the_loss_is_the_per_document_loss(tmp_path: Path) -> None:
    masked, per_document, unmasked, docs = run_on_ranks(
        _first_loss_and_per_document, 1, str(tmp_path / "run"), _corpus(tmp_path)
    )[0]
    assert docs > 2  # the rows really hold several documents
    assert abs(masked - per_document) <= 1e-5 * abs(per_document), (masked, per_document)
    # without masking the loss lies far outside that tolerance (random init: ~3e-4 relative): not ignored
    assert abs(unmasked - per_document) > 10 * 1e-5 * abs(per_document), (unmasked, per_document)


def test_cp2_trains_as_cp1_with_documents(tmp_path: Path) -> None:
    docs = _corpus(tmp_path)
    ref = run_on_ranks(_train_losses, 1, str(tmp_path / "cp1"), docs, 3)[0]
    for variant in ("all_gather", "all_to_all"):
        overrides = [*docs, "parallel.cp_size=2", f"parallel.options.cp_attention={variant}"]
        for got in run_on_ranks(_train_losses, 2, str(tmp_path / variant), overrides, 3):
            assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5, (variant, ref, got)


@pytest.mark.parametrize(
    ("recipe", "match"),
    [
        ("dense_fsdp2", r"data.document_masking needs a transformers model"),
        ("pipeline", r"data.document_masking with parallel.pp_size 2 is not supported"),
        ("vlm_frozen_tower", r"data.document_masking is not supported for a multimodal model"),
    ],
)
def test_document_masking_is_refused_where_not_built(recipe: str, match: str) -> None:
    from plait.train.recipes import load_recipe
    from plait.train.setup import check_recipe

    with pytest.raises(ValueError, match=match):
        check_recipe(load_recipe(recipe, ["data.document_masking=true"]), 4, devices=False)
