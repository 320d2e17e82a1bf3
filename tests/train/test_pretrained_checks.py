"""Pretrained weights are checked up front: validate, plan and the ranks refuse a misfit alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from plait.train.errors import UserError
from plait.train.models import build_model
from plait.train.plan import validate
from plait.train.recipes import load_recipe
from plait.train.setup import check_recipe

HF_SMALL = (
    "model.hf_config={vocab_size: 272, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,"
    " num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 64, tie_word_embeddings: false}"
)


def _save(model: torch.nn.Module, directory: Path, reshape: str | None = None) -> Path:
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if reshape is not None:
        state[reshape] = torch.zeros(state[reshape].shape[0] + 1, *state[reshape].shape[1:])
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / "model.safetensors"))
    return directory


def test_weights_of_another_shape_are_refused_by_validate_and_by_the_ranks_checks(tmp_path: Path) -> None:
    recipe = load_recipe("dense_fsdp2", [])
    bad = _save(build_model(recipe.model, "cpu"), tmp_path / "w", reshape="model.norm.weight")
    misfit = load_recipe("dense_fsdp2", [f"model.pretrained_path={bad}"])
    with pytest.raises(UserError) as from_validate:
        validate(misfit, 2)
    with pytest.raises(UserError) as from_ranks:
        check_recipe(misfit, 2)
    assert str(from_validate.value) == str(from_ranks.value)
    assert "shape differs: model.norm.weight" in str(from_validate.value), from_validate.value
    good = _save(build_model(recipe.model, "cpu"), tmp_path / "good")
    assert validate(load_recipe("dense_fsdp2", [f"model.pretrained_path={good}"]), 2).endswith(
        "ok on 2 rank(s)"
    )


def test_a_recipe_hf_config_never_silently_overrides_the_checkpoints_config(tmp_path: Path) -> None:
    small = load_recipe("hf_llama", [HF_SMALL])
    directory = _save(build_model(small.model, "cpu"), tmp_path / "hf")
    build_model(small.model, "cpu").config.save_pretrained(str(directory))
    shipped = load_recipe("hf_llama", [f"model.pretrained_path={directory}"])
    with pytest.raises(ValueError, match=r"model\.hf_config would override model\.pretrained_path") as info:
        validate(shipped, 2)
    assert "hidden_size: 128 in the recipe vs 32 in config.json" in str(info.value), info.value
    assert "--set 'model.hf_config={}'" in str(info.value)
    as_is = load_recipe("hf_llama", [f"model.pretrained_path={directory}", "model.hf_config={}"])
    assert validate(as_is, 2).endswith("ok on 2 rank(s)")
    same = load_recipe("hf_llama", [f"model.pretrained_path={directory}", HF_SMALL])  # repeats config.json
    assert validate(same, 2).endswith("ok on 2 rank(s)")


def test_the_summary_names_the_weights_and_the_precision() -> None:
    from plait.train.summary import weights_text

    assert (
        weights_text("/ckpt/llama", 0, "bf16")
        == "weights pretrained /ckpt/llama | precision bf16 parameters, fp32 reduce"
    )
    assert weights_text(None, 7, "fp32").startswith("weights fresh init (plait.mesh.materialize, seed 7:")
